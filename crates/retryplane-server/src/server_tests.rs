//! The whole server over real sockets on 127.0.0.1:0.

use std::fs;
use std::net::SocketAddr;
use std::path::Path;

use crate::agent_stream::StreamLimits;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request};

use super::*;

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
const V2: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n";
const INVALID: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n";
const TOKENS: &str = "\
tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
";

fn config(dir: &Path) -> ServeConfig {
    let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        ..ServeConfig::default()
    }
}

fn with_file(contents: &str) -> (tempfile::TempDir, ServeConfig) {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("policies.yaml"), contents).unwrap();
    let cfg = config(dir.path());
    (dir, cfg)
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// An HTTP/2 connection to `addr`, driven on a task of its own (the handle ends with it).
async fn h2_connection(
    addr: SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    (send, tokio::spawn(conn))
}

/// [`with_file`] with [`TOKENS`] as its tokens file.
fn with_tokens(contents: &str) -> (tempfile::TempDir, ServeConfig) {
    let (dir, mut cfg) = with_file(contents);
    fs::write(dir.path().join("tokens.yaml"), TOKENS).unwrap();
    cfg.tokens_file = Some(dir.path().join("tokens.yaml"));
    (dir, cfg)
}

/// A gRPC call's head for a raw HTTP/2 client: `POST path`, gRPC content type, trailers.
fn grpc_post(path: &str) -> http::Request<()> {
    http::Request::post(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// Sends [`grpc_post`] of `path`, with no body, on the connection of `send` once it has room
/// for a stream: the answer to come.
async fn grpc_send(
    send: &h2::client::SendRequest<bytes::Bytes>,
    path: &str,
) -> h2::client::ResponseFuture {
    let (answer, _) = send
        .clone()
        .ready()
        .await
        .unwrap()
        .send_request(grpc_post(path), true)
        .unwrap();
    answer
}

async fn admin(running: &Running) -> AdminServiceClient<Channel> {
    AdminServiceClient::new(channel(running.admin_addr).await)
}

/// Starts a control plane on `cfg`, capturing what it logs at start through `filter` (an
/// `EnvFilter` directive): the running server and that log.
async fn start_logged(cfg: ServeConfig, filter: &str) -> (Running, String) {
    let (log, guard) = crate::test_logs::capture(filter);
    let running = start(cfg).await.unwrap();
    drop(guard);
    (running, log.text())
}

async fn current(running: &Running) -> pb::VersionInfo {
    let got = admin(running)
        .await
        .get(pb::GetRequest { version: 0 })
        .await
        .unwrap();
    got.into_inner().info.unwrap()
}

/// `GET path` over HTTP/1.1: the status code and body.
async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    (status, body)
}

#[tokio::test]
async fn serves_the_file_on_three_listeners() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    assert_ne!(running.agent_addr.port(), 0);
    let info = current(&running).await;
    assert_eq!((info.version, info.source.as_str()), (1, "file"));
    assert_eq!(http_get(running.http_addr, "/readyz").await.0, 200);
    let (status, metrics) = http_get(running.http_addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("retryplane_server_current_version 1"),
        "{metrics}"
    );
    // Which build: its version and commit.
    assert!(
        metrics.contains(&format!(
            "retryplane_server_build_info{{version=\"{}\",commit=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::COMMIT
        )),
        "{metrics}"
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn restart_with_an_unchanged_file_keeps_version_and_hash() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg.clone()).await.unwrap();
    let before = current(&running).await;
    running.shutdown().await.unwrap();
    let running = start(cfg).await.unwrap();
    let after = current(&running).await;
    assert_eq!(
        (after.version, &after.content_hash),
        (before.version, &before.content_hash)
    );
    // Served as stored: no publish counted, and no word of a version a failed write hid.
    assert_eq!(running.control().metrics.publishes.get(), 0);
    assert_eq!(
        running.control().file_read().map(|r| r.outcome),
        Some(Ok(()))
    );
    running.shutdown().await.unwrap();
}

/// The start-up log names the store and says whether this start created it (a mistyped
/// `--data-dir` makes a new, empty one), and the serving line carries the version and store.
#[tokio::test]
async fn the_start_up_log_names_the_store_and_whether_it_is_new() {
    let (_dir, mut cfg) = with_file(V1);
    // A path with a space is quoted: one field of the line.
    cfg.data_dir = cfg.data_dir.join("state dir");
    let store = std::path::absolute(cfg.data_dir.join("retryplane.redb")).unwrap();
    let quoted = format!("store=\"{}\"", store.display());
    for (run, said) in [
        (1, "created a new, empty version store"),
        (2, "opened the version store"),
    ] {
        let (running, logged) = start_logged(cfg.clone(), "retryplane_server=info").await;
        let line = logged
            .lines()
            .find(|l| l.contains(said))
            .unwrap_or_else(|| panic!("run {run}: {logged}"));
        assert!(line.contains(&quoted), "{line}");
        let serving = logged
            .lines()
            .find(|l| l.contains("control plane serving"))
            .unwrap_or_else(|| panic!("run {run}: {logged}"));
        assert!(
            serving.contains(&format!("version={}", env!("CARGO_PKG_VERSION")))
                && serving.contains(&format!("commit={}", crate::COMMIT))
                && serving.contains("mode=file:/")
                && serving.contains(&quoted),
            "{serving}"
        );
        running.shutdown().await.unwrap();
    }
}

/// A start on a file that removes endpoints of the stored version publishes it and says so at
/// warn, with what changed: a `--config` that is not the file meant removes endpoints
/// fleet-wide. An edit that removes none, and an unchanged file, get no warning.
#[tokio::test]
async fn a_start_on_a_file_that_removes_endpoints_warns() {
    let (dir, cfg) = with_file(V1);
    let running = start(cfg.clone()).await.unwrap();
    running.shutdown().await.unwrap();
    fs::write(
        dir.path().join("policies.yaml"),
        "version: 1\nendpoints:\n  payments: {}\n  payments-v2: {}\n",
    )
    .unwrap();
    let (running, logged) = start_logged(cfg.clone(), "retryplane_server=warn").await;
    assert_eq!(current(&running).await.version, 2);
    assert!(!logged.contains("removes endpoints"), "{logged}");
    running.shutdown().await.unwrap();
    fs::write(
        dir.path().join("policies.yaml"),
        "version: 1\nendpoints:\n  payments-v2: {}\n",
    )
    .unwrap();
    let (running, logged) = start_logged(cfg.clone(), "retryplane_server=warn").await;
    assert_eq!(current(&running).await.version, 3);
    assert!(
        logged.contains("the policy file read at start removes endpoints")
            && logged.contains("before=2 version=3")
            && logged.contains("(payments)"),
        "{logged}"
    );
    running.shutdown().await.unwrap();
    // An unchanged file at the next start: no word.
    let (running, logged) = start_logged(cfg, "retryplane_server=warn").await;
    assert!(!logged.contains("removes endpoints"), "{logged}");
    running.shutdown().await.unwrap();
}

/// A start on an invalid file serves the stored version, and says why the file was not
/// applied for `FleetStatus`, as a save while running would.
#[tokio::test]
async fn a_start_on_an_invalid_file_notes_why_it_was_not_applied() {
    let (dir, cfg) = with_file(V1);
    let running = start(cfg.clone()).await.unwrap();
    running.shutdown().await.unwrap();
    fs::write(
        dir.path().join("policies.yaml"),
        "version: 1\nendpoints:\n  payments: {max_attempts: 0, deadline: 0s}\n",
    )
    .unwrap();
    let running = start(cfg).await.unwrap();
    assert_eq!(current(&running).await.version, 1);
    let Some(Err(problem)) = running.control().file_read().map(|r| r.outcome) else {
        panic!("{:?}", running.control().file_read())
    };
    assert!(
        problem.starts_with("2 error(s), first: 3:28: error: endpoints.payments.max_attempts: "),
        "{problem}"
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_start_refusing_a_file_that_removes_thousands_of_endpoints_names_only_the_first() {
    let many: String = (0..3_000)
        .map(|i| format!("  endpoint-with-a-long-name-{i:05}: {{}}\n"))
        .collect();
    let (dir, cfg) = with_file(&format!("version: 1\nendpoints:\n{many}"));
    let running = start(cfg.clone()).await.unwrap();
    running.shutdown().await.unwrap();
    fs::write(
        dir.path().join("policies.yaml"),
        "version: 1\nendpoints:\n  fresh: {}\n",
    )
    .unwrap();
    let (running, text) = start_logged(cfg, "retryplane_server=error").await;
    assert_eq!(
        current(&running).await.version,
        1,
        "the stored version stays"
    );
    let Some(Err(problem)) = running.control().file_read().map(|r| r.outcome) else {
        panic!("{:?}", running.control().file_read())
    };
    assert!(
        problem.starts_with(
            "it removes every endpoint: add the new ones first, then remove the old ones \
             (endpoint-with-a-long-name-00000, "
        ),
        "{problem}"
    );
    assert!(problem.len() <= 1_024 + '…'.len_utf8(), "{}", problem.len());
    assert!(problem.ends_with(" more endpoints)"), "{problem}");
    running.shutdown().await.unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("removes every stored endpoint"))
        .unwrap_or_else(|| panic!("not logged: {text}"));
    assert!(line.len() < 2_000, "{} bytes", line.len());
    assert!(line.contains("endpoint-with-a-long-name-00000, "), "{line}");
    assert!(line.contains(" more endpoints)"), "{line}");
}

#[tokio::test]
async fn an_invalid_file_and_an_empty_store_refuse_to_start() {
    let (_dir, cfg) = with_file(INVALID);
    let err = start(cfg).await.unwrap_err().to_string();
    assert!(
        err.contains("policies.yaml:4:19: error: endpoints.payments.max_attempts"),
        "{err}"
    );
}

#[tokio::test]
async fn an_invalid_file_over_a_stored_version_serves_the_stored_one() {
    let (dir, cfg) = with_file(V1);
    start(cfg.clone()).await.unwrap().shutdown().await.unwrap();
    fs::write(dir.path().join("policies.yaml"), INVALID).unwrap();
    let running = start(cfg).await.unwrap();
    assert_eq!(current(&running).await.version, 1);
    assert_eq!(running.control().metrics.rejected_changes.get(), 1);
    running.shutdown().await.unwrap();
}

/// A restart during a disk-full incident, with the policy file changed while the control plane
/// was down: the stored version is served (ready), and the file is published once there is
/// room (at the watcher's next rescan, with no new save). Needs root (skipped otherwise).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_restart_on_a_full_disk_serves_the_stored_version_and_the_file_once_there_is_room() {
    let (dir, cfg) = with_file(V1);
    let Some(disk) = crate::test_disk::SmallDisk::mount(&cfg.data_dir, "1m") else {
        return;
    };
    start(cfg.clone()).await.unwrap().shutdown().await.unwrap();
    disk.fill();
    fs::write(dir.path().join("policies.yaml"), V2).unwrap();
    let running = start(cfg).await.unwrap();
    assert_eq!(current(&running).await.version, 1);
    assert_eq!(http_get(running.http_addr, "/readyz").await.0, 200);
    assert_eq!(last_reload_successful(&running).await, "0");
    disk.unfill();
    // Bounded: the watcher rescans every 10 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while current(&running).await.version != 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the changed file was not published once there was room"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last_reload_successful(&running).await, "1");
    running.shutdown().await.unwrap();
    drop(disk);
}

/// A valid file under the 1 MiB limit whose snapshot is over the 4 MiB agents decode: one
/// 900 KB path prefix, repeated by aliases in six routes.
pub(crate) fn too_large_for_agents() -> String {
    let prefix = format!("/{}", "a".repeat(900_000));
    let mut yaml = format!(
        "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {{method: GET, path_prefix: &p {prefix}}}\n"
    );
    for method in ["PUT", "POST", "DELETE", "PATCH", "HEAD"] {
        yaml.push_str(&format!(
            "      - match: {{method: {method}, path_prefix: *p}}\n"
        ));
    }
    yaml
}

