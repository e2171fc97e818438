//! The agent stream service (SPEC §3): Hello first, a Snapshot whenever the agent is behind,
//! ACK/NACK recorded by nonce, metrics reports taken at a bounded rate.
//!
//! A numbered report (`seq` > 0) is answered with a `MetricsAck`: counted now, or already
//! counted (a report sent again after a lost stream: acknowledged, counted once, and counted in
//! `retryplane_server_reports_duplicate`), or refused by the rate limit (`dropped`, nothing
//! counted, so the agent sends the counts again later under a new seq; the refused seq stays
//! refused). Which reports were counted or refused is kept in the agent's [`Fleet`] entry,
//! shared by every stream of the agent id ([`crate::report_seq`]). A report with seq 0, or from
//! an agent whose Hello gave no instance id, is counted as it comes, unanswered.
//!
//! One task per stream owns its state; it wakes on a new publish, on the agent's next message,
//! when a newer stream replaces it, when a tokens reload takes its secret away, or at
//! shutdown; and, for an agent that sends heartbeats (`Hello.heartbeats`), every keepalive
//! period to send a `Keepalive` when nothing waits to go, and when the agent has been silent
//! for the liveness timeout, which ends the stream ([`retryplane_proto::liveness`]: behind an
//! HTTP/2 proxy, which answers keepalive pings for the agent, nothing else tells that it has
//! gone).
//!
//! The outbound side is not tonic's encoder: the task sends the publisher's shared, pre-framed
//! snapshot bytes (and each ack, framed by [`encode_frame`]) to the stream's
//! [`crate::frame_body::SharedFrameBody`], and
//! [`crate::agent_route`] serves the `Connect` route (see there for why).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use retryplane_policy::diag::LogValue;
use retryplane_proto::liveness::{Life, keepalive_period, liveness_timeout};
use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;
use tonic::{Request, Status};
use tracing::{debug, info, warn};

use crate::aggregate::{Aggregator, ServiceHandle};
use crate::auth::{Credential, TokenName, TokenSet, Tokens};
use crate::fleet::{Fleet, RegisterError, ReportBucket, StreamToken};
use crate::frame_body::{Outbound, encode_frame};
use crate::metrics::ServerMetrics;
use crate::publisher::Publisher;
use crate::report_seq::ReportVerdict;

/// The default of [`StreamLimits::max_pending_handshakes`]: enough for a fleet reconnecting at
/// once (a handshake takes one round trip), small enough that streams which never say Hello
/// cannot pile up.
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 1024;

/// Bounds on what one stream may do.
#[derive(Clone, Debug)]
pub struct StreamLimits {
    /// How long a new stream may take to send Hello.
    pub hello_timeout: Duration,
    /// Metrics reports accepted per second per agent id, on average, across its streams, so a
    /// reconnect does not start a new burst (see
    /// [`StreamLimits::for_metrics_interval`]); a report past the limit is dropped and counted
    /// in `retryplane_server_reports_dropped` (a numbered one is acknowledged as dropped, so
    /// its agent sends the counts again).
    pub reports_per_second: f64,
    /// Reports accepted in a burst.
    pub report_burst: f64,
    /// Longest agent id, service name, label key or value.
    pub max_field_len: usize,
    /// Most labels on one agent.
    pub max_labels: usize,
    /// Most streams waiting for their Hello at once; a stream past it is refused with
    /// `RESOURCE_EXHAUSTED` at once. Registered agents do not count.
    pub max_pending_handshakes: usize,
    /// How long a stream may wait to send while the answers to its agent's metrics reports
    /// pile up: past it, at the agent's next report with 64 answers waiting, the stream ends
    /// with `RESOURCE_EXHAUSTED` (and, whatever the time, once 1,024 wait).
    pub unread_for: Duration,
    /// Most bytes of agents' messages under way (come in part, in more than one frame) the
    /// control plane holds at once, over all agent streams; one agent token holds at most
    /// all but a quarter of them. A message whose next bytes find no room ends its stream
    /// with `RESOURCE_EXHAUSTED` (see [`crate::inbound::Room`]). Default
    /// [`crate::inbound::DEFAULT_MAX_INBOUND_BYTES`] (256 MiB); at least the largest message
    /// an agent stream takes.
    pub max_inbound_bytes: usize,
}

impl StreamLimits {
    /// These limits, with the report rate raised to at least twice the rate agents report at
    /// when they follow `metrics_interval` (the interval the server sends in every snapshot),
    /// so an agent that reports on the interval it was given is never limited: a dropped report
    /// without a seq loses its counts (a numbered one is acknowledged as dropped and its counts
    /// come back in a later report). The limit is there for agents that report far faster.
    #[must_use]
    pub fn for_metrics_interval(mut self, metrics_interval: Duration) -> Self {
        let secs = metrics_interval.as_secs_f64();
        if secs > 0.0 {
            self.reports_per_second = self.reports_per_second.max(2.0 / secs);
        }
        self
    }
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            hello_timeout: Duration::from_secs(10),
            reports_per_second: 2.0,
            report_burst: 10.0,
            max_field_len: retryplane_proto::MAX_HELLO_FIELD_BYTES,
            max_labels: retryplane_proto::MAX_HELLO_LABELS,
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
            unread_for: Duration::from_secs(30),
            max_inbound_bytes: crate::inbound::DEFAULT_MAX_INBOUND_BYTES,
        }
    }
}

/// What the agent service needs from the server.
#[derive(Debug)]
pub struct StreamContext {
    /// The current snapshot.
    pub publisher: Arc<Publisher>,
    /// Connected agents.
    pub fleet: Arc<Fleet>,
    /// Server figures.
    pub metrics: Arc<ServerMetrics>,
    /// Aggregated agent metrics.
    pub aggregates: Arc<Aggregator>,
    /// Per-stream bounds.
    pub limits: StreamLimits,
    /// Becomes true when the server shuts down.
    pub shutdown: watch::Receiver<bool>,
    /// The tokens in force, when there is a tokens file: a reload that takes a stream's secret
    /// away ends the stream.
    pub tokens: Option<Arc<TokenSet>>,
    /// Run after a stream is registered, before its task starts: a publish that lands between.
    #[cfg(test)]
    pub after_register: Option<Hook>,
}

/// A test's code run at one point of the handshake.
#[cfg(test)]
#[derive(Clone)]
pub struct Hook(pub Arc<dyn Fn() + Send + Sync>);

#[cfg(test)]
impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

/// The `retryplane.v1.AgentService` implementation.
#[derive(Clone, Debug)]
pub struct AgentStreamService {
    ctx: Arc<StreamContext>,
    /// One permit per stream waiting for its Hello ([`StreamLimits::max_pending_handshakes`]).
    handshakes: Arc<Semaphore>,
    /// Streams waiting for their Hello per token (by the digest of its secret), counted for
    /// every token: at most twice its `max_agents`, and with other agent tokens at most
    /// [`token_share`] of the places, so
    /// that no one token (its agents reconnecting at once, or streams opened and left without
    /// a Hello) can hold every handshake place and keep other tokens' agents out.
    pending_by_token: Arc<Mutex<HashMap<[u8; 32], usize>>>,
}

impl AgentStreamService {
    /// The metrics interval agents are to report at, in milliseconds (sent in every snapshot,
    /// and in the `Connect` response's metadata).
    pub fn metrics_interval_ms(&self) -> u64 {
        self.ctx.publisher.metrics_interval_ms()
    }

    /// The limits its streams keep, and the counts of their room for messages under way.
    pub(crate) fn inbound_limits(&self) -> (&StreamLimits, &crate::inbound::RoomCounts) {
        (&self.ctx.limits, &self.ctx.metrics.inbound)
    }

