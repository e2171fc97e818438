//! A start whose cache file read ends after the start's wait (a cold network volume): the read
//! is settled later, before anything is written to the cache path, and a valid cache is put in
//! force if no snapshot came first. The slow disk is the builder's test hook; the control plane
//! is scripted: every stream and agent message goes to the test.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use prost::Message as _;
use retryplane_proto::convert;
use retryplane_proto::pb::agent_message::Kind;
use retryplane_proto::pb::agent_service_server::{AgentService, AgentServiceServer};
use retryplane_proto::pb::{self, ServerMessage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use crate::cache::HEADER;
use crate::test_logs::Logs;
use crate::{Agent, CallMeta, Source};

/// The longest any single wait may take before the test fails.
const WAIT: Duration = Duration::from_secs(15);

/// The sending half of one stream, towards the agent.
type ToAgent = mpsc::Sender<Result<ServerMessage, Status>>;

#[derive(Debug)]
enum Event {
    Opened(ToAgent),
    Message(Kind),
    Ended,
}

/// The scripted control plane's service.
struct Scripted(mpsc::UnboundedSender<Event>);

#[tonic::async_trait]
impl AgentService for Scripted {
    type ConnectStream = ReceiverStream<Result<ServerMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        self.0
            .send(Event::Opened(tx))
            .map_err(|_| Status::unavailable("the test is over"))?;
        let mut inbound = request.into_inner();
        let events = self.0.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if let Some(kind) = m.kind {
                    let _ = events.send(Event::Message(kind));
                }
            }
            let _ = events.send(Event::Ended);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The test's side of the scripted control plane.
struct Plane {
    addr: std::net::SocketAddr,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Plane {
    async fn start() -> Plane {
        Self::start_at("127.0.0.1:0".parse().unwrap()).await
    }

    /// [`Plane::start`] on `addr` (a port the test held and let go, where nothing listened).
    async fn start_at(addr: std::net::SocketAddr) -> Plane {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(AgentServiceServer::new(Scripted(tx)))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        Plane { addr, events }
    }

    async fn next(&mut self) -> Event {
        tokio::time::timeout(WAIT, self.events.recv())
            .await
            .expect("the agent does something in time")
            .expect("the server is up")
    }

    /// The next agent message that is not a metrics report.
    async fn reply(&mut self) -> Kind {
        loop {
            match self.next().await {
                Event::Message(Kind::Metrics(_)) => {}
                Event::Message(kind) => return kind,
                other => panic!("expected a message, got {other:?}"),
            }
        }
    }

    /// A new stream and its Hello (the old stream may end on the way).
    async fn opened(&mut self) -> (ToAgent, pb::Hello) {
        let to_agent = loop {
            match self.next().await {
                Event::Opened(tx) => break tx,
                Event::Ended | Event::Message(Kind::Metrics(_)) => {}
                other => panic!("expected a new stream, got {other:?}"),
            }
        };
        match self.reply().await {
            Kind::Hello(hello) => (to_agent, hello),
            other => panic!("expected Hello, got {other:?}"),
        }
    }

    /// Shuts `agent` down, ending the stream once the agent has half-closed it.
    async fn shut_down(&mut self, agent: Agent, to_agent: ToAgent) {
        let close = async {
            loop {
                if let Event::Ended = self.next().await {
                    break;
                }
            }
            drop(to_agent);
        };
        tokio::time::timeout(WAIT, async { tokio::join!(agent.shutdown(), close) })
            .await
            .expect("the agent shuts down in time");
    }
}

/// A valid snapshot: endpoint `a` with `max_attempts`, the metrics interval `interval_ms`.
fn snapshot(version: u64, max_attempts: u32, interval_ms: u64) -> pb::Snapshot {
    let yaml = format!("version: 1\nendpoints:\n  a: {{max_attempts: {max_attempts}}}\n");
    let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
    let doc = pb::PolicyDocument::from(set.document().as_ref());
    pb::Snapshot {
        version,
        content_hash: convert::content_hash(&doc),
        policies: Some(doc),
        nonce: format!("n-{version}"),
        metrics_interval_ms: interval_ms,
    }
}

async fn send(to_agent: &ToAgent, snap: &pb::Snapshot) {
    to_agent
        .send(Ok(ServerMessage::with_snapshot(snap)))
        .await
        .unwrap();
}

/// A cache file as the agent writes it, holding `snap`.
fn write_cache(path: &Path, snap: &pb::Snapshot) -> Vec<u8> {
    let bytes = crate::cache::encode(snap);
    std::fs::write(path, &bytes).unwrap();
    bytes
}

/// A disk that answers once the sender is used or dropped.
fn slow_disk() -> (
    std::sync::mpsc::Sender<()>,
    impl Fn() + Send + Sync + 'static,
) {
    let (release, slow) = std::sync::mpsc::channel::<()>();
    let slow = Mutex::new(slow);
    (release, move || {
        let _ = slow.lock().unwrap().recv();
    })
}

/// An agent of the scripted control plane at `addr` with the cache file `cache`, read by a
/// disk that answers late.
fn agent(
    addr: std::net::SocketAddr,
    cache: &Path,
    stall: impl Fn() + Send + Sync + 'static,
) -> Agent {
    Agent::builder()
        .url(format!("http://{addr}"))
        .service("checkout")
        .agent_id("a")
        .rng_seed(1)
        .reconnect_backoff(crate::ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(300),
            Duration::from_secs(10),
        ))
        .cache_file(cache)
        .cache_read_stall(stall)
        .connect()
        .unwrap()
}

/// Polls `check` until it holds, failing after [`WAIT`].
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The snapshot in a cache file the agent wrote.
fn cached_version(path: &Path) -> Option<u64> {
    let bytes = std::fs::read(path).ok()?;
    let snap = pb::Snapshot::decode(bytes.strip_prefix(HEADER)?).ok()?;
    Some(snap.version)
}

#[tokio::test]
async fn a_cache_read_late_is_written_by_the_next_snapshot_but_not_applied_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.cache");
    let cached = write_cache(&path, &snapshot(3, 4, 250));
    let mut plane = Plane::start().await;
    let (release, stall) = slow_disk();
    let agent = agent(plane.addr, &path, stall);
    assert_eq!(
        agent.policies().source(),
        Source::Fallback,
        "not read in time"
    );

    // A snapshot while the read is under way: applied and answered at once, not written yet.
    let (to_agent, hello) = plane.opened().await;
    assert_eq!(hello.last_applied_version, 0);
    send(&to_agent, &snapshot(8, 2, 60_000)).await;
    match plane.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    assert_eq!(
        std::fs::read(&path).unwrap(),
        cached,
        "written before it was read"
    );

    // The read ends: the file is ours, so the newest snapshot is written; the cached policies,
    // older than the control plane's, are not put in force.
    release.send(()).unwrap();
    eventually("the cache file holds v8", || {
        cached_version(&path) == Some(8)
    })
    .await;
    let p = agent.policies();
    assert_eq!((p.source(), p.version()), (Source::ControlPlane, 8));
    assert_eq!(
        agent
            .shared()
            .metrics_interval_ms
            .load(std::sync::atomic::Ordering::Relaxed),
        60_000
    );
    plane.shut_down(agent, to_agent).await;
    assert_eq!(cached_version(&path), Some(8));
}

