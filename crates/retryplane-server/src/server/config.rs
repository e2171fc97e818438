//! What `retryplane serve` is told, and the check of its listen addresses.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use tracing::warn;

use super::{
    CONNECTION_IDLE_TIMEOUT, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, MAX_STREAMS_PER_CONNECTION,
    ServeError,
};
use crate::agent_stream::StreamLimits;
use crate::aggregate::DEFAULT_MAX_SERIES;

/// Everything `retryplane serve` is told.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The policy file: the source of truth in file mode, the seed of an empty store in API
    /// mode. Default `config/policies.yaml`.
    pub config_file: PathBuf,
    /// Where the version store lives. Default `./data`.
    pub data_dir: PathBuf,
    /// The agent gRPC listener. Default `127.0.0.1:7470`.
    pub listen: SocketAddr,
    /// The admin gRPC listener. Default `127.0.0.1:7471`.
    pub admin_listen: SocketAddr,
    /// The HTTP listener: `/healthz`, `/readyz` and `/metrics`, to anyone who can reach it
    /// (with or without a tokens file). Default `127.0.0.1:7472`.
    pub http_listen: SocketAddr,
    /// The tokens file, read at start and again by [`crate::server::Running::reload_tokens`];
    /// without one there is no authentication and the agent and admin listeners must be on
    /// loopback addresses (unless `insecure`).
    pub tokens_file: Option<PathBuf>,
    /// API mode: the store owns the policies and the admin API changes them.
    pub api_mode: bool,
    /// API mode: `config_file` was named by the operator, so an empty store with no file
    /// there stops the start (a mistyped seed path), rather than waiting unready for the first
    /// apply as it does for the default path. Default false.
    pub seed_required: bool,
    /// Allow non-loopback agent and admin listeners without a tokens file.
    pub insecure: bool,
    /// Most agents connected at once. Default 20,000. Must be more than zero.
    pub max_agents: usize,
    /// Most connections the agent listener holds at once: past them, the next is accepted once
    /// one closes (the rest wait in the kernel's queue, holding no file descriptor of the
    /// process). `None`: twice `max_agents` (an agent holds one connection, and a second while
    /// it reconnects and its stale one is not yet closed) plus
    /// `stream_limits.max_pending_handshakes`. Either way lowered to what the process's open-file limit
    /// leaves beside the admin and HTTP listeners' own caps (256 each; with a warning when
    /// that is below the value given, or below `max_agents`), so
    /// that a flood of connections to the agent listener cannot take the descriptors that
    /// health probes, admin calls and the store need. Must be more than zero.
    pub max_agent_connections: Option<usize>,
    /// Largest gRPC message decoded. Default 4 MiB ([`retryplane_proto::MAX_MESSAGE_BYTES`]).
    /// Must be more than zero.
    pub max_message_bytes: usize,
    /// How often agents send metrics reports. Default 10 s.
    pub metrics_interval: Duration,
    /// Per-stream bounds.
    pub stream_limits: StreamLimits,
    /// Most (service, endpoint) metrics series kept apart; reports past it are counted in one
    /// `other` series. Default [`DEFAULT_MAX_SERIES`] (10,000).
    pub max_series: usize,
    /// Most of those series one calling service may take; its reports for further endpoints
    /// are counted in `other`. Default
    /// [`crate::aggregate::DEFAULT_MAX_SERIES_PER_SERVICE`] (1,000).
    pub max_series_per_service: usize,
    /// How often both gRPC listeners send an HTTP/2 PING on each connection. Default
    /// [`KEEPALIVE_INTERVAL`] (20 s). Must be more than zero.
    pub keepalive_interval: Duration,
    /// How long a PING may go unanswered before the connection is dropped; an agent's stream
    /// on it ends and the agent shows as disconnected. Default [`KEEPALIVE_TIMEOUT`] (10 s).
    /// Must be more than zero.
    pub keepalive_timeout: Duration,
    /// Most HTTP/2 streams one connection may have open at once, on each gRPC listener
    /// (advertised in the connection's SETTINGS; a stream past it is refused by the HTTP/2
    /// layer). Default [`MAX_STREAMS_PER_CONNECTION`] (1,024): an agent needs one stream, and
    /// without a bound one connection could open streams without end. Must be more than zero.
    pub max_streams_per_connection: u32,
    /// How long a connection of either gRPC listener may carry no stream (none open since it
    /// was accepted, or since its last one ended; and then no byte moved for a moment, 0.3 s)
    /// before it is closed: a connection that opens
    /// no stream and answers every PING holds its socket this long at most. An agent's
    /// connection always carries its stream. Also how long any other call (admin calls, health,
    /// reflection) may last: past it, it ends with `UNAVAILABLE` ("call again"), so one call
    /// that never ends does not hold a connection for good. Default
    /// [`CONNECTION_IDLE_TIMEOUT`] (5 min). Must be more than zero.
    pub connection_idle_timeout: Duration,
    /// How long a disconnected agent stays in FleetStatus; `None` keeps it until more than
    /// [`crate::fleet::MAX_DISCONNECTED`] disconnected agents are listed (then the longest gone
    /// tenth go).
    /// Default [`crate::fleet::FORGET_DISCONNECTED_AFTER`] (1 h).
    pub forget_disconnected_after: Option<Duration>,
    /// How often the version store is checked (its file still there and writable, its
    /// reads working: `crate::store_check`). Default [`crate::store_check::INTERVAL`] (10 s).
    pub store_check_interval: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        let loopback = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        Self {
            config_file: PathBuf::from("config/policies.yaml"),
            data_dir: PathBuf::from("./data"),
            listen: loopback(7470),
            admin_listen: loopback(7471),
            http_listen: loopback(7472),
            tokens_file: None,
            api_mode: false,
            seed_required: false,
            insecure: false,
            max_agents: 20_000,
            max_agent_connections: None,
            max_message_bytes: retryplane_proto::MAX_MESSAGE_BYTES,
            metrics_interval: Duration::from_secs(10),
            stream_limits: StreamLimits::default(),
            max_series: DEFAULT_MAX_SERIES,
            max_series_per_service: crate::aggregate::DEFAULT_MAX_SERIES_PER_SERVICE,
            keepalive_interval: KEEPALIVE_INTERVAL,
            keepalive_timeout: KEEPALIVE_TIMEOUT,
            max_streams_per_connection: MAX_STREAMS_PER_CONNECTION,
            connection_idle_timeout: CONNECTION_IDLE_TIMEOUT,
            forget_disconnected_after: Some(crate::fleet::FORGET_DISCONNECTED_AFTER),
            store_check_interval: crate::store_check::INTERVAL,
        }
    }
}

