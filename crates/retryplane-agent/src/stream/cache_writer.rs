//! Writing the cache file off the stream's path.
//!
//! The stream task used to write the cache file itself, between applying a snapshot and
//! answering it: on a slow or hung disk (a network volume that stopped answering) the ACK,
//! every metrics report and shutdown waited for the disk, for as long as it hung. The writes
//! now run in a task of their own, one at a time and in order; when several snapshots come
//! while one is being written, only the newest is written next. The stream still answers a
//! snapshot once it is cached, but waits for that a bounded time only
//! ([`CacheWriter::written`]), and so does shutdown ([`CacheWriter::finish`]).
//!
//! When the start could not read the cache file in time, the writer first waits for that read
//! to end and say whether the file is ours ([`Gate`]): until then nothing is written, each
//! write asked for counts as done at once (the stream does not wait for a disk that has not
//! been read yet), and only the newest one is kept, to be written once the file is found to be
//! ours; none is, if it is not.

use retryplane_policy::diag::LogPath;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

/// How a cache file is written (the agent's own [`crate::cache::write_atomic`]; tests hand
/// in one that stands for a hung disk).
pub(crate) type WriteFn = fn(&Path, &[u8]) -> std::io::Result<()>;

/// What a writer waits for before its first write: whether the file at the path may be
/// written (it is ours, or there is none).
pub(crate) type Gate = Pin<Box<dyn Future<Output = bool> + Send>>;

/// The newest bytes asked for, and how many writes have been asked for so far.
type Newest = (u64, Option<Arc<[u8]>>);