#[tokio::test]
async fn a_cache_read_late_is_applied_when_no_snapshot_came_first() {
    let (logs, _guard) = Logs::capture();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.cache");
    let cached = snapshot(3, 4, 250);
    write_cache(&path, &cached);
    let mut plane = Plane::start().await;
    let (release, stall) = slow_disk();
    // Its own interval is the default, 10 s; the cached one 250 ms.
    let agent = agent(plane.addr, &path, stall);
    assert_eq!(
        agent.policies().source(),
        Source::Fallback,
        "not read in time"
    );
    let (to_agent, hello) = plane.opened().await;
    assert_eq!(hello.last_applied_version, 0);

    // The control plane has sent nothing when the read ends: the cache is put in force, as
    // at start, with the interval cached with it.
    release.send(()).unwrap();
    eventually("the cached policies are in force", || {
        agent.policies().source() == Source::Cache
    })
    .await;
    let p = agent.policies();
    assert_eq!(
        (p.version(), p.content_hash()),
        (3, cached.content_hash.as_str())
    );
    let attempts = p.set().unwrap().endpoint("a").unwrap().policy.max_attempts;
    assert_eq!(attempts, 4);
    let text = logs.text();
    assert!(
        text.contains("the policy cache was read late; running on its policies"),
        "{text}"
    );

    // The control plane knew the agent on the fallback: a new stream, opened at once, says
    // the agent runs the cached version.
    let (to_agent, hello) = reopened(&mut plane, to_agent).await;
    assert_eq!(
        (hello.last_applied_version, hello.last_applied_hash.as_str()),
        (3, cached.content_hash.as_str())
    );

    // Reports go out at the cached interval from then on, not at the agent's own 10 s.
    call(&agent).await;
    let report = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Event::Message(Kind::Metrics(report)) = plane.next().await {
                break report;
            }
        }
    })
    .await
    .expect("a report at the cached interval");
    assert_eq!(report.policy_version, 3);
    plane.shut_down(agent, to_agent).await;
}

