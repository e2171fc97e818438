//! `retryplane diff FILE`: what `apply FILE` would change, changing nothing; `retryplane diff
//! --from N [--to M]`: what changed from stored version N to version M (default: the current
//! one), in the same form.
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
//!
//! Two versions are read with `Get` (any token that reads may) and compared here, with the
//! policy crate's diff, the one the control plane runs for `apply`: so `diff --from 5` shows
//! what changed since version 5 (the other way round from `rollback 5 --dry-run`, which shows
//! what going back to it would change). Exit codes as for a file (an unknown version: 1, or 2
//! with `--exit-code`). JSON: `{from: {version, content_hash}, to: {version, content_hash},
//! differs, diff}`, `diff` as `apply`'s.

use std::path::PathBuf;

use super::change::{self, ApplyFlags};
use super::client::Client;
use super::{Server, ServerArgs, block_on};
use crate::input::Source;
use crate::output::{self, Format};
use crate::{Outcome, Report};
use retryplane_policy::document::PolicyDocument;
use retryplane_proto::pb;

/// `retryplane diff` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Policy file to compare with the current version; `-` reads standard input.
    #[arg(
        value_name = "FILE",
        required_unless_present = "from",
        conflicts_with = "from"
    )]
    file: Option<PathBuf>,
    /// Compare stored versions instead of a file: what changed from version N (to the current
    /// one, or to `--to`).
    #[arg(long, value_name = "N", value_parser = crate::flags::at_least_one)]
    from: Option<u64>,
    /// With `--from`: the version to compare it with, instead of the current one.
    #[arg(long, value_name = "N", requires = "from", value_parser = crate::flags::at_least_one)]
    to: Option<u64>,
    /// Exit 1 when the file (or `--from`'s version) differs from what it is compared with,
    /// and 2 when it could not be compared (an invalid file, an unknown version, a refusal, no
    /// server).
    #[arg(long)]
    exit_code: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to compare with what.
#[derive(Debug)]
pub enum Compared {
    /// A policy file, with the current version.
    File(Source),
    /// Two stored versions: from `from` to `to` (`None`: the current one).
    Versions {
        /// The older side, usually.
        from: u64,
        /// The other side; `None` for the current version.
        to: Option<u64>,
    },
}

/// What to compare, checked once.
#[derive(Debug)]
pub struct Settings {
    /// What to compare.
    pub compared: Compared,
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
            compared: match (args.file, args.from) {
                (_, Some(from)) => Compared::Versions { from, to: args.to },
                (Some(file), None) => Compared::File(Source::from_arg(file)),
                // clap asks for one of the two.
                (None, None) => anyhow::bail!("give a policy file, or --from VERSION"),
            },
            exit_code: args.exit_code,
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Asks for a dry-run `Apply` of the file and prints its diff; with `--from`, compares two
/// stored versions instead (see the module docs).
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
    let source = match &settings.compared {
        Compared::File(source) => source,
        Compared::Versions { from, to } => {
            return block_on(async {
                let mut client = Client::connect(&settings.server).await?;
                Ok(match versions(&mut client, *from, *to, settings).await? {
                    Ok(report) => report,
                    Err(refused) => not_compared(refused),
                })
            });
        }
    };
    let file = match change::read_policy(source, settings.format)? {
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
        Ok(compared(stdout, !response.diff.is_empty(), settings))
    })
}

/// Why `apply` would refuse the file `response` (a forced dry run) showed, when its diff
/// removes an endpoint and a dry run of the same file, unforced, is refused for removing
/// every endpoint, or endpoints agents call (`FAILED_PRECONDITION`; the server's message says
/// what to do in its mode). (For the second, the forced dry run's warning has said what the
/// removal does; this says that `apply` needs `--force` for it.)
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
        source: Some(file.source()),
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

/// Version `version` (0: the current one), read with `Get`: its number and hash, and its
/// document. `Ok(Err(report))` when the control plane refused (an unknown version).
async fn stored(
    client: &mut Client,
    version: u64,
) -> anyhow::Result<Result<(pb::VersionInfo, PolicyDocument), Report>> {
    let (info, policies) = match change::stored_version(client, version).await? {
        Ok(stored) => stored,
        Err(refused) => return Ok(Err(refused)),
    };
    let document = PolicyDocument::try_from(policies).map_err(|e| {
        anyhow::anyhow!(
            "the control plane sent v{} in a form this command cannot read: {e}",
            info.version
        )
    })?;
    Ok(Ok((info, document)))
}

/// Compares two stored versions (see the module docs).
async fn versions(
    client: &mut Client,
    from: u64,
    to: Option<u64>,
    settings: &Settings,
) -> anyhow::Result<Result<Report, Report>> {
    let (old, old_document) = match stored(client, from).await? {
        Ok(old) => old,
        Err(refused) => return Ok(Err(refused)),
    };
    let (new, new_document) = match stored(client, to.unwrap_or(0)).await? {
        Ok(new) => new,
        Err(refused) => return Ok(Err(refused)),
    };
    let diff: Vec<pb::DiffEntry> = retryplane_policy::diff::diff(&old_document, &new_document)
        .iter()
        .map(pb::DiffEntry::from)
        .collect();
    let differs = !diff.is_empty();
    let stdout = match settings.format {
        Format::Json => output::json(&serde_json::json!({
            "from": {"version": old.version, "content_hash": old.content_hash},
            "to": {"version": new.version, "content_hash": new.content_hash},
            "differs": differs,
            "diff": change::diff_json(&diff),
        }))?,
        Format::Text => {
            let mut out = String::new();
            change::push_diff(&mut out, &diff);
            out
        }
    };
    Ok(Ok(compared(stdout, differs, settings)))
}

/// What a comparison prints, and its exit: 1 when it `differs` and `--exit-code` asks.
fn compared(stdout: String, differs: bool, settings: &Settings) -> Report {
    Report {
        stdout,
        outcome: if settings.exit_code && differs {
            Outcome::Failure
        } else {
            Outcome::Success
        },
    }
}
