//! `retryplane history [--limit N] [--before VERSION]`: every stored version, newest first
//! (with `--before`, only those older than that version).
//!
//! Text: a table of `VERSION CREATED SOURCE AUTHOR HASH SUMMARY`, the time in UTC (RFC 3339),
//! the source `file`, `admin` or `rollback(vN)` (the version whose content was restored), `-`
//! for no author, the first 12 hex digits of the content hash. JSON: an array of
//! `{version, content_hash, source, author, created_unix_ms, created, summary,
//! rolled_back_from}`.
//!
//! The control plane answers a page at a time (1,000 versions); the pages are read one after
//! the other until every version asked for has come.

use serde_json::Value;

use super::client::Client;
use super::time::rfc3339_utc;
use super::{Server, ServerArgs, block_on, json, short_hash};
use crate::output::{self, Align, Format};
use crate::{Outcome, Report};
use retryplane_proto::pb;

/// `retryplane history` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only the N newest versions.
    #[arg(long, value_name = "N", value_parser = crate::flags::at_least_one_u32)]
    limit: Option<u32>,
    /// Only versions older than this one (to read on from the last version listed).
    #[arg(long, value_name = "VERSION", value_parser = crate::flags::at_least_one)]
    before: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to list, checked once.
#[derive(Debug)]
pub struct Settings {
    /// At most this many versions; `None` for all.
    pub limit: Option<u32>,
    /// Only versions older than this one; `None` from the newest.
    pub before: Option<u64>,
    /// Output format.
    pub format: Format,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        Ok(Self {
            limit: args.limit,
            before: args.before,
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Calls `History` and prints the versions.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let mut versions: Vec<pb::VersionInfo> = Vec::new();
        let mut before = settings.before.unwrap_or(0);
        loop {
            let sent = u32::try_from(versions.len()).unwrap_or(u32::MAX);
            let request = pb::HistoryRequest {
                // Whatever is left of the limit; 0 asks for all.
                limit: settings.limit.map_or(0, |limit| limit.saturating_sub(sent)),
                before,
            };
            let response = match client.history(request).await {
                Ok(response) => response,
                Err(status) => return Ok(super::failed(&status, String::new())),
            };
            let empty = response.versions.is_empty();
            versions.extend(response.versions);
            let next = response.next_before;
            let wanted = settings
                .limit
                .is_none_or(|limit| versions.len() < limit as usize);
            // Each page starts below the last and holds something, so this ends; a control
            // plane that does not page (no `next_before`) answers once.
            if next == 0 || !wanted || empty || (before != 0 && next >= before) {
                break;
            }
            before = next;
        }
        let stdout = match settings.format {
            Format::Json => {
                let all: Vec<Value> = versions
                    .iter()
                    .map(|v| Value::Object(json::version_info(v)))
                    .collect();
                output::json(&all)?
            }
            Format::Text if versions.is_empty() => {
                match settings.before {
                    Some(before) => output::note(format_args!("no version older than {before}")),
                    None => output::note(format_args!("no versions stored yet")),
                }
                String::new()
            }
            Format::Text => table(&versions),
        };
        Ok(Report {
            stdout,
            outcome: Outcome::Success,
        })
    })
}

/// The versions as a table with a header.
fn table(versions: &[pb::VersionInfo]) -> String {
    let mut rows = vec![
        ["VERSION", "CREATED", "SOURCE", "AUTHOR", "HASH", "SUMMARY"]
            .map(str::to_owned)
            .to_vec(),
    ];
    for v in versions {
        let source = match v.rolled_back_from {
            0 => v.source.clone(),
            from => format!("{}(v{from})", v.source),
        };
        // A token's name, escaped for the terminal as agent names are (a version stored before
        // names with control characters were refused may still hold one).
        let author = if v.author.is_empty() {
            "-".to_owned()
        } else {
            crate::output::name(&v.author)
        };
        rows.push(vec![
            v.version.to_string(),
            rfc3339_utc(v.created_unix_ms),
            source,
            author,
            short_hash(&v.content_hash).to_owned(),
            // Names in it come from the server: kept to one line, as every cell is.
            output::OneLine(&v.summary).to_string(),
        ]);
    }
    let mut out = String::new();
    output::table(&mut out, "", &[Align::Right], &rows);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_is_a_table_with_utc_times_and_short_hashes() {
        let versions = vec![
            pb::VersionInfo {
                version: 12,
                content_hash: "0123456789abcdef0123".to_owned(),
                source: "rollback".to_owned(),
                author: "ops".to_owned(),
                created_unix_ms: 1_764_473_825_123,
                summary: "-1 endpoint".to_owned(),
                rolled_back_from: 3,
            },
            pb::VersionInfo {
                version: 3,
                content_hash: "fedcba9876543210fedc".to_owned(),
                source: "file".to_owned(),
                author: String::new(),
                created_unix_ms: 0,
                summary: "+2 endpoints, -0, 0 modified".to_owned(),
                rolled_back_from: 0,
            },
        ];
        assert_eq!(
            table(&versions),
            "\
VERSION  CREATED               SOURCE        AUTHOR  HASH          SUMMARY
     12  2025-11-30T03:37:05Z  rollback(v3)  ops     0123456789ab  -1 endpoint
      3  1970-01-01T00:00:00Z  file          -       fedcba987654  +2 endpoints, -0, 0 modified
"
        );
    }

    #[test]
    fn an_author_with_control_characters_stays_on_its_row() {
        let version = pb::VersionInfo {
            version: 2,
            content_hash: "0123456789abcdef0123".to_owned(),
            source: "admin".to_owned(),
            author: "ci\nbot\u{1b}[31m".to_owned(),
            created_unix_ms: 0,
            summary: "no changes".to_owned(),
            rolled_back_from: 0,
        };
        let out = table(&[version]);
        assert_eq!(out.lines().count(), 2, "{out}");
        assert!(!out.contains('\u{1b}'), "{out:?}");
    }
}
