//! The control plane's one way to change policies: validate, check safety, store, publish.
//!
//! File reloads, admin applies and rollbacks all go through [`ControlPlane::apply`], one at a
//! time, so versions are decided in one place (the store) and the publisher only fans out.
//!
//! Storing a version and publishing it are one step that cannot be cut in half: they run in a
//! task of their own, which finishes even when the caller goes away (an admin client that
//! hangs up or hits its deadline drops the RPC's future). Otherwise the store could hold a new
//! version that no agent is ever sent, and applying the same content again would change
//! nothing, as it equals the stored current version.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, PoisonError};

use retryplane_policy::diag::LogValue;
use retryplane_policy::diff::{self, Change};
use retryplane_policy::{Diagnostic, PolicyDocument, PolicySet};
use retryplane_proto::{TooLargeForAgents, convert, pb};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tracing::{info, warn};

use crate::aggregate::{Aggregator, EndpointInUse};
use crate::fleet::{Fleet, unix_ms};
use crate::metrics::ServerMetrics;
use crate::publisher::Publisher;
use crate::store::{
    NewVersion, Published, REOPEN_INTERVAL, Source, StoreError, VersionRecord, VersionStore,
};
use crate::store_check::StoreHealth;

/// Who owns the policies (SPEC §3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The file is the source of truth; admin writes are refused, naming this path (made
    /// absolute at start by the server, since the refusal is read by remote admins).
    File(PathBuf),
    /// The store is the source of truth; changes come through the admin API.
    Api,
}

/// `file:PATH` or `api`, as the start-up log says it.
impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::File(path) => write!(f, "file:{}", path.display()),
            Mode::Api => f.write_str("api"),
        }
    }
}

/// The policies a change holds.
#[derive(Debug)]
pub enum ChangeContent {
    /// A wire document (the admin API's typed form, a stored version), validated by the change.
    Document(Box<pb::PolicyDocument>),
    /// Policies the caller loaded and validated already (a policy file, through
    /// `retryplane_policy::load`), with the warnings found: the change takes their wire form
    /// and does not validate them again, and its outcome carries these warnings.
    Loaded {
        /// The compiled policies.
        policies: PolicySet,
        /// The warnings the load found (with their places in the file).
        warnings: Vec<Diagnostic>,
    },
}

/// A requested change.
#[derive(Debug)]
pub struct ChangeRequest {
    /// The new policies.
    pub content: ChangeContent,
    /// Where the change comes from.
    pub source: Source,
    /// The admin token's name, if any.
    pub author: Option<String>,
    /// Refuse unless the current version is this one.
    pub expected_version: Option<u64>,
    /// Report what would change without storing.
    pub dry_run: bool,
    /// Allow a change that removes every endpoint.
    pub force: bool,
    /// Refuse a change that removes any endpoint of the current version
    /// ([`ChangeError::MaybePartial`], not counted in `retryplane_server_rejected_changes`):
    /// the policy file watcher sets it for a read it was made to take while a writer still
    /// held the file (or it kept changing), which may be the first part of a save.
    pub keep_endpoints: bool,
}

/// The result of a change.
#[derive(Debug)]
pub struct ChangeOutcome {
    /// The version current after the change (unchanged on a no-op or dry run).
    pub record: Option<VersionRecord>,
    /// Whether a new version was stored: false for a dry run and for content equal to the
    /// current version's (content equal to an older version's is stored as a new version).
    pub changed: bool,
    /// Whether the content differs from the current version's, so that applying it stores a
    /// new version: for a dry run, whether the apply would; otherwise equal to `changed`.
    pub would_change: bool,
    /// The content hash of the requested policies: what a new version of them gets (or, for
    /// a dry run, would get).
    pub content_hash: String,
    /// What differs from the version that was current.
    pub diff: Vec<Change>,
    /// Validation warnings.
    pub warnings: Vec<Diagnostic>,
}

/// `N error(s), first: LOC: error: PATH: message` of a refused change's problems, counted as
/// the policy crate counts a cut list (`diag::counts`).
pub(crate) fn errors_in_brief(diagnostics: &[Diagnostic]) -> String {
    let (errors, _) = retryplane_policy::diag::counts(diagnostics);
    let first = diagnostics
        .iter()
        .find(|d| d.is_error() && retryplane_policy::diag::unlisted(d).is_none());
    match first {
        Some(first) => format!("{errors} error(s), first: {first}"),
        None => "no error named".to_owned(),
    }
}

