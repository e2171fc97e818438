use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::*;
use crate::control::{ChangeContent, ChangeRequest, Mode};
use crate::store::{MemoryStore, NewVersion, Published, VersionMeta, VersionRecord, VersionStore};

const FILE: &str = "/data/retryplane.redb";

/// A store kept in memory whose check fails while `failing` holds why, and whose publishes
/// fail the same way.
#[derive(Default)]
struct Checked {
    inner: MemoryStore,
    failing: Mutex<Option<&'static str>>,
    checks: AtomicUsize,
}

impl Checked {
    fn fail(&self, why: Option<&'static str>) {
        *self.failing.lock().unwrap() = why;
    }

    fn problem(&self) -> Result<(), StoreError> {
        match *self.failing.lock().unwrap() {
            Some(why) => Err(StoreError::Backend(why.into())),
            None => Ok(()),
        }
    }
}

impl VersionStore for Checked {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.inner.current()
    }

    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        self.inner.get(version)
    }

    fn history(&self, limit: usize, before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError> {
        self.inner.history(limit, before)
    }

    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError> {
        self.problem()?;
        self.inner.publish(new, expected)
    }

    fn check(&self) -> Result<(), StoreError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.problem()
    }
}

/// A control plane over a [`Checked`] store, checked every `every` by [`spawn`]'s task until
/// the sender turns true.
fn checked_every(
    every: Duration,
) -> (
    Arc<Checked>,
    ControlPlane,
    watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    let store = Arc::new(Checked::default());
    let control = ControlPlane::for_tests(store.clone(), Mode::Api);
    let (stop, stopped) = watch::channel(false);
    let task = spawn(&control, PathBuf::from(FILE), every, stopped);
    (store, control, stop, task)
}

/// Polls `done` every 10 ms for at most 10 s.
async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..1_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

#[test]
fn a_failing_store_shows_in_the_gauge_and_the_state_and_in_the_log_when_its_problem_changes() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let gauge = Gauge::default();
    let health = StoreHealth::new(gauge.clone());
    assert_eq!(gauge.get(), 1);
    assert_eq!(health.state().failing, None);
    let file = Path::new(FILE);
    let replaced = StoreError::FileReplaced {
        path: file.into(),
        descriptor: None,
    };
    health.note(file, Err(&replaced));
    assert_eq!(gauge.get(), 0);
    let first = health.state().failing.unwrap();
    assert!(
        first.problem.contains("was deleted or replaced"),
        "{first:?}"
    );
    assert!(first.since_unix_ms > 0);
    // The same problem at the next check: not logged again, and failing since the first.
    health.note(file, Err(&replaced));
    assert_eq!(health.state().failing.as_ref(), Some(&first));
    assert_eq!(
        log.text().matches("the version store is failing").count(),
        1
    );
    // Another problem: logged, still failing since the first check that failed.
    let read_only = StoreError::NotWritable {
        path: file.into(),
        why: "its file system is read-only",
    };
    health.note(file, Err(&read_only));
    let second = health.state().failing.unwrap();
    assert!(second.problem.contains("read-only"), "{second:?}");
    assert_eq!(second.since_unix_ms, first.since_unix_ms);
    assert_eq!(
        log.text().matches("the version store is failing").count(),
        2
    );
    health.note(file, Ok(()));
    assert_eq!(gauge.get(), 1);
    assert_eq!(health.state().failing, None);
    assert!(health.state().checked_unix_ms >= second.since_unix_ms);
    assert!(
        log.text().contains("passes its checks again"),
        "{}",
        log.text()
    );
}

#[test]
fn a_long_problem_is_kept_cut_at_1024_bytes_and_marked() {
    let health = StoreHealth::new(Gauge::default());
    let long = "x".repeat(5_000);
    let error = StoreError::Corrupt(long);
    health.note(Path::new(FILE), Err(&error));
    let kept = health.state().failing.unwrap().problem;
    assert_eq!(kept.len(), MAX_PROBLEM_BYTES + '…'.len_utf8());
    assert!(kept.ends_with('…'), "{kept}");
    assert!(
        kept.starts_with("the version store is corrupt: xxx"),
        "{kept}"
    );
}

/// The store is checked at start, then every interval; a change that reached it asks for a
/// check at once, so that a failed change shows before the next tick, and a stored one clears
/// the failure.
#[tokio::test]
async fn the_store_is_checked_at_start_and_at_once_after_each_change() {
    // An hour between ticks: every check after the first is one a change asked for.
    let (store, control, stop, task) = checked_every(Duration::from_secs(3_600));
    until("the first check", || {
        store.checks.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(control.store_health.state().failing, None);
    assert!(control.store_health.state().checked_unix_ms > 0);
    store.fail(Some("the disk is gone"));
    let change = |yaml: &str| ChangeRequest {
        content: ChangeContent::Document(Box::new(crate::control::tests::wire(yaml))),
        source: crate::store::Source::Admin,
        author: None,
        expected_version: None,
        dry_run: false,
        force: false,
        keep_endpoints: false,
    };
    let failed = control
        .apply(change("version: 1\nendpoints:\n  a: {max_attempts: 2}\n"))
        .await;
    assert!(failed.is_err(), "{failed:?}");
    until("the failed change's check", || {
        control.store_health.state().failing.is_some()
    })
    .await;
    assert_eq!(
        control.store_health.state().failing.unwrap().problem,
        "the version store backend failed: the disk is gone"
    );
    assert_eq!(control.metrics.store_healthy.get(), 0);
    store.fail(None);
    control
        .apply(change("version: 1\nendpoints:\n  a: {max_attempts: 2}\n"))
        .await
        .unwrap();
    until("the stored change's check", || {
        control.store_health.state().failing.is_none()
    })
    .await;
    assert_eq!(control.metrics.store_healthy.get(), 1);
    assert_eq!(store.checks.load(Ordering::SeqCst), 3);
    stop.send(true).unwrap();
    task.await.unwrap();
}

/// Without a change, a store that starts failing is seen at the next tick.
#[tokio::test]
async fn a_store_that_fails_between_changes_is_seen_at_the_next_tick() {
    let (store, control, stop, task) = checked_every(Duration::from_millis(20));
    until("the first check", || {
        store.checks.load(Ordering::SeqCst) >= 1
    })
    .await;
    store.fail(Some("the disk is gone"));
    until("a failing check", || {
        control.store_health.state().failing.is_some()
    })
    .await;
    store.fail(None);
    until("a passing check", || {
        control.store_health.state().failing.is_none()
    })
    .await;
    stop.send(true).unwrap();
    task.await.unwrap();
}
