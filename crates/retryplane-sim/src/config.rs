//! What to simulate: the fleet, the upstream and the scenario, checked once.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use retryplane_policy::duration::{format_duration, parse_duration};

/// The most logical calls one run may simulate per variant (`clients × rate × duration`).
pub const MAX_CALLS: f64 = 20_000_000.0;
/// The most logical calls one variant may hold in flight (or paused) at once: a call in
/// flight takes about 220 bytes until it ends, in each of the four variants run side by side,
/// so a run stays under about 2 GB. A run that reaches it stops with
/// [`ConfigError::TooManyInFlight`].
pub const MAX_IN_FLIGHT: usize = 2_000_000;
/// The longest run.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);
/// The longest base latency of the upstream.
pub const MAX_LATENCY: Duration = Duration::from_secs(60);
/// The most clients: each has its own state and RNG in every variant (about 3 KB in all).
pub const MAX_CLIENTS: u32 = 100_000;
/// The most clients × seconds of run: every client is looked at once per simulated second,
/// whether it calls or not (10⁸ takes about 20 s here).
pub const MAX_CLIENT_SECONDS: f64 = 100_000_000.0;
/// The highest rate per client: arrivals are drawn to the nanosecond, so a mean gap under a
/// microsecond would no longer be a Poisson process.
pub const MAX_RATE: f64 = 1_000_000.0;
/// The highest upstream capacity, requests per second.
pub const MAX_CAPACITY: f64 = 1_000_000_000.0;

/// How the upstream fails, besides being overloaded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scenario {
    /// From `start` for `len`, every request is answered `503` (after the base latency) and
    /// requests in flight at `start` are not affected; the upstream's capacity is not used.
    Outage {
        /// When it starts, from the beginning of the run.
        start: Duration,
        /// How long it lasts.
        len: Duration,
    },
    /// During the whole run, each request the upstream serves fails with `503` with probability
    /// `p` (it still costs capacity).
    ErrorRate {
        /// In `0..=1`.
        p: f64,
    },
    /// From `start` for `len`, every request is answered `429` with `Retry-After: retry_after`
    /// (after the base latency); the upstream's capacity is not used.
    Throttle {
        /// When it starts.
        start: Duration,
        /// How long it lasts.
        len: Duration,
        /// The hint every `429` carries.
        retry_after: Duration,
    },
}

impl Scenario {
    /// The incident window `[start, end)`, when the scenario has one.
    pub fn window(&self) -> Option<(Duration, Duration)> {
        match *self {
            Scenario::Outage { start, len } | Scenario::Throttle { start, len, .. } => {
                Some((start, start.saturating_add(len)))
            }
            Scenario::ErrorRate { .. } => None,
        }
    }
}

impl Default for Scenario {
    /// `outage:30s+20s`.
    fn default() -> Self {
        Scenario::Outage {
            start: Duration::from_secs(30),
            len: Duration::from_secs(20),
        }
    }
}

/// The scenario as written on the command line: `outage:30s+20s`, `error-rate:0.1`,
/// `throttle:30s+20s:5s`.
impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Scenario::Outage { start, len } => write!(
                f,
                "outage:{}+{}",
                format_duration(start),
                format_duration(len)
            ),
            Scenario::ErrorRate { p } => write!(f, "error-rate:{p}"),
            Scenario::Throttle {
                start,
                len,
                retry_after,
            } => write!(
                f,
                "throttle:{}+{}:{}",
                format_duration(start),
                format_duration(len),
                format_duration(retry_after)
            ),
        }
    }
}

