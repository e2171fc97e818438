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
//! (STYLE.md #3). [`Schedule`] is the same walk as an endless `Iterator<Item = Duration>` owning its
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
/// whatever came before: `[min(base, max), min(max, base × 3^retry)]`.
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
    let product = base.as_nanos() as f64 * factor.powf(f64::from(exp));
    // Infinity lands here too; NaN cannot occur (base > 0, factor >= 1).
    if product.is_nan() || product >= cap.as_nanos() as f64 {
        return cap;
    }
    from_nanos(product.round() as u128).min(cap)
}

/// A `Duration` of `nanos` nanoseconds, saturating at `Duration::MAX`.
fn from_nanos(nanos: u128) -> Duration {
    const PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(nanos / PER_SEC).unwrap_or(u64::MAX);
    Duration::new(secs, (nanos % PER_SEC) as u32)
}

/// A uniform duration in `[0, max]` (nanosecond resolution; spans beyond ~584 years clamp).
fn uniform(rng: &mut (impl Rng + ?Sized), max: Duration) -> Duration {
    let span = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
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
mod tests {
    use super::*;
    use crate::rng::{Rng, SeededRng};
    use proptest::prelude::*;

    fn cfg(base_ms: u64, max_ms: u64, multiplier: f64, jitter: Jitter) -> BackoffConfig {
        BackoffConfig {
            base: Duration::from_millis(base_ms),
            max: Duration::from_millis(max_ms),
            multiplier,
            jitter,
        }
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn ceilings_double_then_cap_at_max() {
        let c = cfg(100, 2000, 2.0, Jitter::None);
        let got: Vec<_> = (1..=7).map(|n| ceiling(&c, n)).collect();
        let want: Vec<_> = [100, 200, 400, 800, 1600, 2000, 2000].map(ms).to_vec();
        assert_eq!(got, want);
    }

    #[test]
    fn no_jitter_pauses_follow_the_worked_schedule() {
        let c = cfg(100, 2000, 2.0, Jitter::None);
        let got: Vec<_> = Schedule::new(&c, SeededRng::with_seed(1)).take(7).collect();
        assert_eq!(got, [100, 200, 400, 800, 1600, 2000, 2000].map(ms));
    }

    #[test]
    fn huge_retry_numbers_and_multipliers_saturate_at_max() {
        for multiplier in [1.5, 2.0, 10.0, 1e300, f64::MAX, f64::INFINITY] {
            let c = cfg(100, 5000, multiplier, Jitter::None);
            assert_eq!(ceiling(&c, u32::MAX), ms(5000));
            assert_eq!(ceiling(&c, 1), ms(100));
        }
        let mut c = cfg(1000, 0, 2.0, Jitter::Full);
        c.max = Duration::MAX;
        assert_eq!(ceiling(&c, u32::MAX), Duration::MAX);
        assert!(jitter_range(&c, u32::MAX).1 == Duration::MAX);
        let mut b = Backoff::new(&c);
        let mut rng = SeededRng::with_seed(3);
        for jitter in Jitter::ALL {
            b.cfg.jitter = jitter;
            b.retry = u32::MAX - 1;
            let _ = b.next_pause(&mut rng);
            let _ = b.next_pause(&mut rng);
            assert_eq!(b.retries(), u32::MAX);
        }
    }

    #[test]
    fn multiplier_of_one_or_less_keeps_a_constant_ceiling() {
        for multiplier in [1.0, 0.5, -3.0, f64::NAN] {
            let c = cfg(250, 5000, multiplier, Jitter::None);
            assert_eq!(ceiling(&c, 1), ms(250));
            assert_eq!(ceiling(&c, 40), ms(250));
        }
    }

    #[test]
    fn fractional_multipliers_round_to_the_nanosecond() {
        let c = cfg(100, 5000, 1.5, Jitter::None);
        assert_eq!(ceiling(&c, 2), ms(150));
        assert_eq!(ceiling(&c, 3), ms(225));
        assert_eq!(ceiling(&c, 0), ms(100), "retry 0 counts as retry 1");
    }

    #[test]
    fn base_above_max_gives_max_and_zero_base_gives_zero() {
        let c = cfg(3000, 1000, 2.0, Jitter::Decorrelated);
        assert_eq!(ceiling(&c, 1), ms(1000));
        let mut b = Backoff::new(&c);
        let mut rng = SeededRng::with_seed(9);
        assert_eq!(b.next_pause(&mut rng), ms(1000));
        let inf = cfg(0, 1000, f64::INFINITY, Jitter::None);
        assert_eq!(ceiling(&inf, 2), Duration::ZERO);
        let zero = cfg(0, 1000, 2.0, Jitter::Decorrelated);
        let pauses: Vec<_> = Schedule::new(&zero, SeededRng::with_seed(9))
            .take(5)
            .collect();
        assert_eq!(pauses, [Duration::ZERO; 5]);
    }

    #[test]
    fn decorrelated_first_pause_is_between_base_and_three_times_base() {
        let c = cfg(100, 60_000, 2.0, Jitter::Decorrelated);
        for seed in 0..200 {
            let p = Backoff::new(&c).next_pause(&mut SeededRng::with_seed(seed));
            assert!((ms(100)..=ms(300)).contains(&p), "{p:?}");
        }
    }

    #[test]
    fn jitter_ranges_match_each_kind() {
        let mut c = cfg(100, 2000, 2.0, Jitter::None);
        assert_eq!(jitter_range(&c, 3), (ms(400), ms(400)));
        c.jitter = Jitter::Full;
        assert_eq!(jitter_range(&c, 3), (Duration::ZERO, ms(400)));
        c.jitter = Jitter::Equal;
        assert_eq!(jitter_range(&c, 3), (ms(200), ms(400)));
        c.jitter = Jitter::Decorrelated;
        assert_eq!(jitter_range(&c, 1), (ms(100), ms(300)));
        assert_eq!(jitter_range(&c, 2), (ms(100), ms(900)));
        assert_eq!(jitter_range(&c, 3), (ms(100), ms(2000)));
    }

    #[test]
    fn works_through_a_dyn_rng() {
        let c = cfg(100, 2000, 2.0, Jitter::Full);
        let mut seeded = SeededRng::with_seed(5);
        let rng: &mut dyn Rng = &mut seeded;
        let mut b = Backoff::new(&c);
        assert!(b.next_pause(rng) <= ms(100));
        assert_eq!(b.config(), &c);
    }

    fn any_cfg() -> impl Strategy<Value = BackoffConfig> {
        (0u64..10_000_000_000, 0u64..100_000_000_000, 1.0f64..10.0).prop_map(
            |(base, extra, multiplier)| BackoffConfig {
                base: Duration::from_nanos(base),
                max: Duration::from_nanos(base + extra),
                multiplier,
                jitter: Jitter::None,
            },
        )
    }

    fn pauses(c: &BackoffConfig, jitter: Jitter, seed: u64, n: usize) -> Vec<Duration> {
        let c = BackoffConfig {
            jitter,
            ..c.clone()
        };
        Schedule::new(&c, SeededRng::with_seed(seed))
            .take(n)
            .collect()
    }

    proptest! {
        #[test]
        fn full_jitter_pause_stays_within_its_ceiling(c in any_cfg(), seed: u64) {
            for (i, p) in pauses(&c, Jitter::Full, seed, 40).into_iter().enumerate() {
                prop_assert!(p <= ceiling(&c, i as u32 + 1));
            }
        }

        #[test]
        fn equal_jitter_pause_stays_in_the_upper_half(c in any_cfg(), seed: u64) {
            for (i, p) in pauses(&c, Jitter::Equal, seed, 40).into_iter().enumerate() {
                let ceil = ceiling(&c, i as u32 + 1);
                prop_assert!(ceil / 2 <= p && p <= ceil);
            }
        }

        #[test]
        fn decorrelated_pause_stays_between_base_and_max(c in any_cfg(), seed: u64) {
            for p in pauses(&c, Jitter::Decorrelated, seed, 40) {
                prop_assert!(c.base <= p && p <= c.max);
            }
        }

        #[test]
        fn every_pause_lies_in_its_jitter_range(c in any_cfg(), seed: u64) {
            for jitter in Jitter::ALL {
                let c = BackoffConfig { jitter, ..c.clone() };
                for (i, p) in pauses(&c, jitter, seed, 40).into_iter().enumerate() {
                    let (low, high) = jitter_range(&c, i as u32 + 1);
                    prop_assert!(low <= p && p <= high, "{jitter:?} retry {}: {p:?}", i + 1);
                }
            }
        }

        #[test]
        fn ceilings_never_decrease_and_never_pass_max(c in any_cfg()) {
            let mut prev = Duration::ZERO;
            for n in (1..200).chain([1_000, 100_000, u32::MAX]) {
                let ceil = ceiling(&c, n);
                prop_assert!(prev <= ceil && ceil <= c.max, "retry {n}: {prev:?} > {ceil:?}");
                prev = ceil;
            }
        }

        #[test]
        fn same_seed_gives_the_same_pauses(c in any_cfg(), seed: u64) {
            for jitter in Jitter::ALL {
                prop_assert_eq!(
                    pauses(&c, jitter, seed, 20),
                    pauses(&c, jitter, seed, 20)
                );
            }
        }
    }
}
