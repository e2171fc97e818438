//! Admin calls that carry a policy (Validate, Apply) take a turn before their message is
//! decoded, and only once it has been received. The admin service checks
//! [`MAX_CONCURRENT_CHECKS`](crate::admin::MAX_CONCURRENT_CHECKS) documents at once, but tonic
//! decodes a request before its handler runs: every call waiting for a check held its decoded
//! document (a viewer's two dozen Validate calls of a 4 MB document held about 170 MB each).
//! Here a call's message is first read as bytes (at most the decoding limit, and a little
//! more), holding no turn, so a client that sends slowly, or never finishes, keeps nobody
//! else waiting; then, past [`MAX_DECODED`] calls at once, it waits with its message
//! undecoded. The bytes read ahead by every call together are bounded
//! ([`READ_AHEAD_BYTES`]: a call waits for room before it reads more), and so is the time a
//! call may take to send its message ([`READ_AHEAD_WAIT`]). One turn, and room for one more
//! message read ahead, are kept for an Apply by a caller who may change the policies
//! (`crate::turns`), so a read-only token's calls cannot hold up an Apply. A body that holds
//! more than its first message is refused here when that message fits the limit (a unary call carries one;
//! tonic decodes every further one before the service runs: a second frame announced and
//! never sent held a decoded document with no turn, and one sent after an empty first message
//! was decoded whole), and handed on when its first message itself is too long (the service
//! refuses it by its length).
//!
//! A body of one message whose endpoints and routes, counted on its bytes, pass what a policy
//! file can hold ([`retryplane_proto::wire_items`]) is handed on without its policy, marked
//! [`TooManyItems`]: the service answers it as it answers a decoded document that size, after
//! the checks it makes first (a document of bare endpoints is two bytes an endpoint on the
//! wire and about 420 decoded: a 4 MiB one decoded to about 850 MB before it was refused).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut as _, Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use http_body_util::BodyExt as _;
use tokio::sync::OwnedSemaphorePermit;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::server::NamedService;

use retryplane_proto::convert::MAX_ITEMS;
use retryplane_proto::wire_items;

use crate::auth::Credential;
use crate::turns::{self, Turns};

/// The most calls that carry a policy decoded at once: those being checked and as many waiting
/// for a check.
pub const MAX_DECODED: usize = 2 * crate::admin::MAX_CONCURRENT_CHECKS;

/// `Apply`'s path: the one call that carries a policy and may change the policies.
const APPLY: &str = "/retryplane.v1.AdminService/Apply";

/// The admin methods whose request carries a policy document.
const CARRY_A_POLICY: [&str; 2] = ["/retryplane.v1.AdminService/Validate", APPLY];

/// A gRPC message's frame header: a compression flag and a 4-byte length.
const FRAME_HEADER: usize = 5;

/// The most bytes the calls that carry a policy hold read ahead at once, all together, beside
/// the room for one more message kept for an Apply by a caller who may change the policies.
pub const READ_AHEAD_BYTES: usize = 64 * 1024 * 1024;

/// How long a call that carries a policy may take to send its message (waits for room in
/// [`READ_AHEAD_BYTES`] included).
pub const READ_AHEAD_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A request extension: the call's message held this many items ([`MAX_ITEMS`]'s count, of
/// its endpoints and routes) on the wire, more than a policy file can hold, and its `source`
/// was cut out before the decode. The admin service answers it with
/// [`too_many_items`](retryplane_proto::convert::too_many_items), the error a decoded document
/// of that size gets (from Validate's check, or from `ControlPlane::apply`'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooManyItems(pub usize);

/// A request extension: fields of the call's message that this control plane does not know,
/// found on its bytes ([`retryplane_proto::unknown_fields`]; at most [`UNKNOWN_LISTED`]).
/// prost skips them, so a request from a newer client (a field its author set in a policy, or
/// a flag of the request) would be taken without them: the admin service refuses it instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownFields(pub Vec<retryplane_proto::unknown_fields::UnknownField>);

/// The most unknown fields one request's refusal names.
pub const UNKNOWN_LISTED: usize = 5;

