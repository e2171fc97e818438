//! Records which commit the control plane is built from (`RETRYPLANE_COMMIT`, its first 12 hex
//! digits, and `RETRYPLANE_COMMIT_DATE`, the commit's date): every build says `0.1.0`, so
//! without them an operator cannot tell two builds apart (`retryplane --version`, the start-up
//! log, `retryplane_server_build_info`). `unknown` outside a git checkout (a source archive)
//! or without `git`. Uncommitted changes are not marked: telling them would mean watching
//! the index, which `git` rewrites on its own, and building this crate again each time.

use std::process::Command;

/// The trimmed output of `git args` run in this crate's directory, if it succeeds.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    // Built again when the commit changes (HEAD moves, or the branch it names does).
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        for file in ["HEAD", "packed-refs", "refs/heads"] {
            println!("cargo:rerun-if-changed={dir}/{file}");
        }
    }
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    let date = git(&["log", "-1", "--format=%cs"]).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=RETRYPLANE_COMMIT={commit}");
    println!("cargo:rustc-env=RETRYPLANE_COMMIT_DATE={date}");
}
