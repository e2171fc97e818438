//! The agents' retry metrics (SPEC §4), aggregated per (calling service, endpoint) and per
//! policy version into lifetime totals and rolling 1-, 5- and 15-minute windows, with the
//! retry-ratio alert, for the admin `Stats` call and `/metrics`.
//!
//! # Shape and bounds
//!
//! A **series** is one (service, endpoint): the service from the agent's `Hello`, the endpoint
//! from the report. At most `max_series` series are kept apart ([`DEFAULT_MAX_SERIES`] unless
//! [`crate::server::ServeConfig::max_series`] says otherwise); reports for any further series,
//! and for names longer than [`MAX_NAME_LEN`] bytes or holding a control character (which
//! `retryplane stats` would otherwise print to a terminal), are counted in the one series whose
//! service and endpoint are both [`OTHER`]; so are a service's endpoints past its share
//! ([`DEFAULT_MAX_SERIES_PER_SERVICE`] unless [`Aggregator::with_max_per_service`] says
//! otherwise, logged once per service). Each such endpoint report is counted
//! (`overflowed_reports`); the first for a name not kept apart and the first past the cap are
//! each logged at warn once (the name escaped, so it cannot forge a log line), and later ones
//! in a summary at most every [`OVERFLOW_SUMMARY_EVERY`]. A series no report has counted into for
//! [`DEFAULT_FORGET_SERIES_AFTER`] (unless [`Aggregator::with_forget_after`] says otherwise; never
//! less than [`MIN_FORGET_SERIES_AFTER`], past the longest window, nor than three of the intervals
//! agents report at) is forgotten, lifetime totals with it, and so is a service left
//! with no series and no stream: names agents no longer report (an endpoint renamed, a service
//! gone) give their place back to the ones they report now, which would otherwise count in
//! `other` once the cap or a service's share filled up. A name reported again starts a new
//! series (Prometheus reads its counters as reset). Each
//! series holds its windows in fixed rings ([`window`] documents the bucket layout and
//! resolution) split by policy version ([`series`] documents version pruning), so a series
//! costs about 3 KB with one live version ([`Aggregator::approx_bytes`]: 3,021 bytes, of
//! which 2,672 are the version's totals and rings) and at most about 13.6 KB, with
//! [`series::MAX_VERSIONS`] versions and the retired buckets: 10,000 series take 29–130 MiB.
//! Which versions a series keeps apart follows the fleet: how many connected agents of its
//! service run each ([`crate::running`], kept by [`crate::fleet::Fleet`]).
//!
//! # Ingestion
//!
//! An agent stream resolves its service once, at `Hello` ([`Aggregator::service`]), and keeps
//! the [`ServiceHandle`]. For each report, [`Aggregator::ingest`] takes that service's map
//! under a read lock once, finds each endpoint's series by `&str` (no allocation) and adds the
//! deltas under that series' own mutex. Only an endpoint seen for the first time takes the
//! service's write lock. Streams of different services share nothing but the atomic series
//! count; streams of one service share read locks and contend only on the same series.
//!
//! # Alerting
//!
//! A series alerts when its retry ratio (retries / calls) over the 5-minute window is above its
//! endpoint's threshold ([`thresholds`]; default 5 %) with at least [`series::MIN_ALERT_CALLS`]
//! calls in that window, its own or, when the endpoint summed over every calling service is
//! above its threshold too, the endpoint's (so a storm spread over many small callers alerts on
//! each of them; [`series::Judge`]); once firing it ends only when the ratio is back at or
//! under the threshold, whatever the volume. It is re-evaluated every [`TICK`] by the task of
//! [`spawn_ticker`], and on every Stats call and scrape. The start is logged once at warn
//! (endpoint, service, ratio, threshold), the end once at info.
//!
//! Time is tokio's clock, passed in, so tests run under paused time.

pub mod counts;
pub mod prometheus;
pub mod series;
pub mod thresholds;
pub mod window;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use retryplane_policy::diag::LogValue;
use retryplane_proto::{pb, rank};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use self::counts::Counts;
use self::series::{Alert, Judge, Series, SeriesView};
use self::thresholds::Thresholds;
use self::window::{Tick, WINDOWS};
use crate::fleet::unix_ms;
use crate::running::AgentsRunning;

/// The span taken for a report that gives none unless configured: the default interval agents
/// report at.
pub const DEFAULT_UNKNOWN_SPAN: Duration = Duration::from_secs(10);

/// The series cap unless configured.
pub const DEFAULT_MAX_SERIES: usize = 10_000;
/// The most series one calling service may take unless configured: a service whose agent
/// names its endpoints after URLs (one name per path) takes this many, and the rest of the
/// fleet keeps its series.
pub const DEFAULT_MAX_SERIES_PER_SERVICE: usize = 1_000;
/// Longest service or endpoint name kept apart, in bytes; longer ones count as [`OTHER`].
pub const MAX_NAME_LEN: usize = retryplane_proto::MAX_SERIES_NAME_BYTES;
/// Service and endpoint of the series that takes what is past the cap. The pair is reserved:
/// an agent whose service and endpoint are both `other` is counted in that series too, so two
/// series never carry the same labels.
pub const OTHER: &str = "other";

/// An endpoint agents called in the last five minutes ([`Aggregator::in_use`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInUse {
    /// Its name.
    pub endpoint: String,
    /// Calls reported in the five minutes, over every service.
    pub calls: u64,
    /// The services that made them, sorted.
    pub services: Vec<String>,
    /// For a name not found in use by a series of its own while the `other` series counted
    /// calls: those calls (in the five minutes), among which this endpoint's may be; 0
    /// otherwise.
    pub maybe_in_other: u64,
}

