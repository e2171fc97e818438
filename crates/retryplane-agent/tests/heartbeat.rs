//! End-to-end liveness of the agent stream through a loopback TCP proxy
//! (`retryplane_proto::liveness`): HTTP/2 keepalive cannot tell that the other side has gone
//! when something between the two answers it, so each side sends keepalives and takes a stream
//! silent for three periods and 2 s for dead. Here the proxy holds one direction: the agent's
//! connection stays open, and nothing of the other side comes through; or it slows one
//! direction down, and a message longer than the link carries within that time keeps the
//! stream while its bytes come at the documented floor or more (4 KiB within the timeout: the
//! agent counts the data bytes of its connection, and sends its messages in pieces of at most that).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use retryplane_agent::CallMeta;
use support::Upstream;
use support::plane::{agent, apply, eventually, listed_connected, metric, plane, stats};
use support::proxy::Proxy;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const SEED: &str = "version: 1\nendpoints:\n  ep: {}\n";

/// The plane's metrics interval in these tests (`support::plane`): 200 ms.
fn limit() -> Duration {
    retryplane_proto::liveness::liveness_timeout(Duration::from_millis(200))
}

/// How much sooner than [`limit`] after the hold a stream may be judged dead: the last thing
/// heard came up to one interval (200 ms) before the hold, and a loaded machine may take the
/// hold late; judging at the bare 2 s (or a few intervals) still falls short of it.
const HEARD_BEFORE_HOLD: Duration = Duration::from_millis(500);

/// What the control plane sends stops coming (its end died behind a proxy that keeps the
/// agent's connection): the agent takes the stream for dead after the liveness timeout, long
/// before HTTP/2 keepalive would, and says why.
#[tokio::test]
async fn an_agent_whose_control_plane_falls_silent_takes_the_stream_for_dead() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), SEED, None).await;
    let proxy = Proxy::start(running.agent_addr).await;
    let agent = agent(proxy.addr, "a", None);
    eventually("the agent is connected", || async { agent.is_connected() }).await;
    // The keepalives keep a quiet stream up past the limit.
    tokio::time::sleep(limit() + Duration::from_millis(500)).await;
    assert!(agent.is_connected());
    assert_eq!(listed_connected(&running, "a").await, Some(true));
    proxy.hold_down(true);
    let held = Instant::now();
    eventually("the agent takes the stream for dead", || async {
        !agent.is_connected()
    })
    .await;
    let waited = held.elapsed();
    assert!(waited >= limit() - HEARD_BEFORE_HOLD, "{waited:?}");
    assert!(waited < limit() + Duration::from_secs(3), "{waited:?}");
    let error = agent
        .stream_error()
        .expect("why the stream ended")
        .to_string();
    assert!(
        error.contains("nothing came from the control plane"),
        "{error}"
    );
    // Back once the proxy forwards again.
    proxy.hold_down(false);
    eventually("the agent reconnects", || async { agent.is_connected() }).await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}

/// What the agent sends stops coming (it vanished behind a proxy that keeps the control plane's
/// connection): the control plane ends its stream after the liveness timeout and lists it
/// disconnected.
#[tokio::test]
async fn a_vanished_agent_is_listed_disconnected() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), SEED, None).await;
    let proxy = Proxy::start(running.agent_addr).await;
    let agent = agent(proxy.addr, "a", None);
    eventually("the agent is listed connected", || async {
        listed_connected(&running, "a").await == Some(true)
    })
    .await;
    proxy.hold_up(true);
    let held = Instant::now();
    eventually("the control plane lists the agent disconnected", || async {
        listed_connected(&running, "a").await == Some(false)
    })
    .await;
    let waited = held.elapsed();
    assert!(waited >= limit() - HEARD_BEFORE_HOLD, "{waited:?}");
    assert!(waited < limit() + Duration::from_secs(3), "{waited:?}");
    proxy.hold_up(false);
    eventually("the agent is back", || async {
        listed_connected(&running, "a").await == Some(true)
    })
    .await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}

