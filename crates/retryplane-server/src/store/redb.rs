//! The embedded [`VersionStore`]: one redb file under the data directory.
//!
//! # Layout
//!
//! The file is `<data dir>/retryplane.redb` and holds two tables:
//!
//! - `versions: u64 -> &[u8]`: version number → one encoded [`StoredRecord`], a private protobuf
//!   message holding the metadata, the document's encoding as stored bytes, and the lowercase
//!   hex SHA-256 of those bytes. In format 2 (written since the store compressed documents) the
//!   stored bytes are the encoding compressed with DEFLATE (RFC 1951); in format 1 (still read)
//!   they are the encoding itself. The checksum is the store's own and is independent of the
//!   content hash, which is the caller's (see the parent module). Keeping the document as bytes
//!   lets a record be verified without re-encoding it, and lets `history` skip decompressing
//!   and decoding documents.
//!
//!   Every version keeps its whole document, as SPEC §3 asks, so the file grows with each
//!   version by its document's compressed size: a policy file's endpoints share most of their
//!   settings, and a 1,000-endpoint file of 330 KB (128 KiB encoded) takes about 17 KiB a
//!   version (`store_bytes` in the server's `/metrics` reports the file's size).
//! - `meta: &str -> u64`: the key `"current"` holds the current version. Versions are contiguous,
//!   `1..=current`.
//!
//! # Durability and consistency
//!
//! A publish reads `current`, appends the record and moves `current` in one write transaction,
//! committed with [`Durability::Immediate`] (redb's default: durable when `commit` returns, and a
//! process killed at any point reopens on either the old or the new commit). The open checks
//! the file's integrity (redb page checksums) and then the store's own invariants — `current`
//! names the last of `1..=current` stored records, and that record decodes and its document
//! matches its checksum — and refuses to serve anything else with [`StoreError::Corrupt`]. Every
//! record read later is decoded and verified the same way. A record in a format newer than
//! [`RECORD_FORMAT`] (written by a later release, before a downgrade) is refused with
//! [`StoreError::NewerFormat`], which says so instead of calling the store corrupt.
//!
//! redb locks the file, and the store locks its directory (so that a file deleted under a
//! running control plane does not let a second one start there): a second open, from another
//! process or this one, fails with [`StoreError::InUse`].
//!
//! # A new store, and a file that holds none
//!
//! A new store is built under a temporary name in the data directory and renamed to
//! `retryplane.redb` only once its tables are committed (a rename that never replaces a file
//! another process put there meanwhile). So the store's path holds either nothing or a whole
//! store: a first start that fails half-way (a full disk, a crash) leaves no file there (and
//! what it left under the temporary name is deleted by a later open that holds the store's
//! lock, once no process holds that file and it is a minute old). A symbolic link at that
//! path that leads to nothing gets the new store where it leads. A
//! file at that path that is empty or holds only zero bytes is therefore not a fresh one but a
//! damaged one (a file system whose flushes were not honoured, a failed copy), and may be all
//! that is left of a version history: the open refuses it with [`StoreError::NotAStore`],
//! naming the file and saying to restore it or move it aside, and writes nothing. An empty
//! file is refused too, although it holds no data: the store never leaves one, so it comes
//! from somewhere else (a truncated copy), and starting a new store in it would hide that the
//! history is gone and hand agents version 1 again.
//!
//! # A file deleted or replaced under a running store
//!
//! redb goes on writing to the file it opened, even once it is deleted: a version published
//! then would be acknowledged and lost at the next start. So a publish first checks that the
//! store's path still names that file (device and inode) and otherwise fails with
//! [`StoreError::FileReplaced`], which says how to keep the old file's versions. Reads go on
//! from the open file.
//!
//! # After an I/O error
//!
//! When a commit fails on the disk (a full disk, say), redb refuses every later call with
//! "Previous I/O error occurred. Please close and re-open the database." The store then does
//! just that: it closes the database, opens the file again (redb recovers the last commit) and
//! runs the call once more. Freeing the space is enough for writes to work again, without a
//! restart. While the disk is still full, the reopen (which checks the whole file) is tried at
//! most once every [`REOPEN_INTERVAL`]: the calls in between fail at once, without touching the
//! file, with the error that says why the store is failing (the disk's, when the reopen failed).
//!
//! A reopen that fails (a full disk, where redb's recovery must write; a file system that the
//! failed write turned read-only, where redb opens nothing for writing and its read-only open
//! refuses a file that needs recovery) leaves the store reading a copy of the file in memory
//! ([`open_copy`], recovered there as redb would the file): `history` and every version still
//! read, as the page cache held them at the failure (which may include the commit whose flush
//! failed). Writes never go into the copy, nor do the reads that must see what is on disk
//! ([`VersionStore::current_in_file`]: the current version a change is judged against, and the
//! read-back of a failed commit): each tries the file
//! again (as often as reopens are), and fails while it cannot be opened. [`VersionStore::check`]
//! fails meanwhile, and tries the file too, so that the store goes back to it without a change
//! once it opens (a full disk with room again; a file system an error turned read-only needs
//! its repair, and a restart).

use retryplane_policy::diag::LogPath;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use prost::Message as _;
use redb::{
    Database, DatabaseError, Durability, ReadableDatabase as _, ReadableTable,
    ReadableTableMetadata, StorageError, TableDefinition,
};
use retryplane_proto::pb;
use sha2::{Digest as _, Sha256};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{
    NewVersion, Plan, Published, Source, StoreError, VersionMeta, VersionRecord, VersionStore,
    history_len, meta_of, plan,
};

/// The store's file name inside the data directory.
const FILE_NAME: &str = "retryplane.redb";
/// The start of the temporary name a new store is built under (see [`create_file`]). A file
/// named so is left only by a first start that was killed before it finished and never held a
/// version: a later open deletes it once it holds the store's lock.
const TEMP_PREFIX: &str = ".retryplane.redb.new-";
/// Version number → encoded [`StoredRecord`].
const VERSIONS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("versions");
/// Store-wide values; only [`CURRENT`] so far.
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// The key of the current version in [`META`].
const CURRENT: &str = "current";
/// The [`StoredRecord::format`] this code writes: its document compressed. It reads this and
/// [`UNCOMPRESSED_FORMAT`].
const RECORD_FORMAT: u32 = 2;
/// The first format, whose document is stored as encoded; records written before the store
/// compressed documents are in it.
const UNCOMPRESSED_FORMAT: u32 = 1;
/// The most a stored document may take once decompressed: a damaged record that would inflate
/// past it is refused rather than read into memory. Far above any document Apply accepts (its
/// snapshot must fit an agent's 4 MiB message).
const MAX_DOCUMENT_BYTES: u64 = 64 << 20;
/// The least time between two reopens after an I/O error (see the module docs).
pub(crate) const REOPEN_INTERVAL: Duration = Duration::from_secs(1);