#[tokio::test]
async fn a_file_too_large_for_agents_over_a_stored_version_serves_the_stored_one() {
    let (dir, cfg) = with_file(V1);
    start(cfg.clone()).await.unwrap().shutdown().await.unwrap();
    fs::write(dir.path().join("policies.yaml"), too_large_for_agents()).unwrap();
    let running = start(cfg).await.unwrap();
    assert_eq!(current(&running).await.version, 1);
    let metrics = &running.control().metrics;
    assert_eq!(metrics.rejected_changes.get(), 1);
    assert_eq!(metrics.config_last_reload_successful.get(), 0);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_file_too_large_for_agents_and_an_empty_store_refuse_to_start() {
    let (_dir, cfg) = with_file(&too_large_for_agents());
    let err = start(cfg).await.unwrap_err();
    let cause = std::error::Error::source(&err).map(ToString::to_string);
    assert!(
        cause
            .as_deref()
            .is_some_and(|c| c.contains("agents decode messages of at most")),
        "{err}: {cause:?}"
    );
}

#[tokio::test]
async fn a_missing_config_directory_over_a_stored_version_serves_the_stored_one() {
    let (dir, cfg) = with_file(V1);
    start(cfg.clone()).await.unwrap().shutdown().await.unwrap();
    let moved = ServeConfig {
        config_file: dir.path().join("nodir").join("policies.yaml"),
        ..cfg.clone()
    };
    let running = start(moved.clone()).await.unwrap();
    assert_eq!(current(&running).await.version, 1);
    running.shutdown().await.unwrap();
    // With nothing stored there is nothing to serve: start-up still stops.
    let empty = ServeConfig {
        data_dir: dir.path().join("empty-data"),
        ..moved
    };
    let err = start(empty).await.unwrap_err().to_string();
    assert!(err.contains("nodir"), "{err}");
}

#[tokio::test]
async fn api_mode_seeds_only_an_empty_store() {
    let (dir, mut cfg) = with_file(V1);
    cfg.api_mode = true;
    start(cfg.clone()).await.unwrap().shutdown().await.unwrap();
    fs::write(dir.path().join("policies.yaml"), V2).unwrap();
    let running = start(cfg).await.unwrap();
    let got = admin(&running)
        .await
        .get(pb::GetRequest { version: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.info.unwrap().version, 1);
    assert!(got.yaml.contains("max_attempts: 3"), "{}", got.yaml);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn file_mode_over_versions_the_admin_api_applied_says_it_replaces_them() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.api_mode = true;
    let running = start(cfg.clone()).await.unwrap();
    let applied = admin(&running)
        .await
        .apply(pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml(V2.to_owned())),
                origin: String::new(),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(applied.into_inner().version, 2);
    running.shutdown().await.unwrap();
    // The same data directory, started without `--api`: the file (still V1) wins, and the
    // log says so, naming the version the admin API made.
    cfg.api_mode = false;
    let (running, logged) = start_logged(cfg, "retryplane_server=warn").await;
    assert!(
        logged.contains("file mode: the current version came from the admin API")
            && logged.contains("version=2")
            && logged.contains("source=\"admin\""),
        "{logged}"
    );
    assert_eq!(
        running.control().publisher.current().map(|s| s.version),
        Some(3)
    );
    running.shutdown().await.unwrap();
}

/// The value of the gauge `name` on `/metrics`.
async fn gauge(running: &Running, name: &str) -> u64 {
    let (_, metrics) = http_get(running.http_addr, "/metrics").await;
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

/// Every version is kept, so an operator watches the store's size: what the file takes on
/// disk, at start and after each change.
#[tokio::test]
async fn the_store_size_is_on_metrics_from_the_start_and_grows_with_each_version() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        api_mode: true,
        ..config(dir.path())
    };
    let file = dir.path().join("data").join("retryplane.redb");
    let running = start(cfg.clone()).await.unwrap();
    let empty = gauge(&running, "retryplane_server_store_bytes").await;
    assert!(empty > 0);
    let mut sizes = vec![empty];
    // Endpoint names no compression shrinks, so that the file grows within a few versions.
    let mut rng = fastrand::Rng::with_seed(7);
    for round in 0..4 {
        let mut yaml = String::from("version: 1\nendpoints:\n");
        for _ in 0..2_000 {
            let name: String = std::iter::repeat_with(|| rng.alphanumeric())
                .take(24)
                .collect();
            yaml.push_str(&format!("  e{round}{name}: {{max_attempts: 2}}\n"));
        }
        let source = pb::PolicySource {
            kind: Some(pb::policy_source::Kind::Yaml(yaml)),
            origin: String::new(),
        };
        admin(&running)
            .await
            .apply(pb::ApplyRequest {
                source: Some(source),
                force: true,
                ..Default::default()
            })
            .await
            .unwrap();
        let now = gauge(&running, "retryplane_server_store_bytes").await;
        assert_eq!(now, std::fs::metadata(&file).unwrap().len());
        sizes.push(now);
    }
    assert!(
        sizes.first() < sizes.last(),
        "the file never grew: {sizes:?}"
    );
    running.shutdown().await.unwrap();
    let running = start(cfg).await.unwrap();
    assert_eq!(
        gauge(&running, "retryplane_server_store_bytes").await,
        std::fs::metadata(&file).unwrap().len()
    );
    running.shutdown().await.unwrap();
}

/// `FleetStatus`'s store state.
async fn store_state(running: &Running) -> pb::StoreState {
    admin(running)
        .await
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner()
        .store
        .unwrap()
}

/// A store file deleted under a running control plane (a cleanup script, a restore done in the
/// wrong order) shows within a check's interval, without waiting for a change to fail on it:
/// on `/metrics`, in `FleetStatus` and in the log. Agents are served on meanwhile, and the
/// versions still read from the open file.
#[tokio::test]
async fn a_store_file_deleted_under_a_running_control_plane_shows_at_the_next_check() {
    let (dir, mut cfg) = with_file(V1);
    cfg.store_check_interval = Duration::from_millis(50);
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let running = start(cfg).await.unwrap();
    let healthy = store_state(&running).await;
    assert!(!healthy.failing, "{healthy:?}");
    assert!(healthy.problem.is_empty(), "{healthy:?}");
    assert_eq!(gauge(&running, "retryplane_server_store_healthy").await, 1);
    std::fs::remove_file(dir.path().join("data").join("retryplane.redb")).unwrap();
    eventually("the store's check fails", || async {
        store_state(&running).await.failing
    })
    .await;
    let since = store_state(&running).await.failing_since_unix_ms;
    // Several checks later, each failing alike.
    eventually("more checks", || async {
        store_state(&running).await.checked_unix_ms >= since + 200
    })
    .await;
    let failing = store_state(&running).await;
    assert!(
        failing.problem.contains("was deleted or replaced"),
        "{failing:?}"
    );
    assert_eq!(failing.failing_since_unix_ms, since);
    assert!(failing.failing_since_unix_ms > 0, "{failing:?}");
    assert!(
        failing.checked_unix_ms >= failing.failing_since_unix_ms,
        "{failing:?}"
    );
    assert_eq!(gauge(&running, "retryplane_server_store_healthy").await, 0);
    assert_eq!(current(&running).await.version, 1);
    let text = log.text();
    assert_eq!(
        text.matches("the version store is failing").count(),
        1,
        "logged once, not at every check: {text}"
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn api_mode_without_a_seed_is_not_ready_until_an_apply() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        api_mode: true,
        ..config(dir.path())
    };
    let running = start(cfg).await.unwrap();
    assert_eq!(http_get(running.http_addr, "/readyz").await.0, 503);
    let source = pb::PolicySource {
        kind: Some(pb::policy_source::Kind::Yaml(V1.to_owned())),
        origin: String::new(),
    };
    let applied = admin(&running)
        .await
        .apply(pb::ApplyRequest {
            source: Some(source),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(applied.into_inner().version, 1);
    assert_eq!(http_get(running.http_addr, "/readyz").await.0, 200);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_keepalive_or_a_stream_limit_of_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (cfg, setting) in [
        (
            ServeConfig {
                keepalive_interval: Duration::ZERO,
                ..config(dir.path())
            },
            "keepalive_interval",
        ),
        (
            ServeConfig {
                keepalive_timeout: Duration::ZERO,
                ..config(dir.path())
            },
            "keepalive_timeout",
        ),
        (
            ServeConfig {
                max_streams_per_connection: 0,
                ..config(dir.path())
            },
            "max_streams_per_connection",
        ),
        // Every agent would be refused, and only agents would hear of it.
        (
            ServeConfig {
                max_agents: 0,
                ..config(dir.path())
            },
            "max_agents",
        ),
        (
            ServeConfig {
                max_message_bytes: 0,
                ..config(dir.path())
            },
            "max_message_bytes",
        ),
    ] {
        let err = start(cfg).await.unwrap_err();
        assert!(
            matches!(err, ServeError::ZeroSetting { setting: s } if s == setting),
            "{err}"
        );
        assert_eq!(err.to_string(), format!("{setting} must be more than zero"));
    }
}

/// Room for agents' messages under way smaller than the largest of them is refused (that
/// message could never come); with a smaller message limit, that limit is the least.
#[tokio::test]
async fn room_for_messages_under_way_below_the_largest_message_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("policies.yaml"), V1).unwrap();
    let largest = retryplane_proto::MAX_AGENT_MESSAGE_BYTES;
    let cfg = ServeConfig {
        stream_limits: StreamLimits {
            max_inbound_bytes: largest - 1,
            ..StreamLimits::default()
        },
        ..config(dir.path())
    };
    let err = start(cfg).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "max_inbound_bytes ({}) must be at least the largest message an agent stream takes \
             ({largest} bytes)",
            largest - 1
        )
    );
    let cfg = ServeConfig {
        max_message_bytes: 1 << 20,
        stream_limits: StreamLimits {
            max_inbound_bytes: 1 << 20,
            ..StreamLimits::default()
        },
        ..config(dir.path())
    };
    start(cfg).await.unwrap().shutdown().await.unwrap();
}

/// Agents take a metrics interval from 100 ms to 1 h, and both ends of a stream derive its
/// heartbeat from it: a control plane started through the library with another is refused (a
/// sub-millisecond one went out as 0, which agents ignore, while the stream's heartbeat ran at
/// 100 ms: idle agents were cut every 2.3 s).
#[tokio::test]
async fn a_metrics_interval_agents_do_not_take_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for value in [
        Duration::ZERO,
        Duration::from_micros(500),
        Duration::from_millis(99),
        Duration::from_secs(3601),
    ] {
        let cfg = ServeConfig {
            metrics_interval: value,
            ..config(dir.path())
        };
        let err = start(cfg).await.unwrap_err();
        assert!(matches!(err, ServeError::MetricsInterval { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            format!("metrics_interval must be from 100ms to 1h, not {value:?}")
        );
    }
    assert!(!dir.path().join("data").exists(), "nothing was stored");
}

#[tokio::test]
async fn two_listeners_on_the_same_address_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    // Taken and released: a free port, refused before anything binds it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let same = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let cases = [
        (
            "agent",
            "admin",
            ServeConfig {
                listen: same,
                admin_listen: same,
                ..config(dir.path())
            },
        ),
        (
            "admin",
            "http",
            ServeConfig {
                admin_listen: same,
                http_listen: same,
                ..config(dir.path())
            },
        ),
        (
            "agent",
            "http",
            ServeConfig {
                listen: same,
                http_listen: same,
                ..config(dir.path())
            },
        ),
    ];
    for (a, b, cfg) in cases {
        let err = start(cfg).await.unwrap_err();
        assert!(
            matches!(err, ServeError::SameAddress { first, second, addr, other }
                if first == a && second == b && addr == same && other == same),
            "{err}"
        );
        assert!(
            err.to_string().starts_with(&format!(
                "the {a} listener ({same}) and the {b} listener ({same}) would share an address"
            )),
            "{err}"
        );
    }
    // An unspecified address takes the port on every address: it overlaps any other address
    // with that port ([::] on IPv4 too, as a dual-stack socket would).
    let all = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    let all6 = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
    for (listen, admin_listen) in [(all, same), (same, all), (all6, same)] {
        let cfg = ServeConfig {
            listen,
            admin_listen,
            insecure: true,
            ..config(dir.path())
        };
        let err = start(cfg).await.unwrap_err();
        assert!(
            matches!(err, ServeError::SameAddress { addr, other, .. }
                if addr == listen && other == admin_listen),
            "{listen} and {admin_listen}: {err}"
        );
    }
    // Port 0 on every listener (the test configuration) is not the same address.
    let (_dir, cfg) = with_file(V1);
    start(cfg).await.unwrap().shutdown().await.unwrap();
}

#[tokio::test]
async fn a_port_in_use_refuses_the_start_before_the_data_directory_is_touched() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let refused = |err: ServeError, which: &str| {
        assert!(
            matches!(&err, ServeError::Bind { listener, addr: a, .. }
                if *listener == which && *a == addr),
            "{err}"
        );
    };
    // API mode on a fresh data directory: no store file is created, nothing is seeded.
    let (dir, cfg) = with_file(V1);
    for (which, cfg) in [
        (
            "agent",
            ServeConfig {
                listen: addr,
                api_mode: true,
                ..cfg.clone()
            },
        ),
        (
            "admin",
            ServeConfig {
                admin_listen: addr,
                api_mode: true,
                ..cfg.clone()
            },
        ),
        (
            "http",
            ServeConfig {
                http_listen: addr,
                ..cfg.clone()
            },
        ),
    ] {
        refused(start(cfg).await.unwrap_err(), which);
        assert!(!dir.path().join("data").exists(), "{which}");
    }
    // An existing store and a changed file: the change is not stored.
    start(cfg.clone()).await.unwrap().shutdown().await.unwrap();
    fs::write(dir.path().join("policies.yaml"), V2).unwrap();
    let busy = ServeConfig {
        admin_listen: addr,
        ..cfg.clone()
    };
    refused(start(busy).await.unwrap_err(), "admin");
    let store = RedbStore::open(&cfg.data_dir).unwrap();
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
}

