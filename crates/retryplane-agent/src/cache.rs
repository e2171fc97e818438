//! The cache file: the last applied snapshot, encoded as a `retryplane.v1.Snapshot` after a
//! one-line header ([`HEADER`]), so a restarted agent starts on its last good policies when the
//! control plane is unreachable.
//!
//! Written atomically after every applied snapshot: a temporary file in the same directory is
//! written and fsynced, then renamed over the cache file (a link at the cache path is replaced,
//! not written through), and the directory is fsynced, so a
//! crash leaves either the old file or the new one, never a torn one. The temporary file's name
//! is random and created exclusively (`.NAME.tmp-…`), so no two writes share it; a write that
//! fails is tried again by the cache writer, and a write removes such files older than 10
//! minutes (an interrupted write's).
//!
//! Read at start; a missing (its directory too), empty or invalid file is logged and ignored. A
//! file of zero bytes only (what a file system that lost its writes leaves: no one writes such a
//! file on purpose) is no one's, as an empty one is: ignored, and replaced by the next applied
//! snapshot. One
//! that cannot be read (permission denied, a loop of links, an I/O error) was not found to be ours:
//! it is logged and left as it is, and no cache is kept for the run. The read runs on a thread of
//! its own and a start waits at most 1 s for it. A read that takes longer (a cold network volume)
//! is not given up on: the agent starts on the fallback policy, and the read is handed to the cache
//! writer, which settles it as a start would before it writes anything. If the file is our valid
//! cache and the agent still runs on the fallback policy (no snapshot came from the control plane
//! meanwhile), the stream task puts its policies and metrics interval in force then, as they would
//! have been at start. With a stream open, the counts made on the fallback are reported first and
//! the stream is reopened so that its Hello says the version in force; without one, those counts are
//! held under the fallback's version and go out first on the next stream. Whatever the file holds, nothing is
//! written to the path until the read has ended and found the file ours, and a read that never ends
//! leaves the path alone for the whole run. Anything at the path that is not a regular file (a FIFO
//! would wait for a writer) is logged, left alone, and no cache is kept for the run. A file that
//! begins with the header is ours whatever follows it (damaged on disk, or written by a newer agent
//! whose snapshot this one cannot check), and so is one whose header has another format number
//! (an agent of another cache format wrote it), or is damaged itself (cut short, or a byte or two
//! changed): it is not used, and the next applied snapshot replaces it. A file without the header is ours only if it is a snapshot whose content hash matches its
//! policies (what agents wrote before the header), and a file larger than any cache is ours only if
//! it begins with the header. One that holds more policies than a policy file can is not used
//! (the agent refuses such a snapshot on the stream too: only a version stored before the control
//! plane had that limit can be one): its endpoints and routes are counted on its bytes, before the
//! decode, and its list entries after it; with the header it is ours and replaced, without it
//! another's. Anything else is most likely another file the agent was pointed at by
//! mistake: it is left as it is and no cache is written for the whole run, rather than being
//! replaced. The metrics interval the control plane set in that snapshot applies again from the
//! start, as it did before the restart: a control plane that finds the agent up to date sends it
//! nothing.

use retryplane_policy::diag::LogPath;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prost::Message as _;
use retryplane_policy::PolicySet;
use retryplane_proto::pb;
use tokio::sync::oneshot;
use tracing::{info, warn};

use crate::judge::{self, Refused};
use crate::snapshot::{PolicySnapshot, Source};

/// Largest cache file read: the header and the largest snapshot the agent takes from a control
/// plane ([`retryplane_proto::MAX_MESSAGE_BYTES`]; encoded again, a decoded message is never
/// longer). Larger, a file is not a cache this agent wrote.
const MAX_BYTES: u64 = (HEADER.len() + retryplane_proto::MAX_MESSAGE_BYTES) as u64;

/// How long a start waits for the cache file to be read (see [`load`]). A local disk reads
/// the largest cache in milliseconds.
const READ_WAIT: Duration = Duration::from_secs(1);

/// The first bytes of every cache file the agent writes: they mark the file as the agent's own.
pub(crate) const HEADER: &[u8] = b"retryplane agent policy cache 1\n";

/// The header without its format number: a file that begins so is an agent's cache, of this
/// format or another (an agent older or newer than this one wrote it), and is ours to replace.
const HEADER_NAME: &[u8] = b"retryplane agent policy cache ";

/// The bytes of the cache file for `snap`: [`HEADER`], then the encoded snapshot.
pub(crate) fn encode(snap: &pb::Snapshot) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER.len() + snap.encoded_len());
    bytes.extend_from_slice(HEADER);
    // Writing into a `Vec` cannot run out of room.
    let _ = snap.encode(&mut bytes);
    bytes
}

