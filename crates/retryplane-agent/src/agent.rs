//! The [`Agent`]: the policies in an `ArcSwap`, the metrics registry, and the background task
//! that owns the control-plane stream.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::time::Duration;

use arc_swap::ArcSwap;
use retryplane_policy::PolicySet;
use retryplane_policy::rng::SeededRng;
use retryplane_proto::{convert, pb};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{info, warn};

use crate::call::{Cores, Endpoint};
use crate::error::{AgentError, StreamError};
use crate::metrics::Registry;
use crate::snapshot::{PolicySnapshot, Source};
use crate::stream::reconnect::ReconnectBackoff;
use crate::stream::{self, StreamConfig};

/// How often metrics are sent when the control plane does not say: 10 s.
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(10);

/// State shared by the handles, the calls and the stream task.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Replaced only through [`Shared::update_policies`]. A call reads its endpoint's entry
    /// from its [`Endpoint`] handle, which looks it up here again after each swap.
    pub(crate) policies: ArcSwap<PolicySnapshot>,
    /// Twice the number of times `policies` was replaced, plus one while a swap is under way:
    /// raised just before each swap and again just after it, so whoever reads an even
    /// generation and then loads `policies` gets that snapshot or a newer one. Endpoint
    /// handles key their kept entry on it, and keep none under an odd one (see
    /// [`crate::Endpoint`]).
    generation: AtomicU64,
    /// The version of the snapshot in force, or of the one about to be (see
    /// [`Shared::announce`]): a call whose entry is of another version counts in that
    /// version's counters for calls that outlived it (see [`crate::metrics`]).
    in_force: AtomicU64,
    /// The snapshot replaced last, kept until the next swap; its lock is the writers' turn.
    /// See [`Shared::update_policies`].
    retired: std::sync::Mutex<Option<Arc<PolicySnapshot>>>,
    /// The snapshot in force, sent at each swap to whoever watches ([`Agent::watch_policies`]).
    changes: tokio::sync::watch::Sender<Arc<PolicySnapshot>>,
    pub(crate) metrics: Registry,
    /// What the handles on each endpoint share (see [`Endpoint`]).
    pub(crate) cores: Cores,
    /// Milliseconds between metrics reports (the control plane may change it).
    pub(crate) metrics_interval_ms: AtomicU64,
    pub(crate) connected: AtomicBool,
    /// Why the last stream ended or could not start; cleared when a stream opens.
    pub(crate) stream_error: std::sync::Mutex<Option<StreamError>>,
    /// The last snapshot refused, until one is applied (see [`Agent::last_refusal`]).
    pub(crate) last_refusal: std::sync::Mutex<Option<crate::error::Refusal>>,
    /// The metrics reports no control plane had acknowledged when the stream task stopped
    /// (see [`Agent::unacknowledged_reports`]).
    pub(crate) unacknowledged_at_stop: AtomicU64,
    seed: u64,
    calls: AtomicU64,
}

/// A watch of the policies in force ([`Agent::watch_policies`]). It hands out the snapshot
/// itself (an `Arc`), never a borrow of the channel: a borrow held across an `.await` would
/// hold up the agent's next swap.
#[derive(Clone, Debug)]
pub struct PolicyWatch(tokio::sync::watch::Receiver<Arc<PolicySnapshot>>);

impl PolicyWatch {
    /// The policies in force now; they count as seen by [`PolicyWatch::changed`].
    pub fn current(&mut self) -> Arc<PolicySnapshot> {
        self.0.borrow_and_update().clone()
    }

    /// Waits for a swap of the policies since the last seen, and gives the policies then in
    /// force; `None` once the agent (every clone of it) is gone.
    pub async fn changed(&mut self) -> Option<Arc<PolicySnapshot>> {
        self.0.changed().await.ok()?;
        Some(self.current())
    }

    /// Waits until the policies in force satisfy `accept` (now, or after a swap), and gives
    /// them; `None` once the agent is gone first.
    pub async fn wait_for(
        &mut self,
        mut accept: impl FnMut(&PolicySnapshot) -> bool,
    ) -> Option<Arc<PolicySnapshot>> {
        let policies = self.0.wait_for(|p| accept(p)).await.ok()?.clone();
        Some(policies)
    }
}

impl Shared {
    pub(crate) fn new(snapshot: PolicySnapshot, seed: u64, metrics_interval: Duration) -> Self {
        let snapshot = Arc::new(snapshot);
        Self {
            in_force: AtomicU64::new(snapshot.version()),
            changes: tokio::sync::watch::Sender::new(snapshot.clone()),
            policies: ArcSwap::new(snapshot),
            generation: AtomicU64::new(0),
            retired: std::sync::Mutex::new(None),
            metrics: Registry::default(),
            cores: Cores::default(),
            metrics_interval_ms: AtomicU64::new(
                u64::try_from(metrics_interval.as_millis()).unwrap_or(u64::MAX),
            ),
            connected: AtomicBool::new(false),
            stream_error: std::sync::Mutex::new(None),
            last_refusal: std::sync::Mutex::new(None),
            unacknowledged_at_stop: AtomicU64::new(0),
            seed,
            calls: AtomicU64::new(0),
        }
    }

    /// Builds the next policies from those in force (`build` gets them, to carry endpoint
    /// state over) and puts them in force. Writers take turns (the stream task and
    /// [`Agent::set_policies`] may both write), so no update is built on a snapshot that
    /// another writer replaced in the meantime and then lost; readers never wait.
    ///
    /// Whoever releases a snapshot last frees it, and freeing one of 1,000 endpoints takes
    /// about 0.7 ms (BENCHMARKS.md): so that this is not a call that was running during the
    /// swap, the replaced snapshot stays here until the next swap, which frees it (after the
    /// writers' lock is released). Calls hold one endpoint's entry, not the snapshot; the agent
    /// keeps each endpoint's entry for its handles ([`crate::Endpoint`]), an old one until the
    /// next call on that endpoint refreshes it, which frees that one entry (or until no handle
    /// holds the endpoint: see [`Shared::forget_unheld`]). The cost is one more snapshot in
    /// memory, and an entry per held endpoint that got no call since the swap.
    pub(crate) fn update_policies(&self, build: impl FnOnce(&PolicySnapshot) -> PolicySnapshot) {
        self.update_policies_if(|current| Some(build(current)));
    }

    /// [`Shared::update_policies`], when `build` gives a snapshot: it is given the policies in
    /// force in the writers' turn, so what it decides from them still holds when its snapshot
    /// is put in force. Whether it was.
    pub(crate) fn update_policies_if(
        &self,
        build: impl FnOnce(&PolicySnapshot) -> Option<PolicySnapshot>,
    ) -> bool {
        let mut retired = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.policies.load_full();
        let Some(next) = build(&current) else {
            return false;
        };
        drop(current);
        self.announce(next.version());
        // Odd while the swap is under way, before the new snapshot can be seen: whoever has
        // seen it (`Agent::policies`) and then reads the generation reads this value or a
        // later one, so no handle gives it the entry kept for the generation before.
        self.generation.fetch_add(1, Release);
        let next = Arc::new(next);
        let replaced = self.policies.swap(next.clone());
        // Even again after the swap (Release): a reader that sees this generation sees the new
        // snapshot. Writers take turns, so plain adds are enough.
        self.generation.fetch_add(1, Release);
        // In the writers' turn, so watchers see the swaps in their order. The value it gives
        // back is `replaced` again, which `retired` keeps.
        let sent = self.changes.send_replace(next);
        let older = retired.replace(replaced);
        drop(retired);
        drop(sent);
        drop(older);
        self.cores.forget_unheld();
        true
    }

    /// Lets go of the endpoints no handle holds (their cores and kept entries), and of the
    /// states of endpoints the policies do not name that nothing holds and that are idle: at
    /// each report, so that an agent whose policies no push changes forgets them too. Their
    /// counters go as their counts are taken ([`Registry::take`]).
    pub(crate) fn forget_unheld(&self) {
        self.cores.forget_unheld();
        self.policies.load().prune_idle_states();
    }

    /// Runs `f` while no swap of the policies is under way, nor can start (the lock
    /// [`Shared::update_policies_if`] holds): for a report, which reads the version in force
    /// and takes the counts made under it, so that `Agent::set_policies` on another thread
    /// cannot swap in between and have calls made on its policies reported under the version
    /// before. `f` must not swap the policies itself.
    pub(crate) fn between_swaps<T>(&self, f: impl FnOnce() -> T) -> T {
        let _no_swap = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        f()
    }

    /// Says that the policies of `version` are about to be put in force: from now on, the
    /// counts of calls on entries of any other version go to that version's counters for calls
    /// that outlived it ([`crate::metrics::Registry::outlived`]), not to the endpoint's, which
    /// the next report credits to `version`. Called before the counts made so far are taken as
    /// the outgoing version's (`crate::stream`), and again by the swap itself.
    pub(crate) fn announce(&self, version: u64) {
        self.in_force.store(version, Release);
    }

    /// The version a call's counts go to the endpoint's counters under (see
    /// [`Shared::announce`]). Relaxed: a count made as the swap happens may land on either
    /// side of it.
    #[inline]
    pub(crate) fn version_in_force(&self) -> u64 {
        self.in_force.load(Relaxed)
    }