#[tokio::test]
async fn non_loopback_without_tokens_is_refused_unless_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let exposed = |listen: bool, admin: bool| {
        let any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
        let base = config(dir.path());
        ServeConfig {
            listen: if listen { any } else { base.listen },
            admin_listen: if admin { any } else { base.admin_listen },
            ..base
        }
    };
    let refused = |err: ServeError| match err {
        ServeError::Exposed { ref listeners } => {
            let names: Vec<&str> = listeners.iter().map(|(name, _)| *name).collect();
            (names, err.to_string())
        }
        other => panic!("not refused for exposure: {other}"),
    };
    let (names, text) = refused(start(exposed(false, true)).await.unwrap_err());
    assert_eq!(names, ["admin"]);
    assert!(text.contains("--insecure"), "{text}");
    assert!(text.contains("read or change the policies"), "{text}");

    // The agent listener cannot change the policies: the message says what it does expose.
    let (names, text) = refused(start(exposed(true, false)).await.unwrap_err());
    assert_eq!(names, ["agent"]);
    assert!(
        text.contains("read the policies, and send made-up metrics"),
        "{text}"
    );
    assert!(!text.contains("change the policies"), "{text}");

    // Both: each is named with what it exposes, the worse included.
    let (names, text) = refused(start(exposed(true, true)).await.unwrap_err());
    assert_eq!(names, ["agent", "admin"]);
    assert!(text.contains("made-up metrics"), "{text}");
    assert!(text.contains("read or change the policies"), "{text}");
}

#[tokio::test]
async fn the_http_listener_needs_no_tokens_file_on_any_address() {
    let (_dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        http_listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    let http = SocketAddr::from((Ipv4Addr::LOCALHOST, running.http_addr.port()));
    assert_eq!(http_get(http, "/healthz").await.0, 200);
    running.shutdown().await.unwrap();
}

fn authorized<T>(message: T, secret: &str) -> Request<T> {
    let mut request = Request::new(message);
    let value = format!("Bearer {secret}").parse().unwrap();
    request.metadata_mut().insert("authorization", value);
    request
}

#[tokio::test]
async fn roles_are_enforced_over_the_wire() {
    let (_dir, cfg) = with_tokens(V1);
    let running = start(cfg).await.unwrap();
    let mut client = admin(&running).await;
    let history = || pb::HistoryRequest::default();
    let missing = client.history(history()).await.unwrap_err();
    assert_eq!(missing.code(), Code::Unauthenticated);
    let wrong = client
        .history(authorized(history(), "not-a-known-secret-at-all"))
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), Code::Unauthenticated);
    let agent = client
        .history(authorized(history(), "agent-secret-0123456789"))
        .await
        .unwrap_err();
    assert_eq!(agent.code(), Code::PermissionDenied);
    let ok = client
        .history(authorized(history(), "admin-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(ok.into_inner().versions.len(), 1);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_agent_streams_with_unavailable() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let (tx, mut inbound) = open_stream(running.agent_addr, hello("a-1"), None)
        .await
        .unwrap();
    let first = inbound.message().await.unwrap().unwrap();
    let snapshot = first.decode_snapshot().unwrap().unwrap();
    assert_eq!(snapshot.version, 1);
    let stopping = tokio::spawn(running.shutdown());
    let end = tokio::time::timeout(SHUTDOWN_GRACE, inbound.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    drop(tx);
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn shutdown_refuses_a_stream_still_waiting_for_its_hello_with_unavailable() {
    let (_dir, mut cfg) = with_file(V1);
    // Longer than the whole shutdown may take: the shutdown must not wait for it.
    cfg.stream_limits.hello_timeout = SHUTDOWN_GRACE * 4;
    let running = start(cfg).await.unwrap();
    let mut client = AgentServiceClient::new(channel(running.agent_addr).await);
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(1);
    let waiting = tokio::spawn(async move { client.connect(ReceiverStream::new(rx)).await });
    let metrics = &running.control().metrics;
    eventually(
        "the stream reaches the server and waits for its Hello",
        || async { metrics.streams_awaiting_hello.get() == 1 },
    )
    .await;
    let began = tokio::time::Instant::now();
    let stopping = tokio::spawn(running.shutdown());
    let refused = tokio::time::timeout(SHUTDOWN_GRACE, waiting)
        .await
        .expect("the waiting stream is answered before the shutdown grace is over")
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    stopping.await.unwrap().unwrap();
    assert!(
        began.elapsed() < SHUTDOWN_GRACE,
        "the shutdown waited {:?} for a stream that never said Hello",
        began.elapsed()
    );
    drop(tx);
}

/// The health a listener gives the server as a whole (`""`), the agent service and the admin
/// service, in that order: a status, or the call's error code.
async fn health(addr: SocketAddr) -> Vec<Result<i32, Code>> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut client = HealthClient::new(channel(addr).await);
    let mut statuses = Vec::new();
    for service in ["", AGENT_SERVICE, ADMIN_SERVICE] {
        let request = HealthCheckRequest {
            service: service.to_owned(),
        };
        let answer = client.check(request).await;
        statuses.push(answer.map(|r| r.into_inner().status).map_err(|e| e.code()));
    }
    statuses
}

#[tokio::test]
async fn health_is_serving_on_both_listeners_once_a_snapshot_is_loaded() {
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    let (serving, not_serving) = (Ok(Wire::Serving as i32), Ok(Wire::NotServing as i32));
    // Each listener knows its own service only: the other one's is not served there.
    let other = Err(Code::NotFound);
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        api_mode: true,
        ..config(dir.path())
    };
    let running = start(cfg).await.unwrap();
    // The server as a whole (service "") too.
    let agent = [not_serving, not_serving, other];
    let admin = [not_serving, other, not_serving];
    assert_eq!(health(running.agent_addr).await, agent);
    assert_eq!(health(running.admin_addr).await, admin);
    running.shutdown().await.unwrap();

    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    assert_eq!(health(running.agent_addr).await, [serving, serving, other]);
    assert_eq!(health(running.admin_addr).await, [serving, other, serving]);
    running.shutdown().await.unwrap();
}

/// The next status of a health `Watch` stream, waiting at most [`SHUTDOWN_GRACE`].
async fn next_status(
    statuses: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
) -> Option<i32> {
    let message = tokio::time::timeout(SHUTDOWN_GRACE, statuses.message()).await;
    message.unwrap().unwrap().map(|m| m.status)
}

#[tokio::test]
async fn the_server_as_a_whole_is_not_serving_from_the_start_of_shutdown() {
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let mut client = HealthClient::new(channel(running.agent_addr).await);
    let mut statuses = client
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next_status(&mut statuses).await, Some(Wire::Serving as i32));
    let stopping = tokio::spawn(running.shutdown());
    assert_eq!(
        next_status(&mut statuses).await,
        Some(Wire::NotServing as i32)
    );
    drop(statuses);
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn reflection_lists_the_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    // Each listener lists its own service and health, not the other listener's service (which
    // would answer UNIMPLEMENTED there).
    for (addr, own, other) in [
        (running.admin_addr, ADMIN_SERVICE, AGENT_SERVICE),
        (running.agent_addr, AGENT_SERVICE, ADMIN_SERVICE),
    ] {
        let mut client = ServerReflectionClient::new(channel(addr).await);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .unwrap()
            .into_inner();
        let response = responses.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
            panic!("{response:?}");
        };
        let mut names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["grpc.health.v1.Health", own],
            "listing of the {own} listener, not {other}"
        );
    }
    running.shutdown().await.unwrap();
}

/// Polls `check` every 20 ms for at most 10 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..500 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

