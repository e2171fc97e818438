//! The admin commands (`apply`, `diff`, `get`, `history`, `rollback`, `status`) run as the real
//! `retryplane` binary against a real control plane on `127.0.0.1:0`, started in this process
//! with a temporary data directory.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use assert_cmd::Command;
use predicates::prelude::*;
use retryplane_proto::pb;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use support::{TestServer, cli, dead_server, json_of, stdout_of};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
const V2: &str = "\
version: 1
endpoints:
  payments:
    max_attempts: 4
  search: {}
";
/// `max_attempts: 0` at 4:19, and a warning (404 is not worth retrying) at 6:27.
const INVALID: &str = "\
version: 1
endpoints:
  payments:
    max_attempts: 0
    retry_on:
      http_status: [503, 404]
";
const TOKENS: &str = "\
tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
";

/// API mode with an empty store, or file mode on `V1`; `tokens` turns authentication on.
fn test_server(api_mode: bool, tokens: Option<&str>) -> TestServer {
    let file = (!api_mode).then_some(V1);
    TestServer::start(file, tokens, |cfg| cfg.api_mode = api_mode)
}

/// Opens an agent stream that says Hello with `last_applied_version` and then stays open
/// (until the returned sender is dropped). Once `connect` returns the server has
/// registered the agent, so `status` sees it.
fn raw_agent(
    server: &TestServer,
    id: &str,
    last_applied_version: u64,
) -> mpsc::Sender<pb::AgentMessage> {
    let addr = server.running().agent_addr();
    server.runtime.block_on(async {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(4);
        let hello = pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            last_applied_version,
            ..Default::default()
        };
        tx.send(pb::AgentMessage {
            kind: Some(pb::agent_message::Kind::Hello(hello)),
        })
        .await
        .unwrap();
        let inbound = AgentServiceClient::new(channel)
            .connect(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        // Keep reading (and dropping) snapshots so the stream never backs up.
        tokio::spawn(async move {
            let mut inbound = inbound;
            while let Ok(Some(_)) = inbound.message().await {}
        });
        tx
    })
}

