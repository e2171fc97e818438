//! When to reconnect: jittered, capped exponential backoff, reset after a stable connection.
//!
//! A pure state machine (no clock, no sleeping): the stream task asks [`ReconnectBackoff::next_delay`]
//! after each failed connection attempt or dropped stream, and tells
//! [`ReconnectBackoff::session_ended`] how long a stream stayed up. The delay ceiling doubles
//! from `base` up to `max`; the delay is "equal jitter" — `ceiling/2 + uniform[0, ceiling/2]` —
//! so agents that lost the same control plane spread out instead of reconnecting in lock-step,
//! and no delay is ever zero. A stream that stayed up for `stable_after` resets the ceiling;
//! the reconnect after it is drawn from half the base to [`SPREAD_AFTER_LOSS`] (1 s; the
//! ceiling when that is longer), uniformly: a fleet whose control plane ended every stream at
//! once (a restart, a rolling deploy) would otherwise come back within 50–100 ms of each
//! other, a thousand agents' Hellos and resent reports in one burst. A stable stream the
//! control plane ended at one of its limits (`RESOURCE_EXHAUSTED`,
//! [`ReconnectBackoff::session_ended_under_load`]) does not reset the ceiling, and the
//! reconnect after it is drawn from half the ceiling to the spread (or the ceiling).

use std::time::Duration;

use retryplane_policy::rng::Rng;

/// How long the reconnects of a fleet that lost its streams at once are spread over: the first
/// after a stable stream is uniform over this (at most the backoff's `max`), as gRPC's own
/// connection backoff starts at 1 s. About 1,000 Hellos a second for a fleet of 1,000.
pub const SPREAD_AFTER_LOSS: Duration = Duration::from_secs(1);

/// Reconnect backoff. Defaults: 100 ms → 30 s, reset after 10 s connected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconnectBackoff {
    base: Duration,
    max: Duration,
    stable_after: Duration,
    failures: u32,
    /// The next delay is the spread after a stable stream's end ([`SPREAD_AFTER_LOSS`]).
    spread: bool,
}

impl Default for ReconnectBackoff {
    fn default() -> Self {
        Self::new(
            Duration::from_millis(100),
            Duration::from_secs(30),
            Duration::from_secs(10),
        )
    }
}

impl ReconnectBackoff {
    /// The smallest `base`: 1 ms.
    pub const MIN_BASE: Duration = Duration::from_millis(1);

    /// Backoff from `base` to `max` (`max` below `base` is raised to `base`), reset after a
    /// stream stays up `stable_after` (raised to `base` when below it). A `base` under [`MIN_BASE`](Self::MIN_BASE) (zero, say)
    /// is raised to it: doubling zero would never back off, and the agent would retry a control
    /// plane that is down in a busy loop.
    pub fn new(base: Duration, max: Duration, stable_after: Duration) -> Self {
        let base = base.max(Self::MIN_BASE);
        Self {
            base,
            max: max.max(base),
            // Below the base, a stream that ends as it opens would count as stable, and an
            // agent whose control plane accepts and ends every stream would never back off.
            stable_after: stable_after.max(base),
            failures: 0,
            spread: false,
        }
    }

    /// The current ceiling: `min(max, base × 2^failures)`.
    pub(crate) fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.failures.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The wait before the next connection attempt; each call raises the ceiling.
    pub(crate) fn next_delay(&mut self, rng: &mut (impl Rng + ?Sized)) -> Duration {
        let ceiling = self.ceiling();
        self.failures = self.failures.saturating_add(1);
        if std::mem::take(&mut self.spread) {
            // Uniform from half the ceiling (half the base, after a stable stream reset it) to
            // the spread: agents that lost the same control plane at once come back spread
            // over it; a ceiling past it keeps its growth (a control plane at its limits).
            let from = ceiling / 2;
            let to = SPREAD_AFTER_LOSS.max(ceiling).min(self.max).max(from);
            let span = u64::try_from((to - from).as_nanos()).unwrap_or(u64::MAX);
            return (from + Duration::from_nanos(rng.below_inclusive(span))).max(Self::MIN_BASE);
        }
        let half = ceiling / 2;
        let span = u64::try_from((ceiling - half).as_nanos()).unwrap_or(u64::MAX);
        half + Duration::from_nanos(rng.below_inclusive(span))
    }

    /// Raises the ceiling to `max`: the next delay is the longest (a stream another process
    /// with the same agent id replaced, which reconnecting at once would replace in turn). A
    /// later stable stream resets it as usual.
    pub(crate) fn back_off_fully(&mut self) {
        self.failures = 31;
        self.spread = false;
    }

