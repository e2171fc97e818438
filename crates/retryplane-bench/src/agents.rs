//! Raw protocol agents in the bench process: Hello, then for every snapshot a timestamp and an
//! ACK, spread over a few HTTP/2 connections.
//!
//! An agent decodes only the head of a snapshot (version and nonce; prost skips the encoded
//! policies in one step), so the bench's own CPU use, on the same cores as the server, stays
//! small. Agent 0 decodes every snapshot in full and checks its endpoint count, so the content
//! is known to arrive whole.

use std::net::SocketAddr;
use std::ops::Range;

use anyhow::{Context as _, bail};
use prost::Message as _;
use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::WAIT;

/// The fields of `retryplane.v1.Snapshot` an agent needs to time and ACK it.
#[derive(Clone, PartialEq, prost::Message)]
struct SnapshotHead {
    /// `Snapshot.version`.
    #[prost(uint64, tag = "1")]
    version: u64,
    /// `Snapshot.nonce`.
    #[prost(string, tag = "4")]
    nonce: String,
}

/// What an agent task reports to the coordinator.
#[derive(Debug)]
enum Event {
    /// A snapshot arrived.
    Received {
        agent: usize,
        version: u64,
        at: Instant,
        bytes: usize,
    },
    /// The agent stopped.
    Failed { agent: usize, error: String },
}

/// When every agent of a range received one version.
#[derive(Debug)]
pub struct Arrivals {
    /// Arrival time per agent of the range, in order.
    pub at: Vec<Instant>,
    /// Size of the encoded snapshot, in bytes.
    pub bytes: usize,
}

/// The agents and their connections.
pub struct Agents {
    channels: Vec<Channel>,
    tasks: JoinSet<()>,
    tx: mpsc::UnboundedSender<Event>,
    rx: mpsc::UnboundedReceiver<Event>,
    endpoints: usize,
    spawned: usize,
}

impl Agents {
    /// Opens `connections` HTTP/2 connections to `addr`; agents expect `endpoints` endpoints
    /// in every snapshot.
    pub async fn connect(
        addr: SocketAddr,
        connections: usize,
        endpoints: usize,
    ) -> anyhow::Result<Self> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .context("bad agent address")?
            .connect_timeout(WAIT)
            .tcp_nodelay(true);
        let mut channels = Vec::with_capacity(connections);
        for i in 0..connections {
            // `connect` (not lazy): one TCP connection per channel, opened now.
            let channel = tokio::time::timeout(WAIT, endpoint.connect())
                .await
                .with_context(|| format!("connection {i} to {addr}: no answer within {WAIT:?}"))?
                .with_context(|| format!("cannot open connection {i} to {addr}"))?;
            channels.push(channel);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        Ok(Self {
            channels,
            tasks: JoinSet::new(),
            tx,
            rx,
            endpoints,
            spawned: 0,
        })
    }

    /// Starts agents `range` (ids `bench-NNNNN`); agent `i` uses connection `i % C`.
    pub fn spawn(&mut self, range: Range<usize>) {
        for agent in range {
            let Some(channel) = self.channels.get(agent % self.channels.len()) else {
                return;
            };
            let task = run_agent(
                agent,
                channel.clone(),
                self.tx.clone(),
                (agent == 0).then_some(self.endpoints),
            );
            self.tasks.spawn(task);
            self.spawned = self.spawned.max(agent + 1);
        }
    }

    /// Waits until every agent of `range` received `version`, at most [`WAIT`].
    pub async fn wait_version(
        &mut self,
        range: Range<usize>,
        version: u64,
    ) -> anyhow::Result<Arrivals> {
        let deadline = Instant::now() + WAIT;
        let mut at: Vec<Option<Instant>> = vec![None; range.len()];
        let mut missing = range.len();
        let mut bytes = 0;
        while missing > 0 {
            let event = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "only {} of {} agents received version {version} within {WAIT:?}",
                        range.len() - missing,
                        range.len()
                    )
                })?
                .context("every agent task is gone")?;
            match event {
                Event::Received {
                    agent,
                    version: got,
                    at: when,
                    bytes: size,
                } => {
                    if got != version {
                        bail!("agent {agent} received version {got} while waiting for {version}");
                    }
                    let slot = agent
                        .checked_sub(range.start)
                        .and_then(|i| at.get_mut(i))
                        .with_context(|| {
                            format!("agent {agent} (outside {range:?}) received version {got}")
                        })?;
                    if slot.replace(when).is_some() {
                        bail!("agent {agent} received version {version} twice");
                    }
                    missing -= 1;
                    bytes = size;
                }
                Event::Failed { agent, error } => bail!("agent {agent} failed: {error}"),
            }
        }
        Ok(Arrivals {
            at: at.into_iter().flatten().collect(),
            bytes,
        })
    }

    /// How many agents were started.
    pub fn len(&self) -> usize {
        self.spawned
    }

    /// Ends every agent task and closes the connections.
    pub async fn shutdown(mut self) {
        self.tasks.shutdown().await;
    }
}

/// An agent task: reports its failure as an event.
async fn run_agent(
    agent: usize,
    channel: Channel,
    events: mpsc::UnboundedSender<Event>,
    check_endpoints: Option<usize>,
) {
    if let Err(e) = agent_loop(agent, channel, &events, check_endpoints).await {
        // The coordinator may be gone already (the bench is ending).
        let _ = events.send(Event::Failed {
            agent,
            error: format!("{e:#}"),
        });
    }
}

async fn agent_loop(
    agent: usize,
    channel: Channel,
    events: &mpsc::UnboundedSender<Event>,
    check_endpoints: Option<usize>,
) -> anyhow::Result<()> {
    let hello = pb::Hello {
        agent_id: format!("bench-{agent:05}"),
        service: "bench".to_owned(),
        agent_version: concat!("retryplane-bench/", env!("CARGO_PKG_VERSION")).to_owned(),
        ..Default::default()
    };
    let (tx, mut inbound) = crate::stream::open(channel, hello).await?;
    while let Some(message) = inbound.message().await.context("the stream failed")? {
        let at = Instant::now();
        let bytes = message
            .snapshot
            .context("a server message without a snapshot")?;
        let head = SnapshotHead::decode(bytes.clone()).context("cannot decode the snapshot")?;
        if let Some(expected) = check_endpoints {
            let full = pb::Snapshot::decode(bytes.clone()).context("cannot decode the snapshot")?;
            let got = full.policies.map_or(0, |p| p.endpoints.len());
            if got != expected {
                bail!(
                    "version {} carries {got} endpoints, expected {expected}",
                    head.version
                );
            }
        }
        events
            .send(Event::Received {
                agent,
                version: head.version,
                at,
                bytes: bytes.len(),
            })
            .context("the coordinator is gone")?;
        tx.send(pb::AgentMessage {
            kind: Some(Kind::Ack(pb::Ack {
                version: head.version,
                nonce: head.nonce,
            })),
        })
        .await
        .context("cannot queue the ACK")?;
    }
    bail!("the server ended the stream")
}
