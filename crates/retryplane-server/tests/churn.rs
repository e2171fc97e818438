//! The control plane under churn, over real sockets on 127.0.0.1:0: agents that connect and
//! drop at every stage of the stream (before the Hello, after it, mid-ACK, with a push in
//! flight, mid-report), the same agent id from several streams at once, ephemeral and
//! long-lived agents, tokens reloads, applies and rollbacks meanwhile; then the fleet, the
//! gauges, the quotas and the process's tasks are back to what they should be.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::fs;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::{self, agent_message::Kind};
use retryplane_server::agent_stream::StreamLimits;
use retryplane_server::server::{Running, ServeConfig, start};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;
use tonic::transport::Channel;

use support::{channel, with_file};

const TEAM_A: &str = "agent-secret-team-a-0123456789";
const TEAM_B: &str = "agent-secret-team-b-0123456789";
const ADMIN: &str = "admin-secret-0123456789abcdef";
const WAIT: Duration = Duration::from_secs(15);

fn tokens_yaml(max_a: usize) -> String {
    format!(
        "tokens:\n  - {{name: team-a, role: agent, secret: \"{TEAM_A}\", max_agents: {max_a}, agent_ids: [\"churn-*\", \"long-*\", \"same-*\", \"eph-*\"]}}\n  - {{name: team-b, role: agent, secret: \"{TEAM_B}\"}}\n  - {{name: alice, role: admin, secret: \"{ADMIN}\"}}\n"
    )
}

fn policy(n: u32) -> String {
    format!(
        "version: 1\nendpoints:\n  payments:\n    max_attempts: {}\n",
        2 + n % 5
    )
}

async fn metrics_text(addr: SocketAddr) -> String {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body).await;
    body
}

fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let (key, value) = line.rsplit_once(' ')?;
        (key == name).then(|| value.parse().ok()).flatten()
    })
}

fn authed<T>(msg: T, secret: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {secret}").parse().unwrap());
    r
}

fn frame(msg: &pb::AgentMessage) -> Bytes {
    let body = msg.encode_to_vec();
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(0);
    out.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&body);
    Bytes::from(out)
}

fn hello_msg(id: &str, instance: u64, stream: u64, ephemeral: bool) -> pb::AgentMessage {
    pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            agent_version: "churn".to_owned(),
            instance_id: instance,
            stream,
            ephemeral,
            ..Default::default()
        })),
    }
}

fn connect_request(secret: &str) -> http::Request<()> {
    http::Request::post("http://x/retryplane.v1.AgentService/Connect")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {secret}"))
        .body(())
        .unwrap()
}

/// Reads gRPC messages out of a response body: every whole one in `buf`.
fn take_messages(buf: &mut Vec<u8>) -> Vec<pb::ServerMessage> {
    let mut out = Vec::new();
    while buf.len() >= 5 {
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if buf.len() < 5 + len {
            break;
        }
        let msg = pb::ServerMessage::decode(&buf[5..5 + len]).unwrap();
        buf.drain(..5 + len);
        out.push(msg);
    }
    out
}

