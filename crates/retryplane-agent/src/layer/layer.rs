//! [`RetryLayer`] and the [`Retry`] service it wraps around a client.

use std::fmt;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt as _};
use tracing::debug;

use super::auth::{DynRefresh, HttpReauth, RefreshCredentials, RefreshFailed, wants_credentials};
use super::body::{
    Buffered, READ_ON_IDLE_FRAMES, Refusal, ReplayBody, ResponseBody, buffer, read_failed,
};
use super::dedup::{Dedup, Landing, Leader, Role, SharedResponse};
use super::grpc::{call_meta, grpc_timeout, is_grpc, set_grpc_timeout};
use super::{BoxError, DEFAULT_BODY_LIMIT, GaveUp, ResponseFuture, RetryError, lock};
use crate::call::{Begun, Endpoint, Keep, KeepAsIs, NoReauth};
use crate::classify::{
    Classification, Classify as _, GRPC_STATUS, classify_boxed, grpc_answer_classification,
    tonic_timeout_in_chain,
};
use crate::error::{CallError, Cause, Last};
use crate::meta::{AttemptInfo, CallMeta};
use crate::ready::{AlwaysReady, Readied, Ready, refuses_now, wait_ready};
use retryplane_policy::breaker::CircuitBreaker;
use retryplane_policy::codes::GrpcCode;
use retryplane_policy::engine::{Outcome, RetryRules};
use retryplane_policy::model::ErrorClass;

/// Wraps a `Service<http::Request<B>>` in [`Retry`]. Defaults: bodies up to
/// [`DEFAULT_BODY_LIMIT`] are buffered for replay; no credential refresh; no de-duplication
/// (`D` is [`NoDedup`] until [`RetryLayer::with_dedup`]).
#[derive(Clone)]
pub struct RetryLayer<D = NoDedup> {
    settings: Settings,
    dedup: D,
}

/// What every call of a [`Retry`] needs, cloned into it.
#[derive(Clone)]
struct Settings {
    endpoint: Endpoint,
    body_limit: usize,
    refresh: Option<Arc<dyn DynRefresh>>,
}

// The hook stays out of Debug (it may hold credentials).
impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("endpoint", &self.endpoint.name())
            .field("body_limit", &self.body_limit)
            .field("auth_refresh", &self.refresh.is_some())
            .finish()
    }
}

impl<D: fmt::Debug> fmt::Debug for RetryLayer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("settings", &self.settings)
            .field("dedup", &self.dedup)
            .finish()
    }
}

/// The de-duplication setting of a [`RetryLayer`] without it (the default): every request
/// makes its own call and responses are passed through as they are.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoDedup;

impl RetryLayer {
    /// Every request through the layer is a logical call of `endpoint`.
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            settings: Settings {
                endpoint,
                body_limit: DEFAULT_BODY_LIMIT,
                refresh: None,
            },
            dedup: NoDedup,
        }
    }
}

impl<D> RetryLayer<D> {
    /// The largest request body kept for replay; larger ones are sent once, never retried
    /// (nor sent again after a credential refresh, nor shared). The warn line of such a call
    /// whose attempt fails, whatever the failure, says `replayable=false`.
    #[must_use]
    pub fn with_body_limit(mut self, limit: usize) -> Self {
        self.settings.body_limit = limit;
        self
    }

    /// Calls `hook` at most once per logical call, when an attempt is answered
    /// `401 Unauthorized` (a gRPC request: also `UNAUTHENTICATED`), and sends that attempt again with the request it updated (see the
    /// [module docs](super)). Requests whose body was not buffered are not sent again.
    #[must_use]
    pub fn with_auth_refresh(mut self, hook: impl RefreshCredentials) -> Self {
        self.settings.refresh = Some(Arc::new(hook));
        self
    }

    /// Shares one logical call among identical in-flight reads (see [`Dedup`] and the
    /// [module docs](super)).
    pub fn with_dedup(self, dedup: Dedup) -> RetryLayer<Dedup> {
        RetryLayer {
            settings: self.settings,
            dedup,
        }
    }
}

impl<S, D: Clone> Layer<S> for RetryLayer<D> {
    type Service = Retry<S, D>;

    fn layer(&self, inner: S) -> Retry<S, D> {
        Retry {
            inner,
            settings: self.settings.clone(),
            dedup: self.dedup.clone(),
            stack: NEXT_STACK.fetch_add(1, Relaxed),
        }
    }
}

/// The next [`Retry::stack`].
static NEXT_STACK: AtomicU64 = AtomicU64::new(0);

/// A client whose requests run under the endpoint's retry policy (see [`super`]).
#[derive(Clone)]
pub struct Retry<S, D = NoDedup> {
    inner: S,
    settings: Settings,
    dedup: D,
    /// Which `layer` call made this service (its clones keep it): de-duplication shares
    /// answers only within one, since what the services below add to a request (a
    /// credential, the upstream of a bare path) is not in the key.
    stack: u64,
}

impl<S: fmt::Debug, D: fmt::Debug> fmt::Debug for Retry<S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("settings", &self.settings)
            .field("dedup", &self.dedup)
            .finish()
    }
}

