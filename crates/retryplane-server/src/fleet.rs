//! Who is connected and what each agent runs (SPEC §3 FleetStatus).
//!
//! One entry per agent id. A second stream with the same id replaces the first: the older
//! stream is told to end, and its late updates are ignored (each registration has its own
//! generation). Disconnected agents stay listed, so status shows who went away: for an hour by
//! default ([`Fleet::forgetting_after`], `--forget-disconnected-after`), and at most
//! [`MAX_DISCONNECTED`] of them, holding about [`MAX_DISCONNECTED_BYTES`] at most (past either,
//! the longest gone tenth go at once). An agent whose Hello says it is
//! ephemeral (`retryplane request --server`, one call and gone) is not listed or counted once
//! its stream has ended; its entry is kept as any other's, for its reports, and is the first to
//! go past [`MAX_DISCONNECTED`].
//! Each entry also keeps which numbered metrics reports of the agent were counted
//! ([`crate::report_seq`]); it is carried over when a stream replaces another and kept while the
//! agent is listed (or kept unlisted, for an ephemeral one), so a report sent again after a
//! reconnect is counted once. A forgotten agent's record is kept apart for a while
//! ([`MAX_FORGOTTEN`] of them): a report counted just before its stream broke, whose ack was
//! lost, and sent again after the agent was forgotten (cut off for longer than the forget
//! time), is still counted once; but not an ephemeral agent's (unless a long-lived stream had
//! its id too), so one-call agents do not push the others' records out.
//!
//! The agent's last NACK (the version, its content hash and the error) is carried over the
//! same way: status keeps showing it after a reconnect, and the new stream is told
//! ([`Registration::refused`]) not to push that snapshot again, since the agent would refuse
//! it again. It is kept for the same agent process only (the same Hello `instance_id`): a
//! restarted or upgraded agent may accept what the old process refused, so a new instance gets
//! the current version as any agent would. It is also forgotten when the agent ACKs a version,
//! or says in its Hello that it runs the refused version.
//!
//! What an agent runs comes from its Hello, then from each ACK. A Hello that names the current
//! version's number with another content hash, or a number the store has not reached (the agent
//! last ran on a control plane whose store was reset and seeded again, so numbers repeat with other
//! content), is not taken at its word: it is listed as running none known (0), pending the push,
//! until it ACKs it, or until its stream finds that very version and hash published since
//! ([`Fleet::runs`]: listed as running it, and not sent it). (A lower number with another store's
//! content is still taken as it says: the fleet keeps only the current version's hash.)
//!
//! The connected agents of each service are also counted by the number their calls are
//! reported under ([`Fleet::running`], changed under the registry's lock): the Hello's number,
//! also when the agent is listed as running 0, then each version it ACKs. Which versions a
//! metrics series keeps apart follows these counts ([`crate::aggregate::series`]).

use std::collections::VecDeque;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::gauge::Gauge;
use retryplane_proto::pb;
use tokio::sync::oneshot;

use crate::report_seq::{ReportSeqs, ReportVerdict};
use crate::running::AgentsRunning;

/// How many disconnected agents status keeps listing.
pub const MAX_DISCONNECTED: usize = 10_000;
/// How much memory the disconnected agents' entries may hold, as `gone_size` reckons it:
/// a Hello may carry 64 labels of 256 bytes, about 45 KB an entry as kept, so the count alone
/// let agents that came and went with the largest Hellos hold 450 MB for the forget time.
pub const MAX_DISCONNECTED_BYTES: usize = 64 << 20;
/// How many forgotten agents' report records are kept (`Forgotten`): under 1 KiB each (an
/// id of up to 256 bytes, twice), 10 MB at most.
pub const MAX_FORGOTTEN: usize = 10_000;
/// How long a disconnected agent stays listed by default: pods that are replaced every day
/// would otherwise fill the list with agents that are never coming back.
pub const FORGET_DISCONNECTED_AFTER: Duration = Duration::from_secs(3600);
/// Longest NACK error kept, in bytes.
pub const MAX_ERROR_LEN: usize = 1024;

/// The wall clock in Unix milliseconds, for status timestamps only.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The wall clock in Unix seconds, to the nanosecond the clock gives (0 before 1970): for the
/// publish time on `/metrics`, which the fan-out bench reads in milliseconds.
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

#[derive(Debug)]
struct Entry {
    status: pb::AgentStatus,
    generation: u64,
    /// Fires to end the stream when a newer one replaces it.
    replaced: Option<oneshot::Sender<()>>,
    /// The numbered metrics reports counted, across this agent id's streams.
    reports: ReportSeqs,
    /// The snapshot the agent refused last, across this agent id's streams; `None` once it
    /// ACKs a version.
    refused: Option<Refused>,
    /// The content hash of the version the agent ACKed last (empty: none, or a NACK since).
    acked_hash: String,
    /// The Hello's `instance_id` of the stream registered last (0: not given).
    instance_id: u64,
    /// The highest `Hello.stream` registered for each of the last few processes
    /// (`instance_id`s) with this agent id, most recent first (see [`StreamNumbers`]).
    streams: StreamNumbers,
    /// The metrics report rate limit, across this agent id's streams, so that a reconnect
    /// does not start a fresh burst.
    bucket: ReportBucket,
    /// The Hello's `ephemeral` of the stream registered last: not listed once disconnected.
    ephemeral: bool,
    /// Whether a stream not marked ephemeral registered with this agent id since the entry
    /// was made (or since its record came back from [`Forgotten`]): its report record is then
    /// kept when it is forgotten, even when an ephemeral stream that took the id registered
    /// last.
    long_lived: bool,
    /// The digest of the secret the stream registered last authenticated with (`None` without
    /// a tokens file): with its name, what tells another token's stream apart.
    secret_digest: Option<[u8; 32]>,
    /// While disconnected, its [`gone_size`] as counted in `Inner::gone_bytes`; 0 while
    /// connected.
    gone_size: usize,
    /// While disconnected, when its stream ended, as `Inner::disconnects` counted then: what
    /// [`prune`] orders the disconnected by (the wall clock of `last_seen_unix_ms` may have
    /// been set back since).
    gone_order: u64,
    /// The version its calls are reported under, as counted in [`Fleet::running`] while it is
    /// connected: its Hello's number (also one listed as running 0), then each it ACKs.
    counted_as: u64,
}

/// About how much memory a disconnected agent's entry holds: its status as encoded, each
/// label's two strings and map slot, and the entry around them (its report record, stream
/// numbers, the map's own slot). An estimate for [`MAX_DISCONNECTED_BYTES`], not a measure.
fn gone_size(status: &pb::AgentStatus) -> usize {
    use prost::Message as _;
    status.encoded_len() + status.labels.len() * 96 + 1024
}

/// The token a stream authenticated with: its name, the digest of its secret, and how many
/// agents it may have connected at once.
#[derive(Clone, Copy, Debug)]
pub struct StreamToken<'a> {
    /// The token's name in the tokens file.
    pub name: &'a str,
    /// The SHA-256 digest of its secret.
    pub secret_digest: [u8; 32],
    /// Its `max_agents` in the tokens file (`None`: only the control plane's own limit).
    pub max_agents: Option<usize>,
    /// The tokens in force, to name the token a connected agent's stream holds now (a reload
    /// may have renamed it since it registered); `None` in tests without a tokens file.
    pub in_force: Option<&'a crate::auth::Tokens>,
}

impl Entry {
    /// Marks the agent seen now on the wall clock, never before its stream connected: a
    /// clock set back since (an NTP step) would show it seen before it connected.
    fn seen_now(&mut self) {
        self.status.last_seen_unix_ms = unix_ms().max(self.status.connected_since_unix_ms);
    }

    /// Whether status lists it: always while connected; once disconnected, unless ephemeral.
    fn listed(&self) -> bool {
        self.status.connected || !self.ephemeral
    }
}

/// A token bucket limiting how fast an agent id's metrics reports are counted: full until
/// its first report, then refilled at the limit's rate up to its burst.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReportBucket {
    tokens: f64,
    /// When it was last refilled; `None` while full and unused.
    refilled: Option<tokio::time::Instant>,
}

impl ReportBucket {
    /// Refills for the time since the last call at `per_second`, up to `burst`, then takes a
    /// token if there is one.
    pub fn take(&mut self, now: tokio::time::Instant, per_second: f64, burst: f64) -> bool {
        self.tokens = match self.refilled {
            Some(at) => {
                let elapsed = now.saturating_duration_since(at).as_secs_f64();
                (self.tokens + elapsed * per_second).min(burst)
            }
            None => burst,
        };
        self.refilled = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A snapshot an agent refused (NACKed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// Its version.
    pub version: u64,
    /// Its content hash: a store that was reset can publish other content under the same
    /// number, which the agent has not refused.
    pub content_hash: String,
}

#[derive(Debug, Default)]
struct Inner {
    agents: HashMap<String, Entry>,
    next_generation: u64,
    connected: usize,
    /// Streams in the order they ended (tokio's clock), with the generation that ended: an
    /// entry whose agent reconnected since has another generation and is not forgotten.
    gone: VecDeque<(tokio::time::Instant, String, u64)>,
    /// Entries kept but not listed (ephemeral and disconnected), so that the count of listed
    /// agents is `agents.len() - hidden` without a scan under the lock.
    hidden: usize,
    /// The sum of the disconnected entries' [`Entry::gone_size`].
    gone_bytes: usize,
    /// Streams ended so far (see [`Entry::gone_order`]).
    disconnects: u64,
    /// The version served when an agent last named a version past it (see
    /// [`Registration::never_held`]).
    never_held_at: Option<u64>,
    /// The report records of agents forgotten last.
    forgotten: Forgotten,
    /// Connected agents per token, by the digest of its secret (none without a tokens file),
    /// for the tokens' own `max_agents`. By secret, not by name: a reload may rename a token
    /// (its agents stay its own), or give a name to another secret (a rotation that keeps the
    /// old secret under another name), and a token is the secret its agents present.
    by_token: HashMap<[u8; 32], usize>,
}

impl Inner {
    /// One more connected agent of the token whose secret has `digest` (`None`: no tokens).
    fn token_in(&mut self, digest: Option<[u8; 32]>) {
        if let Some(digest) = digest {
            *self.by_token.entry(digest).or_default() += 1;
        }
    }

    /// One connected agent of that token fewer.
    fn token_out(&mut self, digest: Option<[u8; 32]>) {
        if let Some(digest) = digest
            && let Some(count) = self.by_token.get_mut(&digest)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.by_token.remove(&digest);
            }
        }
    }
}

impl Inner {
    /// Removes `id`'s entry, keeping `hidden` right.
    fn remove(&mut self, id: &str) -> Option<Entry> {
        let entry = self.agents.remove(id)?;
        if !entry.listed() {
            self.hidden -= 1;
        }
        self.gone_bytes = self.gone_bytes.saturating_sub(entry.gone_size);
        Some(entry)
    }

    /// Forgets `id`'s entry (the forget time, or the prune): its report record is kept apart,
    /// but an ephemeral agent's (one call, a random id, gone for good: `retryplane request
    /// --server` runs, which would push out the records of agents that come back).
    fn forget(&mut self, id: String) {
        if let Some(entry) = self.remove(&id)
            && entry.long_lived
            && entry.reports.any_decided()
        {
            self.forgotten.keep(id, entry.reports);
        }
    }
}

/// The report records ([`crate::report_seq`]) of forgotten agents, the newest
/// [`MAX_FORGOTTEN`]: an agent that comes back after it was forgotten gets its record back, so
/// that a report it sends again (one counted just before its stream broke, whose ack it never
/// got) is counted once.
#[derive(Debug, Default)]
struct Forgotten {
    /// Agent id → when it was kept (a number) and its record.
    records: HashMap<String, (u64, ReportSeqs)>,
    /// The ids in the order they were kept, with that number: one whose number differs from
    /// its record's (taken back, or kept again since) is stale.
    order: VecDeque<(String, u64)>,
    kept: u64,
}