/// The stream `to_agent` ended by the agent (its half of the stream first), and the next one
/// with its Hello.
async fn reopened(plane: &mut Plane, to_agent: ToAgent) -> (ToAgent, pb::Hello) {
    loop {
        match plane.next().await {
            Event::Ended => break,
            Event::Message(Kind::Metrics(_)) => {}
            other => panic!("expected the stream to end, got {other:?}"),
        }
    }
    drop(to_agent);
    plane.opened().await
}

/// A call on endpoint `a`, answered at once.
async fn call(agent: &Agent) {
    agent
        .endpoint("a")
        .call(CallMeta::http("GET", "/"), |_| async {
            Ok::<_, std::io::Error>(http::Response::new(()))
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn calls_on_the_fallback_before_a_late_cache_are_reported_under_version_0() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.cache");
    write_cache(&path, &snapshot(3, 4, 250));
    let mut plane = Plane::start().await;
    let (release, stall) = slow_disk();
    let agent = agent(plane.addr, &path, stall);
    let (to_agent, hello) = plane.opened().await;
    assert_eq!(hello.last_applied_version, 0);
    call(&agent).await;
    assert_eq!(agent.policies().source(), Source::Fallback);

    // The read ends: the call made on the fallback goes out under version 0, before the cache
    // is put in force.
    release.send(()).unwrap();
    let report = loop {
        match plane.next().await {
            Event::Message(Kind::Metrics(report)) => break report,
            Event::Message(_) => {}
            other => panic!("expected a metrics report, got {other:?}"),
        }
    };
    assert_eq!(report.policy_version, 0, "{report:?}");
    assert_eq!(report.endpoints.iter().map(|e| e.calls).sum::<u64>(), 1);
    eventually("the cached policies are in force", || {
        agent.policies().source() == Source::Cache
    })
    .await;
    let (to_agent, hello) = reopened(&mut plane, to_agent).await;
    assert_eq!(hello.last_applied_version, 3);
    plane.shut_down(agent, to_agent).await;
}

#[tokio::test]
async fn a_late_cache_put_in_force_after_a_nack_is_told_by_a_new_hello() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.cache");
    let cached = snapshot(3, 4, 250);
    write_cache(&path, &cached);
    let mut plane = Plane::start().await;
    let (release, stall) = slow_disk();
    let agent = agent(plane.addr, &path, stall);
    let (to_agent, hello) = plane.opened().await;
    assert_eq!(hello.last_applied_version, 0);

    // A snapshot the agent refuses: it stays on the fallback.
    let mut bad = snapshot(8, 2, 60_000);
    bad.content_hash = "0".repeat(64);
    send(&to_agent, &bad).await;
    match plane.reply().await {
        Kind::Nack(nack) => assert_eq!(nack.version, 8),
        other => panic!("expected Nack v8, got {other:?}"),
    }
    assert_eq!(agent.policies().source(), Source::Fallback);

    // The read ends: the cache is put in force, and the control plane is told by a new Hello.
    release.send(()).unwrap();
    let (to_agent, hello) = reopened(&mut plane, to_agent).await;
    assert_eq!(
        (hello.last_applied_version, hello.last_applied_hash.as_str()),
        (3, cached.content_hash.as_str())
    );
    assert_eq!(agent.policies().source(), Source::Cache);
    plane.shut_down(agent, to_agent).await;
}

#[tokio::test]
async fn a_foreign_file_read_late_is_left_alone() {
    let (logs, _guard) = Logs::capture();
    let dir = tempfile::tempdir().unwrap();
    // The policies file given as the cache file by mistake.
    let path = dir.path().join("policies.yaml");
    let yaml = b"version: 1\nendpoints:\n  a: {max_attempts: 4}\n";
    std::fs::write(&path, yaml).unwrap();
    let mut plane = Plane::start().await;
    let (release, stall) = slow_disk();
    let agent = agent(plane.addr, &path, stall);
    let (to_agent, _) = plane.opened().await;
    send(&to_agent, &snapshot(8, 2, 60_000)).await;
    match plane.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    release.send(()).unwrap();
    eventually("the file is found not to be a cache", || {
        logs.text().contains("the cache file is not a policy cache")
    })
    .await;
    // Another snapshot after the read: not written either.
    send(&to_agent, &snapshot(9, 3, 60_000)).await;
    match plane.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 9),
        other => panic!("expected Ack v9, got {other:?}"),
    }
    // Shutdown waits for the cache writes asked for: none may have replaced it.
    plane.shut_down(agent, to_agent).await;
    assert_eq!(std::fs::read(&path).unwrap(), yaml);
}

