//! The pause schedule between attempts (SPEC §2 step 7): pure numbers, no clock, no I/O.
//!
//! Retry `n` (n >= 1, the retry after failed attempt `n`) has the ceiling
//! `min(max, base × multiplier^(n-1))` ([`ceiling`]); the jitter kind then picks the pause:
//!
//! | jitter         | pause for retry `n`                                        |
//! |----------------|------------------------------------------------------------|
//! | `none`         | the ceiling                                                |
//! | `full`         | uniform in `[0, ceiling]`                                  |
//! | `equal`        | `ceiling/2 + uniform[0, ceiling/2]`                        |
//! | `decorrelated` | `min(max, uniform[base, previous_pause × 3])`, first `previous_pause = base` (AWS) |
//!
//! [`BackoffConfig`] is the policy (plain data); [`Backoff`] is the per-call state that walks it
//! (which retry comes next, the previous pause), kept apart as in tower's `backoff.rs`
//! (config and runtime apart). [`Schedule`] is the same walk as an endless `Iterator<Item = Duration>` owning its
//! RNG, in the style of `backon`. Randomness always comes from an injected [`Rng`], so a seeded
//! generator gives the same pauses every run.
//!
//! Nothing here panics or overflows: any retry number up to `u32::MAX`, any multiplier (one below
//! 1 or NaN, which validation refuses, counts as 1) and any durations saturate at `max`.

use std::time::Duration;

use crate::model::{BackoffConfig, Jitter};
use crate::rng::Rng;

/// The pause ceiling of retry `retry` (1 for the pause after the first attempt):
/// `min(max, base × multiplier^(retry-1))`. Retry 0 counts as retry 1.
pub fn ceiling(cfg: &BackoffConfig, retry: u32) -> Duration {
    let multiplier = if cfg.multiplier >= 1.0 {
        cfg.multiplier
    } else {
        1.0
    };
    grow(cfg.base, multiplier, retry.saturating_sub(1), cfg.max)
}

/// The `[low, high]` range the pause of retry `retry` can take under `cfg`'s jitter.
///
/// For `decorrelated` the pause depends on the previous one, so the range is the bound that holds
/// whatever computed pauses came before: `[min(base, max), min(max, base × 3^retry)]`. A pause
/// a server's `Retry-After` lengthened to `H` ([`Backoff::paused`]) lets the next one reach
/// `min(max, 3 × H)`.
pub fn jitter_range(cfg: &BackoffConfig, retry: u32) -> (Duration, Duration) {
    let c = ceiling(cfg, retry);
    match cfg.jitter {
        Jitter::None => (c, c),
        Jitter::Full => (Duration::ZERO, c),
        Jitter::Equal => (c / 2, c),
        Jitter::Decorrelated => (
            cfg.base.min(cfg.max),
            grow(cfg.base, 3.0, retry.max(1), cfg.max),
        ),
    }
}

/// The first attempt that can never start inside `deadline` when every attempt before it
/// fails at once and every pause is the shortest `cfg`'s jitter allows; `None` when all
/// `max_attempts` can. The engine gives up instead of pausing past the deadline (SPEC §2 step 7),
/// so no call under this schedule is sent more than `first - 1` times, unless a server's hint
/// replaces a pause by a shorter one (gRPC pushback; an HTTP `Retry-After` only lengthens).
pub fn first_unreachable_attempt(
    cfg: &BackoffConfig,
    max_attempts: u32,
    deadline: Duration,
) -> Option<u32> {
    let mut elapsed = Duration::ZERO;
    for retry in 1..max_attempts {
        let (low, _) = jitter_range(cfg, retry);
        elapsed = elapsed.saturating_add(low);
        if elapsed >= deadline {
            return Some(retry + 1);
        }
    }
    None
}

/// `min(cap, base × factor^exp)` for `factor >= 1`, rounded to the nanosecond, saturating.
fn grow(base: Duration, factor: f64, exp: u32, cap: Duration) -> Duration {
    if base.is_zero() {
        // Zero times anything, even an infinite factor, is zero.
        return Duration::ZERO;
    }
    if base >= cap {
        // factor >= 1, so the product can only be larger.
        return cap;
    }
    let base_nanos = as_f64(base);
    if exp == 0 && base_nanos < (1u64 << 52) as f64 {
        // `factor^0` is exactly 1, and a base this small is exact as an `f64` and stays below
        // the cap as one: the general path would give `base` back.
        return base;
    }
    let product = base_nanos * factor.powf(f64::from(exp));
    // Infinity lands here too; NaN cannot occur (base > 0, factor >= 1).
    if product.is_nan() || product >= as_f64(cap) {
        return cap;
    }
    let rounded = product.round();
    // Exact either way: the `u64` conversions are only the cheaper ones for the same values.
    if rounded < u64::MAX as f64 {
        Duration::from_nanos(rounded as u64).min(cap)
    } else {
        wide_from_f64(rounded).min(cap)
    }
}

