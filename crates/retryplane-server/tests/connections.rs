//! The connections of the gRPC listeners, over real sockets on 127.0.0.1:0: the idle close
//! (`conn_idle.rs`; bytes moving for no call, such as PINGs, do not keep a connection without a
//! stream for good), the bound on calls other than an agent's stream, and the close of what is
//! left at the end of a shutdown (`preface.rs`).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use retryplane_proto::pb::{self, agent_message::Kind};
use retryplane_server::server::{Running, SHUTDOWN_GRACE, ServeConfig, start};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use support::{V1, channel, with_file};

fn check_request() -> http::Request<()> {
    grpc_post("/grpc.health.v1.Health/Check")
}

/// A gRPC call's head for a raw HTTP/2 client: `POST path`, gRPC content type, trailers.
fn grpc_post(path: &str) -> http::Request<()> {
    http::Request::post(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// An empty gRPC message frame (an empty `HealthCheckRequest`).
fn empty_frame() -> Bytes {
    Bytes::from_static(&[0, 0, 0, 0, 0])
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

/// A call whose answer is never sent on (the peer gives the stream no flow-control window, so
/// hyper never polls the answer's body, where the bound's cut is made) no longer keeps its
/// connection busy past its bound: the connection is closed as idle. (Before, a peer without
/// any token held a connection for good with one health Check, answering PINGs.)
#[tokio::test]
async fn a_check_whose_answer_gets_no_window_is_cut_and_its_connection_closed() {
    let (_dir, cfg) = with_file(V1);
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr, running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        let mut conn = tokio::spawn(conn);
        let (answer, mut body) = send
            .clone()
            .ready()
            .await
            .unwrap()
            .send_request(check_request(), false)
            .unwrap();
        body.send_data(empty_frame(), true).unwrap();
        let answer = tokio::time::timeout(SHUTDOWN_GRACE, answer)
            .await
            .expect("the head comes (HEADERS need no window)")
            .unwrap();
        assert_eq!(answer.status(), 200);
        let mut answer_body = answer.into_body();
        // The call bound is 300 ms: by 10 bounds the call should have ended (its trailers
        // need no window) and the connection been closed as idle.
        let ended = tokio::time::timeout(idle * 10, &mut conn).await;
        let trailers =
            tokio::time::timeout(Duration::from_millis(10), answer_body.trailers()).await;
        assert!(
            ended.is_ok(),
            "{addr}: the connection was kept {:?} after a call whose answer got no window \
             (call bound {idle:?}); trailers: {trailers:?}",
            idle * 10
        );
        conn.abort();
    }
    running.shutdown().await.unwrap();
}

/// A very long `ServeConfig::connection_idle_timeout` (a library user's "never") is served:
/// no `Instant` arithmetic overflows in a call.
#[tokio::test]
async fn a_very_long_idle_timeout_is_refused_or_served() {
    let (_dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        connection_idle_timeout: Duration::from_secs(u64::MAX / 2),
        ..cfg
    };
    let running = match start(cfg).await {
        Ok(running) => running,
        Err(e) => {
            eprintln!("refused at start: {e}");
            return;
        }
    };
    let got = tokio::time::timeout(
        SHUTDOWN_GRACE,
        AdminServiceClient::new(channel(running.admin_addr).await)
            .fleet_status(pb::FleetStatusRequest::default()),
    )
    .await
    .unwrap();
    assert!(got.is_ok(), "started, then a call failed: {got:?}");
    running.shutdown().await.unwrap();
}

/// Streams that end in every odd way (reset by the client before or after the head, refused
/// as UNIMPLEMENTED, oversize, or with an unfinished request body) leave no count behind:
/// the connection is still closed as idle.
#[tokio::test]
async fn streams_ended_oddly_leave_no_count_behind() {
    let (_dir, cfg) = with_file(V1);
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        max_message_bytes: 1024,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr, running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::handshake(tcp).await.unwrap();
        let mut conn = tokio::spawn(conn);
        let req = |path: &str| grpc_post(path);
        let mut sendr = send.clone().ready().await.unwrap();
        // 1: reset by the client with the request body unfinished (the call waits on it).
        let (a1, mut b1) = sendr
            .send_request(req("/retryplane.v1.AdminService/Get"), false)
            .unwrap();
        // 2: unimplemented.
        let (a2, _) = sendr.send_request(req("/nope.Svc/Nope"), true).unwrap();
        // 3: oversize message (declared 1 MiB, some bytes sent), left open.
        let (a3, mut b3) = sendr
            .send_request(req("/retryplane.v1.AdminService/Apply"), false)
            .unwrap();
        let mut big = vec![0u8, 0, 0x10, 0, 0];
        big.extend(std::iter::repeat_n(0u8, 2000));
        b3.send_data(Bytes::from(big), false).unwrap();
        // 4: an agent stream's path with no hello, reset after its head (agent listener).
        let (a4, mut b4) = sendr
            .send_request(req("/retryplane.v1.AgentService/Connect"), false)
            .unwrap();
        // 5: a Watch reset by the client after its first message.
        let (a5, mut b5) = sendr
            .send_request(req("/grpc.health.v1.Health/Watch"), false)
            .unwrap();
        b5.send_data(empty_frame(), true).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        b1.send_reset(h2::Reason::CANCEL);
        let _ = tokio::time::timeout(Duration::from_secs(2), a2).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), a3).await;
        b3.send_reset(h2::Reason::CANCEL);
        let _ = tokio::time::timeout(Duration::from_millis(200), a4).await;
        b4.send_reset(h2::Reason::CANCEL);
        if let Ok(Ok(a5)) = tokio::time::timeout(Duration::from_secs(2), a5).await {
            let mut body = a5.into_body();
            let _ = tokio::time::timeout(Duration::from_secs(1), body.data()).await;
            drop(body);
        }
        b5.send_reset(h2::Reason::CANCEL);
        drop(a1);
        let began = tokio::time::Instant::now();
        // The hello timeout (10 s) is longer than this wait; an unbounded Connect without
        // hello would hold the connection until it.
        let ended = tokio::time::timeout(idle * 10, &mut conn).await;
        assert!(
            ended.is_ok(),
            "{addr}: the connection was kept {:?} after its streams ended",
            began.elapsed()
        );
    }
    running.shutdown().await.unwrap();
}