/// Why a change was refused.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    /// The policies are invalid; holds every problem found (warnings too). Its message counts
    /// the errors and names the first, as the agent's `InvalidPolicyFile` does.
    #[error("invalid policies: {}", errors_in_brief(.0))]
    Invalid(Vec<Diagnostic>),
    /// The change removes every endpoint of the current version; holds their names.
    #[error(
        "the change removes every endpoint ({}); this takes the whole fleet's policies away: pass force to do it anyway",
        .0.join(", ")
    )]
    RemovesEverything(Vec<String>),
    /// The change removes endpoints agents called in the last five minutes, whose calls would
    /// then run on the defaults: refused unless forced, but for a policy file's save (in file
    /// mode the file decides; the publish is warned of instead). Holds them.
    #[error(
        "the change removes {}; their calls would run on the defaults: pass force to do it anyway",
        in_use_in_brief(.0, 5)
    )]
    RemovesInUse(Vec<EndpointInUse>),
    /// A change asked to keep every endpoint ([`ChangeRequest::keep_endpoints`]: a read of the
    /// policy file that may be half of a save) removes some; holds their names.
    #[error(
        "the change removes {} endpoint(s) ({}) and may be part of a save still being written",
        .0.len(),
        .0.join(", ")
    )]
    MaybePartial(Vec<String>),
    /// The snapshot of the policies would be a message longer than an agent decodes
    /// ([`retryplane_proto::MAX_MESSAGE_BYTES`]): every agent would refuse every push of it.
    #[error(transparent)]
    TooLarge(#[from] TooLargeForAgents),
    /// The policies hold more endpoints, routes and list entries than a policy file can
    /// ([`convert::check_items`]'s error): checked before anything else looks at them, as
    /// converting such a document takes hundreds of megabytes, and no agent runs one (a
    /// version stored before the limit, which a rollback would publish again, say).
    #[error("{}", .0.message)]
    TooManyItems(Diagnostic),
    /// Another change came first.
    #[error("version conflict: expected version {expected}, current is {current}")]
    Conflict {
        /// What the caller expected.
        expected: u64,
        /// What is current.
        current: u64,
        /// The current version holds the content of the change (a change sent again after
        /// its answer was lost, which was stored the first time).
        holds_it: bool,
        /// Where the current version came from and who made it (`admin change by bob`),
        /// when known: who to ask before changing it again.
        made_by: Option<String>,
    },
    /// The store failed and the change was not stored; its message and causes are the store
    /// error's own, so a log line or a start-up error that prints the chain
    /// ([`crate::ErrorChain`]) says what the disk said.
    #[error(transparent)]
    Store(StoreError),
    /// The store failed while writing the change, and could not be read back to see whether
    /// the change was stored: it may have been (what is stored is published once the store
    /// can be read again).
    #[error(transparent)]
    StoreUncertain(StoreError),
    /// The change's validation and diff (run on a blocking thread) did not finish: the task
    /// panicked or the runtime is shutting down. Nothing was stored.
    #[error("the change's check did not finish: {0}")]
    Unfinished(String),
}

impl From<StoreError> for ChangeError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { expected, current } => ChangeError::Conflict {
                expected,
                current,
                holds_it: false,
                made_by: None,
            },
            other => ChangeError::Store(other),
        }
    }
}

/// The server's shared state.
pub struct ControlPlane {
    /// Every version.
    pub store: Arc<dyn VersionStore>,
    /// The current snapshot.
    pub publisher: Arc<Publisher>,
    /// Connected agents.
    pub fleet: Arc<Fleet>,
    /// Server figures.
    pub metrics: Arc<ServerMetrics>,
    /// Aggregated agent metrics; its alert thresholds follow every publish.
    pub aggregates: Arc<Aggregator>,
    /// Who owns the policies.
    pub mode: Mode,
    /// Held from the read of the current version until the new one is published; the commit
    /// task takes it over, so it is held until the publish even if the caller is gone.
    changes: Arc<Mutex<()>>,
    /// The last stored version a change was checked against or stored, converted: a change
    /// is diffed against the current version, and converting that from its wire form on
    /// every change took about as long as the diff (10 ms at 1,000 endpoints).
    converted: Arc<std::sync::Mutex<Option<Arc<Converted>>>>,
    /// File mode: the verdict on the policy file's last read ([`ControlPlane::file_read`]).
    file_read: FileReads,
    /// What the last check of the store found (`crate::store_check`).
    pub store_health: Arc<StoreHealth>,
}

/// File mode: what became of a read of the policy file, for `FleetStatus`: a save that was not
/// applied is otherwise seen only in the log and on `/metrics`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRead {
    /// When it was read, Unix milliseconds (the wall clock's, as shown to people).
    pub read_unix_ms: u64,
    /// `Ok` when what the file held is served (applied, or equal to the version served); else
    /// why not, on one line.
    pub outcome: Result<(), String>,
}

/// The longest [`FileRead::outcome`] problem kept, in bytes (as a NACK's reason).
const MAX_FILE_PROBLEM_BYTES: usize = 1_024;

