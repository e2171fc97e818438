//! `retryplane serve`: wires the store, the services, auth, the file watcher and shutdown.
//!
//! [`start`] does everything that can fail before serving — checks the listen addresses
//! against the tokens file, loads the tokens, binds the three listeners, opens the store under
//! the data directory, loads the policy file (file mode) or seeds an empty store (API mode) and
//! publishes the current version — and returns a [`Running`] server. The listeners are bound
//! before anything touches the data directory, so a start refused for a port in use changes
//! nothing on disk. The listeners:
//!
//! - the agent listener: `retryplane.v1.AgentService` (role `agent`), gRPC health and
//!   reflection;
//! - the admin listener: `retryplane.v1.AdminService` (role `admin`), health and reflection;
//! - the HTTP listener: `/healthz`, `/readyz`, `/metrics` ([`crate::http`]).
//!
//! Both gRPC listeners send HTTP/2 keepalive pings every [`ServeConfig::keepalive_interval`]
//! (default 20 s) and drop a peer that does not answer within
//! [`ServeConfig::keepalive_timeout`] (default 10 s) — an agent whose connection is dropped so
//! shows as disconnected — and set `TCP_NODELAY`. A connection that has carried no stream for
//! [`ServeConfig::connection_idle_timeout`] (default 5 min) is closed (`crate::conn_idle`).
//! Health on each listener reports its own service
//! (the other listener's is `NOT_FOUND` there) and the server as a whole (service `""`),
//! `NOT_SERVING` until a snapshot is published and from the start of shutdown. Port 0 binds a free port; [`Running`] tells which.
//!
//! [`Running::shutdown`] tells every agent stream to end with `UNAVAILABLE` ("reconnect"),
//! stops accepting, waits up to [`SHUTDOWN_GRACE`] for the servers to drain, closes the
//! connections still open then (`crate::preface::Connections`), and closes the store
//! (redb makes every commit durable; there is nothing else to flush). A gRPC connection that
//! has not sent the HTTP/2 preface half a second into the shutdown is closed then rather than
//! waited for (`crate::preface`).

use retryplane_policy::diag::LogPath;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use retryplane_proto::pb::admin_service_server::AdminServiceServer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::{Stream, StreamExt as _};
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::{error, info, warn};

use crate::admin::AdminApi;
use crate::agent_route::AgentRoute;
use crate::agent_stream::{AgentStreamService, StreamContext};
use crate::aggregate::{self, Aggregator};
use crate::auth::{Guard, Role, TokenSet, TokensError};
use crate::conn_idle::CountStreamsLayer;
use crate::control::{ControlPlane, Mode};
use crate::fleet::Fleet;
use crate::http::{HttpState, router};
use crate::metrics::ServerMetrics;
use crate::oversized::OversizedIsExhausted;
use crate::preface::{Connections, Preface};
use crate::publisher::Publisher;
use crate::store::{RedbStore, VersionStore};

mod boot;
mod config;
mod error;

pub use self::config::{MAX_METRICS_INTERVAL, MIN_METRICS_INTERVAL, ServeConfig};
use self::config::{check_exposure, check_settings};
pub use self::error::ServeError;

/// How long shutdown waits for the servers to drain before closing what is left.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long the end of a shutdown waits for the connections it closes to let go.
const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// How long a shutdown waits for a check of the store under way ([`Running::shutdown`]).
const STORE_CHECK_WAIT: Duration = Duration::from_secs(2);
/// The default HTTP/2 keepalive ping interval on the gRPC listeners
/// ([`ServeConfig::keepalive_interval`]).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// The default of how long a keepalive ping may go unanswered before the connection is
/// dropped ([`ServeConfig::keepalive_timeout`]).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// The default of [`ServeConfig::connection_idle_timeout`]: how long a gRPC connection may
/// carry no stream before it is closed.
pub const CONNECTION_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// The default of [`ServeConfig::max_streams_per_connection`].
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

const AGENT_SERVICE: &str = <AgentRoute as NamedService>::NAME;
const ADMIN_SERVICE: &str = <AdminServiceServer<AdminApi> as NamedService>::NAME;

