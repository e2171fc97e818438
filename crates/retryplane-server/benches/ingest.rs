//! Metrics ingestion at the server: endpoint-reports per second through
//! [`Aggregator::ingest`] (what the agent stream calls for every accepted `MetricsReport`),
//! and the memory of the aggregates.
//!
//! `A` agents (default 10,000), each with its own [`ServiceHandle`] (resolved once, as a
//! stream does at Hello) and a report of `E` endpoints (default 20), spread over `S` calling
//! services. `T` threads (default 2, the machine's cores) each take a share of the agents and
//! send every one of its reports once per round, reading tokio's clock per report as the
//! stream does; `R` rounds (default 50) after one warm-up round. The rate is endpoint-reports
//! (`A × E × R`) over the wall time of the slowest thread. Decoding the protobuf message and
//! the stream's own bookkeeping are not included.
//!
//! CPU time: each thread's own (`/proc/thread-self/schedstat`), summed over the threads and
//! divided by the endpoint-reports: what one endpoint-report costs, whatever else the machine
//! runs.
//!
//! Memory: [`Aggregator::approx_bytes`] (from the layout) and the process's `VmRSS` growth from
//! before the aggregator was made to after the last round (the reports are built before). Only
//! the first configuration of a process has a meaningful RSS growth (later ones reuse freed
//! memory), so the figures are taken one configuration per run.
//!
//! ```sh
//! cargo bench -p retryplane-server --bench ingest                        # the default matrix
//! cargo bench -p retryplane-server --bench ingest -- 10000 20 100 2 50   # one: A E S T R
//! ```

use std::sync::{Arc, Barrier};
use std::time::Duration;

use retryplane_proto::pb;
use retryplane_server::aggregate::{Aggregator, DEFAULT_MAX_SERIES, ServiceHandle};
use tokio::time::Instant;

#[derive(Clone, Copy, Debug)]
struct Config {
    agents: usize,
    endpoints: usize,
    services: usize,
    threads: usize,
    rounds: usize,
}

fn report(agent: usize, endpoints: usize) -> pb::MetricsReport {
    pb::MetricsReport {
        window_start_unix_ms: 0,
        window_end_unix_ms: 10_000,
        policy_version: 7,
        endpoints: (0..endpoints)
            .map(|e| pb::EndpointCounters {
                endpoint: format!("endpoint-{e:02}"),
                calls: 100 + (agent % 7) as u64,
                attempts: 104,
                retries: 4,
                success_first_try: 96,
                success_after_retry: 3,
                gave_up_attempts: 1,
                backoff_ms: 350,
                ..Default::default()
            })
            .collect(),
        seq: 0,
    }
}

/// This thread's CPU time so far (`/proc/thread-self/schedstat`, first field, ns): time on a
/// CPU, not counting time other processes had the core.
fn thread_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn run(cfg: Config) {
    let reports: Vec<pb::MetricsReport> =
        (0..cfg.agents).map(|a| report(a, cfg.endpoints)).collect();
    let rss_before = rss_kib();
    let agg = Arc::new(Aggregator::new(
        DEFAULT_MAX_SERIES,
        Instant::now(),
        Arc::default(),
    ));
    let handles: Vec<ServiceHandle> = (0..cfg.agents)
        .map(|a| agg.service(&format!("service-{:04}", a % cfg.services)))
        .collect();
    let reports = Arc::new(reports);
    let handles = Arc::new(handles);
    let barrier = Arc::new(Barrier::new(cfg.threads));
    let threads: Vec<_> = (0..cfg.threads)
        .map(|t| {
            let (agg, reports, handles, barrier) = (
                agg.clone(),
                reports.clone(),
                handles.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                let mine: Vec<usize> = (t..cfg.agents).step_by(cfg.threads).collect();
                for &a in &mine {
                    agg.ingest(&handles[a], &reports[a], Instant::now());
                }
                barrier.wait();
                let start = Instant::now();
                let cpu_start = thread_cpu();
                for _ in 0..cfg.rounds {
                    for &a in &mine {
                        agg.ingest(&handles[a], &reports[a], Instant::now());
                    }
                }
                let cpu = match (cpu_start, thread_cpu()) {
                    (Some(s), Some(e)) => e.saturating_sub(s),
                    _ => Duration::ZERO,
                };
                (start.elapsed(), cpu)
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    let mut cpu = Duration::ZERO;
    for t in threads {
        let (wall, used) = t.join().unwrap_or_default();
        slowest = slowest.max(wall);
        cpu += used;
    }
    let rss_after = rss_kib();
    let endpoint_reports = (cfg.agents * cfg.endpoints * cfg.rounds) as f64;
    let rate = endpoint_reports / slowest.as_secs_f64();
    let cpu_ns = cpu.as_secs_f64() * 1e9 / endpoint_reports;
    let series = agg.series_count();
    let bytes = agg.approx_bytes();
    let rss = match (rss_before, rss_after) {
        (Some(b), Some(a)) => format!("{:.1} MiB", a.saturating_sub(b) as f64 / 1024.0),
        _ => "n/a".to_owned(),
    };
    println!(
        "agents {:>6} × endpoints {:>3}, services {:>5}, threads {}, rounds {:>3}: \
         {:>10.0} endpoint-reports/s ({:>5.1} ns of wall time, {:>5.1} ns of CPU time each; \
         {:>6.1} ms per round of {} reports); \
         series {:>6} (+other: {} overflowed), aggregates {:.2} MiB ({} B/series), RSS growth {}",
        cfg.agents,
        cfg.endpoints,
        cfg.services,
        cfg.threads,
        cfg.rounds,
        rate,
        1e9 / rate,
        cpu_ns,
        slowest.as_secs_f64() * 1e3 / cfg.rounds as f64,
        cfg.agents,
        series,
        agg.overflowed_reports(),
        bytes as f64 / (1024.0 * 1024.0),
        bytes / series.max(1),
        rss,
    );
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if let [agents, endpoints, services, threads, rounds] = args[..] {
        run(Config {
            agents,
            endpoints,
            services,
            threads,
            rounds,
        });
        return;
    }
    let base = Config {
        agents: 10_000,
        endpoints: 20,
        services: 100,
        threads: 2,
        rounds: 50,
    };
    // One process per configuration, so each RSS growth starts from a fresh heap.
    let exe = std::env::current_exe().ok();
    for cfg in [
        base,
        Config { threads: 1, ..base },
        Config {
            services: 1,
            ..base
        },
        Config {
            services: 500,
            ..base
        },
    ] {
        let args = [
            cfg.agents,
            cfg.endpoints,
            cfg.services,
            cfg.threads,
            cfg.rounds,
        ]
        .map(|n| n.to_string());
        let status = exe
            .as_ref()
            .and_then(|exe| std::process::Command::new(exe).args(&args).status().ok());
        if !status.is_some_and(|s| s.success()) {
            eprintln!("the run with {args:?} failed; running it in this process");
            run(cfg);
        }
    }
}
