//! One configuration: start the server, connect the agents, measure memory, publish rounds.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail, ensure};
use retryplane_proto::pb::{self, admin_service_client::AdminServiceClient, policy_source};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::WAIT;
use crate::agents::Agents;
use crate::percentile::percentile;
use crate::policy::{check, policy_yaml};
use crate::server::{ServerProcess, cpu_ms};

/// Agents started (and waited for) at once while connecting.
const WAVE: usize = 500;
/// Pause after a round settles (every ACK counted) before the next publish.
const BETWEEN_ROUNDS: Duration = Duration::from_millis(100);
/// Dry-run Applies timed before the rounds.
const DRY_RUNS: usize = 5;
/// Pause before reading the server's memory, so allocations in flight have landed.
const SETTLE: Duration = Duration::from_secs(1);
/// Pause between two server processes, so the sockets of the last one close first.
pub const BETWEEN_SERVERS: Duration = Duration::from_secs(2);

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Agents (streams).
    pub agents: usize,
    /// Endpoints in every published policy.
    pub endpoints: usize,
    /// HTTP/2 connections the agents are spread over.
    pub connections: usize,
    /// Measured publishes.
    pub rounds: usize,
    /// Publishes before the measured ones, not counted.
    pub warmup: usize,
    /// The server binary: `retryplane`, or the plain tonic baseline.
    pub server_bin: PathBuf,
}

/// The figures of one configuration. Times in milliseconds, memory in KiB.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Outcome {
    /// When the run started: UTC time of day, `HH:MM:SS`.
    pub started_utc: String,
    /// The machine's 1-minute load average when the run started (`/proc/loadavg`; -1 when it
    /// cannot be read): on a shared machine, what else was running.
    pub load_at_start: f64,
    /// Agents.
    pub agents: usize,
    /// Endpoints per policy.
    pub endpoints: usize,
    /// HTTP/2 connections.
    pub connections: usize,
    /// Measured rounds.
    pub rounds: usize,
    /// Encoded snapshot size in bytes.
    pub snapshot_bytes: usize,
    /// Time from the publish (the server's `retryplane_server_last_publish_timestamp_seconds`,
    /// set as its streams are woken, once the version is stored) to the last agent's arrival,
    /// p50 over rounds: issue 3's "time from publish to every agent". Read across the two
    /// processes through the system clock (one machine, one clock).
    pub published_p50_ms: f64,
    /// The same, p99 over rounds (nearest rank: the worst round when rounds < 100). Both are
    /// NaN (`null` in JSON) against a server that does not expose its publish time.
    pub published_p99_ms: f64,
    /// Time from the Apply call to the last agent's arrival, p50 over rounds: the publish
    /// above, and before it the Apply call's parse, validation, diff and store commit.
    pub all_p50_ms: f64,
    /// The same, p99 over rounds (nearest rank: the worst round when rounds < 100).
    pub all_p99_ms: f64,
    /// Time from the Apply call to each agent's arrival, p50 over agents × rounds.
    pub agent_p50_ms: f64,
    /// The same, p99.
    pub agent_p99_ms: f64,
    /// Time from the Apply call to the first agent's arrival, p50 over rounds (validation,
    /// store commit and encoding, before any fan-out).
    pub first_p50_ms: f64,
    /// Time from the first to the last agent's arrival, p50 over rounds (the fan-out alone).
    pub spread_p50_ms: f64,
    /// The same, p99.
    pub spread_p99_ms: f64,
    /// How long the Apply call took, p50 over rounds.
    pub apply_rpc_p50_ms: f64,
    /// How long a dry-run Apply of the same size took (parse, validation, diff; no store
    /// commit, no publish), p50 of a few calls before the rounds.
    pub dry_run_p50_ms: f64,
    /// Server CPU time (user + system) per measured round: the publish, the push to every
    /// stream, the ACKs, the bench's `/metrics` polls.
    pub server_cpu_ms_per_round: f64,
    /// This process's CPU time per measured round: the agents receiving and ACKing.
    pub bench_cpu_ms_per_round: f64,
    /// Server RSS with the snapshot loaded and no agent.
    pub rss_idle_kib: u64,
    /// Server RSS with every agent connected and its first snapshot ACKed.
    pub rss_connected_kib: u64,
    /// Server RSS after every round.
    pub rss_after_kib: u64,
    /// (connected - idle) / agents.
    pub kib_per_agent: f64,
    /// (after rounds - idle) / agents.
    pub kib_per_agent_after_pushes: f64,
}

/// [`percentile`], NaN when `values` is empty (a figure not measured).
fn percentile_or_nan(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        f64::NAN
    } else {
        percentile(values, p)
    }
}

