//! The agent token each stream is opened with: the one given to
//! [`crate::AgentBuilder::token`], or the content of the file given to
//! [`crate::AgentBuilder::token_file`], read again before each stream is opened, so that a
//! rotated secret (a mounted Kubernetes secret, a file a vault agent rewrites) reaches a
//! running service without a restart. A read that fails, or finds no token a control plane
//! could hold, keeps the token read before, warned of once until the reason changes; the file
//! is never logged from, only named.
//!
//! Reads run on a thread of their own and are waited for at most [`READ_WAIT`]: a file on a
//! volume that stops answering must hold neither `connect` nor the stream task (nor the
//! agent's shutdown, nor the runtime's: a blocking task of tokio's would be waited for when
//! the runtime is dropped). A read still under way is waited for by the next stream rather
//! than started again. A FIFO or a socket is refused before it is opened (opening a FIFO
//! waits for a writer). A content other than the token in use is taken only once two reads
//! 50 ms apart agree, so that a file rewritten in place, caught between its truncation and
//! its last write, does not send a piece of a secret.

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

impl TokenSource {
    /// The token to open the next stream with; `None` only when `cancel` fired while no token
    /// had been read yet.
    pub(crate) async fn current(&self, cancel: &CancellationToken) -> Option<AsciiMetadataValue> {
        match self {
            TokenSource::Fixed(value) => Some(value.clone()),
            TokenSource::File(file) => file.read(cancel).await,
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
    /// The token last read (`None` while the first read is under way).
    last: Option<AsciiMetadataValue>,
    /// Why the reads since then failed, warned of once until it changes.
    failing: Option<String>,
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
    /// the token read before (with none yet, waiting for the read until `cancel`). A content
    /// other than the token in use is taken once two reads [`CONFIRM_AFTER`] apart agree.
    async fn read(&self, cancel: &CancellationToken) -> Option<AsciiMetadataValue> {
        let last = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last
            .clone();
        let mut seen: Option<AsciiMetadataValue> = None;
        for attempt in 0..MOST_READS {
            if attempt > 0 {
                tokio::select! {
                    () = tokio::time::sleep(CONFIRM_AFTER) => {}
                    () = cancel.cancelled() => return last,
                }
            }
            let Some(read) = self.read_once(last.is_some(), cancel).await else {
                return last;
            };
            match read {
                Err(reason) => {
                    self.failed(reason);
                    return last;
                }
                // The first token (nothing better to use), the one in use again, or a new one
                // read twice alike.
                Ok(value)
                    if last.is_none()
                        || last.as_ref() == Some(&value)
                        || seen.as_ref() == Some(&value) =>
                {
                    self.taken(&value);
                    return Some(value);
                }
                Ok(value) => seen = Some(value),
            }
        }
        self.failed("it changed at each read (is it being written in place?)".to_owned());
        last
    }

    /// One read's answer: the read under way, or a new one; `None` (the token read before is
    /// to be used) when `cancel` fires, or, when `bounded`, it has not answered within the
    /// wait (it stays under way, for the next read to wait for).
    async fn read_once(&self, bounded: bool, cancel: &CancellationToken) -> Option<ReadResult> {
        let pending = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pending
            .take();
        let mut pending = match pending {
            Some(pending) => pending,
            None => match spawn_read(&self.path) {
                Ok((found, _)) => found,
                Err(reason) => return Some(Err(reason)),
            },
        };
        let wait = async {
            if bounded {
                tokio::time::sleep(self.wait).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            read = &mut pending => Some(
                read.unwrap_or_else(|_| Err("the read ended without an answer".to_owned())),
            ),
            () = cancel.cancelled() => {
                self.state.lock().unwrap_or_else(PoisonError::into_inner).pending = Some(pending);
                None
            }
            () = wait => {
                self.state.lock().unwrap_or_else(PoisonError::into_inner).pending = Some(pending);
                self.failed(format!(
                    "it could not be read within {} ms (a volume that does not answer?)",
                    self.wait.as_millis()
                ));
                None
            }
        }
    }

    /// `value` read and taken: said at info when it is a new token, or when the file can be
    /// used again after reads that failed.
    fn taken(&self, value: &AsciiMetadataValue) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.last.as_ref().is_some_and(|last| last != value) {
            info!(file = %self.path.display(), "the agent token file holds a new token: streams from now on use it");
        } else if state.failing.is_some() {
            info!(file = %self.path.display(), "the agent token file can be used again");
        }
        state.last = Some(value.clone());
        state.failing = None;
    }

    /// A read that failed for `reason`: warned of once until the reason changes.
    fn failed(&self, reason: String) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.failing.as_deref() != Some(reason.as_str()) {
            warn!(file = %self.path.display(), %reason, "cannot use the agent token file; the token read before stays in use");
            state.failing = Some(reason);
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

    /// Asserts that the next read of `file` gives `token`.
    async fn reads(file: &TokenFile, token: &str) {
        let cancel = CancellationToken::new();
        assert_eq!(file.read(&cancel).await.unwrap(), bearer(token));
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
        assert_eq!(logs.text().matches("can be used again").count(), 1);
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
                failing: None,
                pending: Some(pending),
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

    /// With no token read yet (a first read that did not end in time at `connect`), the
    /// first stream's read waits for it, or for the agent's shutdown.
    #[tokio::test]
    async fn a_slow_first_read_is_waited_for_by_the_first_stream() {
        let dir = tempfile::tempdir().unwrap();
        let (file, answer) = under_way(&dir.path().join("token"), None);
        let cancelled = CancellationToken::new();
        cancelled.cancel();
        assert_eq!(file.read(&cancelled).await, None);
        let cancel = CancellationToken::new();
        let read = file.read(&cancel);
        tokio::pin!(read);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut read)
                .await
                .is_err(),
            "no token to use meanwhile"
        );
        answer.send(Ok(bearer("first-secret-0123"))).unwrap();
        assert_eq!(read.await.unwrap(), bearer("first-secret-0123"));
    }
}
