//! `retryplane stats [--endpoint E] [--service S] [--window 1m|5m|15m]`: the fleet's retry
//! metrics (SPEC §4), as the control plane aggregates them from the agents' reports.
//!
//! Text, two tables:
//!
//! - per (service, endpoint), in the server's order (service, then endpoint), over the chosen
//!   window (default `5m`): `CALLS/S RETRIES/S RETRY% FIRST-TRY GIVE-UPS BACKOFF VERSION ALERT`
//!   — logical calls and retries per second, retries per call, the share of calls that
//!   succeeded on the first attempt, the calls that gave up by cause (see
//!   [`super::metrics`]), the total backoff slept in the window, the policy version the counts
//!   were last reported under, then the others with counts in the window (`v8,v7` during a
//!   change; a version replaced before the window began is not listed), and `ALERT 7.2% > 5.0%` when the
//!   endpoint's 5-minute retry ratio is past its threshold;
//! - lifetime totals per endpoint, summed over every service:
//!   `CALLS RETRIES RETRY% FIRST-TRY AFTER-RETRY GIVE-UPS BACKOFF`.
//!
//! A footer says how many reports were counted in the `other` series when the server's cap on
//! series was reached. With nothing reported yet, stdout is empty and stderr says so; with
//! nothing that matches `--endpoint` or `--service` while other series were reported, stderr
//! says that nothing matches them instead.
//!
//! JSON, one object (ratios as fractions, not percentages; `null` where a figure is undefined
//! or unset):
//!
//! ```text
//! {"now_unix_ms", "now",
//!  "series": [{"service", "endpoint", "policy_version",
//!              "alert": {"threshold", "ratio", "firing", "since_unix_ms", "since"},
//!              "lifetime": {<counters>},
//!              "windows": [{"window_seconds", "covered_seconds", "counters": {<counters>},
//!                           "calls_per_second", "retries_per_second", "retry_ratio",
//!                           "first_try_success_ratio"}],
//!              "versions": [{"policy_version", "lifetime", "windows"}]}],
//!  "endpoints": [{"endpoint", <counters>, "retry_ratio", "first_try_success_ratio"}],
//!  "alerts": [{"service", "endpoint", "ratio", "threshold", "window_seconds",
//!              "since_unix_ms", "since"}],
//!  "max_series", "max_series_per_service", "overflowed_reports",
//!  "overflowed_by_reason": {"series_cap", "bad_name", "service_share"}}
//! ```
//!
//! `<counters>` are the wire's `Counters` fields by name (`calls`, `attempts`, `retries`,
//! `success_first_try`, `success_after_retry`, `gave_up_attempts`, `gave_up_budget`,
//! `gave_up_deadline`, `gave_up_retry_after`, `gave_up_not_retryable`, `circuit_open`,
//! `backoff_ms`, `retry_after_honored`, `cancelled`). Every window the server sent is included
//! whatever `--window` says; `--window` only chooses the text view's columns.

use std::fmt::Write as _;

use clap::builder::NonEmptyStringValueParser;
use serde_json::{Value, json};

use super::client::Client;
use super::metrics::{self, Row, Window, WindowArg};
use super::time::rfc3339_utc;
use super::{Server, ServerArgs, block_on};
use crate::output::{self, Align, Format};
use crate::{Outcome, Report};
use retryplane_proto::pb;

/// `retryplane stats` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only this endpoint.
    #[arg(long, value_name = "NAME", value_parser = NonEmptyStringValueParser::new())]
    endpoint: Option<String>,
    /// Only the series of this calling service (the agents' `service`); the lifetime totals
    /// per endpoint stay summed over every service.
    #[arg(long, value_name = "NAME", value_parser = NonEmptyStringValueParser::new())]
    service: Option<String>,
    /// The trailing window that rates and ratios are taken over (text only: JSON has them
    /// all).
    #[arg(long, value_enum, default_value_t)]
    window: WindowArg,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    #[command(flatten)]
    server: ServerArgs,
}