/// `retryplane_server_config_last_reload_successful` as `/metrics` shows it.
async fn last_reload_successful(running: &Running) -> String {
    let (_, metrics) = http_get(running.http_addr, "/metrics").await;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("retryplane_server_config_last_reload_successful "));
    line.unwrap_or_else(|| panic!("no reload gauge in {metrics}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn the_reload_gauge_follows_every_read_of_the_policy_file() {
    let (dir, cfg) = with_file(V1);
    let file = dir.path().join("policies.yaml");
    let running = start(cfg).await.unwrap();
    assert_eq!(last_reload_successful(&running).await, "1");
    fs::write(&file, INVALID).unwrap();
    let served = &running;
    eventually("the invalid save to set the gauge to 0", || async move {
        last_reload_successful(served).await == "0"
    })
    .await;
    fs::write(&file, V2).unwrap();
    eventually("the valid save to set the gauge to 1", || async move {
        last_reload_successful(served).await == "1"
    })
    .await;
    assert_eq!(current(served).await.version, 2);
    // A file that cannot be read counts as a failed reload too.
    fs::remove_file(&file).unwrap();
    eventually("the missing file to set the gauge to 0", || async move {
        last_reload_successful(served).await == "0"
    })
    .await;
    fs::write(&file, V2).unwrap();
    eventually(
        "the file back as it was to set the gauge to 1",
        || async move { last_reload_successful(served).await == "1" },
    )
    .await;
    assert_eq!(current(served).await.version, 2);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn reports_over_a_stream_show_in_metrics_stats_and_fleet_status() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let (tx, mut inbound) = open_stream(running.agent_addr, hello("a-1"), None)
        .await
        .unwrap();
    let snapshot = inbound.message().await.unwrap().unwrap();
    let snapshot = snapshot.decode_snapshot().unwrap().unwrap();
    tx.send(pb::AgentMessage {
        kind: Some(Kind::Ack(pb::Ack {
            version: snapshot.version,
            nonce: snapshot.nonce.clone(),
        })),
    })
    .await
    .unwrap();
    let counters = pb::EndpointCounters {
        endpoint: "payments".to_owned(),
        calls: 40,
        attempts: 50,
        retries: 10,
        gave_up_budget: 2,
        backoff_ms: 250,
        ..Default::default()
    };
    send_report(&tx, snapshot.version, counters).await;
    let calls = r#"retryplane_calls_total{service="checkout",endpoint="payments"} 40"#;
    let text = metrics_once_it_shows(&running, "the report shows in /metrics", calls).await;
    let series = r#"{service="checkout",endpoint="payments"}"#;
    for line in [
        format!("retryplane_retries_total{series} 10"),
        r#"retryplane_giveups_total{service="checkout",endpoint="payments",cause="budget_exhausted"} 2"#.to_owned(),
        format!("retryplane_backoff_seconds_total{series} 0.25"),
        r#"retryplane_retry_ratio{service="checkout",endpoint="payments",window="5m"} 0.25"#.to_owned(),
        format!("retryplane_retry_ratio_alert{series} 1.0"),
        r#"retryplane_agents{applied_version="1"} 1"#.to_owned(),
        "retryplane_server_acks_total 1".to_owned(),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    let mut admin = admin(&running).await;
    let stats = admin
        .stats(pb::StatsRequest {
            service: "checkout".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.series.len(), 1);
    let s = &stats.series[0];
    assert_eq!(
        (s.service.as_str(), s.endpoint.as_str()),
        ("checkout", "payments")
    );
    assert_eq!(s.policy_version, 1);
    let alert = s.alert.unwrap();
    assert!(alert.firing);
    assert_eq!((alert.ratio, alert.threshold), (0.25, 0.05));
    assert_eq!(stats.endpoints[0].calls, 40);
    assert_eq!(stats.max_series, 10_000);
    let fleet = admin
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fleet.alerting_endpoints, ["payments"]);
    drop(tx);
    running.shutdown().await.unwrap();
}

/// The versions `checkout`/`payments` keeps apart in Stats, and its lifetime calls.
async fn payments_versions(running: &Running) -> (Vec<u64>, u64) {
    let stats = admin(running)
        .await
        .stats(pb::StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let Some(s) = stats.series.iter().find(|s| s.endpoint == "payments") else {
        return (Vec::new(), 0);
    };
    let mut versions: Vec<u64> = s.versions.iter().map(|v| v.policy_version).collect();
    versions.sort_unstable();
    (versions, s.lifetime.map_or(0, |c| c.calls))
}

/// Over real streams: the four places of a series are taken by the published version and
/// three numbers no agent runs (one agent's reports); two agents whose Hello names 50 (another
/// store's content) connect, one of them reports 50, and 50 takes the place of one of those
/// three (97, the first reported); a further number no agent runs takes none. The control
/// plane's fleet counts the agents each version has.
#[tokio::test]
async fn a_series_keeps_apart_the_versions_its_connected_agents_run() {
    let (_dir, cfg) = with_file(V1);
    let (running, tx, _inbound) = with_agent_on_v1(cfg).await;
    let mut calls = 0;
    for version in [1, 97, 98, 99] {
        send_report(&tx, version, first_try_successes("payments", 1)).await;
        calls += 1;
        eventually("the report counted", || async {
            payments_versions(&running).await.1 == calls
        })
        .await;
    }
    assert_eq!(payments_versions(&running).await.0, [1, 97, 98, 99]);
    let mut others = Vec::new();
    for id in ["b-1", "b-2"] {
        let mut h = hello(id);
        if let Some(Kind::Hello(h)) = &mut h.kind {
            h.last_applied_version = 50;
            h.last_applied_hash = "another-store".to_owned();
        }
        // Registered once the stream is open (`connect` answers after the registration).
        others.push(open_stream(running.agent_addr, h, None).await.unwrap());
    }
    send_report(&others[0].0, 50, first_try_successes("payments", 1)).await;
    calls += 1;
    eventually("50 kept apart", || async {
        payments_versions(&running).await == (vec![1, 50, 98, 99], calls)
    })
    .await;
    send_report(&tx, 96, first_try_successes("payments", 1)).await;
    calls += 1;
    eventually("the report counted", || async {
        payments_versions(&running).await.1 == calls
    })
    .await;
    assert_eq!(payments_versions(&running).await.0, [1, 50, 98, 99]);
    drop((tx, others));
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn agents_that_never_report_take_no_place_among_the_series() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.max_series = 2;
    let running = start(cfg).await.unwrap();
    // Two services whose agents connect and say nothing more.
    let mut idle = Vec::new();
    for i in 0..2 {
        let first = pb::AgentMessage {
            kind: Some(Kind::Hello(pb::Hello {
                agent_id: format!("idle-{i}"),
                service: format!("idle-service-{i}"),
                ..Default::default()
            })),
        };
        let (tx, mut inbound) = open_stream(running.agent_addr, first, None).await.unwrap();
        assert_eq!(next_version(&mut inbound).await, 1);
        idle.push((tx, inbound));
    }
    let (tx, mut inbound) = open_stream(running.agent_addr, hello("a-1"), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut inbound).await, 1);
    send_report(&tx, 1, first_try_successes("payments", 7)).await;
    let mut admin = admin(&running).await;
    let mut series = Vec::new();
    for _ in 0..200 {
        let stats = admin
            .stats(pb::StatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        series = stats
            .series
            .iter()
            .map(|s| (s.service.clone(), s.endpoint.clone()))
            .collect();
        if !series.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(series, [("checkout".to_owned(), "payments".to_owned())]);
    drop((tx, idle));
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_report_with_counts_no_agent_could_make_is_left_out_and_counted() {
    let (_dir, cfg) = with_file(V1);
    let (running, tx, _inbound) = with_agent_on_v1(cfg).await;
    let absurd = pb::EndpointCounters {
        endpoint: "stock".to_owned(),
        calls: u64::MAX,
        attempts: u64::MAX,
        ..Default::default()
    };
    send_report(&tx, 1, absurd).await;
    send_report(&tx, 1, first_try_successes("payments", 7)).await;
    let calls = r#"retryplane_calls_total{service="checkout",endpoint="payments"} 7"#;
    let text =
        metrics_once_it_shows(&running, "the plausible report shows in /metrics", calls).await;
    assert!(
        text.lines()
            .any(|l| l == "retryplane_server_report_endpoints_implausible_total 1"),
        "{text}"
    );
    assert!(!text.contains(r#"endpoint="stock""#), "{text}");
    drop(tx);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_message_over_the_limit_ends_its_stream_with_a_log_line_saying_why() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.max_message_bytes = 64 * 1024;
    let (running, tx, mut inbound) = with_agent_on_v1(cfg).await;
    let (log, guard) = crate::test_logs::capture("retryplane_server=warn");
    let big = pb::EndpointCounters {
        endpoint: "x".repeat(100 * 1024),
        ..Default::default()
    };
    send_report(&tx, 1, big).await;
    let ended = loop {
        match inbound.message().await {
            Ok(Some(_)) => {}
            other => break other,
        }
    };
    assert_eq!(ended.unwrap_err().code(), tonic::Code::ResourceExhausted);
    drop(guard);
    let logged = log.text();
    assert!(
        logged.contains("ending an agent stream") && logged.contains("ResourceExhausted"),
        "{logged}"
    );
    drop(tx);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_oversized_admin_message_is_resource_exhausted() {
    // As on the agent listener (and gRPC's own servers), not tonic's `OUT_OF_RANGE`.
    let (_dir, mut cfg) = with_file(V1);
    cfg.max_message_bytes = 64 * 1024;
    let running = start(cfg).await.unwrap();
    let source = |yaml: String| pb::ValidateRequest {
        source: Some(pb::PolicySource {
            origin: String::new(),
            kind: Some(pb::policy_source::Kind::Yaml(yaml)),
        }),
    };
    let mut client = admin(&running).await;
    let status = client
        .validate(source(format!("# {}\n{V1}", "x".repeat(100 * 1024))))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");
    // A message within the limit is answered as before, and the server goes on.
    client.validate(source(V1.to_owned())).await.unwrap();
    running.shutdown().await.unwrap();
}

/// A control plane started on `cfg` (serving version 1) and agent `a-1`'s stream, which has
/// taken version 1.
async fn with_agent_on_v1(
    cfg: ServeConfig,
) -> (
    Running,
    mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::ServerMessage>,
) {
    let running = start(cfg).await.unwrap();
    let (tx, mut inbound) = open_stream(running.agent_addr, hello("a-1"), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut inbound).await, 1);
    (running, tx, inbound)
}

/// The `/metrics` text once a line of it is `line` (polled with a bound; `what` names the wait).
async fn metrics_once_it_shows(running: &Running, what: &str, line: &str) -> String {
    eventually(what, || async {
        http_get(running.http_addr, "/metrics")
            .await
            .1
            .lines()
            .any(|l| l == line)
    })
    .await;
    http_get(running.http_addr, "/metrics").await.1
}

/// The counters of `calls` calls to `endpoint`, one attempt each.
fn first_try_successes(endpoint: &str, calls: u64) -> pb::EndpointCounters {
    pb::EndpointCounters {
        endpoint: endpoint.to_owned(),
        calls,
        attempts: calls,
        success_first_try: calls,
        ..Default::default()
    }
}

/// Sends one unnumbered report of `counters`, made under `version`.
async fn send_report(
    tx: &mpsc::Sender<pb::AgentMessage>,
    version: u64,
    counters: pb::EndpointCounters,
) {
    let report = pb::MetricsReport {
        policy_version: version,
        endpoints: vec![counters],
        ..Default::default()
    };
    tx.send(pb::AgentMessage {
        kind: Some(Kind::Metrics(report)),
    })
    .await
    .unwrap();
}

fn hello(agent_id: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: agent_id.to_owned(),
            service: "checkout".to_owned(),
            ..Default::default()
        })),
    }
}

/// Opens an agent stream with the stock generated client; the stream's inbound side stays
/// open while the returned sender lives.
async fn open_stream(
    addr: SocketAddr,
    first: pb::AgentMessage,
    secret: Option<&str>,
) -> Result<
    (
        mpsc::Sender<pb::AgentMessage>,
        tonic::Streaming<pb::ServerMessage>,
    ),
    tonic::Status,
> {
    let mut client = AgentServiceClient::new(channel(addr).await);
    let (tx, rx) = mpsc::channel(4);
    tx.send(first).await.unwrap();
    let request = match secret {
        Some(secret) => authorized(ReceiverStream::new(rx), secret),
        None => Request::new(ReceiverStream::new(rx)),
    };
    let inbound = client.connect(request).await?.into_inner();
    Ok((tx, inbound))
}

async fn next_snapshot(inbound: &mut tonic::Streaming<pb::ServerMessage>) -> pb::Snapshot {
    let message = tokio::time::timeout(SHUTDOWN_GRACE, inbound.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    message.decode_snapshot().unwrap().unwrap()
}

async fn next_version(inbound: &mut tonic::Streaming<pb::ServerMessage>) -> u64 {
    next_snapshot(inbound).await.version
}

/// The Hello of a stream the agent gave up comes after the Hello of its next stream: refused
/// with ABORTED, and the open stream stays (it still gets the next push).
#[tokio::test]
async fn a_late_hello_of_a_stream_the_agent_gave_up_does_not_replace_its_next_one() {
    let (dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let numbered = |stream| pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: "a-1".to_owned(),
            service: "checkout".to_owned(),
            instance_id: 7,
            stream,
            ..Default::default()
        })),
    };
    let (_tx2, mut second) = open_stream(running.agent_addr, numbered(2), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut second).await, 1);
    let late = open_stream(running.agent_addr, numbered(1), None)
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(late.code(), Code::Aborted, "{late:?}");
    assert!(late.message().contains("opened a later stream"), "{late:?}");
    fs::write(dir.path().join("policies.yaml"), V2).unwrap();
    assert_eq!(next_version(&mut second).await, 2, "the open stream stays");
    running.shutdown().await.unwrap();
}

/// The fleet's record of what `agent_id` runs.
fn applied_version(running: &Running, agent_id: &str) -> Option<u64> {
    running
        .control()
        .fleet
        .status()
        .into_iter()
        .find(|s| s.agent_id == agent_id)
        .map(|s| s.applied_version)
}

