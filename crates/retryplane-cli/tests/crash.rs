//! `retryplane serve --api` killed with SIGKILL while applies are streaming in comes back, on
//! the same data directory, with a whole version (issue 3, "Store"): it starts (the store is
//! not corrupt), its current version is the one before the kill or the apply that was in
//! flight, with exactly the content hash of what the test applied, every version the test saw
//! acknowledged is still there, and the history is contiguous `1..=current` with every
//! stored document matching its hash.
//!
//! Each round starts the real binary (port 0 listeners, addresses read from stdout), notes the
//! current version, sends distinct applies one after another over the admin gRPC API and
//! kills the process after a different short delay (so some kills land before the first apply,
//! some during one, some between two), then checks the next start against what it sent.

#![cfg(unix)]
// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_proto::convert::content_hash;
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};
use tonic::transport::Channel;

/// Kill-and-restart rounds.
const ROUNDS: usize = 16;
/// Bound on every wait: a start, an RPC, an exit.
const BOUND: Duration = Duration::from_secs(30);
/// Per round, how long after the applies start the SIGKILL is sent, in microseconds: from
/// "before the first apply reaches the server" to "after several applies". An apply takes a
/// few milliseconds (one durable commit), so the steps land at different points of one.
const KILL_AFTER_US: [u64; ROUNDS] = [
    0, 300, 1_100, 2_300, 3_600, 5_000, 6_700, 8_500, 10_400, 12_600, 15_100, 18_200, 22_300,
    28_000, 36_500, 50_000,
];
/// The policy file that seeds the empty store as version 1.
const SEED: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";

/// The `n`-th document the test applies: valid, and different from every other `n` (and from
/// the seed). `payments` stays in every one, so no apply removes every endpoint.
fn document(n: u32) -> String {
    let mut yaml = format!(
        "version: 1\nendpoints:\n  payments:\n    max_attempts: {}\n    deadline: {}ms\n",
        2 + n % 2,
        5_000 + n
    );
    for i in 0..8 {
        yaml.push_str(&format!(
            "  ep-{n}-{i}:\n    per_try_timeout: {}ms\n",
            100 + i
        ));
    }
    yaml
}

/// The content hash the server must record for `yaml`: the same conversion as the admin API's.
fn hash_of(yaml: &str) -> String {
    let loaded = retryplane_policy::load(yaml.as_bytes());
    let policies = loaded.policies.unwrap_or_else(|| {
        panic!(
            "the test's document is invalid: {:?}\n{yaml}",
            loaded.diagnostics
        )
    });
    content_hash(&pb::PolicyDocument::from(&**policies.document()))
}

/// One `retryplane serve --api` process on `dir/data`.
struct Server {
    child: Child,
    admin: AdminServiceClient<Channel>,
}

impl Server {
    /// Starts the binary and connects an admin client; panics with the server's log when it
    /// does not come up.
    async fn start(dir: &Path, run: usize) -> Self {
        let log = dir.join(format!("serve-{run}.log"));
        let stderr = std::fs::File::create(&log).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_retryplane"))
            .current_dir(dir)
            .args([
                "serve",
                "--api",
                "--config",
                "seed.yaml",
                "--data-dir",
                "data",
            ])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--http-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut admin = None;
        for _ in 0..3 {
            match timeout(BOUND, lines.next_line()).await {
                Ok(Ok(Some(line))) => {
                    if let Some(addr) = line.strip_prefix("admin: ") {
                        admin = Some(addr.to_owned());
                    }
                }
                other => {
                    let status = child.try_wait();
                    panic!(
                        "start {run} on the same data dir failed ({other:?}, exit {status:?}); its log:\n{}",
                        read_log(&log)
                    );
                }
            }
        }
        let addr = admin.expect("no `admin: ADDR` line");
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(BOUND)
            .timeout(BOUND)
            .connect()
            .await
            .unwrap();
        Self {
            child,
            admin: AdminServiceClient::new(channel),
        }
    }