/// What is known of the policy file's last judged read, in the two places that show it: the
/// gauge `retryplane_server_config_last_reload_successful` and the [`FileRead`] `FleetStatus`
/// gives. One call sets both, so they never disagree. Shared with the commit task that
/// publishes a save.
#[derive(Clone, Debug)]
struct FileReads {
    last: Arc<std::sync::Mutex<Option<FileRead>>>,
    /// The gauge (a handle on the one `/metrics` shows).
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl FileReads {
    fn new(gauge: prometheus_client::metrics::gauge::Gauge) -> Self {
        Self {
            last: Arc::default(),
            gauge,
        }
    }

    /// Keeps the verdict on a read judged now (`Err`: why it was not applied, cut to
    /// [`MAX_FILE_PROBLEM_BYTES`]) and sets the gauge from it.
    fn note(&self, outcome: Result<(), String>) {
        self.gauge.set(i64::from(outcome.is_ok()));
        let outcome = outcome.map_err(|problem| {
            retryplane_policy::diag::cut_marked(&problem, MAX_FILE_PROBLEM_BYTES).into_owned()
        });
        let read = FileRead {
            read_unix_ms: crate::fleet::unix_ms(),
            outcome,
        };
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(read);
    }

    /// The last verdict kept.
    fn last(&self) -> Option<FileRead> {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A stored version as a change's check needs it ([`ControlPlane::converted`]).
#[derive(Debug)]
struct Converted {
    /// Which version, and its content hash as stored: the entry serves only that record.
    version: u64,
    content_hash: String,
    /// The version's document, converted from its wire form.
    document: Arc<PolicyDocument>,
    /// Its [`content_key`].
    content_key: String,
}

/// What two documents of the same content have alike, though their content hashes (of what
/// was sent, which agents check) may differ: the hash of `document` with every `-0.0` read as
/// `0.0` and the lists that read as sets in order ([`convert::lists_as_sets`]).
fn content_key(document: &pb::PolicyDocument) -> String {
    let mut document = document.clone();
    convert::unsigned_zeros(&mut document);
    convert::lists_as_sets(&mut document);
    convert::content_hash(&document)
}

/// `record` converted, from `cache` when it holds that record, else converted now (and kept
/// in `cache`); a stored document that does not convert is corrupt.
fn converted(
    cache: &std::sync::Mutex<Option<Arc<Converted>>>,
    record: &VersionRecord,
) -> Result<Arc<Converted>, ChangeError> {
    let cached = cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .filter(|c| c.version == record.meta.version && c.content_hash == record.meta.content_hash);
    if let Some(cached) = cached {
        return Ok(cached);
    }
    let document = PolicyDocument::try_from(record.document.clone())
        .map_err(|e| ChangeError::Store(StoreError::Corrupt(e.to_string())))?;
    let entry = Arc::new(Converted {
        version: record.meta.version,
        content_hash: record.meta.content_hash.clone(),
        document: Arc::new(document),
        content_key: content_key(&record.document),
    });
    *cache.lock().unwrap_or_else(PoisonError::into_inner) = Some(entry.clone());
    Ok(entry)
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("mode", &self.mode)
            .field("publisher", &self.publisher)
            .finish_non_exhaustive()
    }
}

/// [`ChangeError::TooManyItems`] for a typed document that holds more than a policy file can:
/// counted on its lists, allocating nothing, before the change waits for its turn. A loaded
/// file never does: its reader (serde-saphyr's budget) bounds its nodes, those aliases and
/// merge keys repeat included, by the same number (pinned by `retryplane_proto`'s tests).
fn too_many_items(content: &ChangeContent) -> Result<(), ChangeError> {
    match content {
        ChangeContent::Document(document) => {
            convert::check_items(document).map_err(ChangeError::TooManyItems)
        }
        ChangeContent::Loaded { .. } => Ok(()),
    }
}

/// [`ChangeError::TooLarge`] when a snapshot of `document` could be a message longer than an
/// agent decodes ([`retryplane_proto::MAX_MESSAGE_BYTES`]): what Apply refuses first, and
/// Validate reports as an error. Whatever this control plane's nonce or metrics interval, as
/// `retryplane validate` checks it.
pub(crate) fn check_size(document: &pb::PolicyDocument) -> Result<(), ChangeError> {
    Ok(retryplane_proto::check_agent_limit(document)?)
}

impl ControlPlane {
    /// State over `store`; nothing is published until [`ControlPlane::publish_current`].
    pub fn new(
        store: Arc<dyn VersionStore>,
        publisher: Arc<Publisher>,
        fleet: Arc<Fleet>,
        metrics: Arc<ServerMetrics>,
        aggregates: Arc<Aggregator>,
        mode: Mode,
    ) -> Self {
        metrics.note_store_size(store.as_ref());
        let file_read = FileReads::new(metrics.config_last_reload_successful.clone());
        let store_health = Arc::new(StoreHealth::new(metrics.store_healthy.clone()));
        Self {
            store,
            publisher,
            fleet,
            metrics,
            aggregates,
            mode,
            changes: Arc::new(Mutex::new(())),
            converted: Arc::new(std::sync::Mutex::new(None)),
            file_read,
            store_health,
        }
    }

    /// File mode: notes the verdict on a read of the policy file, read now (`Err`: why it was
    /// not applied, cut to 1,024 bytes), for `FleetStatus` and on `/metrics`
    /// (`retryplane_server_config_last_reload_successful`, 1 for `Ok`).
    pub fn note_file_read(&self, outcome: Result<(), String>) {
        self.file_read.note(outcome);
    }

    /// File mode: the verdict on the policy file's last read that was judged; `None` in API
    /// mode, and until a read is judged.
    pub fn file_read(&self) -> Option<FileRead> {
        self.file_read.last()
    }

    /// A control plane over `store` with a fresh publisher, fleet (100 agents), metrics and
    /// aggregator (100 series): what the unit tests run.
    #[cfg(test)]
    pub(crate) fn for_tests(store: Arc<dyn VersionStore>, mode: Mode) -> Self {
        let fleet = Arc::new(Fleet::new(100));
        let aggregates = Aggregator::new(100, tokio::time::Instant::now(), fleet.running());
        Self::new(
            store,
            Arc::new(Publisher::new(10_000)),
            fleet,
            Arc::new(ServerMetrics::new()),
            Arc::new(aggregates),
            mode,
        )
    }

    /// What makes a stored version current, detached from `self` so a commit task owns it.
    fn fanout(&self) -> Fanout {
        Fanout {
            publisher: self.publisher.clone(),
            aggregates: self.aggregates.clone(),
            metrics: self.metrics.clone(),
            file_read: self.file_read.clone(),
        }
    }

    /// Runs a blocking store call off the async threads.
    pub async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn VersionStore) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(store.as_ref()))
            .await
            .map_err(|e| StoreError::Backend(Box::new(e)))?
    }

    /// Publishes the stored current version, if any (at start). Holds the lock changes take, so
    /// a change committed meanwhile (a file save seen by the watcher) is published after this,
    /// never before it.
    ///
    /// The publish time on `/metrics` is then the version's own (when it was stored and first
    /// published), not the start's: the fleet has been on it since. A version already served
    /// (a save the watcher applied first) is not published again (see `Publisher::publish`).
    pub async fn publish_current(&self) -> Result<Option<VersionRecord>, StoreError> {
        let _one_at_a_time = self.changes.lock().await;
        let current = self.blocking(|s| s.current()).await?;
        if let Some(record) = &current {
            if let Err(too_many) = retryplane_proto::convert::check_items(&record.document) {
                // Stored before the limit: agents refuse it (NACK), keeping what they run.
                warn!(
                    version = record.meta.version,
                    "the current version holds more than a policy file can, and agents refuse \
                     it: {}; apply a smaller one",
                    too_many.message
                );
            } else {
                // Checked again by this build's rules, which may be stricter than those of the
                // build that stored it: agents of this build refuse what they do not pass.
                let document = record.document.clone();
                let checked = tokio::task::spawn_blocking(move || {
                    retryplane_proto::convert::validate(document)
                })
                .await;
                if let Ok(Err(errors)) = checked {
                    let (count, _) = retryplane_policy::diag::counts(&errors);
                    warn!(
                        version = record.meta.version,
                        errors = count,
                        first = %errors.first().map(ToString::to_string).unwrap_or_default(),
                        "the current version does not pass this build's checks (stored by an \
                         earlier build whose rules were looser): agents of this build refuse \
                         it (NACK) and keep what they run; apply a fixed version"
                    );
                }
            }
            self.fanout().publish_at(record, PublishedAt::Stored);
        }
        Ok(current)
    }

    /// Validates, checks and stores a change, then publishes it. One change at a time. A change
    /// refused as invalid, as too large for the agents or as removing every endpoint counts in
    /// `retryplane_server_rejected_changes`, one the store failed to store in
    /// `retryplane_server_store_failures`, unless it is a dry run.
    ///
    /// Dropping the returned future before it completes either changes nothing or lets the
    /// store write and the publish both finish (see the module docs).
    pub async fn apply(&self, req: ChangeRequest) -> Result<ChangeOutcome, ChangeError> {
        let dry_run = req.dry_run;
        let result = match too_many_items(&req.content) {
            // Refused before it waits for the changes being committed: it can never be made.
            Err(too_many) => Err(too_many),
            Ok(()) => {
                // A dry run stores nothing, so it does not wait for (or hold up) the changes
                // being committed: it is checked against the version current when it reads
                // the store.
                let one_at_a_time = if dry_run {
                    None
                } else {
                    Some(self.changes.clone().lock_owned().await)
                };
                self.apply_locked(req, one_at_a_time).await
            }
        };
        if !dry_run
            && matches!(
                result,
                Err(ChangeError::Invalid(_)
                    | ChangeError::RemovesEverything(_)
                    | ChangeError::RemovesInUse(_)
                    | ChangeError::TooLarge(_)
                    | ChangeError::TooManyItems(_))
            )
        {
            self.metrics.rejected_changes.inc();
        }
        if !dry_run
            && matches!(
                result,
                Err(ChangeError::Store(_) | ChangeError::StoreUncertain(_))
            )
        {
            self.metrics.store_failures.inc();
        }
        if !dry_run {
            // A change that failed in the store shows in `status` at once, and one stored
            // clears a failure the checks saw (a change refused before the store asks too:
            // a check is a few system calls and a read, and a store read from a copy of its
            // file tries the file at most once a second).
            self.store_health.check_soon();
        }
        result
    }

    /// [`ControlPlane::apply`] of `req`, holding the change lock unless it is a dry run.
    async fn apply_locked(
        &self,
        req: ChangeRequest,
        one_at_a_time: Option<OwnedMutexGuard<()>>,
    ) -> Result<ChangeOutcome, ChangeError> {
        // Validating and diffing a large document takes tens of milliseconds of CPU (about
        // 30 ms at 1,000 endpoints): done off the async threads, with the store read between
        // the two, so agent streams sharing a worker with this Apply are not held up. The order
        // is the same as ever: an invalid change is refused before the store is read.
        let ChangeRequest {
            content,
            source,
            author,
            expected_version,
            dry_run,
            force,
            keep_endpoints,
        } = req;
        let store = self.store.clone();
        let cache = self.converted.clone();
        let aggregates = self.aggregates.clone();
        let now = tokio::time::Instant::now();
        // In file mode the file decides: a save (and a dry run of one) that removes endpoints
        // in use is published with a warning, as nothing could force it.
        let in_use_is_warned = matches!(source, Source::File) || matches!(self.mode, Mode::File(_));
        let (document, current, (changes, used), warnings, content_hash, same_content, new_doc) =
            tokio::task::spawn_blocking(move || {
                // What is stored is the wire form of what was checked and diffed: a loaded file
                // is converted here, never handed in beside its policies.
                let (document, loaded) = match content {
                    // Counted before the lock was taken (`too_many_items`).
                    ChangeContent::Document(document) => (*document, None),
                    ChangeContent::Loaded { policies, warnings } => {
                        let document = pb::PolicyDocument::from(policies.document().as_ref());
                        // Never over: see `too_many_items`.
                        debug_assert!(convert::check_items(&document).is_ok());
                        (document, Some((policies, warnings)))
                    }
                };
                // Before anything else: a snapshot no agent can decode is never stored, whatever
                // else the change holds.
                check_size(&document)?;
                let content_hash = convert::content_hash(&document);
                // One conversion and one validation: the compiled set keeps its document. A
                // change the caller validated (a policy file) is not validated again.
                let (set, warnings) = match loaded {
                    Some(loaded) => loaded,
                    None => convert::validate(document.clone()).map_err(ChangeError::Invalid)?,
                };
                // A change is judged against what the store's file holds, never against a copy
                // in memory that may hold a commit whose flush failed (the same content sent
                // again would find it "unchanged" and publish what is not stored); while the
                // file cannot be opened, the change fails. A dry run may read the copy.
                let current = if dry_run {
                    store.current()?
                } else {
                    store.current_in_file()?
                };
                // A stale expected version is a conflict whatever the change holds: the caller
                // must read the current version again before the rest of the checks mean anything.
                // An empty store is version 0, as the store's own check has it.
                let current_version = current.as_ref().map_or(0, |c| c.meta.version);
                if let Some(expected) = expected_version
                    && expected != current_version
                {
                    return Err(ChangeError::Conflict {
                        expected,
                        current: current_version,
                        holds_it: current
                            .as_ref()
                            .is_some_and(|c| c.meta.content_hash == content_hash),
                        made_by: current.as_ref().map(|c| made_by(&c.meta)),
                    });
                }
                let stored = current
                    .as_ref()
                    .map(|record| converted(&cache, record))
                    .transpose()?;
                let (changes, used) = check(
                    set.document(),
                    stored.as_ref().map(|s| &*s.document),
                    force,
                    keep_endpoints,
                    in_use_is_warned,
                    |names| aggregates.in_use(now, names),
                )?;
                let mut warnings = warnings;
                if !used.is_empty() {
                    warnings.push(in_use_warning(&used));
                }
                // A version stored with a `-0.0`, or with a list in another order, keeps the hash
                // of what was sent: the same content sent again, the sign dropped or the list
                // reordered, is no change either.
                let new_key = content_key(&document);
                let same_content = stored.is_some_and(|s| s.content_key == new_key);
                // What the check of the next change needs of this one, once it is stored.
                let new_doc = (!dry_run).then(|| (set.document().clone(), new_key));
                Ok::<_, ChangeError>((
                    document,
                    current,
                    (changes, used),
                    warnings,
                    content_hash,
                    same_content,
                    new_doc,
                ))
            })
            .await
            .map_err(|e| ChangeError::Unfinished(e.to_string()))??;
        // Only the current version counts: content equal to an older version's (a rollback, a
        // reverted file) is a change and gets a new version.
        let unchanged = current
            .as_ref()
            .is_some_and(|c| c.meta.content_hash == content_hash)
            || same_content;
        // Unchanged: the hash the content goes by is the current version's, as stored.
        let content_hash = match (&current, unchanged) {
            (Some(c), true) => c.meta.content_hash.clone(),
            _ => content_hash,
        };
        if unchanged
            && !dry_run
            && let Some(current) = &current
        {
            // What the store holds is what is served, even after a write that failed once its
            // commit was durable (see `Fanout::catch_up`).
            self.fanout().catch_up(current);
        }
        let (one_at_a_time, (new_doc, new_key)) = match (one_at_a_time, new_doc) {
            (Some(held), Some(new_doc)) if !dry_run && !unchanged => (held, new_doc),
            _ => {
                return Ok(ChangeOutcome {
                    record: current,
                    changed: false,
                    would_change: !unchanged,
                    content_hash,
                    diff: if unchanged { Vec::new() } else { changes },
                    warnings,
                });
            }
        };
        let new = NewVersion {
            document,
            content_hash: content_hash.clone(),
            source,
            author,
            summary: diff::summary(&changes),
            created_unix_ms: unix_ms(),
        };
        let commit = Commit {
            store: self.store.clone(),
            fanout: self.fanout(),
            new,
            expected: expected_version,
            converted: (self.converted.clone(), new_doc, new_key),
            one_at_a_time,
        };
        // The task is not cancelled when this future is dropped: it stores and publishes, or
        // fails before storing anything. If the task itself failed, whether it stored the
        // change is not known.
        let (record, changed) = tokio::spawn(commit.run())
            .await
            .map_err(|e| ChangeError::StoreUncertain(StoreError::Backend(Box::new(e))))??;
        if changed && !used.is_empty() {
            warn!(
                version = record.meta.version,
                source = record.meta.source.as_str(),
                "v{} removes {}; their calls now run on the defaults",
                record.meta.version,
                in_use_in_brief(&used, 5)
            );
        }
        Ok(ChangeOutcome {
            record: Some(record),
            changed,
            // The store found the content current after all (an equal change came first).
            would_change: changed,
            content_hash,
            diff: changes,
            warnings,
        })
    }
}