/// Writes `bytes` to `path` atomically: into a new temporary file beside it, which is renamed
/// over `path`. The temporary file is created with a random name and never through an existing
/// file or link (`O_EXCL`, by `tempfile`), so a link planted in a shared directory cannot turn the
/// write onto another file; it is readable by its owner only, as is the cache file it becomes.
///
/// A cache path that is a link is replaced by the file, never written through: whoever can
/// write the link's directory could otherwise swap the link after the start's read and lead
/// the write onto any file the agent may replace (any file at all, for an agent run as root).
/// Give the agent the file's own path (on the volume that should keep it).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "cache".to_owned());
    let prefix = format!(".{name}.tmp-");
    // Removed when dropped, so a failed write leaves nothing behind.
    let mut tmp = tempfile::Builder::new().prefix(&prefix).tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // Make the rename itself durable; not every platform can open a directory.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    remove_left_temporaries(dir, &prefix, LEFT_AFTER);
    Ok(())
}

/// How old a temporary file of a cache write must be to be taken for one an interrupted write
/// left (a write takes milliseconds; one that hangs that long on its disk is not coming back).
const LEFT_AFTER: Duration = Duration::from_secs(10 * 60);

/// Removes the temporary files of cache writes in `dir` (named `prefix…`, regular files) last
/// modified over `older_than` ago: what a write left when its process was killed, or the host
/// lost power, between creating one and renaming it over the cache. Each is up to a cache's
/// size, and nothing else removes them. Best effort: what cannot be read or removed is left.
fn remove_left_temporaries(dir: &Path, prefix: &str, older_than: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = std::time::SystemTime::now();
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(prefix) {
            continue;
        }
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|at| now.duration_since(at).ok())
            .is_some_and(|age| age > older_than);
        if meta.is_file() && old && std::fs::remove_file(entry.path()).is_ok() {
            info!(file = %LogPath(&entry.path()), "removed the temporary file of an interrupted policy cache write");
        }
    }
}

/// What a valid cache file gives back.
#[derive(Debug)]
pub(crate) struct Cached {
    /// The cached policies, checked.
    policies: PolicySet,
    version: u64,
    content_hash: String,
    /// The metrics interval the control plane set with it; `None` when it left it to the agent.
    pub(crate) metrics_interval: Option<Duration>,
}

impl Cached {
    /// The cached snapshot's version.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// A cache as read, for tests of what the stream task does with one.
    #[cfg(test)]
    pub(crate) fn for_test(policies: PolicySet, version: u64) -> Self {
        Self {
            policies,
            version,
            content_hash: String::new(),
            metrics_interval: None,
        }
    }

    /// The snapshot to put in force, built on `previous` (the policies in force, whose endpoint
    /// state carries over as with any new snapshot; `None` at start).
    pub(crate) fn into_snapshot(self, previous: Option<&PolicySnapshot>) -> PolicySnapshot {
        PolicySnapshot::build(
            self.policies,
            self.version,
            self.content_hash,
            Source::Cache,
            previous,
        )
    }
}

/// A file at the cache path that is not a policy cache: left as it is, and no cache is kept.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Foreign;

/// How a start's read of the cache file went.
#[derive(Debug)]
pub(crate) enum Start {
    /// Read within the start's wait: the snapshot kept there, if it is there and valid;
    /// [`Foreign`] when the file there is not a policy cache (see the module docs).
    Read(Result<Option<Cached>, Foreign>),
    /// Not read within the start's wait, and still being read.
    Late(LateRead),
}

/// A read of the cache file that a start did not wait for to the end. Whoever writes the cache
/// file settles it ([`LateRead::settle`]) before the first write.
#[derive(Debug)]
pub(crate) struct LateRead {
    path: PathBuf,
    found: oneshot::Receiver<Found>,
}

impl LateRead {
    /// Waits for the read, without blocking a thread, and judges what it found as a start does,
    /// with the same log lines; a valid cache is not logged here (the caller says what it does
    /// with it). Never returns if the read never ends.
    pub(crate) async fn settle(self) -> Result<Option<Cached>, Foreign> {
        match self.found.await {
            Ok(found) => found.judge(&self.path),
            Err(_) => failed(&self.path),
        }
    }
}

/// The reading thread ended without an answer: the file was not checked, so it is not ours to
/// replace.
fn failed(path: &Path) -> Result<Option<Cached>, Foreign> {
    warn!(
        file = %LogPath(path),
        "the policy cache read failed; running without it, and no cache is kept this run"
    );
    Err(Foreign)
}