    /// Twice the number of swaps so far, plus one while a swap is under way (Acquire: read it
    /// before loading `policies`). An entry is kept only under an even generation.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Acquire)
    }

    /// A generator for one call: the agent's seed mixed with a call counter, so a seeded agent
    /// gives the same sequence of pauses run after run, with no lock on the call path.
    pub(crate) fn call_rng(&self) -> SeededRng {
        let n = self.calls.fetch_add(1, Relaxed);
        SeededRng::with_seed(self.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

/// The background task and what stops it: when the last [`Agent`] clone and the last
/// [`Endpoint`] handle holding it are dropped.
#[derive(Debug)]
pub(crate) struct Task {
    cancel: CancellationToken,
    handle: Mutex<Option<JoinHandle<()>>>,
    _guard: DropGuard,
}

/// The agent a service embeds: cheap to clone. The background task (the stream to the control
/// plane, the cache file, the metrics reports) runs until [`Agent::shutdown`] is called or the
/// last clone of the agent and the last [`Endpoint`] handle made from it are dropped, so a
/// service may keep only its handles. Its `Debug` is one short line: the policies in force
/// (as [`PolicySnapshot`]'s), its task (`none` without a control plane, `running`,
/// `shutting_down`, `shut_down`, or `ended` when it stopped on its own), whether the stream is
/// connected, and the first 160 bytes of why it last ended.
#[derive(Clone)]
pub struct Agent {
    shared: Arc<Shared>,
    task: Option<Arc<Task>>,
}

// Written by hand: the derived form printed the shared state whole (every policy, counter
// and endpoint), kilobytes per `?agent` in a log line.
impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let control_plane = match &self.task {
            None => "none",
            Some(task) => {
                // `None` while `shutdown` holds the handle (it waits for the task).
                let ended = task
                    .handle
                    .try_lock()
                    .ok()
                    .map(|h| h.as_ref().is_none_or(JoinHandle::is_finished));
                match (task.cancel.is_cancelled(), ended) {
                    (true, Some(true)) => "shut_down",
                    (true, _) => "shutting_down",
                    (false, Some(true)) => "ended",
                    (false, _) => "running",
                }
            }
        };
        // The first bytes of why the stream last ended: a status message comes from the
        // other end, and may be long.
        let stream_error = self
            .stream_error()
            .map(|e| retryplane_policy::diag::cut_marked(&e.message, 160).into_owned());
        f.debug_struct("Agent")
            .field("policies", &self.shared.policies.load())
            .field("control_plane", &format_args!("{control_plane}"))
            .field("connected", &self.is_connected())
            .field("stream_error", &stream_error)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// A builder for an agent fed by a control plane:
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use retryplane_agent::{Agent, CallMeta};
    ///
    /// // Returns at once; one background task connects, applies each version the control
    /// // plane pushes, keeps the last one in the cache file, and reconnects when it must.
    /// let agent = Agent::builder()
    ///     .url("http://127.0.0.1:7470")
    ///     .service("checkout")
    ///     .token(std::env::var("RETRYPLANE_AGENT_TOKEN")?)
    ///     .cache_file("/var/cache/checkout/retryplane-policies.bin")
    ///     .connect()?;
    /// // Handles are kept: a call reads the policy in force when it begins.
    /// let payments = agent.endpoint("payments");
    /// let answer = payments
    ///     .call(CallMeta::http("GET", "/v1/charges/42"), |_attempt| async {
    ///         Ok::<_, std::io::Error>(http::Response::new(()))
    ///     })
    ///     .await;
    /// # let _ = answer;
    /// agent.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder() -> AgentBuilder {
        AgentBuilder::default()
    }

    /// An agent on the policies of a policy file (SPEC §1), with no control plane: its
    /// snapshot's [`Source`](crate::Source) is `Static`, and nothing is reported anywhere.
    ///
    /// The file is read once, here, and checked as `retryplane validate` checks it: a file
    /// with errors is [`AgentError::InvalidPolicyFile`] (how many, and the first); warnings
    /// do not stop it and are not logged (run `retryplane validate` on the file to see them).
    /// A file over the 1 MiB limit of policy files is an [`AgentError::InvalidPolicyFile`];
    /// a file that cannot be read is an [`AgentError::ReadPolicyFile`], and so is a FIFO or a
    /// socket at `path`, refused without being opened (opening one would wait for a writer).
    /// To change the policies later, load the file again ([`crate::policy::load`]) and
    /// hand its policies to [`Agent::set_policies`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Agent, AgentError> {
        let path = path.as_ref();
        let (bytes, size) =
            read_policy_file(path).map_err(|source| AgentError::ReadPolicyFile {
                path: path.to_owned(),
                source,
            })?;
        let loaded = if bytes.len() > retryplane_policy::yaml::MAX_FILE_BYTES {
            retryplane_policy::too_large(size)
        } else {
            retryplane_policy::load(&bytes)
        };
        match loaded.policies {
            Some(set) if !loaded.has_errors() => Ok(Agent::from_policies(set)),
            _ => {
                // Counted whole: a long list ends with a line saying how many more there are.
                let (count, _) = retryplane_policy::diag::counts(&loaded.diagnostics);
                let first = loaded.diagnostics.iter().find(|d| d.is_error());
                Err(AgentError::InvalidPolicyFile {
                    path: path.to_owned(),
                    errors: count,
                    first: first.map(ToString::to_string).unwrap_or_default(),
                })
            }
        }
    }

    /// An agent on `policies`, with no control plane (tests, static setups); the RNG is seeded
    /// from entropy.
    pub fn from_policies(policies: PolicySet) -> Agent {
        Agent::from_policies_seeded(policies, fastrand_seed())
    }

    /// [`Agent::from_policies`] with a fixed RNG seed: the same calls give the same pauses.
    pub fn from_policies_seeded(policies: PolicySet, seed: u64) -> Agent {
        let hash = convert::content_hash(&pb::PolicyDocument::from(policies.document().as_ref()));
        let snapshot = PolicySnapshot::build(policies, 0, hash, Source::Static, None);
        Agent {
            shared: Arc::new(Shared::new(snapshot, seed, DEFAULT_METRICS_INTERVAL)),
            task: None,
        }
    }

    /// A handle on the endpoint `name` (a policy may or may not name it; unnamed endpoints run
    /// under the policies' defaults). Handles on one name share its state and counters; see
    /// the crate docs for when an endpoint no handle holds is forgotten.
    pub fn endpoint(&self, name: &str) -> Endpoint {
        Endpoint::new(self.shared.clone(), self.task.clone(), name)
    }

    /// The policies in force now.
    pub fn policies(&self) -> Arc<PolicySnapshot> {
        self.shared.policies.load_full()
    }

    /// A watch of the policies in force, told of each swap: a service can hold its readiness
    /// until the policies it wants are in force (the cache file's, or the control plane's:
    /// [`PolicySnapshot::source`]), or log each version as it comes. A watch that falls behind
    /// sees only the latest policies.
    ///
    /// Wait for any source but [`Source::Fallback`], as below, not for
    /// [`Source::ControlPlane`] alone: an agent restarted with a current cache file stays on
    /// [`Source::Cache`] once connected, as the control plane sends nothing to an agent that
    /// runs its version, and a wait for the control plane's would never end. (A newer version
    /// is pushed as soon as the agent connects, and the watch is told of it then.)
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let yaml = &b"version: 1\nendpoints:\n  users: {}\n"[..];
    /// # let agent = retryplane_agent::Agent::from_policies(
    /// #     retryplane_agent::policy::load(yaml).policies.unwrap());
    /// use retryplane_agent::Source;
    ///
    /// let mut policies = agent.watch_policies();
    /// # agent.set_policies(retryplane_agent::policy::load(yaml).policies.unwrap());
    /// // Ready once the policies are no longer the fallback: the cache file's, the control
    /// // plane's, or (here) set by the service.
    /// let ready = policies
    ///     .wait_for(|p| p.source() != Source::Fallback)
    ///     .await;
    /// assert!(ready.is_some());
    /// # }
    /// ```
    pub fn watch_policies(&self) -> PolicyWatch {
        PolicyWatch(self.shared.changes.subscribe())
    }

    /// Replaces the policies (static agents, tests); endpoint state is kept where the budget
    /// and breaker settings did not change. An agent on a control plane is updated by it:
    /// policies set here are version 0 until its next push; what was counted on the pushed
    /// version is still reported under it.
    pub fn set_policies(&self, policies: PolicySet) {
        let hash = convert::content_hash(&pb::PolicyDocument::from(policies.document().as_ref()));
        self.shared.update_policies(|current| {
            let next = PolicySnapshot::build(policies, 0, hash, Source::Static, Some(current));
            // The stream task takes the counts made on a pushed version as it replaces it
            // (`crate::stream`); here they are put with those of the calls that outlive it.
            if current.version() != next.version() {
                self.shared.announce(next.version());
                self.shared.metrics.retire(current.version());
            }
            next
        });
    }

    /// Whether the stream to the control plane is up now.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Relaxed)
    }

    /// Why the stream to the control plane last ended or could not start, while it is down;
    /// `None` while a stream is up, before the first try ends, and for an agent with no control
    /// plane. For tools that want to say why no policy came (a wrong token, the wrong
    /// listener); the agent keeps reconnecting whatever it is. A first try whose opening has
    /// had no answer for 5 s (a host that takes the connection and never answers: a wrong URL,
    /// a black-holed port) says so here (`no answer yet: …`, code `None`) while it waits for
    /// the rest of its 30 s.
    pub fn stream_error(&self) -> Option<StreamError> {
        self.shared
            .stream_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The last snapshot the control plane pushed that this agent refused (NACKed), with why,
    /// until a later one is applied; `None` when none was refused since. The control plane
    /// records the same reason (`retryplane status`); for tools that want to say why no policy
    /// came from it (`retryplane request --server`).
    pub fn last_refusal(&self) -> Option<crate::error::Refusal> {
        self.shared
            .last_refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Stops the background task after it sends the counts not yet reported and the answers
    /// to snapshots not yet sent (when connected), and the last applied snapshot is in the
    /// cache file. Each of those waits is bounded: 2 s for what is left to find room on the
    /// stream and, once any of it has, 2 s more at most for the control plane to take it (a control
    /// plane that takes nothing holds shutdown up 2 s; one that is slow but reading, 4 s at
    /// most); 2 s for the cache file.
    /// Handles keep working on the last policies. Every call, from any clone, returns once the
    /// task has stopped.
    ///
    /// The last report holds the calls ended by then: a call still in flight when shutdown
    /// begins, and any call made after it, is counted in the agent
    /// ([`crate::Endpoint::pending_counts`]) but never reported. Call `shutdown` once the
    /// service has stopped making calls (after its own graceful drain) to have them all.
    pub async fn shutdown(&self) {
        let Some(task) = &self.task else { return };
        task.cancel.cancel();
        // Held while waiting: a call made meanwhile waits for the same end. A call given up
        // half-way leaves the handle to the next one.
        let mut handle = task.handle.lock().await;
        if let Some(running) = handle.as_mut() {
            let _ = running.await;
            *handle = None;
        }
    }

    /// After [`Agent::shutdown`]: how many metrics reports no control plane had acknowledged
    /// when the agent stopped (sent and not answered, or never sent: a control plane that
    /// vanished, one that answered too late). Their counts may not be in the fleet's figures;
    /// counts never put in a report are in [`crate::Endpoint::pending_counts`]. 0 before
    /// shutdown, and for an agent on static policies.
    pub fn unacknowledged_reports(&self) -> u64 {
        self.shared.unacknowledged_at_stop.load(Relaxed)
    }

    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

fn fastrand_seed() -> u64 {
    use retryplane_policy::rng::Rng as _;
    SeededRng::from_entropy().next_u64()
}

/// The agent token as the builder was given it.
#[derive(Clone)]
enum GivenToken {
    /// [`AgentBuilder::token`].
    Value(String),
    /// [`AgentBuilder::token_file`].
    File(PathBuf),
}

/// `authorization: Bearer <token>` as metadata marked sensitive: HPACK never indexes it, so the
/// secret stays out of the connection's header tables (and any proxy's that honours the flag).
///
/// A token no control plane can hold is refused here, once, rather than refused by the control
/// plane on every try for good: an empty one, one with white space at either end (the control
/// plane trims what it is sent), or one with a character other than printable ASCII and the
/// space (what a tokens file's secrets are made of).
pub(crate) fn bearer(token: &str) -> Result<tonic::metadata::AsciiMetadataValue, AgentError> {
    if token.is_empty() || token.trim() != token || !retryplane_proto::is_metadata_text(token) {
        return Err(AgentError::InvalidToken);
    }
    let mut value: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}")
        .parse()
        .map_err(|_| AgentError::InvalidToken)?;
    value.set_sensitive(true);
    Ok(value)
}

/// The agent id made from the service name when none is given: the name, cut to leave room
/// (at a character boundary), then `-` and 16 hex digits of `seed`, within the control plane's
/// bound on a Hello field.
fn derived_agent_id(service: &str, seed: u64) -> String {
    let end = service.floor_char_boundary(retryplane_proto::MAX_HELLO_FIELD_BYTES - 17);
    format!("{}-{seed:016x}", &service[..end])
}

/// Refuses a control-plane URL (`text`, parsed as `uri`) without a scheme (no connection can be
/// made with it: the agent would retry for ever), with `https://` (it would be served in clear
/// text, token included, since the agent does not speak TLS), with a `user:password@` part (it
/// would go out in every call's `:authority`), with no host, with no port or one that is not a
/// number from 1 to 65535 (the connection would quietly go to port 80), or with a scheme other than `http://`
/// and `grpc://` (`grpcs://` asks for TLS, as `https://` does).
fn check_url(text: &str, uri: &http::Uri) -> Result<(), AgentError> {
    let reason: std::borrow::Cow<'static, str> = match uri.scheme_str() {
        None => "it has no scheme".into(),
        // HTTP/2 forbids userinfo in a request's `:authority` (RFC 9113 §8.3.1), where it would
        // otherwise go out in clear text on every call; the control plane takes a token. Any
        // `@` of the text counts: a password holding `/`, `?` or `#` ends the parsed authority
        // early (`http://u:pa/ss@h` is host `u`, port `pa`), and only the scheme and authority
        // of this URL are ever used, so no working URL needs one.
        Some(_) if uri.authority().is_some_and(|a| a.as_str().contains('@')) => {
            "it holds a user:password@ part, which is not sent: give the control plane's token \
             with AgentBuilder::token"
                .into()
        }
        Some(_) if text.contains('@') => {
            "it holds an `@` after the host (in a path or query, or in a password holding `/`, \
             `?` or `#`): only the scheme, host and port are used"
                .into()
        }
        // Named as written (`grpcs://` too): a scheme is a few letters, never a secret.
        Some(s) if s.eq_ignore_ascii_case("https") || s.eq_ignore_ascii_case("grpcs") => format!(
            "{}:// is not supported yet (TLS comes later), and the agent will not send its \
             token in clear text to a URL that asks for TLS",
            s.to_ascii_lowercase()
        )
        .into(),
        Some(s) if s.eq_ignore_ascii_case("unix") => "Unix sockets are not supported".into(),
        // Any other scheme would be served as `http://` (the connector dials the host and
        // port whatever the scheme says). `grpc://`, the usual name of clear-text gRPC, is
        // taken as `http://` (agents configured so have always connected).
        Some(s) if !s.eq_ignore_ascii_case("http") && !s.eq_ignore_ascii_case("grpc") => {
            "its scheme is neither http:// nor grpc://".into()
        }
        Some(_) if crate::names_no_host(uri) => "it names no host".into(),
        // The connection would go to port 80, where no control plane listens by default.
        Some(_)
            if uri
                .authority()
                .is_some_and(|a| crate::written_port(a.as_str()).is_none()) =>
        {
            "it names no port (the control plane's agent listener is on 7470 unless \
             `retryplane serve --listen` says otherwise)"
                .into()
        }
        Some(_) if has_bad_port(uri) => "its port is not a number from 1 to 65535".into(),
        Some(_) => return Ok(()),
    };
    Err(AgentError::UnsupportedUrl {
        reason: reason.into_owned(),
    })
}