/// `admin change by bob`, `rollback to v3's content by alice`, `file change`: where a version
/// came from, and who made it.
fn made_by(meta: &crate::store::VersionMeta) -> String {
    let what = match meta.source {
        Source::File => "file change".to_owned(),
        Source::Admin => "admin change".to_owned(),
        Source::Rollback { from } => format!("rollback to v{from}'s content"),
    };
    match &meta.author {
        Some(author) => format!("{what} by {author}"),
        None => what,
    }
}

/// `N endpoint(s) that agents called in the last 5 minutes: ` and the first `max` of `used`,
/// then how many more (a refusal's message stays short); `called, or may have called,` when
/// some of them are only possibly in use ([`EndpointInUse::maybe_in_other`]).
pub fn in_use_in_brief(used: &[EndpointInUse], max: usize) -> String {
    let mut shown: Vec<String> = used.iter().take(max).map(ToString::to_string).collect();
    if used.len() > max {
        shown.push(format!("and {} more", used.len() - max));
    }
    let called = if used.iter().any(|u| u.maybe_in_other > 0) {
        "called, or may have called,"
    } else {
        "called"
    };
    format!(
        "{} endpoint(s) that agents {called} in the last 5 minutes: {}",
        used.len(),
        shown.join(", ")
    )
}