/// One churning stream on its own connection, dropped at `stage`.
async fn churn_one(addr: SocketAddr, secret: &'static str, id: String, stage: u32, seed: u64) {
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let Ok((send, conn)) = h2::client::handshake(tcp).await else {
        return;
    };
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let run = async {
        let mut send = send.ready().await.ok()?;
        let (answer, mut body) = send.send_request(connect_request(secret), false).ok()?;
        match stage {
            // Reset before the Hello.
            0 => {
                tokio::task::yield_now().await;
                body.send_reset(h2::Reason::CANCEL);
                return Some(());
            }
            // The whole connection dropped before the Hello.
            1 => return Some(()),
            // Half a Hello, then reset.
            2 => {
                let f = frame(&hello_msg(&id, seed, 1, false));
                body.send_data(f.slice(..f.len() / 2), false).ok()?;
                tokio::task::yield_now().await;
                body.send_reset(h2::Reason::CANCEL);
                return Some(());
            }
            _ => {}
        }
        let ephemeral = stage == 7;
        let mut hello = hello_msg(&id, seed, 1 + seed % 3, ephemeral);
        if let Some(Kind::Hello(h)) = &mut hello.kind {
            h.heartbeats = seed % 2 == 1;
        }
        body.send_data(frame(&hello), false).ok()?;
        if stage == 3 {
            // Right after the Hello, before its answer.
            body.send_reset(h2::Reason::CANCEL);
            return Some(());
        }
        let answer = tokio::time::timeout(WAIT, answer).await.ok()?.ok()?;
        let mut rbody = answer.into_body();
        if stage == 4 {
            // After the head, the push (if any) unread.
            drop(rbody);
            body.send_reset(h2::Reason::CANCEL);
            return Some(());
        }
        let mut buf = Vec::new();
        let mut snapshot = None;
        let deadline = Instant::now() + Duration::from_millis(500);
        while snapshot.is_none() && Instant::now() < deadline {
            let Ok(Some(Ok(data))) = tokio::time::timeout_at(deadline, rbody.data()).await else {
                break;
            };
            let _ = rbody.flow_control().release_capacity(data.len());
            buf.extend_from_slice(&data);
            for m in take_messages(&mut buf) {
                if let Ok(Some(s)) = m.decode_snapshot() {
                    snapshot = Some(s);
                }
            }
        }
        let ack = snapshot.as_ref().map(|s| {
            frame(&pb::AgentMessage {
                kind: Some(Kind::Ack(pb::Ack {
                    version: s.version,
                    nonce: s.nonce.clone(),
                })),
            })
        });
        match stage {
            5 => {
                // Mid-ACK.
                if let Some(ack) = ack {
                    body.send_data(ack.slice(..ack.len() - 2), false).ok()?;
                }
                tokio::task::yield_now().await;
                body.send_reset(h2::Reason::CANCEL);
            }
            6 => {
                // ACK, reports, then the connection dropped mid-report.
                if let Some(ack) = ack {
                    body.send_data(ack, false).ok()?;
                }
                for seq in 1..=3u64 {
                    let r = frame(&pb::AgentMessage {
                        kind: Some(Kind::Metrics(pb::MetricsReport {
                            seq,
                            endpoints: vec![pb::EndpointCounters {
                                endpoint: "payments".to_owned(),
                                calls: 1,
                                attempts: 1,
                                ..Default::default()
                            }],
                            ..Default::default()
                        })),
                    });
                    if seq == 3 {
                        body.send_data(r.slice(..r.len() / 2), false).ok()?;
                    } else {
                        body.send_data(r, false).ok()?;
                    }
                }
                return Some(());
            }
            _ => {
                // ACK and a clean end of the request (stage 7: an ephemeral agent).
                if let Some(ack) = ack {
                    body.send_data(ack, false).ok()?;
                }
                body.send_data(Bytes::new(), true).ok()?;
                let _ = tokio::time::timeout(Duration::from_secs(2), async {
                    while let Some(Ok(d)) = rbody.data().await {
                        let _ = rbody.flow_control().release_capacity(d.len());
                    }
                })
                .await;
            }
        }
        Some(())
    };
    let _ = tokio::time::timeout(WAIT, run).await;
    conn.abort();
}

/// A long-lived agent on its own connection: ACKs every snapshot, until `stop`.
fn long_lived(
    ch: Channel,
    id: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tx.send(hello_msg(&id, 7, 1, false)).await.unwrap();
        let mut client = pb::agent_service_client::AgentServiceClient::new(ch);
        let mut inbound = client
            .connect(authed(
                tokio_stream::wrappers::ReceiverStream::new(rx),
                TEAM_A,
            ))
            .await
            .unwrap_or_else(|e| panic!("{id}: {e:?}"))
            .into_inner();
        loop {
            tokio::select! {
                m = inbound.message() => match m {
                    Ok(Some(m)) => {
                        if let Ok(Some(s)) = m.decode_snapshot() {
                            let _ = tx.send(pb::AgentMessage { kind: Some(Kind::Ack(pb::Ack { version: s.version, nonce: s.nonce })) }).await;
                        }
                    }
                    other => panic!("{id}: long-lived stream ended: {other:?}"),
                },
                _ = stop.changed() => return,
            }
        }
    })
}

async fn fleet(admin: &Channel) -> pb::FleetStatusResponse {
    AdminServiceClient::new(admin.clone())
        .fleet_status(authed(pb::FleetStatusRequest::default(), ADMIN))
        .await
        .unwrap()
        .into_inner()
}

async fn apply(admin: &Channel, n: u32) -> Option<u64> {
    let r = AdminServiceClient::new(admin.clone())
        .apply(authed(
            pb::ApplyRequest {
                source: Some(pb::PolicySource {
                    kind: Some(pb::policy_source::Kind::Yaml(policy(n))),
                    origin: "churn".into(),
                }),
                ..Default::default()
            },
            ADMIN,
        ))
        .await
        .ok()?
        .into_inner();
    Some(r.version)
}