#[test]
fn an_endpoint_named_defaults_is_told_apart_from_the_defaults_block() {
    let server = test_server(true, None);
    server.write("v1.yaml", V1);
    server.write(
        "v2.yaml",
        "version: 1\ndefaults: {deadline: 20s}\nendpoints:\n  payments:\n    max_attempts: 3\n  defaults: {max_attempts: 2}\n",
    );
    server.retryplane(&["apply", "v1.yaml"]).assert().code(0);
    server
        .retryplane(&["diff", "v2.yaml"])
        .assert()
        .code(0)
        .stdout(
            "~ defaults\n    deadline: 15s (inherited) -> 20s\n+ endpoints.defaults\n    max_attempts: 2\n",
        );
    let json = server.json(&["apply", "v2.yaml"]);
    let scopes: Vec<(&str, &str, &str)> = json["diff"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["endpoint"].as_str().unwrap(),
                e["scope"].as_str().unwrap(),
                e["change"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        scopes,
        [
            ("defaults", "defaults", "modified"),
            ("defaults", "endpoint", "added")
        ]
    );
    // The stored summary counts the endpoint as one.
    let history = server.history();
    assert_eq!(
        history[0]["summary"],
        "+1 endpoint (endpoints.defaults), -0, 0 modified, defaults modified"
    );
}

#[test]
fn apply_get_history_diff_rollback_and_status_work_against_a_real_server() {
    let server = test_server(true, None);
    server.write("v1.yaml", V1);
    server.write("v2.yaml", V2);

    // An empty store: everything is new.
    server
        .retryplane(&["diff", "v1.yaml"])
        .assert()
        .code(0)
        .stdout("+ payments\n    max_attempts: 3\n");
    server
        .retryplane(&["diff", "v1.yaml", "--exit-code"])
        .assert()
        .code(1);

    // `--expected-version 0`: only while the store is empty (the first of two racing seeds).
    let applied = server
        .retryplane(&["apply", "v1.yaml", "--expected-version", "0"])
        .assert()
        .code(0);
    let out = stdout_of(&applied);
    assert!(out.starts_with("+ payments\n"), "{out}");
    assert!(
        out.ends_with("…)\n") && out.contains("applied v1 (sha256 "),
        "{out}"
    );
    server
        .retryplane(&["apply", "v1.yaml"])
        .assert()
        .code(0)
        .stdout("no changes (v1)\n");

    // A dry run stores nothing.
    server
        .retryplane(&["apply", "v2.yaml", "--dry-run"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains(
            "~ payments\n    max_attempts: 3 -> 4\n",
        ))
        .stdout(predicate::str::contains("+ search\n"))
        .stdout(predicate::str::ends_with(
            "dry run: would change v1: +1 endpoint (search), -0, 1 modified (payments)\n",
        ));
    let got = server.retryplane(&["get"]).assert().code(0);
    assert!(stdout_of(&got).contains("max_attempts: 3"));

    server
        .retryplane(&["apply", "v2.yaml", "--expected-version", "0"])
        .assert()
        .code(1)
        .stdout("")
        .stderr(predicate::str::contains(
            "ABORTED: version conflict: expected an empty store (no version yet), \
             but the current version is 1",
        ));

    // Optimistic concurrency: a stale expected version is refused (exit 1).
    server
        .retryplane(&["apply", "v2.yaml", "--expected-version", "7"])
        .assert()
        .code(1)
        .stdout("")
        .stderr(predicate::str::contains("retryplane: error: ABORTED: "));
    server
        .retryplane(&["apply", "v2.yaml", "--expected-version", "1"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("applied v2 (sha256 "));
    server
        .retryplane(&["diff", "v2.yaml", "--exit-code"])
        .assert()
        .code(0)
        .stdout("");
    // A file that cannot be compared: exit 1 as with `apply`, but 2 with `--exit-code`, where
    // 1 says "differs".
    server.write(
        "bad.yaml",
        "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n",
    );
    server.retryplane(&["diff", "bad.yaml"]).assert().code(1);
    server
        .retryplane(&["diff", "bad.yaml", "--exit-code"])
        .assert()
        .code(2)
        .stdout(predicate::str::contains("bad.yaml:4:19: error: "))
        .stderr(predicate::str::contains("bad.yaml is invalid"));

    // get: the current version as a policy file, a past one, and JSON.
    let current = server.retryplane(&["get"]).assert().code(0);
    let current = stdout_of(&current);
    assert!(current.contains("max_attempts: 4"));
    // It names its version, so that an edit of it is applied only while it is current (a
    // version looked up after the get may be a newer one, whose changes the edit would undo).
    let first = current.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("# version 2 (sha256 ")
            && first.ends_with(&format!(") from {}", server.url)),
        "{current}"
    );
    assert!(
        current.lines().nth(1).is_some_and(|l| l
            .starts_with("# in file mode, edit the control plane's own policy file; ")
            && l.ends_with("retryplane apply FILE --expected-version 2")),
        "{current}"
    );
    let past = server
        .retryplane(&["get", "--version", "1"])
        .assert()
        .code(0);
    let past = stdout_of(&past);
    assert!(past.contains("max_attempts: 3"));
    assert!(past.starts_with("# version 1 (sha256 "), "{past}");
    assert!(!past.contains("--expected-version"), "{past}");
    // Without the header: the policies alone, the same whoever asks whom.
    let bare = server.retryplane(&["get", "--no-header"]).assert().code(0);
    let bare = stdout_of(&bare);
    assert!(!bare.contains('#'), "{bare}");
    assert_eq!(
        current.lines().skip(2).collect::<Vec<_>>(),
        bare.lines().collect::<Vec<_>>()
    );
    server
        .retryplane(&["get", "--no-header", "--output", "json"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--no-header is for --output yaml"));
    // What it printed, edited, is a policy file to apply with the version it names.
    server.write(
        "edited.yaml",
        &current.replace("max_attempts: 4", "max_attempts: 5"),
    );
    server
        .retryplane(&[
            "apply",
            "edited.yaml",
            "--expected-version",
            "2",
            "--dry-run",
        ])
        .assert()
        .code(0);
    let json = server.json(&["get"]);
    assert_eq!(json["version"], 2);
    assert_eq!(json["source"], "admin");
    assert_eq!(json["policies"]["endpoints"][0]["name"], "payments");
    assert_eq!(json["policies"]["endpoints"][0]["max_attempts"], 4);
    server
        .retryplane(&["get", "--version", "99"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("NOT_FOUND"));

    // history: newest first.
    let text = stdout_of(&server.retryplane(&["history"]).assert().code(0));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].starts_with("VERSION  CREATED"), "{text}");
    assert!(lines[1].trim_start().starts_with("2  20"), "{text}");
    // Each version names the endpoints it changed.
    assert!(
        lines[1].ends_with("+1 endpoint (search), -0, 1 modified (payments)"),
        "{text}"
    );
    let history = server.history();
    assert_eq!(history.as_array().unwrap().len(), 2);
    assert_eq!(history[0]["version"], 2);
    let v1_hash = history[1]["content_hash"].as_str().unwrap().to_owned();
    let limited = server.json(&["history", "--limit", "1"]);
    assert_eq!(limited.as_array().unwrap().len(), 1);

    // rollback --dry-run: what it would change, nothing stored.
    server
        .retryplane(&["rollback", "1", "--dry-run"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("- search\n"))
        .stdout(predicate::str::contains(
            "dry run: rolling back to v1 would change v2: ",
        ));
    let dry_run = server.json(&["rollback", "1", "--dry-run"]);
    let fields = [
        "version",
        "changed",
        "dry_run",
        "would_change",
        "rolled_back_to",
    ];
    assert_eq!(
        fields.map(|field| dry_run[field].to_string()),
        ["2", "false", "true", "true", "1"],
        "{dry_run}"
    );
    assert_eq!(dry_run["new_content_hash"], v1_hash.as_str());
    server
        .retryplane(&["rollback", "1", "--dry-run", "--expected-version", "1"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("ABORTED"));
    let still = server.history();
    assert_eq!(
        still.as_array().unwrap().len(),
        2,
        "a dry run stored nothing"
    );

    // rollback: v1's content as v3.
    server
        .retryplane(&["rollback", "1"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("- search\n"))
        .stdout(predicate::str::ends_with(format!(
            "rolled back to v1: now v3 (sha256 {}…)\n",
            &v1_hash[..12]
        )));
    let history = server.history();
    assert_eq!(history[0]["version"], 3);
    assert_eq!(history[0]["content_hash"], v1_hash.as_str());
    assert_eq!(history[0]["rolled_back_from"], 1);
    server
        .retryplane(&["rollback", "99"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("NOT_FOUND"));

    // diff --from/--to: what changed between stored versions (v3 has v1's content).
    server
        .retryplane(&["diff", "--from", "1"])
        .assert()
        .code(0)
        .stdout("");
    server
        .retryplane(&["diff", "--from", "1", "--to", "2", "--exit-code"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains(
            "~ payments\n    max_attempts: 3 -> 4\n",
        ));
    let between = server.json(&["diff", "--from", "2"]);
    assert_eq!(between["from"]["version"], 2, "{between}");
    assert_eq!(between["to"]["version"], 3, "{between}");
    assert_eq!(between["to"]["content_hash"], v1_hash.as_str());
    assert_eq!(between["differs"], true);
    assert_eq!(between["diff"][0]["endpoint"], "payments");
    server
        .retryplane(&["diff", "--from", "99", "--exit-code"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("NOT_FOUND"));
    server
        .retryplane(&["diff", "--from", "1", "--to", "99"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("NOT_FOUND"));
    for usage in [
        &["diff"][..],
        &["diff", "v2.yaml", "--from", "1"],
        &["diff", "--to", "1"],
    ] {
        server.retryplane(usage).assert().code(2);
    }

    // status: one agent resumes on the current version, one is still on v1.
    let _on_current = raw_agent(&server, "agent-a", 3);
    let _behind = raw_agent(&server, "agent-b", 1);
    let status = server.retryplane(&["status"]).assert().code(0);
    let text = stdout_of(&status);
    assert!(
        text.ends_with("v3: 1 acked, 0 nacked, 1 pending\n"),
        "{text}"
    );
    assert!(text.starts_with("AGENT "), "{text}");
    assert!(text.contains("agent-a  checkout"), "{text}");
    // A control plane that started moments ago says its fleet may be incomplete, under the
    // counts it speaks of (stdout and stderr in one file, as at a terminal).
    let stderr = String::from_utf8_lossy(&status.get_output().stderr).into_owned();
    assert!(
        stderr.starts_with("retryplane: note: the control plane started ")
            && stderr.contains("agents that ran before may be missing from these counts"),
        "{stderr}"
    );
    let (code, both) = server.retryplane_one_stream(&["status"]);
    assert_eq!(code, Some(0));
    let lines: Vec<&str> = both.lines().collect();
    assert_eq!(
        lines[lines.len() - 2],
        "v3: 1 acked, 0 nacked, 1 pending",
        "{both}"
    );
    assert!(
        lines[lines.len() - 1].starts_with("retryplane: note: the control plane started "),
        "{both}"
    );
    let json = server.json(&["status"]);
    assert!(json["started_unix_ms"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(json["current_version"], 3);
    assert_eq!(json["summary"]["acked"], 1);
    assert_eq!(json["summary"]["pending"], 1);
    assert_eq!(json["agents"].as_array().unwrap().len(), 2);
}

#[test]
fn history_reads_every_page_of_a_long_history() {
    use retryplane_server::store::{NewVersion, RedbStore, Source, VersionStore as _};

    const VERSIONS: u64 = 1_205;
    let server = TestServer::start(None, None, |cfg| {
        cfg.api_mode = true;
        // Stored before the server starts: more versions than one History answer holds.
        let store = RedbStore::open(&cfg.data_dir).unwrap();
        for i in 1..=VERSIONS {
            let yaml = format!("version: 1\nendpoints:\n  e{i}: {{}}\n");
            let policies = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
            let document = pb::PolicyDocument::from(policies.document().as_ref());
            let new = NewVersion {
                content_hash: retryplane_proto::convert::content_hash(&document),
                document,
                source: Source::Admin,
                author: None,
                summary: format!("v{i}"),
                created_unix_ms: i,
            };
            store.publish(new, None).unwrap();
        }
    });
    let versions = |args: &[&str]| -> Vec<u64> {
        let mut all = vec!["history", "--output", "json"];
        all.extend(args);
        let json = json_of(&server.retryplane(&all).assert().code(0));
        json.as_array()
            .unwrap()
            .iter()
            .map(|v| v["version"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(versions(&[]), (1..=VERSIONS).rev().collect::<Vec<_>>());
    assert_eq!(
        versions(&["--limit", "1100"]),
        (VERSIONS - 1_099..=VERSIONS).rev().collect::<Vec<_>>()
    );
    let text = stdout_of(&server.retryplane(&["history"]).assert().code(0));
    assert_eq!(
        text.lines().count() as u64,
        VERSIONS + 1,
        "header and every version"
    );
    // Read on from a version: those older than it, across pages too.
    assert_eq!(
        versions(&["--before", "1203", "--limit", "2"]),
        [1202, 1201]
    );
    assert_eq!(
        versions(&["--before", "1102"]),
        (1..=1101).rev().collect::<Vec<_>>()
    );
    assert!(versions(&["--before", "1"]).is_empty());
    server
        .retryplane(&["history", "--before", "1"])
        .assert()
        .code(0)
        .stdout("")
        .stderr(predicate::str::contains("no version older than 1"));
}

#[test]
fn an_invalid_file_prints_its_diagnostics_and_exits_1() {
    let server = test_server(true, None);
    server.write("bad.yaml", INVALID);
    let assert = server
        .retryplane(&["apply", "bad.yaml"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains(
            "retryplane: error: bad.yaml is invalid: 1 error, 1 warning",
        ));
    let out = stdout_of(&assert);
    assert!(
        out.starts_with("bad.yaml:4:19: error: endpoints.payments.max_attempts: "),
        "{out}"
    );
    assert!(
        out.contains("bad.yaml:6:"),
        "the warning is printed too: {out}"
    );
    let json = json_of(
        &server
            .retryplane(&["diff", "bad.yaml", "--output", "json"])
            .assert()
            .code(1),
    );
    assert_eq!(json[0]["file"], "bad.yaml");
    assert_eq!(json[0]["severity"], "error");
    assert_eq!(json[0]["line"], 4);
    // Nothing was stored.
    server
        .retryplane(&["get"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("NOT_FOUND"));
}

#[test]
fn apply_of_a_file_too_large_for_agents_is_refused_here_and_sends_nothing() {
    let server = test_server(true, None);
    let yaml = support::too_large_for_agents();
    server.write("big.yaml", &yaml);
    for command in ["apply", "diff"] {
        let assert = server
            .retryplane(&[command, "big.yaml"])
            .assert()
            .code(1)
            .stderr(predicate::str::contains(
                "big.yaml is invalid: 1 error, 0 warnings; nothing was sent to the server",
            ));
        let out = stdout_of(&assert);
        assert!(
            out.starts_with("big.yaml:1:1: error: <root>: the policies encode to "),
            "{command}: {out}"
        );
    }
    server
        .retryplane(&["get"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("NOT_FOUND"));
}

#[test]
fn apply_of_a_file_with_many_problems_prints_every_one_like_validate_and_exits_1() {
    let server = test_server(true, None);
    let mut bad = String::from("version: 1\nendpoints:\n");
    for i in 0..200 {
        bad.push_str(&format!("  checkout-service-{i:04}: {{max_attempts: 0}}\n"));
    }
    server.write("bad.yaml", &bad);
    let validate = server
        .retryplane_here(&["validate", "bad.yaml"])
        .assert()
        .code(1);
    let every_problem = stdout_of(&validate);
    assert_eq!(every_problem.lines().count(), 200, "{every_problem}");
    for command in ["apply", "diff"] {
        let assert = server
            .retryplane(&[command, "bad.yaml"])
            .assert()
            .code(1)
            .stderr(predicate::str::contains(
                "retryplane: error: bad.yaml is invalid: 200 errors, 0 warnings",
            ));
        assert_eq!(stdout_of(&assert), every_problem, "{command}");
    }
    // Checked before any call: the same answer with no server to talk to.
    server
        .retryplane_here(&["apply", "bad.yaml", "--server", &dead_server()])
        .assert()
        .code(1)
        .stdout(every_problem);
    // Nothing was stored.
    server
        .retryplane(&["get"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("NOT_FOUND"));
}

/// A version whose policy file would pass 1 MiB (aliases written out) is printed with a
/// warning, and without its opening comment, which a note says.
#[test]
fn get_of_a_version_over_the_file_limit_says_its_comment_is_left_out() {
    let server = test_server(true, None);
    // One long path prefix, written once and named 1,500 times.
    let endpoints: String = (0..1_500)
        .map(|i| format!("  ep-{i:04}: {{routes: [{{match: {{path_prefix: *p}}}}]}}\n"))
        .collect();
    server.write(
        "big.yaml",
        &format!(
            "version: 1\nendpoints:\n  first:\n    routes: [{{match: {{path_prefix: &p /v1/{}}}}}]\n{endpoints}",
            "p".repeat(700)
        ),
    );
    server.retryplane(&["apply", "big.yaml"]).assert().code(0);
    let got = server.retryplane(&["get"]).assert().code(0);
    let stdout = stdout_of(&got);
    let stderr = String::from_utf8_lossy(&got.get_output().stderr).into_owned();
    assert!(stdout.starts_with("version: 1"), "{}", &stdout[..80]);
    assert!(stdout.len() > 1_048_576, "{}", stdout.len());
    assert!(
        stderr.contains("retryplane: note: the opening comment (version 1, sha256 "),
        "{stderr}"
    );
    assert!(stderr.contains("over the 1048576 bytes"), "{stderr}");
}

#[test]
fn file_mode_refuses_writes_naming_the_file() {
    let server = test_server(false, None);
    server.write("v2.yaml", V2);
    server
        .retryplane(&["apply", "v2.yaml"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("FAILED_PRECONDITION"))
        .stderr(predicate::str::contains("policies.yaml"));
    // Reading works, and so does a dry run.
    server
        .retryplane(&["get"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("max_attempts: 3"));
    server
        .retryplane(&["rollback", "1", "--dry-run"])
        .assert()
        .code(0)
        .stdout("dry run: no changes: v1 already has the content of v1\n");
    server
        .retryplane(&["diff", "--from", "1"])
        .assert()
        .code(0)
        .stdout("");
    server
        .retryplane(&["rollback", "1"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("FAILED_PRECONDITION"));
}

#[test]
fn the_token_is_sent_as_a_bearer_token_and_never_printed() {
    let server = test_server(true, Some(TOKENS));
    server
        .retryplane(&["history"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("UNAUTHENTICATED"));
    server
        .retryplane(&["history", "--token", "agent-secret-0123456789"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("PERMISSION_DENIED"))
        .stderr(predicate::str::contains("agent-secret").not());
    server.write("v1.yaml", V1);
    server
        .retryplane(&["apply", "v1.yaml"])
        .env("RETRYPLANE_TOKEN", "admin-secret-0123456789")
        .assert()
        .code(0)
        .stdout(predicate::str::contains("admin-secret").not());
    let history = json_of(
        &server
            .retryplane(&["history", "--output", "json"])
            .env("RETRYPLANE_TOKEN", "admin-secret-0123456789")
            .assert()
            .code(0),
    );
    assert_eq!(history[0]["author"], "alice");
    // A token read from a file or a variable often ends in a line break.
    server
        .retryplane(&["history"])
        .env("RETRYPLANE_TOKEN", "admin-secret-0123456789\n")
        .assert()
        .code(0);
    // An empty `--token` (`--token "$TOKEN"` with the variable unset) counts as not given: the
    // environment's token is sent.
    server
        .retryplane(&["history", "--token", ""])
        .env("RETRYPLANE_TOKEN", "admin-secret-0123456789")
        .assert()
        .code(0);
}

#[test]
fn an_empty_server_flag_counts_as_not_given_and_reads_retryplane_server() {
    let server = test_server(true, None);
    // `--server "$CP_URL"` with `CP_URL` unset, in a job that exports `RETRYPLANE_SERVER`:
    // the command reaches the control plane the variable names, not the default address.
    let out = server
        .retryplane_here(&["history", "--output", "json", "--server", ""])
        .env("RETRYPLANE_SERVER", &server.url)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let via_env: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let direct = server.history();
    assert_eq!(via_env, direct);
}

#[test]
fn what_get_prints_of_a_file_near_the_size_limit_is_a_file_again() {
    // One line an endpoint, as a generator writes: 0.96 MB, 1.18 MB in block style.
    let mut yaml = String::from("version: 1\nendpoints:\n");
    for i in 0..12_500 {
        yaml.push_str(&format!(
            "  svc-{i:05}: {{max_attempts: 2, deadline: 3s, backoff: {{base: 10ms, max: 1s}}}}\n"
        ));
    }
    let server = test_server(true, None);
    server.write("generated.yaml", &yaml);
    // Each command reads or writes the whole 12,500 endpoints, in a debug build: a few seconds
    // on a quiet machine, past `WAIT` on a loaded one, so each has a longer bound of its own.
    let heavy = |args: &[&str]| {
        let mut cmd = server.retryplane(args);
        cmd.timeout(HEAVY_WAIT);
        cmd
    };
    heavy(&["apply", "generated.yaml"]).assert().code(0);
    let printed = heavy(&["get"]).assert().code(0);
    let printed = stdout_of(&printed);
    assert!(printed.len() <= 1024 * 1024, "{} bytes", printed.len());
    server.write("printed.yaml", &printed);
    server
        .retryplane_here(&["validate", "printed.yaml"])
        .timeout(HEAVY_WAIT)
        .assert()
        .code(0);
    heavy(&["diff", "printed.yaml", "--exit-code"])
        .assert()
        .code(0);
}

/// The bound of a command that handles a file near the size limit in a debug build.
const HEAVY_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

#[test]
fn get_warns_when_a_version_is_over_the_size_of_a_policy_file_even_one_line_an_endpoint() {
    // 0.3 MB written once and repeated by aliases: 1.2 MB written out.
    let prefix = format!("/{}", "p".repeat(300_000));
    let yaml = format!(
        "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {{method: GET, path_prefix: &p {prefix}}}\n      - match: {{method: PUT, path_prefix: *p}}\n      - match: {{method: POST, path_prefix: *p}}\n      - match: {{method: DELETE, path_prefix: *p}}\n"
    );
    let server = test_server(true, None);
    server.write("aliases.yaml", &yaml);
    server
        .retryplane(&["apply", "aliases.yaml"])
        .assert()
        .code(0);
    let printed = server.retryplane(&["get"]).assert().code(0);
    let stderr = String::from_utf8_lossy(&printed.get_output().stderr).into_owned();
    assert!(
        stderr.contains("over the 1048576 bytes a policy file may be"),
        "{stderr}"
    );
    assert!(stdout_of(&printed).len() > 1024 * 1024);
}

#[test]
fn white_space_around_the_server_url_is_dropped_as_around_the_token() {
    let server = test_server(true, None);
    // As read from a file or a secret: a line break at the end, or a stray space.
    for given in [
        format!("{}\n", server.url),
        format!(" {}", server.url),
        format!("{} ", server.url),
    ] {
        for (flag, variable) in [(None, Some(&given)), (Some(&given), None)] {
            let mut command = server.retryplane_here(&["history"]);
            if let Some(variable) = variable {
                command.env("RETRYPLANE_SERVER", variable);
            }
            if let Some(flag) = flag {
                command.args(["--server", flag]);
            }
            let out = command.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(0), "{given:?}: {stderr}");
        }
    }
}

#[test]
fn an_empty_retryplane_server_is_the_default_server() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("v1.yaml"), V1).unwrap();
    // Every admin command reads it through the same flags; `apply` and `rollback` are left out
    // here only because they would change a control plane running on the default address.
    for args in [
        &["diff", "v1.yaml"][..],
        &["get"],
        &["history"],
        &["status"],
        &["stats"],
        &["top", "--iterations", "1", "--interval", "100ms"],
    ] {
        let out = cli(args)
            .current_dir(dir.path())
            .env("RETRYPLANE_SERVER", "")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // No complaint about the URL (each names `--server URL:`). Nothing listens on the
        // default address, usually: then the command names it as the default; a control plane
        // that does answers.
        assert!(
            !stderr.contains("--server http") && !stderr.contains("--server:"),
            "{args:?}: {stderr}"
        );
        if stderr.contains("cannot connect") {
            assert!(
                stderr.contains(
                    "cannot connect to http://127.0.0.1:7471 (the default address: \
                                 give the control plane's admin address with --server or \
                                 RETRYPLANE_SERVER)"
                ),
                "{args:?}: {stderr}"
            );
        }
    }
}

/// A `RETRYPLANE_TOKEN` that is not UTF-8 (a secret file read with the wrong encoding) stops
/// the command with clap's `invalid UTF-8 was detected in one or more arguments`, naming no
/// variable: the command line it points at is fine (`RETRYPLANE_SERVER` does the same). The
/// message should name the variable (and never print its value).
#[test]
fn a_token_variable_that_is_not_utf8_is_named_as_the_variable_not_an_argument() {
    use std::os::unix::ffi::OsStrExt as _;
    let server = test_server(true, Some(TOKENS));
    let variable = "RETRYPLANE_TOKEN";
    let value = std::ffi::OsStr::from_bytes(b"\xffadmin-secret-0123456789");
    // Read by clap (no --token), and by the fallback of an empty --token (clap reads nothing
    // then; the value was dropped and the call went out with no token).
    for args in [&["history"][..], &["history", "--token", ""]] {
        let out = server
            .retryplane(args)
            .env(variable, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("admin-secret"), "{args:?}: {stderr}");
        assert!(stderr.contains(variable), "{args:?}: {stderr}");
    }
}

#[test]
fn an_empty_retryplane_token_is_reported_missing_like_an_unset_one() {
    let server = test_server(true, Some(TOKENS));
    let stderr = |cmd: &mut Command| {
        let assert = cmd.assert().code(1);
        String::from_utf8(assert.get_output().stderr.clone()).unwrap()
    };
    let unset = stderr(&mut server.retryplane(&["history"]));
    let empty = stderr(server.retryplane(&["history"]).env("RETRYPLANE_TOKEN", ""));
    assert!(
        empty.contains("retryplane: error: UNAUTHENTICATED: missing credentials"),
        "{empty}"
    );
    assert_eq!(empty, unset);
}

#[test]
fn the_agent_or_http_listener_instead_of_the_admin_one_is_named_as_the_likely_mistake() {
    let server = test_server(true, None);
    let running = server.running();
    for (listener, addr) in [
        ("agent", running.agent_addr()),
        ("http", running.http_addr()),
    ] {
        for command in ["history", "status", "get"] {
            let stderr = failed_against(command, &addr.to_string());
            assert!(
                stderr.contains("retryplane: error: UNIMPLEMENTED")
                    && stderr.contains("retryplane: hint: ")
                    && stderr.contains("--admin-listen, port 7471 by default"),
                "{command} on the {listener} listener: {stderr}"
            );
        }
    }
}

#[test]
fn a_missing_or_unknown_token_says_how_to_give_one() {
    let server = test_server(true, Some(TOKENS));
    for token in [None, Some("not-a-known-token-at-all")] {
        let mut cmd = server.retryplane(&["history"]);
        if let Some(token) = token {
            cmd.env("RETRYPLANE_TOKEN", token);
        }
        cmd.assert()
            .code(1)
            .stderr(predicate::str::contains("UNAUTHENTICATED"))
            .stderr(predicate::str::contains(
                "retryplane: hint: give a token of role admin (or viewer, for a command that only reads) with --token or RETRYPLANE_TOKEN",
            ))
            .stderr(predicate::str::contains("not-a-known").not());
    }
    // A token copied with the header's `Bearer ` (sent as `Bearer Bearer …`): a note says the
    // prefix is added for it, without showing the token.
    let bearer = "retryplane: note: the token given opens with `Bearer `, which is added for it";
    server
        .retryplane(&["history", "--token", "Bearer admin-secret-0123456789"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains(bearer))
        .stderr(predicate::str::contains("admin-secret").not());
    server
        .retryplane(&["history"])
        .env("RETRYPLANE_TOKEN", "admin-secret-0123456789")
        .assert()
        .code(0)
        .stderr(predicate::str::contains(bearer).not());
    // A secret that does open so works as given, with no note.
    let opens_so = test_server(
        true,
        Some("tokens:\n  - {name: bob, role: admin, secret: \"Bearer admin-secret-0123456789\"}\n"),
    );
    opens_so
        .retryplane(&["history", "--token", "Bearer admin-secret-0123456789"])
        .assert()
        .code(0)
        .stderr(predicate::str::contains(bearer).not());
}

/// An unreachable server exits 2, and a message naming an address the command line does not
/// show says where it came from (a `RETRYPLANE_SERVER` left set points every command elsewhere).
#[test]
fn an_unreachable_server_exits_2() {
    let url = dead_server();
    cli(&["status"])
        .env("RETRYPLANE_SERVER", &url)
        .assert()
        .code(2)
        .stdout("")
        .stderr(predicate::str::contains(format!(
            "retryplane: error: cannot connect to {url} (from RETRYPLANE_SERVER): "
        )));
    cli(&["status", "--server", &url])
        .env("RETRYPLANE_SERVER", "http://127.0.0.1:1")
        .assert()
        .code(2)
        .stderr(predicate::str::contains(format!(
            "retryplane: error: cannot connect to {url}: "
        )));
    cli(&["status"])
        .env("RETRYPLANE_SERVER", "::garbage")
        .assert()
        .code(2)
        .stderr(predicate::str::contains(
            "retryplane: error: RETRYPLANE_SERVER http://::garbage: not a valid URL",
        ));
    // The checks that name `--server` name the variable too.
    cli(&["status"])
        .env("RETRYPLANE_SERVER", "http://127.0.0.1:99999")
        .assert()
        .code(2)
        .stderr(
            "retryplane: error: RETRYPLANE_SERVER http://127.0.0.1:99999: the port must be a \
             number from 1 to 65535, not `99999`\n",
        );
}

/// A loopback server that is not a gRPC one: each connection gets an HTTP/1.1 answer to
/// whatever it sent first (the HTTP/2 preface, here), and is closed. Runs until the test ends.
fn http1_server() -> String {
    use std::io::{Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0_u8; 1024];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
    });
    url
}

#[test]
fn a_server_that_does_not_speak_grpc_is_named_with_what_broke_and_a_hint() {
    let url = http1_server();
    for command in ["history", "status", "get"] {
        let stderr = failed_against(command, &url);
        // Before: `retryplane: error: UNKNOWN: transport error`, naming neither the server nor
        // what happened.
        assert!(
            stderr.contains(&format!(
                "retryplane: error: UNAVAILABLE: the connection to {url} failed before an answer: "
            )),
            "{command}: {stderr}"
        );
        assert!(
            stderr.contains("retryplane: hint: is --server the admin listener"),
            "{command}: {stderr}"
        );
        assert_eq!(stderr.lines().count(), 2, "{command}: {stderr}");
    }
}

/// A loopback server that takes each connection and closes it at once, having read nothing
/// (a port-forward or a load balancer with no backend behind it, a control plane going down).
/// Runs until the test ends.
fn closing_server() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
        }
    });
    url
}

/// A connection closed before any answer is what the module docs call UNAVAILABLE ("the
/// connection to URL failed before an answer", with the hint): it printed
/// `retryplane: error: CANCELLED: operation was canceled`, which names neither the server nor
/// what broke, and reads as if the user had cancelled something.
#[test]
fn a_server_that_closes_each_connection_at_once_is_named_as_unavailable_not_cancelled() {
    let url = closing_server();
    for command in ["history", "status", "get"] {
        let stderr = failed_against(command, &url);
        assert!(
            !stderr.contains("CANCELLED"),
            "{command}: nothing was cancelled: {stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "retryplane: error: UNAVAILABLE: the connection to {url} failed before an answer: "
            )),
            "{command}: {stderr}"
        );
        assert!(
            stderr.contains("retryplane: hint: is --server the admin listener"),
            "{command}: {stderr}"
        );
    }
}

/// An `apply` whose answer never comes back (a network that drops it, a proxy that hangs)
/// may still have been stored: here the request reaches the control plane, which stores v1,
/// while its answer is dropped on the way back. After its 30 s the CLI said only
/// `DEADLINE_EXCEEDED: no answer from the server within 30 s` and the hint for "a server that
/// accepts the connection and never answers", as if nothing had happened; a write that timed
/// out should say it may have been stored (as the server says of a store failure it cannot
/// read back: "`retryplane history` shows what is"). Takes the CLI's 30 s request timeout.
#[test]
fn an_apply_whose_answer_is_lost_says_it_may_have_been_stored() {
    let server = test_server(true, None);
    server.write("v1.yaml", V1);
    let upstream = server.running().admin_addr();
    let listener = server
        .runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let proxy = listener.local_addr().unwrap();
    server.runtime.spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let up = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let (mut from_client, _to_client) = tcp.into_split();
                let (mut from_server, mut to_server) = up.into_split();
                // What the client sends goes through; what the server answers is dropped.
                let sink = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut tokio::io::sink()).await;
                });
                let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                sink.abort();
            });
        }
    });
    let assert = server
        .retryplane_here(&["apply", "v1.yaml", "--server", &format!("http://{proxy}")])
        .timeout(std::time::Duration::from_secs(60))
        .assert()
        .code(2);
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).into_owned();
    // The change was stored all the same.
    let history = server.history();
    assert_eq!(history[0]["version"], 1, "{history}");
    assert!(
        stderr.contains("may have been stored") || stderr.contains("may still have been stored"),
        "a timed-out write should say it may have been stored: {stderr}"
    );
}

/// A server in API mode on `V1` (stored), and `other.yaml`, which replaces its only endpoint,
/// `payments`, by `search`.
fn v1_and_a_file_replacing_it() -> TestServer {
    let server = test_server(true, None);
    server.write("v1.yaml", V1);
    server.write("other.yaml", "version: 1\nendpoints:\n  search: {}\n");
    server.retryplane(&["apply", "v1.yaml"]).assert().code(0);
    server
}

/// A change that replaces every endpoint with others (`payments` by `search`) is refused as
/// "removes every endpoint" (by design: README, replace them in two steps), but the refusal
/// said it "takes every policy away from the fleet", the empty snapshot SPEC §3 guards
/// against, when the fleet would get `search`'s policy: a reader takes the file for empty.
#[test]
fn the_refusal_of_a_change_that_replaces_every_endpoint_does_not_call_it_an_empty_fleet() {
    let server = v1_and_a_file_replacing_it();
    let assert = server.retryplane(&["apply", "other.yaml"]).assert().code(1);
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).into_owned();
    assert!(stderr.contains("payments"), "{stderr}");
    assert!(
        !stderr.contains("takes every policy away from the fleet"),
        "the fleet keeps a policy (search): {stderr}"
    );
}

/// A dry run returns the diff (SPEC §3), also of a change `apply` refuses without `--force`:
/// the endpoints it removes and adds are shown above the refusal, which still exits 1, and
/// nothing is stored.
#[test]
fn a_dry_run_of_a_change_that_removes_every_endpoint_shows_its_diff_and_the_refusal() {
    let server = v1_and_a_file_replacing_it();
    let assert = server
        .retryplane(&["apply", "other.yaml", "--dry-run"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("--force"));
    let stdout = String::from_utf8_lossy(&assert.get_output().stdout).into_owned();
    assert!(
        stdout.lines().any(|l| l.starts_with("- payments"))
            && stdout.lines().any(|l| l.starts_with("+ search")),
        "the diff of the refused change: {stdout}"
    );
    // JSON output stays empty on a refusal.
    server
        .retryplane(&["apply", "other.yaml", "--dry-run", "--output", "json"])
        .assert()
        .code(1)
        .stdout("");
    // `diff` only shows, and notes that `apply` would refuse it (in text output).
    server
        .retryplane(&["diff", "other.yaml"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("- payments"))
        .stderr(predicate::str::contains(
            "retryplane: note: applying it would be refused: the change removes every endpoint (payments)",
        ));
    server
        .retryplane(&["diff", "other.yaml", "--output", "json"])
        .assert()
        .code(0)
        .stderr(predicate::str::contains("refused").not());
    let history = server.history();
    assert_eq!(history.as_array().map(Vec::len), Some(1), "{history}");
    // A file that removes one endpoint of several is no such change: no note.
    server.write(
        "two.yaml",
        "version: 1\nendpoints:\n  payments: {}\n  search: {}\n",
    );
    server.retryplane(&["apply", "two.yaml"]).assert().code(0);
    server
        .retryplane(&["diff", "v1.yaml"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("- search"))
        .stderr(predicate::str::contains("refused").not());
}

#[test]
fn removing_every_endpoint_needs_force_for_apply_and_rollback() {
    let server = v1_and_a_file_replacing_it();

    // `payments` would go and nothing of v1 stay: refused, nothing stored.
    server
        .retryplane(&["apply", "other.yaml"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("payments"))
        .stderr(predicate::str::contains("--force"));
    server
        .retryplane(&["get"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("payments"));
    server
        .retryplane(&["apply", "other.yaml", "--force"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("applied v2"));

    // Back to v1 removes `search`, every endpoint of v2; a dry run shows its diff above the
    // same refusal.
    server
        .retryplane(&["rollback", "1"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("--force"));
    server
        .retryplane(&["rollback", "1", "--dry-run"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("- search"))
        .stderr(predicate::str::contains("--force"));
    server
        .retryplane(&["rollback", "1", "--force"])
        .assert()
        .code(0);
    server
        .retryplane(&["get"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("payments"))
        .stdout(predicate::str::contains("search").not());
}

#[test]
fn a_dry_run_in_json_says_the_hash_the_content_would_get_and_whether_it_changes_anything() {
    let server = test_server(true, None);
    server.write("v1.yaml", V1);
    server.write("v2.yaml", V2);
    let json = |args: &[&str]| json_of(&server.retryplane(args).assert().code(0));

    // An empty store: version 0, no current hash, and the content would be new.
    let first = json(&["diff", "v1.yaml", "--output", "json"]);
    assert_eq!(
        (&first["version"], &first["content_hash"], &first["changed"]),
        (&0.into(), &"".into(), &false.into())
    );
    assert_eq!(first["would_change"], true, "{first}");
    let v1 = json(&["apply", "v1.yaml", "--output", "json"]);
    assert_eq!(v1["changed"], true, "{v1}");
    assert_eq!(v1["would_change"], true, "{v1}");
    assert_eq!(v1["new_content_hash"], v1["content_hash"], "{v1}");
    assert_eq!(first["new_content_hash"], v1["content_hash"], "{first}");

    // A dry run of different content: the current version as before, and what would change.
    for dry_run in [
        json(&["apply", "v2.yaml", "--dry-run", "--output", "json"]),
        json(&["diff", "v2.yaml", "--output", "json"]),
    ] {
        assert_eq!(dry_run["version"], 1, "{dry_run}");
        assert_eq!(dry_run["content_hash"], v1["content_hash"], "{dry_run}");
        assert_eq!(dry_run["changed"], false, "{dry_run}");
        assert_eq!(dry_run["dry_run"], true, "{dry_run}");
        assert_eq!(dry_run["would_change"], true, "{dry_run}");
        assert_ne!(dry_run["new_content_hash"], v1["content_hash"], "{dry_run}");
        assert_eq!(dry_run["new_content_hash"].as_str().unwrap().len(), 64);
    }
    let predicted = json(&["diff", "v2.yaml", "--output", "json"])["new_content_hash"].clone();
    let v2 = json(&["apply", "v2.yaml", "--output", "json"]);
    assert_eq!(
        v2["content_hash"], predicted,
        "the dry run told the hash v2 got"
    );

    // A dry run of the content already current changes nothing.
    let same = json(&["apply", "v2.yaml", "--dry-run", "--output", "json"]);
    assert_eq!(same["would_change"], false, "{same}");
    assert_eq!(same["new_content_hash"], v2["content_hash"], "{same}");
    let again = json(&["apply", "v2.yaml", "--output", "json"]);
    assert_eq!(
        (&again["changed"], &again["would_change"]),
        (&false.into(), &false.into())
    );
}

/// `retryplane COMMAND --server SERVER` without a token, which must fail with exit code 2 and
/// nothing on stdout: its stderr.
fn failed_against(command: &str, server: &str) -> String {
    let assert = cli(&[command, "--server", server])
        .assert()
        .code(2)
        .stdout("");
    String::from_utf8_lossy(&assert.get_output().stderr).into_owned()
}

#[test]
fn a_password_in_the_server_url_is_never_printed() {
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, V1).unwrap();
    let file = file.to_str().unwrap();
    let refusing = dead_server();
    let dead = refusing.replace("http://", "http://alice:s3cret-pw@");
    let commands: &[&[&str]] = &[
        &["status"],
        &["stats"],
        &["get"],
        &["history"],
        &["diff", file],
        &["apply", file],
        &["rollback", "1"],
        &["top", "--iterations", "1"],
        &["top", "--iterations", "1", "--output", "json"],
    ];
    let mut runs: Vec<(Vec<&str>, &str)> = commands
        .iter()
        .map(|c| (c.to_vec(), dead.as_str()))
        .collect();
    // Refused before any connection: the URL is named in the error.
    for bad in [
        "http://alice:s3cret-pw@127.0.0.1:99999",
        "alice:s3cret-pw@127.0.0.1:",
        "https://alice:s3cret-pw@127.0.0.1",
    ] {
        runs.push((vec!["status"], bad));
    }
    for (args, server) in runs {
        let out = cli(&args)
            .args(["--server", server])
            .timeout(std::time::Duration::from_secs(30))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?} {server}");
        let shown = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!shown.contains("s3cret-pw"), "{args:?}: {shown}");
        assert!(shown.contains("alice:***@127.0.0.1"), "{args:?}: {shown}");
    }
}

/// A route's path prefix is printed in the text diff of `diff`, `apply` and `rollback` with its
/// control characters escaped: a line break in it would print a line of its own (`+ evil`, read
/// as an added endpoint by a person or a script), and a carriage return or an escape would reach
/// the terminal.
#[test]
fn the_text_diff_escapes_control_characters_of_a_route_match() {
    const CONTROL: &str = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: \"/x\\n+ evil\\r\\u001b[31mred\"}\n        max_attempts: 2\n";
    let server = TestServer::start(None, None, |cfg| cfg.api_mode = true);
    server.write("control.yaml", CONTROL);
    server.write("plain.yaml", "version: 1\nendpoints:\n  a: {}\n");
    let mut outputs = vec![(
        "diff",
        server
            .retryplane(&["diff", "control.yaml"])
            .output()
            .unwrap(),
    )];
    outputs.push((
        "apply",
        server
            .retryplane(&["apply", "control.yaml"])
            .output()
            .unwrap(),
    ));
    server.retryplane(&["apply", "plain.yaml"]).assert().code(0);
    outputs.push((
        "rollback",
        server.retryplane(&["rollback", "1"]).output().unwrap(),
    ));
    for (command, o) in &outputs {
        assert_eq!(o.status.code(), Some(0), "{command}: {o:?}");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            !out.lines().any(|l| l.starts_with("+ evil"))
                && !out.chars().any(|c| c.is_control() && c != '\n'),
            "{command}: {out:?}"
        );
        assert!(
            out.contains("routes[0] added: * /x\\n+ evil\\r\\u{1b}[31mred"),
            "{command}: {out:?}"
        );
    }
}

/// A read (`get`, `history`, `status`, `stats`, `diff`) whose connection breaks before the
/// answer is sent once more on a new connection: the control plane closes a connection left
/// idle, and a restarted one's is gone, which the channel learns only from the call it sends.
/// Here the first connection takes the call and closes; the second reaches the control plane.
#[test]
fn a_read_whose_connection_broke_before_the_answer_is_sent_again() {
    let server = TestServer::start(Some(V1), None, |_| {});
    let upstream = server.running().admin_addr();
    let listener = server
        .runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let proxy = listener.local_addr().unwrap();
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = requests.clone();
    server.runtime.spawn(async move {
        // The first connection: HTTP/2 up, the call taken, then closed without an answer.
        let (tcp, _) = listener.accept().await.unwrap();
        let mut h2 = h2::server::handshake(tcp).await.unwrap();
        if let Some(Ok(_call)) = h2.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        drop(h2);
        // The next ones: to the control plane.
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut up = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tcp, &mut up).await;
            });
        }
    });
    let assert = server
        .retryplane_here(&["get", "--server", &format!("http://{proxy}")])
        .assert()
        .code(0);
    assert!(stdout_of(&assert).contains("max_attempts: 3"));
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A policy file under the size limit whose warnings, each naming a 128-byte endpoint, make an
/// `ApplyResponse` of about 87 MB: past the 64 MiB the CLI decodes. The control plane stores
/// and serves the change; `apply` must say so (exit 0, the new version), not fail with a
/// transport error that reads as "nothing applied".
#[test]
fn an_apply_whose_warnings_pass_the_answer_limit_is_still_reported_as_applied() {
    let server = test_server(true, None);
    server.write("v1.yaml", V1);
    server.retryplane(&["apply", "v1.yaml"]).assert().code(0);
    let name = "n".repeat(128);
    // Each `404` after the first is warned about twice (a client error; listed twice).
    let statuses = vec!["404"; 199_000].join(",");
    let file = format!(
        "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n  {name}:\n    retry_on: {{http_status: [{statuses}]}}\n"
    );
    assert!(file.len() < 1 << 20, "{} bytes", file.len());
    server.write("many-warnings.yaml", &file);
    let assert = server.retryplane(&["apply", "many-warnings.yaml"]).assert();
    let output = assert.get_output().clone();
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The change is in force whatever the CLI said.
    let current = server.runtime.block_on(async {
        let channel = Channel::from_shared(server.url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        pb::admin_service_client::AdminServiceClient::new(channel)
            .max_decoding_message_size(256 << 20)
            .get(pb::GetRequest { version: 0 })
            .await
            .unwrap()
            .into_inner()
            .info
            .map(|i| i.version)
    });
    assert_eq!(current, Some(2), "the control plane serves the new version");
    assert_eq!(
        output.status.code(),
        Some(0),
        "apply failed although version 2 was applied: {}",
        stderr.lines().take(3).collect::<Vec<_>>().join(" | ")
    );
}

#[test]
fn apply_of_a_file_cut_at_the_listing_limit_counts_every_error_in_its_summary() {
    // 1,200 errors: 1,000 are listed, then "200 more error(s) not listed". `validate` says
    // 1,200 (diag::counts); `apply`'s own check counted the closing line as one error and
    // said `1001 errors`.
    let server = test_server(true, None);
    let mut bad = String::from("version: 1\nendpoints:\n");
    for i in 0..1_200 {
        bad.push_str(&format!("  e{i}: {{max_attempts: 0}}\n"));
    }
    server.write("bad.yaml", &bad);
    for command in ["apply", "diff"] {
        let assert = server
            .retryplane_here(&[command, "bad.yaml", "--server", &dead_server()])
            .assert()
            .code(1);
        let stderr = String::from_utf8(assert.get_output().stderr.clone()).unwrap();
        assert!(
            stderr.contains("bad.yaml is invalid: 1200 errors, 0 warnings"),
            "{command}: {stderr}"
        );
    }
}

/// `--token ""` (a script's `--token "$ADMIN_TOKEN"` with the variable unset) falls back to
/// `RETRYPLANE_TOKEN`; one that is not UTF-8 is then dropped without a word and the command
/// goes out with no token at all (`UNAUTHENTICATED: missing credentials`, and a hint to give a
/// token, which the user did). Named as it is when the flag is not given at all.
#[test]
fn an_empty_token_flag_falling_back_to_a_token_variable_that_is_not_utf8_names_the_variable() {
    use std::os::unix::ffi::OsStrExt as _;
    let server = test_server(true, Some(TOKENS));
    let variable = "RETRYPLANE_TOKEN";
    let value = std::ffi::OsStr::from_bytes(b"\xffadmin-secret-0123456789");
    let out = server
        .retryplane(&["history", "--token", ""])
        .env(variable, value)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("admin-secret"), "{stderr}");
    assert!(
        stderr.contains(&format!("{variable} is not valid UTF-8")),
        "{stderr}"
    );
}

/// The same for `--server ""`: a `RETRYPLANE_SERVER` that is not UTF-8 is dropped without a
/// word and the command goes to the default server (`http://127.0.0.1:7471`), another one
/// than the user named.
#[test]
fn an_empty_server_flag_falling_back_to_a_server_variable_that_is_not_utf8_names_the_variable() {
    use std::os::unix::ffi::OsStrExt as _;
    let variable = "RETRYPLANE_SERVER";
    let mut value = dead_server().to_string().into_bytes();
    value.push(0xff);
    let out = cli(&["history", "--server", ""])
        .env(variable, std::ffi::OsStr::from_bytes(&value))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{variable} is not valid UTF-8")),
        "{stderr}"
    );
}

/// Each variable a flag falls back to, when the flag is not given at all, is read in the same
/// place as when it is given empty: one that is not UTF-8 is named, never dropped or shown, and
/// nothing is sent.
#[test]
fn a_variable_that_is_not_utf8_is_named_when_its_flag_is_not_given_at_all() {
    use std::os::unix::ffi::OsStrExt as _;
    let server = dead_server().to_string();
    for (variable, args) in [
        (
            "RETRYPLANE_TOKEN",
            vec!["history", "--server", server.as_str()],
        ),
        ("RETRYPLANE_SERVER", vec!["history"]),
        (
            "RETRYPLANE_AGENT_TOKEN",
            vec![
                "request",
                "--server",
                server.as_str(),
                "--endpoint",
                "e",
                "http://127.0.0.1:9/",
            ],
        ),
    ] {
        let out = cli(&args)
            .env_remove("RETRYPLANE_AGENT_TOKEN")
            .env(
                variable,
                std::ffi::OsStr::from_bytes(b"\xffsecret-0123456789"),
            )
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("secret-0123"), "{variable}: {stderr}");
        assert!(
            stderr.contains(&format!("{variable} is not valid UTF-8")),
            "{variable}: {stderr}"
        );
        assert_eq!(out.status.code(), Some(2), "{variable}: {stderr}");
    }
}
