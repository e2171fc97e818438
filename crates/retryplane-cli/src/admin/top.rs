//! `retryplane top [--interval 2s] [--window 1m|5m|15m] [--iterations N] [--output json]`: a
//! live view of the fleet's retry metrics, refreshed every interval, like `top` or
//! `kubectl top`.
//!
//! Every refresh calls `FleetStatus` (the current version and the count of connected agents,
//! without the agent list) and `Stats`; on a terminal, `Stats` asks for only as many series as
//! the screen has rows, ranked worst first by the server, which counts the rest, so a refresh
//! stays small with thousands of series. It shows one header line — the time of the figures
//! (UTC), the server, the current policy version, connected agents, series and how many of them
//! alert — then one row per (service, endpoint), highest retry ratio first over the chosen
//! window (default `1m`):
//! `! ENDPOINT SERVICE CALLS/S RETRIES/S RETRY% FIRST-TRY VERSION GIVE-UPS`, where `!` marks a
//! series whose 5-minute retry ratio is past its threshold (the columns are those of
//! `retryplane stats`).
//!
//! Two modes, chosen by whether stdout is a terminal:
//!
//! - **terminal**: the view takes the alternate screen and redraws in place; it fits the
//!   terminal (names are shortened with `…` to fit the width, the rows with the highest ratios
//!   are kept to fit the height). `q`, `Q`, Esc or Ctrl-C (and SIGTERM) end it with exit 0. A
//!   failed refresh (server down, refused) shows on the second header line and the view keeps
//!   the last figures and tries again at the next interval. The terminal is restored on every
//!   way out: the normal one, an error, and a panic (a guard and a panic hook).
//! - **plain** (stdout is a pipe or a file): the same header and table as text, once per
//!   interval, blocks separated by a blank line, no escape codes and no truncation. Like
//!   `top -b`, it runs until stopped (Ctrl-C or SIGTERM end it with exit 0) unless
//!   `--iterations N` is given. The first refresh must answer: if it fails, the run ends like
//!   the other admin commands (exit 1 when the server refused, 2 when it could not be
//!   reached). After it, a refresh that fails other than by a refusal (the server cannot be
//!   reached, as during a restart of the control plane, or gives no answer within the admin
//!   commands' 30 s, or an error) is said on stderr, `retryplane: warning: refresh failed
//!   (retrying every 2s): …`, nothing is printed on stdout for it, and the next interval
//!   connects anew; a refusal (a token taken away) still ends the run with exit 1. A failed
//!   refresh counts toward `--iterations`, and a run that ends on one exits 2.
//!
//! `--iterations N` stops after N refreshes in both modes.
//!
//! `--output json` is the plain mode for programs, on a terminal or not: one JSON object per
//! refresh on a line of its own (JSON Lines), so `retryplane top --output json | jq` follows the
//! fleet as it changes. Each object has the keys (serialized in alphabetical order)
//! `{"taken", "taken_unix_ms", "server", "current_version", "agents", "window", "stats"}`
//! (`taken` is the header's time, RFC 3339 UTC), where `stats` is the whole document
//! of `retryplane stats --output json` (every series, every window's rates, the lifetime
//! totals and the alerts); `window` only names the window the text view would rank by.

use std::fmt::Write as _;
use std::future::Future;
use std::io::{self, IsTerminal as _, Write as _};
use std::pin::Pin;
use std::time::Duration;

use anyhow::Context as _;
use crossterm::event::{Event, EventStream, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use retryplane_policy::duration::parse_duration;
use tokio::time::{self, MissedTickBehavior};
use tokio_stream::StreamExt as _;
use tonic::Status;
use unicode_width::UnicodeWidthStr;

use super::client::Client;
use super::metrics::{self, Window, WindowArg};
use super::stats::stats_json;
use super::time::rfc3339_utc;
use super::{Server, ServerArgs, block_on, status_line};
use crate::output::{self, Align, Format};
use crate::serve::Signals;
use crate::{Outcome, Report};
use retryplane_proto::pb;

/// The shortest `--interval`: a refresh is two admin calls.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// `retryplane top` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Time between refreshes (at least 100ms).
    #[arg(long, value_name = "D", default_value = "2s", value_parser = interval)]
    interval: Duration,
    /// The trailing window that rates and ratios are taken over.
    #[arg(long, value_enum, default_value = "1m")]
    window: WindowArg,
    /// Stop after N refreshes, failed ones included (off a terminal or with `--output json`, a
    /// run that ends on a failed one exits 2) [default: run until q, Ctrl-C or SIGTERM (only Ctrl-C or SIGTERM
    /// when stdout is not a terminal or with `--output json`), like `top -b`].
    #[arg(long, value_name = "N", value_parser = crate::flags::at_least_one)]
    iterations: Option<u64>,
    /// Output format, `text` or `json`: `json` prints one JSON object per refresh, each on a
    /// line of its own (JSON Lines), and never takes over the terminal.
    #[arg(
        long,
        value_enum,
        default_value_t,
        alias = "format",
        hide_possible_values = true
    )]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