/// Why a scenario or a configuration was refused, or a run stopped before its end.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The scenario text does not parse.
    #[error(
        "scenario `{0}`: expected outage:START+LEN, error-rate:P or throttle:START+LEN:RETRY_AFTER (for example outage:30s+20s)"
    )]
    Scenario(String),
    /// A duration inside the scenario does not parse.
    #[error("scenario `{scenario}`: {source}")]
    ScenarioDuration {
        /// The whole scenario text.
        scenario: String,
        /// What is wrong with the duration.
        source: retryplane_policy::duration::DurationError,
    },
    /// A probability outside `0..=1`.
    #[error("scenario `{0}`: the error rate must be a number between 0 and 1")]
    ErrorRate(String),
    /// A throttle's Retry-After that is not whole seconds, as HTTP's `Retry-After` is.
    #[error(
        "scenario `{0}`: RETRY_AFTER must be whole seconds, as HTTP's Retry-After is (an agent ignores `1.5`)"
    )]
    RetryAfterNotWholeSeconds(String),
    /// The outage or throttle lasts zero time.
    #[error("scenario `{0}`: the length must be more than 0s")]
    EmptyWindow(String),
    /// A field out of its range.
    #[error("{field} must be {expected}, not {value}")]
    OutOfRange {
        /// The flag or field.
        field: &'static str,
        /// The accepted range, in words.
        expected: &'static str,
        /// The value given.
        value: String,
    },
    /// The incident starts after the run ends.
    #[error("the scenario starts at {start}, at or after the end of the run ({duration})")]
    AfterRun {
        /// The incident start.
        start: String,
        /// The run length.
        duration: String,
    },
    /// The run would look at its clients too often to finish in reasonable time.
    #[error(
        "{clients} clients for {duration} are {client_seconds:.0} client-seconds to simulate; at most {MAX_CLIENT_SECONDS:.0}: fewer clients or a shorter run"
    )]
    TooLong {
        /// Clients.
        clients: u32,
        /// The run length.
        duration: String,
        /// Clients × seconds of run.
        client_seconds: f64,
    },
    /// The run would be too large to simulate in reasonable time and memory.
    #[error(
        "{clients} clients × {rate}/s × {duration} is about {calls:.0} calls per variant; at most {MAX_CALLS:.0}"
    )]
    TooLarge {
        /// Clients.
        clients: u32,
        /// Calls per second per client.
        rate: f64,
        /// The run length.
        duration: String,
        /// The expected number of logical calls.
        calls: f64,
    },
    /// A variant held too many calls in flight at once (see [`MAX_IN_FLIGHT`]).
    #[error(
        "the {variant} variant reached its limit of {limit} calls in flight at once {at_s:.1} s into the run (its pauses and deadline keep calls going while new ones arrive): fewer clients, a lower rate, or a shorter deadline or outage"
    )]
    TooManyInFlight {
        /// The variant's short name.
        variant: &'static str,
        /// The calls it held in flight.
        limit: usize,
        /// When, in seconds of the run.
        at_s: f64,
    },
}

impl FromStr for Scenario {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let bad = || ConfigError::Scenario(text.to_owned());
        let dur = |s: &str| {
            parse_duration(s).map_err(|source| ConfigError::ScenarioDuration {
                scenario: text.to_owned(),
                source,
            })
        };
        let window = |s: &str| -> Result<(Duration, Duration), ConfigError> {
            let (start, len) = s.split_once('+').ok_or_else(bad)?;
            let (start, len) = (dur(start)?, dur(len)?);
            if len.is_zero() {
                return Err(ConfigError::EmptyWindow(text.to_owned()));
            }
            Ok((start, len))
        };
        let (kind, rest) = text.trim().split_once(':').ok_or_else(bad)?;
        match kind {
            "outage" => {
                let (start, len) = window(rest)?;
                Ok(Scenario::Outage { start, len })
            }
            "error-rate" => match rest.trim().parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => Ok(Scenario::ErrorRate { p }),
                _ => Err(ConfigError::ErrorRate(text.to_owned())),
            },
            "throttle" => {
                let (span, retry_after) = rest.rsplit_once(':').ok_or_else(bad)?;
                let (start, len) = window(span)?;
                let retry_after = dur(retry_after)?;
                if retry_after.subsec_nanos() != 0 {
                    return Err(ConfigError::RetryAfterNotWholeSeconds(text.to_owned()));
                }
                Ok(Scenario::Throttle {
                    start,
                    len,
                    retry_after,
                })
            }
            _ => Err(bad()),
        }
    }
}