impl std::fmt::Display for EndpointInUse {
    /// `payments (9006 calls by checkout, search)`; long names cut as diagnostics cut them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = |name: &str| retryplane_policy::diag::endpoint_name_shown(name).into_owned();
        if self.maybe_in_other > 0 {
            return write!(
                f,
                "{} (its calls may be among the {} counted in the \"other\" series)",
                shown(&self.endpoint),
                self.maybe_in_other
            );
        }
        // Three services at most: the message of a refusal must stay short.
        let mut services: Vec<String> = self.services.iter().take(3).map(|s| shown(s)).collect();
        if self.services.len() > 3 {
            services.push(format!("{} more", self.services.len() - 3));
        }
        write!(
            f,
            "{} ({} call{} by {})",
            shown(&self.endpoint),
            self.calls,
            if self.calls == 1 { "" } else { "s" },
            services.join(", ")
        )
    }
}
/// How long a series may go without a report before it is forgotten, unless configured.
pub const DEFAULT_FORGET_SERIES_AFTER: Duration = Duration::from_secs(3600);
/// The shortest time a series is kept without a report: past its longest window (15 minutes,
/// in whole-minute buckets), with room to spare.
pub const MIN_FORGET_SERIES_AFTER: Duration = Duration::from_secs(20 * 60);
/// How often alerts are re-evaluated and versions pruned in the background.
pub const TICK: Duration = Duration::from_secs(5);
/// Shortest time between two summaries of overflowed reports in the log.
pub const OVERFLOW_SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// One calling service's series.
#[derive(Debug)]
struct ServiceSeries {
    name: Box<str>,
    endpoints: RwLock<HashMap<Box<str>, Arc<Series>>>,
    /// Whether a report past this service's share was logged.
    share_warned: AtomicBool,
}

/// A stream's handle on its service's series, from [`Aggregator::service`].
#[derive(Clone, Debug)]
pub struct ServiceHandle(Result<Arc<ServiceSeries>, Overflow>);

/// Why a report is counted in `other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// A service or endpoint name longer than [`MAX_NAME_LEN`], holding a control character,
    /// or the overflow series' own; or an empty endpoint name.
    BadName,
    /// The cap on series is reached.
    Cap,
    /// The service holds its share of series ([`Aggregator::with_max_per_service`]).
    ServiceShare,
}

impl Overflow {
    /// Every reason.
    pub const ALL: [Overflow; 3] = [Overflow::Cap, Overflow::BadName, Overflow::ServiceShare];

    /// The `reason` label of `retryplane_metrics_overflowed_reports_total`.
    pub fn label(self) -> &'static str {
        match self {
            Overflow::Cap => "series_cap",
            Overflow::BadName => "bad_name",
            Overflow::ServiceShare => "service_share",
        }
    }
}

/// Endpoint reports counted in `other`, by reason.
#[derive(Debug, Default)]
struct Overflowed {
    cap: AtomicU64,
    bad_name: AtomicU64,
    service_share: AtomicU64,
}

impl Overflowed {
    fn of(&self, why: Overflow) -> &AtomicU64 {
        match why {
            Overflow::Cap => &self.cap,
            Overflow::BadName => &self.bad_name,
            Overflow::ServiceShare => &self.service_share,
        }
    }
}

#[derive(Debug)]
struct OverflowLog {
    at: Instant,
    reports: u64,
}

/// The aggregated metrics of the whole fleet; see the module docs.
#[derive(Debug)]
pub struct Aggregator {
    epoch: Instant,
    max_series: usize,
    max_per_service: usize,
    /// The span taken for a report that gives none (see [`Aggregator::with_unknown_span`]).
    unknown_span: Duration,
    series: AtomicUsize,
    services: RwLock<HashMap<Box<str>, Arc<ServiceSeries>>>,
    other: Series,
    /// The coarse bucket (plus one; 0 for never) in which a service named `other` last reported
    /// the endpoint `other`: that pair is counted in the overflow series (its labels are the
    /// same), which then also stands for an endpoint while that bucket is in its alert's
    /// window.
    other_pair_reported: AtomicU64,
    overflowed: Overflowed,
    overflow_warned: AtomicBool,
    bad_name_warned: AtomicBool,
    overflow_log: Mutex<OverflowLog>,
    thresholds: Thresholds,
    /// A series silent this long is forgotten (see the module docs), or three report
    /// intervals when that is longer.
    forget_after: Duration,
    /// The interval agents are told to report at ([`Aggregator::with_unknown_span`]).
    report_interval: Duration,
    /// The newest version published (0 before any is known, see
    /// [`Aggregator::set_published`]).
    published: AtomicU64,
    /// Connected agents per service and version: which versions a series keeps apart.
    running: Arc<AgentsRunning>,
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// Which series a Stats call or scrape reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct Filter<'a> {
    /// Only this calling service.
    pub service: Option<&'a str>,
    /// Only this endpoint.
    pub endpoint: Option<&'a str>,
    /// Only series whose alert is firing (Stats' `series`; its per-endpoint totals are not
    /// narrowed by it).
    pub firing_only: bool,
}

/// How many series a `Stats` answer keeps, and the window it ranks them over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// Series kept.
    pub count: usize,
    /// The window whose retry ratio ranks them.
    pub window: window::Window,
}

