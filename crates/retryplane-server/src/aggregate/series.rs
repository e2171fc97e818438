//! One (service, endpoint) series: lifetime totals, windows split by policy version, and its
//! retry-ratio alert.
//!
//! The series' windows are the sum of its versions' windows (plus `retired`, below), so each
//! count is kept once per bucket size. A version is pruned once nothing of it is left in the
//! 15-minute window (no counts for 14–15 minutes); its lifetime stays in the series lifetime.
//! At most [`MAX_VERSIONS`] versions are kept apart, chosen by the fleet: by how many
//! connected agents of the series' service run each ([`crate::running`]; of every service for
//! the series that takes what is past the caps). A report under yet another version, while
//! every place is taken, evicts the kept version the fewest agents run (of two alike, the one
//! with the fewer calls per second over the 15-minute window, then the least recently
//! counted) when more agents run its own; else it is counted into `retired`. The version
//! published always gets a place (the fleet moves to it) and is never evicted. So a late report
//! (calls that outlived their version), a straggler, a client's bogus number or an agent's
//! backlog from before a restart never evicts the version more agents run, and a version gets
//! a place at the first report once more agents run it than run the kept one fewest run,
//! whatever its number and whatever arrived first. At a tie the kept version stays (no churn
//! between versions as many agents run): while a fleet reconnects after a restart, the first
//! of its agents back on a version may find each kept one run by as many, and that report is
//! counted in the series' totals and windows only, not apart. The evicted version's buckets
//! are folded into `retired` (allocated only then, freed once empty), so the series' windows
//! lose nothing.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use retryplane_policy::diag::LogValue;
use retryplane_proto::pb;
use tokio::time::Instant;
use tracing::{info, warn};

use super::counts::{CALLS, Counts, RETRIES, ratio};
use super::window::{Began, Tick, WINDOWS, Window, Windows};
use crate::fleet::unix_ms;
use crate::running::RunningOf;

/// Most policy versions one series keeps apart.
pub const MAX_VERSIONS: usize = 4;

/// Fewest calls in the 5-minute window for an alert to start: below it, one retry out of two
/// calls is noise, not a retry storm. A firing alert ends only when the ratio is back at or
/// under the threshold, whatever the volume. The calls of a series count, or those of its
/// endpoint over every calling service when that sum is past the threshold too (see
/// [`Judge`]): a storm spread over many small callers is still a storm.
pub const MIN_ALERT_CALLS: u64 = 20;

/// What a series' alert is judged against.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Judge {
    /// The endpoint's threshold.
    pub threshold: f64,
    /// Whether the endpoint, summed over every calling service in the 5-minute window, has
    /// [`MIN_ALERT_CALLS`] calls and a retry ratio above the threshold: then the volume guard
    /// of each of its series is met.
    pub endpoint_wide: bool,
    /// Whether the endpoint, summed over every calling service in the 5-minute window, has a
    /// retry ratio above the threshold, whatever its volume: what keeps a lent alert
    /// ([`Alert::lent`]) firing.
    pub endpoint_above: bool,
    /// How long after a series' last report its next one may still come (the report interval
    /// agents are told, and some slack): while the 5-minute window holds no call and no report
    /// is overdue, a firing alert goes on. With a report interval of minutes, the window can
    /// be empty between two reports however steady the series.
    pub hold: Duration,
}

impl Judge {
    /// Judged against `threshold` alone.
    pub fn threshold(threshold: f64) -> Self {
        Self {
            threshold,
            endpoint_wide: false,
            endpoint_above: false,
            hold: Duration::ZERO,
        }
    }
}

/// Counts made under one policy version.
#[derive(Debug)]
struct VersionSeries {
    version: u64,
    first: Began,
    last: Instant,
    lifetime: Counts,
    windows: Windows,
}

impl VersionSeries {
    /// Calls per second over the 15-minute window (the part of it this version covers).
    fn rate(&self, tick: &Tick) -> f64 {
        let calls = self.windows.sum(tick, Window::FifteenMinutes).0[CALLS];
        calls as f64
            / tick
                .covered_seconds(Window::FifteenMinutes, self.first)
                .max(1.0)
    }
}

/// The alert's state as last evaluated.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Alert {
    /// The threshold it was evaluated against.
    pub threshold: f64,
    /// `retries / calls` over the 5-minute window; 0 without calls.
    pub ratio: f64,
    /// Whether it fires.
    pub firing: bool,
    /// When it started firing, Unix milliseconds; 0 when not firing.
    pub since_unix_ms: u64,
    /// It fires on the endpoint's account only: it started below the volume an alert needs,
    /// because the endpoint over every calling service was above its threshold, and this
    /// series has not had that volume since. It ends when its own ratio or the endpoint's
    /// falls back.
    pub lent: bool,
}