    /// A service over `ctx`.
    pub fn new(ctx: Arc<StreamContext>) -> Self {
        let pending = ctx
            .limits
            .max_pending_handshakes
            .min(Semaphore::MAX_PERMITS);
        Self {
            ctx,
            handshakes: Arc::new(Semaphore::new(pending)),
            pending_by_token: Arc::default(),
        }
    }
}

/// The handshake places one agent token may hold beside other agent tokens, of `all`: all but
/// a quarter, rounded up (768 of 1,024; 2 of 3), so that a quarter is always left to the others
/// (at least one place is a token's, so with one place in all none is left).
fn token_share(all: usize) -> usize {
    (all - all.div_ceil(4)).max(1)
}

/// What bounds a token's streams waiting for their Hello.
#[derive(Clone, Copy, Debug)]
enum PlacesBy {
    /// Twice its `max_agents`.
    MaxAgents(usize),
    /// Its share ([`token_share`]) of all the places.
    Share(usize),
}

impl PlacesBy {
    /// The refusal of a stream past `places` of its token's streams waiting.
    fn refusal(self, places: usize) -> String {
        let waiting = if places == 1 {
            "1 stream of this token already waits".to_owned()
        } else {
            format!("{places} streams of this token already wait")
        };
        match self {
            PlacesBy::MaxAgents(limit) => format!(
                "{waiting} to send Hello, twice its `max_agents` ({limit}) in the control \
                 plane's tokens file; retry later"
            ),
            // Reached with 2 places or more: with one, the control plane's own bound refuses
            // first.
            PlacesBy::Share(all) => {
                let kept = all.saturating_sub(places);
                format!(
                    "{waiting} to send Hello, its share of the control plane's {all} places \
                     (`--max-pending-handshakes`: {kept} {} kept for other tokens' agents); \
                     retry later",
                    if kept == 1 { "is" } else { "are" }
                )
            }
        }
    }
}

/// A stream's place among its token's streams waiting for their Hello (see
/// [`AgentStreamService::pending_by_token`]), given back when dropped.
struct TokenPending {
    counts: Arc<Mutex<HashMap<[u8; 32], usize>>>,
    digest: [u8; 32],
}

impl TokenPending {
    /// A place among the streams of the token whose secret has `digest`, unless `bound`'s
    /// number of them already wait: then `bound`, for the refusal. A token with no bound is
    /// counted all the same, so that a reload that adds an agent token finds the streams
    /// already waiting counted.
    fn take(
        counts: &Arc<Mutex<HashMap<[u8; 32], usize>>>,
        digest: [u8; 32],
        bound: Option<(usize, PlacesBy)>,
    ) -> Result<Self, (usize, PlacesBy)> {
        let mut map = counts.lock().unwrap_or_else(PoisonError::into_inner);
        let count = map.entry(digest).or_default();
        if let Some(full @ (places, _)) = bound
            && *count >= places
        {
            return Err(full);
        }
        *count += 1;
        Ok(Self {
            counts: counts.clone(),
            digest,
        })
    }
}

impl Drop for TokenPending {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = map.get_mut(&self.digest) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                map.remove(&self.digest);
            }
        }
    }
}

