//! Rolling windows in fixed rings of time buckets on tokio's clock.
//!
//! # Layout and resolution
//!
//! Time is counted from the aggregator's epoch (its creation) in two bucket sizes:
//!
//! - **fine**: 10-second buckets, a ring of [`FINE_SLOTS`] = 6, for the 1-minute window;
//! - **coarse**: 1-minute buckets, a ring of [`COARSE_SLOTS`] = 15, for the 5- and 15-minute
//!   windows.
//!
//! A window of `k` buckets is the current (partial) bucket and the `k - 1` before it, so it
//! covers between `(k - 1)` and `k` buckets of the past: the 1-minute window 50–60 s, the
//! 5-minute window 4–5 min, the 15-minute window 14–15 min. A count leaves the window when the
//! bucket it was added to falls out, between 50 and 60 s (1 min), 4 and 5 min, or 14 and 15 min
//! after it was counted; `covered_seconds` says exactly how much time a window's figures span.
//! Every count is in one fine and one coarse bucket, except those of a report that covers more
//! than two report intervals (an agent's backlog after it was cut off from the control plane):
//! the counts of its span past the last interval are spread over the buckets of that time, each
//! taking its share in proportion to the time it holds, so that 30 minutes of calls do not read
//! as a 30-fold burst in the 1-minute window. (Counting every report by its arrival, the rest,
//! keeps a series fed by many agents at its true rate on average; a series fed by one agent
//! reads up to one report's counts high or low, as a window's edge passes a report.)
//! One ring pair is 21 buckets of 120 bytes (14 counters and the bucket's number), 2,520 bytes,
//! allocated inline: no window ever allocates.

use std::time::Duration;

use tokio::time::Instant;

use super::counts::{CALLS, Counts, RETRIES};

/// Length of a fine bucket.
pub const FINE: Duration = Duration::from_secs(10);
/// Length of a coarse bucket.
pub const COARSE: Duration = Duration::from_secs(60);
/// Fine buckets kept: the 1-minute window.
pub const FINE_SLOTS: usize = 6;
/// Coarse buckets kept: the 15-minute window.
pub const COARSE_SLOTS: usize = 15;

/// The three windows, in the order Stats and `/metrics` list them.
pub const WINDOWS: [Window; 3] = [
    Window::OneMinute,
    Window::FiveMinutes,
    Window::FifteenMinutes,
];

/// A trailing window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// 6 fine buckets.
    OneMinute,
    /// 5 coarse buckets.
    FiveMinutes,
    /// 15 coarse buckets.
    FifteenMinutes,
}

impl Window {
    /// The nominal length in seconds: 60, 300 or 900.
    pub fn seconds(self) -> u32 {
        match self {
            Window::OneMinute => 60,
            Window::FiveMinutes => 300,
            Window::FifteenMinutes => 900,
        }
    }

    /// The window of nominal length `seconds` (60, 300 or 900), if there is one.
    pub fn from_seconds(seconds: u32) -> Option<Self> {
        WINDOWS.into_iter().find(|w| w.seconds() == seconds)
    }

    /// The `window` label: `1m`, `5m`, `15m`.
    pub fn label(self) -> &'static str {
        match self {
            Window::OneMinute => "1m",
            Window::FiveMinutes => "5m",
            Window::FifteenMinutes => "15m",
        }
    }

    pub(crate) fn buckets(self) -> (Duration, u64) {
        match self {
            Window::OneMinute => (FINE, FINE_SLOTS as u64),
            Window::FiveMinutes => (COARSE, 5),
            Window::FifteenMinutes => (COARSE, COARSE_SLOTS as u64),
        }
    }
}

/// When the counts of a series or a version began: the arrival of the first report that counted
/// into it, and the span that report covered (its `window_end - window_start`, on the agent's
/// clock; zero when it did not say).
///
/// Why a floor and not a start moved back by the span: the counts of a series come from many
/// agents, each reporting every interval at its own phase. Moving the start back by the first
/// report's span would divide the first minutes of a series fed by N agents by too long a
/// time (about half the rate after one interval with 10 agents); a floor divides the first
/// report's counts by their own span and is within one report of the truth from then on. (A
/// single agent's second report, or reports resent together after a restart, can make the
/// rate up to twice the truth until more time has passed than they span.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Began {
    /// The first report's arrival.
    pub at: Instant,
    /// The first report's span.
    pub span: Duration,
}