impl Alert {
    /// The wire form.
    pub fn to_pb(self) -> pb::RetryRatioAlert {
        pb::RetryRatioAlert {
            threshold: self.threshold,
            ratio: self.ratio,
            firing: self.firing,
            since_unix_ms: self.since_unix_ms,
        }
    }
}

#[derive(Debug)]
struct State {
    /// When the series was made, and the span of the first report that counted into it
    /// (`None` until one has).
    created: Instant,
    /// When a report last counted into it (its creation until one has).
    last_report: Instant,
    first_span: Option<Duration>,
    lifetime: Counts,
    /// The newest version kept (see [`State::note_newest`]).
    newest_version: u64,
    /// Most recently counted first.
    versions: Vec<VersionSeries>,
    /// Buckets of evicted versions that may still be inside a window.
    retired: Option<Box<Windows>>,
    alert: Alert,
}

/// One (service, endpoint) series.
#[derive(Debug)]
pub struct Series {
    service: Box<str>,
    endpoint: Box<str>,
    state: Mutex<State>,
}

/// What a series looks like at one instant: what Stats and `/metrics` read.
#[derive(Clone, Debug)]
pub struct SeriesView {
    /// The calling service.
    pub service: String,
    /// The endpoint.
    pub endpoint: String,
    /// The version the series is shown under: the newest with counts in the 15-minute window,
    /// at or below the one published when one such has counts (see `State::shown_version`).
    pub newest_version: u64,
    /// Lifetime totals.
    pub lifetime: Counts,
    /// The 1-, 5- and 15-minute windows, with their covered seconds.
    pub windows: [(Counts, f64); 3],
    /// The retry-ratio alert.
    pub alert: Alert,
}

/// What [`Series::add`] goes by besides the report.
#[derive(Clone, Copy, Debug, Default)]
pub struct AddSettings<'a> {
    /// The interval agents are told to report at.
    pub interval: Duration,
    /// The newest version published; 0 when none is known.
    pub published: u64,
    /// The connected agents running each version, of the series' service.
    pub running: RunningOf<'a>,
}

/// A change of an alert, for the caller to log after the series lock is released.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Transition {
    /// It started firing.
    Started {
        /// The ratio.
        ratio: f64,
        /// The threshold.
        threshold: f64,
        /// Calls in the window.
        calls: u64,
    },
    /// It stopped firing.
    Ended {
        /// The ratio.
        ratio: f64,
        /// The threshold.
        threshold: f64,
        /// Calls in the window.
        calls: u64,
    },
}

impl Series {
    /// A series with nothing counted yet, created at `now`.
    pub fn new(service: &str, endpoint: &str, now: Instant) -> Self {
        Self {
            service: service.into(),
            endpoint: endpoint.into(),
            state: Mutex::new(State {
                created: now,
                last_report: now,
                first_span: None,
                lifetime: Counts::default(),
                newest_version: 0,
                versions: Vec::new(),
                retired: None,
                alert: Alert::default(),
            }),
        }
    }

    /// The calling service.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain counters: a panic elsewhere leaves nothing half-updated that matters.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds one endpoint's deltas, made under `version` over `span` (the report's own span)
    /// and received at `tick`, from agents told to report every `settings.interval`. The first report's
    /// span is the least time the series' and the version's windows cover (see [`Began`]), so a
    /// young series' first counts are not divided by the instant since they arrived.
    pub fn add(
        &self,
        tick: &Tick,
        version: u64,
        counts: &Counts,
        span: Duration,
        settings: AddSettings<'_>,
    ) {
        let AddSettings {
            interval,
            published,
            running,
        } = settings;
        let mut s = self.lock();
        s.first_span.get_or_insert(span);
        s.last_report = s.last_report.max(tick.now);
        s.lifetime.add(counts);
        let at = match s.versions.iter().position(|v| v.version == version) {
            Some(i) => i,
            None => {
                s.prune(tick);
                let mut evict = None;
                if s.versions.len() >= MAX_VERSIONS {
                    evict = s.place_for(version, tick, published, running);
                    if evict.is_none() {
                        s.retired
                            .get_or_insert_with(Box::default)
                            .add(tick, counts, span, interval);
                        return;
                    }
                }
                let at = s.new_version(version, tick, span, evict);
                s.note_newest();
                at
            }
        };
        let v = &mut s.versions[at];
        v.last = v.last.max(tick.now);
        v.lifetime.add(counts);
        v.windows.add(tick, counts, span, interval);
        // Keep the most recent version first, so the usual lookup is one comparison.
        if at != 0 {
            s.versions.swap(0, at);
        }
    }