/// Which direction a [`SlowProxy`] slows down.
#[derive(Clone, Copy)]
enum Slowed {
    /// What the control plane sends.
    Down,
    /// What agents send.
    Up,
}

/// A loopback TCP proxy that forwards one direction at `rate` bytes a second (a twentieth of
/// it every 50 ms) and the other as it comes; `moved` counts the bytes of the slow direction,
/// `connections` the connections accepted (an agent that lost its stream opens another).
struct SlowProxy {
    addr: SocketAddr,
    moved: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SlowProxy {
    async fn start(target: SocketAddr, slowed: Slowed, rate: usize) -> SlowProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let moved = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let (counted, accepted) = (moved.clone(), connections.clone());
        let task = tokio::spawn(async move {
            while let Ok((agent, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let (agent_read, agent_write) = agent.into_split();
                let (server_read, server_write) = server.into_split();
                let ((mut fast_from, mut fast_to), (mut slow_from, mut slow_to)) = match slowed {
                    Slowed::Down => ((agent_read, server_write), (server_read, agent_write)),
                    Slowed::Up => ((server_read, agent_write), (agent_read, server_write)),
                };
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut fast_from, &mut fast_to).await;
                });
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; (rate / 20).max(1)];
                    loop {
                        let n = match slow_from.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if slow_to.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                        counted.fetch_add(n as u64, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                });
            }
        });
        SlowProxy {
            addr,
            moved,
            connections,
            task,
        }
    }
}

/// A policy set with `endpoint-00000` … besides `ep`: a snapshot of 1,500 of them is about
/// 42 KB.
fn many_endpoints(n: usize) -> String {
    many_endpoints_with(n, 3)
}

/// [`many_endpoints`], `ep` with `max_attempts`.
fn many_endpoints_with(n: usize, max_attempts: u32) -> String {
    let mut yaml = format!("version: 1\nendpoints:\n  ep: {{max_attempts: {max_attempts}}}\n");
    for i in 0..n {
        yaml.push_str(&format!(
            "  endpoint-{i:05}: {{max_attempts: 3, per_try_timeout: 250ms}}\n"
        ));
    }
    yaml
}

/// The rate a slow link must beat, in bytes a second: the floor is 4 KiB within the liveness
/// timeout (1.6 KB a second at the plane's 200 ms interval).
fn floor_rate() -> f64 {
    4.0 * 1024.0 / limit().as_secs_f64()
}

/// Polls `done` until it holds, the agent's stream up all along (within 20 s).
async fn until_on_one_stream<F, Fut>(agent: &retryplane_agent::Agent, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !done().await {
        assert!(
            agent.stream_error().is_none(),
            "the stream was lost after {:?}: {:?}",
            started.elapsed(),
            agent.stream_error()
        );
        assert!(started.elapsed() < Duration::from_secs(20), "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Neither side cut the stream: the control plane ended none for silence, and the agent
/// opened one connection (an agent that lost its stream and is back has no error to show).
async fn never_cut(running: &retryplane_server::server::Running, proxy: &SlowProxy) {
    assert_eq!(
        metric(running, "retryplane_server_streams_silent_total").await,
        Some(0.0)
    );
    assert_eq!(
        proxy.connections.load(Ordering::SeqCst),
        1,
        "the stream was lost"
    );
}

/// A snapshot that takes longer than the liveness timeout to come down a link at about three
/// times the floor's rate arrives whole, on the same stream.
#[tokio::test]
async fn a_large_snapshot_on_a_slow_downlink_keeps_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), SEED, None).await;
    // About three times the floor; under a quarter of what a 16 KiB DATA frame needs.
    let rate = 5_000;
    assert!(f64::from(rate) > 3.0 * floor_rate());
    assert!(f64::from(rate) < 16.0 * 1024.0 / limit().as_secs_f64());
    let proxy = SlowProxy::start(running.agent_addr, Slowed::Down, rate as usize).await;
    let agent = agent(proxy.addr, "a", None);
    eventually("the agent runs the seed", || async {
        agent.is_connected() && agent.policies().version() >= 1
    })
    .await;
    let before = proxy.moved.load(Ordering::SeqCst);
    let started = Instant::now();
    let version = apply(&running, many_endpoints(1_500)).await;
    until_on_one_stream(&agent, "the snapshot did not arrive", || async {
        agent.policies().version() == version
    })
    .await;
    let took = started.elapsed();
    let moved = proxy.moved.load(Ordering::SeqCst) - before;
    assert!(
        took > limit(),
        "the snapshot came within the timeout ({took:?}): no test"
    );
    assert!(moved > 30_000, "{moved} bytes");
    never_cut(&running, &proxy).await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}

