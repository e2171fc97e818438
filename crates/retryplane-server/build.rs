//! Records which commit the control plane is built from (`RETRYPLANE_COMMIT`, its first 12 hex
//! digits, and `RETRYPLANE_COMMIT_DATE`, the commit's date): every build says `0.1.0`, so
//! without them an operator cannot tell two builds apart (`retryplane --version`, the start-up
//! log, `retryplane_server_build_info`).
//!
//! Read from git when the workspace is the top of a git checkout; a packager building from a
//! source archive sets both variables instead; otherwise both are `unknown` (an archive
//! unpacked inside another repository does not take that repository's commit). Uncommitted
//! changes are not marked: telling them would mean watching the index, which `git` rewrites on
//! its own, and building this crate again each time.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The trimmed output of `git args` run in `dir`, if it succeeds.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .current_dir(dir)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RETRYPLANE_COMMIT");
    println!("cargo:rerun-if-env-changed=RETRYPLANE_COMMIT_DATE");
    let given = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let (commit, date) = match (given("RETRYPLANE_COMMIT"), given("RETRYPLANE_COMMIT_DATE")) {
        (Some(commit), date) => (commit, date.unwrap_or_else(|| "unknown".to_owned())),
        (None, _) => from_git().unwrap_or_else(|| ("unknown".to_owned(), "unknown".to_owned())),
    };
    println!("cargo:rustc-env=RETRYPLANE_COMMIT={commit}");
    println!("cargo:rustc-env=RETRYPLANE_COMMIT_DATE={date}");
}

/// The commit and its date, when the workspace (two levels above this crate) is the top of a
/// git checkout; asks cargo to build again when the commit changes.
fn from_git() -> Option<(String, String)> {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    let workspace = manifest.join("../..").canonicalize().ok()?;
    let top = PathBuf::from(git(&workspace, &["rev-parse", "--show-toplevel"])?);
    if top.canonicalize().ok()? != workspace {
        return None;
    }
    // Built again when HEAD moves or the branch it names does. Only files that exist are
    // named: cargo takes a missing one as changed on every build (a clone without
    // `packed-refs`, a worktree's own directory).
    let dir = git(&workspace, &["rev-parse", "--absolute-git-dir"])?;
    let common = git(&workspace, &["rev-parse", "--git-common-dir"])
        .map(|c| workspace.join(c))
        .unwrap_or_else(|| PathBuf::from(&dir));
    for file in [
        PathBuf::from(&dir).join("HEAD"),
        common.join("packed-refs"),
        common.join("refs/heads"),
    ] {
        if file.exists() {
            println!("cargo:rerun-if-changed={}", file.display());
        }
    }
    let commit = git(&workspace, &["rev-parse", "--short=12", "HEAD"])?;
    // `%cd` with `--date=short`, not `%cs`: older gits have it too.
    let date = git(&workspace, &["log", "-1", "--format=%cd", "--date=short"])?;
    Some((commit, date))
}