/// A stream's handshake place, held from the moment the stream is accepted until it is
/// registered or refused; shown as `retryplane_server_streams_awaiting_hello`.
struct AwaitingHello {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl AwaitingHello {
    fn new(permit: OwnedSemaphorePermit, gauge: &Gauge) -> Self {
        gauge.inc();
        Self {
            _permit: permit,
            gauge: gauge.clone(),
        }
    }
}

impl Drop for AwaitingHello {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Whether `status` reports the end of the stream's HTTP/2 connection (a GOAWAY) rather than
/// anything of the stream's own.
fn connection_ended(status: &Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(status);
    while let Some(e) = source {
        if e.downcast_ref::<h2::Error>()
            .is_some_and(h2::Error::is_go_away)
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// Refuses (`INVALID_ARGUMENT`, naming the field) a Hello the limits do not admit
/// ([`retryplane_proto::check_hello`]).
fn check_hello(hello: &pb::Hello, limits: &StreamLimits) -> Result<(), Status> {
    retryplane_proto::check_hello(hello, limits.max_field_len, limits.max_labels)
        .map_err(|e| Status::invalid_argument(e.to_string()))
}

/// `peer` with an IPv4-mapped IPv6 address as its IPv4 address; any other as it is.
pub(crate) fn canonical_peer(peer: std::net::SocketAddr) -> std::net::SocketAddr {
    match peer.ip().to_canonical() {
        ip @ std::net::IpAddr::V4(_) if peer.is_ipv6() => {
            std::net::SocketAddr::new(ip, peer.port())
        }
        _ => peer,
    }
}

impl AgentStreamService {
    /// `retryplane.v1.AgentService/Connect`: waits for Hello, registers the agent and starts
    /// the stream's task. Returns what the task sends (shared frames, then at most one final
    /// status), or the status that refuses the stream (`UNAVAILABLE`, "reconnect", when the
    /// server shuts down before the Hello comes).
    pub async fn connect(
        &self,
        request: Request<crate::inbound::Messages>,
    ) -> Result<mpsc::Receiver<Outbound>, Status> {
        // An IPv4 client of a dual-stack listener (`[::]`) is shown by its IPv4 address, as
        // the operator knows it, not as `[::ffff:a.b.c.d]`; any other address as it is (a
        // link-local one keeps its zone, `[fe80::1%2]`).
        let peer = request.remote_addr().map(canonical_peer);
        let life = request.extensions().get::<Life>().cloned();
        let credential = request.extensions().get::<Credential>().cloned();
        let token_name = request.extensions().get::<TokenName>().map(|t| t.0.clone());
        let secret_digest = credential.as_ref().map(Credential::digest);
        let limits = &self.ctx.limits;
        // Held until the stream is registered (or refused), so streams that never say Hello
        // cannot pile up; a registered stream counts against the agent limit instead.
        let Ok(permit) = self.handshakes.clone().try_acquire_owned() else {
            self.ctx.metrics.streams_refused.inc();
            return Err(Status::resource_exhausted(
                match limits.max_pending_handshakes {
                    1 => "1 stream is already waiting to send Hello; retry later".to_owned(),
                    places => {
                        format!("{places} streams are already waiting to send Hello; retry later")
                    }
                },
            ));
        };
        let _handshake = AwaitingHello::new(permit, &self.ctx.metrics.streams_awaiting_hello);
        // A token that may connect only so many agents holds no more than twice as many
        // handshake places (room for each agent's next stream while a stream it gave up still
        // waits), and, beside other agent tokens, no more than its share of them, so that no
        // one token (a small team's, or any without `max_agents`) can take every place.
        let token_places = match (&self.ctx.tokens, &credential) {
            (Some(tokens), Some(credential)) => {
                let tokens = tokens.current();
                let own = tokens
                    .max_agents(credential)
                    .map(|limit| (limit.saturating_mul(2), PlacesBy::MaxAgents(limit)));
                let share = (tokens.agent_tokens() > 1).then(|| {
                    let all = limits.max_pending_handshakes;
                    (token_share(all), PlacesBy::Share(all))
                });
                let bound = [own, share]
                    .into_iter()
                    .flatten()
                    .min_by_key(|(places, _)| *places);
                Some((credential.digest(), bound))
            }
            _ => None,
        };
        let _token_pending = match token_places {
            Some((digest, bound)) => Some(
                TokenPending::take(&self.pending_by_token, digest, bound).map_err(
                    |(places, by)| {
                        self.ctx.metrics.streams_refused.inc();
                        Status::resource_exhausted(by.refusal(places))
                    },
                )?,
            ),
            None => None,
        };
        let mut inbound = request.into_inner();
        // A shutdown does not wait for the Hello: the stream is told to reconnect at once, as
        // registered ones are, so a stream that never says Hello cannot hold the shutdown up.
        let mut shutdown = self.ctx.shutdown.clone();
        // What ends the stream when a reload takes its secret away: also while it waits for
        // its Hello (after the Guard admitted it), so that it does not keep its slot here.
        let mut revocation = match (&self.ctx.tokens, credential) {
            (Some(tokens), Some(credential)) => Some(Revocation {
                tokens: tokens.subscribe(),
                credential,
                hello: None,
            }),
            _ => None,
        };
        let first = tokio::select! {
            first = tokio::time::timeout(limits.hello_timeout, inbound.message()) => first,
            _ = shutdown.wait_for(|stop| *stop) => return Err(shutdown_status()),
            status = Revocation::revoked(&mut revocation) => return Err(status),
        };
        let mut hello = match first {
            Ok(Ok(Some(pb::AgentMessage {
                kind: Some(Kind::Hello(hello)),
            }))) => hello,
            Ok(Ok(Some(_))) => {
                return Err(Status::invalid_argument(
                    "the first message on the stream must be Hello",
                ));
            }
            Ok(Ok(None)) => return Err(Status::cancelled("stream closed before Hello")),
            Ok(Err(status)) => return Err(status),
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "no Hello within {:?}",
                    limits.hello_timeout
                )));
            }
        };
        check_hello(&hello, limits)?;
        // Hex in either case (the control plane writes lower case): compared as the same
        // content from here on.
        hello.last_applied_hash.make_ascii_lowercase();
        // Kept only for an agent that sends heartbeats, and whose stream counts what it hears.
        let life = life.filter(|_| hello.heartbeats);
        if let Some(life) = &life {
            life.heard();
        }
        // A reload that came with the Hello refuses it here, before it is registered or sent
        // anything.
        if let Some(revocation) = &mut revocation {
            // From here on, a token that may not connect as this agent id, or report as this
            // service, ends the stream too.
            revocation.hello = Some((hello.agent_id.clone(), hello.service.clone()));
            if let Some(status) = revocation.refusal() {
                // `PERMISSION_DENIED`: the agent id (a secret taken away is the reload's).
                if status.code() == tonic::Code::PermissionDenied {
                    self.ctx.metrics.auth_refused.inc();
                    info!(agent = %LogValue(&hello.agent_id), service = %LogValue(&hello.service), token = %LogValue(token_name.as_deref().unwrap_or_default()), "refused a Hello: the agent id or the service is not among its token's `agent_ids` or `services`");
                }
                return Err(status);
            }
        }
        // The token's name and limit in force now (a reload since the stream was admitted may
        // have renamed it).
        let in_force = revocation.as_ref().and_then(Revocation::in_force);
        let tokens_now = revocation.as_ref().map(|r| Arc::clone(&r.tokens.borrow()));
        let token = match (&token_name, secret_digest) {
            (Some(name), Some(secret_digest)) => Some(StreamToken {
                name: in_force
                    .as_ref()
                    .map_or(name.as_str(), |(name, _)| name.as_str()),
                secret_digest,
                max_agents: in_force.as_ref().and_then(|(_, max)| *max),
                in_force: tokens_now.as_deref(),
            }),
            _ => None,
        };
        let current = self.ctx.publisher.current();
        let serving = current
            .as_deref()
            .map(|s| (s.version, s.content_hash.as_str()));
        let registration = self
            .ctx
            .fleet
            .register_with_token(&hello, peer, serving, token)
            .map_err(|e| {
                self.ctx.metrics.streams_refused.inc();
                match e {
                    RegisterError::Full(_) | RegisterError::TokenFull { .. } => {
                        Status::resource_exhausted(e.to_string())
                    }
                    RegisterError::HeldByAnotherToken => {
                        warn!(agent = %LogValue(&hello.agent_id), "a stream of another token asked for a connected agent's id; refused");
                        Status::already_exists(e.to_string())
                    }
                    RegisterError::Superseded { .. } => {
                        info!(agent = %LogValue(&hello.agent_id), "a late Hello of a stream the agent gave up (it has opened a later one); refused");
                        Status::aborted(e.to_string())
                    }
                }
            })?;
        info!(agent = %LogValue(&hello.agent_id), service = %LogValue(&hello.service), version = hello.last_applied_version, "agent connected");
        if let Some(served) = registration.never_held {
            warn!(agent = %LogValue(&hello.agent_id), version = hello.last_applied_version, served, "an agent runs a version this control plane's store never reached: the store was reset or its file lost (a volume not mounted?); agents are sent the version served. Said once for the version served");
        }
        #[cfg(test)]
        if let Some(Hook(hook)) = &self.ctx.after_register {
            hook();
        }
        // What the fleet lists the agent as running, not what its Hello says: content this
        // control plane does not have is version 0 here too, so the current version is pushed
        // to it whatever was published since it was judged, unless that is the very version
        // and hash the Hello named (`named`: then it is listed as running it).
        let (known_version, known_hash, named) =
            if registration.applied_version == hello.last_applied_version {
                (
                    hello.last_applied_version,
                    hello.last_applied_hash.clone(),
                    None,
                )
            } else {
                let named = (hello.last_applied_version, hello.last_applied_hash.clone());
                (registration.applied_version, String::new(), Some(named))
            };
        // Two slots: at most one snapshot waits, and a closing status always has room.
        let (tx, rx) = mpsc::channel(2);
        let stream = AgentStream {
            ctx: self.ctx.clone(),
            agent_id: hello.agent_id.clone(),
            generation: registration.generation,
            known_version,
            known_hash,
            named,
            instance_id: hello.instance_id,
            sent_nonce: None,
            refused: registration.refused,
            service_name: hello.service.clone(),
            service: None,
            implausible_warned: false,
            bucket: ReportBucket::default(),
            held_acks: VecDeque::new(),
            earlier_pushes: VecDeque::new(),
            heartbeat: life.map(|life| {
                let interval = Duration::from_millis(self.ctx.publisher.metrics_interval_ms());
                Heartbeat {
                    life,
                    limit: liveness_timeout(interval),
                    period: keepalive_period(interval),
                    ended_silent: self.ctx.metrics.streams_silent.clone(),
                }
            }),
        };
        tokio::spawn(stream.run(inbound, tx, registration.replaced, revocation));
        Ok(rx)
    }
}

/// The tokens in force as a stream sees them, the credential it was admitted with, and the
/// agent id and service its Hello named (once it has).
struct Revocation {
    tokens: watch::Receiver<Arc<Tokens>>,
    credential: Credential,
    hello: Option<(String, String)>,
}

/// Why `tokens` no longer admit a stream with `credential` and the agent id and service of
/// its `hello`: its secret is no agent token's (`UNAUTHENTICATED`), or its token may not
/// connect as that agent id or report as that service (`PERMISSION_DENIED`).
fn refusal(
    tokens: &Tokens,
    credential: &Credential,
    hello: Option<(&str, &str)>,
) -> Option<Status> {
    if !tokens.admits(credential) {
        return Some(revoked_status());
    }
    let (agent_id, service) = hello?;
    tokens
        .refuses_agent_id(credential, agent_id)
        .or_else(|| tokens.refuses_service(credential, service))
}

impl Revocation {
    /// The name and `max_agents` of the stream's token in the tokens in force.
    fn in_force(&self) -> Option<(String, Option<usize>)> {
        self.tokens.borrow().name_and_max_agents(&self.credential)
    }