/// What to show, checked once.
#[derive(Debug)]
pub struct Settings {
    /// Only this endpoint.
    pub endpoint: Option<String>,
    /// Only this calling service.
    pub service: Option<String>,
    /// The window of the text view.
    pub window: Window,
    /// Output format.
    pub format: Format,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        Ok(Self {
            endpoint: args.endpoint,
            service: args.service,
            window: args.window.0,
            format: args.output,
            server: args.server.try_into()?,
        })
    }
}

/// Calls `Stats` and prints the metrics.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let request = pb::StatsRequest {
            endpoint: settings.endpoint.clone().unwrap_or_default(),
            service: settings.service.clone().unwrap_or_default(),
            // Every series: `stats` lists them all, sorted by the server.
            ..Default::default()
        };
        let response = match client.stats(request).await {
            Ok(response) => response,
            Err(status) => return Ok(super::failed(&status, String::new())),
        };
        let stdout = match settings.format {
            Format::Json => output::json(&stats_json(&response))?,
            // `endpoints` sums every service, whatever `--service` says: with no series of
            // the service asked for, that is nothing of it to show.
            Format::Text
                if response.series.is_empty()
                    && (response.endpoints.is_empty() || settings.service.is_some()) =>
            {
                output::note(format_args!(
                    "{}",
                    nothing_shown(settings, &mut client).await
                ));
                String::new()
            }
            Format::Text => text(&response, settings.window),
        };
        Ok(Report {
            stdout,
            outcome: Outcome::Success,
        })
    })
}

/// Why nothing is shown: nothing reported at all, or, with `--endpoint` or `--service`,
/// nothing that matches them while other series were reported (asked for with one more
/// `Stats` call, for one series).
async fn nothing_shown(settings: &Settings, client: &mut Client) -> String {
    let filters: Vec<String> = [
        ("endpoint", &settings.endpoint),
        ("service", &settings.service),
    ]
    .into_iter()
    .filter_map(|(flag, value)| {
        value
            .as_ref()
            .map(|v| format!("--{flag} {}", output::name(v)))
    })
    .collect();
    if filters.is_empty() {
        return NOTHING_REPORTED.to_owned();
    }
    let any = pb::StatsRequest {
        limit: 1,
        series_only: true,
        ..Default::default()
    };
    let filters = filters.join(" ");
    match client.stats(any).await {
        Ok(all) if all.matched_series == 0 && all.series.is_empty() => NOTHING_REPORTED.to_owned(),
        Ok(_) => format!(
            "no metrics match {filters} (other series were reported: retryplane stats lists them)"
        ),
        // Whether anything else was reported is unknown: say only what is certain.
        Err(_) => format!("no metrics match {filters}"),
    }
}

/// What `stats` says when the control plane holds no metrics at all.
const NOTHING_REPORTED: &str = "no metrics reported yet";

/// The text view; see the module docs.
pub fn text(response: &pb::StatsResponse, window: Window) -> String {
    let mut out = String::new();
    let rows = metrics::rows(response, window);
    if !rows.is_empty() {
        let _ = writeln!(out, "last {}, per service and endpoint:", window.label());
        if series_table(&mut out, &rows) {
            let _ = writeln!(out, "{YOUNG_NOTE}");
        }
    }
    if !response.endpoints.is_empty() {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str("lifetime, per endpoint (every service):\n");
        endpoint_table(&mut out, &response.endpoints);
    }
    for line in overflow_notes(response) {
        let _ = writeln!(out, "note: {line}");
    }
    out
}

/// What was counted in the `other` series, one line per reason, each saying what would help.
/// A server that does not tell the reasons apart gives only the total.
pub fn overflow_notes(r: &pb::StatsResponse) -> Vec<String> {
    const OTHER: &str = "were counted in the \"other\" series";
    let by_reason = r
        .overflowed_cap
        .saturating_add(r.overflowed_bad_name)
        .saturating_add(r.overflowed_service_share);
    if by_reason == 0 {
        return if r.overflowed_reports > 0 {
            vec![format!("{} endpoint reports {OTHER}", r.overflowed_reports)]
        } else {
            Vec::new()
        };
    }
    let mut out = Vec::new();
    if r.overflowed_cap > 0 {
        out.push(format!(
            "{} endpoint reports past the cap of {} series {OTHER} (serve --max-series)",
            r.overflowed_cap, r.max_series
        ));
    }
    if r.overflowed_service_share > 0 {
        out.push(format!(
            "{} endpoint reports past a service's share of {} series {OTHER} (serve \
             --max-series-per-service; are endpoint names made from URLs?)",
            r.overflowed_service_share, r.max_series_per_service
        ));
    }
    if r.overflowed_bad_name > 0 {
        out.push(format!(
            "{} endpoint reports with a service or endpoint name over 256 bytes, holding a \
             control character, or named \"other\", or an empty endpoint name, {OTHER}",
            r.overflowed_bad_name
        ));
    }
    out
}