    /// A stream that was up for `lasted` ended: a stable one resets the backoff, and the next
    /// delay is drawn over [`SPREAD_AFTER_LOSS`].
    pub(crate) fn session_ended(&mut self, lasted: Duration) {
        if lasted >= self.stable_after {
            self.failures = 0;
            self.spread = true;
        }
    }

    /// A stream that was up for `lasted` was ended by a control plane at one of its limits
    /// (`RESOURCE_EXHAUSTED`): the backoff is not reset, however long the stream was up (the
    /// control plane is not asked again each second), but after a stable one the next delay
    /// is still drawn over the spread, from half the ceiling (up to the ceiling when that is
    /// longer): such ends come to many agents at once (a full room, a snapshot too large for
    /// them all).
    pub(crate) fn session_ended_under_load(&mut self, lasted: Duration) {
        if lasted >= self.stable_after {
            self.spread = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retryplane_policy::rng::SeededRng;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A stable stream ended by a control plane at its limits: the next delay is spread over
    /// the second, from half the ceiling, and the ceiling keeps growing; past a second, the
    /// delays are the ceiling's as before.
    #[test]
    fn a_stable_stream_ended_under_load_is_spread_without_a_reset() {
        let mut rng = SeededRng::with_seed(11);
        let mut firsts = Vec::new();
        for _ in 0..1_000 {
            let mut b = ReconnectBackoff::default();
            b.next_delay(&mut rng);
            b.session_ended_under_load(ms(10_000));
            assert!(b.spread);
            assert_eq!(b.ceiling(), ms(200), "not reset");
            let d = b.next_delay(&mut rng);
            assert!(d >= ms(100) && d <= SPREAD_AFTER_LOSS, "{d:?}");
            firsts.push(d);
            assert_eq!(b.ceiling(), ms(400));
        }
        // Spread over 100 ms to a second: each of 9 slices of 100 ms holds about a ninth.
        for slice in 1..10u64 {
            let within = firsts
                .iter()
                .filter(|d| (ms(slice * 100)..ms(slice * 100 + 100)).contains(d))
                .count();
            assert!((70..=160).contains(&within), "{slice}: {within}");
        }
        // A short stream is not spread; past a second, the ceiling's own jitter.
        let mut b = ReconnectBackoff::default();
        b.session_ended_under_load(ms(9_999));
        assert!(!b.spread);
        for _ in 0..5 {
            b.next_delay(&mut rng);
        }
        assert_eq!(b.ceiling(), ms(3_200));
        b.session_ended_under_load(ms(10_000));
        let d = b.next_delay(&mut rng);
        assert!(d >= ms(1_600) && d <= ms(3_200), "{d:?}");
    }

    /// A `stable_after` under the base is raised to it: a stream that ends as it opens is
    /// not stable.
    #[test]
    fn a_stream_shorter_than_the_base_is_never_stable() {
        let mut b = ReconnectBackoff::new(ms(100), ms(1_000), Duration::ZERO);
        let mut rng = SeededRng::with_seed(2);
        for _ in 0..4 {
            b.session_ended(ms(1));
            b.next_delay(&mut rng);
        }
        assert_eq!(b.ceiling(), ms(1_000));
        b.session_ended(ms(100));
        assert_eq!(b.ceiling(), ms(100));
    }

    #[test]
    fn backing_off_fully_waits_at_least_half_the_max_until_a_stable_stream() {
        let mut b = ReconnectBackoff::new(ms(100), ms(30_000), ms(10_000));
        let mut rng = SeededRng::with_seed(3);
        b.back_off_fully();
        assert_eq!(b.ceiling(), ms(30_000));
        let d = b.next_delay(&mut rng);
        assert!(d >= ms(15_000) && d <= ms(30_000), "{d:?}");
        b.session_ended(ms(10_000));
        assert_eq!(b.ceiling(), ms(100));
    }

    /// After a stable stream, the first delay is spread uniformly over a second (a fleet whose
    /// streams all ended at once does not come back within 50-100 ms); the ones after it back
    /// off from the base again.
    #[test]
    fn the_reconnect_after_a_stable_stream_is_spread_over_a_second() {
        let mut rng = SeededRng::with_seed(11);
        let mut firsts = Vec::new();
        for _ in 0..1_000 {
            let mut b = ReconnectBackoff::default();
            b.session_ended(ms(10_000));
            assert!(b.spread);
            let d = b.next_delay(&mut rng);
            assert!(d >= ms(50) && d <= SPREAD_AFTER_LOSS, "{d:?}");
            assert!(!b.spread, "once");
            firsts.push(d);
            assert_eq!(b.ceiling(), ms(200), "then doubling as before");
            let next = b.next_delay(&mut rng);
            assert!(next >= ms(100) && next <= ms(200), "{next:?}");
        }
        // Spread from 50 ms to the second: each of 19 slices of 50 ms holds about a
        // nineteenth of the fleet.
        for slice in 1..20u64 {
            let within = firsts
                .iter()
                .filter(|d| (ms(slice * 50)..ms(slice * 50 + 50)).contains(d))
                .count();
            assert!((25..=85).contains(&within), "{slice}: {within}");
        }
        // A short stream is not spread; a backoff whose max is under a second is spread to it.
        let mut b = ReconnectBackoff::new(ms(10), ms(50), ms(1_000));
        b.session_ended(ms(999));
        assert!(!b.spread);
        b.session_ended(ms(1_000));
        assert!(b.spread);
        for _ in 0..100 {
            b.session_ended(ms(1_000));
            let d = b.next_delay(&mut rng);
            assert!(d >= ms(5) && d <= ms(50), "{d:?}");
        }
        // A replaced stream waits the longest, spread or not.
        b.session_ended(ms(1_000));
        b.back_off_fully();
        assert!(!b.spread);
        assert_eq!(b.ceiling(), ms(50));
        // A base over the spread keeps its own: from half of it to it.
        let mut b = ReconnectBackoff::new(ms(5_000), ms(30_000), ms(10_000));
        for _ in 0..100 {
            b.session_ended(ms(10_000));
            let d = b.next_delay(&mut rng);
            assert!(d >= ms(2_500) && d <= ms(5_000), "{d:?}");
        }
    }

    #[test]
    fn ceilings_double_from_base_and_stop_at_max() {
        let mut b = ReconnectBackoff::new(ms(100), ms(1000), ms(5000));
        let mut rng = SeededRng::with_seed(1);
        let mut ceilings = Vec::new();
        for _ in 0..7 {
            ceilings.push(b.ceiling());
            b.next_delay(&mut rng);
        }
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1000, 1000, 1000].map(ms).to_vec()
        );
    }

