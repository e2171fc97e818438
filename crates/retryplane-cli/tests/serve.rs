//! `retryplane serve` as a process: prints its addresses, serves, stops cleanly on SIGTERM,
//! reads its tokens file again on SIGHUP, and takes its limits from flags.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::panic)]
#![cfg(unix)]

use std::process::Stdio;
use std::time::Duration;

use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

mod process;
use process::{BOUND, http_get, terminate};

const POLICY: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n";

/// [`process::serve`] of [`POLICY`], its log dropped.
async fn serve(dir: &std::path::Path, extra: &[&str]) -> (Child, Vec<(String, String)>) {
    process::serve(dir, POLICY, extra, Stdio::null()).await
}

#[cfg(unix)]
#[tokio::test]
async fn serve_prints_its_addresses_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addrs) = serve(dir.path(), &[]).await;
    let response = http_get(&addrs[2].1, "/readyz").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    terminate(child).await;
    assert!(dir.path().join("data").is_dir());
}

/// A second SIGTERM during the drain stops the process at once: a health `Watch` (which holds
/// the drain for its whole grace) does not keep it.
#[cfg(unix)]
#[tokio::test]
async fn a_second_sigterm_stops_at_once_without_the_drains_grace() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let stderr = Stdio::from(std::fs::File::create(&log).unwrap());
    let (mut child, addrs) = process::serve(dir.path(), POLICY, &[], stderr).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", addrs[0].1))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut statuses = HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let status = |m: Option<tonic_health::pb::HealthCheckResponse>| m.map(|m| m.status);
    let first = statuses.message().await.unwrap();
    assert_eq!(status(first), Some(ServingStatus::Serving as i32));
    let pid = child.id().unwrap().to_string();
    let kill = || async {
        let sent = Command::new("kill").args(["-TERM", &pid]).status().await;
        assert!(sent.unwrap().success());
    };
    kill().await;
    // The drain has begun once the watch hears of it.
    let next = tokio::time::timeout(BOUND, statuses.message()).await;
    assert_eq!(
        status(next.unwrap().unwrap()),
        Some(ServingStatus::NotServing as i32)
    );
    let second = tokio::time::Instant::now();
    kill().await;
    let exited = tokio::time::timeout(BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exited.success(), "{exited:?}");
    // The drain's grace is 5 s; stopping at once takes well under it.
    assert!(
        second.elapsed() < Duration::from_secs(3),
        "{:?} after the second SIGTERM",
        second.elapsed()
    );
    drop(statuses);
    // The line names the signal.
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("signal=SIGTERM") && logged.contains("a second SIGTERM or Ctrl-C"),
        "{logged}"
    );
}

/// `/dev/full`, which every write fails ("no space left on device"), as a full log disk or
/// a log pipe whose reader died does.
#[cfg(target_os = "linux")]
fn dev_full() -> std::fs::File {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap()
}

