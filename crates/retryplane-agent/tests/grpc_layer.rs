//! A generated tonic client over a `Channel` wrapped with the retry layer, against a real
//! tonic server on 127.0.0.1:0 whose errors are "Trailers-Only" responses (HTTP 200 with
//! `grpc-status` in the headers): the layer classifies them by their gRPC code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_agent::layer::{Idempotent, RetryError, RetryLayer, into_tonic_request};
use retryplane_agent::{
    Agent, CallError, CallMeta, Cause, Classification, Classify as _, CounterValues, GiveUpCause,
    Outcome,
};
use retryplane_policy::ErrorClass;
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::admin_service_server::{AdminService, AdminServiceServer};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// The longest any wait may take.
const WAIT: Duration = Duration::from_secs(15);

/// One scripted answer: an error code and its pushback (ms), if any.
type Scripted = (Code, Option<&'static str>);

/// An `AdminService` whose `Get` plays a script of errors, then answers version 7; the other
/// methods are not used.
#[derive(Clone, Default)]
struct Upstream {
    script: Arc<Mutex<VecDeque<Scripted>>>,
    gets: Arc<Mutex<u32>>,
    /// The `grpc-timeout` each `Get` came with, read as the server reads it.
    timeouts: Arc<Mutex<Vec<Option<Duration>>>>,
}

impl Upstream {
    fn gets(&self) -> u32 {
        *self.gets.lock().unwrap()
    }

    fn timeouts(&self) -> Vec<Option<Duration>> {
        self.timeouts.lock().unwrap().clone()
    }
}

/// A `grpc-timeout` value (gRPC over HTTP/2: 1 to 8 digits and a unit).
fn read_grpc_timeout(value: &str) -> Duration {
    let (digits, unit) = value.split_at(value.len() - 1);
    assert!((1..=8).contains(&digits.len()), "{value:?}");
    let n: u64 = digits.parse().unwrap();
    match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => panic!("not a grpc-timeout: {value:?}"),
    }
}

fn unused<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not used by the test"))
}

#[tonic::async_trait]
impl AdminService for Upstream {
    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        *self.gets.lock().unwrap() += 1;
        let timeout = request
            .metadata()
            .get("grpc-timeout")
            .map(|v| read_grpc_timeout(v.to_str().unwrap()));
        self.timeouts.lock().unwrap().push(timeout);
        let next = self.script.lock().unwrap().pop_front();
        match next {
            Some((code, pushback)) => {
                let mut status = Status::new(code, "scripted");
                if let Some(ms) = pushback {
                    status
                        .metadata_mut()
                        .insert("grpc-retry-pushback-ms", ms.parse().unwrap());
                }
                Err(status)
            }
            None => Ok(Response::new(pb::GetResponse {
                info: Some(pb::VersionInfo {
                    version: 7,
                    ..Default::default()
                }),
                ..Default::default()
            })),
        }
    }

    async fn validate(
        &self,
        _: Request<pb::ValidateRequest>,
    ) -> Result<Response<pb::ValidateResponse>, Status> {
        unused()
    }
    async fn apply(
        &self,
        _: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        unused()
    }
    async fn history(
        &self,
        _: Request<pb::HistoryRequest>,
    ) -> Result<Response<pb::HistoryResponse>, Status> {
        unused()
    }
    async fn rollback(
        &self,
        _: Request<pb::RollbackRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        unused()
    }
    async fn fleet_status(
        &self,
        _: Request<pb::FleetStatusRequest>,
    ) -> Result<Response<pb::FleetStatusResponse>, Status> {
        unused()
    }
    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        unused()
    }
}

/// Starts the scripted server on 127.0.0.1:0 and returns it with a channel to it.
async fn serve(script: &[Scripted]) -> (Upstream, Channel) {
    let upstream = Upstream::default();
    *upstream.script.lock().unwrap() = script.iter().copied().collect();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AdminServiceServer::new(upstream.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(WAIT)
        .connect()
        .await
        .unwrap();
    (upstream, channel)
}

/// Fast deterministic pauses, no budget or breaker: `upstream` has 3 attempts.
fn agent() -> Agent {
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  upstream:\n    max_attempts: 3\n";
    let loaded = retryplane_policy::load(yaml.as_bytes());
    Agent::from_policies_seeded(loaded.policies.unwrap(), 1)
}

/// A `Get` through the layer, declared idempotent or not.
async fn get(agent: &Agent, channel: Channel, idempotent: Option<bool>) -> Result<u64, Status> {
    get_within(agent, channel, idempotent, None).await
}

/// [`get`], with the caller's own deadline (`grpc-timeout`) when `timeout` is given.
async fn get_within(
    agent: &Agent,
    channel: Channel,
    idempotent: Option<bool>,
    timeout: Option<Duration>,
) -> Result<u64, Status> {
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel);
    get_through(service, idempotent, timeout).await
}