/// The UTC time of day now, `HH:MM:SS` (the bench's report only needs the time).
fn utc_time_of_day() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let day = secs % 86_400;
    format!("{:02}:{:02}:{:02}", day / 3_600, day % 3_600 / 60, day % 60)
}

/// The 1-minute load average from `/proc/loadavg`; -1 when it cannot be read.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(-1.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs one configuration against a fresh server process, which is killed afterwards.
pub async fn run(cfg: &Config) -> anyhow::Result<Outcome> {
    ensure!(cfg.agents > 0, "--agents must be at least 1");
    ensure!(cfg.endpoints > 0, "--endpoints must be at least 1");
    ensure!(cfg.rounds > 0, "--rounds must be at least 1");
    ensure!(cfg.connections > 0, "--connections must be at least 1");
    let seed = policy_yaml(cfg.endpoints, 0);
    check(&seed, cfg.endpoints)?;
    let (started_utc, load_at_start) = (utc_time_of_day(), load_average());
    let server = ServerProcess::start(&cfg.server_bin, &seed).await?;
    let outcome = measure(&server, cfg).await.map(|o| Outcome {
        started_utc,
        load_at_start,
        ..o
    });
    let outcome =
        outcome.with_context(|| format!("server log (last lines):\n{}", server.log_tail()));
    let stopped = server.stop().await;
    let outcome = outcome?;
    stopped?;
    Ok(outcome)
}

async fn channel(addr: std::net::SocketAddr) -> anyhow::Result<Channel> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .context("bad admin address")?
        .connect_timeout(WAIT)
        .timeout(WAIT);
    tokio::time::timeout(WAIT, endpoint.connect())
        .await
        .with_context(|| format!("admin {addr}: no answer within {WAIT:?}"))?
        .with_context(|| format!("cannot connect to the admin listener {addr}"))
}

/// Waits until the server's `/metrics` sample `name` is at least `want`, at most [`WAIT`].
async fn wait_metric(server: &ServerProcess, name: &str, want: f64) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT;
    loop {
        let got = server.metric(name).await?;
        if got >= want {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{name} is {got} after {WAIT:?}, expected at least {want}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The server's sample of when the version it serves was published (Unix time, s).
pub const PUBLISHED_AT: &str = "retryplane_server_last_publish_timestamp_seconds";

/// `t` as Unix time in seconds (0 before 1970).
pub fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

#[allow(clippy::cast_precision_loss)]
fn per_agent(rss: u64, idle: u64, agents: usize) -> f64 {
    (rss as f64 - idle as f64) / agents as f64
}

async fn measure(server: &ServerProcess, cfg: &Config) -> anyhow::Result<Outcome> {
    let mut admin = AdminServiceClient::new(channel(server.admin_addr).await?);
    let mut version = admin
        .get(pb::GetRequest { version: 0 })
        .await
        .context("admin Get failed")?
        .into_inner()
        .info
        .context("admin Get returned no version")?
        .version;
    tokio::time::sleep(SETTLE).await;
    let rss_idle_kib = server.rss_kib()?;

    let mut agents = Agents::connect(server.agent_addr, cfg.connections, cfg.endpoints).await?;
    let result = rounds(
        server,
        cfg,
        &mut admin,
        &mut agents,
        &mut version,
        rss_idle_kib,
    )
    .await;
    agents.shutdown().await;
    result
}

/// An Apply of round `round`'s policies over `expected_version`.
fn apply_request(
    endpoints: usize,
    round: u64,
    expected_version: u64,
    dry_run: bool,
) -> pb::ApplyRequest {
    pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(policy_source::Kind::Yaml(policy_yaml(endpoints, round))),
            origin: "retryplane-bench".to_owned(),
        }),
        expected_version: Some(expected_version),
        dry_run,
        force: false,
    }
}

