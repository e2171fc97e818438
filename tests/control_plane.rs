//! End-to-end: the real control plane on 127.0.0.1:0, raw protocol agents, the admin API.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Duration;

use retryplane_e2e::*;
use retryplane_proto::pb::{self, agent_message::Kind};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_agent_gets_the_snapshot_and_its_ack_shows_in_status() {
    let plane = Plane::file_mode(&policy_yaml(3, 4)).await;
    let mut agent = plane.agent("a1").await;
    let snap = agent.next_snapshot().await.unwrap();
    assert_eq!(snap.version, 1);
    assert_eq!(snap.content_hash.len(), 64);
    assert_eq!(snap.policies.as_ref().unwrap().endpoints.len(), 3);
    agent.ack(&snap).await;
    plane
        .until_agent("a1", "the ACK shows in fleet status", |s| {
            s.applied_version == 1 && s.last_response == "ack"
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_keeps_the_last_good_version_and_shows_the_error_in_status() {
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let (mut agent, _) = plane.acked_agent("a1", 7).await;
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
    plane
        .until_agent("a1", "the NACK shows in fleet status", |s| {
            s.applied_version == 1
                && s.last_response == "nack"
                && s.last_response_version == 2
                && s.last_error == "unknown field in policy"
        })
        .await;
    // A NACK is recorded, not answered with the same snapshot again: the stream handles the
    // NACK before the numbered report sent after it, so the report's ack comes first.
    agent.send(report(1, "payments", 1)).await;
    let next = agent.next_message().await.unwrap();
    assert!(
        next.metrics_ack.is_some(),
        "the server re-sent a NACKed snapshot: {next:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_snapshot_is_not_pushed_again_after_a_reconnect() {
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let with_instance = |mut message: pb::AgentMessage, last: &pb::Snapshot| {
        if let Some(Kind::Hello(h)) = &mut message.kind {
            h.instance_id = 7;
            h.last_applied_version = last.version;
            h.last_applied_hash.clone_from(&last.content_hash);
        }
        message
    };
    let (mut agent, v1) = plane.acked_agent("a1", 7).await;
    assert_eq!(plane.apply(&policy_yaml(2, 5)).await, 2);
    let v2 = agent.next_snapshot().await.unwrap();
    agent.nack(&v2, "unknown field in policy").await;
    let nacked = |s: &pb::AgentStatus| {
        s.applied_version == 1
            && s.last_response == "nack"
            && s.last_response_version == 2
            && s.last_error == "unknown field in policy"
    };
    plane
        .until_agent("a1", "the NACK shows in fleet status", |s| nacked(s))
        .await;
    // The agent reconnects running v1, as an agent does after a lost stream.
    drop(agent);
    let mut agent = RawAgent::connect(
        plane.agent_channel().await,
        with_instance(hello("a1", 0, ""), &v1),
    )
    .await
    .unwrap();
    // The stream's task answers a numbered report after it has decided whether to push: the
    // ack comes first, with no snapshot before it.
    agent.send(report(1, "payments", 1)).await;
    let first = agent.next_message().await.unwrap();
    assert!(
        first.metrics_ack.is_some(),
        "the NACKed snapshot was pushed again: {first:?}"
    );
    let status = agent_status(&plane, "a1").await.unwrap();
    assert!(status.connected && nacked(&status), "{status:?}");
    // A newer version is pushed as usual, and its ACK replaces the NACK.
    assert_eq!(plane.apply(&policy_yaml(2, 4)).await, 3);
    let v3 = agent.next_snapshot().await.unwrap();
    assert_eq!(v3.version, 3);
    agent.ack(&v3).await;
    plane
        .until_agent("a1", "the ACK replaces the NACK", |s| {
            s.last_response == "ack" && s.last_error.is_empty()
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_resumes_with_the_current_version_gets_no_duplicate_push() {
    let plane = Plane::file_mode(&policy_yaml(2, 3)).await;
    let mut first = plane.agent("a1").await;
    let snap = first.next_snapshot().await.unwrap();
    first.ack(&snap).await;
    drop(first);
    let mut resume = hello("a1", snap.version, &snap.content_hash);
    if let Some(Kind::Hello(h)) = &mut resume.kind {
        h.instance_id = 7;
    }
    let mut again = RawAgent::connect(plane.agent_channel().await, resume)
        .await
        .unwrap();
    // The stream decides whether to push before it reads the agent's first message, so the
    // ack of a numbered report sent now comes first when nothing is pushed.
    again.send(report(1, "payments", 1)).await;
    let next = again.next_message().await.unwrap();
    assert!(
        next.metrics_ack.is_some(),
        "an up-to-date agent was sent a snapshot: {next:?}"
    );
    // An agent that is behind gets the snapshot on resume.
    let _behind = plane.agent_on("a2", snap.version).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_naming_the_current_number_with_other_content_is_pending_until_it_answers() {
    let plane = Plane::file_mode(&policy_yaml(2, 3)).await;
    // The agent last ran v1 of a control plane whose store was since reset and seeded again
    // with other content: this v1 is not what it runs.
    let before_the_reset = "0".repeat(64);
    let mut agent = RawAgent::connect(
        plane.agent_channel().await,
        hello("a1", 1, &before_the_reset),
    )
    .await
    .unwrap();
    let snap = agent.next_snapshot().await.unwrap();
    assert_eq!(snap.version, 1);
    assert_ne!(snap.content_hash, before_the_reset);
    // The push is not answered yet: the agent runs no version this control plane knows.
    let status = plane
        .admin()
        .await
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.current_version, 1);
    let a1 = status.agents.iter().find(|a| a.agent_id == "a1").unwrap();
    assert!(a1.connected, "{a1:?}");
    assert_eq!(
        (a1.applied_version, a1.last_response.as_str()),
        (0, ""),
        "counted as running the current version: {a1:?}"
    );
    let metrics = metrics_text(plane.running.http_addr).await;
    assert!(
        metrics
            .lines()
            .any(|l| l == r#"retryplane_agents{applied_version="0"} 1"#),
        "{metrics}"
    );
    assert!(
        !metrics.contains(r#"retryplane_agents{applied_version="1"}"#),
        "{metrics}"
    );
    // Its ACK of the push records what it runs.
    agent.ack(&snap).await;
    plane
        .until_agent("a1", "the ACK shows in fleet status", |s| {
            s.applied_version == 1 && s.last_response == "ack"
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stream_with_the_same_agent_id_replaces_the_first() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut first = plane.agent("a1").await;
    first.next_snapshot().await.unwrap();
    let mut second = plane.agent("a1").await;
    second.next_snapshot().await.unwrap();
    let ended = first.next_snapshot().await.unwrap_err();
    assert_eq!(ended.code(), Code::Aborted, "{ended:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_serves_the_same_version_and_hash() {
    let plane = Plane::file_mode(&policy_yaml(3, 3)).await;
    let mut agent = plane.agent("a1").await;
    let before = agent.next_snapshot().await.unwrap();
    drop(agent);
    let Plane { running, dir } = plane;
    running.shutdown().await.unwrap();
    let plane = Plane::start_in(dir, false, None).await;
    let mut agent = plane.agent("a2").await;
    let after = agent.next_snapshot().await.unwrap();
    assert_eq!(
        (after.version, after.content_hash),
        (before.version, before.content_hash)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_file_is_published_and_an_invalid_save_keeps_the_old_version() {
    let plane = Plane::file_mode(&policy_yaml(2, 3)).await;
    let mut agent = plane.agent_on("a1", 1).await;
    // Save by rename, as editors do.
    let path = plane.policy_path();
    let tmp = path.with_extension("yaml.swp");
    std::fs::write(&tmp, policy_yaml(2, 5)).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let v2 = agent.next_snapshot().await.unwrap();
    assert_eq!(v2.version, 2);
    // An invalid save is refused; the last good version keeps being served.
    std::fs::write(&tmp, "version: 1\nendpoints:\n  ep-0: {max_attempts: 0}\n").unwrap();
    std::fs::rename(&tmp, &path).unwrap();
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
    // FleetStatus says the file was not applied, and why (`retryplane status` shows it).
    let policy_file = || {
        let mut admin = admin.clone();
        async move {
            admin
                .fleet_status(pb::FleetStatusRequest::default())
                .await
                .unwrap()
                .into_inner()
                .policy_file
        }
    };
    eventually("FleetStatus says the save was not applied", || async {
        policy_file().await.is_some_and(|f| !f.served)
    })
    .await;
    let file = policy_file().await.unwrap();
    assert_eq!(
        std::path::Path::new(&file.path).file_name(),
        path.file_name()
    );
    assert!(std::path::Path::new(&file.path).is_absolute(), "{file:?}");
    assert!(
        file.problem
            .starts_with("1 error(s), first: 3:24: error: endpoints.ep-0.max_attempts: "),
        "{file:?}"
    );
    assert!(file.read_unix_ms > 0);
    let _late = plane.agent_on("a2", 2).await;
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
    let _ok = plane.agent_on("a1", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_closes_only_that_stream() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut big = plane.agent("big").await;
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
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    // Refused at its header, at an agent message's limit (an agent's largest report and its
    // envelope), before any of it is kept.
    assert_eq!(
        err.message(),
        format!(
            "a message of 8388623 bytes is over the {} bytes this control plane takes",
            retryplane_proto::MAX_AGENT_MESSAGE_BYTES
        ),
        "{err:?}"
    );
    let _ok = plane.agent_on("small", 1).await;
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
            .fleet_status(pb::FleetStatusRequest::default())
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

/// Agent `a1` (process 1), sent version 1 and then version 2 without answering either.
async fn sent_v1_then_v2(plane: &Plane) -> (RawAgent, pb::Snapshot, pb::Snapshot) {
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello_instance("a1", 1))
        .await
        .unwrap();
    let v1 = agent.next_snapshot().await.unwrap();
    assert_eq!(plane.apply(&policy_yaml(1, 4)).await, 2);
    let v2 = agent.next_snapshot().await.unwrap();
    assert_eq!(v2.version, 2);
    (agent, v1, v2)
}

/// A channel to the agent listener whose streams' receive window is 64 bytes: once its agent
/// stops reading, the server can send a stream nothing more.
async fn tiny_window_channel(plane: &Plane) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", plane.running.agent_addr))
        .unwrap()
        .initial_stream_window_size(64)
        .connect()
        .await
        .unwrap()
}

/// Reads what `agent` was sent until its stream ends; the status it ended with.
async fn until_ended(agent: &mut RawAgent) -> tonic::Status {
    loop {
        if let Err(status) = agent.next_message().await {
            return status;
        }
    }
}

/// Waits until the server has read every message `agent` sent so far: a stream is read in
/// order, so once a numbered report sent now is acknowledged, all before it were read.
async fn after_answers(agent: &mut RawAgent, seq: u64) {
    agent.send(report(seq, "ep-0", 1)).await;
    assert_eq!(agent.next_ack().await, (seq, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_counts_only_for_the_version_its_nonce_was_sent_with() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello_instance("a1", 1))
        .await
        .unwrap();
    let v1 = agent.next_snapshot().await.unwrap();
    // The nonce of the snapshot sent, with another version: both answers are ignored.
    agent
        .send(Kind::Ack(pb::Ack {
            version: 7,
            nonce: v1.nonce.clone(),
        }))
        .await;
    agent
        .send(Kind::Nack(pb::Nack {
            version: 7,
            nonce: v1.nonce.clone(),
            error: "not the version that was sent".into(),
        }))
        .await;
    after_answers(&mut agent, 1).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 0, "{status:?}");
    assert_eq!(status.last_response, "", "{status:?}");
    let metrics = &plane.running.control().metrics;
    assert_eq!((metrics.acks.get(), metrics.nacks.get()), (0, 0));
    // The right version with its nonce is recorded.
    agent.ack(&v1).await;
    plane
        .until_agent("a1", "the ACK of version 1 shows in fleet status", |s| {
            s.applied_version == 1 && s.last_response == "ack"
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_a_stale_nonce_is_ignored() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let (mut agent, v1, v2) = sent_v1_then_v2(&plane).await;
    // Answers to the push before the last one, and to a nonce never sent.
    agent.ack(&v1).await;
    agent.nack(&v1, "late").await;
    agent
        .send(Kind::Ack(pb::Ack {
            version: 2,
            nonce: "never-sent".into(),
        }))
        .await;
    after_answers(&mut agent, 1).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    // No answer to the last push, but the late ACK (the first answer to the push before it)
    // says what the agent runs, and is its last answer; the NACK after it, a second answer to
    // the same push, and the ACK of a nonce never sent are ignored.
    assert_eq!(status.applied_version, 1, "{status:?}");
    assert_eq!(status.last_response, "ack", "{status:?}");
    assert_eq!(status.last_response_version, 1, "{status:?}");
    let metrics = &plane.running.control().metrics;
    assert_eq!((metrics.acks.get(), metrics.nacks.get()), (1, 0));
    // The last push is still answered.
    agent.ack(&v2).await;
    after_answers(&mut agent, 2).await;
    assert_eq!((metrics.acks.get(), metrics.nacks.get()), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_counts_only_its_first_answer() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello_instance("a1", 1))
        .await
        .unwrap();
    let v1 = agent.next_snapshot().await.unwrap();
    // The same ACK twice, then a NACK of the same push: only the first answer counts.
    agent.ack(&v1).await;
    agent.ack(&v1).await;
    agent.nack(&v1, "changed its mind").await;
    after_answers(&mut agent, 1).await;
    let metrics = &plane.running.control().metrics;
    assert_eq!((metrics.acks.get(), metrics.nacks.get()), (1, 0));
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 1, "{status:?}");
    assert_eq!(status.last_response, "ack", "{status:?}");
    assert_eq!(status.last_error, "", "{status:?}");
    // The next push is answered anew.
    assert_eq!(plane.apply(&policy_yaml(1, 4)).await, 2);
    let v2 = agent.next_snapshot().await.unwrap();
    agent.nack(&v2, "unknown field").await;
    agent.ack(&v2).await;
    after_answers(&mut agent, 2).await;
    assert_eq!((metrics.acks.get(), metrics.nacks.get()), (1, 1));
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 1, "{status:?}");
    assert_eq!(status.last_error, "unknown field", "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_stops_reading_is_still_replaced_and_its_stream_ends() {
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let control = plane.running.control().clone();
    let idle = control.publisher.subscribers();
    // A tiny stream window: once the client stops reading, the server can send nothing more.
    let stalled_channel = tiny_window_channel(&plane).await;
    let mut stalled = RawAgent::connect(stalled_channel, hello("a1", 0, ""))
        .await
        .unwrap();
    eventually("the first snapshot is sent", || async {
        control.metrics.pushes.get() >= 1
    })
    .await;
    // More versions than the stream can hold while its agent does not read.
    for max_attempts in 4..=9 {
        plane.apply(&policy_yaml(2, max_attempts)).await;
    }
    let mut second = plane.agent_on("a1", 7).await;
    // The replaced stream's task ends although its agent never read: only the new stream
    // still follows the publisher, and status shows the new stream.
    eventually("the replaced stream's task ends", || async {
        control.publisher.subscribers() == idle + 1
    })
    .await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert!(status.connected);
    assert_eq!(control.fleet.connected(), 1);
    assert_eq!(
        metric(
            plane.running.http_addr,
            "retryplane_server_agents_connected"
        )
        .await,
        Some(1.0)
    );
    // When the stalled agent reads again, what was queued arrives, then the reason it ended.
    let ended = loop {
        match stalled.next_snapshot().await {
            Ok(snapshot) => assert!(snapshot.version < 7, "{snapshot:?}"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), Code::Aborted, "{ended:?}");
    // The new stream is unaffected.
    assert_eq!(plane.apply(&policy_yaml(2, 10)).await, 8);
    assert_eq!(second.next_snapshot().await.unwrap().version, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_waiting_for_hello_are_bounded() {
    let plane = Plane::api_mode_with(&policy_yaml(1, 3), |cfg| {
        cfg.stream_limits.max_pending_handshakes = 2;
        cfg.stream_limits.hello_timeout = Duration::from_secs(60);
    })
    .await;
    // Two streams that have not sent Hello yet hold both handshake places.
    let mut silent = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::AgentMessage>(1);
        let channel = plane.agent_channel().await;
        let pending = tokio::spawn(async move {
            pb::agent_service_client::AgentServiceClient::new(channel)
                .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map(tonic::Response::into_inner)
        });
        silent.push((tx, pending));
    }
    // Both must be waiting on the server before the third comes: one that arrived after a
    // third would be the one refused.
    let http = plane.running.http_addr;
    eventually("both silent streams to wait for their Hello", || async move {
        metric(http, "retryplane_server_streams_awaiting_hello").await == Some(2.0)
    })
    .await;
    // A third stream is refused at once while they wait.
    let Err(refused) = RawAgent::connect(plane.agent_channel().await, hello("probe", 0, "")).await
    else {
        panic!("a third stream got in while two waited for their Hello");
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("waiting to send Hello"),
        "{refused:?}"
    );
    // Once the waiting streams say Hello, new streams are accepted again.
    for (i, (tx, pending)) in silent.into_iter().enumerate() {
        tx.send(hello(&format!("slow-{i}"), 0, "")).await.unwrap();
        let mut inbound = pending.await.unwrap().unwrap();
        let first = inbound.message().await.unwrap().unwrap();
        assert_eq!(first.decode_snapshot().unwrap().unwrap().version, 1);
    }
    assert_eq!(
        metric(http, "retryplane_server_streams_awaiting_hello").await,
        Some(0.0)
    );
    let _late = plane.agent_on("late", 1).await;
}

/// An encoded Hello, for [`BytesAgent`].
fn hello_bytes(id: &str) -> Vec<u8> {
    prost::Message::encode_to_vec(&hello(id, 0, ""))
}

/// Bytes that are no AgentMessage: a varint that never ends.
const GARBAGE: [u8; 12] = [0xff; 12];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_hello_ends_only_that_stream_with_invalid_argument() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let mut other = plane.agent_on("other", 1).await;
    let mut bad = BytesAgent::connect(plane.agent_channel().await, hello_bytes("bad"))
        .await
        .unwrap();
    let first = bad.rx.message().await.unwrap().unwrap();
    assert_eq!(first.decode_snapshot().unwrap().unwrap().version, 1);
    bad.tx.send(GARBAGE.to_vec()).await.unwrap();
    let ended = bad.ended().await;
    assert_eq!(ended.code(), Code::InvalidArgument, "{ended:?}");
    assert!(
        ended.message().starts_with("cannot decode the message"),
        "{ended:?}"
    );
    plane
        .until_agent("bad", "the bad stream shows as disconnected", |s| {
            !s.connected
        })
        .await;
    // Every other stream keeps working.
    assert_eq!(plane.apply(&policy_yaml(1, 4)).await, 2);
    assert_eq!(other.next_snapshot().await.unwrap().version, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_first_message_is_refused_with_invalid_argument() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let refused = match BytesAgent::connect(plane.agent_channel().await, GARBAGE.to_vec()).await {
        Err(status) => status,
        Ok(mut agent) => agent.ended().await,
    };
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().starts_with("cannot decode the message"),
        "{refused:?}"
    );
    let _ok = plane.agent_on("a1", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_grpc_message_header_ends_only_that_stream_with_invalid_argument() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let mut other = plane.agent_on("other", 1).await;
    // A message that decodes; only its header is wrong.
    let ack = prost::Message::encode_to_vec(&pb::AgentMessage {
        kind: Some(Kind::Ack(pb::Ack {
            version: 1,
            nonce: "n".into(),
        })),
    });
    for (id, flag, code, says) in [
        (
            "bad-flag",
            2,
            Code::InvalidArgument,
            "invalid gRPC message header: compressed-flag 2; it must be 0 or 1",
        ),
        // gRPC's compression spec: INTERNAL for a compressed message with no grpc-encoding.
        (
            "bad-compressed",
            1,
            Code::Internal,
            "invalid gRPC message header: compressed-flag 1 on a stream without compression (grpc-encoding absent or identity)",
        ),
    ] {
        let mut bad =
            FramedAgent::connect(plane.agent_channel().await, framed(0, &hello_bytes(id)))
                .await
                .unwrap();
        let first = bad.rx.message().await.unwrap().unwrap();
        assert_eq!(first.decode_snapshot().unwrap().unwrap().version, 1);
        bad.tx.send(framed(flag, &ack)).await.unwrap();
        let ended = bad.ended().await;
        assert_eq!((ended.code(), ended.message()), (code, says), "{ended:?}");
        plane
            .until_agent(id, "the bad stream shows as disconnected", |s| !s.connected)
            .await;
    }
    // As the first message, the stream is refused the same way.
    let refused = match FramedAgent::connect(
        plane.agent_channel().await,
        framed(0xff, &hello_bytes("bad-first")),
    )
    .await
    {
        Err(status) => status,
        Ok(mut agent) => agent.ended().await,
    };
    assert_eq!(
        (refused.code(), refused.message()),
        (
            Code::InvalidArgument,
            "invalid gRPC message header: compressed-flag 255; it must be 0 or 1"
        ),
        "{refused:?}"
    );
    assert!(agent_status(&plane, "bad-first").await.is_none());
    // Every other stream keeps working, and a new one is served.
    assert_eq!(plane.apply(&policy_yaml(1, 4)).await, 2);
    assert_eq!(other.next_snapshot().await.unwrap().version, 2);
    let _late = plane.agent_on("late", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_limit_refuses_new_agents_over_the_wire() {
    let plane = Plane::api_mode_with(&policy_yaml(1, 3), |cfg| cfg.max_agents = 2).await;
    let channel = plane.agent_channel().await;
    let mut a1 = RawAgent::connect(channel.clone(), hello("a1", 0, ""))
        .await
        .unwrap();
    a1.next_snapshot().await.unwrap();
    let mut a2 = RawAgent::connect(channel.clone(), hello("a2", 0, ""))
        .await
        .unwrap();
    a2.next_snapshot().await.unwrap();
    let refused = match RawAgent::connect(channel.clone(), hello("a3", 0, "")).await {
        Err(status) => status,
        Ok(mut agent) => agent.next_snapshot().await.unwrap_err(),
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(
        refused.message(),
        "the control plane already serves its maximum of 2 agents"
    );
    assert_eq!(
        metric(
            plane.running.http_addr,
            "retryplane_server_streams_refused_total"
        )
        .await,
        Some(1.0)
    );
    // A known agent that reconnects replaces its stream, at the limit too.
    let mut again = RawAgent::connect(channel.clone(), hello("a1", 0, ""))
        .await
        .unwrap();
    again.next_snapshot().await.unwrap();
    // Once an agent leaves, a new one gets its place.
    drop(a2);
    plane
        .until_agent("a2", "a2 shows as disconnected", |s| !s.connected)
        .await;
    let mut a3 = RawAgent::connect(channel, hello("a3", 0, ""))
        .await
        .unwrap();
    a3.next_snapshot().await.unwrap();
    drop(a1);
}

/// A Hello for `id` with `labels`.
fn hello_with(id: &str, service: &str, labels: &[(String, String)]) -> pb::AgentMessage {
    pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: id.to_owned(),
            service: service.to_owned(),
            agent_version: "test".to_owned(),
            labels: labels.iter().cloned().collect(),
            ..Default::default()
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_fields_and_labels_are_bounded() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let channel = plane.agent_channel().await;
    let refused = |message: pb::AgentMessage| {
        let channel = channel.clone();
        async move {
            match RawAgent::connect(channel, message).await {
                Err(status) => status,
                Ok(mut agent) => agent.next_snapshot().await.unwrap_err(),
            }
        }
    };
    let long = "x".repeat(257);
    let at_limit = "x".repeat(256);
    let fields =
        |field: &str| format!("Hello.{field} is 257 bytes; Hello fields are limited to 256 bytes");
    let labels_message = "Hello carries at most 64 labels of at most 256 bytes";
    let label = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let many: Vec<_> = (0..65).map(|i| label(&format!("k{i}"), "v")).collect();
    for (message, expected) in [
        (
            hello_with("", "checkout", &[]),
            "Hello.agent_id is empty".to_owned(),
        ),
        (hello_with(&long, "checkout", &[]), fields("agent_id")),
        (hello_with("a1", &long, &[]), fields("service")),
        (
            hello_with("a1", "checkout", &many),
            labels_message.to_owned(),
        ),
        (
            hello_with("a1", "checkout", &[label(&long, "v")]),
            labels_message.to_owned(),
        ),
        (
            hello_with("a1", "checkout", &[label("zone", &long)]),
            labels_message.to_owned(),
        ),
    ] {
        let status = refused(message).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert_eq!(status.message(), expected);
    }
    let mut long_version = hello_with("a1", "checkout", &[]);
    if let Some(Kind::Hello(h)) = &mut long_version.kind {
        h.agent_version = long.clone();
    }
    let status = refused(long_version).await;
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, fields("agent_version").as_str())
    );
    // At the limits, the agent is accepted.
    let most: Vec<_> = (0..64)
        .map(|i| label(&format!("{i:0>256}"), &at_limit))
        .collect();
    let mut ok = RawAgent::connect(channel.clone(), hello_with(&at_limit, &at_limit, &most))
        .await
        .unwrap();
    assert_eq!(ok.next_snapshot().await.unwrap().version, 1);
    let status = agent_status(&plane, &at_limit).await.unwrap();
    assert_eq!(status.labels.len(), 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_status_shows_who_connected_from_where_and_who_left() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let http = plane.running.http_addr;
    let wall_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let before = wall_ms();
    let labels = [("zone".to_owned(), "eu-1".to_owned())];
    let mut agent = RawAgent::connect(
        plane.agent_channel().await,
        hello_with("a1", "checkout", &labels),
    )
    .await
    .unwrap();
    agent.next_snapshot().await.unwrap();
    let after = wall_ms();
    let status = agent_status(&plane, "a1").await.unwrap();
    assert!(status.connected);
    assert_eq!(status.service, "checkout");
    assert_eq!(status.agent_version, "test");
    assert_eq!(status.labels.get("zone").map(String::as_str), Some("eu-1"));
    assert_eq!(status.labels.len(), 1);
    let peer: std::net::SocketAddr = status.peer.parse().unwrap();
    assert!(peer.ip().is_loopback(), "{peer}");
    assert_ne!(peer.port(), 0);
    assert_ne!(peer.port(), plane.running.agent_addr.port());
    assert!(
        (before..=after).contains(&status.connected_since_unix_ms),
        "{} not in {before}..={after}",
        status.connected_since_unix_ms
    );
    assert!(status.last_seen_unix_ms >= status.connected_since_unix_ms);
    assert_eq!(
        metric(http, "retryplane_server_agents_connected").await,
        Some(1.0)
    );
    // A dropped stream stays listed as disconnected, and the gauge goes down.
    drop(agent);
    plane
        .until_agent("a1", "a1 shows as disconnected", |s| !s.connected)
        .await;
    let gone = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(gone.connected_since_unix_ms, status.connected_since_unix_ms);
    assert_eq!(gone.peer, status.peer);
    eventually("the gauge shows no agent", || async {
        metric(http, "retryplane_server_agents_connected").await == Some(0.0)
    })
    .await;
}

/// Copies bytes from `from` to `to` until `frozen` is set; from then on it neither reads nor
/// writes, and keeps both sockets open: a peer that went silent without closing anything (a
/// partitioned network, a suspended VM), which only HTTP/2 keepalive can tell.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(std::sync::atomic::Ordering::SeqCst) {
            // Holds both halves: the connection stays open and says nothing more.
            return std::future::pending().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_goes_silent_is_dropped_by_keepalive_and_shows_disconnected() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let plane = Plane::api_mode_with(&policy_yaml(1, 3), |cfg| {
        cfg.keepalive_interval = Duration::from_secs(1);
        // Room for a loaded machine to answer the PINGs of the connections that do read.
        cfg.keepalive_timeout = Duration::from_secs(3);
    })
    .await;
    // A TCP relay between the agent and the server that can stop passing anything on.
    let upstream = plane.running.agent_addr;
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let frozen = Arc::new(AtomicBool::new(false));
    let relay_frozen = frozen.clone();
    tokio::spawn(async move {
        loop {
            let (agent_side, _) = relay.accept().await.unwrap();
            let server_side = tokio::net::TcpStream::connect(upstream).await.unwrap();
            let (agent_read, agent_write) = agent_side.into_split();
            let (server_read, server_write) = server_side.into_split();
            tokio::spawn(pump(agent_read, server_write, relay_frozen.clone()));
            tokio::spawn(pump(server_read, agent_write, relay_frozen.clone()));
        }
    });
    let mut silent = RawAgent::connect(channel(relay_addr).await, hello("silent", 0, ""))
        .await
        .unwrap();
    let snapshot = silent.next_snapshot().await.unwrap();
    silent.ack(&snapshot).await;
    let mut direct = plane.agent("direct").await;
    direct.next_snapshot().await.unwrap();
    plane
        .until_agent("silent", "the silent agent's ACK is recorded", |s| {
            s.connected && s.last_response == "ack"
        })
        .await;
    frozen.store(true, Ordering::SeqCst);
    // No FIN, no RST: only an unanswered PING ends the connection (1 s + 3 s here).
    plane
        .until_agent("silent", "the silent agent shows as disconnected", |s| {
            !s.connected
        })
        .await;
    // Everyone else carries on.
    assert!(agent_status(&plane, "direct").await.unwrap().connected);
    let version = plane.apply(&policy_yaml(1, 4)).await;
    assert_eq!(direct.next_snapshot().await.unwrap().version, version);
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_sends_but_does_not_read_ends_alone_and_its_connection_carries_on() {
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    // One connection for both agents, as behind an HTTP/2 proxy, with a tiny stream window:
    // once an agent stops reading, the server can send it nothing more.
    let shared = tiny_window_channel(&plane).await;
    let mut good = RawAgent::connect(shared.clone(), hello_instance("good", 1))
        .await
        .unwrap();
    let snapshot = good.next_snapshot().await.unwrap();
    good.ack(&snapshot).await;
    let mut deaf = RawAgent::connect(shared, hello_instance("deaf", 2))
        .await
        .unwrap();
    // Numbered reports from an agent that never reads their acks: far more small messages
    // than h2 keeps unread for one connection (about 2,000) before it drops the connection.
    for seq in 1..=5_000 {
        let message = pb::AgentMessage {
            kind: Some(report(seq, "svc-0", 1)),
        };
        match tokio::time::timeout(Duration::from_secs(2), deaf.tx.send(message)).await {
            Ok(Ok(())) => {}
            // The stream was ended and its messages are no longer taken.
            _ => break,
        }
    }
    // The other agent on the connection is unaffected: it gets the next version, and its own
    // report is answered.
    assert_eq!(plane.apply(&policy_yaml(2, 4)).await, 2);
    assert_eq!(good.next_snapshot().await.unwrap().version, 2);
    good.send(report(1, "svc-0", 1)).await;
    assert_eq!(good.next_ack().await, (1, false));
    // The agent that did not read finds, once it reads, what was queued and then why its
    // stream ended.
    let ended = until_ended(&mut deaf).await;
    assert_eq!(ended.code(), Code::ResourceExhausted, "{ended:?}");
    assert!(ended.message().contains("does not read"), "{ended:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_without_a_hash_naming_a_version_never_reached_runs_no_known_version() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello("a1", 999, ""))
        .await
        .unwrap();
    let v1 = agent.next_snapshot().await.unwrap();
    assert_eq!(v1.version, 1);
    agent.nack(&v1, "no").await;
    plane
        .until_agent("a1", "the NACK shows", |s| s.last_response == "nack")
        .await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 0, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_ack_of_an_earlier_push_says_what_the_agent_runs_when_it_refuses_the_last() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let (mut agent, v1) = plane.acked_agent("a1", 1).await;
    after_answers(&mut agent, 1).await;
    assert_eq!(plane.apply(&policy_yaml(1, 4)).await, 2);
    assert_eq!(plane.apply(&policy_yaml(1, 5)).await, 3);
    let v2 = agent.next_snapshot().await.unwrap();
    let v3 = agent.next_snapshot().await.unwrap();
    assert_eq!((v2.version, v3.version), (2, 3));
    // The agent applies v2 (and says so), then refuses v3 and keeps running v2.
    agent.ack(&v2).await;
    agent.nack(&v3, "refused").await;
    after_answers(&mut agent, 2).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.last_response, "nack", "{status:?}");
    assert_eq!(status.last_response_version, 3, "{status:?}");
    assert_eq!(status.applied_version, 2, "the agent runs v2: {status:?}");
    // An answer to v1 now, or a second ACK of v2, changes nothing.
    agent.ack(&v1).await;
    agent.ack(&v2).await;
    after_answers(&mut agent, 3).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(
        (status.applied_version, status.last_response.as_str()),
        (2, "nack"),
        "{status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_ack_is_known_however_many_pushes_followed_it() {
    // An agent slow to apply: twelve versions are pushed before it answers the first. It
    // runs that one and refuses the rest.
    const LATER: u64 = 12;
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello_instance("a1", 1))
        .await
        .unwrap();
    let mut pushed = vec![agent.next_snapshot().await.unwrap()];
    for n in 1..=LATER {
        let version = plane.apply(&policy_yaml(1 + n as usize, 3)).await;
        let snapshot = agent.next_snapshot().await.unwrap();
        assert_eq!(snapshot.version, version);
        pushed.push(snapshot);
    }
    agent.ack(&pushed[0]).await;
    after_answers(&mut agent, 1).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 1, "the agent runs v1: {status:?}");
    for snapshot in &pushed[1..] {
        agent.nack(snapshot, "refused").await;
    }
    after_answers(&mut agent, 2).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(
        (status.applied_version, status.last_response.as_str()),
        (1, "nack"),
        "{status:?}"
    );
    assert_eq!(status.last_response_version, 1 + LATER, "{status:?}");
    // An ACK with a nonce this control plane never gave that version changes nothing.
    agent
        .send(Kind::Ack(pb::Ack {
            version: 5,
            nonce: pushed[0].nonce.clone(),
        }))
        .await;
    after_answers(&mut agent, 3).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 1, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_reads_is_not_ended_for_a_burst_of_reports() {
    // A backlog resent at once after an outage, as agent.proto has an agent do.
    const REPORTS: u64 = 300;
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello_instance("a1", 1))
        .await
        .unwrap();
    let tx = agent.tx.clone();
    let reader = tokio::spawn(async move {
        let mut acks = 0;
        while acks < REPORTS {
            let message = agent.next_message().await?;
            acks += u64::from(message.metrics_ack.is_some());
        }
        Ok::<_, tonic::Status>(acks)
    });
    for seq in 1..=REPORTS {
        let message = pb::AgentMessage {
            kind: Some(report(seq, "ep-0", 1)),
        };
        tx.send(message).await.unwrap();
    }
    let read = reader.await.unwrap();
    assert_eq!(read.as_ref().ok(), Some(&REPORTS), "{read:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_reports_but_has_not_read_for_a_while_is_ended() {
    let plane = Plane::api_mode_with(&policy_yaml(2, 3), |cfg| {
        cfg.stream_limits.unread_for = Duration::from_millis(500);
    })
    .await;
    // A tiny stream window: the snapshot fills it, and the agent never reads.
    let channel = tiny_window_channel(&plane).await;
    let mut deaf = RawAgent::connect(channel, hello_instance("deaf", 1))
        .await
        .unwrap();
    // Reports spread over more than the limit: more than the acks a stream may then hold
    // (64), far fewer than the bound whatever the time (1,024).
    for seq in 1..=100 {
        let message = pb::AgentMessage {
            kind: Some(report(seq, "ep-0", 1)),
        };
        if tokio::time::timeout(Duration::from_secs(2), deaf.tx.send(message))
            .await
            .is_err()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ended = until_ended(&mut deaf).await;
    assert_eq!(ended.code(), Code::ResourceExhausted, "{ended:?}");
    assert!(ended.message().contains("has waited"), "{ended:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_after_a_nack_of_an_earlier_push_is_ignored() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let (mut agent, v1, _v2) = sent_v1_then_v2(&plane).await;
    // The first answer to the v1 push refuses it; a contradicting one after it counts for
    // nothing.
    agent.nack(&v1, "refused").await;
    agent.ack(&v1).await;
    after_answers(&mut agent, 1).await;
    let status = agent_status(&plane, "a1").await.unwrap();
    assert_eq!(status.applied_version, 0, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_has_not_read_for_a_while_with_few_acks_waiting_is_not_ended() {
    let plane = Plane::api_mode_with(&policy_yaml(2, 3), |cfg| {
        cfg.stream_limits.unread_for = Duration::from_millis(500);
    })
    .await;
    // Not reading for a second, past the limit, with fewer acks waiting than end a stream
    // (as an agent that reads all along, on a link slow enough that a large snapshot ahead
    // of the acks takes that long to go out).
    let mut agent = RawAgent::connect(tiny_window_channel(&plane).await, hello_instance("a1", 1))
        .await
        .unwrap();
    const REPORTS: u64 = 40;
    for seq in 1..=REPORTS {
        agent.send(report(seq, "ep-0", 1)).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut acks = 0;
    while acks < REPORTS {
        let message = agent.next_message().await.unwrap();
        acks += u64::from(message.metrics_ack.is_some());
    }
    // The stream goes on (past the report rate limit, the answer says the report was dropped).
    agent.send(report(REPORTS + 1, "ep-0", 1)).await;
    assert_eq!(agent.next_ack().await.0, REPORTS + 1);
}

/// A request from a client newer than the control plane: a field it does not know, in a
/// document's endpoint or on the request itself. prost would skip it, so the version would be
/// stored without what its author wrote: Apply refuses it, naming the field and where it is,
/// and stores nothing; Validate calls it invalid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_holding_fields_this_control_plane_does_not_know_is_refused() {
    use prost::Message as _;
    let plane = Plane::api_mode(&policy_yaml(2, 3)).await;
    let document = pb::PolicyDocument {
        defaults: None,
        endpoints: vec![pb::Endpoint {
            name: "ep-0".into(),
            overlay: Some(pb::Overlay {
                max_attempts: Some(2),
                ..Default::default()
            }),
            routes: Vec::new(),
        }],
    };
    // The endpoint's overlay with field 40 (a varint) added.
    let mut endpoint = Vec::new();
    prost::encoding::string::encode(1, &"ep-0".to_owned(), &mut endpoint);
    let mut overlay = document.endpoints[0]
        .overlay
        .clone()
        .unwrap()
        .encode_to_vec();
    prost::encoding::uint64::encode(40, &7, &mut overlay);
    prost::encoding::bytes::encode(2, &overlay, &mut endpoint);
    let mut doc = Vec::new();
    prost::encoding::bytes::encode(2, &endpoint, &mut doc);
    let mut source = Vec::new();
    prost::encoding::bytes::encode(2, &doc, &mut source);
    let mut request = Vec::new();
    prost::encoding::bytes::encode(1, &source, &mut request);
    // It decodes as this build reads it: the same document without the field.
    let read = pb::ApplyRequest::decode(request.as_slice()).unwrap();
    assert!(matches!(
        read.source.and_then(|s| s.kind),
        Some(pb::policy_source::Kind::Document(d)) if d == document
    ));

    let refused = raw_admin_call::<pb::ApplyResponse>(
        &plane,
        "/retryplane.v1.AdminService/Apply",
        request.clone(),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains(
            "field 40 of retryplane.v1.Overlay at `source.document.endpoints[0].overlay` is \
             not known to this control plane"
        ) && refused.message().contains("nothing was applied"),
        "{}",
        refused.message()
    );
    let current = plane
        .admin()
        .await
        .get(pb::GetRequest { version: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(current.info.map(|i| i.version), Some(1), "nothing stored");

    // A flag of the request itself.
    let mut flagged = Vec::new();
    prost::encoding::bytes::encode(1, &source, &mut flagged);
    prost::encoding::bool::encode(30, &true, &mut flagged);
    let refused =
        raw_admin_call::<pb::ApplyResponse>(&plane, "/retryplane.v1.AdminService/Apply", flagged)
            .await
            .unwrap_err();
    assert!(
        refused
            .message()
            .contains("field 30 of retryplane.v1.ApplyRequest is not known"),
        "{}",
        refused.message()
    );

    let checked = raw_admin_call::<pb::ValidateResponse>(
        &plane,
        "/retryplane.v1.AdminService/Validate",
        request,
    )
    .await
    .unwrap();
    assert!(!checked.valid);
    assert!(
        checked.diagnostics[0]
            .message
            .contains("field 40 of retryplane.v1.Overlay"),
        "{checked:?}"
    );
    // The same document as this build writes it is taken.
    let taken = plane
        .admin()
        .await
        .apply(pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Document(document)),
                origin: "test".into(),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(taken.version, 2);
}

/// An agent given its token as a file, when the operator rotates the secret: the control
/// plane's tokens file gets the new secret under a new name and drops the old one, and is
/// reloaded; the agent's stream ends (UNAUTHENTICATED) and, once its token file holds the new
/// secret, its next stream is admitted under the new token, with no restart of the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_token_file_is_rotated_connects_with_the_new_secret() {
    const ADMIN: &str = "admin-secret-0123456789";
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policy_yaml(1, 3)).unwrap();
    let tokens = dir.path().join("tokens.yaml");
    let write_tokens = |agent: &str| {
        std::fs::write(
            &tokens,
            format!("tokens:\n  - {agent}\n  - {{name: ops, role: admin, secret: {ADMIN}}}\n"),
        )
        .unwrap();
    };
    write_tokens("{name: fleet-2025, role: agent, secret: old-agent-secret-0123}");
    let token_file = dir.path().join("agent-token");
    std::fs::write(&token_file, "old-agent-secret-0123\n").unwrap();
    let plane = Plane::start_in(dir, false, Some(tokens.clone())).await;
    let agent =
        token_file_agent(&plane, "rotated-1", &token_file, Duration::from_secs(10), 1).await;
    let before = status_with(&plane, ADMIN, "rotated-1").await.unwrap();
    assert_eq!(before.token, "fleet-2025");

    write_tokens("{name: fleet-2026, role: agent, secret: new-agent-secret-0123}");
    assert_eq!(plane.running.reload_tokens().unwrap(), Some(2));
    eventually("the old secret's stream ends", || async {
        !agent.is_connected()
    })
    .await;
    std::fs::write(&token_file, "new-agent-secret-0123\n").unwrap();
    eventually("the agent is back with the new secret", || async {
        status_with(&plane, ADMIN, "rotated-1")
            .await
            .is_some_and(|s| s.connected && s.token == "fleet-2026")
    })
    .await;
    agent.shutdown().await;
}