/// The task that writes the newest applied snapshot's cache bytes to the cache file.
#[derive(Debug)]
pub(crate) struct CacheWriter {
    /// The newest bytes asked for, and how many writes have been asked for so far.
    newest: watch::Sender<Newest>,
    /// The number of the last write done (or failed, or put off while the gate is shut);
    /// later ones replace earlier ones.
    done: watch::Receiver<u64>,
    /// Whether the task still waits for its [`Gate`].
    gated: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl CacheWriter {
    /// Starts the task that writes to `path`, once `gate` (if any) says it may.
    pub(crate) fn start(path: PathBuf, gate: Option<Gate>) -> Self {
        Self::start_with(path, crate::cache::write_atomic, gate)
    }

    /// [`CacheWriter::start`], writing with `write`.
    pub(crate) fn start_with(path: PathBuf, write: WriteFn, gate: Option<Gate>) -> Self {
        let (newest, rx) = watch::channel((0, None));
        let (done_tx, done) = watch::channel(0);
        let gated = Arc::new(AtomicBool::new(gate.is_some()));
        let task = tokio::spawn(write_newest(path, rx, done_tx, write, gate, gated.clone()));
        Self {
            newest,
            done,
            gated,
            task,
        }
    }

    /// Asks for `bytes` to be written, after the write under way if there is one, and returns
    /// at once the write's number, for [`CacheWriter::written`]. Bytes asked for earlier and
    /// not yet written are not written.
    pub(crate) fn write(&self, bytes: Vec<u8>) -> u64 {
        let mut number = 0;
        self.newest.send_modify(|(n, newest)| {
            *n += 1;
            number = *n;
            *newest = Some(bytes.into());
        });
        number
    }

    /// Waits, at most `bound`, for write `number` (or a later one) to be done, failed
    /// included, or put off until the gate opens; whether it was.
    pub(crate) async fn written(&self, number: u64, bound: Duration) -> bool {
        let mut done = self.done.clone();
        tokio::time::timeout(bound, done.wait_for(|&n| n >= number))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits for the last write asked for to be done, for at most `grace`: a disk that does
    /// not answer does not hold up shutdown. The write goes on in the background then, on a
    /// thread that neither the runtime nor the process's exit waits for. With nothing to write,
    /// a gate still shut is not waited for.
    pub(crate) async fn finish(self, grace: Duration) {
        let Self {
            newest,
            task,
            gated,
            ..
        } = self;
        // Closing the channel ends the task once it has written the newest bytes.
        drop(newest);
        if tokio::time::timeout(grace, task).await.is_err() {
            if gated.load(Ordering::Acquire) {
                // Said at warn when the start gave up waiting for the read.
                debug!("the policy cache file has not been read yet; nothing is written to it");
            } else {
                warn!(
                    grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
                    "the policy cache file is still being written; not waiting for it any longer"
                );
            }
        }
    }
}

/// The task: once `gate` (if any) opens, each newest bytes in turn, until the channel closes
/// with nothing left unwritten (a write that failed is tried once more then).
async fn write_newest(
    path: PathBuf,
    mut newest: watch::Receiver<Newest>,
    done: watch::Sender<u64>,
    write: WriteFn,
    gate: Option<Gate>,
    gated: Arc<AtomicBool>,
) {
    if let Some(gate) = gate {
        let open = wait_for(gate, &mut newest, &done).await;
        gated.store(false, Ordering::Release);
        match open {
            // Closed with nothing to write: no need to know.
            None => return,
            Some(false) => {
                // Not ours: nothing is ever written, and no write is waited for.
                while newest.changed().await.is_ok() {
                    let number = newest.borrow_and_update().0;
                    done.send_replace(number);
                }
                return;
            }
            Some(true) => {}
        }
    }
    // A write that failed (a full or missing volume) is tried again, `RETRY_FIRST` later and
    // twice as long each time after, up to `RETRY_MAX`, until it is done or newer bytes
    // replace it: else the file would keep an older version until the control plane
    // publishes another, and a restart without it would run that.
    let mut failed: Option<(Arc<[u8]>, Duration)> = None;
    // The newest bytes asked for while the gate was shut, if it was.
    let mut asked = newest.borrow_and_update().clone();
    loop {
        if let (number, Some(bytes)) = std::mem::take(&mut asked) {
            let ok = write_one(&path, Arc::clone(&bytes), write, failed.is_some()).await;
            done.send_replace(number);
            failed = (!ok).then_some((bytes, RETRY_FIRST));
        }
        let retry = failed.as_ref().map(|(_, after)| *after);
        // `changed` still reports bytes sent just before the sender was dropped.
        asked = tokio::select! {
            changed = newest.changed() => match changed {
                Ok(()) => newest.borrow_and_update().clone(),
                Err(_) => {
                    // Shutdown: a write that failed gets one last try (within `finish`'s
                    // grace), else the file keeps an older version with nothing said.
                    if let Some((bytes, _)) = failed.take() {
                        if write_one(&path, bytes, write, true).await {
                            info!(file = %LogPath(&path), "policy cache written after failing");
                        } else {
                            warn!(file = %LogPath(&path), "the policy cache file keeps an older version than the one applied: its write failed, and so did a last try at shutdown");
                        }
                    }
                    return;
                }
            },
            () = tokio::time::sleep(retry.unwrap_or_default()), if retry.is_some() => {
                let Some((bytes, after)) = failed.take() else { continue };
                if write_one(&path, Arc::clone(&bytes), write, true).await {
                    info!(file = %LogPath(&path), "policy cache written after failing");
                } else {
                    failed = Some((bytes, (after * 2).min(RETRY_MAX)));
                }
                continue;
            }
        };
    }
}

/// When a failed cache write is first tried again.
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between tries of a failed cache write.
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Waits for `gate`; meanwhile each write asked for counts as done at once, its bytes left in
/// `newest` (the newest replacing the others). `None` when the channel closes with no bytes
/// asked for: the gate is not waited for then.
async fn wait_for(
    mut gate: Gate,
    newest: &mut watch::Receiver<Newest>,
    done: &watch::Sender<u64>,
) -> Option<bool> {
    let mut open = true;
    loop {
        tokio::select! {
            may = &mut gate => return Some(may),
            changed = newest.changed(), if open => match changed {
                Ok(()) => {
                    let number = newest.borrow().0;
                    done.send_replace(number);
                }
                // Closed: only bytes already asked for are left to write.
                Err(_) if newest.borrow().1.is_none() => return None,
                Err(_) => open = false,
            },
        }
    }
}

/// Writes `bytes` to `path`; whether it was written. A failure is logged at warn, or at debug
/// when `again` (a retry of a failed write, which was warned of).
async fn write_one(path: &Path, bytes: Arc<[u8]>, write: WriteFn, again: bool) -> bool {
    let shown = path.display().to_string();
    let at = path.to_owned();
    // A thread of its own, not tokio's blocking pool: a runtime joins its blocking threads
    // when it is dropped, so a write hung on the disk would hold up the process's exit
    // after `finish` stopped waiting for it.
    let (result_tx, result) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("retryplane-cache".into())
        .spawn(move || {
            let _ = result_tx.send(write(&at, &bytes));
        });
    let error = match spawned {
        Err(e) => format!("cannot start the policy cache writer: {e}"),
        Ok(_detached) => match result.await {
            Ok(Ok(())) => {
                debug!(file = %shown, "policy cache written");
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            // The write panicked.
            Err(_) => "the writer failed".to_owned(),
        },
    };
    if again {
        debug!(file = %shown, %error, "cannot write the policy cache yet; trying again later");
    } else {
        warn!(file = %shown, %error, "cannot write the policy cache; trying again later");
    }
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::Mutex;

    use super::*;

    /// The longest any single wait may take before the test fails.
    const WAIT: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn the_newest_bytes_are_written_and_finish_waits_for_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let writer = CacheWriter::start(path.clone(), None);
        let first = writer.write(b"first".to_vec());
        assert!(writer.written(first, WAIT).await);
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        writer.write(b"second".to_vec());
        writer.write(b"newest".to_vec());
        writer.finish(WAIT).await;
        assert_eq!(std::fs::read(&path).unwrap(), b"newest");
    }

    /// Until the gate opens, writes count as done at once and nothing is written; then the
    /// newest is written, or none if the gate says the file is not ours.
    #[tokio::test]
    async fn writes_wait_for_the_gate_and_only_the_newest_is_written() {
        for ours in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("agent.cache");
            std::fs::write(&path, b"old").unwrap();
            let (open, gate) = tokio::sync::oneshot::channel::<bool>();
            let gate: Gate = Box::pin(async move { gate.await.unwrap_or(false) });
            let writer = CacheWriter::start_with(path.clone(), recording_write, Some(gate));
            writer.write(b"v1".to_vec());
            let v2 = writer.write(b"v2".to_vec());
            assert!(writer.written(v2, WAIT).await, "not waited for");
            assert_eq!(std::fs::read(&path).unwrap(), b"old");
            assert!(recorded(&path).is_empty(), "written before the gate opened");
            open.send(ours).unwrap();
            writer.finish(WAIT).await;
            let want: &[u8] = if ours { b"v2" } else { b"old" };
            assert_eq!(std::fs::read(&path).unwrap(), want, "ours: {ours}");
            let writes: Vec<Vec<u8>> = if ours { vec![b"v2".to_vec()] } else { vec![] };
            assert_eq!(recorded(&path), writes, "ours: {ours}");
        }
    }

    /// Tries of `failing_twice`, which fails its first two.
    static TRIES: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

    fn failing_twice(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        failing_first(2, &TRIES, path, bytes)
    }

    /// Records a try in `tries`, and fails the first `failing` of them as a full disk would.
    fn failing_first(
        failing: usize,
        tries: &Mutex<Vec<Vec<u8>>>,
        path: &Path,
        bytes: &[u8],
    ) -> std::io::Result<()> {
        let mut tries = tries.lock().unwrap();
        tries.push(bytes.to_vec());
        if tries.len() <= failing {
            return Err(std::io::Error::other("no space left on device"));
        }
        crate::cache::write_atomic(path, bytes)
    }

    /// A write that fails is tried again after a pause (1 s, then 2 s) until it is done; the
    /// stream is not kept waiting for it meanwhile; newer bytes replace it.
    // Real time: each write runs on a thread of its own, which paused time would not wait for.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_is_tried_again_until_it_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let writer = CacheWriter::start_with(path.clone(), failing_twice, None);
        let v1 = writer.write(b"v1".to_vec());
        assert!(
            writer.written(v1, WAIT).await,
            "a failed write is waited for once"
        );
        assert!(!path.exists());
        let started = tokio::time::Instant::now();
        tokio::time::timeout(WAIT, async {
            while std::fs::read(&path).ok().as_deref() != Some(&b"v1"[..]) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("written once the disk takes writes");
        assert!(
            started.elapsed() >= Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            *TRIES.lock().unwrap(),
            [b"v1".to_vec(), b"v1".to_vec(), b"v1".to_vec()]
        );
        writer.finish(WAIT).await;
    }

    /// Tries of `failing_once`, which fails its first.
    static TRIES_ONCE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

    fn failing_once(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        failing_first(1, &TRIES_ONCE, path, bytes)
    }

    /// Shutdown does not give up a failed write waiting for its next try: it tries once more,
    /// so the file holds the snapshot last applied when the disk takes writes again.
    // Real time, as above.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_tries_a_failed_write_once_more() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let writer = CacheWriter::start_with(path.clone(), failing_once, None);
        let v1 = writer.write(b"v1".to_vec());
        assert!(writer.written(v1, WAIT).await);
        assert!(!path.exists());
        // Long before the next try (1 s later).
        writer.finish(WAIT).await;
        assert_eq!(std::fs::read(&path).unwrap(), b"v1");
        assert_eq!(
            *TRIES_ONCE.lock().unwrap(),
            [b"v1".to_vec(), b"v1".to_vec()]
        );
    }

    /// Tries of `failing_always`, every one of which fails.
    static TRIES_ALWAYS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

    fn failing_always(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        failing_first(usize::MAX, &TRIES_ALWAYS, path, bytes)
    }

    /// A write whose last try at shutdown fails too is not dropped unsaid: the file keeps an
    /// older version than the agent applied, and a restart without the control plane would run
    /// that, so it is said at warn.
    // Real time, as above; one thread, so that the writer's task logs where the test captures.
    #[tokio::test(flavor = "current_thread")]
    async fn a_last_try_at_shutdown_that_fails_too_is_warned_of() {
        let (logs, _guard) = crate::test_logs::Logs::capture();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let writer = CacheWriter::start_with(path.clone(), failing_always, None);
        let v1 = writer.write(b"v1".to_vec());
        assert!(writer.written(v1, WAIT).await);
        writer.finish(WAIT).await;
        assert!(!path.exists());
        assert_eq!(
            *TRIES_ALWAYS.lock().unwrap(),
            [b"v1".to_vec(), b"v1".to_vec()]
        );
        let text = logs.text();
        assert!(
            text.contains("WARN") && text.contains("the policy cache file keeps an older version than the one applied: its write failed, and so did a last try at shutdown"),
            "{text}"
        );
    }

    /// Every write `recording_write` did: where, and what.
    static RECORDED: Mutex<Vec<(PathBuf, Vec<u8>)>> = Mutex::new(Vec::new());

    /// Writes as the agent does, recorded.
    fn recording_write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        RECORDED
            .lock()
            .unwrap()
            .push((path.to_owned(), bytes.to_vec()));
        crate::cache::write_atomic(path, bytes)
    }

