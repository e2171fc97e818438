//! A lock-free sliding-window counter, shared by [`crate::budget`] and [`crate::breaker`].
//!
//! Time since an origin is cut into slots of `ceil(window / 10)` nanoseconds (at least 1 ns).
//! A ring of 16 positions (fewer for windows under 8 ns; a power of two, so a slot's position is
//! a mask) holds `C` counters per position — the budget counts requests and retries, the breaker
//! attempts and failures — each one `AtomicU64` word packing `epoch << 32 | count`, the epoch being
//! the low 32 bits of the slot number. An increment is a CAS loop: if the word's epoch is the
//! slot's, add one; if it is stale (or the word is empty), write `(epoch, 1)`. The reset *is* the
//! increment, so no separate clearing step can race with it. A read adds up the words whose epoch
//! is exactly the slot it expects, so stale slots count 0.
//!
//! Two spans are read (`W` = window, `d` = slot width):
//! - [`Span::Inside`]: the last `floor(W / d)` slots (10 when `d` divides `W`). They start after
//!   `now - W`, so what they hold is a **subset** of the trailing window `(now - W, now]`.
//! - [`Span::Covering`]: the last `1 + ceil((W - 1ns) / d)` slots (11 when `d` divides `W`). They
//!   start at or before `now - W + 1ns`, so they hold a **superset** of the trailing window.
//!
//! Time: `now` before the origin saturates to slot 0. The newest slot seen is kept in `latest`
//! (`fetch_max`); a `now` that falls in an older slot (time going backwards, or threads passing
//! slightly different instants) is treated as that newest slot, so counts never land in a slot
//! that was already recycled. Finding the slot costs a multiplication and a comparison against
//! `latest`; the division runs only when time enters a new slot.
//!
//! Epoch wrap: an epoch repeats every 2³² slots, so a word left untouched that long would look
//! current again. Whenever `latest` crosses a multiple of 2²⁹ slots (as any jump of 2²⁹ slots or
//! more does), the thread that advanced it sweeps the ring and zeroes, by CAS so that a fresh
//! increment is never lost, every word that has left the covering span; between sweeps no word
//! gets near 2³² slots old. Reads skip the slots newer than `latest`, so a read-only look after a
//! long idle gap, which does not sweep, cannot see a wrapped epoch either. Per-slot counts
//! saturate at `u32::MAX`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::time::Instant;

/// Slots per window (the last slot may be shorter when the window does not divide evenly).
const SLOTS_PER_WINDOW: u64 = 10;
/// The count half of a word; also the saturation point of one slot's count.
const COUNT_MASK: u64 = 0xFFFF_FFFF;
/// `latest` crossing a multiple of `1 << SWEEP_BITS` slots triggers a sweep.
const SWEEP_BITS: u32 = 29;

/// Which slots a sum covers, relative to the trailing window `(now - window, now]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Span {
    /// The recent slots that lie wholly inside the window: counts a subset of it.
    Inside,
    /// The recent slots that together contain the whole window: counts a superset of it.
    Covering,
}

/// `C` counters over a sliding window, updated and read lock-free through `&self`.
#[derive(Debug)]
pub(crate) struct SlidingCounter<const C: usize> {
    origin: Instant,
    slot_nanos: u64,
    inside: u64,
    covering: u64,
    /// `covering` rounded up to a power of two, so that a slot's position is `slot & mask`.
    ring: Box<[[AtomicU64; C]]>,
    mask: u64,
    latest: AtomicU64,
}

fn epoch(word: u64) -> u32 {
    (word >> 32) as u32
}

fn pack(slot: u64, count: u64) -> u64 {
    (u64::from(slot as u32) << 32) | count
}

