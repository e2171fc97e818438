//! A change whose caller goes away half way: the store write and the publish happen together
//! or not at all.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex as StdMutex, mpsc as std_mpsc};
use std::time::Duration;

use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::admin_service_server::{AdminService as _, AdminServiceServer};
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use retryplane_proto::pb::{agent_message::Kind, policy_source};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use super::*;
use crate::admin::AdminApi;
use crate::agent_route::AgentRoute;
use crate::agent_stream::{AgentStreamService, Hook, StreamContext, StreamLimits};
use crate::fleet::unix_seconds;
use crate::store::{MemoryStore, VersionMeta};

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
const V2: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n";
const V3: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 5\n";

/// The longest any wait in these tests may take.
const WAIT: Duration = Duration::from_secs(10);

/// A memory store whose publishes, while the gate is closed, report that they started and then
/// wait until the test lets them go on (a slow commit).
struct GatedStore {
    inner: MemoryStore,
    closed: AtomicBool,
    entered: mpsc::UnboundedSender<()>,
    open: StdMutex<std_mpsc::Receiver<()>>,
}

/// The test's side of a [`GatedStore`].
struct Gate {
    store: Arc<GatedStore>,
    entered: mpsc::UnboundedReceiver<()>,
    open: std_mpsc::Sender<()>,
}

impl Gate {
    fn new() -> Self {
        let (entered_tx, entered) = mpsc::unbounded_channel();
        let (open, open_rx) = std_mpsc::channel();
        let store = Arc::new(GatedStore {
            inner: MemoryStore::new(),
            closed: AtomicBool::new(false),
            entered: entered_tx,
            open: StdMutex::new(open_rx),
        });
        Self {
            store,
            entered,
            open,
        }
    }

    fn close(&self) {
        self.store.closed.store(true, Ordering::SeqCst);
    }

    /// Lets the waiting publish go on; later publishes pass.
    fn open(&self) {
        self.store.closed.store(false, Ordering::SeqCst);
        self.open.send(()).unwrap();
    }
}

impl VersionStore for GatedStore {
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
        if self.closed.load(Ordering::SeqCst) {
            let _ = self.entered.send(());
            let open = self.open.lock().unwrap();
            open.recv_timeout(WAIT).unwrap();
        }
        self.inner.publish(new, expected)
    }
}

fn control(store: Arc<GatedStore>, mode: Mode) -> Arc<ControlPlane> {
    Arc::new(ControlPlane::for_tests(store, mode))
}

fn apply_request(yaml: &str) -> pb::ApplyRequest {
    pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(policy_source::Kind::Yaml(yaml.to_owned())),
            origin: String::new(),
        }),
        ..Default::default()
    }
}

/// Serves the agent and admin services of `control` on 127.0.0.1:0.
async fn serve(control: &Arc<ControlPlane>) -> (std::net::SocketAddr, watch::Sender<bool>) {
    serve_with(control, None).await
}

/// [`serve`], with `after_register` run as each agent stream is registered.
async fn serve_with(
    control: &Arc<ControlPlane>,
    after_register: Option<Hook>,
) -> (std::net::SocketAddr, watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = watch::channel(false);
    let ctx = StreamContext {
        publisher: control.publisher.clone(),
        fleet: control.fleet.clone(),
        metrics: control.metrics.clone(),
        aggregates: control.aggregates.clone(),
        limits: StreamLimits::default(),
        shutdown: stopped.clone(),
        tokens: None,
        after_register,
    };
    let router = Server::builder()
        .add_service(AgentRoute::new(
            AgentStreamService::new(Arc::new(ctx)),
            1 << 20,
        ))
        .add_service(AdminServiceServer::new(AdminApi::new(control.clone())));
    let mut stopped = stopped;
    tokio::spawn(
        router.serve_with_incoming_shutdown(TcpIncoming::from(listener), async move {
            let _ = stopped.wait_for(|s| *s).await;
        }),
    );
    (addr, stop)
}

