//! A scripted control plane for the agent's stream tests: a tonic `AgentService` on
//! 127.0.0.1:0 that hands every stream and every agent message to the test, which decides what
//! to send. The real control plane never publishes an invalid policy, and does not let a test
//! look at the raw messages; this one does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use retryplane_proto::convert;
use retryplane_proto::pb::agent_message::Kind;
use retryplane_proto::pb::agent_service_server::{AgentService, AgentServiceServer};
use retryplane_proto::pb::{self, ServerMessage};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::plane::{WAIT, yaml};

/// The sending half of one stream, towards the agent.
pub type ToAgent = mpsc::Sender<Result<ServerMessage, Status>>;

/// What the scripted control plane saw.
#[derive(Debug)]
pub enum Event {
    /// The agent opened a stream; send on this to reach it, drop it to end the stream.
    Opened(ToAgent),
    /// A message from the agent.
    Message(Kind),
    /// The agent's side of a stream ended.
    Ended,
}

/// The scripted `AgentService`: every stream and message goes to the test.
#[derive(Clone)]
struct Scripted {
    events: mpsc::UnboundedSender<Event>,
    /// Whether a new stream's response says metrics reports are acknowledged. The script
    /// itself never acknowledges one; the test does, or does not.
    announce_acks: Arc<AtomicBool>,
    /// Keepalives received on every stream.
    keepalives: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl AgentService for Scripted {
    type ConnectStream = ReceiverStream<Result<ServerMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        self.events
            .send(Event::Opened(tx))
            .map_err(|_| Status::unavailable("the test is over"))?;
        let mut inbound = request.into_inner();
        let events = self.events.clone();
        let keepalives = self.keepalives.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                let kind = m.kind.expect("every agent message has a kind");
                // The agent's heartbeat (it sends one whatever the response says): counted,
                // not handed to the test, which scripts the rest.
                if matches!(kind, Kind::Keepalive(_)) {
                    keepalives.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                if events.send(Event::Message(kind)).is_err() {
                    return;
                }
            }
            let _ = events.send(Event::Ended);
        });
        let mut response = Response::new(ReceiverStream::new(rx));
        if self.announce_acks.load(Ordering::SeqCst) {
            response.metadata_mut().insert(
                retryplane_proto::METRICS_ACK_METADATA,
                tonic::metadata::MetadataValue::from_static("1"),
            );
        }
        Ok(response)
    }
}

/// The test's side of the scripted control plane.
pub struct Script {
    /// Where the agent connects.
    pub addr: SocketAddr,
    events: mpsc::UnboundedReceiver<Event>,
    announce_acks: Arc<AtomicBool>,
    keepalives: Arc<AtomicU64>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Script {
    pub async fn start() -> Script {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let announce_acks = Arc::new(AtomicBool::new(false));
        let keepalives = Arc::new(AtomicU64::new(0));
        let service = AgentServiceServer::new(Scripted {
            events: events_tx,
            announce_acks: announce_acks.clone(),
            keepalives: keepalives.clone(),
        });
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                }),
        );
        Script {
            addr,
            events,
            announce_acks,
            keepalives,
            stop: Some(stop),
            server,
        }
    }

    /// Whether streams opened from now on say, in their response metadata, that metrics
    /// reports are acknowledged (as the real control plane does). Off at the start, as on a
    /// control plane that predates acknowledgements.
    pub fn announce_acks(&self, on: bool) {
        self.announce_acks.store(on, Ordering::SeqCst);
    }

    /// The keepalives agents sent so far (on every stream).
    pub fn keepalives(&self) -> u64 {
        self.keepalives.load(Ordering::SeqCst)
    }

    /// The next event, within [`WAIT`].
    pub async fn next(&mut self) -> Event {
        tokio::time::timeout(WAIT, self.events.recv())
            .await
            .expect("the agent does something in time")
            .expect("the server is up")
    }

    /// The next agent message on the open stream that is not a metrics report.
    pub async fn reply(&mut self) -> Kind {
        loop {
            match self.next().await {
                Event::Message(Kind::Metrics(_)) => {}
                Event::Message(kind) => return kind,
                other => panic!("expected a message on the open stream, got {other:?}"),
            }
        }
    }

    /// Waits for a new stream and its Hello; the old stream may end on the way (even after the
    /// new one opened), and metrics reports may come, but nothing else.
    pub async fn reconnected(&mut self) -> (ToAgent, pb::Hello) {
        let to_agent = loop {
            match self.next().await {
                Event::Opened(tx) => break tx,
                Event::Ended | Event::Message(Kind::Metrics(_)) => {}
                other => panic!("expected only a new stream, got {other:?}"),
            }
        };
        // An earlier stream's end may still come before the Hello: the events of two streams
        // interleave, and a new stream that ends before its Hello gets no Hello (the wait for
        // it fails).
        loop {
            match self.next().await {
                Event::Ended | Event::Message(Kind::Metrics(_)) => {}
                Event::Message(Kind::Hello(hello)) => return (to_agent, hello),
                other => panic!("expected Hello first, got {other:?}"),
            }
        }
    }

    /// Waits for the agent's side of the open stream to end (metrics may come first).
    pub async fn until_ended(&mut self) {
        loop {
            match self.next().await {
                Event::Ended => return,
                Event::Message(Kind::Metrics(_)) => {}
                other => panic!("expected the stream to end, got {other:?}"),
            }
        }
    }

    /// Shuts `agent` down as a service would and checks the stream ends cleanly: the agent
    /// half-closes its side, then the server (this script) ends the stream; then stops.
    pub async fn shut_down(mut self, agent: retryplane_agent::Agent, to_agent: ToAgent) {
        let close = async {
            self.until_ended().await;
            drop(to_agent);
        };
        tokio::time::timeout(WAIT, async { tokio::join!(agent.shutdown(), close) })
            .await
            .expect("the agent shuts down in time");
        self.stop().await;
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(WAIT, self.server)
            .await
            .expect("the server stops in time")
            .unwrap()
            .unwrap();
        // Nothing arrived that the test did not look at.
        while let Ok(event) = self.events.try_recv() {
            assert!(
                matches!(event, Event::Ended | Event::Message(Kind::Metrics(_))),
                "unexpected {event:?}"
            );
        }
    }
}

/// A valid snapshot: endpoint `ep` with `max_attempts`.
pub fn snapshot(version: u64, max_attempts: u32) -> pb::Snapshot {
    snapshot_of(version, &yaml(max_attempts))
}

/// A snapshot of the valid policy file `policies`.
pub fn snapshot_of(version: u64, policies: &str) -> pb::Snapshot {
    let loaded = retryplane_policy::load(policies.as_bytes());
    let doc = pb::PolicyDocument::from(loaded.policies.unwrap().document().as_ref());
    pb::Snapshot {
        version,
        content_hash: convert::content_hash(&doc),
        policies: Some(doc),
        nonce: format!("nonce-{version}"),
        metrics_interval_ms: 60_000,
    }
}

pub async fn send(to_agent: &ToAgent, snap: &pb::Snapshot) {
    to_agent
        .send(Ok(ServerMessage::with_snapshot(snap)))
        .await
        .unwrap();
}
