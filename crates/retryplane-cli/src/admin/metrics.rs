//! The retry metrics of `Stats` (SPEC §4) as `stats`, `top` and `status` show them: rates over
//! a trailing window, ratios, the compact give-up column, the retry-ratio alert, and the JSON
//! shapes of the wire messages.
//!
//! Rates divide a window's counters by the seconds the window covers (`covered_seconds`, less
//! than the window's length while the server or the series is younger than it); a window that
//! covers no time has no rate (`-` in text, `null` in JSON). Ratios divide by the window's
//! logical calls; with no calls there is no ratio either.
//!
//! The give-up column lists the non-zero causes of logical calls that failed in the window,
//! `att:3 bud:1 dl:2 ra:1 nr:4`, circuit-open rejections as `open:2`, and calls their caller
//! cancelled or dropped before they ended as `cancel:5` (`-` when none): `att` attempts
//! exhausted, `bud` retry budget exhausted, `dl` deadline, `ra` a Retry-After hint longer than
//! allowed, `nr` not retryable.

use std::fmt::Write as _;

use retryplane_proto::pb;
use retryplane_proto::rank::{Rank, worst_first};
use retryplane_server::aggregate::window::WINDOWS;
pub use retryplane_server::aggregate::window::Window;
use serde_json::{Value, json};

use super::time::rfc3339_utc;

/// What the give-up column's short names stand for, as `stats --help` and `top --help` say it.
pub const GIVE_UPS_HELP: &str = "GIVE-UPS lists the calls that ended without success in the \
window, by cause: att attempts exhausted, bud retry budget exhausted, dl deadline (reached, or \
a pause that would have passed it), ra a Retry-After hint over retry_after.max, nr not \
retryable, open refused by an open circuit breaker (or stopped by one before a retry), cancel \
cancelled or dropped by their caller; - when none.";

/// `--window`: the trailing window that rates and ratios are taken over, one of the control
/// plane's [`Window`]s by its label (`1m`, `5m`, `15m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowArg(pub Window);

impl Default for WindowArg {
    /// The alert's window.
    fn default() -> Self {
        WindowArg(ALERT_WINDOW)
    }
}

impl clap::ValueEnum for WindowArg {
    fn value_variants<'a>() -> &'a [Self] {
        const ALL: [WindowArg; 3] = [
            WindowArg(WINDOWS[0]),
            WindowArg(WINDOWS[1]),
            WindowArg(WINDOWS[2]),
        ];
        &ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let help = match self.0 {
            Window::OneMinute => "The last minute",
            Window::FiveMinutes => "The last five minutes (the alert's window)",
            Window::FifteenMinutes => "The last fifteen minutes",
        };
        Some(clap::builder::PossibleValue::new(self.0.label()).help(help))
    }
}

/// The window over which the server judges the retry-ratio alert.
pub const ALERT_WINDOW: Window = Window::FiveMinutes;

/// What a window's counters amount to.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rates {
    /// Logical calls per second.
    pub calls_per_second: Option<f64>,
    /// Retries per second.
    pub retries_per_second: Option<f64>,
    /// Retries per logical call.
    pub retry_ratio: Option<f64>,
    /// Share of logical calls that succeeded on the first attempt.
    pub first_try_success: Option<f64>,
}

impl Rates {
    /// The rates of one window; see the module docs for when a figure is `None`.
    pub fn of(window: &pb::WindowStats) -> Self {
        let c = window.counters.unwrap_or_default();
        Self {
            calls_per_second: per_second(c.calls, window.covered_seconds),
            retries_per_second: per_second(c.retries, window.covered_seconds),
            retry_ratio: ratio(c.retries, c.calls),
            first_try_success: ratio(c.success_first_try, c.calls),
        }
    }
}

#[allow(clippy::cast_precision_loss)] // counts far below 2^52 in practice; a rate needs no more
fn per_second(count: u64, covered_seconds: f64) -> Option<f64> {
    (covered_seconds.is_finite() && covered_seconds > 0.0).then(|| count as f64 / covered_seconds)
}

