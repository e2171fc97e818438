//! `explain` for people: a header, the effective policy, the schedule, the load, the warnings.
//!
//! ```text
//! endpoint  payments (config/policies.yaml:40:3)
//! call      HTTP POST /v1/charges
//! route     routes[0]: POST /v1/charges (config/policies.yaml:48:16)
//! retried   only when the request carries the `Idempotency-Key` header: POST is not in ...
//!
//! effective policy (each value from the most specific layer that sets it: built-in < defaults < endpoint < route)
//!   field            value   from      set at
//!   max_attempts     2       route     config/policies.yaml:49:23
//!   backoff.base     200ms   endpoint  config/policies.yaml:45:13
//!   ...
//!
//! schedule (deadline 10000ms, per_try_timeout 1500ms, jitter decorrelated; times in ms)
//!   retry n follows failed attempt n and starts attempt n+1
//!   worst-case start = n x per_try_timeout + the longest pauses of retries 1..=n ...
//!   retry  attempt  ceiling  jitter range    worst-case start  fits deadline
//!       1        2        -  [200ms, 600ms]            2100ms  yes
//!
//! load (upstream requests per logical call when every attempt fails)
//!   max_attempts  2x: ...
//!   budget        up to 1.2x from 50 calls/s up (...); below that, the reserve allows ...
//! ```

use std::fmt::Write as _;

use retryplane_policy::Diagnostic;
use retryplane_policy::duration::format_duration;

use super::Call;
use super::report::{Explanation, Load};
use crate::output::{self, Align};

/// A fit with less than this to spare shows how much: timers that fire a little late can use
/// it up, and the attempt then does not start.
const TIGHT: std::time::Duration = std::time::Duration::from_millis(10);

/// The whole text output; `warnings` are the file's warnings about this endpoint's policy for
/// the call, and `other_routes` how many more are about routes the call does not take.
pub fn render(e: &Explanation, warnings: &[&Diagnostic], other_routes: usize) -> String {
    let mut out = String::new();
    header(&mut out, e);
    out.push('\n');
    policy(&mut out, e);
    out.push('\n');
    schedule(&mut out, e);
    out.push('\n');
    load(&mut out, &e.load);
    if !warnings.is_empty() {
        let _ = writeln!(out, "\nwarnings about this endpoint");
        for d in warnings {
            out.push_str("  ");
            output::push_diagnostic_line(&mut out, &e.file, d);
        }
    }
    if other_routes > 0 {
        let _ = writeln!(
            out,
            "\n{other_routes} {} about routes this call does not take: `retryplane validate` lists {}",
            if other_routes == 1 {
                "warning"
            } else {
                "warnings"
            },
            if other_routes == 1 { "it" } else { "them" },
        );
    }
    out
}

fn place(file: &str, line: Option<u32>, column: Option<u32>) -> String {
    match (line, column) {
        (Some(line), Some(column)) => format!("{file}:{line}:{column}"),
        _ => String::new(),
    }
}

fn header(out: &mut String, e: &Explanation) {
    let at = |line, column| match place(&e.file, line, column) {
        p if p.is_empty() => String::new(),
        p => format!(" ({p})"),
    };
    let ep = &e.endpoint;
    let _ = writeln!(out, "endpoint  {}{}", ep.name, at(ep.line, ep.column));
    let call = match &e.call {
        Call::Http { method, path } => format!("HTTP {method} {path}"),
        Call::Grpc { path } => format!("gRPC {path}"),
        Call::Endpoint => {
            "none given: the endpoint's own policy (--method/--path or --grpc match a route)"
                .to_owned()
        }
    };
    let _ = writeln!(out, "call      {call}");
    let route = match (&e.route, &e.call) {
        (Some(r), _) => format!("routes[{}]: {}{}", r.index, r.matcher, at(r.line, r.column)),
        (None, Call::Endpoint) => "not looked up".to_owned(),
        (None, _) => "none matched: the endpoint's own policy".to_owned(),
    };
    let _ = writeln!(out, "route     {route}");
    let _ = writeln!(out, "retried   {}", e.retried.summary);
}

fn policy(out: &mut String, e: &Explanation) {
    let _ = writeln!(
        out,
        "effective policy (each value from the most specific layer that sets it: built-in < defaults < endpoint < route)"
    );
    let mut rows = vec![vec![
        "field".to_owned(),
        "value".to_owned(),
        "from".to_owned(),
        "set at".to_owned(),
    ]];
    rows.extend(e.policy.iter().map(|f| {
        vec![
            f.field.to_owned(),
            f.text.clone(),
            f.level.to_owned(),
            place(&e.file, f.line, f.column),
        ]
    }));
    output::table(out, "  ", &[Align::Left; 4], &rows);
}