    /// Why the tokens in force no longer admit the stream, if they do not.
    fn refusal(&self) -> Option<Status> {
        refusal(
            &self.tokens.borrow(),
            &self.credential,
            self.hello.as_ref().map(|(a, s)| (a.as_str(), s.as_str())),
        )
    }

    /// Resolves, with the status to end the stream with, when the tokens in force no longer
    /// admit it (at once if a reload took its secret away before this was first polled); never
    /// without a revocation.
    async fn revoked(revocation: &mut Option<Self>) -> Status {
        let Some(Revocation {
            tokens,
            credential,
            hello,
        }) = revocation
        else {
            return std::future::pending().await;
        };
        let hello = hello.as_ref().map(|(a, s)| (a.as_str(), s.as_str()));
        // `wait_for` looks at the value in force first, then at every change.
        let refused = tokens
            .wait_for(|t| refusal(t, credential, hello).is_some())
            .await
            .map(|t| refusal(&t, credential, hello));
        match refused {
            Ok(status) => status.unwrap_or_else(revoked_status),
            // The token set is gone: the server is stopping, which ends the stream anyway.
            Err(_) => std::future::pending().await,
        }
    }
}

/// The status ending a stream whose secret a reload took away (or gave another role).
fn revoked_status() -> Status {
    Status::unauthenticated(
        "the token this stream authenticated with is no longer an agent token in the control plane's tokens file",
    )
}

/// One open stream's state, owned by its task.
struct AgentStream {
    ctx: Arc<StreamContext>,
    agent_id: String,
    generation: u64,
    /// What the fleet lists the agent as running (its Hello's version, or 0 for content this
    /// control plane did not have), or what it was last sent: once a snapshot is sent, that
    /// snapshot (an answer naming another version is stale).
    known_version: u64,
    known_hash: String,
    /// The version and hash the Hello named, when the fleet judged them unknown, until the agent
    /// ACKs a push: when they become the current version (published since the judgment) while
    /// no push waits for an answer, the agent runs it and is listed so, and nothing is sent.
    named: Option<(u64, String)>,
    /// The agent process (`Hello.instance_id`) its numbered reports belong to.
    instance_id: u64,
    /// The nonce of the last snapshot sent, until it is answered: a push counts one ACK or
    /// NACK, and an answer to another nonce, or a second answer to the same push (repeated or
    /// contradicting), is ignored.
    sent_nonce: Option<String>,
    /// The snapshot the agent refused on an earlier stream ([`crate::fleet::Registration`]):
    /// never pushed again on this one.
    refused: Option<crate::fleet::Refused>,
    /// The service its Hello named.
    service_name: String,
    /// Where its metrics reports are added: that service's series, looked up at the first
    /// report with an endpoint, so that an agent that never reports takes no place among the
    /// series the cap allows (services count against it too).
    service: Option<ServiceHandle>,
    /// Whether the stream has logged a report with implausible counts.
    implausible_warned: bool,
    /// The report rate limit used when the agent id's own (in its [`Fleet`] entry, shared by
    /// its streams) is gone: the entry was pruned while the stream was open.
    bucket: ReportBucket,
    /// Answers to numbered metrics reports not yet queued on the body, oldest first (see
    /// [`AgentStream::send`]).
    held_acks: VecDeque<pb::MetricsAck>,
    /// The versions of the pushes sent before the last one that still wait for an answer,
    /// oldest first, while the last one waits too, at most [`MAX_EARLIER_PUSHES`]: a late ACK
    /// of one is no answer to the last push, but says what the agent runs (it may then refuse
    /// the last one). Versions and content hashes: a push's nonce follows from its version
    /// ([`Publisher::is_nonce_of`]). Only pushes sent count: a version published while the
    /// stream had no room, and skipped, was never the agent's to run.
    earlier_pushes: VecDeque<(u64, String)>,
    /// For an agent that sends heartbeats: what the stream has heard of it, and when to send
    /// and to give up.
    heartbeat: Option<Heartbeat>,
}

/// The liveness of a stream whose agent sends heartbeats ([`retryplane_proto::liveness`]).
#[derive(Clone, Debug)]
struct Heartbeat {
    /// When the agent was last heard (its body's bytes, its messages).
    life: Life,
    /// Silence past this ends the stream.
    limit: Duration,
    /// A `Keepalive` goes every `period` when nothing waits to be sent.
    period: Duration,
    /// Counts the streams ended for silence (`retryplane_server_streams_silent`).
    ended_silent: prometheus_client::metrics::counter::Counter,
}

impl Heartbeat {
    /// Resolves once the agent has been silent for the limit; never without a heartbeat.
    async fn silent(heartbeat: Option<&Self>) {
        match heartbeat {
            Some(h) => h.life.silent(h.limit).await,
            None => std::future::pending().await,
        }
    }

    /// The status that ends a silent stream, counted.
    fn silent_status(&self) -> Status {
        self.ended_silent.inc();
        Status::unavailable(format!(
            "nothing came from the agent for {} ms (it sends a keepalive every {} ms): the stream is taken for dead",
            self.limit.as_millis(),
            self.period.as_millis()
        ))
    }
}

/// See [`AgentStream::earlier_pushes`]: an agent this many pushes behind on one stream, all
/// unanswered, is not one that answers the oldest of them later. (Versions only: 2 KiB at most
/// a stream.)
const MAX_EARLIER_PUSHES: usize = 256;

/// Resolves at `at`; never when `None`.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

enum Next {
    Continue,
    /// Send this answer to a numbered metrics report, then carry on.
    Ack(pb::MetricsAck),
    End(Option<Status>),
}

/// Metrics acks a stream may hold while a frame waits to be queued (see [`AgentStream::send`]),
/// whatever the time: a bound on memory, far above what an agent that reads holds (the acks
/// of the reports it sent at once, a backlog resent after an outage included). An agent that
/// does not read is ended earlier: see [`STALLED_HELD_ACKS`].
const MAX_HELD_ACKS: usize = 1024;

/// How long a stream whose agent has ended its side (a shutdown, which waits for the acks of
/// its last reports) may take to send the acks it still holds before it ends. An agent that
/// closes and then reads nothing gets none after it.
pub const CLOSE_FLUSH: std::time::Duration = std::time::Duration::from_secs(5);

/// Metrics acks held past which a stream whose frame has waited [`StreamLimits::unread_for`]
/// is ended. Above what our agent ever leaves unanswered (8 reports), so that an agent which
/// reads all along, but on a link slow enough that a large snapshot ahead of the acks takes
/// longer than that to go out, is not ended.
const STALLED_HELD_ACKS: usize = 64;

/// What ended [`queue`]'s wait.
// Large (a whole agent message), but made only when the agent's message came first, and moved
// straight out: a box would cost that message an allocation to save stack space for a moment.
#[allow(clippy::large_enum_variant)]
enum Queued {
    /// The frame is on the body.
    Sent,
    /// The agent sent a message first: the frame, not queued, and the message.
    Read(Outbound, Result<Option<pb::AgentMessage>, Status>),
}

/// A stream's two directions and what can end it, borrowed by its task's waits.
struct Io<'a> {
    tx: &'a mpsc::Sender<Outbound>,
    inbound: &'a mut crate::inbound::Messages,
    replaced: &'a mut tokio::sync::oneshot::Receiver<()>,
    shutdown: &'a mut watch::Receiver<bool>,
    revocation: &'a mut Option<Revocation>,
}

