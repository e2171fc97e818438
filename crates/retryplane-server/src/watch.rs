//! File mode hot reload (SPEC §3): a saved edit of the policy file is validated and published.
//!
//! Directories are watched, not the file: editors and `sed -i` save by writing a new file and
//! renaming it over the old one, which replaces the inode a file watch would be attached to.
//! The watched directories are the file's own (the parent of the path as given) and, when the
//! path goes through symbolic links (the file itself, a link it points to, or a directory on
//! the way), the real directory holding each link and the real directory of the file the chain
//! ends at. So a Kubernetes ConfigMap volume (`policies.yaml -> ..data/policies.yaml`, where
//! `..data` is swapped atomically for a new timestamped directory) and a link to a file kept in
//! another directory are both followed. The chain is resolved again before every read, since a
//! swap changes it; at most [`MAX_LINKS`] links are followed, so a link loop ends the walk
//! rather than hanging it.
//!
//! Any event in a watched directory other than a pure read (ours included) starts the
//! debounced read: a reload starts after [`DEBOUNCE`] without further events, so a save that
//! arrives as several writes (or a rename plus a chmod) is read once, complete; but at most
//! [`MAX_QUIET_WAIT`] after the wait began, so that another file written more often than the
//! quiet period (a log in the same directory) cannot hold reloads back for as long as it goes
//! on. Events are not
//! filtered by file name, since a swap renames a link other than the file (`..data_tmp` over
//! `..data`); instead, a read whose bytes equal those last read is skipped quietly (at debug),
//! so unrelated files touched in a watched directory neither publish nor log.
//!
//! A reload reads the file (at most [`MAX_FILE_BYTES`] + 1 bytes; a larger file is refused with
//! its size from the metadata), loads it with the validator `retryplane validate` runs, and
//! hands the document to [`ControlPlane::apply`] as [`Source::File`]. An invalid save is logged, one warning per
//! problem as `FILE:LINE:COLUMN: error: PATH: message`, counted in
//! `retryplane_server_rejected_changes`, and the last good version stays served. Content equal
//! to the current version's publishes nothing; a save whose bytes changed but not its policies
//! (a comment, the layout) logs one info line saying so, so that whoever saved it knows it was
//! read. Every read sets
//! `retryplane_server_config_last_reload_successful` (1 for a valid file applied or equal to the
//! version served, 0 otherwise), and the first good read after one that was not logs one info
//! line saying the file is valid again and which version is served (the first read of a file
//! start-up left to its writer says instead that it was read once its writer closed it).
//!
//! A watch is attached to a directory's inode, so a watched directory deleted and created
//! again, or replaced by a rename, would no longer be watched: every read sets the watches up
//! again on the paths as they are then (a missing directory is covered by watching where it
//! should appear: the nearest directory above it that exists, from start-up on, so a server
//! started with a file whose directory does not exist yet serves its stored version and reads
//! the file once it appears). And some changes raise no event in a watched directory at all: a write
//! through a hard link elsewhere, a file bind-mounted into a container and edited from outside,
//! a network file system, events lost when the kernel's queue overflows. So every [`RESCAN`]
//! the watcher also reads the file without an event (after the same quiet period); equal
//! bytes are skipped quietly, so this costs a read and a few system calls.
//!
//! A save written in place in pieces (truncated, then written; `scp` or a generator writing
//! on a slow link) can look complete to the debounce when the writer pauses longer than the
//! quiet period, and half a file may well be a valid one (the first endpoints only). Where the
//! platform reports a writer closing the file (inotify on Linux), a file written to and not yet
//! closed is not read: the read waits for the writer to close it, at most
//! [`Timing::unclosed`] ([`UNCLOSED`]) after the quiet period, and then reads what is there,
//! with a warning (a writer that keeps the file open for good delays a reload by that much, no
//! more), and applies it unless it removes an endpoint served, as the first part of a longer
//! file would ([`ChangeRequest::keep_endpoints`]): such a read is held back, with a warning
//! (not counted as a rejected change or a failed reload), and the wait for the writer starts
//! again; when it closes the file, what is there is a whole save. The same bytes found at the
//! next bound are applied: a writer that changed nothing for that long is not in the middle of
//! a save (so a writer that keeps the file open for good delays a save that removes endpoints
//! by two bounds, no more). Only removals are guarded: a first part cut between two fields of
//! its last endpoint is published at the bound as a change of that endpoint. A file created
//! is taken as open for writing until its writer closes it, as one
//! written to is (a writer may hold it open before its first write), while it is still empty:
//! one created with content (a hard link, an `O_TMPFILE` linked in) has no writer here. A
//! file moved in from a directory not watched clears its name's mark. What a writer did in a
//! directory before the watcher watched it (one made that same moment), or through a path no
//! watch hears (a hard link elsewhere), is not known from events: so before a read that would
//! change what is served, the system is asked whether a process holds the file open for
//! writing (`crate::writers`; on Linux, the processes this one can see), and the read waits
//! for it the same way, asking again every second (its close may raise no event here).
//! A writer the system does not show is judged by the file's times alone. notify delivers the
//! writer's events on its own thread, so a save that begins just as the quiet period ends may
//! not be known yet when the file is read: after the read the file is looked at again, and a
//! read of a file now open for writing, whose size or times moved during the read (a
//! truncation caught mid-read leaves a cut-off copy of the old file), or modified less than
//! the quiet period before, is not applied: it is read again once the file has been quiet
//! that long. An empty read is looked at once more after a quiet period before it is refused.
//!
//! notify calls back on its own thread; the callback notes which files are written to and not
//! yet closed, and forwards a wake-up into a one-slot tokio channel with `try_send` (a full
//! slot already means "look again").

use retryplane_policy::diag::LogPath;
use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, Read as _};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use retryplane_policy::Loaded;
use retryplane_policy::duration::format_duration;
use retryplane_policy::yaml::MAX_FILE_BYTES;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::ErrorChain;
use crate::control::{ChangeContent, ChangeError, ChangeRequest, ControlPlane};
use crate::store::{Source, StoreError};
use crate::writers;

