use std::fs;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::*;
use crate::aggregate::Aggregator;
use crate::control::Mode;
use crate::fleet::Fleet;
use crate::metrics::ServerMetrics;
use crate::publisher::Publisher;
use crate::store::{MemoryStore, VersionStore};

/// SPEC/issue 3: a valid save is published within a second.
const PUBLISH_BOUND: Duration = Duration::from_secs(1);

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
const V2: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n";
const V3: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 5\n";
const INVALID: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n";

struct Fixture {
    dir: tempfile::TempDir,
    file: PathBuf,
    control: Arc<ControlPlane>,
    _stop: watch::Sender<bool>,
}

/// A control plane in file mode serving `V1` as version 1, with the watcher running.
async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policies.yaml");
    fs::write(&file, V1).unwrap();
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    let control = Arc::new(ControlPlane::new(
        store,
        Arc::new(Publisher::new(10_000)),
        Arc::new(Fleet::new(100)),
        Arc::new(ServerMetrics::new()),
        Arc::new(Aggregator::new(100, tokio::time::Instant::now())),
        Mode::File(file.clone()),
    ));
    reload(&control, &file).await;
    assert_eq!(current_version(&control), Some(1));
    let (stop, shutdown) = watch::channel(false);
    spawn(control.clone(), file.clone(), DEBOUNCE, shutdown).unwrap();
    Fixture {
        dir,
        file,
        control,
        _stop: stop,
    }
}

fn current_version(control: &ControlPlane) -> Option<u64> {
    control.publisher.current().map(|s| s.version)
}

/// Saves like vim or `sed -i`: a new file renamed over the old one.
fn save_by_rename(f: &Fixture, contents: &str) {
    let tmp = f.dir.path().join(".policies.yaml.swp");
    fs::write(&tmp, contents).unwrap();
    fs::rename(&tmp, &f.file).unwrap();
}

async fn wait_for_version(control: &ControlPlane, version: u64, bound: Duration) {
    let mut snapshots = control.publisher.subscribe();
    tokio::time::timeout(
        bound,
        snapshots.wait_for(|s| s.as_ref().is_some_and(|s| s.version == version)),
    )
    .await
    .unwrap_or_else(|_| panic!("version {version} was not published within {bound:?}"))
    .unwrap();
}

/// Polls `done` every 10 ms for at most 5 s.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let polled = tokio::time::timeout(Duration::from_secs(5), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(polled.is_ok(), "timed out waiting for {what}");
}

async fn max_attempts_served(control: &ControlPlane) -> Option<u32> {
    let snapshot = control.publisher.current()?;
    let doc = retryplane_policy::PolicyDocument::try_from((*snapshot.document).clone()).ok()?;
    doc.endpoint("payments")?
        .overlay
        .max_attempts
        .as_ref()
        .map(|f| f.value)
}

#[tokio::test]
async fn rename_save_is_published_within_a_second() {
    let f = fixture().await;
    save_by_rename(&f, V2);
    wait_for_version(&f.control, 2, PUBLISH_BOUND).await;
    assert_eq!(max_attempts_served(&f.control).await, Some(4));
}

#[tokio::test]
async fn a_burst_of_writes_is_read_once_after_the_quiet_period() {
    let f = fixture().await;
    for contents in [V2, V1, V3] {
        fs::write(&f.file, contents).unwrap();
    }
    wait_for_version(&f.control, 2, PUBLISH_BOUND).await;
    assert_eq!(max_attempts_served(&f.control).await, Some(5));
    let history = f.control.blocking(|s| s.history(0)).await.unwrap();
    assert_eq!(history.len(), 2, "one version for the whole burst");
}

#[tokio::test]
async fn invalid_save_is_rejected_and_the_last_good_version_stays() {
    let f = fixture().await;
    save_by_rename(&f, INVALID);
    eventually("the invalid save to be rejected", || {
        f.control.metrics.rejected_changes.get() == 1
    })
    .await;
    assert_eq!(current_version(&f.control), Some(1));
    assert_eq!(max_attempts_served(&f.control).await, Some(3));
    // The next valid save goes through.
    save_by_rename(&f, V2);
    wait_for_version(&f.control, 2, PUBLISH_BOUND).await;
}

#[tokio::test]
async fn saving_the_same_content_publishes_nothing() {
    let f = fixture().await;
    save_by_rename(&f, &format!("# a comment\n{V1}"));
    save_by_rename(&f, V2);
    wait_for_version(&f.control, 2, PUBLISH_BOUND).await;
    let history = f.control.blocking(|s| s.history(0)).await.unwrap();
    assert_eq!(history.len(), 2);
}

#[tokio::test]
async fn other_files_in_the_directory_are_ignored() {
    let f = fixture().await;
    fs::write(f.dir.path().join("other.yaml"), INVALID).unwrap();
    save_by_rename(&f, V2);
    wait_for_version(&f.control, 2, PUBLISH_BOUND).await;
    assert_eq!(f.control.metrics.rejected_changes.get(), 0);
}

#[tokio::test]
async fn the_watcher_stops_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policies.yaml");
    fs::write(&file, V1).unwrap();
    let control = Arc::new(ControlPlane::new(
        Arc::new(MemoryStore::new()),
        Arc::new(Publisher::new(10_000)),
        Arc::new(Fleet::new(100)),
        Arc::new(ServerMetrics::new()),
        Arc::new(Aggregator::new(100, tokio::time::Instant::now())),
        Mode::File(file.clone()),
    ));
    let (stop, shutdown) = watch::channel(false);
    let task = spawn(control, file, DEBOUNCE, shutdown).unwrap();
    stop.send_replace(true);
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}