/// Two versions published at once (a stream wakes once for both, on this one-thread runtime):
/// the stream sends the later only. A late ACK of the one it skipped, with the nonce this
/// control plane would have given it, is no answer: the agent never had it to run. A late ACK
/// of the push it did send says what the agent runs.
#[tokio::test]
async fn a_late_ack_counts_only_for_a_push_the_stream_sent() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let hello = pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: "a-1".to_owned(),
            service: "checkout".to_owned(),
            instance_id: 7,
            ..Default::default()
        })),
    };
    let (tx, mut inbound) = open_stream(running.agent_addr, hello, None).await.unwrap();
    let first = next_snapshot(&mut inbound).await;
    assert_eq!(first.version, 1);
    let publisher = &running.control().publisher;
    let current = running
        .control()
        .blocking(|s| s.current())
        .await
        .unwrap()
        .unwrap();
    let version = |v: u64| crate::store::VersionRecord {
        meta: crate::store::VersionMeta {
            version: v,
            content_hash: format!("{v:064x}"),
            ..current.meta.clone()
        },
        document: current.document.clone(),
    };
    publisher.publish_then(&version(2), || {});
    publisher.publish_then(&version(3), || {});
    assert_eq!(
        next_version(&mut inbound).await,
        3,
        "the stream sends the latest"
    );
    let skipped_nonce = first.nonce.replace("-1", "-2");
    assert!(publisher.is_nonce_of(&skipped_nonce, 2));
    let ack = |version: u64, nonce: String| pb::AgentMessage {
        kind: Some(Kind::Ack(pb::Ack { version, nonce })),
    };
    tx.send(ack(2, skipped_nonce)).await.unwrap();
    tx.send(ack(1, first.nonce.clone())).await.unwrap();
    // Read in order: once the ACK of v1 shows, the one before it was read.
    let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
    while applied_version(&running, "a-1") != Some(1) {
        assert!(
            applied_version(&running, "a-1") != Some(2),
            "listed as running v2, which it was never sent"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the ACK of v1 never showed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_replaced_stream_ends_with_aborted_and_its_message() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let (_tx1, mut first) = open_stream(running.agent_addr, hello("a-1"), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut first).await, 1);
    let (_tx2, mut second) = open_stream(running.agent_addr, hello("a-1"), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut second).await, 1);
    let ended = tokio::time::timeout(SHUTDOWN_GRACE, first.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(ended.code(), Code::Aborted, "{ended:?}");
    assert_eq!(
        ended.message(),
        "replaced by a newer stream with the same agent id"
    );
    // The stream is over: the client sees the end, not another message.
    assert!(matches!(first.message().await, Ok(None) | Err(_)));
    drop(second);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_without_hello_is_refused_with_invalid_argument() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.stream_limits.hello_timeout = Duration::from_millis(200);
    let running = start(cfg).await.unwrap();
    let mut client = AgentServiceClient::new(channel(running.agent_addr).await);
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(1);
    let refused = client.connect(ReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(refused.message(), "no Hello within 200ms");
    drop(tx);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn agent_streams_need_an_agent_token() {
    let (_dir, cfg) = with_tokens(V1);
    let running = start(cfg).await.unwrap();
    let addr = running.agent_addr;
    let missing = open_stream(addr, hello("a-1"), None).await.unwrap_err();
    assert_eq!(missing.code(), Code::Unauthenticated, "{missing:?}");
    let admin = open_stream(addr, hello("a-1"), Some("admin-secret-0123456789"))
        .await
        .unwrap_err();
    assert_eq!(admin.code(), Code::PermissionDenied, "{admin:?}");
    let (_tx, mut inbound) = open_stream(addr, hello("a-1"), Some("agent-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(next_version(&mut inbound).await, 1);
    drop(inbound);
    // The two refusals show on the server's side: an agent with a wrong token is not silent.
    let (_, metrics) = http_get(running.http_addr, "/metrics").await;
    assert!(
        metrics.contains("\nretryplane_server_auth_refused_total 2\n"),
        "{metrics}"
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_tokens_reload_ends_the_streams_whose_secret_it_removes_and_admits_new_ones() {
    let (dir, mut cfg) = with_file(V1);
    let tokens_file = dir.path().join("tokens.yaml");
    fs::write(
        &tokens_file,
        "tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: batch, role: agent, secret: batch-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
",
    )
    .unwrap();
    cfg.tokens_file = Some(tokens_file.clone());
    let running = start(cfg).await.unwrap();
    let addr = running.agent_addr;
    let (_tx1, mut fleet) = open_stream(addr, hello("a-1"), Some("agent-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(next_version(&mut fleet).await, 1);
    let (_tx2, mut batch) = open_stream(addr, hello("a-2"), Some("batch-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(next_version(&mut batch).await, 1);
    // A file that cannot be used changes nothing.
    fs::write(
        &tokens_file,
        "tokens: [{name: x, role: agent, secret: short}]\n",
    )
    .unwrap();
    let gauge = |running: &Running| {
        running
            .control()
            .metrics
            .tokens_last_reload_successful
            .get()
    };
    assert_eq!(gauge(&running), 1, "as read at start");
    assert!(running.reload_tokens().is_err());
    assert_eq!(gauge(&running), 0, "the old tokens stay in force");
    // One that cannot be read: the log says why, as at start.
    let moved = tokens_file.with_extension("moved");
    fs::rename(&tokens_file, &moved).unwrap();
    let (log, guard) = crate::test_logs::capture("retryplane_server=error");
    assert!(running.reload_tokens().is_err());
    drop(guard);
    let logged = log.text();
    assert!(
        logged.contains("tokens file not reloaded") && logged.contains("(os error 2)"),
        "{logged}"
    );
    fs::rename(&moved, &tokens_file).unwrap();
    // `batch` is revoked, `fleet` kept, and a new agent token added.
    fs::write(
        &tokens_file,
        "tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: new, role: agent, secret: newer-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
",
    )
    .unwrap();
    assert_eq!(running.reload_tokens().unwrap(), Some(3));
    assert_eq!(gauge(&running), 1);
    let ended = tokio::time::timeout(SHUTDOWN_GRACE, batch.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(
        ended.message().contains("no longer an agent token"),
        "{ended:?}"
    );
    let refused = open_stream(addr, hello("a-2"), Some("batch-secret-0123456789"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    let (_tx3, mut new) = open_stream(addr, hello("a-3"), Some("newer-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(next_version(&mut new).await, 1);
    // The stream whose token stayed still gets what is published.
    fs::write(dir.path().join("policies.yaml"), V2).unwrap();
    assert_eq!(next_version(&mut fleet).await, 2);
    running.shutdown().await.unwrap();
}

const TWO_AGENT_TOKENS: &str = "\
tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: batch, role: agent, secret: batch-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
";

/// `TWO_AGENT_TOKENS` without `fleet`.
const FLEET_REVOKED: &str = "\
tokens:
  - {name: batch, role: agent, secret: batch-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
";

#[tokio::test]
async fn a_stream_of_another_token_cannot_take_a_connected_agents_id() {
    let (dir, mut cfg) = with_file(V1);
    let tokens_file = dir.path().join("tokens.yaml");
    fs::write(&tokens_file, TWO_AGENT_TOKENS).unwrap();
    cfg.tokens_file = Some(tokens_file);
    let running = start(cfg).await.unwrap();
    let addr = running.agent_addr;
    let (_tx, mut inbound) = open_stream(addr, hello("a-1"), Some("agent-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(next_version(&mut inbound).await, 1);
    let refused = open_stream(addr, hello("a-1"), Some("batch-secret-0123456789"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");
    assert!(
        refused.message().contains("connected with another token"),
        "{refused:?}"
    );
    // The first stream is not ended, and is listed with its token.
    let (fleet, connected, _) = running.control().fleet.status_and_counts(true);
    assert_eq!(connected, 1);
    assert_eq!(
        (fleet[0].agent_id.as_str(), fleet[0].token.as_str()),
        ("a-1", "fleet")
    );
    let (_tx2, mut second) = open_stream(addr, hello("a-1"), Some("agent-secret-0123456789"))
        .await
        .unwrap();
    assert_eq!(next_version(&mut second).await, 1);
    let replaced = inbound.message().await.unwrap_err();
    assert_eq!(replaced.code(), Code::Aborted, "{replaced:?}");
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_whose_token_is_removed_while_it_waits_for_hello_is_refused_unregistered() {
    let (dir, mut cfg) = with_file(V1);
    let tokens_file = dir.path().join("tokens.yaml");
    fs::write(&tokens_file, TWO_AGENT_TOKENS).unwrap();
    cfg.tokens_file = Some(tokens_file.clone());
    cfg.stream_limits.hello_timeout = Duration::from_secs(30);
    let running = start(cfg).await.unwrap();
    let addr = running.agent_addr;
    let (tx, rx) = mpsc::channel(4);
    let mut client = AgentServiceClient::new(channel(addr).await);
    let request = authorized(ReceiverStream::new(rx), "agent-secret-0123456789");
    let waiting = tokio::spawn(async move { client.connect(request).await });
    // Past the token check and waiting for its Hello.
    let metrics = &running.control().metrics;
    eventually("the stream waits for its Hello", || async {
        metrics.streams_awaiting_hello.get() == 1
    })
    .await;
    fs::write(&tokens_file, FLEET_REVOKED).unwrap();
    assert_eq!(running.reload_tokens().unwrap(), Some(2));
    tx.send(hello("a-1")).await.unwrap();
    let refused = waiting.await.unwrap().unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(
        refused.message().contains("no longer an agent token"),
        "{refused:?}"
    );
    let (fleet, _, _) = running.control().fleet.status_and_counts(true);
    assert!(fleet.iter().all(|a| a.agent_id != "a-1"), "{fleet:?}");
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_whose_agent_stopped_reading_ends_when_its_token_is_removed() {
    let (dir, mut cfg) = with_file(V1);
    let tokens_file = dir.path().join("tokens.yaml");
    fs::write(&tokens_file, TWO_AGENT_TOKENS).unwrap();
    cfg.tokens_file = Some(tokens_file.clone());
    cfg.api_mode = true;
    let running = start(cfg).await.unwrap();
    let (_tx, mut inbound) = open_stream(
        running.agent_addr,
        hello("a-1"),
        Some("agent-secret-0123456789"),
    )
    .await
    .unwrap();
    assert_eq!(next_version(&mut inbound).await, 1);
    // From here the agent reads nothing: versions of about 900 KB fill the flow-control
    // window and the stream's queue, and its task waits for room to send.
    let mut admin = AdminServiceClient::new(channel(running.admin_addr).await);
    for c in ['b', 'c', 'd', 'e', 'f', 'g', 'h', 'i'] {
        let yaml = format!(
            "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {{method: GET, path_prefix: /{}}}\n",
            c.to_string().repeat(900_000)
        );
        let request = pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml(yaml)),
                origin: String::new(),
            }),
            ..Default::default()
        };
        admin
            .apply(authorized(request, "admin-secret-0123456789"))
            .await
            .unwrap();
    }
    fs::write(&tokens_file, FLEET_REVOKED).unwrap();
    assert_eq!(running.reload_tokens().unwrap(), Some(2));
    // Polled, at most 10 s.
    for _ in 0..200 {
        let (_, connected, _) = running.control().fleet.status_and_counts(false);
        if connected == 0 {
            running.shutdown().await.unwrap();
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the stream of the removed token is still connected");
}

#[tokio::test]
async fn another_agent_service_method_is_unimplemented() {
    use tonic::codegen::http::uri::PathAndQuery;
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel(running.agent_addr).await);
    grpc.ready().await.unwrap();
    let err = grpc
        .unary::<pb::Ack, pb::Ack, _>(
            Request::new(pb::Ack::default()),
            PathAndQuery::from_static("/retryplane.v1.AgentService/Other"),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn each_grpc_listener_bounds_the_streams_of_one_connection() {
    let (_dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        max_streams_per_connection: 3,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr(), running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, mut conn) = h2::client::handshake(tcp).await.unwrap();
        // Before the server's SETTINGS arrive the client assumes no bound.
        assert_eq!(conn.max_concurrent_send_streams(), usize::MAX);
        let request = grpc_post("/grpc.health.v1.Health/Check");
        let answered = async {
            let mut send = send.ready().await?;
            let (response, _) = send.send_request(request, true)?;
            response.await
        };
        // Drive the connection until the answer (which comes after the SETTINGS).
        let response = tokio::select! {
            r = answered => r.unwrap(),
            end = &mut conn => panic!("the connection ended first: {end:?}"),
        };
        assert_eq!(response.status(), 200);
        assert_eq!(conn.max_concurrent_send_streams(), 3, "{addr}");
    }
    running.shutdown().await.unwrap();
}

/// With a tokens file, only calls a token admitted keep a connection open: one whose calls are
/// all refused for their token, or go to a service no token guards (a health check, health
/// Watches kept open and overlapping), is closed the idle timeout after its accept, however
/// often they come (a peer with no token kept a connection, and its file descriptor, for good
/// with one every few seconds); one whose calls a token admitted is kept.
#[tokio::test]
async fn only_calls_a_token_admitted_keep_a_connection_open() {
    let (_dir, cfg) = with_tokens(V1);
    let idle = Duration::from_millis(600);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    // Bytes that move put the close off by at most this many moments of silence.
    let closed_by = idle + crate::preface::QUIET_IO * crate::preface::MAX_QUIET_TURNS;
    for (path, token, kept) in [
        ("/retryplane.v1.AdminService/Get", None, false),
        ("/grpc.health.v1.Health/Check", None, false),
        ("/grpc.health.v1.Health/Watch", None, false),
        (
            "/retryplane.v1.AdminService/Get",
            Some("Bearer admin-secret-0123456789"),
            true,
        ),
    ] {
        let began = tokio::time::Instant::now();
        let (send, conn) = h2_connection(running.admin_addr).await;
        // A kept connection is watched for longer than its close would take.
        let watched = if kept {
            closed_by + idle
        } else {
            closed_by + SHUTDOWN_GRACE
        };
        let mut answered = 0;
        // The answers are kept: a Watch stays open while its answer is.
        let mut answers = Vec::new();
        while !conn.is_finished() && began.elapsed() < watched {
            let Ok(mut ready) = send.clone().ready().await else {
                break;
            };
            let mut request = grpc_post(path);
            if let Some(token) = token {
                request
                    .headers_mut()
                    .insert("authorization", token.parse().unwrap());
            }
            let Ok((answer, mut body)) = ready.send_request(request, false) else {
                break;
            };
            // One empty message: what Get, Check and Watch take.
            if body
                .send_data(bytes::Bytes::from_static(&[0; 5]), true)
                .is_err()
            {
                break;
            }
            if let Ok(answer) = answer.await {
                answered += 1;
                answers.push(answer);
            }
            tokio::time::sleep(idle / 6).await;
        }
        assert!(answered >= 3, "{path}: {answered} calls answered");
        assert_eq!(
            !conn.is_finished(),
            kept,
            "{path} (token: {}): kept for {:?}",
            token.is_some(),
            began.elapsed()
        );
        if !kept {
            assert!(began.elapsed() >= idle, "{:?}", began.elapsed());
        }
    }
    running.shutdown().await.unwrap();
}

/// An admin `Get` with the admin token on `send`'s connection: the answer's HTTP status and
/// `grpc-status`.
async fn admitted_get(send: h2::client::SendRequest<bytes::Bytes>) -> (http::StatusCode, String) {
    let mut request = grpc_post("/retryplane.v1.AdminService/Get");
    request.headers_mut().insert(
        "authorization",
        "Bearer admin-secret-0123456789".parse().unwrap(),
    );
    let (answer, mut body) = send
        .ready()
        .await
        .unwrap()
        .send_request(request, false)
        .unwrap();
    body.send_data(bytes::Bytes::from_static(&[0; 5]), true)
        .unwrap();
    let answer = answer.await.unwrap();
    let status = answer.status();
    let mut answer = answer.into_body();
    while answer.data().await.is_some() {}
    let trailers = answer.trailers().await.unwrap().unwrap();
    (status, trailers["grpc-status"].to_str().unwrap().to_owned())
}

/// With a tokens file, a connection that has carried no call is closed `NO_CALL_IDLE` after
/// its accept, well before the idle timeout (a peer with no token held each silent connection
/// it opened for the whole idle timeout), on both gRPC listeners; one with a call, admitted by
/// a token or refused for it, is kept to the idle timeout (a prober's health checks are not cut
/// under it every few seconds).
#[tokio::test]
async fn a_connection_that_carried_no_call_is_closed_before_the_idle_timeout() {
    use crate::conn_idle::NO_CALL_IDLE;
    let (_dir, cfg) = with_tokens(V1);
    let running = start(cfg).await.unwrap();
    assert_eq!(
        ServeConfig::default().connection_idle_timeout,
        Duration::from_secs(300)
    );
    let closed_by =
        NO_CALL_IDLE + crate::preface::QUIET_IO * crate::preface::MAX_QUIET_TURNS + SHUTDOWN_GRACE;
    let began = tokio::time::Instant::now();
    // Silent, and with one refused call, on each listener.
    let (_silent_agent, silent_agent) = h2_connection(running.agent_addr()).await;
    let (_silent_admin, silent_admin) = h2_connection(running.admin_addr).await;
    let (refused_send, refused) = h2_connection(running.admin_addr).await;
    let answer = grpc_send(&refused_send, "/retryplane.v1.AdminService/Get").await;
    let answer = answer.await.unwrap();
    assert_eq!(answer.headers()["grpc-status"], "16", "UNAUTHENTICATED");
    // One admitted call.
    let (admitted_send, admitted) = h2_connection(running.admin_addr).await;
    assert_eq!(
        admitted_get(admitted_send.clone()).await,
        (http::StatusCode::OK, "0".to_owned())
    );
    for (what, conn) in [
        ("silent agent", silent_agent),
        ("silent admin", silent_admin),
    ] {
        let ended = tokio::time::timeout(closed_by.saturating_sub(began.elapsed()), conn).await;
        assert!(ended.is_ok(), "{what}: kept for {:?}", began.elapsed());
        assert!(
            began.elapsed() >= NO_CALL_IDLE,
            "{what}: {:?}",
            began.elapsed()
        );
    }
    assert!(
        !admitted.is_finished(),
        "the admitted connection was closed"
    );
    assert!(
        !refused.is_finished(),
        "the refused call's connection was closed"
    );
    running.shutdown().await.unwrap();
}

/// With a tokens file, a full listener makes room by closing the oldest connection no token
/// was admitted on: a peer with no token that holds every place of the admin listener with
/// silent connections (each kept 10 s, so 26 a second kept it full) does not keep an admin
/// client with a token out; a connection whose call a token admitted is not closed for room.
#[tokio::test]
async fn silent_connections_without_a_token_do_not_keep_a_client_with_one_out() {
    let (_dir, cfg) = with_tokens(V1);
    let running = start(cfg).await.unwrap();
    // A client with a token first: its connection is kept through the flood.
    let (first, first_conn) = h2_connection(running.admin_addr).await;
    assert_eq!(
        admitted_get(first.clone()).await,
        (http::StatusCode::OK, "0".to_owned())
    );
    let mut flood = Vec::new();
    for _ in 0..crate::places::ADMIN_MAX_CONNECTIONS {
        flood.push(
            tokio::net::TcpStream::connect(running.admin_addr)
                .await
                .unwrap(),
        );
    }
    let legit = async {
        let (send, _conn) = h2_connection(running.admin_addr).await;
        admitted_get(send).await
    };
    // Well under the 10 s a silent connection is kept.
    let served = tokio::time::timeout(Duration::from_secs(5), legit).await;
    assert_eq!(
        served.expect("the client with a token was not served"),
        (http::StatusCode::OK, "0".to_owned())
    );
    assert!(
        !first_conn.is_finished(),
        "the admitted connection was closed"
    );
    assert_eq!(
        admitted_get(first).await,
        (http::StatusCode::OK, "0".to_owned())
    );
    drop(flood);
    running.shutdown().await.unwrap();
}

/// With a tokens file, a listener that one connection fills closes nothing while no other
/// waits: the only connection (a token admits no call on it yet) is served, on both its calls.
#[tokio::test]
async fn a_lone_connection_on_a_full_listener_is_served() {
    let (_dir, mut cfg) = with_tokens(V1);
    cfg.max_agent_connections = Some(1);
    let running = start(cfg).await.unwrap();
    let (send, conn) = h2_connection(running.agent_addr()).await;
    for _ in 0..2 {
        let answer = grpc_send(&send, "/grpc.health.v1.Health/Check").await;
        let answer = tokio::time::timeout(SHUTDOWN_GRACE, answer)
            .await
            .expect("no answer")
            .expect("the connection was closed");
        assert_eq!(answer.status(), 200);
    }
    assert!(!conn.is_finished());
    running.shutdown().await.unwrap();
}

/// The agent listener holds `max_agent_connections` at once: the next connection is not
/// served (its HTTP/2 handshake gets no answer) until one of them closes, and is then.
#[tokio::test]
async fn the_agent_listener_holds_at_most_its_cap_of_connections() {
    let (_dir, cfg) = with_file(V1);
    let running = start(ServeConfig {
        max_agent_connections: Some(2),
        ..cfg
    })
    .await
    .unwrap();
    let addr = running.agent_addr();
    let mut held = Vec::new();
    for _ in 0..2 {
        let (send, conn) = h2_connection(addr).await;
        // Served: a health check is answered.
        let answer = grpc_send(&send, "/grpc.health.v1.Health/Check").await;
        assert_eq!(answer.await.unwrap().status(), 200);
        held.push((send, conn));
    }
    // The third connects (the kernel's queue) but is not served while both are held.
    let (send, mut conn) = h2_connection(addr).await;
    let third = async {
        let answer = grpc_send(&send, "/grpc.health.v1.Health/Check").await;
        answer.await.unwrap().status()
    };
    tokio::pin!(third);
    // Long enough for an answer over loopback many times over.
    let waited = tokio::time::timeout(Duration::from_millis(500), &mut third).await;
    assert!(
        waited.is_err(),
        "the third connection was served: {waited:?}"
    );
    assert!(!conn.is_finished());
    // One held connection closes: the third is served.
    let (send, first) = held.remove(0);
    drop(send);
    first.abort();
    let status = tokio::time::timeout(SHUTDOWN_GRACE * 4, &mut third)
        .await
        .expect("the third connection was never served");
    assert_eq!(status, 200);
    conn.abort();
    let _ = (&mut conn).await;
    running.shutdown().await.unwrap();
}

/// A connection that opens no stream and answers every PING (what an h2 client that is polled
/// does) is closed once it has carried no stream for `connection_idle_timeout`, on both gRPC
/// listeners, and so is one whose last stream ended that long ago; a connection that carries
/// an agent's stream is kept, and takes new streams, however long it lives.
#[tokio::test]
async fn connections_without_a_stream_for_the_idle_timeout_are_closed_and_others_kept() {
    let (dir, cfg) = with_file(V1);
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr(), running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (_send, conn) = h2::client::handshake(tcp).await.unwrap();
        // Driven (PINGs answered) and streamless: it ends when the server closes it.
        let began = tokio::time::Instant::now();
        let ended = tokio::time::timeout(SHUTDOWN_GRACE * 2, conn).await;
        assert!(
            ended.is_ok(),
            "{addr}: a streamless connection was not closed: {ended:?}"
        );
        assert!(began.elapsed() >= idle, "{addr}: {:?}", began.elapsed());
    }
    // A connection whose one call ended: closed the idle timeout after it.
    let (send, conn) = h2_connection(running.admin_addr).await;
    let check = grpc_post("/grpc.health.v1.Health/Check");
    let (answer, _) = send
        .clone()
        .ready()
        .await
        .unwrap()
        .send_request(check, true)
        .unwrap();
    let answer = answer.await.unwrap();
    assert_eq!(answer.status(), 200);
    let mut body = answer.into_body();
    while body.data().await.is_some() {}
    let _ = body.trailers().await;
    let answered = tokio::time::Instant::now();
    let ended = tokio::time::timeout(SHUTDOWN_GRACE * 2, conn).await;
    assert!(ended.is_ok(), "a connection whose call ended was kept");
    assert!(answered.elapsed() >= idle, "{:?}", answered.elapsed());
    // An agent's stream, on a connection of its own.
    let (send, conn) = h2_connection(running.agent_addr).await;
    let request = grpc_post(crate::agent_route::CONNECT_PATH);
    let (response, mut body) = send
        .clone()
        .ready()
        .await
        .unwrap()
        .send_request(request, false)
        .unwrap();
    body.send_data(
        crate::frame_body::encode_frame(&hello("kept")).unwrap(),
        false,
    )
    .unwrap();
    let response = tokio::time::timeout(SHUTDOWN_GRACE, response)
        .await
        .unwrap()
        .unwrap();
    let mut reader = RawReader {
        body: response.into_body(),
        buf: Vec::new(),
    };
    let first = reader.next().await.unwrap();
    assert_eq!(first.decode_snapshot().unwrap().unwrap().version, 1);
    // Several idle timeouts pass (time passing is what is tested here).
    tokio::time::sleep(idle * 4).await;
    assert!(
        !conn.is_finished(),
        "the connection closed under its stream"
    );
    fs::write(dir.path().join("policies.yaml"), V2).unwrap();
    let next = tokio::time::timeout(SHUTDOWN_GRACE, async {
        loop {
            let message = reader.next().await.expect("the stream goes on");
            if let Some(snapshot) = message.decode_snapshot().unwrap() {
                return snapshot.version;
            }
        }
    })
    .await
    .expect("the next version reaches the stream");
    assert_eq!(next, 2);
    // The connection still takes a new stream.
    let check = grpc_post("/grpc.health.v1.Health/Check");
    let (answer, _) = send
        .clone()
        .ready()
        .await
        .expect("no GOAWAY")
        .send_request(check, true)
        .unwrap();
    assert_eq!(answer.await.unwrap().status(), 200);
    drop(body);
    running.shutdown().await.unwrap();
}

/// A streamless connection is closed for idleness even with PINGs every second (the shortest
/// keepalive interval): the moment without a byte it needs is shorter than that.
#[tokio::test]
async fn a_streamless_connection_is_closed_with_pings_every_second() {
    let (_dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        connection_idle_timeout: Duration::from_millis(300),
        keepalive_interval: Duration::from_secs(1),
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr(), running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (_send, conn) = h2::client::handshake(tcp).await.unwrap();
        let ended = tokio::time::timeout(SHUTDOWN_GRACE * 2, conn).await;
        assert!(ended.is_ok(), "{addr}: kept");
    }
    running.shutdown().await.unwrap();
}

/// A client that keeps its channel gets every call answered after the idle timeout: a channel
/// whose connection was closed for idleness gets a new one for its next call, without an error,
/// also one whose long call (a health Watch) was cut at its bound (UNAVAILABLE, "call again").
#[tokio::test]
async fn a_client_that_keeps_its_channel_gets_no_error_across_the_idle_timeout() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let (_dir, cfg) = with_file(V1);
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    let calls = |channel: Channel| async move {
        let mut client = AdminServiceClient::new(channel);
        let mut results = Vec::new();
        for _ in 0..3 {
            results.push(
                client
                    .fleet_status(pb::FleetStatusRequest::default())
                    .await
                    .map(drop)
                    .map_err(|s| format!("{:?}: {}", s.code(), s.message())),
            );
        }
        results
    };
    let watched = channel(running.admin_addr).await;
    let mut watch = HealthClient::new(watched.clone())
        .watch(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(watch.message().await.unwrap().is_some());
    let idle_channel = channel(running.admin_addr).await;
    assert!(calls(idle_channel.clone()).await.iter().all(Result::is_ok));
    // The Watch is cut at its bound.
    let cut = tokio::time::timeout(SHUTDOWN_GRACE, watch.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(cut.code(), tonic::Code::Unavailable, "{cut:?}");
    // Long enough for both connections to have been closed (the bound, the idle timeout and
    // the moment without a byte; time passing is what is tested here).
    tokio::time::sleep(idle * 6).await;
    let results = calls(watched).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let results = calls(idle_channel).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    drop(watch);
    running.shutdown().await.unwrap();
}

/// A connection that the shutdown's GOAWAY does not end (a peer that sent its preface and
/// settings, then reads nothing and never acks the GOAWAY's PING) is closed at the end of the
/// shutdown's grace: nothing of the control plane is left behind, and it starts again at once
/// on the same data directory (its store was still open in the connection's task, which
/// aborting the servers does not reach, until keepalive gave up on the peer).
#[tokio::test]
async fn a_connection_left_after_the_shutdowns_grace_is_closed_and_the_store_let_go() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg.clone()).await.unwrap();
    let mut held = Vec::new();
    for addr in [running.agent_addr(), running.admin_addr] {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        // The preface, and an empty SETTINGS frame.
        tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        held.push(tcp);
    }
    // Both connections served (the server's SETTINGS came) before the shutdown.
    for tcp in &mut held {
        let mut head = [0u8; 9];
        tokio::time::timeout(SHUTDOWN_GRACE, tcp.read_exact(&mut head))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(head[3], 4, "SETTINGS");
    }
    let began = tokio::time::Instant::now();
    running.shutdown().await.unwrap();
    assert!(
        began.elapsed() < SHUTDOWN_GRACE + Duration::from_secs(2),
        "{:?}",
        began.elapsed()
    );
    let again = tokio::time::timeout(Duration::from_secs(10), start(cfg))
        .await
        .unwrap()
        .expect("the store was let go");
    // And the peers' connections were closed: what they read ends.
    for tcp in &mut held {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(2), tcp.read_to_end(&mut rest)).await;
        assert!(read.is_ok(), "a connection outlived the shutdown");
    }
    again.shutdown().await.unwrap();
}

/// A call other than an agent's stream lasts at most the idle timeout, token or not: a health
/// Watch is ended with UNAVAILABLE ("call again"), and a health Check whose request the peer
/// never finishes is answered so; then their connections, left without a stream, are closed.
/// Without the bound a peer with no token held a connection for good with one such call.
#[tokio::test]
async fn calls_other_than_an_agents_stream_are_bounded_by_the_idle_timeout() {
    let (_dir, cfg) = with_file(V1);
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr(), running.admin_addr] {
        for (path, finished) in [
            ("/grpc.health.v1.Health/Watch", true),
            ("/grpc.health.v1.Health/Check", false),
        ] {
            let (send, conn) = h2_connection(addr).await;
            let request = grpc_post(path);
            let began = tokio::time::Instant::now();
            let (response, mut body) = send
                .ready()
                .await
                .unwrap()
                .send_request(request, false)
                .unwrap();
            if finished {
                // An empty HealthCheckRequest, and the request's end.
                body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
                    .unwrap();
            }
            let status = tokio::time::timeout(SHUTDOWN_GRACE * 2, async {
                let response = response.await.unwrap();
                if let Some(status) = response.headers().get("grpc-status") {
                    return status.to_str().unwrap().to_owned();
                }
                let mut answer = response.into_body();
                while answer.data().await.is_some() {}
                let trailers = answer.trailers().await.unwrap().unwrap();
                trailers["grpc-status"].to_str().unwrap().to_owned()
            })
            .await
            .unwrap_or_else(|_| panic!("{addr} {path}: the call was not ended"));
            assert_eq!(status, "14", "{addr} {path}: UNAVAILABLE");
            assert!(
                began.elapsed() >= idle,
                "{addr} {path}: {:?}",
                began.elapsed()
            );
            let ended = tokio::time::timeout(SHUTDOWN_GRACE * 2, conn).await;
            assert!(ended.is_ok(), "{addr} {path}: the connection was kept");
            drop(body);
        }
    }
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_does_not_wait_for_connections_that_never_send_anything() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    // Connected, and silent: no HTTP/2 preface (a port scanner, a half-open load balancer check).
    let silent = [
        tokio::net::TcpStream::connect(running.agent_addr)
            .await
            .unwrap(),
        tokio::net::TcpStream::connect(running.admin_addr)
            .await
            .unwrap(),
        tokio::net::TcpStream::connect(running.http_addr)
            .await
            .unwrap(),
    ];
    let began = tokio::time::Instant::now();
    running.shutdown().await.unwrap();
    // About PREFACE_GRACE (0.5 s); the 5 s grace would mean they were waited for.
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "the shutdown waited {:?} for connections that sent nothing",
        began.elapsed()
    );
    drop(silent);
}

/// A restart while a writer still has the policy file open (a deploy that restarts the control
/// plane while `scp` or a generator writes the file in place) does not publish the half it has
/// written (here a valid file without `search`, which would have dropped the endpoint for every
/// agent): the stored version is served until the writer closes the file, and the whole save
/// is published then, logged as the read its writer waited for (nothing invalid was read).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_start_does_not_publish_a_file_its_writer_still_holds_open() {
    use std::io::Write as _;
    const BOTH: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n  search:\n    max_attempts: 2\n";
    const SAVE: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n  search:\n    max_attempts: 2\n";
    let (dir, cfg) = with_file(BOTH);
    let running = start(cfg.clone()).await.unwrap();
    assert_eq!(current(&running).await.version, 1);
    running.shutdown().await.unwrap();
    // The writer truncates the file, writes its first half and pauses, the file still open.
    let path = dir.path().join("policies.yaml");
    let mut writer = fs::File::create(&path).unwrap();
    let cut = SAVE.find("  search:").unwrap();
    writer.write_all(&SAVE.as_bytes()[..cut]).unwrap();
    writer.flush().unwrap();
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let running = start(cfg).await.unwrap();
    let at_start = current(&running).await;
    // Nothing failed: the stored version is served, and the gauge says no reload failed.
    assert_eq!(last_reload_successful(&running).await, "1");
    // The writer finishes: the whole save is the next version.
    writer.write_all(&SAVE.as_bytes()[cut..]).unwrap();
    drop(writer);
    assert_eq!(
        at_start.version, 1,
        "start-up published the half-written file ({})",
        at_start.summary
    );
    eventually("the whole save is published", || async {
        current(&running).await.version == 2
    })
    .await;
    // Only `payments` changed: `search` was never dropped.
    let info = current(&running).await;
    assert_eq!(info.summary, "+0 endpoints, -0, 1 modified (payments)");
    assert_read_once_its_writer_closed(&log.text(), 2);
    running.shutdown().await.unwrap();
}

/// The same with a save that changes no policy (the writer wrote the file out again): one line
/// says it was read, and the version stays.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_start_that_waited_for_a_writer_of_the_same_policies_says_so_once() {
    use std::io::Write as _;
    const SAVE: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
    let (dir, cfg) = with_file(SAVE);
    let running = start(cfg.clone()).await.unwrap();
    running.shutdown().await.unwrap();
    let mut writer = fs::File::create(dir.path().join("policies.yaml")).unwrap();
    let cut = SAVE.find("  payments:").unwrap();
    writer.write_all(&SAVE.as_bytes()[..cut]).unwrap();
    writer.flush().unwrap();
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let running = start(cfg).await.unwrap();
    writer.write_all(&SAVE.as_bytes()[cut..]).unwrap();
    drop(writer);
    eventually("the read once the writer closed the file", || {
        let text = log.text();
        async move { text.contains("the policy file's writer closed it") }
    })
    .await;
    assert_read_once_its_writer_closed(&log.text(), 1);
    assert_eq!(current(&running).await.version, 1);
    running.shutdown().await.unwrap();
}

/// The one line that says the file start-up left to its writer was read once it closed it,
/// and no line saying it is valid again.
fn assert_read_once_its_writer_closed(log: &str, version: u64) {
    let read = "the policy file's writer closed it, and it is read";
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(read)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(&format!("version {version} is served")),
        "{log}"
    );
    assert!(!log.contains("valid again"), "{log}");
    assert!(!log.contains("policies did not change"), "{log}");
}

/// The same on a first start (an empty store): the start does not wait for the writer (a stop
/// signal ends the server as usual); the server is unready until the writer closes the file,
/// and its first version is the whole save.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_first_start_on_a_file_its_writer_holds_open_is_unready_until_the_whole_save() {
    use std::io::Write as _;
    const SAVE: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n  search:\n    max_attempts: 2\n";
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let mut writer = fs::File::create(dir.path().join("policies.yaml")).unwrap();
    let cut = SAVE.find("  search:").unwrap();
    writer.write_all(&SAVE.as_bytes()[..cut]).unwrap();
    writer.flush().unwrap();
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let running = tokio::time::timeout(Duration::from_secs(10), start(cfg))
        .await
        .expect("the start does not wait for the writer")
        .unwrap();
    assert_eq!(http_get(running.http_addr, "/readyz").await.0, 503);
    assert_eq!(last_reload_successful(&running).await, "0");
    writer.write_all(&SAVE.as_bytes()[cut..]).unwrap();
    drop(writer);
    eventually("the whole save is published", || async {
        http_get(running.http_addr, "/readyz").await.0 == 200
    })
    .await;
    let info = current(&running).await;
    assert_eq!(
        (info.version, info.summary.as_str()),
        (1, "+2 endpoints (payments, search), -0, 0 modified")
    );
    assert_read_once_its_writer_closed(&log.text(), 1);
    assert_eq!(last_reload_successful(&running).await, "1");
    running.shutdown().await.unwrap();
}

/// Start-up in file mode asks `/proc` whether the policy file is held open for writing; an
/// epoll elsewhere on the host whose `epoll_ctl` waits on a stopped FUSE daemon does not hold
/// it up (reading that epoll's `fdinfo` would wait as long, and `serve` looks at SIGTERM only
/// once the start returned). Needs root, bindfs and python3 (skipped otherwise).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_is_not_held_up_by_an_epoll_stuck_on_a_stopped_fuse_daemon() {
    let (_dir, cfg) = with_file(V1);
    let Some(stuck) = crate::writers::tests::StuckEpoll::new() else {
        return;
    };
    let started = tokio::time::timeout(std::time::Duration::from_secs(10), start(cfg)).await;
    stuck.release();
    let hung = started.is_err();
    if let Ok(Ok(running)) = started {
        running.shutdown().await.unwrap();
    }
    drop(stuck);
    assert!(!hung, "start-up did not return within 10 s");
}

/// A Hello that asks for heartbeats (`retryplane_proto::liveness`).
fn beating_hello(agent_id: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: agent_id.to_owned(),
            service: "checkout".to_owned(),
            instance_id: 7,
            heartbeats: true,
            ..Default::default()
        })),
    }
}

/// An agent stream over a bare HTTP/2 connection, so that a test sends the bytes of its
/// messages as it likes (a slow link, a trickle): the sending half, and the response.
async fn raw_stream(
    addr: SocketAddr,
    hello: &pb::AgentMessage,
) -> (h2::SendStream<bytes::Bytes>, RawReader) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let request = grpc_post(crate::agent_route::CONNECT_PATH);
    let mut send = send.ready().await.unwrap();
    let (response, mut body) = send.send_request(request, false).unwrap();
    body.send_data(crate::frame_body::encode_frame(hello).unwrap(), false)
        .unwrap();
    let response = tokio::time::timeout(SHUTDOWN_GRACE, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        response.headers()[retryplane_proto::liveness::HEARTBEAT_METADATA],
        "1"
    );
    let reader = RawReader {
        body: response.into_body(),
        buf: Vec::new(),
    };
    (body, reader)
}

/// The response side of [`raw_stream`]: its gRPC messages, then its status.
struct RawReader {
    body: h2::RecvStream,
    buf: Vec<u8>,
}

impl RawReader {
    /// The next message; `None` at the end of the messages.
    async fn next(&mut self) -> Option<pb::ServerMessage> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes(self.buf[1..5].try_into().unwrap());
                let end = 5 + usize::try_from(len).unwrap();
                if self.buf.len() >= end {
                    let message = prost::Message::decode(&self.buf[5..end]).unwrap();
                    self.buf.drain(..end);
                    return Some(message);
                }
            }
            let data = self.body.data().await?.unwrap();
            let _ = self.body.flow_control().release_capacity(data.len());
            self.buf.extend_from_slice(&data);
        }
    }

    /// Whether the report numbered `seq` is acknowledged within `within` (other messages
    /// before it are skipped; the stream's end or the time up is `false`).
    async fn acked(&mut self, seq: u64, within: Duration) -> bool {
        let read = async {
            while let Some(m) = self.next().await {
                if m.metrics_ack.is_some_and(|ack| ack.seq == seq) {
                    return true;
                }
            }
            false
        };
        tokio::time::timeout(within, read).await.unwrap_or(false)
    }

    /// The `grpc-status` of the trailers (after the messages).
    async fn status(&mut self) -> Option<String> {
        let trailers = self.body.trailers().await.ok().flatten()?;
        Some(trailers.get("grpc-status")?.to_str().unwrap().to_owned())
    }
}

/// Reads a raw stream's response until its end, bounded by `within`: its messages and its
/// `grpc-status`.
async fn read_to_end(
    reader: &mut RawReader,
    within: Duration,
) -> (Vec<pb::ServerMessage>, Option<String>) {
    let read = async {
        let mut messages = Vec::new();
        while let Some(m) = reader.next().await {
            messages.push(m);
        }
        (messages, reader.status().await)
    };
    tokio::time::timeout(within, read)
        .await
        .expect("the stream ends in time")
}

async fn connected(running: &Running, agent_id: &str) -> Option<bool> {
    let fleet = admin(running)
        .await
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    fleet
        .agents
        .iter()
        .find(|a| a.agent_id == agent_id)
        .map(|a| a.connected)
}

/// An agent that asks for heartbeats and then sends nothing, on a connection that stays up
/// (as behind an HTTP/2 proxy, which answers keepalive pings for it): the control plane sends
/// it keepalives, then ends its stream with UNAVAILABLE after the liveness timeout and lists it
/// disconnected. An agent that does not ask keeps its silent stream and is sent no keepalive.
#[tokio::test]
async fn a_stream_whose_agent_falls_silent_is_ended_and_its_agent_listed_disconnected() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.metrics_interval = Duration::from_millis(100);
    let running = start(cfg).await.unwrap();
    let opened = tokio::time::Instant::now();
    let (_beating_tx, mut beating) =
        raw_stream(running.agent_addr, &beating_hello("beating")).await;
    let (_quiet_tx, mut quiet) = open_stream(running.agent_addr, hello("quiet"), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut quiet).await, 1);
    let (messages, status) = read_to_end(&mut beating, SHUTDOWN_GRACE * 2).await;
    let limit = retryplane_proto::liveness::liveness_timeout(Duration::from_millis(100));
    assert!(opened.elapsed() >= limit, "{:?}", opened.elapsed());
    assert_eq!(status.as_deref(), Some("14"), "UNAVAILABLE");
    assert!(messages[0].snapshot.is_some());
    let keepalives = messages.iter().filter(|m| m.keepalive.is_some()).count();
    assert!(keepalives >= 10, "{keepalives} keepalives in {limit:?}");
    eventually("the silent agent is listed disconnected", || async {
        connected(&running, "beating").await == Some(false)
    })
    .await;
    assert_eq!(connected(&running, "quiet").await, Some(true));
    let (_, metrics) = http_get(running.http_addr, "/metrics").await;
    assert!(
        metrics.contains("\nretryplane_server_streams_silent_total 1\n"),
        "{metrics}"
    );
    // The quiet agent got no keepalive (nor anything else) meanwhile.
    let nothing = tokio::time::timeout(Duration::from_millis(300), quiet.message()).await;
    assert!(nothing.is_err(), "{nothing:?}");
    running.shutdown().await.unwrap();
}

