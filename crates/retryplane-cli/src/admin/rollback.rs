//! `retryplane rollback VERSION`: publish the content of a past version as a new version.
//!
//! Versions only grow: rolling back to v3 while v7 is current stores v8 with v3's content
//! (the same content hash). Text: the diff against the version that was current, then
//! `rolled back to v3: now v8 (sha256 0123456789ab…)`, or `no changes: v7 already has the
//! content of v3`. With `--dry-run`, nothing is stored: the diff, then `dry run: rolling back
//! to v3 would change v7: +1 endpoint (search), -0, 2 modified (inventory, payments)` (`dry
//! run: no changes: v7 already has the content of v3`). JSON: `{version, content_hash, changed, dry_run, would_change,
//! new_content_hash, diff, warnings, rolled_back_to}` (see `change::change_json`). An unknown
//! version, a version conflict or a rollback that removes every endpoint, or endpoints agents
//! called in the last 5 minutes, without `--force` is
//! refused (exit 1; a dry run of one prints its diff above the refusal, in text output).
//!
//! The dry run reads the version (`Get`) and sends its policies to `Apply` as a dry run: so it
//! answers in file mode too, and to a token that only reads, as `apply --dry-run` does, and
//! no control plane can take it for a rollback (one older than a dry-run field of `Rollback`
//! would ignore the field and roll back).

use std::fmt::Write as _;

use serde_json::Value;

use super::change::{ApplyFlags, PolicyFile};
use super::client::Client;
use super::{Server, ServerArgs, block_on, change, short_hash};
use crate::output::{self, Format};
use crate::{Outcome, Report};
use retryplane_proto::pb;

/// `retryplane rollback` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The version whose content to publish again.
    #[arg(value_name = "VERSION", value_parser = crate::flags::at_least_one)]
    target: u64,
    /// Refuse unless version N is current.
    #[arg(long, value_name = "N", value_parser = crate::flags::at_least_one)]
    expected_version: Option<u64>,
    /// Allow a rollback that removes every endpoint, or endpoints agents called in the last 5
    /// minutes (their calls then run on the defaults).
    #[arg(long)]
    force: bool,
    /// Show what the rollback would change, and store nothing (works in file mode and with a
    /// token that only reads).
    #[arg(long)]
    dry_run: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to roll back to, checked once.
#[derive(Debug)]
pub struct Settings {
    /// The version to restore.
    pub version: u64,
    /// Refuse unless this version is current.
    pub expected_version: Option<u64>,
    /// Allow removing every endpoint.
    pub force: bool,
    /// Only report what would change.
    pub dry_run: bool,
    /// Output format.
    pub format: Format,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        Ok(Self {
            version: args.target,
            expected_version: args.expected_version,
            force: args.force,
            dry_run: args.dry_run,
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Calls `Rollback` and prints the resulting version; with `--dry-run`, what it would change
/// (see the module docs).
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let response = if settings.dry_run {
            match dry_run(&mut client, settings).await? {
                Ok(response) => response,
                Err(report) => return Ok(report),
            }
        } else {
            let request = pb::RollbackRequest {
                version: settings.version,
                expected_version: settings.expected_version.unwrap_or(0),
                force: settings.force,
            };
            match client.rollback(request).await {
                Ok(response) => response,
                Err(status) => return Ok(super::failed(&status, String::new())),
            }
        };
        let name = format!("v{}", settings.version);
        let stdout = match settings.format {
            Format::Json => {
                let mut value = change::change_json(&response, &name, settings.dry_run);
                if let Value::Object(o) = &mut value {
                    o.insert("rolled_back_to".to_owned(), settings.version.into());
                }
                output::json(&value)?
            }
            Format::Text => {
                let mut out = String::new();
                let warnings: Vec<_> = response.warnings.iter().map(change::diagnostic).collect();
                change::push_diagnostics(&mut out, &name, &warnings);
                change::push_diff(&mut out, &response.diff);
                out.push_str(&result_line(&response, settings.version, settings.dry_run));
                out
            }
        };
        Ok(Report {
            stdout,
            outcome: Outcome::Success,
        })
    })
}

/// The version's policies, as `Get` answers them, sent to `Apply` as a dry run (see the
/// module docs). `Ok(Err(report))` when either call was refused.
async fn dry_run(
    client: &mut Client,
    settings: &Settings,
) -> anyhow::Result<Result<pb::ApplyResponse, Report>> {
    let file = match PolicyFile::stored(client, settings.version).await? {
        Ok(file) => file,
        Err(refused) => return Ok(Err(refused)),
    };
    let flags = ApplyFlags {
        expected_version: settings.expected_version,
        dry_run: true,
        force: settings.force,
    };
    change::apply(client, &file, flags, settings.format).await
}

/// The last line of the text output, with its newline.
fn result_line(response: &pb::ApplyResponse, target: u64, dry_run: bool) -> String {
    let mut line = String::new();
    if dry_run {
        if change::would_change(response) {
            let _ = write!(
                line,
                "dry run: rolling back to v{target} would change v{}: {}",
                response.version,
                change::summary(&response.diff)
            );
        } else {
            let _ = write!(
                line,
                "dry run: no changes: v{} already has the content of v{target}",
                response.version
            );
        }
    } else if response.changed {
        let _ = write!(
            line,
            "rolled back to v{target}: now v{} (sha256 {}…)",
            response.version,
            short_hash(&response.content_hash)
        );
    } else {
        let _ = write!(
            line,
            "no changes: v{} already has the content of v{target}",
            response.version
        );
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_result_names_the_restored_and_the_new_version() {
        let mut response = pb::ApplyResponse {
            version: 8,
            content_hash: "abcdef0123456789abcdef".to_owned(),
            changed: true,
            ..Default::default()
        };
        assert_eq!(
            result_line(&response, 3, false),
            "rolled back to v3: now v8 (sha256 abcdef012345…)\n"
        );
        response.changed = false;
        response.version = 7;
        assert_eq!(
            result_line(&response, 3, false),
            "no changes: v7 already has the content of v3\n"
        );
        // A dry run: whether it would change anything, and what.
        assert_eq!(
            result_line(&response, 3, true),
            "dry run: no changes: v7 already has the content of v3\n"
        );
        response.diff = vec![pb::DiffEntry {
            endpoint: "payments".to_owned(),
            change: pb::diff_entry::Change::Modified.into(),
            ..Default::default()
        }];
        assert_eq!(
            result_line(&response, 3, true),
            "dry run: rolling back to v3 would change v7: +0 endpoints, -0, 1 modified (payments)\n"
        );
    }
}
