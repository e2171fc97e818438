//! The cache file: the last applied snapshot, encoded as a `retryplane.v1.Snapshot` after a
//! one-line header ([`HEADER`]), so a restarted agent starts on its last good policies when the
//! control plane is unreachable.
//!
//! Written atomically after every applied snapshot: a temporary file in the same directory is
//! written and fsynced, then renamed over the cache file, and the directory is fsynced, so a
//! crash leaves either the old file or the new one, never a torn one. The temporary file's name
//! is unique per write (process id and a counter), so two agents of one process never share it.
//!
//! Read at start; a missing (its directory too), empty, unreadable or invalid file is logged
//! and ignored. The read runs on a thread of its own and a start waits at most 1 s for it: a
//! volume that does not answer, or anything at the path that is not a regular file (a FIFO
//! would wait for a writer), is logged, left alone, and no cache is kept for the run. A file that
//! begins with the header is ours whatever follows it (damaged on disk, or written by a newer
//! agent whose snapshot this one cannot check): it is not used, and the next applied snapshot
//! replaces it. A file without the header is ours only if it is a snapshot whose content hash
//! matches its policies (what agents wrote before the header), and a file larger than any cache
//! is ours only if it begins with the header; anything else is most likely
//! another file the agent was pointed at by mistake: it is left as it is and no cache is
//! written for the whole run, rather than being replaced. The metrics interval the control
//! plane set in that snapshot applies again from the start, as it did before the restart: a
//! control plane that finds the agent up to date sends it nothing.

use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prost::Message as _;
use retryplane_proto::{convert, pb};
use tracing::{info, warn};

use crate::snapshot::{PolicySnapshot, Source};

/// Largest cache file read.
const MAX_BYTES: u64 = 16 * 1024 * 1024;

/// How long a start waits for the cache file to be read (see [`within`]). A local disk
/// reads the largest cache in milliseconds.
const READ_WAIT: Duration = Duration::from_secs(1);

/// The first bytes of every cache file the agent writes: they mark the file as the agent's own.
pub(crate) const HEADER: &[u8] = b"retryplane agent policy cache 1\n";

/// The bytes of the cache file for `snap`: [`HEADER`], then the encoded snapshot.
pub(crate) fn encode(snap: &pb::Snapshot) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER.len() + snap.encoded_len());
    bytes.extend_from_slice(HEADER);
    // Writing into a `Vec` cannot run out of room.
    let _ = snap.encode(&mut bytes);
    bytes
}

/// Writes `bytes` to `path` atomically.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "cache".to_owned());
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable; not every platform can open a directory.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// What a valid cache file gives back.
#[derive(Debug)]
pub(crate) struct Cached {
    /// The last applied snapshot.
    pub(crate) snapshot: PolicySnapshot,
    /// The metrics interval the control plane set with it; `None` when it left it to the agent.
    pub(crate) metrics_interval: Option<Duration>,
}

/// A file at the cache path that is not a policy cache: left as it is, and no cache is kept.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Foreign;