/// `S` (the admin service), with the calls that carry a policy received whole before they take
/// one of [`MAX_DECODED`] turns.
#[derive(Clone, Debug)]
pub struct DecodeTurns<S> {
    inner: S,
    /// [`MAX_DECODED`] turns, one of them kept for an Apply by a caller who may change the
    /// policies.
    turns: Turns,
    /// [`READ_AHEAD_BYTES`] permits, one a byte, and room for one more message kept for an
    /// Apply by a caller who may change the policies.
    budget: Turns,
    /// The most bytes of a message read ahead: the decoding limit and a frame header. A longer
    /// body is handed on as it comes, without a turn: the service refuses it by its length.
    read_ahead: usize,
}

impl<S> DecodeTurns<S> {
    /// Wraps `inner`, which decodes messages of at most `max_message_bytes`.
    pub fn new(inner: S, max_message_bytes: usize) -> Self {
        Self::with_turns(inner, max_message_bytes, MAX_DECODED)
    }

    /// `turns` decode turns in all: from 2 on, one kept for an Apply by a caller who may change
    /// the policies and the rest for every call.
    fn with_turns(inner: S, max_message_bytes: usize, turns: usize) -> Self {
        let read_ahead = max_message_bytes.saturating_add(FRAME_HEADER);
        let kept = usize::from(turns >= 2);
        Self {
            inner,
            turns: Turns::new(turns - kept, kept),
            budget: Turns::new(READ_AHEAD_BYTES, read_ahead.min(READ_AHEAD_BYTES)),
            read_ahead,
        }
    }
}

impl<S: NamedService> NamedService for DecodeTurns<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for DecodeTurns<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if !CARRY_A_POLICY.contains(&request.uri().path()) {
            return Box::pin(self.inner.call(request));
        }
        // The service made ready goes with the call; a clone takes its place (tower's way).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (turns, budget, limit) = (self.turns.clone(), self.budget.clone(), self.read_ahead);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            // An Apply by a caller who may change the policies (its credential set by the
            // auth guard, which runs first: `server::AdminStack`); a Validate is a check only.
            let may_change = parts.uri.path() == APPLY
                && turns::may_change(parts.extensions.get::<Credential>());
            let read = tokio::time::timeout(
                READ_AHEAD_WAIT,
                read_ahead(body, limit, &budget, may_change),
            );
            let Ok((body, whole, _room)) = read.await else {
                return Ok(Status::deadline_exceeded(format!(
                    "the request's message did not come within {} s",
                    READ_AHEAD_WAIT.as_secs()
                ))
                .into_http());
            };
            if body.more_than_one_message(limit) {
                return Ok(Status::invalid_argument(
                    "the request holds more than one message; this call takes one",
                )
                .into_http());
            }
            let (body, mark) = body.screened(parts.uri.path());
            let mut parts = parts;
            match mark {
                Some(Mark::TooMany(too_many)) => {
                    parts.extensions.insert(too_many);
                }
                Some(Mark::Unknown(unknown)) => {
                    parts.extensions.insert(unknown);
                }
                None => {}
            }
            // A body that ended within the limit, or broke off after its message (a reset the
            // service may take for its end), is decoded with a turn; one past the limit is
            // refused by its length, decoding nothing. The semaphore is never closed; should it
            // be, the call goes on without a turn.
            let _turn = match whole || body.rest.is_none() {
                true => turns.acquire(1, may_change).await.ok(),
                false => None,
            };
            inner
                .call(http::Request::from_parts(parts, Body::new(body)))
                .await
        })
    }
}

/// Reads `body` until it ends or passes `limit` bytes, once `budget` has room for the message
/// its first frame header announces: what was read, then the rest (its trailers, the body
/// where the read stopped, or its error), whether it ended within the limit, and the room it
/// takes in `budget`.
async fn read_ahead(
    mut body: Body,
    limit: usize,
    budget: &Turns,
    may_change: bool,
) -> (ReadAhead, bool, Option<OwnedSemaphorePermit>) {
    let mut room: Option<OwnedSemaphorePermit> = None;
    // The bytes the first frame header announces (with the header), within the limit: the
    // room taken, and the most read. A unary call sends nothing after its message, so a body
    // that goes on past it is refused when it has come this far (it once read on to the limit
    // holding room for the header alone: a header of an empty message, then 4 MiB).
    let mut most = limit;
    let mut read = BytesMut::new();
    let mut ahead = ReadAhead {
        prefix: None,
        trailers: None,
        rest: None,
        error: None,
    };
    let whole = loop {
        match body.frame().await {
            None => break true,
            Some(Err(e)) => {
                ahead.error = Some(e);
                break false;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    read.extend_from_slice(&data);
                    // Room for the whole message its header announces (within the limit), taken
                    // at once: calls that each held part of the budget while they waited for
                    // more could all wait on each other until their time ran out.
                    if room.is_none()
                        && let Some(framed) = first_frame_len(&read)
                    {
                        let wanted = framed.min(limit).min(READ_AHEAD_BYTES);
                        most = wanted;
                        // The semaphore is never closed; should it be, the call goes uncounted.
                        room = budget
                            .acquire(u32::try_from(wanted).unwrap_or(u32::MAX), may_change)
                            .await
                            .ok();
                    }
                    if read.len() > most {
                        ahead.rest = Some(body);
                        break false;
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        ahead.trailers = Some(trailers);
                        break true;
                    }
                }
            },
        }
    };
    ahead.prefix = (!read.is_empty()).then(|| read.freeze());
    (ahead, whole, room)
}