/// A `Get` through `service` (a stack over a channel), declared idempotent or not when
/// `idempotent` says, with the caller's own deadline when `timeout` is given: the version it
/// answered, within [`WAIT`].
async fn get_through<T>(
    service: T,
    idempotent: Option<bool>,
    timeout: Option<Duration>,
) -> Result<u64, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tower::BoxError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tower::BoxError> + Send,
{
    let mut client = AdminServiceClient::new(service);
    let mut request = Request::new(pb::GetRequest { version: 0 });
    if let Some(declared) = idempotent {
        request.extensions_mut().insert(Idempotent(declared));
    }
    if let Some(timeout) = timeout {
        request.set_timeout(timeout);
    }
    let response = tokio::time::timeout(WAIT, client.get(request))
        .await
        .expect("the call ends in time")?;
    Ok(response.into_inner().info.unwrap().version)
}

fn counts(agent: &Agent) -> CounterValues {
    agent.endpoint("upstream").pending_counts()
}

#[tokio::test]
async fn unavailable_twice_then_ok_succeeds_at_the_third_attempt_honouring_the_pushback() {
    let (upstream, channel) =
        serve(&[(Code::Unavailable, Some("60")), (Code::Unavailable, None)]).await;
    let agent = agent();
    assert_eq!(get(&agent, channel, Some(true)).await.unwrap(), 7);
    assert_eq!(upstream.gets(), 3);
    let c = counts(&agent);
    assert_eq!(
        (c.calls, c.attempts, c.retries, c.success_after_retry),
        (1, 3, 2, 1)
    );
    assert_eq!((c.success_first_try, c.gave_up_not_retryable), (0, 0));
    // The pushback replaced the first pause (5 ms); after it the schedule starts over (gRFC
    // A6), so the second pause is the base again, 5 ms, not 10.
    assert_eq!(c.retry_after_honored, 1);
    assert_eq!(c.backoff_ms, 60 + 5);
}

