//! `retryplane-bench-admin`: how long an admin's `apply` takes while `viewer` tokens' Validate
//! calls flood the admin service, against the same `apply` on a quiet server in the same run.
//!
//! # What it measures
//!
//! The real `retryplane serve --api` runs as a separate process (a temp data dir, a tokens file
//! with one `admin` and one `viewer` token, every listener on `127.0.0.1:0`). For each of `K`
//! pairs it runs two phases, quiet first:
//!
//! - **quiet**: `A` Apply calls one after another with the admin token, each a new version of
//!   a policy of `E` endpoints (one `defaults` field differs per call), each timed from the call
//!   to its answer; then `P` **probes**: Validate calls of a policy of the same size with the
//!   viewer token, timed the same way;
//! - **flood**: `V` viewer tasks, each on its own HTTP/2 connection, call Validate with a
//!   policy of `F` endpoints (YAML, about 285 bytes an endpoint) in a loop. Once every viewer
//!   has had one answer, the same Apply calls and probes are timed; then the viewers stop,
//!   each once its call in flight is answered (the server would go on checking a dropped
//!   call's policy into the next quiet phase).
//!
//! The server keeps one check turn, one decode turn and room for one message read ahead for
//! changes by callers who may make them (README, "Limits"). The defaults (100 viewers of an
//! 838 KiB message) hold more than the server's read-ahead room (64 MiB), so all three are
//! used; the bench says how much the flood holds. A viewer's call gets none of them,
//! so the probes are the same-run contrast: they wait in the queue an Apply would wait in
//! without the kept turns. The figures to read are the ratios of each phase's times, flood ÷
//! quiet, in the same pair. It also reports the viewers' Validate calls answered during the
//! timed flood and the server's CPU time per phase (`/proc/<pid>/stat`), and fails the run
//! when a viewer's call was refused (a flood of quick refusals is another load). The viewers
//! run in this process, on the same cores as the server.
//!
//! ```sh
//! cargo build --release -p retryplane-cli -p retryplane-bench
//! target/release/retryplane-bench-admin --viewers 100 --flood-endpoints 3000 --applies 20 --probes 3 --pairs 3
//! ```

#![forbid(unsafe_code)]

mod percentile;
mod policy;
// Shared with the other benches; this one uses neither the agent listener nor `/metrics`.
#[allow(dead_code)]
mod server;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use retryplane_proto::pb::{self, admin_service_client::AdminServiceClient, policy_source};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use retryplane_server::decode_turns::READ_AHEAD_BYTES;

use crate::percentile::percentile;
use crate::server::ServerProcess;

/// The bound on any single wait: server start, a connection, a call, the viewers' first
/// answers, their stop.
pub const WAIT: Duration = Duration::from_secs(60);

const ADMIN_SECRET: &str = "bench-admin-secret-0123456789";
const VIEWER_SECRET: &str = "bench-viewer-secret-0123456789";

/// An admin's Apply under a flood of viewers' Validate calls, against a quiet server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Viewer tasks calling Validate in a loop during the flood, each on its own connection.
    #[arg(long, default_value_t = 100)]
    viewers: usize,
    /// Endpoints in the policy the viewers validate.
    #[arg(long, default_value_t = 3_000)]
    flood_endpoints: usize,
    /// Endpoints in the policies the admin applies.
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    /// Apply calls timed in each phase.
    #[arg(long, default_value_t = 20)]
    applies: usize,
    /// Validate calls of the applied policy with the viewer token, timed after the Apply
    /// calls of each phase: the same-run contrast, as a viewer's call gets no kept turn.
    #[arg(long, default_value_t = 3)]
    probes: usize,
    /// Pairs of phases (quiet, then flood).
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// The `retryplane` binary (default: the one beside this executable).
    #[arg(long)]
    server_bin: Option<PathBuf>,
}

