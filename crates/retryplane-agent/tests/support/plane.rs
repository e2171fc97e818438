//! A real control plane on `127.0.0.1:0` for the end-to-end tests, and bounded polling.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use retryplane_agent::{Agent, AgentBuilder, AttemptInfo, CallMeta, ReconnectBackoff};
use retryplane_proto::pb;
use retryplane_server::server::{Running, ServeConfig, start};
use tonic::transport::{Channel, Endpoint};

use super::Fut;

/// The longest any single wait may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(15);

/// The e2e policy: fast deterministic pauses, no budget or breaker, `ep` with `max_attempts`.
pub fn yaml(max_attempts: u32) -> String {
    format!(
        "version: 1\ndefaults:\n  backoff: {{base: 5ms, max: 20ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: {max_attempts}\n"
    )
}

/// Starts a control plane in API mode over `dir` (seeded with `seed` when the store is empty),
/// its agent listener on `agent_listen`.
pub async fn plane(dir: &Path, seed: &str, agent_listen: Option<SocketAddr>) -> Running {
    plane_with(dir, seed, agent_listen, |_| {}).await
}

/// [`plane`], with `tune` applied to the server's configuration.
pub async fn plane_with(
    dir: &Path,
    seed: &str,
    agent_listen: Option<SocketAddr>,
    tune: impl FnOnce(&mut ServeConfig),
) -> Running {
    std::fs::write(dir.join("policies.yaml"), seed).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut cfg = ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: agent_listen.unwrap_or(any),
        admin_listen: any,
        http_listen: any,
        api_mode: true,
        metrics_interval: Duration::from_millis(200),
        ..ServeConfig::default()
    };
    tune(&mut cfg);
    start(cfg).await.unwrap()
}

/// The tests' agent settings for a control plane at `addr`: seeded, reconnecting quickly.
pub fn builder(addr: SocketAddr, id: &str) -> AgentBuilder {
    Agent::builder()
        .url(format!("http://{addr}"))
        .service("checkout")
        .label("zone", "test")
        .agent_id(id)
        .rng_seed(1)
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(300),
            Duration::from_secs(10),
        ))
}

/// An agent connected to `addr`.
pub fn agent(addr: SocketAddr, id: &str, cache: Option<&Path>) -> Agent {
    let mut b = builder(addr, id);
    if let Some(c) = cache {
        b = b.cache_file(c);
    }
    b.connect().unwrap()
}

/// An admin client.
pub async fn admin(running: &Running) -> pb::admin_service_client::AdminServiceClient<Channel> {
    let ch = Endpoint::from_shared(format!("http://{}", running.admin_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    pb::admin_service_client::AdminServiceClient::new(ch)
}

/// Applies `yaml` through the admin API.
pub async fn apply(running: &Running, yaml: String) -> u64 {
    admin(running)
        .await
        .apply(pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml(yaml)),
                origin: "test".into(),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .version
}

/// The fleet-wide stats of `ep`.
pub async fn stats(running: &Running) -> Option<pb::EndpointStats> {
    let r = admin(running)
        .await
        .stats(pb::StatsRequest {
            endpoint: "ep".into(),
            ..Default::default()
        })
        .await
        .ok()?
        .into_inner();
    r.endpoints.into_iter().find(|e| e.endpoint == "ep")
}

/// The server's status of agent `id` (`None`: not listed).
pub async fn agent_status(running: &Running, id: &str) -> Option<pb::AgentStatus> {
    let fleet = admin(running)
        .await
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    fleet.agents.into_iter().find(|a| a.agent_id == id)
}

/// Whether the server lists agent `id` as connected (`None`: not listed).
pub async fn listed_connected(running: &Running, id: &str) -> Option<bool> {
    agent_status(running, id).await.map(|a| a.connected)
}

/// The value of the sample `name` (no labels) on the server's `/metrics`.
pub async fn metric(running: &Running, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = tokio::net::TcpStream::connect(running.http_addr)
        .await
        .unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    tcp.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        Some(value.trim().parse().unwrap())
    })
}

/// Polls `check` until it holds, failing after [`WAIT`].
pub async fn eventually<F, Fut2>(what: &str, mut check: F)
where
    F: FnMut() -> Fut2,
    Fut2: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `n` calls to `ep` that succeed on the first try.
pub async fn succeed(agent: &Agent, n: u64) {
    for _ in 0..n {
        agent
            .endpoint("ep")
            .call(
                CallMeta::http("GET", "/"),
                super::Upstream::new([]).attempt(),
            )
            .await
            .unwrap();
    }
}

/// Attempts one always-failing GET on `ep` makes (checked against the upstream's count).
pub async fn attempts_of(agent: &Agent) -> u32 {
    let count = Arc::new(AtomicU32::new(0));
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http("GET", "/"), failing(count.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.attempts, count.load(Ordering::SeqCst));
    err.attempts
}

/// An upstream that always answers 503 and counts attempts.
pub fn failing(count: Arc<AtomicU32>) -> impl FnMut(AttemptInfo) -> Fut {
    move |_| {
        count.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(super::response(503, None)) })
    }
}