/// The agent's address is its stream's remote address, as FleetStatus shows it.
#[tokio::test]
async fn fleet_status_shows_the_agents_address() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let tcp_probe = tokio::net::TcpStream::connect(running.agent_addr)
        .await
        .unwrap();
    drop(tcp_probe);
    let ch = channel(running.agent_addr).await;
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello("addr-1")).await.unwrap();
    let mut inbound = AgentServiceClient::new(ch)
        .connect(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    assert!(inbound.message().await.unwrap().is_some());
    let status = AdminServiceClient::new(channel(running.admin_addr).await)
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    let agent = status
        .agents
        .iter()
        .find(|a| a.agent_id == "addr-1")
        .unwrap();
    eprintln!("peer: {}", agent.peer);
    let peer: SocketAddr = agent.peer.parse().expect("a peer address");
    assert_eq!(peer.ip(), Ipv4Addr::LOCALHOST);
    assert_ne!(peer.port(), running.agent_addr.port());
    drop(tx);
    running.shutdown().await.unwrap();
}

/// 1,000 health Watch streams on one connection, agents connected and an admin call's request
/// left unfinished: shutdown ends within its grace plus the close wait, and the store opens again
/// at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_thousand_streams_lets_the_store_go() {
    let (_dir, cfg) = with_file(V1);
    let running: Running = start(cfg.clone()).await.unwrap();
    let tcp = tokio::net::TcpStream::connect(running.agent_addr)
        .await
        .unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut watches = Vec::new();
    let mut sendr = send.clone().ready().await.unwrap();
    for _ in 0..1000 {
        sendr = sendr.ready().await.unwrap();
        let (answer, mut body) = sendr
            .send_request(grpc_post("/grpc.health.v1.Health/Watch"), false)
            .unwrap();
        body.send_data(empty_frame(), true).unwrap();
        watches.push(answer);
    }
    let mut heads = 0;
    for answer in watches.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(5), answer)
            .await
            .is_ok()
        {
            heads += 1;
        }
    }
    eprintln!("heads: {heads}");
    // Agents on connections of their own.
    let mut agents = Vec::new();
    for i in 0..20 {
        let (tx, rx) = mpsc::channel(4);
        tx.send(hello(&format!("a-{i}"))).await.unwrap();
        let mut inbound = AgentServiceClient::new(channel(running.agent_addr).await)
            .connect(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        assert!(inbound.message().await.unwrap().is_some());
        agents.push((tx, inbound));
    }
    // An admin call whose request never finishes.
    let tcp = tokio::net::TcpStream::connect(running.admin_addr)
        .await
        .unwrap();
    let (asend, aconn) = h2::client::handshake(tcp).await.unwrap();
    let aconn = tokio::spawn(aconn);
    let (_aanswer, mut abody) = asend
        .ready()
        .await
        .unwrap()
        .send_request(grpc_post("/retryplane.v1.AdminService/FleetStatus"), false)
        .unwrap();
    abody
        .send_data(Bytes::from_static(&[0, 0, 0, 0, 9]), false)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let began = tokio::time::Instant::now();
    running.shutdown().await.unwrap();
    let took = began.elapsed();
    eprintln!("shutdown took {took:?}");
    let again = tokio::time::timeout(Duration::from_secs(10), start(cfg))
        .await
        .unwrap();
    eprintln!("start again after {:?}", began.elapsed());
    let again = again.expect("the store was let go");
    assert!(took < SHUTDOWN_GRACE + Duration::from_secs(2), "{took:?}");
    again.shutdown().await.unwrap();
    conn.abort();
    aconn.abort();
    drop(agents);
}

