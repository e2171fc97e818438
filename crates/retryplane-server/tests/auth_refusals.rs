//! Refusals of the tokens file's rules, against the real server on 127.0.0.1:0 with raw tonic
//! clients: a reload that takes a secret away ends a stream still waiting for its Hello, a
//! read-only token's attempted change is counted with the other refusals, and an agent token
//! connects only as the agent ids the file gives it.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::net::SocketAddr;
use std::time::Duration;

use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use retryplane_proto::pb::agent_service_client::AgentServiceClient;
use retryplane_server::server::{Running, ServeConfig, start};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use support::{V1, channel, with_file};

const AGENT: &str = "agent-secret-0123456789abcdef";
const AGENT2: &str = "agent2-secret-0123456789abcdef";
const ADMIN: &str = "admin-secret-0123456789abcdef";
const VIEWER: &str = "viewer-secret-0123456789abcdef";

fn tokens_yaml(with_agent: bool) -> String {
    tokens_yaml_with(with_agent.then_some(""))
}

/// The tokens file, `team-a`'s token left out for `None`, and given `agent_a_extra` (such as
/// `, agent_ids: [a-*]`) in its entry otherwise.
fn tokens_yaml_with(agent_a_extra: Option<&str>) -> String {
    let mut s = String::from("tokens:\n");
    if let Some(extra) = agent_a_extra {
        s += &format!("  - {{name: team-a, role: agent, secret: \"{AGENT}\"{extra}}}\n");
    }
    s += &format!("  - {{name: team-b, role: agent, secret: \"{AGENT2}\"}}\n");
    s += &format!("  - {{name: alice, role: admin, secret: \"{ADMIN}\"}}\n");
    s += &format!("  - {{name: dash, role: viewer, secret: \"{VIEWER}\"}}\n");
    s
}

fn setup() -> (tempfile::TempDir, ServeConfig) {
    let (dir, cfg) = with_file(V1);
    fs::write(dir.path().join("tokens.yaml"), tokens_yaml(true)).unwrap();
    let cfg = ServeConfig {
        tokens_file: Some(dir.path().join("tokens.yaml")),
        ..cfg
    };
    (dir, cfg)
}

/// A control plane on 127.0.0.1:0 whose tokens file holds `tokens`: its directory (kept for the
/// test's life), the tokens file (rewritten before a reload), the server and a channel to its
/// agent listener.
async fn serving(tokens: &str) -> (tempfile::TempDir, std::path::PathBuf, Running, Channel) {
    let (dir, cfg) = setup();
    let file = dir.path().join("tokens.yaml");
    fs::write(&file, tokens).unwrap();
    let running = start(cfg).await.unwrap();
    let agent = channel(running.agent_addr).await;
    (dir, file, running, agent)
}

/// The status `stream` ends with, waited for (bounded) past the messages before it.
async fn ended_status(stream: &mut tonic::Streaming<pb::ServerMessage>) -> tonic::Status {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("the stream was not ended")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    }
}