#[tokio::test]
async fn the_grpc_client_reads_why_the_call_gave_up_in_the_status_metadata() {
    let why = |status: &Status| {
        let text = |name| {
            status
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        (
            text("retryplane-gave-up"),
            text("retryplane-attempts"),
            text("grpc-retry-pushback-ms"),
        )
    };
    // The upstream pushes back each time; once the call gives up, the answer says "do not
    // retry" in its stead, for whoever it is handed on to.
    let unavailable = [(Code::Unavailable, Some("1")); 3];
    let (_, channel) = serve(&unavailable).await;
    let status = get(&agent(), channel, Some(true)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let expected = (
        Some("attempts_exhausted".to_owned()),
        Some("3".to_owned()),
        Some("-1".to_owned()),
    );
    assert_eq!(why(&status), expected);
    let (_, channel) = serve(&[(Code::InvalidArgument, None)]).await;
    let status = get(&agent(), channel, Some(true)).await.unwrap_err();
    let expected = (
        Some("not_retryable".to_owned()),
        Some("1".to_owned()),
        Some("-1".to_owned()),
    );
    assert_eq!(why(&status), expected);
}

#[tokio::test]
async fn a_non_retryable_code_returns_at_once_and_counts_as_a_failure() {
    let (upstream, channel) = serve(&[(Code::InvalidArgument, None)]).await;
    let agent = agent();
    let status = get(&agent, channel, Some(true)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(upstream.gets(), 1);
    let c = counts(&agent);
    assert_eq!((c.calls, c.attempts, c.retries), (1, 1, 0));
    assert_eq!((c.success_first_try, c.gave_up_not_retryable), (0, 1));
}

#[tokio::test]
async fn a_grpc_call_not_declared_idempotent_is_not_retried() {
    for declared in [None, Some(false)] {
        let (upstream, channel) = serve(&[(Code::Unavailable, None)]).await;
        let agent = agent();
        let status = get(&agent, channel, declared).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{declared:?}");
        assert_eq!(upstream.gets(), 1, "{declared:?}");
        let c = counts(&agent);
        assert_eq!(
            (c.attempts, c.gave_up_not_retryable),
            (1, 1),
            "{declared:?}"
        );
    }
}

/// A channel to a port on 127.0.0.1 that nothing listens on (bound, then released).
async fn channel_to_a_closed_port() -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(WAIT)
        .connect_lazy()
}

/// A call over `channel`, which cannot connect, fails with UNAVAILABLE over a connect error,
/// and the agent sends it again although it is not declared idempotent: the request never
/// left.
async fn a_connect_error_retried_whatever_the_method(channel: Channel) {
    let mut client = AdminServiceClient::new(channel);
    let status = tokio::time::timeout(WAIT, client.get(pb::GetRequest { version: 0 }))
        .await
        .expect("the call ends in time")
        .unwrap_err();
    // tonic says UNAVAILABLE; the transport error below it says the request never left.
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        status.classify(),
        Classification::Outcome(Outcome::Transport(ErrorClass::Connect))
    );

    // Not declared idempotent: only a failed connect may be sent again.
    let agent = agent();
    let ep = agent.endpoint("upstream");
    let err = tokio::time::timeout(
        WAIT,
        ep.call(CallMeta::grpc("/retryplane.v1.AdminService/Get"), |_| {
            let mut client = client.clone();
            async move { client.get(pb::GetRequest { version: 0 }).await }
        }),
    )
    .await
    .expect("the call ends in time")
    .unwrap_err();
    assert_eq!(err.cause.to_string(), "attempts_exhausted");
    let c = counts(&agent);
    assert_eq!((c.calls, c.attempts, c.retries), (1, 3, 2));
    assert_eq!(c.gave_up_not_retryable, 0);
}

#[tokio::test]
async fn a_failed_connect_is_a_connect_error_and_retried_whatever_the_method() {
    a_connect_error_retried_whatever_the_method(channel_to_a_closed_port().await).await;
}

/// An idempotent `Get` on `channel` through the agent's endpoint `upstream` (`Endpoint::call`),
/// which must fail: its error.
async fn idempotent_get_fails(
    agent: &Agent,
    channel: Channel,
) -> CallError<Response<pb::GetResponse>, Status> {
    let client = AdminServiceClient::new(channel);
    let meta = CallMeta::grpc("/retryplane.v1.AdminService/Get").idempotent(true);
    tokio::time::timeout(
        WAIT,
        agent.endpoint("upstream").call(meta, |_| {
            let mut client = client.clone();
            async move { client.get(pb::GetRequest { version: 0 }).await }
        }),
    )
    .await
    .expect("the call ends in time")
    .expect_err("the call fails")
}

#[tokio::test]
async fn a_failed_grpc_connect_is_retried_by_retry_on_errors_connect_not_by_its_code() {
    // UNAVAILABLE is not listed: only the transport class can make the call retry.
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  upstream:\n    max_attempts: 3\n    retry_on: {grpc_status: [INTERNAL], errors: [connect]}\n";
    let loaded = retryplane_policy::load(yaml.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    let agent = Agent::from_policies_seeded(loaded.policies.unwrap(), 1);
    let err = idempotent_get_fails(&agent, channel_to_a_closed_port().await).await;
    assert_eq!(err.cause.to_string(), "attempts_exhausted");
    assert_eq!(counts(&agent).attempts, 3);
}

#[tokio::test]
async fn a_grpc_connect_that_times_out_is_a_connect_error_and_retried_whatever_the_method() {
    // The connector gives up: the request never left, so it is a connect error, not a timeout
    // (an unknown outcome that a call not declared idempotent may not repeat).
    let (listener, _held) = support::full_backlog().await;
    let channel = Channel::from_shared(format!("http://{}", listener.local_addr().unwrap()))
        .unwrap()
        .connect_timeout(Duration::from_millis(200))
        .connect_lazy();
    a_connect_error_retried_whatever_the_method(channel).await;
}

/// A server on 127.0.0.1:0 that accepts every connection and never sends a byte (each held
/// open while the test runs): every call to it hangs until a timeout ends it.
async fn silent_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    addr
}

/// A channel to a [`silent_server`].
async fn channel_to_a_silent_server() -> Channel {
    Channel::from_shared(format!("http://{}", silent_server().await))
        .unwrap()
        .connect_lazy()
}

/// The agent's own error under a status the generated client returned.
fn retry_error(status: &Status) -> &RetryError {
    std::error::Error::source(status)
        .and_then(|e| e.downcast_ref::<RetryError>())
        .expect("the agent's error is the status's source")
}

#[tokio::test]
async fn a_call_whose_attempts_all_time_out_is_deadline_exceeded_for_the_grpc_client() {
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  upstream:\n    max_attempts: 2\n    per_try_timeout: 100ms\n";
    let agent = Agent::from_policies_seeded(
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap(),
        1,
    );
    let status = get(&agent, channel_to_a_silent_server().await, Some(true))
        .await
        .unwrap_err();
    // Not UNKNOWN: the code says time ran out, as for any gRPC call past its deadline.
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        matches!(
            retry_error(&status),
            RetryError::TimedOut { attempts: 2, .. }
        ),
        "{status:?}"
    );
    // As an answer given up on says: not to be retried by whoever it is handed on to.
    assert_eq!(
        gave_up_metadata(&status),
        (Some("-1"), Some("attempts_exhausted"), Some("2"))
    );
    assert_eq!(counts(&agent).gave_up_attempts, 1);
}

