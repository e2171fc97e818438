//! Log capture for the crate's unit tests: this thread's tracing output into a buffer.

use std::sync::{Arc, Mutex};

/// A log sink shared with the test.
#[derive(Clone, Default)]
pub(crate) struct Sink(Arc<Mutex<Vec<u8>>>);

impl Sink {
    /// Everything written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// This thread's logs that pass `filter` (an `EnvFilter` directive), for as long as the guard
/// lives.
pub(crate) fn capture(filter: &str) -> (Sink, tracing::subscriber::DefaultGuard) {
    let log = Sink::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    // Other tests of this binary run on other threads with no subscriber. A callsite they
    // registered while this subscriber was being set up can keep an interest of "never";
    // rebuilding the interests now makes this subscriber count for every callsite.
    tracing::callsite::rebuild_interest_cache();
    (log, guard)
}