/// A metrics report that takes longer than the liveness timeout to go up a link at about three
/// times the floor's rate arrives whole, on the same stream, and is counted.
#[tokio::test]
async fn a_large_report_on_a_slow_uplink_keeps_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &many_endpoints(800), None).await;
    let rate = 5_000;
    let proxy = SlowProxy::start(running.agent_addr, Slowed::Up, rate).await;
    let agent = agent(proxy.addr, "a", None);
    eventually("the agent runs the seed", || async {
        agent.is_connected() && agent.policies().version() >= 1
    })
    .await;
    // Counts on every endpoint: the next report names 801 of them (about 19 KB).
    let upstream = Upstream::new([]);
    for i in 0..800 {
        agent
            .endpoint(&format!("endpoint-{i:05}"))
            .call(CallMeta::http("GET", "/"), upstream.attempt())
            .await
            .unwrap();
    }
    for _ in 0..7 {
        agent
            .endpoint("ep")
            .call(CallMeta::http("GET", "/"), upstream.attempt())
            .await
            .unwrap();
    }
    let before = proxy.moved.load(Ordering::SeqCst);
    let started = Instant::now();
    until_on_one_stream(&agent, "the report did not arrive", || async {
        stats(&running).await.is_some_and(|s| s.calls == 7)
    })
    .await;
    let moved = proxy.moved.load(Ordering::SeqCst) - before;
    assert!(moved > 15_000, "{moved} bytes: no test");
    assert!(
        started.elapsed() > limit(),
        "{:?}: no test",
        started.elapsed()
    );
    never_cut(&running, &proxy).await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}