/// A status's `grpc-retry-pushback-ms`, `retryplane-gave-up` and `retryplane-attempts`.
fn gave_up_metadata(status: &Status) -> (Option<&str>, Option<&str>, Option<&str>) {
    let get = |key| status.metadata().get(key).and_then(|v| v.to_str().ok());
    (
        get("grpc-retry-pushback-ms"),
        get("retryplane-gave-up"),
        get("retryplane-attempts"),
    )
}

#[tokio::test]
async fn a_call_the_open_breaker_refuses_is_unavailable_for_the_grpc_client() {
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 1, window: 10s, open_for: 60s, half_open_probes: 1}\nendpoints:\n  upstream:\n    max_attempts: 1\n";
    let agent = Agent::from_policies_seeded(
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap(),
        1,
    );
    let (upstream, channel) = serve(&[(Code::Unavailable, None)]).await;
    // The upstream's own UNAVAILABLE opens the breaker.
    let status = get(&agent, channel.clone(), Some(true)).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::Unavailable, "scripted")
    );
    // The next call is refused without an attempt: UNAVAILABLE (what a gRPC client retries
    // elsewhere or later), with the agent's reason, not UNKNOWN.
    let status = get(&agent, channel, Some(true)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        matches!(
            retry_error(&status),
            RetryError::NoAnswer {
                cause: Cause::GaveUp(GiveUpCause::CircuitOpen)
            }
        ),
        "{status:?}"
    );
    assert_eq!(
        gave_up_metadata(&status),
        (Some("-1"), Some("circuit_open"), Some("0"))
    );
    assert_eq!(upstream.gets(), 1);
    assert_eq!(counts(&agent).circuit_open, 1);
}

/// An agent whose endpoint `outer` (3 attempts) is to be stacked above `upstream`
/// (`upstream`'s lines), with `retry_after.honor` as given.
fn stacked_agent(honor: bool, upstream: &str) -> Agent {
    let yaml = format!(
        "version: 1\ndefaults:\n  backoff: {{base: 5ms, max: 20ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\n  retry_after: {{honor: {honor}}}\nendpoints:\n  outer:\n    max_attempts: 3\n  upstream:\n{upstream}"
    );
    Agent::from_policies_seeded(
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap(),
        1,
    )
}

/// An idempotent `Get` through `outer`'s layer stacked above `upstream`'s over `channel`: the
/// status it fails with. Checks that the outer layer made one attempt and gave it up as not
/// retryable.
async fn get_through_stacked_layers(agent: &Agent, channel: Channel, honor: bool) -> Status {
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("outer")))
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel);
    let status = get_through(service, Some(true), None).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unavailable,
        "honor {honor}: {status:?}"
    );
    let outer = agent.endpoint("outer").pending_counts();
    assert_eq!(
        (outer.retries, outer.gave_up_not_retryable),
        (0, 1),
        "honor {honor}: {outer:?}"
    );
    status
}