/// Run on the reading thread before it reads (tests: a disk that answers late).
pub(crate) type BeforeRead = Box<dyn FnOnce() + Send>;

/// Reads the cache file at `path` on a thread of its own, which runs `before` first (tests: a
/// disk that answers late): [`Start::Read`] if the read is done within [`READ_WAIT`], else
/// [`Start::Late`]. [`crate::AgentBuilder::connect`] is not async
/// and does not wait for the network, so a volume that stops answering may not hold it up
/// either. The wait is the wall clock's, not tokio's: a disk does not run on tokio's clock.
pub(crate) fn load(path: &Path, before: Option<BeforeRead>) -> Start {
    load_with(path, READ_WAIT, before)
}

/// [`load`], waiting at most `wait`.
pub(crate) fn load_with(path: &Path, wait: Duration, before: Option<BeforeRead>) -> Start {
    let (found_tx, found) = oneshot::channel();
    // What a start waits on: the disk's answer (bounded), then the check of what it read (not
    // bounded: no disk, and a start always waited for it). Each is also said when the thread
    // ends without getting there.
    let (read_tx, read) = std::sync::mpsc::sync_channel::<()>(1);
    let (checked_tx, checked) = std::sync::mpsc::sync_channel::<()>(1);
    let at = path.to_owned();
    let spawned = std::thread::Builder::new()
        .name("retryplane-cache-read".into())
        .spawn(move || {
            if let Some(before) = before {
                before();
            }
            let gathered = gather(&at);
            let _ = read_tx.send(());
            let _ = found_tx.send(match gathered {
                Gathered::Bytes(bytes) => check(&bytes),
                Gathered::Other(found) => found,
            });
            let _ = checked_tx.send(());
        });
    if let Err(e) = spawned {
        // Reading inline could hang the start; not reading, the file was not checked: it is
        // not ours to replace.
        warn!(
            file = %LogPath(path),
            error = %e,
            "cannot start a thread to read the policy cache; starting without it, and no \
             cache is kept this run"
        );
        return Start::Read(Err(Foreign));
    }
    let mut late = LateRead {
        path: path.to_owned(),
        found,
    };
    if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = read.recv_timeout(wait) {
        warn!(
            file = %LogPath(path),
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "the policy cache could not be read in time (a volume that does not answer?); \
             starting without it. Its policies are used when the read ends if none came from \
             the control plane by then; nothing is written to the cache file before it is read"
        );
        return Start::Late(late);
    }
    let _ = checked.recv();
    let loaded = match late.found.try_recv() {
        Ok(found) => found.judge(path),
        Err(_) => failed(path),
    };
    if let Ok(Some(cached)) = &loaded {
        info!(file = %LogPath(path), version = cached.version(), "starting on cached policies");
    }
    Start::Read(loaded)
}

/// What a read found at the cache path, checked (on the reading thread, after the disk
/// answered: a large file takes time to decode, and a late one is not decoded on the caller's
/// runtime).
#[derive(Debug)]
enum Found {
    /// Our cache, valid.
    Cached(Cached),
    /// Nothing there; `no_dir` when its directory does not exist either.
    Missing { no_dir: bool },
    /// The read failed.
    Unreadable(std::io::Error),
    /// Not a regular file.
    NotRegular,
    /// Our own cache file, not usable (why): replaced by the next applied snapshot.
    Ours(String),
    /// An empty file: no one's.
    Empty,
    /// A file of zero bytes only (a file system that lost its writes): no one's.
    Zeros,
    /// Not a policy cache (why): never replaced.
    Foreign(String),
}

/// What the disk gave: the bytes of the regular file at the cache path, to [`check`], or what
/// else was found there.
enum Gathered {
    Bytes(Vec<u8>),
    Other(Found),
}

/// Every disk access of a read of `path`.
fn gather(path: &Path) -> Gathered {
    match read(path) {
        Ok(Read::Bytes(bytes)) => Gathered::Bytes(bytes),
        Ok(Read::NotRegular) => Gathered::Other(Found::NotRegular),
        Ok(Read::Missing) => {
            // (A directory that is a file or cannot be searched fails the read itself.)
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            let no_dir = matches!(
                dir.map(std::fs::metadata),
                Some(Err(e)) if e.kind() == std::io::ErrorKind::NotFound
            );
            Gathered::Other(Found::Missing { no_dir })
        }
        Err(e) => Gathered::Other(Found::Unreadable(e)),
    }
}