impl Forgotten {
    fn keep(&mut self, id: String, reports: ReportSeqs) {
        self.kept += 1;
        self.records.insert(id.clone(), (self.kept, reports));
        self.order.push_back((id, self.kept));
        while self.records.len() > MAX_FORGOTTEN {
            let Some((id, kept)) = self.order.pop_front() else {
                break;
            };
            if self.records.get(&id).is_some_and(|(k, _)| *k == kept) {
                self.records.remove(&id);
            }
        }
        // Stale ids pile up as agents come back: dropped once they are as many as the rest.
        if self.order.len() > 2 * MAX_FORGOTTEN {
            let records = &self.records;
            self.order
                .retain(|(id, kept)| records.get(id).is_some_and(|(k, _)| k == kept));
        }
    }

    /// `id`'s record, if it was forgotten and is still kept.
    fn take(&mut self, id: &str) -> Option<ReportSeqs> {
        self.records.remove(id).map(|(_, reports)| reports)
    }
}

/// Connected agents counted by version, from [`Fleet::versions`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetVersions {
    /// Version applied → connected agents running it (0 = none yet, or content this control
    /// plane does not know; see [`Fleet::register_with_token`]).
    pub applied: BTreeMap<u64, u64>,
    /// Version refused → connected agents whose last answer was a NACK of it.
    pub nacked: BTreeMap<u64, u64>,
}

/// Sets an agent's last answer, reusing the string's buffer: an ACK of every push from every
/// agent would otherwise allocate.
fn set_response(last: &mut String, answer: &str) {
    if last != answer {
        last.clear();
        last.push_str(answer);
    }
}

/// The fleet registry.
#[derive(Debug)]
pub struct Fleet {
    inner: Mutex<Inner>,
    max_agents: usize,
    /// How long a disconnected agent stays listed; `None`: until it is among the longest gone
    /// once more than [`MAX_DISCONNECTED`] are listed (see [`prune`]).
    forget_after: Option<Duration>,
    /// Agents with an open stream, set under the lock with every change of the count, so two
    /// streams changing it at once cannot leave it stale.
    connected_gauge: Gauge,
    /// Connected agents per service and version, changed under the lock with every change of
    /// what a connected agent runs.
    running: Arc<AgentsRunning>,
    /// When the registry was made, Unix milliseconds.
    started_unix_ms: u64,
}

/// The highest stream number (`Hello.stream`) registered for each of the last
/// [`StreamNumbers::PROCESSES`] processes (`Hello.instance_id`) with one agent id, most recent
/// first; unnumbered streams and processes (0) are not kept. A few, not one: a process that
/// restarts keeping its agent id, or a second process with the same id (which the agent warns
/// of), registers in between a process's streams.
#[derive(Clone, Copy, Debug, Default)]
struct StreamNumbers([(u64, u64); StreamNumbers::PROCESSES]);

impl StreamNumbers {
    /// How many processes are remembered.
    const PROCESSES: usize = 4;

    /// The higher number `instance_id` has registered, if `stream` is lower than it (both
    /// non-zero): a stream that process gave up.
    fn later_than(&self, instance_id: u64, stream: u64) -> Option<u64> {
        if instance_id == 0 || stream == 0 {
            return None;
        }
        self.0
            .iter()
            .find(|(instance, _)| *instance == instance_id)
            .map(|&(_, highest)| highest)
            .filter(|&highest| stream < highest)
    }

    /// These numbers with `stream` of `instance_id` registered.
    fn registered(mut self, instance_id: u64, stream: u64) -> Self {
        if instance_id == 0 || stream == 0 {
            return self;
        }
        let at = self
            .0
            .iter()
            .position(|(instance, _)| *instance == instance_id)
            .unwrap_or(Self::PROCESSES - 1);
        // Most recent first: the ones before `at` move down one place, the last is dropped
        // when `instance_id` was not there. (`stream` is its highest: a lower one is refused.)
        self.0.copy_within(..at, 1);
        self.0[0] = (instance_id, stream);
        self
    }
}

/// A stream's registration: its generation and the signal that it was replaced.
#[derive(Debug)]
pub struct Registration {
    /// Identifies this stream among registrations of the same agent id.
    pub generation: u64,
    /// Resolves when a newer stream with the same agent id takes over.
    pub replaced: oneshot::Receiver<()>,
    /// The snapshot an earlier stream of this agent id pushed and the agent refused: not to be
    /// pushed to it again.
    pub refused: Option<Refused>,
    /// The version the agent is listed as running: its Hello's, or 0 when that names content
    /// this control plane does not have (see [`Fleet::register_with_token`]). The stream goes by it, so
    /// an agent listed so gets the current version pushed, and its ACK lists it right, even
    /// when the current version changed after it was judged (unless the current version became
    /// the one the Hello named: see [`Fleet::runs`]).
    pub applied_version: u64,
    /// Set (to the version served) for the first agent whose Hello names a version past it,
    /// one this store never reached (it was reset, or its file lost), per version served: to
    /// be warned of once, not for every agent of the fleet.
    pub never_held: Option<u64>,
}

/// Why a stream could not register.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegisterError {
    /// The server holds its maximum number of connected agents.
    #[error(
        "the control plane already serves its maximum of {limit} agent{s}",
        limit = .0,
        s = if *.0 == 1 { "" } else { "s" }
    )]
    Full(usize),
    /// The stream's token has as many agents connected as its `max_agents` in the tokens file.
    #[error(
        "token `{token}` already has {connected} agent{} connected, and its `max_agents` in \
         the control plane's tokens file is {limit}",
        if *connected == 1 { "" } else { "s" }
    )]
    TokenFull {
        /// The token's name.
        token: String,
        /// Its agents connected now.
        connected: usize,
        /// Its `max_agents`.
        limit: usize,
    },
    /// A stream of another token holds the agent id: a stream replaces only one of its own
    /// token, so that one token's holder cannot push another's agents off the control plane.
    #[error(
        "this agent id is connected with another token; a stream replaces one with the same id \
         only when it has the same token (is the id shared by agents of two services?)"
    )]
    HeldByAnotherToken,
    /// The agent's process has opened a later stream: this one, numbered lower, is one it gave
    /// up, whose Hello came late.
    #[error(
        "this agent process has opened a later stream (number {later}; this one is number \
         {this}): a stream it gave up is not taken"
    )]
    Superseded {
        /// The later stream's number.
        later: u64,
        /// This stream's number.
        this: u64,
    },
}