/// Whether listeners on `a` and `b` (the same port, not 0) could not both bind: the same
/// address, or one unspecified address of the same family (it takes the port on every address
/// of that family), or `[::]`, which on a dual-stack system takes it on IPv4 too. An
/// IPv4-mapped address (`[::ffff:127.0.0.1]`) is its IPv4 address: its listener takes that
/// address's IPv4 connections.
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    let dual_stack = |x: SocketAddr| x.is_ipv6() && x.ip().is_unspecified();
    let (ia, ib) = (a.ip().to_canonical(), b.ip().to_canonical());
    ia == ib
        || (ia.is_ipv4() == ib.is_ipv4() && (ia.is_unspecified() || ib.is_unspecified()))
        || dual_stack(a)
        || dual_stack(b)
}

/// The shortest metrics interval (`--metrics-interval`), as agents take it.
pub const MIN_METRICS_INTERVAL: Duration = Duration::from_millis(100);
/// The longest metrics interval.
pub const MAX_METRICS_INTERVAL: Duration = Duration::from_secs(3600);

/// Refuses a keepalive interval or timeout of zero (a PING after every frame, or a connection
/// dropped as soon as a PING goes out), an idle timeout of zero, a metrics interval outside 100 ms to 1 h, a connection
/// that may open no stream, no agent or no message byte allowed (every agent would be refused,
/// and only agents would hear of it), room for agents' messages under way smaller than the
/// largest of them, and two listeners given the same address (the second could not bind it).
pub(super) fn check_settings(cfg: &ServeConfig) -> Result<(), ServeError> {
    let listeners = [
        ("agent", cfg.listen),
        ("admin", cfg.admin_listen),
        ("http", cfg.http_listen),
    ];
    for (i, &(first, addr)) in listeners.iter().enumerate() {
        // Port 0 asks the system for a free port: each listener gets its own.
        if addr.port() == 0 {
            continue;
        }
        if let Some(&(second, other)) = listeners[i + 1..]
            .iter()
            .find(|&&(_, other)| overlap(addr, other))
        {
            return Err(ServeError::SameAddress {
                first,
                second,
                addr,
                other,
            });
        }
    }
    if cfg.max_agent_connections == Some(0) {
        return Err(ServeError::ZeroSetting {
            setting: "max_agent_connections",
        });
    }
    for (setting, zero) in [
        (
            "max_streams_per_connection",
            cfg.max_streams_per_connection == 0,
        ),
        ("max_agents", cfg.max_agents == 0),
        ("max_message_bytes", cfg.max_message_bytes == 0),
    ] {
        if zero {
            return Err(ServeError::ZeroSetting { setting });
        }
    }
    // Agents take no other (a snapshot's interval is in milliseconds, and they keep their
    // own for 0), and both ends of a stream derive its heartbeat from the same interval.
    if !(MIN_METRICS_INTERVAL..=MAX_METRICS_INTERVAL).contains(&cfg.metrics_interval) {
        return Err(ServeError::MetricsInterval {
            value: cfg.metrics_interval,
        });
    }
    let largest = cfg
        .max_message_bytes
        .min(retryplane_proto::MAX_AGENT_MESSAGE_BYTES);
    if cfg.stream_limits.max_inbound_bytes < largest {
        return Err(ServeError::InboundRoom {
            value: cfg.stream_limits.max_inbound_bytes,
            largest,
        });
    }
    for (setting, value) in [
        ("keepalive_interval", cfg.keepalive_interval),
        ("keepalive_timeout", cfg.keepalive_timeout),
        ("connection_idle_timeout", cfg.connection_idle_timeout),
    ] {
        if value.is_zero() {
            return Err(ServeError::ZeroSetting { setting });
        }
    }
    Ok(())
}

