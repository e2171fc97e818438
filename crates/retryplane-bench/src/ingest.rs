//! `retryplane-bench-ingest`: metrics ingestion at the control plane over real agent streams
//! (issue 5, "Bench").
//!
//! # What it measures
//!
//! The real `retryplane serve --api` runs as a separate process (a temp data dir, a seed
//! policy with `E` endpoints, every listener on `127.0.0.1:0`). This process connects `N` raw
//! protocol agents over `C` HTTP/2 connections (default `max(4, ⌈N/100⌉)`), in `S` calling
//! services; each sends Hello, ACKs its snapshot, and once every agent is connected, sends a
//! `MetricsReport` of `E` endpoints (1 call each) every `I` ms for `D` seconds, the agents'
//! phases spread evenly over the interval. Offered load: `N × E × 1000 / I` endpoint-reports
//! per second. It reports:
//!
//! - the **offered and achieved rate**: endpoint-reports sent over the sending time, and the
//!   time until the server's admin `Stats` counts every call sent (the lag after the last
//!   send; Stats is polled every 50 ms);
//! - the server's **CPU time** (user + system, `/proc/<pid>/stat`, 10 ms resolution) from the
//!   first send until every agent has sent its last report and the server has ended its
//!   stream (before Stats is polled), per endpoint-report and as a share of a core; this
//!   includes HTTP/2, protobuf decoding, the per-agent rate limit, the fleet's last-seen
//!   update and `retryplane_server::aggregate::Aggregator::ingest`;
//! - `retryplane_server_reports_dropped_total` (reports over the per-agent rate limit: must
//!   be 0 at 1 report per second per agent, the limit being 2/s with a burst of 10);
//! - the server's `VmRSS` before the reports and after.
//!
//! The agents run in this process, on the same 2 cores as the server.
//!
//! ```sh
//! cargo build --release -p retryplane-cli -p retryplane-bench
//! target/release/retryplane-bench-ingest --agents 10000 --endpoints 20 --interval-ms 1000 --seconds 20
//! ```

#![forbid(unsafe_code)]

mod policy;
// Shared with the other benches; this one reads no peak memory.
#[allow(dead_code)]
mod server;
mod stream;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use prost::Message as _;
use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::server::{ServerProcess, cpu_ms};

/// The bound on any single wait: server start, a connection, every agent ready, catching up.
pub const WAIT: Duration = Duration::from_secs(60);

/// Metrics ingestion over real agent streams into `retryplane serve`.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Agents (one stream each).
    #[arg(long, default_value_t = 10_000)]
    agents: usize,
    /// Endpoints in each report (and in the seed policy).
    #[arg(long, default_value_t = 20)]
    endpoints: usize,
    /// Calling services the agents are spread over.
    #[arg(long, default_value_t = 100)]
    services: usize,
    /// Milliseconds between two reports of one agent.
    #[arg(long, default_value_t = 1_000)]
    interval_ms: u64,
    /// How long the agents send, in seconds.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// HTTP/2 connections the agents share (default max(4, ⌈agents / 100⌉)).
    #[arg(long)]
    connections: Option<usize>,
    /// The `retryplane` binary (default: the one beside this executable).
    #[arg(long)]
    server_bin: Option<PathBuf>,
}

/// The fields of `retryplane.v1.Snapshot` an agent needs to ACK it.
#[derive(Clone, PartialEq, prost::Message)]
struct SnapshotHead {
    #[prost(uint64, tag = "1")]
    version: u64,
    #[prost(string, tag = "4")]
    nonce: String,
}

struct Plan {
    agent: usize,
    service: String,
    endpoints: usize,
    phase: Duration,
    interval: Duration,
    sends: u64,
}

