//! The budget and the breaker over months of uptime, with chosen instants.
//!
//! The smallest window a policy may hold is 1 ms (slots of 100 µs), so the 32-bit slot epochs of
//! `window.rs` wrap every 2^32 slots = 4.97 days, and sweeps run every 2^29 slots = 14.9 hours:
//! a service that runs for weeks meets both many times.

use std::time::Duration;

use retryplane_policy::breaker::{BreakerState, CircuitBreaker};
use retryplane_policy::budget::RetryBudget;
use retryplane_policy::model::{BreakerConfig, BudgetConfig};
use tokio::time::Instant;

/// A deterministic xorshift for the schedules.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

const SLOT: u64 = 100_000; // ns: a tenth of a 1 ms window
const WRAP: u64 = 1 << 32; // slots
const SWEEP: u64 = 1 << 29; // slots

/// The gap to the next event, in nanoseconds: mostly short, sometimes days, sometimes exactly
/// around a multiple of the sweep period or of the epoch wrap.
fn gap(rng: &mut Rng) -> u64 {
    match rng.below(1000) {
        0..=599 => rng.below(3 * SLOT),
        600..=989 => rng.below(30 * SLOT),
        990..=993 => rng.below(WRAP * 2) * SLOT + rng.below(SLOT),
        994..=995 => {
            (WRAP * (1 + rng.below(2)))
                .wrapping_add(rng.below(40))
                .wrapping_sub(20)
                * SLOT
        }
        _ => {
            (SWEEP * (1 + rng.below(8)))
                .wrapping_add(rng.below(40))
                .wrapping_sub(20)
                * SLOT
        }
    }
}

/// The exact slotted counts the budget should hold, from every event's slot.
#[derive(Default)]
struct Model {
    requests: Vec<u64>,
    retries: Vec<u64>,
}

fn count(events: &[u64], from: u64, to: u64) -> u64 {
    events.iter().filter(|&&s| s >= from && s <= to).count() as u64
}

#[test]
fn a_one_ms_budget_counts_exactly_over_months_of_uptime() {
    let cfg = BudgetConfig {
        ratio: 0.5,
        min_per_second: 2000, // reserve: 2 per 1 ms window
        window: Duration::from_millis(1),
    };
    for seed in 1..=20u64 {
        let origin = Instant::now();
        let budget = RetryBudget::new(&cfg, origin);
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut model = Model::default();
        let mut t: u64 = 0;
        let mut steps = 0;
        for step in 0..200_000 {
            t = t.saturating_add(gap(&mut rng));
            if t > 200 * 86_400 * 1_000_000_000 {
                break;
            }
            steps = step;
            let now = origin + Duration::from_nanos(t);
            let slot = t / SLOT;
            // Only the last 11 slots matter; drop the rest to keep the model small.
            model.requests.retain(|&s| s + 11 > slot);
            model.retries.retain(|&s| s + 11 > slot);
            let deposits = rng.below(3);
            for _ in 0..deposits {
                budget.deposit(now);
                model.requests.push(slot);
            }
            for _ in 0..rng.below(4) {
                let requests = count(&model.requests, slot.saturating_sub(9), slot);
                let retries = count(&model.retries, slot.saturating_sub(10), slot);
                let allowance = 2u64.max(requests / 2);
                let expected = retries < allowance;
                let got = budget.try_withdraw(now);
                assert_eq!(
                    got,
                    expected,
                    "seed {seed} step {step}: at {:.3} days (slot {slot}, slot mod 2^32 = {}), \
                     requests {requests}, retries {retries}: withdraw {got}, expected {expected}; \
                     snapshot {:?}",
                    t as f64 / 86_400e9,
                    slot % WRAP,
                    budget.snapshot(now)
                );
                if got {
                    model.retries.push(slot);
                }
            }
            let snap = budget.snapshot(now);
            let want = (
                count(&model.requests, slot.saturating_sub(9), slot),
                count(&model.retries, slot.saturating_sub(10), slot),
            );
            assert_eq!(
                (snap.requests, snap.retries),
                want,
                "seed {seed} step {step}: at {:.3} days (slot {slot})",
                t as f64 / 86_400e9
            );
        }
        eprintln!(
            "seed {seed}: {steps} steps, {:.1} days",
            t as f64 / 86_400e9
        );
    }
}

fn breaker_cfg() -> BreakerConfig {
    BreakerConfig {
        failure_ratio: 0.5,
        min_requests: 4,
        window: Duration::from_millis(1),
        open_for: Duration::from_millis(5),
        half_open_probes: 1,
    }
}

/// Four failures in one slot open a 1 ms breaker, at any age of the process.
fn fail_four(b: &CircuitBreaker, now: Instant) {
    for _ in 0..4 {
        if let Ok(p) = b.try_acquire(now) {
            b.record(p, false, now);
        }
    }
}

#[test]
fn a_one_ms_breaker_opens_and_closes_at_every_age_up_to_a_year() {
    let origin = Instant::now();
    let b = CircuitBreaker::new(&breaker_cfg(), origin);
    let mut rng = Rng(0xDEAD_BEEF);
    let mut t: u64 = 0;
    for step in 0..5_000 {
        t += gap(&mut rng).max(10 * 1_000_000); // past any open period
        if t > 365 * 86_400 * 1_000_000_000 {
            break;
        }
        let now = origin + Duration::from_nanos(t);
        // A few successes spread over the last slots, which must not stop an opening.
        assert_ne!(
            b.state(now),
            BreakerState::Open,
            "step {step}: still open {:.3} days in",
            t as f64 / 86_400e9
        );
        if b.state(now) == BreakerState::HalfOpen {
            let p = b.try_acquire(now).expect("a probe");
            b.record(p, true, now);
        }
        assert_eq!(b.state(now), BreakerState::Closed, "step {step}");
        fail_four(&b, now);
        assert_eq!(
            b.state(now),
            BreakerState::Open,
            "step {step}: four failures did not open it {:.3} days in (slot mod 2^32 = {})",
            t as f64 / 86_400e9,
            (t / SLOT) % WRAP
        );
    }
}

#[test]
fn a_budget_after_a_nine_hour_clock_jump_at_forty_days() {
    // A window of 10 s: the whole window's counts are gone after the clock jumps 9 hours.
    let origin = Instant::now();
    let cfg = BudgetConfig {
        ratio: 0.1,
        min_per_second: 1,
        window: Duration::from_secs(10),
    };
    let budget = RetryBudget::new(&cfg, origin);
    let start = origin + Duration::from_secs(40 * 86_400);
    for _ in 0..100 {
        budget.deposit(start);
    }
    let mut allowed = 0;
    while budget.try_withdraw(start) {
        allowed += 1;
    }
    assert_eq!(allowed, 10);
    let later = start + Duration::from_secs(9 * 3600);
    assert_eq!(budget.snapshot(later).requests, 0);
    assert_eq!(budget.snapshot(later).retries, 0);
    assert!(budget.try_withdraw(later), "the reserve is there again");
}