fn rss_kb() -> u64 {
    let s = fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn setup(dir: &Path, cfg: ServeConfig, max_a: usize) -> ServeConfig {
    fs::write(dir.join("tokens.yaml"), tokens_yaml(max_a)).unwrap();
    ServeConfig {
        tokens_file: Some(dir.join("tokens.yaml")),
        api_mode: true,
        max_agents: 200,
        metrics_interval: Duration::from_millis(100),
        forget_disconnected_after: std::env::var("CHURN_FORGET_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
            .or(cfg.forget_disconnected_after),
        stream_limits: StreamLimits {
            hello_timeout: Duration::from_millis(800),
            max_pending_handshakes: 64,
            ..StreamLimits::default()
        },
        ..cfg
    }
}

/// Drives one round of churn: `n` streams dropped at every stage, same-id races, applies and
/// reloads meanwhile.
async fn round(running: &Running, dir: &Path, admin: &Channel, r: u64, n: u64) {
    let addr = running.agent_addr;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let seed = r * 1_000_003 + i;
        let stage = (i % 8) as u32;
        let (secret, id) = match i % 11 {
            // Another token asking for team-a's ids, and team-a's own same-id races.
            0 => (TEAM_B, format!("same-{}", i % 5)),
            1..=3 => (TEAM_A, format!("same-{}", i % 5)),
            _ if stage == 7 && std::env::var("CHURN_NO_EPH").is_err() => {
                (TEAM_A, format!("eph-{r}-{i}"))
            }
            _ => (TEAM_A, format!("churn-{}", i % 37)),
        };
        tasks.spawn(churn_one(addr, secret, id, stage, seed));
        if i % 16 == 0 {
            tokio::task::yield_now().await;
        }
    }
    // Applies, rollbacks and reloads while the streams come and go.
    for k in 0..6u32 {
        if std::env::var("CHURN_NO_APPLY").is_ok() {
            break;
        }
        let _ = apply(admin, u32::try_from(r).unwrap() * 10 + k).await;
        if k % 3 == 2 {
            let _ = AdminServiceClient::new(admin.clone())
                .rollback(authed(
                    pb::RollbackRequest {
                        version: 1,
                        ..Default::default()
                    },
                    ADMIN,
                ))
                .await;
        }
        let max_a = if k % 2 == 0 { 40 } else { 60 };
        fs::write(dir.join("tokens.yaml"), tokens_yaml(max_a)).unwrap();
        let _ = running.reload_tokens();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let end = Instant::now() + Duration::from_secs(60);
    while tokio::time::timeout_at(end, tasks.join_next())
        .await
        .expect("churn round took over 60 s")
        .is_some()
    {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_churn_the_fleet_gauges_and_quotas_return_to_the_truth() {
    let (dir, cfg) = with_file(support::V1);
    let cfg = setup(dir.path(), cfg, 40);
    let running = start(cfg).await.unwrap();
    let admin = channel(running.admin_addr).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let long_ids: Vec<String> = (0..8).map(|i| format!("long-{i}")).collect();
    let mut longs = Vec::new();
    for id in &long_ids {
        longs.push(long_lived(
            channel(running.agent_addr).await,
            id.clone(),
            stop_rx.clone(),
        ));
    }
    let deadline = Instant::now() + WAIT;
    while fleet(&admin)
        .await
        .agents
        .iter()
        .filter(|a| a.connected)
        .count()
        < 8
    {
        assert!(
            Instant::now() < deadline,
            "the long-lived agents did not connect"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rounds = std::env::var("CHURN_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3u64);
    let per_round = std::env::var("CHURN_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300u64);
    let metrics_runtime = tokio::runtime::Handle::current().metrics();
    for r in 0..rounds {
        round(&running, dir.path(), &admin, r, per_round).await;
        // Settle: only the long-lived agents are connected.
        let want: BTreeSet<String> = long_ids.iter().cloned().collect();
        let deadline = Instant::now() + WAIT;
        loop {
            let f = fleet(&admin).await;
            let connected: BTreeSet<String> = f
                .agents
                .iter()
                .filter(|a| a.connected)
                .map(|a| a.agent_id.clone())
                .collect();
            let text = metrics_text(running.http_addr).await;
            let gauge = sample(&text, "retryplane_server_agents_connected");
            let awaiting = sample(&text, "retryplane_server_streams_awaiting_hello");
            let eph: Vec<_> = f
                .agents
                .iter()
                .filter(|a| a.agent_id.starts_with("eph-"))
                .map(|a| a.agent_id.clone())
                .collect();
            let counts = (f.connected_agents, f.known_agents as usize);
            if connected == want
                && gauge == Some(8.0)
                && awaiting == Some(0.0)
                && eph.is_empty()
                && counts == (8, f.agents.len())
            {
                break;
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "eph listed: {eph:?}; counts {counts:?} listed {}",
                    f.agents.len()
                );
            }
            assert!(
                Instant::now() < deadline,
                "round {r}: connected {connected:?} gauge {gauge:?} awaiting {awaiting:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!(
            "round {r}: rss {} kB, alive tasks {}",
            rss_kb(),
            metrics_runtime.num_alive_tasks()
        );
    }
    // The long-lived agents run the current version.
    let current = apply(&admin, 999).await.unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let f = fleet(&admin).await;
        let behind: Vec<_> = f
            .agents
            .iter()
            .filter(|a| a.connected && a.applied_version != current)
            .map(|a| (a.agent_id.clone(), a.applied_version))
            .collect();
        if behind.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "v{current}: behind {behind:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = metrics_text(running.http_addr).await;
    for line in text.lines().filter(|l| {
        l.starts_with("retryplane_agents")
            || l.starts_with("retryplane_server_streams")
            || l.starts_with("retryplane_server_agents")
            || l.starts_with("retryplane_server_pushes")
            || l.starts_with("retryplane_server_acks")
            || l.starts_with("retryplane_server_auth")
            || l.starts_with("retryplane_server_publishes")
            || l.starts_with("retryplane_server_current")
            || l.starts_with("retryplane_server_rejected")
            || l.starts_with("retryplane_server_nacks")
            || l.starts_with("retryplane_server_reports")
    }) {
        eprintln!("{line}");
    }
    // team-a's quota: max_agents (the last reload wrote 60) less its 8 long-lived agents.
    fs::write(dir.path().join("tokens.yaml"), tokens_yaml(40)).unwrap();
    running.reload_tokens().unwrap();
    let ch = channel(running.agent_addr).await;
    let mut held = Vec::new();
    for i in 0..32 {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(hello_msg(&format!("churn-q{i}"), 1, 1, false))
            .await
            .unwrap();
        let got = pb::agent_service_client::AgentServiceClient::new(ch.clone())
            .connect(authed(
                tokio_stream::wrappers::ReceiverStream::new(rx),
                TEAM_A,
            ))
            .await;
        assert!(got.is_ok(), "quota place {i} of 32 not given back: {got:?}");
        held.push((tx, got.unwrap()));
    }
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(hello_msg("churn-q-over", 1, 1, false))
        .await
        .unwrap();
    let over = pb::agent_service_client::AgentServiceClient::new(ch.clone())
        .connect(authed(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            TEAM_A,
        ))
        .await;
    assert_eq!(
        over.err().map(|e| e.code()),
        Some(tonic::Code::ResourceExhausted)
    );
    drop(held);
    // Every handshake place is given back: 64 streams may wait for their Hello (team-b's
    // share is three quarters of them, 48; team-a's streams take the rest).
    let mut waiting = Vec::new();
    for i in 0..64 {
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::AgentMessage>(4);
        let mut client = pb::agent_service_client::AgentServiceClient::new(ch.clone());
        let secret = if i < 48 { TEAM_B } else { TEAM_A };
        let req = authed(tokio_stream::wrappers::ReceiverStream::new(rx), secret);
        waiting.push((
            tx,
            tokio::spawn(async move { client.connect(req).await.map(|_| ()) }),
        ));
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let text = metrics_text(running.http_addr).await;
        let awaiting = sample(&text, "retryplane_server_streams_awaiting_hello");
        if awaiting == Some(64.0) {
            break;
        }
        let refused: Vec<_> = waiting.iter().filter(|(_, t)| t.is_finished()).collect();
        assert!(
            Instant::now() < deadline && refused.is_empty(),
            "awaiting {awaiting:?}, {} refused",
            refused.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(waiting);
    stop_tx.send_replace(true);
    for l in longs {
        l.await.unwrap();
    }
    running.shutdown().await.unwrap();
}

/// A shutdown in the middle of churn ends every stream (each long-lived agent is told
/// `UNAVAILABLE`), returns within its grace, and the store opens again with every version an
/// apply was answered for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_during_churn_ends_every_stream_and_the_store_is_intact_after() {
    let (dir, cfg) = with_file(support::V1);
    let cfg = setup(dir.path(), cfg, 40);
    let running = start(cfg.clone()).await.unwrap();
    let admin = channel(running.admin_addr).await;
    // Long-lived agents that report how their stream ended.
    let mut ends = Vec::new();
    for i in 0..8 {
        let ch = channel(running.agent_addr).await;
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tx.send(hello_msg(&format!("long-{i}"), 7, 1, false))
            .await
            .unwrap();
        let mut inbound = pb::agent_service_client::AgentServiceClient::new(ch)
            .connect(authed(
                tokio_stream::wrappers::ReceiverStream::new(rx),
                TEAM_A,
            ))
            .await
            .unwrap()
            .into_inner();
        ends.push(tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(m)) => {
                        if let Ok(Some(s)) = m.decode_snapshot() {
                            let _ = tx
                                .send(pb::AgentMessage {
                                    kind: Some(Kind::Ack(pb::Ack {
                                        version: s.version,
                                        nonce: s.nonce,
                                    })),
                                })
                                .await;
                        }
                    }
                    Ok(None) => return tonic::Code::Ok,
                    Err(status) => return status.code(),
                }
            }
        }));
    }
    let addr = running.agent_addr;
    let churn = tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..2000u64 {
            tasks.spawn(churn_one(
                addr,
                TEAM_A,
                format!("churn-{}", i % 37),
                (i % 8) as u32,
                i,
            ));
            if i % 32 == 0 {
                tokio::task::yield_now().await;
            }
        }
        while tasks.join_next().await.is_some() {}
    });
    let applier = {
        let admin = admin.clone();
        tokio::spawn(async move {
            let mut last = 0;
            for n in 0..1000u32 {
                match apply(&admin, n).await {
                    Some(v) => last = v,
                    None => break,
                }
            }
            last
        })
    };
    // Into the thick of it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let began = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), running.shutdown())
        .await
        .expect("shutdown took over 10 s")
        .unwrap();
    eprintln!("shutdown took {:?}", began.elapsed());
    for e in ends {
        let code = tokio::time::timeout(WAIT, e)
            .await
            .expect("a long-lived stream outlived the shutdown")
            .unwrap();
        assert_eq!(code, tonic::Code::Unavailable);
    }
    let last = tokio::time::timeout(WAIT, applier)
        .await
        .expect("an apply outlived the shutdown")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), churn)
        .await
        .expect("churn outlived the shutdown")
        .unwrap();
    // The store opens again, serving the last version an apply was answered for (or later).
    let running = start(cfg).await.unwrap();
    let served = running
        .control()
        .publisher
        .current()
        .map(|s| s.version)
        .unwrap_or(0);
    eprintln!("last answered apply v{last}; serving v{served} after restart");
    assert!(
        served >= last && last > 0,
        "last answered v{last}, serving v{served}"
    );
    running.shutdown().await.unwrap();
}