/// The note under a table with rates marked `*` (see [`Row::young`]).
const YOUNG_NOTE: &str = "* over the seconds the series' reports cover so far, less than half \
the window: a young series, where a few calls make a high rate";

/// Writes the table of `rows`; whether any row's rates are marked young (see [`Row::young`]).
fn series_table(out: &mut String, rows: &[Row<'_>]) -> bool {
    let any_young = rows.iter().any(Row::young);
    let mut cells = vec![
        [
            "SERVICE",
            "ENDPOINT",
            "CALLS/S",
            "RETRIES/S",
            "RETRY%",
            "FIRST-TRY",
            "GIVE-UPS",
            "BACKOFF",
            "VERSION",
            "ALERT",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for row in rows {
        let c = row.counters();
        let [calls, retries] = row.marked_rates(any_young);
        cells.push(vec![
            metrics::service_name(&row.series.service),
            output::name(&row.series.endpoint),
            calls,
            retries,
            metrics::percent(row.rates.retry_ratio),
            metrics::percent(row.rates.first_try_success),
            metrics::give_ups(&c),
            if row.window.is_some() {
                metrics::compact_ms(c.backoff_ms)
            } else {
                "-".to_owned()
            },
            metrics::versions(row.series, row.window.map(|w| w.window_seconds)),
            metrics::alert_text(row.series).map_or_else(String::new, |t| format!("ALERT {t}")),
        ]);
    }
    use Align::{Left, Right};
    let align = [
        Left, Left, Right, Right, Right, Right, Left, Right, Left, Left,
    ];
    output::table(out, "", &align, &cells);
    any_young
}

fn endpoint_table(out: &mut String, endpoints: &[pb::EndpointStats]) {
    let mut cells = vec![
        [
            "ENDPOINT",
            "CALLS",
            "RETRIES",
            "RETRY%",
            "FIRST-TRY",
            "AFTER-RETRY",
            "GIVE-UPS",
            "BACKOFF",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for e in endpoints {
        cells.push(vec![
            output::name(&e.endpoint),
            e.calls.to_string(),
            e.retries.to_string(),
            metrics::percent(metrics::ratio(e.retries, e.calls)),
            metrics::percent(metrics::ratio(e.success_first_try, e.calls)),
            e.success_after_retry.to_string(),
            metrics::give_ups(&metrics::lifetime_counters(e)),
            metrics::compact_ms(e.backoff_ms),
        ]);
    }
    use Align::{Left, Right};
    let align = [Left, Right, Right, Right, Right, Right, Left, Right];
    output::table(out, "", &align, &cells);
}

/// The JSON document; see the module docs.
pub fn stats_json(response: &pb::StatsResponse) -> Value {
    json!({
        "now_unix_ms": match response.now_unix_ms {
            0 => Value::Null,
            ms => json!(ms),
        },
        "now": match response.now_unix_ms {
            0 => Value::Null,
            ms => json!(rfc3339_utc(ms)),
        },
        "series": response.series.iter().map(metrics::series_json).collect::<Vec<_>>(),
        "endpoints": response.endpoints.iter().map(metrics::endpoint_json).collect::<Vec<_>>(),
        "alerts": metrics::alerts_json(response),
        "max_series": response.max_series,
        "max_series_per_service": response.max_series_per_service,
        "overflowed_reports": response.overflowed_reports,
        "overflowed_by_reason": {
            "series_cap": response.overflowed_cap,
            "bad_name": response.overflowed_bad_name,
            "service_share": response.overflowed_service_share,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::metrics::tests::{alerting, counters, series, window};

    fn response() -> pb::StatsResponse {
        let mut payments = alerting(
            series("checkout", "payments", counters(3000, 216, 2700)),
            0.072,
        );
        // 5m window: 3000 calls over 300 s = 10/s, 216 retries = 0.72/s, 7.2%, 90% first try.
        payments.windows[1].counters = Some(pb::Counters {
            gave_up_budget: 3,
            gave_up_deadline: 1,
            backoff_ms: 4_250,
            ..counters(3000, 216, 2700)
        });
        let mut young = series("search", "inventory", counters(0, 0, 0));
        young.windows[1] = window(300, 0.0, counters(0, 0, 0));
        pb::StatsResponse {
            series: vec![payments, young],
            endpoints: vec![
                pb::EndpointStats {
                    endpoint: "inventory".to_owned(),
                    ..Default::default()
                },
                pb::EndpointStats {
                    endpoint: "payments".to_owned(),
                    calls: 10_000,
                    retries: 700,
                    success_first_try: 9_000,
                    success_after_retry: 950,
                    gave_up_attempts: 50,
                    backoff_ms: 125_000,
                    ..Default::default()
                },
            ],
            max_series: 1000,
            overflowed_reports: 0,
            now_unix_ms: 1_764_473_825_000,
            ..Default::default()
        }
    }

    #[test]
    fn text_has_the_window_table_with_the_alert_and_the_lifetime_table() {
        assert_eq!(
            text(&response(), Window::FiveMinutes),
            "\
last 5m, per service and endpoint:
SERVICE   ENDPOINT   CALLS/S  RETRIES/S  RETRY%  FIRST-TRY  GIVE-UPS    BACKOFF  VERSION  ALERT
checkout  payments      10.0        0.7    7.2%      90.0%  bud:3 dl:1     4.2s  v7       ALERT 7.2% > 5.0%
search    inventory        -          -       -          -  -               0ms  v7

lifetime, per endpoint (every service):
ENDPOINT   CALLS  RETRIES  RETRY%  FIRST-TRY  AFTER-RETRY  GIVE-UPS  BACKOFF
inventory      0        0       -          -            0  -             0ms
payments   10000      700    7.0%      90.0%          950  att:50      2m05s
"
        );
    }

    #[test]
    fn rates_over_less_than_half_the_window_are_marked_young_with_a_note() {
        let mut r = response();
        // One call in its first report, 70 ms long: 14.3 calls/s over what it covers.
        r.series[1].windows[1] = window(300, 0.07, counters(1, 0, 1));
        let out = text(&r, Window::FiveMinutes);
        assert!(
            out.contains("checkout  payments     10.0        0.7     7.2%"),
            "a full window is not marked, its digits aligned with the marked ones: {out}"
        );
        assert!(
            out.contains("search    inventory    14.3*       0.0*    0.0%"),
            "{out}"
        );
        assert!(out.contains(&format!("\n{YOUNG_NOTE}\n")), "{out}");
        // Half the window or more: no mark, no note.
        r.series[1].windows[1] = window(300, 150.0, counters(1, 0, 1));
        let out = text(&r, Window::FiveMinutes);
        assert!(!out.contains('*') && !out.contains(YOUNG_NOTE), "{out}");
    }

    #[test]
    fn names_from_agents_cannot_drive_the_terminal() {
        let mut r = response();
        r.series[0].service = "check\u{1b}[2Jout".to_owned();
        r.series[0].endpoint = "ep\u{1b}[31mX".to_owned();
        r.endpoints[0].endpoint = "inv\r\nentory".to_owned();
        let out = text(&r, Window::FiveMinutes);
        assert!(!out.contains('\u{1b}') && !out.contains('\r'), "{out}");
        assert!(
            out.contains(r#""check\u{1b}[2Jout"  "ep\u{1b}[31mX""#),
            "{out}"
        );
        assert!(out.contains("\n\"inv\\r\\nentory\"  "), "{out}");
        let alerts = metrics::alert_lines(&r);
        assert_eq!(
            alerts,
            [r#""ep\u{1b}[31mX" ("check\u{1b}[2Jout") retry ratio 7.2% > 5.0% over 5m"#]
        );
        // JSON keeps the names as sent: its encoding escapes them.
        assert_eq!(stats_json(&r)["series"][0]["endpoint"], "ep\u{1b}[31mX");
    }

    #[test]
    fn the_one_minute_window_changes_the_rates() {
        let mut r = response();
        r.series[0].windows[0] = window(60, 30.0, counters(90, 45, 45));
        let out = text(&r, Window::OneMinute);
        assert!(
            out.starts_with("last 1m, per service and endpoint:\n"),
            "{out}"
        );
        // 90 calls over the 30 s the window covers: 3/s, 1.5 retries/s.
        assert!(
            out.contains("checkout  payments       3.0        1.5   50.0%      50.0%  -"),
            "{out}"
        );
    }

    #[test]
    fn the_footer_tells_about_reports_past_the_series_cap() {
        let mut r = response();
        r.overflowed_reports = 12;
        r.overflowed_cap = 12;
        r.max_series = 2;
        let out = text(&r, Window::FiveMinutes);
        assert!(
            out.ends_with(
                "note: 12 endpoint reports past the cap of 2 series were counted in the \"other\" series (serve --max-series)\n"
            ),
            "{out}"
        );
        assert!(!text(&response(), Window::FiveMinutes).contains("note:"));
    }

    #[test]
    fn the_footer_names_each_reason_reports_went_to_other_and_only_those() {
        let mut r = response();
        r.overflowed_reports = 3;
        r.overflowed_bad_name = 1;
        r.overflowed_service_share = 2;
        r.max_series_per_service = 1_000;
        let notes = overflow_notes(&r);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].starts_with("2 endpoint reports past a service's share of 1000 series"));
        assert!(
            notes[1].starts_with("1 endpoint reports with a service or endpoint name over 256")
        );
        assert!(
            !notes.iter().any(|n| n.contains("--max-series ")),
            "{notes:?}"
        );
        // A server that does not tell the reasons apart: the total alone, no cause guessed.
        let mut old = response();
        old.overflowed_reports = 5;
        assert_eq!(
            overflow_notes(&old),
            ["5 endpoint reports were counted in the \"other\" series"]
        );
    }

    #[test]
    fn lifetime_totals_alone_are_shown_when_there_are_no_series() {
        let mut r = response();
        r.series.clear();
        let out = text(&r, Window::FiveMinutes);
        assert!(
            out.starts_with("lifetime, per endpoint (every service):\nENDPOINT"),
            "{out}"
        );
    }

    #[test]
    fn json_has_every_series_window_endpoint_and_alert() {
        let v = stats_json(&response());
        assert_eq!(v["now"], "2025-11-30T03:37:05Z");
        assert_eq!(v["series"].as_array().map(Vec::len), Some(2));
        assert_eq!(v["series"][0]["windows"].as_array().map(Vec::len), Some(3));
        assert_eq!(
            v["series"][0]["windows"][1]["calls_per_second"],
            json!(10.0)
        );
        assert_eq!(
            v["series"][0]["windows"][1]["counters"]["gave_up_budget"],
            3
        );
        assert_eq!(
            v["series"][1]["windows"][1]["calls_per_second"],
            Value::Null
        );
        assert_eq!(v["endpoints"][1]["calls"], 10_000);
        assert_eq!(v["alerts"][0]["endpoint"], "payments");
        assert_eq!(v["alerts"].as_array().map(Vec::len), Some(1));
        assert_eq!(v["max_series"], 1000);
        assert_eq!(v["overflowed_reports"], 0);
        let empty = stats_json(&pb::StatsResponse::default());
        assert_eq!(
            empty,
            json!({
                "now_unix_ms": null,
                "now": null,
                "series": [],
                "endpoints": [],
                "alerts": [],
                "max_series": 0,
                "max_series_per_service": 0,
                "overflowed_reports": 0,
                "overflowed_by_reason": {"series_cap": 0, "bad_name": 0, "service_share": 0}
            })
        );
    }
}
