//! The version store: every published policy document, numbered (SPEC §3).
//!
//! The store is the single place that decides version numbers. A publish is one
//! atomic step: it reads the current version, checks the caller's expected version (optimistic
//! concurrency), compares content hashes, and appends `current + 1` — or, when the content is
//! the same as the current version's, writes nothing and answers [`Published::Unchanged`], so
//! the content being served is never republished under a new version. The comparison is with
//! the current version only: content equal to an older version's (a rollback, a file reverted
//! by hand) is stored again under a new number. Versions start at 1; 0 means "the store is
//! empty" wherever a version number is expected.
//!
//! The content hash is the caller's: `retryplane_proto::convert::content_hash`, computed over a
//! canonical form of the document (endpoint order and empty sections do not count), so equal
//! hashes mean equal content. The store compares hashes and stores them as given, but never
//! recomputes them: a later change to the canonical form must not turn stored versions into
//! "corrupt" ones. Integrity of the stored bytes is the backend's business ([`RedbStore`] keeps
//! its own checksum of every stored document).
//!
//! The store sits behind the small [`VersionStore`] trait so that another backend (etcd, SPEC §6)
//! can replace the embedded one. Its methods are synchronous, as the embedded database is; async
//! callers run them with `tokio::task::spawn_blocking`.
//!
//! - [`RedbStore`]: the embedded, crash-safe backend under the data directory.
//! - [`MemoryStore`]: a `Vec` behind a mutex, for tests of other components.

use std::path::PathBuf;

use retryplane_proto::pb;

mod memory;
mod redb;
#[cfg(test)]
mod redb_tests;
#[cfg(test)]
mod tests;

pub use self::memory::MemoryStore;
pub(crate) use self::redb::REOPEN_INTERVAL;
pub use self::redb::{RedbStore, compress_document, inflate_document};

/// Where a version came from.
///
/// Stored by name in each record, and a build refuses a record whose source it does not know
/// as damaged: a new source must come with a new record format (`RECORD_FORMAT` in
/// `store/redb.rs`), so that an older build refuses the store as written by a newer one (and
/// says so) rather than as corrupt, which tells the operator to move it aside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The policy file (file mode, or the seed of an empty store in API mode).
    File,
    /// The admin API (`retryplane apply`).
    Admin,
    /// An admin rollback that restored the content of an older version.
    Rollback {
        /// The version whose content was restored.
        from: u64,
    },
}

impl Source {
    /// The name used on the wire and in history listings: `"file"`, `"admin"` or `"rollback"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Admin => "admin",
            Self::Rollback { .. } => "rollback",
        }
    }

    /// For a rollback, the version whose content was restored.
    pub fn rolled_back_from(&self) -> Option<u64> {
        match self {
            Self::Rollback { from } => Some(*from),
            Self::File | Self::Admin => None,
        }
    }
}

/// Everything about a stored version except its document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionMeta {
    /// The version number, from 1.
    pub version: u64,
    /// The content hash the version was published with.
    pub content_hash: String,
    /// Where the version came from.
    pub source: Source,
    /// The name of the admin token that made it, if any.
    pub author: Option<String>,
    /// When it was published, in milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// A one-line description of the change, e.g. `+1 endpoint (search), -0, 2 modified
    /// (inventory, payments)` (`retryplane_policy::diff::summary`; versions stored before it
    /// named endpoints hold the counts only).
    pub summary: String,
}

/// A stored version: its metadata and its document.
#[derive(Clone, Debug, PartialEq)]
pub struct VersionRecord {
    /// The metadata.
    pub meta: VersionMeta,
    /// The policy document as published.
    pub document: pb::PolicyDocument,
}

#[cfg(test)]
impl VersionRecord {
    /// Version `version` of `document`, from the file, with a hash made of the version: what
    /// the tests publish without a store.
    pub(crate) fn of_version(version: u64, document: pb::PolicyDocument) -> Self {
        Self {
            meta: VersionMeta {
                version,
                content_hash: format!("{version:064x}"),
                source: Source::File,
                author: None,
                created_unix_ms: 0,
                summary: String::new(),
            },
            document,
        }
    }
}

