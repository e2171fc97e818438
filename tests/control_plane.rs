//! End-to-end: the real control plane on 127.0.0.1:0, raw protocol agents, the admin API.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Duration;

use retryplane_e2e::*;
use retryplane_proto::pb::{self, agent_message::Kind};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_agent_gets_the_snapshot_and_its_ack_shows_in_status() {
    let plane = Plane::file_mode(&policy_yaml(3, 4)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    let snap = agent.next_snapshot().await.unwrap();
    assert_eq!(snap.version, 1);
    assert_eq!(snap.content_hash.len(), 64);
    assert_eq!(snap.policies.as_ref().unwrap().endpoints.len(), 3);
    agent.ack(&snap).await;
    eventually("the ACK shows in fleet status", || async {
        agent_status(&plane, "a1")
            .await
            .is_some_and(|s| s.applied_version == 1 && s.last_response == "ack")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_keeps_the_last_good_version_and_shows_the_error_in_status() {
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    let v1 = agent.next_snapshot().await.unwrap();
    agent.ack(&v1).await;
    let mut admin = plane.admin().await;
    admin
        .apply(pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml(policy_yaml(2, 5))),
                origin: "test".into(),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let v2 = agent.next_snapshot().await.unwrap();
    assert_eq!(v2.version, 2);
    agent.nack(&v2, "unknown field in policy").await;
    eventually("the NACK shows in fleet status", || async {
        agent_status(&plane, "a1").await.is_some_and(|s| {
            s.applied_version == 1
                && s.last_response == "nack"
                && s.last_response_version == 2
                && s.last_error == "unknown field in policy"
        })
    })
    .await;
    // A NACK is recorded, not answered with the same snapshot again.
    let again = tokio::time::timeout(Duration::from_millis(300), agent.rx.message()).await;
    assert!(again.is_err(), "the server re-sent a NACKed snapshot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_resumes_with_the_current_version_gets_no_duplicate_push() {
    let plane = Plane::file_mode(&policy_yaml(2, 3)).await;
    let mut first = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    let snap = first.next_snapshot().await.unwrap();
    first.ack(&snap).await;
    drop(first);
    let mut again = RawAgent::connect(
        plane.agent_channel().await,
        hello("a1", snap.version, &snap.content_hash),
    )
    .await
    .unwrap();
    let nothing = tokio::time::timeout(Duration::from_millis(300), again.rx.message()).await;
    assert!(nothing.is_err(), "an up-to-date agent was sent a snapshot");
    // An agent that is behind gets the snapshot on resume.
    let mut behind = RawAgent::connect(plane.agent_channel().await, hello("a2", 0, ""))
        .await
        .unwrap();
    assert_eq!(behind.next_snapshot().await.unwrap().version, snap.version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stream_with_the_same_agent_id_replaces_the_first() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut first = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    first.next_snapshot().await.unwrap();
    let mut second = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    second.next_snapshot().await.unwrap();
    let ended = first.next_snapshot().await.unwrap_err();
    assert_eq!(ended.code(), Code::Aborted, "{ended:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_serves_the_same_version_and_hash() {
    let plane = Plane::file_mode(&policy_yaml(3, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    let before = agent.next_snapshot().await.unwrap();
    drop(agent);
    let Plane { running, dir } = plane;
    running.shutdown().await.unwrap();
    let plane = Plane::start_in(dir, false, None).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello("a2", 0, ""))
        .await
        .unwrap();
    let after = agent.next_snapshot().await.unwrap();
    assert_eq!(
        (after.version, after.content_hash),
        (before.version, before.content_hash)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_file_is_published_and_an_invalid_save_keeps_the_old_version() {
    let plane = Plane::file_mode(&policy_yaml(2, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    assert_eq!(agent.next_snapshot().await.unwrap().version, 1);
    // Save by rename, as editors do.
    let path = plane.policy_path();
    let tmp = path.with_extension("yaml.swp");
    std::fs::write(&tmp, policy_yaml(2, 5)).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let v2 = agent.next_snapshot().await.unwrap();
    assert_eq!(v2.version, 2);
    // An invalid save is refused; the last good version keeps being served.
    std::fs::write(&path, "version: 1\nendpoints:\n  ep-0: {max_attempts: 0}\n").unwrap();
    let mut admin = plane.admin().await;
    eventually("the invalid save is counted as rejected", || async {
        let http = plane.running.http_addr;
        metrics_text(http)
            .await
            .contains("retryplane_server_rejected_changes_total 1")
    })
    .await;
    let current = admin
        .get(pb::GetRequest { version: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(current.info.unwrap().version, 2);
    let mut late = RawAgent::connect(plane.agent_channel().await, hello("a2", 0, ""))
        .await
        .unwrap();
    assert_eq!(late.next_snapshot().await.unwrap().version, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_removes_every_endpoint_is_refused_unless_forced() {
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let mut admin = plane.admin().await;
    let other = "version: 1\nendpoints:\n  brand-new: {}\n".to_owned();
    let request = |force| pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(pb::policy_source::Kind::Yaml(other.clone())),
            origin: "test".into(),
        }),
        force,
        ..Default::default()
    };
    let refused = admin.apply(request(false)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("force"), "{}", refused.message());
    let forced = admin.apply(request(true)).await.unwrap().into_inner();
    assert!(forced.changed);
    assert_eq!(forced.version, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_message_that_is_not_hello_ends_the_stream_with_invalid_argument() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let ack_first = pb::AgentMessage {
        kind: Some(Kind::Ack(pb::Ack {
            version: 1,
            nonce: "x".into(),
        })),
    };
    let err = match RawAgent::connect(plane.agent_channel().await, ack_first).await {
        Err(status) => status,
        Ok(mut agent) => agent.next_snapshot().await.unwrap_err(),
    };
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // The server keeps serving everyone else.
    let mut ok = RawAgent::connect(plane.agent_channel().await, hello("a1", 0, ""))
        .await
        .unwrap();
    assert_eq!(ok.next_snapshot().await.unwrap().version, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_closes_only_that_stream() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut big = RawAgent::connect(plane.agent_channel().await, hello("big", 0, ""))
        .await
        .unwrap();
    big.next_snapshot().await.unwrap();
    let huge = pb::Nack {
        version: 1,
        nonce: "n".into(),
        error: "x".repeat(8 * 1024 * 1024),
    };
    // The send may fail once the server resets the stream; either way the stream ends.
    let _ = big
        .tx
        .send(pb::AgentMessage {
            kind: Some(Kind::Nack(huge)),
        })
        .await;
    let err = big.next_snapshot().await.unwrap_err();
    assert_ne!(err.code(), Code::Ok);
    let mut ok = RawAgent::connect(plane.agent_channel().await, hello("small", 0, ""))
        .await
        .unwrap();
    assert_eq!(ok.next_snapshot().await.unwrap().version, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_streams_all_receive_one_push() {
    let plane = Plane::api_mode(&policy_yaml(10, 3)).await;
    // Spread the agents over several HTTP/2 connections, as real fleets are.
    let mut channels = Vec::new();
    for _ in 0..8 {
        channels.push(plane.agent_channel().await);
    }
    let mut agents = Vec::new();
    for i in 0..1000 {
        let ch = channels[i % channels.len()].clone();
        agents.push(tokio::spawn(async move {
            let mut agent = RawAgent::connect(ch, hello(&format!("agent-{i}"), 0, ""))
                .await
                .unwrap();
            let v1 = agent.next_snapshot().await.unwrap();
            agent.ack(&v1).await;
            agent
        }));
    }
    let mut connected = Vec::new();
    for a in agents {
        connected.push(a.await.unwrap());
    }
    let mut admin = plane.admin().await;
    admin
        .apply(pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml(policy_yaml(10, 5))),
                origin: "test".into(),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut waits = Vec::new();
    for mut agent in connected {
        waits.push(tokio::spawn(async move {
            let v2 = agent.next_snapshot().await.unwrap();
            agent.ack(&v2).await;
            (v2.version, agent)
        }));
    }
    let mut keep = Vec::new();
    for w in waits {
        let (version, agent) = w.await.unwrap();
        assert_eq!(version, 2);
        keep.push(agent);
    }
    eventually("every agent's ACK of v2 shows in status", || async {
        let status = admin
            .clone()
            .fleet_status(pb::FleetStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        status
            .agents
            .iter()
            .filter(|a| a.applied_version == 2)
            .count()
            == 1000
    })
    .await;
}