/// Where an instant falls: its fine and coarse bucket numbers since the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tick {
    /// The instant itself.
    pub now: Instant,
    /// Fine bucket number.
    pub fine: u64,
    /// Coarse bucket number.
    pub coarse: u64,
    epoch: Instant,
}

impl Tick {
    /// The buckets of `now`, counted from `epoch` (an instant before the epoch is bucket 0).
    pub fn new(epoch: Instant, now: Instant) -> Self {
        let secs = now.saturating_duration_since(epoch).as_secs();
        Self {
            now,
            fine: secs / FINE.as_secs(),
            coarse: secs / COARSE.as_secs(),
            epoch,
        }
    }

    fn current(&self, window: Window) -> u64 {
        match window {
            Window::OneMinute => self.fine,
            Window::FiveMinutes | Window::FifteenMinutes => self.coarse,
        }
    }

    /// Seconds of `window` that the counts of a series (or version) that `began` cover: from
    /// the start of the window's oldest bucket, or the first report's arrival if that is later,
    /// to now; but never less than the first report's span (as far as the window reaches
    /// back), since that report's counts were made over that span before it arrived.
    ///
    /// The aggregator numbers its buckets from the longest window before it was made, so a
    /// window never reaches back past the epoch (the first reports after a restart count
    /// calls made before it: a report covers the time since the agent's previous one).
    pub fn covered_seconds(&self, window: Window, began: Began) -> f64 {
        let (size, k) = window.buckets();
        let current = self.current(window);
        let start = match (current + 1).checked_sub(k) {
            Some(first) => self.epoch + size * u32::try_from(first).unwrap_or(u32::MAX),
            None => {
                let before = size * u32::try_from(k - 1 - current).unwrap_or(u32::MAX);
                // An epoch too close to the clock's own origin: no earlier start.
                self.epoch.checked_sub(before).unwrap_or(self.epoch)
            }
        };
        let since_arrival = self.now.saturating_duration_since(start.max(began.at));
        let reach = self.now.saturating_duration_since(start);
        since_arrival.max(began.span.min(reach)).as_secs_f64()
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    /// Bucket number + 1; 0 = never used.
    tag: u64,
    counts: Counts,
}

#[derive(Clone, Copy, Debug)]
struct Ring<const S: usize> {
    slots: [Slot; S],
}

impl<const S: usize> Default for Ring<S> {
    fn default() -> Self {
        Self {
            slots: [Slot::default(); S],
        }
    }
}

impl<const S: usize> Ring<S> {
    fn add(&mut self, bucket: u64, counts: &Counts) {
        let slot = &mut self.slots[(bucket % S as u64) as usize];
        let tag = bucket + 1;
        // A slot holding an older bucket is reused; one holding a newer bucket (a report that
        // waited for the lock across a bucket edge) takes the count too, so none is lost.
        if slot.tag < tag {
            slot.tag = tag;
            slot.counts = Counts::default();
        }
        slot.counts.add(counts);
    }