/// A document of bare endpoints holding more than a policy file can (one endpoint past
/// `convert::MAX_ITEMS`).
#[cfg(test)]
pub(crate) fn over_the_item_limit() -> pb::PolicyDocument {
    pb::PolicyDocument {
        defaults: None,
        endpoints: (0..=retryplane_proto::convert::MAX_ITEMS / 2)
            .map(|i| pb::Endpoint {
                name: format!("e{i}"),
                ..Default::default()
            })
            .collect(),
    }
}

/// Stores a version holding more than a policy file can ([`over_the_item_limit`]): what a
/// store written before the control plane had the limit may hold.
#[cfg(test)]
pub(crate) fn store_over_the_item_limit(store: &dyn VersionStore) {
    let document = over_the_item_limit();
    let new = NewVersion {
        content_hash: retryplane_proto::convert::content_hash(&document),
        document,
        source: Source::Admin,
        author: None,
        summary: "large".to_owned(),
        created_unix_ms: 0,
    };
    if let Err(e) = store.publish(new, None) {
        panic!("{e}");
    }
}

/// A document to publish, with what the store records about it.
#[derive(Clone, Debug, PartialEq)]
pub struct NewVersion {
    /// The policy document, already validated by the caller.
    pub document: pb::PolicyDocument,
    /// The content hash of `document` (`retryplane_proto::convert::content_hash`); equal hashes
    /// mean equal content. Stored as given.
    pub content_hash: String,
    /// Where it comes from.
    pub source: Source,
    /// The name of the admin token that sent it, if any.
    pub author: Option<String>,
    /// A one-line description of the change.
    pub summary: String,
    /// The caller's clock, in milliseconds since the Unix epoch (the store reads no clock).
    pub created_unix_ms: u64,
}

/// The outcome of [`VersionStore::publish`].
#[derive(Clone, Debug, PartialEq)]
pub enum Published {
    /// A new version was stored and is now current.
    New(VersionRecord),
    /// The content equals the current version's; nothing was written. Holds the current version.
    Unchanged(VersionRecord),
}

impl Published {
    /// The version now current, whether new or not.
    pub fn record(&self) -> &VersionRecord {
        match self {
            Self::New(record) | Self::Unchanged(record) => record,
        }
    }

    /// Takes the version now current, whether new or not.
    pub fn into_record(self) -> VersionRecord {
        match self {
            Self::New(record) | Self::Unchanged(record) => record,
        }
    }