/// Quiet time after the last event before the file is read.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// How often the watches are set up again and the file read, events or not (see the module
/// docs): the longest a change the events missed takes to be seen.
pub const RESCAN: Duration = Duration::from_secs(10);

/// The longest a read waits, after the quiet period, for a writer that still has the policy
/// file open to close it, or for a file that keeps changing to go quiet (see the module docs);
/// then it reads what is there, with a warning.
pub const UNCLOSED: Duration = Duration::from_secs(30);

/// How often a read waiting for a writer that only the system knows of ([`crate::writers`])
/// asks again: each look goes through every open file of the host.
const HELD_POLL: Duration = Duration::from_secs(1);

/// The longest events keep a read waiting for a quiet period: other files written in a watched
/// directory more often than [`DEBOUNCE`] (a log, another program's data) would otherwise hold
/// every reload, the rescan's included, for as long as they go on. Short of a second, so that
/// a save is published within one even then (the wait, the read and the apply).
pub const MAX_QUIET_WAIT: Duration = Duration::from_millis(700);

/// The watcher's timings.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Quiet time after the last event before the file is read ([`DEBOUNCE`]).
    pub debounce: Duration,
    /// How often the watches are renewed and the file read without an event ([`RESCAN`]).
    pub rescan: Duration,
    /// The longest a read waits for a writer to close the file it wrote to, or for the file to
    /// stop changing ([`UNCLOSED`]).
    pub unclosed: Duration,
    /// The longest events keep a read waiting for a quiet period ([`MAX_QUIET_WAIT`]).
    pub max_quiet_wait: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            debounce: DEBOUNCE,
            rescan: RESCAN,
            unclosed: UNCLOSED,
            max_quiet_wait: MAX_QUIET_WAIT,
        }
    }
}

/// Whether the platform's watch reports a writer closing a file, so that a file written to and
/// not closed yet can be told (inotify does; FSEvents, kqueue and polling do not, and there
/// every file written to would look open for good).
const CLOSES_REPORTED: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// At most this many files of the watched directories are remembered as open for writing; past
/// it they are all forgotten (a directory full of files held open, logs say: the policy file
/// is then read after the quiet period, as on a platform that does not report closes).
const MAX_OPEN_WRITES: usize = 1024;

/// The files of the watched directories written to and not closed since, by the path their
/// events carry (a watched directory's real path and the file's name), each with how it is
/// known to be open. Filled by notify's thread, read before every read of the policy file.
#[derive(Clone, Debug, Default)]
struct OpenWrites(Arc<Mutex<HashMap<PathBuf, Mark>>>);

/// How a file is known to be open for writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    /// Written to (a modify event named it) and not closed since.
    Written,
    /// Created, and not yet written to under this name. A writer that holds a file open
    /// before its first write leaves it empty; a file created with content (a hard link, a
    /// file made elsewhere and linked in) has no writer here, so this counts only while the
    /// file is empty.
    Created,
}

impl OpenWrites {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Mark>> {
        // Plain data: a panic while holding the lock leaves nothing half-done worth refusing.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes what `event` says about files open for writing.
    fn note(&self, event: &Event) {
        if !CLOSES_REPORTED {
            return;
        }
        // Only a regular file can be being written: not a symbolic link or a FIFO, which no
        // writer closes. Looked at here, before the lock.
        let created: Vec<&PathBuf> = match event.kind {
            EventKind::Create(CreateKind::File) => {
                event.paths.iter().filter(|p| is_regular(p)).collect()
            }
            _ => Vec::new(),
        };
        let mut open = self.lock();
        match event.kind {
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) => {
                if open.len() + event.paths.len() > MAX_OPEN_WRITES {
                    open.clear();
                }
                for path in &event.paths {
                    open.insert(path.clone(), Mark::Written);
                }
            }
            EventKind::Create(CreateKind::File) => {
                if open.len() + created.len() > MAX_OPEN_WRITES {
                    open.clear();
                }
                for path in created {
                    open.insert(path.clone(), Mark::Created);
                }
            }
            EventKind::Access(AccessKind::Close(AccessMode::Write)) | EventKind::Remove(_) => {
                for path in &event.paths {
                    open.remove(path);
                }
            }
            // A file renamed while still open keeps its writer under its new name; one renamed
            // closed replaces whatever was at the new name, writer and all.
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
                if let [from, to] = event.paths.as_slice() {
                    match open.remove(from) {
                        Some(mark) => {
                            open.insert(to.clone(), mark);
                        }
                        None => {
                            open.remove(to);
                        }
                    }
                }
            }
            // Moved in from a directory not watched: another file is at that name now. (A
            // move within the watched directories comes as `To`, then `Both`, which carries a
            // writer across.)
            EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
                for path in &event.paths {
                    open.remove(path);
                }
            }
            _ => {}
        }
    }

    /// Whether `path` (a real path) is written to and not closed since: written to, or
    /// created and still empty (see [`Mark::Created`]).
    fn is_open(&self, path: &Path) -> bool {
        // Copied out, so the file is looked at without holding the lock notify's thread takes.
        let mark = self.lock().get(path).copied();
        match mark {
            Some(Mark::Written) => true,
            Some(Mark::Created) => std::fs::metadata(path).is_ok_and(|m| m.len() == 0),
            None => false,
        }
    }

    /// Stops waiting for `path`'s writer to close it; whether it was marked.
    fn forget(&self, path: &Path) -> bool {
        self.lock().remove(path).is_some()
    }

    /// Waits again for `path`'s writer to close it (see [`LastRead::HeldBack`]).
    fn mark_written(&self, path: &Path) {
        let mut open = self.lock();
        if open.len() < MAX_OPEN_WRITES {
            open.insert(path.to_owned(), Mark::Written);
        }
    }

    /// Forgets every file of `dir`: its watch is dropped, so no close will be told.
    fn forget_dir(&self, dir: &Path) {
        self.lock().retain(|path, _| path.parent() != Some(dir));
    }
}