async fn channel(addr: std::net::SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// An agent stream to `addr` that has sent `hello`: what the agent sends next, and what it
/// receives.
async fn connect_agent(
    addr: std::net::SocketAddr,
    hello: pb::Hello,
) -> (
    mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::ServerMessage>,
) {
    let (agent_tx, agent_rx) = mpsc::channel(4);
    agent_tx
        .send(pb::AgentMessage {
            kind: Some(Kind::Hello(hello)),
        })
        .await
        .unwrap();
    let inbound = AgentServiceClient::new(channel(addr).await)
        .connect(ReceiverStream::new(agent_rx))
        .await
        .unwrap()
        .into_inner();
    (agent_tx, inbound)
}

/// The next snapshot on `inbound`, waiting at most [`WAIT`].
async fn next_snapshot(inbound: &mut tonic::Streaming<pb::ServerMessage>) -> pb::Snapshot {
    let message = tokio::time::timeout(WAIT, inbound.message())
        .await
        .expect("a snapshot in time")
        .unwrap()
        .unwrap();
    message.decode_snapshot().unwrap().unwrap()
}

/// The next snapshot's version on `inbound`, waiting at most [`WAIT`].
async fn next_version(inbound: &mut tonic::Streaming<pb::ServerMessage>) -> u64 {
    next_snapshot(inbound).await.version
}

/// Drives `change` until the store's publish has started, then drops it, as hyper drops the
/// handler of an RPC whose client hung up.
async fn drop_mid_commit<F: std::future::Future>(gate: &mut Gate, change: F) {
    gate.close();
    let mut change = Box::pin(change);
    tokio::select! {
        _ = &mut change => panic!("the change finished while the store was held"),
        entered = gate.entered.recv() => entered.unwrap(),
    }
    drop(change);
    gate.open();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_apply_dropped_mid_commit_is_still_sent_to_agents() {
    let mut gate = Gate::new();
    let control = control(gate.store.clone(), Mode::Api);
    let api = AdminApi::new(control.clone());
    api.apply(Request::new(apply_request(V1))).await.unwrap();
    let (addr, _stop) = serve(&control).await;
    let hello = pb::Hello {
        agent_id: "a-1".to_owned(),
        service: "checkout".to_owned(),
        ..Default::default()
    };
    let (agent_tx, mut inbound) = connect_agent(addr, hello).await;
    assert_eq!(next_version(&mut inbound).await, 1);

    drop_mid_commit(&mut gate, api.apply(Request::new(apply_request(V2)))).await;

    // The running server serves what the store holds: to the connected agent and in status.
    assert_eq!(next_version(&mut inbound).await, 2);
    assert_eq!(control.store.current().unwrap().unwrap().meta.version, 2);
    let mut admin = AdminServiceClient::new(channel(addr).await);
    let fleet = admin
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fleet.current_version, 2);
    assert_eq!(control.metrics.current_version.get(), 2);
    // The next change is not held up by the one whose caller left.
    let applied = tokio::time::timeout(WAIT, admin.apply(apply_request(V3)))
        .await
        .unwrap()
        .unwrap()
        .into_inner();
    assert_eq!((applied.version, applied.changed), (3, true));
    assert_eq!(next_version(&mut inbound).await, 3);
    drop(agent_tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_dropped_mid_commit_is_still_published() {
    let mut gate = Gate::new();
    let control = control(gate.store.clone(), Mode::Api);
    let api = AdminApi::new(control.clone());
    api.apply(Request::new(apply_request(V1))).await.unwrap();
    api.apply(Request::new(apply_request(V2))).await.unwrap();
    let rollback = api.rollback(Request::new(pb::RollbackRequest {
        version: 1,
        ..Default::default()
    }));
    drop_mid_commit(&mut gate, rollback).await;
    until_published(&control, 3, "the rollback is published").await;
    let current = control.store.current().unwrap().unwrap();
    assert_eq!(current.meta.source, Source::Rollback { from: 1 });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_reload_dropped_mid_commit_is_still_published() {
    let mut gate = Gate::new();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policies.yaml");
    std::fs::write(&file, V1).unwrap();
    let control = control(gate.store.clone(), Mode::File(file.clone()));
    crate::watch::reload(&control, &file).await;
    assert_eq!(control.publisher.current().unwrap().version, 1);
    std::fs::write(&file, V2).unwrap();
    drop_mid_commit(&mut gate, crate::watch::reload(&control, &file)).await;
    until_published(&control, 2, "the saved file is published").await;
}

/// A store whose reads fail, counting them.
struct BrokenStore {
    reads: std::sync::atomic::AtomicUsize,
}

impl VersionStore for BrokenStore {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        Err(StoreError::Corrupt("unreadable".to_owned()))
    }

    fn get(&self, _version: u64) -> Result<Option<VersionRecord>, StoreError> {
        Err(StoreError::Corrupt("unreadable".to_owned()))
    }

    fn history(&self, _limit: usize, _before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError> {
        Err(StoreError::Corrupt("unreadable".to_owned()))
    }

    fn publish(&self, _new: NewVersion, _expected: Option<u64>) -> Result<Published, StoreError> {
        Err(StoreError::Corrupt("unwritable".to_owned()))
    }
}

fn change(document: pb::PolicyDocument) -> ChangeRequest {
    ChangeRequest {
        content: ChangeContent::Document(Box::new(document)),
        source: Source::Admin,
        author: None,
        expected_version: None,
        dry_run: false,
        force: false,
        keep_endpoints: false,
    }
}

#[tokio::test]
async fn an_invalid_change_is_refused_before_the_store_is_read() {
    let store = Arc::new(BrokenStore {
        reads: std::sync::atomic::AtomicUsize::new(0),
    });
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    let valid = retryplane_policy::load(V1.as_bytes()).policies.unwrap();
    let valid = pb::PolicyDocument::from(valid.document().as_ref());
    let mut invalid = valid.clone();
    invalid.endpoints[0]
        .overlay
        .get_or_insert_with(Default::default)
        .max_attempts = Some(0);

    let refused = control.apply(change(invalid)).await.unwrap_err();
    assert!(matches!(refused, ChangeError::Invalid(_)), "{refused:?}");
    // Its message names the first error, not only a count.
    assert!(
        refused
            .to_string()
            .starts_with("invalid policies: 1 error(s), first: ")
            && refused.to_string().contains("max_attempts"),
        "{refused}"
    );
    assert_eq!(store.reads.load(Ordering::SeqCst), 0, "the store was read");
    assert_eq!(control.metrics.rejected_changes.get(), 1);

    let failed = control.apply(change(valid)).await.unwrap_err();
    assert!(
        matches!(failed, ChangeError::Store(StoreError::Corrupt(_))),
        "{failed:?}"
    );
    assert_eq!(store.reads.load(Ordering::SeqCst), 1);
    assert_eq!(
        control.metrics.rejected_changes.get(),
        1,
        "a store failure is no rejection"
    );
    assert_eq!(
        control.metrics.store_failures.get(),
        1,
        "but a store failure"
    );
}

/// Every change is counted against the item limit where it is made, whoever makes it: a
/// document over it is refused before it is validated or the store is read, counted as a
/// rejected change unless it is a dry run.
#[tokio::test]
async fn a_change_holding_more_than_a_policy_file_can_is_refused_before_anything_reads_it() {
    let store = Arc::new(BrokenStore {
        reads: std::sync::atomic::AtomicUsize::new(0),
    });
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    // Every endpoint invalid too: the count comes before the validator.
    let large = pb::PolicyDocument {
        defaults: None,
        endpoints: (0..=retryplane_proto::convert::MAX_ITEMS / 2)
            .map(|i| pb::Endpoint {
                name: format!("e{i}"),
                overlay: Some(pb::Overlay {
                    max_attempts: Some(0),
                    ..Default::default()
                }),
                routes: vec![],
            })
            .collect(),
    };
    let dry_run = ChangeRequest {
        dry_run: true,
        ..change(large.clone())
    };
    for (request, rejected) in [(dry_run, 0), (change(large), 1)] {
        let refused = control.apply(request).await.unwrap_err();
        assert!(
            matches!(&refused, ChangeError::TooManyItems(d)
                if d.message.contains("the document is too large")),
            "{refused:?}"
        );
        assert_eq!(control.metrics.rejected_changes.get(), rejected);
    }
    assert_eq!(store.reads.load(Ordering::SeqCst), 0, "the store was read");
}

/// A change over the item limit is refused while another change holds the change lock (its
/// store write and publish): it does not wait for a turn it could never use. (Under the paused
/// clock a change that waited would let the bound pass at once.)
#[tokio::test(start_paused = true)]
async fn a_change_over_the_item_limit_does_not_wait_for_the_change_lock() {
    let store = Arc::new(BrokenStore {
        reads: std::sync::atomic::AtomicUsize::new(0),
    });
    let control = Arc::new(ControlPlane::for_tests(store, Mode::Api));
    let _held = control.changes.clone().lock_owned().await;
    let large = crate::store::over_the_item_limit();
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        control.apply(change(large)),
    )
    .await
    .expect("the change waited for the lock")
    .unwrap_err();
    assert!(
        matches!(&refused, ChangeError::TooManyItems(_)),
        "{refused:?}"
    );
    assert_eq!(control.metrics.rejected_changes.get(), 1);
}

#[test]
fn a_store_failure_keeps_the_disks_error_for_logs_and_start_up_errors() {
    let disk = std::io::Error::new(std::io::ErrorKind::StorageFull, "No space left on device");
    let failed = ChangeError::from(StoreError::Backend(Box::new(disk)));
    assert_eq!(
        crate::ErrorChain(&failed).to_string(),
        "the version store backend failed: No space left on device"
    );
    let start = crate::server::ServeError::Apply {
        file: PathBuf::from("policies.yaml"),
        source: failed,
    };
    // What `retryplane serve` prints when it cannot start.
    assert_eq!(
        format!("{:#}", anyhow::Error::new(start)),
        "cannot apply the policy file policies.yaml: the version store backend failed: No space \
         left on device"
    );
}

#[tokio::test]
async fn a_dry_run_on_an_empty_store_with_an_expected_version_is_a_conflict_as_the_apply_is() {
    let control = Arc::new(ControlPlane::for_tests(
        Arc::new(MemoryStore::default()),
        Mode::Api,
    ));
    let valid = retryplane_policy::load(V1.as_bytes()).policies.unwrap();
    let valid = pb::PolicyDocument::from(valid.document().as_ref());
    for dry_run in [true, false] {
        let refused = control
            .apply(ChangeRequest {
                expected_version: Some(3),
                dry_run,
                ..change(valid.clone())
            })
            .await
            .unwrap_err();
        assert!(
            matches!(
                refused,
                ChangeError::Conflict {
                    expected: 3,
                    current: 0,
                    holds_it: false,
                    made_by: None,
                }
            ),
            "dry run {dry_run}: {refused:?}"
        );
    }
    // 0 is what an empty store is.
    let applied = control
        .apply(ChangeRequest {
            expected_version: Some(0),
            ..change(valid)
        })
        .await
        .unwrap();
    assert_eq!(applied.record.map(|r| r.meta.version), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_does_not_wait_for_a_change_being_committed() {
    let mut gate = Gate::new();
    let control = control(gate.store.clone(), Mode::Api);
    let api = AdminApi::new(control.clone());
    api.apply(Request::new(apply_request(V1))).await.unwrap();
    gate.close();
    let committing = {
        let api = AdminApi::new(control.clone());
        tokio::spawn(async move { api.apply(Request::new(apply_request(V2))).await })
    };
    // The change holds the change lock in the store's publish.
    tokio::time::timeout(WAIT, gate.entered.recv())
        .await
        .unwrap()
        .unwrap();
    let dry_run = pb::ApplyRequest {
        dry_run: true,
        ..apply_request(V3)
    };
    let answered = tokio::time::timeout(WAIT, api.apply(Request::new(dry_run)))
        .await
        .expect("the dry run answers while the change commits")
        .unwrap()
        .into_inner();
    // Against the version current when it read the store.
    assert_eq!(answered.version, 1);
    assert!(!answered.changed);
    assert_eq!(answered.diff.len(), 1);
    gate.open();
    let committed = committing.await.unwrap().unwrap().into_inner();
    assert_eq!(committed.version, 2);
}

/// The wire form of a policy file that loads without errors.
pub(crate) fn wire(yaml: &str) -> pb::PolicyDocument {
    let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
    pb::PolicyDocument::from(set.document().as_ref())
}

/// The current version is kept converted between changes; a version stored since by another
/// writer of the store is diffed as stored, not as the version kept.
#[tokio::test]
async fn a_version_stored_by_another_writer_is_what_a_change_is_diffed_against() {
    let store = Arc::new(MemoryStore::default());
    let control = ControlPlane::for_tests(store.clone(), Mode::Api);
    control.apply(change(wire(V1))).await.unwrap();
    let v2 = wire(V2);
    store
        .publish(
            NewVersion {
                content_hash: convert::content_hash(&v2),
                document: v2,
                source: Source::Admin,
                author: None,
                summary: String::new(),
                created_unix_ms: 0,
            },
            Some(1),
        )
        .unwrap();
    let dry_run = |yaml: &str| ChangeRequest {
        dry_run: true,
        ..change(wire(yaml))
    };
    let outcome = control.apply(dry_run(V3)).await.unwrap();
    let fresh = ControlPlane::for_tests(store.clone(), Mode::Api);
    let expected = fresh.apply(dry_run(V3)).await.unwrap();
    assert_eq!(outcome.diff, expected.diff);
    assert_eq!(
        outcome.diff[0].details,
        ["max_attempts: 4 -> 5"],
        "{:?}",
        outcome.diff
    );
    // V2's content is current: no change, whatever was kept of V1.
    let again = control.apply(change(wire(V2))).await.unwrap();
    assert!(!again.changed && !again.would_change);
    assert_eq!(again.record.map(|r| r.meta.version), Some(2));
}

/// A policy file's change handed over loaded (its compiled set) is decided, stored and diffed
/// as its wire document sent as such, which is validated here.
#[tokio::test]
async fn a_checked_file_change_is_the_same_change_as_its_document_unchecked() {
    let example = include_str!("../../../config/policies.yaml");
    let set = retryplane_policy::load(example.as_bytes())
        .policies
        .unwrap();
    let document = pb::PolicyDocument::from(set.document().as_ref());
    let checked = |dry_run: bool| ChangeRequest {
        dry_run,
        content: ChangeContent::Loaded {
            policies: set.clone(),
            warnings: Vec::new(),
        },
        ..change(document.clone())
    };
    let unchecked = |dry_run: bool| ChangeRequest {
        dry_run,
        ..change(document.clone())
    };
    let with = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    let without = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    for control in [&with, &without] {
        control.apply(change(wire(V1))).await.unwrap();
    }
    for dry_run in [true, false] {
        let a = with.apply(checked(dry_run)).await.unwrap();
        let b = without.apply(unchecked(dry_run)).await.unwrap();
        assert!(!a.diff.is_empty());
        assert_eq!(a.diff, b.diff);
        assert_eq!(a.content_hash, b.content_hash);
        assert_eq!((a.changed, a.would_change), (b.changed, b.would_change));
        assert_eq!(
            a.record.map(|r| (
                r.meta.version,
                r.meta.content_hash,
                r.meta.summary,
                r.document
            )),
            b.record.map(|r| (
                r.meta.version,
                r.meta.content_hash,
                r.meta.summary,
                r.document
            ))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_judged_to_run_unknown_content_published_right_after_is_listed_running_it() {
    let (_gate, control, document) = on_v1().await;
    // The agent names version 2 with its hash, which this store has not reached when its Hello
    // is judged (so it is listed as running 0); version 2 with that very hash is published as
    // soon as the stream is registered, before its task first looks at the current version.
    let v2 = VersionRecord::of_version(2, document.clone());
    let hello = hello_naming(2, &v2.meta.content_hash);
    let publisher = control.publisher.clone();
    let hook = Hook(Arc::new(move || {
        publisher.publish(&v2);
    }));
    let (addr, _stop) = serve_with(&control, Some(hook)).await;
    let (agent_tx, mut inbound) = connect_agent(addr, hello).await;
    // Listed as running 0 when judged; as its stream starts, the current version is the one it
    // named: it is listed as running it, and not sent it again.
    until_listed(&control, |s| s.applied_version == 2).await;
    assert_eq!(control.metrics.pushes.get(), 0, "nothing was pushed");
    assert_eq!(control.fleet.status()[0].last_response, "");
    // A later version is pushed as to any agent.
    let v3 = VersionRecord::of_version(3, document);
    control.publisher.publish(&v3);
    assert_eq!(next_version(&mut inbound).await, 3);
    drop(agent_tx);
}

/// A control plane in API mode on a gated store, version 1 (`V1`) applied: the gate (kept for
/// the store), the control plane, and version 1's document.
async fn on_v1() -> (Gate, Arc<ControlPlane>, pb::PolicyDocument) {
    let gate = Gate::new();
    let control = control(gate.store.clone(), Mode::Api);
    AdminApi::new(control.clone())
        .apply(Request::new(apply_request(V1)))
        .await
        .unwrap();
    let document = control.store.current().unwrap().unwrap().document;
    (gate, control, document)
}

/// A Hello from agent process 1 naming `version` with `hash`.
fn hello_naming(version: u64, hash: &str) -> pb::Hello {
    pb::Hello {
        agent_id: "a-1".to_owned(),
        service: "checkout".to_owned(),
        last_applied_version: version,
        last_applied_hash: hash.to_owned(),
        instance_id: 1,
        ..Default::default()
    }
}

/// Waits (at most [`WAIT`]) until the one agent's status satisfies `f`.
async fn until_listed(control: &Arc<ControlPlane>, f: impl Fn(&pb::AgentStatus) -> bool) {
    let listed = async {
        while !control.fleet.status().first().is_some_and(&f) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(WAIT, listed)
        .await
        .expect("the fleet lists the agent so in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_refused_the_push_is_listed_running_its_named_version_once_published() {
    let (_gate, control, document) = on_v1().await;
    let (addr, _stop) = serve(&control).await;
    // It names version 2, which this control plane has not reached: it is pushed version 1,
    // refuses it, and keeps running its version 2.
    let v2 = VersionRecord::of_version(2, document);
    let hello = hello_naming(2, &v2.meta.content_hash);
    let (agent_tx, mut inbound) = connect_agent(addr, hello).await;
    let pushed = next_snapshot(&mut inbound).await;
    assert_eq!(pushed.version, 1);
    let nack = pb::Nack {
        version: 1,
        nonce: pushed.nonce,
        error: "refused".to_owned(),
    };
    agent_tx
        .send(pb::AgentMessage {
            kind: Some(Kind::Nack(nack)),
        })
        .await
        .unwrap();
    until_listed(&control, |s| s.last_response == "nack").await;
    // Version 2 as it named it is published: it runs it, so it is listed so and not sent it.
    control.publisher.publish(&v2);
    until_listed(&control, |s| s.applied_version == 2).await;
    assert_eq!(control.metrics.pushes.get(), 1, "only version 1 was pushed");
    drop(agent_tx);
}

#[tokio::test]
async fn a_refusal_is_logged_with_the_agents_reason_on_one_line() {
    // The operator reading the log saw "agent refused a snapshot" and had to run `status` to
    // learn why. (One thread: the log capture is this thread's.)
    let (log, _guard) = crate::test_logs::capture("retryplane_server=debug");
    let (_gate, control, _) = on_v1().await;
    let (addr, _stop) = serve(&control).await;
    let (agent_tx, mut inbound) = connect_agent(addr, hello_naming(0, "")).await;
    let pushed = next_snapshot(&mut inbound).await;
    let reason = format!("endpoints.payments: \"bad\"\nnext line {}", "x".repeat(400));
    agent_tx
        .send(pb::AgentMessage {
            kind: Some(Kind::Nack(pb::Nack {
                version: pushed.version,
                nonce: pushed.nonce,
                error: reason,
            })),
        })
        .await
        .unwrap();
    until_listed(&control, |s| s.last_response == "nack").await;
    let text = log.text();
    let line = text
        .lines()
        .find(|l| l.contains("agent refused a snapshot"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(" WARN "), "{line}");
    let cut = format!(
        r#"error="endpoints.payments: \"bad\"\nnext line {}…""#,
        "x".repeat(256 - "endpoints.payments: \"bad\"\nnext line ".len())
    );
    assert!(line.contains(&cut), "{line}");
    drop(agent_tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_empty_store_an_agent_is_listed_running_a_first_version_it_named() {
    // Version 1's document of another control plane.
    let (_other, _, document) = on_v1().await;
    let gate = Gate::new();
    let control = control(gate.store.clone(), Mode::Api);
    let (addr, _stop) = serve(&control).await;
    let v2 = VersionRecord::of_version(2, document);
    let (agent_tx, _inbound) = connect_agent(addr, hello_naming(2, &v2.meta.content_hash)).await;
    until_listed(&control, |s| s.connected && s.applied_version == 0).await;
    control.publisher.publish(&v2);
    until_listed(&control, |s| s.applied_version == 2).await;
    assert_eq!(control.metrics.pushes.get(), 0, "nothing was pushed");
    drop(agent_tx);
}

/// A Hello's content hash is hex in either case: an agent that names the current version with
/// its hash in upper case runs that content, and is not pushed it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_hash_in_upper_case_names_the_same_content() {
    let (_gate, control, _) = on_v1().await;
    let (addr, _stop) = serve(&control).await;
    let current = control.store.current().unwrap().unwrap();
    let hash = current.meta.content_hash.to_ascii_uppercase();
    assert_ne!(hash, current.meta.content_hash);
    let (agent_tx, _inbound) = connect_agent(addr, hello_naming(current.meta.version, &hash)).await;
    until_listed(&control, |s| {
        s.connected && s.applied_version == current.meta.version
    })
    .await;
    assert_eq!(control.metrics.pushes.get(), 0, "nothing was pushed");
    drop(agent_tx);
}

/// A memory store whose next publishes commit and then report an error (as redb can when the
/// sync after its commit point fails), each followed by `reads_after` failed reads.
struct LateErrorStore {
    inner: MemoryStore,
    failed_commits: std::sync::atomic::AtomicUsize,
    reads_after: std::sync::atomic::AtomicUsize,
    failed_reads: std::sync::atomic::AtomicUsize,
}

impl LateErrorStore {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::new(),
            failed_commits: 0.into(),
            reads_after: 0.into(),
            failed_reads: 0.into(),
        })
    }
}

/// Takes one from `left`, if any is left.
fn take_one(left: &std::sync::atomic::AtomicUsize) -> bool {
    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

impl VersionStore for LateErrorStore {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        if take_one(&self.failed_reads) {
            return Err(StoreError::Corrupt("unreadable for now".to_owned()));
        }
        self.inner.current()
    }

    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        self.inner.get(version)
    }

    fn history(&self, limit: usize, before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError> {
        self.inner.history(limit, before)
    }

    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError> {
        let published = self.inner.publish(new, expected)?;
        if take_one(&self.failed_commits) {
            let reads = self.reads_after.load(Ordering::SeqCst);
            self.failed_reads.store(reads, Ordering::SeqCst);
            let disk = std::io::Error::new(std::io::ErrorKind::StorageFull, "No space left");
            return Err(StoreError::Backend(Box::new(disk)));
        }
        Ok(published)
    }
}

/// Waits (at most [`WAIT`]) until `control` has published `version`; `what` says what that
/// means when it does not.
async fn until_published(control: &ControlPlane, version: u64, what: &str) {
    let mut published = control.publisher.subscribe();
    tokio::time::timeout(
        WAIT,
        published.wait_for(|s| s.as_ref().is_some_and(|s| s.version == version)),
    )
    .await
    .expect(what)
    .unwrap();
}

fn served(control: &ControlPlane) -> u64 {
    control.publisher.current().map_or(0, |s| s.version)
}

#[tokio::test]
async fn a_write_that_fails_after_its_commit_is_published_as_the_new_version() {
    let store = LateErrorStore::new();
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    control.apply(change(wire(V1))).await.unwrap();
    store.failed_commits.store(1, Ordering::SeqCst);

    let outcome = control.apply(change(wire(V2))).await.unwrap();
    assert!(outcome.changed);
    assert_eq!(outcome.record.unwrap().meta.version, 2);
    assert_eq!(served(&control), 2, "what the store holds is served");
    assert_eq!(control.metrics.current_version.get(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_stored_version_a_failed_write_hid_is_published_once_the_store_reads_again() {
    // The commit lands, its error comes back, and the read that follows fails too.
    let store = LateErrorStore::new();
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    control.apply(change(wire(V1))).await.unwrap();
    store.failed_commits.store(1, Ordering::SeqCst);
    store.reads_after.store(3, Ordering::SeqCst);

    let failed = control.apply(change(wire(V2))).await.unwrap_err();
    // The store could not be read back: the change may have been stored (it was).
    assert!(
        matches!(failed, ChangeError::StoreUncertain(_)),
        "{failed:?}"
    );
    assert_eq!(served(&control), 1);
    assert_eq!(control.metrics.store_failures.get(), 1);

    // While a change holds the lock, the task waits: what that change publishes is not
    // overtaken by an older version.
    let held = control.changes.clone().lock_owned().await;
    tokio::time::sleep(REOPEN_INTERVAL * 5).await;
    assert_eq!(
        served(&control),
        1,
        "published while a change held the lock"
    );
    drop(held);

    until_published(
        &control,
        2,
        "the stored version is published once the store can be read",
    )
    .await;
}

/// A save of the policy file whose write failed after its commit, published later when the
/// store reads again, says nothing of the file's last read: a save refused since is still
/// shown as refused, on `/metrics` and in `FleetStatus`.
#[tokio::test(start_paused = true)]
async fn a_file_version_a_failed_write_hid_published_later_leaves_the_files_verdict() {
    let store = LateErrorStore::new();
    let control = Arc::new(ControlPlane::for_tests(
        store.clone(),
        Mode::File("/etc/retryplane/policies.yaml".into()),
    ));
    let file_change = |yaml| ChangeRequest {
        source: Source::File,
        ..change(wire(yaml))
    };
    control.apply(file_change(V1)).await.unwrap();
    assert_eq!(control.file_read().map(|r| r.outcome), Some(Ok(())));
    store.failed_commits.store(1, Ordering::SeqCst);
    store.reads_after.store(3, Ordering::SeqCst);
    let failed = control.apply(file_change(V2)).await.unwrap_err();
    assert!(
        matches!(failed, ChangeError::StoreUncertain(_)),
        "{failed:?}"
    );
    // What the watcher notes of that save, then of a save refused after it.
    control.note_file_read(Err("cannot store it: …".to_owned()));
    control.note_file_read(Err("1 error(s), first: …".to_owned()));
    control.metrics.config_last_reload_successful.set(0);

    until_published(
        &control,
        2,
        "the stored version is published once the store can be read",
    )
    .await;
    assert_eq!(
        control.file_read().map(|r| r.outcome),
        Some(Err("1 error(s), first: …".to_owned()))
    );
    assert_eq!(control.metrics.config_last_reload_successful.get(), 0);
}

#[tokio::test]
async fn the_same_content_again_publishes_a_stored_version_that_was_not_served() {
    let store = LateErrorStore::new();
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    control.apply(change(wire(V1))).await.unwrap();
    // Stored behind the control plane's back: what a failed write that committed leaves
    // when the store could not be read at the time.
    store_behind(&store, V3);
    assert_eq!(served(&control), 1);

    let outcome = control.apply(change(wire(V3))).await.unwrap();
    assert!(!outcome.changed, "no new version for the same content");
    assert_eq!(served(&control), 2, "the stored version is served");
}

#[tokio::test]
async fn lists_in_another_order_are_the_same_content_and_no_new_version() {
    let store = Arc::new(MemoryStore::new());
    let control = Arc::new(ControlPlane::for_tests(store, Mode::Api));
    let first = "version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [500, 503], grpc_status: [UNAVAILABLE, RESOURCE_EXHAUSTED]}\n    idempotent_methods: [GET, PUT]\n";
    let again = "version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [503, 500], grpc_status: [RESOURCE_EXHAUSTED, UNAVAILABLE]}\n    idempotent_methods: [PUT, GET]\n";
    let stored = control.apply(change(wire(first))).await.unwrap();
    let outcome = control.apply(change(wire(again))).await.unwrap();
    assert!(!outcome.changed && !outcome.would_change, "{outcome:?}");
    assert!(outcome.diff.is_empty());
    assert_eq!(
        outcome.content_hash, stored.content_hash,
        "the stored version's hash"
    );
    assert_eq!(served(&control), 1);
}

/// An agent id with spaces and `=` (`web-1 service=payments`) is one field of the log line,
/// not two.
#[tokio::test]
async fn an_agent_id_with_spaces_cannot_forge_fields_of_a_log_line() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let (_gate, control, _) = on_v1().await;
    let (addr, _stop) = serve(&control).await;
    let hello = pb::Hello {
        agent_id: "web-1 service=payments version=42".to_owned(),
        service: "checkout".to_owned(),
        ..Default::default()
    };
    let (_tx, _inbound) = connect_agent(addr, hello).await;
    tokio::time::timeout(WAIT, async {
        while !log.text().contains("agent connected") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the connection is logged");
    let text = log.text();
    assert!(
        text.contains(r#"agent="web-1 service=payments version=42" service=checkout"#),
        "{text}"
    );
}

#[tokio::test]
async fn an_agent_id_with_invisible_or_bidi_characters_is_logged_escaped() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let (_gate, control, _) = on_v1().await;
    let (addr, _stop) = serve(&control).await;
    let hello = pb::Hello {
        agent_id: "pay\u{202e}tuo".to_owned(),
        service: "checkout\u{200b}".to_owned(),
        ..Default::default()
    };
    let (_tx, _inbound) = connect_agent(addr, hello).await;
    tokio::time::timeout(WAIT, async {
        while !log.text().contains("agent connected") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the connection is logged");
    let text = log.text();
    assert!(
        text.contains(r#"agent="pay\u{202e}tuo" service="checkout\u{200b}""#),
        "{text}"
    );
    assert!(
        !text.contains('\u{202e}') && !text.contains('\u{200b}'),
        "{text}"
    );
}

/// A memory store whose next publish stores the version and then panics (a backend that
/// trips over its own state after its commit point): the caller's thread sees a failed task,
/// not an answer.
struct PanicAfterCommitStore {
    inner: MemoryStore,
    panics: std::sync::atomic::AtomicUsize,
}

impl VersionStore for PanicAfterCommitStore {
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
        let published = self.inner.publish(new, expected)?;
        if take_one(&self.panics) {
            panic!("the store tripped after its commit");
        }
        Ok(published)
    }
}

#[tokio::test]
async fn a_store_write_whose_task_failed_after_storing_is_not_said_to_be_not_stored() {
    let store = Arc::new(PanicAfterCommitStore {
        inner: MemoryStore::new(),
        panics: 0.into(),
    });
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    control.apply(change(wire(V1))).await.unwrap();
    store.panics.store(1, Ordering::SeqCst);

    let answer = control.apply(change(wire(V2))).await;
    assert_eq!(
        store.inner.current().unwrap().unwrap().meta.version,
        2,
        "the store holds the change"
    );
    // `ChangeError::Store` is the error the admin answer turns into "the change was not
    // stored"; the store, read back, holds it: it is stored (and served), or at least "may
    // have been".
    assert!(!matches!(answer, Err(ChangeError::Store(_))), "{answer:?}");
    until_published(
        &control,
        2,
        "the stored version is served, as `history` shows it",
    )
    .await;
}

/// The publish time on `/metrics` is when the version served was published: set by a change
/// that publishes, left alone by one that does not (the same content again, a dry run).
#[tokio::test]
async fn the_publish_time_is_set_when_a_version_is_published_and_only_then() {
    let control = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    let published = || control.metrics.last_publish_seconds.get();
    assert_eq!(published(), 0.0, "nothing published yet");
    let first = publish_time_of(&control, change(wire(V1)), "apply").await;
    control.apply(change(wire(V1))).await.unwrap();
    control
        .apply(ChangeRequest {
            dry_run: true,
            ..change(wire(V2))
        })
        .await
        .unwrap();
    assert_eq!(published(), first, "nothing published since");
    publish_time_of(&control, change(wire(V2)), "apply").await;
}

/// Applies `req` and returns the publish time on `/metrics` after it, checked to fall within
/// the call (`what` names the call in the message).
async fn publish_time_of(control: &ControlPlane, req: ChangeRequest, what: &str) -> f64 {
    let before = unix_seconds();
    control.apply(req).await.unwrap();
    let at = control.metrics.last_publish_seconds.get();
    assert!(
        (before..=unix_seconds()).contains(&at),
        "{what}: {at} not within the call"
    );
    at
}

/// Stores `yaml` as a new version behind the control plane's back (in the store under
/// `store`'s gate), as a write whose commit failed after storing leaves it.
fn store_behind(store: &LateErrorStore, yaml: &str) {
    store_directly(&store.inner, wire(yaml));
}

/// Stores `document` as a new version in `store` directly, unchecked.
fn store_directly(store: &MemoryStore, document: pb::PolicyDocument) {
    store
        .publish(
            NewVersion {
                content_hash: convert::content_hash(&document),
                document,
                source: Source::Admin,
                author: None,
                summary: String::new(),
                created_unix_ms: 0,
            },
            None,
        )
        .unwrap();
}

/// Waits (bounded) until the system clock reads later than `t`, so that a gauge set now
/// would differ from `t`.
async fn clock_past(t: f64) {
    tokio::time::timeout(WAIT, async {
        while unix_seconds() <= t {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the system clock moves");
}

/// The paths that publish set the publish time (a rollback, the
/// catch-up of a version a failed commit stored, a write whose commit failed after storing),
/// and an older version that `publish_then` refuses leaves it alone.
#[tokio::test]
async fn the_publish_time_follows_every_publish_and_no_refused_one() {
    let store = LateErrorStore::new();
    let control = Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api));
    let published = || control.metrics.last_publish_seconds.get();
    control.apply(change(wire(V1))).await.unwrap();
    control.apply(change(wire(V2))).await.unwrap();
    let at_v2 = published();

    // An older version offered to the fan-out (a stale read) is refused: no publish.
    clock_past(at_v2).await;
    let v1 = store.inner.get(1).unwrap().unwrap();
    control.fanout().publish(&v1);
    assert_eq!(served(&control), 2);
    assert_eq!(
        published(),
        at_v2,
        "a refused older version set the publish time"
    );

    // A rollback publishes a new version.
    let rollback = ChangeRequest {
        source: Source::Rollback { from: 1 },
        ..change(v1.document.clone())
    };
    let at_v3 = publish_time_of(&control, rollback, "rollback").await;
    assert_eq!(served(&control), 3);

    // A write whose commit reported an error after storing is published.
    clock_past(at_v3).await;
    store.failed_commits.store(1, Ordering::SeqCst);
    let at_v4 = publish_time_of(&control, change(wire(V3)), "late error").await;
    assert_eq!(served(&control), 4);

    // A version stored behind the served one is caught up by the same content sent again.
    clock_past(at_v4).await;
    store_behind(&store, V1);
    let before = unix_seconds();
    let outcome = control.apply(change(wire(V1))).await.unwrap();
    assert!(!outcome.changed);
    assert_eq!(served(&control), 5);
    assert!((before..=unix_seconds()).contains(&published()), "catch-up");
}

/// `publish_current` does not publish the version already served again (the publisher would
/// take an equal version) nor move the publish time: nothing new reaches any agent. At start
/// this is the case when the watcher applies a save before `publish_current` takes the
/// change lock.
#[tokio::test]
async fn publishing_the_served_version_again_does_not_move_the_publish_time() {
    let control = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    control.apply(change(wire(V1))).await.unwrap();
    let first = control.metrics.last_publish_seconds.get();
    clock_past(first).await;
    control.publish_current().await.unwrap();
    assert_eq!(served(&control), 1);
    assert_eq!(
        control.metrics.last_publish_seconds.get(),
        first,
        "version 1 was published at {first}, and not since"
    );
}

/// A current version stored before the item limit (written to the store directly here) is
/// still served at start, with a warning that agents refuse it.
#[tokio::test]
async fn a_current_version_holding_more_than_a_file_can_is_served_at_start_with_a_warning() {
    let store = Arc::new(MemoryStore::default());
    crate::store::store_over_the_item_limit(store.as_ref());
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let control = ControlPlane::for_tests(store, Mode::Api);
    control.publish_current().await.unwrap();
    assert_eq!(served(&control), 1);
    let text = log.text();
    assert!(
        text.contains("WARN") && text.contains("agents refuse it: the document is too large"),
        "{text}"
    );
}

/// A current version that this build's checks refuse (stored by an earlier build with looser
/// rules; written to the store directly here) is still served at start, with a warning that
/// agents of this build refuse it. A valid one gets no such warning.
#[tokio::test]
async fn a_current_version_this_build_refuses_is_served_at_start_with_a_warning() {
    let store = Arc::new(MemoryStore::default());
    let mut invalid = wire(V1);
    invalid.endpoints[0]
        .overlay
        .get_or_insert_with(Default::default)
        .max_attempts = Some(0);
    store_directly(&store, invalid);
    let (log, _guard) = crate::test_logs::capture("retryplane_server=warn");
    let control = ControlPlane::for_tests(store, Mode::Api);
    control.publish_current().await.unwrap();
    assert_eq!(served(&control), 1);
    let text = log.text();
    assert!(
        text.contains("WARN")
            && text.contains("does not pass this build's checks")
            && text.contains("max_attempts"),
        "{text}"
    );
    let valid = Arc::new(MemoryStore::default());
    ControlPlane::for_tests(valid.clone(), Mode::Api)
        .apply(change(wire(V1)))
        .await
        .unwrap();
    let before = log.text().len();
    ControlPlane::for_tests(valid, Mode::Api)
        .publish_current()
        .await
        .unwrap();
    assert_eq!(log.text().len(), before, "{}", log.text());
}

/// README says `time() -` the publish time is how long the fleet has been on the version
/// served: after a restart it is still the version's publish, not the restart's instant.
#[tokio::test]
async fn after_a_restart_the_publish_time_is_not_later_than_the_versions_publish() {
    let store = Arc::new(MemoryStore::default());
    let before = ControlPlane::for_tests(store.clone(), Mode::Api);
    before.apply(change(wire(V1))).await.unwrap();
    let first = before.metrics.last_publish_seconds.get();
    clock_past(first).await;
    let restarted = ControlPlane::for_tests(store, Mode::Api);
    restarted.publish_current().await.unwrap();
    assert_eq!(served(&restarted), 1);
    let after = restarted.metrics.last_publish_seconds.get();
    assert!(
        after <= first,
        "version 1 was published at {first}; after the restart the gauge says {after}"
    );
}

/// The publish time reads back from `/metrics`' text, as the fan-out
/// bench parses it (`name value`, split at the first space), to the value set, not rounded to
/// a coarser figure (the bench subtracts two Unix times some milliseconds apart).
#[tokio::test]
async fn the_publish_time_on_metrics_parses_back_to_the_value_set() {
    let control = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    control.apply(change(wire(V1))).await.unwrap();
    let set = control.metrics.last_publish_seconds.get();
    let text = control.metrics.render();
    let read = text
        .lines()
        .find_map(|line| {
            let (key, value) = line.split_once(' ')?;
            (key == "retryplane_server_last_publish_timestamp_seconds")
                .then(|| value.trim().parse::<f64>().ok())?
        })
        .unwrap_or_else(|| panic!("no sample in\n{text}"));
    assert_eq!(read.to_bits(), set.to_bits(), "{read} read back, {set} set");
}

/// A change asked to keep every endpoint (a policy file read while its writer may not be
/// done) is refused when it removes one, naming it, and not counted as rejected (it may be a
/// save still being written); one that adds or changes endpoints goes through as any change
/// does.
#[tokio::test]
async fn a_change_asked_to_keep_every_endpoint_is_refused_only_when_it_removes_one() {
    let control = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    let two = "version: 1\nendpoints:\n  payments: {max_attempts: 3}\n  search: {}\n";
    control.apply(change(wire(two))).await.unwrap();
    let keep = |yaml: &str| ChangeRequest {
        keep_endpoints: true,
        ..change(wire(yaml))
    };
    let refused = control
        .apply(keep(
            "version: 1\nendpoints:\n  payments: {max_attempts: 4}\n",
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ChangeError::MaybePartial(names) if names == &["search"]),
        "{refused:?}"
    );
    // Not counted as rejected: it may be a save still being written.
    assert_eq!(control.metrics.rejected_changes.get(), 0);
    assert_eq!(control.publisher.current().map(|s| s.version), Some(1));
    let grown = "version: 1\nendpoints:\n  payments: {max_attempts: 4}\n  search: {}\n  new: {}\n";
    let outcome = control.apply(keep(grown)).await.unwrap();
    assert!(outcome.changed);
    assert_eq!(control.publisher.current().map(|s| s.version), Some(2));
}

/// A save of the policy file published sets `config_last_reload_successful` as the version is
/// published, not once the watcher gets the answer: no scrape shows the new version beside the
/// failed reload of the save before it. A change of another source leaves it alone.
#[tokio::test]
async fn a_published_save_of_the_file_sets_the_reload_gauge_with_the_version() {
    let control = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    let reload_ok = || control.metrics.config_last_reload_successful.get();
    control.metrics.config_last_reload_successful.set(0);
    control.apply(change(wire(V1))).await.unwrap();
    assert_eq!(reload_ok(), 0, "an admin change is no read of the file");
    let save = ChangeRequest {
        source: Source::File,
        ..change(wire(V2))
    };
    control.apply(save).await.unwrap();
    assert_eq!(served(&control), 2);
    assert_eq!(reload_ok(), 1, "set as the save was published");
}

/// The publish line names who made the version and, for a rollback, the version it restored.
#[tokio::test]
async fn the_publish_line_names_its_author_and_what_a_rollback_restored() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let control = ControlPlane::for_tests(Arc::new(MemoryStore::default()), Mode::Api);
    let by = |yaml: &str, source: Source, author: Option<&str>| ChangeRequest {
        source,
        author: author.map(str::to_owned),
        ..change(wire(yaml))
    };
    control.apply(by(V1, Source::File, None)).await.unwrap();
    control
        .apply(by(V2, Source::Admin, Some("alice ops")))
        .await
        .unwrap();
    control
        .apply(by(V1, Source::Rollback { from: 1 }, Some("bob")))
        .await
        .unwrap();
    let text = log.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("published a new policy version"))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].contains(r#"version=1 source="file""#) && !lines[0].contains("author"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].contains(r#"version=2 source="admin" author="alice ops""#)
            && !lines[1].contains("restored"),
        "{}",
        lines[1]
    );
    assert!(
        lines[2].contains(r#"version=3 source="rollback" restored=1 author=bob"#),
        "{}",
        lines[2]
    );
}

/// A store read from a copy of its file in memory while the file cannot be opened (as the
/// embedded store is after a failed commit): the copy holds a version the file does not (a
/// commit whose flush failed, still in the page cache).
#[derive(Default)]
struct CopiedStore {
    file: MemoryStore,
    copy: MemoryStore,
    /// Whether reads come from the copy, and the file cannot be opened.
    on_copy: AtomicBool,
}

impl CopiedStore {
    fn reads(&self) -> &MemoryStore {
        if self.on_copy.load(Ordering::SeqCst) {
            &self.copy
        } else {
            &self.file
        }
    }

    fn file(&self) -> Result<&MemoryStore, StoreError> {
        if self.on_copy.load(Ordering::SeqCst) {
            Err(StoreError::Backend("the file cannot be opened".into()))
        } else {
            Ok(&self.file)
        }
    }
}

impl VersionStore for CopiedStore {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.reads().current()
    }

    fn current_in_file(&self) -> Result<Option<VersionRecord>, StoreError> {
        self.file()?.current()
    }

    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        self.reads().get(version)
    }

    fn history(&self, limit: usize, before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError> {
        self.reads().history(limit, before)
    }

    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError> {
        self.file()?.publish(new, expected)
    }
}

/// The same content sent again after a failed commit (an operator's retry, the policy file
/// read again) while the store reads a copy that holds that commit: judged against the copy,
/// it was "unchanged" and the copy's version was published though the file does not hold it.
/// It is judged against the file, and fails while the file cannot be opened.
#[tokio::test]
async fn a_change_is_judged_against_the_file_not_a_copy_that_holds_a_failed_commit() {
    let store = Arc::new(CopiedStore::default());
    store_directly(&store.file, wire(V1));
    store_directly(&store.copy, wire(V1));
    store_directly(&store.copy, wire(V2));
    let control = ControlPlane::for_tests(store.clone(), Mode::Api);
    control.publish_current().await.unwrap();
    store.on_copy.store(true, Ordering::SeqCst);

    let failed = control.apply(change(wire(V2))).await.unwrap_err();
    assert!(matches!(failed, ChangeError::Store(_)), "{failed:?}");
    assert_eq!(control.publisher.current().unwrap().version, 1);
    // A dry run may read the copy.
    let dry_run = ChangeRequest {
        dry_run: true,
        ..change(wire(V3))
    };
    assert!(control.apply(dry_run).await.unwrap().would_change);

    store.on_copy.store(false, Ordering::SeqCst);
    let outcome = control.apply(change(wire(V2))).await.unwrap();
    assert!(outcome.changed);
    assert_eq!(control.publisher.current().unwrap().version, 2);
    assert_eq!(store.file.current().unwrap().unwrap().meta.version, 2);
}