/// A request body read ahead ([`read_ahead`]): the bytes read, then its trailers, the rest of
/// the body, or its error.
struct ReadAhead {
    prefix: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<Body>,
    error: Option<Status>,
}

impl ReadAhead {
    /// Whether the body holds more than its first message: bytes after it, or a body past the
    /// limit whose first message fits it. A unary call carries one message; tonic decodes
    /// every further one (each up to the limit) before the service runs (a second frame after
    /// an empty first one was decoded whole, with nothing counted on the wire).
    fn more_than_one_message(&self, limit: usize) -> bool {
        if self.rest.is_some() {
            return self.first_message_fits(limit);
        }
        self.prefix
            .as_deref()
            .is_some_and(|prefix| first_frame_len(prefix).is_some_and(|len| prefix.len() > len))
    }

    /// The body with its message's `source` cut out when that message holds more items on the
    /// wire than a policy file can (see [`TooManyItems`]); else as it was. Only a body read
    /// whole within the limit (or up to its error) that holds one message, all of it, is
    /// looked at: one past the limit is left for the service to refuse by its length (cut
    /// short, it passed that check, and the frames after it were decoded with no turn), and a
    /// compressed message is left to the service, which takes none.
    ///
    /// A message within the limit is also walked for fields this control plane does not know
    /// (see [`UnknownFields`]), as the request of `path` (Validate's or Apply's).
    fn screened(mut self, path: &str) -> (Self, Option<Mark>) {
        if self.rest.is_some() {
            return (self, None);
        }
        let Some(prefix) = &self.prefix else {
            return (self, None);
        };
        // Uncompressed, and all of it.
        if prefix.first() != Some(&0) || first_frame_len(prefix) != Some(prefix.len()) {
            return (self, None);
        }
        let message = &prefix[FRAME_HEADER..];
        let items = wire_items::items_at_least(message);
        if items <= MAX_ITEMS {
            let type_name = if path == APPLY {
                "retryplane.v1.ApplyRequest"
            } else {
                "retryplane.v1.ValidateRequest"
            };
            let unknown =
                retryplane_proto::unknown_fields::find(type_name, message, UNKNOWN_LISTED);
            let mark = (!unknown.is_empty()).then_some(Mark::Unknown(UnknownFields(unknown)));
            return (self, mark);
        }
        let cut = wire_items::without_source(message);
        let mut framed = BytesMut::with_capacity(FRAME_HEADER + cut.len());
        framed.put_u8(0);
        // Shorter than the message, whose length fit.
        framed.put_u32(u32::try_from(cut.len()).unwrap_or(u32::MAX));
        framed.extend_from_slice(&cut);
        self.prefix = Some(framed.freeze());
        (self, Some(Mark::TooMany(TooManyItems(items))))
    }

    /// Whether the first message the bytes read announce (its frame header's length) fits
    /// `limit` with its header: a body past the limit then holds more than one message.
    fn first_message_fits(&self, limit: usize) -> bool {
        self.prefix
            .as_deref()
            .and_then(first_frame_len)
            .is_some_and(|len| len <= limit)
    }
}

/// What [`ReadAhead::screened`] found of a message.
enum Mark {
    TooMany(TooManyItems),
    Unknown(UnknownFields),
}