/// Whether `uri`'s authority writes a port (after the host's last `:`, outside an IPv6
/// literal's brackets) that is not a number from 1 to 65535, `:` alone included.
fn has_bad_port(uri: &http::Uri) -> bool {
    uri.authority()
        .and_then(|a| crate::written_port(a.as_str()))
        .is_some_and(|port| !port.parse::<u16>().is_ok_and(|port| port > 0))
}

/// This process's `Hello.instance_id`: drawn from entropy even when [`AgentBuilder::rng_seed`]
/// fixes the seed, so that a restarted process (same seed, same agent id) never passes for the
/// previous one and has its numbered metrics reports taken for duplicates. Never 0 (0 says "the
/// client does not number its reports").
fn instance_id() -> u64 {
    fastrand_seed().max(1)
}

/// Settings of an agent fed by a control plane. Defaults: agent id `<service>-<random hex>`,
/// no labels, no token, no cache file, metrics every [`DEFAULT_METRICS_INTERVAL`] (the control
/// plane may set another), HTTP/2 keepalive pings every 20 s with 10 s to answer, RNG seeded
/// from entropy.
#[derive(Clone, Default)]
pub struct AgentBuilder {
    url: Option<String>,
    token: Option<GivenToken>,
    service: String,
    labels: BTreeMap<String, String>,
    agent_id: Option<String>,
    cache_file: Option<PathBuf>,
    metrics_interval: Option<Duration>,
    seed: Option<u64>,
    backoff: Option<ReconnectBackoff>,
    keepalive: Option<(Duration, Duration)>,
    ephemeral: bool,
    /// Run on the cache file's reading thread before it reads: a disk that answers late.
    #[cfg(test)]
    cache_read_stall: Option<Arc<dyn Fn() + Send + Sync>>,
}

// The token stays out of Debug.
impl std::fmt::Debug for AgentBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBuilder")
            .field(
                "url",
                &self.url.as_deref().map(crate::shown_url_without_query),
            )
            .field(
                "token",
                &self.token.as_ref().map(|given| match given {
                    GivenToken::Value(_) => "<redacted>".to_owned(),
                    GivenToken::File(path) => format!("file {}", path.display()),
                }),
            )
            .field("service", &self.service)
            .field("labels", &self.labels)
            .field("agent_id", &self.agent_id)
            .field("cache_file", &self.cache_file)
            .field("metrics_interval", &self.metrics_interval)
            .field("keepalive", &self.keepalive)
            .field("ephemeral", &self.ephemeral)
            .finish()
    }
}

