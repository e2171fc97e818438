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
//! Time: the counter works in nanoseconds since an origin kept by its owner, which converts each
//! `Instant` once ([`nanos_since`]; instants before the origin saturate to 0, so to slot 0). The
//! newest slot seen is kept in `latest` (`fetch_max`); a `now` that falls in an older slot (time
//! going backwards, or threads passing slightly different instants) is treated as that newest
//! slot, so counts never land in a slot that was already recycled. Finding the slot costs a
//! multiplication and a comparison against `latest`; the division runs only when time enters a
//! new slot.
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

/// `d` in nanoseconds, saturating at `u64::MAX` (584 years).
#[inline]
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// `now - origin`, or `None` when `now` is before `origin`.
///
/// It subtracts the `std` instants that tokio's wrap (`into_std` is a field read, inlined):
/// tokio's own `checked_duration_since` is one more call around `std`'s, and neither is
/// inlined into another crate without LTO. On the engine's success path this is the one call
/// chain left (BENCHMARKS.md, section 1).
#[inline]
pub(crate) fn since(origin: Instant, now: Instant) -> Option<Duration> {
    now.into_std().checked_duration_since(origin.into_std())
}

/// Nanoseconds from `origin` to `now`: 0 when `now` is before `origin`, saturating at
/// `u64::MAX`.
#[inline]
pub(crate) fn nanos_since(origin: Instant, now: Instant) -> u64 {
    since(origin, now).map_or(0, duration_nanos)
}

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