    /// Lifetime totals.
    pub fn lifetime(&self) -> Counts {
        self.lock().lifetime
    }

    /// Calls and retries in the 5-minute window as of `tick`.
    pub fn five_minutes(&self, tick: &Tick) -> (u64, u64) {
        let mut s = self.lock();
        s.prune(tick);
        let w = s.window(tick, Window::FiveMinutes);
        (w.0[CALLS], w.0[RETRIES])
    }

    /// Whether no report has counted into this series for `after` or more as of `now` and its
    /// alert does not fire: it may be forgotten ([`crate::aggregate::Aggregator::tick`]).
    pub fn silent_for(&self, after: Duration, now: Instant) -> bool {
        let s = self.lock();
        !s.alert.firing && now.saturating_duration_since(s.last_report) >= after
    }

    /// Drops versions and retired buckets with nothing left in any window.
    pub fn prune(&self, tick: &Tick) {
        self.lock().prune(tick);
    }

    /// Re-evaluates the alert against `threshold` as of `tick`; the transition, if any, is
    /// logged here once (after the lock is released).
    pub fn evaluate(&self, tick: &Tick, judge: Judge) -> Alert {
        let (alert, transition) = {
            let mut s = self.lock();
            s.prune(tick);
            s.evaluate(tick, judge)
        };
        if let Some(t) = transition {
            self.log(t);
        }
        alert
    }

    /// Prunes, evaluates the alert and returns the whole series as of `tick`, shown under the
    /// version `State::shown_version` picks with `published` (the newest version published;
    /// 0 when none is known).
    pub fn view(&self, tick: &Tick, judge: Judge, published: u64) -> SeriesView {
        let (view, transition) = {
            let mut s = self.lock();
            s.prune(tick);
            let (alert, transition) = s.evaluate(tick, judge);
            let windows = WINDOWS.map(|w| (s.window(tick, w), tick.covered_seconds(w, s.began())));
            let view = SeriesView {
                service: self.service.to_string(),
                endpoint: self.endpoint.to_string(),
                newest_version: s.shown_version(published),
                lifetime: s.lifetime,
                windows,
                alert,
            };
            (view, transition)
        };
        if let Some(t) = transition {
            self.log(t);
        }
        view
    }

    /// Per version with counts in the last 15 minutes, newest version first.
    pub fn versions(&self, tick: &Tick) -> Vec<pb::VersionStats> {
        let s = self.lock();
        let mut out: Vec<pb::VersionStats> = s
            .versions
            .iter()
            .map(|v| pb::VersionStats {
                policy_version: v.version,
                lifetime: Some(v.lifetime.to_pb()),
                windows: WINDOWS
                    .iter()
                    .map(|&w| window_stats(w, &v.windows.sum(tick, w), tick, v.first))
                    .collect(),
            })
            .collect();
        out.sort_by_key(|v| std::cmp::Reverse(v.policy_version));
        out
    }

    fn log(&self, t: Transition) {
        match t {
            Transition::Started {
                ratio,
                threshold,
                calls,
            } => warn!(
                endpoint = %LogValue(&self.endpoint),
                service = %LogValue(&self.service),
                ratio,
                threshold,
                calls,
                "retry ratio over 5 minutes passed the endpoint's threshold"
            ),
            // An alert the series had from its endpoint (too few calls of its own to alert)
            // ends with the endpoint's ratio over every caller, while its own may stay above.
            Transition::Ended {
                ratio,
                threshold,
                calls,
            } if ratio > threshold => info!(
                endpoint = %LogValue(&self.endpoint),
                service = %LogValue(&self.service),
                ratio,
                threshold,
                calls,
                "retry ratio alert ended: the endpoint's ratio over every calling service is no \
                 longer above its threshold over 5 minutes (this service's own ratio, on too few \
                 calls to alert alone, still is)"
            ),
            Transition::Ended {
                ratio,
                threshold,
                calls,
            } => info!(
                endpoint = %LogValue(&self.endpoint),
                service = %LogValue(&self.service),
                ratio,
                threshold,
                calls,
                "retry ratio over 5 minutes is no longer above the endpoint's threshold"
            ),
        }
    }