/// Queues `frame` on a stream's body once there is room for it and for a closing status after
/// it, so that the status can always be queued (`try_send` at the end of [`AgentStream::run`]).
/// An agent that stops reading therefore still ends here when its stream is replaced or the
/// server shuts down: `Err` carries the status to end with (`None`: the body is gone).
///
/// A message from the agent that comes first (with `inbound`) is handed back with the frame,
/// so that the stream goes on reading while its agent does not: h2 keeps a stream's unread
/// DATA frames in a buffer shared by its connection, and drops the whole connection (every
/// agent behind one proxy) once too many small ones pile up there.
async fn queue(
    tx: &mpsc::Sender<Outbound>,
    frame: Outbound,
    inbound: Option<&mut crate::inbound::Messages>,
    replaced: &mut tokio::sync::oneshot::Receiver<()>,
    shutdown: &mut watch::Receiver<bool>,
    revocation: &mut Option<Revocation>,
    heartbeat: Option<&Heartbeat>,
) -> Result<Queued, Option<Status>> {
    let read = async {
        match inbound {
            Some(inbound) => inbound.message().await,
            None => std::future::pending().await,
        }
    };
    // A stream whose secret was taken away gets nothing more, even when there is room; one
    // whose agent stopped reading ends here too.
    // Then room: a frame that can be queued is, even when the stream is ending (the ack of a
    // report just counted must reach the agent, or it sends the report again to the next
    // server process, which counts it again).
    let room = tokio::select! {
        biased;
        status = Revocation::revoked(revocation) => return Err(Some(status)),
        room = tx.reserve_many(2) => room,
        _ = replaced => return Err(Some(replaced_status())),
        _ = shutdown.wait_for(|s| *s) => return Err(Some(shutdown_status())),
        message = read => return Ok(Queued::Read(frame, message)),
        // An agent that neither reads nor sends: gone, behind a proxy that keeps its
        // connection (the agent's bytes, read meanwhile, keep a live one).
        () = Heartbeat::silent(heartbeat) => {
            return Err(heartbeat.map(Heartbeat::silent_status));
        }
    };
    let mut room = room.map_err(|_| None)?;
    if let Some(permit) = room.next() {
        permit.send(frame);
    }
    Ok(Queued::Sent)
}

fn replaced_status() -> Status {
    Status::aborted("replaced by a newer stream with the same agent id")
}

fn shutdown_status() -> Status {
    Status::unavailable("control plane shutting down; reconnect")
}

impl AgentStream {
    async fn run(
        mut self,
        mut inbound: crate::inbound::Messages,
        tx: mpsc::Sender<Outbound>,
        mut replaced: tokio::sync::oneshot::Receiver<()>,
        mut revocation: Option<Revocation>,
    ) {
        let mut snapshots = self.ctx.publisher.subscribe();
        let mut shutdown = self.ctx.shutdown.clone();
        let mut io = Io {
            tx: &tx,
            inbound: &mut inbound,
            replaced: &mut replaced,
            shutdown: &mut shutdown,
            revocation: &mut revocation,
        };
        let keepalive = pb::ServerMessage::keepalive();
        let keepalive = encode_frame(&keepalive).ok();
        let mut next_keepalive = self.heartbeat.as_ref().map(|h| Instant::now() + h.period);
        let end = loop {
            if let Err(end) = self.send_held_acks(&mut io).await {
                break end;
            }
            let current = snapshots.borrow_and_update().clone();
            if let Some(snap) = &current
                && self.sent_nonce.is_none()
                && self
                    .named
                    .as_ref()
                    .is_some_and(|(v, h)| snap.version == *v && snap.content_hash == *h)
                && let Some((version, hash)) = self.named.take()
            {
                self.known_version = version;
                self.known_hash = hash;
                self.ctx
                    .fleet
                    .runs(&self.agent_id, self.generation, version);
            }
            if let Some(snap) = current
                && self.behind(&snap)
            {
                let snap = match self.send_newest(&mut io, &mut snapshots, snap).await {
                    Ok(Some(snap)) => snap,
                    // Published meanwhile: what the agent runs already.
                    Ok(None) => continue,
                    Err(end) => break end,
                };
                if self.sent_nonce.take().is_some() {
                    if self.earlier_pushes.len() == MAX_EARLIER_PUSHES {
                        self.earlier_pushes.pop_front();
                    }
                    self.earlier_pushes
                        .push_back((self.known_version, self.known_hash.clone()));
                }
                self.known_version = snap.version;
                self.known_hash.clone_from(&snap.content_hash);
                self.sent_nonce = Some(snap.nonce.clone());
                self.ctx.metrics.pushes.inc();
                debug!(agent = %LogValue(&self.agent_id), version = snap.version, "snapshot sent");
                // Acks held while it waited go next (the versions published meanwhile, which
                // would have woken the wait below, were taken in by the send).
                if !self.held_acks.is_empty() {
                    continue;
                }
            }
            let next = tokio::select! {
                // In this order: what the agent sent is read before its silence is judged
                // (after a stall of the task, both may be ready).
                biased;
                changed = snapshots.changed() => match changed {
                    Ok(()) => Next::Continue,
                    Err(_) => Next::End(Some(shutdown_status())),
                },
                message = io.inbound.message() => self.on_message(message),
                _ = &mut *io.replaced => Next::End(Some(replaced_status())),
                _ = io.shutdown.wait_for(|s| *s) => Next::End(Some(shutdown_status())),
                status = Revocation::revoked(io.revocation) => Next::End(Some(status)),
                () = Heartbeat::silent(self.heartbeat.as_ref()) => {
                    info!(agent = %LogValue(&self.agent_id), "ending an agent stream: nothing came from the agent, which sends a keepalive every period, for the liveness timeout");
                    Next::End(self.heartbeat.as_ref().map(Heartbeat::silent_status))
                }
                () = sleep_until_some(next_keepalive) => {
                    // Only when nothing waits to go (the channel's two slots free: room for it
                    // and a closing status after it, as `queue` keeps): what waits carries the
                    // stream's life already.
                    if let (Some(frame), Ok(mut room)) = (&keepalive, tx.try_reserve_many(2))
                        && let Some(permit) = room.next()
                    {
                        permit.send(Ok(frame.clone()));
                    }
                    next_keepalive = self.heartbeat.as_ref().map(|h| Instant::now() + h.period);
                    Next::Continue
                }
            };
            match next {
                Next::Continue => {}
                Next::Ack(ack) => self.held_acks.push_back(ack),
                Next::End(status) => break status,
            }
        };
        let mut end = end;
        // The agent ended its side (it shuts down; an error would have ended it with a status):
        // the acks it is owed go before the stream ends.
        if io.inbound.ended() && end.is_none() && !self.held_acks.is_empty() {
            let held = self.held_acks.len();
            match tokio::time::timeout(CLOSE_FLUSH, self.send_held_acks(&mut io)).await {
                Ok(Ok(())) => {}
                // Cut short by a shutdown, a replacement or a revoked token: ended as those end.
                Ok(Err(status)) => end = status,
                // The agent reads nothing more: the acks left are dropped; it sends those
                // reports again, and they are answered as counted.
                Err(_) => {
                    debug!(agent = %LogValue(&self.agent_id), held, "the agent ended its stream and did not read the acks it was owed");
                }
            }
        }
        match end.as_ref().map(Status::code) {
            Some(tonic::Code::Unauthenticated) => {
                info!(agent = %LogValue(&self.agent_id), "a tokens reload took the stream's token away; ending the stream");
            }
            // Only a reload that left the agent id or the service out of its token's
            // `agent_ids` or `services` ends a registered stream so.
            Some(tonic::Code::PermissionDenied) => {
                info!(agent = %LogValue(&self.agent_id), "a tokens reload left the agent id or the service out of its token's `agent_ids` or `services`; ending the stream");
            }
            _ => {}
        }
        if let Some(status) = end {
            // A slot is free (see `queue`), so this never waits on an agent that does not read.
            // The agent may be gone already; nothing to do then.
            let _ = tx.try_send(Err(status));
        }
        self.ctx.fleet.disconnected(&self.agent_id, self.generation);
        info!(agent = %LogValue(&self.agent_id), "agent disconnected");
    }

