//! A caller's own mistake (a URI its client cannot use) says nothing about the upstream: it is
//! not retried, and it is not held against the endpoint's circuit breaker, whichever client
//! made it (README: "A request the HTTP client refuses to send … is the caller's error: it
//! fails at once, is not retried, and is not counted").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use retryplane_agent::layer::{Idempotent, RetryLayer, into_tonic_request};
use retryplane_agent::{Agent, CallMeta, Cause};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tonic::transport::Channel;

/// The longest any call may take.
const WAIT: Duration = Duration::from_secs(10);

const GET: &str = "/retryplane.v1.AdminService/Get";

/// An agent whose `ep` makes 3 attempts, with a breaker that opens at half of 4 attempts.
fn guarded() -> Agent {
    support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 3\n",
    )
}

/// A channel built from a URI without a scheme (`host:port`, as a gRPC target is often
/// written): tonic accepts it, and refuses every request on it ("invalid URI") before any
/// connection.
fn schemeless_channel() -> Channel {
    Channel::from_shared("127.0.0.1:50051".to_owned())
        .expect("tonic accepts the URI")
        .connect_lazy()
}

/// A call of `ep` whose upstream answers at once: whether the agent let it through.
async fn a_healthy_call(agent: &Agent) -> Result<(), Cause> {
    tokio::time::timeout(
        WAIT,
        agent.endpoint("ep").call(CallMeta::grpc(GET), |_| async {
            Ok::<_, tonic::Status>(tonic::Response::new(()))
        }),
    )
    .await
    .expect("the call ends")
    .map(|_| ())
    .map_err(|e| e.cause)
}

/// Stands in for hyper-rustls' `HttpsConnector` built `https_only()`: it refuses a URI that is
/// not `https` with `io::Error::other("unsupported scheme http")` (its connector.rs), and a
/// scheme-less one with "missing scheme", before dialing.
fn refuse_unless_https(
    dst: http::Uri,
) -> std::future::Ready<Result<hyper_util::rt::TokioIo<tokio::net::TcpStream>, std::io::Error>> {
    let message = match dst.scheme() {
        Some(scheme) => format!("unsupported scheme {scheme}"),
        None => "missing scheme".to_owned(),
    };
    std::future::ready(Err(std::io::Error::other(message)))
}

/// `get` (a call of `agent`'s `ep` that its client refuses to send: `what`) fails at its first
/// attempt, and four such calls leave the endpoint's breaker closed to a healthy call.
async fn refused_at_once_and_not_counted<T, E, Fut>(
    agent: &Agent,
    get: impl Fn() -> Fut,
    what: &str,
) where
    Fut: Future<Output = Result<T, retryplane_agent::CallError<T, E>>>,
    retryplane_agent::CallError<T, E>: std::fmt::Debug,
{
    for _ in 0..4 {
        let err = tokio::time::timeout(WAIT, get())
            .await
            .expect("the call ends")
            .err()
            .expect("the client refuses it");
        assert_eq!(err.attempts, 1, "{what} was tried again: {err:?}");
    }
    assert_eq!(
        a_healthy_call(agent).await,
        Ok(()),
        "{what} opened the endpoint's breaker: {:?}",
        agent.endpoint("ep").pending_counts()
    );
}

#[tokio::test]
async fn a_tonic_channel_with_a_uri_it_refuses_does_not_open_the_breaker_for_the_endpoints_other_calls()
 {
    // tonic refuses the request itself (`UNKNOWN`, "transport error" over its `InvalidUri`):
    // nothing was sent, so four such calls must not open the breaker for the endpoint's
    // healthy calls.
    let agent = guarded();
    let client = AdminServiceClient::new(schemeless_channel());
    let ep = agent.endpoint("ep");
    let get = || {
        ep.call(CallMeta::grpc(GET), |_| {
            let mut client = client.clone();
            async move { client.get(pb::GetRequest { version: 0 }).await }
        })
    };
    refused_at_once_and_not_counted(&agent, get, "the caller's own bad URI").await;
}

#[tokio::test]
async fn a_tonic_channel_with_a_uri_it_refuses_is_not_retried_nor_held_against_the_upstream_through_the_layer()
 {
    // The same channel under the tower layer: the layer sees tonic's transport error
    // (`InvalidUri`) bare, not a status.
    let agent = guarded();
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("ep")))
        .map_request(into_tonic_request)
        .service(schemeless_channel());
    let mut client = AdminServiceClient::new(service);
    let mut get = async || {
        let mut request = tonic::Request::new(pb::GetRequest { version: 0 });
        request.extensions_mut().insert(Idempotent(true));
        tokio::time::timeout(WAIT, client.get(request))
            .await
            .expect("the call ends")
            .expect_err("nothing can be sent on the channel")
    };
    get().await;
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (c.attempts, c.retries),
        (1, 0),
        "a request tonic refused to send was sent again, as if the upstream had reset it: {c:?}"
    );
    for _ in 0..3 {
        get().await;
    }
    assert_eq!(
        a_healthy_call(&agent).await,
        Ok(()),
        "the caller's own bad URI opened the endpoint's breaker: {:?}",
        agent.endpoint("ep").pending_counts()
    );
}

