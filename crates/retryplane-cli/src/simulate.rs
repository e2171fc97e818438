//! `retryplane simulate --policy FILE --endpoint NAME [...]`: what the endpoint's policy does to
//! an upstream that falls over, compared with the same policy without budget, without jitter,
//! and with a naive client (the simulation itself is `retryplane-sim`).
//!
//! The simulated calls are `GET` requests under the endpoint's own policy (routes are not
//! consulted); the file's warnings about that policy (those `explain --endpoint NAME` lists)
//! go to standard error. Text output is a table with one column per variant; `--output json` prints the
//! whole report, per-second series included; `--plot FILE.svg` also writes the attempts per
//! second as an SVG chart. The same flags and seed give the same output, byte for byte. A run
//! that takes more than a second shows how far it has come on standard error when that is a
//! terminal (`simulating: 42%`, rewritten in place and cleared at the end).
//!
//! Exit codes: `0` simulated; `1` the policy file has errors (printed exactly as `validate`
//! prints them, text or JSON); `2` bad flags, an unreadable file, an unknown endpoint, a run
//! stopped at its limit of calls in flight (`retryplane_sim::config::MAX_IN_FLIGHT`) or a plot
//! that cannot be written.

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};
use retryplane_sim::{Config, Progress, Scenario};

use crate::flags::duration_in;
use crate::input::{Source, no_such_endpoint};
use crate::output::{self, Format};
use crate::{Outcome, Report};

/// What the report's figures mean, for `--help` (the definitions are `retryplane_sim::stats`'s;
/// README's "Simulate a retry storm" says the same).
pub const FIGURES: &str = "\
The figures, per variant:
  logical calls        calls started (arrivals during --duration)
  upstream attempts    requests sent to the upstream, shed ones included (a call refused by
                       an open breaker sends none)
  amplification        attempts / logical calls over the whole run; incident mean: attempts
                       sent in the incident's seconds / calls started in them; incident peak
                       (1s): the largest such ratio of one second (it can pass max_attempts:
                       a second's attempts include retries of calls started before it)
  peak attempts/s      the most attempts sent in one second
  success              calls that returned a success / logical calls
  latency p50, p99     start to result of every call, success or not
  gave up: CAUSE       calls that ended without a success, by cause (as `request` names it)
  time to recover      from the incident's end to the first second whose calls succeed at 95%
                       of the rate before it; not in run: no such second before the run's
                       end; n/a: the incident does not end within the run (error-rate)

The incident's seconds are those wholly inside the outage or throttle (if none, those it
overlaps; every second of --duration for error-rate: attempts sent after it, by calls still
retrying, are in the overall figure only). A variant that made no call shows n/a (null in
JSON) for its ratios, shares and latencies. The upstream sheds requests past --capacity (a token bucket holding
100 ms of it, at least 10 requests) with 503, and answers an outage's or throttle's requests
without using capacity.";

/// `retryplane simulate` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Policy file; `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    policy: PathBuf,
    /// The endpoint whose policy the clients run.
    #[arg(long, value_name = "NAME")]
    endpoint: String,
    /// Clients, each with its own retry budget, circuit breaker and random source (at most
    /// 100,000, and clients × seconds of run at most 10⁸).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    clients: u32,
    /// Logical calls per second per client (Poisson arrivals; at most 1,000,000, and at most
    /// 20 million calls in the run).
    #[arg(long, value_name = "R", default_value_t = 1.0)]
    rate: f64,
    /// Simulated (virtual) time during which calls start.
    #[arg(long, value_name = "D", default_value = "120s", value_parser = run_duration)]
    duration: Duration,
    /// How the upstream fails: outage:START+LEN (every request 503), error-rate:P, or
    /// throttle:START+LEN:RETRY_AFTER (429 with Retry-After).
    #[arg(long, value_name = "SCENARIO", default_value = "outage:30s+20s")]
    scenario: Scenario,
    /// Requests per second the upstream serves (at most 10⁹); above it, requests fail with
    /// 503 [default: 1.5 × clients × rate, at most 10⁹].
    #[arg(long, value_name = "C")]
    capacity: Option<f64>,
    /// The upstream's base latency (at most 60s): an answer takes it × uniform[0.5, 1.5], and a
    /// served request up to 4 times that as the upstream nears its capacity (so a per-try
    /// timeout near it times out some calls even with no failures).
    #[arg(long, value_name = "L", default_value = "20ms", value_parser = latency)]
    latency: Duration,
    /// Seed of every random choice; the same seed gives the same output.
    #[arg(long, value_name = "S", default_value_t = 1)]
    seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    /// Also write upstream attempts per second as an SVG chart to this file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// Runs `run` on a thread of its own and, past its first second, shows its progress on
