//! `retryplane-bench-plain-server`: the "plain tonic fan-out" that `retryplane-bench-fanout
//! --baseline` measures in the same run as `retryplane serve`, so the control plane's figures
//! can be read as ratios against it.
//!
//! # What "plain tonic" means here
//!
//! The straightforward way to write a snapshot fan-out with tonic, and none of the control
//! plane's own work:
//!
//! - the generated `AgentServiceServer` and `AdminServiceServer` with the prost codec, on
//!   default tonic `Server` settings and a default `#[tokio::main]` multi-thread runtime;
//! - `Connect` reads the first message (Hello, else INVALID_ARGUMENT), then spawns one task per
//!   stream. The task holds a `watch::Receiver` of the current snapshot message and sends every
//!   new one into an `mpsc` channel whose `ReceiverStream` is the response stream; it also reads
//!   the agent's messages, counts ACKs and ignores everything else. A gauge counts the streams
//!   past their Hello;
//! - `Apply` parses, validates and converts the YAML with the same library calls as the real
//!   server (`retryplane_policy::load`, `PolicyDocument` → `pb::PolicyDocument` and
//!   `content_hash`; until 2026-12-02 both also validated the wire form a second time with
//!   `retryplane_proto::convert::validate`), refuses a stale
//!   `expected_version` (ABORTED), answers a dry run without publishing, and otherwise bumps the
//!   version, builds the snapshot message as the real publisher does (a `pb::Snapshot` in
//!   `pb::ServerMessage::with_snapshot`) and `send_replace`s it into the watch. `Get` answers the
//!   current version. Every other admin RPC is UNIMPLEMENTED;
//! - nothing durable (no store, no history), no diff, no auth, no fleet table, no limits, no
//!   metrics aggregation, no keepalive, no resumption (every stream gets the current snapshot
//!   first), no nonce matching (every ACK counts).
//!
//! Each stream encodes the snapshot itself, as a server written with a generated
//! `ServerMessage { oneof kind { Snapshot snapshot = 1; … } }` would: the watch holds the
//! `pb::Snapshot`, and each stream's task builds its message with
//! `pb::ServerMessage::with_snapshot` (an encode of the whole snapshot, policies included), which
//! the stream's prost codec then copies into its own frame buffer. (`pb::ServerMessage` keeps
//! its snapshot as encoded bytes, see `retryplane-proto`'s `frame`; that is the control plane's
//! own encode-once path, which this baseline leaves out on purpose: it is the "per-stream
//! encode" the issue's plain tonic fan-out figures describe.) Encoding into a `Vec` that the
//! codec then copies is one snapshot-sized allocation and copy per stream more than a generated
//! oneof would make: at 76 KiB and 1,000 streams, about 76 MB of copying per push, a few ms of
//! the several hundred ms of CPU a push costs this server. `Apply` parses on the runtime's
//! worker, as a handler written plainly would (the real server moves it to a blocking thread;
//! no push is in flight while it runs in the bench). What the real server adds over this is
//! the encode-once framing, the store, the diff, the fleet and the limits above.
//!
//! A small HTTP/1.1 listener answers `GET /readyz` (200 once a snapshot is published) and
//! `GET /metrics` with the samples the bench reads, `retryplane_server_agents_connected`,
//! `retryplane_server_acks_total` and `retryplane_server_last_publish_timestamp_seconds` (set
//! as the snapshot is put in the watch), each response with `Connection: close`.
//!
//! The command line is `retryplane serve`'s as the bench starts it: `serve --api --config FILE
//! --data-dir DIR --listen ADDR --admin-listen ADDR --http-listen ADDR` (`--api` and
//! `--data-dir` are accepted and ignored: this server is always in API mode and keeps nothing).
//! The config file is published as version 1 at start; then the bound addresses are printed as
//! `agent: ADDR`, `admin: ADDR`, `http: ADDR` lines, and the server serves until killed.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use http_body_util::Full;
use hyper::body::Bytes;
use retryplane_proto::convert;
use retryplane_proto::pb::{
    self, admin_service_server::AdminService, admin_service_server::AdminServiceServer,
    agent_message::Kind, agent_service_server::AgentService,
    agent_service_server::AgentServiceServer, policy_source,
};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// Snapshot messages queued per stream before its task waits.
const STREAM_QUEUE: usize = 4;
/// How long a new stream may take to send Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// `Snapshot.metrics_interval_ms`: `retryplane serve`'s default `--metrics-interval`.
const METRICS_INTERVAL_MS: u64 = 10_000;