/// One simulation: the fleet, the upstream, the scenario and the seed.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Clients, each with its own budget, breaker and RNG.
    pub clients: u32,
    /// Logical calls per second per client (Poisson arrivals).
    pub rate: f64,
    /// Calls start in `[0, duration)`; calls still running at the end are finished.
    pub duration: Duration,
    /// How the upstream fails.
    pub scenario: Scenario,
    /// Requests per second the upstream serves; above it, requests fail with `503`.
    pub capacity: f64,
    /// The upstream's base latency, unloaded.
    pub latency: Duration,
    /// Seeds every random choice; the same seed gives the same report.
    pub seed: u64,
}

impl Default for Config {
    /// 1,000 clients × 1 call/s for 120 s, `outage:30s+20s`, capacity 1.5 × the offered load,
    /// 20 ms latency, seed 1.
    fn default() -> Self {
        Self {
            clients: 1000,
            rate: 1.0,
            duration: Duration::from_secs(120),
            scenario: Scenario::default(),
            capacity: Self::default_capacity(1000, 1.0),
            latency: Duration::from_millis(20),
            seed: 1,
        }
    }
}

impl Config {
    /// The default capacity: 1.5 × the offered load (`clients × rate`), 50% headroom, at most
    /// [`MAX_CAPACITY`].
    pub fn default_capacity(clients: u32, rate: f64) -> f64 {
        (1.5 * f64::from(clients) * rate).min(MAX_CAPACITY)
    }