    #[test]
    fn every_delay_lies_between_half_the_ceiling_and_the_ceiling() {
        let mut b = ReconnectBackoff::default();
        let mut rng = SeededRng::with_seed(7);
        for _ in 0..200 {
            let ceiling = b.ceiling();
            let d = b.next_delay(&mut rng);
            assert!(d >= ceiling / 2 && d <= ceiling, "{d:?} vs {ceiling:?}");
            assert!(!d.is_zero());
        }
        assert_eq!(b.ceiling(), Duration::from_secs(30));
    }

    #[test]
    fn a_stable_session_resets_the_backoff_and_a_short_one_does_not() {
        let mut b = ReconnectBackoff::new(ms(100), ms(30_000), ms(10_000));
        let mut rng = SeededRng::with_seed(3);
        for _ in 0..4 {
            b.next_delay(&mut rng);
        }
        b.session_ended(ms(9_999));
        assert_eq!(b.ceiling(), ms(1600));
        b.session_ended(ms(10_000));
        assert_eq!(b.ceiling(), ms(100));
    }

    #[test]
    fn a_huge_failure_count_saturates_instead_of_overflowing() {
        let mut b = ReconnectBackoff::new(ms(100), ms(30_000), ms(10_000));
        let mut rng = SeededRng::with_seed(3);
        for _ in 0..100 {
            b.next_delay(&mut rng);
        }
        assert_eq!(b.ceiling(), ms(30_000));
    }

    #[test]
    fn a_zero_base_still_backs_off_and_never_waits_zero() {
        let mut b = ReconnectBackoff::new(Duration::ZERO, ms(1000), ms(10_000));
        let mut rng = SeededRng::with_seed(5);
        let delays: Vec<Duration> = (0..20).map(|_| b.next_delay(&mut rng)).collect();
        assert!(delays.iter().all(|d| !d.is_zero()), "{delays:?}");
        assert_eq!(b.ceiling(), ms(1000), "the ceiling still grows to max");
    }

    #[test]
    fn the_same_seed_gives_the_same_delays() {
        let run = |seed| {
            let mut b = ReconnectBackoff::default();
            let mut rng = SeededRng::with_seed(seed);
            (0..10).map(|_| b.next_delay(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
    }
}