    /// Whether a new version was stored.
    pub fn is_new(&self) -> bool {
        matches!(self, Self::New(_))
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The current version is not the one the caller expected (0 = empty store).
    #[error("expected version {expected} to be current, but the current version is {current}")]
    Conflict {
        /// The version the caller expected.
        expected: u64,
        /// The version actually current (0 = empty store).
        current: u64,
    },
    /// A rollback names a version that is not stored.
    #[error("version {version} does not exist")]
    NoSuchVersion {
        /// The missing version.
        version: u64,
    },
    /// Another process (or another handle in this one) holds the store.
    #[error("{}", match linked {
        None => format!("the data directory {} is in use by another retryplane process", dir.display()),
        Some(to) => format!(
            "the store file of the data directory {} is a link to {}, which another retryplane \
             process holds",
            dir.display(),
            to.display()
        ),
    })]
    InUse {
        /// The data directory.
        dir: PathBuf,
        /// Where the store file links to, when it is a link and its target is what another
        /// process holds (the data directory itself is not then in use).
        linked: Option<PathBuf>,
    },
    /// The stored data is inconsistent; the store refuses to serve it.
    #[error("the version store is corrupt: {0}")]
    Corrupt(String),
    /// A record was written by a newer release, in a format this build does not read: the
    /// store is refused (and left as it is), not taken for a damaged one.
    #[error(
        "version {version} of the version store was written by a newer retryplane (record \
         format {format}; this build reads format {supported}): run that release or a later one"
    )]
    NewerFormat {
        /// The version whose record it is.
        version: u64,
        /// The record's format.
        format: u32,
        /// The format this build reads.
        supported: u32,
    },
    /// The store's file exists but holds no store: it is empty, or holds zero bytes only (as a
    /// file system that lost its writes, or a failed copy, leaves it). The store never takes
    /// such a file for a new store: that would replace the version history it may once have
    /// held. The file is left as it is.
    #[error(
        "the store file {} {what}, so it holds no version store; retryplane does not overwrite \
         it. Restore it from a backup, or, to start a new, empty store, move it aside",
        path.display()
    )]
    NotAStore {
        /// The store's file.
        path: PathBuf,
        /// What is wrong with it: "is empty" or "holds only zero bytes".
        what: &'static str,
    },
    /// The store's file cannot be opened or read (permissions, a directory in its place, ...).
    #[error("cannot open the store file {}", path.display())]
    OpenFile {
        /// The store's file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A new store's file cannot be created in the data directory.
    #[error("cannot create the store file {}", path.display())]
    CreateFile {
        /// The store's file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The data directory's path is taken by something that is not a directory (a file).
    #[error("the data directory {} exists and is not a directory", dir.display())]
    NotADirectory {
        /// The data directory.
        dir: PathBuf,
    },
    /// The data directory cannot be created.
    #[error("cannot create the data directory {}", dir.display())]
    CreateDir {
        /// The data directory.
        dir: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The store's file was deleted, or another file put at its path, while the store was
    /// open: what it took would go into a file nothing can open again, and be lost at the next
    /// start. Reads go on from the open file; nothing is stored until a restart.
    #[error(
        "the store file {} was deleted or replaced while the control plane ran: no change is \
         stored until it restarts on the file now at that path (this process still holds the \
         old file open; if the removal was a mistake, copy it from /proc/{}/fd{} before the \
         restart)",
        path.display(),
        std::process::id(),
        descriptor.map_or_else(String::new, |fd| format!("/{fd}"))
    )]
    FileReplaced {
        /// The store's file.
        path: PathBuf,
        /// The descriptor this process holds the old file open on, when found (Linux).
        descriptor: Option<u64>,
    },
    /// The store's file cannot be written, though it is still read: its file system is mounted
    /// read-only (as ext4 does after an error), or the file is marked immutable or append-only.
    /// Found by [`VersionStore::check`] and before a publish, which then writes nothing; at
    /// start, the open that failed on it says so. (A commit that fails on such a file leaves
    /// the store reading a copy of it: see `RedbStore`.)
    #[error(
        "the store file {} cannot be written ({why}): no change is stored until it can be \
         (a file system an error turned read-only needs its repair, and a restart); the \
         versions stored are still read",
        path.display()
    )]
    NotWritable {
        /// The store's file.
        path: PathBuf,
        /// Why: "its file system is mounted read-only", "it is marked immutable" or "it is
        /// marked append-only".
        why: &'static str,
    },
    /// The storage backend failed (I/O error, failed commit, ...).
    #[error("the version store backend failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// A versioned, append-only store of policy documents.