    /// Adds `counts`, made from `from` to `to` (at or before `tick.now`), to the buckets (of
    /// `size`; the current one is `current`) of that time that this ring keeps, each its share:
    /// `floor(c × end / span) - floor(c × start / span)` for the bucket's part of the span from
    /// `start` to `end`, so that the shares of the buckets kept add up to their time's counts
    /// (retries follow the calls instead: see [`retries_between`]; `report` is the whole
    /// report's counts, of which `counts` is the part before its last interval).
    /// Bucket 0 also holds what was made before the epoch; what is older than the ring's oldest
    /// bucket is left out (it is in no window).
    fn add_spread(
        &mut self,
        tick: &Tick,
        size: Duration,
        current: u64,
        (from, to): (Instant, Instant),
        counts: &Counts,
        report: &Counts,
    ) {
        let oldest = (current + 1).saturating_sub(S as u64);
        let bucket_of = |at: Instant| {
            (at.saturating_duration_since(tick.epoch).as_secs() / size.as_secs()).min(current)
        };
        let start_of = |bucket: u64| {
            let offset = Duration::from_secs(size.as_secs().saturating_mul(bucket));
            tick.epoch.checked_add(offset).unwrap_or(to)
        };
        // Bucket 0 also holds what was made before the epoch, as far back as a window reaches
        // from it (`Tick::covered_seconds` counts that time for a young aggregator).
        let before_epoch = size.saturating_mul(u32::try_from(S - 1).unwrap_or(u32::MAX));
        let first_start = tick.epoch.checked_sub(before_epoch).unwrap_or(tick.epoch);
        let total = to.saturating_duration_since(from).as_nanos();
        if total == 0 {
            if bucket_of(to) >= oldest {
                self.add(bucket_of(to), counts);
            }
            return;
        }
        for bucket in bucket_of(from).max(oldest)..=bucket_of(to) {
            let start = if bucket == 0 {
                first_start
            } else {
                start_of(bucket)
            };
            let start = start.max(from);
            let end = start_of(bucket + 1).min(to);
            let lo = start.saturating_duration_since(from).as_nanos();
            let hi = end.saturating_duration_since(from).as_nanos();
            if hi <= lo {
                continue;
            }
            // At most 2^64 × 2^47 (a day in nanoseconds): no overflow in u128.
            let share = |c: u64| {
                let c = u128::from(c);
                u64::try_from(c * hi / total - c * lo / total).unwrap_or(u64::MAX)
            };
            let mut shares = Counts(counts.0.map(share));
            shares.0[RETRIES] = retries_between(counts, report, (lo, hi), total);
            self.add(bucket, &shares);
        }
    }

    /// Adds buckets `current - k + 1 ..= current` into `into`.
    fn sum_into(&self, current: u64, k: u64, into: &mut Counts) {
        let oldest = (current + 1).saturating_sub(k) + 1;
        for slot in &self.slots {
            if slot.tag >= oldest {
                into.add(&slot.counts);
            }
        }
    }

    /// Whether any bucket at or after `current - k + 1` holds a count.
    fn any_since(&self, current: u64, k: u64) -> bool {
        let oldest = (current + 1).saturating_sub(k) + 1;
        self.slots
            .iter()
            .any(|s| s.tag >= oldest && !s.counts.is_zero())
    }

    /// Adds `other`'s buckets. Slots at the same index hold buckets `S` apart or the same one:
    /// the older of two different ones is already out of every window, so the newer wins.
    fn merge(&mut self, other: &Ring<S>) {
        for (dst, src) in self.slots.iter_mut().zip(other.slots.iter()) {
            if src.tag > dst.tag {
                *dst = *src;
            } else if src.tag == dst.tag {
                dst.counts.add(&src.counts);
            }
        }
    }
}

/// The fine and coarse rings of one series or version.
#[derive(Clone, Copy, Debug, Default)]
pub struct Windows {
    fine: Ring<FINE_SLOTS>,
    coarse: Ring<COARSE_SLOTS>,
}

impl Windows {
    /// Counts `counts`, made over the `span` before `tick` by an agent told to report every
    /// `interval`: the counts of the last `interval` at `tick`, those of the span before it
    /// spread over their time (see the module docs).
    pub fn add(&mut self, tick: &Tick, counts: &Counts, span: Duration, interval: Duration) {
        // A report a little late, or one interval missed, is a report like any other: only a
        // span past two intervals (an agent cut off, or held back by unanswered reports) is a
        // backlog.
        let Some(older) = span
            .checked_sub(interval)
            .filter(|_| span > interval.saturating_mul(2))
        else {
            self.fine.add(tick.fine, counts);
            self.coarse.add(tick.coarse, counts);
            return;
        };
        // The last interval's share (`floor(c × interval / span)`), and the rest.
        let (interval_ns, span_ns) = (interval.as_nanos(), span.as_nanos());
        let mut recent = Counts(
            counts
                .0
                .map(|c| u64::try_from(u128::from(c) * interval_ns / span_ns).unwrap_or(u64::MAX)),
        );
        if let Some(retries) = recent_retries(counts, recent.0[CALLS]) {
            recent.0[RETRIES] = retries;
        }
        let mut earlier = *counts;
        for (e, r) in earlier.0.iter_mut().zip(recent.0) {
            *e -= r;
        }
        self.fine.add(tick.fine, &recent);
        self.coarse.add(tick.coarse, &recent);
        let to = tick.now.checked_sub(interval).unwrap_or(tick.now);
        let from = to.checked_sub(older).unwrap_or(to);
        self.fine
            .add_spread(tick, FINE, tick.fine, (from, to), &earlier, counts);
        self.coarse
            .add_spread(tick, COARSE, tick.coarse, (from, to), &earlier, counts);
    }

