//! A proxy's HTTP answer (no `grpc-status`) to a gRPC request, from a real hyper HTTP/2 server
//! on 127.0.0.1:0: through the layer it counts as the code tonic's client maps its status to,
//! and the client reads why the call gave up in the status's metadata.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retryplane_agent::Agent;
use retryplane_agent::layer::{Idempotent, RetryLayer, into_tonic_request};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

const WAIT: Duration = Duration::from_secs(15);

/// An HTTP/2 "proxy" answering every request `status` with `body` (text/html, no grpc-status).
async fn proxy(status: u16, body: &'static [u8]) -> (Arc<AtomicU32>, Channel) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicU32::new(0));
    let counted = seen.clone();
    tokio::spawn(async move {
        for _ in 0..64 {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async move {
                        Ok::<_, Infallible>(
                            http::Response::builder()
                                .status(status)
                                .header("content-type", "text/html")
                                .body(Full::new(Bytes::from_static(body)))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(WAIT)
        .connect()
        .await
        .unwrap();
    (seen, channel)
}

fn agent(lines: &str) -> Agent {
    let yaml = format!(
        "version: 1\ndefaults:\n  backoff: {{base: 5ms, max: 20ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  upstream:\n{lines}"
    );
    let loaded = retryplane_policy::load(yaml.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    Agent::from_policies_seeded(loaded.policies.unwrap(), 1)
}

const UNAVAILABLE_ONLY: &str = "    max_attempts: 3\n    retry_on: {grpc_status: [UNAVAILABLE]}\n";

/// A `Get` through the layer with a generated client.
async fn get_through_layer(agent: &Agent, channel: Channel) -> Status {
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel);
    let mut client = AdminServiceClient::new(service);
    let mut request = Request::new(pb::GetRequest { version: 0 });
    request.extensions_mut().insert(Idempotent(true));
    tokio::time::timeout(WAIT, client.get(request))
        .await
        .expect("the call ends in time")
        .expect_err("the call fails")
}

fn why(status: &Status) -> (Option<String>, Option<String>) {
    let text = |name| {
        status
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    (text("retryplane-gave-up"), text("retryplane-attempts"))
}

/// A proxy's 503 with an empty body is `UNAVAILABLE` for the client and the layer alike, and
/// the layer's answer says why the call gave up.
#[tokio::test]
async fn a_proxys_empty_503_is_unavailable_and_says_why_the_call_gave_up() {
    let (seen, channel) = proxy(503, b"").await;
    let agent = agent(UNAVAILABLE_ONLY);
    let status = get_through_layer(&agent, channel).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 3);
    assert_eq!(
        why(&status),
        (Some("attempts_exhausted".to_owned()), Some("3".to_owned())),
        "{status:?}"
    );
}
