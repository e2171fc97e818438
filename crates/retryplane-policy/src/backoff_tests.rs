//! Tests of the pause schedule: ceilings, jitter ranges, saturation.

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

    #[test]
    fn ceilings_equal_the_plain_128_bit_arithmetic(
        base in prop_oneof![0u64..10_000_000_000, any::<u64>()],
        base_secs in prop_oneof![Just(0u64), 1u64 << 30..1u64 << 40, Just(u64::MAX)],
        max in prop_oneof![0u64..100_000_000_000, any::<u64>()],
        max_secs in prop_oneof![Just(0u64), 1u64 << 30..1u64 << 40, Just(u64::MAX)],
        multiplier in prop_oneof![1.0f64..10.0, Just(1.5), Just(1e300), Just(f64::INFINITY)],
        retry in prop_oneof![0u32..70, any::<u32>()],
    ) {
        let c = BackoffConfig {
            base: Duration::new(base_secs, 0).saturating_add(Duration::from_nanos(base)),
            max: Duration::new(max_secs, 0).saturating_add(Duration::from_nanos(max)),
            multiplier,
            jitter: Jitter::None,
        };
        prop_assert_eq!(ceiling(&c, retry), reference_ceiling(&c, retry));
    }
}

/// [`ceiling`] as first written: every conversion through `u128`.
fn reference_ceiling(cfg: &BackoffConfig, retry: u32) -> Duration {
    let factor = if cfg.multiplier >= 1.0 {
        cfg.multiplier
    } else {
        1.0
    };
    let (base, cap) = (cfg.base, cfg.max);
    if base.is_zero() {
        return Duration::ZERO;
    }
    if base >= cap {
        return cap;
    }
    let product = base.as_nanos() as f64 * factor.powf(f64::from(retry.saturating_sub(1)));
    if product.is_nan() || product >= cap.as_nanos() as f64 {
        return cap;
    }
    from_nanos(product.round() as u128).min(cap)
}
