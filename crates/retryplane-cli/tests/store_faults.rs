//! `retryplane serve` as a process on a damaged or lost version store: a start on a store
//! that is not what it was says what is wrong, where, and what to do.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::panic)]
#![cfg(unix)]

use std::path::Path;
use std::time::Duration;

use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

mod process;
use process::{BOUND, http_get, terminate};

const POLICY: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n";

/// [`process::serve`] of [`POLICY`], its log (at `warn`) going to `dir/serve.log`; the three
/// addresses (`agent`, `admin`, `http`).
async fn serve(dir: &Path, extra: &[&str]) -> (Child, Vec<String>) {
    let log = std::fs::File::create(dir.join("serve.log")).unwrap();
    let (child, addrs) = process::serve(dir, POLICY, extra, log.into()).await;
    (child, addrs.into_iter().map(|(_, addr)| addr).collect())
}

/// A page of the store's file damaged on disk (one bit of the stored version's record
/// flipped, as a failing disk or a bad copy does): redb's checksums catch it and the start
/// fails, as it should. But the error is redb's own words, "Primary is corrupted despite
/// 2-phase commit", after the data directory: it names neither the file nor what to do,
/// where every other refusal of the store's file names it (`data/retryplane.redb is
/// truncated`, `the store file data/retryplane.redb holds only zero bytes ... move it aside`).
#[tokio::test]
async fn a_damaged_page_of_the_store_stops_the_start_naming_the_file_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let (child, _) = serve(dir.path(), &[]).await;
    terminate(child).await;
    let file = dir.path().join("data/retryplane.redb");
    let mut bytes = std::fs::read(&file).unwrap();
    // Every copy of the version's summary, so that the live one is among them (the record
    // keeps it as written; the document is compressed, so its endpoint names show only
    // here).
    let summary = b"+1 endpoint (";
    let at: Vec<usize> = bytes
        .windows(summary.len())
        .enumerate()
        .filter(|(_, w)| w == summary)
        .map(|(at, _)| at)
        .collect();
    assert!(!at.is_empty(), "the stored record holds its summary");
    for at in at {
        bytes[at] ^= 0x01;
    }
    std::fs::write(&file, &bytes).unwrap();

    let output = assert_cmd::Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir.path())
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .timeout(BOUND)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("corrupt"), "{stderr}");
    assert_eq!(std::fs::read(&file).unwrap(), bytes, "left as it was");
    assert!(
        stderr.contains("data/retryplane.redb") && stderr.contains("backup"),
        "the error should name the damaged file and say to restore it from a backup: {stderr}"
    );
}