/// What differs between the `stored` current version (converted) and the validated `new_doc`,
/// and which of the endpoints it removes agents call now (`in_use` finds them among the
/// names it is given); refuses a change that removes any endpoint when `keep_endpoints`, one
/// that removes every endpoint unless `force`, and one that removes endpoints in use unless
/// `force` or `in_use_is_warned` (a policy file's save). CPU-bound: run it off the async
/// threads.
fn check(
    new_doc: &PolicyDocument,
    stored: Option<&PolicyDocument>,
    force: bool,
    keep_endpoints: bool,
    in_use_is_warned: bool,
    in_use: impl FnOnce(&[&str]) -> Vec<EndpointInUse>,
) -> Result<(Vec<Change>, Vec<EndpointInUse>), ChangeError> {
    let empty = PolicyDocument::default();
    let old_doc = stored.unwrap_or(&empty);
    let changes = diff::diff(old_doc, new_doc);
    // A set, not a lookup per endpoint: linear in the number of endpoints.
    let new_names: HashSet<&str> = new_doc
        .endpoints
        .iter()
        .map(|e| e.name.value.as_str())
        .collect();
    let survivors = old_doc
        .endpoints
        .iter()
        .filter(|e| new_names.contains(e.name.value.as_str()))
        .count();
    if keep_endpoints && survivors < old_doc.endpoints.len() {
        let removed = old_doc
            .endpoints
            .iter()
            .filter(|e| !new_names.contains(e.name.value.as_str()))
            .map(|e| e.name.value.clone())
            .collect();
        return Err(ChangeError::MaybePartial(removed));
    }
    if !old_doc.endpoints.is_empty() && survivors == 0 && !force {
        let names = old_doc
            .endpoints
            .iter()
            .map(|e| e.name.value.clone())
            .collect();
        return Err(ChangeError::RemovesEverything(names));
    }
    let removed: Vec<&str> = old_doc
        .endpoints
        .iter()
        .map(|e| e.name.value.as_str())
        .filter(|name| !new_names.contains(name))
        .collect();
    let used = in_use(&removed);
    if !used.is_empty() && !force && !in_use_is_warned {
        return Err(ChangeError::RemovesInUse(used));
    }
    Ok((changes, used))
}