/// `retryplane top`'s order ([`rank::worst_first`]) over window number `w` of [`WINDOWS`].
fn worst_first(a: &SeriesView, b: &SeriesView, w: usize) -> std::cmp::Ordering {
    rank::worst_first(&rank_of(a, w), &rank_of(b, w))
}

/// What `v` is ranked by over window number `w`.
fn rank_of(v: &SeriesView, w: usize) -> rank::Rank<'_> {
    let (retries, calls) = v
        .windows
        .get(w)
        .map_or((0, 0), |(c, _)| (c.0[counts::RETRIES], c.0[counts::CALLS]));
    rank::Rank::new(retries, calls, v.alert.firing, &v.service, &v.endpoint)
}

impl Filter<'_> {
    fn matches(&self, service: &str, endpoint: &str) -> bool {
        self.service.is_none_or(|s| s == service) && self.endpoint.is_none_or(|e| e == endpoint)
    }
}

impl Aggregator {
    /// An empty aggregate keeping at most `max_series` series apart; windows count from `now`.
    /// Each series keeps apart the versions the most connected agents run, as `running` counts
    /// them (the fleet's: [`crate::fleet::Fleet::running`]; an empty count knows no agent, and
    /// a series then keeps apart the versions it has places for and the one published).
    pub fn new(max_series: usize, now: Instant, running: Arc<AgentsRunning>) -> Self {
        Self {
            // Buckets are numbered from the longest window before `now`, so that the counts of
            // a report that covers the time before this aggregate was made (an agent's backlog
            // from while the control plane was down) have buckets of their own to be spread
            // over. A multiple of both bucket lengths: the buckets' edges are the same.
            epoch: now.checked_sub(window::COARSE * 15).unwrap_or(now),
            max_series,
            max_per_service: DEFAULT_MAX_SERIES_PER_SERVICE,
            unknown_span: DEFAULT_UNKNOWN_SPAN,
            series: AtomicUsize::new(0),
            services: RwLock::new(HashMap::new()),
            other: Series::new(OTHER, OTHER, now),
            other_pair_reported: AtomicU64::new(0),
            overflowed: Default::default(),
            overflow_warned: AtomicBool::new(false),
            bad_name_warned: AtomicBool::new(false),
            overflow_log: Mutex::new(OverflowLog {
                at: now,
                reports: 0,
            }),
            thresholds: Thresholds::default(),
            published: AtomicU64::new(0),
            forget_after: DEFAULT_FORGET_SERIES_AFTER,
            report_interval: DEFAULT_UNKNOWN_SPAN,
            running,
        }
    }

    /// This aggregate, forgetting a series no report has counted into for `after` (default
    /// [`DEFAULT_FORGET_SERIES_AFTER`]; at least [`MIN_FORGET_SERIES_AFTER`], so a series with
    /// counts in a window is never forgotten).
    #[must_use]
    pub fn with_forget_after(mut self, after: Duration) -> Self {
        self.forget_after = after.max(MIN_FORGET_SERIES_AFTER);
        self
    }

    /// This aggregate, with at most `max` series per calling service (at least 1; default
    /// [`DEFAULT_MAX_SERIES_PER_SERVICE`]); a report for another endpoint of a service that
    /// holds that many is counted in `other`.
    #[must_use]
    pub fn with_max_per_service(mut self, max: usize) -> Self {
        self.max_per_service = max.max(1);
        self
    }

    /// [`Judge::hold`]: the report interval and [`REPORT_SLACK`].
    fn report_due(&self) -> Duration {
        self.report_interval.saturating_add(REPORT_SLACK)
    }

    /// This aggregate, taking a report without a known span (no start, or an end at or before
    /// its start) to cover `span`: the interval agents are told to report at. Taken as zero, a new
    /// series' first counts would be divided by the instant since they arrived, and its rates
    /// read as hundreds of calls a second. Default [`DEFAULT_UNKNOWN_SPAN`].
    #[must_use]
    pub fn with_unknown_span(mut self, span: Duration) -> Self {
        // Agents report about this often: a series is kept for three such intervals at least,
        // so one reported every interval (an hour at most) is never forgotten between two.
        self.report_interval = span;
        self.unknown_span = span.min(MAX_REPORT_SPAN);
        self
    }

    /// The cap on series.
    pub fn max_series(&self) -> usize {
        self.max_series
    }

    /// The most series one calling service may take.
    pub fn max_per_service(&self) -> usize {
        self.max_per_service
    }

    /// Series kept apart so far (not counting `other`).
    pub fn series_count(&self) -> usize {
        self.series.load(Ordering::Relaxed)
    }

    /// Endpoint reports counted in `other`, for any reason.
    pub fn overflowed_reports(&self) -> u64 {
        Overflow::ALL
            .iter()
            .map(|&why| self.overflowed_by(why))
            .fold(0, u64::saturating_add)
    }

    /// Endpoint reports counted in `other` for `why`.
    pub fn overflowed_by(&self, why: Overflow) -> u64 {
        self.overflowed.of(why).load(Ordering::Relaxed)
    }

    /// Says that `version` is published: the version the fleet moves to, which a series keeps
    /// apart from its first report on, before its agents' ACKs are counted, and never evicts
    /// (the others follow the agents running them: [`series`]). Versions only go forward.
    pub fn set_published(&self, version: u64) {
        self.published.fetch_max(version, Ordering::Relaxed);
    }