/// An agent that sends a keepalive every period keeps its stream past the liveness timeout.
#[tokio::test]
async fn an_agent_that_sends_keepalives_keeps_its_stream() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.metrics_interval = Duration::from_millis(100);
    let running = start(cfg).await.unwrap();
    let (tx, mut inbound) = open_stream(running.agent_addr, beating_hello("beating"), None)
        .await
        .unwrap();
    assert_eq!(next_version(&mut inbound).await, 1);
    let limit = retryplane_proto::liveness::liveness_timeout(Duration::from_millis(100));
    let until = tokio::time::Instant::now() + limit * 2;
    let keepalive = pb::AgentMessage {
        kind: Some(Kind::Keepalive(pb::Keepalive {})),
    };
    while tokio::time::Instant::now() < until {
        tx.send(keepalive.clone()).await.unwrap();
        // Read what comes meanwhile (keepalives); the stream must not end.
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), inbound.message()).await {
            let m = m.unwrap().expect("the stream goes on");
            assert!(m.keepalive.is_some(), "{m:?}");
        }
    }
    assert_eq!(connected(&running, "beating").await, Some(true));
    running.shutdown().await.unwrap();
}

/// A message longer than the link carries within the liveness timeout (a large report backlog
/// on a slow uplink) keeps the stream while 4 KiB of it come within the timeout; a peer that
/// trickles fewer bytes of a message that never ends is taken for gone.
#[tokio::test]
async fn a_long_message_on_a_slow_link_keeps_the_stream_and_a_trickle_does_not() {
    let (_dir, mut cfg) = with_file(V1);
    cfg.metrics_interval = Duration::from_millis(100);
    let running = start(cfg).await.unwrap();
    let limit = retryplane_proto::liveness::liveness_timeout(Duration::from_millis(100));
    // About 80 KB of counts, sent 2 KiB every 100 ms: about 4 s, well past the limit.
    let report = pb::AgentMessage {
        kind: Some(Kind::Metrics(pb::MetricsReport {
            seq: 1,
            endpoints: (0..4_000)
                .map(|i| pb::EndpointCounters {
                    endpoint: format!("endpoint-{i:05}"),
                    calls: 1,
                    attempts: 1,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })),
    };
    let frame = crate::frame_body::encode_frame(&report).unwrap();
    assert!(frame.len() > 64 * 1024, "{}", frame.len());
    let (mut slow, mut slow_in) = raw_stream(running.agent_addr, &beating_hello("slow")).await;
    let (mut trickle, mut trickle_in) =
        raw_stream(running.agent_addr, &beating_hello("trickle")).await;
    let started = tokio::time::Instant::now();
    let mut chunks = frame.chunks(2048);
    let mut trickled = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // No burst of ticks after a late one: the trickle stays a trickle.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(chunk) = chunks.next() else { break };
        slow.send_data(bytes::Bytes::copy_from_slice(chunk), false)
            .unwrap();
        // The trickle: a byte a period (10 a second) of a message that says it is 1 MiB long.
        let bytes = if trickled == 0 {
            let mut head = vec![0u8];
            head.extend_from_slice(&(1u32 << 20).to_be_bytes());
            head
        } else {
            vec![0]
        };
        trickled += 1;
        let _ = trickle.send_data(bytes.into(), false);
    }
    assert!(started.elapsed() > limit + Duration::from_secs(1));
    // The slow report arrived whole and was answered; the stream is up.
    let mut acked = false;
    for _ in 0..100 {
        let m = tokio::time::timeout(SHUTDOWN_GRACE, slow_in.next())
            .await
            .unwrap()
            .expect("the slow stream goes on");
        if m.metrics_ack.is_some_and(|ack| ack.seq == 1) {
            acked = true;
            break;
        }
    }
    assert!(acked, "the slow report was answered");
    assert_eq!(connected(&running, "slow").await, Some(true));
    // The trickle's stream ended (well before its message could).
    let (_, status) = read_to_end(&mut trickle_in, SHUTDOWN_GRACE).await;
    assert_eq!(status.as_deref(), Some("14"), "UNAVAILABLE");
    assert_eq!(connected(&running, "trickle").await, Some(false));
    running.shutdown().await.unwrap();
}

/// Agents' messages under way share one room (`StreamLimits::max_inbound_bytes`), charged as
/// their bytes come. One stream sends all but the last bytes of the largest message: it holds
/// the whole room, shown in `/metrics` (a header alone holds nothing). Another's message in two
/// frames then ends its stream with RESOURCE_EXHAUSTED at once; a report whole in one frame is
/// answered meanwhile; and once the first message is given up, the room is free again. The
/// refusal is logged as the control plane's load, not as the agent's fault.
#[tokio::test]
async fn agents_messages_under_way_share_one_room() {
    let largest = retryplane_proto::MAX_AGENT_MESSAGE_BYTES;
    let (_dir, mut cfg) = with_file(V1);
    cfg.stream_limits.max_inbound_bytes = largest;
    let (log, _guard) = crate::test_logs::capture("retryplane_server=warn");
    let running = start(cfg).await.unwrap();
    let (mut holder, holder_in) = raw_stream(running.agent_addr, &beating_hello("holder")).await;
    let mut head = vec![0u8];
    head.extend_from_slice(&u32::try_from(largest).unwrap().to_be_bytes());
    head.push(0);
    holder.send_data(head.into(), false).unwrap();
    eventually(
        "the byte that came is held, not the length announced",
        || async {
            http_get(running.http_addr, "/metrics")
                .await
                .1
                .contains("\nretryplane_server_inbound_held_bytes 1\n")
        },
    )
    .await;
    holder
        .send_data(vec![0; largest - 1_000].into(), false)
        .unwrap();
    let held = format!("\nretryplane_server_inbound_held_bytes {largest}\n");
    eventually("the room is held", || async {
        http_get(running.http_addr, "/metrics")
            .await
            .1
            .contains(&held)
    })
    .await;

    let numbered = |seq| {
        crate::frame_body::encode_frame(&pb::AgentMessage {
            kind: Some(Kind::Metrics(pb::MetricsReport {
                seq,
                endpoints: vec![pb::EndpointCounters {
                    endpoint: "e".to_owned(),
                    calls: 1,
                    attempts: 1,
                    ..Default::default()
                }],
                ..Default::default()
            })),
        })
        .unwrap()
    };
    let (mut waiter, mut waiter_in) =
        raw_stream(running.agent_addr, &beating_hello("waiter")).await;
    let report = numbered(1);
    let (first, second) = report.split_at(10);
    waiter
        .send_data(bytes::Bytes::copy_from_slice(first), false)
        .unwrap();
    waiter
        .send_data(bytes::Bytes::copy_from_slice(second), false)
        .unwrap();
    let (whole, mut whole_in) = raw_stream(running.agent_addr, &beating_hello("whole")).await;
    let mut whole = whole;
    whole.send_data(numbered(1), false).unwrap();
    assert!(
        whole_in.acked(1, SHUTDOWN_GRACE).await,
        "a report whole in one frame is answered"
    );

    let (messages, status) = read_to_end(&mut waiter_in, SHUTDOWN_GRACE).await;
    assert_eq!(status.as_deref(), Some("8"), "RESOURCE_EXHAUSTED");
    assert!(
        !messages.iter().any(|m| m.metrics_ack.is_some()),
        "{messages:?}"
    );
    let (_, metrics) = http_get(running.http_addr, "/metrics").await;
    for line in [
        "\nretryplane_server_inbound_refused_total 1\n",
        held.as_str(),
    ] {
        assert!(metrics.contains(line), "{line:?} in {metrics}");
    }
    let logged = log.text();
    assert_eq!(
        logged
            .matches("ending an agent stream: agents' messages under way fill the room")
            .count(),
        1,
        "{logged}"
    );
    assert!(
        !logged.contains("the agent sent a message this control plane cannot take"),
        "{logged}"
    );

    // The holder gives its message up: its stream ends, and the room with it.
    holder.send_reset(h2::Reason::CANCEL);
    drop(holder_in);
    eventually("the room is given back", || async {
        http_get(running.http_addr, "/metrics")
            .await
            .1
            .contains("\nretryplane_server_inbound_held_bytes 0\n")
    })
    .await;
    let (mut after, mut after_in) = raw_stream(running.agent_addr, &beating_hello("after")).await;
    after
        .send_data(bytes::Bytes::copy_from_slice(first), false)
        .unwrap();
    after
        .send_data(bytes::Bytes::copy_from_slice(second), false)
        .unwrap();
    assert!(
        after_in.acked(1, SHUTDOWN_GRACE).await,
        "once the room is free, a report in two frames is answered"
    );
    running.shutdown().await.unwrap();
}

/// A typed document of more endpoints than a policy file can hold, sent over the wire: the
/// control plane counts its endpoints on the message's bytes and cuts the policy out before
/// the decode (a document of bare endpoints is two bytes an endpoint there, hundreds once
/// decoded). Validate answers with the size error, Apply refuses a viewer for its role and
/// a file-mode server for its mode before it looks at the size, then refuses the change and
/// counts it. The count is of endpoints and routes only (the list entries of `defaults:` are
/// not in it, as they are in the count of a decoded document): that is how these tests know
/// the policy was never decoded.
#[tokio::test]
async fn a_document_larger_than_a_file_can_hold_is_refused_on_its_bytes_after_the_checks_before_it()
{
    let endpoints = retryplane_proto::convert::MAX_ITEMS / 2 + 1;
    let document = pb::PolicyDocument {
        defaults: Some(pb::Overlay {
            idempotent_methods: Some(pb::MethodList {
                methods: vec!["GET".to_owned(), "PUT".to_owned()],
            }),
            ..Default::default()
        }),
        endpoints: (0..endpoints)
            .map(|i| pb::Endpoint {
                name: format!("e{i}"),
                overlay: None,
                routes: vec![],
            })
            .collect(),
    };
    let source = Some(pb::PolicySource {
        kind: Some(pb::policy_source::Kind::Document(document)),
        origin: String::new(),
    });
    // On the wire: 2 items an endpoint; decoded, the 2 methods as well.
    let on_the_wire = format!("the document is too large: {} items", 2 * endpoints);
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("policies.yaml"), V1).unwrap();
    fs::write(
        dir.path().join("tokens.yaml"),
        format!("{TOKENS}  - {{name: vic, role: viewer, secret: viewer-secret-0123456789}}\n"),
    )
    .unwrap();
    for api_mode in [true, false] {
        let mut cfg = config(dir.path());
        cfg.tokens_file = Some(dir.path().join("tokens.yaml"));
        cfg.data_dir = dir.path().join(format!("data-{api_mode}"));
        cfg.api_mode = api_mode;
        let running = start(cfg).await.unwrap();
        let mut client = admin(&running).await;
        let checked = client
            .validate(authorized(
                pb::ValidateRequest {
                    source: source.clone(),
                },
                "viewer-secret-0123456789",
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(!checked.valid);
        assert_eq!(checked.diagnostics.len(), 1, "{:?}", checked.diagnostics);
        assert!(
            checked.diagnostics[0].message.starts_with(&on_the_wire),
            "{}",
            checked.diagnostics[0].message
        );
        let apply = |secret: &str| {
            authorized(
                pb::ApplyRequest {
                    source: source.clone(),
                    ..Default::default()
                },
                secret,
            )
        };
        let viewer = client
            .apply(apply("viewer-secret-0123456789"))
            .await
            .unwrap_err();
        assert_eq!(viewer.code(), Code::PermissionDenied, "{viewer:?}");
        let refused = client
            .apply(apply("admin-secret-0123456789"))
            .await
            .unwrap_err();
        if api_mode {
            assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
            assert!(
                refused.message().contains(&on_the_wire),
                "{}",
                refused.message()
            );
            assert_eq!(running.control().metrics.rejected_changes.get(), 1);
        } else {
            assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
            assert_eq!(running.control().metrics.rejected_changes.get(), 0);
        }
        let got = client
            .get(authorized(
                pb::GetRequest { version: 0 },
                "admin-secret-0123456789",
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.info.unwrap().version, 1, "nothing stored");
        running.shutdown().await.unwrap();
    }
}

/// A running control plane warns of what its tokens file lets no one do, at start and at each
/// reload: no agent token (no agent can connect), and in API mode no admin token; a file that
/// gives every role is not warned of.
#[tokio::test]
async fn a_tokens_file_missing_a_role_is_warned_of_at_start_and_at_each_reload() {
    const NO_AGENT: &str = "no `agent` token: no agent can connect";
    const NO_ADMIN: &str = "no `admin` token: no one can apply";
    let (dir, mut cfg) = with_file(V1);
    let tokens_file = dir.path().join("tokens.yaml");
    fs::write(
        &tokens_file,
        "tokens: [{name: ops, role: viewer, secret: viewer-secret-0123456789}]\n",
    )
    .unwrap();
    cfg.tokens_file = Some(tokens_file.clone());
    cfg.api_mode = true;
    let (running, text) = start_logged(cfg, "retryplane_server=warn").await;
    assert!(text.contains(NO_AGENT) && text.contains(NO_ADMIN), "{text}");
    let reload = |running: &Running| {
        let (log, guard) = crate::test_logs::capture("retryplane_server=warn");
        assert!(running.reload_tokens().unwrap().is_some());
        drop(guard);
        log.text()
    };
    fs::write(&tokens_file, TOKENS).unwrap();
    let text = reload(&running);
    assert!(
        !text.contains(NO_AGENT) && !text.contains(NO_ADMIN),
        "{text}"
    );
    fs::write(
        &tokens_file,
        "tokens: [{name: alice, role: admin, secret: admin-secret-0123456789}]\n",
    )
    .unwrap();
    let text = reload(&running);
    assert!(
        text.contains(NO_AGENT) && !text.contains(NO_ADMIN),
        "{text}"
    );
    running.shutdown().await.unwrap();
}
