//! What `apply`, `diff` and `rollback` share: sending a policy file, and printing a change
//! (its diff, its warnings) or the diagnostics of a refused one.

use retryplane_policy::Diagnostic;
use std::fmt::Write as _;

use retryplane_policy::diff::{self, Change, Scope};
use retryplane_policy::yaml::Loc;
use retryplane_proto::pb;
use serde_json::{Value, json};
use tonic::Code;

use super::client::Client;
use crate::input::{Contents, Source};
use crate::output::{self, Format, JsonDiagnostic};
use crate::{Outcome, Report};

/// `+ payments` (added), `- payments` (removed), `~ payments` (modified), each followed by its
/// detail lines indented by four spaces (`    max_attempts: 3 -> 4`). The `defaults:` block is
/// `defaults`, and an endpoint named `defaults` is `endpoints.defaults` (its path in the file).
pub fn push_diff(out: &mut String, diff: &[pb::DiffEntry]) {
    for entry in diff {
        let mark = match entry.change() {
            pb::diff_entry::Change::Added => '+',
            pb::diff_entry::Change::Removed => '-',
            pb::diff_entry::Change::Modified => '~',
            pb::diff_entry::Change::Unspecified => '?',
        };
        out.push(mark);
        out.push(' ');
        // `defaults`, an endpoint's name, or `endpoints.defaults` for an endpoint so named.
        // Names and route matches are written as the file has them, so control characters
        // are escaped: a line break in a path prefix would otherwise print a line of its own
        // (`+ evil`, read as an added endpoint), and an escape would reach the terminal.
        let scope = Change::from(entry).scope.to_string();
        let _ = write!(out, "{}", output::OneLine(&scope));
        out.push('\n');
        for line in &entry.details {
            let _ = writeln!(out, "    {}", output::OneLine(line));
        }
    }
}

/// `+1 endpoint (search), -0, 2 modified (inventory, payments)` (and `, defaults modified`), as
/// the server summarises versions in `history` ([`diff::summary`]).
pub fn summary(diff: &[pb::DiffEntry]) -> String {
    let changes: Vec<Change> = diff.iter().map(Change::from).collect();
    // The names come from the server: shown on one line, as the diff above it shows them.
    output::OneLine(&diff::summary(&changes)).to_string()
}

/// A diagnostic from the wire, printed by the same code as `retryplane validate`'s.
pub fn diagnostic(d: &pb::Diagnostic) -> Diagnostic {
    let loc = Loc {
        line: d.line,
        column: d.column,
    };
    match d.severity() {
        pb::diagnostic::Severity::Warning => Diagnostic::warning(loc, &d.path, &d.message),
        pb::diagnostic::Severity::Error | pb::diagnostic::Severity::Unspecified => {
            Diagnostic::error(loc, &d.path, &d.message)
        }
    }
}

/// `FILE:LINE:COLUMN: SEVERITY: PATH: MESSAGE`, one line each (SPEC §5).
pub fn push_diagnostics(out: &mut String, file: &str, diags: &[Diagnostic]) {
    for d in diags {
        output::push_diagnostic_line(out, file, d);
    }
}

/// The `validate --format json` array of `diags`.
fn diagnostics_json(file: &str, diags: &[Diagnostic]) -> Value {
    diags
        .iter()
        .map(|d| json!(JsonDiagnostic::new(file, d)))
        .collect()
}

/// `{version, content_hash, changed, dry_run, would_change, new_content_hash, diff: [{endpoint,
/// scope, change, details}], warnings: [...]}` for `--output json`; `scope` is `defaults` for the
/// file's `defaults:` block (whose `endpoint` reads `defaults`) and `endpoint` for an endpoint,
/// even one named `defaults`.
///
/// `version` and `content_hash` are the version current after the call (for a dry run, the
/// one that stays current; 0 and `""` for an empty store); `changed` whether this call stored a
/// new version (never for a dry run). `would_change` is whether the content differs from the
/// current version's (for a dry run, whether applying it would store a new version), and
/// `new_content_hash` the hash the content gets, or would get. A control plane that predates
/// those two answers neither: `new_content_hash` is `null` then, and `would_change` is read
/// from the diff.
pub fn change_json(response: &pb::ApplyResponse, file: &str, dry_run: bool) -> Value {
    let diff = diff_json(&response.diff);
    let warnings: Vec<Diagnostic> = response.warnings.iter().map(diagnostic).collect();
    let new_content_hash =
        (!response.new_content_hash.is_empty()).then_some(&response.new_content_hash);
    let would_change = would_change(response);
    json!({
        "version": response.version,
        "content_hash": response.content_hash,
        "changed": response.changed,
        "dry_run": dry_run,
        "would_change": would_change,
        "new_content_hash": new_content_hash,
        "diff": diff,
        "warnings": diagnostics_json(file, &warnings),
    })
}