    /// Heap bytes this series holds beyond `size_of::<Series>()`: names, the version entries
    /// and retired buckets.
    pub fn heap_bytes(&self) -> usize {
        let s = self.lock();
        self.service.len()
            + self.endpoint.len()
            + s.versions.capacity() * size_of::<VersionSeries>()
            + s.retired.as_ref().map_or(0, |_| size_of::<Windows>())
    }
}

/// One window's wire form.
pub fn window_stats(window: Window, counts: &Counts, tick: &Tick, began: Began) -> pb::WindowStats {
    pb::WindowStats {
        window_seconds: window.seconds(),
        covered_seconds: tick.covered_seconds(window, began),
        counters: Some(counts.to_pb()),
    }
}

impl State {
    /// When the series' counts began.
    fn began(&self) -> Began {
        Began {
            at: self.created,
            span: self.first_span.unwrap_or_default(),
        }
    }

    /// The kept version a report of `version`, which is not kept apart, evicts while every
    /// place is taken, or `None` when it goes with the evicted versions' counts: the kept
    /// version the fewest connected agents run (of two alike, the one with the fewer calls per
    /// second over the 15-minute window, then the least recently counted), never the one
    /// published, when more agents run `version` or it is the one published.
    fn place_for(
        &self,
        version: u64,
        tick: &Tick,
        published: u64,
        running: RunningOf<'_>,
    ) -> Option<usize> {
        let is_published = published > 0 && version == published;
        // The counts read under one hold of their lock, into (index, agents) of each kept
        // version that may go (no allocation: at most `MAX_VERSIONS`).
        let mut kept = [(0usize, 0u64); MAX_VERSIONS];
        let mut len = 0;
        let agents = running.with(|agents_on| {
            for (i, v) in self.versions.iter().enumerate() {
                if (published == 0 || v.version != published) && len < MAX_VERSIONS {
                    kept[len] = (i, agents_on(v.version));
                    len += 1;
                }
            }
            agents_on(version)
        });
        let kept = &kept[..len];
        // A version no agent runs (a late report, a straggler's last one, a client's bogus
        // number) has no more agents than any kept one: turned away.
        let fewest = kept.iter().map(|&(_, n)| n).min()?;
        if !is_published && agents <= fewest {
            return None;
        }
        // Of the kept versions the fewest agents run, the one with the fewer calls per second,
        // then the least recently counted (the windows are summed only for these).
        kept.iter()
            .filter(|&&(_, n)| n == fewest)
            .map(|&(i, _)| (i, self.versions[i].rate(tick), self.versions[i].last))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)))
            .map(|(i, ..)| i)
    }

    /// Adds `version`, after evicting the version at `evict` (see [`State::place_for`]);
    /// returns its index.
    fn new_version(
        &mut self,
        version: u64,
        tick: &Tick,
        span: Duration,
        evict: Option<usize>,
    ) -> usize {
        if let Some(at) = evict {
            let evicted = self.versions.swap_remove(at);
            self.retired
                .get_or_insert_with(Box::default)
                .merge(&evicted.windows);
        }
        self.versions.push(VersionSeries {
            version,
            first: Began { at: tick.now, span },
            last: tick.now,
            lifetime: Counts::default(),
            windows: Windows::default(),
        });
        self.versions.len() - 1
    }

    fn prune(&mut self, tick: &Tick) {
        self.versions.retain(|v| v.windows.is_live(tick));
        self.note_newest();
        if self.retired.as_ref().is_some_and(|r| !r.is_live(tick)) {
            self.retired = None;
        }
    }

    /// The version the series is shown under: the newest kept version at or below `published`,
    /// so that a number above it (a client's bogus one, another store's) does not head a series
    /// in which a version of this store has counts; with none kept at or below it (or none
    /// published), the newest kept; with none kept, the newest of the last ones.
    fn shown_version(&self, published: u64) -> u64 {
        if published > 0
            && let Some(v) = self
                .versions
                .iter()
                .map(|v| v.version)
                .filter(|&v| v <= published)
                .max()
        {
            return v;
        }
        self.newest_version
    }

    /// Sets `newest_version` to the newest version kept; with none kept, it stays the newest
    /// of the last ones. So a version no store published (a client's bogus number) is shown
    /// only while its counts are in the 15-minute window, not for the server's life.
    fn note_newest(&mut self) {
        if let Some(newest) = self.versions.iter().map(|v| v.version).max() {
            self.newest_version = newest;
        }
    }

    fn window(&self, tick: &Tick, window: Window) -> Counts {
        let mut c = Counts::default();
        for v in &self.versions {
            v.windows.sum_into(tick, window, &mut c);
        }
        if let Some(r) = &self.retired {
            r.sum_into(tick, window, &mut c);
        }
        c
    }

    fn evaluate(&mut self, tick: &Tick, judge: Judge) -> (Alert, Option<Transition>) {
        let threshold = judge.threshold;
        let w = self.window(tick, Window::FiveMinutes);
        let (calls, retries) = (w.0[CALLS], w.0[RETRIES]);
        let was = self.alert.firing;
        // No call in the window, and the next report not due yet: nothing new to judge by, so
        // the alert holds at the ratio it last had, against the threshold in force now.
        if calls == 0
            && was
            && tick.now.saturating_duration_since(self.last_report) < judge.hold
            && self.alert.ratio > threshold
        {
            self.alert.threshold = threshold;
            return (self.alert, None);
        }
        let ratio = ratio(retries, calls);
        let own_volume = calls >= MIN_ALERT_CALLS;
        // The volume guard only keeps an alert from starting: one that fires goes on while the
        // ratio stays above the threshold, so a storm that also cuts the traffic does not
        // flap the alert. An alert a small series got from its endpoint's ratio (`lent`) goes
        // on only while the endpoint's ratio stays above the threshold (whatever its volume,
        // for the same reason), or once the series has the volume itself: a caller of a few
        // calls (`retryplane request --server`) made during a storm would otherwise fire until
        // its calls left the window, long after the storm.
        let fire = ratio > threshold
            && (own_volume
                || judge.endpoint_wide
                || (was && (!self.alert.lent || judge.endpoint_above)));
        let lent = fire && !own_volume && (!was || self.alert.lent);
        let since_unix_ms = match (was, fire) {
            (false, true) => unix_ms(),
            (true, true) => self.alert.since_unix_ms,
            (_, false) => 0,
        };
        self.alert = Alert {
            threshold,
            ratio,
            firing: fire,
            since_unix_ms,
            lent,
        };
        let transition = match (was, fire) {
            (false, true) => Some(Transition::Started {
                ratio,
                threshold,
                calls,
            }),
            (true, false) => Some(Transition::Ended {
                ratio,
                threshold,
                calls,
            }),
            _ => None,
        };
        (self.alert, transition)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn counts(calls: u64, retries: u64) -> Counts {
        let mut c = Counts::default();
        c.0[CALLS] = calls;
        c.0[RETRIES] = retries;
        c
    }

    #[test]
    fn a_transition_is_reported_once_when_it_starts_and_once_when_it_ends() {
        let epoch = Instant::now();
        let tick = Tick::new(epoch, epoch);
        let series = Series::new("checkout", "payments", epoch);
        series.add(
            &tick,
            1,
            &counts(40, 10),
            Duration::ZERO,
            AddSettings::default(),
        );
        let mut s = series.lock();
        let (alert, started) = s.evaluate(&tick, Judge::threshold(0.05));
        assert_eq!(
            started,
            Some(Transition::Started {
                ratio: 0.25,
                threshold: 0.05,
                calls: 40
            })
        );
        assert!(alert.firing);
        assert_eq!(
            s.evaluate(&tick, Judge::threshold(0.05)).1,
            None,
            "still firing: nothing to log"
        );
        let (alert, ended) = s.evaluate(&tick, Judge::threshold(0.5));
        assert_eq!(
            ended,
            Some(Transition::Ended {
                ratio: 0.25,
                threshold: 0.5,
                calls: 40
            })
        );
        assert!(!alert.firing);
        assert_eq!(s.evaluate(&tick, Judge::threshold(0.5)).1, None);
    }

    #[test]
    fn a_report_waiting_across_a_bucket_edge_is_not_lost() {
        let epoch = Instant::now();
        let later = Tick::new(epoch, epoch + Duration::from_secs(61));
        let earlier = Tick::new(epoch, epoch + Duration::from_secs(59));
        let series = Series::new("checkout", "payments", epoch);
        series.add(
            &later,
            1,
            &counts(1, 0),
            Duration::ZERO,
            AddSettings::default(),
        );
        series.add(
            &earlier,
            1,
            &counts(2, 0),
            Duration::ZERO,
            AddSettings::default(),
        );
        let view = series.view(&later, Judge::threshold(0.05), 0);
        assert_eq!(view.windows.map(|(c, _)| c.0[CALLS]), [3, 3, 3]);
    }
}
