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
//! Every count is in exactly one fine and one coarse bucket. One ring pair is 21 buckets of
//! 120 bytes (14 counters and the bucket's number), 2,520 bytes, allocated inline: no window
//! ever allocates.

use std::time::Duration;

use tokio::time::Instant;

use super::counts::Counts;

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

    fn buckets(self) -> (Duration, u64) {
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
    /// While the aggregator is younger than the window, the oldest bucket lies before the
    /// epoch: the first buckets hold reports that count calls made before the epoch (a report
    /// covers the time since the agent's previous one, so the first reports after a restart
    /// cover the restart).
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
    /// Counts `counts` at `tick`.
    pub fn add(&mut self, tick: &Tick, counts: &Counts) {
        self.fine.add(tick.fine, counts);
        self.coarse.add(tick.coarse, counts);
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