/// A diff's entries as JSON: `[{endpoint, scope, change, details}]` (see [`change_json`]).
pub fn diff_json(diff: &[pb::DiffEntry]) -> Vec<Value> {
    diff.iter()
        .map(|e| {
            let change = Change::from(e);
            json!({
                "endpoint": e.endpoint,
                "scope": match change.scope {
                    Scope::Defaults => "defaults",
                    Scope::Endpoint(_) => "endpoint",
                },
                "change": change.kind.as_str(),
                "details": e.details,
            })
        })
        .collect()
}

/// Whether the content sent differs from the current version's (for a dry run, whether the
/// change would store a new version): `would_change`, or, from a control plane that predates
/// it (no `new_content_hash`), read from the diff.
pub fn would_change(response: &pb::ApplyResponse) -> bool {
    if response.new_content_hash.is_empty() {
        response.changed || !response.diff.is_empty()
    } else {
        response.would_change
    }
}

/// Policies ready to send: a policy file, or a stored version's document.
#[derive(Debug)]
pub struct PolicyFile {
    /// The name diagnostics are printed with: the path as given, `<stdin>`, or `v3`.
    pub name: String,
    /// Its content: the file's text, or a version's document as `Get` answered it.
    pub content: pb::policy_source::Kind,
}

impl PolicyFile {
    /// The policies as an `Apply` or `Validate` request carries them.
    pub fn source(&self) -> pb::PolicySource {
        pb::PolicySource {
            kind: Some(self.content.clone()),
            origin: self.name.clone(),
        }
    }

    /// Stored version `version` (0: the current one), read with [`stored_version`], as
    /// policies to send, named `vN`.
    pub async fn stored(client: &mut Client, version: u64) -> anyhow::Result<Result<Self, Report>> {
        Ok(stored_version(client, version)
            .await?
            .map(|(info, policies)| Self {
                name: format!("v{}", info.version),
                content: pb::policy_source::Kind::Document(policies),
            }))
    }
}

/// Stored version `version` (0: the current one), read with `Get`: its metadata and its
/// policies. `Ok(Err(report))` when the control plane refused (an unknown version:
/// `NOT_FOUND`).
pub async fn stored_version(
    client: &mut Client,
    version: u64,
) -> anyhow::Result<Result<(pb::VersionInfo, pb::PolicyDocument), Report>> {
    let got = match client.get(pb::GetRequest { version }).await {
        Ok(got) => got,
        Err(status) => return Ok(Err(super::failed(&status, String::new()))),
    };
    let (Some(info), Some(policies)) = (got.info, got.policies) else {
        let shown = match version {
            0 => "the current version".to_owned(),
            n => format!("v{n}"),
        };
        anyhow::bail!("the control plane's answer for {shown} holds no version or no policies");
    };
    Ok(Ok((info, policies)))
}

