//! The agent token each stream is opened with: the one given to
//! [`crate::AgentBuilder::token`], or the content of the file given to
//! [`crate::AgentBuilder::token_file`], read again before each stream is opened, so that a
//! rotated secret (a mounted Kubernetes secret, a file a vault agent rewrites) reaches a
//! running service without a restart. A read that fails, or finds no token a control plane
//! could hold, keeps the token read before, warned of once until the reason changes; the file
//! is never logged from, only named.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use tonic::metadata::AsciiMetadataValue;
use tracing::{info, warn};

use crate::error::AgentError;

/// The most bytes a token file is read to: a token is a line of printable ASCII, and a path
/// pointed at another file by mistake must not be read whole.
pub const MAX_TOKEN_FILE_BYTES: usize = 4096;

/// Where a stream's token comes from.
#[derive(Debug)]
pub(crate) enum TokenSource {
    /// Given once, for the agent's life.
    Fixed(AsciiMetadataValue),
    /// Read from a file before each stream.
    File(TokenFile),
}

impl TokenSource {
    /// The token to open the next stream with.
    pub(crate) async fn current(&self) -> AsciiMetadataValue {
        match self {
            TokenSource::Fixed(value) => value.clone(),
            TokenSource::File(file) => file.read().await,
        }
    }
}

/// A token file and the token last read from it.
#[derive(Debug)]
pub(crate) struct TokenFile {
    path: PathBuf,
    /// The token last read, and the reason a read since failed (warned of once).
    last: Mutex<(AsciiMetadataValue, Option<String>)>,
}

impl TokenFile {
    /// Reads `path` a first time: an agent given a file it cannot use is refused at once.
    pub(crate) fn open(path: &Path) -> Result<Self, AgentError> {
        let value = read_token(path).map_err(|reason| AgentError::TokenFile {
            path: path.to_owned(),
            reason,
        })?;
        Ok(Self {
            path: path.to_owned(),
            last: Mutex::new((value, None)),
        })
    }

    /// Reads the file again: its token, or, when that fails, the token read before.
    async fn read(&self) -> AsciiMetadataValue {
        let path = self.path.clone();
        let read = tokio::task::spawn_blocking(move || read_token(&path))
            .await
            .unwrap_or_else(|e| Err(format!("the read did not finish: {e}")));
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match read {
            Ok(value) => {
                if value != last.0 {
                    info!(file = %self.path.display(), "the agent token file holds a new token: streams from now on use it");
                }
                *last = (value, None);
            }
            Err(reason) => {
                if last.1.as_deref() != Some(reason.as_str()) {
                    warn!(file = %self.path.display(), %reason, "cannot use the agent token file; the token read before stays in use");
                    last.1 = Some(reason);
                }
            }
        }
        last.0.clone()
    }
}

/// The token in the file at `path`: its content without the white space around it (a secret
/// file often ends with a newline), as [`crate::agent::bearer`] sends it; else why not, never
/// quoting the file.
fn read_token(path: &Path) -> Result<AsciiMetadataValue, String> {
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
    crate::agent::bearer(text.trim()).map_err(|_| {
        if text.trim().is_empty() {
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
        assert_eq!(file.read().await, bearer("first-secret-0123"));
        std::fs::write(&path, "second-secret-0123\n").unwrap();
        assert_eq!(file.read().await, bearer("second-secret-0123"));
        std::fs::remove_file(&path).unwrap();
        for _ in 0..3 {
            assert_eq!(file.read().await, bearer("second-secret-0123"));
        }
        std::fs::write(&path, "\n").unwrap();
        assert_eq!(file.read().await, bearer("second-secret-0123"));
        std::fs::write(&path, "third-secret-0123").unwrap();
        assert_eq!(file.read().await, bearer("third-secret-0123"));
        let text = logs.text();
        assert_eq!(text.matches("holds a new token").count(), 2, "{text}");
        assert_eq!(
            text.matches("cannot use the agent token file").count(),
            2,
            "{text}"
        );
        for secret in ["first-secret", "second-secret", "third-secret"] {
            assert!(!text.contains(secret), "{text}");
        }
        assert!(matches!(
            TokenFile::open(&dir.path().join("nosuch")),
            Err(AgentError::TokenFile { .. })
        ));
    }
}