/// `C` counters over a sliding window, updated and read lock-free through `&self`. Time is in
/// nanoseconds since the owner's origin.
#[derive(Debug)]
pub(crate) struct SlidingCounter<const C: usize> {
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
    /// An empty counter for a window of `window`.
    pub(crate) fn new(window: Duration) -> Self {
        let window = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX).max(1);
        let slot_nanos = window.div_ceil(SLOTS_PER_WINDOW);
        let covering = 1 + (window - 1).div_ceil(slot_nanos);
        let capacity = covering.next_power_of_two();
        let ring = (0..capacity)
            .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
            .collect();
        Self {
            slot_nanos,
            inside: window / slot_nanos,
            covering,
            ring,
            mask: capacity - 1,
            latest: AtomicU64::new(0),
        }
    }

    /// The window's length, in whole slots (as [`SlidingCounter::recent`] covers it).
    pub(crate) fn span_nanos(&self) -> u64 {
        self.slot_nanos.saturating_mul(self.inside)
    }

    /// The newest slot seen, and the slot of `nanos` if it is newer (`None` when `nanos` falls in
    /// the newest slot or before it: the common case costs a multiplication, not a division).
    #[inline(always)]
    fn slots(&self, nanos: u64) -> (u64, Option<u64>) {
        let latest = self.latest.load(Relaxed);
        if nanos < latest.saturating_add(1).saturating_mul(self.slot_nanos) {
            (latest, None)
        } else {
            (latest, Some(nanos / self.slot_nanos))
        }
    }

    /// The slot `nanos` falls in, never older than the newest slot seen. Read-only: it neither
    /// records the slot nor sweeps.
    pub(crate) fn peek(&self, nanos: u64) -> u64 {
        let (latest, newer) = self.slots(nanos);
        newer.unwrap_or(latest)
    }

    /// Like [`Self::peek`], and records the slot as the newest seen, sweeping the ring when that
    /// crosses a multiple of 2²⁹ slots. Call before writing.
    #[inline(always)]
    pub(crate) fn advance(&self, nanos: u64) -> u64 {
        let (latest, newer) = self.slots(nanos);
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
    #[cold]
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

    #[inline]
    fn word(&self, slot: u64, counter: usize) -> &AtomicU64 {
        &self.ring[(slot & self.mask) as usize][counter]
    }

    /// Adds one to `counter` in `slot` (from [`Self::advance`]).
    ///
    /// `advance`, `slots` and this are `#[inline(always)]`: with `#[inline]` the compiler
    /// kept `add` out of line in some callers (the criterion bench of the success path), and
    /// forcing them in took about 3 ns off that path (BENCHMARKS.md, section 1, 2026-12-02).
    #[inline(always)]
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

    /// The start of the newest slot seen, in nanoseconds since the origin.
    pub(crate) fn newest_start(&self) -> u64 {
        self.latest.load(Relaxed).saturating_mul(self.slot_nanos)
    }

    /// Counts, as of `nanos`, what `old` (a counter of the same owner, with another window)
    /// counts in its recent slots, each at its own time as near as `old`'s slots tell: counter
    /// `i` at its slot's start, or at its end (at `nanos` for the slot of `nanos`) where
    /// `at_end[i]`. A count at its slot's start leaves this window no later than at its true
    /// time, one at its end no sooner. Slots too old for this window are left out.
    pub(crate) fn take_over(&self, old: &Self, nanos: u64, at_end: [bool; C]) {
        let newest = self.advance(nanos);
        for (slot, counts) in old.recent(old.peek(nanos)) {
            let start = slot.saturating_mul(old.slot_nanos);
            let end = start.saturating_add(old.slot_nanos - 1).min(nanos);
            for (counter, (n, at_end)) in counts.into_iter().zip(at_end).enumerate() {
                let at = if at_end { end } else { start } / self.slot_nanos;
                // Within the covering span: a write there cannot land on a newer slot's word.
                if at <= newest && newest - at < self.covering {
                    self.add_n(at, counter, n);
                }
            }
        }
    }

    /// The covering span's slots ending at `slot` (from [`Self::peek`]) that hold a count, with
    /// their counts.
    pub(crate) fn recent(&self, slot: u64) -> Vec<(u64, [u64; C])> {
        let first = slot.saturating_sub(self.latest.load(Relaxed));
        (first..self.covering.min(slot.saturating_add(1)))
            .filter_map(|back| {
                let s = slot - back;
                let counts = self.ring[(s & self.mask) as usize].each_ref().map(|word| {
                    let w = word.load(Relaxed);
                    if epoch(w) == s as u32 {
                        w & COUNT_MASK
                    } else {
                        0
                    }
                });
                counts.iter().any(|c| *c > 0).then_some((s, counts))
            })
            .collect()
    }

    /// Adds `n` to `counter` in `slot` (within the covering span of the newest slot), saturating
    /// as [`Self::add`] does.
    fn add_n(&self, slot: u64, counter: usize, n: u64) {
        if n == 0 {
            return;
        }
        let word = self.word(slot, counter);
        let mut w = word.load(Relaxed);
        loop {
            let count = live_count(w, slot).unwrap_or(0);
            let new = pack(slot, count.saturating_add(n).min(COUNT_MASK));
            match word.compare_exchange_weak(w, new, Relaxed, Relaxed) {
                Ok(_) => return,
                Err(current) => w = current,
            }
        }
    }

    /// The count of `counter` in `slot` itself (0 when its word holds another slot).
    pub(crate) fn current(&self, slot: u64, counter: usize) -> u64 {
        let w = self.word(slot, counter).load(Relaxed);
        if epoch(w) == slot as u32 {
            w & COUNT_MASK
        } else {
            0
        }
    }

    /// Adds one to `counter` in `slot` only if `older` (the span's other slots, read by
    /// [`Self::sums`] with `skip` 1) plus the slot's own count stays `<= limit` with it. The CAS
    /// on the slot's word makes this strict against every writer of that slot.
    pub(crate) fn try_add(&self, slot: u64, counter: usize, older: u64, limit: u64) -> bool {
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

    /// Takes one back from `counter` in `slot` (one [`Self::add`] or [`Self::try_add`] made
    /// there): nothing when the word no longer holds that slot (it left the ring, or was
    /// swept or cleared), when its count is 0, or when it saturated (the count is no longer
    /// exact).
    pub(crate) fn remove(&self, slot: u64, counter: usize) {
        let word = self.word(slot, counter);
        let mut w = word.load(Relaxed);
        loop {
            let count = w & COUNT_MASK;
            if epoch(w) != slot as u32 || count == 0 || count == COUNT_MASK {
                return;
            }
            match word.compare_exchange_weak(w, w - 1, Relaxed, Relaxed) {
                Ok(_) => return,
                Err(current) => w = current,
            }
        }
    }

    fn len(&self, span: Span) -> u64 {
        match span {
            Span::Inside => self.inside,
            Span::Covering => self.covering,
        }
    }

    /// Every counter's sum in one pass over the ring: counter `i` over `spans[i].0` ending at
    /// `slot` (from [`Self::peek`] or [`Self::advance`]), leaving out its `spans[i].1` newest
    /// slots (1: all but `slot` itself).
    pub(crate) fn sums(&self, slot: u64, spans: [(Span, u64); C]) -> [u64; C] {
        let ranges = spans.map(|(span, skip)| (skip, self.len(span)));
        let end = ranges.iter().map(|r| r.1).max().unwrap_or(0);
        // Slots newer than the newest one written to are empty: skipping them keeps a read-only
        // `peek` after a long idle gap from seeing a stale word whose epoch wrapped around.
        let first = slot.saturating_sub(self.latest.load(Relaxed));
        let mut out = [0; C];
        for back in first..end.min(slot.saturating_add(1)) {
            let s = slot - back;
            let words = &self.ring[(s & self.mask) as usize];
            for ((sum, word), (skip, len)) in out.iter_mut().zip(words).zip(ranges) {
                if back < skip || back >= len {
                    continue;
                }
                let w = word.load(Relaxed);
                if epoch(w) == s as u32 {
                    *sum += w & COUNT_MASK;
                }
            }
        }
        out
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
        let c = SlidingCounter::<1>::new(Duration::from_secs(10));
        assert_eq!(
            (c.slot_nanos, c.inside, c.covering),
            (1_000_000_000, 10, 11)
        );
    }

    #[test]
    fn windows_shorter_than_ten_nanoseconds_use_one_nanosecond_slots() {
        for w in 1..10 {
            let c = SlidingCounter::<1>::new(Duration::from_nanos(w));
            assert_eq!((c.slot_nanos, c.inside, c.covering), (1, w, w));
        }
        let c = SlidingCounter::<1>::new(Duration::ZERO);
        assert_eq!((c.slot_nanos, c.inside, c.covering), (1, 1, 1));
    }

    #[test]
    fn uneven_windows_keep_inside_a_subset_and_covering_a_superset() {
        for w in [11u64, 19, 95, 101, 999, 1_000_000_007] {
            let c = SlidingCounter::<1>::new(Duration::from_nanos(w));
            assert!(c.inside * c.slot_nanos <= w, "inside {w}");
            assert!((c.covering - 1) * c.slot_nanos + 1 >= w, "covering {w}");
        }
    }

    #[test]
    fn counts_sum_over_the_span_and_expire_out_of_it() {
        const SEC: u64 = 1_000_000_000;
        let c = SlidingCounter::<2>::new(Duration::from_secs(10));
        for i in 0..10 {
            let s = c.advance(i * SEC);
            c.add(s, 0);
        }
        let s = c.advance(10 * SEC);
        assert_eq!(c.sums(s, [(Span::Inside, 0); 2]), [9, 0]);
        assert_eq!(c.sums(s, [(Span::Covering, 0); 2]), [10, 0]);
        assert_eq!(c.sums(s, [(Span::Inside, 0), (Span::Covering, 1)]), [9, 0]);
        assert_eq!(c.sums(s, [(Span::Covering, 1), (Span::Inside, 0)]), [10, 0]);
        let s = c.advance(30 * SEC);
        assert_eq!(c.sums(s, [(Span::Covering, 0); 2]), [0, 0]);
    }

    #[test]
    fn a_removed_count_leaves_its_slot_and_never_touches_a_later_one() {
        const SEC: u64 = 1_000_000_000;
        let c = SlidingCounter::<1>::new(Duration::from_secs(10));
        let s = c.advance(0);
        c.add(s, 0);
        c.add(s, 0);
        c.remove(s, 0);
        assert_eq!(c.current(s, 0), 1);
        c.remove(s, 0);
        c.remove(s, 0);
        assert_eq!(c.current(s, 0), 0, "never below zero");
        // The ring came round: the word holds a later slot, which a late removal leaves alone.
        c.add(s, 0);
        let later = c.advance(16 * SEC);
        assert_eq!(later & c.mask, s & c.mask, "the same word");
        c.add(later, 0);
        c.remove(s, 0);
        assert_eq!(c.current(later, 0), 1);
    }

    #[test]
    fn nanos_since_saturates_before_the_origin() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_nanos(1_500_000_007);
        assert_eq!(nanos_since(t0, later), 1_500_000_007);
        assert_eq!(nanos_since(later, t0), 0);
        assert_eq!(duration_nanos(Duration::MAX), u64::MAX);
    }
}