/// An agent stream on its own connection that has sent `hello`: its local address, the answer
/// (head, then body), the request body, the connection's task.
async fn open_raw(
    addr: SocketAddr,
    secret: &str,
    hello: &pb::AgentMessage,
) -> (
    SocketAddr,
    h2::client::ResponseFuture,
    h2::SendStream<Bytes>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let local = tcp.local_addr().unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut send = send.ready().await.unwrap();
    let (answer, mut body) = send.send_request(connect_request(secret), false).unwrap();
    body.send_data(frame(hello), false).unwrap();
    (local, answer, body, conn)
}

/// Whether the stream behind `answer` has ended (its trailers, or an error), read for at most
/// `within`; `None` while it is open.
async fn ended_within(answer: &mut Option<h2::RecvStream>, within: Duration) -> Option<String> {
    let body = answer.as_mut()?;
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, body.data()).await {
            Err(_) => return None,
            Ok(Some(Ok(d))) => {
                let _ = body.flow_control().release_capacity(d.len());
            }
            Ok(Some(Err(e))) => return Some(format!("error {e}")),
            Ok(None) => {
                let t = body.trailers().await.ok().flatten();
                return Some(format!(
                    "ended {:?}",
                    t.and_then(|t| t.get("grpc-status").cloned())
                ));
            }
        }
    }
}