/// Whether `path` is a regular file itself (not a symbolic link to one, not a FIFO).
fn is_regular(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// At most this many symbolic links are followed when resolving the policy file's path; the
/// watch covers at most this many directories plus two.
pub const MAX_LINKS: usize = 8;

/// Why the file cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The path names no file.
    #[error("the policy file path {} has no file name", .0.display())]
    NoFileName(PathBuf),
    /// The file's directory is missing, and no directory above it can be watched either.
    #[error(
        "the directory {} of the policy file does not exist and no directory above it can be \
         watched",
        .0.display()
    )]
    Unwatchable(PathBuf),
    /// The directory cannot be watched.
    #[error("cannot watch the directory {} for changes to the policy file", dir.display())]
    Watch {
        /// The watched directory.
        dir: PathBuf,
        /// What notify said.
        #[source]
        source: notify::Error,
    },
}

/// What one read of the policy file found.
struct FileRead {
    /// At most [`MAX_FILE_BYTES`] + 1 bytes: one more than allowed tells an oversized file.
    bytes: Vec<u8>,
    /// The file's size from its metadata, when it is a regular file (a FIFO or a device says 0).
    size: Option<u64>,
    /// When the file was last modified, as it stood once read (`None` where not known).
    modified: Option<SystemTime>,
    /// Whether the file stood still while it was read: the same size, modification and change
    /// times before and after, and as many bytes read as its size says. A save that truncates
    /// the file during the read (the kernel sets the size before the times, and tells inotify
    /// after both) can leave a cut-off copy of the old file that is otherwise unremarkable.
    stable: bool,
}

impl FileRead {
    /// How long until the file has gone `quiet` without a change, when it was modified less
    /// than that before now (or has a modification time just ahead of this clock): its writer
    /// may have started a save the events have not told of yet, so what was read may be half
    /// of it. `None` when it has been quiet that long (or its time is not known, or far ahead).
    fn settles_in(&self, quiet: Duration) -> Option<Duration> {
        let at = self.modified?;
        match SystemTime::now().duration_since(at) {
            Ok(age) => quiet.checked_sub(age).filter(|left| !left.is_zero()),
            Err(ahead) => (ahead.duration() < quiet).then_some(quiet),
        }
    }
}

/// What tells a file apart from itself a moment later: its size, modification and change times.
fn stamp(m: &std::fs::Metadata) -> (u64, Option<SystemTime>, i64, i64) {
    #[cfg(unix)]
    let changed = {
        use std::os::unix::fs::MetadataExt as _;
        (m.ctime(), m.ctime_nsec())
    };
    #[cfg(not(unix))]
    let changed = (0, 0);
    (m.len(), m.modified().ok(), changed.0, changed.1)
}

impl FileRead {
    /// Loads the bytes with the validator; an oversized file is refused with its real size
    /// (or "more than" the limit, when it is not known), not the number of bytes read.
    fn load(&self) -> Loaded {
        if self.bytes.len() <= MAX_FILE_BYTES {
            return retryplane_policy::load(&self.bytes);
        }
        let limit = u64::try_from(MAX_FILE_BYTES).unwrap_or(u64::MAX);
        retryplane_policy::too_large(self.size.filter(|&size| size > limit))
    }
}

/// Reads at most [`MAX_FILE_BYTES`] + 1 bytes of `path` (one byte more than allowed, so an
/// oversized file is told apart) and its size. Blocking.
fn read_bytes(path: &Path) -> io::Result<FileRead> {
    // The watcher (and start-up, and the shutdown that waits for it) would hang on a FIFO.
    crate::refuse_fifo_or_socket(
        path,
        "the policy file",
        "save the policies in a regular file",
    )?;
    let file = std::fs::File::open(path)?;
    let before = file.metadata().ok().filter(std::fs::Metadata::is_file);
    let size = before.as_ref().map(std::fs::Metadata::len);
    let mut bytes = Vec::new();
    let limit = u64::try_from(MAX_FILE_BYTES).map_or(u64::MAX, |m| m + 1);
    (&file).take(limit).read_to_end(&mut bytes)?;
    let after = file.metadata().ok();
    let modified = after.as_ref().and_then(|m| m.modified().ok());
    // Only a regular file has a size to hold the bytes read against (a FIFO says 0).
    let stable = match (&before, &after) {
        (Some(before), Some(after)) => {
            let read_all = u64::try_from(bytes.len()).is_ok_and(|n| n == after.len())
                || bytes.len() > MAX_FILE_BYTES;
            stamp(before) == stamp(after) && read_all
        }
        _ => true,
    };
    Ok(FileRead {
        bytes,
        size,
        modified,
        stable,
    })
}

/// Runs `f` off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(io::Error::other)
}

/// Reads and loads a policy file, off the async threads. `Err` only when it cannot be read.
pub async fn read_policy_file(path: &Path) -> io::Result<(Vec<u8>, Loaded)> {
    let path = path.to_owned();
    blocking(move || {
        read_bytes(&path).map(|read| {
            let loaded = read.load();
            (read.bytes, loaded)
        })
    })
    .await?
}

/// Logs every diagnostic of `file` at warn, as `FILE:LINE:COLUMN: SEVERITY: PATH: MESSAGE`.
pub fn log_diagnostics(file: &Path, loaded: &Loaded) {
    for diag in &loaded.diagnostics {
        warn!("{}:{diag}", file.display());
    }
}

/// Why a file that cannot be read is not applied, on one line, for `FleetStatus` (at start
/// and while running alike).
pub fn cannot_read(e: &io::Error) -> String {
    format!("cannot read it: {e}")
}

/// Why a file the store did not take is not applied, on one line, for `FleetStatus`.
pub fn cannot_store(e: &StoreError) -> String {
    format!("cannot store it: {}", ErrorChain(e))
}

/// Why a file that removes every endpoint (`names`, a capped list) is not applied, on one
/// line, for `FleetStatus`: the advice before the names, which a cut to 1,024 bytes may
/// shorten.
pub fn removes_everything(names: &str) -> String {
    format!("it removes every endpoint: add the new ones first, then remove the old ones ({names})")
}

/// Where a watcher started before start-up's own read of the policy file learns what start-up
/// did with it ([`FileAtStart`]).
#[derive(Debug)]
pub struct StartRead(oneshot::Sender<FileAtStart>, mpsc::Sender<()>);