/// `part / whole`, or `None` when `whole` is 0.
#[allow(clippy::cast_precision_loss)]
pub fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

/// One (service, endpoint) series seen through one window.
#[derive(Clone, Debug)]
pub struct Row<'a> {
    /// The series as the server sent it.
    pub series: &'a pb::SeriesStats,
    /// Its counters over the chosen window; `None` when the server sent no such window.
    pub window: Option<&'a pb::WindowStats>,
    /// The rates of `window` (all `None` without it).
    pub rates: Rates,
}

impl Row<'_> {
    /// Whether the rates are over less than half the window: a series (or a control plane)
    /// younger than that, whose first reports' counts are divided by the little time they
    /// cover (one call in a 70 ms report reads as 14 calls/s). Marked `*` in tables.
    pub fn young(&self) -> bool {
        self.window.is_some_and(|w| {
            w.covered_seconds > 0.0 && w.covered_seconds < f64::from(w.window_seconds) / 2.0
        })
    }

    /// The calls and retries rates as table cells: marked `*` when [`Row::young`]; when
    /// another row of the table is (`any_young`), followed by a space, so that the digits of
    /// every row stay aligned.
    pub fn marked_rates(&self, any_young: bool) -> [String; 2] {
        let mark = match (self.young(), any_young) {
            (true, _) => "*",
            (false, true) => " ",
            (false, false) => "",
        };
        [self.rates.calls_per_second, self.rates.retries_per_second]
            .map(|r| format!("{}{mark}", rate(r)))
    }
}

impl<'a> Row<'a> {
    /// `series` through `window`.
    pub fn new(series: &'a pb::SeriesStats, window: Window) -> Self {
        let window = find_window(&series.windows, window);
        Self {
            series,
            window,
            rates: window.map(Rates::of).unwrap_or_default(),
        }
    }

    /// Whether the series' retry-ratio alert is firing.
    pub fn alerting(&self) -> bool {
        self.series.alert.is_some_and(|a| a.firing)
    }

    /// The window's counters (zero without the window).
    pub fn counters(&self) -> pb::Counters {
        self.window.and_then(|w| w.counters).unwrap_or_default()
    }
}

/// The window of nominal length `window` among `windows`.
pub fn find_window(windows: &[pb::WindowStats], window: Window) -> Option<&pb::WindowStats> {
    windows
        .iter()
        .find(|w| w.window_seconds == window.seconds())
}

/// Every series of `response` through `window`, in the server's order (the server applies the
/// `--service` and `--endpoint` filters).
pub fn rows(response: &pb::StatsResponse, window: Window) -> Vec<Row<'_>> {
    response
        .series
        .iter()
        .map(|s| Row::new(s, window))
        .collect()
}