/// One stored version, as encoded in the `versions` table.
#[derive(Clone, PartialEq, prost::Message)]
struct StoredRecord {
    /// Layout of this message; [`RECORD_FORMAT`].
    #[prost(uint32, tag = "1")]
    format: u32,
    /// Equal to the record's key.
    #[prost(uint64, tag = "2")]
    version: u64,
    /// The content hash the version was published with.
    #[prost(string, tag = "3")]
    content_hash: String,
    /// `"file"`, `"admin"` or `"rollback"`.
    #[prost(string, tag = "4")]
    source: String,
    /// For `"rollback"`: the version whose content was restored.
    #[prost(uint64, tag = "5")]
    rolled_back_from: u64,
    /// The admin token's name, if any.
    #[prost(string, optional, tag = "6")]
    author: Option<String>,
    /// Milliseconds since the Unix epoch.
    #[prost(uint64, tag = "7")]
    created_unix_ms: u64,
    /// One-line description of the change.
    #[prost(string, tag = "8")]
    summary: String,
    /// Lowercase hex SHA-256 of `document`.
    #[prost(string, tag = "9")]
    document_sha256: String,
    /// The encoded `pb::PolicyDocument`: compressed with DEFLATE in [`RECORD_FORMAT`], as
    /// encoded in [`UNCOMPRESSED_FORMAT`].
    #[prost(bytes = "vec", tag = "10")]
    document: Vec<u8>,
}

/// Opens the database in a file: redb's own file backend, except in tests that put a disk that
/// fails on demand in between.
pub(crate) type OpenDb = Box<dyn Fn(&Path) -> Result<Database, DatabaseError> + Send + Sync>;

/// The embedded [`VersionStore`], backed by a redb file under the data directory.
pub struct RedbStore {
    /// The open database; replaced after an I/O error (see the module docs).
    db: RwLock<Slot>,
    path: PathBuf,
    dir: PathBuf,
    open_db: OpenDb,
    /// The data directory, locked for as long as the store is open ([`lock_dir`]).
    _dir_lock: Option<std::fs::File>,
    /// The file's size as last seen ([`VersionStore::disk_bytes`]).
    disk_bytes: std::sync::atomic::AtomicU64,
    /// Whether the open created the store's file.
    created: bool,
}

impl std::fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The database a [`RedbStore`] runs its calls on.
struct Slot {
    /// `None` once a reopen failed: a later call tries again.
    db: Option<Database>,
    /// How many times the database was reopened, so that calls that failed on the same
    /// database reopen it once.
    generation: u64,
    /// When the last reopen was tried (on the tokio clock), if ever.
    reopened_at: Option<Instant>,
    /// Why the store is failing, once a call has needed a reopen: what the calls refused until
    /// the next reopen carry.
    failing: Option<Arc<StoreError>>,
    /// The file the database was opened on, when known: a publish checks that the store's path
    /// still names it ([`RedbStore::check_file`]).
    file: Option<FileId>,
    /// Whether `db` is a copy of the file in memory ([`open_copy`]), for reads only: the file
    /// could not be opened again after an I/O error. A write tries the file first, and fails
    /// while it cannot be opened.
    copy: bool,
}

impl Slot {
    /// Closes the database (its file lock goes with it), if open, and starts a new generation:
    /// the next call opens the file again.
    fn close(&mut self) {
        if let Some(db) = self.db.take()
            && let Err(error) = db.close()
        {
            debug!(error = %error, "closing the version store");
        }
        self.generation += 1;
    }
}

/// A file's identity: its device and inode numbers.
type FileId = (u64, u64);

/// The descriptor under `/proc/self/fd` on which this process holds the file `id` open (the
/// store's, deleted or replaced under it), so that the error can say where to copy it from.
/// `None` where there is no `/proc`, or no such descriptor is found.
fn descriptor_of(id: FileId) -> Option<u64> {
    // Bounded: a process holds at most its open-file limit of descriptors.
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    entries.flatten().find_map(|entry| {
        let fd: u64 = entry.file_name().to_str()?.parse().ok()?;
        (file_id(&entry.path()).ok()?? == id).then_some(fd)
    })
}

/// The identity of the file at `path` (links followed); `None` where the platform has none.
#[cfg(unix)]
fn file_id(path: &Path) -> std::io::Result<Option<FileId>> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).map(|m| Some((m.dev(), m.ino())))
}

/// The identity of the file at `path` (links followed); `None` where the platform has none.
#[cfg(not(unix))]
fn file_id(path: &Path) -> std::io::Result<Option<FileId>> {
    std::fs::metadata(path).map(|_| None)
}