/// A started server.
#[derive(Debug)]
pub struct Running {
    /// The bound agent listener address (the real port when 0 was asked for).
    pub agent_addr: SocketAddr,
    /// The bound admin listener address.
    pub admin_addr: SocketAddr,
    /// The bound HTTP listener address.
    pub http_addr: SocketAddr,
    control: Arc<ControlPlane>,
    shutdown: watch::Sender<bool>,
    health: Health,
    servers: JoinSet<Result<(), ServeError>>,
    background: Vec<JoinHandle<()>>,
    /// The store's checks (`crate::store_check`): waited for at shutdown, not aborted, since
    /// a check under way holds the store on a blocking thread that an abort does not stop.
    store_check: JoinHandle<()>,
    tokens: Option<Arc<TokenSet>>,
    /// In file mode, asks the policy file's watcher for a read.
    read_again: Option<crate::watch::ReadAgain>,
    /// The gRPC listeners' connections, closed at the end of the shutdown's grace.
    connections: Connections,
}

async fn bind(listener: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            listener,
            addr,
            source,
        })
}

fn local_addr(listener: &'static str, socket: &TcpListener) -> Result<SocketAddr, ServeError> {
    socket.local_addr().map_err(|source| ServeError::Bind {
        listener,
        addr: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        source,
    })
}

/// Resolves once `shutdown` is true or its sender is gone.
async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// How many streams a connection to the agent listener may open and give up before they are
/// accepted, before it is taken for an attack (h2's rapid-reset guard) and ended with
/// `GOAWAY`, every other stream on it with it. hyper's default (20, kept on the admin
/// listener) is below what an HTTP/2 proxy carrying many agents passes on at once (agents
/// giving up in a mass reconnect while the control plane is slow); a fixed number, not one
/// that grows with `--max-streams-per-connection`, since each step up lets a flood of
/// reset streams in larger bursts go on uncut.
pub const AGENT_PENDING_RESETS: usize = 64;

fn grpc_server(
    cfg: &ServeConfig,
    pending_resets: Option<usize>,
) -> Server<tower::layer::util::Stack<CountStreamsLayer, tower::layer::util::Identity>> {
    Server::builder()
        .http2_keepalive_interval(Some(cfg.keepalive_interval))
        .http2_keepalive_timeout(Some(cfg.keepalive_timeout))
        // tonic's default is no bound at all (it overrides hyper's 200).
        .max_concurrent_streams(cfg.max_streams_per_connection)
        .http2_max_pending_accept_reset_streams(pending_resets)
        .tcp_nodelay(true)
        // Each connection's open streams, so one that carries none for the idle timeout is
        // closed (see `crate::conn_idle`).
        .layer(CountStreamsLayer {
            max_call: cfg.connection_idle_timeout,
            guarded: cfg.tokens_file.is_some(),
        })
}

/// The connections of a gRPC listener, at most `max` at once (see [`crate::places`]), each one
/// closed at shutdown if it has not yet sent the HTTP/2 preface (see [`crate::preface`]), and
/// once idle (`guarded`: a tokens file is in force, see [`crate::conn_idle::NO_CALL_IDLE`]).
fn incoming(
    socket: TcpListener,
    max: usize,
    shutdown: &watch::Receiver<bool>,
    idle_after: Duration,
    guarded: bool,
    connections: &Connections,
) -> impl Stream<Item = io::Result<Preface<TcpStream>>> + use<> {
    let shutdown = shutdown.clone();
    let connections = connections.clone();
    let evictable = guarded.then(|| Arc::new(crate::places::Evictable::new(max)));
    let listed = evictable.clone();
    // The builder's tcp_nodelay does not apply to a listener we bound ourselves.
    crate::places::Capped::new(
        TcpIncoming::from(socket).with_nodelay(Some(true)),
        max,
        evictable,
    )
    .then(|accepted| async move {
        if let Err(e) = &accepted {
            accept_failed(e).await;
        }
        accepted
    })
    .map(move |accepted| {
        accepted.map(|(stream, place)| {
            Preface::new(stream, shutdown.clone(), idle_after, guarded, &connections)
                .holding(Some(place))
                .evictable_in(listed.as_deref())
        })
    })
}