/// The control plane's order of ranked series ([`retryplane_proto::rank::worst_first`]):
/// highest retry ratio first, rows without calls last, then firing alerts first, then by
/// service and endpoint, so that the order is stable between refreshes.
pub fn sort_by_ratio(rows: &mut [Row<'_>]) {
    rows.sort_by(|a, b| worst_first(&rank(a), &rank(b)));
}

/// What `row` is ranked by.
fn rank<'r>(row: &'r Row<'_>) -> Rank<'r> {
    Rank {
        retry_ratio: row.rates.retry_ratio,
        firing: row.alerting(),
        service: &row.series.service,
        endpoint: &row.series.endpoint,
    }
}

/// A rate with one decimal (`12.3`), or `-`. A rate above 0 that one decimal would show as
/// `0.0` (a few calls in the window) gets two (`0.03`), or `<0.01`: `0.0 calls/s` beside a
/// retry ratio of 200 % read as retries of nothing.
pub fn rate(value: Option<f64>) -> String {
    match value {
        None => "-".to_owned(),
        Some(v) if v > 0.0 && v < 0.005 => "<0.01".to_owned(),
        Some(v) if v > 0.0 && v < 0.05 => format!("{v:.2}"),
        Some(v) => format!("{v:.1}"),
    }
}

/// A ratio as a percentage with one decimal (`7.2%`), or `-`.
pub fn percent(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

/// The give-up column; see the module docs.
pub fn give_ups(c: &pb::Counters) -> String {
    let causes = [
        ("att", c.gave_up_attempts),
        ("bud", c.gave_up_budget),
        ("dl", c.gave_up_deadline),
        ("ra", c.gave_up_retry_after),
        ("nr", c.gave_up_not_retryable),
        ("open", c.circuit_open),
        ("cancel", c.cancelled),
    ];
    let mut out = String::new();
    for (name, n) in causes.into_iter().filter(|(_, n)| *n > 0) {
        if !out.is_empty() {
            out.push(' ');
        }
        let _ = write!(out, "{name}:{n}");
    }
    if out.is_empty() {
        out.push('-');
    }
    out
}

/// Milliseconds in a short form: `850ms`, `2s`, `12.3s`, `4m05s`, `2h07m`.
pub fn compact_ms(ms: u64) -> String {
    let secs = ms / 1000;
    if ms < 1000 {
        format!("{ms}ms")
    } else if secs < 60 {
        // Tenths, truncated: 12_399 ms is 12.3s; 2_050 ms is 2s.
        match ms % 1000 / 100 {
            0 => format!("{secs}s"),
            tenths => format!("{secs}.{tenths}s"),
        }
    } else if secs < 3600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{}h{:02}m", secs / 3600, secs / 60 % 60)
    }
}

/// The policy version a series was last reported under (`v7`), followed by the other versions
/// with counts in the row's window (`window_seconds`; the last 15 minutes, as the server keeps
/// them, without one), newest first (`v8,v7`); three at most, then `+N`. A version replaced
/// before the window began is not listed, so that the column answers whether anything still
/// calls under it.
pub fn versions(series: &pb::SeriesStats, window_seconds: Option<u32>) -> String {
    let in_window = |v: &pb::VersionStats| {
        window_seconds.is_none_or(|secs| {
            v.windows.iter().any(|w| {
                w.window_seconds == secs
                    && w.counters.is_some_and(|c| c.calls > 0 || c.attempts > 0)
            })
        })
    };
    let mut all = Vec::new();
    if series.policy_version != 0 {
        all.push(series.policy_version);
    }
    for v in &series.versions {
        if v.policy_version != 0 && !all.contains(&v.policy_version) && in_window(v) {
            all.push(v.policy_version);
        }
    }
    if all.is_empty() {
        return "-".to_owned();
    }
    const SHOWN: usize = 3;
    let mut out = all
        .iter()
        .take(SHOWN)
        .map(|v| format!("v{v}"))
        .collect::<Vec<_>>()
        .join(",");
    if all.len() > SHOWN {
        let _ = write!(out, ",+{}", all.len() - SHOWN);
    }
    out
}

/// `7.2% > 5.0%` for a firing alert, `None` otherwise. When one decimal would print the two
/// alike (5.02 % over 5 %), both get the decimals that tell them apart (`5.02% > 5.00%`), up
/// to six.
pub fn alert_text(series: &pb::SeriesStats) -> Option<String> {
    series.alert.filter(|a| a.firing).map(|a| {
        let (ratio, threshold) = (a.ratio * 100.0, a.threshold * 100.0);
        let mut decimals = 1;
        while decimals < 6 && format!("{ratio:.decimals$}") == format!("{threshold:.decimals$}") {
            decimals += 1;
        }
        format!("{ratio:.decimals$}% > {threshold:.decimals$}%")
    })
}

/// The firing alerts of `response`, one line each:
/// `payments (checkout) retry ratio 7.2% > 5.0% over 5m`, and when the last minute had calls
/// and is back under the threshold or under half the 5-minute ratio (a fix at work, which the
/// 5-minute ratio shows only minutes later) `…, last minute 0.8%`.
pub fn alert_lines(response: &pb::StatsResponse) -> Vec<String> {
    response
        .series
        .iter()
        .filter_map(|s| {
            alert_text(s).map(|text| {
                format!(
                    "{} ({}) retry ratio {text} over {}{}",
                    crate::output::name(&s.endpoint),
                    service_name(&s.service),
                    ALERT_WINDOW.label(),
                    last_minute_under(s).unwrap_or_default()
                )
            })
        })
        .collect()
}

/// `, last minute 0.8%` when the series' last minute had calls and is under its alert's
/// threshold or under half its 5-minute ratio; `None` otherwise (or without those figures).
/// A minute with no call says nothing: with a `--metrics-interval` of a minute or more, the
/// minute's window often holds no report while the storm goes on.
fn last_minute_under(series: &pb::SeriesStats) -> Option<String> {
    let alert = series.alert?;
    let minute = find_window(&series.windows, Window::OneMinute)?;
    let ratio = Rates::of(minute).retry_ratio?;
    (ratio <= alert.threshold || ratio < alert.ratio / 2.0)
        .then(|| format!(", last minute {}", percent(Some(ratio))))
}

/// A service name for people: `-` when the agents sent none, control characters escaped
/// ([`crate::output::name`]).
pub fn service_name(service: &str) -> String {
    if service.is_empty() {
        "-".to_owned()
    } else {
        crate::output::name(service)
    }
}

/// The firing alerts as JSON: `[{service, endpoint, ratio, threshold, since_unix_ms, since}]`.
pub fn alerts_json(response: &pb::StatsResponse) -> Value {
    response
        .series
        .iter()
        .filter_map(|s| {
            let a = s.alert.filter(|a| a.firing)?;
            Some(json!({
                "service": s.service,
                "endpoint": s.endpoint,
                "ratio": a.ratio,
                "threshold": a.threshold,
                "window_seconds": ALERT_WINDOW.seconds(),
                "since_unix_ms": nonzero(a.since_unix_ms),
                "since": time(a.since_unix_ms),
            }))
        })
        .collect::<Vec<_>>()
        .into()
}

/// Every counter of SPEC §4 and `cancelled`, named as on the wire.
pub fn counters_json(c: &pb::Counters) -> Value {
    json!({
        "calls": c.calls,
        "attempts": c.attempts,
        "retries": c.retries,
        "success_first_try": c.success_first_try,
        "success_after_retry": c.success_after_retry,
        "gave_up_attempts": c.gave_up_attempts,
        "gave_up_budget": c.gave_up_budget,
        "gave_up_deadline": c.gave_up_deadline,
        "gave_up_retry_after": c.gave_up_retry_after,
        "gave_up_not_retryable": c.gave_up_not_retryable,
        "circuit_open": c.circuit_open,
        "backoff_ms": c.backoff_ms,
        "retry_after_honored": c.retry_after_honored,
        "cancelled": c.cancelled,
    })
}

/// `{window_seconds, covered_seconds, counters, calls_per_second, retries_per_second,
/// retry_ratio, first_try_success_ratio}`; the derived figures are `null` when undefined.
pub fn window_json(w: &pb::WindowStats) -> Value {
    let rates = Rates::of(w);
    json!({
        "window_seconds": w.window_seconds,
        "covered_seconds": w.covered_seconds,
        "counters": counters_json(&w.counters.unwrap_or_default()),
        "calls_per_second": rates.calls_per_second,
        "retries_per_second": rates.retries_per_second,
        "retry_ratio": rates.retry_ratio,
        "first_try_success_ratio": rates.first_try_success,
    })
}

/// One series with every window and version:
/// `{service, endpoint, policy_version, alert, lifetime, windows, versions}`.
pub fn series_json(s: &pb::SeriesStats) -> Value {
    let alert = s.alert.map_or(Value::Null, |a| {
        json!({
            "threshold": a.threshold,
            "ratio": a.ratio,
            "firing": a.firing,
            "since_unix_ms": nonzero(a.since_unix_ms),
            "since": time(a.since_unix_ms),
        })
    });
    let versions: Vec<Value> = s
        .versions
        .iter()
        .map(|v| {
            json!({
                "policy_version": v.policy_version,
                "lifetime": counters_json(&v.lifetime.unwrap_or_default()),
                "windows": v.windows.iter().map(window_json).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "service": s.service,
        "endpoint": s.endpoint,
        "policy_version": nonzero(s.policy_version),
        "alert": alert,
        "lifetime": counters_json(&s.lifetime.unwrap_or_default()),
        "windows": s.windows.iter().map(window_json).collect::<Vec<_>>(),
        "versions": versions,
    })
}

/// One endpoint's lifetime totals over every service: `{endpoint, retry_ratio,
/// first_try_success_ratio, <every counter>}`.
pub fn endpoint_json(e: &pb::EndpointStats) -> Value {
    let mut value = counters_json(&lifetime_counters(e));
    if let Value::Object(o) = &mut value {
        o.insert("endpoint".to_owned(), json!(e.endpoint));
        o.insert("retry_ratio".to_owned(), json!(ratio(e.retries, e.calls)));
        o.insert(
            "first_try_success_ratio".to_owned(),
            json!(ratio(e.success_first_try, e.calls)),
        );
    }
    value
}

/// An endpoint's lifetime totals as [`pb::Counters`].
pub fn lifetime_counters(e: &pb::EndpointStats) -> pb::Counters {
    pb::Counters {
        calls: e.calls,
        attempts: e.attempts,
        retries: e.retries,
        success_first_try: e.success_first_try,
        success_after_retry: e.success_after_retry,
        gave_up_attempts: e.gave_up_attempts,
        gave_up_budget: e.gave_up_budget,
        gave_up_deadline: e.gave_up_deadline,
        gave_up_retry_after: e.gave_up_retry_after,
        gave_up_not_retryable: e.gave_up_not_retryable,
        circuit_open: e.circuit_open,
        backoff_ms: e.backoff_ms,
        retry_after_honored: e.retry_after_honored,
        cancelled: e.cancelled,
    }
}

/// The number, or `null` for 0 (unset).
fn nonzero(n: u64) -> Value {
    if n == 0 { Value::Null } else { json!(n) }
}

/// RFC 3339 UTC, or `null` for 0 (never).
fn time(unix_ms: u64) -> Value {
    if unix_ms == 0 {
        Value::Null
    } else {
        json!(rfc3339_utc(unix_ms))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Counters with `calls`, `retries` and `first` first-try successes.
    pub(crate) fn counters(calls: u64, retries: u64, first: u64) -> pb::Counters {
        pb::Counters {
            calls,
            attempts: calls + retries,
            retries,
            success_first_try: first,
            ..Default::default()
        }
    }

    pub(crate) fn window(seconds: u32, covered: f64, c: pb::Counters) -> pb::WindowStats {
        pb::WindowStats {
            window_seconds: seconds,
            covered_seconds: covered,
            counters: Some(c),
        }
    }

    /// A series with the same counters in its 1m, 5m and 15m windows, each fully covered.
    pub(crate) fn series(service: &str, endpoint: &str, c: pb::Counters) -> pb::SeriesStats {
        pb::SeriesStats {
            service: service.to_owned(),
            endpoint: endpoint.to_owned(),
            policy_version: 7,
            lifetime: Some(c),
            windows: vec![
                window(60, 60.0, c),
                window(300, 300.0, c),
                window(900, 900.0, c),
            ],
            versions: vec![],
            alert: Some(pb::RetryRatioAlert {
                threshold: 0.05,
                ratio: ratio(c.retries, c.calls).unwrap_or(0.0),
                firing: false,
                since_unix_ms: 0,
            }),
        }
    }

    /// `series` with its alert firing at `ratio`.
    pub(crate) fn alerting(mut s: pb::SeriesStats, ratio: f64) -> pb::SeriesStats {
        s.alert = Some(pb::RetryRatioAlert {
            threshold: 0.05,
            ratio,
            firing: true,
            since_unix_ms: 1_764_473_825_000,
        });
        s
    }

    #[test]
    fn window_flag_values_are_the_servers_windows_by_label() {
        use clap::ValueEnum as _;
        let parsed: Vec<(Window, u32)> = ["1m", "5m", "15m"]
            .into_iter()
            .map(|label| WindowArg::from_str(label, false).map(|w| (w.0, w.0.seconds())))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            parsed,
            [
                (Window::OneMinute, 60),
                (Window::FiveMinutes, 300),
                (Window::FifteenMinutes, 900)
            ]
        );
        assert!(WindowArg::from_str("2m", false).is_err());
        assert_eq!(WindowArg::default().0, ALERT_WINDOW);
        assert_eq!(ALERT_WINDOW.label(), "5m");
    }

    #[test]
    fn rates_divide_by_the_covered_seconds_not_the_window_length() {
        // A server up for 30 s: 60 calls in the 5-minute window are 2 calls per second.
        let w = window(300, 30.0, counters(60, 6, 54));
        let r = Rates::of(&w);
        assert_eq!(r.calls_per_second, Some(2.0));
        assert_eq!(r.retries_per_second, Some(0.2));
        assert_eq!(r.retry_ratio, Some(0.1));
        assert_eq!(r.first_try_success, Some(0.9));
    }

    #[test]
    fn no_covered_time_or_no_calls_gives_no_rate_and_no_ratio() {
        let r = Rates::of(&window(60, 0.0, counters(0, 0, 0)));
        assert_eq!(r, Rates::default());
        let r = Rates::of(&window(60, f64::NAN, counters(3, 1, 2)));
        assert_eq!(r.calls_per_second, None);
        assert_eq!(r.retry_ratio, Some(1.0 / 3.0));
        let r = Rates::of(&window(60, 60.0, counters(0, 0, 0)));
        assert_eq!(r.calls_per_second, Some(0.0));
        assert_eq!(r.retry_ratio, None);
        assert_eq!(r.first_try_success, None);
        assert_eq!(
            (rate(r.retry_ratio), percent(r.first_try_success)),
            ("-".to_owned(), "-".to_owned())
        );
    }

    #[test]
    fn a_small_rate_is_not_shown_as_zero() {
        assert_eq!(rate(Some(0.0)), "0.0");
        assert_eq!(rate(Some(0.001)), "<0.01");
        assert_eq!(rate(Some(2.0 / 60.0)), "0.03");
        assert_eq!(rate(Some(0.05)), "0.1");
        assert_eq!(rate(Some(12.34)), "12.3");
        assert_eq!(rate(None), "-");
    }

    #[test]
    fn a_row_takes_the_chosen_window() {
        let mut s = series("checkout", "payments", counters(600, 60, 540));
        s.windows[0] = window(60, 60.0, counters(60, 30, 30));
        assert_eq!(Row::new(&s, Window::OneMinute).rates.retry_ratio, Some(0.5));
        assert_eq!(
            Row::new(&s, Window::FiveMinutes).rates.retry_ratio,
            Some(0.1)
        );
        s.windows.truncate(1);
        let missing = Row::new(&s, Window::FifteenMinutes);
        assert!(missing.window.is_none());
        assert_eq!(missing.rates, Rates::default());
        assert_eq!(missing.counters(), pb::Counters::default());
    }

    #[test]
    fn rows_sort_by_retry_ratio_descending_with_idle_series_last() {
        let response = pb::StatsResponse {
            series: vec![
                series("a", "idle", counters(0, 0, 0)),
                series("a", "low", counters(100, 1, 99)),
                series("b", "high", counters(100, 30, 70)),
                series("a", "mid", counters(100, 10, 90)),
                alerting(series("a", "mid-alerting", counters(100, 10, 90)), 0.1),
            ],
            ..Default::default()
        };
        let mut rows = rows(&response, Window::OneMinute);
        sort_by_ratio(&mut rows);
        let order: Vec<&str> = rows.iter().map(|r| r.series.endpoint.as_str()).collect();
        assert_eq!(order, ["high", "mid-alerting", "mid", "low", "idle"]);
    }

    #[test]
    fn give_ups_list_only_causes_that_happened() {
        assert_eq!(give_ups(&pb::Counters::default()), "-");
        let c = pb::Counters {
            gave_up_budget: 3,
            gave_up_deadline: 1,
            circuit_open: 2,
            ..Default::default()
        };
        assert_eq!(give_ups(&c), "bud:3 dl:1 open:2");
        let all = pb::Counters {
            gave_up_attempts: 1,
            gave_up_budget: 2,
            gave_up_deadline: 3,
            gave_up_retry_after: 4,
            gave_up_not_retryable: 5,
            circuit_open: 6,
            cancelled: 7,
            ..Default::default()
        };
        assert_eq!(give_ups(&all), "att:1 bud:2 dl:3 ra:4 nr:5 open:6 cancel:7");
        // Each short name the column shows is told in `--help`.
        for shown in give_ups(&all).split(' ') {
            let name = shown.split(':').next().unwrap();
            assert!(
                GIVE_UPS_HELP.contains(&format!(" {name} ")),
                "{name} is not in GIVE_UPS_HELP"
            );
        }
    }

    #[test]
    fn durations_are_compact() {
        assert_eq!(compact_ms(0), "0ms");
        assert_eq!(compact_ms(999), "999ms");
        assert_eq!(compact_ms(12_399), "12.3s");
        assert_eq!(compact_ms(2_050), "2s");
        assert_eq!(compact_ms(245_000), "4m05s");
        assert_eq!(compact_ms(7_620_000), "2h07m");
    }

    #[test]
    fn versions_show_the_newest_and_the_others_in_the_window() {
        let mut s = series("checkout", "payments", counters(1, 0, 1));
        assert_eq!(versions(&s, Some(60)), "v7");
        s.versions = [8, 7, 6, 5, 4]
            .map(|v| pb::VersionStats {
                policy_version: v,
                ..Default::default()
            })
            .to_vec();
        s.policy_version = 8;
        assert_eq!(versions(&s, None), "v8,v7,v6,+2");
        // In a window, only the versions with calls in it, and the one last reported.
        let calls_in_1m = |calls| pb::WindowStats {
            window_seconds: 60,
            counters: Some(pb::Counters {
                calls,
                ..Default::default()
            }),
            ..Default::default()
        };
        for v in &mut s.versions {
            v.windows = vec![calls_in_1m(if v.policy_version == 6 { 3 } else { 0 })];
        }
        assert_eq!(versions(&s, Some(60)), "v8,v6");
        assert_eq!(
            versions(&s, Some(300)),
            "v8",
            "no such window: no calls in it"
        );
        s.policy_version = 0;
        s.versions.clear();
        assert_eq!(versions(&s, None), "-");
    }

    #[test]
    fn an_alert_just_over_its_threshold_never_reads_as_equal_to_it() {
        let text = |ratio| alert_text(&alerting(series("s", "e", counters(1, 0, 1)), ratio));
        assert_eq!(text(0.0502).as_deref(), Some("5.02% > 5.00%"));
        assert_eq!(text(0.05004).as_deref(), Some("5.004% > 5.000%"));
        assert_eq!(text(0.072).as_deref(), Some("7.2% > 5.0%"));
    }

    #[test]
    fn an_alert_line_says_when_the_last_minute_is_back_under_the_threshold() {
        let mut s = alerting(series("checkout", "payments", counters(1000, 72, 900)), 0.5);
        let line = |s: &pb::SeriesStats| {
            alert_lines(&pb::StatsResponse {
                series: vec![s.clone()],
                ..Default::default()
            })
        };
        // The last minute is past the threshold, and more than half the 5 minutes' ratio:
        // nothing more.
        s.windows[0] = window(60, 60.0, counters(1000, 400, 600));
        assert_eq!(
            line(&s),
            ["payments (checkout) retry ratio 50.0% > 5.0% over 5m"]
        );
        s.windows[0] = window(60, 60.0, counters(1000, 8, 990));
        assert_eq!(
            line(&s),
            ["payments (checkout) retry ratio 50.0% > 5.0% over 5m, last minute 0.8%"]
        );
        // Still over the threshold, but down to less than half the 5-minute ratio.
        s.windows[0] = window(60, 60.0, counters(1000, 240, 700));
        assert_eq!(
            line(&s),
            ["payments (checkout) retry ratio 50.0% > 5.0% over 5m, last minute 24.0%"]
        );
        // No call in the minute (a report may not have come in it): nothing said.
        s.windows[0] = window(60, 60.0, counters(0, 0, 0));
        assert_eq!(
            line(&s),
            ["payments (checkout) retry ratio 50.0% > 5.0% over 5m"]
        );
    }

    #[test]
    fn firing_alerts_become_lines_and_json() {
        let response = pb::StatsResponse {
            series: vec![
                alerting(
                    series("checkout", "payments", counters(1000, 72, 900)),
                    0.072,
                ),
                series("checkout", "inventory", counters(1000, 72, 900)),
                alerting(series("", "search", counters(10, 9, 1)), 0.9),
            ],
            ..Default::default()
        };
        assert_eq!(
            alert_lines(&response),
            [
                "payments (checkout) retry ratio 7.2% > 5.0% over 5m",
                "search (-) retry ratio 90.0% > 5.0% over 5m"
            ]
        );
        let alerts = alerts_json(&response);
        assert_eq!(alerts.as_array().map(Vec::len), Some(2));
        assert_eq!(
            alerts[0],
            json!({
                "service": "checkout",
                "endpoint": "payments",
                "ratio": 0.072,
                "threshold": 0.05,
                "window_seconds": 300,
                "since_unix_ms": 1_764_473_825_000_u64,
                "since": "2025-11-30T03:37:05Z"
            })
        );
        assert_eq!(
            alert_lines(&pb::StatsResponse::default()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn series_json_has_every_window_with_derived_rates() {
        let mut s = series("checkout", "payments", counters(120, 12, 100));
        s.windows[0] = window(60, 0.0, counters(0, 0, 0));
        let v = series_json(&s);
        assert_eq!(v["service"], "checkout");
        assert_eq!(v["policy_version"], 7);
        assert_eq!(v["lifetime"]["calls"], 120);
        assert_eq!(v["lifetime"]["gave_up_not_retryable"], 0);
        let windows = v["windows"].as_array().map(Vec::len);
        assert_eq!(windows, Some(3));
        assert_eq!(v["windows"][0]["calls_per_second"], Value::Null);
        assert_eq!(v["windows"][0]["retry_ratio"], Value::Null);
        assert_eq!(v["windows"][1]["window_seconds"], 300);
        assert_eq!(v["windows"][1]["calls_per_second"], json!(0.4));
        assert_eq!(v["windows"][1]["retry_ratio"], json!(0.1));
        assert_eq!(v["alert"]["firing"], false);
        assert_eq!(v["alert"]["since"], Value::Null);
        assert_eq!(v["versions"], json!([]));
    }

    #[test]
    fn endpoint_json_has_every_counter_and_the_ratios() {
        let e = pb::EndpointStats {
            endpoint: "payments".to_owned(),
            calls: 4,
            retries: 1,
            success_first_try: 3,
            backoff_ms: 250,
            ..Default::default()
        };
        let v = endpoint_json(&e);
        assert_eq!(v["endpoint"], "payments");
        assert_eq!(v["calls"], 4);
        assert_eq!(v["backoff_ms"], 250);
        assert_eq!(v["retry_ratio"], json!(0.25));
        assert_eq!(v["first_try_success_ratio"], json!(0.75));
        let idle = endpoint_json(&pb::EndpointStats::default());
        assert_eq!(idle["retry_ratio"], Value::Null);
    }
}
