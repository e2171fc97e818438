//! End-to-end: what the control plane says about the fleet (FleetStatus, the `status` summary's
//! inputs, the `/metrics` fleet gauges) while versions change fast and raw protocol agents
//! answer slowly, out of order, with stale nonces, refuse, reconnect, and the server restarts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::collections::BTreeMap;

use retryplane_e2e::*;
use retryplane_proto::pb::{self, agent_message::Kind};

/// The whole FleetStatus answer.
async fn fleet(plane: &Plane) -> pb::FleetStatusResponse {
    plane
        .admin()
        .await
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner()
}

/// `(applied_version, last_response, last_response_version)` of `id`.
fn row(status: &pb::FleetStatusResponse, id: &str) -> (u64, String, u64) {
    let a = status
        .agents
        .iter()
        .find(|a| a.agent_id == id)
        .unwrap_or_else(|| panic!("{id} not listed: {status:?}"));
    (
        a.applied_version,
        a.last_response.clone(),
        a.last_response_version,
    )
}

/// The `status` summary as README and `retryplane status` define it: `(acked, nacked,
/// pending, disconnected)` on the current version.
fn summary(status: &pb::FleetStatusResponse) -> (usize, usize, usize, usize) {
    let current = status.current_version;
    let mut out = (0, 0, 0, 0);
    for a in &status.agents {
        if a.last_response == "nack" && a.last_response_version == current {
            out.1 += 1;
        } else if a.connected && current != 0 && a.applied_version == current {
            out.0 += 1;
        } else if a.connected {
            out.2 += 1;
        } else {
            out.3 += 1;
        }
    }
    out
}

