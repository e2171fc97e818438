//! The agent token each stream is opened with: the one given to
//! [`crate::AgentBuilder::token`], or the content of the file given to
//! [`crate::AgentBuilder::token_file`], read again before each stream is opened (and after
//! the control plane ends a stream for its token, to tell a rotation from a fault), so that a
//! rotated secret (a mounted Kubernetes secret, a file a vault agent rewrites) reaches a
//! running service without a restart. A read that fails, or finds no token a control plane
//! could hold, keeps the token read before, warned of once until the reason changes; the file
//! is never logged from, only named.
//!
//! Reads run on a thread of their own and are waited for at most [`READ_WAIT`]: a file on a
//! volume that stops answering must hold neither `connect` nor the stream task (nor the
//! agent's shutdown, nor the runtime's: a blocking task of tokio's would be waited for when
//! the runtime is dropped). A read still under way is waited for by the next stream rather
//! than started again. Until a first token has been read, no stream is opened: each try waits
//! for the read as long, then is lost and tried again after the backoff. A FIFO or a socket is
//! refused before it is opened (opening a FIFO waits for a writer). A content other than the
//! token in use is taken only once two reads agree (50 ms apart, or of successive tries), so
//! that a file rewritten in place, caught between its truncation and its last write, does not
//! send a piece of a secret. The first token is taken as read: there is nothing else to use.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::metadata::AsciiMetadataValue;
use tracing::{info, warn};

use crate::error::AgentError;

/// The most bytes a token file is read to: a token is a line of printable ASCII, and a path
/// pointed at another file by mistake must not be read whole.
pub const MAX_TOKEN_FILE_BYTES: usize = 4096;

/// How long a read of the token file is waited for, at `connect` and before a stream, when a
/// token read before can be used meanwhile.
pub(crate) const READ_WAIT: Duration = Duration::from_secs(1);

/// How long a read that found a new content waits before it reads again to confirm it (a
/// writer that truncates a file and writes it in pieces is done within it, as a rule).
const CONFIRM_AFTER: Duration = Duration::from_millis(50);

/// How many reads a new content may take to be read the same twice in a row.
const MOST_READS: usize = 4;

/// Where a stream's token comes from.
#[derive(Debug)]
pub(crate) enum TokenSource {
    /// Given once, for the agent's life.
    Fixed(AsciiMetadataValue),
    /// Read from a file before each stream.
    File(TokenFile),
}

/// Why there is no token to open a stream with.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoToken {
    /// The agent is shutting down.
    Cancelled,
    /// No token has been read from the file yet: the first read failed, or has not ended (it
    /// goes on, and the next stream waits for it again). The stream is not opened, and is
    /// tried again after the backoff.
    NotRead(String),
}

impl TokenSource {
    /// The token to open the next stream with.
    pub(crate) async fn current(
        &self,
        cancel: &CancellationToken,
    ) -> Result<AsciiMetadataValue, NoToken> {
        match self {
            TokenSource::Fixed(value) => Ok(value.clone()),
            TokenSource::File(file) => file.read(cancel).await,
        }
    }

    /// After the control plane ended a stream because it dropped the token the stream was
    /// opened with: whether the file holds another one now (read again, a new content
    /// confirmed as before; a read that fails or is slow answers `false`). That is the last
    /// step of a rotation done in order (the new secret added to the control plane, the file
    /// rewritten, the old secret dropped), not a fault: the next stream uses it.
    pub(crate) async fn rotated(&self, cancel: &CancellationToken) -> bool {
        match self {
            TokenSource::Fixed(_) => false,
            TokenSource::File(file) => {
                let used = file.lock().last.clone();
                match file.read(cancel).await {
                    Ok(now) => used.is_some_and(|used| used != now),
                    Err(_) => false,
                }
            }
        }
    }
}

/// What a read of the token file answers: the token, or why not.
type ReadResult = Result<AsciiMetadataValue, String>;

/// A token file and the token last read from it.
#[derive(Debug)]
pub(crate) struct TokenFile {
    path: PathBuf,
    /// How long a read is waited for ([`READ_WAIT`]).
    wait: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The token last read (`None` until a first read has given one).
    last: Option<AsciiMetadataValue>,
    /// A content other than `last` read once, waiting for a second read to agree (kept
    /// across streams: reads slower than the wait may each end on another stream's turn).
    unconfirmed: Option<AsciiMetadataValue>,
    /// Why the reads since the last good one failed, warned of once until it changes.
    failing: Option<String>,
    /// Whether reads not ending within the wait were warned of: once, until a read started
    /// afresh ends within it (a read under way from before ending in time says nothing of
    /// the volume's speed).
    slow_warned: bool,
    /// A read still under way, its answer to come.
    pending: Option<oneshot::Receiver<ReadResult>>,
}