impl<S, B, RB> Service<Request<B>> for Retry<S, NoDedup>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body + Send + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = BoxError;
    type Future = ResponseFuture<Response<ResponseBody<RB>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = Inner::take_ready(&mut self.inner);
        let settings = self.settings.clone();
        ResponseFuture::new(Box::pin(async move {
            // The call begins here, with its one read of the policies (SPEC §2): the body read,
            // the attempts and their deadline all go by it, whatever a swap does meanwhile.
            let begun = settings.endpoint.begin();
            let prepared = prepare(request, &settings, &begun).await?;
            send(inner, &settings, prepared, begun).await
        }))
    }
}

/// With de-duplication, `poll_ready` reserves nothing below (it is always ready): a request
/// that will share another's answer needs no capacity, and one held back for capacity could
/// not join the call it would share (under a concurrency limit of 1, identical reads would run
/// one after another, each calling the upstream). A call that sends readies its clone of the
/// inner service first (`ready_for_first_send`), within the call's deadline and before its
/// first attempt's timer starts.
impl<S, B, RB> Service<Request<B>> for Retry<S, Dedup>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body + Send + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = BoxError;
    type Future = ResponseFuture<Response<ResponseBody<RB>>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = Inner::not_ready(&self.inner);
        let settings = self.settings.clone();
        let dedup = self.dedup.clone();
        let stack = self.stack;
        ResponseFuture::new(Box::pin(run_dedup(inner, settings, dedup, stack, request)))
    }
}

/// The inner service of one logical call. `poll_ready` reserved capacity (a concurrency
/// permit, a buffer slot) on [`Retry`]'s own service, and only that instance may use it: the
/// call takes it (leaving a clone behind, the usual tower pattern) and sends its first request
/// through it; every later send (a retry, the resend after a credential refresh, a follower's
/// own call) readies a clone of its own first.
struct Inner<S> {
    /// The service `poll_ready` readied, until the first send; after it, the template each
    /// later send clones.
    svc: S,
    /// Whether `svc` still holds the capacity `poll_ready` reserved.
    ready: bool,
}

impl<S: Clone> Inner<S> {
    /// Takes the readied service out of `slot`, leaving a clone there (not ready).
    fn take_ready(slot: &mut S) -> Self {
        let clone = slot.clone();
        Self {
            svc: std::mem::replace(slot, clone),
            ready: true,
        }
    }

    /// A clone of `svc` that holds no reserved capacity.
    fn not_ready(svc: &S) -> Self {
        Self {
            svc: svc.clone(),
            ready: false,
        }
    }

    /// Gives up the reserved capacity without using it (a follower that waits for its
    /// leader holds none meanwhile): the readied instance is dropped for a clone.
    fn release(&mut self) {
        if std::mem::take(&mut self.ready) {
            self.svc = self.svc.clone();
        }
    }

    /// Sends `request`: through the readied service the first time, through a clone readied
    /// for it afterwards.
    ///
    /// A later send's future (the clone and the request until it is ready) is boxed: it comes
    /// only with a retry or a resend, and inline it made every attempt's future, and each
    /// future holding one, larger by the service and a request (about 700 bytes), held by every
    /// request in flight (BENCHMARKS.md, "the tower layer").
    fn send<R>(
        &mut self,
        request: R,
    ) -> impl Future<Output = Result<S::Response, BoxError>> + use<S, R>
    where
        S: Service<R>,
        S::Error: Into<BoxError>,
    {
        let call = if std::mem::take(&mut self.ready) {
            Ok(self.svc.call(request))
        } else {
            Err(Box::pin(self.svc.clone().oneshot(request)))
        };
        async move {
            match call {
                Ok(first) => first.await,
                Err(later) => later.await,
            }
            .map_err(Into::into)
        }
    }
}

impl<S> Inner<S> {
    /// Readies `svc` for the next send (see [`crate::ready`]); once ready, it stays so until
    /// that send.
    fn poll_ready<R>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>>
    where
        S: Service<R>,
        S::Error: Into<BoxError>,
    {
        if self.ready {
            return Poll::Ready(Ok(()));
        }
        let polled = self.svc.poll_ready(cx).map_err(Into::into);
        self.ready = matches!(polled, Poll::Ready(Ok(())));
        polled
    }
}

/// The inner service of a call, readied before its first send ([`ready_for_first_send`]).
struct ReadyOwned<'a, S, R>(&'a mut Inner<S>, PhantomData<fn(R)>);

impl<S, R> Ready<BoxError> for ReadyOwned<'_, S, R>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
{
    fn needed(&self) -> bool {
        true
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready::<R>(cx)
    }
}

/// The inner service of a call, shared with its attempts, readied before each later send
/// (a retry, the resend after a credential refresh) outside the attempt's timer.
struct ReadyShared<'a, S, R>(&'a Mutex<Inner<S>>, PhantomData<fn(R)>);

impl<'a, S, R> ReadyShared<'a, S, R> {
    fn new(inner: &'a Mutex<Inner<S>>) -> Self {
        Self(inner, PhantomData)
    }
}

impl<S, R> Ready<BoxError> for ReadyShared<'_, S, R>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
{
    fn needed(&self) -> bool {
        true
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        lock(self.0).poll_ready::<R>(cx)
    }
}

