//! `retryplane serve`: runs the control plane (SPEC §3) until SIGTERM or Ctrl-C.
//!
//! The defaults work from the repository root with nothing else set up: file mode on
//! `config/policies.yaml`, the version store in `./data`, loopback listeners on 7470 (agents),
//! 7471 (admin) and 7472 (HTTP health and metrics), no authentication.
//!
//! Once serving, stdout gets one line per listener with the address actually bound (so port 0
//! can be used), `agent: ADDR`, `admin: ADDR`, `http: ADDR`; logs go to stderr (`RUST_LOG`,
//! default `info`; the file watching crate's own messages only at error unless `RUST_LOG`
//! names `notify`). Stdout that cannot be written (a full disk, closed) is logged as a warning
//! and serving goes on. SIGTERM or Ctrl-C ends agent streams with "reconnect", drains and exits 0;
//! a second one during the drain exits 0 at once.
//! SIGHUP reads the tokens file again (`Running::reload_tokens`): added, rotated and removed
//! tokens take effect at once, agent streams whose secret was removed end, and a file that
//! cannot be used is logged and leaves the tokens in force. In file mode it also has the
//! policy file read now (`Running::read_policy_file_again`), as a save would, rather than at
//! the next rescan when no watch saw the save.
//! Anything that stops the start (a bad tokens file, an invalid policy file with an empty
//! store, a seed file named with `--api --config` that is missing, a port in use) exits 2 with
//! the reason.

use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use retryplane_policy::duration::{DurationError, parse_duration};
use retryplane_server::agent_stream::StreamLimits;
use retryplane_server::server::{self, ServeConfig};
use tokio::time::Instant;
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

use crate::{Outcome, Report};

/// `retryplane serve` flags, as parsed. Defaults match [`ServeConfig::default`].
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The policy file: the source of truth in file mode (reloaded when saved); with --api,
    /// only the seed of an empty store (a file named here that is missing then stops the
    /// start; at the default path, the server waits for the first apply)
    /// [default: config/policies.yaml].
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where the version store keeps every version.
    #[arg(long, value_name = "DIR", default_value = "./data")]
    data_dir: PathBuf,
    /// Agent gRPC listener.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7470", value_parser = listen_address)]
    listen: SocketAddr,
    /// Admin gRPC listener.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7471", value_parser = listen_address)]
    admin_listen: SocketAddr,
    /// HTTP listener: /healthz, /readyz and /metrics (the server's own figures), served to
    /// anyone who can reach it, with or without --tokens; no policy and no change goes
    /// through it.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7472", value_parser = listen_address)]
    http_listen: SocketAddr,
    /// Tokens file (names, roles agent/admin/viewer, secrets, and the agent ids and number of
    /// agents an agent token may connect), read again on SIGHUP. Without one
    /// there is no authentication and the agent and admin listeners must be on loopback
    /// addresses.
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// API mode: the store owns the policies and `retryplane apply` changes them.
    #[arg(long)]
    api: bool,
    /// Allow non-loopback agent and admin listeners without a tokens file.
    #[arg(long)]
    insecure: bool,
    /// How often agents send metrics reports (sent to them in every snapshot): a duration with
    /// its unit (`500ms`, `10s`, `1m`), from 100ms to 1h.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = metrics_interval)]
    metrics_interval: Duration,
    /// How often the gRPC listeners send an HTTP/2 PING on each connection: a duration with
    /// its unit, from 1s to 1h.
    #[arg(long, value_name = "DURATION", default_value = "20s", value_parser = keepalive)]
    keepalive_interval: Duration,
    /// How long a PING may go unanswered before the connection is dropped (an agent on it
    /// then shows as disconnected): a duration with its unit, from 1s to 1h.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = keepalive)]
    keepalive_timeout: Duration,
    /// How long a connection to a gRPC listener may carry no stream before it is closed (an
    /// agent's always carries its own), and how long any call other than an agent's stream
    /// may last (then it ends with UNAVAILABLE): a duration with its unit, from 1s to 24h.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = idle_timeout)]
    connection_idle_timeout: Duration,
    /// Removed: refused with the flag that replaced it (hidden), so that a deployment that
    /// still passes it is told what to do rather than offered the nearest name.
    #[arg(long, value_name = "DURATION", hide = true, num_args = 0..=1,
          default_missing_value = "", value_parser = removed_max_connection_age)]
    max_connection_age: Option<Duration>,
    /// Most agents connected at once; one more is refused with RESOURCE_EXHAUSTED.
    #[arg(long, value_name = "N", default_value_t = ServeConfig::default().max_agents,
          value_parser = crate::flags::at_least_one_usize)]
    max_agents: usize,
    /// Most connections the agent listener holds at once (the next waits in the kernel's
    /// queue until one closes); by default twice --max-agents (room for an agent's second
    /// connection while it reconnects) plus --max-pending-handshakes. Lowered to what the
    /// open-file limit leaves beside the admin and HTTP listeners (256 connections each), with
    /// a warning when that is below this flag's value or --max-agents.
    #[arg(long, value_name = "N", value_parser = crate::flags::at_least_one_usize)]
    max_agent_connections: Option<usize>,
    /// Most agent streams waiting for their Hello at once; one more is refused with
    /// RESOURCE_EXHAUSTED. Where the tokens file holds more than one agent token, one token's
    /// streams take at most all but a quarter of them (768 of the default).
    #[arg(long, value_name = "N",
          default_value_t = StreamLimits::default().max_pending_handshakes,
          value_parser = crate::flags::at_least_one_usize)]
    max_pending_handshakes: usize,
    /// Most MiB of agents' messages under way (come in part) the control plane holds at once,
    /// over all agent streams; one agent token holds at most three quarters of it. A stream
    /// whose message's next bytes find no room ends with RESOURCE_EXHAUSTED (the agent
    /// reconnects and sends it again). At least 2 (the largest agent message is 1.06 MiB).
    #[arg(long, value_name = "MIB",
          default_value_t = StreamLimits::default().max_inbound_bytes >> 20,
          value_parser = inbound_mib)]
    max_inbound_mib: usize,
    /// Most HTTP/2 streams one connection may have open at once, on each gRPC listener (an
    /// agent needs one).
    #[arg(long, value_name = "N",
          default_value_t = ServeConfig::default().max_streams_per_connection,
          value_parser = crate::flags::at_least_one_u32)]
    max_streams_per_connection: u32,
    /// Most (service, endpoint) metrics series kept apart; reports past it are counted in one
    /// `other` series.
    #[arg(long, value_name = "N", default_value_t = ServeConfig::default().max_series,
          value_parser = crate::flags::at_least_one_usize)]
    max_series: usize,
    /// Most of those series one calling service may take (a service that names endpoints
    /// after URLs cannot take the whole cap); its further endpoints are counted in `other`.
    #[arg(long, value_name = "N", default_value_t = ServeConfig::default().max_series_per_service,
          value_parser = crate::flags::at_least_one_usize)]
    max_series_per_service: usize,
    /// How long a disconnected agent stays listed by `status`: a duration with its unit
    /// (`30m`, `48h`, `7d`), up to 30d; `0` keeps it until more than 10,000 disconnected agents
    /// are listed (then the longest gone tenth go).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = forget_after)]
    forget_disconnected_after: Duration,
}