fn interval(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text).map_err(|e| match e {
        // A policy file's example (`2ms`) may be under the shortest interval.
        retryplane_policy::duration::DurationError::MissingUnit(_) => format!(
            "duration `{text}` needs a unit (ms, s, m or h): at least {}",
            every(MIN_INTERVAL)
        ),
        e => e.to_string(),
    })?;
    if d < MIN_INTERVAL {
        return Err(format!("{text} is too short: refresh at most every 100ms"));
    }
    Ok(d)
}

/// What to show, checked once.
#[derive(Debug)]
pub struct Settings {
    /// Time between refreshes.
    pub interval: Duration,
    /// The window of rates and ratios.
    pub window: Window,
    /// Stop after this many refreshes; `None` runs until stopped.
    pub iterations: Option<u64>,
    /// Text (the view) or JSON Lines.
    pub format: Format,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        Ok(Self {
            interval: args.interval,
            window: args.window.0,
            iterations: args.iterations,
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Runs the view: on the terminal when stdout is one and text is asked for, else as plain text
/// or JSON Lines.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    if settings.format == Format::Text && io::stdout().is_terminal() {
        block_on(interactive(settings))
    } else {
        block_on(plain(settings))
    }
}

/// What one refresh brought.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The version the control plane publishes.
    pub current_version: u64,
    /// Agents connected now.
    pub agents: usize,
    /// The metrics.
    pub stats: pb::StatsResponse,
    /// When the figures were taken (the server's clock if it says, else ours), Unix ms.
    pub taken_unix_ms: u64,
}

/// One refresh. With a `limit` (on a terminal: the rows that fit), the server sends only that
/// many series, worst first over `window`, and the counts of the rest; without (plain mode),
/// every series. The per-endpoint lifetime totals come only with `totals` (JSON: the view
/// does not show them). The agent list is never fetched: only its counts are shown.
async fn poll(
    client: &mut Client,
    window: Window,
    limit: Option<usize>,
    totals: bool,
) -> Result<Snapshot, Status> {
    let fleet = client
        .fleet_status_with(pb::FleetStatusRequest {
            counts_only: true,
            ..Default::default()
        })
        .await?;
    let request = pb::StatsRequest {
        limit: limit.map_or(0, |n| u32::try_from(n.max(1)).unwrap_or(u32::MAX)),
        order_window_seconds: window.seconds(),
        series_only: !totals,
        ..Default::default()
    };
    let stats = client.stats(request).await?;
    let taken_unix_ms = match stats.now_unix_ms {
        0 => super::time::now_unix_ms(),
        ms => ms,
    };
    // A control plane that predates the counts sends the whole list and no count.
    let listed = fleet.agents.iter().filter(|a| a.connected).count();
    let agents = usize::try_from(fleet.connected_agents)
        .unwrap_or(usize::MAX)
        .max(listed);
    Ok(Snapshot {
        current_version: fleet.current_version,
        agents,
        stats,
        taken_unix_ms,
    })
}

/// A refresh that did not answer.
enum Unanswered {
    /// Connecting anew failed.
    Connect(anyhow::Error),
    /// A call failed, or the server refused it.
    Call(Status),
}

impl Unanswered {
    /// What went wrong, on one line.
    fn message(&self) -> String {
        match self {
            Unanswered::Call(status) => status_line(status),
            Unanswered::Connect(e) => retryplane_server::ErrorChain(e.as_ref()).to_string(),
        }
    }
}

/// One refresh (see [`poll`] for `limit` and `totals`), connecting first when the last one
/// failed (`client` is `None` then, and again after a failure).
async fn refresh(
    server: &Server,
    client: &mut Option<Client>,
    window: Window,
    limit: Option<usize>,
    totals: bool,
) -> Result<Snapshot, Unanswered> {
    let mut connected = match client.take() {
        Some(c) => c,
        None => Client::connect(server).await.map_err(Unanswered::Connect)?,
    };
    let snapshot = poll(&mut connected, window, limit, totals)
        .await
        .map_err(Unanswered::Call)?;
    *client = Some(connected);
    Ok(snapshot)
}