/// Three streams of one agent id race to register (of one process, numbered; unnumbered; or
/// one of them another token's); whichever order their Hellos take, exactly one stays open,
/// the fleet lists the agent connected from that stream's address, and once it goes the agent
/// is listed disconnected and the gauge is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_streams_of_one_agent_leave_one_open_and_the_fleet_lists_that_one() {
    let (dir, cfg) = with_file(support::V1);
    let cfg = setup(dir.path(), cfg, 40);
    let running = start(cfg).await.unwrap();
    let admin = channel(running.admin_addr).await;
    for round in 0..60u64 {
        // Numbered streams of one process, unnumbered ones, and one of another token among
        // numbered ones, in turn.
        let numbered = round % 3 != 1;
        let mixed = round % 3 == 2;
        let id = format!("same-{round}");
        let mut opened = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for s in 1..=3u64 {
            let addr = running.agent_addr;
            let hello = if numbered {
                hello_msg(&id, 42, s, false)
            } else {
                hello_msg(&id, 0, 0, false)
            };
            let secret = if s == 2 && mixed { TEAM_B } else { TEAM_A };
            tasks.spawn(async move {
                let (local, answer, body, conn) = open_raw(addr, secret, &hello).await;
                let answer = tokio::time::timeout(WAIT, answer).await.unwrap();
                (local, answer, body, conn)
            });
        }
        while let Some(j) = tasks.join_next().await {
            opened.push(j.unwrap());
        }
        // Refused ones have a trailers-only answer.
        let mut bodies: Vec<(SocketAddr, Option<h2::RecvStream>, String)> = Vec::new();
        for (local, answer, _body, _conn) in &mut opened {
            let answer = answer.take_unwrap_answer();
            bodies.push(answer.map_or_else(
                |why| (*local, None, why),
                |b| (*local, Some(b), String::new()),
            ));
        }
        // Wait until at most one is open.
        let deadline = Instant::now() + WAIT;
        loop {
            for (_, body, why) in &mut bodies {
                if let Some(end) = ended_within(body, Duration::from_millis(10)).await {
                    *why = end;
                    *body = None;
                }
            }
            let open = bodies.iter().filter(|(_, b, _)| b.is_some()).count();
            if open <= 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: {open} streams of {id} open"
            );
        }
        let open: Vec<_> = bodies.iter().filter(|(_, b, _)| b.is_some()).collect();
        let listed = fleet(&admin)
            .await
            .agents
            .into_iter()
            .find(|a| a.agent_id == id);
        let ends: Vec<_> = bodies.iter().map(|(l, _, w)| format!("{l}: {w}")).collect();
        assert_eq!(open.len(), 1, "round {round}: {ends:?}, listed {listed:?}");
        let listed = listed.unwrap();
        assert!(listed.connected, "round {round}: {ends:?}");
        assert_eq!(
            listed.peer,
            open[0].0.to_string(),
            "round {round}: {ends:?}"
        );
        drop(bodies);
        drop(opened);
        let deadline = Instant::now() + WAIT;
        loop {
            let f = fleet(&admin).await;
            let a = f.agents.iter().find(|a| a.agent_id == id).unwrap();
            if !a.connected && f.connected_agents == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: {id} still connected"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let text = metrics_text(running.http_addr).await;
    assert_eq!(
        sample(&text, "retryplane_server_agents_connected"),
        Some(0.0)
    );
    running.shutdown().await.unwrap();
}