impl Fleet {
    /// An empty registry accepting up to `max_agents` connected agents.
    pub fn new(max_agents: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            max_agents,
            forget_after: Some(FORGET_DISCONNECTED_AFTER),
            connected_gauge: Gauge::default(),
            running: Arc::default(),
            started_unix_ms: unix_ms(),
        }
    }

    /// When this registry was made (the control plane's start), Unix milliseconds: it knows
    /// only the agents that connected since.
    pub fn started_unix_ms(&self) -> u64 {
        self.started_unix_ms
    }

    /// Connected agents per calling service and the version their calls are reported under,
    /// which the registry keeps (see [`crate::running`]): what the aggregator's series go by.
    pub fn running(&self) -> Arc<AgentsRunning> {
        self.running.clone()
    }

    /// The registry, forgetting an agent `forget_after` after its stream ended (`None`: only
    /// when more than [`MAX_DISCONNECTED`] disconnected agents are listed and it is among the
    /// longest gone).
    #[must_use]
    pub fn forgetting_after(mut self, forget_after: Option<Duration>) -> Self {
        self.forget_after = forget_after;
        self
    }

    /// Forgets the agents whose stream ended `forget_after` ago or more and who did not come
    /// back since. Oldest first, so each call looks only at what it removes, and one more.
    fn forget_gone(&self, inner: &mut Inner) {
        let Some(forget_after) = self.forget_after else {
            return;
        };
        let now = tokio::time::Instant::now();
        while let Some((ended, _, _)) = inner.gone.front()
            && now.saturating_duration_since(*ended) >= forget_after
        {
            let Some((_, id, generation)) = inner.gone.pop_front() else {
                break;
            };
            if inner
                .agents
                .get(&id)
                .is_some_and(|e| e.generation == generation && !e.status.connected)
            {
                inner.forget(id);
            }
        }
    }

    /// The gauge of agents with an open stream (`retryplane_server_agents_connected`); the
    /// registry keeps it equal to [`Fleet::connected`].
    pub fn connected_gauge(&self) -> Gauge {
        self.connected_gauge.clone()
    }

    fn set_gauge(&self, inner: &Inner) {
        self.connected_gauge
            .set(i64::try_from(inner.connected).unwrap_or(i64::MAX));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`Fleet::register_with_token`] with no token (a control plane without a tokens file).
    #[cfg(test)]
    pub fn register(
        &self,
        hello: &pb::Hello,
        peer: Option<SocketAddr>,
        current: Option<(u64, &str)>,
    ) -> Result<Registration, RegisterError> {
        self.register_with_token(hello, peer, current, None)
    }

    /// Registers a stream from `hello` that authenticated with `token` (`None` without a tokens
    /// file), replacing any earlier stream of the same agent id and token; an id connected with
    /// another token is refused. A token is the same when its secret is, or its name is the
    /// name the held stream's secret has in the tokens in force (`token.in_force`; the name it
    /// registered with once its secret is gone): a reload that renames a token, or one that
    /// gives its name a new secret and drops the old one, does not lock its own agents out
    /// while their old streams are still open. One that keeps the old secret under another
    /// name makes two tokens, which the fleet cannot tell from a name given to another team's
    /// token: the new secret's agents wait for their old streams to end. `current` is the version the control plane
    /// serves now and its content hash (`None` before the first one): a Hello with a content
    /// hash that names that version's number with
    /// another hash, or a higher number (the agent ran on a control plane whose store was since
    /// reset and seeded again, so numbers repeat with other content), is listed as running no
    /// known version (0) until it answers the push.
    pub fn register_with_token(
        &self,
        hello: &pb::Hello,
        peer: Option<SocketAddr>,
        current: Option<(u64, &str)>,
        token: Option<StreamToken<'_>>,
    ) -> Result<Registration, RegisterError> {
        let now = unix_ms();
        let mut inner = self.lock();
        self.forget_gone(&mut inner);
        let held = inner
            .agents
            .get(&hello.agent_id)
            .filter(|e| e.status.connected);
        // The same token: the same secret, or the same name, as the held stream's secret is
        // named now (a reload that renamed it and gave its old name to another team's token
        // does not let that token push its agents off); the name it registered with when its
        // secret is no longer in force (a rotation, whose old streams are being ended).
        let same_token = |e: &Entry| match token {
            Some(t) => {
                let held_name = e
                    .secret_digest
                    .and_then(|d| t.in_force?.name_of_digest(&d))
                    .unwrap_or(&e.status.token);
                held_name == t.name || e.secret_digest == Some(t.secret_digest)
            }
            None => e.secret_digest.is_none(),
        };
        if held.is_some_and(|e| !same_token(e)) {
            return Err(RegisterError::HeldByAnotherToken);
        }
        // Whether or not that later stream is still open, and whichever process registered
        // since: the process gave this one up.
        if let Some(later) = inner
            .agents
            .get(&hello.agent_id)
            .and_then(|e| e.streams.later_than(hello.instance_id, hello.stream))
        {
            return Err(RegisterError::Superseded {
                later,
                this: hello.stream,
            });
        }
        let replacing = held.is_some();
        if !replacing && inner.connected >= self.max_agents {
            return Err(RegisterError::Full(self.max_agents));
        }
        // A replacement takes its agent's place; a new agent must fit its token's own limit, and
        // so must one that replaces an agent of another secret (a token given a name another
        // secret had: that agent is new to this token's count).
        let same_secret = held.is_some_and(|e| e.secret_digest == token.map(|t| t.secret_digest));
        if !same_secret
            && let Some(t) = token
            && let Some(limit) = t.max_agents
            && let connected = inner.by_token.get(&t.secret_digest).copied().unwrap_or(0)
            && connected >= limit
        {
            return Err(RegisterError::TokenFull {
                token: t.name.to_owned(),
                connected,
                limit,
            });
        }
        inner.next_generation += 1;
        let generation = inner.next_generation;
        let (tx, rx) = oneshot::channel();
        let previous = inner.remove(&hello.agent_id);
        let mut streams = StreamNumbers::default();
        let mut reports = ReportSeqs::default();
        let mut bucket = ReportBucket::default();
        // The last NACK, if the same process comes back and does not run the version it refused.
        let mut refused = None;
        // The last ACK's version and content hash, if the same process comes back: still its
        // last answer while it runs that content.
        let mut acked = None;
        let mut long_lived = !hello.ephemeral;
        if let Some(mut old) = previous {
            long_lived |= old.long_lived;
            if let Some(kick) = old.replaced.take() {
                let _ = kick.send(());
            }
            if old.status.connected {
                inner.connected -= 1;
                inner.token_out(old.secret_digest);
                self.running.left(&old.status.service, old.counted_as);
            }
            reports = old.reports;
            bucket = old.bucket;
            streams = old.streams;
            // Kept only from a stream of the same process: the entry's `instance_id` is the
            // one that refused it (a NACK is recorded only with a non-zero id).
            let same_process = old.instance_id == hello.instance_id;
            // An agent that runs the refused version has no NACK to keep; one that names its
            // number with other content (its last store's, before a reset) still refuses it.
            let runs = |r: &Refused| {
                r.version == hello.last_applied_version
                    && (hello.last_applied_hash.is_empty()
                        || hello.last_applied_hash == r.content_hash)
            };
            acked = (same_process && old.instance_id != 0 && old.status.last_response == "ack")
                .then(|| (old.status.last_response_version, old.acked_hash.clone()));
            refused = old
                .refused
                .filter(|r| same_process && !runs(r))
                .map(|r| (r, old.status.last_error));
        } else if let Some(kept) = inner.forgotten.take(&hello.agent_id) {
            // Forgotten, and back: the reports it counted are still counted (and were kept
            // for a long-lived agent).
            reports = kept;
            long_lived = true;
        }
        reports.hello(hello.instance_id);
        // A number this store has not reached (numbers only go up; a rollback gets a new one)
        // is another store's content, with or without a hash; so is the current version's
        // number with another hash. An agent that sends no hash is otherwise judged by the
        // number, as the push decision does.
        // The version served, when the Hello names a number past it (flagged once per version
        // served: see `Registration::never_held`).
        let past = current.filter(|(version, _)| hello.last_applied_version > *version);
        let other_content = match current {
            Some((version, hash)) => {
                past.is_some()
                    || (hello.last_applied_version == version
                        && !hello.last_applied_hash.is_empty()
                        && hello.last_applied_hash != hash)
            }
            None => hello.last_applied_version > 0,
        };
        let never_held = past
            .map(|(version, _)| version)
            .filter(|version| inner.never_held_at != Some(*version));
        if never_held.is_some() {
            inner.never_held_at = never_held;
        }
        let applied_version = if other_content {
            0
        } else {
            hello.last_applied_version
        };
        // A NACK carried over, else an ACK of the version the agent says it still runs (a
        // stream that dropped and came back has answered nothing new, but its last answer
        // stands); else nothing answered on this agent's behalf yet.
        let (last_response, last_response_version, last_error, acked_hash) = match (&refused, acked)
        {
            (Some((r, error)), _) => ("nack".to_owned(), r.version, error.clone(), String::new()),
            (None, Some((v, hash)))
                if v == applied_version
                    && v != 0
                    && (hello.last_applied_hash.is_empty() || hello.last_applied_hash == hash) =>
            {
                ("ack".to_owned(), v, String::new(), hash)
            }
            _ => (String::new(), 0, String::new(), String::new()),
        };
        let refused = refused.map(|(r, _)| r);
        let status = pb::AgentStatus {
            agent_id: hello.agent_id.clone(),
            service: hello.service.clone(),
            labels: hello.labels.clone(),
            peer: peer.map(|p| p.to_string()).unwrap_or_default(),
            agent_version: hello.agent_version.clone(),
            connected: true,
            connected_since_unix_ms: now,
            last_seen_unix_ms: now,
            applied_version,
            last_response,
            last_response_version,
            last_error,
            token: token.map(|t| t.name.to_owned()).unwrap_or_default(),
        };
        inner.agents.insert(
            hello.agent_id.clone(),
            Entry {
                status,
                generation,
                replaced: Some(tx),
                reports,
                refused: refused.clone(),
                acked_hash,
                instance_id: hello.instance_id,
                streams: streams.registered(hello.instance_id, hello.stream),
                bucket,
                ephemeral: hello.ephemeral,
                long_lived,
                secret_digest: token.map(|t| t.secret_digest),
                gone_size: 0,
                gone_order: 0,
                counted_as: hello.last_applied_version,
            },
        );
        inner.connected += 1;
        inner.token_in(token.map(|t| t.secret_digest));
        self.running
            .joined(&hello.service, hello.last_applied_version);
        self.set_gauge(&inner);
        Ok(Registration {
            applied_version,
            generation,
            replaced: rx,
            refused,
            never_held,
        })
    }

    fn update(&self, id: &str, generation: u64, f: impl FnOnce(&mut Entry)) {
        let mut inner = self.lock();
        if let Some(entry) = inner.agents.get_mut(id)
            && entry.generation == generation
        {
            entry.seen_now();
            f(entry);
        }
    }

    /// A connected agent's calls are reported under `version` from now on.
    fn counts_as(&self, entry: &mut Entry, version: u64) {
        if entry.status.connected {
            self.running
                .moved(&entry.status.service, entry.counted_as, version);
            entry.counted_as = version;
        }
    }

    /// The agent runs `version`: its Hello named it with the content hash this control plane
    /// published it with, after the Hello was judged (so it was listed as running 0), or it
    /// ACKed a push sent before the last one. Its last answer stays as it was.
    pub fn runs(&self, id: &str, generation: u64, version: u64) {
        self.update(id, generation, |e| {
            e.status.applied_version = version;
            self.counts_as(e, version);
        });
    }

    /// The agent sent something ([`Fleet::ack`] and [`Fleet::nack`] count as seen too).
    pub fn seen(&self, id: &str, generation: u64) {
        self.update(id, generation, |_| {});
    }

    /// An unnumbered metrics report of agent `id` arrived on the stream of registration
    /// `generation` (which it marks seen, when that is still the agent's stream): whether it
    /// is counted, as `admit` decides with the agent id's [`ReportBucket`] (`None` for an
    /// unknown agent id, whose entry was pruned: the stream then uses its own).
    pub fn admit_report(
        &self,
        id: &str,
        generation: u64,
        admit: impl FnOnce(Option<&mut ReportBucket>) -> bool,
    ) -> bool {
        self.on_report(id, generation, |entry| match entry {
            Some(entry) => admit(Some(&mut entry.bucket)),
            None => admit(None),
        })
    }

    /// Runs `f` on agent `id`'s entry (`None` when it was pruned), under the lock, having
    /// marked it seen when `generation` is still its stream: what every metrics report does.
    fn on_report<T>(
        &self,
        id: &str,
        generation: u64,
        f: impl FnOnce(Option<&mut Entry>) -> T,
    ) -> T {
        let mut inner = self.lock();
        let mut entry = inner.agents.get_mut(id);
        if let Some(entry) = entry.as_deref_mut()
            && entry.generation == generation
        {
            entry.seen_now();
        }
        f(entry)
    }

    /// A metrics report numbered `seq` (> 0) by process `instance` of agent `id` arrived on the
    /// stream of registration `generation` (which it marks seen, when that is still the
    /// agent's stream). Decided against every report of the agent id counted so far, whichever
    /// stream brought it, so that a report sent again is counted once; `admit` (the rate
    /// limit, given the agent id's [`ReportBucket`]) is asked only about a report not counted
    /// before. An unknown agent id (its entry pruned) has no record: the report is decided by
    /// `admit` alone, given `None`.
    pub fn claim_report(
        &self,
        id: &str,
        generation: u64,
        instance: u64,
        seq: u64,
        admit: impl FnOnce(Option<&mut ReportBucket>) -> bool,
    ) -> ReportVerdict {
        self.on_report(id, generation, |entry| match entry {
            Some(entry) => {
                let bucket = &mut entry.bucket;
                entry.reports.claim(instance, seq, || admit(Some(bucket)))
            }
            None if admit(None) => ReportVerdict::Count,
            None => ReportVerdict::Refused,
        })
    }

    /// The agent acknowledged `version` (with `content_hash`); its last NACK is forgotten.
    pub fn ack(&self, id: &str, generation: u64, version: u64, content_hash: &str) {
        self.update(id, generation, |e| {
            self.counts_as(e, version);
            e.refused = None;
            content_hash.clone_into(&mut e.acked_hash);
            let s = &mut e.status;
            s.applied_version = version;
            set_response(&mut s.last_response, "ack");
            s.last_response_version = version;
            s.last_error.clear();
        });
    }

    /// The agent refused `version` (with `content_hash`); it keeps running what it had. Kept
    /// across the agent's streams (see the module docs).
    pub fn nack(&self, id: &str, generation: u64, version: u64, content_hash: &str, error: &str) {
        let error = error[..error.floor_char_boundary(MAX_ERROR_LEN)].to_owned();
        self.update(id, generation, |e| {
            // A stream without an instance id cannot be told from a restarted process: its
            // NACK is shown, but not carried over to its next stream.
            e.refused = (e.instance_id != 0).then(|| Refused {
                version,
                content_hash: content_hash.to_owned(),
            });
            let s = &mut e.status;
            set_response(&mut s.last_response, "nack");
            s.last_response_version = version;
            s.last_error = error;
        });
    }

    /// After a tokens reload: each connected agent is listed with the name its token's secret
    /// has now (`name_of` its digest; `None`, a secret taken away, leaves the name: that
    /// stream is being ended).
    pub fn rename_tokens<'t>(&self, name_of: impl Fn(&[u8; 32]) -> Option<&'t str>) {
        let mut inner = self.lock();
        for entry in inner.agents.values_mut().filter(|e| e.status.connected) {
            if let Some(name) = entry.secret_digest.as_ref().and_then(&name_of)
                && entry.status.token != name
            {
                name.clone_into(&mut entry.status.token);
            }
        }
    }

    /// The stream of this registration ended.
    pub fn disconnected(&self, id: &str, generation: u64) {
        let mut inner = self.lock();
        inner.disconnects += 1;
        let order = inner.disconnects;
        let ended = match inner.agents.get_mut(id) {
            Some(entry) if entry.generation == generation && entry.status.connected => {
                entry.status.connected = false;
                entry.replaced = None;
                entry.gone_size = gone_size(&entry.status);
                entry.gone_order = order;
                self.running.left(&entry.status.service, entry.counted_as);
                Some((entry.ephemeral, entry.secret_digest, entry.gone_size))
            }
            _ => None,
        };
        if let Some((ephemeral, token, size)) = ended {
            inner.gone_bytes += size;
            inner.connected -= 1;
            inner.token_out(token);
            if ephemeral {
                inner.hidden += 1;
            }
            self.set_gauge(&inner);
            if self.forget_after.is_some() {
                let ended_at = tokio::time::Instant::now();
                inner.gone.push_back((ended_at, id.to_owned(), generation));
                // Agents that come and go quickly leave stale records (they reconnected since):
                // past a bound, keep only those of agents still gone, which are at most
                // MAX_DISCONNECTED + 1, so the records stay bounded at O(1) amortised cost.
                if inner.gone.len() > 2 * MAX_DISCONNECTED + self.max_agents {
                    let Inner { agents, gone, .. } = &mut *inner;
                    gone.retain(|(_, id, generation)| {
                        agents
                            .get(id)
                            .is_some_and(|e| e.generation == *generation && !e.status.connected)
                    });
                }
            }
            self.forget_gone(&mut inner);
            prune(&mut inner);
        }
    }

    /// Agents with an open stream.
    pub fn connected(&self) -> usize {
        self.lock().connected
    }

    /// Connected agents by the version they run, and connected agents whose last answer was a
    /// NACK by the version they refused; for the fleet gauges of `/metrics`.
    pub fn versions(&self) -> FleetVersions {
        let inner = self.lock();
        let mut out = FleetVersions::default();
        for s in inner
            .agents
            .values()
            .map(|e| &e.status)
            .filter(|s| s.connected)
        {
            *out.applied.entry(s.applied_version).or_default() += 1;
            if s.last_response == "nack" {
                *out.nacked.entry(s.last_response_version).or_default() += 1;
            }
        }
        out
    }

    /// Every listed agent, sorted by id.
    pub fn status(&self) -> Vec<pb::AgentStatus> {
        self.status_and_counts(true).0
    }

    /// Every listed agent sorted by id (none unless `list`), the agents connected now, and the
    /// agents known (connected, and disconnected ones still listed), all read at one instant.
    pub fn status_and_counts(&self, list: bool) -> (Vec<pb::AgentStatus>, usize, usize) {
        let page = self.status_page(list, "", usize::MAX, usize::MAX);
        (page.agents, page.connected, page.known)
    }

    /// At most `size` listed agents (none unless `list`) whose ids sort after `after` (every
    /// one when it is empty), sorted by id, and no more than fit `max_bytes` as encoded (one
    /// at least), with the counts of [`Fleet::status_and_counts`], all read at one instant.
    pub fn status_page(&self, list: bool, after: &str, size: usize, max_bytes: usize) -> FleetPage {
        let mut inner = self.lock();
        self.forget_gone(&mut inner);
        // Only the page is copied, so a page costs the lock (which every report takes) a sort
        // of references, not a copy of every agent after it.
        let mut more = false;
        let agents: Vec<pb::AgentStatus> = if list {
            let listed: Vec<&Entry> = inner
                .agents
                .values()
                .filter(|e| e.listed() && e.status.agent_id.as_str() > after)
                .collect();
            let (page, cut) = first_in_order(listed, size, max_bytes, PAGE_CHUNK);
            more = cut;
            page.into_iter().map(|e| e.status.clone()).collect()
        } else {
            Vec::new()
        };
        debug_assert!(inner.hidden <= inner.agents.len());
        let known = inner.agents.len().saturating_sub(inner.hidden);
        let connected = inner.connected;
        drop(inner);
        let next = match agents.last() {
            Some(last) if more => last.agent_id.clone(),
            _ => String::new(),
        };
        FleetPage {
            agents,
            next,
            connected,
            known,
        }
    }
}