/// Reads `source` under the size limit and validates it here, with the same checks as the
/// server. `Ok(Err(report))` when the file is not worth sending (too large, not UTF-8, or with
/// errors): every diagnostic on stdout, exactly as `validate` prints them, one summary line on
/// stderr, exit 1, and the server is never contacted. A file with warnings only is sent (the
/// server answers its warnings, which are printed with the outcome). `Err` when it cannot be
/// read at all (exit 2).
///
/// Checking here first matters for large files: the server's refusal carries only as many
/// problems as fit a gRPC status message, while this prints them all.
pub fn read_policy(source: &Source, format: Format) -> anyhow::Result<Result<PolicyFile, Report>> {
    let name = source.to_string();
    let loaded = match source.read()? {
        Contents::TooLarge(size) => retryplane_policy::too_large(size),
        Contents::Bytes(bytes) => match String::from_utf8(bytes) {
            Ok(yaml) => {
                let mut loaded = retryplane_policy::load(yaml.as_bytes());
                crate::input::fit_agents(&mut loaded);
                if !loaded.has_errors() {
                    return Ok(Ok(PolicyFile {
                        name,
                        content: pb::policy_source::Kind::Yaml(yaml),
                    }));
                }
                loaded
            }
            // The policy crate says what is wrong with the bytes, with a place.
            Err(e) => retryplane_policy::load(e.as_bytes()),
        },
    };
    let mut diags = loaded.diagnostics;
    if !diags.iter().any(Diagnostic::is_error) {
        diags.push(Diagnostic::error(
            Loc { line: 1, column: 1 },
            "<root>",
            "the file is not UTF-8 text",
        ));
    }
    output::error(format_args!(
        "{} is invalid: {}; nothing was sent to the server",
        output::OneLine(&name),
        counts(&diags)
    ));
    Ok(Err(diagnostics_report(&name, &diags, format)?))
}

/// The diagnostics of a refused policy on stdout, exit 1.
fn diagnostics_report(file: &str, diags: &[Diagnostic], format: Format) -> anyhow::Result<Report> {
    let stdout = match format {
        Format::Text => {
            let mut out = String::new();
            push_diagnostics(&mut out, file, diags);
            out
        }
        Format::Json => output::json(&diagnostics_json(file, diags))?,
    };
    Ok(Report {
        stdout,
        outcome: Outcome::Failure,
    })
}

/// What to ask of `Apply`, besides the file.
#[derive(Clone, Copy, Debug, Default)]
pub struct ApplyFlags {
    /// Refuse unless this version is current.
    pub expected_version: Option<u64>,
    /// Only report what would change.
    pub dry_run: bool,
    /// Allow a change that removes every endpoint, or endpoints agents called in the last 5
    /// minutes.
    pub force: bool,
}

/// Sends `file` to `Apply`. `Ok(Err(report))` when the server refused it: for an invalid
/// policy, the server's diagnostics on stdout, as `validate` prints them, and a one-line
/// summary on stderr; any other refusal as [`super::failed`].
///
/// The diagnostics are asked of `Validate` (the same validator as `Apply`): `Apply`'s status
/// carries them only as text lines, without the file name and not meant to be parsed.
pub async fn apply(
    client: &mut Client,
    file: &PolicyFile,
    flags: ApplyFlags,
    format: Format,
) -> anyhow::Result<Result<pb::ApplyResponse, Report>> {
    let request = pb::ApplyRequest {
        source: Some(file.source()),
        expected_version: flags.expected_version,
        dry_run: flags.dry_run,
        force: flags.force,
    };
    let status = match client.apply(request).await {
        Ok(response) => return Ok(Ok(response)),
        Err(status) => status,
    };
    // A dry run shows what the change does (SPEC §3), also one that would be refused for
    // removing every endpoint, or endpoints agents call (the only refusals of a dry run with
    // `FAILED_PRECONDITION`): the diff is asked for again, forced, and printed above the
    // refusal, which still exits 1.
    // JSON output stays empty on a refusal, as for any other.
    if flags.dry_run
        && !flags.force
        && status.code() == Code::FailedPrecondition
        && format == Format::Text
        && let Ok(forced) = client
            .apply(pb::ApplyRequest {
                source: Some(file.source()),
                expected_version: flags.expected_version,
                dry_run: true,
                force: true,
            })
            .await
    {
        let mut out = String::new();
        let warnings: Vec<_> = forced.warnings.iter().map(diagnostic).collect();
        push_diagnostics(&mut out, &file.name, &warnings);
        push_diff(&mut out, &forced.diff);
        return Ok(Err(super::failed(&status, out)));
    }
    if status.code() == Code::InvalidArgument {
        let validated = client
            .validate(pb::ValidateRequest {
                source: Some(file.source()),
            })
            .await;
        if let Ok(v) = validated
            && !v.valid
        {
            let diags: Vec<Diagnostic> = v.diagnostics.iter().map(diagnostic).collect();
            let report = diagnostics_report(&file.name, &diags, format)?;
            let message = format!(
                "{} is invalid: {}",
                output::OneLine(&file.name),
                counts(&diags)
            );
            return Ok(Err(super::failed_with(
                status.code(),
                &message,
                report.stdout,
            )));
        }
    }
    Ok(Err(super::failed(&status, String::new())))
}