/// A listen address: an IP address and a port (`127.0.0.1:7470`, `[::1]:7470`, `0.0.0.0:7470`;
/// port 0 takes a free one). Said in the error is what is wrong with one that is not: a name
/// (a listener binds an address, and `localhost` may stand for two), a URL, a missing port, a
/// port past 65535, a `:` after the port, an IPv6 address without its brackets, an IPv4
/// address in brackets, a zone given by name.
fn listen_address(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim_ascii();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    // A `--server` URL or one from a browser's bar pasted in: its address is suggested only
    // when it is one a listener takes (not a name, not without a port), and never with the
    // `user:password@` a URL may hold.
    if let Some((_, rest)) = text.split_once("://") {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
        let address = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
        return Err(if address.parse::<SocketAddr>().is_ok() {
            format!(
                "a listener takes an IP address and a port, not a URL: write {address}, \
                 without the scheme"
            )
        } else {
            "a listener takes an IP address and a port, not a URL: 127.0.0.1:PORT or \
             [::1]:PORT for loopback, 0.0.0.0:PORT or [::]:PORT for every address"
                .to_owned()
        });
    }
    if text.parse::<std::net::IpAddr>().is_ok() || text.parse::<std::net::Ipv6Addr>().is_ok() {
        return Err(if text.contains(':') {
            format!("no port: write [{text}]:PORT (an IPv6 address in brackets, then the port)")
        } else {
            format!("no port: write {text}:PORT")
        });
    }
    let bracketed = text.strip_prefix('[').and_then(|t| t.strip_suffix(']'));
    if bracketed.is_some_and(|h| h.parse::<std::net::Ipv6Addr>().is_ok()) {
        return Err(format!("no port: write {text}:PORT"));
    }
    let Some((host, port)) = text.rsplit_once(':').filter(|(host, _)| !host.is_empty()) else {
        return Err(
            "not an IP address and port: write 127.0.0.1:PORT, [::1]:PORT or 0.0.0.0:PORT"
                .to_owned(),
        );
    };
    if host.parse::<SocketAddr>().is_ok() {
        return Err(format!(
            "a `:` too many after the port: write {host} (an IP address, `:`, the port)"
        ));
    }
    let ip = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    if let Some(v4) = ip.filter(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok()) {
        return Err(format!(
            "an IPv4 address goes without brackets: write {v4}:{port}"
        ));
    }
    // Rust (like `getaddrinfo` with numeric hosts) takes the zone of a link-local address by
    // its number (`%2`), not by the interface's name (`%eth0`, as `ip address` shows it).
    let zoned = ip.and_then(|ip| ip.split_once('%'));
    if let Some((addr, zone)) = zoned
        && addr.parse::<std::net::Ipv6Addr>().is_ok()
        && zone.parse::<u32>().is_err()
    {
        return Err(format!(
            "the zone after `%` must be the interface's number (`ip link` shows it first), \
             not {zone:?}"
        ));
    }
    let host_is_ip = match ip {
        // With a zone by number, taken above: what is wrong is the port.
        Some(ip) => zoned
            .map_or(ip, |(addr, _)| addr)
            .parse::<std::net::Ipv6Addr>()
            .is_ok(),
        None => host.parse::<std::net::Ipv4Addr>().is_ok(),
    };
    if host_is_ip {
        return Err(format!(
            "the port must be a number from 0 to 65535 (0 takes a free one), not {port:?}"
        ));
    }
    if host.contains(':') && ip.is_none() {
        return Err("an IPv6 address goes in brackets: [::1]:PORT".to_owned());
    }
    Err(format!(
        "{host:?} is not an IP address: a listener takes one (127.0.0.1:PORT or [::1]:PORT for \
         loopback, 0.0.0.0:PORT or [::]:PORT for every address), not a name"
    ))
}

