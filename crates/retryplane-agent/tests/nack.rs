//! An invalid or undecodable snapshot over a real stream is NACKed and the last good policy keeps
//! applying.
//!
//! The real control plane never publishes an invalid policy, so a scripted one stands in
//! (`support::script`). The agent is the real one (`Agent::builder().connect()`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::Path;

use prost::Message as _;
use retryplane_agent::Source;
use retryplane_proto::convert;
use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::attempts_of;
use support::script::{Script, send, snapshot};

/// Version 2 with `max_attempts: 0` on `ep` and a hash that matches it: only the validator
/// can refuse it.
fn invalid_snapshot() -> pb::Snapshot {
    let mut snap = snapshot(2, 3);
    let doc = snap.policies.as_mut().unwrap();
    let ep = doc.endpoints.iter_mut().find(|e| e.name == "ep").unwrap();
    ep.overlay.get_or_insert_with(Default::default).max_attempts = Some(0);
    snap.content_hash = convert::content_hash(doc);
    snap
}

/// The snapshot in the cache file (after the file's one-line header).
fn cached(path: &Path) -> pb::Snapshot {
    let bytes = std::fs::read(path).unwrap();
    let body = bytes
        .strip_prefix(b"retryplane agent policy cache 1\n".as_slice())
        .expect("the cache file's header");
    pb::Snapshot::decode(body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_snapshot_is_nacked_and_the_last_good_policy_keeps_applying() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", Some(&cache));

    // Hello, then v1 (4 attempts) is ACKed with its nonce.
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(
        (hello.agent_id.as_str(), hello.last_applied_version),
        ("a", 0)
    );
    let v1 = snapshot(1, 4);
    send(&to_agent, &v1).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!((ack.version, ack.nonce.as_str()), (1, "nonce-1")),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    assert_eq!(agent.policies().version(), 1);
    assert_eq!(agent.last_refusal(), None);
    assert_eq!(attempts_of(&agent).await, 4);
    assert_eq!(
        cached(&cache),
        v1,
        "the ACKed snapshot is cached before the ACK"
    );

    // v2 with max_attempts 0 is NACKed with its nonce and a reason that names the field.
    send(&to_agent, &invalid_snapshot()).await;
    match script.reply().await {
        Kind::Nack(nack) => {
            assert_eq!((nack.version, nack.nonce.as_str()), (2, "nonce-2"));
            assert!(nack.error.contains("max_attempts"), "{}", nack.error);
            // Kept for tools that say why no policy came (`retryplane request --server`).
            let refusal = agent.last_refusal().expect("the refusal is kept");
            assert_eq!((refusal.version, &refusal.error), (2, &nack.error));
        }
        other => panic!("expected Nack v2, got {other:?}"),
    }
    // v2 again, its content no longer matching its hash: NACKed for the hash.
    let mut tampered = snapshot(2, 3);
    tampered.content_hash = "0".repeat(64);
    tampered.nonce = "nonce-2b".into();
    send(&to_agent, &tampered).await;
    match script.reply().await {
        Kind::Nack(nack) => {
            assert_eq!((nack.version, nack.nonce.as_str()), (2, "nonce-2b"));
            assert!(nack.error.contains("hash"), "{}", nack.error);
        }
        other => panic!("expected Nack v2, got {other:?}"),
    }
    // v2 whose policies do not decode at all: NACKed with the version and nonce it carries.
    let head = pb::Snapshot {
        version: 2,
        nonce: "nonce-2c".into(),
        ..Default::default()
    };
    let mut bytes = head.encode_to_vec();
    // Field 3 (policies), 2 bytes long, holding a truncated varint.
    bytes.extend_from_slice(&[0x1a, 0x02, 0x08, 0xff]);
    let broken = pb::ServerMessage {
        snapshot: Some(bytes.into()),
        ..Default::default()
    };
    to_agent.send(Ok(broken)).await.unwrap();
    match script.reply().await {
        Kind::Nack(nack) => {
            assert_eq!((nack.version, nack.nonce.as_str()), (2, "nonce-2c"));
            assert!(nack.error.contains("does not decode"), "{}", nack.error);
        }
        other => panic!("expected Nack v2, got {other:?}"),
    }
    let p = agent.policies();
    assert_eq!((p.version(), p.source()), (1, Source::ControlPlane));
    assert_eq!(p.content_hash(), v1.content_hash);
    assert_eq!(attempts_of(&agent).await, 4, "v1 still applies");
    assert_eq!(cached(&cache), v1, "the cache still holds v1");
    assert!(agent.is_connected(), "a NACK does not end the stream");

    // The control plane ends the stream: the agent comes back on v1, not on the refused v2,
    // and has sent nothing but metrics since the NACK (no NACK loop).
    drop(to_agent);
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(hello.last_applied_version, 1);
    assert_eq!(hello.last_applied_hash, v1.content_hash);

    // v3 (2 attempts) is ACKed: the next answer after the NACKs, on the new stream.
    let v3 = snapshot(3, 2);
    send(&to_agent, &v3).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!((ack.version, ack.nonce.as_str()), (3, "nonce-3")),
        other => panic!("expected Ack v3, got {other:?}"),
    }
    assert_eq!(agent.last_refusal(), None, "cleared by the version applied");
    assert_eq!(agent.policies().version(), 3);
    assert_eq!(attempts_of(&agent).await, 2);
    assert_eq!(cached(&cache), v3);

    script.shut_down(agent, to_agent).await;
}