/// One agent: Hello, ACK, then `sends` reports; returns how many it sent.
async fn agent(
    plan: Plan,
    channel: Channel,
    ready: mpsc::Sender<()>,
    mut start: watch::Receiver<Option<Instant>>,
) -> anyhow::Result<u64> {
    let hello = pb::Hello {
        agent_id: format!("ingest-{:05}", plan.agent),
        service: plan.service,
        ..Default::default()
    };
    let (tx, mut inbound) = crate::stream::open(channel, hello).await?;
    let first = inbound
        .message()
        .await
        .context("the stream failed")?
        .context("the server ended the stream before a snapshot")?;
    let bytes = first
        .snapshot
        .context("a server message without a snapshot")?;
    let head = SnapshotHead::decode(bytes).context("cannot decode the snapshot")?;
    tx.send(pb::AgentMessage {
        kind: Some(Kind::Ack(pb::Ack {
            version: head.version,
            nonce: head.nonce,
        })),
    })
    .await
    .context("cannot queue the ACK")?;
    ready.send(()).await.context("the coordinator is gone")?;
    let at = *start
        .wait_for(Option::is_some)
        .await
        .context("the coordinator is gone")?;
    let Some(at) = at else {
        bail!("no start time");
    };
    let report = pb::AgentMessage {
        kind: Some(Kind::Metrics(pb::MetricsReport {
            policy_version: head.version,
            endpoints: (0..plan.endpoints)
                .map(|e| pb::EndpointCounters {
                    endpoint: format!("svc-{e:05}"),
                    calls: 1,
                    attempts: 1,
                    success_first_try: 1,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })),
    };
    let mut ticks = tokio::time::interval_at(at + plan.phase, plan.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent = 0;
    while sent < plan.sends {
        ticks.tick().await;
        tx.send(report.clone())
            .await
            .context("the stream closed while sending")?;
        sent += 1;
    }
    // Close the request side and wait for the server to end the call: dropping the response
    // first would cancel the stream and lose the reports still queued.
    drop(tx);
    while tokio::time::timeout(WAIT, inbound.message())
        .await
        .context("the server did not end the stream after the last report")?
        .is_ok_and(|m| m.is_some())
    {}
    Ok(sent)
}

async fn calls_counted(admin: &mut pb::admin_service_client::AdminServiceClient<Channel>) -> u64 {
    match admin.stats(pb::StatsRequest::default()).await {
        Ok(r) => r.into_inner().endpoints.iter().map(|e| e.calls).sum(),
        Err(_) => 0,
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let bin = server::server_binary(cli.server_bin, "retryplane", "--server-bin")?;
    let seed = policy::policy_yaml(cli.endpoints, 0);
    policy::check(&seed, cli.endpoints)?;
    let server = ServerProcess::start(&bin, &seed).await?;
    let connections = cli
        .connections
        .unwrap_or_else(|| cli.agents.div_ceil(100).max(4));
    let endpoint = Endpoint::from_shared(format!("http://{}", server.agent_addr))
        .context("bad agent address")?
        .connect_timeout(WAIT)
        .tcp_nodelay(true);
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        channels.push(
            tokio::time::timeout(WAIT, endpoint.connect())
                .await
                .context("no connection within the bound")?
                .context("cannot connect")?,
        );
    }
    let interval = Duration::from_millis(cli.interval_ms.max(1));
    let sends = (cli.seconds * 1_000).div_ceil(cli.interval_ms.max(1));
    let (ready_tx, mut ready_rx) = mpsc::channel(cli.agents.max(1));
    let (start_tx, start_rx) = watch::channel(None);
    let mut tasks = JoinSet::new();
    for a in 0..cli.agents {
        let plan = Plan {
            agent: a,
            service: format!("service-{:04}", a % cli.services.max(1)),
            endpoints: cli.endpoints,
            phase: interval * u32::try_from(a).unwrap_or(u32::MAX)
                / u32::try_from(cli.agents).unwrap_or(u32::MAX),
            interval,
            sends,
        };
        let channel = channels[a % channels.len()].clone();
        tasks.spawn(agent(plan, channel, ready_tx.clone(), start_rx.clone()));
    }
    drop(ready_tx);
    let deadline = Instant::now() + WAIT;
    for i in 0..cli.agents {
        tokio::time::timeout_at(deadline, ready_rx.recv())
            .await
            .with_context(|| format!("only {i} of {} agents were ready in time", cli.agents))?
            .with_context(|| {
                format!(
                    "agents failed before sending; the server log:\n{}",
                    server.log_tail()
                )
            })?;
    }
    let admin_channel = Endpoint::from_shared(format!("http://{}", server.admin_addr))
        .context("bad admin address")?
        .connect()
        .await
        .context("cannot connect to the admin listener")?;
    let mut admin = pb::admin_service_client::AdminServiceClient::new(admin_channel);
    let rss_before = server.rss_kib()?;
    let bench_stat = format!("/proc/{}/stat", std::process::id());
    let (server_cpu_0, bench_cpu_0) = (server.cpu_ms()?, cpu_ms(&bench_stat)?);
    let t0 = Instant::now();
    start_tx.send_replace(Some(t0));
    let mut sent = 0;
    let end = t0 + Duration::from_secs(cli.seconds) + WAIT;
    while let Some(joined) = tokio::time::timeout_at(end, tasks.join_next())
        .await
        .context("the agents did not finish sending in time")?
    {
        sent += joined.context("an agent task panicked")??;
    }
    let sending = t0.elapsed();
    let (server_cpu, bench_cpu) = (
        server.cpu_ms()? - server_cpu_0,
        cpu_ms(&bench_stat)? - bench_cpu_0,
    );
    let expected = sent * cli.endpoints as u64;
    let deadline = Instant::now() + WAIT;
    let mut counted = calls_counted(&mut admin).await;
    while counted < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        counted = calls_counted(&mut admin).await;
    }
    let caught_up = t0.elapsed();
    let rss_after = server.rss_kib()?;
    let dropped = server
        .metric("retryplane_server_reports_dropped_total")
        .await?;
    let endpoint_reports = expected as f64;
    println!(
        "agents {} × endpoints {}, services {}, {} connections, one report every {} ms for {} s",
        cli.agents, cli.endpoints, cli.services, connections, cli.interval_ms, cli.seconds
    );
    println!(
        "offered {:.0} endpoint-reports/s; sent {} reports ({} endpoint-reports) in {:.2} s: {:.0}/s",
        (cli.agents * cli.endpoints) as f64 * 1_000.0 / cli.interval_ms.max(1) as f64,
        sent,
        expected,
        sending.as_secs_f64(),
        endpoint_reports / sending.as_secs_f64()
    );
    println!(
        "server counted {} of {} calls, {:.0} ms after the last send; reports dropped by the rate limit: {}",
        counted,
        expected,
        (caught_up.saturating_sub(sending)).as_secs_f64() * 1e3,
        dropped
    );
    println!(
        "while sending: server CPU {:.0} ms over {:.2} s ({:.0} % of one core; {:.2} µs per \
         endpoint-report, {:.0} endpoint-reports per CPU-second); bench process CPU {:.0} ms",
        server_cpu,
        sending.as_secs_f64(),
        server_cpu / sending.as_secs_f64() / 10.0,
        server_cpu * 1e3 / endpoint_reports,
        endpoint_reports / (server_cpu / 1e3),
        bench_cpu
    );
    println!(
        "server RSS {:.1} MiB before the reports, {:.1} MiB after",
        rss_before as f64 / 1024.0,
        rss_after as f64 / 1024.0
    );
    if counted != expected {
        bail!("the server counted {counted} calls of {expected} sent");
    }
    server.stop().await
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("retryplane-bench-ingest: {e:#}");
            ExitCode::FAILURE
        }
    }
}
