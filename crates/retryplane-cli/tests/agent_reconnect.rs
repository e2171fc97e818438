//! A real agent and `retryplane serve` killed with SIGKILL: the control plane disappears
//! without a goodbye (no "reconnect" status, no stream end from the server). The agent keeps
//! calling under the policy it had, and when a new control plane comes up on the same port with
//! a new policy version, it reconnects and applies that version.

#![cfg(unix)]
// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, ReconnectBackoff, Source};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};

/// Bound on every wait: a start, a reconnect, an exit.
const BOUND: Duration = Duration::from_secs(30);

/// The policy file: fast deterministic pauses, no budget or breaker, `ep` with `max_attempts`.
fn policy(max_attempts: u32) -> String {
    format!(
        "version: 1\ndefaults:\n  backoff: {{base: 5ms, max: 20ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: {max_attempts}\n"
    )
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// `retryplane serve` in file mode on `dir/policies.yaml` and `dir/data`, its agent listener
/// on `port`; returns once it has printed its addresses.
async fn serve(dir: &Path, port: u16, run: usize) -> Child {
    let log = dir.join(format!("serve-{run}.log"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir)
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--admin-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..3 {
        match timeout(BOUND, lines.next_line()).await {
            Ok(Ok(Some(_))) => {}
            other => panic!(
                "start {run} failed ({other:?}, exit {:?}); its log:\n{}",
                child.try_wait(),
                read_log(&log)
            ),
        }
    }
    child
}

fn read_log(path: &PathBuf) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(unreadable: {e})"))
}

/// Polls `check` every 20 ms until it holds, failing after [`BOUND`].
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + BOUND;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        sleep(Duration::from_millis(20)).await;
    }
}

/// Attempts one always-failing GET on `ep` makes, checked against the upstream's count.
async fn attempts_of(agent: &Agent) -> u32 {
    let count = Arc::new(AtomicU32::new(0));
    let seen = count.clone();
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http("GET", "/"), move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
            async {
                http::Response::builder()
                    .status(503)
                    .body(())
                    .map_err(std::io::Error::other)
            }
        })
        .await
        .unwrap_err();
    assert_eq!(err.attempts, count.load(Ordering::SeqCst));
    err.attempts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_outlives_a_killed_control_plane_and_takes_the_next_ones_policy() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policy(3)).unwrap();
    let port = free_port();
    let mut server = serve(dir.path(), port, 1).await;

    let agent = Agent::builder()
        .url(format!("http://127.0.0.1:{port}"))
        .service("checkout")
        .agent_id("a")
        .rng_seed(1)
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
            Duration::from_secs(10),
        ))
        .connect()
        .unwrap();
    eventually("the agent applies version 1", || {
        agent.policies().version() == 1 && agent.is_connected()
    })
    .await;
    let v1_hash = agent.policies().content_hash().to_owned();
    assert_eq!(attempts_of(&agent).await, 3);

    // SIGKILL: the process gets no chance to tell its agents anything.
    server.start_kill().unwrap();
    let status = timeout(BOUND, server.wait()).await.unwrap().unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    eventually("the agent sees the stream gone", || !agent.is_connected()).await;

    // Disconnected, it keeps the policy it had, call after call.
    let p = agent.policies();
    assert_eq!((p.version(), p.source()), (1, Source::ControlPlane));
    assert_eq!(p.content_hash(), v1_hash);
    for _ in 0..3 {
        assert_eq!(attempts_of(&agent).await, 3);
    }

    // A new control plane on the same port, with a changed file: version 2.
    std::fs::write(dir.path().join("policies.yaml"), policy(5)).unwrap();
    let mut server = serve(dir.path(), port, 2).await;
    eventually("the agent reconnects and applies version 2", || {
        agent.is_connected() && agent.policies().version() == 2
    })
    .await;
    assert_ne!(agent.policies().content_hash(), v1_hash);
    assert_eq!(attempts_of(&agent).await, 5);

    agent.shutdown().await;
    server.start_kill().unwrap();
    timeout(BOUND, server.wait()).await.unwrap().unwrap();
}