/// Parses `--metrics-interval`: a policy-style duration between 100 ms and 1 h.
fn metrics_interval(text: &str) -> Result<Duration, String> {
    crate::flags::duration_in(
        text,
        server::MIN_METRICS_INTERVAL..=server::MAX_METRICS_INTERVAL,
        "from 100ms to 1h",
    )
}

/// Parses `--keepalive-interval` and `--keepalive-timeout`: a policy-style duration between
/// 1 s and 1 h (a PING more often than every second is what gRPC peers call abuse).
fn keepalive(text: &str) -> Result<Duration, String> {
    crate::flags::duration_in(
        text,
        Duration::from_secs(1)..=Duration::from_secs(3600),
        "from 1s to 1h",
    )
}

/// Parses `--connection-idle-timeout`: a policy-style duration between 1 s and 24 h.
fn idle_timeout(text: &str) -> Result<Duration, String> {
    crate::flags::duration_in(
        text,
        Duration::from_secs(1)..=Duration::from_secs(24 * 3600),
        "from 1s to 24h",
    )
}

/// Parses `--forget-disconnected-after`: `0`, or a duration up to 30 days. Policy durations
/// stop at a day, so this one also takes hours past 24 (`48h`) and days (`7d`, `1.5d`).
fn forget_after(text: &str) -> Result<Duration, String> {
    const SAID: &str = "0, or from 1ms to 30d (720h)";
    let max = Duration::from_secs(30 * 24 * 3600);
    let trimmed = text.trim();
    if trimmed == "0" {
        return Ok(Duration::ZERO);
    }
    let duration = match parse_duration(trimmed) {
        Ok(duration) => duration,
        Err(DurationError::OutOfRange(_)) if trimmed.ends_with('h') => {
            past_a_day(text, trimmed, "h", 3_600, SAID)?
        }
        Err(DurationError::UnknownUnit { unit, .. }) if unit == "d" => {
            past_a_day(text, trimmed, "d", 24 * 3_600, SAID)?
        }
        Err(e) => return Err(e.to_string()),
    };
    // `0s` is the `0` the help names.
    if duration.is_zero() || (Duration::from_millis(1)..=max).contains(&duration) {
        Ok(duration)
    } else {
        Err(format!("`{text}` is out of range: {SAID}"))
    }
}

/// `trimmed` (ending in `unit`, `seconds` long) as a duration: its number is read as a count of
/// seconds, to the millisecond, then scaled.
fn past_a_day(
    text: &str,
    trimmed: &str,
    unit: &str,
    seconds: u32,
    said: &str,
) -> Result<Duration, String> {
    let number = trimmed.strip_suffix(unit).unwrap_or(trimmed);
    match parse_duration(&format!("{number}s")) {
        Ok(count) => count
            .checked_mul(seconds)
            .ok_or_else(|| format!("`{text}` is out of range: {said}")),
        Err(DurationError::OutOfRange(_)) => Err(format!("`{text}` is out of range: {said}")),
        Err(_) => Err(format!(
            "`{text}` is not a duration: write a number and a unit (ms, s, m, h or d), such as \
             `30m` or `7d`"
        )),
    }
}

/// `--max-inbound-mib`: a whole number of MiB from 2 (the largest agent message, 1.06 MiB,
/// must fit) to what a byte count holds.
fn inbound_mib(text: &str) -> Result<usize, String> {
    let largest = retryplane_proto::MAX_AGENT_MESSAGE_BYTES.div_ceil(1 << 20);
    let mib = crate::flags::at_least_one_usize(text)?;
    if mib < largest {
        return Err(format!(
            "must be at least {largest}: the largest message an agent sends ({} bytes) must \
             fit",
            retryplane_proto::MAX_AGENT_MESSAGE_BYTES
        ));
    }
    mib.checked_mul(1 << 20)
        .map(|_| mib)
        .ok_or_else(|| format!("must be at most {}", usize::MAX >> 20))
}

/// Refuses `--max-connection-age` (removed) whatever its value.
fn removed_max_connection_age(_: &str) -> Result<Duration, String> {
    Err(
        "--max-connection-age was removed: the control plane now closes a connection that \
         carries no stream for --connection-idle-timeout (default 5m), and an agent's \
         connection stays open; drop the flag, or set --connection-idle-timeout"
            .to_owned(),
    )
}