    /// The newest version published ([`Aggregator::set_published`]); 0 before any.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// The alert thresholds, set on every publish.
    pub fn thresholds(&self) -> &Thresholds {
        &self.thresholds
    }

    /// What a series of `service` (`None`: the overflow series, whose reports come from every
    /// service) adds a report by.
    fn add_settings<'a>(&'a self, service: Option<&'a str>) -> series::AddSettings<'a> {
        series::AddSettings {
            interval: self.report_interval,
            published: self.published.load(Ordering::Relaxed),
            running: self.running.of(service),
        }
    }

    /// The handle a stream of `service` keeps for [`Aggregator::ingest`]. Past the cap (more
    /// services than series allowed), or for a too long name or one with a control character,
    /// every report of the stream counts in `other`.
    pub fn service(&self, service: &str) -> ServiceHandle {
        if service.len() > MAX_NAME_LEN || retryplane_policy::diag::has_control(service) {
            return ServiceHandle(Err(Overflow::BadName));
        }
        if let Some(s) = read(&self.services).get(service) {
            return ServiceHandle(Ok(s.clone()));
        }
        let mut services = write(&self.services);
        if let Some(s) = services.get(service) {
            return ServiceHandle(Ok(s.clone()));
        }
        if services.len() >= self.max_series {
            return ServiceHandle(Err(Overflow::Cap));
        }
        let s = Arc::new(ServiceSeries {
            name: service.into(),
            endpoints: RwLock::new(HashMap::new()),
            share_warned: AtomicBool::new(false),
        });
        services.insert(service.into(), s.clone());
        ServiceHandle(Ok(s))
    }

