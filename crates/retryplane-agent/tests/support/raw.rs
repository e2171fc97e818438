//! A one-connection HTTP/2 control plane written with `h2` directly, for what the real one and
//! tonic do not let a test do: hold the agent's stream window shut and open it when the test
//! says, read slowly, hold the data read without giving the window back, ping the agent. It
//! answers each stream of the agent's with the heartbeat header (`retryplane-heartbeat: 1`),
//! the metrics interval and, when asked, the metrics-ack header, then hands the test the
//! response's sending half and the agent's messages, decoded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use retryplane_proto::pb::{self, ServerMessage, agent_message::Kind};
use tokio::sync::mpsc;

use super::script::snapshot;

/// How the control plane opens and reads the agent's stream.
#[derive(Clone, Copy, Debug)]
pub struct Opening {
    /// `retryplane-metrics-interval-ms` of the response.
    pub interval_ms: u64,
    /// Whether the response says metrics reports are acknowledged (numbered reports).
    pub acks: bool,
    /// The stream window the agent gets at first (0: it sends nothing until
    /// [`RawPlane::set_window`]).
    pub window: u32,
    /// A pause after each piece of data read, before its window is given back.
    pub read_pause: Option<Duration>,
    /// Whether the window of what is read is kept until [`RawPlane::release`].
    pub held: bool,
    /// A PING of the control plane's own this often (as an HTTP/2 proxy sends).
    pub pings: Option<Duration>,
}

impl Default for Opening {
    fn default() -> Self {
        Self {
            interval_ms: 10_000,
            acks: false,
            window: 0,
            read_pause: None,
            held: false,
            pings: None,
        }
    }
}

/// The test's side of the raw control plane (see the module's docs).
pub struct RawPlane {
    /// Where the agent connects.
    pub addr: SocketAddr,
    /// The agent's messages, as the control plane reads them.
    pub msgs: mpsc::UnboundedReceiver<pb::AgentMessage>,
    sends: mpsc::UnboundedReceiver<h2::SendStream<Bytes>>,
    window: mpsc::UnboundedSender<u32>,
    release: Arc<AtomicBool>,
}

impl RawPlane {
    /// Listens on `127.0.0.1:0` and serves the first connection as `opening` says.
    pub async fn start(opening: Opening) -> RawPlane {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (send_tx, sends) = mpsc::unbounded_channel();
        let (msg_tx, msgs) = mpsc::unbounded_channel();
        let (window, mut windows) = mpsc::unbounded_channel::<u32>();
        let release = Arc::new(AtomicBool::new(!opening.held));
        let released = release.clone();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::Builder::new()
                .initial_window_size(opening.window)
                .initial_connection_window_size(16 << 20)
                .handshake::<_, Bytes>(tcp)
                .await
                .unwrap();
            if let Some(every) = opening.pings {
                let mut pings = conn.ping_pong().unwrap();
                tokio::spawn(async move {
                    // Bounded: 10,000 pings.
                    for _ in 0..10_000 {
                        if pings.ping(h2::Ping::opaque()).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(every).await;
                    }
                });
            }
            // A window h2 could not set yet: it takes one SETTINGS change at a time, until the
            // agent acknowledges the one before (under load that took over 200 ms, and the
            // second set failed the test).
            let mut pending: Option<u32> = None;
            loop {
                tokio::select! {
                    accepted = conn.accept() => {
                        let Some(Ok((request, mut respond))) = accepted else { return };
                        let response = http::Response::builder()
                            .status(200)
                            .header("content-type", "application/grpc")
                            .header(retryplane_proto::liveness::HEARTBEAT_METADATA, "1")
                            .header(retryplane_proto::METRICS_INTERVAL_METADATA, opening.interval_ms)
                            .header(retryplane_proto::METRICS_ACK_METADATA, if opening.acks { "1" } else { "0" })
                            .body(())
                            .unwrap();
                        let _ = send_tx.send(respond.send_response(response, false).unwrap());
                        tokio::spawn(read(request.into_body(), opening.read_pause, released.clone(), msg_tx.clone()));
                    }
                    Some(w) = windows.recv() => {
                        if pending.is_some() || conn.set_initial_window_size(w).is_err() {
                            pending = Some(w);
                        }
                    }
                    () = tokio::time::sleep(Duration::from_millis(5)), if pending.is_some() => {
                        if let Some(w) = pending
                            && conn.set_initial_window_size(w).is_ok()
                        {
                            pending = None;
                        }
                    }
                }
            }
        });
        RawPlane {
            addr,
            msgs,
            sends,
            window,
            release,
        }
    }

    /// The sending half of the agent's next stream, once it is open (10 s at most).
    pub async fn stream(&mut self) -> h2::SendStream<Bytes> {
        tokio::time::timeout(Duration::from_secs(10), self.sends.recv())
            .await
            .expect("the agent opens its stream")
            .unwrap()
    }

    /// Sets the stream window the agent gets (for its open stream too).
    pub fn set_window(&self, window: u32) {
        self.window.send(window).unwrap();
    }

    /// Gives back the window of what was read, and of what is read from now on.
    pub fn release(&self) {
        self.release.store(true, Ordering::SeqCst);
    }
}