impl From<Args> for ServeConfig {
    fn from(args: Args) -> Self {
        let defaults = ServeConfig::default();
        ServeConfig {
            seed_required: args.config.is_some(),
            config_file: args.config.unwrap_or(defaults.config_file),
            data_dir: args.data_dir,
            listen: args.listen,
            admin_listen: args.admin_listen,
            http_listen: args.http_listen,
            tokens_file: args.tokens,
            api_mode: args.api,
            insecure: args.insecure,
            metrics_interval: args.metrics_interval,
            keepalive_interval: args.keepalive_interval,
            keepalive_timeout: args.keepalive_timeout,
            connection_idle_timeout: args.connection_idle_timeout,
            max_agents: args.max_agents,
            max_agent_connections: args.max_agent_connections,
            max_series: args.max_series,
            max_series_per_service: args.max_series_per_service,
            max_streams_per_connection: args.max_streams_per_connection,
            forget_disconnected_after: (!args.forget_disconnected_after.is_zero())
                .then_some(args.forget_disconnected_after),
            stream_limits: StreamLimits {
                max_pending_handshakes: args.max_pending_handshakes,
                max_inbound_bytes: args.max_inbound_mib << 20,
                ..defaults.stream_limits
            },
            ..defaults
        }
    }
}

/// How long the process waits at its end for tasks still on the runtime's blocking threads.
const BLOCKING_AT_EXIT: Duration = Duration::from_secs(2);

/// Serves until a signal; see the module docs. Nothing is left for `main` to print.
pub fn run(settings: ServeConfig) -> anyhow::Result<Report> {
    init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(serve(settings));
    // Tasks on the runtime's blocking threads (a read of the policy file on a mount that does
    // not answer, a `/metrics` render) are waited for this long at most: a runtime dropped as
    // usual waits for them for good, and a stop (a second signal's above all) must end.
    runtime.shutdown_timeout(BLOCKING_AT_EXIT);
    served?;
    Ok(Report {
        stdout: String::new(),
        outcome: Outcome::Success,
    })
}

/// notify logs its own bookkeeping of a watched directory that was deleted (at info and warn:
/// "Unable to remove the path from the watches", on every Kubernetes ConfigMap swap), which the
/// policy file watcher handles; its real errors reach the watcher. Kept to errors unless
/// `RUST_LOG` names it.
const NOTIFY_QUIET: &str = "notify=error";

/// The log filter for `RUST_LOG` (`info` when unset or empty), notify kept quiet unless named.
fn filter_spec(rust_log: Option<String>) -> String {
    let spec = rust_log
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "info".to_owned());
    if spec.contains("notify") {
        spec
    } else {
        format!("{spec},{NOTIFY_QUIET}")
    }
}

fn init_logging() {
    let spec = filter_spec(std::env::var("RUST_LOG").ok());
    let filter = EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| EnvFilter::new(format!("info,{NOTIFY_QUIET}")));
    // Already set (never, in the binary) is not worth failing over.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // A closed stderr (a log pipe that died) must not stop the control plane: by default
        // tracing-subscriber reports a failed write on stderr itself, which then panics.
        .log_internal_errors(false)
        .with_writer(io::stderr)
        // Colours only for a person at a terminal, not in log files or CI output.
        .with_ansi(io::IsTerminal::is_terminal(&io::stderr()))
        .try_init();
}

async fn serve(settings: ServeConfig) -> anyhow::Result<()> {
    // Installed before the addresses are printed: a SIGTERM sent as soon as they appear must
    // shut down cleanly, not kill the process.
    let mut terminated = Signals::install()?;
    let mut hangups = Hangups::install()?;
    let mut running = server::start(settings).await?;
    {
        let mut out = io::stdout().lock();
        let printed = writeln!(out, "agent: {}", running.agent_addr)
            .and_then(|()| writeln!(out, "admin: {}", running.admin_addr))
            .and_then(|()| writeln!(out, "http: {}", running.http_addr))
            .and_then(|()| out.flush());
        // A full disk or a closed stdout must not stop the control plane: the addresses go
        // to the log instead.
        if let Err(e) = printed {
            warn!(
                error = %e,
                agent = %running.agent_addr,
                admin = %running.admin_addr,
                http = %running.http_addr,
                "cannot write the listener addresses to stdout; serving anyway"
            );
        }
    }
    let mut reloads = Reloads::new(STUCK_READ);
    let stopped = loop {
        tokio::select! {
            stopped = running.wait() => break Some(stopped),
            signal = terminated.recv() => {
                info!(signal = %signal, "stopping: a signal came");
                break None;
            }
            // The reload logs its outcome; a bad file keeps the tokens in force. The file is
            // read on a thread of its own, not waited for here: a read that does not end (a
            // file on a network mount that does not answer) must not keep this loop from
            // SIGTERM (see `Reloads`).
            () = hangups.recv() => {
                // In file mode, the policy file too: read by its watcher, as a save would be
                // (on a network mount no watch may see one until the rescan).
                if running.read_policy_file_again() {
                    info!("SIGHUP: reading the policy file again");
                }
                reloads.hangup(|| running.tokens_reload());
            }
        }
    };
    // A second SIGTERM or Ctrl-C stops at once, not waiting out the drain's grace (a person
    // who pressed Ctrl-C twice; every stored version is already durable).
    tokio::select! {
        stopped = running.shutdown() => stopped?,
        signal = terminated.recv() => {
            warn!(signal = %signal, "a second SIGTERM or Ctrl-C: stopping now, without waiting for the connections to drain");
        }
    }
    match stopped {
        Some(Err(e)) => Err(e).context("the control plane stopped"),
        Some(Ok(())) => anyhow::bail!("the control plane stopped unexpectedly"),
        None => Ok(()),
    }
}