/// A request ready to be sent: its head, and its body in memory or still to come.
enum Prepared<B> {
    /// Sent again as often as needed.
    Buffered {
        head: Parts,
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// Over the limit, or not read by the deadline: sent once. `refused`: the read stopped
    /// because the breaker refuses the call, which then gives up with `circuit_open`.
    Once {
        head: Parts,
        body: ReplayBody<B>,
        refused: bool,
    },
}

impl<B> Prepared<B> {
    /// The request's head.
    fn head(&self) -> &Parts {
        match self {
            Prepared::Buffered { head, .. } | Prepared::Once { head, .. } => head,
        }
    }
}

/// Reads the body of `request` into memory if it fits in the layer's limit and comes before the
/// deadline of the call `begun`.
async fn prepare<B>(
    request: Request<B>,
    settings: &Settings,
    begun: &Begun,
) -> Result<Prepared<B>, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (head, body) = request.into_parts();
    // Reading the body waits on the caller's stream, inside the call's deadline: a stalled one
    // is bounded by it, and the call then gives up at that same deadline, sending nothing.
    let meta = call_meta(&head, head.uri.path());
    let deadline = begun.deadline(&meta);
    // An open circuit fails the call fast: the read stops (or never starts) when the breaker
    // would refuse the call, which then gives up with it, sending nothing (see
    // `CallMeta::refused`: a breaker that lets calls through again meanwhile does not change
    // that, so a body left half read is never sent in its stead).
    let breaker = begun.breaker(&meta).map(|breaker| Refusal {
        breaker,
        began: begun.at(),
    });
    let buffered = buffer(body, settings.body_limit, deadline, breaker)
        .await
        .map_err(Into::into)?;
    Ok(match buffered {
        Buffered::Replayable(data, trailers) => Prepared::Buffered {
            head,
            data,
            trailers,
        },
        Buffered::Once(body) => Prepared::Once {
            head,
            body,
            refused: false,
        },
        Buffered::Refused(body) => Prepared::Once {
            head,
            body,
            refused: true,
        },
    })
}