/// Two layers stacked over one channel: the inner one refuses the call (its breaker open),
/// and the outer one does not send it again (retried at one layer only), whether or not its
/// policy honours the refusal's pushback.
#[tokio::test]
async fn a_layer_stacked_above_does_not_retry_what_the_one_below_refused() {
    for honor in [true, false] {
        let agent = stacked_agent(
            honor,
            "    max_attempts: 1\n    circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 1, window: 10s, open_for: 60s, half_open_probes: 1}\n",
        );
        let (upstream, channel) = serve(&[(Code::Unavailable, None)]).await;
        // The upstream's own UNAVAILABLE opens the inner breaker.
        get(&agent, channel.clone(), Some(true)).await.unwrap_err();
        get_through_stacked_layers(&agent, channel, honor).await;
        assert_eq!(upstream.gets(), 1);
        assert_eq!(
            counts(&agent).circuit_open,
            1,
            "honor {honor}: refused once, not once an outer attempt"
        );
    }
}

/// An answer the inner layer gave up on (an upstream's `UNAVAILABLE` after its attempts) is
/// not sent again by the outer one either, whether or not its policy honours hints.
#[tokio::test]
async fn a_layer_stacked_above_does_not_retry_an_answer_the_one_below_gave_up_on() {
    for honor in [true, false] {
        let agent = stacked_agent(honor, "    max_attempts: 2\n");
        let (upstream, channel) = serve(&[(Code::Unavailable, None); 6]).await;
        let status = get_through_stacked_layers(&agent, channel, honor).await;
        assert_eq!(
            gave_up_metadata(&status),
            (Some("-1"), Some("attempts_exhausted"), Some("2")),
            "honor {honor}: the inner layer's cause and attempts"
        );
        assert_eq!(upstream.gets(), 2, "honor {honor}: 2 attempts, not 2 × 3");
    }
}

#[tokio::test]
async fn a_tonic_request_timeout_is_judged_by_its_code_so_a_callers_deadline_is_not_retried_past() {
    // tonic enforces a caller's deadline (`Request::set_timeout`, the `grpc-timeout` header)
    // and a channel's request timeout alike, below the agent, with the same error
    // (`TimeoutExpired`, status CANCELLED). The caller's deadline is the whole call's: taken
    // as a timeout, an idempotent call was sent again with the same `grpc-timeout`, so the
    // caller waited up to 3 times its deadline. Neither can be told from the other in a
    // status, so the status is judged by its code, which the policy does not retry. (The
    // layer, which writes the caller's deadline itself, can tell them apart: see the test
    // below.)
    let agent = agent();
    let client = AdminServiceClient::new(channel_to_a_silent_server().await);
    let meta = CallMeta::grpc("/retryplane.v1.AdminService/Get").idempotent(true);
    let err = tokio::time::timeout(
        WAIT,
        agent.endpoint("upstream").call(meta, |_| {
            let mut client = client.clone();
            async move {
                let mut request = Request::new(pb::GetRequest { version: 0 });
                request.set_timeout(Duration::from_millis(100));
                client.get(request).await
            }
        }),
    )
    .await
    .expect("the call ends in time")
    .expect_err("the call fails");
    let status = err.error().expect("the last status");
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    assert_eq!(
        status.classify(),
        Classification::Outcome(Outcome::Grpc {
            code: retryplane_policy::codes::GrpcCode::Cancelled,
            pushback: None
        })
    );
    assert_eq!(err.cause.to_string(), "not_retryable");
    let c = counts(&agent);
    assert_eq!((c.attempts, c.gave_up_not_retryable), (1, 1));
}