#[tokio::test]
async fn a_cache_read_that_never_ends_leaves_the_file_alone_and_is_warned_of_once() {
    let (logs, _guard) = Logs::capture();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.cache");
    let cached = write_cache(&path, &snapshot(3, 4, 250));
    let mut plane = Plane::start().await;
    // Held, never sent on: the read does not end while the agent runs.
    let (_hold, stall) = slow_disk();
    let agent = agent(plane.addr, &path, stall);
    let (to_agent, _) = plane.opened().await;
    send(&to_agent, &snapshot(8, 2, 60_000)).await;
    match plane.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    assert_eq!(
        agent.policies().version(),
        8,
        "the agent works all the same"
    );
    plane.shut_down(agent, to_agent).await;
    assert_eq!(std::fs::read(&path).unwrap(), cached);
    let text = logs.text();
    let warned: Vec<&str> = text.lines().filter(|l| l.contains(" WARN ")).collect();
    assert_eq!(warned.len(), 1, "{text}");
    assert!(warned[0].contains("could not be read in time"), "{text}");
}

#[tokio::test]
async fn fallback_calls_before_a_cache_read_late_between_streams_are_under_version_0() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.cache");
    write_cache(&path, &snapshot(3, 4, 250));
    // Nothing listens at the control plane's address yet: the agent reconnects on its backoff.
    let addr = {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        held.local_addr().unwrap()
    };
    let (release, stall) = slow_disk();
    let agent = agent(addr, &path, stall);
    call(&agent).await;
    assert_eq!(agent.policies().source(), Source::Fallback);

    // The read ends while no stream is up: the cache is put in force between tries.
    release.send(()).unwrap();
    eventually("the cached policies are in force", || {
        agent.policies().source() == Source::Cache
    })
    .await;
    assert_eq!(agent.policies().version(), 3);

    // The control plane comes up. The call was made on the fallback (version 0): it is
    // reported under version 0, as it is when the read ends while a stream is up.
    let mut plane = Plane::start_at(addr).await;
    let (to_agent, hello) = plane.opened().await;
    assert_eq!(hello.last_applied_version, 3);
    let mut by_version = std::collections::BTreeMap::<u64, u64>::new();
    tokio::time::timeout(WAIT, async {
        while by_version.values().sum::<u64>() < 1 {
            if let Event::Message(Kind::Metrics(report)) = plane.next().await {
                let calls: u64 = report.endpoints.iter().map(|e| e.calls).sum();
                *by_version.entry(report.policy_version).or_default() += calls;
            }
        }
    })
    .await
    .expect("the call is reported (the cached interval is 250 ms)");
    assert_eq!(
        by_version,
        [(0, 1)].into(),
        "calls per reported version: the call made on the fallback is credited to it"
    );
    plane.shut_down(agent, to_agent).await;
}