/// How many agents [`first_in_order`] sorts first: a page cut by bytes (agents choose how
/// large their entries are, up to about 87 KB) holds a few dozen of the largest, so sorting
/// every agent after the page's start for each page, under the fleet's lock, would cost a
/// listing of the whole fleet a sort of it per page.
const PAGE_CHUNK: usize = 1024;

/// The first of `listed` by agent id, at most `size` of them and no more than fit `max_bytes`
/// as encoded (one at least), in order; and whether any were left out. Chosen by chunks, the
/// first of `chunk` agents and each next one twice the last (each a selection over those
/// left, then a sort of the chunk), so that a page costs a few passes over the agents and a
/// sort of about the page, not a sort of them all.
fn first_in_order(
    mut listed: Vec<&Entry>,
    size: usize,
    max_bytes: usize,
    chunk: usize,
) -> (Vec<&Entry>, bool) {
    let by_id = |a: &&Entry, b: &&Entry| a.status.agent_id.cmp(&b.status.agent_id);
    let mut page = Vec::new();
    let mut bytes = 0usize;
    let mut chunk = chunk.max(1);
    while page.len() < size && !listed.is_empty() {
        let take = chunk.min(size - page.len()).min(listed.len());
        chunk = chunk.saturating_mul(2);
        if listed.len() > take {
            listed.select_nth_unstable_by(take, by_id);
        }
        let mut next: Vec<&Entry> = listed.drain(..take).collect();
        next.sort_unstable_by(by_id);
        for (i, entry) in next.iter().enumerate() {
            bytes = bytes.saturating_add(prost::Message::encoded_len(&entry.status) + 4);
            if bytes > max_bytes && !page.is_empty() {
                return (page, true);
            }
            page.push(*entry);
            if bytes > max_bytes {
                // One agent larger than the bound: sent alone.
                return (page, i + 1 < next.len() || !listed.is_empty());
            }
        }
    }
    let more = !listed.is_empty();
    (page, more)
}

/// One page of [`Fleet::status_page`].
#[derive(Debug, PartialEq)]
pub struct FleetPage {
    /// The agents of the page, sorted by id.
    pub agents: Vec<pb::AgentStatus>,
    /// The id of the page's last agent when more follow it; empty when none does.
    pub next: String,
    /// Agents connected now.
    pub connected: usize,
    /// Agents known: connected, and disconnected ones still listed.
    pub known: usize,
}

/// How many disconnected agents are kept when more than [`MAX_DISCONNECTED`] are: a tenth
/// fewer, so that the sort of them all is paid once per thousand disconnects, not on each (at
/// the cap, each disconnect of a rolling restart took 3.5 ms under the fleet's lock).
const PRUNED_TO: usize = MAX_DISCONNECTED - MAX_DISCONNECTED / 10;

/// What the disconnected agents' entries are pruned to once they hold more than
/// [`MAX_DISCONNECTED_BYTES`]: a tenth less, as for [`PRUNED_TO`].
const PRUNED_TO_BYTES: usize = MAX_DISCONNECTED_BYTES - MAX_DISCONNECTED_BYTES / 10;