/// The bytes the first frame of `body` takes, its header and the message it announces; `None`
/// before its header has come.
fn first_frame_len(body: &[u8]) -> Option<usize> {
    let &[_, a, b, c, d] = body.get(..FRAME_HEADER)? else {
        return None;
    };
    let announced = usize::try_from(u32::from_be_bytes([a, b, c, d])).unwrap_or(usize::MAX);
    Some(announced.saturating_add(FRAME_HEADER))
}

impl http_body::Body for ReadAhead {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        if let Some(error) = self.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        if let Some(rest) = self.rest.as_mut() {
            return Pin::new(rest).poll_frame(cx);
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Notify;

    use super::*;

    /// A service whose answers wait for `release`, counting the calls it has begun and keeping
    /// each one's [`CALL`] header, in the order they began.
    #[derive(Clone, Default)]
    struct Held {
        begun: Arc<AtomicUsize>,
        names: Arc<std::sync::Mutex<Vec<String>>>,
        release: Arc<Notify>,
    }

    /// A test request's name, for [`Held`] to tell which calls began.
    const CALL: &str = "x-test-call";

    impl Held {
        /// The [`CALL`] names of the calls begun so far, in the order they began (empty for a
        /// call without one).
        fn names(&self) -> Vec<String> {
            self.names.lock().unwrap().clone()
        }

        /// The calls begun so far.
        fn begun(&self) -> usize {
            self.begun.load(Ordering::SeqCst)
        }