/// The error of a call while the store is failing after an I/O error: the reopen that failed,
/// and each call refused without touching the file until the next reopen, [`REOPEN_INTERVAL`]
/// after it. Its source says why the store is failing (the disk's error, when the reopen failed).
#[derive(Debug, thiserror::Error)]
#[error(
    "the version store is failing after an I/O error; it is reopened at most once every {} ms",
    REOPEN_INTERVAL.as_millis()
)]
struct Failing(#[source] Arc<StoreError>);

/// The memory redb may keep of the file's pages. Its default (1 GiB) let a crawl of the
/// history (`get --version N` for each N) make the process resident for about the size of the
/// store; the server keeps the current version itself, and a read of another costs a few disk
/// reads without the cache.
const CACHE_BYTES: usize = 16 << 20;

/// The data directory `dir`, locked for one store: an exclusive `flock` on the directory
/// itself, let go when the store is dropped or its process ends. redb locks the store's file,
/// and a file deleted under a running control plane takes that lock with it: a second control
/// plane started on the same directory would then make a new store beside the first one's
/// (which serves on, refusing changes, until it is restarted). The directory stays, so the
/// second one is refused with [`StoreError::InUse`]. Where the directory cannot be opened or
/// locked (a file system without `flock`, or NFS and CIFS, where `flock` is a write lock that
/// a directory opened to read cannot take), the store goes on with redb's lock alone, with a
/// warning. A store file that is a link into another directory is guarded by the link's
/// directory.
#[cfg(unix)]
fn lock_dir(dir: &Path) -> Result<Option<std::fs::File>, StoreError> {
    let handle = match std::fs::File::open(dir) {
        Ok(handle) => handle,
        Err(e) => {
            warn!(dir = %LogPath(dir), error = %e, "cannot open the data directory to lock it; relying on the store file's own lock");
            return Ok(None);
        }
    };
    match handle.try_lock() {
        Ok(()) => Ok(Some(handle)),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::InUse {
            dir: dir.to_owned(),
            linked: None,
        }),
        Err(std::fs::TryLockError::Error(e)) => {
            warn!(dir = %LogPath(dir), error = %e, "cannot lock the data directory; relying on the store file's own lock");
            Ok(None)
        }
    }
}

/// See the Unix [`lock_dir`]: elsewhere a directory is not opened as a file, and redb's lock on
/// the store's file is the only one.
#[cfg(not(unix))]
fn lock_dir(_dir: &Path) -> Result<Option<std::fs::File>, StoreError> {
    Ok(None)
}

/// What a [`RedbStore::run`] op may run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// A read a copy of the file ([`Slot::copy`]) may serve.
    Copy,
    /// A write, or a read that must see the file itself (what a failed commit left on disk):
    /// never runs on a copy, which is read through the page cache and may hold a commit whose
    /// flush failed.
    File,
}

/// The largest store file [`open_copy`] copies into memory. Far above a store's usual size
/// (about 17 KiB a version of a 1,000-endpoint file); past it, reads fail with the store.
pub(super) const MAX_COPY_BYTES: u64 = 256 << 20;