    /// Queues `frame` ([`queue`]), taking what the agent sends meanwhile as it comes: a metrics
    /// report is counted and its ack held, to be sent after `frame`. The stream ends when the
    /// wait has lasted [`StreamLimits::unread_for`] with [`STALLED_HELD_ACKS`] acks held (the
    /// agent takes nothing it is sent, and reports go on), or past [`MAX_HELD_ACKS`].
    async fn send(&mut self, io: &mut Io<'_>, frame: Outbound) -> Result<(), Option<Status>> {
        self.send_waiting_since(io, frame, Instant::now()).await
    }

    /// Queues the snapshot `snap` as [`AgentStream::send`] does; while it waits for room, a
    /// newer version published meanwhile takes its place (an agent that reads slowly gets the
    /// newest next, not every version published while it read). What was queued, or `None` when
    /// the newest is what the agent runs already. The wait for room counts from the first
    /// snapshot's (the stall rule of `send` is not put off by new versions).
    async fn send_newest(
        &mut self,
        io: &mut Io<'_>,
        snapshots: &mut watch::Receiver<Option<Arc<crate::publisher::Snapshot>>>,
        mut snap: Arc<crate::publisher::Snapshot>,
    ) -> Result<Option<Arc<crate::publisher::Snapshot>>, Option<Status>> {
        let waiting_since = Instant::now();
        loop {
            // (`send` is cancel-safe here: a frame it has not queued is dropped with it, and
            // what it read from the agent meanwhile has been taken in.)
            let changed = tokio::select! {
                biased;
                sent = self.send_waiting_since(io, snap.frame(), waiting_since) => {
                    return sent.map(|()| Some(snap));
                }
                changed = snapshots.changed() => changed,
            };
            if changed.is_err() {
                return Err(Some(shutdown_status()));
            }
            match snapshots.borrow_and_update().clone() {
                Some(newest) if self.behind(&newest) => snap = newest,
                _ => return Ok(None),
            }
        }
    }

    /// [`AgentStream::send`], its wait for room counted from `waiting_since`.
    async fn send_waiting_since(
        &mut self,
        io: &mut Io<'_>,
        mut frame: Outbound,
        waiting_since: Instant,
    ) -> Result<(), Option<Status>> {
        loop {
            // Nothing more is read once the agent has ended its side.
            let inbound = if io.inbound.ended() {
                None
            } else {
                Some(&mut *io.inbound)
            };
            let queued = queue(
                io.tx,
                frame,
                inbound,
                io.replaced,
                io.shutdown,
                io.revocation,
                self.heartbeat.as_ref(),
            )
            .await?;
            let (back, message) = match queued {
                Queued::Sent => return Ok(()),
                Queued::Read(back, message) => (back, message),
            };
            frame = back;
            match self.on_message(message) {
                Next::Continue => {}
                Next::Ack(_)
                    if self.held_acks.len() >= MAX_HELD_ACKS
                        || (self.held_acks.len() >= STALLED_HELD_ACKS
                            && waiting_since.elapsed() >= self.ctx.limits.unread_for) =>
                {
                    let waited = waiting_since.elapsed();
                    warn!(agent = %LogValue(&self.agent_id), held = self.held_acks.len(), waited_ms = waited.as_millis(), "ending an agent stream: the agent sends metrics reports but does not read what it is sent");
                    return Err(Some(Status::resource_exhausted(format!(
                        "the agent does not read its stream: a message has waited {} ms to be sent while {} metrics acks wait for it",
                        waited.as_millis(),
                        self.held_acks.len() + 1
                    ))));
                }
                Next::Ack(ack) => self.held_acks.push_back(ack),
                Next::End(status) => return Err(status),
            }
        }
    }

    /// Sends the metrics acks held, oldest first.
    async fn send_held_acks(&mut self, io: &mut Io<'_>) -> Result<(), Option<Status>> {
        while let Some(ack) = self.held_acks.pop_front() {
            let frame = match encode_frame(&pb::ServerMessage::with_metrics_ack(ack)) {
                Ok(frame) => frame,
                // A message of two integers always encodes.
                Err(e) => {
                    warn!(agent = %LogValue(&self.agent_id), error = %e, "cannot frame a metrics ack");
                    continue;
                }
            };
            if let Err(end) = self.send(io, Ok(frame)).await {
                // Still owed: the stream may yet send it (the agent ended its side while it
                // waited for room).
                self.held_acks.push_front(ack);
                return Err(end);
            }
        }
        Ok(())
    }

    /// Whether an answer naming `nonce` and `version` is the first answer to the last push;
    /// if so, the push counts as answered.
    fn answers_last_push(&mut self, nonce: &str, version: u64) -> bool {
        let first = self.sent_nonce.as_deref() == Some(nonce) && version == self.known_version;
        if first {
            self.sent_nonce = None;
            self.earlier_pushes.clear();
        }
        first
    }

    /// Whether `nonce` and `version` name a push sent before the last one and not answered
    /// yet ([`AgentStream::earlier_pushes`]): its content hash if so. It and the pushes older
    /// than it are moot from now on: an agent answers its pushes in order.
    fn answers_earlier_push(&mut self, nonce: &str, version: u64) -> Option<String> {
        let at = self.earlier_pushes.iter().position(|(v, _)| *v == version);
        match at {
            Some(at) if self.ctx.publisher.is_nonce_of(nonce, version) => self
                .earlier_pushes
                .drain(..=at)
                .next_back()
                .map(|(_, hash)| hash),
            _ => None,
        }
    }

    /// Whether the agent should get `snap`: another version, or the same number with other
    /// content (a store that was reset). Never the snapshot the agent refused on an earlier
    /// stream: the same version number with the same content hash (a rollback to equal
    /// content gets a new number, so it is pushed).
    fn behind(&self, snap: &crate::publisher::Snapshot) -> bool {
        let refused = self
            .refused
            .as_ref()
            .is_some_and(|r| r.version == snap.version && r.content_hash == snap.content_hash);
        !refused
            && (snap.version != self.known_version
                || (!self.known_hash.is_empty() && self.known_hash != snap.content_hash))
    }