        /// Waits until `calls` have begun, for at most 10 s; `what` says what that means when
        /// they do not. Sleeps, not yields: under a paused clock a loop that only yields never
        /// lets the bound pass.
        async fn until_begun(&self, calls: usize, what: &str) {
            tokio::time::timeout(std::time::Duration::from_secs(10), async {
                while self.begun() < calls {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{what}: {} of {calls} calls begun", self.begun()));
        }
    }

    impl Service<http::Request<Body>> for Held {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<http::Response<Body>, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<Body>) -> Self::Future {
            let name = request
                .headers()
                .get(CALL)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            self.names.lock().unwrap().push(name);
            let (begun, release) = (self.begun.clone(), self.release.clone());
            Box::pin(async move {
                begun.fetch_add(1, Ordering::SeqCst);
                release.notified().await;
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    fn request(path: &str) -> http::Request<Body> {
        http::Request::builder()
            .uri(format!("http://localhost{path}"))
            .body(Body::empty())
            .unwrap()
    }

    /// Past its turns, a Validate or Apply call is not begun (its message not decoded) until one
    /// ends; other calls are not held.
    #[tokio::test(start_paused = true)]
    async fn calls_that_carry_a_policy_begin_only_with_a_turn() {
        let held = Held::default();
        let mut service = DecodeTurns::with_turns(held.clone(), 1024, 2);
        let mut calls = tokio::task::JoinSet::new();
        for path in [
            "/retryplane.v1.AdminService/Validate",
            "/retryplane.v1.AdminService/Apply",
            "/retryplane.v1.AdminService/Validate",
            "/retryplane.v1.AdminService/FleetStatus",
        ] {
            calls.spawn(service.call(request(path)));
        }
        held.until_begun(3, "two with a turn and FleetStatus begin")
            .await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            held.begun(),
            3,
            "a third call carrying a policy began without a turn"
        );
        held.release.notify_one();
        held.until_begun(4, "the third begins once one ends").await;
        held.release.notify_waiters();
        held.release.notify_one();
    }

    /// With the shared decode turns held by a read-only token's calls, the next of them waits,
    /// and so does an admin's Validate (a check only); an admin's Apply takes the turn kept for
    /// callers who may change the policies.
    #[tokio::test(start_paused = true)]
    async fn an_admins_call_takes_the_kept_turn_when_readers_hold_the_others() {
        use crate::auth::Role;
        let held = Held::default();
        let mut service = DecodeTurns::with_turns(held.clone(), 1024, 2);
        let as_role = |role: Role, path: &str| {
            let mut request = request(path);
            request
                .extensions_mut()
                .insert(crate::auth::Credential::for_test(role));
            request
        };
        let mut calls = tokio::task::JoinSet::new();
        let validate = "/retryplane.v1.AdminService/Validate";
        calls.spawn(service.call(as_role(Role::Viewer, validate)));
        calls.spawn(service.call(as_role(Role::Viewer, validate)));
        held.until_begun(1, "the first reader begins").await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(held.begun(), 1, "a second reader took the kept turn");
        calls.spawn(service.call(as_role(Role::Admin, validate)));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(held.begun(), 1, "an admin's Validate took the kept turn");
        calls.spawn(service.call(as_role(Role::Admin, APPLY)));
        held.until_begun(2, "the admin's call waited behind the readers")
            .await;
        held.release.notify_waiters();
        held.release.notify_one();
    }

    /// A body that never ends.
    struct Never;

    impl http_body::Body for Never {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Pending
        }
    }

    fn validate(body: Body) -> http::Request<Body> {
        http::Request::builder()
            .uri("http://localhost/retryplane.v1.AdminService/Validate")
            .body(body)
            .unwrap()
    }

    /// A call whose message never finishes coming holds no turn (a client that sends slowly
    /// kept every Validate and Apply waiting); one longer than the limit is handed on without
    /// one, to be refused by its length.
    #[tokio::test(start_paused = true)]
    async fn a_call_takes_its_turn_only_once_its_message_has_come() {
        let held = Held::default();
        let mut service = DecodeTurns::with_turns(held.clone(), 4, 1);
        // Before the message that never comes is given up (`READ_AHEAD_WAIT`), or a call that
        // wrongly took the only turn would free it then and the test pass all the same.
        let start = tokio::time::Instant::now();
        let mut calls = tokio::task::JoinSet::new();
        let named = |name: &str, body: Body| {
            let mut request = validate(body);
            request
                .headers_mut()
                .insert(CALL, http::HeaderValue::from_str(name).unwrap());
            request
        };
        calls.spawn(service.call(named("never", Body::new(Never))));
        calls.spawn(service.call(named(
            "came",
            Body::new(http_body_util::Full::new(Bytes::from_static(b"12345"))),
        )));
        held.until_begun(1, "the call whose message came begins with the turn")
            .await;
        // The only turn is held: a message past the limit (4 + 5 bytes) still goes on.
        calls.spawn(service.call(named(
            "long",
            Body::new(http_body_util::Full::new(Bytes::from_static(b"0123456789"))),
        )));
        held.until_begun(2, "a message past the limit is handed on without a turn")
            .await;
        assert!(start.elapsed() < READ_AHEAD_WAIT, "{:?}", start.elapsed());
        // The two that began are the message that came (with the turn) and the long one; the
        // message that never comes did not.
        assert_eq!(held.names(), ["came", "long"]);
    }

    /// A body longer than one message whose first message fits (a second frame announced
    /// after it) is refused without being decoded; a call whose message does not come in time
    /// is ended, holding nothing.
    #[tokio::test(start_paused = true)]
    async fn a_padded_or_late_message_is_refused_before_it_is_decoded() {
        let held = Held::default();
        let mut service = DecodeTurns::with_turns(held.clone(), 8, 1);
        // A 3-byte message, then the header of a 1 MiB frame (and a little of it).
        let mut padded = vec![0, 0, 0, 0, 3, b'a', b'b', b'c'];
        padded.extend_from_slice(&[0, 0, 0x10, 0, 0, b'x']);
        let answer = service
            .call(validate(Body::new(http_body_util::Full::new(Bytes::from(
                padded,
            )))))
            .await
            .unwrap();
        assert_eq!(
            answer.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"3"[..]),
            "{answer:?}"
        );
        let began = tokio::time::Instant::now();
        let answer = service.call(validate(Body::new(Never))).await.unwrap();
        assert_eq!(
            answer.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"4"[..]),
            "{answer:?}"
        );
        assert_eq!(began.elapsed(), READ_AHEAD_WAIT);
        assert_eq!(held.begun(), 0, "nothing was decoded");
        assert_eq!(
            service.budget.available_permits(),
            READ_AHEAD_BYTES + service.read_ahead.min(READ_AHEAD_BYTES)
        );
        // An error mid-body is no second message: handed on, for the service to report.
        let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
            Ok(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 3, b'a']))),
            Err(Status::cancelled("reset")),
        ];
        let call = service.call(validate(Body::new(http_body_util::StreamBody::new(
            tokio_stream::iter(frames),
        ))));
        tokio::spawn(call);
        held.until_begun(1, "handed on").await;
    }

    /// A body that goes on past the message its header announces is refused once it has:
    /// it is not read on to the limit (or its time) holding room for that message alone.
    /// A message whose body then breaks off is decoded with a turn, as one that ends.
    #[tokio::test(start_paused = true)]
    async fn a_body_past_its_message_is_refused_there_and_one_that_breaks_off_waits_its_turn() {
        let held = Held::default();
        let mut service = DecodeTurns::with_turns(held.clone(), 1 << 20, 1);
        let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
            Ok(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
            Ok(Frame::data(Bytes::from_static(b"xxxxxxxxxx"))),
        ];
        let endless =
            tokio_stream::StreamExt::chain(tokio_stream::iter(frames), tokio_stream::pending());
        let began = tokio::time::Instant::now();
        let answer = service
            .call(validate(Body::new(http_body_util::StreamBody::new(
                endless,
            ))))
            .await
            .unwrap();
        assert_eq!(
            answer.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"3"[..]),
            "{answer:?}"
        );
        assert!(began.elapsed() < READ_AHEAD_WAIT, "{:?}", began.elapsed());
        assert_eq!(held.begun(), 0);
        // One call holds the only turn; a message whose body then breaks off waits for it.
        let whole = || {
            validate(Body::new(http_body_util::Full::new(Bytes::from_static(&[
                0, 0, 0, 0, 3, b'a', b'b', b'c',
            ]))))
        };
        tokio::spawn(service.call(whole()));
        held.until_begun(1, "the first call begins").await;
        let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
            Ok(Frame::data(Bytes::from_static(&[
                0, 0, 0, 0, 3, b'a', b'b', b'c',
            ]))),
            Err(Status::cancelled("reset")),
        ];
        tokio::spawn(
            service.call(validate(Body::new(http_body_util::StreamBody::new(
                tokio_stream::iter(frames),
            )))),
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert_eq!(held.begun(), 1, "began without a turn");
        held.release.notify_one();
        held.until_begun(2, "it begins once the turn is free").await;
        held.release.notify_one();
    }

    /// What a call brought: its [`TooManyItems`] mark and its body.
    type Brought = (Option<TooManyItems>, Bytes);

    /// A service that keeps what each call brought.
    #[derive(Clone, Default)]
    struct Capture(Arc<std::sync::Mutex<Vec<Brought>>>);

    impl Service<http::Request<Body>> for Capture {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<http::Response<Body>, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<Body>) -> Self::Future {
            let calls = self.0.clone();
            Box::pin(async move {
                let mark = request.extensions().get::<TooManyItems>().copied();
                let body = request.into_body().collect().await.unwrap().to_bytes();
                calls.lock().unwrap().push((mark, body));
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    /// A framed Apply message of `endpoints` bare endpoints (two bytes each), `dry_run` set,
    /// padded with an unknown field to `len` bytes when given.
    fn big_apply(endpoints: usize, len: Option<usize>) -> (Vec<u8>, Vec<u8>) {
        use prost::Message as _;
        let request = retryplane_proto::pb::ApplyRequest {
            source: Some(retryplane_proto::pb::PolicySource {
                kind: Some(retryplane_proto::pb::policy_source::Kind::Document(
                    retryplane_proto::pb::PolicyDocument {
                        defaults: None,
                        endpoints: vec![Default::default(); endpoints],
                    },
                )),
                origin: String::new(),
            }),
            dry_run: true,
            ..Default::default()
        };
        let mut message = request.encode_to_vec();
        if let Some(len) = len {
            // Field 15, length-delimited: a tag, a 3-byte length, then bytes.
            let pad = len - message.len() - 4;
            message.push(15 << 3 | 2);
            message.extend_from_slice(&[
                (pad & 0x7f) as u8 | 0x80,
                (pad >> 7 & 0x7f) as u8 | 0x80,
                (pad >> 14) as u8,
            ]);
            message.resize(len, 0);
            assert!(retryplane_proto::pb::ApplyRequest::decode(message.as_slice()).is_ok());
        }
        let mut framed = vec![0];
        framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        framed.extend_from_slice(&message);
        (message, framed)
    }

    fn apply_call(bytes: Vec<u8>) -> http::Request<Body> {
        http::Request::builder()
            .uri("http://localhost/retryplane.v1.AdminService/Apply")
            .body(Body::new(http_body_util::Full::new(Bytes::from(bytes))))
            .unwrap()
    }

    /// One message of more endpoints than a policy file can hold is handed on without its
    /// `source` and marked; one of fewer, as it came.
    #[tokio::test]
    async fn a_message_of_too_many_endpoints_is_handed_on_without_its_policy() {
        use prost::Message as _;
        let capture = Capture::default();
        let mut service = DecodeTurns::with_turns(capture.clone(), 1 << 20, 1);
        let over = retryplane_proto::convert::MAX_ITEMS / 2 + 1;
        let (_, framed) = big_apply(over, None);
        service.call(apply_call(framed)).await.unwrap();
        let (_, framed) = big_apply(over - 1, None);
        service.call(apply_call(framed.clone())).await.unwrap();
        let calls = capture.0.lock().unwrap().clone();
        assert_eq!(calls[0].0, Some(TooManyItems(2 * over)));
        let body = &calls[0].1;
        assert_eq!(body[0], 0);
        assert_eq!(
            usize::try_from(u32::from_be_bytes([body[1], body[2], body[3], body[4]])).unwrap(),
            body.len() - FRAME_HEADER
        );
        let decoded = retryplane_proto::pb::ApplyRequest::decode(&body[FRAME_HEADER..]).unwrap();
        assert_eq!(decoded.source, None);
        assert!(decoded.dry_run);
        assert_eq!(calls[1], (None, Bytes::from(framed)));
        // A message of exactly the limit is counted and cut too.
        let (message, framed) = big_apply(over, Some(2 * over + 1_000));
        let capture = Capture::default();
        let mut service = DecodeTurns::with_turns(capture.clone(), message.len(), 1);
        service.call(apply_call(framed)).await.unwrap();
        let calls = capture.0.lock().unwrap().clone();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].0, Some(TooManyItems(2 * over)));
    }

    /// Past the limit by a byte, a first message of too many endpoints is handed on as it came,
    /// for the service to refuse by its length (cut short, it passed that check, and the
    /// frames after it were decoded without a turn); a second message after a first within the
    /// limit, even an empty first, is refused, not handed on.
    #[tokio::test]
    async fn a_message_past_the_limit_or_a_second_message_is_never_cut_short() {
        let over = retryplane_proto::convert::MAX_ITEMS / 2 + 1;
        let (message, framed) = big_apply(over, Some(2 * over + 1_000));
        let capture = Capture::default();
        let mut service = DecodeTurns::with_turns(capture.clone(), message.len() - 1, 1);
        let (_, second) = big_apply(1, None);
        let mut body = framed.clone();
        body.extend_from_slice(&second);
        service.call(apply_call(body.clone())).await.unwrap();
        assert_eq!(
            capture.0.lock().unwrap().clone(),
            vec![(None, Bytes::from(body))]
        );
        // An empty first message, then one of too many endpoints, within the limit.
        let mut service = DecodeTurns::with_turns(capture.clone(), 1 << 20, 1);
        let mut body = vec![0, 0, 0, 0, 0];
        body.extend_from_slice(&big_apply(over, None).1);
        let answer = service.call(apply_call(body)).await.unwrap();
        assert_eq!(
            answer.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"3"[..]),
            "{answer:?}"
        );
        assert_eq!(capture.0.lock().unwrap().len(), 1, "not handed on");
    }

    /// What was read ahead is handed on whole: its bytes, then its trailers, or the rest of
    /// the body where the read stopped.
    #[tokio::test]
    async fn a_body_read_ahead_is_handed_on_whole() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-t", "1".parse().unwrap());
        // A 3-byte message, its header and body in two frames.
        let body = || {
            let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
                Ok(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 3, b'a']))),
                Ok(Frame::data(Bytes::from_static(b"bc"))),
                Ok(Frame::trailers(trailers.clone())),
            ];
            Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
        };
        let whole_message: &[u8] = &[0, 0, 0, 0, 3, b'a', b'b', b'c'];
        let budget = Turns::new(READ_AHEAD_BYTES, 16);
        let (ahead, whole, room) = read_ahead(body(), 16, &budget, false).await;
        assert_eq!(
            room.map(|r| r.num_permits()),
            Some(8),
            "the message its header announces takes room, at once"
        );
        assert!(whole);
        let collected = ahead.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), whole_message);
        // Past the limit: the first frame, then the rest as it comes.
        let (ahead, whole, _) = read_ahead(body(), 4, &budget, false).await;
        assert!(!whole);
        let collected = ahead.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), whole_message);
    }
}