/// Runs the logical call `begun` of `prepared` (its deadline runs from when it began, the body
/// read included, and it goes by the policy read then). The answer to a gRPC request with its
/// caller's deadline (`grpc-timeout`) ends by that deadline, its body included: a gRPC
/// deadline bounds the whole RPC (gRFC A6), and tonic's client enforces it only until the
/// answer's head, so an upstream that sends its head and then stalls held the caller past it.
async fn send<S, B, RB>(
    mut inner: Inner<S>,
    settings: &Settings,
    prepared: Prepared<B>,
    begun: Begun,
) -> Result<Response<ResponseBody<RB>>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<RB>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    RB: Body,
    RB::Error: Into<BoxError>,
{
    let endpoint = &settings.endpoint;
    let (grpc, timeouts_are_the_channels) = match &prepared {
        Prepared::Buffered { head, .. } | Prepared::Once { head, .. } => (
            is_grpc(head),
            // A `grpc-timeout` the layer cannot read (tonic reads some the protocol does not
            // allow, such as `+5S`) is a caller's deadline tonic enforces on its own: its
            // timeout is then judged by its code, as outside the layer.
            !head.headers.contains_key("grpc-timeout") || grpc_timeout(head).is_some(),
        ),
    };
    let gave_up = move |e| gave_up(e, grpc, timeouts_are_the_channels);
    let classify = |r: &Result<Response<ResponseBody<RB>>, BoxError>| match r {
        // An answer a `RetryLayer` below gave up on: retried at one layer only.
        Ok(response) if crate::classify::gave_up_below(response.extensions()) => {
            Classification::Fatal
        }
        Ok(response) if grpc => {
            grpc_answer_classification(response.status(), grpc_status_carrier(response))
        }
        Ok(response) => response.classify(),
        Err(e) => {
            // A status an inner service returned as its error is judged as the status, its
            // pushback read (one a `RetryLayer` below this one returned, holding its
            // `RetryError`, is fatal: see `Classify for tonic::Status`).
            let judged = match e.downcast_ref::<tonic::Status>() {
                Some(status) if grpc => status.classify(),
                _ => classify_boxed(&**e),
            };
            // A channel's request timeout, under a status too, is a timeout.
            if timeouts_are_the_channels {
                channel_timeout_is_a_timeout(judged, &**e)
            } else {
                judged
            }
        }
    };
    let (result, callers) = match prepared {
        Prepared::Buffered {
            head,
            data,
            trailers,
        } => {
            // The meta borrows the path; `head` moves on (an `Uri` clone shares its bytes).
            let uri = head.uri.clone();
            let meta = call_meta(&head, uri.path()).with_headers(&head.headers);
            let callers = callers_deadline(&meta, &begun, grpc);
            // A failed answer's body is read only if the answer may be sent again.
            let retried = &begun.retry_rules(&meta);
            let refresh = settings.refresh.is_some();
            // Whether the refresh hook ran: a 401 after it is not sent again for it.
            let refresh_used = &AtomicBool::new(false);
            // Shared with the refresh hook, which may update it for the attempts that follow.
            let head = Mutex::new(head);
            let (head, data, trailers) = (&head, &data, &trailers);
            // Shared by the attempts, which send through it, and the step that readies it
            // before each later send (`ReadyShared`), outside the attempt's timer.
            let inner = &Mutex::new(inner);
            let attempt = move |info: AttemptInfo| {
                let sent_at = Instant::now();
                let mut parts = lock(head).clone();
                if let Some(deadline) = callers {
                    set_grpc_timeout(&mut parts.headers, deadline, sent_at);
                }
                let request = Request::from_parts(
                    parts,
                    ReplayBody::buffered(data.clone(), trailers.clone()),
                );
                let sent = lock(inner).send(request);
                // The answer's body must be read before the attempt's timeout, which would
                // lose the answer (the agent's timer runs from just before `sent_at`).
                let read = ReadFailed {
                    retried: retried
                        .as_ref()
                        .filter(|rules| info.number < rules.max_attempts()),
                    attempt: info.number,
                    refresh: refresh && !refresh_used.load(Ordering::Relaxed),
                    read_by: sent_at + info.timeout.saturating_sub(FAILED_BODY_WAIT),
                    grpc,
                };
                async move {
                    match sent.await {
                        Ok(response) => Ok(read_if_failed(response, read).await),
                        Err(e) => Err(unless_callers_deadline(e, callers).await),
                    }
                }
            };
            let ready = ReadyShared::new(inner);
            let result = match &settings.refresh {
                None => endpoint
                    .call_reauth(
                        begun,
                        meta,
                        classify,
                        attempt,
                        NoReauth,
                        ready,
                        ReadOn::new(),
                    )
                    .await
                    .or_else(gave_up),
                Some(hook) => {
                    let mut reauth = HttpReauth::new(&**hook, head, refresh_used, grpc);
                    // Boxed: held inline, this call's state (larger than the one above by the
                    // refresh's) made every call's future larger, with a hook or not.
                    let result = Box::pin(endpoint.call_reauth(
                        begun,
                        meta,
                        classify,
                        attempt,
                        &mut reauth,
                        ready,
                        ReadOn::new(),
                    ))
                    .await
                    .or_else(gave_up);
                    match (result, reauth.error) {
                        (Ok(mut response), Some(e))
                            if wants_credentials(
                                response.status(),
                                grpc_status_carrier(&response),
                                grpc,
                            ) =>
                        {
                            response
                                .extensions_mut()
                                .insert(RefreshFailed(Arc::from(e)));
                            Ok(response)
                        }
                        (result, _) => result,
                    }
                }
            };
            (result, callers)
        }
        Prepared::Once {
            head,
            body,
            refused,
        } => {
            // Sent once: the call makes one attempt, whatever it fails with (a failed connect
            // included), and that attempt's answer or error is returned. A call the breaker
            // refused while its body was read makes none.
            let uri = head.uri.clone();
            let meta = call_meta(&head, uri.path()).not_replayable();
            let meta = if refused { meta.refused() } else { meta };
            let callers = callers_deadline(&meta, &begun, grpc);
            let mut request = Some(Request::from_parts(head, body));
            // `attempt` runs once: for a request marked not replayable the engine retries no
            // failure (`CallInfo::may_retry`), and `call_with` sends nothing again after a
            // 401. So `take` always finds the request; the error is for a second run that
            // cannot come, and stands in for an empty request, never a panic.
            let attempt = move |info: AttemptInfo| {
                let sent_at = Instant::now();
                let sent = request.take().map(|mut r| {
                    if let Some(deadline) = callers {
                        set_grpc_timeout(r.headers_mut(), deadline, sent_at);
                    }
                    inner.send(r)
                });
                // The attempt's answer must be looked at before its timeout, which would lose
                // it (see `ReadFailed::read_by`).
                let read_by = sent_at + info.timeout.saturating_sub(FAILED_BODY_WAIT);
                // Never sent again: its answer is returned as it comes, its first frame looked
                // at if its status may be in trailers.
                async move {
                    match sent.ok_or("a streamed body cannot be sent twice")?.await {
                        Ok(response) if grpc && status_in_trailers(&response) => {
                            Ok(first_frame(response, read_by).await)
                        }
                        Ok(response) => Ok(response.map(ResponseBody::passthrough)),
                        Err(e) => Err(unless_callers_deadline(e, callers).await),
                    }
                }
            };
            // Boxed: this path is rare (a body over the limit or late), and its call's state,
            // held inline beside the buffered path's, made every call's future larger.
            let result = Box::pin(endpoint.call_reauth(
                begun,
                meta,
                classify,
                attempt,
                NoReauth,
                AlwaysReady,
                KeepAsIs,
            ))
            .await
            .or_else(gave_up);
            (result, callers)
        }
    };
    match callers {
        Some(at) => result.map(|response| response.map(|body| body.ending_at(at))),
        None => result,
    }
}