/// The count `word` contributes to `slot` when incrementing: its count when it holds that slot
/// (or a newer one: this thread stalled for a whole ring), `None` when it is empty or stale and
/// must be restarted. Sweeps keep every word younger than about 2³⁰ slots, so a stale word
/// never looks less than 2³¹ slots ahead.
fn live_count(word: u64, slot: u64) -> Option<u64> {
    let count = word & COUNT_MASK;
    let ahead = epoch(word).wrapping_sub(slot as u32);
    (count > 0 && ahead < 1 << 30).then_some(count)
}

impl<const C: usize> SlidingCounter<C> {
    /// An empty counter whose slots are measured from `origin`.
    pub(crate) fn new(window: Duration, origin: Instant) -> Self {
        let window = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX).max(1);
        let slot_nanos = window.div_ceil(SLOTS_PER_WINDOW);
        let covering = 1 + (window - 1).div_ceil(slot_nanos);
        let capacity = covering.next_power_of_two();
        let ring = (0..capacity)
            .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
            .collect();
        Self {
            origin,
            slot_nanos,
            inside: window / slot_nanos,
            covering,
            ring,
            mask: capacity - 1,
            latest: AtomicU64::new(0),
        }
    }

    /// The newest slot seen, and the slot of `now` if it is newer (`None` when `now` falls in the
    /// newest slot or before it: the common case costs a multiplication, not a division).
    fn slots(&self, now: Instant) -> (u64, Option<u64>) {
        let since = now.saturating_duration_since(self.origin);
        let nanos = since
            .as_secs()
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::from(since.subsec_nanos()));
        let latest = self.latest.load(Relaxed);
        if nanos < latest.saturating_add(1).saturating_mul(self.slot_nanos) {
            (latest, None)
        } else {
            (latest, Some(nanos / self.slot_nanos))
        }
    }

    /// The slot `now` falls in, never older than the newest slot seen. Read-only: it neither
    /// records the slot nor sweeps.
    pub(crate) fn peek(&self, now: Instant) -> u64 {
        let (latest, newer) = self.slots(now);
        newer.unwrap_or(latest)
    }

    /// Like [`Self::peek`], and records the slot as the newest seen, sweeping the ring when that
    /// crosses a multiple of 2²⁹ slots. Call before writing.
    pub(crate) fn advance(&self, now: Instant) -> u64 {
        let (latest, newer) = self.slots(now);
        let Some(raw) = newer else {
            return latest;
        };
        let prev = self.latest.fetch_max(raw, Relaxed);
        if prev < raw && prev >> SWEEP_BITS != raw >> SWEEP_BITS {
            self.sweep(prev, raw);
        }
        raw.max(prev)
    }

    /// Zeroes every word last written at or before `prev` whose slot left the ring by `slot`.
    fn sweep(&self, prev: u64, slot: u64) {
        for word in self.ring.iter().flatten() {
            let w = word.load(Relaxed);
            let age = (prev as u32).wrapping_sub(epoch(w));
            // A word written after `prev` (by a thread racing us into a newer slot) is live.
            if w & COUNT_MASK == 0 || age >= 1 << 31 {
                continue;
            }
            if prev.saturating_sub(u64::from(age)) + self.covering <= slot {
                let _ = word.compare_exchange(w, 0, Relaxed, Relaxed);
            }
        }
    }

    fn word(&self, slot: u64, counter: usize) -> &AtomicU64 {
        &self.ring[(slot & self.mask) as usize][counter]
    }

    /// Adds one to `counter` in `slot` (from [`Self::advance`]).
    pub(crate) fn add(&self, slot: u64, counter: usize) {
        let word = self.word(slot, counter);
        let mut w = word.load(Relaxed);
        loop {
            let new = match live_count(w, slot) {
                Some(COUNT_MASK) => return,
                Some(_) => w + 1,
                None => pack(slot, 1),
            };
            match word.compare_exchange_weak(w, new, Relaxed, Relaxed) {
                Ok(_) => return,
                Err(current) => w = current,
            }
        }
    }

    /// Adds one to `counter` in `slot` only if the sum over `span` stays `<= limit` with it.
    /// The CAS on the current slot's word makes this strict against every writer of that slot;
    /// the older slots of the span are read once, before the loop.
    pub(crate) fn try_add(&self, slot: u64, counter: usize, span: Span, limit: u64) -> bool {
        let older = self.sum_from(slot, counter, span, 1);
        let word = self.word(slot, counter);
        let mut w = word.load(Relaxed);
        loop {
            let live = live_count(w, slot);
            let current = live.unwrap_or(0);
            if current >= COUNT_MASK || older + current + 1 > limit {
                return false;
            }
            let new = if live.is_some() { w + 1 } else { pack(slot, 1) };
            match word.compare_exchange_weak(w, new, Relaxed, Relaxed) {
                Ok(_) => return true,
                Err(current) => w = current,
            }
        }
    }

    /// The sum of `counter` over `span`, ending at `slot` (from [`Self::peek`] or
    /// [`Self::advance`]).
    pub(crate) fn sum(&self, slot: u64, counter: usize, span: Span) -> u64 {
        self.sum_from(slot, counter, span, 0)
    }

    fn sum_from(&self, slot: u64, counter: usize, span: Span, skip: u64) -> u64 {
        let len = match span {
            Span::Inside => self.inside,
            Span::Covering => self.covering,
        };
        // Slots newer than the newest one written to are empty: skipping them keeps a read-only
        // `peek` after a long idle gap from seeing a stale word whose epoch wrapped around.
        let first = skip.max(slot.saturating_sub(self.latest.load(Relaxed)));
        (first..len.min(slot.saturating_add(1)))
            .map(|back| {
                let s = slot - back;
                let w = self.word(s, counter).load(Relaxed);
                if epoch(w) == s as u32 {
                    w & COUNT_MASK
                } else {
                    0
                }
            })
            .sum()
    }

    /// Zeroes every counter. Increments racing with it may survive or be lost.
    pub(crate) fn clear(&self) {
        for word in self.ring.iter().flatten() {
            word.store(0, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ten_second_window_has_ten_inside_and_eleven_covering_slots() {
        let c = SlidingCounter::<1>::new(Duration::from_secs(10), Instant::now());
        assert_eq!(
            (c.slot_nanos, c.inside, c.covering),
            (1_000_000_000, 10, 11)
        );
    }

    #[test]
    fn windows_shorter_than_ten_nanoseconds_use_one_nanosecond_slots() {
        for w in 1..10 {
            let c = SlidingCounter::<1>::new(Duration::from_nanos(w), Instant::now());
            assert_eq!((c.slot_nanos, c.inside, c.covering), (1, w, w));
        }
        let c = SlidingCounter::<1>::new(Duration::ZERO, Instant::now());
        assert_eq!((c.slot_nanos, c.inside, c.covering), (1, 1, 1));
    }

    #[test]
    fn uneven_windows_keep_inside_a_subset_and_covering_a_superset() {
        for w in [11u64, 19, 95, 101, 999, 1_000_000_007] {
            let c = SlidingCounter::<1>::new(Duration::from_nanos(w), Instant::now());
            assert!(c.inside * c.slot_nanos <= w, "inside {w}");
            assert!((c.covering - 1) * c.slot_nanos + 1 >= w, "covering {w}");
        }
    }

    #[test]
    fn counts_sum_over_the_span_and_expire_out_of_it() {
        let t0 = Instant::now();
        let c = SlidingCounter::<2>::new(Duration::from_secs(10), t0);
        for i in 0..10 {
            let s = c.advance(t0 + Duration::from_secs(i));
            c.add(s, 0);
        }
        let s = c.advance(t0 + Duration::from_secs(10));
        assert_eq!(c.sum(s, 0, Span::Inside), 9);
        assert_eq!(c.sum(s, 0, Span::Covering), 10);
        assert_eq!(c.sum(s, 1, Span::Covering), 0);
        let s = c.advance(t0 + Duration::from_secs(30));
        assert_eq!(c.sum(s, 0, Span::Covering), 0);
    }
}