/// A busy agent on a slow uplink while snapshots keep coming on a free downlink: with about
/// 1 MB of counts a report, more than the HTTP/2 window and the socket buffers hold is on its
/// way, so the agent's outbound queue fills with reports and answers. The agent goes on reading
/// the control plane while an answer waits for room (it once stopped reading there, heard none
/// of the control plane's keepalives, and took the live stream for dead within 12 s); the
/// control plane hears the agent's bytes; no stream is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_uplink_is_full_goes_on_hearing_the_control_plane() {
    let dir = tempfile::tempdir().unwrap();
    let interval = Duration::from_secs(1);
    let limit = retryplane_proto::liveness::liveness_timeout(interval);
    let running = support::plane::plane_with(dir.path(), SEED, None, |cfg| {
        cfg.metrics_interval = interval;
    })
    .await;
    let proxy = SlowProxy::start(running.agent_addr, Slowed::Up, 8 * 1024).await;
    let agent = support::plane::builder(proxy.addr, "a")
        .metrics_interval(interval)
        .connect()
        .unwrap();
    eventually("the agent is connected", || async { agent.is_connected() }).await;
    // Counts on 6,500 endpoints with long names every second: reports of about 1 MB.
    let caller = {
        let agent = agent.clone();
        tokio::spawn(async move {
            let names: Vec<String> = (0..6_500)
                .map(|i| format!("endpoint-{i:05}-{}", "x".repeat(110)))
                .collect();
            let upstream = Upstream::new([]);
            loop {
                for name in &names {
                    let _ = agent
                        .endpoint(name)
                        .call(CallMeta::http("GET", "/"), upstream.attempt())
                        .await;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    let mut pushes = 0;
    while started.elapsed() < limit * 4 {
        pushes += 1;
        apply(&running, support::plane::yaml(1 + pushes % 5)).await;
        assert!(
            agent.stream_error().is_none(),
            "the stream was lost after {:?} ({pushes} pushes): {:?}",
            started.elapsed(),
            agent.stream_error()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    caller.abort();
    let moved = proxy.moved.load(Ordering::SeqCst);
    assert!(moved > 100_000, "{moved} bytes up: no test");
    assert!(agent.is_connected());
    never_cut(&running, &proxy).await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}

/// Against a control plane that does not say it sends keepalives (one that predates them, or
/// behind something that dropped the header), the agent sends its own all the same (a control
/// plane that judges its silence must get them) and never takes the quiet stream for dead.
#[tokio::test]
async fn without_the_header_the_agent_sends_keepalives_and_judges_nothing() {
    let mut script = support::script::Script::start().await;
    script.announce_acks(true);
    let agent = support::plane::builder(script.addr, "a").connect().unwrap();
    let (to_agent, _hello) = script.reconnected().await;
    // A 100 ms interval: keepalives every 100 ms, and a liveness timeout of 2.3 s.
    let mut v1 = support::script::snapshot(1, 1);
    v1.metrics_interval_ms = 100;
    support::script::send(&to_agent, &v1).await;
    assert!(matches!(
        script.reply().await,
        retryplane_proto::pb::agent_message::Kind::Ack(_)
    ));
    let quiet = retryplane_proto::liveness::liveness_timeout(Duration::from_millis(100)) * 2;
    let started = Instant::now();
    while started.elapsed() < quiet {
        // Nothing but metrics may come (a new stream would be an `Opened`).
        match tokio::time::timeout(quiet - started.elapsed(), script.next()).await {
            Err(_) => break,
            Ok(support::script::Event::Message(
                retryplane_proto::pb::agent_message::Kind::Metrics(_),
            )) => {}
            Ok(other) => panic!("expected a quiet stream, got {other:?}"),
        }
    }
    assert!(agent.is_connected());
    let keepalives = script.keepalives();
    assert!(keepalives >= 20, "{keepalives} keepalives in {quiet:?}");
    script.shut_down(agent, to_agent).await;
}

/// A peer (an HTTP/2 proxy whose upstream end died) opens the stream with heartbeats at a
/// 100 ms interval (liveness timeout 2.3 s), then sends nothing on it but HTTP/2 frames of its
/// own: a PING every 2 ms (about 8 KB/s, over the 4 KiB per timeout that counts as hearing),
/// WINDOW_UPDATEs for the agent's keepalives (a stream window of 32 bytes), and the acks of the
/// agent's own keepalive pings. Only the stream's data counts: the agent takes the stream for
/// dead in time. (It once counted every byte of its connection, and kept the dead stream.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_frames_of_the_next_hop_do_not_hide_a_dead_stream() {
    let mut plane = support::raw::RawPlane::start(support::raw::Opening {
        interval_ms: 100,
        window: 32,
        pings: Some(Duration::from_millis(2)),
        ..support::raw::Opening::default()
    })
    .await;
    let agent = support::plane::builder(plane.addr, "a")
        .keepalive(Duration::from_secs(1), Duration::from_secs(1))
        .connect()
        .unwrap();
    let _stream = plane.stream().await;
    let opened = Instant::now();
    let limit = retryplane_proto::liveness::liveness_timeout(Duration::from_millis(100));
    let error = tokio::time::timeout_at(opened + limit + Duration::from_millis(1_500), async {
        loop {
            if let Some(e) = agent.stream_error() {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the agent takes the silent stream for dead in time");
    assert!(opened.elapsed() >= limit - Duration::from_millis(300));
    assert!(error.message.contains("nothing came"), "{error:?}");
    agent.shutdown().await;
}