/// The warning a change that removes endpoints in use carries (forced, or a policy file's
/// save): their calls now run on the defaults.
fn in_use_warning(used: &[EndpointInUse]) -> Diagnostic {
    Diagnostic::warning(
        retryplane_policy::yaml::Loc::UNKNOWN,
        "endpoints",
        format!(
            "the change removes {}; their calls run on the defaults once it is published",
            in_use_in_brief(used, 5)
        ),
    )
}

/// The parts of the control plane a publish touches.
#[derive(Clone)]
struct Fanout {
    publisher: Arc<Publisher>,
    aggregates: Arc<Aggregator>,
    metrics: Arc<ServerMetrics>,
    file_read: FileReads,
}

impl Fanout {
    /// Makes `record` current: the version gauge, the publish time and the aggregates'
    /// published version, set before the streams are woken (whoever sees the new version
    /// pushed reads it in the gauge too), the snapshot streams send, then the alert thresholds
    /// (read from the whole document, so not before the push). A record no newer than what is
    /// served changes nothing (see `Publisher::publish`). Whether it was published.
    fn publish(&self, record: &VersionRecord) -> bool {
        self.publish_at(record, PublishedAt::Now)
    }

    /// [`Fanout::publish`], with the publish time on `/metrics` taken as `at` says.
    fn publish_at(&self, record: &VersionRecord, at: PublishedAt) -> bool {
        let mut published = false;
        self.publisher.publish_then(record, || {
            published = true;
            self.metrics
                .current_version
                .set(i64::try_from(record.meta.version).unwrap_or(i64::MAX));
            // Before any agent runs it: its first report is judged as the published version's.
            self.aggregates.set_published(record.meta.version);
            let seconds = match at {
                PublishedAt::Now | PublishedAt::CaughtUp => crate::fleet::unix_seconds(),
                PublishedAt::Stored => record.meta.created_unix_ms as f64 / 1_000.0,
            };
            self.metrics.last_publish_seconds.set(seconds);
            // A save of the policy file published: the read that gave it was a good one. Noted
            // (the gauge and `FleetStatus`'s verdict) with the version, so neither shows the
            // new version beside the failed reload of an earlier save (the watcher notes it
            // again once `apply` returns). At start the watcher's first read notes it, whatever
            // the stored version's source.
            if matches!(at, PublishedAt::Now) && record.meta.source == Source::File {
                self.file_read.note(Ok(()));
            }
        });
        if published {
            self.aggregates.thresholds().set_from(&record.document);
        }
        published
    }