fn schedule(out: &mut String, e: &Explanation) {
    let s = &e.schedule;
    let _ = writeln!(
        out,
        "schedule (deadline {}, per_try_timeout {}, jitter {}; times in ms)",
        s.deadline_ms, s.per_try_timeout_ms, s.jitter
    );
    if s.retries.is_empty() {
        let why = s.never.unwrap_or("max_attempts is 1");
        let _ = writeln!(out, "  no retries: {why}");
        return;
    }
    let _ = writeln!(
        out,
        "  retry n follows failed attempt n and starts attempt n+1\n  \
         worst-case start = n x per_try_timeout + the longest pauses of retries 1..=n \
         (every attempt so far timed out, every pause was the longest its jitter allows)\n  \
         fits deadline = that start is before the deadline, so the attempt gets to run; a start within\n  \
         a few ms of it may not (each timeout and pause can end a millisecond or so late): such a fit\n  \
         shows what it has to spare"
    );
    if s.jitter == "decorrelated" {
        let _ = writeln!(
            out,
            "  decorrelated jitter: a pause depends on the previous one; the range holds whatever came before,\n  \
             server hints aside (after a Retry-After of H, the next pause can reach min(backoff.max, 3 x H))"
        );
    }
    let mut rows = vec![
        [
            "retry",
            "attempt",
            "ceiling",
            "jitter range",
            "worst-case start",
            "fits deadline",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    rows.extend(s.retries.iter().map(|r| {
        vec![
            r.retry.to_string(),
            r.attempt.to_string(),
            // Decorrelated pauses have no ceiling of their own: the range is their bound.
            r.ceiling_ms
                .map_or_else(|| "-".to_owned(), |c| c.to_string()),
            format!("[{}, {}]", r.jitter_low_ms, r.jitter_high_ms),
            r.worst_case_start_ms.to_string(),
            match s.deadline_ms.0.checked_sub(r.worst_case_start_ms.0) {
                _ if !r.fits_deadline => "no".to_owned(),
                Some(spare) if spare < TIGHT => format!("yes, {} to spare", format_duration(spare)),
                _ => "yes".to_owned(),
            },
        ]
    }));
    use Align::{Left, Right};
    output::table(out, "  ", &[Right, Right, Right, Left, Right, Left], &rows);
}

fn load(out: &mut String, l: &Load) {
    let _ = writeln!(
        out,
        "load (upstream requests per logical call when every attempt fails)"
    );
    let attempts = match l.first_unreachable_attempt {
        _ if l.multiplier <= 1 && l.first_unreachable_attempt.is_none() => {
            "1x: never retried".to_owned()
        }
        None => format!(
            "{}x: each call may be sent max_attempts times",
            l.multiplier
        ),
        Some(first) if l.multiplier < first => format!(
            "{}x: attempt {first} and later can never start inside the deadline",
            l.multiplier
        ),
        Some(first) => format!(
            "{}x: each call may be sent max_attempts times, though attempt {first} and later start \
             inside the deadline only if a gRPC server's pushback shortens the pauses before them",
            l.multiplier
        ),
    };
    let budget = match &l.budget {
        None if l.multiplier <= 1 => "disabled (no retries to bound)".to_owned(),
        None => "disabled: nothing below max_attempts bounds retry load in an outage".to_owned(),
        Some(_) if l.multiplier <= 1 => "enabled (no retries to bound)".to_owned(),
        Some(b) => {
            let reserve = format!(
                "{} retries/s ({} per {} window)",
                b.min_per_second,
                b.reserve_per_window,
                format_duration(b.window_ms.0)
            );
            let text = match b.ratio_applies_from_calls_per_second {
                // No reserve: there is no "below that"; with no ratio either, no retry at all.
                Some(_) if b.reserve_per_window == 0 => format!(
                    "up to {}x at any traffic (1 + ratio {:?}: at most {:?} retries per call over the window); \
                     no reserve (min_per_second 0)",
                    b.multiplier, b.ratio, b.ratio,
                ),
                None if b.reserve_per_window == 0 => {
                    "allows no retry: ratio 0 and no reserve (min_per_second 0)".to_owned()
                }
                // A ratio so small (`1e-320`) that the reserve outweighs it at any rate a
                // number can hold: "from inf calls/s up" says nothing.
                Some(rate) if !rate.is_finite() => format!(
                    "ratio {:?} adds nothing at any traffic: only the reserve of {reserve}",
                    b.ratio
                ),
                Some(rate) => format!(
                    "up to {}x from {} calls/s up (1 + ratio {:?}: at most {:?} retries per call over the window); \
                     below that, the reserve allows {reserve}",
                    b.multiplier,
                    trim_float(rate),
                    b.ratio,
                    b.ratio,
                ),
                None => format!("ratio 0: only the reserve of {reserve}, whatever the traffic"),
            };
            // Rates an operator would otherwise read as the fleet's.
            format!("{text}; each agent process counts its own calls and retries")
        }
    };
    let rows = vec![
        vec!["max_attempts".to_owned(), attempts],
        vec!["budget".to_owned(), budget],
    ];
    output::table(out, "  ", &[Align::Left, Align::Left], &rows);
}

/// `50` rather than `50.0`, `33.33` rather than `33.333333333333336`.
fn trim_float(f: f64) -> String {
    let text = format!("{f:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}