/// Refuses agent and admin listeners on addresses other than loopback without a tokens file,
/// unless `insecure`. The HTTP listener is left out: it serves only `/healthz`, `/readyz` and
/// `/metrics`, never a policy or a change, and a tokens file would not guard it either.
pub(super) fn check_exposure(cfg: &ServeConfig) -> Result<(), ServeError> {
    if cfg.tokens_file.is_some() {
        return Ok(());
    }
    let listeners = [("agent", cfg.listen), ("admin", cfg.admin_listen)];
    let exposed: Vec<_> = listeners
        .into_iter()
        .filter(|(_, addr)| !addr.ip().to_canonical().is_loopback())
        .collect();
    match exposed.first() {
        None => {
            warn!("no tokens file: the agent and admin listeners serve on loopback only");
            Ok(())
        }
        Some(_) if !cfg.insecure => Err(ServeError::Exposed { listeners: exposed }),
        Some(_) => {
            for (listener, addr) in exposed {
                warn!(%addr, "--insecure: the {listener} listener accepts anyone, with no tokens file");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn listeners_overlap_on_one_address_or_an_unspecified_one_of_that_port() {
        for (a, b) in [
            ("127.0.0.1:7000", "127.0.0.1:7000"),
            ("0.0.0.0:7000", "127.0.0.1:7000"),
            ("127.0.0.1:7000", "0.0.0.0:7000"),
            ("[::]:7000", "[::1]:7000"),
            ("[::]:7000", "127.0.0.1:7000"),
            ("[::ffff:127.0.0.1]:7000", "127.0.0.1:7000"),
            ("127.0.0.1:7000", "[::ffff:127.0.0.1]:7000"),
            ("[::ffff:0.0.0.0]:7000", "127.0.0.1:7000"),
        ] {
            assert!(overlap(at(a), at(b)), "{a} and {b}");
        }
        for (a, b) in [
            ("127.0.0.1:7000", "127.0.0.1:7001"),
            ("127.0.0.1:7000", "127.0.0.2:7000"),
            ("[::1]:7000", "127.0.0.1:7000"),
            ("0.0.0.0:7000", "[::1]:7000"),
            ("0.0.0.0:7000", "0.0.0.0:7001"),
            ("[::ffff:127.0.0.1]:7000", "[::1]:7000"),
            ("[::ffff:0.0.0.0]:7000", "[::1]:7000"),
        ] {
            assert!(!overlap(at(a), at(b)), "{a} and {b}");
        }
    }

    #[test]
    fn without_tokens_loopback_is_said_and_another_address_needs_insecure() {
        let cfg = |listen: &str, admin: &str, insecure: bool| ServeConfig {
            listen: at(listen),
            admin_listen: at(admin),
            insecure,
            ..ServeConfig::default()
        };
        // Loopback (IPv4 or IPv6): served, and the log says there is no authentication.
        for (listen, admin) in [("127.0.0.1:7470", "127.0.0.1:7471"), ("[::1]:0", "[::1]:0")] {
            let (log, guard) = crate::test_logs::capture("retryplane_server=warn");
            assert!(check_exposure(&cfg(listen, admin, false)).is_ok());
            drop(guard);
            let log = log.text();
            assert!(
                log.contains(
                    "no tokens file: the agent and admin listeners serve on loopback only"
                ),
                "{log}"
            );
        }
        // Another address: refused, unless --insecure, which is said for each such listener.
        let exposed = cfg("0.0.0.0:7470", "[::]:7471", false);
        assert!(matches!(
            check_exposure(&exposed),
            Err(ServeError::Exposed { ref listeners }) if listeners.len() == 2
        ));
        let (log, guard) = crate::test_logs::capture("retryplane_server=warn");
        assert!(check_exposure(&cfg("0.0.0.0:7470", "[::]:7471", true)).is_ok());
        drop(guard);
        let log = log.text();
        assert!(
            log.contains("--insecure: the agent listener accepts anyone"),
            "{log}"
        );
        assert!(
            log.contains("--insecure: the admin listener accepts anyone"),
            "{log}"
        );
        // With a tokens file any address is served.
        let with_tokens = ServeConfig {
            tokens_file: Some(PathBuf::from("tokens.yaml")),
            ..exposed
        };
        assert!(check_exposure(&with_tokens).is_ok());
    }
}