    /// Publishes `record`, the store's current version, if what is served is older: after a
    /// store call that failed once its commit was durable (redb can report a failed sync of a
    /// commit that is on disk), the store holds a version no stream was sent.
    fn catch_up(&self, record: &VersionRecord) {
        let served = self.publisher.current().map_or(0, |s| s.version);
        if self.publish_at(record, PublishedAt::CaughtUp) {
            warn!(
                version = record.meta.version,
                served, "the store held a version that was not published; published it now"
            );
            self.metrics.publishes.inc();
        }
    }
}

/// What the publish time on `/metrics` says for a publish.
#[derive(Clone, Copy)]
enum PublishedAt {
    /// Now: the version goes out to the streams for the first time.
    Now,
    /// When the version was stored (and first published): at start, for the version the
    /// store holds.
    Stored,
    /// Now, for a version the store took although it reported a failure: not the change being
    /// committed, so it says nothing of the policy file's last read (which may since have been
    /// a save that was refused).
    CaughtUp,
}

/// A store write and its publish, run as one task (see the module docs).
struct Commit {
    store: Arc<dyn VersionStore>,
    fanout: Fanout,
    new: NewVersion,
    expected: Option<u64>,
    /// Where the new version is kept converted once stored, its document converted, and the
    /// hash of its content with `-0.0` read as `0.0` when that differs.
    converted: ConvertedNew,
    /// Released when the task ends, after the publish.
    one_at_a_time: OwnedMutexGuard<()>,
}

/// [`Commit::converted`].
type ConvertedNew = (
    Arc<std::sync::Mutex<Option<Arc<Converted>>>>,
    Arc<PolicyDocument>,
    String,
);