/// Whose the bytes of a regular file at the cache path are, and whether they can be used.
fn check(bytes: &[u8]) -> Found {
    // Larger than any cache the agent writes: ours (damaged) only if it starts like one.
    let checked = if bytes.len() as u64 > MAX_BYTES {
        Err(if bytes.starts_with(HEADER_NAME) {
            Unusable::Ours("the cache file is too large".to_owned())
        } else {
            Unusable::Foreign("too large for a policy cache".to_owned())
        })
    } else {
        decode(bytes)
    };
    match checked {
        Ok(cached) => Found::Cached(cached),
        Err(Unusable::Ours(reason)) => Found::Ours(reason),
        Err(Unusable::Foreign(_)) if bytes.is_empty() => Found::Empty,
        // Within the size of any cache the agent writes: a larger file (a sparse one, a disk
        // image) that begins with zeros is someone else's.
        Err(Unusable::Foreign(_))
            if bytes.len() as u64 <= MAX_BYTES && bytes.iter().all(|&b| b == 0) =>
        {
            Found::Zeros
        }
        Err(Unusable::Foreign(reason)) => Found::Foreign(reason),
    }
}

impl Found {
    /// What the agent makes of it: the cache to use, if any, or [`Foreign`]: not to be
    /// replaced. Logged, except a valid cache.
    fn judge(self, path: &Path) -> Result<Option<Cached>, Foreign> {
        let file = path.display();
        match self {
            Found::Cached(cached) => Ok(Some(cached)),
            Found::Missing { no_dir: true } => {
                warn!(
                    %file,
                    "the policy cache's directory does not exist: no cache can be kept there \
                     until it is created"
                );
                Ok(None)
            }
            Found::Missing { no_dir: false } => {
                info!(%file, "no policy cache yet");
                Ok(None)
            }
            // Not known to be ours, so not to be replaced (a file of another user's, for one).
            Found::Unreadable(e) => {
                warn!(
                    %file,
                    error = %e,
                    "cannot read the policy cache; it is left as it is and no cache is kept: \
                     make it readable to the agent, or give the agent a cache file of its own"
                );
                Err(Foreign)
            }
            Found::NotRegular => {
                warn!(
                    %file,
                    "the cache path is not a regular file; it is left as it is and no cache is \
                     kept: give the agent a cache file of its own"
                );
                Err(Foreign)
            }
            Found::Ours(reason) => {
                warn!(%file, %reason, "the policy cache is not usable; ignored");
                Ok(None)
            }
            Found::Empty => {
                info!(%file, "the policy cache is empty; ignored");
                Ok(None)
            }
            Found::Zeros => {
                warn!(
                    %file,
                    "the policy cache holds only zero bytes (a file system that lost its \
                     writes?); ignored, and replaced by the next policies applied"
                );
                Ok(None)
            }
            Found::Foreign(reason) => {
                warn!(
                    %file,
                    %reason,
                    "the cache file is not a policy cache; it is left as it is and no cache is \
                     kept: give the agent a cache file of its own"
                );
                Err(Foreign)
            }
        }
    }
}

/// Why a cache file cannot be used.
enum Unusable {
    /// A snapshot this agent (or another version of it) wrote, whose policies no longer
    /// validate: replaced by the next applied snapshot.
    Ours(String),
    /// Not a snapshot with policies and a matching content hash: not ours to replace.
    Foreign(String),
}

/// What is at the cache path.
#[derive(Debug)]
enum Read {
    /// A regular file's bytes (up to one more than [`MAX_BYTES`]).
    Bytes(Vec<u8>),
    /// Nothing.
    Missing,
    /// Something other than a regular file (or a link to one), not opened: opening a FIFO
    /// would wait for a writer.
    NotRegular,
}

/// Reads what is at `path` (see [`Read`]).
fn read(path: &Path) -> std::io::Result<Read> {
    use std::io::Read as _;
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => return Ok(Read::NotRegular),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Read::Missing),
        Err(e) => return Err(e),
    }
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Read::Missing),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    // One byte more than the limit tells a file over it (see `check`).
    f.take(MAX_BYTES + 1).read_to_end(&mut bytes)?;
    Ok(Read::Bytes(bytes))
}

/// Whether `bytes` begin with [`HEADER`] damaged on disk: cut short inside it, or with one or
/// two of its bytes changed. No other file begins so, and without this rule such a file of our
/// own would be taken for another's, left in place and no cache kept, run after run.
fn damaged_header(bytes: &[u8]) -> bool {
    if bytes.len() < HEADER.len() {
        return !bytes.is_empty() && HEADER.starts_with(bytes);
    }
    let differing = HEADER.iter().zip(bytes).filter(|(a, b)| a != b).count();
    differing <= 2
}