trait TakeAnswer {
    fn take_unwrap_answer(&mut self) -> Result<h2::RecvStream, String>;
}

impl TakeAnswer for Result<http::Response<h2::RecvStream>, h2::Error> {
    fn take_unwrap_answer(&mut self) -> Result<h2::RecvStream, String> {
        let taken = std::mem::replace(self, Err(h2::Error::from(h2::Reason::NO_ERROR)));
        match taken {
            Ok(r) => {
                if let Some(s) = r.headers().get("grpc-status") {
                    return Err(format!("refused {s:?}"));
                }
                Ok(r.into_body())
            }
            Err(e) => Err(format!("error {e}")),
        }
    }
}

/// Behind an HTTP/2 proxy, one connection carries many agents: streams of that connection that
/// come and go at every stage (reset before the Hello, after it, after the answer's head) do
/// not end the connection, nor the streams of the agents that stay on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_that_come_and_go_on_a_shared_connection_leave_the_others_on_it_connected() {
    let (dir, cfg) = with_file(support::V1);
    let cfg = setup(dir.path(), cfg, 1000);
    let running = start(cfg).await.unwrap();
    let admin = channel(running.admin_addr).await;
    let tcp = tokio::net::TcpStream::connect(running.agent_addr)
        .await
        .unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    let mut conn = tokio::spawn(conn);
    let mut stay = Vec::new();
    for i in 0..8 {
        let mut s = send.clone().ready().await.unwrap();
        let (answer, mut body) = s.send_request(connect_request(TEAM_A), false).unwrap();
        body.send_data(frame(&hello_msg(&format!("long-{i}"), 1, 1, false)), false)
            .unwrap();
        let answer = tokio::time::timeout(WAIT, answer).await.unwrap().unwrap();
        assert!(answer.headers().get("grpc-status").is_none());
        stay.push((answer.into_body(), body));
    }
    let n: u64 = std::env::var("CHURN_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    let mut tasks = tokio::task::JoinSet::new();
    let at_once: usize = std::env::var("CHURN_AT_ONCE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(at_once));
    for i in 0..n {
        let send = send.clone();
        let permit = gate.clone().acquire_owned().await.unwrap();
        tasks.spawn(async move {
            let _permit = permit;
            let Ok(mut s) = send.ready().await else {
                return;
            };
            let Ok((answer, mut body)) = s.send_request(connect_request(TEAM_A), false) else {
                return;
            };
            let stage = std::env::var("CHURN_STAGE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(i % 4);
            match stage {
                0 => body.send_reset(h2::Reason::CANCEL),
                1 => {
                    let _ = body.send_data(
                        frame(&hello_msg(&format!("churn-{}", i % 37), i, 1, false)),
                        false,
                    );
                    body.send_reset(h2::Reason::CANCEL);
                }
                _ => {
                    let _ = body.send_data(
                        frame(&hello_msg(&format!("churn-{}", i % 37), i, 1, false)),
                        false,
                    );
                    if let Ok(Ok(answer)) = tokio::time::timeout(WAIT, answer).await {
                        let mut rb = answer.into_body();
                        if stage == 3
                            && let Ok(Some(Ok(d))) =
                                tokio::time::timeout(Duration::from_millis(200), rb.data()).await
                        {
                            let _ = rb.flow_control().release_capacity(d.len());
                        }
                    }
                    body.send_reset(h2::Reason::CANCEL);
                }
            }
        });
        if i % 64 == 0 {
            tokio::task::yield_now().await;
        }
    }
    while tokio::time::timeout(Duration::from_secs(60), tasks.join_next())
        .await
        .expect("churn took over 60 s")
        .is_some()
    {}
    assert!(
        !conn.is_finished(),
        "the shared connection ended: {:?}",
        (&mut conn).await
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let f = fleet(&admin).await;
        let connected: Vec<_> = f
            .agents
            .iter()
            .filter(|a| a.connected)
            .map(|a| a.agent_id.clone())
            .collect();
        if connected.len() == 8 && connected.iter().all(|a| a.starts_with("long-")) {
            break;
        }
        assert!(Instant::now() < deadline, "connected: {connected:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(stay);
    conn.abort();
    running.shutdown().await.unwrap();
}

/// One HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK literal field without indexing, its name a new name, no Huffman coding.
fn hpack_literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00, u8::try_from(name.len()).unwrap()];
    out.extend_from_slice(name.as_bytes());
    out.push(u8::try_from(value.len()).unwrap());
    out.extend_from_slice(value.as_bytes());
    out
}

/// Behind an HTTP/2 proxy, agents that give up their streams as soon as they open them (a
/// burst of pods killed at once, their proxy passing on each one's RST_STREAM) do not end the
/// proxy's connection, which carries the other agents' streams. With h2's rapid-reset guard
/// (`max_pending_accept_reset_streams`) at hyper's default, more than 20 such resets arriving
/// together were taken for an attack and the whole connection was ended with GOAWAY
/// `ENHANCE_YOUR_CALM` ("too_many_resets").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_agents_giving_up_at_once_behind_a_proxy_do_not_end_the_proxys_connection() {
    let (dir, cfg) = with_file(support::V1);
    let cfg = setup(dir.path(), cfg, 1000);
    let running = start(cfg).await.unwrap();
    let mut tcp = tokio::net::TcpStream::connect(running.agent_addr)
        .await
        .unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(4, 0, 0, &[]));
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    block.extend(hpack_literal(
        ":path",
        "/retryplane.v1.AgentService/Connect",
    ));
    block.extend(hpack_literal(":authority", "agents"));
    block.extend(hpack_literal("content-type", "application/grpc"));
    block.extend(hpack_literal("te", "trailers"));
    block.extend(hpack_literal("authorization", &format!("Bearer {TEAM_A}")));
    // Forty streams opened and given up (CANCEL), then a PING: one write.
    for i in 0..40u32 {
        let id = 1 + 2 * i;
        out.extend(h2_frame(1, 0x4, id, &block));
        out.extend(h2_frame(3, 0, id, &8u32.to_be_bytes()));
    }
    out.extend(h2_frame(6, 0, 0, b"churn-01"));
    tcp.write_all(&out).await.unwrap();
    // The connection answers the PING, rather than going away.
    let answer = tokio::time::timeout(WAIT, async {
        let mut buf = Vec::new();
        loop {
            while buf.len() >= 9 {
                let len =
                    (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
                if buf.len() < 9 + len {
                    break;
                }
                let (kind, flags) = (buf[3], buf[4]);
                let payload = buf[9..9 + len].to_vec();
                buf.drain(..9 + len);
                match kind {
                    // SETTINGS: acknowledged.
                    4 if flags & 1 == 0 => {
                        let _ = tcp.write_all(&h2_frame(4, 1, 0, &[])).await;
                    }
                    6 if flags & 1 == 1 => return Ok(()),
                    7 => {
                        let code =
                            u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                        return Err(format!(
                            "GOAWAY code {code:#x}, {:?}",
                            String::from_utf8_lossy(&payload[8..])
                        ));
                    }
                    _ => {}
                }
            }
            let mut chunk = [0u8; 4096];
            match tcp.read(&mut chunk).await {
                Ok(0) | Err(_) => return Err("connection closed".to_owned()),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .expect("neither a PING answer nor a GOAWAY within the wait");
    drop(tcp);
    assert_eq!(answer, Ok(()), "the proxy's connection was ended");
    running.shutdown().await.unwrap();
}

/// Numbered reports sent again on overlapping streams of the same agent process (a new stream
/// opened while the old one still carries the same reports, as after a lost ack) are counted
/// once each, however the streams interleave and end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_resent_on_overlapping_streams_are_counted_once() {
    let (dir, cfg) = with_file(support::V1);
    let cfg = setup(dir.path(), cfg, 1000);
    let running = start(cfg).await.unwrap();
    let admin = channel(running.admin_addr).await;
    let agents = 20u64;
    let seqs = 8u64;
    let mut tasks = tokio::task::JoinSet::new();
    for a in 0..agents {
        let addr = running.agent_addr;
        tasks.spawn(async move {
            let ch = channel(addr).await;
            let mut streams = Vec::new();
            for s in 1..=4u64 {
                let (tx, rx) = tokio::sync::mpsc::channel(32);
                tx.send(hello_msg(&format!("churn-r{a}"), 1000 + a, s, false))
                    .await
                    .unwrap();
                let got = pb::agent_service_client::AgentServiceClient::new(ch.clone())
                    .connect(authed(
                        tokio_stream::wrappers::ReceiverStream::new(rx),
                        TEAM_A,
                    ))
                    .await;
                let Ok(inbound) = got else { continue };
                let mut inbound = inbound.into_inner();
                for seq in 1..=seqs {
                    let _ = tx
                        .send(pb::AgentMessage {
                            kind: Some(Kind::Metrics(pb::MetricsReport {
                                seq,
                                endpoints: vec![pb::EndpointCounters {
                                    endpoint: "payments".to_owned(),
                                    calls: 1,
                                    attempts: 1,
                                    ..Default::default()
                                }],
                                ..Default::default()
                            })),
                        })
                        .await;
                }
                // The last stream reads every ack; the others are given up after a few.
                let want = if s == 4 { seqs } else { (a + s) % seqs };
                let mut acked = 0;
                while acked < want {
                    match tokio::time::timeout(WAIT, inbound.message()).await {
                        Ok(Ok(Some(m))) => {
                            if let Some(ack) = m.metrics_ack {
                                assert!(!ack.dropped, "churn-r{a} seq {} dropped", ack.seq);
                                acked += 1;
                            }
                        }
                        other => {
                            assert!(s < 4, "churn-r{a}'s last stream: {other:?}");
                            break;
                        }
                    }
                }
                streams.push((tx, inbound));
                if streams.len() > 1 && a % 2 == 0 {
                    streams.remove(0);
                }
            }
            drop(streams);
        });
    }
    while tokio::time::timeout(Duration::from_secs(60), tasks.join_next())
        .await
        .expect("took over 60 s")
        .is_some_and(|r| {
            r.unwrap();
            true
        })
    {}
    let stats = AdminServiceClient::new(admin.clone())
        .stats(authed(
            pb::StatsRequest {
                endpoint: "payments".to_owned(),
                ..Default::default()
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    let calls: u64 = stats
        .endpoints
        .iter()
        .filter(|e| e.endpoint == "payments")
        .map(|e| e.calls)
        .sum();
    let text = metrics_text(running.http_addr).await;
    eprintln!(
        "calls {calls}; duplicates {:?}; dropped {:?}",
        sample(&text, "retryplane_server_reports_duplicate_total"),
        sample(&text, "retryplane_server_reports_dropped_total")
    );
    assert_eq!(calls, agents * seqs);
    running.shutdown().await.unwrap();
}
