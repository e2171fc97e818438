//! One (service, endpoint) series: lifetime totals, windows split by policy version, and its
//! retry-ratio alert.
//!
//! The series' windows are the sum of its versions' windows (plus `retired`, below), so each
//! count is kept once per bucket size. A version is pruned once nothing of it is left in the
//! 15-minute window (no counts for 14–15 minutes); its lifetime stays in the series lifetime.
//! At most [`MAX_VERSIONS`] versions are kept apart. A report under yet another version, while
//! all places are taken, evicts the kept version with the fewest calls per second over the
//! 15-minute window, never the two newest kept at or below the published one (the version the
//! fleet moves to, and the one agents refusing it stay on; with none published, the newest
//! kept, for an older one); the evicted version's buckets are folded into `retired`
//! (allocated only then, freed once empty) so the series' windows lose nothing. It is counted
//! into `retired` directly instead when its calls per second come to fewer than the evicted
//! one's would (its report's over a report interval at least; for a version turned away or
//! evicted lately, all its reports' since, from its second on: many agents' reports add up,
//! a straggler's one does not), or when it is a number above the published one while none
//! such is kept (see `State::place_for`); never when it is the published version.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use retryplane_policy::diag::OneLine;
use retryplane_proto::pb;
use tokio::time::Instant;
use tracing::{info, warn};

use super::counts::{CALLS, Counts, RETRIES, ratio};
use super::window::{Began, Tick, WINDOWS, Window, Windows};
use crate::fleet::unix_ms;

/// Most policy versions one series keeps apart.
pub const MAX_VERSIONS: usize = 4;

/// The most versions a series remembers evicting (see `State::evicted`).
const MAX_EVICTED: usize = 16;

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
    /// Calls per second over the 15-minute window (the part of it this version covers):
    /// whatever the report interval, the version agents run now counts the most.
    fn rate(&self, tick: &Tick) -> f64 {
        let calls = self.windows.sum(tick, Window::FifteenMinutes).0[CALLS];
        calls as f64
            / tick
                .covered_seconds(Window::FifteenMinutes, self.first)
                .max(1.0)
    }
}

