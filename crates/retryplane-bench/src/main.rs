//! `retryplane-bench-fanout`: how fast a published policy version reaches every connected agent,
//! and how much server memory each connected agent costs (issue 3, "Benchmark").
//!
//! # What it measures
//!
//! The real `retryplane serve --api` runs as a separate process (a temp data dir, a seed policy
//! with `E` endpoints, every listener on `127.0.0.1:0`). This process connects `N` raw protocol
//! agents over `C` HTTP/2 connections (default `max(4, ⌈N/100⌉)`, so at most 100 streams share
//! a connection); each sends Hello and ACKs the snapshot it gets. Then, for each of `R` rounds
//! (after a few warm-up rounds), it records `t0`, applies a new version through the admin API
//! (one `defaults` field differs per round) and timestamps, in each agent's task, the arrival of
//! that version's snapshot. It reports:
//!
//! - **time to every agent**: per round, the latest arrival minus `t0`; p50 and p99 over the
//!   rounds (nearest rank, so with fewer than 100 rounds p99 is the worst round);
//! - **per-agent latency**: every arrival minus `t0`; p50 and p99 over agents × rounds;
//! - the first arrival (what the Apply itself costs: validation, diff, store commit, encoding)
//!   and the **fan-out**: from the first to the last arrival, the push to every stream once
//!   the version is published; plus the Apply call's own time and that of a dry-run Apply of
//!   the same size (parse, validation, diff; no store commit, no publish);
//! - CPU time per measured round of the server and of this process (from `/proc/*/stat`):
//!   on a busy machine wall-clock latencies move with the load, CPU time much less;
//! - **server memory per agent**: the server's `VmRSS` with the snapshot loaded and no agent,
//!   then with every agent connected and its first snapshot ACKed: the difference over `N`, in
//!   KiB; and the same after all the rounds.
//!
//! `t0` is taken just before the Apply call, so the times include the admin RPC, validation
//! and the durable store commit: publish-to-agent as an operator sees it. Each round waits for
//! every ACK (the server's `/metrics`) before the next one starts. Agents live in this process,
//! on the same cores as the server: on a small machine their CPU time is part of the figures.
//! So by default this process runs on one thread (a current-thread runtime, `--threads 1`).
//! On tokio's multi-thread runtime, a task that wakes another runs it next on the same worker
//! (the "LIFO slot"), so each agent's ACK went out in its own `writev` right after it was
//! queued, and the workers woke each other through futexes: with 0.9 KiB snapshots that cost
//! the bench about twice the CPU per round (BENCHMARKS.md, "Control plane fan-out",
//! 2026-11-30). With 76 KiB snapshots and 10,000 agents the bench's own decoding needs more
//! than one core: `--threads 2` is faster there. Either way every agent gets the whole message
//! on its own stream, decodes its version and nonce and ACKs it.
//!
//! # How to run it
//!
//! ```sh
//! cargo build --release -p retryplane-cli -p retryplane-bench
//! target/release/retryplane-bench-fanout --agents 1000 --endpoints 10
//! target/release/retryplane-bench-fanout --matrix        # the issue's four configurations
//! ```
//!
//! The server binary defaults to the `retryplane` next to this executable (`--server-bin` to
//! choose another). Every wait is bounded ([`WAIT`]); the server process is killed at the end
//! and on any error. Memory is read from `/proc`, so the bench runs on Linux.
//!
//! # Same-run baseline: `--baseline`
//!
//! Figures on a shared machine are read as ratios against a baseline measured in the same run.
//! With `--baseline`, each configuration runs `--pairs K` times (default 2) on each of two
//! servers: the plain tonic fan-out `retryplane-bench-plain-server` (its doc says what "plain"
//! means: generated services, prost codec, a watch and an mpsc per stream, a per-stream encode,
//! nothing durable) and `retryplane serve`; plain first in odd pairs and retryplane first in
//! even ones, so a load that drifts does not always fall on the same server; each run on a
//! fresh server process with the same agents and settings, its start time and load average
//! reported. The report has both servers' figures and, per figure,
//! retryplane ÷ plain of the same pair: time to every agent p50/p99, fan-out p50/p99, first
//! arrival, server CPU per round, memory per agent connected and after the rounds (text: a
//! table per configuration; json: an object per configuration with `plain` and `retryplane`
//! arrays and `ratios`). The plain server defaults to the one next to this executable
//! (`--baseline-bin` to choose another).
//!
//! ```sh
//! target/release/retryplane-bench-fanout --agents 1000 --endpoints 10 --baseline --pairs 2
//! target/release/retryplane-bench-fanout --matrix --baseline --output json
//! ```