#[tokio::test]
async fn a_grpc_request_a_proxy_refuses_as_too_large_does_not_open_the_breaker() {
    // A proxy in front of a gRPC upstream refuses a message over its size limit with a plain
    // HTTP 413 (no `grpc-status`): the caller's request is at fault, and as an HTTP answer a
    // 413 "says nothing about the upstream's health". Read as tonic reads it (`UNKNOWN`), it
    // counts as a server error: four such calls open the breaker for the endpoint's other calls.
    use http_body_util::{BodyExt as _, Full};
    use tower::{Layer as _, ServiceExt as _};
    let agent = guarded();
    let (proxy, seen) = support::status_upstream::<Full<bytes::Bytes>>(&[413, 413, 413, 413]);
    let client = RetryLayer::new(agent.endpoint("ep")).layer(proxy);
    let request = || {
        http::Request::post("http://up/pkg.Svc/Upload")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Full::new(bytes::Bytes::from_static(b"\0\0\0\0\x01x")))
            .unwrap()
    };
    for _ in 0..4 {
        let answer = tokio::time::timeout(WAIT, client.clone().oneshot(request()))
            .await
            .expect("the call ends")
            .expect("the proxy's answer");
        assert_eq!(answer.status(), 413);
        let _ = answer.into_body().collect().await;
    }
    let answer = tokio::time::timeout(WAIT, client.clone().oneshot(request()))
        .await
        .expect("the call ends");
    assert!(
        matches!(&answer, Ok(a) if a.status() == 200),
        "a request that fits was refused: {:?}; {:?}",
        answer.map(|a| a.status()),
        agent.endpoint("ep").pending_counts()
    );
    assert_eq!(seen.lock().unwrap().len(), 5);
}

#[tokio::test]
async fn an_http_url_through_an_https_only_connector_is_not_retried_nor_held_against_the_upstream()
{
    // hyper-rustls' `HttpsConnector` built `https_only()` (a common builder step) refuses a
    // URL that is not `https` with `io::Error::other("unsupported scheme http")` (its
    // connector.rs), before dialing; a scheme-less one with "missing scheme". Stood in for here
    // by a connector that refuses the same way. Nothing was sent: the caller's own error, as
    // the same URL through hyper-util's plain connector is ("invalid URL, scheme is not
    // http"). README: "a URL its connector cannot dial … is not retried, and is not counted".
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let https_only = tower::service_fn(refuse_unless_https);
    let client: Client<_, Full<bytes::Bytes>> =
        Client::builder(TokioExecutor::new()).build(https_only);
    let agent = guarded();
    let ep = agent.endpoint("ep");
    let get = || {
        let client = client.clone();
        ep.call(CallMeta::http("GET", "/v1/x"), move |_| {
            client.request(
                http::Request::get("http://127.0.0.1:9/v1/x")
                    .body(Full::default())
                    .unwrap(),
            )
        })
    };
    refused_at_once_and_not_counted(&agent, get, "a URL the connector refused to dial").await;
}

#[tokio::test]
async fn an_http_channel_through_an_https_only_connector_under_tonic_is_not_retried_nor_held_against_the_upstream()
 {
    // A tonic channel built with hyper-rustls' `HttpsConnector` (`https_only()`, through
    // `Endpoint::connect_with_connector`) refuses an `http://` channel before dialing. This
    // stands in for hyper-rustls' `HttpsConnector::https_only()`: it refuses a URI that is not
    // `https` with `io::Error::other("unsupported scheme http")` (its connector.rs), before
    // dialing.
    let https_only = tower::service_fn(refuse_unless_https);
    let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:9")
        .connect_with_connector_lazy(https_only);
    let client = AdminServiceClient::new(channel);
    let agent = guarded();
    let ep = agent.endpoint("ep");
    let get = || {
        let client = client.clone();
        ep.call(CallMeta::grpc(GET).idempotent(true), move |_| {
            let mut client = client.clone();
            async move { client.get(pb::GetRequest { version: 0 }).await }
        })
    };
    refused_at_once_and_not_counted(&agent, get, "a channel URI the connector refused to dial")
        .await;
}