    /// Adds `window`'s counts as of `tick` into `into`.
    pub fn sum_into(&self, tick: &Tick, window: Window, into: &mut Counts) {
        let (_, k) = window.buckets();
        match window {
            Window::OneMinute => self.fine.sum_into(tick.fine, k, into),
            Window::FiveMinutes | Window::FifteenMinutes => {
                self.coarse.sum_into(tick.coarse, k, into);
            }
        }
    }

    /// `window`'s counts as of `tick`.
    pub fn sum(&self, tick: &Tick, window: Window) -> Counts {
        let mut c = Counts::default();
        self.sum_into(tick, window, &mut c);
        c
    }

    /// Whether anything is left in the 15-minute window (the longest) as of `tick`.
    pub fn is_live(&self, tick: &Tick) -> bool {
        self.coarse.any_since(tick.coarse, COARSE_SLOTS as u64)
    }

    /// Adds every bucket of `other` into these rings (bucket by bucket).
    pub fn merge(&mut self, other: &Windows) {
        self.fine.merge(&other.fine);
        self.coarse.merge(&other.coarse);
    }
}

/// The retries of `earlier` (the part of a report before its last interval, spanning `total`
/// nanoseconds; the whole report's counts are `report`) that [`Ring::add_spread`] gives the
/// part of its span from `lo` to `hi`. Retries follow the calls, not the time: the retries made
/// before a point are the report's ratio of the calls made before it, rounded up (what
/// [`Windows::add`] keeps for the last interval is the rest). So what a window ending now
/// holds of a report (the end of its span) has at most the report's own ratio of retries to
/// calls: a report at or under the alert's threshold cannot take the window's ratio past it by
/// rounding, as counters rounded each on its own could. Retries with no calls follow the time.
fn retries_between(earlier: &Counts, report: &Counts, (lo, hi): (u128, u128), total: u128) -> u64 {
    let (calls, retries) = (u128::from(report.0[CALLS]), u128::from(report.0[RETRIES]));
    let earlier_calls = u128::from(earlier.0[CALLS]);
    let before = |at: u128| {
        if calls == 0 {
            u128::from(earlier.0[RETRIES]) * at / total
        } else {
            // At most 2^64 × 2^64: no overflow in u128.
            (retries * (earlier_calls * at / total)).div_ceil(calls)
        }
    };
    u64::try_from(before(hi) - before(lo)).unwrap_or(u64::MAX)
}

/// The retries of a report of `report` counts that [`Windows::add`] keeps for its last
/// interval, when that interval has `recent_calls` of its calls: the rest of what
/// [`retries_between`] gives the time before it.
fn recent_retries(report: &Counts, recent_calls: u64) -> Option<u64> {
    let (calls, retries) = (u128::from(report.0[CALLS]), u128::from(report.0[RETRIES]));
    if calls == 0 {
        return None;
    }
    let earlier_calls = calls - u128::from(recent_calls).min(calls);
    let earlier = (retries * earlier_calls).div_ceil(calls);
    u64::try_from(retries - earlier).ok()
}