/// Drops the longest-gone disconnected agents, ephemeral ones first, once more than
/// [`MAX_DISCONNECTED`] are kept or they hold more than [`MAX_DISCONNECTED_BYTES`]: down to
/// [`PRUNED_TO`] and [`PRUNED_TO_BYTES`].
fn prune(inner: &mut Inner) {
    let gone = inner.agents.len() - inner.connected;
    if gone <= MAX_DISCONNECTED && inner.gone_bytes <= MAX_DISCONNECTED_BYTES {
        return;
    }
    let mut disconnected: Vec<(bool, u64, String)> = inner
        .agents
        .values()
        .filter(|e| !e.status.connected)
        .map(|e| {
            let id = e.status.agent_id.clone();
            (!e.ephemeral, e.gone_order, id)
        })
        .collect();
    disconnected.sort_unstable();
    let mut left = gone;
    for (_, _, id) in disconnected {
        if left <= PRUNED_TO && inner.gone_bytes <= PRUNED_TO_BYTES {
            break;
        }
        inner.forget(id);
        left -= 1;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn hello(id: &str) -> pb::Hello {
        pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            ..Default::default()
        }
    }

    #[test]
    fn a_second_stream_with_the_same_id_replaces_the_first() {
        let fleet = Fleet::new(10);
        let mut first = fleet.register(&hello("a"), None, None).unwrap();
        let second = fleet.register(&hello("a"), None, None).unwrap();
        assert!(first.replaced.try_recv().is_ok());
        assert_eq!(fleet.connected(), 1);
        // The first stream's late updates are ignored.
        fleet.ack("a", first.generation, 7, "h7");
        fleet.disconnected("a", first.generation);
        assert_eq!(fleet.connected(), 1);
        let status = fleet.status();
        assert_eq!(status[0].applied_version, 0);
        assert!(status[0].connected);
        fleet.ack("a", second.generation, 7, "h7");
        assert_eq!(fleet.status()[0].applied_version, 7);
    }

    #[test]
    fn a_connected_id_is_replaced_only_by_a_stream_of_the_same_token() {
        let fleet = Fleet::new(10);
        let token = |name, secret: u8| {
            Some(StreamToken {
                name,
                secret_digest: [secret; 32],
                max_agents: None,
                in_force: None,
            })
        };
        let mut first = fleet
            .register_with_token(&hello("a"), None, None, token("payments", 1))
            .unwrap();
        let refused = fleet.register_with_token(&hello("a"), None, None, token("checkout", 2));
        assert_eq!(refused.err(), Some(RegisterError::HeldByAnotherToken));
        assert!(first.replaced.try_recv().is_err(), "the first stream stays");
        assert_eq!(fleet.status()[0].token, "payments");
        // The same token replaces it, be it by its name (a new secret) or by its secret (a
        // reload renamed it); once gone, the id is anyone's.
        let mut second = fleet
            .register_with_token(&hello("a"), None, None, token("payments", 3))
            .unwrap();
        assert!(first.replaced.try_recv().is_ok());
        let third = fleet
            .register_with_token(&hello("a"), None, None, token("payments-2026", 3))
            .unwrap();
        assert!(second.replaced.try_recv().is_ok());
        assert_eq!(fleet.status()[0].token, "payments-2026");
        fleet.disconnected("a", third.generation);
        fleet
            .register_with_token(&hello("a"), None, None, token("checkout", 2))
            .unwrap();
        assert_eq!(fleet.status()[0].token, "checkout");
        assert_eq!(fleet.connected(), 1);
    }

    #[test]
    fn every_answer_and_report_marks_the_agent_seen() {
        let fleet = Fleet::new(10);
        let reg = fleet.register(&hello("a"), None, None).unwrap();
        let forget = || {
            if let Some(e) = fleet.lock().agents.get_mut("a") {
                e.status.last_seen_unix_ms = 0;
            }
        };
        let seen = || fleet.status()[0].last_seen_unix_ms > 0;
        forget();
        fleet.ack("a", reg.generation, 1, "h1");
        assert!(seen(), "ack");
        forget();
        fleet.nack("a", reg.generation, 2, "h2", "bad");
        assert!(seen(), "nack");
        forget();
        fleet.seen("a", reg.generation);
        assert!(seen(), "a report or a stale answer");
        // A stream that was replaced does not touch the new one's status.
        forget();
        fleet.ack("a", reg.generation + 1, 3, "h3");
        assert!(!seen());
    }

    #[test]
    fn nack_keeps_the_applied_version_and_records_the_error() {
        let fleet = Fleet::new(10);
        let mut h = hello("a");
        h.last_applied_version = 3;
        let reg = fleet.register(&h, None, Some((4, "h4"))).unwrap();
        fleet.nack("a", reg.generation, 4, "h4", &"x".repeat(5000));
        let s = &fleet.status()[0];
        assert_eq!(s.applied_version, 3);
        assert_eq!(s.last_response, "nack");
        assert_eq!(s.last_response_version, 4);
        assert_eq!(s.last_error.len(), MAX_ERROR_LEN);
    }

    #[test]
    fn the_last_nack_is_kept_across_streams_until_an_ack() {
        let fleet = Fleet::new(10);
        let mut h = hello("a");
        h.last_applied_version = 1;
        h.instance_id = 5;
        let first = fleet.register(&h, None, None).unwrap();
        assert_eq!(first.refused, None);
        fleet.nack("a", first.generation, 2, "h2", "bad");
        fleet.disconnected("a", first.generation);
        let second = fleet.register(&h, None, None).unwrap();
        let refused = Refused {
            version: 2,
            content_hash: "h2".to_owned(),
        };
        assert_eq!(second.refused, Some(refused.clone()));
        let s = &fleet.status()[0];
        assert_eq!(
            (
                s.last_response.as_str(),
                s.last_response_version,
                s.last_error.as_str()
            ),
            ("nack", 2, "bad")
        );
        // A replacement while connected keeps it too.
        let third = fleet.register(&h, None, None).unwrap();
        assert_eq!(third.refused, Some(refused.clone()));
        // One that names the refused version's number with other content (the store it last
        // ran on was reset) has not run it: the NACK is kept.
        h.last_applied_version = 2;
        h.last_applied_hash = "h-before-the-reset".to_owned();
        let other_content = fleet.register(&h, None, None).unwrap();
        assert_eq!(other_content.refused, Some(refused.clone()));
        assert_eq!(fleet.status()[0].last_response, "nack");
        // An agent that says it runs the refused version has no NACK to keep.
        h.last_applied_hash = "h2".to_owned();
        let runs_it = fleet.register(&h, None, None).unwrap();
        assert_eq!(runs_it.refused, None);
        assert_eq!(fleet.status()[0].last_response, "");
        // An ACK forgets it.
        h.last_applied_version = 1;
        h.last_applied_hash.clear();
        let fourth = fleet.register(&h, None, None).unwrap();
        fleet.nack("a", fourth.generation, 3, "h3", "bad");
        fleet.ack("a", fourth.generation, 4, "h4");
        assert_eq!(fleet.register(&h, None, None).unwrap().refused, None);
    }

    /// The last answer `id` is listed with, and its version.
    fn last(fleet: &Fleet, id: &str) -> (String, u64) {
        let all = fleet.status();
        let s = all.iter().find(|s| s.agent_id == id).unwrap();
        (s.last_response.clone(), s.last_response_version)
    }

    #[test]
    fn the_last_ack_is_kept_when_the_same_process_comes_back_running_that_version() {
        let fleet = Fleet::new(10);
        let current = Some((4, "h4"));
        let mut h = hello("a");
        h.instance_id = 5;
        let first = fleet.register(&h, None, current).unwrap();
        fleet.ack("a", first.generation, 4, "h4");
        fleet.disconnected("a", first.generation);
        h.last_applied_version = 4;
        h.last_applied_hash = "h4".to_owned();
        let second = fleet.register(&h, None, current).unwrap();
        assert_eq!(
            last(&fleet, "a"),
            ("ack".to_owned(), 4),
            "a dropped stream came back"
        );
        // A replacement while connected keeps it too.
        fleet.register(&h, None, current).unwrap();
        assert_eq!(last(&fleet, "a"), ("ack".to_owned(), 4));
        fleet.disconnected("a", second.generation);
        // Another process under the same id has answered nothing yet.
        h.instance_id = 6;
        fleet.register(&h, None, current).unwrap();
        assert_eq!(last(&fleet, "a"), (String::new(), 0));
        // Nor has one that says it runs another version, or other content under that number.
        let mut h = hello("b");
        h.instance_id = 7;
        let b = fleet.register(&h, None, current).unwrap();
        fleet.ack("b", b.generation, 4, "h4");
        h.last_applied_version = 3;
        fleet.register(&h, None, current).unwrap();
        assert_eq!(last(&fleet, "b"), (String::new(), 0));
        let b = fleet.register(&h, None, current).unwrap();
        fleet.ack("b", b.generation, 4, "h4");
        h.last_applied_version = 4;
        h.last_applied_hash = "other".to_owned();
        fleet.register(&h, None, current).unwrap();
        assert_eq!(last(&fleet, "b"), (String::new(), 0));
        // Once the control plane has moved past the acked number, a Hello naming that number
        // with other content (another store's) is told apart by the ACK's own hash.
        let moved_on = Some((5, "h5"));
        let mut h = hello("d");
        h.instance_id = 8;
        let d = fleet.register(&h, None, current).unwrap();
        fleet.ack("d", d.generation, 4, "h4");
        h.last_applied_version = 4;
        h.last_applied_hash = "another-store".to_owned();
        fleet.register(&h, None, moved_on).unwrap();
        assert_eq!(last(&fleet, "d"), (String::new(), 0));
        let d = fleet.register(&h, None, current).unwrap();
        h.last_applied_hash = "h4".to_owned();
        fleet.ack("d", d.generation, 4, "h4");
        fleet.register(&h, None, moved_on).unwrap();
        assert_eq!(
            last(&fleet, "d"),
            ("ack".to_owned(), 4),
            "the same content, still acked"
        );
        // An agent that gives no instance id cannot be told from a restarted one.
        let mut h = hello("c");
        let c = fleet.register(&h, None, current).unwrap();
        fleet.ack("c", c.generation, 4, "h4");
        h.last_applied_version = 4;
        fleet.register(&h, None, current).unwrap();
        let all = fleet.status();
        assert_eq!(
            all.iter()
                .find(|s| s.agent_id == "c")
                .unwrap()
                .last_response,
            ""
        );
    }

    #[test]
    fn a_restarted_agent_process_is_not_held_to_the_old_processs_nack() {
        let fleet = Fleet::new(10);
        let mut h = hello("a");
        h.last_applied_version = 1;
        h.instance_id = 5;
        let first = fleet.register(&h, None, None).unwrap();
        fleet.nack("a", first.generation, 2, "h2", "bad");
        // Another process (an upgrade, say) under the same agent id: it gets the version again.
        h.instance_id = 6;
        assert_eq!(fleet.register(&h, None, None).unwrap().refused, None);
        assert_eq!(fleet.status()[0].last_response, "");
        // A client that gives no instance id cannot be told from a restart: not carried over.
        h.instance_id = 0;
        let unnumbered = fleet.register(&h, None, None).unwrap();
        fleet.nack("a", unnumbered.generation, 2, "h2", "bad");
        assert_eq!(fleet.status()[0].last_response, "nack");
        assert_eq!(fleet.register(&h, None, None).unwrap().refused, None);
    }

    #[test]
    fn a_hello_naming_the_current_number_with_other_content_runs_no_known_version() {
        let fleet = Fleet::new(10);
        let current = Some((3, "h3"));
        let applied = |version: u64, hash: &str| {
            let mut h = hello("a");
            h.last_applied_version = version;
            h.last_applied_hash = hash.to_owned();
            fleet.register(&h, None, current).unwrap();
            fleet.status()[0].applied_version
        };
        // The current version's number from a store that was reset: not the current content.
        assert_eq!(applied(3, "h-before-the-reset"), 0);
        assert_eq!(fleet.versions().applied, BTreeMap::from([(0, 1)]));
        assert_eq!(applied(3, "h3"), 3);
        // Without a hash, the current version's number is taken at its word.
        assert_eq!(applied(3, ""), 3);
        // A lower number is not the current version whatever its content.
        assert_eq!(applied(2, "h-before-the-reset"), 2);
        // A number this store has not reached is another store's content, with or without a
        // hash.
        assert_eq!(applied(7, "h-before-the-reset"), 0);
        assert_eq!(applied(7, ""), 0);
        let mut h = hello("b");
        h.last_applied_version = 4;
        h.last_applied_hash = "h4".to_owned();
        let empty = Fleet::new(10);
        empty.register(&h, None, None).unwrap();
        assert_eq!(empty.status()[0].applied_version, 0);
        // Its ACK of the push records what it runs.
        let mut h = hello("a");
        h.last_applied_version = 3;
        h.last_applied_hash = "h-before-the-reset".to_owned();
        let reg = fleet.register(&h, None, current).unwrap();
        fleet.ack("a", reg.generation, 3, "h3");
        assert_eq!(fleet.status()[0].applied_version, 3);
    }

    #[test]
    fn the_agent_limit_refuses_new_agents_but_not_replacements() {
        let fleet = Fleet::new(1);
        let _a = fleet.register(&hello("a"), None, None).unwrap();
        assert_eq!(
            fleet.register(&hello("b"), None, None).unwrap_err(),
            RegisterError::Full(1)
        );
        assert!(fleet.register(&hello("a"), None, None).is_ok());
    }

    #[test]
    fn a_tokens_own_limit_refuses_its_new_agents_but_not_replacements_nor_other_tokens() {
        let fleet = Fleet::new(10);
        let token = |name, secret: u8, max_agents| {
            Some(StreamToken {
                name,
                secret_digest: [secret; 32],
                max_agents,
                in_force: None,
            })
        };
        let payments = |max| token("payments", 1, max);
        let _first_a = fleet
            .register_with_token(&hello("a"), None, None, payments(Some(2)))
            .unwrap();
        let _b = fleet
            .register_with_token(&hello("b"), None, None, payments(Some(2)))
            .unwrap();
        assert_eq!(
            fleet
                .register_with_token(&hello("c"), None, None, payments(Some(2)))
                .unwrap_err(),
            RegisterError::TokenFull {
                token: "payments".to_owned(),
                connected: 2,
                limit: 2
            }
        );
        assert_eq!(
            RegisterError::Full(1).to_string(),
            "the control plane already serves its maximum of 1 agent"
        );
        let one = RegisterError::TokenFull {
            token: "t".to_owned(),
            connected: 1,
            limit: 1,
        };
        assert!(
            one.to_string().contains("already has 1 agent connected"),
            "{one}"
        );
        // Its agent's next stream replaces the last; another token has its own count.
        let a = fleet
            .register_with_token(&hello("a"), None, None, payments(Some(2)))
            .unwrap();
        let _x = fleet
            .register_with_token(&hello("x"), None, None, token("checkout", 2, Some(1)))
            .unwrap();
        // One of its agents gone, a new one fits; a limit raised by a reload counts the same
        // agents.
        fleet.disconnected("a", a.generation);
        let _c = fleet
            .register_with_token(&hello("c"), None, None, payments(Some(2)))
            .unwrap();
        assert!(
            fleet
                .register_with_token(&hello("d"), None, None, payments(Some(2)))
                .is_err()
        );
        let _d = fleet
            .register_with_token(&hello("d"), None, None, payments(Some(3)))
            .unwrap();
        assert!(
            fleet
                .register_with_token(&hello("e"), None, None, payments(None))
                .is_ok(),
            "without a limit of its own"
        );
        assert_eq!(fleet.lock().by_token.get(&[1; 32]), Some(&4));
        assert_eq!(fleet.lock().by_token.get(&[2; 32]), Some(&1));
    }

    /// What [`Fleet::running`] counts of `service` under each of `versions`.
    fn running(fleet: &Fleet, service: &str, versions: &[u64]) -> Vec<u64> {
        let running = fleet.running();
        versions
            .iter()
            .map(|&v| running.agents(Some(service), v))
            .collect()
    }

    #[test]
    fn the_agents_running_each_version_follow_hellos_acks_replacements_and_disconnects() {
        let fleet = Fleet::new(10);
        let current = Some((3, "h3"));
        let mut h = hello("a");
        h.last_applied_version = 2;
        let a = fleet.register(&h, None, current).unwrap();
        // Another store's content under a number past the current one: listed as running
        // none known, but its calls are reported under 7 until it takes the push.
        let mut h = hello("b");
        h.last_applied_version = 7;
        h.last_applied_hash = "h-before-the-reset".to_owned();
        let b = fleet.register(&h, None, current).unwrap();
        assert_eq!(fleet.status()[1].applied_version, 0);
        let mut h = hello("c");
        h.service = "search".to_owned();
        h.last_applied_version = 2;
        let c = fleet.register(&h, None, current).unwrap();
        assert_eq!(running(&fleet, "checkout", &[2, 3, 7]), [1, 0, 1]);
        assert_eq!(running(&fleet, "search", &[2]), [1]);
        assert_eq!(fleet.running().agents(None, 2), 2);
        // A NACK leaves it where it was; an ACK moves it.
        fleet.nack("a", a.generation, 3, "h3", "bad");
        assert_eq!(running(&fleet, "checkout", &[2, 3]), [1, 0]);
        fleet.ack("a", a.generation, 3, "h3");
        fleet.ack("b", b.generation, 3, "h3");
        assert_eq!(running(&fleet, "checkout", &[2, 3, 7]), [0, 2, 0]);
        // A second stream of "a" replaces the first: counted once, under its Hello's number;
        // the first stream's late ACK changes nothing.
        let mut h = hello("a");
        h.last_applied_version = 3;
        let a2 = fleet.register(&h, None, current).unwrap();
        fleet.ack("a", a.generation, 4, "h4");
        assert_eq!(running(&fleet, "checkout", &[3, 4]), [2, 0]);
        // `runs` moves it as an ACK does.
        fleet.runs("a", a2.generation, 4);
        assert_eq!(running(&fleet, "checkout", &[3, 4]), [1, 1]);
        // Disconnects take each off, once.
        fleet.disconnected("a", a2.generation);
        fleet.disconnected("a", a2.generation);
        fleet.disconnected("a", a.generation);
        fleet.disconnected("b", b.generation);
        fleet.disconnected("c", c.generation);
        assert_eq!(running(&fleet, "checkout", &[3, 4]), [0, 0]);
        assert_eq!(running(&fleet, "search", &[2]), [0]);
        assert_eq!(fleet.running().agents(None, 2), 0);
    }

    /// A seeded walk of registrations (replacements, also
    /// with another service in the new Hello; refusals: a full fleet, another token's id, a
    /// superseded stream), ACKs and `runs` of the current and of old generations, NACKs,
    /// disconnects (twice, of old generations) and forgetting (at once, and the prune),
    /// against a model: the connected agents by (service, the Hello's number, then each
    /// version ACKed or run). After every step `running` counts each exactly, per service and
    /// over every service, and holds nothing for a service or version no connected agent has.
    #[test]
    fn the_agents_running_each_version_follow_a_seeded_walk_exactly() {
        for forget_after in [None, Some(Duration::ZERO)] {
            walk_of_agents_running(Fleet::new(5).forgetting_after(forget_after));
        }
    }

    /// [`the_agents_running_each_version_follow_a_seeded_walk_exactly`] on `fleet`.
    fn walk_of_agents_running(fleet: Fleet) {
        let long = "s".repeat(300);
        let services = ["checkout", "search", "bad\nname", long.as_str()];
        let mut seed: u64 = 0x0098_5eed;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        // Agent id → (service, version counted) of its connected stream, and the generation
        // of that stream; every generation handed out, per id.
        let mut model: HashMap<String, (String, u64)> = HashMap::new();
        let mut current: HashMap<String, u64> = HashMap::new();
        let mut generations: HashMap<String, Vec<u64>> = HashMap::new();
        let mut streams: HashMap<String, u64> = HashMap::new();
        for step in 0..20_000u32 {
            let id = format!("agent-{}", next(8));
            let gens = generations.get(&id).cloned().unwrap_or_default();
            let generation = match gens.len() {
                0 => 0,
                n => gens[usize::try_from(next(n as u64)).unwrap()],
            };
            let version = next(6);
            match next(7) {
                0 | 1 => {
                    let service = services[usize::try_from(next(4)).unwrap()];
                    let stream = streams.entry(id.clone()).or_insert(1);
                    // Now and then a stream the agent gave up (an older number): refused.
                    let number = if next(6) == 0 {
                        stream.saturating_sub(1)
                    } else {
                        *stream += 1;
                        *stream
                    };
                    let h = pb::Hello {
                        agent_id: id.clone(),
                        service: service.to_owned(),
                        last_applied_version: version,
                        last_applied_hash: if next(3) == 0 {
                            "another-store".to_owned()
                        } else {
                            String::new()
                        },
                        instance_id: 7,
                        stream: number,
                        ..Default::default()
                    };
                    let secret = if next(8) == 0 { 2 } else { 1 };
                    let token = Some(StreamToken {
                        name: if secret == 1 { "one" } else { "two" },
                        secret_digest: [secret; 32],
                        max_agents: None,
                        in_force: None,
                    });
                    let served = Some((3, "h3"));
                    if let Ok(r) = fleet.register_with_token(&h, None, served, token) {
                        model.insert(id.clone(), (service.to_owned(), version));
                        current.insert(id.clone(), r.generation);
                        generations
                            .entry(id.clone())
                            .or_default()
                            .push(r.generation);
                    }
                }
                2 => {
                    fleet.ack(&id, generation, version, "h");
                    if current.get(&id) == Some(&generation)
                        && let Some(m) = model.get_mut(&id)
                    {
                        m.1 = version;
                    }
                }
                3 => {
                    fleet.runs(&id, generation, version);
                    if current.get(&id) == Some(&generation)
                        && let Some(m) = model.get_mut(&id)
                    {
                        m.1 = version;
                    }
                }
                4 => fleet.nack(&id, generation, version, "h", "no"),
                _ => {
                    fleet.disconnected(&id, generation);
                    if current.get(&id) == Some(&generation) {
                        model.remove(&id);
                    }
                }
            }
            let running = fleet.running();
            let mut all: HashMap<u64, u64> = HashMap::new();
            for service in services {
                for v in 0..6 {
                    let want = model
                        .values()
                        .filter(|(s, mv)| s == service && *mv == v)
                        .count() as u64;
                    *all.entry(v).or_default() += want;
                    assert_eq!(
                        running.agents(Some(service), v),
                        want,
                        "step {step}: {service:?} on {v}"
                    );
                }
            }
            for v in 0..6 {
                assert_eq!(running.agents(None, v), all[&v], "step {step}: all on {v}");
            }
            assert_eq!(fleet.connected(), model.len(), "step {step}");
        }
        for (id, generation) in current {
            fleet.disconnected(&id, generation);
        }
        let running = fleet.running();
        for service in services {
            for v in 0..6 {
                assert_eq!(running.agents(Some(service), v), 0);
            }
        }
    }

    #[test]
    fn the_agents_running_each_version_are_exact_after_concurrent_streams() {
        let fleet = Arc::new(Fleet::new(10_000));
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let fleet = fleet.clone();
                scope.spawn(move || {
                    for i in 0..500u64 {
                        let mut h = hello(&format!("agent-{}", i % 50));
                        h.last_applied_version = t;
                        let Ok(r) = fleet.register(&h, None, None) else {
                            continue;
                        };
                        fleet.ack(&h.agent_id, r.generation, t + 10, "h");
                        if i % 3 == 0 {
                            fleet.disconnected(&h.agent_id, r.generation);
                        }
                    }
                });
            }
        });
        let connected = fleet.connected() as u64;
        let counted: u64 = (0..14)
            .map(|v| fleet.running().agents(Some("checkout"), v))
            .sum();
        assert_eq!(counted, connected);
        let by_status = fleet.versions().applied;
        for (version, agents) in by_status {
            assert_eq!(
                fleet.running().agents(None, version),
                agents,
                "version {version}"
            );
        }
    }

    #[test]
    fn versions_count_connected_agents_and_their_nacks() {
        let fleet = Fleet::new(10);
        let a = fleet.register(&hello("a"), None, None).unwrap();
        let b = fleet.register(&hello("b"), None, None).unwrap();
        let c = fleet.register(&hello("c"), None, None).unwrap();
        fleet.ack("a", a.generation, 2, "h2");
        fleet.ack("b", b.generation, 2, "h2");
        fleet.nack("b", b.generation, 3, "h3", "bad");
        fleet.ack("c", c.generation, 2, "h2");
        fleet.disconnected("c", c.generation);
        let v = fleet.versions();
        assert_eq!(v.applied, BTreeMap::from([(2, 2)]));
        assert_eq!(v.nacked, BTreeMap::from([(3, 1)]));
    }

    #[test]
    fn counted_reports_are_remembered_across_streams_of_the_same_agent_id() {
        let fleet = Fleet::new(10);
        let mut h = hello("a");
        h.instance_id = 11;
        let first = fleet.register(&h, None, None).unwrap();
        let yes = |_: Option<&mut ReportBucket>| true;
        let claim =
            |generation, instance, seq| fleet.claim_report("a", generation, instance, seq, yes);
        assert_eq!(claim(first.generation, 11, 1), ReportVerdict::Count);
        fleet.disconnected("a", first.generation);
        let second = fleet.register(&h, None, None).unwrap();
        assert_eq!(claim(second.generation, 11, 1), ReportVerdict::Duplicate);
        assert_eq!(claim(second.generation, 11, 2), ReportVerdict::Count);
        // A replaced stream's late report is decided against the same record.
        let third = fleet.register(&h, None, None).unwrap();
        assert_eq!(claim(second.generation, 11, 2), ReportVerdict::Duplicate);
        assert_eq!(claim(second.generation, 11, 3), ReportVerdict::Count);
        assert_eq!(claim(third.generation, 11, 3), ReportVerdict::Duplicate);
        // A restarted process starts afresh.
        h.instance_id = 12;
        let restarted = fleet.register(&h, None, None).unwrap();
        assert_eq!(claim(restarted.generation, 12, 1), ReportVerdict::Count);
        let refused = fleet.claim_report("a", restarted.generation, 12, 2, |_| false);
        assert_eq!(refused, ReportVerdict::Refused);
        assert_eq!(
            claim(restarted.generation, 12, 2),
            ReportVerdict::RefusedBefore
        );
        assert_eq!(claim(restarted.generation, 12, 3), ReportVerdict::Count);
    }

    #[test]
    fn the_gauge_follows_every_change_of_the_count() {
        let fleet = Fleet::new(10);
        let gauge = fleet.connected_gauge();
        let a = fleet.register(&hello("a"), None, None).unwrap();
        let b = fleet.register(&hello("b"), None, None).unwrap();
        assert_eq!(gauge.get(), 2);
        // A replacement keeps the count.
        let a2 = fleet.register(&hello("a"), None, None).unwrap();
        assert_eq!(gauge.get(), 2);
        fleet.disconnected("a", a.generation);
        assert_eq!(
            gauge.get(),
            2,
            "a replaced stream's end is not a disconnect"
        );
        fleet.disconnected("b", b.generation);
        fleet.disconnected("b", b.generation);
        assert_eq!(gauge.get(), 1);
        fleet.disconnected("a", a2.generation);
        assert_eq!(gauge.get(), 0);
    }

    #[test]
    fn the_gauge_is_exact_after_concurrent_connects_and_disconnects() {
        let fleet = Arc::new(Fleet::new(10_000));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let fleet = fleet.clone();
                std::thread::spawn(move || {
                    for i in 0..500 {
                        let id = format!("{t}-{i}");
                        let reg = fleet.register(&hello(&id), None, None).unwrap();
                        if i % 2 == 0 {
                            fleet.disconnected(&id, reg.generation);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(fleet.connected(), 8 * 250);
        assert_eq!(fleet.connected_gauge().get(), 8 * 250);
    }

    #[test]
    fn disconnected_agents_stay_listed() {
        let fleet = Fleet::new(10);
        let reg = fleet.register(&hello("a"), None, None).unwrap();
        fleet.disconnected("a", reg.generation);
        assert_eq!(fleet.connected(), 0);
        assert!(!fleet.status()[0].connected);
    }

    #[tokio::test(start_paused = true)]
    async fn a_disconnected_agent_is_forgotten_after_the_set_time_unless_it_came_back() {
        let minute = Duration::from_secs(60);
        let fleet = Fleet::new(10).forgetting_after(Some(60 * minute));
        let ids = |fleet: &Fleet| -> Vec<String> {
            fleet.status().into_iter().map(|a| a.agent_id).collect()
        };
        let a = fleet.register(&hello("a"), None, None).unwrap();
        let b = fleet.register(&hello("b"), None, None).unwrap();
        fleet.register(&hello("c"), None, None).unwrap();
        fleet.disconnected("a", a.generation);
        tokio::time::advance(30 * minute).await;
        fleet.disconnected("b", b.generation);
        // `b` comes back; its ended stream is not what is forgotten.
        let b = fleet.register(&hello("b"), None, None).unwrap();
        tokio::time::advance(29 * minute).await;
        assert_eq!(ids(&fleet), ["a", "b", "c"]);
        tokio::time::advance(minute).await;
        assert_eq!(ids(&fleet), ["b", "c"], "a, gone for an hour, is forgotten");
        assert_eq!(fleet.status_and_counts(false).2, 2);
        // `b` leaves again: an hour from now, not from its first disconnect.
        fleet.disconnected("b", b.generation);
        tokio::time::advance(59 * minute).await;
        assert_eq!(ids(&fleet), ["b", "c"]);
        tokio::time::advance(minute).await;
        assert_eq!(ids(&fleet), ["c"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_report_sent_again_after_the_agent_was_forgotten_is_counted_once() {
        let fleet = Fleet::new(10).forgetting_after(Some(Duration::from_secs(60)));
        let yes = |_: Option<&mut ReportBucket>| true;
        let mut h = hello("a");
        h.instance_id = 11;
        let first = fleet.register(&h, None, None).unwrap();
        assert_eq!(
            fleet.claim_report("a", first.generation, 11, 1, yes),
            ReportVerdict::Count
        );
        // Cut off for longer than the forget time: forgotten (and not listed).
        fleet.disconnected("a", first.generation);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(fleet.status().is_empty());
        // Back, it sends again the report whose ack it never got, then a new one.
        let back = fleet.register(&h, None, None).unwrap();
        assert_eq!(
            fleet.claim_report("a", back.generation, 11, 1, yes),
            ReportVerdict::Duplicate
        );
        assert_eq!(
            fleet.claim_report("a", back.generation, 11, 2, yes),
            ReportVerdict::Count
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_ephemeral_agents_record_is_not_kept_once_it_is_forgotten() {
        let fleet = Fleet::new(10).forgetting_after(Some(Duration::from_secs(60)));
        let yes = |_: Option<&mut ReportBucket>| true;
        let eph = pb::Hello {
            ephemeral: true,
            instance_id: 7,
            ..hello("cli-1")
        };
        let reg = fleet.register(&eph, None, None).unwrap();
        assert_eq!(
            fleet.claim_report("cli-1", reg.generation, 7, 1, yes),
            ReportVerdict::Count
        );
        fleet.disconnected("cli-1", reg.generation);
        tokio::time::advance(Duration::from_secs(61)).await;
        // Forgotten (at the next look at the fleet), and its record not kept apart: a
        // one-call agent, gone for good, would take the place of one that comes back.
        assert!(fleet.status().is_empty());
        assert!(fleet.lock().forgotten.records.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_ephemeral_stream_that_took_a_long_lived_agents_id_does_not_drop_its_record() {
        let fleet = Fleet::new(10).forgetting_after(Some(Duration::from_secs(60)));
        let yes = |_: Option<&mut ReportBucket>| true;
        let long_lived = pb::Hello {
            instance_id: 1,
            ..hello("a")
        };
        let reg = fleet.register(&long_lived, None, None).unwrap();
        assert_eq!(
            fleet.claim_report("a", reg.generation, 1, 1, yes),
            ReportVerdict::Count
        );
        fleet.disconnected("a", reg.generation);
        // A one-call agent with the same id registers last.
        let eph = pb::Hello {
            ephemeral: true,
            instance_id: 9,
            ..hello("a")
        };
        let reg = fleet.register(&eph, None, None).unwrap();
        fleet.disconnected("a", reg.generation);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(fleet.status().is_empty());
        // The long-lived agent comes back and sends its counted report again: counted once.
        let back = fleet.register(&long_lived, None, None).unwrap();
        assert_eq!(
            fleet.claim_report("a", back.generation, 1, 1, yes),
            ReportVerdict::Duplicate
        );
    }

    #[test]
    fn forgotten_agents_records_are_bounded_and_the_newest_kept() {
        let mut forgotten = Forgotten::default();
        let record = || {
            let mut reports = ReportSeqs::default();
            assert_eq!(reports.claim(1, 1, || true), ReportVerdict::Count);
            reports
        };
        for i in 0..MAX_FORGOTTEN + 5 {
            forgotten.keep(format!("a{i}"), record());
        }
        assert_eq!(forgotten.records.len(), MAX_FORGOTTEN);
        assert!(forgotten.take("a4").is_none(), "the oldest went");
        assert!(forgotten.take("a5").is_some());
        // Ids taken back leave stale places in the order, which do not pile up.
        for round in 0..3 {
            for i in 0..MAX_FORGOTTEN {
                let id = format!("b{round}-{i}");
                forgotten.keep(id.clone(), record());
                assert!(forgotten.take(&id).is_some());
            }
        }
        assert!(forgotten.order.len() <= 2 * MAX_FORGOTTEN + 1);
        assert!(forgotten.records.len() < MAX_FORGOTTEN);
    }

    #[test]
    fn an_ephemeral_agent_is_listed_while_connected_and_kept_but_not_listed_after() {
        let fleet = Fleet::new(10);
        let eph = pb::Hello {
            ephemeral: true,
            instance_id: 7,
            ..hello("cli")
        };
        let reg = fleet.register(&eph, None, None).unwrap();
        fleet.register(&hello("svc"), None, None).unwrap();
        assert_eq!(fleet.status().len(), 2);
        assert_eq!(fleet.status_and_counts(false), (vec![], 2, 2));
        let claim = |generation| fleet.claim_report("cli", generation, 7, 1, |_| true);
        assert_eq!(claim(reg.generation), ReportVerdict::Count);
        fleet.disconnected("cli", reg.generation);
        let ids: Vec<_> = fleet.status().into_iter().map(|a| a.agent_id).collect();
        assert_eq!(ids, ["svc"]);
        assert_eq!(fleet.status_and_counts(false), (vec![], 1, 1));
        // Its record is kept: a report sent again on a new stream of the same process is not
        // counted twice, and while connected again it is listed again.
        let again = fleet.register(&eph, None, None).unwrap();
        assert_eq!(claim(again.generation), ReportVerdict::Duplicate);
        assert_eq!(fleet.status().len(), 2);
        assert_eq!(fleet.status_and_counts(false), (vec![], 2, 2));
        fleet.disconnected("cli", again.generation);
        assert_eq!(fleet.status_and_counts(false), (vec![], 1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_forgotten_ephemeral_agent_leaves_the_counts_right() {
        let fleet = Fleet::new(10).forgetting_after(Some(Duration::from_secs(60)));
        let eph = pb::Hello {
            ephemeral: true,
            ..hello("cli")
        };
        let reg = fleet.register(&eph, None, None).unwrap();
        fleet.disconnected("cli", reg.generation);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(fleet.status_and_counts(false), (vec![], 0, 0));
        let reg = fleet.register(&eph, None, None).unwrap();
        assert_eq!(fleet.status_and_counts(false), (vec![], 1, 1));
        fleet.disconnected("cli", reg.generation);
        assert_eq!(fleet.status_and_counts(false), (vec![], 0, 0));
    }

    #[test]
    fn ephemeral_agents_are_the_first_disconnected_ones_to_go() {
        let fleet = Fleet::new(MAX_DISCONNECTED + 10).forgetting_after(None);
        let reg = fleet.register(&hello("svc-gone"), None, None).unwrap();
        fleet.disconnected("svc-gone", reg.generation);
        for i in 0..MAX_DISCONNECTED {
            let id = format!("cli-{i}");
            let eph = pb::Hello {
                ephemeral: true,
                ..hello(&id)
            };
            let reg = fleet.register(&eph, None, None).unwrap();
            fleet.disconnected(&id, reg.generation);
        }
        // One past the cap: the longest gone tenth go at once, ephemeral ones first.
        let inner = fleet.lock();
        assert_eq!(inner.agents.len(), PRUNED_TO);
        assert!(
            inner.agents.contains_key("svc-gone"),
            "the longest gone, but not ephemeral"
        );
        drop(inner);
        assert_eq!(fleet.status_and_counts(false), (vec![], 0, 1));
    }

    #[test]
    fn the_longest_gone_are_pruned_first_though_the_wall_clock_stepped_back_since_they_left() {
        // README: past 10,000 disconnected agents, "the longest gone tenth go". "old" left
        // first, while the wall clock ran an hour ahead; an NTP correction then set it back,
        // and 10,000 agents came and went after it. The wall clock orders none of that.
        let fleet = Fleet::new(MAX_DISCONNECTED + 10).forgetting_after(None);
        let reg = fleet.register(&hello("old"), None, None).unwrap();
        if let Some(e) = fleet.lock().agents.get_mut("old") {
            e.status.last_seen_unix_ms = unix_ms() + 3_600_000;
        }
        fleet.disconnected("old", reg.generation);
        for i in 0..MAX_DISCONNECTED {
            let id = format!("svc-{i}");
            let reg = fleet.register(&hello(&id), None, None).unwrap();
            fleet.disconnected(&id, reg.generation);
        }
        let inner = fleet.lock();
        assert_eq!(inner.agents.len(), PRUNED_TO);
        assert!(
            !inner.agents.contains_key("old"),
            "the agent gone longest is kept, and {} that left after it went, because its \
             last_seen_unix_ms reads later on a wall clock that was set back since",
            MAX_DISCONNECTED + 1 - PRUNED_TO
        );
    }

    #[test]
    fn an_agent_is_never_shown_seen_before_it_connected_though_the_wall_clock_stepped_back() {
        let fleet = Fleet::new(10);
        let reg = fleet.register(&hello("a"), None, None).unwrap();
        // It connected while the wall clock ran an hour ahead; the clock was set back since.
        let ahead = unix_ms() + 3_600_000;
        if let Some(e) = fleet.lock().agents.get_mut("a") {
            e.status.connected_since_unix_ms = ahead;
        }
        fleet.seen("a", reg.generation);
        let status = &fleet.status()[0];
        assert_eq!(status.connected_since_unix_ms, ahead);
        assert!(
            status.last_seen_unix_ms >= status.connected_since_unix_ms,
            "seen at {} before it connected at {}",
            status.last_seen_unix_ms,
            status.connected_since_unix_ms
        );
    }

    #[test]
    fn an_agent_past_the_version_served_is_flagged_once_per_version_served() {
        let fleet = Fleet::new(10);
        let past = |id: &str, version: u64| pb::Hello {
            last_applied_version: version,
            ..hello(id)
        };
        let at = |version: u64| Some((version, "h"));
        let flagged =
            |h: pb::Hello, served| fleet.register(&h, None, at(served)).unwrap().never_held;
        assert_eq!(flagged(past("a", 1), 1), None, "the version served");
        assert_eq!(flagged(past("b", 13), 1), Some(1));
        assert_eq!(flagged(past("c", 13), 1), None, "once for version 1");
        assert_eq!(flagged(past("d", 12), 2), Some(2), "again for version 2");
        assert_eq!(flagged(past("e", 0), 2), None);
    }

    /// A Hello as large as the control plane takes: 64 labels of 256 bytes, fields of 256.
    fn largest_hello(id: &str) -> pb::Hello {
        pb::Hello {
            service: "s".repeat(256),
            agent_version: "v".repeat(256),
            labels: (0..64)
                .map(|i| (format!("{i:0>255}"), "l".repeat(256)))
                .collect(),
            ..hello(id)
        }
    }

    /// Pages are cut by bytes as well as by count (agents choose how large their entries
    /// are): every agent comes once, in order, across the pages, each page within the bound
    /// but for a page of one agent larger than it.
    #[test]
    fn a_page_of_large_agents_is_cut_at_its_byte_bound() {
        let fleet = Fleet::new(100);
        for i in 0..10 {
            fleet
                .register(&largest_hello(&format!("a-{i}")), None, None)
                .unwrap();
        }
        let one = prost::Message::encoded_len(&fleet.status()[0]);
        assert!(one > 32 << 10, "{one}");
        let bound = 3 * one + one / 2;
        let (mut after, mut seen) = (String::new(), Vec::new());
        loop {
            let page = fleet.status_page(true, &after, usize::MAX, bound);
            assert_eq!(page.agents.len(), if seen.len() < 9 { 3 } else { 1 });
            seen.extend(page.agents.iter().map(|a| a.agent_id.clone()));
            if page.next.is_empty() {
                break;
            }
            after = page.next;
        }
        let every: Vec<String> = (0..10).map(|i| format!("a-{i}")).collect();
        assert_eq!(seen, every);
        // The count still cuts first; a bound below one agent still sends one.
        assert_eq!(fleet.status_page(true, "", 2, usize::MAX).agents.len(), 2);
        let tiny = fleet.status_page(true, "", usize::MAX, 1);
        assert_eq!((tiny.agents.len(), tiny.next.as_str()), (1, "a-0"));
    }

    /// A page chosen a chunk at a time is the page a sort of every agent gives: the same
    /// agents, in order, cut at the same count or byte bound, saying the same about the rest.
    #[test]
    fn a_page_chosen_by_chunks_is_the_page_of_a_whole_sort() {
        let fleet = Fleet::new(1000);
        for i in 0..200u32 {
            // Ids out of order; entries of three sizes.
            let id = format!("a-{:03}", (i * 73) % 200);
            let hello = pb::Hello {
                labels: (0..i % 3)
                    .map(|l| (format!("k{l}"), "v".repeat(500)))
                    .collect(),
                ..hello(&id)
            };
            fleet.register(&hello, None, None).unwrap();
        }
        let inner = fleet.lock();
        let every = || -> Vec<&Entry> { inner.agents.values().collect() };
        // The page as it was chosen before chunks: every agent left sorted at once.
        let whole = |size: usize, max_bytes: usize| {
            let mut listed = every();
            let mut more = listed.len() > size;
            listed.sort_unstable_by(|a, b| a.status.agent_id.cmp(&b.status.agent_id));
            listed.truncate(size);
            let mut bytes = 0usize;
            let fit = listed
                .iter()
                .position(|e| {
                    bytes = bytes.saturating_add(prost::Message::encoded_len(&e.status) + 4);
                    bytes > max_bytes
                })
                .map_or(listed.len(), |at| at.max(1));
            if fit < listed.len() {
                more = true;
                listed.truncate(fit);
            }
            (listed, more)
        };
        let ids = |(page, more): (Vec<&Entry>, bool)| {
            let ids: Vec<String> = page.iter().map(|e| e.status.agent_id.clone()).collect();
            (ids, more)
        };
        let mut sorted: Vec<String> = every().iter().map(|e| e.status.agent_id.clone()).collect();
        sorted.sort();
        assert_eq!(ids(whole(usize::MAX, usize::MAX)), (sorted.clone(), false));
        assert_eq!(ids(whole(7, usize::MAX)), (sorted[..7].to_vec(), true));
        for size in [1, 5, 64, 199, 200, 201, usize::MAX] {
            for max_bytes in [1, 100, 700, 5_000, 40_000, usize::MAX] {
                for chunk in [0, 1, 2, 3, 16, 1024, usize::MAX] {
                    assert_eq!(
                        ids(first_in_order(every(), size, max_bytes, chunk)),
                        ids(whole(size, max_bytes)),
                        "size {size}, max_bytes {max_bytes}, chunk {chunk}"
                    );
                }
            }
        }
    }

    #[test]
    fn disconnected_agents_with_the_largest_hellos_are_kept_within_the_memory_bound() {
        let per_entry = gone_size(&pb::AgentStatus {
            labels: largest_hello("x").labels,
            ..Default::default()
        });
        assert!(per_entry > 32 << 10, "{per_entry}");
        let n = MAX_DISCONNECTED_BYTES / per_entry + 100;
        let fleet = Fleet::new(n + 10).forgetting_after(None);
        let reg = fleet.register(&largest_hello("first"), None, None).unwrap();
        fleet.disconnected("first", reg.generation);
        for i in 1..n {
            let id = format!("agent-{i}");
            let reg = fleet.register(&largest_hello(&id), None, None).unwrap();
            fleet.disconnected(&id, reg.generation);
        }
        let inner = fleet.lock();
        assert!(
            inner.gone_bytes <= MAX_DISCONNECTED_BYTES,
            "{}",
            inner.gone_bytes
        );
        assert!(
            inner.agents.len() < n,
            "pruned by memory, below the count cap"
        );
        let kept: usize = inner.agents.values().map(|e| e.gone_size).sum();
        assert_eq!(inner.gone_bytes, kept, "the sum is kept exactly");
        assert!(
            !inner.agents.contains_key("first"),
            "the longest gone go first"
        );
        assert!(inner.agents.contains_key(&format!("agent-{}", n - 1)));
    }

    #[test]
    fn the_disconnected_agents_memory_is_given_back_when_they_return_or_are_forgotten() {
        let fleet = Fleet::new(10).forgetting_after(None);
        let a = fleet.register(&largest_hello("a"), None, None).unwrap();
        let b = fleet.register(&hello("b"), None, None).unwrap();
        assert_eq!(fleet.lock().gone_bytes, 0);
        fleet.disconnected("a", a.generation);
        fleet.disconnected("b", b.generation);
        let both = fleet.lock().gone_bytes;
        assert!(both > 32 << 10, "{both}");
        // `a` comes back: its share goes; `b` is forgotten: so does its.
        let a = fleet.register(&largest_hello("a"), None, None).unwrap();
        assert!(fleet.lock().gone_bytes < 4 << 10);
        fleet.lock().forget("b".to_owned());
        assert_eq!(fleet.lock().gone_bytes, 0);
        fleet.disconnected("a", a.generation);
        fleet.disconnected("a", a.generation);
        let inner = fleet.lock();
        assert!(
            (32 << 10..both).contains(&inner.gone_bytes),
            "{}",
            inner.gone_bytes
        );
        assert_eq!(
            inner.gone_bytes, inner.agents["a"].gone_size,
            "counted once"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_time_disconnected_agents_stay_listed() {
        let fleet = Fleet::new(10).forgetting_after(None);
        let a = fleet.register(&hello("a"), None, None).unwrap();
        fleet.disconnected("a", a.generation);
        tokio::time::advance(Duration::from_secs(365 * 24 * 3600)).await;
        assert_eq!(fleet.status().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn agents_that_come_and_go_leave_a_bounded_record() {
        let fleet = Fleet::new(1).forgetting_after(Some(Duration::from_secs(3600)));
        for _ in 0..3 * MAX_DISCONNECTED {
            let a = fleet.register(&hello("a"), None, None).unwrap();
            fleet.disconnected("a", a.generation);
        }
        assert!(fleet.lock().gone.len() <= 2 * MAX_DISCONNECTED + 1);
        assert_eq!(fleet.status().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_report_bucket_starts_full_and_refills_at_its_rate_up_to_its_burst() {
        let mut b = ReportBucket::default();
        let now = tokio::time::Instant::now();
        let took = (0..5).filter(|_| b.take(now, 2.0, 3.0)).count();
        assert_eq!(took, 3, "the burst");
        tokio::time::advance(std::time::Duration::from_millis(500)).await;
        let now = tokio::time::Instant::now();
        assert!(b.take(now, 2.0, 3.0), "one token in half a second");
        assert!(!b.take(now, 2.0, 3.0));
        tokio::time::advance(std::time::Duration::from_secs(3600)).await;
        let now = tokio::time::Instant::now();
        let took = (0..5).filter(|_| b.take(now, 2.0, 3.0)).count();
        assert_eq!(took, 3, "never more than the burst");
    }
}

/// `Hello.stream`: what a refusal leaves as it was, and which streams are never refused.
#[cfg(test)]
mod stream_number_tests {
    use super::*;

    fn numbered(id: &str, instance_id: u64, stream: u64) -> pb::Hello {
        pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            instance_id,
            stream,
            ..Default::default()
        }
    }

    #[test]
    fn a_stream_the_agent_gave_up_does_not_replace_its_later_one() {
        let fleet = Fleet::new(10);
        let mut second = fleet.register(&numbered("a", 7, 2), None, None).unwrap();
        // The Hello of the stream the process gave up comes late.
        let late = fleet.register(&numbered("a", 7, 1), None, None);
        assert_eq!(
            late.err(),
            Some(RegisterError::Superseded { later: 2, this: 1 })
        );
        assert!(
            second.replaced.try_recv().is_err(),
            "the later stream stays"
        );
        assert_eq!(fleet.connected(), 1);
        fleet.ack("a", second.generation, 3, "h3");
        assert_eq!(fleet.status()[0].applied_version, 3);
        // A later stream replaces it; so does another process (a restart counts from 1), and
        // a stream that does not number itself.
        let mut third = fleet.register(&numbered("a", 7, 3), None, None).unwrap();
        assert!(second.replaced.try_recv().is_ok());
        let mut restarted = fleet.register(&numbered("a", 8, 1), None, None).unwrap();
        assert!(third.replaced.try_recv().is_ok());
        assert_eq!(fleet.connected(), 1);
        fleet.register(&numbered("a", 8, 0), None, None).unwrap();
        assert!(restarted.replaced.try_recv().is_ok());
        // Once the later stream has ended too (the agent waits to connect again), the late
        // Hello is still refused: the agent is not listed as connected on a stream it gave up.
        let fleet = Fleet::new(10);
        let later = fleet.register(&numbered("a", 7, 2), None, None).unwrap();
        fleet.disconnected("a", later.generation);
        assert_eq!(
            fleet.register(&numbered("a", 7, 1), None, None).err(),
            Some(RegisterError::Superseded { later: 2, this: 1 })
        );
        assert!(!fleet.status()[0].connected);
        assert_eq!(fleet.connected(), 0);
        // Its next stream is taken.
        assert!(fleet.register(&numbered("a", 7, 3), None, None).is_ok());
    }

    #[test]
    fn a_refusal_leaves_the_listing_and_counts_as_they_were() {
        let fleet = Fleet::new(10);
        let live = fleet.register(&numbered("a", 7, 2), None, None).unwrap();
        fleet.ack("a", live.generation, 3, "h3");
        let before = fleet.status();
        let gauge = fleet.connected_gauge();
        assert!(matches!(
            fleet.register(&numbered("a", 7, 1), None, None),
            Err(RegisterError::Superseded { later: 2, this: 1 })
        ));
        assert_eq!(fleet.status(), before);
        assert_eq!(fleet.connected(), 1);
        assert_eq!(gauge.get(), 1);
        // The live stream's generation still counts: its disconnect lists it as gone.
        fleet.disconnected("a", live.generation);
        assert_eq!(fleet.connected(), 0);
        assert!(!fleet.status()[0].connected);
    }

    #[test]
    fn the_same_number_twice_and_numbers_of_other_processes_are_taken() {
        let fleet = Fleet::new(10);
        fleet.register(&numbered("a", 7, 3), None, None).unwrap();
        // A foreign client that does not count: the same number again replaces.
        fleet.register(&numbered("a", 7, 3), None, None).unwrap();
        // Another process (restart) from 1, and an unnumbered stream, are taken.
        fleet.register(&numbered("a", 8, 1), None, None).unwrap();
        fleet.register(&numbered("a", 0, 0), None, None).unwrap();
        fleet.register(&numbered("a", 7, 0), None, None).unwrap();
        assert_eq!(fleet.connected(), 1);
    }

    #[test]
    fn an_ephemeral_agents_late_hello_is_refused_after_its_later_stream_ended() {
        let fleet = Fleet::new(10);
        let mut h = numbered("e", 7, 2);
        h.ephemeral = true;
        let later = fleet.register(&h, None, None).unwrap();
        fleet.disconnected("e", later.generation);
        assert!(fleet.status().is_empty());
        h.stream = 1;
        assert!(matches!(
            fleet.register(&h, None, None),
            Err(RegisterError::Superseded { .. })
        ));
        assert!(fleet.status().is_empty());
        assert_eq!(fleet.connected(), 0);
        h.stream = 3;
        fleet.register(&h, None, None).unwrap();
        assert_eq!(fleet.connected(), 1);
    }

    #[test]
    fn a_full_fleet_refuses_the_next_stream_without_raising_the_bar() {
        let fleet = Fleet::new(1);
        let other = fleet.register(&numbered("b", 9, 1), None, None).unwrap();
        let a = fleet.register(&numbered("a", 7, 2), None, None);
        assert!(matches!(a, Err(RegisterError::Full(1))));
        fleet.disconnected("b", other.generation);
        // Stream 1 was never registered; stream 3 (after 2 was refused) is taken.
        fleet.register(&numbered("a", 7, 3), None, None).unwrap();
    }

    /// A restarted process (or a second one) with the same agent id registers between one
    /// process's streams: that process's given-up stream is still refused, and the other's
    /// live stream stays.
    #[test]
    fn a_given_up_stream_of_a_process_is_refused_after_another_process_registered() {
        let fleet = Fleet::new(10);
        let _x2 = fleet.register(&numbered("a", 7, 2), None, None).unwrap();
        let mut y1 = fleet.register(&numbered("a", 8, 1), None, None).unwrap();
        let late = fleet.register(&numbered("a", 7, 1), None, None);
        assert!(
            matches!(late, Err(RegisterError::Superseded { later: 2, this: 1 })),
            "process 7 opened stream 2 after stream 1; got {:?}",
            late.map(|r| r.generation)
        );
        assert!(
            y1.replaced.try_recv().is_err(),
            "process 8's live stream stays"
        );
    }

    /// The last four processes are remembered, most recent first; a fifth pushes the oldest
    /// out, and a process that registers again moves to the front.
    #[test]
    fn the_stream_numbers_of_the_last_four_processes_are_kept() {
        let mut numbers = StreamNumbers::default();
        for instance in 1..=4 {
            numbers = numbers.registered(instance, 10 + instance);
        }
        for instance in 1..=4 {
            assert_eq!(numbers.later_than(instance, 1), Some(10 + instance));
            assert_eq!(
                numbers.later_than(instance, 10 + instance),
                None,
                "the same number"
            );
        }
        // Process 1 again, then a fifth: process 2 (now the oldest) is forgotten.
        numbers = numbers.registered(1, 20).registered(5, 3);
        assert_eq!(numbers.later_than(1, 12), Some(20));
        assert_eq!(numbers.later_than(2, 1), None);
        assert_eq!(numbers.later_than(3, 1), Some(13));
        assert_eq!(numbers.later_than(5, 2), Some(3));
        // Unnumbered streams and processes are neither kept nor refused.
        assert_eq!(numbers.registered(0, 9).later_than(0, 1), None);
        assert_eq!(numbers.registered(6, 0).later_than(6, 0), None);
    }
}