/// `retryplane serve` in file mode on `dir`, every listener on port 0, with `RUST_LOG` set to
/// `log` and the given stdout and stderr.
#[cfg(target_os = "linux")]
fn serve_with(dir: &std::path::Path, log: &str, stdout: Stdio, stderr: Stdio) -> Child {
    std::fs::write(dir.join("policies.yaml"), POLICY).unwrap();
    Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir)
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .env("RUST_LOG", log)
        .stdout(stdout)
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn serve_keeps_serving_when_its_stdout_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = serve_with(
        dir.path(),
        "warn,retryplane_server::server=info",
        dev_full().into(),
        Stdio::piped(),
    );
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let (mut http_addr, mut warned) = (None, false);
    while http_addr.is_none() || !warned {
        let line = tokio::time::timeout(BOUND, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap_or_else(|| panic!("serve ended its log before serving"));
        if line.contains("control plane serving") {
            let addr = line.split("http_addr=").nth(1).unwrap();
            http_addr = Some(addr.split(' ').next().unwrap().to_owned());
        }
        warned |= line.contains("WARN")
            && line.contains("cannot write the listener addresses to stdout; serving anyway");
    }
    let response = http_get(&http_addr.unwrap(), "/readyz").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    // The log is read no further; it must not fill the pipe and block the server meanwhile.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    terminate(child).await;
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn serve_keeps_serving_when_its_log_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = serve_with(dir.path(), "info", Stdio::piped(), dev_full().into());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut http_addr = None;
    while http_addr.is_none() {
        let line = tokio::time::timeout(BOUND, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap_or_else(|| panic!("serve ended before printing its addresses"));
        http_addr = line.strip_prefix("http: ").map(str::to_owned);
    }
    let response = http_get(&http_addr.unwrap(), "/readyz").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    terminate(child).await;
}

/// `retryplane get --server http://ADMIN --token SECRET`, run to its end: the exit code.
async fn get_with_token(admin: &str, secret: &str) -> i32 {
    let status = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .args([
            "get",
            "--server",
            &format!("http://{admin}"),
            "--token",
            secret,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap();
    status.code().unwrap()
}

#[cfg(unix)]
#[tokio::test]
async fn sighup_reloads_the_tokens_file_and_a_bad_one_keeps_the_tokens_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.yaml");
    let write = |secret: &str| {
        std::fs::write(
            &tokens,
            format!("tokens:\n  - {{name: alice, role: admin, secret: {secret}}}\n"),
        )
        .unwrap();
    };
    write("first-secret-0123456789");
    let log = dir.path().join("serve.log");
    let stderr = Stdio::from(std::fs::File::create(&log).unwrap());
    let (child, addrs) = process::serve_logging(
        dir.path(),
        POLICY,
        &["--tokens", "tokens.yaml"],
        stderr,
        "warn,retryplane=info",
    )
    .await;
    let admin = addrs[1].1.clone();
    let pid = child.id().unwrap().to_string();
    let hangup = || async {
        let sent = Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .await
            .unwrap();
        assert!(sent.success());
    };
    assert_eq!(get_with_token(&admin, "first-secret-0123456789").await, 0);
    // The secret is rotated: the old one works until the reload, the new one after it.
    write("second-secret-012345678");
    assert_eq!(get_with_token(&admin, "second-secret-012345678").await, 1);
    hangup().await;
    let mut rotated = false;
    for _ in 0..100 {
        if get_with_token(&admin, "second-secret-012345678").await == 0 {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rotated, "the new secret was not taken after SIGHUP");
    // In file mode the policy file is read again too.
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("SIGHUP: reading the policy file again"),
        "{logged}"
    );
    assert_eq!(get_with_token(&admin, "first-secret-0123456789").await, 1);
    // A file that cannot be used does not stop the server (the server's own tests check that
    // the tokens in force stay).
    std::fs::write(&tokens, "tokens: [}").unwrap();
    hangup().await;
    hangup().await;
    assert_eq!(get_with_token(&admin, "second-secret-012345678").await, 0);
    terminate(child).await;
}

/// Opens an agent stream as `id` and says Hello; the stream, or the status it was refused with.
async fn open_stream(
    agent_addr: &str,
    id: &str,
) -> Result<
    (
        tonic::Streaming<pb::ServerMessage>,
        mpsc::Sender<pb::AgentMessage>,
    ),
    tonic::Status,
> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{agent_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = AgentServiceClient::new(channel);
    let (tx, rx) = mpsc::channel(4);
    let hello = pb::Hello {
        agent_id: id.to_owned(),
        service: "checkout".to_owned(),
        ..Default::default()
    };
    tx.send(pb::AgentMessage {
        kind: Some(Kind::Hello(hello)),
    })
    .await
    .unwrap();
    let stream = client.connect(ReceiverStream::new(rx)).await?.into_inner();
    Ok((stream, tx))
}

#[cfg(unix)]
#[tokio::test]
async fn serve_flags_set_the_metrics_interval_and_the_agent_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addrs) = serve(
        dir.path(),
        &["--metrics-interval", "2500ms", "--max-agents", "1"],
    )
    .await;
    let agent_addr = &addrs[0].1;
    let (mut first, _keep) = open_stream(agent_addr, "a-1").await.unwrap();
    let message = tokio::time::timeout(BOUND, first.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let snapshot = message.decode_snapshot().unwrap().unwrap();
    assert_eq!(snapshot.metrics_interval_ms, 2500);
    // A second agent is one too many; the first stays.
    let refused = match open_stream(agent_addr, "a-2").await {
        Err(status) => status,
        Ok((mut second, _keep)) => tokio::time::timeout(BOUND, second.message())
            .await
            .unwrap()
            .unwrap_err(),
    };
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    terminate(child).await;
}

#[test]
fn bad_serve_flags_are_usage_errors() {
    for (args, says) in [
        (["--metrics-interval", "10"], "needs a unit"),
        (["--metrics-interval", "50ms"], "from 100ms to 1h"),
        (["--max-agents", "0"], "--max-agents"),
        (
            ["--max-pending-handshakes", "0"],
            "--max-pending-handshakes",
        ),
        (["--max-series", "x"], "--max-series"),
        (["--keepalive-interval", "500ms"], "from 1s to 1h"),
        (["--keepalive-interval", "20"], "needs a unit"),
        (["--keepalive-timeout", "0s"], "from 1s to 1h"),
        (["--keepalive-timeout", "2h"], "from 1s to 1h"),
    ] {
        assert_cmd::Command::new(env!("CARGO_BIN_EXE_retryplane"))
            .arg("serve")
            .args(args)
            .assert()
            .code(2)
            .stderr(predicates::str::contains(says));
    }
}

#[cfg(unix)]
#[tokio::test]
async fn forget_disconnected_after_takes_days_and_hours_past_a_day_up_to_30d() {
    // Its help says "up to 30d": every form of that range starts the server, and `0` (keep)
    // written with any unit.
    for value in ["7d", "1.5d", "30d", "48h", "720h", "0", "0s", "0d", "90m"] {
        let dir = tempfile::tempdir().unwrap();
        let (child, _addrs) = serve(dir.path(), &["--forget-disconnected-after", value]).await;
        terminate(child).await;
    }
    for (value, says) in [
        ("31d", "from 1ms to 30d (720h)"),
        ("721h", "from 1ms to 30d (720h)"),
        ("7w", "unknown unit `w`"),
        ("1.2.3d", "is not a duration"),
    ] {
        assert_cmd::Command::new(env!("CARGO_BIN_EXE_retryplane"))
            .args(["serve", "--forget-disconnected-after", value])
            .assert()
            .code(2)
            .stderr(predicates::str::contains(says));
    }
}

/// `retryplane serve` in file mode on `dir` (its `data` directory prepared by the caller), run
/// until it exits, as a start that fails does: the exit code and stderr.
fn serve_until_it_fails(dir: &std::path::Path) -> (Option<i32>, String) {
    std::fs::write(dir.join("policies.yaml"), POLICY).unwrap();
    serve_with_until_it_fails(dir, &["--config", "policies.yaml"])
}

/// [`serve_until_it_fails`] with `mode` (`--config FILE`, `--api`, …) in place of the policy
/// file it writes: loopback listeners on any port, the store in `dir/data`.
fn serve_with_until_it_fails(dir: &std::path::Path, mode: &[&str]) -> (Option<i32>, String) {
    let output = assert_cmd::Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir)
        .arg("serve")
        .args(mode)
        .args(["--data-dir", "data"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .timeout(BOUND)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn in_api_mode_a_seed_file_named_but_missing_stops_the_start_of_an_empty_store() {
    // A path named with --config is one the operator meant: missing, it is a mistake, not
    // "no seed". (The default path missing, which waits for the first apply: `request.rs`,
    // an agent on an empty store with no seed.)
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = serve_with_until_it_fails(dir.path(), &["--api", "--config", "sead.yaml"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("cannot read the policy file sead.yaml, and the store holds no version")
            && stderr.contains("No such file"),
        "{stderr}"
    );
}

#[test]
fn a_store_file_that_cannot_be_opened_is_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    // A directory in the file's place: opening it fails for every user, root included.
    std::fs::create_dir_all(dir.path().join("data/retryplane.redb")).unwrap();
    let (code, stderr) = serve_until_it_fails(dir.path());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("cannot open the store file data/retryplane.redb"),
        "{stderr}"
    );
}

#[test]
fn a_store_file_without_read_permission_is_named_at_start() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data/retryplane.redb");
    std::fs::create_dir(dir.path().join("data")).unwrap();
    std::fs::write(&file, b"a store").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::File::open(&file).is_ok() {
        eprintln!("skipped: this user reads a file of mode 000 (root?), so it cannot be refused");
        return;
    }
    let (code, stderr) = serve_until_it_fails(dir.path());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("cannot open the store file data/retryplane.redb")
            && stderr.contains("Permission denied"),
        "{stderr}"
    );
}

#[test]
fn a_store_file_of_zeros_only_stops_the_start_and_is_left_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data/retryplane.redb");
    std::fs::create_dir(dir.path().join("data")).unwrap();
    std::fs::write(&file, vec![0; 73_728]).unwrap();
    let (code, stderr) = serve_until_it_fails(dir.path());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("the store file data/retryplane.redb holds only zero bytes")
            && stderr.contains("move it aside"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), vec![0; 73_728]);
}

#[tokio::test]
async fn a_write_refused_in_file_mode_names_the_policy_file_by_its_absolute_path() {
    let dir = tempfile::tempdir().unwrap();
    // Started with `--config policies.yaml`, relative to its working directory.
    let (child, addrs) = serve(dir.path(), &[]).await;
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("new.yaml"), POLICY).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(elsewhere.path())
        .args(["apply", "new.yaml", "--server"])
        .arg(format!("http://{}", addrs[1].1))
        .env_remove("RETRYPLANE_TOKEN")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let absolute = dir.path().join("policies.yaml");
    assert!(
        stderr.contains(&format!(
            "policies are owned by the file {}:",
            absolute.display()
        )),
        "{stderr}"
    );
    terminate(child).await;
}