/// What puts a token's secret on every call of a [`Client`].
#[derive(Clone)]
struct Bearer(MetadataValue<Ascii>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// An admin client whose calls carry a token's secret.
type Client = AdminServiceClient<InterceptedService<Channel, Bearer>>;

async fn client(addr: std::net::SocketAddr, secret: &str) -> anyhow::Result<Client> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .context("bad admin address")?
        .connect_timeout(WAIT)
        .timeout(WAIT)
        .tcp_nodelay(true);
    let channel = tokio::time::timeout(WAIT, endpoint.connect())
        .await
        .with_context(|| format!("admin {addr}: no answer within {WAIT:?}"))?
        .with_context(|| format!("cannot connect to the admin listener {addr}"))?;
    let bearer = format!("Bearer {secret}")
        .parse()
        .context("a secret that is no header value")?;
    Ok(
        AdminServiceClient::with_interceptor(channel, Bearer(bearer))
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20),
    )
}

fn yaml_source(yaml: String) -> Option<pb::PolicySource> {
    Some(pb::PolicySource {
        kind: Some(policy_source::Kind::Yaml(yaml)),
        origin: "retryplane-bench".to_owned(),
    })
}

/// The nearest-rank `q` quantile of `times` ([`percentile()`] of a copy).
fn quantile(times: &[f64], q: f64) -> f64 {
    percentile(&mut times.to_vec(), q)
}

/// The answer to `call` (bounded by [`WAIT`]) and how long it took, in milliseconds; `what`
/// names the call in errors.
async fn timed<T>(
    what: &str,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<(T, f64)> {
    let t0 = Instant::now();
    let answer = tokio::time::timeout(WAIT, call)
        .await
        .with_context(|| format!("{what} took more than {WAIT:?}"))?
        .with_context(|| format!("{what} failed"))?
        .into_inner();
    Ok((answer, t0.elapsed().as_secs_f64() * 1e3))
}

/// Times `count` Apply calls from round `*round` on, each a new version; milliseconds each.
async fn applies(
    admin: &mut Client,
    endpoints: usize,
    count: usize,
    round: &mut u64,
) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        *round += 1;
        let request = pb::ApplyRequest {
            source: yaml_source(policy::policy_yaml(endpoints, *round)),
            ..Default::default()
        };
        let (answer, ms) = timed("an Apply", admin.apply(request)).await?;
        times.push(ms);
        if !answer.changed {
            bail!("Apply {round} stored no new version");
        }
    }
    Ok(times)
}

/// What the viewers saw during a flood.
#[derive(Default)]
struct Flood {
    answered: AtomicU64,
    /// Refusals by gRPC code.
    refused: std::sync::Mutex<BTreeMap<String, u64>>,
}

/// One viewer: Validate of `source` in a loop until `stop`; `started` counts the viewers that
/// had an answer. A call in flight when `stop` comes is finished, not dropped: the server
/// would go on checking a dropped call's policy, into the next quiet phase.
async fn viewer(
    mut client: Client,
    source: Option<pb::PolicySource>,
    flood: Arc<Flood>,
    started: Arc<(AtomicU64, Notify)>,
    stop: watch::Receiver<bool>,
) {
    let mut first = true;
    while !*stop.borrow() {
        let answer = client
            .validate(pb::ValidateRequest {
                source: source.clone(),
            })
            .await;
        match answer {
            Ok(_) => {
                flood.answered.fetch_add(1, Ordering::Relaxed);
            }
            Err(status) => {
                let mut refused = flood
                    .refused
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                *refused.entry(format!("{:?}", status.code())).or_default() += 1;
            }
        }
        if std::mem::take(&mut first) {
            started.0.fetch_add(1, Ordering::SeqCst);
            started.1.notify_one();
        }
    }
}

