//! `retryplane-bench-inbound`: what agents' messages under way make the control plane hold when
//! one agent token's streams each send most of the largest message and stop, with the shared
//! room for messages under way (`serve --max-inbound-mib`, default 256) against a room too large
//! to bind (the baseline, the same binary in the same run).
//!
//! # What it measures
//!
//! The real `retryplane serve --api` runs as a separate process (a temp data dir, a tokens file
//! with one `agent` token, every listener on `127.0.0.1:0`). For each of `K` pairs it runs two
//! phases, the baseline first: `C` HTTP/2 connections of `S` agent streams each, all with the
//! one token; each stream sends a Hello (a distinct agent id), then a gRPC message header
//! announcing just under the agent stream's message limit
//! ([`retryplane_proto::MAX_AGENT_MESSAGE_BYTES`]) and `B` bytes of that message, as HTTP/2
//! flow control lets it, and never the rest. Once every stream has sent its bytes or been
//! ended, and the server's held bytes have settled, it reads the server's resident memory at
//! its peak (`VmHWM`) and now (`VmRSS`), `retryplane_server_inbound_held_bytes` and
//! `retryplane_server_inbound_refused_total`, and checks that an honest agent (the same token,
//! another id) still gets its Snapshot. The figures to read are the ratios, room ÷ baseline,
//! of the peak and of the growth over the server's memory before the streams, in the same
//! pair. The streams run in this process, on the same cores as the server.
//!
//! ```sh
//! cargo build --release -p retryplane-cli -p retryplane-bench
//! target/release/retryplane-bench-inbound --connections 10 --streams 100 --send-bytes 1000000 --pairs 3
//! ```

#![forbid(unsafe_code)]

mod percentile;
// Shared with the other benches; this one only writes the seed policy.
#[allow(dead_code)]
mod policy;
// Shared with the other benches; this one uses neither the admin listener nor the CPU times.
#[allow(dead_code)]
mod server;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Parser;
use prost::Message as _;
use retryplane_proto::pb;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::percentile::percentile;
use crate::server::ServerProcess;

/// The bound on any single wait: server start, a connection, the streams' sending, an answer.
pub const WAIT: Duration = Duration::from_secs(60);

const AGENT_SECRET: &str = "bench-agent-secret-0123456789";

/// Agents' messages under way, held by one token's streams, with and without the shared room.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// HTTP/2 connections the streams are spread over.
    #[arg(long, default_value_t = 10)]
    connections: usize,
    /// Agent streams on each connection.
    #[arg(long, default_value_t = 100)]
    streams: usize,
    /// Bytes of its message each stream sends (under the message limit, about 1.06 MiB).
    #[arg(long, default_value_t = 1_000_000)]
    send_bytes: usize,
    /// Baseline and room phases, alternated.
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// The room in MiB of the baseline phase: more than the streams can send.
    #[arg(long, default_value_t = 65_536)]
    baseline_room_mib: usize,
    /// The `retryplane` binary (default: the one beside this executable).
    #[arg(long)]
    server_bin: Option<PathBuf>,
}

/// What one phase saw.
#[derive(Debug)]
struct Phase {
    /// `--max-inbound-mib`, `None` for the server's default.
    room_mib: Option<usize>,
    before_kib: u64,
    peak_kib: u64,
    now_kib: u64,
    held_bytes: f64,
    refused: f64,
    /// Streams the server had not ended when the figures were read.
    kept: u64,
    /// Streams the server ended (with any status) before or after their bytes.
    ended: u64,
}

/// How far the streams of a phase got.
#[derive(Debug, Default)]
struct Tally {
    /// Streams done sending: all their bytes sent, or sending failed.
    done: AtomicU64,
    /// Streams whose response ended (trailers, a reset, or the connection's end).
    ended: AtomicU64,
}

