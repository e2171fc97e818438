//! The one background task that owns the control-plane stream (SPEC §3, STYLE #5).
//!
//! Each session: connect (HTTP/2 keepalive on), send Hello with the version in force (when it
//! came from the control plane or the cache) and the process's instance id; once the stream's
//! response says the control plane acknowledges metrics reports
//! ([`retryplane_proto::METRICS_ACK_METADATA`]), send again the reports the previous streams
//! left unacknowledged ([`outbox`]). Then apply every snapshot ([`apply`]), write the cache
//! file (waiting for the disk a bounded time only, [`cache_writer`]), answer ACK or NACK, and
//! send a `MetricsReport` of counter deltas every interval (on a
//! schedule kept across streams, so a report due while no stream was up goes out as soon as one
//! opens): numbered and kept until acknowledged, or unnumbered to a control plane that does not
//! acknowledge reports. When the stream ends or cannot be opened (a control plane that has not
//! answered its opening within [`OPEN_TIMEOUT`] included) the task waits a
//! [`ReconnectBackoff`] delay and tries again; the policies in force are never dropped. Each
//! loss is logged at info, but a refusal that trying again will not fix (a token refused, a Hello
//! refused as invalid, a URL that is not the agent listener) at warn, with what to check, once
//! until the reason changes; an open stream whose token the control plane dropped, while the
//! agent's token file holds another by then, is the last step of a rotation, said at info. On
//! shutdown it sends the answers that wait and the counts not yet reported (waiting a bounded
//! time for room), half-closes the stream and waits (bounded) for the server to close it, then
//! (bounded too) for the last cache file write (see [`Closing`]).

pub(crate) mod apply;
mod cache_writer;
mod counted;
#[cfg(test)]
mod late_read_tests;
pub(crate) mod outbox;
pub mod reconnect;
pub(crate) mod token;
mod unsent;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retryplane_policy::codes::GrpcCode;
use retryplane_policy::rng::SeededRng;
use retryplane_proto::liveness::{
    Chunked, HEARTBEAT_METADATA, Life, keepalive_period, liveness_timeout,
};
use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::agent::Shared;
use crate::cache::{Cached, Foreign, LateRead};
use crate::error::StreamError;
use crate::snapshot::Source;
use cache_writer::{CacheWriter, Gate};
use outbox::{NotSent, Outbox};
use reconnect::ReconnectBackoff;
use unsent::Unsent;

/// HTTP/2 keepalive ping interval by default (the same as the control plane's default).
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// How long a ping may go unanswered before the connection counts as dead.
pub(crate) const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// The range the keepalive interval and timeout are held in: the control plane's own for
/// `--keepalive-interval` and `--keepalive-timeout`. A zero timeout would count every
/// connection dead at its first ping, a zero interval ping without pause, and a timer past
/// the clock's range panics in the HTTP/2 connection on every connection.
pub(crate) const KEEPALIVE_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600));
/// Longest wait for a TCP connection to the control plane.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait, once connected, for the control plane to answer the stream's opening (its
/// response headers: the control plane sends them once it has the Hello, sent at once). A peer
/// that takes the request and never answers it (a proxy or a server that is stuck, but still
/// answers HTTP/2 pings, so keepalive does not see it) would otherwise hold the agent away
/// from every other control plane for good. Generous: a control plane that thousands of agents
/// reconnect to at once answers late, and giving up on it early would only add to that load.
pub(crate) const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stream's opening waits for an answer before the agent says it waits (see
/// [`note_slow_open`]): a control plane answers within milliseconds, and a wrong URL whose
/// host accepts connections but never answers (another service, a black-holed port) would
/// otherwise leave nothing said for [`OPEN_TIMEOUT`].
pub(crate) const SLOW_OPEN: Duration = Duration::from_secs(5);

/// A stream's opening still unanswered after [`SLOW_OPEN`]: with no earlier reason to show,
/// [`Agent::stream_error`](crate::Agent::stream_error) says it waits, and so does one info
/// line (one at debug when an earlier try's reason stands: it is kept until this try ends).
/// Whether it set `stream_error` (a shutdown during the wait takes it back: nothing waits then).
fn note_slow_open(shared: &Shared) -> bool {
    let message = format!(
        "no answer yet: the control plane accepted the connection but has not answered the \
         stream's opening in {} s (it is given {} s); is the URL the agent listener of \
         `retryplane serve`?",
        SLOW_OPEN.as_secs(),
        OPEN_TIMEOUT.as_secs()
    );
    let mut error = shared
        .stream_error
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if error.is_none() {
        info!("{message}");
        *error = Some(StreamError {
            code: None,
            message,
        });
        true
    } else {
        debug!("{message}");
        false
    }
}

/// How long the session reads an answer that is not gRPC for what tonic makes of it.
const NOT_GRPC_READ: Duration = Duration::from_secs(2);
/// Each of the close's two bounds (see [`Closing`]): the longest wait on shutdown for the
/// waiting answers and the last report to find room on the stream; then, once any of it has,
/// for the server to read it and close its side.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Longest wait on shutdown for the last cache file write (see [`cache_writer`]).
const CACHE_GRACE: Duration = Duration::from_secs(2);
/// Longest wait for an applied snapshot's cache file write before it is answered: the answer
/// then goes, and the write goes on in the background.
const CACHE_WAIT: Duration = Duration::from_secs(1);
/// The shortest metrics interval: the control plane's own lower bound (`--metrics-interval`).
/// A shorter one, from the agent's settings, its cache file or a snapshot, would flood the
/// control plane with reports that its rate limit then refuses.
pub(crate) const MIN_METRICS_INTERVAL: Duration = Duration::from_millis(100);
/// The longest metrics interval: the control plane's own upper bound. A longer one would keep
/// the counts from the control plane for as long.
pub(crate) const MAX_METRICS_INTERVAL: Duration = Duration::from_secs(3600);
/// Messages queued towards the control plane.
const OUTBOUND: usize = 16;
// A new stream holds Hello and every unacknowledged report at once.
const _: () = assert!(outbox::WINDOW < OUTBOUND);

/// What the stream task is told.
#[derive(Debug)]
pub(crate) struct StreamConfig {
    pub(crate) endpoint: tonic::transport::Endpoint,
    pub(crate) token: Option<token::TokenSource>,
    pub(crate) hello: pb::Hello,
    pub(crate) cache_file: Option<PathBuf>,
    /// The start's read of `cache_file` when it did not end in time: settled before the first
    /// write there ([`settle_late_read`]).
    pub(crate) late_read: Option<LateRead>,
    pub(crate) default_metrics_interval: Duration,
    pub(crate) backoff: ReconnectBackoff,
    /// HTTP/2 keepalive: ping interval, and how long a ping may go unanswered.
    pub(crate) keepalive: (Duration, Duration),
}

/// How a session ended.
enum SessionEnd {
    /// The agent is shutting down.
    Cancelled,
    /// A cache read late was put in force on an open stream: a new stream, opened at once,
    /// tells the control plane the version in force in its Hello.
    Reopen,
    /// The connection failed or the stream ended; `up` is how long it was open, if it was.
    Lost {
        up: Option<Duration>,
        reason: String,
        /// The gRPC status the control plane answered with, if it did.
        code: Option<tonic::Code>,
        /// The control plane ended the stream because a newer stream with the same agent id
        /// took over (`ABORTED`): two processes share the id.
        replaced: bool,
    },
}

