//! `retryplane status`: every agent the server knows, and how far the fleet is on the current
//! version.
//!
//! Text: a table (`AGENT SERVICE LABELS PEER STATE SINCE APPLIED LAST ERROR LAST-SEEN`, sorted by
//! service then agent id; `LABELS` is `k=v,…` sorted by key; `SINCE` is when the agent's current
//! (or last) stream started; `LAST` is the agent's last answer, `ack v7` or `nack v8`; `ERROR`
//! its NACK's reason on one line, cut to [`ERROR_COLUMNS`] columns: `--output json` has it
//! whole, as the server keeps it, up to 1,024 bytes), then one summary
//! line, `v7: 998 acked, 2 nacked, 0 pending` (and `, 3 disconnected` when some are; `no
//! version yet: …` before the first version is stored):
//!
//! - nacked: agents whose last answer is a NACK of the current version (connected or not),
//!   even one whose Hello named the current version's number (with other content: a control
//!   plane started on a new store);
//! - acked: the other connected agents that run the current version (none while no version
//!   is published);
//! - pending: the other connected agents (the push is on its way, or unanswered);
//! - disconnected: the other agents the server still remembers.
//!
//! In file mode, when the policy file's last read was not applied (a save with errors, one that
//! removes every endpoint, a file that cannot be read), one line says so, and why: `file:
//! /etc/retryplane/policies.yaml not applied (read 2026-12-06T22:14:51Z): 1 error(s), first:
//! 3:28: error: endpoints.payments.max_attempts: …; v2 is served` (`no version is served`
//! before the first one).
//!
//! While the control plane's checks of its version store fail (its file deleted or replaced,
//! not writable, not readable), one line says so, and why: `store: failing since
//! 2026-12-07T19:40:01Z (checked 2026-12-07T19:41:01Z): the store file … was deleted or
//! replaced …; v7 is served from memory`.
//!
//! Then one line per endpoint whose retry ratio over the last 5 minutes is past its threshold
//! (SPEC §4): `FleetStatus` names them and, only when it names any, `Stats` gives the figures:
//! `alert: payments (checkout) retry ratio 7.2% > 5.0% over 5m`, followed by `, last minute
//! 0.8%` once the last minute had calls and is back under the threshold or under half the
//! 5-minute ratio:
//! a fix at work shows there minutes before the 5-minute ratio falls.
//!
//! Under a control plane started less than a minute ago, a note on stderr says that agents that
//! ran before its start may be missing until they reconnect (its fleet records are in memory).
//!
//! JSON: `{current_version, started_unix_ms, started, summary: {acked, nacked, pending, disconnected}, agents: [...],
//! alerts: [...], store, policy_file}`, `store` being `{failing, failing_since_unix_ms,
//! failing_since, checked_unix_ms, checked, problem}` (`problem` `null` while the checks pass;
//! `store` `null` from a control plane older than its checks), `policy_file` being `null` in
//! API mode (and in file mode until a read is judged), else `{path, served, read_unix_ms, read,
//! problem}` (`problem` `null` when served), each agent with every field of the wire message (`labels` an object; times
//! in Unix milliseconds and, for people, RFC 3339 UTC; empty strings as `null`), each alert as
//! `retryplane stats` prints it (`{service, endpoint, ratio, threshold, window_seconds,
//! since_unix_ms, since}`).
//!
//! A server without `Stats` (UNIMPLEMENTED) gives no alert lines and `"alerts": null`; any
//! other `Stats` failure does the same with a note on stderr: the fleet's state is still worth
//! printing, and the exit code is the fleet call's.

use anyhow::Context as _;
use serde_json::{Value, json};

use tonic::Code;

use super::client::Client;
use super::metrics;
use super::time::rfc3339_or_dash;
use super::{Server, ServerArgs, block_on, json::non_empty, status_line};
use crate::output::{self, Format};
use crate::{Outcome, Report};
use retryplane_proto::pb;