    /// The record of `version` (0: the current one).
    async fn get(&self, version: u64) -> pb::GetResponse {
        self.admin
            .clone()
            .get(pb::GetRequest { version })
            .await
            .unwrap_or_else(|status| panic!("Get {version}: {status:?}"))
            .into_inner()
    }

    /// Checks the current version and every stored one: contiguous `1..=current` in History,
    /// each record's document hashing to its content hash. Returns the current version and
    /// hash.
    async fn check_whole(&self) -> (u64, String) {
        let current = self.get(0).await.info.unwrap();
        // Every page of the history, newest first (a page holds at most 1,000 versions).
        let mut versions = Vec::new();
        let mut before = 0;
        loop {
            let page = self
                .admin
                .clone()
                .history(pb::HistoryRequest {
                    before,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            assert!(
                page.next_before == 0
                    || (!page.versions.is_empty() && (before == 0 || page.next_before < before)),
                "a page that names a next one must hold versions and move back: {before} -> {}",
                page.next_before
            );
            versions.extend(page.versions);
            if page.next_before == 0 {
                break;
            }
            before = page.next_before;
        }
        let listed: Vec<u64> = versions.iter().map(|v| v.version).collect();
        let contiguous: Vec<u64> = (1..=current.version).rev().collect();
        assert_eq!(listed, contiguous, "History is not 1..={}", current.version);
        for listed in &versions {
            let record = self.get(listed.version).await;
            let info = record.info.unwrap();
            assert_eq!(info.version, listed.version);
            assert_eq!(info.content_hash, listed.content_hash);
            assert_eq!(
                content_hash(&record.policies.unwrap()),
                info.content_hash,
                "the stored document of v{} does not match its hash",
                info.version
            );
        }
        (current.version, current.content_hash)
    }

    /// SIGKILL, and the exit it causes.
    async fn kill(mut self) {
        self.child.start_kill().unwrap();
        let status = timeout(BOUND, self.child.wait()).await.unwrap().unwrap();
        assert_eq!(status.signal(), Some(9), "{status:?}");
    }

    /// SIGTERM (a clean shutdown), and its exit 0.
    async fn terminate(mut self) {
        let pid = self.child.id().unwrap().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        assert!(sent.success());
        let status = timeout(BOUND, self.child.wait()).await.unwrap().unwrap();
        assert!(status.success(), "{status:?}");
    }
}

fn read_log(path: &PathBuf) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(unreadable: {e})"))
}

/// What one round's applies did, as the client saw it.
#[derive(Debug, Default)]
struct Applied {
    /// The content hash of every apply sent, in order (the last one may never have answered).
    sent: Vec<String>,
    /// Every answer: version, content hash, changed.
    answered: Vec<(u64, String, bool)>,
    /// The failure that ended the applies (the server's death).
    ended: Option<tonic::Status>,
}

/// Applies `document(first)`, `document(first + 1)`, … one after another until one fails
/// (the server was killed), recording each in `applied` before it is sent and when it answers.
async fn apply_until_killed(
    mut admin: AdminServiceClient<Channel>,
    first: u32,
    applied: Arc<Mutex<Applied>>,
) {
    for n in first.. {
        let yaml = document(n);
        applied.lock().unwrap().sent.push(hash_of(&yaml));
        let request = pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml(yaml)),
                origin: format!("doc-{n}.yaml"),
            }),
            ..Default::default()
        };
        match admin.apply(request).await {
            Ok(response) => {
                let r = response.into_inner();
                applied
                    .lock()
                    .unwrap()
                    .answered
                    .push((r.version, r.content_hash, r.changed));
            }
            Err(status) => {
                applied.lock().unwrap().ended = Some(status);
                return;
            }
        }
    }
}