/// Asks a running watcher to read the policy file now, as a change in its directory would
/// (`serve`'s SIGHUP): the read waits for the file to be quiet, and bytes read before change
/// nothing.
#[derive(Clone, Debug)]
pub struct ReadAgain(mpsc::Sender<()>);

impl ReadAgain {
    /// Asks for a read; one already asked for and not yet begun stands for this one too.
    pub fn now(&self) {
        // Full: a read is already asked for. Closed: the watcher has stopped.
        let _ = self.0.try_send(());
    }
}

/// What start-up did with the policy file, for the watcher. (Start-up that neither settled the
/// file nor left it to its writer, such as a read that failed, tells nothing: it drops the
/// [`StartRead`], and the watcher reads the file afresh.)
#[derive(Debug)]
pub enum FileAtStart {
    /// Start-up read these bytes and settled them (applied, equal to the stored version, or
    /// refused with its problems logged): the watcher treats them as read, so the first event
    /// in a watched directory neither applies nor logs them again.
    Settled(Vec<u8>),
    /// Start-up did not read the file, as another process held it open for writing (and
    /// logged so): the watcher's first read once the writer closes it says that it read it,
    /// rather than that the file is valid again (nothing invalid was read).
    LeftToItsWriter,
}

impl StartRead {
    /// A handle that asks the watcher to read the file again, for as long as it runs.
    pub fn read_again(&self) -> ReadAgain {
        ReadAgain(self.1.clone())
    }

    /// Tells the watcher what start-up did with the file.
    pub fn tell(self, at_start: FileAtStart) {
        // The watcher may have stopped already: nothing to tell then.
        let _ = self.0.send(at_start);
    }
}

/// Starts watching `file`; the task reloads it on every (debounced) save until `shutdown`
/// becomes true or its sender is dropped. Call inside a tokio runtime.
///
/// The watches are in place when this returns. Only the file's own directory must be
/// watchable; a directory further along a symbolic link chain that cannot be watched is
/// logged and left out. When the file's directory does not exist (yet), the nearest directory
/// above it that does is watched instead, so the file is read once it appears there; only when
/// no directory on the way can be watched is that an error.
///
/// The watcher is started before the server's own first read of the file (so a save during
/// start-up is not missed): hand that read to the returned [`StartRead`]. Dropping it instead
/// is fine: the watcher then reads the file afresh on its first event.
pub fn spawn_before_start(
    control: Arc<ControlPlane>,
    file: PathBuf,
    timing: Timing,
    shutdown: watch::Receiver<bool>,
) -> Result<(JoinHandle<()>, StartRead), WatchError> {
    if file.file_name().is_none() {
        return Err(WatchError::NoFileName(file));
    }
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    // Watched by its real path: two paths to one directory would share one inotify watch,
    // and unwatching one would end the other. A missing directory has none yet: its absolute
    // path stands in until it exists (see `Watches::update`).
    let own_dir = std::fs::canonicalize(&dir)
        .or_else(|_| std::path::absolute(&dir))
        .unwrap_or(dir);
    let own_dir_exists = own_dir.is_dir();
    let (tx, rx) = mpsc::channel(1);
    let again = tx.clone();
    let open_writes = OpenWrites::default();
    let noted = open_writes.clone();
    let watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
        match event {
            Ok(event) if !is_read(&event) => {
                // Before the wake-up, so the read it starts sees the close.
                noted.note(&event);
                // Full: a wake-up is already pending. Closed: the task is gone.
                let _ = tx.try_send(());
            }
            Ok(_) => {}
            Err(e) => debug!(error = %e, "file watch error"),
        }
    })
    .map_err(|source| WatchError::Watch {
        dir: own_dir.clone(),
        source,
    })?;
    let mut watches = Watches {
        watcher,
        file: file.clone(),
        own_dir,
        wanted: Vec::new(),
        active: Vec::new(),
        open_writes,
    };
    if own_dir_exists {
        watches.watch_own_dir()?;
    } else {
        warn!(
            file = %LogPath(&file),
            dir = %LogPath(&watches.own_dir),
            "the policy file's directory does not exist; watching for it to appear"
        );
        // Said once, here: `update` only notes it at debug from now on.
        watches.wanted.push(watches.own_dir.clone());
    }
    watches.update();
    if watches.active.is_empty() {
        return Err(WatchError::Unwatchable(watches.own_dir));
    }
    info!(
        file = %LogPath(&file),
        directories = ?watches.directories(),
        "watching the policy file for changes"
    );
    let (start_tx, start_rx) = oneshot::channel();
    let task = tokio::spawn(run(
        control,
        file,
        timing,
        rx,
        shutdown,
        watches,
        Some(start_rx),
    ));
    Ok((task, StartRead(start_tx, again)))
}

/// Whether `event` is a pure read (ours included), which changes nothing.
fn is_read(event: &Event) -> bool {
    matches!(
        event.kind,
        EventKind::Access(
            AccessKind::Open(_) | AccessKind::Read | AccessKind::Close(AccessMode::Read)
        )
    )
}

/// The directories watched for the policy file.
struct Watches {
    // Watching stops when the watcher is dropped.
    watcher: RecommendedWatcher,
    file: PathBuf,
    /// The real path of the file's own directory; always watched.
    own_dir: PathBuf,
    /// The directories the last resolution of the path asked for.
    wanted: Vec<PathBuf>,
    /// The directories watched now, each with the identity of the directory its watch was
    /// attached to.
    active: Vec<(PathBuf, Option<DirId>)>,
    /// The files of the watched directories open for writing, as the watcher's events tell.
    open_writes: OpenWrites,
}

impl Watches {
    /// The directories watched now.
    fn directories(&self) -> Vec<&Path> {
        self.active.iter().map(|(d, _)| d.as_path()).collect()
    }

    fn watch_own_dir(&mut self) -> Result<(), WatchError> {
        self.watcher
            .watch(&self.own_dir, RecursiveMode::NonRecursive)
            .map_err(|source| WatchError::Watch {
                dir: self.own_dir.clone(),
                source,
            })?;
        self.active
            .push((self.own_dir.clone(), dir_id(&self.own_dir)));
        Ok(())
    }