impl AgentBuilder {
    /// The control plane's agent listener, `http://host:port` (`grpc://host:port` is taken as
    /// `http://`). [`AgentBuilder::connect`] refuses a URL without a scheme, with `https://` or
    /// `grpcs://` (the agent does not speak TLS yet) or any other scheme, a Unix socket, a
    /// `user:password@` part (the control plane takes a [token](AgentBuilder::token)) or an
    /// `@` after the host, no host, no port (the control plane's agent listener is on 7470 by
    /// default; the connection would quietly go to port 80), and a port that is not a number
    /// from 1 to 65535 ([`AgentError::UnsupportedUrl`](crate::AgentError::UnsupportedUrl)
    /// says which); a path, query or fragment is not used (the
    /// stream goes to the server's root), and a warning says so. Debug output shows a password
    /// here as `***` and leaves a query or fragment out (`?…`), as either may carry a
    /// credential ([`crate::shown_url_without_query`]).
    #[must_use]
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// The agent token, sent as `authorization: Bearer <token>`; never logged.
    /// [`AgentBuilder::connect`] refuses one no control plane holds (empty, white space at
    /// either end, a character other than printable ASCII and the space). Replaces a
    /// [`AgentBuilder::token_file`] given before.
    #[must_use]
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(GivenToken::Value(token.into()));
        self
    }

    /// The agent token, read from `path` (its content, without the ASCII white space around
    /// it) when the agent connects and again before each stream it opens, so that a secret
    /// rotated on disk (a mounted Kubernetes secret, a file a vault agent rewrites) is used
    /// from the next stream on, without a restart: a stream already open goes on with the
    /// token it opened with until it ends (the control plane ends it when the tokens file it
    /// reads no longer holds that secret).
    ///
    /// [`AgentBuilder::connect`] refuses a file it cannot read, a FIFO or a socket, or one
    /// whose content cannot be a token (as [`AgentBuilder::token`] refuses one)
    /// ([`AgentError::TokenFile`]); whether the control plane holds the token is learnt at
    /// the first stream. `connect` waits at most a second for the read (a volume that does
    /// not answer; the cache file's read may add another); until a token has been read, no
    /// stream is opened, and each try waits at most a second for the read under way. A later
    /// read that fails, or does not end within a second, keeps the token read before, and is
    /// warned of; a content other than the token in use is taken once two reads 50 ms apart
    /// agree (or two reads of successive tries) (a file rewritten in
    /// place is best replaced whole, by a rename, as Kubernetes does). Replaces
    /// [`AgentBuilder::token`] given before. The file is read to at most
    /// [`MAX_TOKEN_FILE_BYTES`](crate::MAX_TOKEN_FILE_BYTES) and never logged.
    ///
    /// ```no_run
    /// # fn run() -> Result<(), retryplane_agent::AgentError> {
    /// // A Kubernetes secret mounted as a file: a rotated secret is used from the next
    /// // stream on, with no restart.
    /// let agent = retryplane_agent::Agent::builder()
    ///     .url("http://retryplane.infra:7470")
    ///     .service("checkout")
    ///     .token_file("/var/run/secrets/retryplane/token")
    ///     .cache_file("/var/cache/checkout/retryplane-policies.bin")
    ///     .connect()?;
    /// # let _ = agent;
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn token_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.token = Some(GivenToken::File(path.into()));
        self
    }

    /// The service this agent runs in (required: [`AgentBuilder::connect`] refuses an agent
    /// without one). The control plane lists and counts agents by it.
    #[must_use]
    pub fn service(mut self, service: impl Into<String>) -> Self {
        self.service = service.into();
        self
    }

    /// Adds a label reported in Hello.
    #[must_use]
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Marks this agent short-lived (`Hello.ephemeral`): a command-line tool that connects for
    /// one call, say. Once its stream has ended, the control plane's fleet status leaves it
    /// out instead of listing it as disconnected. Off by default: a service's agent that
    /// disappears should show.
    #[must_use]
    pub fn ephemeral(mut self, ephemeral: bool) -> Self {
        self.ephemeral = ephemeral;
        self
    }

    /// A stable agent id (default: generated per process).
    #[must_use]
    pub fn agent_id(mut self, id: impl Into<String>) -> Self {
        self.agent_id = Some(id.into());
        self
    }

    /// Where the last applied snapshot is kept, for a start without the control plane. A file
    /// there that is not a policy cache (another file, given by mistake), one the agent cannot
    /// read, and anything that is not a regular file are never replaced: that is logged, and no
    /// cache is kept for the run.
    /// A cache file of the agent's own that cannot be used (damaged, written by a newer
    /// agent, or, with its header, holding more than a policy file can) is replaced by the
    /// next applied snapshot, and so is an empty file or one of zero bytes only (what a file
    /// system that lost its writes leaves). A file that cannot be read within 1 s at start (a cold network
    /// volume) is still read: the agent starts on the fallback policy
    /// and, when the read ends, puts the cached policies in force if it still runs on the
    /// fallback policy (the control plane sent none meanwhile). With a stream open, the counts
    /// made on the fallback are reported first, under its version, and the stream is then
    /// reopened at once so that the control plane learns the version in force. (Without one,
    /// they are held under the fallback's version and go out first on the next stream.)
    /// Nothing is written to the path before the read has ended and found the file the
    /// agent's own: a read that never ends leaves it alone for the run. A path that is a link
    /// to a cache is read through, and replaced by the file at the first write (never written
    /// through): give the file's own path. A write that fails (a full or missing volume) is
    /// warned of and tried again, 1 s later and then twice as long each time up to a minute,
    /// until it is done or a newer snapshot replaces it, and once more at
    /// [`Agent::shutdown`] (a warning says so if that fails too); a temporary file that an interrupted
    /// write left beside the cache (the process killed mid-write) is removed by a later write
    /// once it is 10 minutes old.
    ///
    /// The file is one agent's, for one control plane: it records neither, so an agent
    /// pointed at another control plane, or sharing the path with another agent, would start
    /// on the other's policies while its own control plane is out of reach (until that
    /// control plane, reached again, sends its own). An empty path is refused at
    /// [`AgentBuilder::connect`] ([`AgentError::EmptyCachePath`]).
    #[must_use]
    pub fn cache_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.cache_file = Some(path.into());
        self
    }

    /// How often metrics are sent unless the control plane says otherwise. This one and the
    /// control plane's are held within the control plane's own range, 100 ms to 1 h: a shorter
    /// one counts as 100 ms, a longer one as 1 h.
    #[must_use]
    pub fn metrics_interval(mut self, interval: Duration) -> Self {
        self.metrics_interval = Some(interval);
        self
    }

    /// The reconnect backoff (default [`ReconnectBackoff::default`]: 100 ms → 30 s; the
    /// reconnect after a stream that was up its `stable_after`, 10 s by default, spread over a
    /// second).
    #[must_use]
    pub fn reconnect_backoff(mut self, backoff: ReconnectBackoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// HTTP/2 keepalive: a ping every `interval`, and the connection counts as dead (the agent
    /// reconnects, keeping its policies) when one goes unanswered for `timeout`. This is what
    /// finds a control plane that vanished without closing the connection (a host gone, a
    /// network partition). Default: 20 s and 10 s, the server's own interval. Each is held
    /// within the control plane's own range, 1 s to 1 h.
    #[must_use]
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keepalive = Some((interval, timeout));
        self
    }

    /// A fixed seed for the RNG behind jitter (tests).
    #[must_use]
    pub fn rng_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Runs `stall` on the cache file's reading thread before it reads: a disk that answers
    /// when `stall` returns.
    #[cfg(test)]
    pub(crate) fn cache_read_stall(mut self, stall: impl Fn() + Send + Sync + 'static) -> Self {
        self.cache_read_stall = Some(Arc::new(stall));
        self
    }

    /// Starts the agent and returns without waiting for the control plane: the policies come
    /// from the cache file if it holds a valid snapshot, else the [`crate::fallback_policy`],
    /// until the control plane sends some; which of the two is logged at start, with why the
    /// cache file was not used. The cache file is read on a thread of its own, waited for at
    /// most 1 s before this returns: a disk that does not answer by then is logged at warn, and
    /// the read goes on in the background (see [`AgentBuilder::cache_file`]). A file read in
    /// time is also checked before this returns (decoded and validated: milliseconds for most
    /// files, longer for one near the size limit). The wait blocks the calling thread, so call
    /// this at start, before the service takes traffic. One background
    /// task owns the stream. Must be called inside a tokio runtime with timers and sockets
    /// (`enable_all()`; `#[tokio::main]` has them): the task runs on that runtime and ends with
    /// it (dropped without [`Agent::shutdown`], the agent then says it is not connected and why,
    /// in [`Agent::stream_error`], and keeps the policies it had). An agent id, service name
    /// or labels the control plane would refuse in the Hello (past its default bounds, or with
    /// a control character) are refused here ([`AgentError::InvalidHello`], naming the field);
    /// the agent id made when none is given fits whatever the service name's length.
    pub fn connect(self) -> Result<Agent, AgentError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| AgentError::NoRuntime)?;
        let url = self.url.ok_or(AgentError::MissingUrl)?;
        // tonic reads `unix:` as a socket path (and its URI as `http://tonic`), which the
        // agent's connector would then dial as a host.
        if url.starts_with("unix:") {
            return Err(AgentError::UnsupportedUrl {
                reason: "Unix sockets are not supported".to_owned(),
            });
        }
        let endpoint =
            tonic::transport::Endpoint::from_shared(url.clone()).map_err(AgentError::InvalidUrl)?;
        check_url(&url, endpoint.uri())?;
        if let Some(parts) = crate::unused_url_parts(&url) {
            let verb = if parts.contains(" and ") { "are" } else { "is" };
            warn!(
                "the {parts} of the control-plane URL {verb} not used: the agent's stream goes to the server's root (only the scheme, host and port count)"
            );
        }
        let token = match &self.token {
            None => None,
            Some(GivenToken::Value(token)) => {
                Some(crate::stream::token::TokenSource::Fixed(bearer(token)?))
            }
            Some(GivenToken::File(path)) => Some(crate::stream::token::TokenSource::File(
                crate::stream::token::TokenFile::open(path)?,
            )),
        };
        // Fleet status, metrics and (SPEC §6) per-caller scoping all go by the service: an
        // agent with none would be listed and counted under an empty name.
        if self.service.trim().is_empty() {
            return Err(AgentError::MissingService);
        }
        // Every write there would fail, retried for the whole run.
        if self
            .cache_file
            .as_ref()
            .is_some_and(|path| path.as_os_str().is_empty())
        {
            return Err(AgentError::EmptyCachePath);
        }
        let agent_id = self
            .agent_id
            .unwrap_or_else(|| derived_agent_id(&self.service, fastrand_seed()));
        let hello = pb::Hello {
            agent_id,
            service: self.service,
            labels: self.labels.into_iter().collect(),
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            last_applied_version: 0,
            last_applied_hash: String::new(),
            instance_id: instance_id(),
            ephemeral: self.ephemeral,
            // Keepalives both ways, and a stream silent too long taken for dead
            // (`retryplane_proto::liveness`), with a control plane that takes them.
            heartbeats: true,
            // Each session numbers its own (see `stream::session`).
            stream: 0,
        };
        // Refused here once, naming the field, rather than by the control plane on every try.
        retryplane_proto::check_hello(
            &hello,
            retryplane_proto::MAX_HELLO_FIELD_BYTES,
            retryplane_proto::MAX_HELLO_LABELS,
        )
        .map_err(AgentError::InvalidHello)?;
        let seed = self.seed.unwrap_or_else(fastrand_seed);
        // A file that is not a policy cache is left alone: no cache is kept this run. One not
        // read in time goes to the stream task, which settles it before writing there.
        #[cfg(test)]
        let before_read = self.cache_read_stall.clone().map(|stall| {
            let stall: crate::cache::BeforeRead = Box::new(move || stall());
            stall
        });
        #[cfg(not(test))]
        let before_read = None;
        let (cached, cache_file, late_read) = match self.cache_file {
            Some(path) => match crate::cache::load(&path, before_read) {
                crate::cache::Start::Read(Ok(cached)) => (cached, Some(path), None),
                crate::cache::Start::Read(Err(crate::cache::Foreign)) => (None, None, None),
                crate::cache::Start::Late(late) => (None, Some(path), Some(late)),
            },
            None => (None, None, None),
        };
        let interval = self.metrics_interval.unwrap_or(DEFAULT_METRICS_INTERVAL);
        // The control plane's interval, kept with the cached snapshot, wins over the agent's own,
        // as it does when a snapshot arrives: an up-to-date agent is sent no snapshot.
        let (snapshot, current_interval) = match cached {
            Some(c) => {
                let current = c.metrics_interval.unwrap_or(interval);
                (c.into_snapshot(None), current)
            }
            None => {
                info!(
                    max_attempts = crate::fallback_policy().max_attempts,
                    "starting on the fallback policy until the control plane sends policies"
                );
                (PolicySnapshot::fallback(), interval)
            }
        };
        let shared = Arc::new(Shared::new(snapshot, seed, current_interval));
        let config = StreamConfig {
            endpoint,
            token,
            hello,
            cache_file,
            late_read,
            default_metrics_interval: interval,
            backoff: self.backoff.unwrap_or_default(),
            keepalive: self
                .keepalive
                .unwrap_or((stream::KEEPALIVE_INTERVAL, stream::KEEPALIVE_TIMEOUT)),
        };
        let cancel = CancellationToken::new();
        let handle = runtime.spawn(stream::run(shared.clone(), config, cancel.clone(), seed));
        Ok(Agent {
            shared,
            task: Some(Arc::new(Task {
                _guard: cancel.clone().drop_guard(),
                cancel,
                handle: Mutex::new(Some(handle)),
            })),
        })
    }
}