/// A plain tonic snapshot fan-out with `retryplane serve`'s command line (for the fan-out
/// benchmark's same-run baseline).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Load the config file as version 1 and serve it until killed.
    Serve(ServeArgs),
}

/// `retryplane serve`'s flags that the bench passes, with the same defaults.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Accepted for `retryplane serve` compatibility; this server is always in API mode.
    #[arg(long)]
    api: bool,
    /// The seed policy file, published as version 1.
    #[arg(long, value_name = "FILE", default_value = "config/policies.yaml")]
    config: PathBuf,
    /// Accepted and ignored: nothing is stored.
    #[arg(long, value_name = "DIR", default_value = "./data")]
    data_dir: PathBuf,
    /// Agent gRPC listener.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7470")]
    listen: SocketAddr,
    /// Admin gRPC listener.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7471")]
    admin_listen: SocketAddr,
    /// HTTP listener: /readyz, /metrics.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7472")]
    http_listen: SocketAddr,
}

/// What the services and the HTTP listener share.
#[derive(Debug)]
struct Shared {
    /// The published snapshot (version 0 until the first publish): what `Get` answers and what
    /// every stream encodes itself.
    current: watch::Sender<Arc<pb::Snapshot>>,
    /// One Apply at a time, so versions go up by one and `expected_version` is checked
    /// against what is then published.
    applying: Mutex<()>,
    /// Streams past their Hello whose task still runs.
    connected: AtomicU64,
    /// ACKs received on every stream.
    acks: AtomicU64,
    /// When the snapshot served was published, Unix time (`f64` bits; 0 before the first).
    published_at: AtomicU64,
    /// Makes the nonces of this process differ from another run's.
    instance: String,
}

impl Shared {
    fn new() -> Self {
        let (current, _) = watch::channel(Arc::new(pb::Snapshot::default()));
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Self {
            current,
            applying: Mutex::new(()),
            connected: AtomicU64::new(0),
            acks: AtomicU64::new(0),
            published_at: AtomicU64::new(0),
            instance: format!("{:08x}", nanos ^ std::process::id()),
        }
    }

    /// Parses, validates and (unless `dry_run`) publishes `yaml` as the next version.
    async fn apply(
        &self,
        yaml: &str,
        expected_version: u64,
        dry_run: bool,
    ) -> Result<pb::ApplyResponse, Status> {
        let _one_at_a_time = self.applying.lock().await;
        let loaded = retryplane_policy::load(yaml.as_bytes());
        let Some(set) = loaded.policies else {
            let lines: Vec<String> = loaded.diagnostics.iter().map(ToString::to_string).collect();
            return Err(Status::invalid_argument(lines.join("\n")));
        };
        // Validated once, as the real server does since 2026-12-02 (until then both converted the
        // wire document back and validated it a second time).
        let document = pb::PolicyDocument::from(set.document().as_ref());
        let current = self.current.borrow().clone();
        if expected_version != 0 && expected_version != current.version {
            return Err(Status::aborted(format!(
                "version conflict: expected version {expected_version} to be current, but it is {}",
                current.version
            )));
        }
        let content_hash = convert::content_hash(&document);
        if dry_run || content_hash == current.content_hash {
            return Ok(pb::ApplyResponse {
                version: current.version,
                content_hash: current.content_hash.clone(),
                changed: false,
                would_change: content_hash != current.content_hash,
                new_content_hash: content_hash,
                ..Default::default()
            });
        }
        let version = current.version + 1;
        let snapshot = pb::Snapshot {
            version,
            content_hash: content_hash.clone(),
            policies: Some(document),
            nonce: format!("{}-{version}", self.instance),
            metrics_interval_ms: METRICS_INTERVAL_MS,
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.published_at
            .store(now.as_secs_f64().to_bits(), Ordering::Relaxed);
        self.current.send_replace(Arc::new(snapshot));
        Ok(pb::ApplyResponse {
            version,
            new_content_hash: content_hash.clone(),
            content_hash,
            changed: true,
            would_change: true,
            ..Default::default()
        })
    }
}

/// The agent stream service.
struct Agents(Arc<Shared>);

/// Decrements the connected-streams gauge when a stream task ends, however it ends.
struct ConnectedGuard(Arc<Shared>);

impl Drop for ConnectedGuard {
    fn drop(&mut self) {
        self.0.connected.fetch_sub(1, Ordering::Relaxed);
    }
}

type Outbound = mpsc::Sender<Result<pb::ServerMessage, Status>>;

/// This stream's own encode of `snapshot` (see the module docs: no sharing across streams).
fn encode(snapshot: &pb::Snapshot) -> pb::ServerMessage {
    pb::ServerMessage::with_snapshot(snapshot)
}

/// One stream: the current snapshot, then every new one; ACKs counted until the agent goes.
async fn stream_task(
    guard: ConnectedGuard,
    mut snapshots: watch::Receiver<Arc<pb::Snapshot>>,
    mut inbound: Streaming<pb::AgentMessage>,
    outbound: Outbound,
) {
    let shared = guard.0.clone();
    let first = snapshots.borrow_and_update().clone();
    if outbound.send(Ok(encode(&first))).await.is_err() {
        return;
    }
    loop {
        tokio::select! {
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return;
                }
                let snapshot = snapshots.borrow_and_update().clone();
                if outbound.send(Ok(encode(&snapshot))).await.is_err() {
                    return;
                }
            }
            message = inbound.message() => match message {
                Ok(Some(pb::AgentMessage { kind: Some(Kind::Ack(_)) })) => {
                    shared.acks.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(_)) => {}
                // The agent closed its side or the stream broke: the task ends.
                Ok(None) | Err(_) => return,
            },
        }
    }
}