    /// Resolves the path again and sets up the watches of the directories it now goes
    /// through, those already watched included: a watch is attached to the directory now at
    /// its path, so a directory deleted and created again, or replaced by a rename, is watched
    /// again (one replaced is unwatched first; one still the same keeps its watch, with no
    /// gap). Blocking.
    fn update(&mut self) {
        // A directory missing at start has its real path once it exists.
        if let Ok(real) = std::fs::canonicalize(&self.own_dir) {
            self.own_dir = real;
        }
        let mut wanted = vec![self.own_dir.clone()];
        for dir in link_dirs(&self.file) {
            if !wanted.contains(&dir) {
                wanted.push(dir);
            }
        }
        // A directory still wanted, and still the directory its watch was attached to, is not
        // unwatched first: dropped and added again, its watch would miss the events in between
        // (a writer's first write, which tells that a save has begun). Watched again, inotify
        // adds to its watch (and a directory deleted and made again with the same inode number
        // gets a new one). Any other is unwatched: a directory renamed away keeps its watch,
        // whose events notify would go on giving under the old path.
        let mut kept = Vec::new();
        for (dir, id) in self.active.drain(..) {
            if id.is_some() && wanted.contains(&dir) && dir_id(&dir) == id {
                kept.push((dir, id));
                continue;
            }
            // Its files' writers can no longer be told closing.
            self.open_writes.forget_dir(&dir);
            // A directory deleted (the old one after a ConfigMap swap, say) took its watch with
            // it, and notify drops the watch on the deletion event: unwatching it fails, which
            // is no news. One renamed away keeps its watch, which notify goes on mapping to
            // the old path until it is unwatched, even when nothing is at that path now.
            let gone = matches!(dir.try_exists(), Ok(false));
            if let Err(e) = self.watcher.unwatch(&dir)
                && !gone
            {
                debug!(dir = %LogPath(&dir), error = %e, "unwatching a directory");
            }
        }
        self.active = kept;
        for dir in &wanted {
            let kept = self.active.iter().any(|(d, _)| d == dir);
            // Taken before the watch is added: a directory replaced in between differs at the
            // next read, and is watched again then.
            let id = dir_id(dir);
            match self.watcher.watch(dir, RecursiveMode::NonRecursive) {
                Ok(()) if kept => {}
                Ok(()) => self.active.push((dir.clone(), id)),
                Err(e) if kept => {
                    debug!(dir = %LogPath(dir), error = %e, "watching a directory again");
                }
                // Already wanted at the last read: missing for now (deleted, not yet created
                // again, say), and said once. Tried again at every read.
                Err(e) if self.wanted.contains(dir) => debug!(
                    dir = %LogPath(dir),
                    error = %e,
                    "cannot watch a directory of the policy file's path for now"
                ),
                Err(e) => warn!(
                    file = %LogPath(&self.file),
                    dir = %LogPath(dir),
                    error = %e,
                    "cannot watch a directory of the policy file's path; changes made there are \
                     not seen until it can be (tried again at every read)"
                ),
            }
        }
        debug!(file = %LogPath(&self.file), directories = ?self.directories(), "policy file watch");
        self.wanted = wanted;
    }
}

/// What tells one directory from another at the same path: its device and inode.
type DirId = (u64, u64);

/// The identity of the directory at `dir` now (following links); `None` when it cannot be
/// read, or on a platform without inodes, where every read watches it again from scratch.
fn dir_id(dir: &Path) -> Option<DirId> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

/// A part of a path still to resolve.
enum Part {
    Root(OsString),
    Up,
    Name(OsString),
}

fn parts(path: &Path) -> impl DoubleEndedIterator<Item = Part> + '_ {
    path.components().filter_map(|c| match c {
        Component::Prefix(_) | Component::RootDir => Some(Part::Root(c.as_os_str().to_owned())),
        Component::CurDir => None,
        Component::ParentDir => Some(Part::Up),
        Component::Normal(name) => Some(Part::Name(name.to_owned())),
    })
}

/// The real directories a change to `file` can happen in, beyond its own: the directory
/// holding each symbolic link met while resolving the path component by component (where
/// swapping the link is a rename), and the real directory of the file the chain ends at (or
/// where it should be, when it is missing). Follows at most [`MAX_LINKS`] links; a loop, or
/// a part that cannot be read, ends the walk with what was found. Blocking.
fn link_dirs(file: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let Ok(absolute) = std::path::absolute(file) else {
        return dirs;
    };
    // A stack: the next part is last.
    let mut pending: Vec<Part> = parts(&absolute).rev().collect();
    let mut resolved = PathBuf::new();
    let mut links = 0;
    while let Some(part) = pending.pop() {
        match part {
            Part::Root(root) => resolved.push(root),
            Part::Up => {
                resolved.pop();
            }
            Part::Name(name) => {
                let next = resolved.join(&name);
                let is_link = std::fs::symlink_metadata(&next)
                    .map(|m| m.file_type().is_symlink())
                    .ok();
                match is_link {
                    Some(true) => {
                        links += 1;
                        if links > MAX_LINKS {
                            return dirs;
                        }
                        if !dirs.contains(&resolved) {
                            dirs.push(resolved.clone());
                        }
                        let Ok(target) = std::fs::read_link(&next) else {
                            return dirs;
                        };
                        // An absolute target starts again from its root.
                        pending.extend(parts(&target).rev());
                    }
                    Some(false) => resolved = next,
                    None => {
                        // Missing (or unreadable): watch where it should appear.
                        resolved = next;
                        break;
                    }
                }
            }
        }
    }
    if let Some(dir) = resolved.parent()
        && !dirs.iter().any(|d| d == dir)
    {
        dirs.push(dir.to_owned());
    }
    dirs
}

/// Why a read of the policy file is not taken yet.
#[derive(Clone, Copy, Debug)]
enum Writing {
    /// A writer holds the file open, as the watch's events tell.
    Open,
    /// A process holds the file open for writing, as the system tells
    /// ([`crate::writers`]); asked again after this long.
    Held(Duration),
    /// The file changed under the read, or less than the quiet period before it; it has been
    /// quiet that long after this.
    Changing(Duration),
}

