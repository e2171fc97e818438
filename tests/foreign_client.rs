//! A client in another language speaks the wire contract as the `.proto` files write it:
//! `tests/python/foreign_client.py`, on Python's grpcio with stubs it generates from `proto/`,
//! runs an agent stream (Hello, Snapshot, Ack, a numbered MetricsReport and its MetricsAck) and
//! admin calls (Apply, Get, FleetStatus, Stats) against a real control plane seeded with
//! `config/policies.yaml`. The server's pre-framed snapshots, its typed policies and its
//! metadata must read the same from there as from the Rust crates.
//!
//! Needs a Python with `grpcio` and `grpcio-tools`: `scripts/test` makes one (a virtual
//! environment under `target/`) and names it in `RETRYPLANE_PYTHON`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use retryplane_e2e::*;
use retryplane_proto::pb;
use serde_json::Value;
use tokio::process::Command;

/// The most the Python client may take, stub generation included.
const WAIT: Duration = Duration::from_secs(120);

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The Python with grpcio: `RETRYPLANE_PYTHON`.
fn python() -> PathBuf {
    std::env::var_os("RETRYPLANE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "this test needs a Python with grpcio and grpcio-tools: run `scripts/test` (it \
                 makes one under target/) or set RETRYPLANE_PYTHON to such a python"
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_grpcio_client_runs_the_agent_stream_and_the_admin_calls() {
    let root = repository();
    let example = std::fs::read_to_string(root.join("config/policies.yaml")).unwrap();
    let plane = Plane::api_mode(&example).await;
    let seeded = plane
        .admin()
        .await
        .get(pb::GetRequest::default())
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();

    let child = Command::new(python())
        .arg(root.join("tests/python/foreign_client.py"))
        .arg(root.join("proto"))
        .arg(plane.running.agent_addr.to_string())
        .arg(plane.running.admin_addr.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("the Python client finishes")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    let seen: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));

    // The first snapshot, decoded by protobuf's own Python runtime.
    assert_eq!(seen["first_version"], seeded.version);
    assert_eq!(seen["content_hash"], seeded.content_hash.as_str());
    assert_eq!(
        seen["endpoints"],
        serde_json::json!([
            "payments",
            "inventory",
            "search",
            "shipping-partner",
            "events"
        ])
    );
    assert_eq!(seen["payments_max_attempts"], 4);
    assert_eq!(
        seen["payments_routes"],
        serde_json::json!([["POST", "/v1/charges"], ["GET", "/v1/charges"]])
    );
    assert_eq!(seen["defaults_backoff_base_ms"], 100);
    assert_eq!(seen["defaults_jitter"], "JITTER_FULL");
    assert!(seen["metrics_interval_ms"].as_u64().unwrap() > 0, "{seen}");
    assert_eq!(seen["metrics_ack_metadata"], "1");
    assert_eq!(
        seen["metrics_ack"],
        serde_json::json!({"seq": 1, "dropped": false})
    );

    // Its dry run said what the Apply would change and the hash it would get, as the current
    // version stayed.
    assert_eq!(seen["dry_run"]["version"], seeded.version);
    assert_eq!(seen["dry_run"]["content_hash"], seeded.content_hash);
    assert_eq!(seen["dry_run"]["changed"], false);
    assert_eq!(seen["dry_run"]["would_change"], true);
    assert_eq!(
        seen["dry_run"]["new_content_hash"],
        seen["get"]["content_hash"]
    );

    // Its Apply made a version that was pushed to it, and it ACKed that.
    let applied = seeded.version + 1;
    assert_eq!(
        seen["applied"],
        serde_json::json!({"version": applied, "changed": true})
    );
    assert_eq!(seen["pushed_version"], applied);
    assert_eq!(seen["pushed_payments_max_attempts"], 5);
    assert_eq!(seen["get"]["version"], applied);
    assert_eq!(seen["get"]["source"], "admin");
    assert_eq!(seen["get"]["yaml_has_payments"], true);
    assert_eq!(seen["fleet"]["applied_version"], applied);
    assert_eq!(seen["fleet"]["last_response"], "ack");
    assert_eq!(seen["fleet"]["service"], "checkout");
    assert_eq!(
        seen["fleet"]["labels"],
        serde_json::json!({"lang": "python"})
    );
    assert_eq!(
        seen["stats"],
        serde_json::json!({"calls": 10, "retries": 3, "backoff_ms": 250})
    );

    // And the server agrees, read from Rust.
    let stats = endpoint_stats(&plane, "payments").await.unwrap();
    assert_eq!((stats.calls, stats.attempts, stats.retries), (10, 13, 3));
    assert_eq!((stats.success_first_try, stats.gave_up_attempts), (8, 1));
    let fleet = plane
        .admin()
        .await
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    let agent = fleet
        .agents
        .iter()
        .find(|a| a.agent_id == "python-agent")
        .unwrap();
    assert_eq!(agent.applied_version, applied);
    assert!(agent.agent_version.starts_with("grpcio-"), "{agent:?}");
}