#[tonic::async_trait]
impl AgentService for Agents {
    type ConnectStream = ReceiverStream<Result<pb::ServerMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let mut inbound = request.into_inner();
        match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
            Ok(Ok(Some(pb::AgentMessage {
                kind: Some(Kind::Hello(_)),
            }))) => {}
            Ok(Ok(Some(_))) => {
                return Err(Status::invalid_argument(
                    "the first message on the stream must be Hello",
                ));
            }
            Ok(Ok(None)) => return Err(Status::cancelled("stream closed before Hello")),
            Ok(Err(status)) => return Err(status),
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "no Hello within {HELLO_TIMEOUT:?}"
                )));
            }
        }
        let (outbound, rx) = mpsc::channel(STREAM_QUEUE);
        self.0.connected.fetch_add(1, Ordering::Relaxed);
        let guard = ConnectedGuard(self.0.clone());
        tokio::spawn(stream_task(
            guard,
            self.0.current.subscribe(),
            inbound,
            outbound,
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The admin service: `Apply` and `Get`; the rest is unimplemented.
struct Admin(Arc<Shared>);

fn unimplemented<T>(rpc: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{rpc} is not part of the plain tonic baseline"
    )))
}

#[tonic::async_trait]
impl AdminService for Admin {
    async fn validate(
        &self,
        _: Request<pb::ValidateRequest>,
    ) -> Result<Response<pb::ValidateResponse>, Status> {
        unimplemented("Validate")
    }

    async fn apply(
        &self,
        request: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        let req = request.into_inner();
        let yaml = match req.source.and_then(|s| s.kind) {
            Some(policy_source::Kind::Yaml(yaml)) => yaml,
            Some(policy_source::Kind::Document(_)) => {
                return Err(Status::unimplemented(
                    "the plain tonic baseline applies YAML sources only",
                ));
            }
            None => return Err(Status::invalid_argument("source is required")),
        };
        self.0
            .apply(&yaml, req.expected_version.unwrap_or(0), req.dry_run)
            .await
            .map(Response::new)
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        let wanted = request.into_inner().version;
        let current = self.0.current.borrow().clone();
        if current.version == 0 {
            return Err(Status::not_found("no version is published yet"));
        }
        if wanted != 0 && wanted != current.version {
            return Err(Status::not_found(format!(
                "only the current version ({}) is kept",
                current.version
            )));
        }
        Ok(Response::new(pb::GetResponse {
            info: Some(pb::VersionInfo {
                version: current.version,
                content_hash: current.content_hash.clone(),
                source: "admin".to_owned(),
                ..Default::default()
            }),
            policies: current.policies.clone(),
            yaml: String::new(),
        }))
    }