/// A request the server has already read is answered, however late its stream is counted: the
/// count is taken when the tower service is called, which tonic does in the stream's own task,
/// and a connection is closed only after a moment in which no byte moved. A server busy for a
/// moment around the idle timeout (its one thread blocked from 500 ms before it to 300 ms after)
/// answers a call that reached it 300 ms before the timeout. (With a 300 ms timeout and the
/// call 50 ms before it, a client stalled about 350 ms on a loaded machine would have sent it
/// too late.)
#[test]
fn a_request_that_reached_the_server_before_the_idle_timeout_is_answered() {
    let idle = Duration::from_secs(1);
    let (dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    // Each message blocks the server's one thread until its sender lets go (a busy runtime: a
    // long poll elsewhere, a 2-core machine under load); `None` ends the server.
    let (hog_tx, mut hog_rx) =
        tokio::sync::mpsc::unbounded_channel::<Option<std::sync::mpsc::Receiver<()>>>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let running = start(cfg).await.unwrap();
            addr_tx.send(running.admin_addr).unwrap();
            while let Some(Some(busy)) = hog_rx.recv().await {
                // Until the test lets go (bounded, should it never).
                let _ = busy.recv_timeout(Duration::from_secs(10));
            }
            running.shutdown().await.unwrap();
        });
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let result = rt.block_on(async {
        let mut failures = Vec::new();
        for round in 0..5 {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (send, conn) = h2::client::handshake(tcp).await.unwrap();
            let conn = tokio::spawn(conn);
            let call = |send: h2::client::SendRequest<Bytes>| async move {
                let (answer, mut body) =
                    send.ready().await?.send_request(check_request(), false)?;
                body.send_data(empty_frame(), true)?;
                let answer = answer.await?;
                let status = answer.status();
                let mut body = answer.into_body();
                while let Some(data) = body.data().await {
                    data?;
                }
                let trailers = body.trailers().await?;
                Ok::<_, h2::Error>((status, trailers))
            };
            call(send.clone()).await.unwrap();
            let answered = tokio::time::Instant::now();
            tokio::time::sleep_until(answered + idle - Duration::from_millis(500)).await;
            let (release, busy) = std::sync::mpsc::channel::<()>();
            hog_tx.send(Some(busy)).unwrap();
            tokio::time::sleep_until(answered + idle - Duration::from_millis(300)).await;
            // Sent 300 ms before the idle timeout (loopback: there at once), read by the server
            // once it is free again, 300 ms after the timeout.
            let pending = tokio::spawn(tokio::time::timeout(
                Duration::from_secs(5),
                call(send.clone()),
            ));
            tokio::time::sleep_until(answered + idle + Duration::from_millis(300)).await;
            drop(release);
            let got = pending.await.unwrap();
            match got {
                Ok(Ok((status, Some(trailers))))
                    if status == 200 && trailers.get("grpc-status").is_some_and(|s| s == "0") => {}
                other => failures.push(format!("round {round}: {other:?}")),
            }
            conn.abort();
        }
        failures
    });
    hog_tx.send(None).unwrap();
    server.join().unwrap();
    drop(dir);
    assert!(
        result.is_empty(),
        "calls sent before the idle timeout failed: {result:#?}"
    );
}