/// A copy of the store's file in memory, opened as a database there (redb recovers it as it
/// would the file, in memory: the file is only read), for reads while the file cannot be
/// opened. Fails on a file over [`MAX_COPY_BYTES`], or one that cannot be read or opened.
pub(super) fn open_copy(path: &Path) -> Result<Database, StoreError> {
    use redb::StorageBackend as _;
    use std::io::Read as _;
    let io = |source| StoreError::OpenFile {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len > MAX_COPY_BYTES {
        return Err(StoreError::Backend(
            format!(
                "the store file is {len} bytes, over the {MAX_COPY_BYTES} a copy in memory may take"
            )
            .into(),
        ));
    }
    let copy = redb::backends::InMemoryBackend::new();
    copy.set_len(len).map_err(io)?;
    let mut chunk = vec![0; 1 << 20];
    let mut offset = 0;
    loop {
        let read = file.read(&mut chunk).map_err(io)?;
        if read == 0 {
            break;
        }
        copy.write(offset, &chunk[..read]).map_err(io)?;
        offset += read as u64;
    }
    open_watched(path, |builder| builder.create_with_backend(copy))
        .map_err(|error| open_error(path.parent().unwrap_or(path), path, error))
}

/// redb with the integrity check on open, on an existing file (never one it would initialize).
///
/// A file whose newest commit does not verify (its pages damaged after it was written, or a
/// crash within a commit) is opened at the commit before it: redb falls back to it, and the
/// newest version may be gone. That is said at warn once the open has succeeded, since nothing
/// else would: the fleet may have run the lost version (agents that did are warned of when they
/// connect). An open that fails says why itself.
fn open_file(path: &Path) -> Result<Database, DatabaseError> {
    open_watched(path, |builder| builder.open(path))
}

/// Opens the store of the file at `path` with `open` on a builder with the integrity check on
/// open and the store's cache, and warns (naming `path`) when redb fell back to the commit
/// before the newest (see [`open_file`]).
fn open_watched(
    path: &Path,
    open: impl FnOnce(&redb::Builder) -> Result<Database, DatabaseError>,
) -> Result<Database, DatabaseError> {
    let fell_back = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = fell_back.clone();
    let mut builder = Database::builder();
    builder
        .set_check_integrity_on_open(true)
        .set_cache_size(CACHE_BYTES)
        .set_repair_callback(move |session| {
            // redb's check reports its progress at 0 (it starts), 0.6 and after (the
            // allocator's rebuild), and in between only when the primary commit slot fails its
            // checksums, just before it tries the secondary one (redb 4's `do_repair`; pinned
            // by a test). Whether that one verifies is known only once the open returns.
            let progress = session.progress();
            if progress > 0.0 && progress < 0.6 {
                seen.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        });
    let db = open(&builder)?;
    if fell_back.load(std::sync::atomic::Ordering::Relaxed) {
        warn!(
            file = %LogPath(path),
            "the store's newest commit did not verify (damaged on disk, or cut by a crash while \
             it was written): the store is opened at the commit before it, so the newest \
             version may be lost; `retryplane history` shows what is kept"
        );
    }
    Ok(db)
}

impl RedbStore {
    /// Opens the store in `dir`, creating the directory and an empty store if needed, and
    /// checks its consistency (see the module docs).
    ///
    /// Fails with [`StoreError::InUse`] when another process holds the store, with
    /// [`StoreError::NotAStore`] when the file is empty or holds only zero bytes, with
    /// [`StoreError::OpenFile`] when it cannot be opened, and with [`StoreError::Corrupt`] when
    /// its content is inconsistent. A refused file is left as it is.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(dir, Box::new(open_file))
    }

    /// [`RedbStore::open`], with `open_db` opening the database file (now and on every reopen).
    pub(crate) fn open_with(dir: &Path, open_db: OpenDb) -> Result<Self, StoreError> {
        // `create_dir_all` would say "File exists" of a file at the path, which reads as if
        // the directory were there.
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            return Err(StoreError::NotADirectory {
                dir: dir.to_owned(),
            });
        }
        std::fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
        let dir_lock = lock_dir(dir)?;
        let path = dir.join(FILE_NAME);
        let mut created = false;
        match std::fs::metadata(&path) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                match dangling(&path) {
                    // A link to where the store is to be (a volume, say): created there.
                    Some(target) => create_file(target.parent().unwrap_or(dir), &target)?,
                    None => create_file(dir, &path)?,
                }
                created = true;
            }
            Err(source) => return Err(StoreError::OpenFile { path, source }),
            Ok(_) => {}
        }
        refuse_blank(&path)?;
        let db = open_db(&path).map_err(|error| match &error {
            // A file that cannot be written (a read-only file system, an immutable mark) is
            // refused saying which, rather than with the system's "Operation not permitted".
            DatabaseError::Storage(StorageError::Io(io))
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
                ) =>
            {
                writable(&path)
                    .err()
                    .unwrap_or_else(|| open_error(dir, &path, error))
            }
            _ => open_error(dir, &path, error),
        })?;
        let file = file_id(&path).ok().flatten();
        let store = Self {
            db: RwLock::new(Slot {
                db: Some(db),
                generation: 0,
                reopened_at: None,
                failing: None,
                file,
                copy: false,
            }),
            path,
            dir: dir.to_owned(),
            open_db,
            _dir_lock: dir_lock,
            disk_bytes: std::sync::atomic::AtomicU64::new(0),
            created,
        };
        store.run(Use::File, create_missing_tables)?;
        store.run(Use::Copy, check)?;
        store.note_size();
        // Only now: the open holds the file's lock, so no other server is building a store here
        // that it could use. Where a link put the store, its new stores were built there.
        remove_leftovers(dir);
        if let Some(real) = std::fs::canonicalize(&store.path)
            .ok()
            .and_then(|p| p.parent().map(Path::to_owned))
            && std::fs::canonicalize(dir).is_ok_and(|d| d != real)
        {
            remove_leftovers(&real);
        }
        Ok(store)
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this open created the store's file (a first start, or a data directory that is
    /// not the one meant).
    pub fn created(&self) -> bool {
        self.created
    }

    /// Reads the file's size for [`VersionStore::disk_bytes`]; one that cannot be read keeps
    /// the size last seen.
    fn note_size(&self) {
        if let Ok(meta) = std::fs::metadata(&self.path) {
            self.disk_bytes
                .store(meta.len(), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Runs `op` on the database; after redb's "previous I/O error", reopens the database and
    /// runs `op` once more, at most once every [`REOPEN_INTERVAL`] (see the module docs). An op
    /// on the file itself ([`Use::File`]: a write, or a read of what is on disk) never runs on
    /// a copy of the file ([`Slot::copy`]): it tries the file again first (as often), and fails
    /// while the file cannot be opened.
    fn run<T>(
        &self,
        use_: Use,
        op: impl Fn(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (generation, previous_io) = {
            let slot = self.db.read().unwrap_or_else(PoisonError::into_inner);
            match &slot.db {
                Some(_) if slot.copy && use_ == Use::File => (slot.generation, None),
                Some(db) => match op(db) {
                    Err(error) if is_previous_io(&error) => (slot.generation, Some(error)),
                    done => return done,
                },
                None => (slot.generation, None),
            }
        };
        self.reopen(generation, previous_io)?;
        let slot = self.db.read().unwrap_or_else(PoisonError::into_inner);
        match &slot.db {
            // The file still cannot be opened (a write never goes into the copy: it would be
            // acknowledged and lost).
            Some(_) if slot.copy && use_ == Use::File => Err(failing(&slot)),
            Some(db) => op(db),
            // Another call's reopen failed in between; a call after the interval tries again.
            None => Err(failing(&slot)),
        }
    }

    /// Fails with [`StoreError::FileReplaced`] when the store's path no longer names the file
    /// the database is open on (deleted, or another file put there): a commit would go into a
    /// file no later start opens. A check that cannot tell (the path cannot be read for another
    /// reason) lets the write go on, and the write says what is wrong.
    fn check_file(&self) -> Result<(), StoreError> {
        let opened = self.db.read().unwrap_or_else(PoisonError::into_inner).file;
        let Some(opened) = opened else {
            return Ok(());
        };
        let replaced = match file_id(&self.path) {
            Ok(now) => now != Some(opened),
            Err(error) => error.kind() == std::io::ErrorKind::NotFound,
        };
        if replaced {
            return Err(StoreError::FileReplaced {
                path: self.path.clone(),
                descriptor: descriptor_of(opened),
            });
        }
        Ok(())
    }

    /// After a commit that failed: closes the database, so that the next call opens the file
    /// again (at once, whenever the last reopen was) and reads what it holds. A commit can fail
    /// after its data reached the disk (a full disk, say), and this handle would go on reading
    /// the state from before it, while the next start serves the version it stored: a caller
    /// told the change failed must find out from the file itself whether it did
    /// (`committed_anyway` in the control plane reads it back).
    fn close_after_failed_commit(&self, error: &StoreError) {
        let mut slot = self.db.write().unwrap_or_else(PoisonError::into_inner);
        warn!(file = %LogPath(&self.path), error = %error, "a commit to the version store failed; reopening it to read what it holds");
        slot.close();
        slot.reopened_at = None;
        slot.failing = Some(Arc::new(StoreError::Backend(
            format!("a commit failed: {error}").into(),
        )));
    }

    /// Closes and opens the database again, unless another call did since `seen`, or a reopen
    /// was tried less than [`REOPEN_INTERVAL`] ago (then fails with why the store is failing).
    /// `previous_io` is the error that made the caller ask, if the database was open.
    fn reopen(&self, seen: u64, previous_io: Option<StoreError>) -> Result<(), StoreError> {
        let mut slot = self.db.write().unwrap_or_else(PoisonError::into_inner);
        if slot.generation != seen && slot.db.is_some() {
            return Ok(());
        }
        if let Some(error) = previous_io
            && slot.generation == seen
        {
            // A failure newer than the last reopen's: the database refuses every call again.
            slot.failing = Some(Arc::new(error));
        }
        let now = Instant::now();
        if slot
            .reopened_at
            .is_some_and(|at| now.saturating_duration_since(at) < REOPEN_INTERVAL)
        {
            return Err(failing(&slot));
        }
        warn!(file = %LogPath(&self.path), "the version store failed after an I/O error; reopening it");
        slot.reopened_at = Some(now);
        // The file lock must go before the file is opened again. No call is running: each holds
        // the read lock while it runs.
        slot.close();
        match (self.open_db)(&self.path) {
            Ok(db) => {
                if slot.copy {
                    info!(file = %LogPath(&self.path), "the version store's file opens again; changes are stored in it again");
                }
                slot.db = Some(db);
                slot.copy = false;
                slot.failing = None;
                slot.file = file_id(&self.path).ok().flatten();
                Ok(())
            }
            Err(error) => {
                let error = open_error(&self.dir, &self.path, error);
                // Reads go on from a copy of the file: on a file system turned read-only (as
                // ext4 does when a commit's write fails), the file still reads, but redb opens
                // it for writing only, and its read-only open refuses a file that needs the
                // recovery a failed commit leaves it in.
                match open_copy(&self.path) {
                    Ok(copy) => {
                        if !slot.copy {
                            warn!(file = %LogPath(&self.path), error = %crate::ErrorChain(&error), "the version store's file cannot be opened again after an I/O error: its versions are read from a copy in memory, and no change is stored until the file opens again");
                        }
                        slot.db = Some(copy);
                        slot.copy = true;
                        slot.failing = Some(Arc::new(error));
                        Ok(())
                    }
                    Err(copy_error) => {
                        debug!(file = %LogPath(&self.path), error = %crate::ErrorChain(&copy_error), "no copy of the version store's file for reads");
                        slot.copy = false;
                        slot.failing = Some(Arc::new(error));
                        Err(failing(&slot))
                    }
                }
            }
        }
    }
}

/// What a call fails with while the store is failing after an I/O error (a failed reopen, and
/// every call until the next one): [`Failing`], with why.
fn failing(slot: &Slot) -> StoreError {
    let cause = slot.failing.clone().unwrap_or_else(|| {
        Arc::new(StoreError::Backend(
            "the version store could not be reopened after an I/O error".into(),
        ))
    });
    StoreError::Backend(Box::new(Failing(cause)))
}

impl VersionStore for RedbStore {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.run(Use::Copy, |db| {
            let txn = db.begin_read().map_err(backend)?;
            let versions = txn.open_table(VERSIONS).map_err(backend)?;
            let meta = txn.open_table(META).map_err(backend)?;
            read_current_record(&versions, &meta)
        })
    }

    fn current_in_file(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.run(Use::File, |db| {
            let txn = db.begin_read().map_err(backend)?;
            let versions = txn.open_table(VERSIONS).map_err(backend)?;
            let meta = txn.open_table(META).map_err(backend)?;
            read_current_record(&versions, &meta)
        })
    }

    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        self.run(Use::Copy, |db| {
            let txn = db.begin_read().map_err(backend)?;
            let versions = txn.open_table(VERSIONS).map_err(backend)?;
            read_record(&versions, version)
        })
    }

    fn history(&self, limit: usize, before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError> {
        self.run(Use::Copy, |db| {
            let txn = db.begin_read().map_err(backend)?;
            let versions = txn.open_table(VERSIONS).map_err(backend)?;
            let count = usize::try_from(versions.len().map_err(backend)?).unwrap_or(usize::MAX);
            let take = history_len(count, limit);
            let entries = match before {
                Some(before) => versions.range(..before).map_err(backend)?,
                None => versions.iter().map_err(backend)?,
            };
            let mut metas = Vec::with_capacity(take.min(1_024));
            for entry in entries.rev().take(take) {
                let (key, value) = entry.map_err(backend)?;
                let (meta, _, _) = decode(key.value(), value.value())?;
                metas.push(meta);
            }
            Ok(metas)
        })
    }

    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError> {
        self.check_file()?;
        // Before the commit: one that failed on a read-only file would close the database to
        // read the file afresh, and a read-only file system refuses that open, so the versions
        // stored could no longer be read either.
        writable(&self.path)?;
        // Compressed once, before the transaction (which may run twice).
        let stored = compress_document(&new.document.encode_to_vec())?;
        let committing = std::cell::Cell::new(false);
        // A call redb refused before committing anything may run twice (see `run`).
        let published = self.run(Use::File, |db| {
            publish_in(db, &new, &stored, expected, &committing)
        });
        if let Err(error) = &published
            && committing.get()
        {
            self.close_after_failed_commit(error);
        }
        self.note_size();
        published
    }

    fn check(&self) -> Result<(), StoreError> {
        self.note_size();
        self.check_file()?;
        writable(&self.path)?;
        // As a write: a store read from a copy of its file fails the check, and tries the file
        // again (at most once every `REOPEN_INTERVAL`), so that its recovery is seen.
        self.run(Use::File, |db| {
            let txn = db.begin_read().map_err(backend)?;
            let meta = txn.open_table(META).map_err(backend)?;
            read_current(&meta).map(drop)
        })
    }

    fn disk_bytes(&self) -> Option<u64> {
        Some(self.disk_bytes.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Fails with [`StoreError::NotWritable`] when the file at `path` cannot be written though it
/// can be read: on a file system mounted read-only, or turned read-only by an error (ext4's
/// `errors=remount-ro`, which since Linux 6.x no longer shows in the mount's flags), or
/// (Linux) a file marked immutable or append-only (`chattr +i`, `+a`). A check that cannot
/// tell lets the caller go on: a write then says what is wrong.
#[cfg(unix)]
fn writable(path: &Path) -> Result<(), StoreError> {
    let not_writable = |why| StoreError::NotWritable {
        path: path.to_owned(),
        why,
    };
    if rustix::fs::statvfs(path)
        .is_ok_and(|fs| fs.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY))
    {
        return Err(not_writable("its file system is mounted read-only"));
    }
    #[cfg(target_os = "linux")]
    {
        // Opened to read its flags only. redb's locks belong to its own open file (an
        // `flock`, or open file description locks), so closing this one leaves them held.
        if let Ok(file) = std::fs::File::open(path)
            && let Ok(flags) = rustix::fs::ioctl_getflags(&file)
        {
            if flags.contains(rustix::fs::IFlags::IMMUTABLE) {
                return Err(not_writable("it is marked immutable"));
            }
            if flags.contains(rustix::fs::IFlags::APPEND) {
                return Err(not_writable("it is marked append-only"));
            }
        }
        // A file system an error turned read-only keeps its mount flags: an unnamed file made
        // beside the store (gone when closed, never in the directory) is refused on it. Only
        // where the directory is on the file's own file system: a file mounted on its own (a
        // Kubernetes `subPath`, a Docker file volume) may be writable in a read-only directory.
        // Where the file system has no unnamed files, nothing is learnt.
        let dir = std::fs::canonicalize(path)
            .ok()
            .and_then(|real| real.parent().map(Path::to_owned))
            .filter(|dir| same_file_system(path, dir));
        if let Some(dir) = dir
            && let Err(rustix::io::Errno::ROFS) = rustix::fs::open(
                &dir,
                rustix::fs::OFlags::TMPFILE
                    | rustix::fs::OFlags::WRONLY
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
            )
        {
            return Err(not_writable("its file system is read-only"));
        }
    }
    Ok(())
}

/// Whether `a` and `b` (links followed) are on one file system (one device); false when either
/// cannot be read.
#[cfg(unix)]
fn same_file_system(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev(),
        _ => false,
    }
}

/// See the Unix [`writable`]: elsewhere a write says what is wrong.
#[cfg(not(unix))]
fn writable(_path: &Path) -> Result<(), StoreError> {
    Ok(())
}

/// One publish transaction (see [`VersionStore::publish`]); `stored` is the document's
/// encoding compressed ([`compress_document`]).
fn publish_in(
    db: &Database,
    new: &NewVersion,
    stored: &[u8],
    expected: Option<u64>,
    committing: &std::cell::Cell<bool>,
) -> Result<Published, StoreError> {
    let mut txn = db.begin_write().map_err(backend)?;
    txn.set_durability(Durability::Immediate).map_err(backend)?;
    let published = {
        let mut versions = txn.open_table(VERSIONS).map_err(backend)?;
        let mut meta = txn.open_table(META).map_err(backend)?;
        let current = read_current_record(&versions, &meta)?;
        match plan(current.as_ref(), new, expected)? {
            Plan::Unchanged(current) => Published::Unchanged(current.clone()),
            Plan::Append(version) => {
                let record = VersionRecord {
                    meta: meta_of(new, version),
                    document: new.document.clone(),
                };
                let bytes = encode(&record.meta, stored.to_vec());
                versions
                    .insert(version, bytes.as_slice())
                    .map_err(backend)?;
                meta.insert(CURRENT, version).map_err(backend)?;
                Published::New(record)
            }
        }
    };
    // On an error above, dropping the transaction aborts it.
    match published {
        Published::New(_) => {
            committing.set(true);
            txn.commit().map_err(backend)?;
        }
        Published::Unchanged(_) => txn.abort().map_err(backend)?,
    }
    Ok(published)
}

// === opening ===

/// Creates the tables of a new store, so that read transactions find them.
fn create_tables(db: &Database) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(backend)?;
    txn.open_table(VERSIONS).map_err(backend)?;
    txn.open_table(META).map_err(backend)?;
    txn.commit().map_err(backend)
}

/// Creates the tables a store's file lacks. A store is made with its tables ([`create_file`]),
/// so this writes only to a file made otherwise: a restart that has nothing to write must not
/// need room on the disk (a full disk would stop it from serving the versions it holds).
fn create_missing_tables(db: &Database) -> Result<(), StoreError> {
    let missing = {
        let txn = db.begin_read().map_err(backend)?;
        let lacks =
            |error: &redb::TableError| matches!(error, redb::TableError::TableDoesNotExist(_));
        let versions = txn.open_table(VERSIONS).err();
        let meta = txn.open_table(META).err();
        match (versions, meta) {
            (None, None) => false,
            (Some(e), _) | (_, Some(e)) if !lacks(&e) => return Err(backend(e)),
            _ => true,
        }
    };
    if missing { create_tables(db) } else { Ok(()) }
}

/// Checks the invariants listed in the module docs.
fn check(db: &Database) -> Result<(), StoreError> {
    let txn = db.begin_read().map_err(backend)?;
    let versions = txn.open_table(VERSIONS).map_err(backend)?;
    let meta = txn.open_table(META).map_err(backend)?;
    let current = read_current(&meta)?;
    let last = versions
        .last()
        .map_err(backend)?
        .map(|(key, _)| key.value());
    let count = versions.len().map_err(backend)?;
    match (current, last) {
        (None, None) => Ok(()),
        (Some(current), Some(last)) if current == last && count == current => {
            read_record(&versions, current)?
                .map(|_| ())
                .ok_or_else(|| corrupt_missing(current))
        }
        (Some(current), _) if count == 0 => Err(StoreError::Corrupt(format!(
            "the current version is {current}, but no version is stored"
        ))),
        (None, Some(last)) => Err(StoreError::Corrupt(format!(
            "{count} versions are stored, up to {last}, but no current version is recorded"
        ))),
        (current, last) => Err(StoreError::Corrupt(format!(
            "the current version is {}, but the {count} stored versions end at {}",
            current.unwrap_or(0),
            last.unwrap_or(0),
        ))),
    }
}

/// Creates a new, empty store at `path`: built under a temporary name in `dir` (see
/// [`TEMP_PREFIX`]) and moved into place only once its tables are committed, so that a first
/// start that fails half-way (a full disk, a crash) leaves no file at `path` for a later start
/// to refuse. When another process created `path` meanwhile, its file is kept and this one
/// dropped.
fn create_file(dir: &Path, path: &Path) -> Result<(), StoreError> {
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| StoreError::CreateFile {
        path: path.to_owned(),
        source,
    };
    // Removed when dropped, on every way out but the rename.
    let mut builder = tempfile::Builder::new();
    builder.prefix(TEMP_PREFIX);
    // The mode the umask gives, as for any file the server creates (a temporary file's own
    // default is owner-only).
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let temp = builder
        .tempfile_in(dir)
        .map_err(|error| failed(error.into()))?;
    let db = Database::builder()
        .create(temp.path())
        .map_err(|error| failed(error.into()))?;
    create_tables(&db).map_err(|error| failed(error.into()))?;
    db.close().map_err(|error| failed(error.into()))?;
    match temp.persist_noclobber(path) {
        Ok(_) => {}
        Err(error) if error.error.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(error) => return Err(failed(error.error.into())),
    }
    // The new name must outlast a power cut as the commits made under it will.
    sync_dir(dir).map_err(|error| failed(error.into()))
}

/// Where the symbolic link at `path` leads, through any links after it, when that is nothing
/// (each relative link resolved against its own directory); `None` when `path` is no link.
/// Called only when `path` leads to nothing: a loop of links is another error.
fn dangling(path: &Path) -> Option<PathBuf> {
    let mut at = path.to_owned();
    // As many links as Linux follows in one path.
    for _ in 0..40 {
        let Ok(target) = std::fs::read_link(&at) else {
            return (at != path).then_some(at);
        };
        at = match at.parent() {
            Some(dir) if target.is_relative() => dir.join(target),
            _ => target,
        };
    }
    None
}

/// How long after its last write a leftover of a first start is kept (see
/// [`remove_leftovers`]): a server that is building its store this very moment has its file
/// open and locked, except in the instant between closing it and renaming it into place.
const LEFTOVER_AGE: Duration = Duration::from_secs(60);

/// Deletes what first starts that were killed left in `dir` (see [`TEMP_PREFIX`]): files of
/// that name that no process holds locked (as redb holds the one it builds) and that were not
/// written in the last [`LEFTOVER_AGE`]. Another server's first start in the same directory,
/// which would then find the store taken, keeps its file and fails as it would have. A file
/// that cannot be deleted is logged and left.
fn remove_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(TEMP_PREFIX)
            || !entry.file_type().is_ok_and(|t| t.is_file())
        {
            continue;
        }
        let path = entry.path();
        // Held until the file is deleted. Opened for writing too: NFS takes a lock only on a
        // file open for writing.
        let Ok(file) = std::fs::File::options().read(true).write(true).open(&path) else {
            continue;
        };
        let recent = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|at| at.elapsed().ok())
            .is_none_or(|age| age < LEFTOVER_AGE);
        if recent || file.try_lock().is_err() {
            debug!(file = %LogPath(&path), "a new store being built: left as it is");
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => info!(file = %LogPath(&path), "removed what an interrupted first start left"),
            Err(error) => warn!(
                file = %LogPath(&path),
                %error,
                "cannot remove what an interrupted first start left"
            ),
        }
    }
}

