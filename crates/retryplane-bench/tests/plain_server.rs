//! The plain tonic baseline server as the fan-out bench runs it: started as a process with
//! `retryplane serve`'s command line on `127.0.0.1:0`, agents from the bench's own code, one
//! published version seen by every agent and every ACK counted on `/metrics`; and the fan-out
//! bench's own measurement (`measure::run`) against it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

// The bench is binaries only: its process, agent and policy modules are compiled into this
// test as they are (they name `crate::WAIT` and `crate::stream`).
#[allow(dead_code)]
#[path = "../src/agents.rs"]
mod agents;
#[allow(dead_code)]
#[path = "../src/measure.rs"]
mod measure;
#[path = "../src/percentile.rs"]
mod percentile;
#[allow(dead_code)]
#[path = "../src/policy.rs"]
mod policy;
#[allow(dead_code)]
#[path = "../src/server.rs"]
mod server;
#[allow(dead_code)]
#[path = "../src/stream.rs"]
mod stream;

use std::path::Path;
use std::time::Duration;

use retryplane_proto::pb::{self, admin_service_client::AdminServiceClient, policy_source};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::agents::Agents;
use crate::policy::policy_yaml;
use crate::server::ServerProcess;

/// The bound on every wait of this test (and of the bench modules it includes).
pub const WAIT: Duration = Duration::from_secs(10);

const AGENTS: usize = 8;
const ENDPOINTS: usize = 3;

fn plain_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_retryplane-bench-plain-server"))
}

/// `path` (absolute) written relative to the current directory, as a user would: `..` for each
/// directory below the one both share, then the rest of `path`.
fn relative_to_here(path: &Path) -> std::path::PathBuf {
    let here = std::env::current_dir().unwrap();
    let shared = here
        .components()
        .zip(path.components())
        .take_while(|(a, b)| a == b)
        .count();
    let mut relative = std::path::PathBuf::new();
    for _ in here.components().skip(shared) {
        relative.push("..");
    }
    relative.extend(path.components().skip(shared));
    relative
}

async fn channel(addr: std::net::SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(WAIT)
        .timeout(WAIT)
        .connect()
        .await
        .unwrap()
}

/// Polls `/metrics` until `name` equals `want`, at most [`WAIT`]; the last value otherwise.
async fn metric_reaches(server: &ServerProcess, name: &str, want: f64) -> f64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let got = server.metric(name).await.unwrap();
        if got == want || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The current version's info, from `Get`.
async fn current(admin: &mut AdminServiceClient<Channel>) -> pb::VersionInfo {
    admin
        .get(pb::GetRequest { version: 0 })
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap()
}

fn apply(round: u64, expected_version: u64, dry_run: bool) -> pb::ApplyRequest {
    pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(policy_source::Kind::Yaml(policy_yaml(ENDPOINTS, round))),
            origin: "test".to_owned(),
        }),
        expected_version: Some(expected_version),
        dry_run,
        force: false,
    }
}

#[tokio::test]
async fn every_agent_gets_a_published_version_and_every_ack_is_counted() {
    let server = ServerProcess::start(plain_bin(), &policy_yaml(ENDPOINTS, 0))
        .await
        .unwrap();
    let mut admin = AdminServiceClient::new(channel(server.admin_addr).await);
    let info = current(&mut admin).await;
    assert_eq!(info.version, 1, "the seed file is version 1");

    // Agent 0 decodes every snapshot in full and checks it carries ENDPOINTS endpoints.
    let mut agents = Agents::connect(server.agent_addr, 2, ENDPOINTS)
        .await
        .unwrap();
    agents.spawn(0..AGENTS);
    agents.wait_version(0..AGENTS, 1).await.unwrap();
    let n = AGENTS as f64;
    let connected = "retryplane_server_agents_connected";
    let acks = "retryplane_server_acks_total";
    assert_eq!(metric_reaches(&server, connected, n).await, n);
    assert_eq!(metric_reaches(&server, acks, n).await, n);

    // A dry run publishes nothing; a stale expected version is refused.
    let dry = admin.apply(apply(1, 1, true)).await.unwrap().into_inner();
    assert_eq!((dry.version, dry.changed), (1, false));
    let stale = admin.apply(apply(1, 7, false)).await.unwrap_err();
    assert_eq!(stale.code(), tonic::Code::Aborted);

    let applied = admin.apply(apply(1, 1, false)).await.unwrap().into_inner();
    assert_eq!((applied.version, applied.changed), (2, true));
    // Fails if an agent got the dry run's or another version instead, or got it twice.
    agents.wait_version(0..AGENTS, 2).await.unwrap();
    assert_eq!(metric_reaches(&server, acks, 2.0 * n).await, 2.0 * n);
    let info = current(&mut admin).await;
    assert_eq!(info.version, 2);
    assert_eq!(info.content_hash, applied.content_hash);

    let history = admin
        .history(pb::HistoryRequest::default())
        .await
        .unwrap_err();
    assert_eq!(history.code(), tonic::Code::Unimplemented);

    // A stream that does not start with Hello is refused; the others keep their streams.
    let (tx, rx) = mpsc::channel(1);
    tx.send(pb::AgentMessage {
        kind: Some(pb::agent_message::Kind::Ack(pb::Ack::default())),
    })
    .await
    .unwrap();
    let refused =
        pb::agent_service_client::AgentServiceClient::new(channel(server.agent_addr).await)
            .connect(ReceiverStream::new(rx))
            .await
            .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(server.metric(connected).await.unwrap(), n);

    // Agents that go away leave the gauge.
    agents.shutdown().await;
    assert_eq!(metric_reaches(&server, connected, 0.0).await, 0.0);
    server.stop().await.unwrap();
}

/// The fan-out bench's "publish → every agent", measured as the
/// bench measures it (`measure::run`) against the plain tonic server, lies where it must: the
/// publish instant is after the Apply call started and no later than the first agent's
/// arrival, so per round `last - first <= last - publish <= last - t0`, and so for the p50 and
/// p99 over rounds. A sign or unit slip in the conversion between the system clock and the
/// bench's monotonic clock, or a round that read an earlier publish's time, breaks it.
#[tokio::test]
async fn a_server_binary_given_by_a_relative_path_starts() {
    // The server runs in a temporary directory of its own: the path is read against ours.
    let relative = relative_to_here(plain_bin());
    assert!(relative.is_relative(), "{}", relative.display());
    let server = ServerProcess::start(&relative, &policy_yaml(ENDPOINTS, 0))
        .await
        .unwrap();
    let mut admin = AdminServiceClient::new(channel(server.admin_addr).await);
    assert_eq!(current(&mut admin).await.version, 1);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn publish_to_every_agent_lies_between_the_fan_out_and_the_apply_call_figure() {
    let cfg = measure::Config {
        agents: 8,
        endpoints: 3,
        connections: 2,
        rounds: 6,
        warmup: 1,
        server_bin: std::path::PathBuf::from(env!("CARGO_BIN_EXE_retryplane-bench-plain-server")),
    };
    let o = measure::run(&cfg).await.unwrap();
    for (name, spread, published, all) in [
        ("p50", o.spread_p50_ms, o.published_p50_ms, o.all_p50_ms),
        ("p99", o.spread_p99_ms, o.published_p99_ms, o.all_p99_ms),
    ] {
        assert!(
            published.is_finite() && spread <= published && published <= all,
            "{name}: first → last {spread} ms, publish → last {published} ms, Apply call → last {all} ms"
        );
    }
}