/// How a stream that the control plane ended with `status`, after `up`, ends the session.
fn ended(up: Option<Duration>, status: &tonic::Status) -> SessionEnd {
    SessionEnd::Lost {
        up,
        reason: format!("stream ended: {}", status_text(status)),
        code: Some(status.code()),
        replaced: status.code() == tonic::Code::Aborted,
    }
}

/// `CODE: message`, the code by its canonical gRPC name (`UNAUTHENTICATED`, as the admin
/// commands and gRPC tools print it), or the code alone when the status has no message (what a
/// server without the service answers), never `CODE: ` with nothing after it.
///
/// A status tonic made of a transport error carries the cause in its sources (`h2 protocol
/// error: http2 error` is all its message says of an HTTP/1 server at the URL; the source says
/// `frame with invalid size`): they follow, `: `-separated, as [`chain`] writes them.
///
/// Control, bidi and invisible characters (a line break in a `grpc-message` from whatever
/// answers at the URL) are written escaped ([`retryplane_policy::diag::OneLine`]), so that the
/// text cannot make lines of its own in the agent's log.
fn status_text(status: &tonic::Status) -> String {
    retryplane_policy::diag::OneLine(&status_text_raw(status)).to_string()
}

/// [`status_text`] as the status says it, unescaped.
fn status_text_raw(status: &tonic::Status) -> String {
    let code = GrpcCode::from_i32(status.code() as i32).map_or("UNKNOWN", GrpcCode::name);
    let mut text = match status.message() {
        "" => code.to_owned(),
        message => format!("{code}: {message}"),
    };
    if let Some(source) = std::error::Error::source(status) {
        let causes = chain(source);
        let first = source.to_string();
        if causes.starts_with(status.message()) && !status.message().is_empty() {
            // The causes begin with what the message says (`transport error: …`): said once.
            text = format!("{code}: {causes}");
        } else if text.ends_with(&first) && !first.is_empty() {
            // The message ends with what the first cause says (`h2 protocol error: error
            // reading a body from connection`, then that cause): only what follows it.
            text.push_str(causes.strip_prefix(first.as_str()).unwrap_or(&causes));
        } else if !text.ends_with(&causes) {
            text.push_str(": ");
            text.push_str(&causes);
        }
    }
    text
}

/// How long the control plane must have been unreachable (no stream up) before the agent
/// says so at warn.
const UNREACHABLE_WARN: Duration = Duration::from_secs(60);

/// `e` and its sources, `: `-separated (a transport error's own text is only "transport
/// error"; the cause is in its sources). A source whose text the one above it already ends
/// with is not repeated (hyper's connect error wraps another that says the same). The
/// control plane's `ErrorChain` does the same; this crate does not depend on it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut above = text.clone();
    let mut source = e.source();
    while let Some(s) = source {
        let said = s.to_string();
        if !above.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        above = said;
        source = s.source();
    }
    text
}

/// Set while the stream task runs: when the task ends any other way than by shutdown (its
/// runtime dropped without `shutdown`, or a panic, as on a runtime built without timers or
/// sockets), the agent no longer says it is connected, and says why in its stream error.
struct TaskAlive<'a> {
    shared: &'a Shared,
    cancel: &'a CancellationToken,
}

impl Drop for TaskAlive<'_> {
    fn drop(&mut self) {
        self.shared.connected.store(false, Relaxed);
        if !self.cancel.is_cancelled() {
            *self
                .shared
                .stream_error
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(StreamError {
                code: None,
                message: "the agent's stream task ended without a shutdown: its tokio runtime \
                          was dropped, or the task failed (a runtime needs `enable_all()`, for \
                          the agent's timers and sockets); policies are no longer updated"
                    .to_owned(),
            });
        }
    }
}

/// The task: sessions until cancelled, then the last cache file write (bounded).
pub(crate) async fn run(
    shared: Arc<Shared>,
    mut config: StreamConfig,
    cancel: CancellationToken,
    seed: u64,
) {
    let _alive = TaskAlive {
        shared: &shared,
        cancel: &cancel,
    };
    let late = config.late_read.take();
    // A cache read late: the writer's gate says whether the file may be written, and hands a
    // valid cache to this task, which decides whether to put it in force.
    let mut late_cache = None;
    let cache = config.cache_file.clone().map(|path| {
        let gate = late.map(|late| {
            let (found, cached) = oneshot::channel();
            late_cache = Some(cached);
            let gate: Gate = Box::pin(settle_late_read(late, found));
            gate
        });
        CacheWriter::start(path, gate)
    });
    sessions(&shared, &config, &cancel, seed, cache.as_ref(), late_cache).await;
    if let Some(cache) = cache {
        cache.finish(CACHE_GRACE).await;
    }
}

/// Waits for the start's read of the cache file that did not end in time and judges it as a
/// start does; a valid cache goes to the stream task on `found` (see [`put_late_cache_in_force`]).
/// Whether the cache file may be written: not if what is there is not a policy cache. Never
/// returns if the read never ends.
async fn settle_late_read(late: LateRead, found: oneshot::Sender<Cached>) -> bool {
    match late.settle().await {
        Ok(Some(cached)) => {
            // The stream task is gone only at shutdown: nothing to put in force then.
            let _ = found.send(cached);
            true
        }
        Ok(None) => true,
        Err(Foreign) => false,
    }
}

/// The cache a read late found, once it is handed over: pending for good when there is none
/// (or it was taken). Cancel-safe: the cache stays in `late` until taken.
async fn late_cache(late: &mut Option<oneshot::Receiver<Cached>>) -> Option<Cached> {
    let Some(found) = late.as_mut() else {
        return std::future::pending().await;
    };
    let cached = found.await.ok();
    *late = None;
    cached
}

/// Does what the start would have done with `cached`, read late: puts it in force, with the
/// metrics interval cached with it, if the agent still runs on the fallback policy (a snapshot
/// from the control plane, or policies the program set, are newer), and brings the next report
/// forward to that interval. Whether it did.
fn put_late_cache_in_force(shared: &Shared, cached: Cached, next_report: &mut Instant) -> bool {
    let version = cached.version();
    let interval = cached.metrics_interval;
    // Decided and done in the writers' turn.
    let applied = shared.update_policies_if(|current| {
        if current.source() != Source::Fallback {
            // Policies set meanwhile (`Agent::set_policies`) came first: the version announced
            // for the cache (`hold_fallback_counts`) is theirs again.
            shared.announce(current.version());
            return None;
        }
        if let Some(interval) = interval {
            shared.metrics_interval_ms.store(
                u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
                Relaxed,
            );
        }
        Some(cached.into_snapshot(Some(current)))
    });
    if applied {
        info!(
            version,
            "the policy cache was read late; running on its policies until the control plane \
             sends policies"
        );
        *next_report = (*next_report).min(Instant::now() + self::interval(shared));
    } else {
        info!(
            version,
            "the policy cache was read late, after newer policies were put in force; they stay"
        );
    }
    applied
}

