//! `retryplane apply FILE`: publish a policy file as the new version (API mode).
//!
//! Text output: the server's warnings as `FILE:LINE:COLUMN: warning: PATH: message` lines, the
//! diff against the current version (`+ added`, `- removed`, `~ modified` endpoints, detail
//! lines indented), then one result line: `applied v7 (sha256 0123456789ab…)`,
//! `no changes (v6)`, or with `--dry-run` `dry run: would change v6: +1 endpoint (search), -0, 2 modified (inventory, payments)`
//! (`dry run: no changes (v6)`). JSON: see `change::change_json`; after a dry run,
//! `would_change` says whether the apply would store a new version and `new_content_hash` the
//! hash it would get (`version` and `content_hash` stay the current version's). A file with errors is checked here and never sent: every
//! diagnostic is printed exactly as `retryplane validate` prints it, and the command exits 1;
//! so does a file the server refuses (its diagnostics printed the same way), a version conflict
//! (`--expected-version`) and a change that removes every endpoint, or endpoints agents called
//! in the last 5 minutes, without `--force` (after a
//! dry run of one, its diff is printed above the refusal, in text output). A control
//! plane older than this command ignores `--expected-version 0`: that is reported (`ABORTED`,
//! exit 1), and if it stored a version all the same, the usual output of that is printed too.

use std::fmt::Write as _;
use std::path::PathBuf;

use tonic::Code;

use super::change::{self, ApplyFlags};
use super::client::Client;
use super::{Server, ServerArgs, block_on, short_hash};
use crate::input::Source;
use crate::output::{self, Format};
use crate::{Outcome, Report};

/// `retryplane apply` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Policy file to publish; `-` reads standard input.
    #[arg(value_name = "FILE")]
    file: PathBuf,
    /// Only show what would change; store nothing.
    #[arg(long)]
    dry_run: bool,
    /// Refuse unless version N is current (another change came first otherwise); 0 refuses
    /// unless the store is empty, so that only one of several first applies lands (a control
    /// plane older than this command does not check 0: that is reported, exit 1).
    #[arg(long, value_name = "N")]
    expected_version: Option<u64>,
    /// Allow a change that removes every endpoint, or endpoints agents called in the last 5
    /// minutes (their calls then run on the defaults; a misspelt endpoint name does that).
    #[arg(long)]
    force: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to apply and where, checked once.
#[derive(Debug)]
pub struct Settings {
    /// The policy file.
    pub source: Source,
    /// Dry run, expected version, force.
    pub flags: ApplyFlags,
    /// Output format.
    pub format: Format,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        Ok(Self {
            source: Source::from_arg(args.file),
            flags: ApplyFlags {
                expected_version: args.expected_version,
                dry_run: args.dry_run,
                force: args.force,
            },
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Sends the file to `Apply`; see the module docs for what is printed.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    let file = match change::read_policy(&settings.source, settings.format)? {
        Ok(file) => file,
        Err(report) => return Ok(report),
    };
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let response =
            match change::apply(&mut client, &file, settings.flags, settings.format).await? {
                Ok(response) => response,
                Err(report) => return Ok(report),
            };
        let stdout = match settings.format {
            Format::Json => output::json(&change::change_json(
                &response,
                &file.name,
                settings.flags.dry_run,
            ))?,
            Format::Text => {
                let mut out = String::new();
                let warnings: Vec<_> = response.warnings.iter().map(change::diagnostic).collect();
                change::push_diagnostics(&mut out, &file.name, &warnings);
                change::push_diff(&mut out, &response.diff);
                out.push_str(&result_line(&response, settings.flags.dry_run));
                out
            }
        };
        Ok(checked(
            settings.flags,
            &response,
            Report {
                stdout,
                outcome: Outcome::Success,
            },
        ))
    })
}

/// `report`, unless `response` shows that the control plane ignored `--expected-version 0`
/// (see [`change::ignored_empty_check`]): then `ABORTED` and exit 1. When it stored a version
/// all the same, the usual output stays on stdout, so that a script keeps the record of what
/// was stored (`--output json` included).
fn checked(
    flags: ApplyFlags,
    response: &retryplane_proto::pb::ApplyResponse,
    report: Report,
) -> Report {
    let Some(message) = change::ignored_empty_check(flags, response) else {
        return report;
    };
    let stored = !flags.dry_run && response.changed;
    let stdout = if stored { report.stdout } else { String::new() };
    super::failed_with(Code::Aborted, &message, stdout)
}

/// The last line of `apply`'s text output, with its newline.
fn result_line(response: &retryplane_proto::pb::ApplyResponse, dry_run: bool) -> String {
    let mut line = String::new();
    let version = response.version;
    if dry_run {
        if !change::would_change(response) {
            let _ = write!(line, "dry run: no changes (v{version})");
        } else if version == 0 {
            let _ = write!(
                line,
                "dry run: would publish the first version: {}",
                change::summary(&response.diff)
            );
        } else {
            let _ = write!(
                line,
                "dry run: would change v{version}: {}",
                change::summary(&response.diff)
            );
        }
    } else if response.changed {
        let _ = write!(
            line,
            "applied v{version} (sha256 {}…)",
            short_hash(&response.content_hash)
        );
    } else {
        let _ = write!(line, "no changes (v{version})");
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use retryplane_proto::pb;

    use super::*;

    fn response(version: u64, changed: bool, diff: usize) -> pb::ApplyResponse {
        pb::ApplyResponse {
            version,
            content_hash: "0123456789abcdef0123456789abcdef".to_owned(),
            changed,
            diff: (0..diff)
                .map(|i| pb::DiffEntry {
                    endpoint: format!("e{i}"),
                    change: pb::diff_entry::Change::Added as i32,
                    details: Vec::new(),
                    defaults: Some(false),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_version_stored_despite_an_ignored_empty_check_keeps_its_record() {
        let flags = |dry_run| ApplyFlags {
            expected_version: Some(0),
            dry_run,
            force: false,
        };
        let report = || Report {
            stdout: "{\"version\":4}\n".to_owned(),
            outcome: Outcome::Success,
        };
        // Stored over a store that was not empty: exit 1, and the record on stdout.
        let stored = checked(flags(false), &response(4, true, 1), report());
        assert!(matches!(stored.outcome, Outcome::Failure));
        assert_eq!(stored.stdout, "{\"version\":4}\n");
        // A dry run stored nothing: exit 1 and nothing on stdout.
        let dry = checked(flags(true), &response(3, false, 1), report());
        assert!(matches!(dry.outcome, Outcome::Failure));
        assert_eq!(dry.stdout, "");
        // Checked (the store was empty): the report as it is.
        let first = checked(flags(false), &response(1, true, 1), report());
        assert!(matches!(first.outcome, Outcome::Success));
        assert_eq!(first.stdout, "{\"version\":4}\n");
    }

    #[test]
    fn the_result_line_says_what_happened() {
        assert_eq!(
            result_line(&response(7, true, 1), false),
            "applied v7 (sha256 0123456789ab…)\n"
        );
        assert_eq!(
            result_line(&response(6, false, 0), false),
            "no changes (v6)\n"
        );
        assert_eq!(
            result_line(&response(6, false, 2), true),
            "dry run: would change v6: +2 endpoints (e0, e1), -0, 0 modified\n"
        );
        assert_eq!(
            result_line(&response(6, false, 0), true),
            "dry run: no changes (v6)\n"
        );
        assert_eq!(
            result_line(&response(0, false, 1), true),
            "dry run: would publish the first version: +1 endpoint (e0), -0, 0 modified\n"
        );
    }
}