/// How a round's kill landed, judged from the restart.
#[derive(Debug, Default)]
struct Tally {
    /// No apply was in flight: every one sent had answered (rare: the next is recorded as sent
    /// as soon as the previous answers).
    idle: usize,
    /// An apply was in flight and the restart has it.
    in_flight_kept: usize,
    /// An apply was in flight and the restart does not have it.
    in_flight_lost: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_during_applies_comes_back_with_a_whole_version() {
    let began = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("seed.yaml"), SEED).unwrap();
    let mut previous: Option<((u64, String), Applied)> = None;
    let mut tally = Tally::default();
    let mut total_answered = 0;

    // One start per kill, and a last one after the last kill.
    for (round, kill_after_us) in KILL_AFTER_US.iter().map(Some).chain([None]).enumerate() {
        let server = Server::start(dir.path(), round).await;
        let (version, hash) = server.check_whole().await;

        if let Some(((start, start_hash), applied)) = previous.take() {
            // Every answered apply took the next version, with the content sent.
            for (i, (v, h, changed)) in applied.answered.iter().enumerate() {
                assert!(changed, "round {round}: apply {i} changed nothing");
                assert_eq!(*v, start + 1 + i as u64, "round {round}: apply {i}");
                assert_eq!(h, &applied.sent[i], "round {round}: apply {i}'s hash");
                let kept = server.get(*v).await.info.unwrap();
                assert_eq!(
                    &kept.content_hash, h,
                    "round {round}: v{v} after the restart"
                );
            }
            let last_answered = start + applied.answered.len() as u64;
            let in_flight = applied.sent.get(applied.answered.len());
            if version == last_answered {
                let expected = applied.answered.last().map_or(&start_hash, |(_, h, _)| h);
                assert_eq!(&hash, expected, "round {round}: v{version}'s hash");
                match in_flight {
                    Some(_) => tally.in_flight_lost += 1,
                    None => tally.idle += 1,
                }
            } else {
                let in_flight = in_flight.unwrap_or_else(|| {
                    panic!("round {round}: v{version} after the restart, but the last apply answered v{last_answered}")
                });
                assert_eq!(
                    version,
                    last_answered + 1,
                    "round {round}: only one apply was in flight"
                );
                assert_eq!(
                    &hash, in_flight,
                    "round {round}: v{version} is not the apply that was in flight"
                );
                tally.in_flight_kept += 1;
            }
            total_answered += applied.answered.len();
        } else {
            assert_eq!(version, 1, "the seed is version 1");
            assert_eq!(hash, hash_of(SEED));
        }

        let Some(&kill_after_us) = kill_after_us else {
            server.terminate().await;
            break;
        };

        let applied = Arc::new(Mutex::new(Applied::default()));
        let first = u32::try_from(round).unwrap() * 10_000;
        let applies = tokio::spawn(apply_until_killed(
            server.admin.clone(),
            first,
            applied.clone(),
        ));
        sleep(Duration::from_micros(kill_after_us)).await;
        server.kill().await;
        // The killed server's connection is gone, so the loop ends on its next answer.
        timeout(BOUND, applies).await.unwrap().unwrap();
        let applied = std::mem::take(&mut *applied.lock().unwrap());
        // The applies end because the connection died, not because the server refused one.
        let ended = applied
            .ended
            .as_ref()
            .expect("the applies ended without an error");
        assert!(
            matches!(
                ended.code(),
                tonic::Code::Unknown | tonic::Code::Unavailable | tonic::Code::Cancelled
            ),
            "round {round}: an apply failed with something else than the kill: {ended:?}"
        );
        println!(
            "round {round}: killed after {} us; {} applies sent, {} answered, then {}",
            kill_after_us,
            applied.sent.len(),
            applied.answered.len(),
            ended.message()
        );
        previous = Some(((version, hash), applied));
    }

    println!(
        "{ROUNDS} kills in {:?}: {total_answered} applies answered; {tally:?}",
        began.elapsed()
    );
}