/// Sessions until cancelled; each applied snapshot's cache bytes go to `cache`.
async fn sessions(
    shared: &Shared,
    config: &StreamConfig,
    cancel: &CancellationToken,
    seed: u64,
    cache: Option<&CacheWriter>,
    mut late: Option<oneshot::Receiver<Cached>>,
) {
    let (min, max) = KEEPALIVE_RANGE;
    let endpoint = config
        .endpoint
        .clone()
        .http2_keep_alive_interval(config.keepalive.0.clamp(min, max))
        .keep_alive_timeout(config.keepalive.1.clamp(min, max))
        .keep_alive_while_idle(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    let mut backoff = config.backoff.clone();
    let mut rng = SeededRng::with_seed(seed.rotate_left(29) ^ 0xA076_1D64_78BD_642F);
    let mut window_start = Instant::now();
    // Outlives the sessions: what one stream left unacknowledged goes out on the next.
    let mut outbox = Outbox::default();
    // So does the report schedule: a report falls due an interval after the last one, whether
    // or not the stream was lost meanwhile, and one that fell due while no stream was up goes
    // out as soon as the next one opens. Counted from each stream's opening, reports would
    // never go out over streams that each last less than the interval.
    let mut next_report = Instant::now() + interval(shared);
    // Why the previous session ended, to say a refused token at warn once, not at every try.
    let mut last_reason: Option<String> = None;
    // Since when no stream has come up (`None` while one is, or was last), and whether that
    // was said at warn.
    let mut unreachable_since: Option<Instant> = None;
    let mut warned_unreachable = false;
    // The number of the stream last opened (`Hello.stream`).
    let mut streams: u64 = 0;
    // Left only when the agent is shut down.
    'sessions: loop {
        streams = streams.saturating_add(1);
        let end = session(
            shared,
            config,
            streams,
            &endpoint,
            cancel,
            cache,
            &mut window_start,
            &mut outbox,
            &mut next_report,
            &mut late,
        )
        .await;
        shared.connected.store(false, Relaxed);
        if let SessionEnd::Reopen = end {
            debug!("reconnecting at once to say the policies in force");
            continue;
        }
        let SessionEnd::Lost {
            up,
            reason,
            code,
            replaced,
        } = end
        else {
            break 'sessions;
        };
        *shared
            .stream_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(StreamError {
            code,
            message: reason.clone(),
        });
        // A stream the control plane ended for its load (RESOURCE_EXHAUSTED: a limit reached,
        // no room for a report) says nothing of a stable connection: the backoff goes on
        // growing, and the report goes again only after it; spread, as such ends come to
        // many agents at once.
        match (up, code) {
            (Some(up), Some(tonic::Code::ResourceExhausted)) => {
                backoff.session_ended_under_load(up);
            }
            (Some(up), _) => backoff.session_ended(up),
            (None, _) => {}
        }
        if replaced {
            // Reconnecting at once would replace the other stream in turn, and the two would
            // push each other off for ever: wait the longest delay, and say why.
            warn!(
                agent = %config.hello.agent_id,
                "another stream with this agent id replaced this one: is the id shared by two \
                 processes? Reconnecting after the longest backoff"
            );
            backoff.back_off_fully();
        }
        // An open stream ended because its secret was dropped (UNAUTHENTICATED; a secret
        // known but refused for this agent id or service is PERMISSION_DENIED) while the file
        // holds another token by now: a rotation done in order, said at info; a refusal of the
        // new token is then warned of as any other. A refusal at a stream's opening is never
        // taken for one: a file flipping between two refused tokens stays warned of.
        let rotated = up.is_some()
            && code == Some(tonic::Code::Unauthenticated)
            && match &config.token {
                Some(source) => source.rotated(cancel).await,
                None => false,
            };
        let delay = backoff.next_delay(&mut rng);
        let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        let same = last_reason.as_deref().map(refusal_of) == Some(refusal_of(&reason));
        match (lasting(code), up) {
            _ if rotated => info!(
                %reason,
                delay_ms,
                "the control plane refused the token this stream was opened with, and the token \
                 file holds another by now (a rotation?): reconnecting with it"
            ),
            // Retrying will not change it: said at warn, once until the reason changes.
            (Some(check), _) if !same => {
                warn!(
                    %reason,
                    delay_ms,
                    check,
                    "the control plane refuses this agent; running on the policies in force and \
                     reconnecting"
                )
            }
            // A stream that was up is lost: an event, said each time.
            (_, Some(_)) => info!(%reason, delay_ms, "control plane stream lost; reconnecting"),
            // No stream came up: said once until the reason changes, not at every try; and
            // at warn once it has lasted `UNREACHABLE_WARN` (a service logging at warn learns
            // that the agent cannot reach its control plane; a routine restart of the control
            // plane is not warned of).
            (None, None) => {
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                let lasted = since.elapsed();
                // A control plane that answers with RESOURCE_EXHAUSTED is reached, and at one
                // of its limits (the reason says which).
                let at_limit = code == Some(tonic::Code::ResourceExhausted);
                if !warned_unreachable && lasted >= UNREACHABLE_WARN {
                    warned_unreachable = true;
                    let what = if at_limit {
                        "the control plane has refused this agent's streams for a while (at one \
                         of its limits)"
                    } else {
                        "the control plane has not been reachable for a while"
                    };
                    warn!(
                        %reason,
                        delay_ms,
                        unreachable_s = lasted.as_secs(),
                        "{what}; running on the policies in force and reconnecting"
                    );
                } else if !same {
                    let what = if at_limit {
                        "the control plane refuses this agent's stream (at one of its limits)"
                    } else {
                        "cannot reach the control plane"
                    };
                    info!(
                        %reason,
                        delay_ms,
                        "{what}; running on the policies in force and reconnecting (said again \
                         when the reason changes)"
                    );
                } else {
                    debug!(%reason, delay_ms, "control plane still not reached; reconnecting");
                }
            }
            _ => debug!(%reason, delay_ms, "control plane still not reached; reconnecting"),
        }
        if up.is_some() {
            unreachable_since = None;
            warned_unreachable = false;
        }
        last_reason = (!rotated).then_some(reason);
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = cancel.cancelled() => break 'sessions,
                () = &mut sleep => break,
                // No stream to tell: the next one's Hello says the version in force.
                Some(cached) = late_cache(&mut late) => {
                    hold_fallback_counts(shared, cached.version(), &mut window_start, &mut outbox);
                    put_late_cache_in_force(shared, cached, &mut next_report);
                }
            }
        }
    }
    shared
        .unacknowledged_at_stop
        .store(outbox.unacknowledged(), Relaxed);
}

/// Whether an answer's head says gRPC (`content-type: application/grpc`, `+proto` or other
/// suffixes included), as the control plane's always does.
fn is_grpc(head: &tonic::metadata::MetadataMap) -> bool {
    head.get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// A reason without how it came (`stream ended: `, `stream refused: `): the same refusal is
/// warned once, whether the control plane ended the open stream with it or refused the next.
fn refusal_of(reason: &str) -> &str {
    reason
        .strip_prefix("stream ended: ")
        .or_else(|| reason.strip_prefix("stream refused: "))
        .unwrap_or(reason)
}

/// What to check when the control plane ended or refused the stream with `code`, for the codes
/// that trying again does not change: the agent's settings (or the control plane's) must.
fn lasting(code: Option<tonic::Code>) -> Option<&'static str> {
    match code? {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => Some(
            "the token the agent is given, and its agent id where the control plane's tokens \
             file names the ids that token may use",
        ),
        tonic::Code::InvalidArgument => Some(
            "the reason: what the agent sends (its Hello's id, service and labels) or a \
             version of the agent the control plane does not understand",
        ),
        tonic::Code::Unimplemented => Some("that the URL is the control plane's agent listener"),
        tonic::Code::AlreadyExists => {
            Some("that the agent id is this agent's own: a stream with another token holds it")
        }
        _ => None,
    }
}