/// The store's file gone (its volume not mounted, the directory deleted by mistake): the
/// start makes a new, empty store without a word above `info`, and in API mode seeds it from
/// the policy file as version 1. An agent that has run version 13 of the lost store says so
/// in its Hello, and is pushed the seed's version 1 (content of another store, as the docs
/// say), so the whole fleet goes back to the seed file. Nothing at `warn` tells the operator
/// that agents run versions this store never held, the one sign that the store was lost.
#[tokio::test]
async fn an_agent_on_a_version_the_store_never_held_is_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addrs) = serve(dir.path(), &["--api"]).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", addrs[0]))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = AgentServiceClient::new(channel);
    let (tx, rx) = mpsc::channel(4);
    let hello = pb::Hello {
        agent_id: "checkout-7".to_owned(),
        service: "checkout".to_owned(),
        instance_id: 77,
        last_applied_version: 13,
        last_applied_hash: "ab".repeat(32),
        ..Default::default()
    };
    tx.send(pb::AgentMessage {
        kind: Some(Kind::Hello(hello)),
    })
    .await
    .unwrap();
    let mut stream = client
        .connect(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let message = tokio::time::timeout(BOUND, stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let snapshot = message.decode_snapshot().unwrap().unwrap();
    assert_eq!(snapshot.version, 1, "the seed, pushed over version 13");

    let log = dir.path().join("serve.log");
    let deadline = Instant::now() + Duration::from_secs(5);
    let warned = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let warned = text
            .lines()
            .any(|l| l.contains("WARN") && l.contains("checkout-7") && l.contains("13"));
        if warned || Instant::now() > deadline {
            break warned;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drop(tx);
    terminate(child).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        warned,
        "no warning that agent checkout-7 runs version 13, which this store (at version 1) \
         never held; the log at warn:\n{text}"
    );
}

/// The store's file deleted (or another put at its path) under a running control plane in API
/// mode: the next apply is refused before anything is written (`StoreError::FileReplaced`,
/// whose message says why and that nothing is stored until a restart). But the caller gets the
/// answer of a commit that failed half-way: INTERNAL, "the version store failed (see the
/// control plane's log); the change may still have been stored". The change was certainly not
/// stored, and the one thing that makes applies work again (a restart) is only in the log,
/// which whoever runs `apply` may not see.
#[tokio::test]
async fn an_apply_refused_because_the_store_file_was_replaced_says_so_and_that_nothing_was_stored()
{
    let dir = tempfile::tempdir().unwrap();
    let (child, addrs) = serve(dir.path(), &["--api"]).await;
    std::fs::remove_file(dir.path().join("data/retryplane.redb")).unwrap();
    std::fs::write(
        dir.path().join("new.yaml"),
        "version: 1\nendpoints:\n  payments:\n    max_attempts: 2\n",
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir.path())
        .args(["apply", "new.yaml", "--server"])
        .arg(format!("http://{}", addrs[1]))
        .env_remove("RETRYPLANE_TOKEN")
        .output()
        .await
        .unwrap();
    // The one sign on /metrics that changes are not being stored.
    let metrics = http_get(&addrs[2], "/metrics").await;
    terminate(child).await;
    assert!(
        metrics.contains("retryplane_server_store_failures_total 1"),
        "{metrics}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_ne!(output.status.code(), Some(0), "{stderr}");
    assert!(
        !stderr.contains("may still have been stored")
            && stderr.contains("deleted or replaced")
            && stderr.contains("restart"),
        "the refusal should say the store file was deleted or replaced, that nothing was \
         stored, and that a restart is needed: {stderr}"
    );
}

/// The store's file deleted under a running control plane, and no change made: the control
/// plane's check of its store finds it within its interval (10 s), and `status` says so on a
/// line of its own, as `/metrics` does with `retryplane_server_store_healthy 0`, before a
/// restart would create a new, empty store in its place.
#[tokio::test]
async fn a_store_file_deleted_with_no_change_made_shows_in_status_and_on_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addrs) = serve(dir.path(), &["--api"]).await;
    let metrics = http_get(&addrs[2], "/metrics").await;
    assert!(
        metrics.contains("retryplane_server_store_healthy 1"),
        "{metrics}"
    );
    std::fs::remove_file(dir.path().join("data/retryplane.redb")).unwrap();
    let status = || async {
        let output = Command::new(env!("CARGO_BIN_EXE_retryplane"))
            .args(["status", "--server"])
            .arg(format!("http://{}", addrs[1]))
            .env_remove("RETRYPLANE_TOKEN")
            .output()
            .await
            .unwrap();
        assert_eq!(output.status.code(), Some(0), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut shown = status().await;
    while !shown.contains("store: failing since") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        shown = status().await;
    }
    let metrics = http_get(&addrs[2], "/metrics").await;
    terminate(child).await;
    let line = shown
        .lines()
        .find(|l| l.starts_with("store: failing since"))
        .unwrap_or_else(|| panic!("no store line within 30 s: {shown}"));
    assert!(
        line.contains("was deleted or replaced") && line.ends_with("v1 is served from memory"),
        "{line}"
    );
    assert!(
        metrics.contains("retryplane_server_store_healthy 0"),
        "{metrics}"
    );
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert_eq!(
        log.matches("the version store is failing").count(),
        1,
        "{log}"
    );
}
