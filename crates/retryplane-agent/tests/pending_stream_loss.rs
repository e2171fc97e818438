//! A gRPC request that waits for a stream slot (the server's `SETTINGS_MAX_CONCURRENT_STREAMS`
//! is reached) when the server's connection is lost was never sent: the upstream went away, the
//! caller did nothing wrong. hyper hands such a request its "dispatch task is gone" error (an
//! `is_user` kind: the connection task dropped the request it held), and tonic makes it an
//! `UNKNOWN` status with that error as its source. README: "A request the client refuses to send
//! is the caller's error" — this one the client did not refuse; the server's connection died.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use retryplane_agent::{CallMeta, Classification, Classify};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// The longest any call may take.
const WAIT: Duration = Duration::from_secs(10);

const GET: &str = "/retryplane.v1.AdminService/Get";

/// An upstream on 127.0.0.1:0 whose first connection allows one stream at a time and holds
/// the first request unanswered: `held` says when it has it; on `cut` that connection is
/// dropped (the process crashed, the proxy restarted). Every later connection answers each
/// request `OK` with an empty message.
async fn one_stream_upstream() -> (SocketAddr, oneshot::Receiver<()>, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (held_tx, held_rx) = oneshot::channel();
    let (cut_tx, cut_rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut conn = h2::server::Builder::new()
            .max_concurrent_streams(1)
            .handshake::<_, Bytes>(socket)
            .await
            .unwrap();
        let first = conn.accept().await.unwrap().unwrap();
        let _ = held_tx.send(());
        tokio::select! {
            _ = cut_rx => {}
            _ = async { while conn.accept().await.is_some() {} } => {}
        }
        drop(first);
        drop(conn);
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let head = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .body(())
                        .unwrap();
                    let Ok(mut send) = respond.send_response(head, false) else {
                        continue;
                    };
                    let _ = send.send_data(Bytes::from_static(b"\0\0\0\0\0"), false);
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    let _ = send.send_trailers(trailers);
                }
            });
        }
    });
    (addr, held_rx, cut_tx)
}

/// A tonic client of `addr`, with the first request held by the upstream and a second one
/// waiting for its stream slot: the upstream's first connection is then cut, and the second
/// request's result returned.
async fn second_request_when_the_connection_is_lost<F, Fut, T>(run: F) -> T
where
    F: FnOnce(AdminServiceClient<Channel>) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let (addr, held, cut) = one_stream_upstream().await;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = AdminServiceClient::new(channel);
    let mut first_client = client.clone();
    let first = tokio::spawn(async move {
        let _ = first_client.get(pb::GetRequest { version: 0 }).await;
    });
    tokio::time::timeout(WAIT, held)
        .await
        .expect("the upstream gets the first request")
        .unwrap();
    let mut second = tokio::spawn(run(client));
    // The second request cannot start a stream while the first holds the only one. Nothing
    // says when it is queued behind it (no frame is sent for it), so this waits a bounded
    // while; a request not yet queued when the connection is cut would take a new one and
    // make one attempt, which the tests below check.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut second)
            .await
            .is_err(),
        "the second request ended while the first held the connection's only stream"
    );
    cut.send(()).unwrap();
    let out = tokio::time::timeout(WAIT, second)
        .await
        .expect("the second request ends")
        .unwrap();
    first.abort();
    out
}

#[tokio::test]
async fn a_grpc_request_left_waiting_for_a_stream_when_the_server_connection_is_lost_is_not_the_callers_own_error()
 {
    let status = second_request_when_the_connection_is_lost(|mut client| async move {
        client
            .get(pb::GetRequest { version: 0 })
            .await
            .expect_err("its connection was lost before it was sent")
    })
    .await;
    assert_ne!(
        status.classify(),
        Classification::Fatal,
        "a request the server's lost connection left unsent is taken for the caller's own \
         error (not retried, not counted): {status:?}"
    );
}

#[tokio::test]
async fn a_grpc_request_left_waiting_for_a_stream_when_the_server_connection_is_lost_is_retried_when_retry_on_lists_its_code()
 {
    // tonic gives the request `UNKNOWN`; a policy that retries `UNKNOWN` (and every transport
    // failure) retried it before e1cd49a, and the restarted upstream answers the retry.
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  retry_on:\n    http_status: [503]\n    grpc_status: [UNAVAILABLE, UNKNOWN]\n    errors: [connect, reset, timeout]\nendpoints:\n  ep:\n    max_attempts: 3\n",
    );
    let ep = agent.endpoint("ep");
    let attempts = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&attempts);
    let result = second_request_when_the_connection_is_lost(move |client| async move {
        ep.call(CallMeta::grpc(GET).idempotent(true), move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
            let mut client = client.clone();
            async move { client.get(pb::GetRequest { version: 0 }).await }
        })
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
    })
    .await;
    assert_eq!(
        (result, attempts.load(Ordering::Relaxed)),
        (Ok(()), 2),
        "an idempotent request the server's lost connection left unsent was not retried \
         (or its first attempt was not the one the lost connection held)"
    );
}

#[tokio::test]
async fn an_http2_get_left_waiting_for_a_stream_when_the_server_connection_is_lost_is_retried_under_the_default_retry_on()
 {
    // The same through hyper-util's client (as reqwest's HTTP/2): the request it held for a
    // stream slot comes back with hyper's "dispatch task is gone", taken for the caller's own
    // error (`is_user`), so an idempotent GET that was never sent is not retried, whatever
    // `retry_on.errors` lists.
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let (addr, held, cut) = one_stream_upstream().await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let request = move || {
        http::Request::get(format!("http://{addr}/v1/x"))
            .body(Full::default())
            .unwrap()
    };
    let first = tokio::spawn({
        let client = client.clone();
        async move {
            let _ = client.request(request()).await;
        }
    });
    tokio::time::timeout(WAIT, held)
        .await
        .expect("the upstream gets the first request")
        .unwrap();
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\nendpoints:\n  ep:\n    max_attempts: 3\n",
    );
    let ep = agent.endpoint("ep");
    let attempts = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&attempts);
    let mut second = tokio::spawn(async move {
        ep.call(CallMeta::http("GET", "/v1/x"), move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
            client.request(request())
        })
        .await
        .map(|answer| answer.status().as_u16())
        .map_err(|e| format!("{e:?}"))
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut second)
            .await
            .is_err(),
        "the second request ended while the first held the connection's only stream"
    );
    cut.send(()).unwrap();
    let result = tokio::time::timeout(WAIT, second)
        .await
        .expect("the second request ends")
        .unwrap();
    first.abort();
    assert_eq!(
        (result, attempts.load(Ordering::Relaxed)),
        (Ok(200), 2),
        "an idempotent GET the server's lost connection left unsent was not retried (or its \
         first attempt was not the one the lost connection held)"
    );
}