/// Flushes `dir`'s entries to disk.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Flushes `dir`'s entries to disk (not possible on this platform: the rename is the best done).
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Refuses a store file that is empty or holds only zero bytes, without writing to it: see
/// [`StoreError::NotAStore`]. The store never leaves such a file at its path (see
/// [`create_file`]), so one there was damaged or put there by something else, and may be all
/// that is left of a version history.
fn refuse_blank(path: &Path) -> Result<(), StoreError> {
    use std::io::Read as _;
    let unreadable = |source| StoreError::OpenFile {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    let mut buffer = vec![0; 64 * 1024];
    let mut len = 0_usize;
    loop {
        match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) if buffer[..n].iter().all(|&b| b == 0) => len += n,
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(unreadable(e)),
        }
    }
    Err(StoreError::NotAStore {
        path: path.to_owned(),
        what: if len == 0 {
            "is empty"
        } else {
            "holds only zero bytes"
        },
    })
}

/// What a store file that cannot be read as one leaves its operator to do.
const WHAT_TO_DO: &str = "retryplane does not repair it. Restore it from a backup, or, to start \
                          a new, empty store, move it aside";

/// The error of an open of `path` in `dir` that failed.
fn open_error(dir: &Path, path: &Path, error: DatabaseError) -> StoreError {
    match error {
        DatabaseError::DatabaseAlreadyOpen | DatabaseError::LockProtocolMismatch => {
            StoreError::InUse {
                dir: dir.to_owned(),
                // This process holds the directory's lock: what another holds is the file the
                // store file links to (named by its real path when it resolves).
                linked: std::fs::read_link(path)
                    .ok()
                    .map(|to| std::fs::canonicalize(path).unwrap_or(to)),
            }
        }
        DatabaseError::Storage(StorageError::Io(error))
            if error.kind() == std::io::ErrorKind::InvalidData =>
        {
            StoreError::Corrupt(format!(
                "{} is not a redb file: {error}; {WHAT_TO_DO}",
                path.display()
            ))
        }
        // A file cut short inside redb's header (it reads the header whole).
        DatabaseError::Storage(StorageError::Io(error))
            if error.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            StoreError::Corrupt(format!(
                "{} is truncated: shorter than a redb file's header ({error}); {WHAT_TO_DO}",
                path.display()
            ))
        }
        DatabaseError::Storage(StorageError::Io(source)) => StoreError::OpenFile {
            path: path.to_owned(),
            source,
        },
        // redb's own words name neither the file nor what to do.
        other => match backend(other) {
            StoreError::Corrupt(message) => StoreError::Corrupt(format!(
                "{} is damaged ({message}); {WHAT_TO_DO}",
                path.display()
            )),
            other => other,
        },
    }
}