    /// What `recording_write` wrote to `path`, in order.
    fn recorded(path: &Path) -> Vec<Vec<u8>> {
        let recorded = RECORDED.lock().unwrap();
        let to = recorded.iter().filter(|(at, _)| at == path);
        to.map(|(_, bytes)| bytes.clone()).collect()
    }

    /// A disk that does not answer until [`release`] is called.
    static HUNG: Mutex<Option<std::sync::mpsc::Receiver<()>>> = Mutex::new(None);
    /// The writes `hung_write` took, in order.
    static WRITTEN: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

    fn hung_write(_: &Path, bytes: &[u8]) -> std::io::Result<()> {
        WRITTEN.lock().unwrap().push(bytes.to_vec());
        if let Some(rx) = HUNG.lock().unwrap().take() {
            let _ = rx.recv();
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hung_disk_holds_up_neither_the_stream_nor_shutdown_for_long() {
        let (release, hung) = std::sync::mpsc::channel::<()>();
        *HUNG.lock().unwrap() = Some(hung);
        let writer = CacheWriter::start_with(PathBuf::from("unused"), hung_write, None);
        // The first write hangs; asking for more returns at once, and waiting for one ends
        // at its bound.
        writer.write(b"v1".to_vec());
        writer.write(b"v2".to_vec());
        let v3 = writer.write(b"v3".to_vec());
        let waited = tokio::time::timeout(WAIT, writer.written(v3, Duration::from_millis(50)));
        assert!(!waited.await.expect("the wait ends at its bound"));
        tokio::time::timeout(WAIT, writer.finish(Duration::from_millis(50)))
            .await
            .expect("finish returns while the disk hangs");
        // Once the disk answers, the newest bytes are written, and nothing older after them.
        release.send(()).unwrap();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let written = WRITTEN.lock().unwrap().clone();
            if written.last().map(Vec::as_slice) == Some(b"v3".as_slice()) {
                assert!(written.len() <= 2, "{written:?}");
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{written:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A disk that never answers (for the test below; the one above has its own).
    static NEVER: Mutex<Option<std::sync::mpsc::Receiver<()>>> = Mutex::new(None);

    fn never_write(_: &Path, _: &[u8]) -> std::io::Result<()> {
        if let Some(rx) = NEVER.lock().unwrap().take() {
            let _ = rx.recv();
        }
        Ok(())
    }

    #[test]
    fn a_hung_disk_does_not_hold_up_the_end_of_the_runtime() {
        // Held, never sent on: the write hangs until the test ends.
        let (_hold, never) = std::sync::mpsc::channel::<()>();
        *NEVER.lock().unwrap() = Some(never);
        let (ended_tx, ended) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let writer = CacheWriter::start_with(PathBuf::from("unused"), never_write, None);
                let write = writer.write(b"v1".to_vec());
                assert!(!writer.written(write, Duration::from_millis(20)).await);
                writer.finish(Duration::from_millis(20)).await;
            });
            // A runtime joins the threads of its blocking pool when dropped: a write made
            // there would hold this up for as long as the disk hangs.
            drop(runtime);
            let _ = ended_tx.send(());
        });
        ended
            .recv_timeout(WAIT)
            .expect("the runtime ends while the disk hangs");
    }
}