/// The snapshot kept in `path`, if it is there and valid; [`Foreign`] when the file there is not
/// a policy cache (see the module docs).
pub(crate) fn load(path: &Path) -> Result<Option<Cached>, Foreign> {
    let bytes = match within(READ_WAIT, {
        let at = path.to_owned();
        move || read(&at)
    }) {
        Ok(Some(Ok(Read::Bytes(b)))) => b,
        Err(e) => {
            // Reading inline could hang the start; not reading, the file was not checked: it
            // is not ours to replace.
            warn!(
                file = %path.display(),
                error = %e,
                "cannot start a thread to read the policy cache; starting without it, and no \
                 cache is kept this run"
            );
            return Err(Foreign);
        }
        Ok(None) => {
            warn!(
                file = %path.display(),
                wait_ms = READ_WAIT.as_millis() as u64,
                "the policy cache could not be read in time (a volume that does not answer?); \
                 starting without it, and no cache is kept this run"
            );
            return Err(Foreign);
        }
        Ok(Some(Ok(Read::NotRegular))) => {
            warn!(
                file = %path.display(),
                "the cache path is not a regular file; it is left as it is and no cache is kept: \
                 give the agent a cache file of its own"
            );
            return Err(Foreign);
        }
        Ok(Some(Ok(Read::Missing))) => {
            // (A directory that is a file or cannot be searched fails the read itself: the
            // warning below says which.)
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            match dir.map(std::fs::metadata) {
                Some(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => warn!(
                    file = %path.display(),
                    "the policy cache's directory does not exist: no cache can be kept there \
                     until it is created"
                ),
                _ => info!(file = %path.display(), "no policy cache yet"),
            }
            return Ok(None);
        }
        Ok(Some(Err(e))) => {
            warn!(file = %path.display(), error = %e, "cannot read the policy cache; ignored");
            return Ok(None);
        }
    };
    // Larger than any cache the agent writes: ours (damaged) only if it starts like one.
    let checked = if bytes.len() as u64 > MAX_BYTES {
        Err(if bytes.starts_with(HEADER) {
            Unusable::Ours("the cache file is too large".to_owned())
        } else {
            Unusable::Foreign("too large for a policy cache".to_owned())
        })
    } else {
        decode(&bytes)
    };
    match checked {
        Ok(cached) => {
            info!(file = %path.display(), version = cached.snapshot.version(), "starting on cached policies");
            Ok(Some(cached))
        }
        Err(Unusable::Ours(reason)) => {
            warn!(file = %path.display(), %reason, "the policy cache is not usable; ignored");
            Ok(None)
        }
        Err(Unusable::Foreign(reason)) if !bytes.is_empty() => {
            warn!(
                file = %path.display(),
                %reason,
                "the cache file is not a policy cache; it is left as it is and no cache is kept: \
                 give the agent a cache file of its own"
            );
            Err(Foreign)
        }
        Err(Unusable::Foreign(_)) => {
            info!(file = %path.display(), "the policy cache is empty; ignored");
            Ok(None)
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

/// `f`'s result if it comes within `wait` (`Ok(None)` if not), run on a detached thread of its
/// own; `Err` if no thread can be started. [`crate::AgentBuilder::connect`] is not async and
/// does not wait for the network, so a volume that stops answering may not hold it up either;
/// the thread is left to finish (or hang) on its own. The wait is the wall clock's, not
/// tokio's: a disk does not run on tokio's clock.
fn within<T: Send + 'static>(
    wait: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<Option<T>> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("retryplane-cache-read".into())
        .spawn(move || {
            let _ = tx.send(f());
        })?;
    Ok(rx.recv_timeout(wait).ok())
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
    // One byte more than the limit tells a file over it (see `load`).
    f.take(MAX_BYTES + 1).read_to_end(&mut bytes)?;
    Ok(Read::Bytes(bytes))
}

fn decode(bytes: &[u8]) -> Result<Cached, Unusable> {
    // With the header, every problem below is one of our own file's; without it, only a
    // snapshot that checks out is ours.
    let (bytes, problem): (&[u8], fn(String) -> Unusable) = match bytes.strip_prefix(HEADER) {
        Some(rest) => (rest, Unusable::Ours),
        None => (bytes, Unusable::Foreign),
    };
    let snap = pb::Snapshot::decode(bytes).map_err(|e| problem(format!("not a snapshot: {e}")))?;
    let doc = snap
        .policies
        .ok_or_else(|| problem("the snapshot holds no policies".to_owned()))?;
    if convert::content_hash(&doc) != snap.content_hash {
        return Err(problem("content hash does not match".to_owned()));
    }
    let (set, _) = convert::validate(doc).map_err(|errors| {
        Unusable::Ours(format!(
            "invalid policies: {}",
            errors.first().map(ToString::to_string).unwrap_or_default()
        ))
    })?;
    let metrics_interval = match snap.metrics_interval_ms {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    };
    Ok(Cached {
        snapshot: PolicySnapshot::build(set, snap.version, snap.content_hash, Source::Cache, None),
        metrics_interval,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let at = path.clone();
        let loaded = within(Duration::from_secs(10), move || {
            load(&at).map(|c| c.is_some())
        });
        // If a reader did wait, a writer lets it go. Without one waiting, a non-blocking open
        // fails at once (`O_NONBLOCK`, its value on these targets) instead of waiting for a reader.
        let _writer = {
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(0o4000)
                .open(&path)
        };
        assert_eq!(loaded.unwrap(), Some(Err(Foreign)));
    }

    /// A directory is not a file to replace; an error reading the path is only that.
    #[test]
    fn a_directory_is_left_alone_and_a_read_error_is_not_taken_for_one() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(load(dir.path()), Err(Foreign)));
        // A path the system refuses (a NUL byte): logged and ignored, the cache kept.
        assert!(matches!(load(Path::new("agent\0.cache")), Ok(None)));
    }

    /// A read that does not come back in time is given up on: the caller goes on.
    #[test]
    fn a_read_that_hangs_is_given_up_on_after_the_wait() {
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let got = within(Duration::from_millis(50), move || hung.recv().is_ok()).unwrap();
        assert_eq!(got, None);
        drop(release);
        // One that answers in time is returned.
        assert_eq!(within(Duration::from_secs(10), || 7).unwrap(), Some(7));
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
        let loaded = load(&path).unwrap().unwrap();
        assert_eq!(
            (loaded.snapshot.version(), loaded.snapshot.source()),
            (9, Source::Cache)
        );
        assert_eq!(loaded.metrics_interval, None, "left to the agent");
        let set_by_server = pb::Snapshot {
            metrics_interval_ms: 250,
            ..snap
        };
        write_atomic(&path, &set_by_server.encode_to_vec()).unwrap();
        let loaded = load(&path).unwrap().unwrap();
        assert_eq!(loaded.metrics_interval, Some(Duration::from_millis(250)));
        assert_eq!(
            load(&dir.path().join("missing")).map(|c| c.is_none()),
            Ok(true)
        );
        std::fs::write(&path, b"").unwrap();
        assert_eq!(
            load(&path).map(|c| c.is_none()),
            Ok(true),
            "an empty file is no one's"
        );
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }

    #[test]
    fn a_file_that_is_not_a_snapshot_is_foreign_and_a_stale_snapshot_is_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, b"version: 1\nendpoints:\n  a: {}\n").unwrap();
        assert_eq!(load(&path).map(|c| c.is_none()), Err(Foreign));
        // A snapshot whose hash does not match its policies is no cache of ours either.
        let doc = pb::PolicyDocument::default();
        let wrong_hash = pb::Snapshot {
            version: 1,
            content_hash: "0".repeat(64),
            policies: Some(doc.clone()),
            ..Default::default()
        };
        std::fs::write(&path, wrong_hash.encode_to_vec()).unwrap();
        assert_eq!(load(&path).map(|c| c.is_none()), Err(Foreign));
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
        assert_eq!(load(&path).map(|c| c.is_none()), Ok(true));
    }

    #[test]
    fn a_file_too_large_for_a_cache_is_foreign_unless_it_starts_like_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let big = vec![7u8; usize::try_from(MAX_BYTES).unwrap() + 1];
        std::fs::write(&path, &big).unwrap();
        assert_eq!(load(&path).map(|c| c.is_none()), Err(Foreign), "left alone");
        let ours = [HEADER, &big].concat();
        std::fs::write(&path, ours).unwrap();
        assert_eq!(
            load(&path).map(|c| c.is_none()),
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
}