/// With a tokens file too: health asks no token, and a zero-window call is let go at its bound.
#[tokio::test]
async fn with_auth_on_a_tokenless_check_whose_answer_gets_no_window_is_still_cut() {
    use std::os::unix::fs::PermissionsExt as _;
    let (dir, cfg) = with_file(V1);
    let tokens = dir.path().join("tokens.yaml");
    fs::write(
        &tokens,
        "tokens:\n  - {name: fleet, role: agent, secret: agent-secret-0123456789}\n  - {name: alice, role: admin, secret: admin-secret-0123456789}\n",
    )
    .unwrap();
    fs::set_permissions(&tokens, fs::Permissions::from_mode(0o600)).unwrap();
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        tokens_file: Some(tokens),
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..20 {
        let tcp = tokio::net::TcpStream::connect(running.agent_addr)
            .await
            .unwrap();
        let (send, conn) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        let conn = tokio::spawn(conn);
        let (answer, mut body) = send
            .ready()
            .await
            .unwrap()
            .send_request(check_request(), false)
            .unwrap();
        body.send_data(empty_frame(), true).unwrap();
        let answer = tokio::time::timeout(SHUTDOWN_GRACE, answer)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.status(), 200);
        held.push((conn, answer));
    }
    tokio::time::sleep(idle * 10).await;
    let open = held.iter().filter(|(conn, _)| !conn.is_finished()).count();
    assert_eq!(
        open, 0,
        "{open} of 20 tokenless connections held past 10 call bounds"
    );
    running.shutdown().await.unwrap();
}

/// At the bottom, `ServeConfig` takes any non-zero idle timeout (the CLI 1 s); at 1 ms an
/// admin call is answered when its future ends within its bound (it is polled before it), and
/// otherwise ends with the bound's documented `UNAVAILABLE` ("call again"): nothing else.
#[tokio::test]
async fn a_tiny_idle_timeout_is_refused_or_served() {
    let (_dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        connection_idle_timeout: Duration::from_millis(1),
        ..cfg
    };
    let running = match start(cfg).await {
        Ok(running) => running,
        Err(e) => {
            eprintln!("refused at start: {e}");
            return;
        }
    };
    let mut admin = AdminServiceClient::new(channel(running.admin_addr).await);
    let mut answered = 0;
    // Bounded: a busy machine may take more than 1 ms over some calls.
    for _ in 0..50 {
        match admin.get(pb::GetRequest { version: 0 }).await {
            Ok(_) => answered += 1,
            Err(e) => assert!(
                e.code() == tonic::Code::Unavailable && e.message().contains("call again"),
                "{:?}: {}",
                e.code(),
                e.message()
            ),
        }
        if answered == 10 {
            break;
        }
    }
    assert!(answered > 0, "no call of 50 was answered");
    running.shutdown().await.unwrap();
}