/// Why `response` shows that the control plane did not check `--expected-version 0`: one that
/// predates the check reads 0 as "no check" and answers as if none was asked. On an empty
/// store, an apply stores v1 and a dry run answers from v0.
pub fn ignored_empty_check(flags: ApplyFlags, response: &pb::ApplyResponse) -> Option<String> {
    if flags.expected_version != Some(0) {
        return None;
    }
    let ignored = "the control plane ignored --expected-version 0 (it is older than this command)";
    if flags.dry_run || !response.changed {
        (response.version != 0).then(|| {
            format!(
                "{ignored}: the store is not empty, v{} is current",
                response.version
            )
        })
    } else {
        (response.version != 1).then(|| {
            format!(
                "{ignored} and stored v{} over a store that was not empty",
                response.version
            )
        })
    }
}

/// `2 errors, 1 warning`.
fn counts(diags: &[Diagnostic]) -> String {
    // Counted whole: a long list ends with a line saying how many more there are.
    let (errors, warnings) = retryplane_policy::diag::counts(diags);
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    format!(
        "{}, {}",
        plural(errors, "error"),
        plural(warnings, "warning")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_control_plane_that_ignored_expected_version_zero_is_told_apart() {
        let flags = |expected_version, dry_run| ApplyFlags {
            expected_version,
            dry_run,
            force: false,
        };
        let answer = |version, changed| pb::ApplyResponse {
            version,
            changed,
            ..Default::default()
        };
        // Checked: an apply into the empty store, a dry run against it.
        assert_eq!(
            ignored_empty_check(flags(Some(0), false), &answer(1, true)),
            None
        );
        assert_eq!(
            ignored_empty_check(flags(Some(0), true), &answer(0, false)),
            None
        );
        // Not checked: the store was not empty.
        let stored = ignored_empty_check(flags(Some(0), false), &answer(4, true));
        assert!(stored.is_some_and(|m| m.contains("stored v4")));
        let dry = ignored_empty_check(flags(Some(0), true), &answer(3, false));
        assert!(dry.is_some_and(|m| m.contains("v3 is current")));
        let unchanged = ignored_empty_check(flags(Some(0), false), &answer(3, false));
        assert!(unchanged.is_some_and(|m| m.contains("v3 is current")));
        // No check asked, or another version: nothing to tell.
        assert_eq!(
            ignored_empty_check(flags(None, false), &answer(4, true)),
            None
        );
        assert_eq!(
            ignored_empty_check(flags(Some(3), false), &answer(4, true)),
            None
        );
    }

    fn entry(endpoint: &str, change: pb::diff_entry::Change, details: &[&str]) -> pb::DiffEntry {
        pb::DiffEntry {
            endpoint: endpoint.to_owned(),
            change: change as i32,
            details: details.iter().map(|d| (*d).to_owned()).collect(),
            defaults: Some(false),
        }
    }

    fn defaults_block(details: &[&str]) -> pb::DiffEntry {
        pb::DiffEntry {
            defaults: Some(true),
            ..entry("defaults", pb::diff_entry::Change::Modified, details)
        }
    }

    fn sample() -> Vec<pb::DiffEntry> {
        use pb::diff_entry::Change::{Added, Modified, Removed};
        vec![
            defaults_block(&["deadline: 15s -> 10s"]),
            entry("search", Added, &["max_attempts: 2"]),
            entry(
                "payments",
                Modified,
                &["max_attempts: 3 -> 4", "backoff.jitter: full -> none"],
            ),
            entry("legacy", Removed, &[]),
        ]
    }

    #[test]
    fn a_diff_marks_each_endpoint_and_indents_its_details() {
        let mut out = String::new();
        push_diff(&mut out, &sample());
        assert_eq!(
            out,
            "~ defaults\n    deadline: 15s -> 10s\n+ search\n    max_attempts: 2\n~ payments\n    max_attempts: 3 -> 4\n    backoff.jitter: full -> none\n- legacy\n"
        );
    }

    #[test]
    fn an_endpoint_named_defaults_is_shown_and_counted_as_an_endpoint() {
        use pb::diff_entry::Change::Added;
        let diff = [
            defaults_block(&["deadline: 15s -> 10s"]),
            entry("defaults", Added, &["max_attempts: 2"]),
        ];
        let mut out = String::new();
        push_diff(&mut out, &diff);
        assert_eq!(
            out,
            "~ defaults\n    deadline: 15s -> 10s\n+ endpoints.defaults\n    max_attempts: 2\n"
        );
        assert_eq!(
            summary(&diff),
            "+1 endpoint (endpoints.defaults), -0, 0 modified, defaults modified"
        );
        let response = pb::ApplyResponse {
            diff: diff.to_vec(),
            ..Default::default()
        };
        let json = change_json(&response, "p.yaml", false);
        let scopes: Vec<(&str, &str)> = json["diff"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["endpoint"].as_str().unwrap_or_default(),
                    e["scope"].as_str().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(scopes, [("defaults", "defaults"), ("defaults", "endpoint")]);
    }

    #[test]
    fn a_diff_is_summarised_like_history() {
        assert_eq!(
            summary(&sample()),
            "+1 endpoint (search), -1 (legacy), 1 modified (payments), defaults modified"
        );
        assert_eq!(summary(&[]), "no changes");
    }

    #[test]
    fn wire_diagnostics_print_like_validate() {
        let d = pb::Diagnostic {
            severity: pb::diagnostic::Severity::Warning as i32,
            line: 4,
            column: 7,
            path: "endpoints.payments.retry_on.http_status".to_owned(),
            message: "404 does not get better by repetition".to_owned(),
        };
        let mut out = String::new();
        push_diagnostics(&mut out, "p.yaml", &[diagnostic(&d)]);
        assert_eq!(
            out,
            "p.yaml:4:7: warning: endpoints.payments.retry_on.http_status: 404 does not get better by repetition\n"
        );
        let unspecified = pb::Diagnostic { severity: 0, ..d };
        assert!(diagnostic(&unspecified).is_error());
    }

    #[test]
    fn a_change_as_json_names_its_kind_and_its_warnings() {
        let response = pb::ApplyResponse {
            version: 7,
            content_hash: "ab".to_owned(),
            changed: true,
            diff: vec![entry("search", pb::diff_entry::Change::Added, &[])],
            warnings: vec![pb::Diagnostic {
                severity: pb::diagnostic::Severity::Warning as i32,
                line: 1,
                column: 2,
                path: "p".to_owned(),
                message: "m".to_owned(),
            }],
            new_content_hash: "ab".to_owned(),
            would_change: true,
        };
        assert_eq!(
            change_json(&response, "f.yaml", false),
            json!({
                "version": 7, "content_hash": "ab", "changed": true, "dry_run": false,
                "would_change": true, "new_content_hash": "ab",
                "diff": [{"endpoint": "search", "scope": "endpoint", "change": "added", "details": []}],
                "warnings": [{"file": "f.yaml", "line": 1, "column": 2, "severity": "warning",
                              "path": "p", "message": "m"}]
            })
        );
    }

    #[test]
    fn a_dry_run_answered_by_an_older_control_plane_reads_would_change_from_the_diff() {
        let response = pb::ApplyResponse {
            version: 6,
            content_hash: "ab".to_owned(),
            diff: vec![entry("search", pb::diff_entry::Change::Added, &[])],
            ..Default::default()
        };
        let json = change_json(&response, "f.yaml", true);
        assert_eq!(
            (&json["would_change"], &json["new_content_hash"]),
            (&Value::Bool(true), &Value::Null)
        );
        let same = pb::ApplyResponse {
            diff: Vec::new(),
            ..response
        };
        assert_eq!(change_json(&same, "f.yaml", true)["would_change"], false);
    }
}