/// What the watcher last read from the file.
enum LastRead {
    Nothing,
    /// Nothing yet: start-up found the file held open for writing and left it to its writer.
    LeftToItsWriter,
    /// These bytes, settled: applied, equal to the current version's, or refused for good.
    Bytes(Vec<u8>),
    /// These bytes, valid, but the store did not take them (a full disk, say), at this
    /// instant: read again, they are tried again at most once every [`UNSTORED_RETRY`] and not
    /// logged again at warn. Every event in the file's directories reads it (a log written
    /// there makes one event per line), and each try would log a warning: a loop.
    Unstored(Vec<u8>, Instant),
    /// Reading failed like this (already logged).
    Failed(io::ErrorKind),
    /// These bytes, read at the bound while their writer was not done, were held back for
    /// removing endpoints: the same bytes read at the next bound are applied (a writer that
    /// has not changed the file in that long is not in the middle of a save).
    HeldBack(Vec<u8>),
}

async fn run(
    control: Arc<ControlPlane>,
    file: PathBuf,
    timing: Timing,
    mut events: mpsc::Receiver<()>,
    mut shutdown: watch::Receiver<bool>,
    mut watches: Watches,
    mut start: Option<oneshot::Receiver<FileAtStart>>,
) {
    let debounce = timing.debounce;
    let open_writes = watches.open_writes.clone();
    let mut rescan = tokio::time::interval_at(Instant::now() + timing.rescan, timing.rescan);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = LastRead::Nothing;
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            event = events.recv() => if event.is_none() { return },
            // No event: read anyway, for a change no watch saw.
            _ = rescan.tick() => {}
        }
        // When the wait for quiet began: it ends at most `max_quiet_wait` later, however many
        // events keep coming (from other files of the directory, maybe). Begun again after
        // each wake while a writer holds the file, so those wakes stay a quiet period apart.
        let mut waiting_since = Instant::now();
        // When the file was first found still being written (held open for writing, or
        // changed within the quiet period).
        let mut writing_since: Option<Instant> = None;
        // Whether an empty read was already given another quiet period.
        let mut empty_looked_again = false;
        // Whether the read was taken at the bound, its writer not done (see the module docs),
        // and the file's path as the writer's mark named it.
        let mut at_bound = false;
        let mut bound_real: Option<PathBuf> = None;
        let read = loop {
            // Debounce: wait for a quiet period.
            loop {
                let left = timing
                    .max_quiet_wait
                    .saturating_sub(waiting_since.elapsed());
                if left.is_zero() {
                    break;
                }
                tokio::select! {
                    _ = shutdown.wait_for(|stop| *stop) => return,
                    event = tokio::time::timeout(debounce.min(left), events.recv()) => match event {
                        Ok(Some(())) => {}
                        Ok(None) => return,
                        Err(_quiet) => break,
                    },
                }
            }
            // Follow the link chain as it is now before reading, so a change made after the
            // read, in a directory the chain newly goes through, is seen.
            let real;
            (watches, real) = match blocking(move || {
                // Set up again on every read: a directory replaced since the last one (deleted
                // and created again, or renamed over) is watched from now on.
                watches.update();
                let real = std::fs::canonicalize(&watches.file).ok();
                (watches, real)
            })
            .await
            {
                Ok(done) => done,
                Err(e) => {
                    warn!(file = %LogPath(&file), error = %e, "the policy file watch stopped");
                    return;
                }
            };
            let open = || real.as_ref().is_some_and(|real| open_writes.is_open(real));
            // A writer still has the file open: what is there may be half of its save.
            let read = if open() {
                None
            } else {
                Some(read_file(&file).await)
            };
            // A writer the events did not tell of (one that opened the file before the watch
            // began, or wrote through a path no watch hears): asked of the system, for a read
            // that would change what is served and that no known writer holds back already (a
            // rescan of the same bytes costs no scan).
            let held = match (&read, &real) {
                (Some(Ok(r)), Some(real))
                    if !open() && !matches!(&last, LastRead::Bytes(b) if *b == r.bytes) =>
                {
                    writers::held_open_for_writing_off_thread(real).await
                }
                _ => false,
            };
            // Looked at again after the read: a save that began just before or during it is
            // told by the writer's events (notify delivers them on its own thread, maybe after
            // the read), by the file's times and size moving during the read, or by its
            // modification time. An empty file is most often a save caught between its
            // truncation and its first write: looked at once more after a quiet period before
            // it is refused.
            let why = match &read {
                None => Some(Writing::Open),
                Some(_) if open() => Some(Writing::Open),
                Some(Ok(_)) if held => Some(Writing::Held(HELD_POLL)),
                Some(Ok(r)) => r
                    .settles_in(debounce)
                    .or_else(|| (!r.stable).then_some(debounce))
                    .or_else(|| (r.bytes.is_empty() && !empty_looked_again).then_some(debounce))
                    .map(Writing::Changing),
                Some(Err(_)) => None,
            };
            if read
                .as_ref()
                .is_some_and(|r| r.as_ref().is_ok_and(|r| r.bytes.is_empty()))
            {
                empty_looked_again = true;
            }
            // No `why` means the file was read (a file not read is open).
            let Some(why) = why else {
                break match read {
                    Some(read) => read,
                    None => read_file(&file).await,
                };
            };
            if writing_since.is_none() && matches!(why, Writing::Held(_)) {
                // Known from the system, not from events: said once, since a process that
                // holds the file read-write without writing delays the read to the bound.
                info!(file = %LogPath(&file), "the policy file is open for writing by another process; reading it once that process closes it, or in {} at most", format_duration(timing.unclosed));
            }
            let since = *writing_since.get_or_insert_with(Instant::now);
            let left = timing.unclosed.saturating_sub(since.elapsed());
            if left.is_zero() {
                let what = match why {
                    Writing::Open | Writing::Held(_) => "has been held open for writing",
                    Writing::Changing(_) => "has kept changing",
                };
                warn!(file = %LogPath(&file), "the policy file {what} for {}; reading it as it is now, which may be half of a save: it is applied unless it removes an endpoint", format_duration(timing.unclosed));
                at_bound = true;
                if let Some(real) = &real {
                    // Forgotten before the read, so that a write made during it marks the
                    // file again.
                    if open_writes.forget(real) {
                        bound_real = Some(real.clone());
                    }
                }
                break match read {
                    Some(read) => read,
                    None => read_file(&file).await,
                };
            }
            debug!(file = %LogPath(&file), why = ?why, "the policy file is being written; waiting for the writer to finish");
            match why {
                // The close (or any other event) starts the next look.
                Writing::Open => {
                    tokio::select! {
                        _ = shutdown.wait_for(|stop| *stop) => return,
                        event = tokio::time::timeout(left, events.recv()) => {
                            if matches!(event, Ok(None)) {
                                return;
                            }
                        }
                    }
                    waiting_since = Instant::now();
                }
                // Until the file has been quiet for the quiet period, whatever other files do;
                // a writer known only to the system is asked after again every `HELD_POLL`, not
                // at every event (its close may raise none here, and each look goes through
                // every open file of the host).
                Writing::Changing(quiet) | Writing::Held(quiet) => tokio::select! {
                    _ = shutdown.wait_for(|stop| *stop) => return,
                    () = tokio::time::sleep(quiet.min(left)) => {}
                },
            }
        };
        // What start-up read counts as read: an event that changed nothing in the file (or a
        // rescan) does not apply or log it a second time.
        if let Some(start_read) = &mut start {
            match start_read.try_recv() {
                Ok(at_start) => {
                    if matches!(last, LastRead::Nothing) {
                        last = match at_start {
                            FileAtStart::Settled(bytes) => LastRead::Bytes(bytes),
                            FileAtStart::LeftToItsWriter => LastRead::LeftToItsWriter,
                        };
                    }
                    start = None;
                }
                Err(oneshot::error::TryRecvError::Closed) => start = None,
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
        }
        reload_if_changed(&control, &file, read, &mut last, at_bound).await;
        // Held back: the next look waits for the writer's close again, as before the bound
        // (the mark was forgotten for the read). A writer that closed meanwhile costs one more
        // bound at most: the same bytes are applied then.
        if matches!(last, LastRead::HeldBack(_))
            && let Some(real) = &bound_real
        {
            open_writes.mark_written(real);
        }
    }
}