#[allow(
    clippy::too_many_arguments,
    reason = "the session's borrows of the task's state, each named"
)]
async fn session(
    shared: &Shared,
    config: &StreamConfig,
    stream: u64,
    endpoint: &tonic::transport::Endpoint,
    cancel: &CancellationToken,
    cache: Option<&CacheWriter>,
    window_start: &mut Instant,
    outbox: &mut Outbox,
    next_report: &mut Instant,
    late: &mut Option<oneshot::Receiver<Cached>>,
) -> SessionEnd {
    let lost = |up: Option<Duration>, reason: String| SessionEnd::Lost {
        up,
        reason,
        code: None,
        replaced: false,
    };
    // The token first: without one, no connection is made for nothing.
    let token = match &config.token {
        Some(source) => match source.current(cancel).await {
            Ok(token) => Some(token),
            Err(token::NoToken::Cancelled) => return SessionEnd::Cancelled,
            // Tried again after the backoff, the read under way kept.
            Err(token::NoToken::NotRead(reason)) => {
                return lost(
                    None,
                    format!("no agent token to open a stream with: {reason}"),
                );
            }
        },
        None => None,
    };
    // The control plane's bytes and messages, as heard (see `retryplane_proto::liveness`):
    // the data bytes read on the connection (see `counted`), and each whole message.
    let life = Life::new(Instant::now());
    let connecting = endpoint.connect_with_connector(counted::connector(life.clone()));
    tokio::pin!(connecting);
    let channel = loop {
        tokio::select! {
            () = cancel.cancelled() => return SessionEnd::Cancelled,
            c = &mut connecting => break c,
            // The Hello is not made yet: it will say the version in force.
            Some(cached) = late_cache(late) => {
                hold_fallback_counts(shared, cached.version(), window_start, outbox);
                put_late_cache_in_force(shared, cached, next_report);
            }
        }
    };
    let channel = match channel {
        Ok(c) => c,
        Err(e) => return lost(None, format!("cannot connect: {}", chain(&e))),
    };
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(OUTBOUND);
    let mut hello = config.hello.clone();
    // Numbered, so that a Hello that comes late on a connection given up does not push this
    // stream's successor off the control plane.
    hello.stream = stream;
    let current = shared.policies.load();
    if matches!(current.source(), Source::ControlPlane | Source::Cache) {
        hello.last_applied_version = current.version();
        hello.last_applied_hash = current.content_hash().to_owned();
    }
    drop(current);
    if tx.try_send(message(Kind::Hello(hello))).is_err() {
        return lost(None, "cannot queue Hello".into());
    }
    // Sent in pieces of at most 4 KiB: the control plane, which counts the data frames of the
    // stream (its connection may carry other agents' streams, behind a proxy), sees a large
    // report's bytes come on a slow link.
    let channel = tower::ServiceBuilder::new()
        .map_request(|request: http::Request<tonic::body::Body>| {
            request.map(|body| tonic::body::Body::new(Chunked::new(body)))
        })
        .service(channel);
    let mut client = pb::agent_service_client::AgentServiceClient::with_interceptor(
        channel,
        move |mut req: tonic::Request<()>| {
            if let Some(t) = &token {
                req.metadata_mut().insert("authorization", t.clone());
            }
            Ok(req)
        },
    )
    // The limit the control plane keeps every snapshot within (it refuses a larger change).
    .max_decoding_message_size(retryplane_proto::MAX_MESSAGE_BYTES);
    let open = tokio::time::timeout(OPEN_TIMEOUT, client.connect(ReceiverStream::new(rx)));
    tokio::pin!(open);
    let slow = tokio::time::sleep(SLOW_OPEN);
    tokio::pin!(slow);
    let (mut waited_long, mut noted) = (false, false);
    let opened = loop {
        tokio::select! {
            () = cancel.cancelled() => {
                if noted {
                    *shared.stream_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
                }
                return SessionEnd::Cancelled;
            }
            r = &mut open => break r,
            () = &mut slow, if !waited_long => {
                waited_long = true;
                noted = note_slow_open(shared);
            }
        }
    };
    let opened = match opened {
        // tonic hands back an answer that is not gRPC (a web server's 404 at the URL) as an
        // opened stream whose first read fails: it is a refusal, not a stream that was up.
        Ok(Ok(r)) if !is_grpc(r.metadata()) => {
            // What tonic makes of it (`grpc-status header missing, mapped from HTTP status code
            // 404`, or a protocol error on an error page's bytes), within a moment, and not
            // past a shutdown.
            let mut inbound = r.into_inner();
            let said = tokio::select! {
                () = cancel.cancelled() => return SessionEnd::Cancelled,
                r = tokio::time::timeout(NOT_GRPC_READ, inbound.message()) => r,
            };
            let detail = match said {
                Ok(Err(status)) => format!(": {}", status_text(&status)),
                _ => String::new(),
            };
            // Whatever tonic calls it, the URL is not the control plane's agent listener: the
            // code `lasting` names that for.
            return SessionEnd::Lost {
                up: None,
                reason: format!("stream refused: the answer is not gRPC{detail}"),
                code: Some(tonic::Code::Unimplemented),
                replaced: false,
            };
        }
        Ok(Ok(r)) => r,
        Err(_elapsed) => {
            return lost(
                None,
                format!(
                    "the control plane did not answer the stream's opening within {} s",
                    OPEN_TIMEOUT.as_secs()
                ),
            );
        }
        Ok(Err(status)) => {
            return SessionEnd::Lost {
                up: None,
                reason: format!("stream refused: {}", status_text(&status)),
                code: Some(status.code()),
                replaced: false,
            };
        }
    };
    // Reports are numbered, kept and resent only for a control plane that answers them.
    let numbered = opened
        .metadata()
        .get(retryplane_proto::METRICS_ACK_METADATA)
        .is_some_and(|v| v == "1");
    // The control plane's silence ends the stream only when it sends keepalives too. The
    // agent's own go whenever its Hello asked for heartbeats: a control plane that judges the
    // agent's silence must get them even if something on the way dropped this header.
    let sends_keepalives = config.hello.heartbeats;
    let heartbeats = opened
        .metadata()
        .get(HEARTBEAT_METADATA)
        .is_some_and(|v| v == "1");
    life.heard();
    // The control plane's interval, for an agent it sends no snapshot (up to date already):
    // it may be another than the cache file's or an earlier control plane's.
    if let Some(ms) = opened
        .metadata()
        .get(retryplane_proto::METRICS_INTERVAL_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms > 0)
    {
        shared.metrics_interval_ms.store(ms, Relaxed);
        // A report due later than this interval allows comes forward, as after a snapshot.
        *next_report = (*next_report).min(Instant::now() + interval(shared));
    }
    if numbered {
        // Before any new report: what earlier streams left unacknowledged, same seqs.
        if !outbox.resend(&tx) {
            return lost(
                None,
                "cannot queue the unacknowledged metrics reports".into(),
            );
        }
    } else {
        debug!("the control plane does not acknowledge metrics reports; sending them unnumbered");
        shared.between_swaps(|| outbox.give_back(&shared.metrics, version_in_force(shared)));
    }
    let mut inbound = opened.into_inner();
    shared.connected.store(true, Relaxed);
    *shared
        .stream_error
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = None;
    let opened_at = Instant::now();
    let up = || Some(Instant::now().duration_since(opened_at));
    // The control plane's silence: the stream is dead, though its connection may answer
    // keepalive pings (an HTTP/2 proxy between the two answers them).
    let silent = |limit: Duration| {
        warn!(
            silent_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            "nothing came from the control plane, which sends a keepalive every period, for the liveness timeout: taking the stream for dead and reconnecting"
        );
        lost(
            up(),
            format!(
                "nothing came from the control plane for {} ms",
                limit.as_millis()
            ),
        )
    };
    // The last keepalive's time: the next is due a period after it, the period of the interval
    // in force (a snapshot may change it).
    let mut last_keepalive = opened_at;
    // The answers to snapshots while the stream has no room for them: sent as soon as it has,
    // the loop reading on meanwhile (see `unsent`).
    let mut unsent = Unsent::default();
    info!("connected to the control plane");
    loop {
        // The control plane's silence past this ends the stream (with heartbeats).
        let limit = liveness_timeout(interval(shared));
        tokio::select! {
            // In this order: a message that came is read before the silence is judged (after a
            // stall of the task, both may be ready).
            biased;
            () = cancel.cancelled() => {
                let closing = Closing { window_start: *window_start, outbox, numbered };
                closing.run(shared, tx, &mut inbound, unsent).await;
                return SessionEnd::Cancelled;
            }
            // (Owned: a borrowed permit would hold `tx` through every branch.)
            room = tx.clone().reserve_owned(), if !unsent.is_empty() => match room {
                Ok(room) => {
                    if let Some(reply) = unsent.pop() {
                        room.send(reply);
                    }
                }
                Err(_) => return lost(up(), "the stream closed before the answer".into()),
            },
            m = inbound.message() => {
                let m = match m {
                    Ok(Some(m)) => m,
                    Ok(None) => return lost(up(), "the control plane closed the stream".into()),
                    Err(status) => return ended(up(), &status),
                };
                life.heard();
                if m.keepalive.is_some() {
                    continue;
                }
                if let Some(ack) = m.metrics_ack {
                    // The version read and the refused counts put back with no swap in
                    // between (`Agent::set_policies` would credit them to its own version).
                    shared.between_swaps(|| {
                        outbox.ack(&shared.metrics, ack.seq, ack.dropped, version_in_force(shared));
                    });
                    continue;
                }
                let handled = match apply::too_many_on_the_wire(&m) {
                    Some(refused) => refused,
                    None => match m.decode_snapshot() {
                    Ok(Some(snap)) => {
                        // The counts so far were made under the policies in force: reported
                        // under their version as the new ones replace them (not before they
                        // are checked and built: calls on other threads go on meanwhile).
                        let version = snap.version;
                        let encoded = m.snapshot.as_deref();
                        apply::apply(shared, snap, encoded, config.default_metrics_interval, |current| {
                            if current.version() != version {
                                send_or_hold(shared, &tx, window_start, outbox, numbered);
                            }
                        })
                    }
                    Ok(None) => {
                        debug!("server message without a snapshot ignored");
                        continue;
                    }
                    Err(e) => match m.snapshot_version_and_nonce() {
                        // NACKed like an invalid one, when it says what it is.
                        Some((version, nonce)) => apply::undecodable(version, nonce, &e),
                        None => {
                            warn!(error = %e, "undecodable snapshot ignored; keeping the policies in force");
                            continue;
                        }
                    },
                    },
                };
                // A refusal is kept for `Agent::last_refusal` until a snapshot is applied.
                *shared
                    .last_refusal
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = match &handled.reply {
                    Kind::Nack(nack) => Some(crate::error::Refusal {
                        version: nack.version,
                        error: nack.error.clone(),
                    }),
                    _ => None,
                };
                // Cached before it is answered, unless the disk takes longer than
                // `CACHE_WAIT`: a hung disk holds up neither the answer nor the reports for
                // longer.
                let reply = message(handled.reply);
                if let (Some(bytes), Some(cache)) = (handled.cache, cache) {
                    let write = cache.write(bytes);
                    tokio::select! {
                        () = cancel.cancelled() => {
                            // The snapshot is applied: answered before the stream closes, in
                            // place of the answers that wait, which it supersedes (see
                            // `unsent`).
                            unsent.push(reply);
                            let closing = Closing { window_start: *window_start, outbox, numbered };
                            closing.run(shared, tx, &mut inbound, unsent).await;
                            return SessionEnd::Cancelled;
                        }
                        cached = cache.written(write, CACHE_WAIT) => if !cached {
                            warn!(
                                wait_ms = u64::try_from(CACHE_WAIT.as_millis()).unwrap_or(u64::MAX),
                                "the policy cache file is slow to write; answering the control \
                                 plane without waiting for it any longer"
                            );
                        },
                    }
                }
                // Queued now if the stream has room, else kept (see `unsent`).
                if unsent.is_empty() {
                    match tx.try_send(reply) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full(reply)) => unsent.push(reply),
                        Err(mpsc::error::TrySendError::Closed(_)) => {
                            return lost(up(), "the stream closed before the answer".into());
                        }
                    }
                } else {
                    unsent.push(reply);
                }
                *next_report = (*next_report).min(Instant::now() + interval(shared));
            }
            () = tokio::time::sleep_until(*next_report) => {
                send_metrics(shared, &tx, window_start, outbox, numbered);
                *next_report = Instant::now() + interval(shared);
            }
            () = life.silent(limit), if heartbeats => return silent(limit),
            () = tokio::time::sleep_until(last_keepalive + keepalive_period(interval(shared))), if sends_keepalives => {
                // Only when nothing waits to go: what waits carries the stream's life already
                // (and a keepalive must not take the room an answer needs).
                if tx.capacity() == tx.max_capacity() {
                    let _ = tx.try_send(message(Kind::Keepalive(pb::Keepalive {})));
                }
                last_keepalive = Instant::now();
            }
            Some(cached) = late_cache(late) => {
                // The counts so far were made on the fallback policy: reported under its
                // version before the cache can replace it (calls that outlive it count apart
                // from the announcement on, as for a push).
                if shared.policies.load().source() == Source::Fallback {
                    shared.announce(cached.version());
                    send_or_hold(shared, &tx, window_start, outbox, numbered);
                    *next_report = Instant::now() + interval(shared);
                }
                if put_late_cache_in_force(shared, cached, next_report) {
                    // The control plane knows the agent by its Hello, which said the fallback.
                    half_close(shared, tx, &mut inbound, outbox, Instant::now() + CLOSE_GRACE)
                        .await;
                    return SessionEnd::Reopen;
                }
            }
        }
    }
}