/// How long a read of the tokens file may go on before a SIGHUP reads it again on another
/// thread beside it.
const STUCK_READ: Duration = Duration::from_secs(5);

/// Most reads of the tokens file left running beside the thread in use, each stuck past
/// [`STUCK_READ`]; past them, a SIGHUP waits its turn on the thread in use.
const MAX_STUCK_READS: usize = 4;

/// The threads that read the tokens file again on SIGHUP. One thread reads for every SIGHUP,
/// in turn (SIGHUPs that come during a read make one more read); a thread, not
/// `spawn_blocking`, as the runtime's end would wait for it. A read that does not end (a file
/// on a network mount that does not answer) would hold every later SIGHUP behind it: once one
/// has gone on for `stuck_after`, the next SIGHUP starts a new thread, and the stuck one is
/// left to end when it may (its tokens, older, are then not put in force: see
/// `TokenSet::reload`), [`MAX_STUCK_READS`] at most.
struct Reloads {
    stuck_after: Duration,
    /// The thread in use: its queue, and since when its read has run (`None` while idle).
    current: Option<(std::sync::mpsc::Sender<()>, Busy)>,
    /// The threads left behind, while their reads run.
    stuck: Vec<Busy>,
}

/// When a reload thread's read began; `None` while it waits for the next.
type Busy = Arc<Mutex<Option<Instant>>>;

impl Reloads {
    fn new(stuck_after: Duration) -> Self {
        Self {
            stuck_after,
            current: None,
            stuck: Vec::new(),
        }
    }

    /// A SIGHUP: a read of the tokens file with the reload `make` gives, on the thread in use
    /// or a new one (said in the log when it cannot be started).
    fn hangup<R>(&mut self, make: impl FnOnce() -> R)
    where
        R: Fn() -> Result<Option<usize>, retryplane_server::auth::TokensError> + Send + 'static,
    {
        let since = |busy: &Busy| *busy.lock().unwrap_or_else(|e| e.into_inner());
        self.stuck.retain(|busy| since(busy).is_some());
        if let Some((queue, busy)) = &self.current {
            let running_for = since(busy).map(|began| began.elapsed());
            match running_for {
                Some(running_for) if running_for >= self.stuck_after => {
                    if self.stuck.len() >= MAX_STUCK_READS {
                        warn!(
                            stuck = self.stuck.len() + 1,
                            "reads of the tokens file have not ended; this SIGHUP waits its turn"
                        );
                    } else {
                        warn!(
                            running_for_s = running_for.as_secs(),
                            "the last read of the tokens file has not ended; reading it again \
                             beside it (its tokens will not replace those read after it)"
                        );
                        if let Some((_, busy)) = self.current.take() {
                            self.stuck.push(busy);
                        }
                        self.current = reload_thread(make());
                        return;
                    }
                }
                _ => {}
            }
            if queue.send(()).is_ok() {
                return;
            }
        }
        self.current = reload_thread(make());
    }
}

/// Starts a thread that reads the tokens file again (`reload`) for each message sent to it,
/// once for any number that wait, and sends it the first; `None` (said in the log) if it
/// cannot be started.
fn reload_thread(
    reload: impl Fn() -> Result<Option<usize>, retryplane_server::auth::TokensError> + Send + 'static,
) -> Option<(std::sync::mpsc::Sender<()>, Busy)> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let busy: Busy = Arc::default();
    let marks = busy.clone();
    let mark = move |began: Option<Instant>| {
        *marks.lock().unwrap_or_else(|e| e.into_inner()) = began;
    };
    let spawned = std::thread::Builder::new()
        .name("tokens-reload".to_owned())
        .spawn(move || {
            while rx.recv().is_ok() {
                while rx.try_recv().is_ok() {}
                mark(Some(Instant::now()));
                let _ = reload();
                mark(None);
            }
        });
    match spawned {
        Ok(_) => {
            // Marked busy from the send, so that a read that never ends counts from now.
            *busy.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            tx.send(()).ok().map(|()| (tx, busy))
        }
        Err(e) => {
            warn!(error = %e, "cannot start a thread to read the tokens file; the tokens in force stay");
            None
        }
    }
}

/// SIGHUP, which makes `serve` read its tokens file again: listened for from the moment it is
/// installed (before, a SIGHUP would end the process).
struct Hangups {
    #[cfg(unix)]
    hup: tokio::signal::unix::Signal,
}