///
/// Implementations are cheap to share (`Arc<dyn VersionStore>`) and every method is atomic on
/// its own.
pub trait VersionStore: Send + Sync + 'static {
    /// The current version, or `None` for an empty store.
    fn current(&self) -> Result<Option<VersionRecord>, StoreError>;

    /// [`VersionStore::current`] as the store's own file holds it, never as a copy of it
    /// read through the page cache (which the embedded store reads from while its file cannot
    /// be opened, and which may hold a commit whose flush failed): what a change is judged
    /// against, and what a failed commit left stored. Fails while the file cannot be opened.
    fn current_in_file(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.current()
    }

    /// A stored version, or `None` if it does not exist.
    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError>;

    /// The metadata of the newest `limit` versions older than `before` (all versions when
    /// `None`), newest first; `limit == 0` means all of them.
    fn history(&self, limit: usize, before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError>;

    /// Publishes `new` as version `current + 1` in one atomic transaction.
    ///
    /// In order: `expected == Some(v)` fails with [`StoreError::Conflict`] unless the current
    /// version is `v` (0 meaning "empty store"); a rollback from a version that is not stored
    /// fails with [`StoreError::NoSuchVersion`]; a content hash equal to the current version's
    /// writes nothing and returns [`Published::Unchanged`] with the current version.
    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError>;

    /// Whether the store could take a change now, as far as can be told without writing
    /// anything: the embedded store checks that its file is still the one it opened (not
    /// deleted or replaced), that the file can be written ([`StoreError::NotWritable`]), and
    /// that it reads. A store that failed after an I/O error is opened again by the check, as
    /// by any call (at most once every `REOPEN_INTERVAL`), so a disk freed again is found
    /// before the next change. A full disk is not seen until a change fails on it.
    ///
    /// The control plane checks its store every few seconds (`crate::store_check`); a store
    /// kept in memory is always fine.
    fn check(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// How long the store's file is, in bytes, as last seen (at open and after each publish,
    /// whether it stored anything or failed; no I/O here), or `None` for a store that keeps
    /// nothing on disk.
    fn disk_bytes(&self) -> Option<u64> {
        None
    }
}

impl From<&VersionMeta> for pb::VersionInfo {
    fn from(meta: &VersionMeta) -> Self {
        Self {
            version: meta.version,
            content_hash: meta.content_hash.clone(),
            source: meta.source.as_str().to_owned(),
            author: meta.author.clone().unwrap_or_default(),
            created_unix_ms: meta.created_unix_ms,
            summary: meta.summary.clone(),
            rolled_back_from: meta.source.rolled_back_from().unwrap_or(0),
        }
    }
}

// === shared by the backends ===

/// What a publish does, decided the same way by every backend.
#[derive(Debug, PartialEq)]
pub(crate) enum Plan<'a> {
    /// The content equals the current version's (held here): write nothing.
    Unchanged(&'a VersionRecord),
    /// Append this version.
    Append(u64),
}

/// Decides a publish of `new` on top of `current`.
///
/// `current` is `None` for an empty store. The caller must hold whatever makes the read of
/// `current` and the following write one atomic step.
pub(crate) fn plan<'a>(
    current: Option<&'a VersionRecord>,
    new: &NewVersion,
    expected: Option<u64>,
) -> Result<Plan<'a>, StoreError> {
    let current_version = current.map_or(0, |record| record.meta.version);
    if let Some(expected) = expected.filter(|&expected| expected != current_version) {
        return Err(StoreError::Conflict {
            expected,
            current: current_version,
        });
    }
    if let Some(from) = new.source.rolled_back_from()
        && (from == 0 || from > current_version)
    {
        return Err(StoreError::NoSuchVersion { version: from });
    }
    match current {
        Some(record) if record.meta.content_hash == new.content_hash => Ok(Plan::Unchanged(record)),
        _ => Ok(Plan::Append(current_version + 1)),
    }
}

/// The metadata of `new` stored as `version`.
pub(crate) fn meta_of(new: &NewVersion, version: u64) -> VersionMeta {
    VersionMeta {
        version,
        content_hash: new.content_hash.clone(),
        source: new.source,
        author: new.author.clone(),
        created_unix_ms: new.created_unix_ms,
        summary: new.summary.clone(),
    }
}

/// How many of `len` entries a history with `limit` returns (0 = all).
pub(crate) fn history_len(len: usize, limit: usize) -> usize {
    if limit == 0 { len } else { len.min(limit) }
}