// === encoding ===

/// `encoded` (a document's encoding) compressed as a record of the current format stores it
/// (DEFLATE at `flate2`'s default level). Public for the store-size bench, which times it.
pub fn compress_document(encoded: &[u8]) -> Result<Vec<u8>, StoreError> {
    use std::io::Write as _;
    let mut encoder =
        flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
    // Into memory: only running out of it could fail.
    encoder
        .write_all(encoded)
        .and_then(|()| encoder.finish())
        .map_err(|e| StoreError::Backend(Box::new(e)))
}

/// The encoding of version `version`'s document from what [`compress_document`] made of it,
/// bounded as a read of the store bounds it. Public for the store-size bench, which times it.
pub fn inflate_document(version: u64, stored: Vec<u8>) -> Result<Vec<u8>, StoreError> {
    document_of(version, RECORD_FORMAT, stored)
}

/// The document's encoding from a record's stored bytes (`format`: the record's), checked
/// against [`MAX_DOCUMENT_BYTES`].
fn document_of(key: u64, format: u32, stored: Vec<u8>) -> Result<Vec<u8>, StoreError> {
    use std::io::Read as _;
    if format == UNCOMPRESSED_FORMAT {
        return Ok(stored);
    }
    let mut document = Vec::with_capacity(stored.len().saturating_mul(8));
    flate2::read::DeflateDecoder::new(stored.as_slice())
        .take(MAX_DOCUMENT_BYTES + 1)
        .read_to_end(&mut document)
        .map_err(|error| {
            StoreError::Corrupt(format!(
                "the document of version {key} cannot be decompressed: {error}"
            ))
        })?;
    if document.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(StoreError::Corrupt(format!(
            "the document of version {key} decompresses to more than {MAX_DOCUMENT_BYTES} bytes"
        )));
    }
    Ok(document)
}