/// `interval` as the error lines say it (`2s`).
fn every(interval: Duration) -> String {
    metrics::compact_ms(u64::try_from(interval.as_millis()).unwrap_or(u64::MAX))
}

/// Plain mode; see the module docs.
async fn plain(settings: &Settings) -> anyhow::Result<Report> {
    let mut signals = Signals::install()?;
    let mut client = Some(Client::connect(&settings.server).await?);
    let mut ticker = time::interval(settings.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut refreshes = 0_u64;
    let mut answered = false;
    let outcome = loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = signals.recv() => break Outcome::Success,
        }
        let polled = tokio::select! {
            polled = refresh(&settings.server, &mut client, settings.window, None, settings.format == Format::Json) => polled,
            _ = signals.recv() => break Outcome::Success,
        };
        let snapshot = match polled {
            Ok(snapshot) => snapshot,
            // Before any answer (a mistyped --server), or a refusal: as the other commands.
            Err(Unanswered::Call(status)) if !answered || super::refused(status.code()) => {
                return Ok(super::failed(&status, String::new()));
            }
            Err(failure) => {
                crate::output::note(format_args!(
                    "retryplane: warning: refresh failed (retrying every {}): {}",
                    every(settings.interval),
                    crate::output::spaced(&failure.message())
                ));
                refreshes += 1;
                if settings.iterations.is_some_and(|n| refreshes >= n) {
                    // What it last knew is that the server could not be reached.
                    break Outcome::Error;
                }
                continue;
            }
        };
        answered = true;
        let block = match settings.format {
            Format::Json => json_line(&settings.server.url, settings.window, &snapshot)?,
            Format::Text => {
                let view = View {
                    server: &settings.server.url,
                    window: settings.window,
                    snapshot: Some(&snapshot),
                    error: None,
                    interactive: false,
                    interval: settings.interval,
                };
                let mut block = String::new();
                if refreshes > 0 {
                    block.push('\n');
                }
                for line in render(&view, None) {
                    block.push_str(&line);
                    block.push('\n');
                }
                block
            }
        };
        match write_stdout(&block) {
            Ok(()) => {}
            // The reader went away (`retryplane top | head`): nothing more to show.
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => break Outcome::Success,
            Err(e) => return Err(e).context("cannot write to stdout"),
        }
        refreshes += 1;
        if settings.iterations.is_some_and(|n| refreshes >= n) {
            break Outcome::Success;
        }
    };
    Ok(Report {
        stdout: String::new(),
        outcome,
    })
}

/// One refresh as a JSON object on one line; see the module docs.
fn json_line(server: &str, window: Window, snapshot: &Snapshot) -> anyhow::Result<String> {
    let value = serde_json::json!({
        "taken": rfc3339_utc(snapshot.taken_unix_ms),
        "taken_unix_ms": snapshot.taken_unix_ms,
        "server": server,
        "current_version": snapshot.current_version,
        "agents": snapshot.agents,
        "window": window.label(),
        "stats": stats_json(&snapshot.stats),
    });
    let mut line = serde_json::to_string(&value)?;
    line.push('\n');
    Ok(line)
}

