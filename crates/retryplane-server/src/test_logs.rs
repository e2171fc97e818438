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

/// The global subscriber of the test binary: it records nothing, but says every callsite may be
/// wanted. A callsite first hit on a thread with no subscriber of its own gets its interest from
/// the subscribers alive at that instant; without this one, a hit that raced a test setting its
/// capture up could leave the callsite at "never" for good, and that test would wait in vain
/// for a line it logged.
struct Undecided;

impl tracing::Subscriber for Undecided {
    fn register_callsite(
        &self,
        _: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }

    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        false
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, _: &tracing::Event<'_>) {}

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// This thread's logs that pass `filter` (an `EnvFilter` directive), for as long as the guard
/// lives.
pub(crate) fn capture(filter: &str) -> (Sink, tracing::subscriber::DefaultGuard) {
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        // Another global subscriber set first does as well.
        let _ = tracing::subscriber::set_global_default(Undecided);
    });
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