/// The record `record` (encoded) with its format and stored document replaced, and the
/// document's checksum made to match: records as another release would write them, or damaged
/// behind a valid checksum.
#[cfg(test)]
pub(super) fn with_document(record: &[u8], format: u32, document: Vec<u8>) -> Vec<u8> {
    let mut stored = StoredRecord::decode(record).unwrap();
    stored.format = format;
    stored.document_sha256 = sha256_hex(&document);
    stored.document = document;
    stored.encode_to_vec()
}

/// Encodes a record from its metadata and the document's stored bytes (compressed, [`compress_document`]).
fn encode(meta: &VersionMeta, document: Vec<u8>) -> Vec<u8> {
    StoredRecord {
        format: RECORD_FORMAT,
        version: meta.version,
        content_hash: meta.content_hash.clone(),
        source: meta.source.as_str().to_owned(),
        rolled_back_from: meta.source.rolled_back_from().unwrap_or(0),
        author: meta.author.clone(),
        created_unix_ms: meta.created_unix_ms,
        summary: meta.summary.clone(),
        document_sha256: sha256_hex(&document),
        document,
    }
    .encode_to_vec()
}

/// Decodes the record stored under `key` into its metadata and the document's stored bytes
/// with the record's format (see [`document_of`]), and checks those bytes against their
/// checksum.
fn decode(key: u64, bytes: &[u8]) -> Result<(VersionMeta, u32, Vec<u8>), StoreError> {
    let bad = |what: String| StoreError::Corrupt(format!("the record of version {key} {what}"));
    let stored =
        StoredRecord::decode(bytes).map_err(|error| bad(format!("cannot be decoded: {error}")))?;
    if stored.format > RECORD_FORMAT {
        return Err(StoreError::NewerFormat {
            version: key,
            format: stored.format,
            supported: RECORD_FORMAT,
        });
    }
    if stored.format != RECORD_FORMAT && stored.format != UNCOMPRESSED_FORMAT {
        return Err(bad(format!(
            "has format {}, but this build reads formats {UNCOMPRESSED_FORMAT} and \
             {RECORD_FORMAT} only",
            stored.format
        )));
    }
    if stored.version != key {
        return Err(bad(format!("says it is version {}", stored.version)));
    }
    let source = match (stored.source.as_str(), stored.rolled_back_from) {
        ("file", _) => Source::File,
        ("admin", _) => Source::Admin,
        ("rollback", from) => Source::Rollback { from },
        (other, _) => return Err(bad(format!("has an unknown source {other:?}"))),
    };
    let computed = sha256_hex(&stored.document);
    if computed != stored.document_sha256 {
        return Err(bad(format!(
            "has a document checksum of {}, but its document hashes to {computed}",
            stored.document_sha256
        )));
    }
    let meta = VersionMeta {
        version: stored.version,
        content_hash: stored.content_hash,
        source,
        author: stored.author,
        created_unix_ms: stored.created_unix_ms,
        summary: stored.summary,
    };
    Ok((meta, stored.format, stored.document))
}