/// The bytes of the policy file at `path`, at most one more than a policy file may hold (as the
/// CLI and the control plane read one): a path to `/dev/zero` or an endless pipe costs 1 MiB,
/// not all memory. A FIFO or a socket is refused before it is opened (opening a FIFO waits for
/// a writer, for good). With them, the file's size when it is a regular file.
fn read_policy_file(path: &Path) -> std::io::Result<(Vec<u8>, Option<u64>)> {
    use std::io::Read as _;
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt as _;
        let kind = std::fs::metadata(path)?.file_type();
        if kind.is_fifo() || kind.is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a FIFO or a socket, not a file; save the policies in a regular file",
            ));
        }
    }
    let file = std::fs::File::open(path)?;
    let size = file
        .metadata()
        .ok()
        .filter(std::fs::Metadata::is_file)
        .map(|m| m.len());
    let limit = u64::try_from(retryplane_policy::yaml::MAX_FILE_BYTES).map_or(u64::MAX, |m| m + 1);
    let mut bytes = Vec::new();
    file.take(limit).read_to_end(&mut bytes)?;
    Ok((bytes, size))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CallMeta;

    fn set(max_attempts: u32) -> PolicySet {
        let yaml = format!("version: 1\nendpoints:\n  a: {{max_attempts: {max_attempts}}}\n");
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
    }

    /// What a watch gives is the snapshot itself: a service that keeps it (across an
    /// `.await`, say) holds up no swap, and the watch hears of each one.
    #[tokio::test(flavor = "current_thread")]
    async fn a_watch_sees_each_swap_and_what_it_gave_holds_none_up() {
        let agent = Agent::from_policies(set(2));
        let mut watch = agent.watch_policies();
        let kept = watch.wait_for(|_| true).await.unwrap();
        assert!(Arc::ptr_eq(&kept, &agent.policies()));
        // With a borrow of the channel held, this swap would wait for good.
        agent.set_policies(set(3));
        let now = watch.changed().await.unwrap();
        assert!(Arc::ptr_eq(&now, &agent.policies()));
        assert_ne!(now.content_hash(), kept.content_hash());
        assert!(Arc::ptr_eq(&watch.current(), &agent.policies()));
        drop(agent);
        assert!(watch.changed().await.is_none(), "the agent is gone");
    }

    /// `?agent`, `?endpoint` and `?snapshot` in a log line are one short line each, whatever
    /// the policies hold (the derived forms printed every policy and state: kilobytes).
    #[tokio::test(start_paused = true)]
    async fn debug_of_the_agent_its_handles_and_snapshots_is_one_short_line() {
        let mut yaml = String::from("version: 1\nendpoints:\n");
        for n in 0..200 {
            yaml.push_str(&format!(
                "  svc-{n}: {{max_attempts: 3, retry_on: {{http_status: [503, 504]}}}}\n"
            ));
        }
        let agent = Agent::from_policies_seeded(
            retryplane_policy::load(yaml.as_bytes()).policies.unwrap(),
            1,
        );
        let endpoint = agent.endpoint("svc-7");
        let shown = [
            format!("{agent:?}"),
            format!("{endpoint:?}"),
            format!("{:?}", agent.policies()),
        ];
        for line in &shown {
            assert!(line.len() < 300 && !line.contains('\n'), "{line}");
            assert!(
                !line.contains("max_attempts") && !line.contains("svc-0"),
                "no policy in it: {line}"
            );
        }
        assert!(
            shown[0].starts_with("Agent { policies: PolicySnapshot { version: 0, content_hash: \"")
        );
        assert!(
            shown[0].ends_with(
                "source: Static, endpoints: 200, .. }, control_plane: none, connected: false, stream_error: None, .. }"
            ),
            "{}",
            shown[0]
        );
        assert_eq!(shown[1], "Endpoint { name: \"svc-7\", version: 0, .. }");
    }

    /// An agent fed by a control plane says in its `Debug` whether its task runs or was shut
    /// down, and why its stream last ended (it once said `control_plane: true` after
    /// `shutdown`, and nothing of the error).
    #[tokio::test]
    async fn debug_of_an_agent_says_its_stream_error_and_when_it_was_shut_down() {
        // A port nothing listens on: the stream cannot start.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let agent = Agent::builder().url(url).service("s").connect().unwrap();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        while agent.stream_error().is_none() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no stream error came"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let shown = format!("{agent:?}");
        assert!(
            shown.contains("control_plane: running, connected: false, stream_error: Some(\""),
            "{shown}"
        );
        assert!(shown.len() < 500 && !shown.contains('\n'), "{shown}");
        agent.shutdown().await;
        let shown = format!("{agent:?}");
        assert!(shown.contains("control_plane: shut_down"), "{shown}");
        // A long reason is cut at 160 bytes, on a character's boundary.
        let long = format!("{}{}", "x".repeat(159), "é".repeat(100));
        *agent.shared.stream_error.lock().unwrap() = Some(StreamError {
            code: None,
            message: long,
        });
        let shown = format!("{agent:?}");
        assert!(
            shown.contains(&format!("stream_error: Some(\"{}…\")", "x".repeat(159))),
            "{shown}"
        );
    }

    /// A service that names its endpoints after hosts calls many once: once no handle holds
    /// them, they have reported their counts and their budgets and breakers are idle, the
    /// agent keeps nothing of them, and a push carries none (before: every name was kept, and
    /// each push that changed `defaults:` rebuilt a budget and breaker for every one).
    #[tokio::test(start_paused = true)]
    async fn endpoints_no_handle_holds_are_forgotten_once_reported_and_idle() {
        let with_ratio = |ratio: u32| {
            let yaml = format!(
                "version: 1\ndefaults:\n  budget: {{ratio: 0.{ratio}}}\nendpoints:\n  a: {{}}\n"
            );
            retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
        };
        let ok = |_| async { Ok::<_, std::io::Error>(http::Response::new(())) };
        let agent = Agent::from_policies_seeded(with_ratio(1), 1);
        let held = agent.endpoint("held");
        held.call(CallMeta::http("GET", "/"), ok).await.unwrap();
        for n in 0..2_000 {
            let ep = agent.endpoint(&format!("host-{n}.example"));
            ep.call(CallMeta::http("GET", "/"), ok).await.unwrap();
        }
        assert_eq!(agent.shared.cores.len(), 2_001);
        assert_eq!(agent.policies().unnamed_states(), 2_001);
        tokio::time::advance(Duration::from_secs(600)).await;
        // The first push still finds each state held by the entry its endpoint kept, and
        // carries it; it lets go of the kept entries, so the second drops the idle states.
        agent.set_policies(with_ratio(2));
        assert_eq!(agent.shared.cores.len(), 1, "only the core a handle holds");
        agent.set_policies(with_ratio(3));
        assert_eq!(
            agent.policies().unnamed_states(),
            1,
            "idle ones made afresh when used; the held one's kept"
        );
        // The counts not yet reported are kept until they are.
        let taken = agent.shared.metrics.take();
        assert_eq!(taken.len(), 2_001);
        assert!(taken.iter().all(|c| c.calls == 1), "{:?}", taken.first());
        assert_eq!(
            agent.shared.metrics.len(),
            1,
            "the held endpoint's counters"
        );
        // A name used again starts afresh, and counts.
        let again = agent.endpoint("host-7.example");
        again.call(CallMeta::http("GET", "/"), ok).await.unwrap();
        assert_eq!(again.pending_counts().calls, 1);
        held.call(CallMeta::http("GET", "/"), ok).await.unwrap();
        assert_eq!(held.pending_counts().calls, 1);
        assert_eq!(agent.policies().unnamed_states(), 2);
    }

    /// With no push (the common case: a control plane pushes only when an operator edits the
    /// policies), an endpoint called once and let go is forgotten at the reports: its core
    /// (with the entry it kept, which pins its state) at the next, its counters once their
    /// counts are taken, its idle state with them.
    #[tokio::test(start_paused = true)]
    async fn endpoints_no_handle_holds_are_forgotten_once_reported_with_no_push() {
        let ok = |_| async { Ok::<_, std::io::Error>(http::Response::new(())) };
        let agent = Agent::from_policies_seeded(set(2), 1);
        let held = agent.endpoint("held");
        held.call(CallMeta::http("GET", "/"), ok).await.unwrap();
        for n in 0..100 {
            let ep = agent.endpoint(&format!("host-{n}.example"));
            ep.call(CallMeta::http("GET", "/"), ok).await.unwrap();
        }
        tokio::time::advance(Duration::from_secs(600)).await;
        // Two reports, as the stream task takes them, a while apart.
        agent.shared.forget_unheld();
        let taken = agent.shared.metrics.take();
        assert_eq!(taken.len(), 101);
        tokio::time::advance(Duration::from_secs(10)).await;
        agent.shared.forget_unheld();
        assert!(agent.shared.metrics.take().is_empty());
        assert_eq!(
            (agent.shared.cores.len(), agent.shared.metrics.len()),
            (1, 1),
            "reported, idle and held by no handle: forgotten; the held one kept"
        );
        assert_eq!(agent.policies().unnamed_states(), 1, "the held one's");
    }

    #[test]
    fn the_token_goes_out_as_a_sensitive_bearer_value() {
        let value = bearer("s3cret").unwrap();
        assert!(value.is_sensitive());
        assert_eq!(value.to_str().unwrap(), "Bearer s3cret");
        for bad in [
            "bad\ntoken",
            "",
            "   ",
            " padded-token-0123",
            "padded-token-0123\t",
            "tökentökentökentöken",
        ] {
            assert!(
                matches!(bearer(bad), Err(AgentError::InvalidToken)),
                "{bad:?}"
            );
        }
        assert!(bearer("a token with spaces inside").is_ok());
    }

    #[test]
    fn an_agent_id_made_from_a_long_service_name_stays_within_the_bound() {
        let max = retryplane_proto::MAX_HELLO_FIELD_BYTES;
        assert_eq!(
            derived_agent_id("checkout", 0xab),
            "checkout-00000000000000ab"
        );
        for service in ["s".repeat(240), "s".repeat(256), "é".repeat(200)] {
            let id = derived_agent_id(&service, u64::MAX);
            assert!(id.len() <= max, "{} bytes", id.len());
            assert!(id.ends_with("-ffffffffffffffff"), "{id}");
            assert!(service.starts_with(&id[..id.len() - 17]));
        }
    }

    #[tokio::test]
    async fn an_identity_the_control_plane_would_refuse_is_refused_at_connect() {
        let url = "http://127.0.0.1:7470";
        // The longest service the control plane takes, with the agent id made from it.
        let ok = Agent::builder().url(url).service("s".repeat(256)).connect();
        assert!(ok.is_ok(), "{:?}", ok.err());
        let refused = |builder: AgentBuilder| match builder.url(url).connect() {
            Err(AgentError::InvalidHello(e)) => e.to_string(),
            other => panic!("expected InvalidHello, got {:?}", other.err()),
        };
        assert_eq!(
            refused(Agent::builder().service("a\nb")),
            "Hello.service holds a control character"
        );
        assert_eq!(
            refused(Agent::builder().service("s".repeat(257))),
            "Hello.service is 257 bytes; Hello fields are limited to 256 bytes"
        );
        assert_eq!(
            refused(Agent::builder().service("checkout").agent_id("")),
            "Hello.agent_id is empty"
        );
        assert!(
            refused(Agent::builder().service("checkout").label("zone", "eu\r"))
                .starts_with("Hello.labels: ")
        );
    }

    #[tokio::test]
    async fn an_agent_without_a_service_name_is_refused_at_connect() {
        let url = "http://127.0.0.1:7470";
        for builder in [Agent::builder(), Agent::builder().service(" \t")] {
            match builder.url(url).connect() {
                Err(e @ AgentError::MissingService) => {
                    assert_eq!(
                        e.to_string(),
                        "no service name given (AgentBuilder::service)"
                    );
                }
                other => panic!("expected MissingService, got {:?}", other.err()),
            }
        }
    }

    #[tokio::test]
    async fn an_empty_cache_path_is_refused_at_connect() {
        let builder = Agent::builder()
            .url("http://127.0.0.1:7470")
            .service("checkout")
            .cache_file("");
        match builder.connect() {
            Err(e @ AgentError::EmptyCachePath) => assert_eq!(
                e.to_string(),
                "the cache file's path is empty (AgentBuilder::cache_file)"
            ),
            other => panic!("expected EmptyCachePath, got {:?}", other.err()),
        }
    }

    #[tokio::test]
    async fn a_url_without_a_scheme_or_asking_for_tls_is_refused_at_connect() {
        let connect = |url: &str| {
            Agent::builder()
                .url(url)
                .service("checkout")
                .token("s3cret")
                .connect()
        };
        // `https://` asks for TLS, which the agent does not speak: the token would go out in
        // clear text.
        for url in ["https://127.0.0.1:7470", "HTTPS://127.0.0.1:7470"] {
            match connect(url) {
                Err(AgentError::UnsupportedUrl { reason }) => {
                    assert!(reason.contains("https://"), "{reason}");
                }
                other => panic!("{url}: expected UnsupportedUrl, got {other:?}"),
            }
        }
        // A scheme other than http:// would be served as http://, whatever it says.
        for (url, says) in [
            (
                "grpcs://127.0.0.1:7470",
                "grpcs:// is not supported yet (TLS",
            ),
            (
                "GRPCS://127.0.0.1:7470",
                "grpcs:// is not supported yet (TLS",
            ),
            ("ftp://127.0.0.1:7470", "neither http:// nor grpc://"),
            ("unix:///tmp/retryplane.sock", "Unix sockets"),
            // No host, no port: no control plane there.
            ("http://:7470", "no host"),
            ("http://127.0.0.1", "no port"),
            ("http://[::1]/", "no port"),
            ("grpc://localhost", "no port"),
        ] {
            match connect(url) {
                Err(AgentError::UnsupportedUrl { reason }) => {
                    assert!(reason.contains(says), "{url}: {reason}");
                }
                other => panic!("{url}: expected UnsupportedUrl, got {other:?}"),
            }
        }
        // No scheme: no connection could ever be made.
        match connect("127.0.0.1:7470") {
            Err(e @ AgentError::UnsupportedUrl { .. }) => {
                assert!(e.to_string().contains("http://"), "{e}");
            }
            other => panic!("expected UnsupportedUrl, got {other:?}"),
        }
        // A password would go out in clear text in every call's `:authority`; neither it nor
        // the URL is quoted in the error.
        // A password holding `/`, `?` or `#` ends the parsed authority early (the host would be
        // `admin`): refused all the same.
        for (url, says) in [
            ("http://admin:s3cret@127.0.0.1:7470", "user:password@ part"),
            ("http://admin@127.0.0.1:7470", "user:password@ part"),
            ("http://admin:s3cret/x@127.0.0.1:7470", "`@` after the host"),
            ("http://admin:s3cret?x@127.0.0.1:7470", "`@` after the host"),
            ("http://admin:s3cret#x@127.0.0.1:7470", "`@` after the host"),
            (
                "http://admin:12345/s3cret@127.0.0.1:7470",
                "`@` after the host",
            ),
            ("http://127.0.0.1:7470/p@x", "`@` after the host"),
        ] {
            match connect(url) {
                Err(e @ AgentError::UnsupportedUrl { .. }) => {
                    let shown = e.to_string();
                    assert!(shown.contains(says), "{url}: {shown}");
                    assert!(
                        !shown.contains("s3cret") && !shown.contains("admin"),
                        "{shown}"
                    );
                }
                other => panic!("{url}: expected UnsupportedUrl, got {other:?}"),
            }
        }
        // A port that is no port would quietly be port 80; it is not quoted either.
        for url in [
            "http://cp:s3cret",
            "http://cp:",
            "http://cp:0",
            "http://[::1]:99999",
        ] {
            match connect(url) {
                Err(e @ AgentError::UnsupportedUrl { .. }) => {
                    let shown = e.to_string();
                    assert!(shown.contains("port"), "{shown}");
                    assert!(!shown.contains("s3cret"), "{shown}");
                }
                other => panic!("{url}: expected UnsupportedUrl, got {other:?}"),
            }
        }
        for url in [
            "http://127.0.0.1:9",
            "http://[::1]:9",
            "http://localhost:9",
            "HTTP://127.0.0.1:9",
            "grpc://127.0.0.1:9",
        ] {
            let agent = connect(url).unwrap();
            agent.shutdown().await;
        }
    }

    #[test]
    fn the_builder_debug_hides_a_password_in_the_url() {
        let builder = Agent::builder().url("http://admin:s3cret@127.0.0.1:7470");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("http://admin:***@127.0.0.1:7470"), "{shown}");
        // A query or fragment may carry a credential too (`?token=…`): left out.
        for url in [
            "http://127.0.0.1:7470/?access_token=qs-secret",
            "http://127.0.0.1:7470/#qs-secret",
        ] {
            let shown = format!("{:?}", Agent::builder().url(url));
            assert!(!shown.contains("qs-secret"), "{shown}");
            assert!(shown.contains("http://127.0.0.1:7470/"), "{shown}");
        }
    }

    fn max_attempts(agent: &Agent) -> u32 {
        let snapshot = agent.policies();
        snapshot
            .set()
            .unwrap()
            .endpoint("a")
            .unwrap()
            .policy
            .max_attempts
    }

    #[test]
    fn from_file_runs_on_the_files_policies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, "version: 1\nendpoints:\n  a: {max_attempts: 4}\n").unwrap();
        let agent = Agent::from_file(&path).unwrap();
        assert_eq!(max_attempts(&agent), 4);
        assert_eq!(agent.policies().source(), Source::Static);
        assert!(!agent.is_connected());
    }

    /// A FIFO is refused without being opened (opening it waits for a writer, for good), and
    /// an endless source is read no further than the size limit allows.
    #[cfg(target_os = "linux")]
    #[test]
    fn from_file_refuses_a_fifo_and_reads_an_endless_source_only_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("policies.yaml");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(Agent::from_file(&fifo).map(|_| ()));
        });
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Err(AgentError::ReadPolicyFile { source, .. })) => {
                assert_eq!(source.kind(), std::io::ErrorKind::InvalidInput);
                assert!(source.to_string().contains("FIFO"), "{source}");
            }
            other => panic!("expected the FIFO refused at once, got {other:?}"),
        }
        match Agent::from_file("/dev/zero") {
            Err(AgentError::InvalidPolicyFile { errors, first, .. }) => {
                assert_eq!(errors, 1);
                assert!(first.contains("more than 1048576"), "{first}");
            }
            other => panic!("expected a too-large file, got {other:?}"),
        }
    }

    #[test]
    fn from_file_reports_a_file_it_cannot_read_with_its_path_and_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.yaml");
        match Agent::from_file(&path) {
            Err(AgentError::ReadPolicyFile { path: p, source }) => {
                assert_eq!(p, path);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("expected ReadPolicyFile, got {other:?}"),
        }
    }

    #[test]
    fn from_file_reports_an_invalid_file_with_its_error_count_and_first_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        // Two errors: max_attempts 0, and a multiplier below 1.
        std::fs::write(
            &path,
            "version: 1\nendpoints:\n  a:\n    max_attempts: 0\n    backoff: {multiplier: 0.5}\n",
        )
        .unwrap();
        match Agent::from_file(&path) {
            Err(AgentError::InvalidPolicyFile {
                path: p,
                errors,
                first,
            }) => {
                assert_eq!(p, path);
                assert_eq!(errors, 2, "{first}");
                assert!(first.contains("max_attempts"), "{first}");
            }
            other => panic!("expected InvalidPolicyFile, got {other:?}"),
        }
        // A file that is not a policy document at all.
        std::fs::write(&path, "endpoints: [").unwrap();
        match Agent::from_file(&path) {
            Err(AgentError::InvalidPolicyFile { errors, first, .. }) => {
                assert!(errors >= 1);
                assert!(!first.is_empty());
            }
            other => panic!("expected InvalidPolicyFile, got {other:?}"),
        }
    }

    #[test]
    fn a_replaced_snapshot_is_freed_by_the_next_swap_not_by_a_call_that_held_it() {
        let agent = Agent::from_policies_seeded(set(2), 1);
        let in_flight = agent.policies();
        agent.set_policies(set(3));
        assert_eq!(max_attempts(&agent), 3);
        assert_eq!(
            Arc::strong_count(&in_flight),
            2,
            "the agent still holds the replaced snapshot: the call's release does not free it"
        );
        drop(in_flight);

        let replaced = Arc::downgrade(&agent.policies());
        agent.set_policies(set(4));
        assert!(replaced.upgrade().is_some(), "kept until the next swap");
        agent.set_policies(set(5));
        assert!(replaced.upgrade().is_none(), "freed by the swap after");
        assert_eq!(max_attempts(&agent), 5);
    }

    /// Writes a cache file holding version 3 of `set(4)`, with the control plane's interval.
    fn cache_with_interval(dir: &std::path::Path, interval_ms: u64) -> PathBuf {
        use prost::Message as _;
        let doc = pb::PolicyDocument::from(set(4).document().as_ref());
        let snap = pb::Snapshot {
            version: 3,
            content_hash: convert::content_hash(&doc),
            policies: Some(doc),
            nonce: "n".into(),
            metrics_interval_ms: interval_ms,
        };
        let path = dir.join(format!("agent-{interval_ms}.cache"));
        crate::cache::write_atomic(&path, &snap.encode_to_vec()).unwrap();
        path
    }

    #[tokio::test]
    async fn an_agent_started_from_its_cache_reports_at_the_interval_the_control_plane_set() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing listens there: the agent runs on its cache.
        let url = "http://127.0.0.1:9";
        let builder = || {
            Agent::builder()
                .url(url)
                .service("checkout")
                .metrics_interval(Duration::from_secs(7))
        };
        let interval = |agent: &Agent| agent.shared().metrics_interval_ms.load(Relaxed);

        let agent = builder()
            .cache_file(cache_with_interval(dir.path(), 250))
            .connect()
            .unwrap();
        assert_eq!(agent.policies().version(), 3);
        assert_eq!(interval(&agent), 250, "the control plane's, from the cache");

        let agent = builder()
            .cache_file(cache_with_interval(dir.path(), 0))
            .connect()
            .unwrap();
        assert_eq!(agent.policies().version(), 3);
        assert_eq!(interval(&agent), 7_000, "left to the agent: its own");

        let agent = builder().connect().unwrap();
        assert_eq!(interval(&agent), 7_000, "no cache: its own");
    }

    /// Reports (each lets go of unheld endpoints, then takes the counts, as `send_metrics`
    /// does) and pushes as fast as they come on one thread, as the stream task makes them,
    /// while callers on other threads make a handle per call on a few names, some calls
    /// retrying, and, with `set_policies`, the program's thread sets policies (version 0) now
    /// and then: every count is taken once, under the version the call ran on (version `v`
    /// makes `attempts_of(v)` attempts), and once all is reported nothing of the endpoints is
    /// kept.
    // The reporter and setter are plain threads, as the stream task and a program's own
    // thread are to the callers; they are paced by the calls ended, not by a clock, and run
    // until the callers (a fixed number of calls each) are done.
    #[allow(clippy::type_complexity)]
    async fn race_calls_with_reports_and_pushes(set_policies: bool) {
        use std::collections::BTreeMap;
        use std::sync::atomic::{AtomicBool, AtomicU64};
        const CALLERS: u64 = 6;
        const CALLS: u64 = 1_500;
        const VERSIONS: u64 = 100;
        let attempts_of = |v: u64| if v == 0 { 2 } else { 3 + v % 7 };
        let policies = move |v: u64| {
            let yaml = format!(
                "version: 1\ndefaults:\n  max_attempts: {}\n  backoff: {{base: 1ms, max: 1ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  named: {{}}\n",
                attempts_of(v)
            );
            retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
        };
        let agent = Agent::from_policies_seeded(policies(1), 1);
        let shared = agent.shared.clone();
        // Version 1, as a push puts it.
        shared.update_policies(|current| {
            PolicySnapshot::build(
                policies(1),
                1,
                String::new(),
                Source::ControlPlane,
                Some(current),
            )
        });
        let done = Arc::new(AtomicBool::new(false));
        // Calls ended so far: what pushes and policies set are paced by.
        let ended = Arc::new(AtomicU64::new(0));
        // attempts per call -> (calls, attempts) the callers saw (u64::MAX: first-try successes).
        let truth: Arc<std::sync::Mutex<BTreeMap<u64, (u64, u64)>>> = Arc::default();
        let mut callers = Vec::new();
        for id in 0..CALLERS {
            let agent = agent.clone();
            let truth = truth.clone();
            let ended = ended.clone();
            callers.push(tokio::spawn(async move {
                for n in 0..CALLS {
                    let ep = agent.endpoint(&format!("host-{}", (id + n) % 16));
                    let made = Arc::new(AtomicU64::new(0));
                    let m = made.clone();
                    let r = ep
                        .call(CallMeta::http("GET", "/"), move |_| {
                            m.fetch_add(1, Relaxed);
                            let status = if n % 4 == 0 { 200 } else { 503 };
                            std::future::ready(Ok::<_, std::io::Error>(
                                http::Response::builder().status(status).body(()).unwrap(),
                            ))
                        })
                        .await;
                    let made = made.load(Relaxed);
                    ended.fetch_add(1, Relaxed);
                    // Failing calls run out of attempts: their count says the version.
                    if r.is_err() {
                        let mut t = truth.lock().unwrap();
                        let e = t.entry(made).or_default();
                        e.0 += 1;
                        e.1 += made;
                    } else {
                        let mut t = truth.lock().unwrap();
                        let e = t.entry(u64::MAX).or_default();
                        e.0 += 1;
                        e.1 += made;
                    }
                }
            }));
        }
        let reporter = {
            let shared = shared.clone();
            let done = done.clone();
            let ended = ended.clone();
            std::thread::spawn(move || {
                // version -> (calls, attempts, first-try successes) reported.
                let mut got: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new();
                let mut add = |v: u64, c: &[pb::EndpointCounters], got: &mut BTreeMap<_, _>| {
                    for c in c {
                        let e: &mut (u64, u64, u64) = got.entry(v).or_default();
                        e.0 += c.calls;
                        e.1 += c.attempts;
                        e.2 += c.success_first_try;
                    }
                };
                let report = |got: &mut BTreeMap<u64, (u64, u64, u64)>,
                              add: &mut dyn FnMut(
                    u64,
                    &[pb::EndpointCounters],
                    &mut BTreeMap<u64, (u64, u64, u64)>,
                )| {
                    shared.forget_unheld();
                    // As `send_metrics`: the version read and the counts taken with no swap
                    // in between.
                    shared.between_swaps(|| {
                        for (v, c) in shared.metrics.take_outlived() {
                            add(v, &c, got);
                        }
                        let v = shared.policies.load().version();
                        add(v, &shared.metrics.take(), got);
                    });
                };
                let mut version = 1;
                // A push each time this many more calls have ended: spread over the run.
                let every = CALLERS * CALLS / VERSIONS;
                let mut next_push = every;
                // Until the callers are done (a bounded number of calls).
                while !done.load(Relaxed) {
                    report(&mut got, &mut add);
                    if ended.load(Relaxed) >= next_push && version < VERSIONS {
                        next_push += every;
                        version += 1;
                        // As `stream::apply` does: announce, take the outgoing version's counts,
                        // swap.
                        shared.update_policies(|current| {
                            let next = PolicySnapshot::build(
                                policies(version),
                                version,
                                String::new(),
                                Source::ControlPlane,
                                Some(current),
                            );
                            shared.announce(version);
                            let c = shared.metrics.take();
                            add(current.version(), &c, &mut got);
                            next
                        });
                    }
                    std::thread::yield_now();
                }
                for _ in 0..2 {
                    report(&mut got, &mut add);
                }
                (got, version)
            })
        };
        let setter = set_policies.then(|| {
            let agent = agent.clone();
            let done = done.clone();
            let ended = ended.clone();
            std::thread::spawn(move || {
                // Policies set each time another 150 calls have ended, until the callers are
                // done.
                let mut next = 150;
                while !done.load(Relaxed) {
                    if ended.load(Relaxed) >= next {
                        next += 150;
                        agent.set_policies(policies(0));
                    }
                    std::thread::yield_now();
                }
            })
        });
        for c in callers {
            c.await.unwrap();
        }
        done.store(true, Relaxed);
        if let Some(setter) = setter {
            setter.join().unwrap();
        }
        let (got, last) = reporter.join().unwrap();
        let truth = truth.lock().unwrap().clone();
        let calls: u64 = truth.values().map(|t| t.0).sum();
        let attempts: u64 = truth.values().map(|t| t.1).sum();
        let first_try = truth.get(&u64::MAX).map_or(0, |t| t.0);
        assert_eq!(calls, CALLERS * CALLS);
        let sum = got
            .values()
            .fold((0, 0, 0), |a, g| (a.0 + g.0, a.1 + g.1, a.2 + g.2));
        assert_eq!(
            sum,
            (calls, attempts, first_try),
            "(calls, attempts, first-try successes) taken against made; got {got:?}, truth {truth:?}, last version {last}"
        );
        // Every call that failed ran out of its version's attempts: per version, the calls
        // taken under it made `v + 1` attempts each, first-try successes aside.
        for (v, (calls, attempts, first)) in &got {
            assert_eq!(
                attempts - first,
                (calls - first) * attempts_of(*v),
                "version {v}: calls and attempts of another version counted under it; got {got:?}, truth {truth:?}"
            );
        }
        assert_eq!(
            (shared.cores.len(), shared.metrics.len()),
            (0, 0),
            "all reported, no handle held: nothing kept"
        );
        assert_eq!(shared.metrics.take_outlived().len(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reports_pushes_and_forgetting_race_calls_on_handles_made_per_call() {
        race_calls_with_reports_and_pushes(false).await;
    }

    /// The same with `Agent::set_policies` called on another thread now and then, as a
    /// program may on an agent of a control plane: every count still under the version it was
    /// made on (a report that read the version apart from taking the counts put calls made
    /// on the policies set under the pushed version about one loaded run in twenty).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn set_policies_on_another_thread_racing_reports_and_pushes() {
        race_calls_with_reports_and_pushes(true).await;
    }

    /// A service that names endpoints after hosts calls some that fail until their
    /// breaker opens, and then never again (the host is gone). Once no handle holds them and
    /// their counts are reported, nothing of them should be kept for ever; but a breaker
    /// that opened is half-open from the end of its open period until a call comes, which is
    /// never, so it is never idle: each such name's state is kept for the agent's life (and
    /// carried on every push that changes `defaults:`).
    #[tokio::test(start_paused = true)]
    async fn the_state_of_an_endpoint_whose_breaker_opened_and_that_is_never_called_again_goes() {
        let yaml = "version: 1\ndefaults:\n  max_attempts: 1\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 1s, half_open_probes: 1}\nendpoints:\n  a: {}\n";
        let agent = Agent::from_policies_seeded(
            retryplane_policy::load(yaml.as_bytes()).policies.unwrap(),
            1,
        );
        let fail = |_| async {
            Ok::<_, std::io::Error>(http::Response::builder().status(503).body(()).unwrap())
        };
        for n in 0..50 {
            let ep = agent.endpoint(&format!("gone-{n}.pod"));
            for _ in 0..6 {
                let _ = ep.call(CallMeta::http("GET", "/"), fail).await;
            }
        }
        // An hour on, with reports (each lets go of what no handle holds, then takes the
        // counts) every 10 s.
        for _ in 0..360 {
            tokio::time::advance(Duration::from_secs(10)).await;
            agent.shared.forget_unheld();
            agent.shared.metrics.take();
        }
        assert_eq!(
            (agent.shared.cores.len(), agent.shared.metrics.len()),
            (0, 0)
        );
        assert_eq!(
            agent.policies().unnamed_states(),
            0,
            "states of endpoints gone for an hour, held by nothing, are kept"
        );
    }
}