impl Hangups {
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                hup: signal(SignalKind::hangup()).context("cannot listen for SIGHUP")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves on each SIGHUP; never where there is none.
    async fn recv(&mut self) {
        #[cfg(unix)]
        if self.hup.recv().await.is_some() {
            return;
        }
        std::future::pending::<()>().await;
    }
}

/// SIGTERM and Ctrl-C (SIGINT), listened for from the moment they are installed.
pub(crate) struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                term: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
                int: signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves on the first signal, with its name (`SIGTERM` or `SIGINT`).
    pub(crate) async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
        #[cfg(not(unix))]
        {
            // If Ctrl-C cannot be listened for, only a server failure ends the run.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
            "Ctrl-C"
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn a_listen_address_is_an_ip_and_a_port_and_the_error_says_what_is_wrong() {
        for ok in [
            "127.0.0.1:0",
            "[::1]:7470",
            "0.0.0.0:7470",
            "[::]:0",
            " 127.0.0.1:1 ",
        ] {
            assert!(listen_address(ok).is_ok(), "{ok}");
        }
        for (bad, says) in [
            ("localhost:0", "not an IP address"),
            ("cp.example:7470", "not an IP address"),
            ("127.0.0.1", "no port: write 127.0.0.1:PORT"),
            ("::1", "no port: write [::1]:PORT"),
            ("[::1]", "no port: write [::1]:PORT"),
            ("127.0.0.1:70000", "from 0 to 65535"),
            ("[::1]:70000", "from 0 to 65535"),
            ("127.0.0.1:", "from 0 to 65535"),
            ("::1:7470", "no port: write [::1:7470]:PORT"),
            ("::1:99999", "in brackets"),
            ("", "not an IP address and port"),
            (":7470", "not an IP address and port"),
            ("http://127.0.0.1:7470/", "not a URL: write 127.0.0.1:7470,"),
            (
                "127.0.0.1:7470:",
                "a `:` too many after the port: write 127.0.0.1:7470",
            ),
            ("[127.0.0.1]:7470", "without brackets: write 127.0.0.1:7470"),
            ("[::1%lo]:0", "the interface's number"),
        ] {
            let e = listen_address(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> ServeConfig {
        let cli = Cli::try_parse_from(["retryplane", "serve"].iter().chain(args)).unwrap();
        match cli.command {
            Command::Serve(args) => args.into(),
            other => panic!("parsed as {other:?}"),
        }
    }

    /// A removed flag is refused with what replaced it (exit 2, as any usage error), not
    /// with clap's guess at the nearest name; it is not in the help.
    #[test]
    fn the_removed_max_connection_age_names_what_replaced_it() {
        for args in [
            &["retryplane", "serve", "--max-connection-age", "5m"][..],
            &["retryplane", "serve", "--max-connection-age"],
        ] {
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            let text = e.to_string();
            assert!(
                text.contains("--max-connection-age was removed")
                    && text.contains("--connection-idle-timeout"),
                "{text}"
            );
        }
        let help = Cli::try_parse_from(["retryplane", "serve", "--help"])
            .unwrap_err()
            .to_string();
        assert!(!help.contains("max-connection-age"), "{help}");
    }

    /// Reads of the tokens file for the reload tests: each waits for a go-ahead from the test
    /// (`release`), and counts itself begun and ended.
    #[derive(Default)]
    struct Reads {
        /// Reads begun and ended, told to `until` by `changed`.
        counts: Mutex<(usize, usize)>,
        changed: std::sync::Condvar,
        gates: Mutex<Vec<std::sync::mpsc::Receiver<()>>>,
    }

    impl Reads {
        /// A reload that takes the next gate and waits on it.
        fn reload(
            self: &Arc<Self>,
        ) -> impl Fn() -> Result<Option<usize>, retryplane_server::auth::TokensError> + Send + 'static
        {
            let reads = self.clone();
            move || {
                let count = |f: fn(&mut (usize, usize))| {
                    f(&mut reads.counts.lock().unwrap());
                    reads.changed.notify_all();
                };
                count(|c| c.0 += 1);
                let gate = reads.gates.lock().unwrap().remove(0);
                let _ = gate.recv();
                count(|c| c.1 += 1);
                Ok(Some(1))
            }
        }

        /// A gate for one more read; sending on it lets that read end.
        fn gate(&self) -> std::sync::mpsc::Sender<()> {
            let (go, gate) = std::sync::mpsc::channel();
            self.gates.lock().unwrap().push(gate);
            go
        }

        /// Waits (bounded) until `n` reads have begun and `m` have ended.
        fn until(&self, n: usize, m: usize) {
            let counts = self.counts.lock().unwrap();
            let (counts, waited) = self
                .changed
                .wait_timeout_while(counts, Duration::from_secs(10), |c| *c != (n, m))
                .unwrap();
            assert!(
                !waited.timed_out(),
                "begun and ended {counts:?}; waited for {n}, {m}"
            );
        }
    }

    /// A read of the tokens file that does not end does not hold the SIGHUPs after it: once it
    /// has run for the stuck time (none here), the next SIGHUP reads on a new thread, and the
    /// stuck one is let go of once it ends.
    #[test]
    fn a_read_that_does_not_end_does_not_hold_later_sighups() {
        let reads = Arc::new(Reads::default());
        let mut reloads = Reloads::new(Duration::ZERO);
        let stuck = reads.gate();
        reloads.hangup(|| reads.reload());
        reads.until(1, 0);
        let second = reads.gate();
        reloads.hangup(|| reads.reload());
        reads.until(2, 0);
        second.send(()).unwrap();
        reads.until(2, 1);
        assert_eq!(reloads.stuck.len(), 1);
        // The stuck read ends: let go of at the next SIGHUP, which the idle thread reads.
        stuck.send(()).unwrap();
        reads.until(2, 2);
        // Each thread marks itself idle just after its read returns (bounded: microseconds).
        let idle = |busy: &Busy| busy.lock().unwrap().is_none();
        let mut turns = 0;
        while !(reloads.stuck.iter().all(idle)
            && reloads.current.as_ref().is_some_and(|(_, b)| idle(b)))
        {
            turns += 1;
            assert!(
                turns < 10_000_000,
                "the reload threads were not marked idle"
            );
            std::thread::yield_now();
        }
        let third = reads.gate();
        reloads.hangup(|| reads.reload());
        reads.until(3, 2);
        third.send(()).unwrap();
        reads.until(3, 3);
        assert!(reloads.stuck.is_empty());
    }

    /// Before the stuck time, SIGHUPs during a read wait their turn on the same thread, and
    /// any number of them make one more read.
    #[test]
    fn sighups_during_a_read_make_one_more_on_the_same_thread() {
        let reads = Arc::new(Reads::default());
        let mut reloads = Reloads::new(Duration::from_secs(3600));
        let first = reads.gate();
        reloads.hangup(|| reads.reload());
        reads.until(1, 0);
        let next = reads.gate();
        for _ in 0..3 {
            reloads.hangup(|| -> fn() -> Result<Option<usize>, _> {
                panic!("a new thread was started while the read ran")
            });
        }
        first.send(()).unwrap();
        reads.until(2, 1);
        next.send(()).unwrap();
        reads.until(2, 2);
        assert!(reloads.stuck.is_empty());
    }

    #[test]
    fn the_log_filter_keeps_notify_to_errors_unless_rust_log_names_it() {
        assert_eq!(filter_spec(None), "info,notify=error");
        assert_eq!(filter_spec(Some(" ".to_owned())), "info,notify=error");
        assert_eq!(
            filter_spec(Some("retryplane_server=debug".to_owned())),
            "retryplane_server=debug,notify=error"
        );
        assert_eq!(
            filter_spec(Some("info,notify=debug".to_owned())),
            "info,notify=debug"
        );
        assert!(EnvFilter::try_new(filter_spec(None)).is_ok());
    }

    #[test]
    fn flag_defaults_are_the_server_defaults() {
        let parsed = parse(&[]);
        let defaults = ServeConfig::default();
        assert_eq!(parsed.config_file, defaults.config_file);
        assert_eq!(parsed.data_dir, defaults.data_dir);
        assert_eq!(
            (parsed.listen, parsed.admin_listen, parsed.http_listen),
            (defaults.listen, defaults.admin_listen, defaults.http_listen)
        );
        assert_eq!(parsed.tokens_file, None);
        assert!(!parsed.api_mode && !parsed.insecure);
        assert_eq!(
            (parsed.keepalive_interval, parsed.keepalive_timeout),
            (defaults.keepalive_interval, defaults.keepalive_timeout)
        );
        assert_eq!(parsed.metrics_interval, defaults.metrics_interval);
        assert_eq!(
            parsed.connection_idle_timeout,
            defaults.connection_idle_timeout
        );
        assert_eq!(
            (
                parsed.max_agents,
                parsed.max_series,
                parsed.max_series_per_service
            ),
            (
                defaults.max_agents,
                defaults.max_series,
                defaults.max_series_per_service
            )
        );
        assert_eq!(
            parsed.stream_limits.max_pending_handshakes,
            defaults.stream_limits.max_pending_handshakes
        );
        assert_eq!(
            parsed.stream_limits.max_inbound_bytes,
            defaults.stream_limits.max_inbound_bytes
        );
        assert_eq!(parsed.max_agent_connections, defaults.max_agent_connections);
        assert_eq!(
            parsed.max_streams_per_connection,
            defaults.max_streams_per_connection
        );
        assert_eq!(
            parsed.forget_disconnected_after,
            defaults.forget_disconnected_after
        );
    }

    #[test]
    fn the_config_flags_help_names_the_server_default() {
        // Written by hand (the flag has no clap default, so that a path given can be told
        // from the default): it must not drift from `ServeConfig::default`.
        use clap::CommandFactory as _;
        let mut cli = Cli::command();
        let help = cli
            .find_subcommand_mut("serve")
            .unwrap()
            .render_long_help()
            .to_string();
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        let default = ServeConfig::default().config_file;
        assert!(
            help.contains(&format!("[default: {}]", default.display())),
            "{help}"
        );
    }

    #[test]
    fn flags_override_the_defaults() {
        let parsed = parse(&[
            "--config",
            "p.yaml",
            "--data-dir",
            "/var/lib/retryplane",
            "--listen",
            "0.0.0.0:9000",
            "--tokens",
            "tokens.yaml",
            "--api",
            "--insecure",
            "--keepalive-interval",
            "1m",
            "--keepalive-timeout",
            "5s",
            "--max-streams-per-connection",
            "64",
            "--connection-idle-timeout",
            "30m",
            "--forget-disconnected-after",
            "15m",
            "--max-agent-connections",
            "500",
            "--max-inbound-mib",
            "64",
        ]);
        assert_eq!(parsed.max_agent_connections, Some(500));
        assert_eq!(parsed.stream_limits.max_inbound_bytes, 64 << 20);
        assert_eq!(parsed.config_file, PathBuf::from("p.yaml"));
        assert_eq!(parsed.listen.port(), 9000);
        assert_eq!(parsed.tokens_file, Some(PathBuf::from("tokens.yaml")));
        assert!(parsed.api_mode && parsed.insecure);
        assert!(
            parsed.seed_required,
            "a seed file named on the command line"
        );
        assert!(!parse(&[]).seed_required, "the default path");
        assert_eq!(parsed.keepalive_interval, Duration::from_secs(60));
        assert_eq!(parsed.keepalive_timeout, Duration::from_secs(5));
        assert_eq!(parsed.max_streams_per_connection, 64);
        assert_eq!(parsed.connection_idle_timeout, Duration::from_secs(1800));
        assert_eq!(
            parsed.forget_disconnected_after,
            Some(Duration::from_secs(900))
        );
        let kept = parse(&["--forget-disconnected-after", "0"]);
        assert_eq!(kept.forget_disconnected_after, None);
        let kept = parse(&["--forget-disconnected-after", "0s"]);
        assert_eq!(kept.forget_disconnected_after, None);
    }

    /// The room for messages under way takes the largest agent message.
    #[test]
    fn max_inbound_mib_holds_the_largest_agent_message() {
        assert_eq!(
            inbound_mib("1").unwrap_err(),
            "must be at least 2: the largest message an agent sends (1114112 bytes) must fit"
        );
        assert!(inbound_mib("0").is_err());
        assert_eq!(inbound_mib("2"), Ok(2));
        assert_eq!(
            inbound_mib(&(usize::MAX >> 19).to_string()).unwrap_err(),
            format!("must be at most {}", usize::MAX >> 20)
        );
    }

    #[test]
    fn a_duration_without_its_unit_is_told_the_range_not_an_example_outside_it() {
        assert_eq!(
            metrics_interval("0").unwrap_err(),
            "duration `0` needs a unit (ms, s, m or h): from 100ms to 1h"
        );
        assert_eq!(
            keepalive("20").unwrap_err(),
            "duration `20` needs a unit (ms, s, m or h): from 1s to 1h"
        );
        assert_eq!(metrics_interval("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(
            idle_timeout("500ms").unwrap_err(),
            "`500ms` is out of range: from 1s to 24h"
        );
        assert_eq!(idle_timeout("24h"), Ok(Duration::from_secs(86_400)));
        // Past what a policy file's duration may be: still the flag's own range.
        assert_eq!(
            keepalive("25h").unwrap_err(),
            "`25h` is out of range: from 1s to 1h, in whole milliseconds"
        );
        assert_eq!(
            metrics_interval("1.5ms").unwrap_err(),
            "`1.5ms` is out of range: from 100ms to 1h, in whole milliseconds"
        );
        assert_eq!(
            idle_timeout("86401s").unwrap_err(),
            "`86401s` is out of range: from 1s to 24h, in whole milliseconds"
        );
    }

    /// A link-local address with its zone by number (which `listen_address` takes) and a
    /// port past 65535 is told its zone must be the interface's number, which it is; the
    /// port is what is wrong.
    #[test]
    fn a_numbered_zone_with_a_bad_port_is_told_about_the_port() {
        assert!(listen_address("[fe80::1%2]:7470").is_ok());
        let e = listen_address("[fe80::1%2]:99999").unwrap_err();
        assert!(
            e.contains("port") && !e.contains("interface's number"),
            "{e}"
        );
    }

    /// A URL given as a listen address is told to write its address only when the listener
    /// takes that address (not a host name, not one without a port), and never with the
    /// URL's `user:password@`.
    #[test]
    fn what_a_url_given_as_a_listen_address_is_told_to_write_is_taken() {
        for url in [
            "http://127.0.0.1:7470/",
            "http://localhost:7470",
            "http://127.0.0.1",
            "http://ops:s3cret@127.0.0.1:7470",
        ] {
            let e = listen_address(url).unwrap_err();
            assert!(!e.contains("s3cret"), "{url}: {e}");
            let suggested = e
                .split_once("write ")
                .and_then(|(_, rest)| rest.split_once(','))
                .map(|(s, _)| s);
            assert!(
                suggested.is_none_or(|s| listen_address(s).is_ok()),
                "{url}: {e}"
            );
        }
    }
}
