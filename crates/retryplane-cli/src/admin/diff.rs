//! `retryplane diff FILE`: what `apply FILE` would change, changing nothing.
//!
//! A dry-run `Apply`. Stdout holds only the diff (`+ added`, `- removed`, `~ modified`
//! endpoints with their detail lines indented), empty when the file matches the current
//! version; the server's warnings go to stderr as `FILE:LINE:COLUMN: warning: …` lines. The
//! check that refuses removing every endpoint is skipped (`force`): a diff only shows; when the
//! file removes an endpoint, the check is asked for once more, unforced, and a change that
//! `apply` (or a save in file mode) would refuse is noted on stderr with the server's reason,
//! in text output (the exit code stays the diff's). With
//! `--output json`, `apply --dry-run`'s object (see `change::change_json`): `would_change` says
//! whether the file differs, `new_content_hash` the hash it would get.
//!
//! Exit 0 whether or not the file differs; with `--exit-code`, 1 when it differs (like
//! `git diff --exit-code`). An invalid file prints its diagnostics and exits 1, and a refusal
//! from the server exits 1, as with the other admin commands; with `--exit-code` both exit 2
//! instead (like `diff(1)`: trouble), so that a script can tell "differs" from "could not
//! compare".

use std::path::PathBuf;

use super::change::{self, ApplyFlags};
use super::client::Client;
use super::{Server, ServerArgs, block_on};
use crate::input::Source;
use crate::output::{self, Format};
use crate::{Outcome, Report};
use retryplane_proto::pb;

/// `retryplane diff` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Policy file to compare with the current version; `-` reads standard input.
    #[arg(value_name = "FILE")]
    file: PathBuf,
    /// Exit 1 when the file differs from the current version, and 2 when it could not be
    /// compared (an invalid file, a refusal, no server).
    #[arg(long)]
    exit_code: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to compare, checked once.
#[derive(Debug)]
pub struct Settings {
    /// The policy file.
    pub source: Source,
    /// Whether a difference exits 1.
    pub exit_code: bool,
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
            exit_code: args.exit_code,
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Asks for a dry-run `Apply` of the file and prints its diff.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    // A run that could not compare (an invalid file, a refusal): with `--exit-code`, where 1
    // means "differs", that is trouble, exit 2.
    let not_compared = |report: Report| match report.outcome {
        Outcome::Failure if settings.exit_code => Report {
            outcome: Outcome::Error,
            ..report
        },
        _ => report,
    };
    let file = match change::read_policy(&settings.source, settings.format)? {
        Ok(file) => file,
        Err(report) => return Ok(not_compared(report)),
    };
    let flags = ApplyFlags {
        expected_version: None,
        dry_run: true,
        force: true,
    };
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let response = match change::apply(&mut client, &file, flags, settings.format).await? {
            Ok(response) => response,
            Err(report) => return Ok(not_compared(report)),
        };
        let stdout = match settings.format {
            Format::Json => output::json(&change::change_json(&response, &file.name, true))?,
            Format::Text => {
                let warnings: Vec<_> = response.warnings.iter().map(change::diagnostic).collect();
                let mut lines = String::new();
                change::push_diagnostics(&mut lines, &file.name, &warnings);
                for line in lines.lines() {
                    output::note(format_args!("{line}"));
                }
                if let Some(refusal) = refusal(&mut client, &file, &response).await {
                    output::note(format_args!(
                        "retryplane: note: applying it would be refused: {refusal}"
                    ));
                }
                let mut out = String::new();
                change::push_diff(&mut out, &response.diff);
                out
            }
        };
        let differs = !response.diff.is_empty();
        Ok(Report {
            stdout,
            outcome: if settings.exit_code && differs {
                Outcome::Failure
            } else {
                Outcome::Success
            },
        })
    })
}

/// Why `apply` would refuse the file `response` (a forced dry run) showed, when its diff
/// removes an endpoint and a dry run of the same file, unforced, is refused for removing
/// every endpoint (`FAILED_PRECONDITION`; the server's message says what to do in its mode).
async fn refusal(
    client: &mut Client,
    file: &change::PolicyFile,
    response: &pb::ApplyResponse,
) -> Option<String> {
    if !response
        .diff
        .iter()
        .any(|e| e.change() == pb::diff_entry::Change::Removed)
    {
        return None;
    }
    let request = pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(file.content.clone()),
            origin: file.name.clone(),
        }),
        expected_version: None,
        dry_run: true,
        force: false,
    };
    match client.apply(request).await {
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            Some(status.message().to_owned())
        }
        _ => None,
    }
}