/// Whether a start would use a cache file holding `bytes` (tests of what the stream applies).
#[cfg(test)]
pub(crate) fn decode_for_test(bytes: &[u8]) -> Result<(), ()> {
    decode(bytes).map(drop).map_err(drop)
}

/// Why a cache file whose snapshot [`judge`] refused is not used; `problem` makes the
/// [`Unusable`] of a file that may or may not be ours. Policies the validator refuses are
/// ours whatever the header: no other program writes a snapshot whose hash matches.
fn refused(why: Refused, problem: fn(String) -> Unusable) -> Unusable {
    match why {
        Refused::TooMany(too_many) => problem(too_many.message),
        Refused::NoPolicies => problem("the snapshot holds no policies".to_owned()),
        // Either cause reads the same here: the agent decodes no field it does not know, so
        // policies a newer agent wrote with a field added hash otherwise once read.
        Refused::HashMismatch => problem(
            "its content hash does not match its policies (damaged on disk, or written by a \
             newer agent whose policies carry fields this one does not know)"
                .to_owned(),
        ),
        Refused::Invalid(errors) => Unusable::Ours(format!(
            "invalid policies: {}",
            errors.first().map(ToString::to_string).unwrap_or_default()
        )),
    }
}

fn decode(bytes: &[u8]) -> Result<Cached, Unusable> {
    // With the header, every problem below is one of our own file's; without it, only a
    // snapshot that checks out is ours.
    let (bytes, problem): (&[u8], fn(String) -> Unusable) = match bytes.strip_prefix(HEADER) {
        Some(rest) => (rest, Unusable::Ours),
        // An agent of another cache format wrote it: not readable here, replaced all the same
        // (an agent rolled back past a format change keeps a cache).
        None if bytes.starts_with(HEADER_NAME) => {
            return Err(Unusable::Ours(
                "a policy cache of another format (another version of the agent wrote it)"
                    .to_owned(),
            ));
        }
        None if damaged_header(bytes) => {
            return Err(Unusable::Ours(
                "a policy cache whose header is damaged (cut short, or a byte or two changed)"
                    .to_owned(),
            ));
        }
        None => (bytes, Unusable::Foreign),
    };
    // The rule the stream judges a pushed snapshot by (`judge`), so that no cache of the
    // agent's own is refused here. Counted before the decode: a document of bare endpoints
    // grows about 200 times decoded.
    judge::on_the_wire(bytes).map_err(|r| refused(r, problem))?;
    let snap = pb::Snapshot::decode(bytes).map_err(|e| problem(format!("not a snapshot: {e}")))?;
    let (set, _) =
        judge::policies(snap.policies, &snap.content_hash).map_err(|r| refused(r, problem))?;
    let metrics_interval = match snap.metrics_interval_ms {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    };
    Ok(Cached {
        policies: set,
        version: snap.version,
        content_hash: snap.content_hash,
        metrics_interval,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use retryplane_proto::convert;

    #[test]
    fn a_write_removes_temporary_files_interrupted_writes_left_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let aged = |name: &str, secs: u64| {
            let p = dir.path().join(name);
            std::fs::write(&p, b"part").unwrap();
            let at = std::time::SystemTime::now() - Duration::from_secs(secs);
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(at)
                .unwrap();
            p
        };
        let left = aged(".agent.cache.tmp-Ab12Cd", 3600);
        let in_progress = aged(".agent.cache.tmp-Ef34Gh", 5);
        let other_cache = aged(".other.cache.tmp-Ij56Kl", 3600);
        let unrelated = aged("notes.txt", 3600);
        let a_dir = dir.path().join(".agent.cache.tmp-dir");
        std::fs::create_dir(&a_dir).unwrap();
        write_atomic(&path, b"snapshot").unwrap();
        assert!(
            !left.exists(),
            "an hour-old temporary file of this cache is removed"
        );
        assert!(
            in_progress.exists(),
            "a young one may be another process's write"
        );
        assert!(other_cache.exists() && unrelated.exists() && a_dir.exists());
        assert_eq!(std::fs::read(&path).unwrap(), b"snapshot");
    }

    /// [`load`], waiting long enough for any disk that answers.
    fn in_time(path: &Path) -> Result<Option<Cached>, Foreign> {
        match load_with(path, Duration::from_secs(10), None) {
            Start::Read(read) => read,
            Start::Late(_) => panic!("not read within 10 s"),
        }
    }

    /// A FIFO at the cache path would hold the start up until something writes to it: it is
    /// refused (and left alone) before it is opened.
    #[cfg(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    ))]
    #[test]
    fn a_fifo_at_the_cache_path_is_left_alone_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        // Late, had the read opened the FIFO: it would wait for the writer below.
        let read = load_with(&path, Duration::from_secs(10), None);
        // If a reader did wait, a writer lets it go. Without one waiting, a non-blocking open
        // fails at once (`O_NONBLOCK`, its value on these targets) instead of waiting for a reader.
        let _writer = {
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(0o4000)
                .open(&path)
        };
        assert!(matches!(read, Start::Read(Err(Foreign))), "{read:?}");
    }

    /// A directory, or a path that cannot be read, is not known to be ours: left alone.
    #[test]
    fn a_directory_or_a_path_that_cannot_be_read_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(in_time(dir.path()), Err(Foreign)));
        // A path the system refuses (a NUL byte).
        assert!(matches!(in_time(Path::new("agent\0.cache")), Err(Foreign)));
        // A link to itself: reading it fails (as a file of another user's does, for an agent
        // that is not root), and a rename over it would replace the link.
        #[cfg(unix)]
        {
            let path = dir.path().join("agent.cache");
            std::os::unix::fs::symlink(&path, &path).unwrap();
            assert!(matches!(in_time(&path), Err(Foreign)));
            assert!(std::fs::symlink_metadata(&path).unwrap().is_symlink());
        }
    }

    /// A read that does not come back in time is not waited for: the start goes on, and the
    /// read, once it ends, is judged as one in time is.
    #[tokio::test]
    async fn a_read_that_ends_after_the_wait_is_judged_when_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, b"version: 1\nendpoints:\n  a: {}\n").unwrap();
        let (release, slow) = std::sync::mpsc::channel::<()>();
        let stall: BeforeRead = Box::new(move || {
            let _ = slow.recv();
        });
        let Start::Late(late) = load_with(&path, Duration::from_millis(50), Some(stall)) else {
            panic!("read in time");
        };
        drop(release);
        let settled = tokio::time::timeout(Duration::from_secs(10), late.settle()).await;
        assert!(matches!(settled, Ok(Err(Foreign))), "{settled:?}");
    }

    #[test]
    fn a_written_snapshot_loads_back_and_garbage_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  a: {max_attempts: 4}\n")
            .policies
            .unwrap();
        let doc = pb::PolicyDocument::from(set.document().as_ref());
        let snap = pb::Snapshot {
            version: 9,
            content_hash: convert::content_hash(&doc),
            policies: Some(doc),
            nonce: "n".into(),
            metrics_interval_ms: 0,
        };
        write_atomic(&path, &snap.encode_to_vec()).unwrap();
        let loaded = in_time(&path).unwrap().unwrap();
        assert_eq!(loaded.version(), 9);
        let interval = loaded.metrics_interval;
        assert_eq!(loaded.into_snapshot(None).source(), Source::Cache);
        assert_eq!(interval, None, "left to the agent");
        let set_by_server = pb::Snapshot {
            metrics_interval_ms: 250,
            ..snap
        };
        write_atomic(&path, &set_by_server.encode_to_vec()).unwrap();
        let loaded = in_time(&path).unwrap().unwrap();
        assert_eq!(loaded.metrics_interval, Some(Duration::from_millis(250)));
        assert_eq!(
            in_time(&dir.path().join("missing")).map(|c| c.is_none()),
            Ok(true)
        );
        std::fs::write(&path, b"").unwrap();
        assert_eq!(
            in_time(&path).map(|c| c.is_none()),
            Ok(true),
            "an empty file is no one's"
        );
        std::fs::write(&path, [0u8; 4096]).unwrap();
        assert_eq!(
            in_time(&path).map(|c| c.is_none()),
            Ok(true),
            "a file of zero bytes only is no one's"
        );
        std::fs::write(&path, [&[0u8; 4095][..], b"x"].concat()).unwrap();
        assert_eq!(
            in_time(&path).map(|c| c.is_none()),
            Err(Foreign),
            "one other byte makes it a file of someone's"
        );
        // Zeros past the size of any cache (a sparse file, a disk image): someone's, whatever
        // comes after what is read.
        let sparse = std::fs::File::create(&path).unwrap();
        sparse.set_len(MAX_BYTES + 1).unwrap();
        drop(sparse);
        assert_eq!(
            in_time(&path).map(|c| c.is_none()),
            Err(Foreign),
            "a file of zeros larger than any cache is someone's"
        );
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }

    #[test]
    fn a_file_that_is_not_a_snapshot_is_foreign_and_a_stale_snapshot_is_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, b"version: 1\nendpoints:\n  a: {}\n").unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Err(Foreign));
        // A snapshot whose hash does not match its policies is no cache of ours either.
        let doc = pb::PolicyDocument::default();
        let wrong_hash = pb::Snapshot {
            version: 1,
            content_hash: "0".repeat(64),
            policies: Some(doc.clone()),
            ..Default::default()
        };
        std::fs::write(&path, wrong_hash.encode_to_vec()).unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Err(Foreign));
        // Behind the header it is ours, and the log says what may have happened: damage, or a
        // newer agent's policies whose fields this one does not decode.
        let ours = [HEADER, wrong_hash.encode_to_vec().as_slice()].concat();
        match decode(&ours) {
            Err(Unusable::Ours(why)) => assert!(
                why.contains("damaged on disk") && why.contains("newer agent"),
                "{why}"
            ),
            _ => panic!("not refused as ours"),
        }
        // Ours, but its policies no longer validate (here: no attempt at all): ignored,
        // replaceable.
        let mut invalid = doc;
        invalid.endpoints.push(pb::Endpoint {
            name: "a".to_owned(),
            overlay: Some(pb::Overlay {
                max_attempts: Some(0),
                ..Default::default()
            }),
            routes: Vec::new(),
        });
        let stale = pb::Snapshot {
            version: 1,
            content_hash: convert::content_hash(&invalid),
            policies: Some(invalid),
            ..Default::default()
        };
        std::fs::write(&path, stale.encode_to_vec()).unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Ok(true));
        // A cache of another format (another version of the agent wrote it): ours, not used,
        // replaceable; also when larger than any cache of this format.
        std::fs::write(&path, b"retryplane agent policy cache 2\nwhatever follows").unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Ok(true));
        let mut large = b"retryplane agent policy cache 7\n".to_vec();
        large.resize(usize::try_from(MAX_BYTES).unwrap() + 1, b'x');
        std::fs::write(&path, large).unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Ok(true));
    }

    /// A cache of ours whose header was damaged on disk (cut short, a bit flipped) is still
    /// ours: not used, and replaced by the next applied snapshot, rather than left in place as
    /// another's file for every run to come.
    #[test]
    fn a_cache_whose_header_is_damaged_is_still_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let whole = encode(&pb::Snapshot {
            version: 3,
            content_hash: convert::content_hash(&pb::PolicyDocument::default()),
            policies: Some(pb::PolicyDocument::default()),
            ..Default::default()
        });
        for cut in [1, 10, HEADER.len() - 1] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            assert_eq!(
                in_time(&path).map(|c| c.is_none()),
                Ok(true),
                "cut at {cut}"
            );
        }
        for at in 0..HEADER.len() {
            for bit in 0..8 {
                let mut flipped = whole.clone();
                flipped[at] ^= 1 << bit;
                std::fs::write(&path, &flipped).unwrap();
                assert_eq!(
                    in_time(&path).map(|c| c.is_none()),
                    Ok(true),
                    "bit {bit} of byte {at}"
                );
            }
        }
        // Three bytes changed is more than damage: another's file.
        let mut three = whole.clone();
        for at in [0, 11, 20] {
            three[at] ^= 0x20;
        }
        std::fs::write(&path, &three).unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Err(Foreign));
        // Text that only starts like it is another's.
        std::fs::write(&path, b"retryplane agent config\nkeep: me\n").unwrap();
        assert_eq!(in_time(&path).map(|c| c.is_none()), Err(Foreign));
    }

    /// A cache holding more than a policy file can (the agent refuses such a snapshot on the
    /// stream, so it never writes one) is refused as ours, not used: a document of bare
    /// endpoints on its bytes, before the decode (a 4 MiB one decoded to about 880 MB); one whose lists hold too many
    /// entries (not counted on the wire) after it. Without the header, another's file.
    #[test]
    fn a_cache_holding_more_than_a_policy_file_can_is_refused() {
        let refused = |bytes: &[u8]| match decode(bytes) {
            Err(Unusable::Ours(why)) => why,
            Err(Unusable::Foreign(why)) => panic!("foreign: {why}"),
            Ok(_) => panic!("used"),
        };
        let cached = |doc: pb::PolicyDocument| {
            encode(&pb::Snapshot {
                version: 3,
                content_hash: convert::content_hash(&doc),
                policies: Some(doc),
                ..Default::default()
            })
        };
        let bare = |n: usize| pb::PolicyDocument {
            defaults: None,
            endpoints: (0..n)
                .map(|i| pb::Endpoint {
                    name: format!("e{i}"),
                    ..Default::default()
                })
                .collect(),
        };
        let over = convert::MAX_ITEMS / 2 + 1;
        let mut bytes = cached(bare(over));
        let why = refused(&bytes);
        assert!(
            why.contains("too large") && why.contains(&(2 * over).to_string()),
            "{why}"
        );
        // A byte the decode refuses after them: still "too large", so the count came first.
        bytes.push(0x80);
        let why = refused(&bytes);
        assert!(why.contains("too large"), "{why}");
        // At the limit, used.
        assert!(decode(&cached(bare(convert::MAX_ITEMS / 2))).is_ok());
        // One endpoint whose list holds the rest and one more.
        let mut listed = bare(1);
        listed.endpoints[0].overlay = Some(pb::Overlay {
            retry_on: Some(pb::RetryOn {
                http_status: Some(pb::StatusList {
                    codes: vec![503; convert::MAX_ITEMS - 1],
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        let why = refused(&cached(listed));
        assert!(why.contains("too large"), "{why}");
        // Not ours without the header.
        let headless = cached(bare(over));
        assert!(matches!(
            decode(&headless[HEADER.len()..]),
            Err(Unusable::Foreign(_))
        ));
    }

    /// The largest cache read is the largest the agent writes: the header and a snapshot of
    /// the largest message the stream decodes (here a small snapshot and an unknown field,
    /// which the decode skips, to that length); one byte more is too large.
    #[test]
    fn a_cache_of_the_largest_snapshot_the_stream_takes_is_read_and_no_larger() {
        let doc = pb::PolicyDocument {
            defaults: None,
            endpoints: vec![pb::Endpoint {
                name: "a".to_owned(),
                ..Default::default()
            }],
        };
        let snap = pb::Snapshot {
            version: 3,
            content_hash: convert::content_hash(&doc),
            policies: Some(doc),
            ..Default::default()
        };
        let padded = |extra: usize| {
            let mut bytes = encode(&snap);
            // Field 15, length-delimited, a 4-byte length (over 2^21).
            let pad = HEADER.len() + retryplane_proto::MAX_MESSAGE_BYTES - bytes.len() - 5 + extra;
            bytes.push((15 << 3) | 2);
            prost::encoding::encode_varint(pad as u64, &mut bytes);
            bytes.resize(bytes.len() + pad, 0);
            bytes
        };
        let largest = padded(0);
        assert_eq!(
            largest.len(),
            HEADER.len() + retryplane_proto::MAX_MESSAGE_BYTES
        );
        assert!(matches!(check(&largest), Found::Cached(_)));
        match check(&padded(1)) {
            Found::Ours(why) => assert!(why.contains("too large"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_file_too_large_for_a_cache_is_foreign_unless_it_starts_like_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let big = vec![7u8; usize::try_from(MAX_BYTES).unwrap() + 1];
        std::fs::write(&path, &big).unwrap();
        assert_eq!(
            in_time(&path).map(|c| c.is_none()),
            Err(Foreign),
            "left alone"
        );
        let ours = [HEADER, &big].concat();
        std::fs::write(&path, ours).unwrap();
        assert_eq!(
            in_time(&path).map(|c| c.is_none()),
            Ok(true),
            "ours, replaceable"
        );
    }

    #[test]
    fn each_write_has_its_own_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        // Many writers of one process at once: every rename lands a whole file.
        std::thread::scope(|scope| {
            for i in 0..8u8 {
                let path = &path;
                scope.spawn(move || {
                    for _ in 0..50 {
                        write_atomic(path, &[i; 4096]).unwrap();
                    }
                });
            }
        });
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 4096);
        assert!(bytes.iter().all(|b| *b == bytes[0]), "a torn cache file");
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }

    /// A cache path that is a link is replaced by the file: the file the link led to is left
    /// as it was (whoever could swap the link must not choose what is written over).
    #[cfg(unix)]
    #[test]
    fn a_cache_path_that_is_a_link_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let path = dir.path().join("agent.cache");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write_atomic(&path, b"snapshot").unwrap();
        assert!(!std::fs::symlink_metadata(&path).unwrap().is_symlink());
        assert_eq!(std::fs::read(&path).unwrap(), b"snapshot");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    }

    #[cfg(unix)]
    #[test]
    fn a_write_never_follows_a_link_planted_in_the_cache_directory() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let path = dir.path().join("agent.cache");
        // Links at every name a predictable scheme could pick.
        for n in 0..64 {
            let name = format!(".agent.cache.tmp-{}-{n}", std::process::id());
            std::os::unix::fs::symlink(&victim, dir.path().join(name)).unwrap();
        }
        write_atomic(&path, b"snapshot").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(std::fs::read(&path).unwrap(), b"snapshot");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "readable by its owner only: {mode:o}");
    }
}