/// Reads the agent's messages from `body` (see [`Opening`]) into `msgs`.
async fn read(
    mut body: h2::RecvStream,
    pause: Option<Duration>,
    release: Arc<AtomicBool>,
    msgs: mpsc::UnboundedSender<pb::AgentMessage>,
) {
    let mut buf = Vec::new();
    let mut held = 0;
    while let Some(Ok(data)) = body.data().await {
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        held += data.len();
        if release.load(Ordering::SeqCst) {
            let _ = body.flow_control().release_capacity(held);
            held = 0;
        }
        buf.extend_from_slice(&data);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
            if buf.len() < 5 + len {
                break;
            }
            let m = pb::AgentMessage::decode(&buf[5..5 + len]).unwrap();
            buf.drain(..5 + len);
            let _ = msgs.send(m);
        }
    }
}

/// `message` as one gRPC frame, as the control plane frames its own.
pub fn grpc_frame(message: &impl prost::Message) -> Bytes {
    retryplane_server::frame_body::encode_frame(message).unwrap()
}

/// Sends `snapshot(v, 4)` for each of `versions` on `send`, each once the agent runs the one
/// before.
pub async fn push(
    agent: &retryplane_agent::Agent,
    send: &mut h2::SendStream<Bytes>,
    versions: std::ops::RangeInclusive<u64>,
) {
    for v in versions {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(agent, v).await;
    }
}

/// Waits (10 s at most) until `agent` runs version `v`.
pub async fn until_version(agent: &retryplane_agent::Agent, v: u64) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while agent.policies().version() != v {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the agent runs v{v} in time"));
}

/// Shuts `agent` down while `meanwhile` runs (the test opening the window, say); 10 s at most.
/// How long the shutdown took.
pub async fn shut_down_while(
    agent: &retryplane_agent::Agent,
    meanwhile: impl std::future::Future<Output = ()>,
) -> Duration {
    let began = tokio::time::Instant::now();
    let shutdown = async {
        agent.shutdown().await;
        began.elapsed()
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(shutdown, meanwhile).0
    })
    .await
    .expect("shutdown ends")
}

/// The messages the control plane gets from `msgs` until `done` holds of them (10 s at most).
pub async fn received_until(
    msgs: &mut mpsc::UnboundedReceiver<pb::AgentMessage>,
    done: impl Fn(&[Kind]) -> bool,
) -> Vec<Kind> {
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while !done(&got) {
            match msgs.recv().await {
                Some(m) => got.extend(m.kind),
                None => return,
            }
        }
    })
    .await;
    got
}

/// The answers among `kinds`, as (kind, version).
pub fn answers(kinds: &[Kind]) -> Vec<(&'static str, u64)> {
    kinds
        .iter()
        .filter_map(|k| match k {
            Kind::Ack(a) => Some(("ack", a.version)),
            Kind::Nack(n) => Some(("nack", n.version)),
            _ => None,
        })
        .collect()
}

/// The calls counted in the metrics reports among `kinds`.
pub fn calls(kinds: &[Kind]) -> u64 {
    kinds
        .iter()
        .map(|k| match k {
            Kind::Metrics(r) => r.endpoints.iter().map(|e| e.calls).sum(),
            _ => 0,
        })
        .sum()
}