/// A logical call that identical in-flight reads share: the first (the leader) runs it,
/// the others wait and get a copy of its response.
async fn run_dedup<S, B, RB>(
    mut inner: Inner<S>,
    settings: Settings,
    dedup: Dedup,
    stack: u64,
    request: Request<B>,
) -> Result<Response<ResponseBody<RB>>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<RB>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    RB: Body,
    RB::Error: Into<BoxError>,
{
    // As in the call without de-duplication: one read of the policies for the whole call, its
    // sharing and its wait for a leader included.
    let begun = settings.endpoint.begin();
    let prepared = prepare(request, &settings, &begun).await?;
    let head = prepared.head();
    let meta = call_meta(head, head.uri.path());
    // The deadline of the call `begun`: it bounds all its waiting, whichever leaders it
    // follows, its own call if it makes one, and, as the leader, the read of the response it
    // shares.
    let deadline = begun.deadline(&meta);
    // What may refuse its first attempt: it does not wait for capacity below then.
    let breaker = begun.breaker(&meta);
    let key = match &prepared {
        // Trailers are rare on a read; such a request is simply not shared. Nor is one the
        // policy in force (or an `Idempotent(false)` on it) does not call idempotent.
        // Nor one that carries its caller's own deadline or cancellation: a leader's would
        // decide the answer of followers that have their own.
        Prepared::Buffered {
            head,
            data,
            trailers: None,
        } if dedup.shares(&head.method)
            && begun.is_idempotent(&meta)
            && meta.within().is_none()
            && meta.cancel_token().is_none() =>
        {
            Some(dedup.key(stack, settings.endpoint.name(), head, data))
        }
        _ => None,
    };
    let Some(key) = key else {
        ready_for_first_send(&mut inner, deadline, breaker).await?;
        return send(inner, &settings, prepared, begun).await;
    };
    loop {
        match dedup.join(key) {
            Role::Lead(leader) => {
                let result = match ready_for_first_send(&mut inner, deadline, breaker).await {
                    Ok(()) => send(inner, &settings, prepared, begun).await,
                    Err(e) => Err(e),
                };
                return land(result, leader, dedup.response_limit(), deadline).await;
            }
            Role::Follow(follower) => {
                // No capacity is held while waiting: a call of its own readies its own.
                inner.release();
                match follower.wait(deadline).await {
                    // No call made, none counted: see the module docs ("What the
                    // endpoint's counters see"); `DedupStats::shared` counts it.
                    Some(Landing::Shared(response)) => return Ok(response.copy()),
                    Some(Landing::OwnCall) => {
                        ready_for_first_send(&mut inner, deadline, breaker).await?;
                        return send(inner, &settings, prepared, begun).await;
                    }
                    // The leader was dropped (its caller went away): lead or follow anew.
                    None => {}
                }
            }
        }
    }
}

/// Readies `inner` for a call's first send (with de-duplication, `poll_ready` did not), waiting
/// for capacity below the layer at most until the call's `deadline`: the wait is the caller's,
/// as it is in `poll_ready` without de-duplication, not the first attempt's (its per-try
/// timeout starts when it is sent). An error readying it ends the call at once, with no
/// attempt counted. Past the deadline the call is sent on unready: it gives up with
/// `deadline_exceeded` before any attempt. A call the `breaker` would refuse, before or while
/// it waits (open, or half-open with every probe out; see [`crate::ready`]), waits no longer
/// (the inner service is not even asked, when it would refuse at once): it is sent on and
/// fails fast with `circuit_open`.
async fn ready_for_first_send<S, R>(
    inner: &mut Inner<S>,
    deadline: Instant,
    breaker: Option<&CircuitBreaker>,
) -> Result<(), BoxError>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
{
    if inner.ready {
        return Ok(());
    }
    let mut ready = ReadyOwned::<S, R>(inner, PhantomData);
    match wait_ready(&mut ready, deadline, || refuses_now(breaker)).await {
        Readied::Failed(e) => Err(e),
        Readied::Ready | Readied::Late | Readied::Refused => Ok(()),
    }
}