#![forbid(unsafe_code)]

mod agents;
mod baseline;
mod measure;
mod percentile;
mod policy;
mod report;
// Shared with the other benches; this one reads no peak memory.
#[allow(dead_code)]
mod server;
mod stream;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::measure::{BETWEEN_SERVERS, Config, run};
use crate::report::Format;

/// The bound on any single wait: server start, a connection, a round, a metric.
pub const WAIT: Duration = Duration::from_secs(60);

/// Most agent streams put on one HTTP/2 connection by default.
const STREAMS_PER_CONNECTION: usize = 100;

/// The configurations of issue 3: (agents, endpoints).
const MATRIX: [(usize, usize); 4] = [(1_000, 10), (10_000, 10), (1_000, 1_000), (10_000, 1_000)];

/// Publish-to-every-agent latency and server memory per agent of `retryplane serve`.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Agents (one stream each).
    #[arg(long, default_value_t = 1_000)]
    agents: usize,
    /// Endpoints in every published policy.
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    /// Measured publishes.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Publishes before the measured ones, not counted.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// HTTP/2 connections the agents are spread over [default: max(4, agents/100)].
    #[arg(long)]
    connections: Option<usize>,
    /// The `retryplane` binary [default: `retryplane` next to this executable].
    #[arg(long, value_name = "PATH")]
    server_bin: Option<PathBuf>,
    /// Result format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    output: Format,
    /// Threads this process runs its agents on: 1 is a current-thread runtime, more a
    /// multi-thread runtime with that many workers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    threads: u16,
    /// Run the issue's four configurations (1,000 and 10,000 agents × 10 and 1,000
    /// endpoints), each on a fresh server, and print a table (text) or an array (json).
    #[arg(long)]
    matrix: bool,
    /// Also measure the plain tonic fan-out server in the same run, alternating with
    /// `retryplane` on fresh processes, and report retryplane ÷ plain per figure.
    #[arg(long)]
    baseline: bool,
    /// The plain tonic server [default: `retryplane-bench-plain-server` next to this
    /// executable].
    #[arg(long, value_name = "PATH", requires = "baseline")]
    baseline_bin: Option<PathBuf>,
    /// With --baseline: runs of each server per configuration (plain, retryplane, plain, …).
    #[arg(long, default_value_t = 2, requires = "baseline",
          value_parser = clap::value_parser!(u16).range(1..))]
    pairs: u16,
}

fn connections_for(agents: usize, explicit: Option<usize>) -> usize {
    explicit.unwrap_or_else(|| agents.div_ceil(STREAMS_PER_CONNECTION).max(4))
}

/// `explicit`, or the binary `name` next to this executable; an error naming `flag` when there
/// is no file there.
async fn main_inner(cli: Cli) -> anyhow::Result<()> {
    let server_bin = server::server_binary(cli.server_bin.clone(), "retryplane", "--server-bin")?;
    let config = |agents, endpoints| Config {
        agents,
        endpoints,
        connections: connections_for(agents, cli.connections),
        rounds: cli.rounds,
        warmup: cli.warmup,
        server_bin: server_bin.clone(),
    };
    if cli.baseline {
        let plain_bin = server::server_binary(
            cli.baseline_bin.clone(),
            "retryplane-bench-plain-server",
            "--baseline-bin",
        )?;
        return with_baseline(&cli, config, &plain_bin).await;
    }
    if !cli.matrix {
        let outcome = run(&config(cli.agents, cli.endpoints)).await?;
        println!("{}", report::one(&outcome, cli.output)?);
        return Ok(());
    }
    let results = over_matrix(
        config,
        "",
        async |cfg| run(cfg).await,
        |outcome| report::one(outcome, Format::Text),
    )
    .await?;
    println!("{}", report::matrix(&results, cli.output)?);
    Ok(())
}

/// Runs `each` on the issue's four configurations in turn (`what` says more of each in the
/// progress line), printing each result as it comes with `show`; returns every
/// configuration's result, failed ones included.
async fn over_matrix<T>(
    config: impl Fn(usize, usize) -> Config,
    what: &str,
    each: impl AsyncFn(&Config) -> anyhow::Result<T>,
    show: impl Fn(&T) -> anyhow::Result<String>,
) -> anyhow::Result<Vec<(Config, anyhow::Result<T>)>> {
    let mut results = Vec::with_capacity(MATRIX.len());
    for (agents, endpoints) in MATRIX {
        let cfg = config(agents, endpoints);
        eprintln!(
            "running {agents} agents × {endpoints} endpoints over {} connections{what}…",
            cfg.connections
        );
        let result = each(&cfg).await;
        match &result {
            Ok(done) => eprintln!("{}", show(done)?),
            Err(e) => eprintln!("failed: {e:#}"),
        }
        results.push((cfg, result));
        // Let the sockets of the last server close before the next one starts.
        tokio::time::sleep(BETWEEN_SERVERS).await;
    }
    Ok(results)
}

