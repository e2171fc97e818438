//! An agent that reads its stream slowly, over real sockets on 127.0.0.1:0 with a raw tonic
//! client of the generated proto: it gets the newest version next, not each one published
//! while it read.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use retryplane_proto::pb::{self, agent_message::Kind};
use retryplane_server::server::{Running, ServeConfig, start};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Status, Streaming};

use support::{channel, with_file};

const WAIT: Duration = Duration::from_secs(15);

/// A policy distinct for every `k`.
fn policy(k: u32) -> String {
    format!("version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n  v{k}: {{}}\n")
}

struct Plane {
    running: Running,
    _dir: tempfile::TempDir,
}

async fn plane_with(tune: impl FnOnce(&mut ServeConfig)) -> Plane {
    let (dir, mut cfg) = with_file(&policy(2));
    cfg.api_mode = true;
    tune(&mut cfg);
    let running = start(cfg).await.expect("server starts");
    Plane { running, _dir: dir }
}

async fn plane() -> Plane {
    plane_with(|_| {}).await
}

impl Plane {
    async fn admin(&self) -> pb::admin_service_client::AdminServiceClient<Channel> {
        pb::admin_service_client::AdminServiceClient::new(channel(self.running.admin_addr).await)
    }
    async fn apply(&self, yaml: &str) -> pb::ApplyResponse {
        self.admin()
            .await
            .apply(pb::ApplyRequest {
                source: Some(pb::PolicySource {
                    kind: Some(pb::policy_source::Kind::Yaml(yaml.to_owned())),
                    origin: "test".into(),
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    }
}

fn hello_full(id: &str, instance: u64, version: u64, hash: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            agent_version: "test".to_owned(),
            last_applied_version: version,
            last_applied_hash: hash.to_owned(),
            instance_id: instance,
            ..Default::default()
        })),
    }
}

fn hello(id: &str) -> pb::AgentMessage {
    hello_full(id, 7, 0, "")
}

struct Agent {
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: Streaming<pb::ServerMessage>,
}

impl Agent {
    async fn connect(channel: Channel, first: pb::AgentMessage) -> Result<Agent, Status> {
        let (tx, rx) = mpsc::channel(64);
        tx.send(first).await.unwrap();
        let mut client = pb::agent_service_client::AgentServiceClient::new(channel);
        let response = client.connect(ReceiverStream::new(rx)).await?;
        Ok(Agent {
            tx,
            rx: response.into_inner(),
        })
    }

    /// The next message within `wait`: `Ok(None)` when nothing came in time.
    async fn next_within(&mut self, wait: Duration) -> Result<Option<pb::ServerMessage>, Status> {
        match tokio::time::timeout(wait, self.rx.message()).await {
            Err(_) => Ok(None),
            Ok(Ok(Some(m))) => Ok(Some(m)),
            Ok(Ok(None)) => Err(Status::cancelled("stream ended (OK)")),
            Ok(Err(s)) => Err(s),
        }
    }

    /// The next snapshot within `wait` (skipping keepalives and metrics acks).
    async fn snapshot_within(&mut self, wait: Duration) -> Result<Option<pb::Snapshot>, Status> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let Some(m) = self.next_within(left).await? else {
                return Ok(None);
            };
            if let Some(s) = m
                .decode_snapshot()
                .map_err(|e| Status::internal(e.to_string()))?
            {
                return Ok(Some(s));
            }
        }
    }

    async fn snapshot(&mut self) -> pb::Snapshot {
        self.snapshot_within(WAIT)
            .await
            .unwrap()
            .expect("a snapshot in time")
    }

    async fn send(&self, kind: Kind) {
        self.tx
            .send(pb::AgentMessage { kind: Some(kind) })
            .await
            .unwrap();
    }

    async fn ack(&self, s: &pb::Snapshot) {
        self.send(Kind::Ack(pb::Ack {
            version: s.version,
            nonce: s.nonce.clone(),
        }))
        .await;
    }
}

fn big_policy(n: usize, k: u32) -> String {
    let mut big = String::from("version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n");
    for i in 0..n {
        big.push_str(&format!(
            "  endpoint-with-a-long-name-{i:05}:\n    max_attempts: 3\n"
        ));
    }
    big.push_str(&format!("  v{k}: {{}}\n"));
    big
}

/// A channel whose HTTP/2 windows are small, so a client that does not read stops the server's
/// sends soon (a client's default stream window holds many small snapshots).
async fn small_window_channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .unwrap()
}

/// Reads every snapshot until `last`: the versions got.
async fn read_up_to(a: &mut Agent, last: u64) -> Vec<u64> {
    let mut got = Vec::new();
    loop {
        let s = a.snapshot_within(Duration::from_secs(5)).await.unwrap();
        let Some(s) = s else { break };
        got.push(s.version);
        if s.version == last {
            a.ack(&s).await;
            // Nothing after the newest.
            assert!(
                a.snapshot_within(Duration::from_millis(500))
                    .await
                    .unwrap()
                    .is_none()
            );
            break;
        }
    }
    got
}

#[tokio::test]
async fn a_slow_reader_of_large_snapshots_gets_the_newest_not_a_queue_of_every_version() {
    let plane = plane().await;
    let v = plane.apply(&big_policy(3000, 0)).await;
    let ch = small_window_channel(plane.running.agent_addr).await;
    let mut a = Agent::connect(ch.clone(), hello("slow")).await.unwrap();
    let s = a.snapshot().await;
    assert_eq!(s.version, v.version);
    let frame = prost::Message::encoded_len(&s);
    a.ack(&s).await;
    let mut last = 0;
    for k in 1..=25 {
        last = plane.apply(&big_policy(3000, k)).await.version;
    }
    let got = read_up_to(&mut a, last).await;
    eprintln!(
        "slow reader (snapshots of {frame} bytes, 64 KiB window) got {} versions: {got:?}",
        got.len()
    );
    assert_eq!(got.last(), Some(&last), "{got:?}");
    assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
    // The one being sent when the agent stopped reading, one its connection's client buffers
    // had taken, one in the stream's own queue, then the newest: a snapshot still waiting
    // for room is replaced by each newer version.
    assert!(
        got.len() <= 4,
        "a queue of stale versions before the newest: {got:?}"
    );
    plane.running.shutdown().await.unwrap();
}