    fn on_message(&mut self, message: Result<Option<pb::AgentMessage>, Status>) -> Next {
        let message = match message {
            Ok(Some(m)) => {
                if let Some(h) = &self.heartbeat {
                    h.life.heard();
                }
                m
            }
            // The agent's end of the stream: the acks it is still owed go first (`run`).
            Ok(None) => return Next::End(None),
            Err(status) => {
                // Garbage, an oversized message or a broken connection: this stream ends with
                // the decoder's status; every other stream carries on. What the agent sent
                // wrong (a message over the limit, a bad header) is its fault and is logged
                // where an operator sees it; a broken connection is routine.
                // A connection's end (a GOAWAY, whoever sent it) is not this stream's doing,
                // even with the code tonic gives h2's ENHANCE_YOUR_CALM (`RESOURCE_EXHAUSTED`),
                // which ends every stream of a connection that held too many unread frames.
                // A refusal for want of room is the control plane's load, logged by the room.
                let agents_fault = !connection_ended(&status)
                    && !status.message().starts_with(crate::inbound::NO_ROOM)
                    && (status.message().starts_with(crate::inbound::BAD_HEADER)
                        || matches!(
                            status.code(),
                            tonic::Code::ResourceExhausted | tonic::Code::InvalidArgument
                        ));
                if agents_fault {
                    warn!(agent = %LogValue(&self.agent_id), code = ?status.code(), reason = %LogValue(status.message()), "ending an agent stream: the agent sent a message this control plane cannot take");
                } else {
                    debug!(agent = %LogValue(&self.agent_id), code = ?status.code(), "stream ended with an error");
                }
                return Next::End(Some(status));
            }
        };
        let ctx = self.ctx.clone();
        // One registry update per message: an ACK or NACK of the snapshot sent marks the agent
        // seen as it records the answer.
        match message.kind {
            Some(Kind::Ack(ack)) => {
                if self.answers_last_push(&ack.nonce, ack.version) {
                    self.named = None;
                    ctx.fleet.ack(
                        &self.agent_id,
                        self.generation,
                        self.known_version,
                        &self.known_hash,
                    );
                    ctx.metrics.acks.inc();
                } else if let Some(hash) = self.answers_earlier_push(&ack.nonce, ack.version) {
                    // A push sent before the last one: the agent runs it, and the last push
                    // still waits for its answer. It is the agent's last answer, and the
                    // first to that push.
                    ctx.fleet
                        .ack(&self.agent_id, self.generation, ack.version, &hash);
                    ctx.metrics.acks.inc();
                    debug!(agent = %LogValue(&self.agent_id), version = ack.version, "ACK of a snapshot sent before the last one: the agent runs it");
                } else {
                    ctx.fleet.seen(&self.agent_id, self.generation);
                    debug!(agent = %LogValue(&self.agent_id), version = ack.version, nonce = %LogValue(&ack.nonce), "ACK ignored: not the first answer to the last snapshot sent");
                }
            }
            Some(Kind::Nack(nack)) => {
                let refused = if self.answers_last_push(&nack.nonce, nack.version) {
                    Some((self.known_version, self.known_hash.clone()))
                } else {
                    // A push sent before the last one, refused: shown and counted as any
                    // refusal (it is the agent's last answer), and only its first answer
                    // counts: a later ACK of it says nothing of what the agent runs.
                    self.answers_earlier_push(&nack.nonce, nack.version)
                        .map(|hash| (nack.version, hash))
                };
                if let Some((version, hash)) = refused {
                    ctx.fleet
                        .nack(&self.agent_id, self.generation, version, &hash, &nack.error);
                    ctx.metrics.nacks.inc();
                    warn!(agent = %LogValue(&self.agent_id), version = nack.version, error = %LogValue(&nack_reason(&nack.error)), "agent refused a snapshot");
                } else {
                    ctx.fleet.seen(&self.agent_id, self.generation);
                    debug!(agent = %LogValue(&self.agent_id), version = nack.version, nonce = %LogValue(&nack.nonce), "NACK ignored: not the first answer to a snapshot sent");
                }
            }
            Some(Kind::Metrics(report)) => return self.on_report(&report),
            // The agent is there (it was heard above); nothing to answer.
            Some(Kind::Keepalive(_)) => ctx.fleet.seen(&self.agent_id, self.generation),
            Some(Kind::Hello(_)) => {
                warn!(agent = %LogValue(&self.agent_id), "ending an agent stream: the agent sent a second Hello");
                return Next::End(Some(Status::invalid_argument(
                    "Hello may only be the first message",
                )));
            }
            // A message kind this control plane does not know (an agent newer than it; prost
            // drops the unknown field), or none: nothing to do, as protobuf's rules for unknown
            // fields want, so that agents can be upgraded first.
            None => {
                ctx.fleet.seen(&self.agent_id, self.generation);
                debug!(agent = %LogValue(&self.agent_id), "a message of a kind this control plane does not know; ignored");
            }
        }
        Next::Continue
    }

    /// Adds an accepted report to the service's series (found or made at its first endpoint).
    fn ingest(&mut self, ctx: &StreamContext, report: &pb::MetricsReport, now: Instant) {
        if report.endpoints.is_empty() {
            return;
        }
        let service = self
            .service
            .get_or_insert_with(|| ctx.aggregates.service(&self.service_name));
        let refused = ctx.aggregates.ingest(service, report, now);
        if refused.count > 0 {
            ctx.metrics
                .report_endpoints_implausible
                .inc_by(refused.count);
            if !self.implausible_warned {
                self.implausible_warned = true;
                // The names come from the agent: escaped, so they cannot forge a log line.
                let why = if refused.repeated == refused.count {
                    "names an endpoint more than once; the repeats were left out"
                } else if refused.repeated == 0 {
                    "holds counts past what one agent could make over its window; those \
                     endpoints' counts were left out"
                } else {
                    "names an endpoint more than once, and holds counts past what one agent \
                     could make over its window; those entries were left out"
                };
                warn!(
                    agent = %LogValue(&self.agent_id),
                    endpoint = %LogValue(refused.first.unwrap_or_default()),
                    entries = refused.count,
                    "a metrics report {why} (this stream logs it once; \
                     retryplane_server_report_endpoints_implausible_total counts them)"
                );
            }
        }
    }

    /// A metrics report: counted at most once per (instance, seq) when numbered, within the
    /// rate limit; a numbered report is answered. A seq from a client that sent no instance id
    /// in its Hello cannot be told apart from the same seq of its previous process, so such a
    /// report is taken as unnumbered: counted as it comes, not answered.
    fn on_report(&mut self, report: &pb::MetricsReport) -> Next {
        let ctx = self.ctx.clone();
        let now = Instant::now();
        let limits = &ctx.limits;
        let own = &mut self.bucket;
        let admit = |bucket: Option<&mut ReportBucket>| {
            bucket
                .unwrap_or(own)
                .take(now, limits.reports_per_second, limits.report_burst)
        };
        if report.seq == 0 || self.instance_id == 0 {
            if ctx
                .fleet
                .admit_report(&self.agent_id, self.generation, admit)
            {
                self.ingest(&ctx, report, now);
            } else {
                ctx.metrics.reports_dropped.inc();
            }
            return Next::Continue;
        }
        let verdict = ctx.fleet.claim_report(
            &self.agent_id,
            self.generation,
            self.instance_id,
            report.seq,
            admit,
        );
        let dropped = match verdict {
            ReportVerdict::Count => {
                self.ingest(&ctx, report, now);
                false
            }
            ReportVerdict::Duplicate => {
                ctx.metrics.reports_duplicate.inc();
                debug!(agent = %LogValue(&self.agent_id), seq = report.seq, "metrics report already counted");
                false
            }
            ReportVerdict::Refused => {
                ctx.metrics.reports_dropped.inc();
                true
            }
            ReportVerdict::OutOfWindow => {
                ctx.metrics.reports_out_of_window.inc();
                debug!(agent = %LogValue(&self.agent_id), seq = report.seq, "metrics report too far below the highest of its process to tell whether it was counted: not counted");
                false
            }
            // Dropped once already: answered as such, not counted as dropped again.
            ReportVerdict::RefusedBefore => {
                debug!(agent = %LogValue(&self.agent_id), seq = report.seq, "metrics report refused before, sent again");
                true
            }
        };
        Next::Ack(pb::MetricsAck {
            seq: report.seq,
            dropped,
        })
    }
}

/// The most of a NACK's error a log line carries; `retryplane status --output json` shows up
/// to [`crate::fleet::MAX_ERROR_LEN`] bytes of it (its table, 60 columns).
const MAX_LOGGED_NACK: usize = 256;