/// After an accept error other than a connection's own (too many open files, above all):
/// logged, and the next accept a second later. tonic's server logs such an error at trace
/// level and accepts again at once, and the listener stays readable, so out of file
/// descriptors it spun on two cores; axum's own accept (the HTTP listener) does the same as
/// this.
async fn accept_failed(e: &io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    error!(error = %e, "cannot accept a connection; trying again in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// The admin service as served: the auth guard outermost, then the refusal of oversized
/// messages, the decode turns and the generated server. The order is the point: the decode
/// turns and the admin service read the guard's credential to keep a turn for callers who
/// may change the policies (`crate::turns::may_change`, which takes a request with no
/// credential for one of a control plane without a tokens file), so a guard moved inside them
/// would give every viewer the kept turns. Moving it means changing this type.
type AdminStack = InterceptedService<
    OversizedIsExhausted<crate::decode_turns::DecodeTurns<AdminServiceServer<AdminApi>>>,
    Guard,
>;

/// [`AdminStack`] over `control`, decoding messages of at most `max_message_bytes`.
fn admin_stack(
    control: &Arc<ControlPlane>,
    tokens: Option<Arc<TokenSet>>,
    max_message_bytes: usize,
) -> AdminStack {
    InterceptedService::new(
        OversizedIsExhausted::new(crate::decode_turns::DecodeTurns::new(
            AdminServiceServer::new(AdminApi::new(control.clone()))
                .max_decoding_message_size(max_message_bytes),
            max_message_bytes,
        )),
        Guard::new(tokens, Role::Admin).counting(control.metrics.auth_refused.clone()),
    )
}

/// Starts the control plane; see the module docs. Raises the process's soft open-file limit
/// to its hard one (see [`crate::places::raise_open_file_limit`]).
pub async fn start(cfg: ServeConfig) -> Result<Running, ServeError> {
    check_exposure(&cfg)?;
    check_settings(&cfg)?;
    let tokens = match &cfg.tokens_file {
        Some(path) => {
            let tokens = TokenSet::load(path)?;
            info!(file = %LogPath(path), tokens = tokens.current().len(), "authentication on");
            for missing in tokens.current().missing_roles(cfg.api_mode) {
                warn!(file = %LogPath(path), "{missing}");
            }
            Some(Arc::new(tokens))
        }
        None => None,
    };
    // Bound before the store is opened: a start that fails on a port in use leaves the data
    // directory as it was (no store file, no seeded or loaded version). Connections that
    // arrive meanwhile wait in the listen backlog until the servers start.
    let agent_socket = bind("agent", cfg.listen).await?;
    let admin_socket = bind("admin", cfg.admin_listen).await?;
    let http_socket = bind("http", cfg.http_listen).await?;
    let agent_addr = local_addr("agent", &agent_socket)?;
    let admin_addr = local_addr("admin", &admin_socket)?;
    let http_addr = local_addr("http", &http_socket)?;
    let data_dir = cfg.data_dir.clone();
    let store = tokio::task::spawn_blocking(move || RedbStore::open(&data_dir))
        .await
        .map_err(|source| ServeError::Task {
            task: "store",
            source,
        })?
        .map_err(|source| ServeError::Store {
            dir: cfg.data_dir.clone(),
            source,
        })?;
    // Which store, and whether it is new: a mistyped `--data-dir` makes a new, empty one
    // (then seeded, or loaded from the file), which nothing else would say.
    let store_file = std::path::absolute(store.path()).unwrap_or_else(|_| store.path().to_owned());
    if store.created() {
        info!(store = %LogPath(&store_file), "created a new, empty version store (if this control plane has run before, check --data-dir)");
    } else {
        info!(store = %LogPath(&store_file), "opened the version store");
    }
    let store: Arc<dyn VersionStore> = Arc::new(store);
    let mode = if cfg.api_mode {
        Mode::Api
    } else {
        // Absolute, for the message that refuses an admin write: its reader may be anywhere.
        // Not resolved through links: the file is edited by the name it was given (a ConfigMap's
        // link is swapped), and it may not exist yet when the store has a version to serve.
        Mode::File(
            std::path::absolute(&cfg.config_file).unwrap_or_else(|_| cfg.config_file.clone()),
        )
    };
    let metrics_interval_ms = u64::try_from(cfg.metrics_interval.as_millis()).unwrap_or(u64::MAX);
    let fleet =
        Arc::new(Fleet::new(cfg.max_agents).forgetting_after(cfg.forget_disconnected_after));
    let aggregates = Arc::new(
        Aggregator::new(cfg.max_series, tokio::time::Instant::now(), fleet.running())
            .with_max_per_service(cfg.max_series_per_service)
            .with_unknown_span(cfg.metrics_interval),
    );
    let control = Arc::new(ControlPlane::new(
        store,
        Arc::new(Publisher::new(metrics_interval_ms)),
        fleet.clone(),
        Arc::new(ServerMetrics::with_aggregates(aggregates.clone(), fleet)),
        aggregates.clone(),
        mode,
    ));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let connections = Connections::default();
    let mut background = vec![aggregate::spawn_ticker(
        aggregates,
        aggregate::TICK,
        shutdown_rx.clone(),
    )];
    let store_check = crate::store_check::spawn(
        &control,
        store_file.clone(),
        cfg.store_check_interval,
        shutdown_rx.clone(),
    );
    let mut start_read = None;
    let mut read_again = None;
    if !cfg.api_mode {
        // Watch before the first read, so a save during start-up is not missed.
        let (task, read) = crate::watch::spawn_before_start(
            control.clone(),
            cfg.config_file.clone(),
            crate::watch::Timing::default(),
            shutdown_rx.clone(),
        )?;
        background.push(task);
        read_again = Some(read.read_again());
        start_read = Some(read);
    }
    // What the store holds is served first: the start's own change (a file edited while the
    // server was down) is then published after it, as any change is, and a file equal to it
    // finds it served. (No agent is connected yet: the listeners start below.)
    control
        .publish_current()
        .await
        .map_err(ServeError::ReadStore)?;
    let at_start = boot::load_policies(&control, &cfg).await?;
    // Neither settled nor left to its writer: the watcher, told nothing, reads it afresh.
    if let (Some(read), Some(at_start)) = (start_read, at_start) {
        read.tell(at_start);
    }

    // One health service per listener: each says the state of its own service only, and
    // NOT_FOUND for the other listener's (which that port would answer UNIMPLEMENTED).
    let (agent_health, agent_health_service) = tonic_health::server::health_reporter();
    let (admin_health, admin_health_service) = tonic_health::server::health_reporter();
    let health = Health([(agent_health, AGENT_SERVICE), (admin_health, ADMIN_SERVICE)]);
    if control.publisher.current().is_some() {
        health.set(ServingStatus::Serving).await;
    } else {
        health.set(ServingStatus::NotServing).await;
        background.push(tokio::spawn(serving_once_published(
            health.clone(),
            control.publisher.clone(),
            shutdown_rx.clone(),
        )));
    }

    let stream_context = Arc::new(StreamContext {
        publisher: control.publisher.clone(),
        fleet: control.fleet.clone(),
        metrics: control.metrics.clone(),
        aggregates: control.aggregates.clone(),
        limits: cfg
            .stream_limits
            .clone()
            .for_metrics_interval(cfg.metrics_interval),
        shutdown: shutdown_rx.clone(),
        tokens: tokens.clone(),
        #[cfg(test)]
        after_register: None,
    });
    // Not the generated `AgentServiceServer`: the route sends one shared frame per version
    // to every stream (see `crate::agent_route`).
    let agent_service = InterceptedService::new(
        AgentRoute::new(
            AgentStreamService::new(stream_context),
            cfg.max_message_bytes,
        ),
        Guard::new(tokens.clone(), Role::Agent)
            .counting(control.metrics.auth_refused.clone())
            .warning(),
    );
    let admin_service = admin_stack(&control, tokens.clone(), cfg.max_message_bytes);

    // Room for a second connection of each agent while it reconnects (its stale one holds a
    // place until keepalive or the idle timeout closes it), and for those waiting for Hello.
    let wanted = cfg.max_agent_connections.unwrap_or(
        cfg.max_agents
            .saturating_mul(2)
            .saturating_add(cfg.stream_limits.max_pending_handshakes),
    );
    // Each agent's connection takes a file descriptor: a soft limit of 1,024 (a common
    // default) would hold the fleet to a few hundred agents while the hard limit allows more.
    let open_files = crate::places::raise_open_file_limit();
    let (caps, lowered) = crate::places::listener_caps(wanted, open_files);
    let agent_connections = caps.agent;
    say_caps(&cfg, wanted, open_files, caps, lowered);
    let mut servers = JoinSet::new();
    let agent_router = grpc_server(&cfg, Some(AGENT_PENDING_RESETS))
        .add_service(agent_health_service)
        .add_service(reflection(AGENT_SERVICE).build_v1()?)
        .add_service(reflection(AGENT_SERVICE).build_v1alpha()?)
        .add_service(agent_service);
    let stop = stopped(shutdown_rx.clone());
    let accepted = incoming(
        agent_socket,
        agent_connections,
        &shutdown_rx,
        cfg.connection_idle_timeout,
        cfg.tokens_file.is_some(),
        &connections,
    );
    servers.spawn(async move {
        agent_router
            .serve_with_incoming_shutdown(accepted, stop)
            .await
            .map_err(|source| ServeError::Grpc {
                listener: "agent",
                source,
            })
    });
    let admin_router = grpc_server(&cfg, None)
        .add_service(admin_health_service)
        .add_service(reflection(ADMIN_SERVICE).build_v1()?)
        .add_service(reflection(ADMIN_SERVICE).build_v1alpha()?)
        .add_service(admin_service);
    let stop = stopped(shutdown_rx.clone());
    let accepted = incoming(
        admin_socket,
        caps.admin,
        &shutdown_rx,
        cfg.connection_idle_timeout,
        cfg.tokens_file.is_some(),
        &connections,
    );
    servers.spawn(async move {
        admin_router
            .serve_with_incoming_shutdown(accepted, stop)
            .await
            .map_err(|source| ServeError::Grpc {
                listener: "admin",
                source,
            })
    });
    let app = router(HttpState {
        publisher: control.publisher.clone(),
        metrics: control.metrics.clone(),
    });
    let stop = stopped(shutdown_rx);
    servers.spawn(async move {
        crate::idle::serve(
            crate::idle::IdleClosing::with_limit(http_socket, caps.http),
            app,
            stop,
        )
        .await
        .map_err(ServeError::Http)
    });
    info!(
        %agent_addr,
        %admin_addr,
        %http_addr,
        mode = %retryplane_policy::diag::LogValue(&control.mode.to_string()),
        agent_connections,
        version = %env!("CARGO_PKG_VERSION"),
        commit = %crate::COMMIT,
        store = %LogPath(&store_file),
        "control plane serving"
    );
    Ok(Running {
        agent_addr,
        admin_addr,
        http_addr,
        control,
        shutdown,
        health,
        servers,
        background,
        store_check,
        tokens,
        read_again,
        connections,
    })
}

/// Logs how the open-file limit `open_files` cut the listeners' caps
/// ([`crate::places::listener_caps`]): a warning when the admin and HTTP listeners get less
/// than their usual 256, or the agent listener less than `--max-agent-connections` asks
/// (`wanted`) or `--max-agents` allows; the default's room for reconnects cut short is only
/// said.
fn say_caps(
    cfg: &ServeConfig,
    wanted: usize,
    open_files: Option<u64>,
    caps: crate::places::ListenerCaps,
    lowered: bool,
) {
    if caps.admin < crate::places::ADMIN_MAX_CONNECTIONS {
        warn!(
            open_file_limit = open_files,
            agent = caps.agent,
            admin = caps.admin,
            http = caps.http,
            "the open-file limit is too low for the usual 256 connections of the admin and HTTP \
             listeners: each holds a quarter of what it leaves, the agent listener the rest; \
             raise it (`ulimit -n`, at least 1152 and more for agents)"
        );
    }
    if lowered && cfg.max_agent_connections.is_some() {
        warn!(
            wanted,
            held = caps.agent,
            open_file_limit = open_files,
            "the agent listener holds fewer connections than --max-agent-connections asks: the \
             process's open-file limit leaves no more beside the other listeners; raise it \
             (`ulimit -n`) for more agents"
        );
    } else if lowered && caps.agent < cfg.max_agents {
        // Nothing asked of the connections themselves: what falls short is --max-agents.
        warn!(
            max_agents = cfg.max_agents,
            held = caps.agent,
            open_file_limit = open_files,
            "the agent listener holds fewer connections than --max-agents allows agents: the \
             process's open-file limit leaves no more beside the other listeners; raise it \
             (`ulimit -n`), or lower --max-agents to what the fleet needs"
        );
    } else if lowered {
        info!(
            wanted,
            held = caps.agent,
            open_file_limit = open_files,
            "the agent listener's room for reconnecting agents is cut to what the open-file limit leaves"
        );
    }
}

/// The gRPC health service's name, advertised by reflection on both listeners.
const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// Reflection for the listener that serves `service`: it lists that service and health, not the
/// other listener's service, which would answer UNIMPLEMENTED here.
fn reflection(service: &str) -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(retryplane_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(service)
        .with_service_name(HEALTH_SERVICE)
}

/// The gRPC health of the two listeners: each listener's reporter and the service it serves.
#[derive(Clone, Debug)]
struct Health([(HealthReporter, &'static str); 2]);

impl Health {
    /// Sets, on each listener, the health of its service and of the whole server (the empty
    /// service name, which a probe without a service asks about; tonic starts it `SERVING`).
    async fn set(&self, status: ServingStatus) {
        for (reporter, service) in &self.0 {
            for name in ["", *service] {
                reporter.set_service_status(name, status).await;
            }
        }
    }
}

/// Reports both listeners `SERVING` once a snapshot is published (API mode, empty store).
async fn serving_once_published(
    health: Health,
    publisher: Arc<Publisher>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut snapshots = publisher.subscribe();
    let published = tokio::select! {
        published = snapshots.wait_for(Option::is_some) => published.is_ok(),
        _ = shutdown.wait_for(|stop| *stop) => false,
    };
    if published {
        health.set(ServingStatus::Serving).await;
    }
}

/// Reads the tokens file of `tokens` again (see [`Running::reload_tokens`]), renaming the
/// fleet's tokens in `control` after a rename. Logs the outcome.
fn reload_tokens(
    tokens: Option<&TokenSet>,
    control: &ControlPlane,
) -> Result<Option<usize>, TokensError> {
    let Some(tokens) = tokens else {
        info!("no tokens file to reload: authentication is off");
        return Ok(None);
    };
    match tokens.reload() {
        Ok(count) => {
            control.metrics.tokens_last_reload_successful.set(1);
            let current = tokens.current();
            control
                .fleet
                .rename_tokens(|digest| current.name_of_digest(digest));
            info!(file = %LogPath(tokens.file()), tokens = count, "tokens file reloaded");
            let api_mode = matches!(control.mode, crate::control::Mode::Api);
            for missing in current.missing_roles(api_mode) {
                warn!(file = %LogPath(tokens.file()), "{missing}");
            }
            Ok(Some(count))
        }
        Err(e @ TokensError::Superseded { .. }) => {
            warn!(error = %crate::ErrorChain(&e), "a slow read of the tokens file ended");
            Err(e)
        }
        Err(e) => {
            control.metrics.tokens_last_reload_successful.set(0);
            error!(
                error = %crate::ErrorChain(&e),
                tokens = tokens.current().len(),
                "tokens file not reloaded; the tokens in force stay"
            );
            Err(e)
        }
    }
}

impl Running {
    /// Reads the tokens file again and puts its tokens in force ([`TokenSet::reload`]): a
    /// token added, rotated or removed takes effect without a restart, and agent streams whose
    /// secret is gone end. `Ok(None)` without a tokens file (there is nothing to reload); `Err`
    /// when the file cannot be used, and the tokens in force stay. Logs the outcome.
    pub fn reload_tokens(&self) -> Result<Option<usize>, TokensError> {
        self.tokens_reload()()
    }

    /// [`Running::reload_tokens`], to run (as often as wanted) on another thread: the file is
    /// read on it (a file on a network mount may not answer), so that the caller (the loop
    /// that waits for SIGTERM) does not wait for it.
    pub fn tokens_reload(
        &self,
    ) -> impl Fn() -> Result<Option<usize>, TokensError> + Send + 'static {
        let tokens = self.tokens.clone();
        let control = self.control.clone();
        move || reload_tokens(tokens.as_deref(), &control)
    }

    /// In file mode, asks the policy file's watcher to read the file now, as a change in
    /// its directory would (a save that no watch saw, on a network mount, is then applied
    /// without waiting for the next rescan): `false` in API mode, where there is no file to
    /// read. The read and what comes of it are logged as any.
    pub fn read_policy_file_again(&self) -> bool {
        match &self.read_again {
            Some(again) => {
                again.now();
                true
            }
            None => false,
        }
    }

    /// The `agent_addr` field, for callers that prefer a method.
    pub fn agent_addr(&self) -> SocketAddr {
        self.agent_addr
    }

    /// The `admin_addr` field.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The `http_addr` field.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The server's state (store, publisher, fleet, metrics). A clone kept past
    /// [`Running::shutdown`] keeps the store open.
    pub fn control(&self) -> &Arc<ControlPlane> {
        &self.control
    }

    /// Resolves when a server stops by itself: `Err` with what failed, `Ok` if it ended
    /// cleanly. Call [`Running::shutdown`] afterwards to stop the others.
    pub async fn wait(&mut self) -> Result<(), ServeError> {
        match self.servers.join_next().await {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(source)) => Err(ServeError::Task {
                task: "server",
                source,
            }),
        }
    }

    /// Stops serving: agent streams end with `UNAVAILABLE` ("reconnect"), the listeners stop
    /// accepting, the servers get [`SHUTDOWN_GRACE`] to drain, then the store is closed.
    /// Returns the first server error seen while draining.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        info!("shutting down");
        self.health.set(ServingStatus::NotServing).await;
        self.shutdown.send_replace(true);
        let mut first_error = None;
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while let Some(joined) = self.servers.join_next().await {
                if let Ok(Err(e)) = joined {
                    first_error.get_or_insert(e);
                }
            }
        })
        .await;
        if drained.is_err() {
            warn!(
                grpc_connections = self.connections.count(),
                "the servers did not stop within {SHUTDOWN_GRACE:?}; closing the remaining connections"
            );
            self.servers.shutdown().await;
        }
        // Connections whose streams outlive the grace (a health Watch, a peer that never acks
        // the GOAWAY) run in tasks of tonic's that aborting the servers does not reach: closed
        // here, so that nothing of this control plane (its store above all) is left behind.
        // (Also with no connection left: their calls' tasks may still be ending.)
        if !self.connections.close_all(CLOSE_WAIT).await {
            warn!(
                connections = self.connections.count(),
                "connections still open {CLOSE_WAIT:?} after they were closed"
            );
        }
        for task in self.background.drain(..) {
            task.abort();
            let _ = task.await;
        }
        // It ends once the check under way (if any) is over: so the store is closed below,
        // and a start right after on the same data directory finds it free. A check held up
        // longer (a disk that does not answer) is left behind.
        if tokio::time::timeout(STORE_CHECK_WAIT, &mut self.store_check)
            .await
            .is_err()
        {
            warn!(
                "a check of the version store has not ended within {STORE_CHECK_WAIT:?}; stopping without it"
            );
            self.store_check.abort();
        }
        // The last reference to the store goes with `self` (unless a caller kept a clone).
        drop(self);
        info!("stopped");
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
#[path = "server_tests.rs"]
pub(crate) mod tests;