/// Times `count` Validate calls of `source` one after another; milliseconds each.
async fn probes(
    client: &mut Client,
    source: &Option<pb::PolicySource>,
    count: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        let request = pb::ValidateRequest {
            source: source.clone(),
        };
        let (answer, ms) = timed("a probe's Validate", client.validate(request)).await?;
        times.push(ms);
        if !answer.valid {
            bail!("the probe's policy is invalid");
        }
    }
    Ok(times)
}

/// One phase's figures: Apply and probe times (ms), server CPU as a share of a core.
struct Phase {
    applies: Vec<f64>,
    probes: Vec<f64>,
    server_cpu: f64,
}

impl Phase {
    fn line(&self) -> String {
        format!(
            "apply p50 {:.1} ms, max {:.1} ms; probe p50 {:.1} ms, max {:.1} ms; server CPU \
             {:.0}% of a core",
            quantile(&self.applies, 0.5),
            quantile(&self.applies, 1.0),
            quantile(&self.probes, 0.5),
            quantile(&self.probes, 1.0),
            self.server_cpu * 100.0,
        )
    }
}

/// The Apply calls, then the probes, with the server's CPU time over both.
async fn phase(
    server: &ServerProcess,
    admin: &mut Client,
    probe: &mut Client,
    cli: &Cli,
    probe_source: &Option<pb::PolicySource>,
    round: &mut u64,
) -> anyhow::Result<Phase> {
    let cpu0 = server.cpu_ms()?;
    let t0 = Instant::now();
    let applies = applies(admin, cli.endpoints, cli.applies, round).await?;
    let probes = probes(probe, probe_source, cli.probes).await?;
    let server_cpu = (server.cpu_ms()? - cpu0) / 1e3 / t0.elapsed().as_secs_f64();
    Ok(Phase {
        applies,
        probes,
        server_cpu,
    })
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if cli.applies == 0 || cli.pairs == 0 || cli.viewers == 0 || cli.probes == 0 {
        bail!("--applies, --probes, --pairs and --viewers must be at least 1");
    }
    let bin = server::server_binary(cli.server_bin.clone(), "retryplane", "--server-bin")?;
    let seed = policy::policy_yaml(cli.endpoints, 0);
    policy::check(&seed, cli.endpoints)?;
    let flood_yaml = policy::policy_yaml(cli.flood_endpoints, 0);
    policy::check(&flood_yaml, cli.flood_endpoints)?;
    let tokens = format!(
        "tokens:\n  - {{name: bench-admin, role: admin, secret: {ADMIN_SECRET}}}\n  \
         - {{name: bench-viewer, role: viewer, secret: {VIEWER_SECRET}}}\n"
    );
    let server = ServerProcess::start_with_tokens(&bin, &seed, Some(&tokens)).await?;
    let mut admin = client(server.admin_addr, ADMIN_SECRET).await?;
    // Checked once, so that a flood that only gets refusals is not measured as one.
    let mut probe = client(server.admin_addr, VIEWER_SECRET).await?;
    let checked = probe
        .validate(pb::ValidateRequest {
            source: yaml_source(flood_yaml.clone()),
        })
        .await
        .context("the viewer's Validate failed")?
        .into_inner();
    if !checked.valid {
        bail!("the server finds the flood's policy invalid");
    }
    let held = cli.viewers * flood_yaml.len();
    println!(
        "a phase: {} Apply calls of {} endpoints (admin), then {} Validate probes of the same \
         size (viewer); flood: {} viewers validating {} endpoints ({} KiB of YAML: {} MiB in \
         all, {} the server's read-ahead room of {} MiB); {} pairs",
        cli.applies,
        cli.endpoints,
        cli.probes,
        cli.viewers,
        cli.flood_endpoints,
        flood_yaml.len() / 1024,
        held >> 20,
        if held > READ_AHEAD_BYTES {
            "over"
        } else {
            "within"
        },
        READ_AHEAD_BYTES >> 20,
        cli.pairs
    );
    let probe_source = yaml_source(policy::policy_yaml(cli.endpoints, 0));
    let mut round = 0;
    let mut ratios = Vec::with_capacity(cli.pairs);
    for pair in 1..=cli.pairs {
        let quiet = phase(
            &server,
            &mut admin,
            &mut probe,
            &cli,
            &probe_source,
            &mut round,
        )
        .await?;

        let flood = Arc::new(Flood::default());
        let started = Arc::new((AtomicU64::new(0), Notify::new()));
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut viewers = JoinSet::new();
        for _ in 0..cli.viewers {
            let client = client(server.admin_addr, VIEWER_SECRET).await?;
            viewers.spawn(viewer(
                client,
                yaml_source(flood_yaml.clone()),
                flood.clone(),
                started.clone(),
                stop_rx.clone(),
            ));
        }
        let want = cli.viewers as u64;
        tokio::time::timeout(WAIT, async {
            while started.0.load(Ordering::SeqCst) < want {
                started.1.notified().await;
            }
        })
        .await
        .with_context(|| {
            format!(
                "{} of {want} viewers had an answer within {WAIT:?}",
                started.0.load(Ordering::SeqCst)
            )
        })?;
        let answered0 = flood.answered.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let flooded = phase(
            &server,
            &mut admin,
            &mut probe,
            &cli,
            &probe_source,
            &mut round,
        )
        .await;
        let answered = flood.answered.load(Ordering::Relaxed) - answered0;
        let flood_wall = t0.elapsed().as_secs_f64();
        stop_tx.send_replace(true);
        tokio::time::timeout(WAIT, async { while viewers.join_next().await.is_some() {} })
            .await
            .context("the viewers did not finish their last calls in time")?;
        let flooded = flooded?;

        let refused = flood
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let ratio =
            |f: fn(&Phase) -> &Vec<f64>, q: f64| quantile(f(&flooded), q) / quantile(f(&quiet), q);
        let r = [
            ratio(|p| &p.applies, 0.5),
            ratio(|p| &p.applies, 1.0),
            ratio(|p| &p.probes, 0.5),
            ratio(|p| &p.probes, 1.0),
        ];
        #[allow(clippy::cast_precision_loss)]
        let per_second = answered as f64 / flood_wall;
        println!("pair {pair}, quiet: {}", quiet.line());
        println!(
            "pair {pair}, flood: {}; {answered} of the viewers' Validate calls answered \
             meanwhile ({per_second:.1}/s), {} refused during the flood",
            flooded.line(),
            refused.values().sum::<u64>()
        );
        println!(
            "pair {pair}, flood ÷ quiet: apply p50 {:.2}×, max {:.2}×; probe p50 {:.0}×, max \
             {:.0}×",
            r[0], r[1], r[2], r[3]
        );
        // A flood of quick refusals is another load: the figures would not say what they claim.
        if !refused.is_empty() {
            bail!(
                "pair {pair}: the viewers' Validate calls were refused during the flood \
                 ({refused:?}); the server's log:\n{}",
                server.log_tail()
            );
        }
        if answered == 0 {
            bail!("pair {pair}: no viewer's Validate call was answered while the flood was timed");
        }
        ratios.push(r);
    }
    let range = |i: usize| {
        ratios
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(r[i]), hi.max(r[i])))
    };
    let [(a50l, a50h), (amaxl, amaxh), (p50l, p50h), (pmaxl, pmaxh)] =
        [range(0), range(1), range(2), range(3)];
    println!(
        "flood ÷ quiet over {} pairs: apply p50 {a50l:.2}–{a50h:.2}×, max {amaxl:.2}–{amaxh:.2}×; \
         probe p50 {p50l:.0}–{p50h:.0}×, max {pmaxl:.0}–{pmaxh:.0}×",
        cli.pairs
    );
    server.stop().await
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("retryplane-bench-admin: {e:#}");
            ExitCode::FAILURE
        }
    }
}