/// The leader's response, read into memory (up to `limit`, until the call's `deadline`) and
/// shared with the followers. A body over the limit or not read by the deadline is not
/// shared: the followers make their own calls and the leader's caller gets the bytes read so
/// far followed by the rest as it comes.
async fn land<RB>(
    result: Result<Response<ResponseBody<RB>>, BoxError>,
    leader: Leader,
    limit: usize,
    deadline: Instant,
) -> Result<Response<ResponseBody<RB>>, BoxError>
where
    RB: Body,
    RB::Error: Into<BoxError>,
{
    let response = match result {
        Ok(response) => response,
        Err(e) => {
            leader.land(Landing::OwnCall);
            return Err(e);
        }
    };
    if let Some(why) = super::dedup::not_shared(response.headers(), response.extensions()) {
        debug!("response not shared: {why}");
        leader.land(Landing::OwnCall);
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    match body.read_whole(limit, deadline).await {
        Ok((data, trailers)) => {
            let shared = SharedResponse::new(parts.clone(), data.clone(), trailers.clone());
            leader.land(Landing::Shared(Arc::new(shared)));
            Ok(Response::from_parts(
                parts,
                ResponseBody::full(data, trailers),
            ))
        }
        Err(body) => {
            if Instant::now() >= deadline {
                debug!("response body not read by the deadline; not shared");
            }
            leader.land(Landing::OwnCall);
            Ok(Response::from_parts(parts, body))
        }
    }
}

/// How long the layer waits for the body of a failed attempt's answer (see
/// [`read_if_failed`]); one that takes longer is left to come as it comes. Short: the body of
/// an error answer comes with its head or right behind it, and the wait adds to the call.
const FAILED_BODY_WAIT: Duration = Duration::from_millis(20);

/// How long the layer looks for the first frame of a gRPC answer whose status may be in its
/// trailers ([`first_frame`]). Longer than a delayed ACK (40 ms on Linux): a server with Nagle
/// on (a tonic server started with `serve_with_incoming`, which leaves `TCP_NODELAY` unset)
/// holds the trailers of an error behind its head until the client acknowledges the head.
/// It delays no message: the read ends at the first byte of one, and a stream whose first
/// message is slower gets its head when the look ends.
const FIRST_FRAME_WAIT: Duration = Duration::from_millis(100);

/// How close to the caller's deadline tonic's own timeout for it may end an attempt (see
/// [`unless_callers_deadline`]): the `grpc-timeout` the layer writes is rounded down by at most
/// one unit (1 ms at most for a deadline under 27 hours).
const CALLERS_DEADLINE_MARGIN: Duration = Duration::from_millis(5);

/// The caller's own deadline for a gRPC request that carries one (`grpc-timeout` or a
/// [`Within`](super::Within), from when the call began): each attempt tells the upstream what
/// is left of it, and the answer's body ends by it. Only then: a request without one is sent
/// without one, since gRPC servers and proxies hold a whole RPC to it (a server stream
/// included, which the agent bounds only until its headers). An HTTP request's `Within`
/// bounds the call until the answer's head, as the policy's deadline does; no header says it.
fn callers_deadline(meta: &CallMeta<'_>, begun: &Begun, grpc: bool) -> Option<Instant> {
    if !grpc {
        return None;
    }
    meta.within()
        .map(|within| retryplane_policy::engine::deadline_at(begun.at(), within))
}

/// `e`, unless it is tonic's own timeout for the caller's `deadline` (the `grpc-timeout` the
/// layer wrote): then this waits for good, and the agent's own timer, due within
/// [`CALLERS_DEADLINE_MARGIN`], ends the attempt as the deadline it is. Both timers end at the
/// same instant; had tonic's error been the attempt's result, the call would end `CANCELLED`
/// (what tonic makes of its timeout, which is not retried) and count as not retryable, rather
/// than `DEADLINE_EXCEEDED` and a give-up at the deadline.
async fn unless_callers_deadline(e: BoxError, deadline: Option<Instant>) -> BoxError {
    if let Some(deadline) = deadline
        && Instant::now() + CALLERS_DEADLINE_MARGIN >= deadline
        && tonic_timeout_in_chain(&*e)
    {
        std::future::pending::<()>().await;
    }
    e
}

/// `class`, the classification of an attempt's error `e`, unless `e` is tonic's own request
/// timeout ([`tonic::TimeoutExpired`], which [`classify_boxed`] judges as the `CANCELLED`
/// status tonic makes of it): through the layer that is a timeout. tonic raises it for the
/// caller's deadline (the `grpc-timeout` the layer writes) and for the channel's
/// `Endpoint::timeout` alike, but the caller's deadline never gets here
/// ([`unless_callers_deadline`] leaves it to the agent's timer). So it is the channel's,
/// which each attempt passes through on its own: a per-try timeout, an unknown outcome,
/// retried as the agent's own per-try timeout is (idempotent or keyed calls only).
fn channel_timeout_is_a_timeout(
    class: Classification,
    e: &(dyn std::error::Error + 'static),
) -> Classification {
    match class {
        Classification::Outcome(Outcome::Grpc {
            code: GrpcCode::Cancelled,
            ..
        }) if tonic_timeout_in_chain(e) => {
            Classification::Outcome(Outcome::Transport(ErrorClass::Timeout))
        }
        class => class,
    }
}

/// The most of a failed attempt's answer the layer reads into memory (see
/// [`read_if_failed`]).
const FAILED_BODY_LIMIT: usize = 64 * 1024;

/// Which failed answers an attempt reads the body of (see [`read_if_failed`]): those that may
/// be sent again.
struct ReadFailed<'a> {
    /// What decides whether the call's answers may be retried, when one may at all (the call
    /// is idempotent or keyed, and this is not its last attempt).
    retried: Option<&'a RetryRules>,
    /// The attempt's number.
    attempt: u32,
    /// A credential-refresh hook is set and has not run yet: a 401 is sent again after it
    /// runs.
    refresh: bool,
    /// The latest the read may go on.
    read_by: Instant,
    /// The request is a gRPC one: its answers are judged as tonic reads them
    /// ([`grpc_answer_classification`]).
    grpc: bool,
}

impl ReadFailed<'_> {
    /// Whether the body of an answer with outcome `o` and HTTP status `status` is read: the
    /// engine's own test of whether it may be retried ([`RetryRules::may_retry`]), or a 401
    /// the refresh hook will send again.
    /// The budget, the breaker and the deadline may still refuse the retry; they are not asked
    /// here, since they may change by the time the engine asks.
    fn wants(&self, o: &Outcome, status: StatusCode, headers: &HeaderMap) -> bool {
        if o.is_success() {
            return false;
        }
        // A transport outcome never comes from an answer.
        let refreshed = self.refresh && wants_credentials(status, headers, self.grpc);
        refreshed
            || self
                .retried
                .is_some_and(|rules| rules.may_retry(o, self.attempt))
    }
}