/// standard error (a terminal) about five times a second, clearing the line at the end.
fn with_progress<T: Send>(run: impl FnOnce(&Progress) -> T + Send) -> T {
    const EVERY: Duration = Duration::from_millis(200);
    /// Waits of `EVERY` with nothing shown: a run shorter than a second stays quiet.
    const QUIET: u32 = 5;
    let progress = Progress::default();
    let (ended, end) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let watched = &progress;
        let handle = scope.spawn(move || {
            let out = run(watched);
            drop(ended);
            out
        });
        let (mut waits, mut shown) = (0, false);
        while let Err(mpsc::RecvTimeoutError::Timeout) = end.recv_timeout(EVERY) {
            waits += 1;
            if waits >= QUIET {
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\rsimulating: {:>3.0}%", progress.done() * 100.0);
                let _ = err.flush();
                shown = true;
            }
        }
        if shown {
            let _ = write!(std::io::stderr().lock(), "\r{:17}\r", "");
        }
        handle
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// `--duration`: the range `retryplane_sim::Config` takes, said as it is.
fn run_duration(text: &str) -> Result<Duration, String> {
    let max = retryplane_sim::config::MAX_DURATION;
    duration_in(text, Duration::from_millis(1)..=max, "from 1ms to 24h")
}

/// `--latency`: the range `retryplane_sim::Config` takes (an upstream that answers at once
/// included), said as it is.
fn latency(text: &str) -> Result<Duration, String> {
    let max = retryplane_sim::config::MAX_LATENCY;
    duration_in(text, Duration::ZERO..=max, "from 0ms to 60s")
}

/// What to simulate, checked once.
#[derive(Debug)]
pub struct Settings {
    /// The policy file.
    pub source: Source,
    /// The endpoint name.
    pub endpoint: String,
    /// The fleet, upstream and scenario.
    pub config: Config,
    /// Output format.
    pub format: Format,
    /// Where to write the SVG chart.
    pub plot: Option<PathBuf>,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        let config = Config {
            clients: args.clients,
            rate: args.rate,
            duration: args.duration,
            scenario: args.scenario,
            capacity: args
                .capacity
                .unwrap_or_else(|| Config::default_capacity(args.clients, args.rate)),
            latency: args.latency,
            seed: args.seed,
        };
        config.validate()?;
        if let Some(plot) = &args.plot {
            if plot.as_os_str().is_empty() {
                bail!("--plot needs a file name");
            }
            // Before the run, which can take a while: a plot it could not write would throw
            // its report away.
            writable(plot).with_context(|| format!("cannot write {}", plot.display()))?;
        }
        Ok(Self {
            source: Source::from_arg(args.policy),
            endpoint: args.endpoint,
            config,
            format: args.output,
            plot: args.plot,
        })
    }
}

/// Whether `path` can be written, as the plot will be after the run: an existing file is
/// opened for writing (not truncated: a run that fails leaves it as it was), and a new one is
/// created and removed again.
fn writable(path: &std::path::Path) -> std::io::Result<()> {
    match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)?;
            std::fs::remove_file(path)
        }
        Err(e) => Err(e),
    }
}

/// Loads the policy, simulates it and renders the report; see the module docs.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    // Every diagnostic: the endpoint's warnings are picked out of them below, and may come
    // past the first `MAX_LISTED` of the file.
    let mut loaded = settings.source.load_all_for_agents()?;
    let file = settings.source.to_string();
    let Some(policies) = &loaded.policies else {
        retryplane_policy::diag::cap(&mut loaded.diagnostics);
        return output::invalid_file_report(&file, &loaded.diagnostics, settings.format);
    };
    let Some(endpoint) = policies.endpoint(&settings.endpoint) else {
        return Err(no_such_endpoint(
            &file,
            &settings.endpoint,
            &policies.names(),
        ));
    };
    // What is simulated is the endpoint's own policy: the warnings that hold for it, on
    // standard error (standard output is the report), as `explain` lists them.
    if let Some(doc_endpoint) = policies.document().endpoint(&settings.endpoint) {
        for d in crate::explain::endpoint_warnings(
            &file,
            &loaded.diagnostics,
            policies.document(),
            doc_endpoint,
        ) {
            let mut line = String::new();
            output::push_diagnostic_line(&mut line, &file, d);
            output::note(format_args!("{}", line.trim_end_matches('\n')));
        }
    }
    let report = if std::io::stderr().is_terminal() {
        with_progress(|progress| {
            retryplane_sim::simulate_watched(
                &endpoint.name,
                &endpoint.policy,
                &settings.config,
                progress,
            )
        })
    } else {
        retryplane_sim::simulate(&endpoint.name, &endpoint.policy, &settings.config)
    }?;
    if let Some(path) = &settings.plot {
        let svg = retryplane_sim::plot::svg(&report)?;
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
        output::note(format_args!("wrote {}", path.display()));
    }
    let stdout = match settings.format {
        Format::Text => report.to_text(),
        Format::Json => report
            .to_json()
            .context("cannot render the report as JSON")?,
    };
    Ok(Report {
        stdout,
        outcome: Outcome::Success,
    })
}