#[tokio::test]
async fn a_channels_request_timeout_through_the_layer_is_a_per_try_timeout() {
    // The layer tells the caller's deadline apart (it ends at the agent's timer, as
    // DEADLINE_EXCEEDED), so tonic's timeout that reaches it is the channel's
    // `Endpoint::timeout`, which each attempt passes through: a timeout, retried for an
    // idempotent call and not for another. Before, it was judged as tonic's CANCELLED and
    // never retried.
    for (idempotent, attempts) in [(true, 3u32), (false, 1)] {
        let channel = Channel::from_shared(format!("http://{}", silent_server().await))
            .unwrap()
            .timeout(Duration::from_millis(100))
            .connect_lazy();
        let agent = self::agent();
        let status = get(&agent, channel, Some(idempotent)).await.unwrap_err();
        // As when the agent's own per-try timeout ends the attempts, not tonic's CANCELLED
        // (which a gRPC client reads as its caller's own doing).
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(
            matches!(retry_error(&status), RetryError::TimedOut { attempts: n, .. } if *n == attempts),
            "{status:?}"
        );
        let c = counts(&agent);
        assert_eq!(c.attempts, u64::from(attempts), "idempotent: {idempotent}");
        if idempotent {
            assert_eq!(c.gave_up_attempts, 1);
        } else {
            assert_eq!(c.gave_up_not_retryable, 1);
        }
    }
}

/// A middleware under the layer that hands on the channel's errors as statuses
/// (`Status::from_error`) leaves a channel's request timeout a timeout: retried for an
/// idempotent call, as without it.
#[tokio::test]
async fn a_channels_request_timeout_under_a_status_is_still_a_per_try_timeout() {
    let channel = Channel::from_shared(format!("http://{}", silent_server().await))
        .unwrap()
        .timeout(Duration::from_millis(100))
        .connect_lazy();
    let agent = self::agent();
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .map_err(|e: tonic::transport::Error| -> tower::BoxError {
            Box::new(Status::from_error(Box::new(e)))
        })
        .service(channel);
    let status = get_through(service, Some(true), None).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let c = counts(&agent);
    assert_eq!((c.attempts, c.gave_up_attempts), (3, 1), "{c:?}");
}

#[tokio::test]
async fn a_grpc_timeout_only_tonic_reads_is_the_callers_deadline_and_not_retried_past() {
    // `+1S` is not a `grpc-timeout` the protocol allows, but tonic reads it (as 1 s) and ends
    // the call there with the same error as a channel's timeout. The layer cannot read it, so
    // it cannot tell the two apart: tonic's timeout is judged by its code, never retried.
    let agent = agent();
    let service = tower::ServiceBuilder::new()
        .map_request(|mut request: http::Request<tonic::body::Body>| {
            request
                .headers_mut()
                .insert("grpc-timeout", http::HeaderValue::from_static("+1S"));
            request
        })
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel_to_a_silent_server().await);
    let status = get_through(service, Some(true), None).await.unwrap_err();
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    let c = counts(&agent);
    assert_eq!((c.attempts, c.gave_up_not_retryable), (1, 1));
}

#[tokio::test]
async fn a_callers_grpc_timeout_bounds_the_whole_call_through_the_layer() {
    // Each UNAVAILABLE asks for a 2 s pushback; the caller's deadline is 1 s. Below the
    // layer, tonic enforces `grpc-timeout` on each attempt only: without the layer reading it,
    // the call slept 2 s twice and answered after 4 s, long past the deadline.
    let (upstream, channel) = serve(&[
        (Code::Unavailable, Some("2000")),
        (Code::Unavailable, Some("2000")),
    ])
    .await;
    let agent = agent();
    let status = get_within(&agent, channel, Some(true), Some(Duration::from_secs(1)))
        .await
        .expect_err("the call gives up");
    // The last answer, returned when the pause would end past the caller's deadline.
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(upstream.gets(), 1);
    let c = counts(&agent);
    assert_eq!((c.attempts, c.gave_up_deadline), (1, 1));
}

#[tokio::test]
async fn each_attempt_tells_the_upstream_what_is_left_of_the_callers_deadline() {
    // The first attempt is answered UNAVAILABLE with a 300 ms pushback. Before, the second
    // attempt carried the caller's `grpc-timeout` as it was set (2 s), though 300 ms of it had
    // been slept.
    let pushback = Duration::from_millis(300);
    let deadline = Duration::from_secs(2);
    let (upstream, channel) = serve(&[(Code::Unavailable, Some("300"))]).await;
    let agent = agent();
    let version = get_within(&agent, channel, Some(true), Some(deadline)).await;
    assert_eq!(version.unwrap(), 7);
    let sent = upstream.timeouts();
    let [Some(first), Some(second)] = sent[..] else {
        panic!("two attempts, each with a grpc-timeout: {sent:?}");
    };
    assert!(first <= deadline, "{first:?}");
    // Less than the first by the pause at least, and the first attempt's round trip.
    assert!(second + pushback < first, "{first:?} then {second:?}");

    // A caller that set no deadline sets none upstream: gRPC servers hold a whole RPC to it,
    // a server stream included, which the policy's deadline bounds only until its headers.
    let (upstream, channel) = serve(&[(Code::Unavailable, Some("10"))]).await;
    let agent = self::agent();
    assert_eq!(get(&agent, channel, Some(true)).await.unwrap(), 7);
    assert_eq!(upstream.timeouts(), [None, None]);
}