/// `response`, with its body read into memory (up to [`FAILED_BODY_LIMIT`], for up to
/// [`FAILED_BODY_WAIT`] and not past `read.read_by`) if it is a failure that may be sent again
/// ([`ReadFailed::wants`]); a success, or a failure that will be returned, as it comes.
///
/// A call keeps its last failure through the pause, in case it ends before its next attempt
/// answers (cancelled, or the breaker opens), and through that next attempt. A body left
/// unread meanwhile holds its connection: an HTTP/1 client cannot reuse it, so every retry
/// opened a new connection to an upstream already failing, and closed the old one when the
/// answer was dropped, unread. Read to its end, the body gives the connection back to the
/// client's pool (and ends an HTTP/2 stream); the caller still gets the same bytes.
async fn read_if_failed<RB>(
    response: Response<RB>,
    read: ReadFailed<'_>,
) -> Response<ResponseBody<RB>>
where
    RB: Body,
    RB::Error: Into<BoxError>,
{
    if read.grpc && status_in_trailers(&response) {
        return first_frame(response, read.read_by).await;
    }
    // Nothing could be read: no need to classify an answer the call classifies anyway.
    if read.retried.is_none() && !read.refresh {
        return response.map(ResponseBody::passthrough);
    }
    let classification = if read.grpc {
        grpc_answer_classification(response.status(), response.headers())
    } else {
        response.classify()
    };
    match classification {
        Classification::Outcome(o) if read.wants(&o, response.status(), response.headers()) => {
            let until = read.read_by.min(Instant::now() + FAILED_BODY_WAIT);
            read_failed(response, FAILED_BODY_LIMIT, until).await
        }
        _ => response.map(ResponseBody::passthrough),
    }
}

/// Whether the answer to a gRPC request has its status in trailers: a 200 with no
/// `grpc-status` in its head.
fn status_in_trailers<RB>(response: &Response<RB>) -> bool {
    response.status() == StatusCode::OK && !response.headers().contains_key(GRPC_STATUS)
}

/// `response` (whose status is in trailers: [`status_in_trailers`]) with its first frame
/// read, for up to [`FIRST_FRAME_WAIT`] and not past `read_by`. Its trailers first, with no
/// message before them, are the answer of a server that sent its head and then an error (a
/// tonic server stream whose first item is an error, a server that flushes its head early):
/// the call's code is theirs, as tonic's client reads it ([`grpc_status_carrier`]), so the
/// answer counts as that failure and is retried as its code says (nothing of it has reached
/// the caller). A message first, or nothing in time (a stream whose first message is slow),
/// is a success, as before; the caller gets every byte.
async fn first_frame<RB>(response: Response<RB>, read_by: Instant) -> Response<ResponseBody<RB>>
where
    RB: Body,
    RB::Error: Into<BoxError>,
{
    // A limit of 0: the read ends at the first byte of a message.
    read_failed(response, 0, read_by.min(Instant::now() + FIRST_FRAME_WAIT)).await
}

/// Where the status of a gRPC answer is read: its head, or the trailers that came before any
/// message of an answer whose head has none ([`first_frame`]).
pub(crate) fn grpc_status_carrier<RB>(response: &Response<ResponseBody<RB>>) -> &HeaderMap {
    match response.body().trailers_before_data() {
        Some(trailers) if status_in_trailers(response) => trailers,
        _ => response.headers(),
    }
}

/// What the layer does with the failed answer a call keeps between attempts ([`Keep`]): it
/// reads on, while the call waits (the pause, the wait for room below, a credential refresh),
/// the body [`read_if_failed`] could not read whole within its attempt (up to
/// [`FAILED_BODY_LIMIT`] in all), and when the next attempt starts lets go of whatever is
/// still unread (the bytes read stay, then an error says the rest was left). A body whose end
/// comes late (an error body behind a delayed ACK, a slow upstream) so still frees its HTTP/1
/// connection for the retry, and a kept answer never holds the HTTP/2 stream the retry is sent
/// on. (A body that has not ended when the call's deadline comes still holds its connection
/// until then: a service below that has one connection only waits for it that long.)
struct ReadOn {
    /// Frames that bring no byte still to be read of the answer kept now (see
    /// [`READ_ON_IDLE_FRAMES`]).
    idle_left: u32,
    /// Once those are spent: the wait before [`READ_ON_IDLE_MORE`] more are read, so that a
    /// body of endless empty frames costs next to nothing, and one whose end comes after them
    /// is still read to it (a connection below freed), only more slowly.
    throttle: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// How long [`ReadOn`] waits, its allowance of empty frames spent, before it reads
/// [`READ_ON_IDLE_MORE`] more.
const READ_ON_IDLE_WAIT: Duration = Duration::from_millis(10);
/// How many empty frames [`ReadOn`] reads after each [`READ_ON_IDLE_WAIT`].
const READ_ON_IDLE_MORE: u32 = 64;

impl ReadOn {
    fn new() -> Self {
        Self {
            idle_left: READ_ON_IDLE_FRAMES,
            throttle: None,
        }
    }

    /// Whether the wait of a spent allowance is over (then `READ_ON_IDLE_MORE` more are
    /// allowed); registers `cx` for its end otherwise.
    fn allowance(&mut self, cx: &mut Context<'_>) -> bool {
        if self.idle_left > 0 {
            return true;
        }
        let wait = self
            .throttle
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(READ_ON_IDLE_WAIT)));
        if wait.as_mut().poll(cx).is_pending() {
            return false;
        }
        self.throttle = None;
        self.idle_left = READ_ON_IDLE_MORE;
        true
    }
}