/// Shutdown on an open stream: the answers that wait for room (see `unsent`), then the last
/// report (in as many parts as its counts need, past a full window), each waiting for room,
/// all within one [`CLOSE_GRACE`] (a stream left with no room is given until its end to make
/// some); the half-close; then, if any of it found room (or the stream has room: what it
/// carried before may still be on its way), a wait for the control plane to read it and close
/// its side, taking the acks that come meanwhile, until one grace after the last room found at
/// most. A control plane that takes nothing holds shutdown up one grace; one that is slow but
/// reading, two at most.
struct Closing<'a> {
    /// The start of the counts not reported yet.
    window_start: Instant,
    outbox: &'a mut Outbox,
    numbered: bool,
}

impl Closing<'_> {
    async fn run(
        self,
        shared: &Shared,
        tx: mpsc::Sender<pb::AgentMessage>,
        inbound: &mut tonic::Streaming<pb::ServerMessage>,
        mut unsent: Unsent,
    ) {
        let deadline = Instant::now() + CLOSE_GRACE;
        // When a message last found room: the half-close waits a grace from then at most for
        // the server to read it and close its side.
        let mut found_room: Option<Instant> = None;
        let answered = tokio::time::timeout_at(deadline, async {
            while let Some(reply) = unsent.pop() {
                if tx.send(reply).await.is_err() {
                    return false;
                }
                found_room = Some(Instant::now());
            }
            true
        })
        .await
        .unwrap_or(false);
        self.outbox.closing();
        // Past the grace (answers that found no room): only what finds room at once. (No later
        // report: the window's start is not moved on.)
        let queued = self
            .outbox
            .send_by(
                &shared.metrics,
                &tx,
                self.numbered,
                if answered { deadline } else { Instant::now() },
                |f| shared.between_swaps(f),
                || report_fill(shared, window(self.window_start).0),
            )
            .await;
        found_room = found_room.max(queued.last_at);
        // What the stream carried before the shutdown (an answer and the report of a swap
        // just before it) may still be on its way: dropping the stream at once could reset it
        // with those messages unsent. A stream with no room at all is first given until the
        // grace's end to make some, as for a report (a close that had nothing of its own has
        // not waited yet); room now counts as room found now. A control plane that takes
        // nothing has then had its one grace: the half-close waits a grace from the last room
        // found, not from the end of the close's own wait (a report's first part that took
        // the one free slot, its second waiting the grace out, held shutdown two).
        if tx.capacity() == 0 {
            let _ = tokio::time::timeout_at(deadline, tx.reserve()).await;
        }
        if tx.capacity() > 0 {
            found_room = Some(Instant::now());
        }
        let until = found_room.map_or_else(Instant::now, |at| at + CLOSE_GRACE);
        half_close(shared, tx, inbound, self.outbox, until).await;
    }
}

