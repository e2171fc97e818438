//! A gRPC answer whose head comes at once and whose messages come late, through the layer,
//! from an HTTP/2 server written with `h2` (a tonic server sends its head with its first
//! message): the caller's own deadline (`grpc-timeout`) ends the answer's body too, a unary
//! message or a stream, since a gRPC deadline bounds the whole RPC; the policy's deadline
//! bounds the call until the answer's head only (a stream may outlast it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::{BufMut as _, Bytes, BytesMut};
use http_body_util::BodyExt as _;
use retryplane_agent::Agent;
use retryplane_agent::layer::{Idempotent, RetryLayer, into_tonic_request};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Request};
use tower::Service as _;

use support::{agent, policy};

/// The longest any wait may take.
const WAIT: Duration = Duration::from_secs(20);

/// What the server does with every request: its head at once, then `messages` messages, each
/// `every` after the one before, then `grpc-status: 0`.
#[derive(Clone, Copy)]
struct Plan {
    every: Duration,
    messages: usize,
}

/// The server's address, how many of its answers the client reset before they ended, and how
/// many connections it accepted.
struct Server {
    addr: std::net::SocketAddr,
    resets: Arc<AtomicU32>,
    connections: Arc<AtomicU32>,
}

/// One gRPC message (5-byte prefix and its encoding).
fn framed(message: &impl prost::Message) -> Bytes {
    let encoded = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(encoded.len() + 5);
    framed.put_u8(0);
    framed.put_u32(u32::try_from(encoded.len()).unwrap());
    framed.put_slice(&encoded);
    framed.freeze()
}

/// `Get`'s answer (version 7), or an empty message of the agent stream.
fn message_for(path: &str) -> Bytes {
    if path.ends_with("/Get") {
        framed(&pb::GetResponse {
            info: Some(pb::VersionInfo {
                version: 7,
                ..Default::default()
            }),
            ..Default::default()
        })
    } else {
        framed(&pb::ServerMessage::default())
    }
}

async fn answer(
    plan: Plan,
    path: String,
    mut respond: h2::server::SendResponse<Bytes>,
    resets: Arc<AtomicU32>,
) {
    let head = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let Ok(mut stream) = respond.send_response(head, false) else {
        return;
    };
    for _ in 0..plan.messages {
        let reset = std::future::poll_fn(|cx| stream.poll_reset(cx));
        tokio::select! {
            _ = reset => {
                resets.fetch_add(1, Ordering::Relaxed);
                return;
            }
            () = tokio::time::sleep(plan.every) => {}
        }
        if stream.send_data(message_for(&path), false).is_err() {
            resets.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = stream.send_trailers(trailers);
}

/// Starts the server on 127.0.0.1:0.
async fn serve(plan: Plan) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let resets = Arc::new(AtomicU32::new(0));
    let connections = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&resets);
    let accepted = Arc::clone(&connections);
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            accepted.fetch_add(1, Ordering::Relaxed);
            let resets = Arc::clone(&counted);
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((request, respond))) = connection.accept().await {
                    let path = request.uri().path().to_owned();
                    tokio::spawn(answer(plan, path, respond, Arc::clone(&resets)));
                }
            });
        }
    });
    Server {
        addr,
        resets,
        connections,
    }
}

async fn channel(server: &Server) -> Channel {
    Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect_timeout(WAIT)
        .connect()
        .await
        .unwrap()
}

/// The layer over a channel to `server`, for a generated client.
macro_rules! stack {
    ($agent:expr, $server:expr) => {
        tower::ServiceBuilder::new()
            .layer(RetryLayer::new($agent.endpoint("ep")))
            .map_request(into_tonic_request)
            .service(channel($server).await)
    };
}

/// A unary `Get` through the layer (idempotent), with the caller's deadline if given.
async fn get(
    agent: &Agent,
    server: &Server,
    timeout: Option<Duration>,
) -> Result<u64, tonic::Status> {
    let mut client = AdminServiceClient::new(stack!(agent, server));
    let mut request = Request::new(pb::GetRequest { version: 0 });
    request.extensions_mut().insert(Idempotent(true));
    if let Some(timeout) = timeout {
        request.set_timeout(timeout);
    }
    let response = tokio::time::timeout(WAIT, client.get(request))
        .await
        .expect("the call ends in time")?;
    Ok(response.into_inner().info.unwrap().version)
}

/// The agent stream's `Connect` through the layer (its one message sent whole), with the
/// caller's deadline if given: the messages read, and how the stream ended.
async fn stream(
    agent: &Agent,
    server: &Server,
    timeout: Option<Duration>,
) -> (usize, Result<(), tonic::Status>) {
    let mut client = AgentServiceClient::new(stack!(agent, server));
    let mut request = Request::new(tokio_stream::iter([pb::AgentMessage::default()]));
    request.extensions_mut().insert(Idempotent(true));
    if let Some(timeout) = timeout {
        request.set_timeout(timeout);
    }
    let mut messages = match tokio::time::timeout(WAIT, client.connect(request))
        .await
        .expect("the head comes in time")
    {
        Ok(response) => response.into_inner(),
        Err(status) => return (0, Err(status)),
    };
    let mut read = 0;
    loop {
        match tokio::time::timeout(WAIT, messages.message())
            .await
            .expect("the stream ends in time")
        {
            Ok(Some(_)) => read += 1,
            Ok(None) => return (read, Ok(())),
            Err(status) => return (read, Err(status)),
        }
    }
}