/// Reads `file` off the async threads.
async fn read_file(file: &Path) -> io::Result<FileRead> {
    let path = file.to_owned();
    blocking(move || read_bytes(&path)).await.and_then(|r| r)
}

/// Applies what was `read` from `file` unless its bytes are those last read: an event on
/// another file in a watched directory publishes and logs nothing. A read `at_bound` (taken
/// while its writer was not done: maybe half of a save) is applied only if it keeps every
/// endpoint served, or holds the bytes held back at the bound before; one held back leaves
/// `last` at [`LastRead::HeldBack`].
async fn reload_if_changed(
    control: &ControlPlane,
    file: &Path,
    read: io::Result<FileRead>,
    last: &mut LastRead,
    at_bound: bool,
) {
    let read = match read {
        Ok(read) => read,
        Err(e) => {
            reload_result(control, file, Err(cannot_read(&e)), Before::Failed);
            if matches!(last, LastRead::Failed(kind) if *kind == e.kind()) {
                debug!(file = %LogPath(file), error = %e, "the policy file still cannot be read");
            } else {
                warn!(file = %LogPath(file), error = %e, "cannot read the policy file; still serving {}", serving(control));
                *last = LastRead::Failed(e.kind());
            }
            return;
        }
    };
    if matches!(last, LastRead::Bytes(seen) if *seen == read.bytes) {
        debug!(file = %LogPath(file), "the policy file is unchanged since it was last read");
        return;
    }
    let again = match last {
        LastRead::Unstored(seen, at) if *seen == read.bytes => {
            if at.elapsed() < UNSTORED_RETRY {
                debug!(file = %LogPath(file), "the policy file is unchanged since the store failed to take it; trying again later");
                return;
            }
            true
        }
        _ => false,
    };
    // The same bytes as at the last bound: unchanged for a whole bound, a save, not half of one.
    let keep_endpoints =
        at_bound && !matches!(last, LastRead::HeldBack(seen) if *seen == read.bytes);
    let (loaded, bytes) = match blocking(move || (read.load(), read.bytes)).await {
        Ok(loaded) => loaded,
        Err(e) => {
            warn!(file = %LogPath(file), error = %e, "cannot load the policy file; still serving {}", serving(control));
            reload_result(
                control,
                file,
                Err(format!("cannot load it: {e}")),
                Before::Failed,
            );
            *last = LastRead::Nothing;
            return;
        }
    };
    // Read before `apply`: a save it publishes sets the gauge as it publishes. Not a read
    // taken at the bound, while the writer still holds the file: that one is logged as such,
    // and logs as any read does.
    let before = if matches!(last, LastRead::LeftToItsWriter) && !at_bound {
        Before::LeftToItsWriter
    } else if control.metrics.config_last_reload_successful.get() == 1 {
        Before::Good
    } else {
        Before::Failed
    };
    let (settled, outcome) = apply(
        control,
        file,
        loaded,
        again,
        keep_endpoints,
        matches!(before, Before::LeftToItsWriter),
    )
    .await;
    // A save still being written is no failed reload: the gauge says what the last one did.
    if !matches!(settled, Settled::HeldBack) {
        reload_result(control, file, outcome, before);
    }
    *last = match settled {
        Settled::Yes => LastRead::Bytes(bytes),
        Settled::Unstored => LastRead::Unstored(bytes, Instant::now()),
        Settled::HeldBack => LastRead::HeldBack(bytes),
        Settled::No => LastRead::Nothing,
    };
}

/// How long the watcher waits before it gives the store bytes it failed to take once more
/// (see [`LastRead::Unstored`]); the rescan reads the file at least every 10 s anyway.
const UNSTORED_RETRY: Duration = Duration::from_secs(5);