/// Half-closes the stream, then waits until `deadline` at most for the server to read what was
/// queued and close its side, taking the acks that come meanwhile.
async fn half_close(
    shared: &Shared,
    tx: mpsc::Sender<pb::AgentMessage>,
    inbound: &mut tonic::Streaming<pb::ServerMessage>,
    outbox: &mut Outbox,
    deadline: Instant,
) {
    drop(tx);
    let _ = tokio::time::timeout_at(deadline, async {
        while let Ok(Some(m)) = inbound.message().await {
            if let Some(ack) = m.metrics_ack {
                shared.between_swaps(|| {
                    outbox.ack(
                        &shared.metrics,
                        ack.seq,
                        ack.dropped,
                        version_in_force(shared),
                    );
                });
            }
        }
    })
    .await;
}

fn message(kind: Kind) -> pb::AgentMessage {
    pb::AgentMessage { kind: Some(kind) }
}

/// The metrics interval in force, within [`MIN_METRICS_INTERVAL`, `MAX_METRICS_INTERVAL`]
/// whatever set it.
fn interval(shared: &Shared) -> Duration {
    Duration::from_millis(shared.metrics_interval_ms.load(Relaxed))
        .clamp(MIN_METRICS_INTERVAL, MAX_METRICS_INTERVAL)
}

/// Fills in a report of the counts made from `start` to `end` (Unix ms, see [`window`]) under
/// the policies in force now (read once: every part of the report says the same version,
/// however late it is filled in).
fn report_fill(shared: &Shared, (start, end): (u64, u64)) -> impl FnMut(&mut pb::MetricsReport) {
    let version = version_in_force(shared);
    move |report| {
        report.window_start_unix_ms = start;
        report.window_end_unix_ms = end;
        report.policy_version = version;
    }
}

/// The version of the policies in force.
fn version_in_force(shared: &Shared) -> u64 {
    shared.policies.load().version()
}

/// With no stream up, as a cache read late (of `version`) is about to replace the fallback
/// policies: the counts made on them are held as a report of their version (see
/// [`Outbox::hold`]), to go out on the next stream before the counts made on the cache's.
fn hold_fallback_counts(
    shared: &Shared,
    version: u64,
    window_start: &mut Instant,
    outbox: &mut Outbox,
) {
    // With no swap in between (`Agent::set_policies` on another thread): the policies it
    // sets would otherwise be counted under the cache's version until the next swap.
    shared.between_swaps(|| {
        if shared.policies.load().source() == Source::Fallback {
            shared.announce(version);
            hold_counts(shared, window(*window_start), window_start, outbox);
        }
    });
}

/// Holds the counts in the counters as a report of the version in force over `bounds` (see
/// [`Outbox::hold`]); the next report's counts start at `end`.
fn hold_counts(
    shared: &Shared,
    (bounds, end): ((u64, u64), Instant),
    window_start: &mut Instant,
    outbox: &mut Outbox,
) {
    outbox.hold(&shared.metrics, report_fill(shared, bounds));
    *window_start = end;
}

/// [`send_metrics`] as the policies in force are about to be replaced: every count in the
/// counters was made under them, and what cannot go out now (a full window, a stream without
/// room, the parts of large counts past either) is held as a report of their version (see
/// [`Outbox::hold`]), not left in the counters, where the next report would credit it to the
/// new version.
fn send_or_hold(
    shared: &Shared,
    tx: &mpsc::Sender<pb::AgentMessage>,
    window_start: &mut Instant,
    outbox: &mut Outbox,
    numbered: bool,
) {
    let span = window(*window_start);
    let _ = outbox.send(&shared.metrics, tx, numbered, report_fill(shared, span.0));
    hold_counts(shared, span, window_start, outbox);
}

/// Hands the counter deltas to the stream as the next report: numbered and kept in `outbox`
/// until acknowledged when `numbered`. While the outbox is full (until shutdown), or when the
/// stream cannot take the report, the counts stay in (or go back into) the counters for a later
/// report.
fn send_metrics(
    shared: &Shared,
    tx: &mpsc::Sender<pb::AgentMessage>,
    window_start: &mut Instant,
    outbox: &mut Outbox,
    numbered: bool,
) {
    shared.forget_unheld();
    let (bounds, end) = window(*window_start);
    let sent = shared
        .between_swaps(|| outbox.send(&shared.metrics, tx, numbered, report_fill(shared, bounds)));
    match sent {
        // Nothing counted since `start` either: the next report's counts are all made after
        // `end`, and its span says so (the control plane spreads the counts of a report that
        // spans more than two intervals over that time).
        Ok(_) | Err(NotSent::Empty) => *window_start = end,
        Err(NotSent::WindowFull) => {
            debug!("metrics reports await acknowledgement; counts kept for a later one");
        }
        Err(NotSent::StreamFull) => {
            debug!("metrics report not queued; counts kept for the next one");
        }
    }
}

/// The bounds (Unix ms) of a report of the counts made since `since`, and the instant it ends:
/// its end is the wall clock now, its start that less the time gone by since `since` on the
/// monotonic clock. The control plane spreads a report's counts over its span: a step of the
/// wall clock (an NTP correction, a resumed VM) must not stretch the span (a step forward by
/// an hour spread a burst of calls over that hour, out of the 1 and 5 minute windows) or
/// shrink it.
fn window(since: Instant) -> ((u64, u64), Instant) {
    let now = Instant::now();
    let end = unix_ms();
    let span = u64::try_from(now.saturating_duration_since(since).as_millis()).unwrap_or(u64::MAX);
    ((end.saturating_sub(span), end), now)
}

