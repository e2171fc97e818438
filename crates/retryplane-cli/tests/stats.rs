//! `stats`, `top` and the alerts of `status`, run as the real `retryplane` binary against a
//! real control plane on `127.0.0.1:0` (started in this process), with a real agent making
//! calls; `top`'s terminal mode runs under a pseudo-terminal made by `script` (util-linux).

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{self, Read as _, Write as _};
use std::process::{ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use assert_cmd::Command;
use predicates::prelude::*;
use retryplane_agent::{Agent, CallMeta};
use support::{TestServer, WAIT, dead_server, json_of, stdout_of};

/// Fast deterministic pauses (5 ms, 10 ms), no budget or breaker; `ep` makes 3 attempts.
const POLICY: &str = "\
version: 1
defaults:
  backoff: {base: 5ms, max: 20ms, jitter: none}
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
endpoints:
  ep:
    max_attempts: 3
";
const TOKENS: &str = "\
tokens:
  - {name: alice, role: admin, secret: admin-secret-0123456789}
";

/// A control plane in API mode, seeded with [`POLICY`], whose agents report every 100 ms.
fn test_server(tokens: Option<&str>) -> TestServer {
    TestServer::start(Some(POLICY), tokens, |cfg| {
        cfg.api_mode = true;
        cfg.metrics_interval = Duration::from_millis(100);
    })
}

/// A real agent of service `checkout`, connected and on version 1.
fn real_agent(server: &TestServer) -> Agent {
    let addr = server.running().agent_addr();
    server.runtime.block_on(async {
        let agent = Agent::builder()
            .url(format!("http://{addr}"))
            .service("checkout")
            .agent_id("agent-1")
            .rng_seed(1)
            .connect()
            .unwrap();
        let deadline = tokio::time::Instant::now() + WAIT;
        while agent.policies().version() != 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the agent never got v1"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agent
    })
}

/// One logical call of `ep` whose attempts answer `statuses` in turn (then 200).
async fn call(agent: &Agent, statuses: &[u16]) {
    let script = Arc::new(Mutex::new(statuses.to_vec()));
    let _ = agent
        .endpoint("ep")
        .call(CallMeta::http("GET", "/"), move |_| {
            let script = script.clone();
            async move {
                let mut script = script.lock().unwrap();
                let status = if script.is_empty() {
                    200
                } else {
                    script.remove(0)
                };
                let mut response = http::Response::new(());
                *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
                Ok::<_, io::Error>(response)
            }
        })
        .await;
}

/// Calls `check` until it returns something, every 50 ms, failing after [`WAIT`].
fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(value) = check() {
                return value;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for: {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

#[test]
fn with_no_agents_stats_is_empty_and_top_prints_plain_blocks() {
    let server = test_server(None);
    let json = json_of(
        &server
            .retryplane(&["stats", "--output", "json"])
            .assert()
            .code(0),
    );
    assert_eq!(json["series"], serde_json::json!([]));
    assert_eq!(json["endpoints"], serde_json::json!([]));
    assert_eq!(json["alerts"], serde_json::json!([]));
    assert_eq!(json["overflowed_reports"], 0);
    server
        .retryplane(&["stats"])
        .assert()
        .code(0)
        .stdout("")
        .stderr("no metrics reported yet\n");
    server
        .retryplane(&["stats", "--endpoint", "nope"])
        .assert()
        .code(0)
        .stdout("")
        .stderr("no metrics reported yet\n");
    server
        .retryplane(&["stats", "--window", "2m"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--window"));

    // stdout is a pipe: plain text, one block per refresh, a blank line between them.
    let top = server
        .retryplane(&["top", "--iterations", "2", "--interval", "100ms"])
        .assert()
        .code(0);
    let out = stdout_of(&top);
    assert!(!out.contains('\x1b'), "no escape codes: {out:?}");
    let blocks: Vec<&str> = out.split("\n\n").collect();
    assert_eq!(blocks.len(), 2, "{out}");
    for block in blocks {
        let lines: Vec<&str> = block.lines().collect();
        assert_eq!(lines.len(), 3, "{block}");
        // `2025-11-30T03:37:05Z  http://127.0.0.1:PORT  v1  0 agents  0 series ...`.
        let rest = format!(
            "Z  {}  v1  0 agents  0 series  0 alerting  window 1m",
            server.url
        );
        assert!(
            lines[0].starts_with("20") && lines[0].ends_with(&rest),
            "{block}"
        );
        assert!(
            lines[1].contains("ENDPOINT") && lines[1].contains("RETRY%"),
            "{block}"
        );
        assert_eq!(lines[2], "no series reported in the window yet");
    }
    server
        .retryplane(&["top", "--interval", "10ms"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("too short"));
    server
        .retryplane(&["top", "--interval", "2"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(
            "duration `2` needs a unit (ms, s, m or h): at least 100ms",
        ));

    // --output json: one object per refresh, each on its own line.
    let top = server
        .retryplane(&[
            "top",
            "--iterations",
            "2",
            "--interval",
            "100ms",
            "--output",
            "json",
        ])
        .assert()
        .code(0);
    let out = stdout_of(&top);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    for line in lines {
        let json: serde_json::Value = serde_json::from_str(line).expect("a JSON object per line");
        assert_eq!(json["server"], server.url.as_str(), "{line}");
        assert_eq!(json["current_version"], 1, "{line}");
        assert_eq!(json["agents"], 0, "{line}");
        assert_eq!(json["window"], "1m", "{line}");
        assert_eq!(json["stats"]["series"], serde_json::json!([]), "{line}");
        assert!(
            json["taken"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{line}"
        );
    }

    // status asks Stats for alerts: none here.
    let status = json_of(
        &server
            .retryplane(&["status", "--output", "json"])
            .assert()
            .code(0),
    );
    assert_eq!(status["alerts"], serde_json::json!([]));
    server
        .retryplane(&["status"])
        .assert()
        .code(0)
        .stdout("v1: 0 acked, 0 nacked, 0 pending\n");
}

#[test]
fn calls_made_by_a_real_agent_show_in_stats() {
    let server = test_server(None);
    let agent = real_agent(&server);
    server.runtime.block_on(async {
        call(&agent, &[]).await; // first try
        call(&agent, &[503]).await; // after one retry (5 ms pause)
        call(&agent, &[503, 503, 503]).await; // gives up after 3 attempts (5 + 10 ms)
        call(&agent, &[]).await; // first try
    });
    // Calls 4, attempts 1 + 2 + 3 + 1 = 7, retries 3, backoff 5 + 5 + 10 = 20 ms.
    let json = eventually("the calls reach the server", || {
        let json = json_of(
            &server
                .retryplane(&["stats", "--endpoint", "ep", "--output", "json"])
                .assert()
                .code(0),
        );
        (json["endpoints"][0]["calls"] == 4).then_some(json)
    });
    let ep = &json["endpoints"][0];
    assert_eq!(ep["endpoint"], "ep");
    assert_eq!(ep["attempts"], 7);
    assert_eq!(ep["retries"], 3);
    assert_eq!(ep["success_first_try"], 2);
    assert_eq!(ep["success_after_retry"], 1);
    assert_eq!(ep["gave_up_attempts"], 1);
    assert_eq!(ep["backoff_ms"], 20);
    assert_eq!(ep["retry_ratio"], 0.75);
    assert_eq!(ep["first_try_success_ratio"], 0.5);
    // The (checkout, ep) series holds the same calls in its lifetime and in every window.
    let series = &json["series"][0];
    assert_eq!(series["service"], "checkout");
    assert_eq!(series["endpoint"], "ep");
    assert_eq!(series["policy_version"], 1);
    assert_eq!(series["lifetime"]["calls"], 4);
    assert_eq!(series["lifetime"]["retries"], 3);
    let windows = series["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 3, "{series}");
    for w in windows {
        assert_eq!(w["counters"]["calls"], 4, "{w}");
        assert_eq!(w["retry_ratio"], 0.75, "{w}");
    }
    // 75 % is past the default 5 % threshold, but 4 calls are below the server's minimum
    // volume for an alert (20 calls in 5 minutes): the ratio shows, the alert does not fire.
    assert_eq!(series["alert"]["ratio"], 0.75, "{series}");
    assert_eq!(series["alert"]["threshold"], 0.05, "{series}");
    assert_eq!(series["alert"]["firing"], false, "{series}");
    assert_eq!(json["alerts"], serde_json::json!([]));

    let text = stdout_of(&server.retryplane(&["stats"]).assert().code(0));
    assert!(
        text.contains("lifetime, per endpoint (every service):\n"),
        "{text}"
    );
    let row = text.lines().find(|l| l.starts_with("ep ")).unwrap();
    let cells: Vec<&str> = row.split_whitespace().collect();
    // ENDPOINT CALLS RETRIES RETRY% FIRST-TRY AFTER-RETRY GIVE-UPS BACKOFF.
    assert_eq!(
        cells,
        ["ep", "4", "3", "75.0%", "50.0%", "1", "att:1", "20ms"],
        "{text}"
    );
    // Another endpoint or service filters everything out.
    let none = json_of(
        &server
            .retryplane(&["stats", "--endpoint", "nope", "--output", "json"])
            .assert()
            .code(0),
    );
    assert_eq!(none["endpoints"], serde_json::json!([]));
    let other_service = json_of(
        &server
            .retryplane(&["stats", "--service", "search", "--output", "json"])
            .assert()
            .code(0),
    );
    assert_eq!(other_service["series"], serde_json::json!([]));
    // In text, that is not "nothing reported": the filters name what matched nothing.
    server
        .retryplane(&["stats", "--endpoint", "nope"])
        .assert()
        .code(0)
        .stdout("")
        .stderr(
            "no metrics match --endpoint nope (other series were reported: retryplane stats \
             lists them)\n",
        );
    // A service with no series is told the same way, not answered with the lifetime totals
    // of every other service.
    server
        .retryplane(&["stats", "--service", "search"])
        .assert()
        .code(0)
        .stdout("")
        .stderr(
            "no metrics match --service search (other series were reported: retryplane stats \
             lists them)\n",
        );
    server
        .retryplane(&["stats", "--endpoint", "nope", "--service", "checkout"])
        .assert()
        .code(0)
        .stdout("")
        .stderr(
            "no metrics match --endpoint nope --service checkout (other series were reported: \
             retryplane stats lists them)\n",
        );

    // top sees the connected agent.
    let top = stdout_of(
        &server
            .retryplane(&["top", "--iterations", "1", "--interval", "100ms"])
            .assert()
            .code(0),
    );
    assert!(top.contains("  v1  1 agent  "), "{top}");
    let top: serde_json::Value = serde_json::from_str(&stdout_of(
        &server
            .retryplane(&["top", "--iterations", "1", "--output", "json"])
            .assert()
            .code(0),
    ))
    .expect("one JSON object");
    assert_eq!(top["agents"], 1, "{top}");
    assert_eq!(top["stats"]["series"][0]["endpoint"], "ep", "{top}");
    assert_eq!(top["stats"]["endpoints"][0]["calls"], 4, "{top}");
    server.runtime.block_on(agent.shutdown());
}

#[test]
fn an_endpoint_retrying_too_much_is_flagged_in_status_stats_and_top() {
    let server = test_server(None);
    let agent = real_agent(&server);
    server.runtime.block_on(async {
        // 20 calls (the volume an alert needs), each after one retry: a ratio of 100 %.
        for _ in 0..20 {
            call(&agent, &[503]).await;
        }
    });
    let status = eventually("status shows the alert", || {
        let json = json_of(
            &server
                .retryplane(&["status", "--output", "json"])
                .assert()
                .code(0),
        );
        (json["alerts"].as_array().map(Vec::len) == Some(1)).then_some(json)
    });
    assert_eq!(status["alerts"][0]["endpoint"], "ep");
    assert_eq!(status["alerts"][0]["service"], "checkout");
    assert_eq!(status["alerts"][0]["ratio"], 1.0);
    let text = stdout_of(&server.retryplane(&["status"]).assert().code(0));
    assert!(
        text.contains("alert: ep (checkout) retry ratio 100.0% > 5.0% over 5m"),
        "{text}"
    );
    let stats = stdout_of(&server.retryplane(&["stats"]).assert().code(0));
    assert!(stats.contains("ALERT 100.0% > 5.0%"), "{stats}");
    let top = stdout_of(
        &server
            .retryplane(&["top", "--iterations", "1"])
            .assert()
            .code(0),
    );
    let row = top.lines().find(|l| l.contains(" ep ")).unwrap_or_default();
    assert!(row.starts_with('!'), "the alerting row is marked:\n{top}");
}

#[test]
fn errors_exit_like_the_other_admin_commands() {
    let dead = dead_server();
    for args in [
        &["stats"][..],
        &["stats", "--output", "json"],
        &["top", "--iterations", "2", "--interval", "100ms"],
    ] {
        Command::cargo_bin("retryplane")
            .unwrap()
            .env_remove("RETRYPLANE_TOKEN")
            .env("RETRYPLANE_SERVER", &dead)
            .args(args)
            .timeout(WAIT)
            .assert()
            .code(2)
            .stdout("")
            .stderr(predicate::str::contains(format!(
                "retryplane: error: cannot connect to {dead}"
            )));
    }
    // Refused (no token): exit 1, and `top` stops at the first refusal in plain mode.
    let server = test_server(Some(TOKENS));
    server
        .retryplane(&["stats"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("UNAUTHENTICATED"));
    server
        .retryplane(&["top", "--interval", "100ms"])
        .assert()
        .code(1)
        .stdout("")
        .stderr(predicate::str::contains("UNAUTHENTICATED"));
    server
        .retryplane(&["stats", "--output", "json"])
        .env("RETRYPLANE_TOKEN", "admin-secret-0123456789")
        .assert()
        .code(0)
        .stdout(predicate::str::contains("\"series\": []"));
}

#[test]
fn off_a_terminal_top_keeps_going_through_a_restart_of_the_control_plane() {
    // `top -b` (and `top --output json | jq`) follows the fleet through a restart of the
    // control plane: a refresh that cannot reach it is a warning on stderr, and the next
    // interval connects anew. (It ended at the first failure, with exit 2.)
    let mut first = test_server(None);
    let admin = first.running().admin_addr();
    let mut top = support::cli_process(&[
        "top",
        "--output",
        "json",
        "--interval",
        "100ms",
        "--server",
        &first.url,
    ])
    .spawn()
    .unwrap();
    let lines_of = |pipe: Box<dyn io::Read + Send>| {
        let (tx, rx) = mpsc::channel();
        let reader = thread::spawn(move || {
            for line in io::BufRead::lines(io::BufReader::new(pipe)) {
                if tx.send(line.unwrap()).is_err() {
                    break;
                }
            }
        });
        (rx, reader)
    };
    let (stdout, out_reader) = lines_of(Box::new(top.stdout.take().unwrap()));
    let (stderr, err_reader) = lines_of(Box::new(top.stderr.take().unwrap()));
    let line = stdout.recv_timeout(WAIT).expect("a first refresh");
    assert_eq!(json_line(&line)["current_version"], 1, "{line}");
    first.stop();
    let warning = stderr.recv_timeout(WAIT).expect("a refresh to fail");
    assert!(
        warning.starts_with("retryplane: warning: refresh failed (retrying every 100ms): "),
        "{warning}"
    );
    assert!(top.try_wait().unwrap().is_none(), "top ended: {warning}");
    // Another control plane on the same address, where version 2 is applied.
    let second = TestServer::start(Some(POLICY), None, |cfg| {
        cfg.api_mode = true;
        cfg.admin_listen = admin;
    });
    second.write(
        "v2.yaml",
        &POLICY.replace("max_attempts: 3", "max_attempts: 2"),
    );
    second.retryplane(&["apply", "v2.yaml"]).assert().code(0);
    // A refresh every 100 ms: version 2 comes within a bounded number of them.
    let mut refreshes = 0;
    loop {
        let line = stdout
            .recv_timeout(WAIT)
            .expect("a refresh after the restart");
        if json_line(&line)["current_version"] == 2 {
            break;
        }
        refreshes += 1;
        assert!(refreshes < 200, "version 2 never shown: {line}");
    }
    // SIGTERM ends it with exit 0.
    let pid = top.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = top.wait().unwrap();
    out_reader.join().unwrap();
    err_reader.join().unwrap();
    let rest: Vec<String> = stderr.try_iter().collect();
    assert_eq!(status.code(), Some(0), "{rest:?}");
    assert!(
        rest.iter()
            .all(|l| l.starts_with("retryplane: warning: refresh failed")),
        "{rest:?}"
    );
}

fn json_line(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// `retryplane top --server URL --interval 100ms` on a 100×30 pseudo-terminal made by
/// `script`; once the output holds `ready`, types `keys`. Returns the exit status and
/// everything written to the terminal.
fn top_in_a_terminal(url: &str, ready: &str, keys: &[u8]) -> (ExitStatus, String) {
    let bin = assert_cmd::cargo::cargo_bin("retryplane");
    let command = format!(
        "stty cols 100 rows 30; exec '{}' top --server '{url}' --interval 100ms",
        bin.display()
    );
    let mut child = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("SHELL", "/bin/sh")
        .env_remove("RETRYPLANE_TOKEN")
        .env_remove("RETRYPLANE_SERVER")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("`script` (util-linux) runs the terminal tests");
    // The reader thread sends each chunk the terminal prints, and hangs up at the end of the
    // output (the program and `script` have exited).
    let (chunks, received) = mpsc::channel::<Vec<u8>>();
    let mut stdout = child.stdout.take().unwrap();
    let reader = thread::spawn(move || {
        let mut buf = [0_u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || chunks.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut stdin = child.stdin.take().unwrap();
    let mut output = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut next_chunk = |output: &mut Vec<u8>| {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match received.recv_timeout(left) {
            Ok(chunk) => {
                output.extend_from_slice(&chunk);
                true
            }
            Err(RecvTimeoutError::Disconnected) => false,
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("top timed out: {:?}", String::from_utf8_lossy(output));
            }
        }
    };
    while !String::from_utf8_lossy(&output).contains(ready) {
        assert!(
            next_chunk(&mut output),
            "top ended before showing {ready:?}: {:?}",
            String::from_utf8_lossy(&output)
        );
    }
    stdin.write_all(keys).unwrap();
    stdin.flush().unwrap();
    while next_chunk(&mut output) {}
    drop(stdin);
    reader.join().unwrap();
    let status = child.wait().unwrap();
    let text = || String::from_utf8_lossy(&output).into_owned();
    (status, text())
}

#[test]
fn on_a_terminal_top_draws_on_the_alternate_screen_and_quits_on_q_and_ctrl_c() {
    let server = test_server(None);
    let header = format!("  {}  v1  0 agents", server.url);
    for keys in [&b"q"[..], b"\x03"] {
        let (status, out) = top_in_a_terminal(&server.url, &header, keys);
        assert_eq!(status.code(), Some(0), "{keys:?}: {out:?}");
        let entered = out
            .find("\x1b[?1049h")
            .expect("enters the alternate screen");
        let header = out.find(&header).unwrap();
        let left = out
            .rfind("\x1b[?1049l")
            .expect("leaves the alternate screen");
        assert!(entered < header && header < left, "{out:?}");
        assert!(
            out.contains("ENDPOINT") && out.contains("q: quit"),
            "{out:?}"
        );
    }
}

#[test]
fn on_a_terminal_top_shows_a_failed_refresh_and_keeps_going() {
    let dead = dead_server();
    let failed = format!("error (retrying every 100ms): cannot connect to {dead}");
    let (status, out) = top_in_a_terminal(&dead, &failed, b"Q");
    assert_eq!(status.code(), Some(0), "{out:?}");
    assert!(out.contains("waiting for the first answer"), "{out:?}");
    assert!(out.contains("\x1b[?1049l"), "{out:?}");
}

#[test]
fn on_a_terminal_top_asks_for_the_rows_that_fit_and_counts_the_rest() {
    let server = test_server(None);
    let agent = real_agent(&server);
    server.runtime.block_on(async {
        // `ep` retried once (ratio 50 %), then 40 endpoints of one call each (no retries).
        call(&agent, &[503]).await;
        for i in 0..40 {
            let _ = agent
                .endpoint(&format!("quiet-{i:02}"))
                .call(CallMeta::http("GET", "/"), |_| async {
                    Ok::<_, io::Error>(http::Response::new(()))
                })
                .await;
        }
    });
    eventually("every series is reported", || {
        let json = json_of(
            &server
                .retryplane(&["stats", "--output", "json"])
                .assert()
                .code(0),
        );
        (json["series"].as_array().map(Vec::len) == Some(41)).then_some(())
    });
    // 30 rows: the header, the keys line and the table's header leave 27; 26 rows and a line
    // for the 15 the server did not send or that do not fit.
    let (status, out) = top_in_a_terminal(&server.url, "… 15 more", b"q");
    assert_eq!(status.code(), Some(0), "{out:?}");
    assert!(
        out.contains("  v1  1 agent  41 series  0 alerting  "),
        "{out:?}"
    );
    let worst = out.find("  ep  ").expect("the retried endpoint is listed");
    let quiet = out
        .find("quiet-00")
        .expect("the first quiet endpoint is listed");
    assert!(worst < quiet, "worst first: {out:?}");
    assert!(
        !out.contains("quiet-39"),
        "the last ones are counted, not listed"
    );
    server.runtime.block_on(agent.shutdown());
}