/// The samples of the labelled gauge `name` on `/metrics`, by label value.
async fn gauge(plane: &Plane, name: &str) -> BTreeMap<u64, u64> {
    let text = metrics_text(plane.running.http_addr).await;
    let prefix = format!("{name}{{");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|l| {
            let (label, value) = l.split_once("} ")?;
            let (_, v) = label.split_once("=\"")?;
            Some((
                v.trim_end_matches('"').parse().ok()?,
                value.parse::<f64>().ok()? as u64,
            ))
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// The value of the unlabelled gauge `name` on `/metrics`.
async fn plain_gauge(plane: &Plane, name: &str) -> u64 {
    let text = metrics_text(plane.running.http_addr).await;
    let prefix = format!("{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}")) as u64
}

/// Waits until the server has read every message `agent` sent so far (a stream is read in
/// order: once a numbered report sent now is acknowledged, all before it were read). Skips
/// any snapshot pushed meanwhile, and returns them.
async fn settled(agent: &mut RawAgent, seq: &mut u64) -> Vec<pb::Snapshot> {
    *seq += 1;
    agent.send(report(*seq, "ep-0", 1)).await;
    let mut pushed = Vec::new();
    loop {
        let message = agent.next_message().await.unwrap();
        if let Some(ack) = message.metrics_ack {
            assert_eq!(ack.seq, *seq);
            return pushed;
        }
        if let Ok(Some(snapshot)) = message.decode_snapshot() {
            pushed.push(snapshot);
        }
    }
}

/// Reads snapshots until one of `version` arrives; every one read, in order.
async fn snapshots_until(agent: &mut RawAgent, version: u64) -> Vec<pb::Snapshot> {
    let mut seen = Vec::new();
    loop {
        let snapshot = agent.next_snapshot().await.unwrap();
        let last = snapshot.version;
        seen.push(snapshot);
        if last == version {
            return seen;
        }
    }
}

/// v2 then v3 applied, each pushed to `agent` (and read) before the next is applied.
async fn pushed_v2_then_v3(plane: &Plane, agent: &mut RawAgent) -> (pb::Snapshot, pb::Snapshot) {
    assert_eq!(plane.apply(&policy_yaml(1, 4)).await, 2);
    let v2 = agent.next_snapshot().await.unwrap();
    assert_eq!(v2.version, 2);
    assert_eq!(plane.apply(&policy_yaml(1, 5)).await, 3);
    let v3 = agent.next_snapshot().await.unwrap();
    assert_eq!(v3.version, 3);
    (v2, v3)
}

fn hello_running(id: &str, instance: u64, runs: Option<&pb::Snapshot>) -> pb::AgentMessage {
    let mut message = hello_instance(id, instance);
    if let (Some(Kind::Hello(h)), Some(s)) = (&mut message.kind, runs) {
        h.last_applied_version = s.version;
        h.last_applied_hash.clone_from(&s.content_hash);
    }
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_gauges_match_what_each_agent_did_while_versions_change_fast() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let ids = ["fast", "slow", "nacker", "mixed", "stale", "silent"];
    let mut agents = Vec::new();
    let mut seqs = [0u64; 6];
    let mut firsts = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let mut a = RawAgent::connect(
            plane.agent_channel().await,
            hello_instance(id, 1 + i as u64),
        )
        .await
        .unwrap();
        let v1 = a.next_snapshot().await.unwrap();
        assert_eq!(v1.version, 1);
        match *id {
            "nacker" => a.nack(&v1, "refuses everything").await,
            "silent" => {}
            _ => a.ack(&v1).await,
        }
        firsts.push(v1);
        agents.push(a);
    }
    for (a, seq) in agents.iter_mut().zip(seqs.iter_mut()) {
        assert!(settled(a, seq).await.is_empty());
    }
    let s = fleet(&plane).await;
    assert_eq!(s.current_version, 1);
    assert_eq!(summary(&s), (4, 1, 1, 0), "{s:?}");
    assert_eq!(row(&s, "nacker"), (0, "nack".into(), 1));
    assert_eq!(row(&s, "silent"), (0, String::new(), 0));
    assert_eq!(
        gauge(&plane, "retryplane_agents").await,
        BTreeMap::from([(0, 2), (1, 4)])
    );
    assert_eq!(
        gauge(&plane, "retryplane_agents_nacked").await,
        BTreeMap::from([(1, 1)])
    );
    assert_eq!(plain_gauge(&plane, "retryplane_agents_behind").await, 2);

    // Three versions in quick succession.
    for n in 2..=4u32 {
        assert_eq!(u64::from(n), plane.apply(&policy_yaml(1, 3 + n)).await);
    }
    let mut pushed = Vec::new();
    for a in &mut agents {
        pushed.push(snapshots_until(a, 4).await);
    }
    // fast ACKs each in order; nacker refuses each; mixed refuses all but the last; stale
    // answers v4 with v1's nonce and with a made-up one; slow and silent wait.
    for s in &pushed[0] {
        agents[0].ack(s).await;
    }
    for s in &pushed[2] {
        agents[2].nack(s, "refuses everything").await;
    }
    let (last, earlier) = pushed[3].split_last().unwrap();
    for s in earlier {
        agents[3].nack(s, "bad").await;
    }
    agents[3].ack(last).await;
    for nonce in [firsts[4].nonce.clone(), "made-up".to_owned()] {
        agents[4]
            .send(Kind::Ack(pb::Ack { version: 4, nonce }))
            .await;
    }
    for (a, seq) in agents.iter_mut().zip(seqs.iter_mut()) {
        assert!(settled(a, seq).await.is_empty());
    }
    let s = fleet(&plane).await;
    assert_eq!(s.current_version, 4);
    assert_eq!(row(&s, "fast"), (4, "ack".into(), 4));
    assert_eq!(row(&s, "slow"), (1, "ack".into(), 1));
    assert_eq!(row(&s, "nacker"), (0, "nack".into(), 4));
    assert_eq!(row(&s, "mixed"), (4, "ack".into(), 4));
    assert_eq!(row(&s, "stale"), (1, "ack".into(), 1));
    assert_eq!(row(&s, "silent"), (0, String::new(), 0));
    assert_eq!(summary(&s), (2, 1, 3, 0), "{s:?}");
    assert_eq!(
        gauge(&plane, "retryplane_agents").await,
        BTreeMap::from([(0, 2), (1, 2), (4, 2)])
    );
    assert_eq!(plain_gauge(&plane, "retryplane_agents_behind").await, 4);
    assert_eq!(
        gauge(&plane, "retryplane_agents_nacked").await,
        BTreeMap::from([(4, 1)])
    );

    // slow ACKs at last; a rollback to v1 follows (v5).
    agents[1].ack(pushed[1].last().unwrap()).await;
    assert!(settled(&mut agents[1], &mut seqs[1]).await.is_empty());
    let rolled = plane
        .admin()
        .await
        .rollback(pb::RollbackRequest {
            version: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rolled.version, 5);
    let mut v5 = Vec::new();
    for a in &mut agents {
        v5.push(snapshots_until(a, 5).await.pop().unwrap());
    }
    agents[0].ack(&v5[0]).await;
    agents[2].nack(&v5[2], "refuses everything").await;
    agents[3].nack(&v5[3], "bad").await;
    for (a, seq) in agents.iter_mut().zip(seqs.iter_mut()) {
        assert!(settled(a, seq).await.is_empty());
    }
    let s = fleet(&plane).await;
    assert_eq!(s.current_version, 5);
    assert_eq!(row(&s, "slow"), (4, "ack".into(), 4));
    assert_eq!(row(&s, "mixed"), (4, "nack".into(), 5));
    assert_eq!(summary(&s), (1, 2, 3, 0), "{s:?}");
    assert_eq!(
        gauge(&plane, "retryplane_agents").await,
        BTreeMap::from([(0, 2), (1, 1), (4, 2), (5, 1)])
    );
    assert_eq!(plain_gauge(&plane, "retryplane_agents_behind").await, 5);
    assert_eq!(
        gauge(&plane, "retryplane_agents_nacked").await,
        BTreeMap::from([(5, 2)])
    );

    // Reconnects mid-push: v6 is pushed; slow comes back naming v4 (older than the push),
    // stale naming v1; silent goes away.
    assert_eq!(plane.apply(&policy_yaml(1, 9)).await, 6);
    for a in &mut agents {
        snapshots_until(a, 6).await;
    }
    let slow_v4 = pushed[1].last().unwrap().clone();
    drop(agents.remove(5));
    let mut slow = RawAgent::connect(
        plane.agent_channel().await,
        hello_running("slow", 2, Some(&slow_v4)),
    )
    .await
    .unwrap();
    assert_eq!(slow.next_snapshot().await.unwrap().version, 6);
    let mut stale = RawAgent::connect(
        plane.agent_channel().await,
        hello_running("stale", 5, Some(&firsts[4])),
    )
    .await
    .unwrap();
    assert_eq!(stale.next_snapshot().await.unwrap().version, 6);
    eventually("silent shows disconnected", || async {
        fleet(&plane)
            .await
            .agents
            .iter()
            .any(|a| a.agent_id == "silent" && !a.connected)
    })
    .await;
    let s = fleet(&plane).await;
    assert_eq!(row(&s, "slow"), (4, "ack".into(), 4));
    assert_eq!(row(&s, "stale"), (1, "ack".into(), 1));
    assert_eq!(summary(&s), (0, 0, 5, 1), "{s:?}");
    assert_eq!(
        gauge(&plane, "retryplane_agents").await,
        BTreeMap::from([(0, 1), (1, 1), (4, 2), (5, 1)])
    );
    assert_eq!(
        gauge(&plane, "retryplane_agents_nacked").await,
        BTreeMap::from([(5, 2)])
    );
    assert_eq!((s.connected_agents, s.known_agents), (5, 6), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_of_a_push_sent_before_the_last_one_shows_as_the_agents_last_answer() {
    // SPEC §3: fleet status shows each agent's last ACK/NACK and its error.
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let (mut agent, _v1) = plane.acked_agent("a1", 1).await;
    let mut seq = 0;
    settled(&mut agent, &mut seq).await;
    let (v2, _v3) = pushed_v2_then_v3(&plane, &mut agent).await;
    let v2 = &v2;
    // The agent refuses v2 (its last answer so far); v3 is still on its way in the agent.
    agent.nack(v2, "unknown field retry_on.foo").await;
    settled(&mut agent, &mut seq).await;
    let s = fleet(&plane).await;
    let a1 = s.agents.iter().find(|a| a.agent_id == "a1").unwrap();
    // `retryplane_server_nacks_total`: "the first answer to each push".
    let nacks = metric(plane.running.http_addr, "retryplane_server_nacks_total").await;
    assert_eq!(
        (
            a1.last_response.as_str(),
            a1.last_response_version,
            a1.last_error.as_str(),
            nacks
        ),
        ("nack", 2, "unknown field retry_on.foo", Some(1.0)),
        "the agent's NACK of v2 and its error are not shown: {a1:?}"
    );
}

/// A numbered report of `calls` calls and `retries` retries to `endpoint` under `version`.
fn retrying_report(seq: u64, version: u64, endpoint: &str, calls: u64, retries: u64) -> Kind {
    Kind::Metrics(pb::MetricsReport {
        seq,
        policy_version: version,
        endpoints: vec![pb::EndpointCounters {
            endpoint: endpoint.to_owned(),
            calls,
            attempts: calls + retries,
            retries,
            ..Default::default()
        }],
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alerting_list_follows_the_threshold_of_the_version_in_force_through_a_rollback() {
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let (mut agent, v1) = plane.acked_agent("a1", 1).await;
    agent
        .send(retrying_report(1, v1.version, "ep-0", 40, 10))
        .await;
    assert_eq!(agent.next_ack().await, (1, false));
    let alert_gauge = r#"retryplane_retry_ratio_alert{service="checkout",endpoint="ep-0"}"#;
    let alerting = |want: bool| {
        let plane = &plane;
        async move {
            let listed = fleet(plane).await.alerting_endpoints == ["ep-0"];
            let gauge = metrics_text(plane.running.http_addr)
                .await
                .lines()
                .any(|l| {
                    l == format!("{alert_gauge} {}", if want { "1" } else { "0" })
                        || l == format!("{alert_gauge} {}", if want { "1.0" } else { "0.0" })
                });
            listed == want && gauge
        }
    };
    eventually("the alert fires at 25 % > 5 %", || alerting(true)).await;
    // v2 raises the endpoint's threshold past the ratio: the alert ends.
    let v2 = plane
        .apply(
            "version: 1\nendpoints:\n  ep-0:\n    max_attempts: 4\n    alert: {retry_ratio: 0.5}\n",
        )
        .await;
    let pushed = agent.next_snapshot().await.unwrap();
    assert_eq!(pushed.version, v2);
    agent.ack(&pushed).await;
    eventually("the alert ends at 25 % < 50 %", || alerting(false)).await;
    // A rollback to v1 brings the 5 % threshold back: the same ratio fires again.
    let rolled = plane
        .admin()
        .await
        .rollback(pb::RollbackRequest {
            version: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let pushed = agent.next_snapshot().await.unwrap();
    assert_eq!(pushed.version, rolled.version);
    agent.ack(&pushed).await;
    eventually("the alert fires again after the rollback", || {
        alerting(true)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_ack_that_arrives_after_the_next_push_is_shown_as_the_agents_last_answer() {
    // The common case of a slow agent while versions change fast: it ACKs v2 (in order, the
    // first answer to that push) after v3 was pushed. It runs v2 and its last answer is that
    // ACK; the table would otherwise read `APPLIED 2  LAST ack v1`.
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let (mut agent, _v1) = plane.acked_agent("a1", 1).await;
    let mut seq = 0;
    settled(&mut agent, &mut seq).await;
    let acks_before = metric(plane.running.http_addr, "retryplane_server_acks_total").await;
    let (v2, _v3) = pushed_v2_then_v3(&plane, &mut agent).await;
    agent.ack(&v2).await;
    settled(&mut agent, &mut seq).await;
    let s = fleet(&plane).await;
    let acks = metric(plane.running.http_addr, "retryplane_server_acks_total").await;
    assert_eq!(
        (row(&s, "a1"), acks),
        ((2, "ack".into(), 2), acks_before.map(|n| n + 1.0)),
        "the ACK of v2 is not the agent's last answer (nor counted in acks_total): {s:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_agents_answering_fifteen_quick_versions_are_each_shown_as_they_answered() {
    const AGENTS: u64 = 40;
    const LAST: u64 = 16;
    let plane = Plane::api_mode(&policy_yaml(1, 3)).await;
    let channel = plane.agent_channel().await;
    let mut tasks = Vec::new();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(AGENTS as usize);
    for i in 0..AGENTS {
        let channel = channel.clone();
        let ready = ready_tx.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("agent-{i:02}");
            let mut agent = RawAgent::connect(channel, hello_instance(&id, 1 + i))
                .await
                .unwrap();
            let v1 = agent.next_snapshot().await.unwrap();
            agent.ack(&v1).await;
            let mut seq = 0;
            settled(&mut agent, &mut seq).await;
            ready.send(()).await.unwrap();
            // 0: ACKs every push in order; 1: refuses every later push; 2: answers only the
            // last version.
            loop {
                let s = agent.next_snapshot().await.unwrap();
                match i % 3 {
                    0 => agent.ack(&s).await,
                    1 => agent.nack(&s, "no").await,
                    _ if s.version == LAST => agent.ack(&s).await,
                    _ => {}
                }
                if s.version == LAST {
                    break;
                }
            }
            settled(&mut agent, &mut seq).await;
            agent
        }));
    }
    for _ in 0..AGENTS {
        ready_rx.recv().await.unwrap();
    }
    for n in 2..=LAST {
        assert_eq!(plane.apply(&policy_yaml(n as usize, 3)).await, n);
    }
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await.unwrap());
    }
    let s = fleet(&plane).await;
    assert_eq!(s.current_version, LAST);
    for i in 0..AGENTS {
        let want = match i % 3 {
            1 => (1, "nack".to_owned(), LAST),
            _ => (LAST, "ack".to_owned(), LAST),
        };
        assert_eq!(row(&s, &format!("agent-{i:02}")), want, "agent {i}");
    }
    let nackers = (0..AGENTS).filter(|i| i % 3 == 1).count();
    let others = AGENTS as usize - nackers;
    assert_eq!(summary(&s), (others, nackers, 0, 0));
    assert_eq!(
        gauge(&plane, "retryplane_agents").await,
        BTreeMap::from([(1, nackers as u64), (LAST, others as u64)])
    );
    assert_eq!(
        gauge(&plane, "retryplane_agents_nacked").await,
        BTreeMap::from([(LAST, nackers as u64)])
    );
    drop(agents);
}