    async fn history(
        &self,
        _: Request<pb::HistoryRequest>,
    ) -> Result<Response<pb::HistoryResponse>, Status> {
        unimplemented("History")
    }

    async fn rollback(
        &self,
        _: Request<pb::RollbackRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        unimplemented("Rollback")
    }

    async fn fleet_status(
        &self,
        _: Request<pb::FleetStatusRequest>,
    ) -> Result<Response<pb::FleetStatusResponse>, Status> {
        unimplemented("FleetStatus")
    }

    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        unimplemented("Stats")
    }
}

/// The HTTP answer to `path`: status and body.
fn http_answer(shared: &Shared, path: &str) -> (hyper::StatusCode, String) {
    match path {
        "/readyz" if shared.current.borrow().version > 0 => {
            (hyper::StatusCode::OK, "ready\n".to_owned())
        }
        "/readyz" => (
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "no snapshot yet\n".to_owned(),
        ),
        "/metrics" => (
            hyper::StatusCode::OK,
            format!(
                "retryplane_server_agents_connected {}\nretryplane_server_acks_total {}\n\
                 retryplane_server_last_publish_timestamp_seconds {}\n",
                shared.connected.load(Ordering::Relaxed),
                shared.acks.load(Ordering::Relaxed),
                f64::from_bits(shared.published_at.load(Ordering::Relaxed)),
            ),
        ),
        _ => (hyper::StatusCode::NOT_FOUND, "not found\n".to_owned()),
    }
}

/// Serves `/readyz` and `/metrics` over HTTP/1.1 with hyper (already in the build through
/// tonic), one task per connection, every response closing its connection.
async fn serve_http(listener: TcpListener, shared: Arc<Shared>) -> anyhow::Result<()> {
    loop {
        let (socket, _) = listener
            .accept()
            .await
            .context("the HTTP listener failed")?;
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<_>| {
                let (status, body) = if request.method() == hyper::Method::GET {
                    http_answer(&shared, request.uri().path())
                } else {
                    (
                        hyper::StatusCode::METHOD_NOT_ALLOWED,
                        "GET only\n".to_owned(),
                    )
                };
                let response = hyper::Response::builder()
                    .status(status)
                    .header(hyper::header::CONTENT_TYPE, "text/plain; version=0.0.4")
                    .header(hyper::header::CONNECTION, "close")
                    .body(Full::new(Bytes::from(body)));
                async move { response }
            });
            // A client that goes away mid-request is its own problem.
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(socket), service)
                .await;
        });
    }
}

/// Binds `addr`, with what the listener is for in the error.
async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot bind the {what} listener on {addr}"))
}