    /// Adds one report's deltas, received at `now` from a stream of `service`. This is what
    /// the agent stream calls for each accepted `MetricsReport`.
    ///
    /// An endpoint's counts past what one agent could make over the report's span
    /// ([`Counts::implausible`]) are left out, whole: they would saturate the series' lifetime
    /// totals and bury its retry ratio. So is a second entry for an endpoint already in the
    /// report. Returns the first endpoint so left out and how many
    /// were, for the stream to count and log.
    pub fn ingest<'r>(
        &self,
        service: &ServiceHandle,
        report: &'r pb::MetricsReport,
        now: Instant,
    ) -> Refused<'r> {
        let tick = Tick::new(self.epoch, now);
        let span = report_span(report).unwrap_or(self.unknown_span);
        let raw_span = raw_span(report);
        let version = report.policy_version;
        let mut refused = Refused::default();
        // An agent sends one entry per endpoint; the bound holds per endpoint, so a name
        // repeated in one report (to pass the bound once per copy) leaves its repeats out.
        // A report of one endpoint needs no set (and makes none).
        let several = report.endpoints.len() > 1;
        let mut seen: HashSet<&'r str> = if several {
            HashSet::with_capacity(report.endpoints.len())
        } else {
            HashSet::new()
        };
        let mut plausible = |c: &'r pb::EndpointCounters| {
            let counts = Counts::of(c);
            // An entry that counted nothing says nothing (the proto asks for none): it makes
            // no series, and is no report of one (it would hold a firing alert through an
            // empty window).
            if counts.is_zero() {
                return None;
            }
            let repeated = several && !seen.insert(c.endpoint.as_str());
            if repeated || counts.implausible(raw_span) {
                refused.count += 1;
                refused.repeated += u64::from(repeated);
                refused.first.get_or_insert(&c.endpoint);
                None
            } else {
                Some(counts)
            }
        };
        let svc = match &service.0 {
            Ok(svc) => svc,
            Err(why) => {
                for c in &report.endpoints {
                    if let Some(counts) = plausible(c) {
                        self.add_other(&tick, version, &counts, span, &c.endpoint, *why, 1);
                    }
                }
                return refused;
            }
        };
        let mut missed = Vec::new();
        let settings = self.add_settings(Some(&svc.name));
        {
            let endpoints = read(&svc.endpoints);
            for c in &report.endpoints {
                let Some(counts) = plausible(c) else { continue };
                match endpoints.get(c.endpoint.as_str()) {
                    Some(series) => series.add(&tick, version, &counts, span, settings),
                    None => missed.push((c, counts)),
                }
            }
        }
        // Once the service's share or the cap is full, the misses after it go to `other`
        // summed, one addition a report: no write lock and no series update for each (a report
        // of 250,000 made-up names cost about 0.16 CPU-s when each was resolved).
        let mut full: Option<(Overflow, Counts, &str, u64)> = None;
        for (c, counts) in missed {
            if let Some((_, sum, _, entries)) = &mut full {
                match self.bad_name(svc, &c.endpoint, tick.now) {
                    Some(why) => self.add_other(&tick, version, &counts, span, &c.endpoint, why, 1),
                    None => {
                        sum.add(&counts);
                        *entries += 1;
                    }
                }
                continue;
            }
            match self.resolve(svc, &c.endpoint, tick.now) {
                Ok(series) => series.add(&tick, version, &counts, span, settings),
                Err(why @ (Overflow::ServiceShare | Overflow::Cap)) => {
                    full = Some((why, counts, &c.endpoint, 1));
                }
                Err(why) => self.add_other(&tick, version, &counts, span, &c.endpoint, why, 1),
            }
        }
        if let Some((why, sum, first, entries)) = full {
            self.add_other(&tick, version, &sum, span, first, why, entries);
        }
        refused
    }

    /// Why `endpoint` of `svc` is counted in `other` whatever room there is: a name too long,
    /// empty or holding a control character, or the `other` pair itself (noted as reported).
    fn bad_name(&self, svc: &ServiceSeries, endpoint: &str, now: Instant) -> Option<Overflow> {
        if &*svc.name == OTHER && endpoint == OTHER {
            let bucket = Tick::new(self.epoch, now).coarse;
            self.other_pair_reported
                .fetch_max(bucket.saturating_add(1), Ordering::Relaxed);
            return Some(Overflow::BadName);
        }
        (endpoint.is_empty()
            || endpoint.len() > MAX_NAME_LEN
            || retryplane_policy::diag::has_control(endpoint))
        .then_some(Overflow::BadName)
    }

    /// The series of `endpoint` in `svc`, made if the cap allows.
    fn resolve(
        &self,
        svc: &ServiceSeries,
        endpoint: &str,
        now: Instant,
    ) -> Result<Arc<Series>, Overflow> {
        if let Some(why) = self.bad_name(svc, endpoint, now) {
            return Err(why);
        }
        let mut endpoints = write(&svc.endpoints);
        if let Some(s) = endpoints.get(endpoint) {
            return Ok(s.clone());
        }
        if endpoints.len() >= self.max_per_service {
            if !svc.share_warned.swap(true, Ordering::Relaxed) {
                warn!(
                    service = %LogValue(&svc.name),
                    max_series_per_service = self.max_per_service,
                    endpoint = %LogValue(truncated(endpoint)),
                    "a service reports more endpoints than its share of metrics series: its \
                     further endpoints are counted in the \"other\" series (logged once per \
                     service; are its endpoint names made from URLs?)"
                );
            }
            return Err(Overflow::ServiceShare);
        }
        let max = self.max_series;
        self.series
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| Overflow::Cap)?;
        let series = Arc::new(Series::new(&svc.name, endpoint, now));
        endpoints.insert(endpoint.into(), series.clone());
        Ok(series)
    }

    /// Adds `counts`, the sum of `entries` endpoint entries of one report (the first of them
    /// `endpoint`), to the `other` series, counted as overflowed for `why`.
    #[allow(clippy::too_many_arguments)]
    fn add_other(
        &self,
        tick: &Tick,
        version: u64,
        counts: &Counts,
        span: Duration,
        endpoint: &str,
        why: Overflow,
        entries: u64,
    ) {
        self.other
            .add(tick, version, counts, span, self.add_settings(None));
        self.overflowed
            .of(why)
            .fetch_add(entries, Ordering::Relaxed);
        // The name comes from an agent: escaped, so a line break or an escape sequence in it
        // cannot forge a log line or drive a terminal.
        let endpoint = LogValue(truncated(endpoint));
        match why {
            Overflow::BadName if !self.bad_name_warned.swap(true, Ordering::Relaxed) => warn!(
                %endpoint,
                "a metrics report names a service or endpoint too long, with a control \
                 character, or the \"other\" series' own, or an empty endpoint: such reports \
                 are counted in the \"other\" series; a summary follows at most every minute"
            ),
            Overflow::Cap if !self.overflow_warned.swap(true, Ordering::Relaxed) => warn!(
                max_series = self.max_series,
                %endpoint,
                "metrics series cap reached: further reports are counted in the \"other\" \
                 series; a summary follows at most every minute"
            ),
            Overflow::BadName | Overflow::Cap | Overflow::ServiceShare => {}
        }
    }

    /// Every series matching `filter`, sorted by service then endpoint; `other` last when it
    /// has counts.
    fn matching(&self, filter: Filter<'_>) -> Vec<Arc<Series>> {
        let mut out = Vec::new();
        for (name, svc) in read(&self.services).iter() {
            if filter.service.is_some_and(|s| s != &**name) {
                continue;
            }
            for (endpoint, series) in read(&svc.endpoints).iter() {
                if filter.endpoint.is_none_or(|e| e == &**endpoint) {
                    out.push(series.clone());
                }
            }
        }
        out.sort_by(|a, b| (a.service(), a.endpoint()).cmp(&(b.service(), b.endpoint())));
        out
    }

    /// Whether `other` is to be listed under `filter`.
    fn other_listed(&self, filter: Filter<'_>) -> bool {
        self.overflowed_reports() > 0 && filter.matches(OTHER, OTHER)
    }

    /// Every series matching `filter` as of `now` (alerts re-evaluated), sorted by service
    /// then endpoint, with `other` last when anything overflowed.
    pub fn views(&self, now: Instant, filter: Filter<'_>) -> Vec<SeriesView> {
        let tick = Tick::new(self.epoch, now);
        let judges = self.judges(&tick);
        let published = self.published.load(Ordering::Relaxed);
        let mut views: Vec<SeriesView> = self
            .matching(filter)
            .iter()
            .map(|s| s.view(&tick, judges.of(s), published))
            .collect();
        if self.other_listed(filter) {
            views.push(self.other.view(&tick, judges.of(&self.other), published));
        }
        views
    }

    /// What each series' alert is judged against as of `tick`: its endpoint's threshold, and
    /// whether the endpoint over every calling service is past it ([`Judge`]).
    fn judges(&self, tick: &Tick) -> Judges<'_> {
        self.judges_of(tick, None)
    }

    /// [`Aggregator::judges`], for the series of the endpoints in `only` alone (every one when
    /// `None`): a Stats call for one service or endpoint sums only what it shows.
    fn judges_of(&self, tick: &Tick, only: Option<&HashSet<&str>>) -> Judges<'_> {
        let mut sums: HashMap<Box<str>, (u64, u64)> = HashMap::new();
        let mut add = |endpoint: &str, series: &Series| {
            let (calls, retries) = series.five_minutes(tick);
            if calls == 0 {
                return;
            }
            let sum = sums.entry(endpoint.into()).or_default();
            sum.0 = sum.0.saturating_add(calls);
            sum.1 = sum.1.saturating_add(retries);
        };
        for svc in read(&self.services).values() {
            let endpoints = read(&svc.endpoints);
            match only {
                Some(only) => {
                    for &endpoint in only {
                        if let Some(series) = endpoints.get(endpoint) {
                            add(endpoint, series);
                        }
                    }
                }
                None => {
                    for (endpoint, series) in endpoints.iter() {
                        add(endpoint, series);
                    }
                }
            }
        }
        sums.retain(|endpoint, (calls, retries)| {
            counts::ratio(*retries, *calls) > self.thresholds.get(endpoint)
        });
        Judges {
            agg: self,
            above: sums,
        }
    }

    /// The admin `Stats` answer as of `now`: every matching series.
    pub fn stats(&self, now: Instant, filter: Filter<'_>) -> pb::StatsResponse {
        self.stats_limited(now, filter, None, false)
    }

    /// The admin `Stats` answer as of `now`; with a `limit`, only its count of series, worst
    /// first (see [`Limit`]), and only the series kept are encoded; with `series_only`, no
    /// per-endpoint totals.
    pub fn stats_limited(
        &self,
        now: Instant,
        filter: Filter<'_>,
        limit: Option<Limit>,
        series_only: bool,
    ) -> pb::StatsResponse {
        let tick = Tick::new(self.epoch, now);
        let matching = self.matching(filter);
        // Alerts are judged (and so evaluated) only for the series shown; a call for one
        // service or endpoint sums the windows of those endpoints only.
        let narrowed = filter.service.is_some() || filter.endpoint.is_some();
        let shown: HashSet<&str> = if narrowed {
            matching.iter().map(|s| s.endpoint()).collect()
        } else {
            HashSet::new()
        };
        let judges = self.judges_of(&tick, narrowed.then_some(&shown));
        let mut series: Vec<&Series> = Vec::new();
        series.extend(matching.iter().map(AsRef::as_ref));
        if self.other_listed(filter) {
            series.push(&self.other);
        }
        let mut views: Vec<(&Series, SeriesView)> = series
            .into_iter()
            .map(|s| {
                (
                    s,
                    s.view(&tick, judges.of(s), self.published.load(Ordering::Relaxed)),
                )
            })
            .filter(|(_, view)| !filter.firing_only || view.alert.firing)
            .collect();
        let matched_series = views.len();
        let firing_series = views.iter().filter(|(_, v)| v.alert.firing).count();
        if let Some(limit) = limit {
            let w = WINDOWS
                .iter()
                .position(|&w| w == limit.window)
                .unwrap_or_default();
            views.sort_by(|(_, a), (_, b)| worst_first(a, b, w));
            views.truncate(limit.count);
        }
        let mut out = Vec::with_capacity(views.len());
        for (s, view) in views {
            out.push(pb::SeriesStats {
                service: view.service,
                endpoint: view.endpoint,
                policy_version: view.newest_version,
                lifetime: Some(view.lifetime.to_pb()),
                windows: WINDOWS
                    .iter()
                    .zip(view.windows.iter())
                    .map(|(&w, (counts, covered))| pb::WindowStats {
                        window_seconds: w.seconds(),
                        covered_seconds: *covered,
                        counters: Some(counts.to_pb()),
                    })
                    .collect(),
                versions: s.versions(&tick),
                alert: Some(view.alert.to_pb()),
            });
        }
        // Per endpoint over every service, as the message says: the service filter picks the
        // series listed, not what the totals cover.
        let every_service = Filter {
            service: None,
            ..filter
        };
        let mut endpoints: HashMap<String, Counts> = HashMap::new();
        let totals: Vec<Arc<Series>> = if series_only {
            Vec::new()
        } else {
            self.matching(every_service)
        };
        // Lifetime totals only: no alert of these series is judged here (some are not shown).
        // The `other` series is no endpoint's (a policy may well name one `other`): its counts
        // are in `series` and `overflowed_reports`.
        for s in totals.iter().map(AsRef::as_ref) {
            endpoints
                .entry(s.endpoint().to_owned())
                .or_default()
                .add(&s.lifetime());
        }
        let mut endpoints: Vec<pb::EndpointStats> = endpoints
            .into_iter()
            .map(|(e, c)| c.to_endpoint_stats(&e))
            .collect();
        endpoints.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        pb::StatsResponse {
            endpoints,
            series: out,
            max_series: u32::try_from(self.max_series).unwrap_or(u32::MAX),
            overflowed_reports: self.overflowed_reports(),
            overflowed_cap: self.overflowed_by(Overflow::Cap),
            overflowed_bad_name: self.overflowed_by(Overflow::BadName),
            overflowed_service_share: self.overflowed_by(Overflow::ServiceShare),
            max_series_per_service: u32::try_from(self.max_per_service).unwrap_or(u32::MAX),
            now_unix_ms: unix_ms(),
            matched_series: u32::try_from(matched_series).unwrap_or(u32::MAX),
            firing_series: u32::try_from(firing_series).unwrap_or(u32::MAX),
        }
    }

    /// Whether a service named `other` reported the endpoint `other` in a bucket the alert's
    /// window (five minutes) still holds at `now`.
    fn other_pair_in_window(&self, now: Instant) -> bool {
        let (_, buckets) = window::Window::FiveMinutes.buckets();
        match self.other_pair_reported.load(Ordering::Relaxed) {
            0 => false,
            at => Tick::new(self.epoch, now).coarse.saturating_sub(at - 1) < buckets,
        }
    }

    /// Those of the endpoints `names` that agents reported calls to in the five minutes
    /// before `now`: each with its calls over every service and the services that made them,
    /// sorted by name. (A change that removes one leaves those calls on the defaults.) While
    /// the `other` series had calls in those five minutes (the series cap or a service's
    /// share was reached, or a name was refused), the calls to a name not found in use by its
    /// own series (it has none, or an idle one: another service's calls may have gone to
    /// `other`) may be among them: each such name is listed too, marked
    /// ([`EndpointInUse::maybe_in_other`]).
    pub fn in_use(&self, now: Instant, names: &[&str]) -> Vec<EndpointInUse> {
        if names.is_empty() {
            return Vec::new();
        }
        let tick = Tick::new(self.epoch, now);
        let (in_other, _) = self.other.five_minutes(&tick);
        let mut found: HashMap<&str, EndpointInUse> = HashMap::new();
        for (service, svc) in read(&self.services).iter() {
            let endpoints = read(&svc.endpoints);
            for &name in names {
                let Some(series) = endpoints.get(name) else {
                    continue;
                };
                let (calls, _) = series.five_minutes(&tick);
                if calls == 0 {
                    continue;
                }
                let used = found.entry(name).or_insert_with(|| EndpointInUse {
                    endpoint: name.to_owned(),
                    calls: 0,
                    services: Vec::new(),
                    maybe_in_other: 0,
                });
                used.calls = used.calls.saturating_add(calls);
                used.services.push(service.to_string());
            }
        }
        let mut out: Vec<EndpointInUse> = Vec::new();
        if in_other > 0 {
            out.extend(
                names
                    .iter()
                    .filter(|name| !found.contains_key(**name))
                    .map(|name| EndpointInUse {
                        endpoint: (*name).to_owned(),
                        calls: 0,
                        services: Vec::new(),
                        maybe_in_other: in_other,
                    }),
            );
        }
        out.extend(found.into_values());
        for used in &mut out {
            used.services.sort();
        }
        out.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        out
    }

    /// Endpoints whose alert fires for at least one calling service, as of `now`, sorted. The
    /// overflow series (`other` / `other`) is no endpoint's and is left out (an endpoint named
    /// `other` is listed by its own series), unless a service named `other` reported an
    /// endpoint named `other`, which is counted there; its alert shows in Stats.
    pub fn alerting_endpoints(&self, now: Instant) -> Vec<String> {
        let tick = Tick::new(self.epoch, now);
        let judges = self.judges(&tick);
        let matching = self.matching(Filter::default());
        let overflow = std::iter::once(&self.other).filter(|_| self.other_pair_in_window(now));
        let mut out: Vec<String> = matching
            .iter()
            .map(AsRef::as_ref)
            .chain(overflow)
            .map(|s| s.view(&tick, judges.of(s), 0))
            .filter(|v| v.alert.firing)
            .map(|v| v.endpoint)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The background work at `now`: prunes versions, re-evaluates every alert (logging
    /// transitions) and logs the overflow summary when due. Returns the alerts that fire.
    pub fn tick(&self, now: Instant) -> usize {
        let tick = Tick::new(self.epoch, now);
        let judges = self.judges(&tick);
        let mut firing = 0;
        let all = self.matching(Filter::default());
        for s in all
            .iter()
            .map(AsRef::as_ref)
            .chain(std::iter::once(&self.other))
        {
            let Alert { firing: f, .. } = s.evaluate(&tick, judges.of(s));
            firing += usize::from(f);
        }
        drop(all);
        self.forget_silent(now);
        self.log_overflow(now);
        firing
    }

    /// Forgets the series silent for `forget_after` or more, and the services left with no
    /// series that no stream holds. A series is judged again under its service's write lock,
    /// which no report can be counting under, so one reported meanwhile stays.
    fn forget_silent(&self, now: Instant) {
        let after = self
            .forget_after
            .max(self.report_interval.saturating_mul(3));
        let services: Vec<Arc<ServiceSeries>> = read(&self.services).values().cloned().collect();
        let mut forgotten = 0;
        for svc in &services {
            let silent = |s: &Arc<Series>| s.silent_for(after, now);
            if !read(&svc.endpoints).values().any(silent) {
                continue;
            }
            let mut endpoints = write(&svc.endpoints);
            let before = endpoints.len();
            endpoints.retain(|_, s| !silent(s));
            forgotten += before - endpoints.len();
            if endpoints.len() < before / 2 {
                endpoints.shrink_to_fit();
            }
        }
        drop(services);
        if forgotten > 0 {
            self.series.fetch_sub(forgotten, Ordering::Relaxed);
            info!(
                series = forgotten,
                silent_for = %retryplane_policy::duration::format_duration(after),
                "forgot the metrics series no agent has reported for a while"
            );
        }
        // A service with no series left, whose handle no stream keeps (only the map holds it):
        // a stream that asks for it again makes it anew. Under the write lock, so no stream
        // takes a handle meanwhile.
        let idle = |svc: &Arc<ServiceSeries>| {
            Arc::strong_count(svc) == 1 && read(&svc.endpoints).is_empty()
        };
        if read(&self.services).values().any(idle) {
            write(&self.services).retain(|_, svc| !idle(svc));
        }
    }

    fn log_overflow(&self, now: Instant) {
        let total = self.overflowed_reports();
        let mut log = self
            .overflow_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if total > log.reports && now.duration_since(log.at) >= OVERFLOW_SUMMARY_EVERY {
            warn!(
                reports = total - log.reports,
                total,
                series_cap = self.overflowed_by(Overflow::Cap),
                bad_name = self.overflowed_by(Overflow::BadName),
                service_share = self.overflowed_by(Overflow::ServiceShare),
                seconds = now.duration_since(log.at).as_secs(),
                max_series = self.max_series,
                max_series_per_service = self.max_per_service,
                "endpoint reports counted in the \"other\" series since the last summary (totals by reason: past the series cap, a bad name, past the service's share)"
            );
            *log = OverflowLog {
                at: now,
                reports: total,
            };
        }
    }

    /// Bytes the aggregate holds, from the layout: every series (struct, names, version
    /// entries, retired buckets, its `Arc`) and the two levels of hash maps (buckets of a key
    /// `Box<str>`, an `Arc` and a control byte). Allocator overhead is not counted.
    pub fn approx_bytes(&self) -> usize {
        const ARC_COUNTS: usize = 2 * size_of::<usize>();
        let entry = size_of::<Box<str>>() + size_of::<Arc<Series>>() + 1;
        let services = read(&self.services);
        let mut bytes = size_of::<Self>() + services.capacity() * entry + self.other.heap_bytes();
        for (name, svc) in services.iter() {
            let endpoints = read(&svc.endpoints);
            bytes += 2 * name.len() + ARC_COUNTS + size_of::<ServiceSeries>();
            bytes += endpoints.capacity() * entry;
            for (key, series) in endpoints.iter() {
                bytes += key.len() + ARC_COUNTS + size_of::<Series>() + series.heap_bytes();
            }
        }
        bytes
    }
}

/// At most 64 bytes of a name, for a log line.
fn truncated(name: &str) -> &str {
    &name[..name.floor_char_boundary(64)]
}

/// Runs [`Aggregator::tick`] every `every` until `shutdown` turns true.
pub fn spawn_ticker(
    aggregator: Arc<Aggregator>,
    every: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                at = interval.tick() => {
                    aggregator.tick(at);
                }
                _ = shutdown.wait_for(|stop| *stop) => break,
            }
        }
    })
}