/// `retryplane status` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to show, checked once.
#[derive(Debug)]
pub struct Settings {
    /// Output format.
    pub format: Format,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        Ok(Self {
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Calls `FleetStatus` and `Stats`, and prints the fleet and its alerts.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let mut response = match client.fleet_status().await {
            Ok(response) => response,
            Err(status) => return Ok(super::failed(&status, String::new())),
        };
        response
            .agents
            .sort_by(|a, b| (&a.service, &a.agent_id).cmp(&(&b.service, &b.agent_id)));
        // The fleet answer names the alerting endpoints; the figures of their alerts come
        // from `Stats`, asked only when there is one and only for the firing series (a full
        // `Stats` of a large fleet is big).
        let stats = if response.alerting_endpoints.is_empty() {
            Ok(pb::StatsResponse::default())
        } else {
            client
                .stats(pb::StatsRequest {
                    firing_only: true,
                    // The alert lines need the series only, not every endpoint's totals.
                    series_only: true,
                    ..Default::default()
                })
                .await
        };
        let stats = match stats {
            Ok(stats) => Some(stats),
            Err(status) if status.code() == Code::Unimplemented => None,
            Err(status) => {
                output::note(format_args!(
                    "retryplane: note: no alerts shown: {}",
                    status_line(&status)
                ));
                None
            }
        };
        let counts = Counts::of(response.current_version, &response.agents);
        let stdout = match settings.format {
            Format::Json => output::json(&status_json(&response, counts, stats.as_ref()))?,
            Format::Text => status_text(&response, counts, stats.as_ref()),
        };
        // On stderr (stdout's lines stay as scripts read them), in either format, and after
        // stdout: at a terminal it comes under the counts it speaks of.
        let stdout = match just_started(response.started_unix_ms, super::time::now_unix_ms()) {
            Some(note) => {
                output::stdout_then_notes(&stdout, &[format!("retryplane: {note}")])
                    .context("cannot write to stdout")?;
                String::new()
            }
            None => stdout,
        };
        Ok(Report {
            stdout,
            outcome: Outcome::Success,
        })
    })
}

/// Where the fleet is on the current version; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    acked: usize,
    nacked: usize,
    pending: usize,
    disconnected: usize,
}

impl Counts {
    fn of(current: u64, agents: &[pb::AgentStatus]) -> Self {
        let mut counts = Counts::default();
        for a in agents {
            let nacked_current = a.last_response == "nack" && a.last_response_version == current;
            // A NACK of the current version first: an agent whose Hello named the current
            // version's number with other content (a control plane started on a new store)
            // was sent this version and refused it, so it does not run it.
            if nacked_current {
                counts.nacked += 1;
            } else if a.connected && current != 0 && a.applied_version == current {
                // (With nothing published yet, version 0, there is nothing to have acked: an
                // agent that has applied nothing waits for the first push.)
                counts.acked += 1;
            } else if a.connected {
                counts.pending += 1;
            } else {
                counts.disconnected += 1;
            }
        }
        counts
    }

    /// `v7: 998 acked, 2 nacked, 0 pending[, 3 disconnected]`; `no version yet: …` when none
    /// is stored (an API-mode store before its first `apply`), never a `v0` that does not exist.
    fn line(self, current: u64) -> String {
        let version = match current {
            0 => "no version yet".to_owned(),
            v => format!("v{v}"),
        };
        let mut line = format!(
            "{version}: {} acked, {} nacked, {} pending",
            self.acked, self.nacked, self.pending
        );
        if self.disconnected > 0 {
            line.push_str(&format!(", {} disconnected", self.disconnected));
        }
        line
    }
}