/// Wall-clock Unix milliseconds, for the report window labels only.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Agent;
    use crate::metrics::Counters;

    #[tokio::test(start_paused = true)]
    async fn a_reports_span_is_the_time_gone_by_on_the_monotonic_clock_not_the_wall_clocks() {
        // The paused clock moves 90 s in no wall-clock time: a span read from the wall clock
        // would be about zero (and one across a wall-clock step, that step).
        let since = Instant::now();
        tokio::time::advance(Duration::from_secs(90)).await;
        let ((start, end), at) = window(since);
        assert_eq!(end - start, 90_000);
        assert_eq!(at, since + Duration::from_secs(90));
        assert!(
            end.abs_diff(unix_ms()) < 60_000,
            "the end is the wall clock now"
        );
    }

    #[test]
    fn a_status_without_a_message_is_named_by_its_code_alone() {
        let SessionEnd::Lost { reason, .. } = ended(None, &tonic::Status::unimplemented("")) else {
            panic!("not lost");
        };
        assert_eq!(reason, "stream ended: UNIMPLEMENTED");
        assert_eq!(
            status_text(&tonic::Status::unauthenticated("unknown token")),
            "UNAUTHENTICATED: unknown token"
        );
    }

    #[test]
    fn a_cause_the_status_message_ends_with_is_said_once() {
        // As tonic makes a status of a body error when the control plane dies mid-stream: its
        // message ends with the first cause's text, which `chain` starts with.
        #[derive(Debug)]
        struct Cause(&'static str, Option<Box<Cause>>);
        impl std::fmt::Display for Cause {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Cause {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1
                    .as_deref()
                    .map(|c| c as &(dyn std::error::Error + 'static))
            }
        }
        let cause = Cause(
            "error reading a body from connection",
            Some(Box::new(Cause(
                "stream closed because of a broken pipe",
                None,
            ))),
        );
        let mut status =
            tonic::Status::unknown("h2 protocol error: error reading a body from connection");
        status.set_source(std::sync::Arc::new(cause));
        assert_eq!(
            status_text(&status),
            "UNKNOWN: h2 protocol error: error reading a body from connection: stream closed because of a broken pipe"
        );
    }

    #[test]
    fn a_stream_replaced_by_the_same_agent_id_is_told_apart() {
        let replaced = tonic::Status::aborted("replaced by a newer stream with the same agent id");
        let SessionEnd::Lost {
            replaced: true,
            reason,
            ..
        } = ended(None, &replaced)
        else {
            panic!("not told apart");
        };
        assert!(reason.contains("replaced by a newer stream"), "{reason}");
        let shutdown = tonic::Status::unavailable("control plane shutting down; reconnect");
        assert!(matches!(
            ended(None, &shutdown),
            SessionEnd::Lost {
                replaced: false,
                ..
            }
        ));
    }

    fn agent() -> Agent {
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  a: {}\n")
            .policies
            .unwrap();
        Agent::from_policies_seeded(set, 1)
    }

    fn count_calls(shared: &Shared, n: u64) {
        let c = shared.metrics.counters(&Arc::from("a"));
        for _ in 0..n {
            Counters::inc(&c.calls);
        }
    }

    #[test]
    fn the_metrics_interval_is_bounded_whatever_set_it() {
        let agent = agent();
        let shared = agent.shared();
        for (ms, bounded) in [
            (0, MIN_METRICS_INTERVAL),
            (1, MIN_METRICS_INTERVAL),
            (250, Duration::from_millis(250)),
            (u64::MAX, MAX_METRICS_INTERVAL),
        ] {
            shared.metrics_interval_ms.store(ms, Relaxed);
            assert_eq!(interval(shared), bounded, "{ms} ms");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_report_the_stream_cannot_take_is_kept_for_the_next_one() {
        let agent = agent();
        let shared = agent.shared();
        count_calls(shared, 3);
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        let began = Instant::now();
        let mut start = began;
        let mut outbox = Outbox::default();
        send_metrics(shared, &tx, &mut start, &mut outbox, true);
        assert_eq!(
            shared.metrics.pending("a").calls,
            3,
            "closed stream: counts kept"
        );

        let (tx, mut rx) = mpsc::channel(1);
        tx.try_send(message(Kind::Ack(pb::Ack::default()))).unwrap();
        send_metrics(shared, &tx, &mut start, &mut outbox, true);
        assert_eq!(
            shared.metrics.pending("a").calls,
            3,
            "full stream: counts kept"
        );

        rx.recv().await.unwrap();
        count_calls(shared, 2);
        tokio::time::advance(Duration::from_secs(5)).await;
        send_metrics(shared, &tx, &mut start, &mut outbox, true);
        assert_eq!(shared.metrics.pending("a").calls, 0);
        let Some(Kind::Metrics(report)) = rx.recv().await.unwrap().kind else {
            panic!("a metrics report");
        };
        assert_eq!(report.endpoints[0].calls, 5, "sent once, all of them");
        assert_eq!(report.seq, 1, "the reports not queued used no seq");
        let span = report.window_end_unix_ms - report.window_start_unix_ms;
        assert_eq!(
            span, 5_000,
            "the counts not sent before are in this report's span"
        );
        assert_eq!(
            start,
            began + Duration::from_secs(5),
            "the next window starts where this one ended"
        );
    }

    /// A cache read late is about to replace the fallback policies (their counts held, the
    /// cache's version announced) when the program sets its own policies on another thread:
    /// whichever way the two interleave, the late cache is not put in force and calls count
    /// under the version of the policies in force (before: set between the stream task's check
    /// for the fallback and its announcement, they were counted under the cache's version
    /// until the next swap, every call as one that outlived its version).
    #[test]
    fn policies_set_before_a_late_cache_goes_in_force_are_counted_under_their_own_version() {
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  a: {}\n")
            .policies
            .unwrap();
        let agent = agent();
        let shared = agent.shared();
        shared.update_policies(|_| crate::snapshot::PolicySnapshot::fallback());
        // The stream task found the fallback in force; the program's thread sets its policies
        // (and the swap announces their version 0); then the stream task announces the cache's.
        agent.set_policies(set.clone());
        shared.announce(9);
        let mut next_report = Instant::now();
        assert!(!put_late_cache_in_force(
            shared,
            crate::cache::Cached::for_test(set, 9),
            &mut next_report
        ));
        assert_eq!(agent.policies().source(), Source::Static);
        assert_eq!(shared.version_in_force(), 0);
        // The check and the announcement are now one step no swap comes between.
        let mut window_start = Instant::now();
        let mut outbox = Outbox::default();
        hold_fallback_counts(shared, 9, &mut window_start, &mut outbox);
        assert_eq!(
            shared.version_in_force(),
            0,
            "not the fallback: nothing announced"
        );
    }

    /// `Agent::set_policies` on an agent of a control plane runs on the program's thread, the
    /// reports on the stream task: a report reads the version in force as it is filled in and
    /// then takes the counters. A swap in between (the stream task's thread descheduled there)
    /// had whole calls made on the policies set after it go out under the pushed version (6
    /// calls of version 0 under 4, about one loaded run in twenty of a stress test). A
    /// report now holds swaps off from the one to the other (`Shared::between_swaps`, as
    /// `send_metrics` takes it): `set_policies` waits for it, and the calls made on its
    /// policies go out under their version in the next report.
    #[tokio::test]
    async fn set_policies_waits_for_a_report_between_its_reading_of_the_version_and_its_taking_of_the_counts()
     {
        let agent = agent_on_4();
        let shared = agent.shared();
        let ok = |_| async { Ok::<_, std::io::Error>(http::Response::new(())) };
        let ep = agent.endpoint("a");
        ep.call(crate::CallMeta::http("GET", "/"), ok)
            .await
            .unwrap();
        let (tx, mut rx) = mpsc::channel(8);
        let mut outbox = Outbox::default();
        let (bounds, _) = window(Instant::now());
        let setter = shared.between_swaps(|| {
            // The stream task reads the version as it fills the report in...
            let fill = report_fill(shared, bounds);
            // ... the program's thread sets its policies meanwhile...
            let setter = std::thread::spawn({
                let agent = agent.clone();
                move || agent.set_policies(policies_for_a(3))
            });
            // ... and does not get through (a swap takes microseconds: without the hold it
            // was through within these turns)...
            for _ in 0..20_000 {
                assert!(
                    !setter.is_finished(),
                    "set_policies swapped inside a report"
                );
                std::thread::yield_now();
            }
            assert_eq!(agent.policies().version(), 4);
            // ... until the stream task has taken the counts.
            assert!(outbox.send(&shared.metrics, &tx, true, fill).is_ok());
            setter
        });
        setter.join().unwrap();
        assert_eq!(agent.policies().version(), 0);
        ep.call(crate::CallMeta::http("GET", "/"), ok)
            .await
            .unwrap();
        let (bounds, _) = window(Instant::now());
        assert!(
            outbox
                .send(&shared.metrics, &tx, true, report_fill(shared, bounds))
                .is_ok()
        );
        let mut calls_by_version = std::collections::BTreeMap::new();
        while let Ok(m) = rx.try_recv() {
            let Some(Kind::Metrics(r)) = m.kind else {
                panic!("a metrics report");
            };
            *calls_by_version.entry(r.policy_version).or_insert(0) +=
                r.endpoints.iter().map(|e| e.calls).sum::<u64>();
        }
        assert_eq!(
            calls_by_version,
            [(0, 1), (4, 1)].into_iter().collect(),
            "version -> calls: one call on the pushed version 4, one on the policies set after"
        );
    }

    /// A set of policies for endpoint `a`, `n` attempts.
    fn policies_for_a(n: u32) -> retryplane_policy::PolicySet {
        let yaml = format!("version: 1\nendpoints:\n  a: {{max_attempts: {n}}}\n");
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
    }

    /// An agent whose policies in force were pushed as version 4.
    fn agent_on_4() -> Agent {
        let agent = agent();
        agent.shared().update_policies(|current| {
            crate::snapshot::PolicySnapshot::build(
                policies_for_a(2),
                4,
                String::new(),
                Source::ControlPlane,
                Some(current),
            )
        });
        agent
    }

    /// version -> calls of the metrics reports queued on `rx`.
    fn calls_by_version(
        rx: &mut mpsc::Receiver<pb::AgentMessage>,
    ) -> std::collections::BTreeMap<u64, u64> {
        let mut by_version = std::collections::BTreeMap::new();
        while let Ok(m) = rx.try_recv() {
            if let Some(Kind::Metrics(r)) = m.kind {
                *by_version.entry(r.policy_version).or_insert(0) +=
                    r.endpoints.iter().map(|e| e.calls).sum::<u64>();
            }
        }
        by_version
    }

    /// An ack of a refused report reads the version in force and puts the refused counts back
    /// as that version's. `Agent::set_policies` on another thread between the two (it moves
    /// version 4's counts aside, then swaps) had the refused counts of version 4 put into the
    /// counters, which the next report credited to version 0 (seen in review). The ack now
    /// holds swaps off from the one to the other, as the stream loop takes it: `set_policies`
    /// waits for it.
    #[tokio::test]
    async fn set_policies_waits_for_an_ack_putting_a_refused_reports_counts_back() {
        let agent = agent_on_4();
        let shared = agent.shared();
        let ok = |_| async { Ok::<_, std::io::Error>(http::Response::new(())) };
        let ep = agent.endpoint("a");
        ep.call(crate::CallMeta::http("GET", "/"), ok)
            .await
            .unwrap();
        let (tx, mut rx) = mpsc::channel(8);
        let mut outbox = Outbox::default();
        let (bounds, _) = window(Instant::now());
        assert_eq!(
            outbox.send(&shared.metrics, &tx, true, report_fill(shared, bounds)),
            Ok(1)
        );
        assert_eq!(calls_by_version(&mut rx), [(4, 1)].into_iter().collect());
        // The control plane refuses report 1; the program's thread sets its policies as the
        // ack is taken.
        let setter = shared.between_swaps(|| {
            let current = version_in_force(shared);
            let setter = std::thread::spawn({
                let agent = agent.clone();
                move || agent.set_policies(policies_for_a(3))
            });
            // A swap takes microseconds: without the hold it was through within these turns.
            for _ in 0..20_000 {
                assert!(!setter.is_finished(), "set_policies swapped inside an ack");
                std::thread::yield_now();
            }
            outbox.ack(&shared.metrics, 1, true, current);
            setter
        });
        setter.join().unwrap();
        assert_eq!(agent.policies().version(), 0);
        let (bounds, _) = window(Instant::now());
        let _ = outbox.send(&shared.metrics, &tx, true, report_fill(shared, bounds));
        assert_eq!(
            calls_by_version(&mut rx),
            [(4, 1)].into_iter().collect(),
            "version -> calls: the refused call was made on version 4"
        );
    }

    /// The shutdown report (`Closing::run` -> `Outbox::send_by`) waits for room on the
    /// stream for each held report before it takes the counters. It read the version before
    /// that wait, and took the counts of calls that outlived their version only then:
    /// `Agent::set_policies` during the wait (up to `CLOSE_GRACE`) moved version 4's counts
    /// aside, never reported, and the calls made on its policies (version 0) went out under
    /// version 4 (seen in review). Both are read as the counters are taken now.
    #[tokio::test]
    async fn policies_set_while_the_shutdown_report_waits_for_room_are_reported_under_their_version()
     {
        let agent = agent_on_4();
        let shared = agent.shared();
        let ok = |_| async { Ok::<_, std::io::Error>(http::Response::new(())) };
        let ep = agent.endpoint("a");
        let mut outbox = Outbox::default();
        // One report held from before (version 3), so that send_by waits before the counters.
        count_calls(shared, 1);
        outbox.hold(&shared.metrics, |r| r.policy_version = 3);
        ep.call(crate::CallMeta::http("GET", "/"), ok)
            .await
            .unwrap();
        let (tx, mut rx) = mpsc::channel(8);
        for _ in 0..8 {
            tx.try_send(message(Kind::Metrics(pb::MetricsReport::default())))
                .unwrap();
        }
        outbox.closing();
        let (bounds, _) = window(Instant::now());
        let deadline = Instant::now() + Duration::from_secs(10);
        {
            let mut fut = std::pin::pin!(outbox.send_by(
                &shared.metrics,
                &tx,
                true,
                deadline,
                |f| shared.between_swaps(f),
                || report_fill(shared, bounds),
            ));
            let pending = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(fut.as_mut().poll(cx).is_pending())
            })
            .await;
            assert!(pending, "send_by waits for room for the held report");
            // The program sets its policies and calls on them while shutdown waits.
            agent.set_policies(policies_for_a(3));
            ep.call(crate::CallMeta::http("GET", "/"), ok)
                .await
                .unwrap();
            for _ in 0..8 {
                rx.try_recv().unwrap();
            }
            fut.await;
        }
        let sent = calls_by_version(&mut rx);
        assert_eq!(
            sent,
            [(0, 1), (3, 1), (4, 1)].into_iter().collect(),
            "version -> calls: one on 3 (held), one on 4 (before shutdown), one on 0 (set \
             during it)"
        );
    }
}
