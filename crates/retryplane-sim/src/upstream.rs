//! The simulated upstream: a capacity, a latency that grows with load, and the scenario's
//! failures.
//!
//! For a request sent at virtual time `t` (nanoseconds), in this order:
//!
//! 1. **Outage** (`t` in the outage window): the answer is `503` after the base latency × a
//!    uniform factor in `[0.5, 1.5]`. A load balancer with no healthy backend answers, so the
//!    request uses no capacity. Requests in flight when the outage starts are not affected.
//! 2. **Throttle** (`t` in the throttle window): `429` with `Retry-After: RETRY_AFTER`, after the
//!    same latency, using no capacity.
//! 3. **Capacity**: a token bucket filled at `capacity` tokens per second, holding at most
//!    `capacity × 100ms` tokens (at least [`MIN_BURST`]), full at the start. A request that finds less than
//!    one token is shed: `503` after the base latency × `[0.5, 1.5]`. So an overloaded upstream
//!    fails more, and retries of those failures overload it further.
//! 4. **Served**: it takes one token and is answered after
//!    `latency × uniform[0.5, 1.5] × (1 + 3 × load)`, where `load` is the share of the bucket
//!    in use (0 when full, 1 when empty): an upstream near its capacity is up to four times
//!    slower. With `error-rate:P` the answer is `503` with probability `P`, else `200`.
//!
//! The client turns an answer that would come after its attempt's timeout into a `timeout` at
//! the timeout (the upstream still did the work).

use retryplane_policy::rng::{Rng, SeededRng};

use crate::config::{Config, Scenario};

/// The fewest requests the upstream takes at once, whatever its capacity: a server holds a
/// few requests in flight or in its accept queue. With a bucket of one token, a small fleet
/// (one client at 1 request/s against a capacity of 1.5/s) had every second request that came
/// within a refill of another shed, so a healthy upstream at two thirds of its capacity
/// answered a third of its calls with `503`.
pub const MIN_BURST: f64 = 10.0;

/// What the upstream answers to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `200`.
    Ok,
    /// `503`: outage, shed for capacity, or a scenario error.
    Unavailable,
    /// `429` with a `Retry-After` of this many nanoseconds.
    Throttled(u64),
}

/// The upstream's state during one run.
#[derive(Debug)]
pub struct Upstream {
    window: Option<(u64, u64)>,
    throttle: Option<u64>,
    error_rate: f64,
    latency: f64,
    /// Tokens per nanosecond.
    refill: f64,
    burst: f64,
    tokens: f64,
    last: u64,
    rng: SeededRng,
}

/// A nanosecond count from a duration, saturating.
pub(crate) fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Upstream {
    /// A fresh upstream for `config`, its randomness drawn from `rng`.
    pub fn new(config: &Config, rng: SeededRng) -> Self {
        let burst = (config.capacity * 0.1).max(MIN_BURST);
        let (window, throttle, error_rate) = match config.scenario {
            Scenario::Outage { .. } => (config.scenario.window(), None, 0.0),
            Scenario::Throttle { retry_after, .. } => {
                (config.scenario.window(), Some(nanos(retry_after)), 0.0)
            }
            Scenario::ErrorRate { p } => (None, None, p),
        };
        Self {
            window: window.map(|(a, b)| (nanos(a), nanos(b))),
            throttle,
            error_rate,
            latency: config.latency.as_nanos() as f64,
            refill: config.capacity / 1e9,
            burst,
            tokens: burst,
            last: 0,
            rng,
        }
    }

    /// A uniform value in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Answers a request sent at `t`: what, and after how many nanoseconds.
    pub fn request(&mut self, t: u64) -> (Answer, u64) {
        let spread = 0.5 + self.unit();
        let base = (self.latency * spread) as u64;
        if let Some((start, end)) = self.window
            && (start..end).contains(&t)
        {
            return match self.throttle {
                Some(hint) => (Answer::Throttled(hint), base),
                None => (Answer::Unavailable, base),
            };
        }
        if t > self.last {
            let elapsed = (t - self.last) as f64;
            self.tokens = (self.tokens + elapsed * self.refill).min(self.burst);
            self.last = t;
        }
        if self.tokens < 1.0 {
            return (Answer::Unavailable, base);
        }
        self.tokens -= 1.0;
        let load = 1.0 - self.tokens / self.burst;
        let delay = (self.latency * spread * (1.0 + 3.0 * load)) as u64;
        let answer = if self.error_rate > 0.0 && self.unit() < self.error_rate {
            Answer::Unavailable
        } else {
            Answer::Ok
        };
        (answer, delay)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn upstream(scenario: Scenario, capacity: f64) -> Upstream {
        let config = Config {
            scenario,
            capacity,
            ..Config::default()
        };
        Upstream::new(&config, SeededRng::with_seed(3))
    }

    #[test]
    fn an_outage_answers_503_inside_its_window_only() {
        let mut u = upstream(Scenario::default(), 1e6);
        assert_eq!(u.request(29_999_999_999).0, Answer::Ok);
        assert_eq!(u.request(30_000_000_000).0, Answer::Unavailable);
        assert_eq!(u.request(49_999_999_999).0, Answer::Unavailable);
        assert_eq!(u.request(50_000_000_000).0, Answer::Ok);
    }

    #[test]
    fn a_throttle_answers_429_with_its_hint() {
        let scenario = Scenario::Throttle {
            start: Duration::ZERO,
            len: Duration::from_secs(1),
            retry_after: Duration::from_secs(5),
        };
        let mut u = upstream(scenario, 1e6);
        assert_eq!(u.request(0).0, Answer::Throttled(5_000_000_000));
    }

    #[test]
    fn requests_beyond_capacity_are_shed_and_latency_grows_with_load() {
        // Capacity 100/s: a bucket of 10 tokens. Eleven requests at once: ten served, one shed.
        let mut u = upstream(Scenario::ErrorRate { p: 0.0 }, 100.0);
        let answers: Vec<_> = (0..11).map(|_| u.request(1)).collect();
        assert!(answers[..10].iter().all(|(a, _)| *a == Answer::Ok));
        assert_eq!(answers[10].0, Answer::Unavailable);
        // The tenth request found the bucket nearly empty: at least 0.5 × (1 + 3 × 0.9) × 20ms.
        assert!(answers[9].1 >= 37_000_000, "{}", answers[9].1);
        // 100ms later the bucket holds 10 tokens again.
        assert_eq!(u.request(100_000_001).0, Answer::Ok);
    }

    #[test]
    fn an_error_rate_of_one_fails_every_request_and_zero_none() {
        let mut u = upstream(Scenario::ErrorRate { p: 1.0 }, 1e9);
        assert!((0..100).all(|i| u.request(i * 1_000_000).0 == Answer::Unavailable));
        let mut u = upstream(Scenario::ErrorRate { p: 0.0 }, 1e9);
        assert!((0..100).all(|i| u.request(i * 1_000_000).0 == Answer::Ok));
    }
}
