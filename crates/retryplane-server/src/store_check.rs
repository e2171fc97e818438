//! The version store, checked while the control plane runs.
//!
//! A store that fails between two changes (its file deleted or replaced, its file system
//! remounted read-only, the disk failing) would otherwise show nowhere until the next change
//! failed on it: agents are served from memory, and nothing reads the store meanwhile. Worse,
//! a deleted store file is found at the next start only, which creates a new, empty store in
//! its place. So the control plane checks its store
//! ([`crate::store::VersionStore::check`]) every [`INTERVAL`], and again right after each
//! change (not a dry run), and shows what it found in three places:
//!
//! - `retryplane_server_store_healthy` on `/metrics`: 1 while the checks pass, 0 from the
//!   first one that fails (an alert's condition);
//! - the log: an error when the store starts failing (and when its problem changes), with what
//!   to do; an info line when it passes again;
//! - `FleetStatus`'s `store` ([`StoreHealth::state`]): the line `retryplane status` prints
//!   while the store fails.
//!
//! The check writes nothing, so a full disk shows only once a change fails on it
//! (`retryplane_server_store_failures`).

use std::sync::PoisonError;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use retryplane_policy::diag::LogPath;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tracing::{error, info};

use crate::control::ControlPlane;
use crate::fleet::unix_ms;
use crate::store::StoreError;

/// How often the store is checked.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// The longest [`StoreState::problem`] kept, in bytes (as a policy file's problem).
const MAX_PROBLEM_BYTES: usize = 1_024;

/// What the last check of the store found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreState {
    /// When it was checked, Unix milliseconds (0 before the first check).
    pub checked_unix_ms: u64,
    /// `None` when the check passed; else why it failed, and since when the checks fail.
    pub failing: Option<StoreFailing>,
}

/// A store that fails its checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreFailing {
    /// The first failed check of this run of them, Unix milliseconds.
    pub since_unix_ms: u64,
    /// Why the last one failed, on one line (the error and its causes, cut to 1,024 bytes).
    pub problem: String,
}

/// The store's last check, for `FleetStatus` and `/metrics`, and the way to ask for the next
/// one sooner. Shared by the check's task and the control plane.
#[derive(Debug)]
pub struct StoreHealth {
    state: std::sync::Mutex<StoreState>,
    /// `retryplane_server_store_healthy` (a handle on the one `/metrics` shows).
    gauge: Gauge,
    /// Wakes the check's task before its next tick.
    soon: Notify,
}

impl StoreHealth {
    /// Healthy until a check says otherwise; sets `gauge` to 1.
    pub fn new(gauge: Gauge) -> Self {
        gauge.set(1);
        Self {
            state: std::sync::Mutex::new(StoreState {
                checked_unix_ms: 0,
                failing: None,
            }),
            gauge,
            soon: Notify::new(),
        }
    }

    /// What the last check found.
    pub fn state(&self) -> StoreState {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Asks for a check now, rather than at the next tick (after a change reached the store:
    /// one that failed shows at once, and one that worked clears a failure).
    pub fn check_soon(&self) {
        self.soon.notify_one();
    }

    /// Keeps what a check of the store at `file` found, sets the gauge from it, and logs a
    /// change of state.
    pub(crate) fn note(&self, file: &std::path::Path, outcome: Result<(), &StoreError>) {
        let now = unix_ms();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.checked_unix_ms = now;
        match outcome {
            Ok(()) => {
                self.gauge.set(1);
                if let Some(was) = state.failing.take() {
                    info!(
                        store = %LogPath(file),
                        failing_for_s = now.saturating_sub(was.since_unix_ms) / 1_000,
                        "the version store passes its checks again; changes are stored again"
                    );
                }
            }
            Err(e) => {
                self.gauge.set(0);
                let problem = crate::ErrorChain(e).to_string();
                let problem =
                    retryplane_policy::diag::cut_marked(&problem, MAX_PROBLEM_BYTES).into_owned();
                if state.failing.as_ref().map(|f| &f.problem) != Some(&problem) {
                    error!(
                        store = %LogPath(file),
                        problem = %problem,
                        "the version store is failing: agents keep the version served (from \
                         memory), but no change can be stored; keep a copy of the versions \
                         (`retryplane history`, `retryplane get`) before a restart"
                    );
                }
                let since_unix_ms = state.failing.as_ref().map_or(now, |f| f.since_unix_ms);
                state.failing = Some(StoreFailing {
                    since_unix_ms,
                    problem,
                });
            }
        }
    }
}

/// Checks `control`'s store (its file at `file`, for the log) every `every`, and whenever
/// [`StoreHealth::check_soon`] asks, until `shutdown` turns true, and sets
/// `retryplane_server_store_bytes` after each check. The checks run on the blocking threads,
/// one at a time; the task ends once the check under way is over (aborting it would leave
/// that check holding the store).
pub fn spawn(
    control: &ControlPlane,
    file: std::path::PathBuf,
    every: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let store = control.store.clone();
    let health = control.store_health.clone();
    let metrics = control.metrics.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // Shutdown first: a tick due as well must not start another check.
                biased;
                _ = shutdown.wait_for(|stop| *stop) => break,
                _ = ticks.tick() => {}
                () = health.soon.notified() => {}
            }
            let checked = store.clone();
            let outcome = tokio::task::spawn_blocking(move || checked.check()).await;
            match outcome {
                Ok(outcome) => health.note(&file, outcome.as_ref().map(|_| ())),
                // The check panicked (a bug; the panic is on stderr): said as a failure, so
                // that it is seen, in words that do not change from one check to the next (a
                // task's id would make each a new reason, logged again).
                Err(_) => health.note(
                    &file,
                    Err(&StoreError::Backend(
                        "the store's check did not finish (it panicked)".into(),
                    )),
                ),
            }
            metrics.note_store_size(store.as_ref());
        }
    })
}

#[cfg(test)]
#[path = "store_check_tests.rs"]
mod tests;