/// The start of a NACK's `error` for the log, cut at a character boundary and marked so when
/// cut: an agent's reason says which field of the snapshot it refused, and an operator reading
/// the log needs it beside the warning (it is the agent's own words about the policy, never a
/// request's header, body or token).
fn nack_reason(error: &str) -> std::borrow::Cow<'_, str> {
    retryplane_policy::diag::cut_marked(error, MAX_LOGGED_NACK)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quarter of the places, rounded up, is left to other tokens, but a token always has
    /// one.
    #[test]
    fn a_tokens_share_leaves_a_quarter_rounded_up() {
        for (all, share) in [(1, 1), (2, 1), (3, 2), (4, 3), (5, 3), (8, 6), (1024, 768)] {
            assert_eq!(token_share(all), share, "{all}");
        }
    }

    /// At the smallest limits the refusals still read as English ("1 stream … waits"), and
    /// say how many places are kept for other tokens.
    #[test]
    fn a_refusal_at_one_place_says_one_stream() {
        let one = PlacesBy::Share(2).refusal(token_share(2));
        assert!(
            one.starts_with("1 stream of this token already waits to send Hello")
                && one.contains("control plane's 2 places (`--max-pending-handshakes`: 1 is kept"),
            "{one}"
        );
        let two = PlacesBy::MaxAgents(1).refusal(2);
        assert!(
            two.starts_with("2 streams of this token already wait to send Hello"),
            "{two}"
        );
        let many = PlacesBy::Share(1024).refusal(token_share(1024));
        assert!(
            many.contains("768 streams")
                && many.contains("1024 places (`--max-pending-handshakes`: 256 are kept"),
            "{many}"
        );
    }

    #[test]
    fn a_mapped_peer_is_shown_by_its_ipv4_address_and_a_link_local_one_keeps_its_zone() {
        let mapped: std::net::SocketAddr = "[::ffff:10.1.2.3]:5000".parse().unwrap();
        assert_eq!(canonical_peer(mapped).to_string(), "10.1.2.3:5000");
        let zoned = std::net::SocketAddr::V6(std::net::SocketAddrV6::new(
            "fe80::1".parse().unwrap(),
            5000,
            0,
            2,
        ));
        assert_eq!(canonical_peer(zoned).to_string(), "[fe80::1%2]:5000");
        let v4: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(canonical_peer(v4), v4);
    }

    #[test]
    fn hello_refuses_control_characters_and_names_the_field() {
        let limits = StreamLimits::default();
        let good = pb::Hello {
            agent_id: "checkout-7f".to_owned(),
            service: "checkout".to_owned(),
            labels: [("zone".to_owned(), "eu-1 a".to_owned())].into(),
            ..Default::default()
        };
        assert!(check_hello(&good, &limits).is_ok());
        let refused = |edit: &dyn Fn(&mut pb::Hello)| {
            let mut hello = good.clone();
            edit(&mut hello);
            let status = check_hello(&hello, &limits).err();
            status.map(|s| (s.code(), s.message().to_owned()))
        };
        let code = tonic::Code::InvalidArgument;
        // A bidi mark, common in Hebrew and Arabic text, is kept (and shown escaped).
        assert_eq!(
            refused(&|h| {
                h.labels
                    .insert("team".to_owned(), "\u{200f}צוות".to_owned());
                h.service = "shop\u{200f}".to_owned();
            }),
            None
        );
        assert_eq!(
            refused(&|h| h.agent_id = "a\u{1b}[2J".to_owned()),
            Some((code, "Hello.agent_id holds a control character".to_owned()))
        );
        assert_eq!(
            refused(&|h| h.service = "ep\u{1b}[31mX".to_owned()),
            Some((code, "Hello.service holds a control character".to_owned()))
        );
        // Every string field is bounded, the hash it last applied too (a SHA-256 in hex is 64).
        let limit = |field: &str| {
            format!("Hello.{field} is 257 bytes; Hello fields are limited to 256 bytes")
        };
        let long = "f".repeat(limits.max_field_len + 1);
        assert_eq!(
            refused(&|h| h.last_applied_hash.clone_from(&long)),
            Some((code, limit("last_applied_hash")))
        );
        assert_eq!(
            refused(&|h| h.agent_version.clone_from(&long)),
            Some((code, limit("agent_version")))
        );
        // A bad service is named before an agent id made from it (the agent's default).
        assert_eq!(
            refused(&|h| {
                h.service = "a\nb".to_owned();
                h.agent_id = "a\nb-0123456789abcdef".to_owned();
            }),
            Some((code, "Hello.service holds a control character".to_owned()))
        );
        for (k, v) in [("zone\n", "eu"), ("zone", "eu\u{2028}"), ("zone", "\r")] {
            let status = refused(&|h| h.labels = [(k.to_owned(), v.to_owned())].into());
            assert_eq!(
                status.map(|(c, m)| (c, m.starts_with("Hello.labels: "))),
                Some((code, true)),
                "{k:?}={v:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_frame_with_room_is_queued_even_as_the_stream_ends() {
        // An ack of a report just counted, as the server shuts down or a newer stream takes
        // over: not queued, the agent would send the report again, to be counted again by
        // the next server process.
        let ack = encode_frame(&pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
            seq: 1,
            dropped: false,
        }))
        .unwrap();
        for ending in ["shutdown", "replaced"] {
            for _ in 0..64 {
                let (tx, mut rx) = mpsc::channel(2);
                let (kick, mut replaced) = tokio::sync::oneshot::channel::<()>();
                let (_stop, mut shutdown) = watch::channel(ending == "shutdown");
                // Kept while not replaced: a dropped sender ends the wait too.
                let _kept = if ending == "replaced" {
                    let _ = kick.send(());
                    None
                } else {
                    Some(kick)
                };
                let sent = queue(
                    &tx,
                    Ok(ack.clone()),
                    None,
                    &mut replaced,
                    &mut shutdown,
                    &mut None,
                    None,
                )
                .await;
                assert!(matches!(sent, Ok(Queued::Sent)), "{ending}: not queued");
                assert!(rx.try_recv().is_ok());
            }
        }
    }

    #[tokio::test]
    async fn a_goaway_is_the_connections_end_and_a_status_of_the_stream_is_not() {
        // A server that drops its connection (as h2 does when it holds too many unread
        // frames) while it reads a stream's request body: what that stream's read gets.
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let (client, connection) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(connection);
        let (_response, _request_body) = client
            .ready()
            .await
            .unwrap()
            .send_request(http::Request::new(()), false)
            .unwrap();
        let mut connection = h2::server::handshake(server_io).await.unwrap();
        let (request, _respond) = connection.accept().await.unwrap().unwrap();
        connection.abrupt_shutdown(h2::Reason::ENHANCE_YOUR_CALM);
        tokio::spawn(async move { while connection.accept().await.is_some() {} });
        let error = request.into_body().data().await.unwrap().unwrap_err();
        let status = Status::from_error(Box::new(error));
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(connection_ended(&status), "{status:?}");

        assert!(!connection_ended(&Status::resource_exhausted("too large")));
        let reset = Status::from_error(Box::new(h2::Error::from(h2::Reason::CANCEL)));
        assert!(!connection_ended(&reset), "{reset:?}");
    }

    #[test]
    fn the_report_rate_allows_twice_the_interval_agents_are_given() {
        let fast = StreamLimits::default().for_metrics_interval(Duration::from_millis(200));
        assert_eq!(fast.reports_per_second, 10.0);
        // The default interval (10 s) keeps the default limit, which is already above it.
        let slow = StreamLimits::default().for_metrics_interval(Duration::from_secs(10));
        assert_eq!(slow.reports_per_second, 2.0);
        let zero = StreamLimits::default().for_metrics_interval(Duration::ZERO);
        assert_eq!(zero.reports_per_second, 2.0);
    }
}