/// An agent whose `upstream` endpoint has the policy lines `lines` (indented), with short
/// pauses and no budget or breaker.
fn agent_with(lines: &str) -> Agent {
    let yaml = format!(
        "version: 1\ndefaults:\n  backoff: {{base: 5ms, max: 20ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  upstream:\n{lines}"
    );
    let loaded = retryplane_policy::load(yaml.as_bytes());
    Agent::from_policies_seeded(loaded.policies.unwrap(), 1)
}

#[tokio::test]
async fn an_attempt_the_callers_deadline_ends_gives_deadline_exceeded_not_tonics_cancelled() {
    // The `grpc-timeout` each attempt carries makes tonic's channel time the attempt out at the
    // caller's deadline, at the same instant as the agent's own timer. tonic's error, had it
    // been the attempt's result, ended the call CANCELLED ("Timeout expired", not retried) and
    // counted it as not retryable, in most runs.
    for (lines, timeout, attempts) in [
        // Attempts of 300 ms, then one that the caller's 800 ms ends (about 180 ms after it
        // begins). (On a loaded machine timers wake late, and the second attempt may end too
        // late for the short pause to fit: the call then gives up after it, at the deadline
        // too.)
        (
            "    max_attempts: 5\n    per_try_timeout: 300ms\n    retry_on: {errors: [timeout]}\n",
            800,
            2..=3,
        ),
        // The first attempt ends at the caller's deadline.
        ("    max_attempts: 3\n", 150, 1..=1),
    ] {
        let mut most = 0;
        for _ in 0..5 {
            let agent = agent_with(lines);
            let channel = channel_to_a_silent_server().await;
            let status = get_within(
                &agent,
                channel,
                Some(true),
                Some(Duration::from_millis(timeout)),
            )
            .await
            .expect_err("no answer");
            assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
            let c = counts(&agent);
            assert!(attempts.contains(&c.attempts), "{c:?} {lines}");
            most = most.max(c.attempts);
            assert_eq!(
                (c.gave_up_deadline, c.gave_up_not_retryable),
                (1, 0),
                "{lines}"
            );
        }
        // At least one of the runs had its last attempt ended by the caller's deadline.
        assert_eq!(most, *attempts.end(), "{lines}");
    }
}

/// A gRPC call its caller cancels through a token in the request ends `CANCELLED`, during a
/// pause after an upstream's `UNAVAILABLE`: not that code, which the caller might hand on.
#[tokio::test]
async fn a_grpc_call_cancelled_by_its_token_during_a_pause_is_cancelled() {
    // The upstream pushes back for 5 s: the pause is the caller's to cut short.
    let (upstream, channel) = serve(&[(Code::Unavailable, Some("5000"))]).await;
    let agent = agent();
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel);
    let mut client = AdminServiceClient::new(service);
    let token = retryplane_agent::CancellationToken::new();
    let mut request = Request::new(pb::GetRequest { version: 0 });
    request.extensions_mut().insert(Idempotent(true));
    request.extensions_mut().insert(token.clone());
    let call = tokio::spawn(async move { client.get(request).await });
    let began = tokio::time::Instant::now();
    while upstream.gets() < 1 {
        assert!(began.elapsed() < WAIT, "the first attempt was never sent");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    token.cancel();
    let status = tokio::time::timeout(WAIT, call)
        .await
        .expect("the call ends once cancelled")
        .unwrap()
        .unwrap_err();
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    assert_eq!(upstream.gets(), 1);
    assert!(status.metadata().get("grpc-retry-pushback-ms").is_none());
}