/// The gRPC listener's incoming connections as tonic's `serve(addr)` would accept them
/// (`Server::default()` sets `TCP_NODELAY`; `serve_with_incoming` leaves it to the incoming).
fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let seed = std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read the seed policy file {}", args.config.display()))?;
    let shared = Arc::new(Shared::new());
    shared
        .apply(&seed, 0, false)
        .await
        .map_err(|status| anyhow::anyhow!("{}", status.message()))
        .with_context(|| format!("the seed policy file {} is invalid", args.config.display()))?;

    let agent_listener = bind(args.listen, "agent").await?;
    let admin_listener = bind(args.admin_listen, "admin").await?;
    let http_listener = bind(args.http_listen, "HTTP").await?;
    let agent_addr = agent_listener
        .local_addr()
        .context("agent listener address")?;
    let admin_addr = admin_listener
        .local_addr()
        .context("admin listener address")?;
    let http_addr = http_listener
        .local_addr()
        .context("HTTP listener address")?;

    let agents = Server::builder()
        .add_service(AgentServiceServer::new(Agents(shared.clone())))
        .serve_with_incoming(incoming(agent_listener));
    let admin = Server::builder()
        .add_service(AdminServiceServer::new(Admin(shared.clone())))
        .serve_with_incoming(incoming(admin_listener));
    let http = serve_http(http_listener, shared);

    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "agent: {agent_addr}")
            .and_then(|()| writeln!(out, "admin: {admin_addr}"))
            .and_then(|()| writeln!(out, "http: {http_addr}"))
            .and_then(|()| out.flush())
            .context("cannot write to stdout")?;
    }
    tokio::select! {
        result = agents => result.context("the agent gRPC server stopped"),
        result = admin => result.context("the admin gRPC server stopped"),
        result = http => result,
    }?;
    anyhow::bail!("a listener stopped")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Command::Serve(args) = Cli::parse().command;
    serve(args).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(deadline_ms: u64) -> String {
        format!(
            "version: 1\ndefaults:\n  max_attempts: 3\n  deadline: {deadline_ms}ms\nendpoints:\n  \
             svc-a:\n    max_attempts: 2\n"
        )
    }

    #[test]
    fn the_command_line_is_the_one_the_bench_passes() {
        let cli = Cli::try_parse_from([
            "retryplane-bench-plain-server",
            "serve",
            "--api",
            "--config",
            "policies.yaml",
            "--data-dir",
            "data",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command;
        assert!(args.api);
        assert_eq!(args.config, PathBuf::from("policies.yaml"));
        assert_eq!(args.listen.port(), 0);
        assert!(
            Cli::try_parse_from(["retryplane-bench-plain-server", "serve", "--tokens", "t"])
                .is_err()
        );
    }

    #[tokio::test]
    async fn apply_publishes_new_content_once_and_checks_the_expected_version() {
        let shared = Shared::new();
        assert_eq!(
            http_answer(&shared, "/readyz").0,
            hyper::StatusCode::SERVICE_UNAVAILABLE
        );
        let mut seen = shared.current.subscribe();
        let first = shared.apply(&yaml(10_000), 0, false).await.unwrap();
        assert_eq!((first.version, first.changed), (1, true));
        assert!(seen.has_changed().unwrap());
        let sent = encode(&seen.borrow_and_update())
            .decode_snapshot()
            .unwrap()
            .unwrap();
        assert_eq!(sent.version, 1);
        assert_eq!(sent.content_hash, first.content_hash);
        assert_eq!(sent.policies.unwrap().endpoints.len(), 1);
        assert_eq!(http_answer(&shared, "/readyz").0, hyper::StatusCode::OK);

        // A dry run and the same content publish nothing.
        let dry = shared.apply(&yaml(20_000), 1, true).await.unwrap();
        assert_eq!((dry.version, dry.changed), (1, false));
        let same = shared.apply(&yaml(10_000), 0, false).await.unwrap();
        assert_eq!((same.version, same.changed), (1, false));
        assert!(!seen.has_changed().unwrap());

        // A stale expected version is refused; a current one publishes with a new nonce.
        let stale = shared.apply(&yaml(20_000), 7, false).await.unwrap_err();
        assert_eq!(stale.code(), tonic::Code::Aborted);
        let second = shared.apply(&yaml(20_000), 1, false).await.unwrap();
        assert_eq!((second.version, second.changed), (2, true));
        assert_ne!(second.content_hash, first.content_hash);
        let next = encode(&seen.borrow_and_update())
            .decode_snapshot()
            .unwrap()
            .unwrap();
        assert_eq!(next.version, 2);
        assert_ne!(next.nonce, sent.nonce);

        let invalid = shared.apply("endpoints: [", 0, false).await.unwrap_err();
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
        assert_eq!(shared.current.borrow().version, 2);
    }

    #[test]
    fn metrics_carry_the_samples_the_bench_reads() {
        let shared = Shared::new();
        shared.connected.store(3, Ordering::Relaxed);
        shared.acks.store(12, Ordering::Relaxed);
        shared
            .published_at
            .store(1_764_900_000.25_f64.to_bits(), Ordering::Relaxed);
        let (status, body) = http_answer(&shared, "/metrics");
        assert_eq!(status, hyper::StatusCode::OK);
        assert_eq!(
            body,
            "retryplane_server_agents_connected 3\nretryplane_server_acks_total 12\n\
             retryplane_server_last_publish_timestamp_seconds 1764900000.25\n"
        );
        assert_eq!(
            http_answer(&shared, "/nope").0,
            hyper::StatusCode::NOT_FOUND
        );
    }
}