/// Until the server has seen `n` resets, for at most [`WAIT`].
async fn resets_reach(server: &Server, n: u32) {
    let end = Instant::now() + WAIT;
    while server.resets.load(Ordering::Relaxed) < n {
        assert!(Instant::now() < end, "the server saw no reset");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_unary_answer_stalled_after_its_head_ends_at_the_callers_deadline() {
    let server = serve(Plan {
        every: Duration::from_secs(10),
        messages: 1,
    })
    .await;
    let agent = agent(&policy("max_attempts: 3"));
    let start = Instant::now();
    let status = get(&agent, &server, Some(Duration::from_millis(300)))
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        (Duration::from_millis(300)..Duration::from_secs(3)).contains(&took),
        "took {took:?}"
    );
    // What was unread is let go: the server's stream is reset.
    resets_reach(&server, 1).await;
}

#[tokio::test]
async fn after_an_answer_the_callers_deadline_ended_the_connection_serves_the_next_call() {
    let server = serve(Plan {
        every: Duration::from_secs(10),
        messages: 1,
    })
    .await;
    let agent = agent(&policy("max_attempts: 3"));
    let mut client = AdminServiceClient::new(stack!(agent, &server));
    for reset in 1..=2 {
        let mut request = Request::new(pb::GetRequest { version: 0 });
        request.extensions_mut().insert(Idempotent(true));
        request.set_timeout(Duration::from_millis(200));
        let status = tokio::time::timeout(WAIT, client.get(request))
            .await
            .expect("the call ends in time")
            .unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        resets_reach(&server, reset).await;
    }
    // Both calls on the one connection: a reset stream, not a closed connection.
    assert_eq!(server.connections.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_unary_answer_within_the_callers_deadline_is_read_whole() {
    let server = serve(Plan {
        every: Duration::from_millis(50),
        messages: 1,
    })
    .await;
    let agent = agent(&policy("max_attempts: 3"));
    assert_eq!(
        get(&agent, &server, Some(Duration::from_secs(5)))
            .await
            .unwrap(),
        7
    );
    assert_eq!(server.resets.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_stream_gets_what_comes_before_the_callers_deadline_then_deadline_exceeded() {
    // A message every 100 ms, 30 of them; the caller gives the RPC 450 ms.
    let server = serve(Plan {
        every: Duration::from_millis(100),
        messages: 30,
    })
    .await;
    let agent = agent(&policy("max_attempts: 3"));
    let start = Instant::now();
    let (read, end) = stream(&agent, &server, Some(Duration::from_millis(450))).await;
    let took = start.elapsed();
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // About four (a busy machine may read a few more that were there by then), never all.
    assert!(read < 30, "read {read}");
    assert!(
        (Duration::from_millis(450)..Duration::from_secs(3)).contains(&took),
        "took {took:?}"
    );
    resets_reach(&server, 1).await;
}

#[tokio::test]
async fn the_policys_deadline_bounds_a_stream_until_its_head_only() {
    // The stream lasts about 2 s; the policy's deadline is 1 s (the head has all of it, on a
    // loaded machine too), and the caller sets none.
    let server = serve(Plan {
        every: Duration::from_millis(100),
        messages: 20,
    })
    .await;
    let agent = agent(&policy(
        "max_attempts: 3\nper_try_timeout: 1s\ndeadline: 1s",
    ));
    let (read, end) = stream(&agent, &server, None).await;
    end.unwrap();
    assert_eq!(read, 20);
}

#[tokio::test]
async fn a_slow_reader_gets_the_whole_stream_the_upstream_ended_before_the_deadline() {
    // Five messages and the status at once; the caller reads one every 200 ms, past its
    // 500 ms deadline: what the upstream sent in time is not lost to the slow reader.
    let server = serve(Plan {
        every: Duration::ZERO,
        messages: 5,
    })
    .await;
    let agent = agent(&policy("max_attempts: 3"));
    let mut client = AgentServiceClient::new(stack!(agent, &server));
    let mut request = Request::new(tokio_stream::iter([pb::AgentMessage::default()]));
    request.set_timeout(Duration::from_millis(500));
    let mut messages = client.connect(request).await.unwrap().into_inner();
    let mut read = 0;
    let end = loop {
        match tokio::time::timeout(WAIT, messages.message())
            .await
            .unwrap()
        {
            Ok(Some(_)) => read += 1,
            Ok(None) => break Ok(()),
            Err(status) => break Err(status),
        }
        // The reader's own pace (not a wait for something to happen).
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!((read, end.map_err(|s| s.code())), (5, Ok(())));
}

#[tokio::test]
async fn an_answer_all_there_before_the_deadline_and_read_after_it_is_read_whole_and_ends() {
    let server = serve(Plan {
        every: Duration::ZERO,
        messages: 1,
    })
    .await;
    let agent = agent(&policy("max_attempts: 3"));
    let mut service = stack!(agent, &server);
    let request = http::Request::post(format!(
        "http://{}/retryplane.v1.AdminService/Get",
        server.addr
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .header("grpc-timeout", "1000m")
    .body(http_body_util::Full::new(framed(&pb::GetRequest {
        version: 0,
    })))
    .unwrap();
    let start = Instant::now();
    let response = tower::ServiceExt::ready(&mut service)
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap();
    // The answer came at once; its body is first read well after the deadline.
    tokio::time::sleep_until(start + Duration::from_millis(1300)).await;
    let mut body = response.into_body();
    let mut data = 0;
    let mut status = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        if let Some(d) = frame.data_ref() {
            data += d.len();
        }
        if let Some(t) = frame.trailers_ref() {
            status = t.get("grpc-status").cloned();
        }
    }
    assert_eq!(data, message_for("/Get").len());
    assert_eq!(status.as_ref().map(|s| s.as_bytes()), Some(&b"0"[..]));
    // Read again after its end: still the end, not an error.
    assert!(body.frame().await.is_none());
}
