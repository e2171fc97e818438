//! What `retryplane request` prints: one record per attempt, rendered as text or as the JSON
//! object of SPEC §5.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

/// The `error` of an attempt the call's cancellation (Ctrl-C) cut before it answered: shown in
/// text; in JSON, `null` (SPEC §5 lists only transport classes there, and the call's `cause`,
/// `cancelled`, says it).
pub const CANCELLED: &str = "cancelled";

/// What one attempt did, as seen from inside the attempt closure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt.
    pub number: u32,
    /// The HTTP status, when a response came back.
    pub status: Option<u16>,
    /// The gRPC code of a "Trailers-Only" gRPC answer (`grpc-status` in its headers), which is
    /// what the call judged it by; `None` for any other answer. Shown in text only: the JSON
    /// object keeps SPEC §5's fields.
    pub grpc: Option<&'static str>,
    /// `connect`, `reset` or `timeout` when no response came back (an attempt dropped by its
    /// time limit stays `timeout`).
    pub error: Option<&'static str>,
    /// The pause slept after this attempt; `None` for the last one.
    pub pause: Option<Duration>,
}

impl Attempt {
    /// An attempt that has just started: a `timeout` until it ends some other way.
    pub fn started(number: u32) -> Self {
        Self {
            number,
            status: None,
            grpc: None,
            error: Some("timeout"),
            pause: None,
        }
    }
}

/// The whole call, ready to render.
#[derive(Debug)]
pub struct Summary {
    /// Whether the call succeeded.
    pub success: bool,
    /// The give-up cause (`attempts_exhausted`, …) of a failed call.
    pub cause: Option<String>,
    /// The final HTTP status, if the last attempt got a response.
    pub status: Option<u16>,
    /// Every attempt, in order.
    pub attempts: Vec<Attempt>,
    /// From the start of the call to its end.
    pub elapsed: Duration,
    /// Lines for stderr that explain the outcome (what the last attempt ran into, why the
    /// policy gave up), printed after the report so that they come under the attempts they
    /// speak of.
    pub notes: Vec<String>,
}

#[derive(Serialize)]
struct JsonSummary<'a> {
    outcome: &'static str,
    cause: Option<&'a str>,
    status: Option<u16>,
    attempts: Vec<JsonAttempt>,
    elapsed_ms: u64,
}

#[derive(Serialize)]
struct JsonAttempt {
    attempt: u32,
    status: Option<u16>,
    error: Option<&'static str>,
    pause_ms: Option<u64>,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Summary {
    /// The SPEC §5 JSON object, on one line.
    pub fn to_json(&self) -> anyhow::Result<String> {
        let json = JsonSummary {
            outcome: if self.success { "success" } else { "failure" },
            cause: self.cause.as_deref(),
            status: self.status,
            attempts: self
                .attempts
                .iter()
                .map(|a| JsonAttempt {
                    attempt: a.number,
                    status: a.status,
                    error: a.error.filter(|e| *e != CANCELLED),
                    pause_ms: a.pause.map(millis),
                })
                .collect(),
            elapsed_ms: millis(self.elapsed),
        };
        let mut text = serde_json::to_string(&json)?;
        text.push('\n');
        Ok(text)
    }

    /// One line per attempt, then the outcome:
    ///
    /// ```text
    /// attempt 1: HTTP 503, retrying in 100 ms
    /// attempt 2: connect error, retrying in 200 ms
    /// attempt 3: HTTP 200
    /// success: HTTP 200 after 3 attempts in 312 ms
    /// ```
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for a in &self.attempts {
            let _ = write!(
                out,
                "attempt {}: {}",
                a.number,
                what(a.status, a.grpc, a.error)
            );
            if let Some(p) = a.pause {
                let _ = write!(out, ", retrying in {} ms", millis(p));
            }
            out.push('\n');
        }
        let n = self.attempts.len();
        let plural = if n == 1 { "" } else { "s" };
        let last = self.attempts.last();
        let result = what(
            self.status,
            last.and_then(|a| a.grpc),
            last.and_then(|a| a.error),
        );
        let elapsed = millis(self.elapsed);
        let _ = match (&self.cause, self.success) {
            (_, true) => writeln!(
                out,
                "success: {result} after {n} attempt{plural} in {elapsed} ms"
            ),
            (Some(cause), false) if n > 0 => writeln!(
                out,
                "failure: {cause} (last: {result}) after {n} attempt{plural} in {elapsed} ms"
            ),
            (cause, false) => writeln!(
                out,
                "failure: {} after {n} attempts in {elapsed} ms",
                cause.as_deref().unwrap_or("unknown")
            ),
        };
        out
    }
}

fn what(status: Option<u16>, grpc: Option<&str>, error: Option<&str>) -> String {
    match (status, error) {
        (Some(s), _) => match grpc {
            Some(code) => format!("gRPC {code} (HTTP {s})"),
            None => format!("HTTP {s}"),
        },
        (None, Some(CANCELLED)) => "no answer (cancelled)".to_owned(),
        (None, Some(e)) => format!("{e} error"),
        (None, None) => "error".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> Summary {
        Summary {
            success: false,
            cause: Some("attempts_exhausted".to_owned()),
            status: None,
            attempts: vec![
                Attempt {
                    number: 1,
                    status: Some(503),
                    grpc: None,
                    error: None,
                    pause: Some(Duration::from_millis(100)),
                },
                Attempt {
                    number: 2,
                    status: None,
                    grpc: None,
                    error: Some("connect"),
                    pause: None,
                },
            ],
            elapsed: Duration::from_millis(123),
            notes: Vec::new(),
        }
    }

    #[test]
    fn json_has_exactly_the_spec_fields() {
        let v: serde_json::Value =
            serde_json::from_str(&summary().to_json().unwrap_or_default()).unwrap_or_default();
        assert_eq!(
            v,
            serde_json::json!({
                "outcome": "failure",
                "cause": "attempts_exhausted",
                "status": null,
                "attempts": [
                    {"attempt": 1, "status": 503, "error": null, "pause_ms": 100},
                    {"attempt": 2, "status": null, "error": "connect", "pause_ms": null}
                ],
                "elapsed_ms": 123
            })
        );
    }

    #[test]
    fn text_has_a_line_per_attempt_and_the_outcome() {
        assert_eq!(
            summary().to_text(),
            "attempt 1: HTTP 503, retrying in 100 ms\nattempt 2: connect error\n\
             failure: attempts_exhausted (last: connect error) after 2 attempts in 123 ms\n"
        );
    }
}
