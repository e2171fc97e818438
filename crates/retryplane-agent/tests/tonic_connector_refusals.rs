//! README: "A request the client refuses to send is the caller's error: it fails at once, is not
//! retried, and is not counted (… the "unsupported scheme" of hyper-rustls's …)". A tonic
//! channel built with hyper-rustls' `HttpsConnector` (`https_only()`, through
//! `Endpoint::connect_with_connector`) refuses an `http://` channel the same way, before dialing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use hyper_util::rt::TokioIo;
use retryplane_agent::{Agent, CallMeta, Cause};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;

/// The longest any call may take.
const WAIT: Duration = Duration::from_secs(10);

const GET: &str = "/retryplane.v1.AdminService/Get";

/// An agent whose `ep` makes 3 attempts, with a breaker that opens at half of 4 attempts.
fn guarded() -> Agent {
    support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 3\n",
    )
}

#[tokio::test]
async fn an_http_channel_through_an_https_only_connector_under_tonic_is_not_retried_nor_held_against_the_upstream()
 {
    // Stands in for hyper-rustls' `HttpsConnector::https_only()`: it refuses a URI that is not
    // `https` with `io::Error::other("unsupported scheme http")` (its connector.rs), before
    // dialing.
    let https_only = tower::service_fn(|dst: http::Uri| {
        let message = match dst.scheme() {
            Some(scheme) => format!("unsupported scheme {scheme}"),
            None => "missing scheme".to_owned(),
        };
        std::future::ready(Err::<TokioIo<tokio::net::TcpStream>, _>(
            std::io::Error::other(message),
        ))
    });
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
    let err = tokio::time::timeout(WAIT, get())
        .await
        .expect("the call ends")
        .expect_err("the connector refuses the URI");
    assert_eq!(
        err.attempts, 1,
        "a channel URI the connector refused to dial was tried again: {err:?}"
    );
    for _ in 0..3 {
        let _ = tokio::time::timeout(WAIT, get())
            .await
            .expect("the call ends");
    }
    let healthy = tokio::time::timeout(
        WAIT,
        agent.endpoint("ep").call(CallMeta::grpc(GET), |_| async {
            Ok::<_, tonic::Status>(tonic::Response::new(()))
        }),
    )
    .await
    .expect("the call ends")
    .map(|_| ())
    .map_err(|e| e.cause);
    assert_eq!(
        healthy,
        Ok::<(), Cause>(()),
        "the caller's own channel URI opened the endpoint's breaker: {:?}",
        agent.endpoint("ep").pending_counts()
    );
}