    /// Checks every field and how they fit together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let range = |field, expected, value: String| ConfigError::OutOfRange {
            field,
            expected,
            value,
        };
        if self.clients == 0 || self.clients > MAX_CLIENTS {
            return Err(range(
                "clients",
                "from 1 to 100000",
                self.clients.to_string(),
            ));
        }
        if !(self.rate.is_finite() && self.rate > 0.0 && self.rate <= MAX_RATE) {
            return Err(range(
                "rate",
                "a number of calls per second per client above 0 and at most 1000000",
                self.rate.to_string(),
            ));
        }
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            return Err(range(
                "duration",
                "between 1ms and 24h",
                format_duration(self.duration),
            ));
        }
        if !(self.capacity.is_finite() && self.capacity > 0.0 && self.capacity <= MAX_CAPACITY) {
            return Err(range(
                "capacity",
                "a number of requests per second above 0 and at most 1000000000",
                self.capacity.to_string(),
            ));
        }
        if self.latency > MAX_LATENCY {
            return Err(range(
                "latency",
                "at most 60s",
                format_duration(self.latency),
            ));
        }
        let client_seconds = f64::from(self.clients) * self.duration.as_secs_f64().ceil();
        if client_seconds > MAX_CLIENT_SECONDS {
            return Err(ConfigError::TooLong {
                clients: self.clients,
                duration: format_duration(self.duration),
                client_seconds,
            });
        }
        let calls = f64::from(self.clients) * self.rate * self.duration.as_secs_f64();
        if calls > MAX_CALLS {
            return Err(ConfigError::TooLarge {
                clients: self.clients,
                rate: self.rate,
                duration: format_duration(self.duration),
                calls,
            });
        }
        // What parsing the scenario's text checks, for one built in code.
        match self.scenario {
            Scenario::ErrorRate { p } if !(0.0..=1.0).contains(&p) => {
                return Err(ConfigError::ErrorRate(self.scenario.to_string()));
            }
            Scenario::Outage { len, .. } | Scenario::Throttle { len, .. } if len.is_zero() => {
                return Err(ConfigError::EmptyWindow(self.scenario.to_string()));
            }
            Scenario::Throttle { retry_after, .. } if retry_after.subsec_nanos() != 0 => {
                return Err(ConfigError::RetryAfterNotWholeSeconds(
                    self.scenario.to_string(),
                ));
            }
            _ => {}
        }
        if let Some((start, _)) = self.scenario.window()
            && start >= self.duration
        {
            return Err(ConfigError::AfterRun {
                start: format_duration(start),
                duration: format_duration(self.duration),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenarios_parse_and_print_back() {
        for text in ["outage:30s+20s", "error-rate:0.25", "throttle:10s+1m:5s"] {
            let s: Scenario = text.parse().unwrap();
            assert_eq!(s.to_string(), text);
        }
        assert_eq!(
            "throttle:1500ms+2s:2000ms".parse::<Scenario>().unwrap(),
            Scenario::Throttle {
                start: Duration::from_millis(1500),
                len: Duration::from_secs(2),
                retry_after: Duration::from_secs(2)
            }
        );
    }

    #[test]
    fn malformed_scenarios_say_what_is_expected() {
        for text in ["outage", "outage:30s", "blackout:1s+2s", "throttle:1s+2s"] {
            let e = text.parse::<Scenario>().unwrap_err().to_string();
            assert!(e.contains("expected outage:START+LEN"), "{text}: {e}");
        }
        let e = "outage:30+20s".parse::<Scenario>().unwrap_err().to_string();
        assert!(e.contains("needs a unit"), "{e}");
        let e = "error-rate:1.5"
            .parse::<Scenario>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("between 0 and 1"), "{e}");
        let e = "outage:1s+0s".parse::<Scenario>().unwrap_err().to_string();
        assert!(e.contains("more than 0s"), "{e}");
        // HTTP's Retry-After is whole seconds: a scenario cannot send what no upstream can.
        let e = "throttle:1s+2s:1500ms"
            .parse::<Scenario>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("RETRY_AFTER must be whole seconds"), "{e}");
        // A scenario built in code is checked as its text would be.
        for scenario in [
            Scenario::Throttle {
                start: Duration::from_secs(1),
                len: Duration::from_secs(2),
                retry_after: Duration::from_millis(500),
            },
            Scenario::Outage {
                start: Duration::from_secs(1),
                len: Duration::ZERO,
            },
            Scenario::ErrorRate { p: f64::NAN },
            Scenario::ErrorRate { p: 1.5 },
        ] {
            let config = Config {
                scenario,
                ..Config::default()
            };
            assert!(config.validate().is_err(), "{scenario:?}");
        }
    }

    #[test]
    fn a_scenario_after_the_end_of_the_run_is_refused() {
        let config = Config {
            duration: Duration::from_secs(20),
            ..Config::default()
        };
        let e = config.validate().unwrap_err().to_string();
        assert_eq!(
            e,
            "the scenario starts at 30s, at or after the end of the run (20s)"
        );
    }

    #[test]
    fn clients_rates_and_capacities_past_what_can_be_simulated_are_refused() {
        let with = |clients, rate, capacity, secs| Config {
            clients,
            rate,
            capacity,
            duration: Duration::from_secs(secs),
            ..Config::default()
        };
        // Each was accepted and then ran out of memory, ran for hours, miscounted its calls
        // or never finished its plot.
        for (config, field) in [
            (with(100_001, 1e-9, 1.0, 120), "clients"),
            (with(4_000_000_000, 1e-9, 1.0, 120), "clients"),
            (with(1, 1e7, 1.0, 1), "rate"),
            (with(1_000, 1.0, 1e306, 120), "capacity"),
        ] {
            let e = config.validate().unwrap_err();
            assert!(
                matches!(e, ConfigError::OutOfRange { field: f, .. } if f == field),
                "{e}"
            );
        }
        let e = with(100_000, 1e-6, 1.0, 24 * 3600).validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "100000 clients for 24h are 8640000000 client-seconds to simulate; at most 100000000: fewer clients or a shorter run"
        );
        assert_eq!(with(100_000, 0.01, 1e9, 1000).validate(), Ok(()));
        let busiest = Config {
            scenario: "error-rate:0.5".parse().unwrap(),
            ..with(1, 1e6, 1.0, 10)
        };
        assert_eq!(busiest.validate(), Ok(()));
        // A default capacity (1.5 × clients × rate) stays within the bound it is checked by.
        let default = Config::default_capacity(1_000, 1e6);
        assert_eq!(default, MAX_CAPACITY);
    }

    #[test]
    fn runs_beyond_twenty_million_calls_are_refused() {
        let config = Config {
            clients: 100_000,
            rate: 1_000.0,
            ..Config::default()
        };
        assert!(matches!(
            config.validate(),
            Err(ConfigError::TooLarge { .. })
        ));
        assert_eq!(Config::default().validate(), Ok(()));
    }
}