/// Waits (bounded) until the agents `FleetStatus` lists as connected are `expected` (sorted).
async fn until_connected(running: &Running, expected: &[&str]) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let mut connected: Vec<_> = listed(running)
            .await
            .into_iter()
            .filter(|a| a.connected)
            .map(|a| a.agent_id)
            .collect();
        connected.sort_unstable();
        if connected == expected {
            return;
        }
        assert!(Instant::now() < end, "still connected: {connected:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The agents `FleetStatus` lists, asked with the admin token.
async fn listed(running: &Running) -> Vec<pb::AgentStatus> {
    AdminServiceClient::new(channel(running.admin_addr).await)
        .fleet_status(with_auth(
            pb::FleetStatusRequest::default(),
            Some(format!("Bearer {ADMIN}").as_bytes()),
        ))
        .await
        .unwrap()
        .into_inner()
        .agents
}

fn with_auth<T>(msg: T, value: Option<&[u8]>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(v) = value {
        r.metadata_mut()
            .insert("authorization", MetadataValue::try_from(v).unwrap());
    }
    r
}

async fn get(ch: &Channel, auth: Option<&[u8]>) -> Result<(), tonic::Status> {
    let mut c = AdminServiceClient::new(ch.clone());
    tokio::time::timeout(
        Duration::from_secs(10),
        c.get(with_auth(pb::GetRequest { version: 0 }, auth)),
    )
    .await
    .expect("get timed out")
    .map(|_| ())
}

async fn metrics(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

fn refused_total(m: &str) -> u64 {
    m.lines()
        .find_map(|l| l.strip_prefix("retryplane_server_auth_refused_total "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The value of the gauge `name` in the server's exposition.
fn gauge(m: &str, name: &str) -> u64 {
    m.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_takes_its_secret_away_ends_a_stream_still_waiting_for_its_hello() {
    let (dir, cfg) = setup();
    let running = start(cfg).await.unwrap();
    let agent = channel(running.agent_addr).await;
    // A stream that sends no Hello (the server waits 10 s for one).
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(8);
    let mut client = AgentServiceClient::new(agent.clone());
    let request = with_auth(
        ReceiverStream::new(rx),
        Some(format!("Bearer {AGENT}").as_bytes()),
    );
    let pending = tokio::spawn(async move {
        let mut stream = client.connect(request).await?.into_inner();
        loop {
            if stream.message().await?.is_none() {
                return Err::<(), _>(tonic::Status::unknown("ended"));
            }
        }
    });
    let end = Instant::now() + Duration::from_secs(10);
    while gauge(
        &metrics(running.http_addr).await,
        "retryplane_server_streams_awaiting_hello",
    ) < 1
    {
        assert!(Instant::now() < end, "the stream never reached the server");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    fs::write(dir.path().join("tokens.yaml"), tokens_yaml(false)).unwrap();
    running.reload_tokens().unwrap();
    let reloaded = Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(12), pending)
        .await
        .expect("the stream was not ended")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(
        reloaded.elapsed() < Duration::from_secs(5),
        "ended after {:?}",
        reloaded.elapsed()
    );
    drop(tx);
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_tokens_attempted_change_is_counted_as_refused() {
    let (_dir, cfg) = setup();
    let running = start(cfg).await.unwrap();
    let admin = channel(running.admin_addr).await;
    let before = refused_total(&metrics(running.http_addr).await);
    let mut c = AdminServiceClient::new(admin.clone());
    let vauth = format!("Bearer {VIEWER}");
    for _ in 0..3 {
        let e = c
            .rollback(with_auth(
                pb::RollbackRequest {
                    version: 1,
                    ..Default::default()
                },
                Some(vauth.as_bytes()),
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
    }
    // Control: an agent token on the admin listener is counted.
    let _ = get(&admin, Some(format!("Bearer {AGENT}").as_bytes()))
        .await
        .unwrap_err();
    let after = refused_total(&metrics(running.http_addr).await);
    running.shutdown().await.unwrap();
    assert_eq!(after - before, 4, "refused_total went {before} -> {after}");
}

/// An agent stream with `secret` whose Hello names `agent_id`: its first message from the
/// control plane, or the status that refused it; and the stream, to read on.
async fn hello(
    agent: &Channel,
    secret: &str,
    agent_id: &str,
) -> Result<
    (
        mpsc::Sender<pb::AgentMessage>,
        tonic::Streaming<pb::ServerMessage>,
    ),
    tonic::Status,
> {
    hello_as(agent, secret, agent_id, "checkout").await
}

/// [`hello`], naming `service` in the Hello.
async fn hello_as(
    agent: &Channel,
    secret: &str,
    agent_id: &str,
    service: &str,
) -> Result<
    (
        mpsc::Sender<pb::AgentMessage>,
        tonic::Streaming<pb::ServerMessage>,
    ),
    tonic::Status,
> {
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(8);
    tx.send(pb::AgentMessage {
        kind: Some(pb::agent_message::Kind::Hello(pb::Hello {
            agent_id: agent_id.to_owned(),
            service: service.to_owned(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut client = AgentServiceClient::new(agent.clone());
    let request = with_auth(
        ReceiverStream::new(rx),
        Some(format!("Bearer {secret}").as_bytes()),
    );
    let mut stream = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("connect timed out")?
        .into_inner();
    // The first push (the server has a version) tells the stream is registered.
    let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("no snapshot in time")?;
    assert!(first.is_some(), "the stream ended without a message");
    Ok((tx, stream))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_connects_only_as_its_agent_ids_and_a_reload_that_narrows_them_ends_the_stream()
 {
    let (_dir, file, running, agent) =
        serving(&tokens_yaml_with(Some(", agent_ids: [checkout-*, cart-7]"))).await;
    let before = refused_total(&metrics(running.http_addr).await);

    // Another team's id with this token: refused, named, counted.
    let e = hello(&agent, AGENT, "payments-1").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(
        e.message(),
        "token `team-a` may not connect as agent id `payments-1`: its `agent_ids` in the tokens \
         file are `checkout-*`, `cart-7`"
    );
    assert_eq!(refused_total(&metrics(running.http_addr).await) - before, 1);
    // An exact id is not a prefix.
    let e = hello(&agent, AGENT, "cart-70").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Its own ids connect; a token without `agent_ids` connects as any id.
    let (_a1, mut checkout) = hello(&agent, AGENT, "checkout-1").await.unwrap();
    let (_a2, _cart) = hello(&agent, AGENT, "cart-7").await.unwrap();
    let (_b, _payments) = hello(&agent, AGENT2, "payments-1").await.unwrap();

    // A reload that takes `checkout-*` from the token ends that stream, and only that one.
    fs::write(&file, tokens_yaml_with(Some(", agent_ids: [cart-7]"))).unwrap();
    running.reload_tokens().unwrap();
    let ended = ended_status(&mut checkout).await;
    assert_eq!(ended.code(), Code::PermissionDenied, "{ended:?}");
    assert!(ended.message().contains("`checkout-1`"), "{ended:?}");
    let e = hello(&agent, AGENT, "checkout-1").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // The fleet lists the ended stream's agent as gone (once its task has ended).
    until_connected(&running, &["cart-7", "payments-1"]).await;
    running.shutdown().await.unwrap();
}

/// An agent token given `services` reports only as those services (an agent token could
/// report under any service's name, and so hide that service's alert), and a reload that
/// takes one away ends the streams that named it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_reports_only_as_its_services_and_a_reload_that_narrows_them_ends_the_stream()
 {
    let (_dir, file, running, agent) =
        serving(&tokens_yaml_with(Some(", services: [checkout, cart-*]"))).await;
    let before = refused_total(&metrics(running.http_addr).await);
    let e = hello_as(&agent, AGENT, "p-1", "payments")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(
        e.message(),
        "token `team-a` may not report as service `payments`: its `services` in the tokens \
         file are `checkout`, `cart-*`"
    );
    assert_eq!(refused_total(&metrics(running.http_addr).await) - before, 1);
    // Its own services connect; a token without `services` reports as any.
    let (_a1, mut checkout) = hello_as(&agent, AGENT, "c-1", "checkout").await.unwrap();
    let (_a2, _cart) = hello_as(&agent, AGENT, "c-2", "cart-eu").await.unwrap();
    let (_b, _payments) = hello_as(&agent, AGENT2, "p-1", "payments").await.unwrap();
    // A reload that takes `checkout` away ends that stream.
    fs::write(&file, tokens_yaml_with(Some(", services: [cart-*]"))).unwrap();
    running.reload_tokens().unwrap();
    let ended = ended_status(&mut checkout).await;
    assert_eq!(ended.code(), Code::PermissionDenied, "{ended:?}");
    assert!(ended.message().contains("`checkout`"), "{ended:?}");
    // The streams of services it keeps, and of the other token, stay: the fleet lists them
    // connected once the ended stream's agent is gone.
    until_connected(&running, &["c-2", "p-1"]).await;
    running.shutdown().await.unwrap();
}

#[test]
fn services_are_for_agent_tokens_and_written_as_a_list_of_at_least_one() {
    use retryplane_server::auth::Tokens;
    let path = std::path::Path::new("tokens.yaml");
    for (text, said) in [
        (
            "tokens: [{name: alice, role: admin, secret: admin-secret-0123456789, services: [checkout]}]",
            "`services` is for agent tokens",
        ),
        (
            "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, services: []}]",
            "`services` is empty",
        ),
        (
            "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, services: }]",
            "`services` has no value",
        ),
        (
            "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, services: checkout}]",
            "`services` is one value, not a list",
        ),
    ] {
        let message = Tokens::parse(text, path).err().unwrap().to_string();
        assert!(message.contains(said), "{text}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_with_max_agents_connects_no_more_at_once_and_others_are_not_held_up() {
    let (_dir, file, running, agent) = serving(&tokens_yaml_with(Some(", max_agents: 2"))).await;
    let first = hello(&agent, AGENT, "checkout-1").await.unwrap();
    let (a2, s2) = hello(&agent, AGENT, "checkout-2").await.unwrap();
    let e = hello(&agent, AGENT, "checkout-3").await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(
        e.message(),
        "token `team-a` already has 2 agents connected, and its `max_agents` in the control \
         plane's tokens file is 2"
    );
    // Its agent's next stream replaces its last; another token's agents connect.
    let (_a2, _s2) = hello(&agent, AGENT, "checkout-2").await.unwrap();
    drop((a2, s2));
    let (_b1, _t1) = hello(&agent, AGENT2, "payments-1").await.unwrap();
    let (_b2, _t2) = hello(&agent, AGENT2, "payments-2").await.unwrap();
    // A limit raised by a reload lets the next one in.
    fs::write(&file, tokens_yaml_with(Some(", max_agents: 3"))).unwrap();
    running.reload_tokens().unwrap();
    let (_a3, _s3) = hello(&agent, AGENT, "checkout-3").await.unwrap();
    // One of its agents gone, a new one takes its place (once the server has seen it go).
    drop(first);
    let end = Instant::now() + Duration::from_secs(10);
    let _a4 = loop {
        match hello(&agent, AGENT, "checkout-4").await {
            Ok(connected) => break connected,
            Err(e) => assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}"),
        }
        assert!(Instant::now() < end, "the gone agent's place was not freed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    running.shutdown().await.unwrap();
}

/// An agent stream with `secret` that has sent no Hello yet: the sender for its messages, and
/// the task that opens it (its result comes once the control plane answers the Hello, or
/// refuses the stream).
fn without_hello(
    agent: &Channel,
    secret: &str,
) -> (
    mpsc::Sender<pb::AgentMessage>,
    tokio::task::JoinHandle<Result<tonic::Streaming<pb::ServerMessage>, tonic::Status>>,
) {
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(8);
    let mut client = AgentServiceClient::new(agent.clone());
    let request = with_auth(
        ReceiverStream::new(rx),
        Some(format!("Bearer {secret}").as_bytes()),
    );
    let opened = tokio::spawn(async move { client.connect(request).await.map(|r| r.into_inner()) });
    (tx, opened)
}

async fn wait_awaiting_hello(addr: SocketAddr, n: u64) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = gauge(
            &metrics(addr).await,
            "retryplane_server_streams_awaiting_hello",
        );
        if now == n {
            return;
        }
        assert!(
            Instant::now() < end,
            "{now} streams wait for their Hello, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_with_max_agents_holds_no_more_than_twice_as_many_streams_waiting_for_their_hello()
{
    let (_dir, _file, running, agent) = serving(&tokens_yaml_with(Some(", max_agents: 1"))).await;
    let first = without_hello(&agent, AGENT);
    let _second = without_hello(&agent, AGENT);
    wait_awaiting_hello(running.http_addr, 2).await;
    // A third of the same token is refused at once; another token's stream waits.
    let (_tx, third) = without_hello(&agent, AGENT);
    let e = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the third stream was not refused at once")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("`max_agents`"), "{e:?}");
    let _other = without_hello(&agent, AGENT2);
    wait_awaiting_hello(running.http_addr, 3).await;
    // Once one of them has said Hello, the token has a place again.
    first
        .0
        .send(pb::AgentMessage {
            kind: Some(pb::agent_message::Kind::Hello(pb::Hello {
                agent_id: "checkout-1".to_owned(),
                service: "checkout".to_owned(),
                ..Default::default()
            })),
        })
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), first.1)
        .await
        .expect("the first stream was not answered")
        .unwrap()
        .unwrap();
    let _fourth = without_hello(&agent, AGENT);
    wait_awaiting_hello(running.http_addr, 3).await;
    running.shutdown().await.unwrap();
}

/// Beside other agent tokens, a token without `max_agents` holds at most all but a quarter of
/// the handshake places (3 of 4 here): its fourth stream waiting for its Hello is refused at
/// once, and another token's stream still finds a place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_without_max_agents_holds_no_more_than_three_quarters_of_the_places_waiting_for_hello()
 {
    let (dir, mut cfg) = setup();
    cfg.stream_limits.max_pending_handshakes = 4;
    let running = start(cfg).await.unwrap();
    let agent = channel(running.agent_addr).await;
    let _waiting: Vec<_> = (0..3).map(|_| without_hello(&agent, AGENT)).collect();
    wait_awaiting_hello(running.http_addr, 3).await;
    let (_tx, fourth) = without_hello(&agent, AGENT);
    let e = tokio::time::timeout(Duration::from_secs(5), fourth)
        .await
        .expect("the fourth stream was not refused at once")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("its share of"), "{e:?}");
    let _other = without_hello(&agent, AGENT2);
    wait_awaiting_hello(running.http_addr, 4).await;
    running.shutdown().await.unwrap();
    drop(dir);
}

/// Streams that began waiting while their token was the only agent token count against its
/// share once a reload adds another: the fourth of 4 places is the new token's, not theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_waiting_before_a_reload_added_an_agent_token_count_against_their_tokens_share() {
    let (dir, mut cfg) = setup();
    let file = dir.path().join("tokens.yaml");
    fs::write(&file, tokens_yaml(false)).unwrap();
    cfg.stream_limits.max_pending_handshakes = 4;
    let running = start(cfg).await.unwrap();
    let agent = channel(running.agent_addr).await;
    let _waiting: Vec<_> = (0..3).map(|_| without_hello(&agent, AGENT2)).collect();
    wait_awaiting_hello(running.http_addr, 3).await;
    fs::write(&file, tokens_yaml(true)).unwrap();
    running.reload_tokens().unwrap();
    let (_tx, fourth) = without_hello(&agent, AGENT2);
    let e = tokio::time::timeout(Duration::from_secs(5), fourth)
        .await
        .expect("the fourth stream was not refused at once")
        .unwrap()
        .unwrap_err();
    assert!(e.message().contains("its share of"), "{e:?}");
    let _other = without_hello(&agent, AGENT);
    wait_awaiting_hello(running.http_addr, 4).await;
    running.shutdown().await.unwrap();
}

#[test]
fn agent_ids_written_with_no_value_are_refused_not_taken_as_any_id() {
    use retryplane_server::auth::Tokens;
    let path = std::path::Path::new("tokens.yaml");
    // `agent_ids: []` is refused ("no agent could connect with this token"); the same field
    // left without a value (its last id commented out, `~`) must not quietly lift the
    // restriction to any agent id.
    for text in [
        "tokens:\n  - name: team-a\n    role: agent\n    secret: agent-secret-0123456789\n    agent_ids:\n    # - checkout-*\n",
        "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, agent_ids: }]",
        "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, agent_ids: ~}]",
    ] {
        let parsed = Tokens::parse(text, path);
        assert!(
            parsed.is_err(),
            "accepted, the token connecting as any agent id:\n{text}"
        );
    }
}

#[test]
fn a_malformed_agent_ids_entry_is_named_in_the_tokens_files_words() {
    use retryplane_server::auth::Tokens;
    let path = std::path::Path::new("tokens.yaml");
    for text in [
        // An id left empty in the list.
        "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, agent_ids: [checkout-*, ~]}]",
        // One id, not in a list.
        "tokens: [{name: team-a, role: agent, secret: agent-secret-0123456789, agent_ids: checkout-*}]",
    ] {
        let message = Tokens::parse(text, path).err().unwrap().to_string();
        assert!(
            message.contains("agent_ids") && !message.contains("Option<"),
            "names neither the field nor what it needs, in the file's words: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_with_many_agent_ids_still_refuses_another_id_with_permission_denied() {
    let (dir, cfg) = setup();
    // One exact id per host, as a fleet of a few hundred hosts would list them.
    let ids: Vec<String> = (0..600)
        .map(|i| format!("checkout-host-{i:04}.eu-west-1"))
        .collect();
    fs::write(
        dir.path().join("tokens.yaml"),
        tokens_yaml_with(Some(&format!(", agent_ids: [{}]", ids.join(", ")))),
    )
    .unwrap();
    let running = start(cfg).await.unwrap();
    let agent = channel(running.agent_addr).await;
    let before = refused_total(&metrics(running.http_addr).await);
    let e = hello(&agent, AGENT, "payments-1").await.unwrap_err();
    let after = refused_total(&metrics(running.http_addr).await);
    running.shutdown().await.unwrap();
    // Counted as refused on the server's side, but the agent must be told so too (its
    // `lasting` codes), not given an HTTP/2 error it takes for a passing fault.
    assert_eq!(after - before, 1);
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
}

#[test]
fn an_agent_id_a_hello_may_carry_can_be_named_in_agent_ids() {
    use retryplane_server::auth::Tokens;
    // A zero-width non-joiner, as Persian and Indic words hold: the control plane takes it in
    // a Hello's agent id, so a token must be able to name that id exactly (the refusal says
    // "which no agent id may hold").
    let id = "cart-\u{645}\u{6cc}\u{200c}\u{647}\u{627}-7";
    let hello = pb::Hello {
        agent_id: id.to_owned(),
        service: "checkout".to_owned(),
        ..Default::default()
    };
    retryplane_proto::check_hello(
        &hello,
        retryplane_proto::MAX_HELLO_FIELD_BYTES,
        retryplane_proto::MAX_HELLO_LABELS,
    )
    .unwrap();
    let text = format!(
        "tokens: [{{name: team-a, role: agent, secret: agent-secret-0123456789, agent_ids: [\"{id}\"]}}]"
    );
    let parsed = Tokens::parse(&text, std::path::Path::new("tokens.yaml"));
    assert!(parsed.is_ok(), "{}", parsed.err().unwrap());
}

#[test]
fn a_secret_swapped_into_agent_ids_is_not_shown() {
    use retryplane_server::auth::Tokens;
    // The two values of an entry swapped, as the file's other checks expect of a name or a
    // role: a generated secret with a `*` inside is refused as a pattern, and must not be
    // quoted to the terminal and the log.
    let text = "tokens: [{name: team-a, role: agent, secret: \"checkout-*\", agent_ids: [\"Zq8*vR2mK9xT4wP7nL3bY6cH1\"]}]";
    let message = Tokens::parse(text, std::path::Path::new("tokens.yaml"))
        .err()
        .unwrap()
        .to_string();
    assert!(message.contains("agent_ids[0]"), "{message}");
    assert!(!message.contains("Zq8"), "{message}");
}

/// A tokens file of agent tokens only: each `(name, secret, extra)` as an entry, `extra` such
/// as `, max_agents: 2`.
fn agent_tokens_yaml(tokens: &[(&str, &str, &str)]) -> String {
    let mut s = String::from("tokens:\n");
    for (name, secret, extra) in tokens {
        s += &format!("  - {{name: {name}, role: agent, secret: \"{secret}\"{extra}}}\n");
    }
    s += &format!("  - {{name: alice, role: admin, secret: \"{ADMIN}\"}}\n");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_renamed_by_a_reload_still_counts_its_connected_agents_against_its_max_agents() {
    let (_dir, file, running, agent) =
        serving(&agent_tokens_yaml(&[("team-a", AGENT, ", max_agents: 2")])).await;
    let _a1 = hello(&agent, AGENT, "checkout-1").await.unwrap();
    let _a2 = hello(&agent, AGENT, "checkout-2").await.unwrap();
    // The same token (its secret and its limit), only renamed: the fleet takes it for the
    // same token (its streams replace the two agents' streams), and it still has 2 agents
    // connected.
    fs::write(
        &file,
        agent_tokens_yaml(&[("team-a-2026", AGENT, ", max_agents: 2")]),
    )
    .unwrap();
    running.reload_tokens().unwrap();
    let third = hello(&agent, AGENT, "checkout-3").await;
    let connected = third.is_ok();
    let fourth = hello(&agent, AGENT, "checkout-4").await;
    running.shutdown().await.unwrap();
    assert!(
        !connected,
        "a third agent connected with a token whose max_agents is 2 (a fourth too: {})",
        fourth.is_ok()
    );
    assert_eq!(third.unwrap_err().code(), Code::ResourceExhausted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_given_a_name_another_token_had_is_not_refused_for_that_tokens_agents() {
    let (_dir, file, running, agent) = serving(&agent_tokens_yaml(&[("team-a", AGENT, "")])).await;
    let _a1 = hello(&agent, AGENT, "checkout-1").await.unwrap();
    let _a2 = hello(&agent, AGENT, "checkout-2").await.unwrap();
    // The old token is kept under another name; a new token, with its own secret, takes the
    // name and may connect 2 agents. None of its agents is connected yet.
    fs::write(
        &file,
        agent_tokens_yaml(&[("legacy", AGENT, ""), ("team-a", AGENT2, ", max_agents: 2")]),
    )
    .unwrap();
    running.reload_tokens().unwrap();
    let first = hello(&agent, AGENT2, "payments-1").await;
    running.shutdown().await.unwrap();
    let e = first.err();
    assert!(
        e.is_none(),
        "the new token's first agent was refused: {:?}",
        e.map(|e| e.message().to_owned())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refusal_past_a_lowered_max_agents_says_how_many_agents_are_connected() {
    let (_dir, file, running, agent) = serving(&tokens_yaml_with(Some(", max_agents: 3"))).await;
    let _a1 = hello(&agent, AGENT, "checkout-1").await.unwrap();
    let _a2 = hello(&agent, AGENT, "checkout-2").await.unwrap();
    let _a3 = hello(&agent, AGENT, "checkout-3").await.unwrap();
    // Lowered to 2: the three stay (a reload ends no stream), a fourth is refused.
    fs::write(&file, tokens_yaml_with(Some(", max_agents: 2"))).unwrap();
    running.reload_tokens().unwrap();
    let e = hello(&agent, AGENT, "checkout-4").await.unwrap_err();
    running.shutdown().await.unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        !e.message().contains("already has 2 agents connected"),
        "3 agents of the token are connected, but the refusal says: {}",
        e.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_that_comes_after_a_reload_renamed_its_token_counts_under_the_new_name() {
    let (_dir, file, running, agent) =
        serving(&agent_tokens_yaml(&[("team-a", AGENT, ", max_agents: 1")])).await;
    // Admitted as `team-a`; its Hello comes once the token is called `team-a-2026`.
    let (tx, opened) = without_hello(&agent, AGENT);
    wait_awaiting_hello(running.http_addr, 1).await;
    fs::write(
        &file,
        agent_tokens_yaml(&[("team-a-2026", AGENT, ", max_agents: 1")]),
    )
    .unwrap();
    running.reload_tokens().unwrap();
    tx.send(pb::AgentMessage {
        kind: Some(pb::agent_message::Kind::Hello(pb::Hello {
            agent_id: "checkout-1".to_owned(),
            service: "checkout".to_owned(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let _first = tokio::time::timeout(Duration::from_secs(10), opened)
        .await
        .expect("the first stream was not answered")
        .unwrap()
        .unwrap();
    let listed = listed(&running).await;
    // The token has its one agent connected: a second is refused.
    let second = hello(&agent, AGENT, "checkout-2").await;
    running.shutdown().await.unwrap();
    let tokens: Vec<_> = listed.iter().map(|a| a.token.as_str()).collect();
    assert!(
        second.is_err(),
        "a second agent connected with a token whose max_agents is 1 (the first is listed \
         with token {tokens:?}, a name no longer in the tokens file)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_replaces_its_agents_stream_is_not_refused_while_a_stream_of_its_token_waits_for_its_hello()
 {
    let (_dir, _file, running, agent) = serving(&tokens_yaml_with(Some(", max_agents: 1"))).await;
    let _first = hello(&agent, AGENT, "checkout-1").await.unwrap();
    // A stream the agent gave up before its Hello went out (a stalled connection), still
    // waiting on the control plane's side.
    let (_stalled, _opened) = without_hello(&agent, AGENT);
    wait_awaiting_hello(running.http_addr, 1).await;
    // The README: "a stream that replaces one of its agents' is not" refused.
    let replacement = hello(&agent, AGENT, "checkout-1").await;
    running.shutdown().await.unwrap();
    let e = replacement.err();
    assert!(
        e.is_none(),
        "the agent's next stream was refused: {:?}",
        e.map(|e| e.message().to_owned())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_given_an_old_name_connects_no_more_agents_than_its_max_agents_by_replacing_the_old_secrets_agents()
 {
    let (_dir, file, running, agent) = serving(&agent_tokens_yaml(&[("team-a", AGENT, "")])).await;
    let _old = hello(&agent, AGENT, "checkout-1").await.unwrap();
    // The old secret kept under another name; the name goes to a new secret allowed 1 agent.
    fs::write(
        &file,
        agent_tokens_yaml(&[("legacy", AGENT, ""), ("team-a", AGENT2, ", max_agents: 1")]),
    )
    .unwrap();
    running.reload_tokens().unwrap();
    let _new = hello(&agent, AGENT2, "payments-1").await.unwrap();
    // The new secret has its one agent: a second, which asks for the id an agent of the old
    // secret holds (that secret is `legacy` now, another token), must be refused too.
    let second = hello(&agent, AGENT2, "checkout-1").await;
    let listed = listed(&running).await;
    running.shutdown().await.unwrap();
    let connected: Vec<_> = listed
        .iter()
        .filter(|a| a.connected)
        .map(|a| (a.agent_id.as_str(), a.token.as_str()))
        .collect();
    assert!(
        second.is_err(),
        "a token whose max_agents is 1 has 2 agents connected: {connected:?}"
    );
}

#[test]
fn a_max_agents_or_agent_ids_of_the_wrong_type_is_refused_naming_the_field_and_its_entry() {
    use retryplane_server::auth::Tokens;
    // Each refused, as it must be; but the message should say which field of which entry and
    // what it must be, as it does for `max_agents: 0` or `agent_ids: checkout-*`, not only
    // "invalid u64" or "invalid type: integer (not shown)" at a line and column.
    let mut vague = Vec::new();
    for (value, field) in [
        ("max_agents: -1", "max_agents"),
        ("max_agents: 1.5", "max_agents"),
        ("max_agents: 99999999999999999999999", "max_agents"),
        ("max_agents: [3]", "max_agents"),
        ("agent_ids: 5", "agent_ids"),
        ("agent_ids: true", "agent_ids"),
        ("agent_ids: {checkout: 1}", "agent_ids"),
    ] {
        let text = format!(
            "tokens:\n  - {{name: team-a, role: agent, secret: agent-secret-0123456789}}\n  - \
             {{name: team-b, role: agent, secret: agent-secret-0123456780, {value}}}\n"
        );
        let message = Tokens::parse(&text, std::path::Path::new("tokens.yaml"))
            .err()
            .unwrap()
            .to_string();
        if !(message.contains(field) && message.contains("tokens[1]")) {
            vague.push(format!("`{value}`: {message}"));
        }
    }
    assert!(
        vague.is_empty(),
        "refused without naming the entry and field:\n{}",
        vague.join("\n")
    );
}

/// A reload that renames a token, and gives its old name to another team's new token, does not
/// make that team's token the same as the renamed one: its stream with a connected agent's id
/// is refused with `ALREADY_EXISTS` (README, **Agents**: "one of another token is refused
/// ... while the first is connected, so the holder of one team's agent token cannot push
/// another team's agents off"). The connected stream's token is named as its secret is named
/// now (`payments`), not by the name it registered with (`team-a`, now the other team's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_freed_by_a_rename_and_given_to_another_token_does_not_push_the_renamed_tokens_agents_off()
 {
    let (_dir, file, running, agent) = serving(&tokens_yaml_with(Some(""))).await;
    let (_tx, mut first) = hello(&agent, AGENT, "payments-1").await.unwrap();
    // team-a's secret is now `payments`; the name `team-a` goes to a new token of another team.
    let renamed = format!(
        "tokens:\n  - {{name: payments, role: agent, secret: \"{AGENT}\"}}\n  - {{name: team-a, role: agent, secret: \"{VIEWER}-new\"}}\n  - {{name: alice, role: admin, secret: \"{ADMIN}\"}}\n"
    );
    fs::write(&file, renamed).unwrap();
    running.reload_tokens().unwrap();
    let other = hello(&agent, &format!("{VIEWER}-new"), "payments-1").await;
    let first_end = tokio::time::timeout(Duration::from_millis(500), async {
        loop {
            match first.message().await {
                Ok(Some(_)) => {}
                Ok(None) => return None,
                Err(status) => return Some(status.code()),
            }
        }
    })
    .await;
    assert_eq!(
        other.as_ref().err().map(tonic::Status::code),
        Some(Code::AlreadyExists),
        "another team's token took the connected agent's id; its first stream ended with \
         {first_end:?}"
    );
    // And status lists the connected agent under its token's name now.
    let listed = listed(&running).await;
    let tokens: Vec<_> = listed
        .iter()
        .map(|a| (a.agent_id.as_str(), a.connected, a.token.as_str()))
        .collect();
    assert_eq!(tokens, [("payments-1", true, "payments")]);
    running.shutdown().await.unwrap();
}