/// The agents' table, the summary line, the policy file's when it was not applied, then one
/// line per alert.
fn status_text(
    response: &pb::FleetStatusResponse,
    counts: Counts,
    stats: Option<&pb::StatsResponse>,
) -> String {
    let mut out = String::new();
    if !response.agents.is_empty() {
        table(&mut out, &response.agents);
    }
    out.push_str(&counts.line(response.current_version));
    out.push('\n');
    if let Some(store) = response.store.as_ref().filter(|s| s.failing) {
        let served = match response.current_version {
            0 => "no version is served".to_owned(),
            v => format!("v{v} is served from memory"),
        };
        out.push_str(&format!(
            "store: failing since {} (checked {}): {}; {served}\n",
            rfc3339_or_dash(store.failing_since_unix_ms),
            rfc3339_or_dash(store.checked_unix_ms),
            output::spaced(&store.problem),
        ));
    }
    if let Some(file) = response.policy_file.as_ref().filter(|f| !f.served) {
        let serving = match response.current_version {
            0 => "no version is served".to_owned(),
            v => format!("v{v} is served"),
        };
        out.push_str(&format!(
            "file: {} not applied (read {}): {}; {serving}\n",
            output::name(&file.path),
            rfc3339_or_dash(file.read_unix_ms),
            output::spaced(&file.problem),
        ));
    }
    for line in stats.map(metrics::alert_lines).unwrap_or_default() {
        out.push_str("alert: ");
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// How long after a control plane's start `status` says its fleet may be incomplete: agents
/// that lost it reconnect within their backoff, at most 30 s by default (and its jitter).
const RECONNECT_WINDOW_MS: u64 = 60_000;

/// The note under the summary of a control plane that started (at `started`, Unix ms) less
/// than [`RECONNECT_WINDOW_MS`] before `now`: its fleet records are in memory, so agents that
/// ran before its start are missing until they reconnect. `None` otherwise (and from a
/// control plane that does not say when it started).
fn just_started(started: u64, now: u64) -> Option<String> {
    let up = now.checked_sub(started).filter(|_| started != 0)?;
    (up < RECONNECT_WINDOW_MS).then(|| {
        format!(
            "note: the control plane started {} s ago and lists agents as they connect again \
             (within their reconnect backoff, 30 s at most by default): agents that ran before \
             may be missing from these counts",
            up / 1000
        )
    })
}

/// The widest a NACK's reason is shown in the table.
pub const ERROR_COLUMNS: usize = 60;

fn table(out: &mut String, agents: &[pb::AgentStatus]) {
    let header = [
        "AGENT",
        "SERVICE",
        "LABELS",
        "PEER",
        "STATE",
        "SINCE",
        "APPLIED",
        "LAST",
        "ERROR",
        "LAST-SEEN",
    ];
    let mut rows = vec![header.map(str::to_owned).to_vec()];
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_owned()
        } else {
            s.to_owned()
        }
    };
    for a in agents {
        let last = match a.last_response.as_str() {
            "" => "-".to_owned(),
            answer => format!("{answer} v{}", a.last_response_version),
        };
        rows.push(vec![
            dash(&output::name(&a.agent_id)),
            dash(&output::name(&a.service)),
            dash(&labels_text(&a.labels)),
            dash(&output::name(&a.peer)),
            if a.connected {
                "connected"
            } else {
                "disconnected"
            }
            .to_owned(),
            rfc3339_or_dash(a.connected_since_unix_ms),
            match a.applied_version {
                0 => "-".to_owned(),
                v => format!("v{v}"),
            },
            last,
            // One line per agent, whatever the agent wrote, and no wider than a reason needs
            // to be told apart: one long reason made every row of the table as wide.
            dash(&output::cut(&output::spaced(&a.last_error), ERROR_COLUMNS)),
            rfc3339_or_dash(a.last_seen_unix_ms),
        ]);
    }
    output::table(out, "", &[], &rows);
}

/// `k=v,k2=v2`, sorted by key, each on one line whatever the agent sent: runs of white space
/// become one space and other control characters are escaped, so an agent's label cannot move
/// the cursor or change colours in the admin's terminal.
fn labels_text(labels: &std::collections::HashMap<String, String>) -> String {
    let one_line = output::spaced;
    let mut pairs: Vec<_> = labels.iter().collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", one_line(k), one_line(v)))
        .collect::<Vec<_>>()
        .join(",")
}