/// A version evicted lately (see `State::evicted`).
#[derive(Debug)]
struct Evicted {
    version: u64,
    /// When it was evicted.
    at: Instant,
    /// Its calls since `since`: those in the 15-minute window when it was evicted, and those
    /// of its reports since.
    calls: u64,
    since: Instant,
    /// Its reports since it was evicted.
    reports: u32,
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
    /// The versions evicted, or turned away, in the last 15 minutes (the longest window), with
    /// their calls since, at most [`MAX_EVICTED`] (when full, the one with the fewest calls
    /// goes; a new entry starts with one report's, so a run of numbers each reported once can
    /// push off a version whose agents have only begun to report it): a
    /// late report of one (calls that outlived it, a report held while newer ones went out)
    /// is counted into `retired`, not kept apart again in place of a version counted after
    /// it; one whose agents go on reporting it (a second report since) comes back when its
    /// calls per second since come to those of the version it would evict. A version that
    /// gets a place leaves the list. Past 15 minutes one comes back as any other.
    evicted: Vec<Evicted>,
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
    /// The newest policy version with counts in the 15-minute window (see `State::note_newest`).
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
pub struct AddSettings {
    /// The interval agents are told to report at.
    pub interval: Duration,
    /// The newest version published; 0 when none is known.
    pub published: u64,
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
                evicted: Vec::new(),
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
        settings: AddSettings,
    ) {
        let AddSettings {
            interval,
            published,
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
                    evict = s.place_for(version, counts, span, interval, tick, published);
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

    /// Prunes, evaluates the alert and returns the whole series as of `tick`.
    pub fn view(&self, tick: &Tick, judge: Judge) -> SeriesView {
        let (view, transition) = {
            let mut s = self.lock();
            s.prune(tick);
            let (alert, transition) = s.evaluate(tick, judge);
            let windows = WINDOWS.map(|w| (s.window(tick, w), tick.covered_seconds(w, s.began())));
            let view = SeriesView {
                service: self.service.to_string(),
                endpoint: self.endpoint.to_string(),
                newest_version: s.newest_version,
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
                endpoint = %OneLine(&self.endpoint),
                service = %OneLine(&self.service),
                ratio,
                threshold,
                calls,
                "retry ratio over 5 minutes passed the endpoint's threshold"
            ),
            Transition::Ended {
                ratio,
                threshold,
                calls,
            } => info!(
                endpoint = %OneLine(&self.endpoint),
                service = %OneLine(&self.service),
                ratio,
                threshold,
                calls,
                "retry ratio over 5 minutes is back under the endpoint's threshold"
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
            + s.evicted.capacity() * size_of::<Evicted>()
    }
}

/// Whether `version` is numbered above the `published` one (none is, with none published):
/// no version a fleet was sent by this control plane.
fn above(version: u64, published: u64) -> bool {
    published > 0 && version > published
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

    /// The kept version a report of `version` (its `counts`, made over `span`, from agents
    /// that report every `interval`), which is not kept apart, evicts while every place is
    /// taken ([`State::victim`]), or `None` when it goes with the evicted versions' counts:
    /// - a number above the published one (a bogus number, or a version of a store the
    ///   control plane no longer has) while every version kept is at or below it: no version
    ///   this control plane published makes room for one it did not;
    /// - a version evicted lately (or turned away here before) at its first report since: a
    ///   late report (calls that outlived their version, a report held while newer ones went
    ///   out) does not take the place of one counted after it;
    /// - calls per second fewer than those of the version it would evict: the report's over a
    ///   report interval at least (an agent's last report before it stops can span a fraction
    ///   of one), or, for a version on the list, all its calls since (its calls in the window
    ///   when it was evicted, and its reports' since), so that the reports of the many agents
    ///   on one version add up and a version its agents go on reporting comes back.
    ///
    /// Never the version published: the fleet moves to it, whatever numbers were reported.
    fn place_for(
        &mut self,
        version: u64,
        counts: &Counts,
        span: Duration,
        interval: Duration,
        tick: &Tick,
        published: u64,
    ) -> Option<usize> {
        if version == published {
            return Some(self.victim(version, tick, published).unwrap_or(0));
        }
        let above_kept = self.versions.iter().any(|v| above(v.version, published));
        if above(version, published) && !above_kept {
            return None;
        }
        let floor = interval.as_secs_f64().max(1.0);
        let rate = match self.evicted.iter_mut().find(|e| e.version == version) {
            Some(e) => {
                e.calls = e.calls.saturating_add(counts.0[CALLS]);
                e.reports = e.reports.saturating_add(1);
                if e.reports < 2 {
                    return None;
                }
                e.calls as f64
                    / tick
                        .now
                        .saturating_duration_since(e.since)
                        .as_secs_f64()
                        .max(floor)
            }
            // Over a report interval at least: an agent's last report before it stops can
            // span a fraction of one.
            _ => counts.0[CALLS] as f64 / span.as_secs_f64().max(floor),
        };
        let victim = self
            .victim(version, tick, published)
            .filter(|&i| rate >= self.versions[i].rate(tick));
        if victim.is_none() && !self.evicted.iter().any(|e| e.version == version) {
            // Turned away at its first report: its next ones add up with this one (the
            // reports of many agents on a version the series has not kept yet).
            self.remember(Evicted {
                version,
                at: tick.now,
                calls: counts.0[CALLS],
                since: tick.now.checked_sub(span.max(interval)).unwrap_or(tick.now),
                reports: 1,
            });
        }
        victim
    }

    /// The kept version a new `version` would evict: the one with the fewest calls per second
    /// over the 15-minute window (of two alike, the least recently counted), whatever the
    /// report interval: not the one most agents run because its report came a second before
    /// a straggler's, or because its reports are minutes apart. Never the versions a fleet
    /// moves to or runs, which count little while their first agents run them: the two newest
    /// kept at or below the one published (a bogus higher number reported must not evict them;
    /// agents that refuse a publish stay on the one before, and a fleet can be split between
    /// the two); with none published, the newest kept, for an older one.
    fn victim(&self, version: u64, tick: &Tick, published: u64) -> Option<usize> {
        let mut real: Vec<u64> = self
            .versions
            .iter()
            .map(|v| v.version)
            .filter(|&v| !above(v, published))
            .collect();
        real.sort_unstable_by(|a, b| b.cmp(a));
        let protected: &[u64] = if published > 0 {
            &real[..real.len().min(2)]
        } else if real.first().is_some_and(|&newest| version < newest) {
            &real[..1]
        } else {
            &[]
        };
        self.versions
            .iter()
            .enumerate()
            .filter(|(_, v)| !protected.contains(&v.version))
            .map(|(i, v)| (i, v.rate(tick), v.last))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)))
            .map(|(i, ..)| i)
    }

    /// Puts `entry` on the list of versions evicted lately, in place of one for the same
    /// version; when the list is full, the entry with the fewest calls goes.
    fn remember(&mut self, entry: Evicted) {
        self.evicted.retain(|e| e.version != entry.version);
        if self.evicted.len() >= MAX_EVICTED
            && let Some(fewest) = self
                .evicted
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| (e.calls, e.at))
                .map(|(i, _)| i)
        {
            self.evicted.remove(fewest);
        }
        self.evicted.push(entry);
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
            let covered = tick.covered_seconds(Window::FifteenMinutes, evicted.first);
            self.remember(Evicted {
                version: evicted.version,
                at: tick.now,
                calls: evicted.windows.sum(tick, Window::FifteenMinutes).0[CALLS],
                since: tick
                    .now
                    .checked_sub(Duration::from_secs_f64(covered))
                    .unwrap_or(tick.now),
                reports: 0,
            });
        }
        // It has a place: what the list held of it is in the past.
        self.evicted.retain(|e| e.version != version);
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
        let longest = Duration::from_secs(Window::FifteenMinutes.seconds().into());
        self.evicted
            .retain(|e| tick.now.saturating_duration_since(e.at) < longest);
        if self.evicted.is_empty() {
            self.evicted = Vec::new();
        }
        self.note_newest();
        if self.retired.as_ref().is_some_and(|r| !r.is_live(tick)) {
            self.retired = None;
        }
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
        let view = series.view(&later, Judge::threshold(0.05));
        assert_eq!(view.windows.map(|(c, _)| c.0[CALLS]), [3, 3, 3]);
    }
}