fn write_stdout(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// A refresh in flight: it owns the client and gives it back (`None` after a failure, so that
/// the next refresh connects anew).
type Fetch = Pin<Box<dyn Future<Output = (Option<Client>, Result<Snapshot, String>)>>>;

async fn fetch(
    server: Server,
    mut client: Option<Client>,
    window: Window,
    limit: usize,
) -> (Option<Client>, Result<Snapshot, String>) {
    let result = refresh(&server, &mut client, window, Some(limit), false)
        .await
        .map_err(|failure| failure.message());
    (client, result)
}

/// Resolves with the fetch's result, or never when none is in flight.
async fn finished(fetch: &mut Option<Fetch>) -> (Option<Client>, Result<Snapshot, String>) {
    match fetch.as_mut() {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// What a terminal event asks for.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Quit,
    Redraw,
    Nothing,
}

/// `q`, `Q`, Esc and Ctrl-C quit; a resize redraws.
fn action(event: &Event) -> Action {
    match event {
        Event::Key(KeyEvent {
            code,
            modifiers,
            kind: KeyEventKind::Press | KeyEventKind::Repeat,
            ..
        }) => match code {
            KeyCode::Char('q' | 'Q') | KeyCode::Esc => Action::Quit,
            KeyCode::Char('c' | 'C') if modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
            _ => Action::Nothing,
        },
        Event::Resize(..) => Action::Redraw,
        _ => Action::Nothing,
    }
}

/// Terminal mode; see the module docs.
async fn interactive(settings: &Settings) -> anyhow::Result<Report> {
    let mut signals = Signals::install()?;
    let terminal = terminal::Terminal::enter()?;
    let mut keys = EventStream::new();
    let mut keys_open = true;
    let mut snapshot: Option<Snapshot> = None;
    let mut error: Option<String> = None;
    let draw = |snapshot: &Option<Snapshot>, error: &Option<String>| {
        let view = View {
            server: &settings.server.url,
            window: settings.window,
            snapshot: snapshot.as_ref(),
            error: error.as_deref(),
            interactive: true,
            interval: settings.interval,
        };
        terminal.draw(&render(&view, Some(terminal::size())))
    };
    draw(&snapshot, &error).context("cannot draw on the terminal")?;

    let mut ticker = time::interval(settings.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut client: Option<Client> = None;
    let mut in_flight: Option<Fetch> = None;
    let mut refreshes = 0_u64;
    // The screen height the last refresh asked for.
    let mut asked = 0;
    loop {
        tokio::select! {
            _ = ticker.tick(), if in_flight.is_none() => {
                // No more series than the screen has rows (the server ranks them).
                let (_, rows) = terminal::size();
                asked = rows;
                in_flight = Some(Box::pin(fetch(
                    settings.server.clone(),
                    client.take(),
                    settings.window,
                    rows,
                )));
            }
            (back, result) = finished(&mut in_flight) => {
                in_flight = None;
                client = back;
                match result {
                    Ok(s) => {
                        snapshot = Some(s);
                        error = None;
                    }
                    Err(e) => error = Some(e),
                }
                draw(&snapshot, &error).context("cannot draw on the terminal")?;
                refreshes += 1;
                if settings.iterations.is_some_and(|n| refreshes >= n) {
                    break;
                }
            }
            event = keys.next(), if keys_open => match event {
                Some(Ok(event)) => match action(&event) {
                    Action::Quit => break,
                    Action::Redraw => {
                        draw(&snapshot, &error).context("cannot draw on the terminal")?;
                        // Taller than what the last refresh asked for: refresh now rather
                        // than show blank rows until the next tick.
                        if terminal::size().1 > asked {
                            ticker.reset_immediately();
                        }
                    }
                    Action::Nothing => {}
                },
                Some(Err(e)) => return Err(e).context("cannot read keys from the terminal"),
                // No more input will come: only a signal (or --iterations) ends the view now.
                None => keys_open = false,
            },
            _ = signals.recv() => break,
        }
    }
    drop(terminal);
    Ok(Report {
        stdout: String::new(),
        outcome: Outcome::Success,
    })
}

/// What one screen (or one plain block) shows.
#[derive(Debug)]
pub struct View<'a> {
    /// The server's URL.
    pub server: &'a str,
    /// The window of rates and ratios.
    pub window: Window,
    /// The last figures, if any came.
    pub snapshot: Option<&'a Snapshot>,
    /// Why the last refresh failed, when it did.
    pub error: Option<&'a str>,
    /// On a terminal: a second header line with the error or the keys.
    pub interactive: bool,
    /// Time between refreshes, for the error line.
    pub interval: Duration,
}

/// The screen's lines: the header, then the table. With a `size` (columns, rows) every line
/// fits the width and the lines fit the height; without, nothing is cut (plain mode).
pub fn render(view: &View<'_>, size: Option<(usize, usize)>) -> Vec<String> {
    let mut lines = vec![header(view)];
    if view.interactive {
        lines.push(match view.error {
            Some(e) => format!(
                "error (retrying every {}): {}",
                every(view.interval),
                crate::output::spaced(e)
            ),
            None => "q: quit".to_owned(),
        });
    }
    let empty = pb::StatsResponse::default();
    let stats = view.snapshot.map_or(&empty, |s| &s.stats);
    let mut rows = metrics::rows(stats, view.window);
    metrics::sort_by_ratio(&mut rows);
    let mut cells = vec![
        [
            " ",
            "ENDPOINT",
            "SERVICE",
            "CALLS/S",
            "RETRIES/S",
            "RETRY%",
            "FIRST-TRY",
            "VERSION",
            "GIVE-UPS",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    let any_young = rows.iter().any(metrics::Row::young);
    if any_young {
        lines[0].push_str(YOUNG_NOTE);
    }
    for row in &rows {
        let [calls, retries] = row.marked_rates(any_young);
        cells.push(vec![
            if row.alerting() { "!" } else { " " }.to_owned(),
            crate::output::name(&row.series.endpoint),
            metrics::service_name(&row.series.service),
            calls,
            retries,
            metrics::percent(row.rates.retry_ratio),
            metrics::percent(row.rates.first_try_success),
            metrics::versions(row.series, row.window.map(|w| w.window_seconds)),
            metrics::give_ups(&row.counters()),
        ]);
    }
    // Series that matched on the server: more than `rows` when it sent only the worst.
    let total = series_count(stats).max(rows.len());
    let mut hidden = total - rows.len();
    if let Some((_, height)) = size {
        // Room for the table's header and rows under the header lines.
        let room = height.saturating_sub(lines.len() + 1);
        if total > room {
            // One line says how many rows are not shown.
            let shown = room.saturating_sub(1).min(rows.len());
            hidden = total - shown;
            cells.truncate(1 + shown);
        }
    }
    if let Some((width, _)) = size {
        shorten_names(&mut cells, width);
    }
    use Align::{Left, Right};
    let align = [Left, Left, Left, Right, Right, Right, Right, Left, Left];
    let mut table = String::new();
    output::table(&mut table, "", &align, &cells);
    lines.extend(table.lines().map(str::to_owned));
    if rows.is_empty() {
        lines.push(match view.snapshot {
            Some(_) => "no series reported in the window yet".to_owned(),
            None => "waiting for the first answer".to_owned(),
        });
    }
    if hidden > 0 {
        lines.push(format!("… {hidden} more"));
    }
    if let Some((width, height)) = size {
        lines.truncate(height);
        for line in &mut lines {
            *line = output::fit(line, width);
        }
    }
    lines
}

/// Ends the header when a row's rates are marked young (see [`metrics::Row::young`]).
const YOUNG_NOTE: &str = "  (*: rate over under half the window, a young series)";

/// `TIME  SERVER  vN  A agents  S series  K alerting  window W`.
fn header(view: &View<'_>) -> String {
    let Some(s) = view.snapshot else {
        return format!("{}  window {}", view.server, view.window.label());
    };
    let listed_alerting = s
        .stats
        .series
        .iter()
        .filter(|series| series.alert.is_some_and(|a| a.firing))
        .count();
    let alerting = usize::try_from(s.stats.firing_series)
        .unwrap_or(usize::MAX)
        .max(listed_alerting);
    let version = match s.current_version {
        0 => "no version yet".to_owned(),
        v => format!("v{v}"),
    };
    let mut line = format!(
        "{}  {}  {version}  {} agent{}  {} series  {alerting} alerting  window {}",
        rfc3339_utc(s.taken_unix_ms),
        view.server,
        s.agents,
        if s.agents == 1 { "" } else { "s" },
        series_count(&s.stats),
        view.window.label(),
    );
    if s.stats.overflowed_reports > 0 {
        let _ = write!(
            line,
            "  {} reports counted in \"other\" (see retryplane stats)",
            s.stats.overflowed_reports
        );
    }
    line
}

/// The series that matched on the server, of which `stats.series` may be the worst only (a
/// control plane that predates the count sends every series and no count).
fn series_count(stats: &pb::StatsResponse) -> usize {
    usize::try_from(stats.matched_series)
        .unwrap_or(usize::MAX)
        .max(stats.series.len())
}

/// Index of the endpoint and service columns.
const ENDPOINT: usize = 1;
const SERVICE: usize = 2;
/// Names are not shortened below this many characters (the line is cut instead).
const MIN_NAME: usize = 6;

/// Shortens the endpoint and service columns so that the table fits `width`: the longer name
/// gives up characters first.
fn shorten_names(cells: &mut [Vec<String>], width: usize) {
    let widths: Vec<usize> = (0..cells.first().map_or(0, Vec::len))
        .map(|c| {
            cells
                .iter()
                .filter_map(|r| r.get(c))
                .map(|cell| UnicodeWidthStr::width(cell.as_str()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let total = widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1);
    let (Some(&endpoint), Some(&service)) = (widths.get(ENDPOINT), widths.get(SERVICE)) else {
        return;
    };
    if total <= width {
        return;
    }
    let floor = endpoint.min(MIN_NAME) + service.min(MIN_NAME);
    let budget = (endpoint + service)
        .saturating_sub(total - width)
        .max(floor);
    let (endpoint_width, service_width) = share(budget, endpoint, service);
    for row in cells.iter_mut() {
        if let Some(cell) = row.get_mut(ENDPOINT) {
            *cell = output::fit(cell, endpoint_width);
        }
        if let Some(cell) = row.get_mut(SERVICE) {
            *cell = output::fit(cell, service_width);
        }
    }
}

/// Splits `budget` characters between two columns `a` and `b` wide: the narrower keeps its
/// width if it fits in half, the wider takes the rest.
fn share(budget: usize, a: usize, b: usize) -> (usize, usize) {
    if a + b <= budget {
        return (a, b);
    }
    let half = budget / 2;
    if a <= half {
        (a, budget - a)
    } else if b <= budget - half {
        (budget - b, b)
    } else {
        (half, budget - half)
    }
}

/// The terminal in raw mode on the alternate screen, restored however the view ends.
mod terminal {
    use std::io::{self, Write as _};
    use std::sync::Once;
    use std::sync::atomic::{AtomicBool, Ordering};

    use anyhow::Context as _;
    use crossterm::cursor::{Hide, MoveTo, Show};
    use crossterm::style::Print;
    use crossterm::terminal::{
        self as term, Clear, ClearType, EnterAlternateScreen, LeaveAlternateScreen,
    };
    use crossterm::{execute, queue};

    /// Whether the terminal is in the view's state and needs restoring.
    static ACTIVE: AtomicBool = AtomicBool::new(false);
    static PANIC_HOOK: Once = Once::new();

    /// The size used when the terminal does not tell its own.
    const FALLBACK_SIZE: (usize, usize) = (80, 24);

    /// While alive, the terminal is in raw mode on the alternate screen with the cursor
    /// hidden; dropping it (or a panic) restores the terminal.
    #[derive(Debug)]
    pub struct Terminal(());

    impl Terminal {
        /// Raw mode, alternate screen, hidden cursor; a panic hook restores the terminal
        /// before the panic message is printed.
        pub fn enter() -> anyhow::Result<Self> {
            PANIC_HOOK.call_once(|| {
                let previous = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    restore();
                    previous(info);
                }));
            });
            term::enable_raw_mode().context("cannot put the terminal in raw mode")?;
            ACTIVE.store(true, Ordering::SeqCst);
            // From here on, an early return restores what was changed.
            let guard = Terminal(());
            execute!(io::stdout(), EnterAlternateScreen, Hide)
                .context("cannot switch to the alternate screen")?;
            Ok(guard)
        }

        /// Replaces the screen's contents with `lines` (each already fitting the width).
        pub fn draw(&self, lines: &[String]) -> io::Result<()> {
            let mut out = io::stdout().lock();
            queue!(out, MoveTo(0, 0))?;
            for (row, line) in lines.iter().enumerate() {
                let row = u16::try_from(row).unwrap_or(u16::MAX);
                queue!(
                    out,
                    MoveTo(0, row),
                    Print(line),
                    Clear(ClearType::UntilNewLine)
                )?;
            }
            queue!(out, Clear(ClearType::FromCursorDown))?;
            out.flush()
        }
    }

    impl Drop for Terminal {
        fn drop(&mut self) {
            restore();
        }
    }

    /// (columns, rows), or 80×24 when the terminal does not say.
    pub fn size() -> (usize, usize) {
        match term::size() {
            Ok((w, h)) if w > 0 && h > 0 => (w.into(), h.into()),
            _ => FALLBACK_SIZE,
        }
    }

    /// Leaves the alternate screen, shows the cursor and leaves raw mode, once.
    fn restore() {
        if ACTIVE.swap(false, Ordering::SeqCst) {
            let _ = execute!(io::stdout(), Show, LeaveAlternateScreen);
            let _ = term::disable_raw_mode();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::metrics::tests::{alerting, counters, series};

    fn snapshot(series: Vec<pb::SeriesStats>) -> Snapshot {
        Snapshot {
            current_version: 7,
            agents: 12,
            stats: pb::StatsResponse {
                series,
                ..Default::default()
            },
            taken_unix_ms: 1_764_473_825_000,
        }
    }

    fn view<'a>(s: Option<&'a Snapshot>, interactive: bool) -> View<'a> {
        View {
            server: "http://127.0.0.1:7471",
            window: Window::OneMinute,
            snapshot: s,
            error: None,
            interactive,
            interval: Duration::from_secs(2),
        }
    }

    fn fleet() -> Snapshot {
        snapshot(vec![
            series("checkout", "inventory", counters(600, 6, 594)),
            alerting(
                series(
                    "checkout",
                    "payments-gateway-eu-west",
                    counters(600, 120, 480),
                ),
                0.2,
            ),
            series("search", "idle", counters(0, 0, 0)),
            series("search", "payments-gateway-eu-west", counters(600, 30, 570)),
        ])
    }

    #[test]
    fn plain_output_is_the_whole_table_sorted_by_retry_ratio() {
        let s = fleet();
        let lines = render(&view(Some(&s), false), None);
        assert_eq!(
            lines.join("\n"),
            "\
2025-11-30T03:37:05Z  http://127.0.0.1:7471  v7  12 agents  4 series  1 alerting  window 1m
   ENDPOINT                  SERVICE   CALLS/S  RETRIES/S  RETRY%  FIRST-TRY  VERSION  GIVE-UPS
!  payments-gateway-eu-west  checkout     10.0        2.0   20.0%      80.0%  v7       -
   payments-gateway-eu-west  search       10.0        0.5    5.0%      95.0%  v7       -
   inventory                 checkout     10.0        0.1    1.0%      99.0%  v7       -
   idle                      search        0.0        0.0       -          -  v7       -"
        );
    }

    #[test]
    fn a_young_series_rates_are_marked_and_the_header_says_what_the_mark_means() {
        let mut s = fleet();
        // 1m window: one call in a first report 70 ms long.
        s.stats.series[2].windows[0] =
            crate::admin::metrics::tests::window(60, 0.07, counters(1, 0, 1));
        let lines = render(&view(Some(&s), false), None);
        assert!(lines[0].ends_with(YOUNG_NOTE), "{}", lines[0]);
        let all = lines.join("\n");
        assert!(
            all.contains("   idle                      search      14.3*       0.0*"),
            "{all}"
        );
        assert!(
            all.contains("   inventory                 checkout    10.0        0.1 "),
            "{all}"
        );
        let plain = render(&view(Some(&fleet()), false), None);
        assert!(!plain.join("\n").contains('*'));
    }

    #[test]
    fn before_the_first_version_the_header_says_so_rather_than_v0() {
        let mut s = snapshot(Vec::new());
        s.current_version = 0;
        let lines = render(&view(Some(&s), false), None);
        assert!(
            lines[0].starts_with(
                "2025-11-30T03:37:05Z  http://127.0.0.1:7471  no version yet  12 agents"
            ),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn names_from_agents_cannot_drive_the_terminal() {
        let s = snapshot(vec![series(
            "svc\u{1b}]0;x\u{7}",
            "ep\u{1b}[31mX",
            counters(600, 6, 594),
        )]);
        let lines = render(&view(Some(&s), false), None);
        let all = lines.join("\n");
        assert!(!all.contains('\u{1b}') && !all.contains('\u{7}'), "{all}");
        assert!(
            all.contains(r#""ep\u{1b}[31mX"  "svc\u{1b}]0;x\u{7}""#),
            "{all}"
        );
    }

    #[test]
    fn a_quoted_name_shortened_keeps_its_closing_quote() {
        assert_eq!(output::fit("\"web checkout\"", 8), "\"web c…\"");
        assert_eq!(output::fit("\"web checkout\"", 14), "\"web checkout\"");
        assert_eq!(output::fit("payments-eu", 6), "payme…");
    }

    #[test]
    fn names_are_shortened_to_fit_the_width() {
        let s = fleet();
        let lines = render(&view(Some(&s), true), Some((80, 40)));
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{lines:#?}");
        // 95 columns wide: the endpoint (24 wide) gives up 15 characters; the service (8)
        // keeps its width.
        assert_eq!(
            lines[2],
            "   ENDPOINT   SERVICE   CALLS/S  RETRIES/S  RETRY%  FIRST-TRY  VERSION  GIVE-UPS"
        );
        assert!(
            lines[3].starts_with("!  payments…  checkout     10.0  "),
            "{lines:#?}"
        );
        assert!(
            lines[4].starts_with("   payments…  search       10.0  "),
            "{lines:#?}"
        );
        // Very narrow: every line is cut to the width.
        let narrow = render(&view(Some(&s), true), Some((20, 40)));
        assert!(
            narrow.iter().all(|l| l.chars().count() <= 20),
            "{narrow:#?}"
        );
        // Both names down to 6 characters, and the rest of the line cut.
        assert_eq!(narrow[3], "!  payme…  check…  …");
    }

    #[test]
    fn the_rows_with_the_highest_ratios_are_kept_to_fit_the_height() {
        let s = fleet();
        // Header, keys line, table header: 3 lines; 2 left for 4 rows → 1 row and "… 3 more".
        let lines = render(&view(Some(&s), true), Some((200, 5)));
        assert_eq!(lines.len(), 5, "{lines:#?}");
        assert!(
            lines[3].starts_with("!  payments-gateway-eu-west  checkout"),
            "{lines:#?}"
        );
        assert_eq!(lines[4], "… 3 more");
        let all = render(&view(Some(&s), true), Some((200, 7)));
        assert_eq!(all.len(), 7);
        assert!(all.iter().all(|l| !l.starts_with('…')));
        let tiny = render(&view(Some(&s), true), Some((200, 1)));
        assert_eq!(tiny.len(), 1);
    }

    #[test]
    fn a_server_that_sent_only_the_worst_series_has_the_rest_counted() {
        // 40 series matched on the server, 3 of them alerting; it sent the 2 worst.
        let mut s = snapshot(vec![
            alerting(series("checkout", "payments", counters(600, 120, 480)), 0.2),
            series("search", "payments", counters(600, 30, 570)),
        ]);
        s.stats.matched_series = 40;
        s.stats.firing_series = 3;
        let lines = render(&view(Some(&s), true), Some((200, 24)));
        assert!(
            lines[0].contains("  12 agents  40 series  3 alerting  window 1m"),
            "{lines:#?}"
        );
        assert!(lines[3].starts_with("!  payments  checkout"), "{lines:#?}");
        assert!(lines[4].starts_with("   payments  search"), "{lines:#?}");
        assert_eq!(lines[5], "… 38 more");
        assert_eq!(lines.len(), 6, "{lines:#?}");
        // Fewer rows than it sent: the same count of what is not shown.
        let short = render(&view(Some(&s), true), Some((200, 5)));
        assert_eq!(short[4], "… 39 more");
    }

    #[test]
    fn no_calls_and_no_answer_are_said_in_words() {
        let empty = snapshot(vec![]);
        let lines = render(&view(Some(&empty), false), None);
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert!(lines[0].contains("  0 series  0 alerting  "), "{lines:#?}");
        assert_eq!(lines[2], "no series reported in the window yet");
        let waiting = render(&view(None, true), Some((80, 24)));
        assert_eq!(waiting[0], "http://127.0.0.1:7471  window 1m");
        assert_eq!(waiting[1], "q: quit");
        assert_eq!(waiting[3], "waiting for the first answer");
    }

    #[test]
    fn an_error_shows_in_the_header_and_the_last_figures_stay() {
        let s = fleet();
        let mut v = view(Some(&s), true);
        v.error = Some("UNAVAILABLE: connection\nrefused");
        let lines = render(&v, Some((120, 24)));
        assert_eq!(
            lines[1],
            "error (retrying every 2s): UNAVAILABLE: connection refused"
        );
        assert!(lines[0].starts_with("2025-11-30T03:37:05Z  "), "{lines:#?}");
        assert!(lines[3].starts_with("!  payments"), "{lines:#?}");
    }

    #[test]
    fn quit_keys_and_resizes() {
        let key = |code, modifiers| Event::Key(KeyEvent::new(code, modifiers));
        let none = KeyModifiers::NONE;
        assert_eq!(action(&key(KeyCode::Char('q'), none)), Action::Quit);
        assert_eq!(
            action(&key(KeyCode::Char('Q'), KeyModifiers::SHIFT)),
            Action::Quit
        );
        assert_eq!(action(&key(KeyCode::Esc, none)), Action::Quit);
        assert_eq!(
            action(&key(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Action::Quit
        );
        assert_eq!(action(&key(KeyCode::Char('c'), none)), Action::Nothing);
        assert_eq!(action(&key(KeyCode::Char('x'), none)), Action::Nothing);
        assert_eq!(action(&Event::Resize(100, 30)), Action::Redraw);
    }

    #[test]
    fn names_share_the_room_the_longer_one_first() {
        assert_eq!(share(30, 10, 8), (10, 8));
        assert_eq!(share(16, 24, 8), (8, 8));
        assert_eq!(share(20, 24, 8), (12, 8));
        assert_eq!(share(20, 4, 30), (4, 16));
        assert_eq!(output::fit("payments", 8), "payments");
        assert_eq!(output::fit("payments", 5), "paym…");
        assert_eq!(output::fit("payments", 0), "");
        // By terminal columns: an ideograph takes two.
        assert_eq!(output::fit("支付服务", 8), "支付服务");
        assert_eq!(output::fit("支付服务", 7), "支付服…");
        assert_eq!(output::fit("支付服务", 6), "支付…");
    }

    #[test]
    fn the_interval_has_a_floor() {
        assert_eq!(interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(interval("100ms"), Ok(Duration::from_millis(100)));
        assert!(interval("50ms").is_err());
        assert!(interval("2").is_err());
    }
}