/// An answer still being written after its stream's count is gone (hyper hands a unary answer
/// whole to h2, which buffers what the peer's window does not yet take, and drops the body, the
/// count with it) arrives whole to a client that reads it for longer than the idle timeout (a
/// slow link; here a 1 KiB window released every 20 ms): bytes moving keep the connection.
#[tokio::test]
async fn a_large_answer_read_slowly_past_the_idle_timeout_arrives_whole() {
    let mut yaml = String::from("version: 1\nendpoints:\n");
    for i in 0..400 {
        yaml.push_str(&format!("  endpoint-number-{i:04}:\n    max_attempts: 3\n"));
    }
    let (_dir, cfg) = with_file(&yaml);
    let idle = Duration::from_millis(300);
    let cfg = ServeConfig {
        connection_idle_timeout: idle,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    let tcp = tokio::net::TcpStream::connect(running.admin_addr)
        .await
        .unwrap();
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(1024)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let (answer, mut body) = send
        .ready()
        .await
        .unwrap()
        .send_request(grpc_post("/retryplane.v1.AdminService/Get"), false)
        .unwrap();
    body.send_data(empty_frame(), true).unwrap();
    let answer = answer.await.unwrap();
    let began = tokio::time::Instant::now();
    let mut body = answer.into_body();
    let mut got = 0usize;
    let mut first = Vec::new();
    let mut failed = None;
    while let Some(data) = tokio::time::timeout(Duration::from_secs(10), body.data())
        .await
        .unwrap()
    {
        let data = match data {
            Ok(data) => data,
            Err(e) => {
                failed = Some(e);
                break;
            }
        };
        if first.len() < 5 {
            first.extend_from_slice(&data[..data.len().min(5 - first.len())]);
        }
        got += data.len();
        tokio::time::sleep(Duration::from_millis(20)).await;
        body.flow_control().release_capacity(data.len()).unwrap();
    }
    let declared = u32::from_be_bytes([first[1], first[2], first[3], first[4]]) as usize + 5;
    let trailers = if failed.is_none() {
        body.trailers().await.ok().flatten()
    } else {
        None
    };
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .cloned();
    eprintln!(
        "read {got} of {declared} bytes in {:?}; error {failed:?}; status {status:?}",
        began.elapsed()
    );
    assert!(
        failed.is_none() && got == declared && status.as_ref().is_some_and(|s| s == "0"),
        "{got} of {declared} bytes in {:?}, then {failed:?} (status {status:?})",
        began.elapsed()
    );
    conn.abort();
    running.shutdown().await.unwrap();
}

/// `--keepalive-interval 1s` (the smallest the CLI takes) and `--connection-idle-timeout 2s`:
/// a connection that never opens a stream is still closed for idleness. The server's own PING
/// every second, answered by the client's h2 stack, moves bytes every second.
#[tokio::test]
async fn server_keepalive_of_one_second_does_not_keep_an_idle_connection_open_for_good() {
    let (_dir, base) = with_file(V1);
    let idle = Duration::from_secs(2);
    let running = start(ServeConfig {
        connection_idle_timeout: idle,
        keepalive_interval: Duration::from_secs(1),
        ..base
    })
    .await
    .unwrap();
    let mut kept = Vec::new();
    for addr in [running.agent_addr, running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (_send, conn) = h2::client::Builder::new()
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(12), conn).await;
        if ended.is_err() {
            kept.push(format!(
                "{addr}: still open {:?} after the handshake (idle timeout {idle:?}, no stream ever)",
                started.elapsed()
            ));
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await;
    assert!(kept.is_empty(), "{kept:#?}");
}

/// A peer with no stream that sends an HTTP/2 PING every 100 ms (needs no token, no call) is
/// closed for idleness all the same: bytes moving put the close off a few seconds at most.
#[tokio::test]
async fn a_peer_pinging_ten_times_a_second_is_still_closed_for_idleness() {
    let (_dir, base) = with_file(V1);
    let idle = Duration::from_secs(1);
    let running = start(ServeConfig {
        connection_idle_timeout: idle,
        ..base
    })
    .await
    .unwrap();
    let addr = running.admin_addr;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (_send, mut conn) = h2::client::Builder::new()
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let mut pings = conn.ping_pong().unwrap();
    let mut conn = tokio::spawn(conn);
    let started = tokio::time::Instant::now();
    let mut closed = false;
    while started.elapsed() < Duration::from_secs(10) {
        tokio::select! {
            _ = &mut conn => { closed = true; break; }
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                if tokio::time::timeout(Duration::from_secs(2), pings.ping(h2::Ping::opaque()))
                    .await
                    .map(|r| r.is_err())
                    .unwrap_or(true)
                {
                    closed = true;
                    break;
                }
            }
        }
    }
    conn.abort();
    let _ = tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await;
    assert!(
        closed,
        "{addr}: a connection that never opened a stream, only PINGing, was still open after \
         {:?} (idle timeout {idle:?})",
        started.elapsed()
    );
}

/// `Running::shutdown` waits for the calls' tasks also when their connections are already gone
/// (the peers dropped them just before the shutdown): a call's task holds the admin API, and
/// with it the store, until it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_right_after_peers_dropped_unfinished_calls_lets_the_store_go() {
    let (_dir, cfg) = with_file(V1);
    let mut failures = Vec::new();
    for round in 0..5 {
        let running = match start(cfg.clone()).await {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("round {round}, its own start: {e}"));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut conns = Vec::new();
        for _ in 0..20 {
            let tcp = tokio::net::TcpStream::connect(running.admin_addr)
                .await
                .unwrap();
            let (send, conn) = h2::client::handshake(tcp).await.unwrap();
            let conn = tokio::spawn(conn);
            let mut send = send.ready().await.unwrap();
            let mut bodies = Vec::new();
            for _ in 0..20 {
                send = send.ready().await.unwrap();
                let (_answer, mut body) = send
                    .send_request(grpc_post("/retryplane.v1.AdminService/FleetStatus"), false)
                    .unwrap();
                body.send_data(Bytes::from_static(&[0, 0, 0, 0, 9]), false)
                    .unwrap();
                bodies.push(body);
            }
            conns.push((conn, bodies, send));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The peers go away (their sockets closed), then at once the shutdown.
        for (conn, _bodies, _send) in &conns {
            conn.abort();
        }
        drop(conns);
        tokio::time::sleep(Duration::from_millis(1)).await;
        tokio::time::timeout(Duration::from_secs(10), running.shutdown())
            .await
            .unwrap()
            .unwrap();
        let began = tokio::time::Instant::now();
        match start(cfg.clone()).await {
            Ok(again) => again.shutdown().await.unwrap(),
            Err(e) => {
                failures.push(format!("round {round}: start right after shutdown: {e}"));
                // How long until it is let go.
                let mut let_go = None;
                while began.elapsed() < Duration::from_secs(5) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if let Ok(again) = start(cfg.clone()).await {
                        let_go = Some(began.elapsed());
                        again.shutdown().await.unwrap();
                        break;
                    }
                }
                failures.push(format!(
                    "round {round}: the store was let go after {let_go:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A rapid-reset flood on one raw HTTP/2 connection to `addr`: `streams` HEADERS
/// (`POST /`), each followed at once by its RST_STREAM (CANCEL), written in large pieces.
/// The error code of the GOAWAY the server answers with, if one comes within `within`
/// (`None` when the connection stays open or closes without one).
async fn rapid_reset_flood(addr: SocketAddr, streams: u32, within: Duration) -> Option<u32> {
    paced_rapid_reset_flood(addr, streams, streams, Duration::ZERO, within).await
}

/// [`rapid_reset_flood`] in bursts of `burst` streams (each written at once), `pause` apart.
async fn paced_rapid_reset_flood(
    addr: SocketAddr,
    streams: u32,
    burst: u32,
    pause: Duration,
    within: Duration,
) -> Option<u32> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = tcp.into_split();
    let mut out = Vec::with_capacity(64 + streams as usize * 25);
    out.extend_from_slice(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    // SETTINGS (empty), and the ACK of the server's.
    out.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&[0, 0, 0, 4, 1, 0, 0, 0, 0]);
    for n in 0..streams {
        let id = (2 * n + 1).to_be_bytes();
        // HEADERS, END_HEADERS: :method POST, :scheme http, :path / (static table).
        out.extend_from_slice(&[0, 0, 3, 1, 4]);
        out.extend_from_slice(&id);
        out.extend_from_slice(&[0x83, 0x86, 0x84]);
        // RST_STREAM CANCEL.
        out.extend_from_slice(&[0, 0, 4, 3, 0]);
        out.extend_from_slice(&id);
        out.extend_from_slice(&8u32.to_be_bytes());
    }
    let writer = tokio::spawn(async move {
        let preface = 24 + 9 + 9;
        if write.write_all(&out[..preface]).await.is_err() {
            return;
        }
        for piece in out[preface..].chunks(burst as usize * 25) {
            if write.write_all(piece).await.is_err() {
                return;
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
        }
        // Kept open: the server decides when the connection ends.
        std::future::pending::<()>().await;
    });
    let goaway = tokio::time::timeout(within, async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            // Whole frames from the front of `buf`.
            while buf.len() >= 9 {
                let len =
                    usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
                if buf.len() < 9 + len {
                    break;
                }
                if buf[3] == 7 && len >= 8 {
                    return Some(u32::from_be_bytes(buf[13..17].try_into().unwrap()));
                }
                buf.drain(..9 + len);
            }
            match read.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .unwrap_or(None);
    writer.abort();
    goaway
}

/// ENHANCE_YOUR_CALM, h2's GOAWAY code for a rapid-reset flood.
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// CVE-2023-44487: a connection that opens streams and resets them before the server takes
/// them is ended (GOAWAY `ENHANCE_YOUR_CALM`) on either gRPC listener (past 64 given up
/// before they are taken on the agent listener, 20 on the admin one).
#[tokio::test]
async fn a_rapid_reset_flood_from_one_connection_is_ended_with_goaway_on_both_listeners() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    for addr in [running.agent_addr, running.admin_addr] {
        let code = rapid_reset_flood(addr, 50_000, Duration::from_secs(20)).await;
        assert_eq!(
            code,
            Some(ENHANCE_YOUR_CALM),
            "{addr}: 50,000 streams opened and reset at once did not end the connection"
        );
    }
    running.shutdown().await.unwrap();
}

/// The same flood where the operator raised `--max-streams-per-connection` for an HTTP/2
/// proxy carrying many agents (README: "raise it when an HTTP/2 proxy carries many agents
/// over one connection"): the rapid-reset guard should still end the connection, on the
/// admin listener (no proxy of agents there) at the least.
#[tokio::test]
async fn a_rapid_reset_flood_is_ended_with_goaway_when_the_streams_per_connection_are_raised() {
    let (_dir, cfg) = with_file(V1);
    let cfg = ServeConfig {
        max_streams_per_connection: 1_000_000,
        ..cfg
    };
    let running = start(cfg).await.unwrap();
    let mut kept = Vec::new();
    for addr in [running.agent_addr, running.admin_addr] {
        let code = rapid_reset_flood(addr, 50_000, Duration::from_secs(20)).await;
        if code != Some(ENHANCE_YOUR_CALM) {
            kept.push((addr, code));
        }
    }
    running.shutdown().await.unwrap();
    assert!(
        kept.is_empty(),
        "50,000 streams opened and reset at once on one connection were all taken, the \
         connection kept (GOAWAY code seen: {kept:?}), agent listener first then admin"
    );
}

/// A flood paced in bursts of 100 streams opened and reset, 20 ms apart (5,000 streams a
/// second, for two seconds), on a control plane with the default settings, is ended at the
/// first burst (a guard that grew with `--max-streams-per-connection`, 1,024, let every burst
/// through, however long the flood went on).
#[tokio::test]
async fn a_rapid_reset_flood_in_bursts_under_the_streams_per_connection_is_still_ended() {
    let (_dir, cfg) = with_file(V1);
    let running = start(cfg).await.unwrap();
    let addr = running.agent_addr;
    let code = paced_rapid_reset_flood(
        addr,
        10_000,
        100,
        Duration::from_millis(20),
        Duration::from_secs(8),
    )
    .await;
    running.shutdown().await.unwrap();
    assert_eq!(
        code,
        Some(ENHANCE_YOUR_CALM),
        "10,000 streams opened and reset in bursts of 100 on one connection were all taken"
    );
}