async fn rounds(
    server: &ServerProcess,
    cfg: &Config,
    admin: &mut AdminServiceClient<Channel>,
    agents: &mut Agents,
    version: &mut u64,
    rss_idle_kib: u64,
) -> anyhow::Result<Outcome> {
    let n = cfg.agents;
    let mut start = 0;
    while start < n {
        let end = (start + WAVE).min(n);
        agents.spawn(start..end);
        agents
            .wait_version(start..end, *version)
            .await
            .with_context(|| format!("connecting agents {start}..{end}"))?;
        start = end;
    }
    #[allow(clippy::cast_precision_loss)]
    let n_f = n as f64;
    wait_metric(server, "retryplane_server_agents_connected", n_f).await?;
    wait_metric(server, "retryplane_server_acks_total", n_f).await?;
    tokio::time::sleep(SETTLE).await;
    let rss_connected_kib = server.rss_kib()?;

    let mut dry_run = Vec::with_capacity(DRY_RUNS);
    for _ in 0..DRY_RUNS {
        let request = apply_request(cfg.endpoints, 1, *version, true);
        let t0 = Instant::now();
        tokio::time::timeout(WAIT, admin.apply(request))
            .await
            .with_context(|| format!("dry-run Apply took more than {WAIT:?}"))?
            .context("dry-run Apply failed")?;
        dry_run.push(ms(t0.elapsed()));
    }

    let mut all = Vec::with_capacity(cfg.rounds);
    let mut from_publish = Vec::with_capacity(cfg.rounds);
    let mut first = Vec::with_capacity(cfg.rounds);
    let mut spread = Vec::with_capacity(cfg.rounds);
    let mut apply_rpc = Vec::with_capacity(cfg.rounds);
    let mut each = Vec::with_capacity(cfg.rounds * n);
    let mut snapshot_bytes = 0;
    let mut cpu_start = (0.0, 0.0);
    for round in 1..=cfg.warmup + cfg.rounds {
        if round == cfg.warmup + 1 {
            cpu_start = (server.cpu_ms()?, cpu_ms("/proc/self/stat")?);
        }
        let request = apply_request(cfg.endpoints, round as u64, *version, false);
        let t0 = Instant::now();
        let t0_unix = unix_seconds(SystemTime::now());
        let response = tokio::time::timeout(WAIT, admin.apply(request))
            .await
            .with_context(|| format!("round {round}: Apply took more than {WAIT:?}"))?
            .with_context(|| format!("round {round}: Apply failed"))?
            .into_inner();
        let applied = Instant::now();
        ensure!(
            response.changed,
            "round {round}: Apply stored nothing (same content?)"
        );
        *version = response.version;
        let arrivals = agents
            .wait_version(0..n, *version)
            .await
            .with_context(|| format!("round {round}"))?;
        snapshot_bytes = arrivals.bytes;
        if round > cfg.warmup {
            let latencies: Vec<f64> = arrivals.at.iter().map(|at| ms(*at - t0)).collect();
            let max = latencies.iter().copied().fold(0.0, f64::max);
            let min = latencies.iter().copied().fold(f64::INFINITY, f64::min);
            all.push(max);
            // The publish instant in this process's clock: its distance from `t0` read on the
            // system clock, which the server's figure is on.
            // A server without the sample (built before it) leaves the figure out.
            if let Ok(at) = server.metric(PUBLISHED_AT).await {
                let published = at - t0_unix;
                ensure!(
                    published >= 0.0,
                    "round {round}: published {published} s before the Apply call (the system clock was set back?)"
                );
                from_publish.push(max - published * 1_000.0);
            }
            first.push(min);
            spread.push(max - min);
            apply_rpc.push(ms(applied - t0));
            each.extend(latencies);
        }
        #[allow(clippy::cast_precision_loss)]
        let acks = (n * (round + 1)) as f64;
        wait_metric(server, "retryplane_server_acks_total", acks)
            .await
            .with_context(|| format!("round {round}: waiting for every ACK"))?;
        tokio::time::sleep(BETWEEN_ROUNDS).await;
    }
    #[allow(clippy::cast_precision_loss)]
    let measured = cfg.rounds as f64;
    let server_cpu_ms_per_round = (server.cpu_ms()? - cpu_start.0) / measured;
    let bench_cpu_ms_per_round = (cpu_ms("/proc/self/stat")? - cpu_start.1) / measured;
    tokio::time::sleep(SETTLE).await;
    let rss_after_kib = server.rss_kib()?;
    Ok(Outcome {
        started_utc: String::new(),
        load_at_start: -1.0,
        agents: agents.len(),
        endpoints: cfg.endpoints,
        connections: cfg.connections,
        rounds: cfg.rounds,
        snapshot_bytes,
        published_p50_ms: percentile_or_nan(&mut from_publish, 0.50),
        published_p99_ms: percentile_or_nan(&mut from_publish, 0.99),
        all_p50_ms: percentile(&mut all, 0.50),
        all_p99_ms: percentile(&mut all, 0.99),
        agent_p50_ms: percentile(&mut each, 0.50),
        agent_p99_ms: percentile(&mut each, 0.99),
        first_p50_ms: percentile(&mut first, 0.50),
        spread_p50_ms: percentile(&mut spread, 0.50),
        spread_p99_ms: percentile(&mut spread, 0.99),
        apply_rpc_p50_ms: percentile(&mut apply_rpc, 0.50),
        dry_run_p50_ms: percentile(&mut dry_run, 0.50),
        server_cpu_ms_per_round,
        bench_cpu_ms_per_round,
        rss_idle_kib,
        rss_connected_kib,
        rss_after_kib,
        kib_per_agent: per_agent(rss_connected_kib, rss_idle_kib, n),
        kib_per_agent_after_pushes: per_agent(rss_after_kib, rss_idle_kib, n),
    })
}