impl TokenFile {
    /// Reads `path` a first time, waiting at most [`READ_WAIT`]: an agent given a file it
    /// cannot use is refused at once. A read that has not ended by then goes on; the agent's
    /// first stream waits for it.
    pub(crate) fn open(path: &Path) -> Result<Self, AgentError> {
        Self::open_waiting(path, READ_WAIT)
    }

    /// [`TokenFile::open`], each read waited for at most `wait`.
    fn open_waiting(path: &Path, wait: Duration) -> Result<Self, AgentError> {
        let refused = |reason| AgentError::TokenFile {
            path: path.to_owned(),
            reason,
        };
        let (mut found, done) = spawn_read(path).map_err(refused)?;
        let mut state = State::default();
        match done.recv_timeout(wait) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                warn!(
                    file = %path.display(),
                    wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                    "the agent token file could not be read in time (a volume that does not \
                     answer?); the agent opens its first stream once it is"
                );
                state.pending = Some(found);
                state.slow_warned = true;
            }
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let read = found
                    .try_recv()
                    .unwrap_or_else(|_| Err("the read ended without an answer".to_owned()));
                state.last = Some(read.map_err(refused)?);
            }
        }
        Ok(Self {
            path: path.to_owned(),
            wait,
            state: Mutex::new(state),
        })
    }

    /// Reads the file again: its token, or, when that fails or does not end within
    /// [`READ_WAIT`] (a read still under way from before is waited for, not started again),
    /// the token read before; with none yet, [`NoToken::NotRead`]. A content other than the
    /// token in use is taken once two reads [`CONFIRM_AFTER`] apart agree, reads of this
    /// stream's turn or of turns before.
    async fn read(&self, cancel: &CancellationToken) -> Result<AsciiMetadataValue, NoToken> {
        let last = self.lock().last.clone();
        let or_last = |reason: String| last.clone().ok_or(NoToken::NotRead(reason));
        for attempt in 0..MOST_READS {
            if attempt > 0 {
                tokio::select! {
                    () = tokio::time::sleep(CONFIRM_AFTER) => {}
                    () = cancel.cancelled() => return last.clone().ok_or(NoToken::Cancelled),
                }
            }
            let read = match self.read_once(cancel).await {
                Ok(read) => read,
                Err(NoToken::Cancelled) => return last.clone().ok_or(NoToken::Cancelled),
                Err(NoToken::NotRead(reason)) => return or_last(reason),
            };
            let value = match read {
                Ok(value) => value,
                Err(reason) => {
                    self.failed(reason.clone(), last.is_some());
                    return or_last(reason);
                }
            };
            let mut state = self.lock();
            // The first token (nothing better to use), the one in use again, or a new one
            // read twice alike.
            if last.is_none()
                || last.as_ref() == Some(&value)
                || state.unconfirmed.as_ref() == Some(&value)
            {
                self.taken(&mut state, &value);
                return Ok(value);
            }
            state.unconfirmed = Some(value);
        }
        let reason = "it changed at each read (is it being written in place?)".to_owned();
        self.failed(reason.clone(), last.is_some());
        or_last(reason)
    }

    /// One read's answer: the read under way, or a new one, waited for at most the wait
    /// (past it, the read stays under way for the next one to wait for); `Err` when `cancel`
    /// fires or the wait passes.
    async fn read_once(&self, cancel: &CancellationToken) -> Result<ReadResult, NoToken> {
        let pending = self.lock().pending.take();
        let fresh = pending.is_none();
        let mut pending = match pending {
            Some(pending) => pending,
            None => match spawn_read(&self.path) {
                Ok((found, _)) => found,
                Err(reason) => return Ok(Err(reason)),
            },
        };
        tokio::select! {
            read = &mut pending => {
                if fresh {
                    self.lock().slow_warned = false;
                }
                Ok(read.unwrap_or_else(|_| Err("the read ended without an answer".to_owned())))
            }
            () = cancel.cancelled() => {
                self.lock().pending = Some(pending);
                Err(NoToken::Cancelled)
            }
            () = tokio::time::sleep(self.wait) => {
                let reason = format!(
                    "it could not be read within {} ms (a volume that does not answer?)",
                    self.wait.as_millis()
                );
                let mut state = self.lock();
                state.pending = Some(pending);
                if !std::mem::replace(&mut state.slow_warned, true) {
                    let in_use = state.last.is_some();
                    drop(state);
                    self.warn(&reason, in_use);
                }
                Err(NoToken::NotRead(reason))
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `value` read and taken: said at info when it is a new token, or when the file can be
    /// used again after reads that failed.
    fn taken(&self, state: &mut State, value: &AsciiMetadataValue) {
        if state.last.as_ref().is_some_and(|last| last != value) {
            info!(file = %self.path.display(), "the agent token file holds a new token: streams from now on use it");
        } else if state.failing.is_some() {
            info!(file = %self.path.display(), "the agent token file can be used again");
        }
        state.last = Some(value.clone());
        state.unconfirmed = None;
        state.failing = None;
    }

    /// A read that failed for `reason`: warned of once until the reason changes.
    fn failed(&self, reason: String, in_use: bool) {
        let mut state = self.lock();
        if state.failing.as_deref() != Some(reason.as_str()) {
            state.failing = Some(reason.clone());
            drop(state);
            self.warn(&reason, in_use);
        }
    }

    /// The warning of a read that failed or was slow, `in_use` when a token read before
    /// stays in use.
    fn warn(&self, reason: &str, in_use: bool) {
        if in_use {
            warn!(file = %self.path.display(), %reason, "cannot use the agent token file; the token read before stays in use");
        } else {
            warn!(file = %self.path.display(), %reason, "cannot use the agent token file; no stream is opened until it can be");
        }
    }
}

/// Reads the token file at `path` on a thread of its own ([`read_token`]): its answer, and a
/// signal when it is sent (for a caller that waits without a runtime).
fn spawn_read(
    path: &Path,
) -> Result<(oneshot::Receiver<ReadResult>, std::sync::mpsc::Receiver<()>), String> {
    let (found_tx, found) = oneshot::channel();
    let (done_tx, done) = std::sync::mpsc::sync_channel(1);
    let path = path.to_owned();
    std::thread::Builder::new()
        .name("retryplane-token-read".into())
        .spawn(move || {
            let _ = found_tx.send(read_token(&path));
            let _ = done_tx.send(());
        })
        .map_err(|e| format!("cannot start a thread to read it: {e}"))?;
    Ok((found, done))
}

/// The token in the file at `path`: its content without the ASCII white space around it (a
/// secret file often ends with a newline) and a byte-order mark before it, as
/// [`crate::agent::bearer`] sends it; else why not, never quoting the file.
fn read_token(path: &Path) -> ReadResult {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt as _;
        let kind = std::fs::metadata(path)
            .map_err(|e| format!("cannot open it: {e}"))?
            .file_type();
        if kind.is_fifo() || kind.is_socket() {
            return Err("it is a FIFO or a socket, not a file".to_owned());
        }
    }
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_TOKEN_FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() > MAX_TOKEN_FILE_BYTES {
        return Err(format!(
            "it is longer than {MAX_TOKEN_FILE_BYTES} bytes: is it the token file?"
        ));
    }
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| "it holds a character other than printable ASCII and the space".to_owned())?;
    let token = text
        .strip_prefix('\u{feff}')
        .unwrap_or(text)
        .trim_matches(|c: char| c.is_ascii_whitespace());
    crate::agent::bearer(token).map_err(|_| {
        if token.is_empty() {
            "it is empty".to_owned()
        } else {
            "it holds a character other than printable ASCII and the space, or more than one \
             line"
                .to_owned()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(token: &str) -> AsciiMetadataValue {
        crate::agent::bearer(token).unwrap()
    }

    /// A read of `file`, failing the test rather than hanging it if the read's own bound
    /// were lost.
    async fn bounded(
        file: &TokenFile,
        cancel: &CancellationToken,
    ) -> Result<AsciiMetadataValue, NoToken> {
        tokio::time::timeout(Duration::from_secs(30), file.read(cancel))
            .await
            .expect("a read of the token file ends within its bound")
    }

    /// Asserts that the next read of `file` gives `token`.
    async fn reads(file: &TokenFile, token: &str) {
        let cancel = CancellationToken::new();
        assert_eq!(bounded(file, &cancel).await.unwrap(), bearer(token));
    }

    /// A token file's content is its token, the white space around it left out; one that
    /// holds no token a control plane could hold, or is too long, is refused saying why and
    /// never quoting it.
    #[test]
    fn a_token_file_holds_one_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        for (content, token) in [
            ("agent-secret-0123\n", "agent-secret-0123"),
            ("  agent-secret-0123\r\n\n", "agent-secret-0123"),
            ("agent secret", "agent secret"),
            ("\u{feff}agent-secret-0123\r\n", "agent-secret-0123"),
        ] {
            std::fs::write(&path, content).unwrap();
            assert_eq!(read_token(&path).unwrap(), bearer(token), "{content:?}");
        }
        for (content, says) in [
            ("\n", "it is empty".to_owned()),
            (
                "agent-secret\nsecond-line",
                "it holds a character other than printable ASCII and the space, or more than \
                 one line"
                    .to_owned(),
            ),
            (
                "ag\u{e9}nt",
                "it holds a character other than printable ASCII and the space, or more than \
                 one line"
                    .to_owned(),
            ),
            (
                &"a".repeat(MAX_TOKEN_FILE_BYTES + 1),
                format!("it is longer than {MAX_TOKEN_FILE_BYTES} bytes: is it the token file?"),
            ),
        ] {
            std::fs::write(&path, content).unwrap();
            assert_eq!(read_token(&path).unwrap_err(), says, "{content:?}");
        }
        // Only ASCII white space is left out: a no-break space is no token's.
        std::fs::write(&path, "agent-secret-0123\u{a0}\n").unwrap();
        assert!(read_token(&path).unwrap_err().contains("printable ASCII"));
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(read_token(&path).unwrap_err().contains("printable ASCII"));
        let gone = read_token(&dir.path().join("nosuch")).unwrap_err();
        assert!(gone.starts_with("cannot open it: "), "{gone}");
    }

    /// Each read takes the file's token as it is now; a read that cannot use the file keeps
    /// the token read before, and says so once until the reason changes.
    #[tokio::test]
    async fn a_rewritten_file_is_taken_and_a_bad_one_keeps_the_token_before() {
        let (logs, _guard) = crate::test_logs::Logs::capture();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first-secret-0123\n").unwrap();
        let file = TokenFile::open(&path).unwrap();
        reads(&file, "first-secret-0123").await;
        std::fs::write(&path, "second-secret-0123\n").unwrap();
        reads(&file, "second-secret-0123").await;
        std::fs::remove_file(&path).unwrap();
        for _ in 0..3 {
            reads(&file, "second-secret-0123").await;
        }
        std::fs::write(&path, "\n").unwrap();
        reads(&file, "second-secret-0123").await;
        std::fs::write(&path, "third-secret-0123").unwrap();
        reads(&file, "third-secret-0123").await;
        let text = logs.text();
        assert_eq!(text.matches("holds a new token").count(), 2, "{text}");
        assert_eq!(
            text.matches("cannot use the agent token file").count(),
            2,
            "{text}"
        );
        assert_eq!(text.matches("can be used again").count(), 0, "{text}");
        // Readable again with the token in use: said once, at info.
        std::fs::remove_file(&path).unwrap();
        reads(&file, "third-secret-0123").await;
        std::fs::write(&path, "third-secret-0123").unwrap();
        reads(&file, "third-secret-0123").await;
        let text = logs.text();
        assert_eq!(text.matches("can be used again").count(), 1);
        for secret in ["first-secret", "second-secret", "third-secret"] {
            assert!(!text.contains(secret), "{text}");
        }
        assert!(matches!(
            TokenFile::open(&dir.path().join("nosuch")),
            Err(AgentError::TokenFile { .. })
        ));
    }

    /// A FIFO is refused before it is opened (opening one waits for a writer, for good).
    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        let Err(AgentError::TokenFile { reason, .. }) = TokenFile::open(&path) else {
            panic!("a FIFO taken as a token file");
        };
        assert_eq!(reason, "it is a FIFO or a socket, not a file");
    }

    /// A token file whose read under way is `pending`, its last token `last`, each read
    /// waited for 10 ms.
    fn under_way(path: &Path, last: Option<&str>) -> (TokenFile, oneshot::Sender<ReadResult>) {
        let (answer, pending) = oneshot::channel();
        let file = TokenFile {
            path: path.to_owned(),
            wait: Duration::from_millis(10),
            state: Mutex::new(State {
                last: last.map(bearer),
                pending: Some(pending),
                ..State::default()
            }),
        };
        (file, answer)
    }

    /// A read that does not end in time leaves the token read before in use, warned of; the
    /// next read waits for that one rather than starting another, and takes its answer.
    #[tokio::test]
    async fn a_read_that_does_not_end_in_time_keeps_the_token_before_until_it_ends() {
        let (logs, _guard) = crate::test_logs::Logs::capture();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let (mut file, answer) = under_way(&path, Some("first-secret-0123"));
        for _ in 0..3 {
            reads(&file, "first-secret-0123").await;
            assert!(
                file.state.lock().unwrap().pending.is_some(),
                "kept, not started again"
            );
        }
        // Its answer, a new token, is taken once a second read (of the file, waited for as
        // long as a read is at most) agrees.
        answer.send(Ok(bearer("second-secret-0123"))).unwrap();
        std::fs::write(&path, "second-secret-0123\n").unwrap();
        file.wait = READ_WAIT;
        reads(&file, "second-secret-0123").await;
        let text = logs.text();
        assert_eq!(
            text.matches("could not be read within 10 ms").count(),
            1,
            "{text}"
        );
        assert_eq!(text.matches("holds a new token").count(), 1, "{text}");
    }

    /// A content other than the token in use is taken only once two reads agree: a read
    /// that caught a file rewritten in place half written (here, the answer under way) is
    /// read again, and the file's whole token taken.
    #[tokio::test]
    async fn a_new_content_is_taken_once_two_reads_agree() {
        let (logs, _guard) = crate::test_logs::Logs::capture();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "second-secret-0123\n").unwrap();
        let (mut file, answer) = under_way(&path, Some("first-secret-0123"));
        file.wait = READ_WAIT;
        answer.send(Ok(bearer("second-sec"))).unwrap();
        reads(&file, "second-secret-0123").await;
        assert_eq!(logs.text().matches("holds a new token").count(), 1);
    }

    /// With no token read yet (a first read that did not end in time at `connect`), a
    /// stream's read waits for it no longer than any read, and says there is none (the
    /// stream is tried again after the backoff); the read goes on, and a later stream takes
    /// its answer. A cancel while it waits is told apart.
    #[tokio::test]
    async fn a_slow_first_read_is_waited_for_by_the_streams_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let (file, answer) = under_way(&dir.path().join("token"), None);
        let cancelled = CancellationToken::new();
        cancelled.cancel();
        assert_eq!(bounded(&file, &cancelled).await, Err(NoToken::Cancelled));
        let cancel = CancellationToken::new();
        for _ in 0..2 {
            assert_eq!(
                bounded(&file, &cancel).await,
                Err(NoToken::NotRead(
                    "it could not be read within 10 ms (a volume that does not answer?)".to_owned()
                ))
            );
        }
        answer.send(Ok(bearer("first-secret-0123"))).unwrap();
        reads(&file, "first-secret-0123").await;
    }

    /// A first read that fails leaves no token: the stream is not opened, and not taken for
    /// the agent's shutdown; a later read of a file that can be used gives its token.
    #[tokio::test]
    async fn a_first_read_that_fails_is_tried_again_at_the_next_stream() {
        let (logs, _guard) = crate::test_logs::Logs::capture();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let (mut file, answer) = under_way(&path, None);
        file.wait = READ_WAIT;
        answer.send(Err("cannot open it: gone".to_owned())).unwrap();
        let cancel = CancellationToken::new();
        assert_eq!(
            bounded(&file, &cancel).await,
            Err(NoToken::NotRead("cannot open it: gone".to_owned()))
        );
        assert!(
            logs.text().contains("no stream is opened until it can be"),
            "{}",
            logs.text()
        );
        std::fs::write(&path, "first-secret-0123\n").unwrap();
        reads(&file, "first-secret-0123").await;
    }

    /// A new content read once is kept for the next stream's read to confirm: reads that each
    /// end on another stream's turn still move to a rotated token.
    #[tokio::test]
    async fn a_new_content_read_once_is_confirmed_by_a_later_streams_read() {
        let dir = tempfile::tempdir().unwrap();
        // No file at the path: each read started afresh fails.
        let (mut file, answer) = under_way(&dir.path().join("token"), Some("first-secret-0123"));
        file.wait = READ_WAIT;
        answer.send(Ok(bearer("second-secret-0123"))).unwrap();
        reads(&file, "first-secret-0123").await;
        let (answer, pending) = oneshot::channel();
        file.lock().pending = Some(pending);
        answer.send(Ok(bearer("second-secret-0123"))).unwrap();
        reads(&file, "second-secret-0123").await;
    }
}