fn status_json(
    response: &pb::FleetStatusResponse,
    counts: Counts,
    stats: Option<&pb::StatsResponse>,
) -> Value {
    let time = |ms: u64| {
        if ms == 0 {
            Value::Null
        } else {
            json!(rfc3339_or_dash(ms))
        }
    };
    let agents: Vec<Value> = response
        .agents
        .iter()
        .map(|a| {
            let labels: serde_json::Map<String, Value> = a
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            json!({
                "agent_id": a.agent_id,
                "service": a.service,
                "labels": labels,
                "peer": non_empty(&a.peer),
                "agent_version": non_empty(&a.agent_version),
                "connected": a.connected,
                "connected_since_unix_ms": a.connected_since_unix_ms,
                "connected_since": time(a.connected_since_unix_ms),
                "last_seen_unix_ms": a.last_seen_unix_ms,
                "last_seen": time(a.last_seen_unix_ms),
                "applied_version": a.applied_version,
                "last_response": non_empty(&a.last_response),
                "last_response_version": a.last_response_version,
                "last_error": non_empty(&a.last_error),
                "token": non_empty(&a.token),
            })
        })
        .collect();
    json!({
        "current_version": response.current_version,
        "started_unix_ms": response.started_unix_ms,
        "started": time(response.started_unix_ms),
        "summary": {
            "acked": counts.acked,
            "nacked": counts.nacked,
            "pending": counts.pending,
            "disconnected": counts.disconnected,
        },
        "agents": agents,
        "alerts": stats.map_or(Value::Null, metrics::alerts_json),
        "store": response.store.as_ref().map_or(Value::Null, |s| json!({
            "failing": s.failing,
            "failing_since_unix_ms": s.failing_since_unix_ms,
            "failing_since": time(s.failing_since_unix_ms),
            "checked_unix_ms": s.checked_unix_ms,
            "checked": time(s.checked_unix_ms),
            "problem": non_empty(&s.problem),
        })),
        "policy_file": response.policy_file.as_ref().map_or(Value::Null, |f| json!({
            "path": f.path,
            "served": f.served,
            "read_unix_ms": f.read_unix_ms,
            "read": time(f.read_unix_ms),
            "problem": non_empty(&f.problem),
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_control_plane_started_less_than_a_minute_ago_says_its_fleet_may_be_incomplete() {
        let started = 1_764_473_825_000;
        let note = just_started(started, started + 12_345).unwrap();
        assert!(
            note.starts_with("note: the control plane started 12 s ago and lists agents"),
            "{note}"
        );
        assert!(just_started(started, started + 59_999).is_some());
        assert_eq!(just_started(started, started + 60_000), None);
        // From a control plane that does not say, or a clock behind its own.
        assert_eq!(just_started(0, started), None);
        assert_eq!(just_started(started, started - 1), None);
    }

    fn agent(id: &str, connected: bool, applied: u64, last: &str, last_v: u64) -> pb::AgentStatus {
        pb::AgentStatus {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            peer: "127.0.0.1:50000".to_owned(),
            connected,
            applied_version: applied,
            last_response: last.to_owned(),
            last_response_version: last_v,
            last_seen_unix_ms: 1_764_473_825_000,
            ..Default::default()
        }
    }

    #[test]
    fn the_summary_counts_acked_nacked_pending_and_disconnected_agents() {
        let agents = vec![
            agent("a", true, 7, "ack", 7),
            agent("b", true, 7, "ack", 7),
            agent("c", true, 6, "nack", 7),
            agent("d", false, 6, "nack", 7),
            agent("e", true, 6, "ack", 6),
            agent("f", true, 6, "nack", 6),
            agent("g", false, 7, "ack", 7),
        ];
        let counts = Counts::of(7, &agents);
        assert_eq!(
            counts,
            Counts {
                acked: 2,
                nacked: 2,
                pending: 2,
                disconnected: 1
            }
        );
        assert_eq!(
            counts.line(7),
            "v7: 2 acked, 2 nacked, 2 pending, 1 disconnected"
        );
        let all_good = Counts::of(7, &agents[..2]);
        assert_eq!(all_good.line(7), "v7: 2 acked, 0 nacked, 0 pending");
    }

    #[test]
    fn an_agent_that_nacked_the_current_version_is_nacked_whatever_version_it_named() {
        // Its Hello named v7 with another content hash (a store started afresh): v7 was sent
        // and refused, so the agent does not run this v7.
        let agents = vec![
            agent("a", true, 7, "nack", 7),
            agent("b", true, 7, "ack", 7),
        ];
        assert_eq!(
            Counts::of(7, &agents).line(7),
            "v7: 1 acked, 1 nacked, 0 pending"
        );
    }

    #[test]
    fn with_no_version_published_a_connected_agent_is_pending_not_acked() {
        let agents = vec![agent("a", true, 0, "", 0), agent("b", false, 0, "", 0)];
        assert_eq!(
            Counts::of(0, &agents),
            Counts {
                acked: 0,
                nacked: 0,
                pending: 1,
                disconnected: 1
            }
        );
        assert_eq!(
            Counts::of(0, &agents).line(0),
            "no version yet: 0 acked, 0 nacked, 1 pending, 1 disconnected"
        );
    }

    #[test]
    fn a_long_reason_is_cut_in_the_table_and_whole_in_json() {
        let mut nacking = agent("c", true, 6, "nack", 7);
        nacking.last_error = format!("endpoints.payments: {}", "x".repeat(1_000));
        let mut out = String::new();
        table(&mut out, &[nacking.clone(), agent("z", false, 0, "", 0)]);
        let cut = format!("endpoints.payments: {}…", "x".repeat(ERROR_COLUMNS - 21));
        assert!(
            out.lines()
                .nth(1)
                .is_some_and(|l| l.contains(&format!("nack v7  {cut}  2025"))),
            "{out}"
        );
        assert!(out.lines().all(|l| l.len() < 250), "{out}");
        let response = pb::FleetStatusResponse {
            current_version: 7,
            agents: vec![nacking],
            ..Default::default()
        };
        let value = status_json(&response, Counts::of(7, &response.agents), None);
        assert_eq!(
            value["agents"][0]["last_error"].as_str().map(str::len),
            Some(1_020)
        );
    }

    #[test]
    fn the_fleet_table_shows_one_line_per_agent() {
        let mut nacking = agent("c", true, 6, "nack", 7);
        nacking.last_error = "endpoints.payments:\n  bad".to_owned();
        let mut labelled = agent("a", true, 7, "ack", 7);
        labelled.labels = [("zone", "eu-1\u{1b}[31m"), ("pod", "checkout\n7f")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .into();
        labelled.connected_since_unix_ms = 1_764_473_000_000;
        let mut out = String::new();
        table(&mut out, &[labelled, nacking, agent("z", false, 0, "", 0)]);
        assert_eq!(
            out,
            "\
AGENT  SERVICE   LABELS                               PEER             STATE         SINCE                 APPLIED  LAST     ERROR                    LAST-SEEN
a      checkout  pod=checkout 7f,zone=eu-1\\u{1b}[31m  127.0.0.1:50000  connected     2025-11-30T03:23:20Z  v7       ack v7   -                        2025-11-30T03:37:05Z
c      checkout  -                                    127.0.0.1:50000  connected     -                     v6       nack v7  endpoints.payments: bad  2025-11-30T03:37:05Z
z      checkout  -                                    127.0.0.1:50000  disconnected  -                     -        -        -                        2025-11-30T03:37:05Z
"
        );
    }

    #[test]
    fn agent_ids_services_and_errors_cannot_drive_the_terminal() {
        let mut a = agent("a\u{1b}[2J", true, 6, "nack", 7);
        a.service = "svc\u{1b}]0;title\u{7}".to_owned();
        a.last_error = "bad\u{1b}[31m red\r\n  next".to_owned();
        let mut out = String::new();
        table(&mut out, &[a]);
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}') && !out.contains('\r'),
            "{out}"
        );
        let row = out.lines().nth(1).unwrap_or_default();
        assert!(
            row.starts_with(r#""a\u{1b}[2J"  "svc\u{1b}]0;title\u{7}"  -  "#),
            "{out}"
        );
        assert!(row.contains("  bad\\u{1b}[31m red next  "), "{out}");
    }

    #[test]
    fn json_has_the_summary_and_every_agent_field() {
        let response = pb::FleetStatusResponse {
            current_version: 7,
            agents: vec![agent("a", true, 7, "ack", 7)],
            ..Default::default()
        };
        let value = status_json(&response, Counts::of(7, &response.agents), None);
        assert_eq!(
            value["summary"],
            json!({"acked": 1, "nacked": 0, "pending": 0, "disconnected": 0})
        );
        assert_eq!(
            value["agents"][0]["last_seen"],
            json!("2025-11-30T03:37:05Z")
        );
        assert_eq!(value["agents"][0]["connected_since"], Value::Null);
        assert_eq!(value["agents"][0]["last_error"], Value::Null);
        assert_eq!(value["agents"][0]["labels"], json!({}));
        assert_eq!(value["alerts"], Value::Null, "no Stats, no alerts");
    }

    #[test]
    fn a_policy_file_not_applied_is_a_line_of_text_and_an_object_in_json() {
        let refused = pb::PolicyFileRead {
            path: "/etc/rp/policies.yaml".to_owned(),
            served: false,
            read_unix_ms: 1_764_473_825_000,
            problem: "1 error(s), first: 3:28: error: endpoints.p.max_attempts: bad\nnext"
                .to_owned(),
        };
        let mut response = pb::FleetStatusResponse {
            current_version: 2,
            policy_file: Some(refused.clone()),
            ..Default::default()
        };
        assert_eq!(
            status_text(&response, Counts::default(), None),
            "v2: 0 acked, 0 nacked, 0 pending\nfile: /etc/rp/policies.yaml not applied (read \
             2025-11-30T03:37:05Z): 1 error(s), first: 3:28: error: endpoints.p.max_attempts: \
             bad next; v2 is served\n"
        );
        let value = status_json(&response, Counts::default(), None);
        assert_eq!(
            value["policy_file"],
            json!({
                "path": "/etc/rp/policies.yaml",
                "served": false,
                "read_unix_ms": 1_764_473_825_000_u64,
                "read": "2025-11-30T03:37:05Z",
                "problem": "1 error(s), first: 3:28: error: endpoints.p.max_attempts: bad\nnext",
            })
        );
        response.current_version = 0;
        assert!(
            status_text(&response, Counts::default(), None)
                .ends_with("bad next; no version is served\n")
        );
        response.current_version = 2;
        // Served: no line, and no problem in JSON.
        response.policy_file = Some(pb::PolicyFileRead {
            served: true,
            problem: String::new(),
            ..refused
        });
        assert_eq!(
            status_text(&response, Counts::default(), None),
            "v2: 0 acked, 0 nacked, 0 pending\n"
        );
        let value = status_json(&response, Counts::default(), None);
        assert_eq!(value["policy_file"]["served"], json!(true));
        assert_eq!(value["policy_file"]["problem"], Value::Null);
        // API mode: none.
        response.policy_file = None;
        assert_eq!(
            status_json(&response, Counts::default(), None)["policy_file"],
            Value::Null
        );
    }

    #[test]
    fn a_failing_store_is_a_line_of_text_and_an_object_in_json() {
        let failing = pb::StoreState {
            checked_unix_ms: 1_764_473_885_000,
            failing: true,
            failing_since_unix_ms: 1_764_473_825_000,
            problem: "the store file /d/retryplane.redb was deleted\nor replaced".to_owned(),
        };
        let mut response = pb::FleetStatusResponse {
            current_version: 2,
            store: Some(failing.clone()),
            ..Default::default()
        };
        assert_eq!(
            status_text(&response, Counts::default(), None),
            "v2: 0 acked, 0 nacked, 0 pending\nstore: failing since 2025-11-30T03:37:05Z \
             (checked 2025-11-30T03:38:05Z): the store file /d/retryplane.redb was deleted or \
             replaced; v2 is served from memory\n"
        );
        assert_eq!(
            status_json(&response, Counts::default(), None)["store"],
            json!({
                "failing": true,
                "failing_since_unix_ms": 1_764_473_825_000_u64,
                "failing_since": "2025-11-30T03:37:05Z",
                "checked_unix_ms": 1_764_473_885_000_u64,
                "checked": "2025-11-30T03:38:05Z",
                "problem": "the store file /d/retryplane.redb was deleted\nor replaced",
            })
        );
        response.current_version = 0;
        assert!(
            status_text(&response, Counts::default(), None)
                .ends_with("or replaced; no version is served\n")
        );
        // Passing: no line, and no problem in JSON.
        response.store = Some(pb::StoreState {
            checked_unix_ms: 1_764_473_885_000,
            ..Default::default()
        });
        assert_eq!(
            status_text(&response, Counts::default(), None),
            "no version yet: 0 acked, 0 nacked, 0 pending\n"
        );
        let value = status_json(&response, Counts::default(), None);
        assert_eq!(value["store"]["failing"], json!(false));
        assert_eq!(value["store"]["problem"], Value::Null);
        assert_eq!(value["store"]["failing_since"], Value::Null);
        // An older control plane: none.
        response.store = None;
        assert_eq!(
            status_json(&response, Counts::default(), None)["store"],
            Value::Null
        );
    }

    #[test]
    fn text_and_json_list_the_firing_alerts() {
        use crate::admin::metrics::tests::{alerting, counters, series};
        let response = pb::FleetStatusResponse {
            current_version: 7,
            agents: vec![],
            ..Default::default()
        };
        let stats = pb::StatsResponse {
            series: vec![
                series("checkout", "inventory", counters(100, 1, 99)),
                alerting(
                    series("checkout", "payments", counters(1000, 72, 900)),
                    0.072,
                ),
            ],
            ..Default::default()
        };
        let value = status_json(&response, Counts::default(), Some(&stats));
        assert_eq!(value["alerts"].as_array().map(Vec::len), Some(1));
        assert_eq!(value["alerts"][0]["endpoint"], "payments");
        assert_eq!(value["alerts"][0]["ratio"], json!(0.072));
        assert_eq!(
            status_text(&response, Counts::default(), Some(&stats)),
            "v7: 0 acked, 0 nacked, 0 pending\nalert: payments (checkout) retry ratio 7.2% > 5.0% over 5m\n"
        );
        assert_eq!(
            status_text(&response, Counts::default(), None),
            "v7: 0 acked, 0 nacked, 0 pending\n"
        );
        let quiet = status_json(
            &response,
            Counts::default(),
            Some(&pb::StatsResponse::default()),
        );
        assert_eq!(quiet["alerts"], json!([]));
    }
}