/// `d` in nanoseconds as an `f64`, rounded to nearest like `d.as_nanos() as f64` (which it
/// equals), without the 128-bit conversion when the count fits in 64 bits.
fn as_f64(d: Duration) -> f64 {
    // 2^34 s is about 1.7 × 10^19 ns, below 2^64.
    if d.as_secs() < 1 << 34 {
        crate::window::duration_nanos(d) as f64
    } else {
        wide_as_f64(d)
    }
}

/// Out of line, so that the compiler does not compute the 128-bit conversion on the common path.
#[cold]
#[inline(never)]
fn wide_as_f64(d: Duration) -> f64 {
    d.as_nanos() as f64
}

/// `nanos` (at least 2^64) as a `Duration`, out of line like [`wide_as_f64`].
#[cold]
#[inline(never)]
fn wide_from_f64(nanos: f64) -> Duration {
    from_nanos(nanos as u128)
}

/// A `Duration` of `nanos` nanoseconds, saturating at `Duration::MAX`.
fn from_nanos(nanos: u128) -> Duration {
    const PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(nanos / PER_SEC).unwrap_or(u64::MAX);
    Duration::new(secs, (nanos % PER_SEC) as u32)
}

/// A uniform duration in `[0, max]` (nanosecond resolution; spans beyond ~584 years clamp).
fn uniform(rng: &mut (impl Rng + ?Sized), max: Duration) -> Duration {
    let span = crate::window::duration_nanos(max);
    Duration::from_nanos(rng.below_inclusive(span))
}

// === impl Backoff ===

/// Per-call backoff state: which retry comes next and the previous pause.
///
/// Holds its own copy of the [`BackoffConfig`] (a few words, no allocation), so it can live in a
/// call's future beside the policy snapshot it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Backoff {
    cfg: BackoffConfig,
    retry: u32,
    prev_pause: Duration,
}

impl Backoff {
    /// State before the first retry of a call.
    pub fn new(cfg: &BackoffConfig) -> Self {
        Self {
            cfg: cfg.clone(),
            retry: 0,
            prev_pause: cfg.base,
        }
    }

    /// The configuration this state walks.
    pub fn config(&self) -> &BackoffConfig {
        &self.cfg
    }

    /// How many pauses [`Backoff::next_pause`] has given so far (the number of the last retry).
    pub fn retries(&self) -> u32 {
        self.retry
    }

    /// The pause before the next retry: retry 1 on the first call, then 2, and so on.
    pub fn next_pause(&mut self, rng: &mut (impl Rng + ?Sized)) -> Duration {
        self.retry = self.retry.saturating_add(1);
        let cfg = &self.cfg;
        match cfg.jitter {
            Jitter::None => ceiling(cfg, self.retry),
            Jitter::Full => uniform(rng, ceiling(cfg, self.retry)),
            Jitter::Equal => {
                let c = ceiling(cfg, self.retry);
                let half = c / 2;
                // `c - half` rather than `half`, so an odd ceiling is still reachable.
                half + uniform(rng, c - half)
            }
            Jitter::Decorrelated => {
                let high = self.prev_pause.saturating_mul(3).max(cfg.base);
                let pause = cfg
                    .base
                    .saturating_add(uniform(rng, high - cfg.base))
                    .min(cfg.max);
                self.prev_pause = pause;
                pause
            }
        }
    }

    /// Tells the state that the retry last planned waited `taken` instead of the pause
    /// [`Backoff::next_pause`] gave (a server's `Retry-After` lengthened it): `decorrelated`
    /// draws the next pause from the previous pause taken (SPEC §2 step 7). The other kinds
    /// depend only on the retry's number.
    pub fn paused(&mut self, taken: Duration) {
        self.prev_pause = taken;
    }
}

// === impl Schedule ===

/// An endless iterator of pauses (retry 1, 2, …) that owns its RNG.
///
/// It never returns `None`; the caller stops it (`take(max_attempts - 1)`, a deadline).
#[derive(Clone, Debug)]
pub struct Schedule<R> {
    backoff: Backoff,
    rng: R,
}

impl<R: Rng> Schedule<R> {
    /// A schedule for `cfg` drawing its jitter from `rng`.
    pub fn new(cfg: &BackoffConfig, rng: R) -> Self {
        Self {
            backoff: Backoff::new(cfg),
            rng,
        }
    }
}

impl<R: Rng> Iterator for Schedule<R> {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.backoff.next_pause(&mut self.rng))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (usize::MAX, None)
    }
}

#[cfg(test)]
#[path = "backoff_tests.rs"]
mod tests;
