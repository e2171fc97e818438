//! The server's own figures (`retryplane_server_*`) and, through
//! [`AggregateCollector`], the agents' aggregated retry metrics and the fleet gauges, in
//! Prometheus text format (`/metrics`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::aggregate::Aggregator;
use crate::aggregate::prometheus::AggregateCollector;
use crate::fleet::Fleet;

/// Counters and gauges the server updates; cheap to clone handles, shared by all streams.
#[derive(Debug)]
pub struct ServerMetrics {
    registry: Registry,
    /// Agents with an open stream; with [`ServerMetrics::with_aggregates`], the fleet's gauge.
    pub agents_connected: Gauge,
    /// Snapshots sent to agents.
    pub pushes: Counter,
    /// ACKs counted: the first answer to a push, when it is an ACK (see `AgentStream`).
    pub acks: Counter,
    /// NACKs counted: the first answer to a push, when it is a NACK.
    pub nacks: Counter,
    /// The version being served.
    pub current_version: Gauge,
    /// Versions published since start.
    pub publishes: Counter,
    /// When the version being served was published: Unix time in seconds, set as the streams
    /// are woken to push it, and at start to the stored version's own publish (0 before the
    /// first). The version reaches the agents from that instant; `time() -` it is how long it
    /// has been served.
    pub last_publish_seconds: Gauge<f64, AtomicU64>,
    /// Policy changes refused: invalid file saves, invalid applies (YAML or typed documents),
    /// applies and rollbacks of policies larger than the agents take (more items than a policy
    /// file holds, or a snapshot past the message limit), and applies or rollbacks that remove
    /// every endpoint without force. Dry runs (`retryplane diff`) are not counted.
    pub rejected_changes: Counter,
    /// The version store's file length, in bytes: set at start and after each store call of a
    /// change, stored or not (0 for a store kept in memory). Every version is kept, so it grows
    /// with them, in steps: the store's file grows ahead of its use (up to about twice what
    /// its versions take).
    pub store_bytes: Gauge,
    /// Policy changes (applies, rollbacks, file saves) the version store failed to store: a
    /// full disk, a store file replaced under the control plane, a failed commit. In API mode
    /// the one sign on `/metrics` that changes are not being stored.
    pub store_failures: Counter,
    /// 1 while the checks of the version store pass, 0 from the first that fails: its file
    /// deleted or replaced, not writable (a read-only file system), or not readable
    /// (`crate::store_check`, every 10 s and after each change). A full disk shows in
    /// `store_failures` only.
    pub store_healthy: Gauge,
    /// 1 when the last read of the policy file in file mode gave a valid file that was
    /// applied (or equal to the version served), 0 when it could not be read, was invalid or
    /// was refused; like Prometheus's own `prometheus_config_last_reload_successful`. Set at
    /// start, by every read the watcher makes, and as a save of the file is published (with
    /// the version gauge); 1 in API mode, where the file is not watched.
    pub config_last_reload_successful: Gauge,
    /// 1 when the tokens in force are the tokens file's as last read (at start, or by the last
    /// reload, SIGHUP), 0 when the last reload could not use the file and the tokens read before
    /// stay: a rotated secret that did not take is then still valid. 1 without a tokens file.
    pub tokens_last_reload_successful: Gauge,
    /// Metrics reports dropped for coming too fast.
    pub reports_dropped: Counter,
    /// Numbered metrics reports received again after they were counted (sent again after a
    /// lost stream), acknowledged and not counted twice.
    pub reports_duplicate: Counter,
    /// `retryplane_server_reports_out_of_window_total`: numbered reports too far below their
    /// instance's highest to tell whether they were counted ([`crate::report_seq`]).
    pub reports_out_of_window: Counter,
    /// Endpoints of accepted metrics reports left out because their counts are past what
    /// one agent could make over the report's span (see
    /// [`crate::aggregate::counts::Counts::implausible`]), or because the report named the
    /// endpoint already.
    pub report_endpoints_implausible: Counter,
    /// Streams refused at registration: a limit reached (connected agents, the token's
    /// `max_agents`, streams waiting for Hello), the agent id held by another token's stream,
    /// or a late Hello of a stream its agent gave up.
    pub streams_refused: Counter,
    /// Agent streams open but not yet registered: waiting for their Hello (bounded by
    /// `StreamLimits::max_pending_handshakes`).
    pub streams_awaiting_hello: Gauge,
    /// Agent streams ended because nothing came from an agent that sends heartbeats for the
    /// liveness timeout (`retryplane_proto::liveness`).
    pub streams_silent: Counter,
    /// The room for agents' messages under way: bytes held, and streams ended because their
    /// message found none (`crate::inbound::Room`).
    pub inbound: crate::inbound::RoomCounts,
    /// Agent streams and admin calls refused for their token: missing, unknown, of a role the
    /// listener does not admit, a read-only token's attempted change, or an agent id outside
    /// the token's `agent_ids` (at the Hello).
    pub auth_refused: Counter,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerMetrics {
    /// Sets `store_bytes` to what `store` takes on disk, as it last saw it (0 in memory).
    pub(crate) fn note_store_size(&self, store: &dyn crate::store::VersionStore) {
        let bytes = store.disk_bytes().unwrap_or(0);
        self.store_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// The server's own figures, registered under the `retryplane_server` prefix, and the
    /// aggregates of `aggregator` and gauges of `fleet`, read at each scrape.
    /// `agents_connected` is the fleet's own gauge, which it sets as agents come and go.
    pub fn with_aggregates(aggregator: Arc<Aggregator>, fleet: Arc<Fleet>) -> Self {
        let mut metrics = Self::build(fleet.connected_gauge());
        metrics
            .registry
            .register_collector(Box::new(AggregateCollector::new(aggregator, fleet)));
        metrics
    }

    /// Only the server's own figures, every one under the `retryplane_server` prefix.
    pub fn new() -> Self {
        Self::build(Gauge::default())
    }

    fn build(agents_connected: Gauge) -> Self {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("retryplane_server");
        let pushes = Counter::default();
        let acks = Counter::default();
        let nacks = Counter::default();
        let current_version = Gauge::default();
        let publishes = Counter::default();
        let last_publish_seconds = Gauge::<f64, AtomicU64>::default();
        let rejected_changes = Counter::default();
        let store_failures = Counter::default();
        let store_bytes = Gauge::default();
        let store_healthy = Gauge::default();
        let config_last_reload_successful = Gauge::default();
        let tokens_last_reload_successful = Gauge::default();
        tokens_last_reload_successful.set(1);
        let reports_dropped = Counter::default();
        let reports_duplicate = Counter::default();
        let reports_out_of_window = Counter::default();
        let report_endpoints_implausible = Counter::default();
        let streams_refused = Counter::default();
        let streams_awaiting_hello = Gauge::default();
        let streams_silent = Counter::default();
        let inbound = crate::inbound::RoomCounts::default();
        let auth_refused = Counter::default();
        registry.register(
            "agents_connected",
            "Agents with an open stream",
            agents_connected.clone(),
        );
        registry.register("pushes", "Snapshots sent to agents", pushes.clone());
        registry.register(
            "acks",
            "Snapshot ACKs from agents, the first answer to each push",
            acks.clone(),
        );
        registry.register(
            "nacks",
            "Snapshot NACKs from agents, the first answer to each push",
            nacks.clone(),
        );
        registry.register(
            "current_version",
            "Policy version being served",
            current_version.clone(),
        );
        registry.register("publishes", "Policy versions published", publishes.clone());
        registry.register(
            "last_publish_timestamp_seconds",
            "When the policy version being served was published, in Unix time",
            last_publish_seconds.clone(),
        );
        registry.register(
            "rejected_changes",
            "Policy changes refused by validation or safety checks",
            rejected_changes.clone(),
        );
        registry.register(
            "store_failures",
            "Policy changes the version store failed to store (not stored, or not known to be)",
            store_failures.clone(),
        );
        registry.register(
            "store_healthy",
            "Whether the last check of the version store passed (1) or found it failing (0): its file deleted or replaced, not writable, or not readable",
            store_healthy.clone(),
        );
        registry.register(
            "store_bytes",
            "Length of the version store's file, in bytes; every version is kept, so it grows with them, in steps",
            store_bytes.clone(),
        );
        registry.register(
            "config_last_reload_successful",
            "Whether the last read of the policy file (file mode) gave a valid file that was applied; 1 in API mode, where the file is not watched",
            config_last_reload_successful.clone(),
        );
        registry.register(
            "tokens_last_reload_successful",
            "Whether the last read of the tokens file (at start or on SIGHUP) was put in force; 0 while the tokens read before it stay",
            tokens_last_reload_successful.clone(),
        );
        // Which build serves, for dashboards across an upgrade or a rollback.
        registry.register(
            "build",
            "The retryplane build serving",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION")),
                ("commit", crate::COMMIT),
            ]),
        );
        registry.register(
            "reports_dropped",
            "Agent metrics reports dropped for exceeding the per-agent rate",
            reports_dropped.clone(),
        );
        registry.register(
            "reports_duplicate",
            "Agent metrics reports received again after they were counted, not counted twice",
            reports_duplicate.clone(),
        );
        registry.register(
            "reports_out_of_window",
            "Numbered agent metrics reports more than 63 below the highest of their agent process: answered as counted, not counted (the agent library never sends one; a client that does loses those counts)",
            reports_out_of_window.clone(),
        );
        registry.register(
            "report_endpoints_implausible",
            "Endpoints of agent metrics reports left out for counts past what one agent could make, or for naming an endpoint already in the report",
            report_endpoints_implausible.clone(),
        );
        registry.register(
            "streams_refused",
            "Agent streams refused at registration: a limit reached (connected agents, a token's max_agents, streams waiting for Hello), the agent id held by another token's stream, or a late Hello of a stream its agent gave up",
            streams_refused.clone(),
        );
        registry.register(
            "streams_awaiting_hello",
            "Agent streams open but not yet registered, waiting for their Hello",
            streams_awaiting_hello.clone(),
        );
        registry.register(
            "streams_silent",
            "Agent streams ended because nothing came from the agent (which sends heartbeats) for the liveness timeout",
            streams_silent.clone(),
        );
        registry.register(
            "inbound_held_bytes",
            "Bytes held for agents' messages under way (come in part), over all agent streams",
            inbound.held.clone(),
        );
        registry.register(
            "inbound_refused",
            "Agent streams ended because their message's next bytes found no room among the bytes held for messages under way",
            inbound.refused.clone(),
        );
        registry.register(
            "auth_refused",
            "Agent streams and admin calls refused for a missing or unknown token, one of a role the listener does not admit, a read-only token's change, or an agent id outside the token's agent_ids",
            auth_refused.clone(),
        );
        Self {
            registry: root,
            agents_connected,
            pushes,
            acks,
            nacks,
            current_version,
            publishes,
            last_publish_seconds,
            rejected_changes,
            store_failures,
            store_bytes,
            store_healthy,
            config_last_reload_successful,
            tokens_last_reload_successful,
            reports_dropped,
            reports_duplicate,
            reports_out_of_window,
            report_endpoints_implausible,
            streams_refused,
            streams_awaiting_hello,
            streams_silent,
            inbound,
            auth_refused,
        }
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