/// `--baseline`: one configuration, or with `--matrix` the issue's four, each as pairs of
/// runs on the plain tonic server and on `retryplane`.
async fn with_baseline(
    cli: &Cli,
    config: impl Fn(usize, usize) -> Config,
    plain_bin: &std::path::Path,
) -> anyhow::Result<()> {
    let pairs = usize::from(cli.pairs);
    if !cli.matrix {
        let comparison =
            baseline::run_pairs(&config(cli.agents, cli.endpoints), plain_bin, pairs).await?;
        println!("{}", baseline::one(&comparison, cli.output)?);
        return Ok(());
    }
    let results = over_matrix(
        config,
        &format!(", {pairs} pairs"),
        async |cfg| baseline::run_pairs(cfg, plain_bin, pairs).await,
        |comparison| baseline::one(comparison, Format::Text),
    )
    .await?;
    println!("{}", baseline::matrix(&results, cli.output)?);
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // One thread by default: see "What it measures" for why.
    let mut builder = if cli.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(usize::from(cli.threads));
        builder
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main_inner(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_keep_streams_per_connection_under_the_cap() {
        assert_eq!(connections_for(10, None), 4);
        assert_eq!(connections_for(1_000, None), 10);
        assert_eq!(connections_for(10_000, None), 100);
        assert_eq!(connections_for(10_001, None), 101);
        assert_eq!(connections_for(10_000, Some(7)), 7);
    }

    #[test]
    fn a_server_binary_given_relative_is_made_absolute_and_a_missing_one_names_its_flag() {
        // Tests run in the package's directory, where `Cargo.toml` is.
        let found = server::server_binary(Some(PathBuf::from("Cargo.toml")), "x", "--a").unwrap();
        assert!(found.is_absolute(), "{}", found.display());
        assert_eq!(found, std::env::current_dir().unwrap().join("Cargo.toml"));

        let missing =
            server::server_binary(Some(PathBuf::from("no/such/bin")), "x", "--server-bin")
                .unwrap_err()
                .to_string();
        assert!(missing.contains("--server-bin"), "{missing}");
        let expected = std::env::current_dir().unwrap().join("no/such/bin");
        assert!(
            missing.contains(&expected.display().to_string()),
            "{missing}"
        );
    }

    #[test]
    fn the_cli_parses() {
        let cli = Cli::try_parse_from([
            "retryplane-bench-fanout",
            "--agents",
            "10",
            "--output",
            "json",
            "--matrix",
        ])
        .unwrap();
        assert_eq!(cli.agents, 10);
        assert!(cli.matrix);
        assert_eq!(cli.threads, 1, "one thread by default");
    }

    #[test]
    fn the_baseline_flags_parse() {
        let plain = Cli::try_parse_from(["retryplane-bench-fanout"]).unwrap();
        assert!(!plain.baseline, "no baseline unless asked");
        let cli = Cli::try_parse_from([
            "retryplane-bench-fanout",
            "--baseline",
            "--baseline-bin",
            "/tmp/plain",
            "--matrix",
            "--output",
            "json",
        ])
        .unwrap();
        assert!(cli.baseline && cli.matrix);
        assert_eq!(cli.pairs, 2, "two pairs by default");
        assert_eq!(cli.baseline_bin, Some(PathBuf::from("/tmp/plain")));
        assert_eq!(cli.output, Format::Json);
        let three =
            Cli::try_parse_from(["retryplane-bench-fanout", "--baseline", "--pairs", "3"]).unwrap();
        assert_eq!(three.pairs, 3);
        assert!(
            Cli::try_parse_from(["retryplane-bench-fanout", "--baseline", "--pairs", "0"]).is_err()
        );
        // The baseline's own flags mean nothing without --baseline.
        assert!(Cli::try_parse_from(["retryplane-bench-fanout", "--pairs", "3"]).is_err());
        assert!(Cli::try_parse_from(["retryplane-bench-fanout", "--baseline-bin", "x"]).is_err());
    }

    #[test]
    fn threads_are_at_least_one() {
        let two = Cli::try_parse_from(["retryplane-bench-fanout", "--threads", "2"]).unwrap();
        assert_eq!(two.threads, 2);
        assert!(Cli::try_parse_from(["retryplane-bench-fanout", "--threads", "0"]).is_err());
    }
}