/// Whether the same bytes would get the same answer from [`apply`] again.
enum Settled {
    /// Yes: applied, equal to what is served, or refused for what they hold.
    Yes,
    /// Not stored: the store failed (a full disk); tried again later.
    Unstored,
    /// No (a conflict with a change made meanwhile).
    No,
    /// Read while its writer was not done, and held back for removing endpoints: read again
    /// once the writer is (the same bytes then are a whole save).
    HeldBack,
}

/// What came before a read of the file, for the line a good read logs.
#[derive(Clone, Copy)]
enum Before {
    /// A good read (the gauge at 1): nothing to say.
    Good,
    /// A read that failed or was refused: a good one says the file is valid again.
    Failed,
    /// Nothing: start-up left the file to the process that held it open. A good read says it
    /// read it once that writer closed it.
    LeftToItsWriter,
}

/// Notes one read of the file ([`ControlPlane::note_file_read`]: the gauge
/// `retryplane_server_config_last_reload_successful` and `FleetStatus`'s verdict; `Err`: why it
/// was not applied), and says once when the file is good after a read that was not, or after
/// start-up left it to its writer (`before`).
fn reload_result(control: &ControlPlane, file: &Path, outcome: Result<(), String>, before: Before) {
    let ok = outcome.is_ok();
    control.note_file_read(outcome);
    match (ok, before) {
        (true, Before::Failed) => {
            info!(file = %LogPath(file), "the policy file is readable and valid again; {} is served", serving(control));
        }
        (true, Before::LeftToItsWriter) => {
            info!(file = %LogPath(file), "the policy file's writer closed it, and it is read: {} is served", serving(control));
        }
        _ => {}
    }
}

fn serving(control: &ControlPlane) -> String {
    control.publisher.current().map_or_else(
        || "nothing".to_owned(),
        |s| format!("version {}", s.version),
    )
}

/// Reads `file` and applies it, whatever was read before; on any problem logs it and keeps the
/// current version.
pub async fn reload(control: &ControlPlane, file: &Path) {
    let read = read_file(file).await;
    reload_if_changed(control, file, read, &mut LastRead::Nothing, false).await;
}

/// Applies what was loaded from `file`, logging any problem (a store failure at debug when
/// these bytes failed so `again`; an unchanged save not at all when it is the read a start
/// left `after_writer`, which its caller logs). Returns whether the outcome is settled, so that the same
/// bytes would get the same answer again (only a store failure is worth another try, and not
/// a store whose file was replaced, which stores nothing until a restart), and whether the
/// file was valid and applied (or equal to the version served): if not, why not, on one line.
async fn apply(
    control: &ControlPlane,
    file: &Path,
    loaded: Loaded,
    again: bool,
    keep_endpoints: bool,
    after_writer: bool,
) -> (Settled, Result<(), String>) {
    log_diagnostics(file, &loaded);
    let Some(policies) = loaded.policies else {
        control.metrics.rejected_changes.inc();
        warn!(file = %LogPath(file), "the policy file has errors; the change is rejected and {} stays served", serving(control));
        return (
            Settled::Yes,
            Err(crate::control::errors_in_brief(&loaded.diagnostics)),
        );
    };
    let request = ChangeRequest {
        content: ChangeContent::Loaded {
            policies,
            warnings: loaded.diagnostics,
        },
        source: Source::File,
        author: None,
        expected_version: None,
        dry_run: false,
        force: false,
        keep_endpoints,
    };
    match control.apply(request).await {
        Ok(outcome) if !outcome.changed => {
            // Its bytes changed (a comment, the layout, a value spelled another way), so whoever
            // saved it is told the save was read; after a failed read, the line that says the
            // file is valid again tells it instead, and for the read a start left to the file's
            // writer, the line that says it was read once the writer closed it.
            if control.metrics.config_last_reload_successful.get() == 1 && !after_writer {
                info!(file = %LogPath(file), "the policy file was saved, but its policies did not change; {} stays served", serving(control));
            }
            (Settled::Yes, Ok(()))
        }
        Ok(_) => (Settled::Yes, Ok(())),
        Err(ChangeError::RemovesEverything(names)) => {
            // As many names as fit one readable line (a file of thousands of endpoints made
            // one log line of 150 KB).
            let names = crate::admin::capped_list(&names, ", ", 1_000, "endpoint", "");
            warn!(
                file = %LogPath(file),
                "the saved file removes every endpoint ({names}); refused, {} stays served. To \
                 replace every endpoint, add the new ones first, save, then remove the old ones",
                serving(control)
            );
            (Settled::Yes, Err(removes_everything(&names)))
        }
        Err(ChangeError::MaybePartial(names)) => {
            let names = crate::admin::capped_list(&names, ", ", 1_000, "endpoint", "");
            warn!(
                file = %LogPath(file),
                "what the policy file holds while its writer is not done removes {names}, which \
                 half of a save would: not applied, {} stays served; it is read again once the \
                 writer closes the file, and applied at the next bound if it has not changed by \
                 then",
                serving(control)
            );
            // Not judged: `reload_if_changed` notes no outcome for a read held back.
            (Settled::HeldBack, Err(String::new()))
        }
        Err(e) => {
            let settled = match &e {
                ChangeError::Store(StoreError::FileReplaced { .. }) => Settled::Yes,
                ChangeError::Store(_) | ChangeError::StoreUncertain(_) => Settled::Unstored,
                ChangeError::Conflict { .. } => Settled::No,
                _ => Settled::Yes,
            };
            if again && matches!(settled, Settled::Unstored) {
                debug!(file = %LogPath(file), error = %ErrorChain(&e), "the saved policy file still cannot be stored; {} stays served", serving(control));
            } else {
                warn!(file = %LogPath(file), error = %ErrorChain(&e), "the saved policy file was not applied; {} stays served", serving(control));
            }
            let why = match &e {
                ChangeError::Store(store) | ChangeError::StoreUncertain(store) => {
                    cannot_store(store)
                }
                _ => ErrorChain(&e).to_string(),
            };
            (settled, Err(why))
        }
    }
}

#[cfg(test)]
#[path = "watch_tests.rs"]
mod tests;