/// A gRPC-framed `AgentMessage`.
fn framed(message: &pb::AgentMessage) -> Bytes {
    let body = message.encode_to_vec();
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(0);
    out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// A Hello of the agent `id`.
fn hello(id: &str) -> Bytes {
    framed(&pb::AgentMessage {
        kind: Some(pb::agent_message::Kind::Hello(pb::Hello {
            agent_id: id.to_owned(),
            service: "bench".to_owned(),
            agent_version: "bench".to_owned(),
            ..Default::default()
        })),
    })
}

/// The head of an agent stream with the bench's token.
fn connect_request() -> anyhow::Result<http::Request<()>> {
    http::Request::builder()
        .method("POST")
        .uri("http://bench/retryplane.v1.AgentService/Connect")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {AGENT_SECRET}"))
        .body(())
        .context("cannot build the stream's head")
}

/// An HTTP/2 connection to `addr`, driven in the background until `set` is dropped.
async fn connection(
    addr: std::net::SocketAddr,
    set: &mut JoinSet<()>,
) -> anyhow::Result<h2::client::SendRequest<Bytes>> {
    let tcp = tokio::time::timeout(WAIT, tokio::net::TcpStream::connect(addr))
        .await
        .context("no connection within the wait")?
        .context("cannot connect to the agent listener")?;
    tcp.set_nodelay(true)?;
    let handshake = h2::client::Builder::new()
        .initial_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        .handshake::<_, Bytes>(tcp);
    let (send, conn) = tokio::time::timeout(WAIT, handshake)
        .await
        .context("no HTTP/2 handshake within the wait")?
        .context("HTTP/2 handshake")?;
    set.spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

/// Sends `data` on `tx` as flow control allows it, in frames of at most 16 KiB.
async fn send_all(tx: &mut h2::SendStream<Bytes>, mut data: Bytes) -> Result<(), h2::Error> {
    while !data.is_empty() {
        tx.reserve_capacity(data.len().min(64 * 1024));
        let capacity = match tx.capacity() {
            0 => match std::future::poll_fn(|cx| tx.poll_capacity(cx)).await {
                Some(capacity) => capacity?,
                None => return Err(h2::Error::from(h2::Reason::CANCEL)),
            },
            capacity => capacity,
        };
        if capacity == 0 {
            continue;
        }
        let chunk = data.split_to(capacity.min(data.len()).min(16 * 1024));
        tx.send_data(chunk, false)?;
    }
    Ok(())
}

/// One stream: a Hello as `id`, then `send` bytes of a message announced at `announce`, held
/// open until the phase aborts the task; beside it, its response drained and its end counted.
async fn flood_stream(
    mut send: h2::client::SendRequest<Bytes>,
    id: String,
    announce: u32,
    send_bytes: usize,
    tally: Arc<Tally>,
) {
    let Ok(opened) = async {
        send = send.ready().await?;
        Ok::<_, anyhow::Error>(send.send_request(connect_request()?, false)?)
    }
    .await
    else {
        tally.done.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let (response, mut tx) = opened;
    let sending = async {
        let sent = async {
            send_all(&mut tx, hello(&id)).await?;
            let mut message = Vec::with_capacity(5 + send_bytes);
            message.push(0);
            message.extend_from_slice(&announce.to_be_bytes());
            message.resize(5 + send_bytes, 0);
            send_all(&mut tx, Bytes::from(message)).await
        };
        let _ = sent.await;
        tally.done.fetch_add(1, Ordering::Relaxed);
        // Never finished: `tx` stays alive until the phase aborts this task.
        std::future::pending::<()>().await;
    };
    let receiving = async {
        if let Ok(response) = response.await {
            let mut body = response.into_body();
            while let Some(Ok(data)) = body.data().await {
                let _ = body.flow_control().release_capacity(data.len());
            }
            let _ = body.trailers().await;
        }
        tally.ended.fetch_add(1, Ordering::Relaxed);
    };
    tokio::join!(sending, receiving);
}

/// Whether an agent of the bench's token, `id`, gets its first message (the Snapshot) within
/// the wait.
async fn honest_agent(addr: std::net::SocketAddr, id: &str) -> anyhow::Result<bool> {
    let mut set = JoinSet::new();
    let send = connection(addr, &mut set).await?;
    let first = async {
        let mut send = send.ready().await?;
        let (response, mut tx) = send.send_request(connect_request()?, false)?;
        send_all(&mut tx, hello(id)).await?;
        let mut body = response.await?.into_body();
        let mut got = 0;
        while got < 5 {
            match body.data().await {
                Some(data) => got += data?.len(),
                None => return Ok::<_, anyhow::Error>(false),
            }
        }
        Ok(true)
    };
    tokio::time::timeout(WAIT, first).await.unwrap_or(Ok(false))
}

/// A phase: the server with `room_mib` (`None`: its default), the streams, the figures.
async fn phase(cli: &Cli, bin: &std::path::Path, room_mib: Option<usize>) -> anyhow::Result<Phase> {
    let tokens = format!("tokens:\n  - {{name: fleet, role: agent, secret: {AGENT_SECRET}}}\n");
    let room = room_mib.map(|mib| mib.to_string());
    let mut args = vec![
        "--max-agents".to_owned(),
        (cli.connections * cli.streams + 16).to_string(),
    ];
    if let Some(room) = room {
        args.extend(["--max-inbound-mib".to_owned(), room]);
    }
    let server =
        ServerProcess::start_with(bin, &policy::policy_yaml(10, 1), Some(&tokens), &args).await?;
    let before_kib = server.rss_kib()?;
    let announce =
        u32::try_from(retryplane_proto::MAX_AGENT_MESSAGE_BYTES - 64).unwrap_or(u32::MAX);
    anyhow::ensure!(
        cli.send_bytes < announce as usize,
        "--send-bytes must be under the message announced ({announce} bytes)"
    );
    let tally = Arc::new(Tally::default());
    let mut connections = JoinSet::new();
    let mut streams = JoinSet::new();
    for c in 0..cli.connections {
        let send = connection(server.agent_addr, &mut connections).await?;
        for s in 0..cli.streams {
            streams.spawn(flood_stream(
                send.clone(),
                format!("bench-{c}-{s}"),
                announce,
                cli.send_bytes,
                tally.clone(),
            ));
        }
    }
    let total = u64::try_from(cli.connections * cli.streams).unwrap_or(u64::MAX);
    let deadline = Instant::now() + WAIT;
    while tally.done.load(Ordering::Relaxed) < total {
        if Instant::now() >= deadline {
            bail!(
                "{} of {total} streams done sending within {WAIT:?}",
                tally.done.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The server reads what came: wait until its held bytes stop moving (bounded).
    let mut held_bytes = server
        .metric("retryplane_server_inbound_held_bytes")
        .await?;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = server
            .metric("retryplane_server_inbound_held_bytes")
            .await?;
        if now == held_bytes {
            break;
        }
        held_bytes = now;
    }
    let honest = honest_agent(server.agent_addr, "bench-honest").await?;
    let figures = Phase {
        room_mib,
        before_kib,
        peak_kib: server.peak_rss_kib()?,
        now_kib: server.rss_kib()?,
        held_bytes,
        refused: server
            .metric("retryplane_server_inbound_refused_total")
            .await?,
        kept: total.saturating_sub(tally.ended.load(Ordering::Relaxed)),
        ended: tally.ended.load(Ordering::Relaxed),
    };
    anyhow::ensure!(
        honest,
        "an honest agent got no Snapshot while the streams held their messages; the server's log:\n{}",
        server.log_tail()
    );
    streams.abort_all();
    drop(connections);
    server.stop().await?;
    Ok(figures)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let bin = server::server_binary(cli.server_bin.clone(), "retryplane", "--server-bin")?;
    println!(
        "{} connections x {} streams of one agent token, each a Hello and {} bytes of a message \
         it never finishes; baseline room {} MiB, then the default room",
        cli.connections, cli.streams, cli.send_bytes, cli.baseline_room_mib
    );
    println!(
        "{:>4}  {:>14}  {:>10}  {:>9}  {:>9}  {:>9}  {:>8}  {:>6}  {:>6}",
        "pair", "room", "before MiB", "peak MiB", "now MiB", "held MiB", "refused", "kept", "ended"
    );
    let mut peak_ratios = Vec::new();
    let mut growth_ratios = Vec::new();
    for pair in 1..=cli.pairs {
        let mut phases = Vec::new();
        for room in [Some(cli.baseline_room_mib), None] {
            let p = phase(&cli, &bin, room).await?;
            println!(
                "{pair:>4}  {:>14}  {:>10.1}  {:>9.1}  {:>9.1}  {:>9.1}  {:>8}  {:>6}  {:>6}",
                p.room_mib
                    .map_or("default".to_owned(), |m| format!("{m} MiB")),
                mib(p.before_kib),
                mib(p.peak_kib),
                mib(p.now_kib),
                p.held_bytes / 1_048_576.0,
                p.refused,
                p.kept,
                p.ended,
            );
            phases.push(p);
        }
        if let [baseline, room] = phases.as_slice() {
            peak_ratios.push(room.peak_kib as f64 / baseline.peak_kib.max(1) as f64);
            growth_ratios.push(
                room.peak_kib.saturating_sub(room.before_kib) as f64
                    / baseline.peak_kib.saturating_sub(baseline.before_kib).max(1) as f64,
            );
        }
    }
    let show = |ratios: &[f64]| {
        ratios
            .iter()
            .map(|r| format!("{r:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "peak, room / baseline: {} (median {:.3})",
        show(&peak_ratios),
        percentile(&mut peak_ratios.clone(), 0.5)
    );
    println!(
        "growth over the start, room / baseline: {} (median {:.3})",
        show(&growth_ratios),
        percentile(&mut growth_ratios.clone(), 0.5)
    );
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("retryplane-bench-inbound: {e:#}");
            ExitCode::FAILURE
        }
    }
}