impl<RB> Keep<Response<ResponseBody<RB>>> for ReadOn
where
    RB: Body,
    RB::Error: Into<BoxError>,
{
    fn poll_paused(&mut self, kept: &mut Response<ResponseBody<RB>>, cx: &mut Context<'_>) {
        if !self.allowance(cx) {
            return;
        }
        kept.body_mut()
            .poll_read_on(FAILED_BODY_LIMIT, &mut self.idle_left, cx);
        // Spent now: the read stopped at an empty frame without asking for the next, so the
        // wait is started (and `cx` registered for its end) at once.
        let _ = self.allowance(cx);
    }

    fn before_next(&mut self, kept: &mut Response<ResponseBody<RB>>) {
        kept.body_mut().cut_unread();
        // The next kept answer has an allowance of its own.
        self.idle_left = READ_ON_IDLE_FRAMES;
        self.throttle = None;
    }
}

/// The header of a gRPC answer the call gave up on that says why (see [`GaveUp`]).
const GAVE_UP_HEADER: http::HeaderName = http::HeaderName::from_static(crate::error::GAVE_UP_KEY);
/// The header of a gRPC answer the call gave up on that says after how many attempts.
const ATTEMPTS_HEADER: http::HeaderName = http::HeaderName::from_static(crate::error::ATTEMPTS_KEY);

/// The response or error a call that gave up returns; `grpc`: the request was a gRPC one
/// (see [`no_answer`]); `timeouts_are_the_channels`: a tonic request timeout is the channel's
/// (see [`channel_timeout_is_a_timeout`]).
fn gave_up<RB>(
    e: CallError<Response<RB>, BoxError>,
    grpc: bool,
    timeouts_are_the_channels: bool,
) -> Result<Response<RB>, BoxError> {
    let CallError {
        cause,
        last,
        attempts,
        ..
    } = e;
    // A gRPC call its caller cancelled (a token in the request) is `CANCELLED`, whatever its
    // last attempt got: not an upstream's code, which the caller might hand on or retry.
    if grpc && cause == Cause::Cancelled {
        return Err(no_answer(RetryError::NoAnswer { cause }, grpc, attempts));
    }
    match last {
        // A layer below gave up on this answer and marked it: its cause and attempts say more
        // than this layer's one attempt, not retried.
        Some(Last::Response(response)) if crate::classify::gave_up_below(response.extensions()) => {
            Ok(response)
        }
        Some(Last::Response(mut response)) => {
            // A gRPC client sees no extension of the answer (tonic drops them), but the head
            // of a Trailers-Only answer becomes its status's metadata: why is said there too.
            if grpc && let Ok(why) = HeaderValue::try_from(cause.to_string()) {
                let headers = response.headers_mut();
                headers.insert(GAVE_UP_HEADER, why);
                headers.insert(ATTEMPTS_HEADER, HeaderValue::from(attempts));
                // The upstream's pushback spoke to this call, which has used it: whoever the
                // answer is handed on to is told not to retry what was retried already.
                if let Cause::GaveUp(_) = cause {
                    headers.insert(
                        crate::classify::GRPC_PUSHBACK,
                        HeaderValue::from_static("-1"),
                    );
                }
            }
            response.extensions_mut().insert(GaveUp { cause, attempts });
            Ok(response)
        }
        // The channel's own request timeout ended the last attempt: as the agent's per-try
        // timeout does (see `channel_timeout_is_a_timeout`), not tonic's `CANCELLED`, which a
        // gRPC client reads as its caller's own doing.
        Some(Last::Error(e))
            if grpc && timeouts_are_the_channels && tonic_timeout_in_chain(&*e) =>
        {
            Err(no_answer(
                RetryError::TimedOut { cause, attempts },
                grpc,
                attempts,
            ))
        }
        Some(Last::Error(e)) => Err(e),
        Some(Last::TimedOut) => Err(no_answer(
            RetryError::TimedOut { cause, attempts },
            grpc,
            attempts,
        )),
        None => Err(no_answer(RetryError::NoAnswer { cause }, grpc, attempts)),
    }
}

/// The error of a call that ended with no answer after `attempts` attempts: `e` itself, or
/// for a gRPC request a `tonic::Status` with the code a gRPC client reports for it
/// (`DEADLINE_EXCEEDED` when time ran out, `UNAVAILABLE` when the circuit is open,
/// `CANCELLED`), `e` as its message and its source, and the metadata an answer the call gave
/// up on carries ([`GaveUp`]): `retryplane-gave-up` and `retryplane-attempts`, and for a call
/// that gave up (not a cancelled one) `grpc-retry-pushback-ms: -1`, so that whoever the
/// status is handed on to, a `RetryLayer` stacked above this one included, does not retry
/// what was retried (or refused) already. A tonic client takes a `Status` it finds as it is,
/// so its caller gets that code and metadata rather than `UNKNOWN`.
fn no_answer(e: RetryError, grpc: bool, attempts: u32) -> BoxError {
    if !grpc {
        return e.into();
    }
    let (code, cause) = match &e {
        RetryError::TimedOut { cause, .. } => (cause.grpc_code(true), *cause),
        RetryError::NoAnswer { cause } => (cause.grpc_code(false), *cause),
    };
    let mut status = tonic::Status::new(code, e.to_string());
    crate::error::mark_gave_up(status.metadata_mut(), cause, attempts);
    status.set_source(Arc::new(e));
    Box::new(status)
}