/// The longest span a report is taken to cover (its counts are spread over it): a day, the
/// longest over which its counts are checked for plausibility.
const MAX_REPORT_SPAN: Duration = counts::MAX_PLAUSIBLE_SPAN;

/// How late past the report interval a series' next report may come before its alert is judged
/// on an empty window ([`Judge::hold`]): agents' reports wait for their stream's turn.
const REPORT_SLACK: Duration = Duration::from_secs(10);

/// The endpoints past their threshold over every calling service, for [`Aggregator::judges`].
struct Judges<'a> {
    agg: &'a Aggregator,
    /// The endpoints above their threshold, summed over every calling service, with their
    /// (calls, retries).
    above: HashMap<Box<str>, (u64, u64)>,
}

impl Judges<'_> {
    /// What `series`' alert is judged against. `other` is never judged endpoint-wide: its
    /// counts are of many endpoints.
    fn of(&self, series: &Series) -> Judge {
        let endpoint = series.endpoint();
        // The `other` series is no endpoint's: the default threshold, whatever a policy's
        // endpoint named `other` sets.
        if std::ptr::eq(series, &self.agg.other) {
            return Judge {
                threshold: self.agg.thresholds.default_threshold(),
                endpoint_wide: false,
                endpoint_above: false,
                hold: self.agg.report_due(),
            };
        }
        Judge {
            threshold: self.agg.thresholds.get(endpoint),
            endpoint_wide: self
                .above
                .get(endpoint)
                .is_some_and(|(calls, _)| *calls >= series::MIN_ALERT_CALLS),
            endpoint_above: self.above.contains_key(endpoint),
            hold: self.agg.report_due(),
        }
    }
}

/// Endpoints of one report left out by [`Aggregator::ingest`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refused<'r> {
    /// How many.
    pub count: u64,
    /// Of those, how many named an endpoint already in the report.
    pub repeated: u64,
    /// The first one's name, as the agent sent it.
    pub first: Option<&'r str>,
}

/// The report's own `window_end - window_start`, uncapped (zero for an end at or before the
/// start); `None` when it gives no start. The plausibility bound takes a zero span as its
/// shortest one.
fn raw_span(report: &pb::MetricsReport) -> Option<Duration> {
    (report.window_start_unix_ms != 0).then(|| {
        Duration::from_millis(
            report
                .window_end_unix_ms
                .saturating_sub(report.window_start_unix_ms),
        )
    })
}

/// The time the counts of `report` were made over: its `window_end - window_start`, both from
/// the agent's clock (so clock skew between the agent and this server does not matter), at most
/// [`MAX_REPORT_SPAN`]. A report without a start (`0`, as a client that leaves it unset sends)
/// or with its end at or before its start covers no known time: `None`.
fn report_span(report: &pb::MetricsReport) -> Option<Duration> {
    raw_span(report)
        .filter(|span| !span.is_zero())
        .map(|span| span.min(MAX_REPORT_SPAN))
}