impl Commit {
    /// Stores the new version and, if it is new, publishes it; returns the version now current
    /// and whether it is new.
    async fn run(self) -> Result<(VersionRecord, bool), ChangeError> {
        let Commit {
            store,
            fanout,
            new,
            expected,
            converted: (cache, document, content_key),
            one_at_a_time,
        } = self;
        let hash = new.content_hash.clone();
        let writer = store.clone();
        // A task that failed (the backend panicked, perhaps past its commit) is read back like
        // any other failed write.
        let published = tokio::task::spawn_blocking(move || writer.publish(new, expected))
            .await
            .unwrap_or_else(|e| Err(StoreError::Backend(Box::new(e))));
        // Whatever came of it: a failed commit may have grown the file (on a full disk, say).
        fanout.metrics.note_store_size(store.as_ref());
        let published = match published {
            Ok(published) => published,
            Err(error) => match committed_anyway(
                &store,
                &fanout,
                &hash,
                OwnedMutexGuard::mutex(&one_at_a_time),
            )
            .await
            {
                AfterFailure::Stored(record) => {
                    warn!(
                        version = record.meta.version,
                        error = %error,
                        "the store reported an error, but the new version was stored"
                    );
                    Published::New(*record)
                }
                // A conflict was refused before anything was written.
                AfterFailure::Unknown if !matches!(error, StoreError::Conflict { .. }) => {
                    return Err(ChangeError::StoreUncertain(error));
                }
                AfterFailure::NotStored | AfterFailure::Unknown => return Err(error.into()),
            },
        };
        let (record, changed) = match published {
            Published::New(r) => (r, true),
            Published::Unchanged(r) => {
                fanout.catch_up(&r);
                (r, false)
            }
        };
        if changed {
            fanout.publish(&record);
            fanout.metrics.publishes.inc();
            // Who made it (a token's name; none without a tokens file, nor from the file),
            // and for a rollback the version whose content it restored.
            info!(
                version = record.meta.version,
                source = record.meta.source.as_str(),
                restored = record.meta.source.rolled_back_from(),
                author = record
                    .meta
                    .author
                    .as_deref()
                    .map(|a| tracing::field::display(LogValue(a))),
                summary = %LogValue(&record.meta.summary),
                "published a new policy version"
            );
            // After the push: the replaced conversion (about 1 MiB at 1,000 endpoints, more
            // for a large file) is freed on a blocking thread, not on the one that wakes the
            // agent streams.
            let replaced = cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .replace(Arc::new(Converted {
                    version: record.meta.version,
                    content_hash: record.meta.content_hash.clone(),
                    document,
                    content_key,
                }));
            if let Some(replaced) = replaced {
                drop(tokio::task::spawn_blocking(move || drop(replaced)));
            }
        }
        drop(one_at_a_time);
        Ok((record, changed))
    }
}

/// After a store write that failed: whether it stored the version with content `hash` after
/// all (the store's current version has that content and is newer than what is served), and
/// that record if so. The store's own file is read ([`VersionStore::current_in_file`]), never
/// a copy in memory, which may hold a commit whose flush failed. A newer current version with other content is published at once (see
/// [`Fanout::catch_up`]). The store is read once here; if that read fails too (a store that
/// failed is reopened at most once every [`REOPEN_INTERVAL`]), a task reads it again every
/// interval for [`CATCH_UP_TRIES`] intervals and publishes what it finds, so that what agents
/// are sent never stays behind what `get` and `history` show. The caller holds `changes`
/// (the lock every change takes); the task takes it for each read and publish, so that a
/// change committed meanwhile is published after it, never before.
async fn committed_anyway(
    store: &Arc<dyn VersionStore>,
    fanout: &Fanout,
    hash: &str,
    changes: &Arc<Mutex<()>>,
) -> AfterFailure {
    let reader = store.clone();
    let current = tokio::task::spawn_blocking(move || reader.current_in_file()).await;
    match current {
        Ok(Ok(Some(record))) => {
            let served = fanout.publisher.current().map_or(0, |s| s.version);
            if record.meta.version <= served {
                AfterFailure::NotStored
            } else if record.meta.content_hash == hash {
                AfterFailure::Stored(Box::new(record))
            } else {
                fanout.catch_up(&record);
                AfterFailure::NotStored
            }
        }
        Ok(Ok(None)) => AfterFailure::NotStored,
        _ => {
            let (store, fanout, changes) = (store.clone(), fanout.clone(), changes.clone());
            tokio::spawn(async move {
                for _ in 0..CATCH_UP_TRIES {
                    tokio::time::sleep(REOPEN_INTERVAL).await;
                    let _one_at_a_time = changes.lock().await;
                    let reader = store.clone();
                    match tokio::task::spawn_blocking(move || reader.current_in_file()).await {
                        Ok(Ok(Some(record))) => {
                            fanout.catch_up(&record);
                            return;
                        }
                        Ok(Ok(None)) => return,
                        _ => {}
                    }
                }
            });
            AfterFailure::Unknown
        }
    }
}

/// What [`committed_anyway`] found.
enum AfterFailure {
    /// The change was stored after all: this is its version.
    Stored(Box<VersionRecord>),
    /// The store, read back, does not hold it.
    NotStored,
    /// The store could not be read back.
    Unknown,
}

/// How many times [`committed_anyway`]'s task reads a failing store again.
const CATCH_UP_TRIES: u32 = 60;

#[cfg(test)]
#[path = "control_tests.rs"]
pub(crate) mod tests;