/// Lowercase hex SHA-256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut hex, byte| {
            // Writing to a String cannot fail.
            let _ = write!(hex, "{byte:02x}");
            hex
        })
}

// === reading ===

/// The version `"current"` names, if any.
fn read_current(meta: &impl ReadableTable<&'static str, u64>) -> Result<Option<u64>, StoreError> {
    Ok(meta
        .get(CURRENT)
        .map_err(backend)?
        .map(|value| value.value()))
}

/// The record of the current version, if any; a dangling `"current"` is corrupt.
fn read_current_record(
    versions: &impl ReadableTable<u64, &'static [u8]>,
    meta: &impl ReadableTable<&'static str, u64>,
) -> Result<Option<VersionRecord>, StoreError> {
    match read_current(meta)? {
        None => Ok(None),
        Some(current) => read_record(versions, current)?
            .map(Some)
            .ok_or_else(|| corrupt_missing(current)),
    }
}

/// The record of `version`, decoded and verified, if stored.
fn read_record(
    versions: &impl ReadableTable<u64, &'static [u8]>,
    version: u64,
) -> Result<Option<VersionRecord>, StoreError> {
    let Some(value) = versions.get(version).map_err(backend)? else {
        return Ok(None);
    };
    let (meta, format, stored) = decode(version, value.value())?;
    let document = document_of(version, format, stored)?;
    let document = pb::PolicyDocument::decode(document.as_slice()).map_err(|error| {
        StoreError::Corrupt(format!(
            "the document of version {version} cannot be decoded: {error}"
        ))
    })?;
    Ok(Some(VersionRecord { meta, document }))
}

// === errors ===

/// A `"current"` that names no stored record.
fn corrupt_missing(current: u64) -> StoreError {
    StoreError::Corrupt(format!(
        "the current version is {current}, but its record is missing"
    ))
}

/// Whether `error` is redb's "previous I/O error": the database refuses every call until it
/// is reopened.
fn is_previous_io(error: &StoreError) -> bool {
    matches!(
        error,
        StoreError::Backend(e) if matches!(e.downcast_ref::<redb::Error>(), Some(redb::Error::PreviousIo))
    )
}

/// Maps a redb error: corruption it detects is [`StoreError::Corrupt`], the rest
/// [`StoreError::Backend`].
fn backend(error: impl Into<redb::Error>) -> StoreError {
    match error.into() {
        redb::Error::Corrupted(message) => StoreError::Corrupt(message),
        other => StoreError::Backend(Box::new(other)),
    }
}
