//! Metrics reports sent and not yet acknowledged: what makes delivery exactly once.
//!
//! Each report taken from the counters gets the next `seq` (1, 2, 3… for the life of the agent
//! process, whose `Hello.instance_id` tells it apart from a restarted one) and stays here until
//! the control plane answers with a `MetricsAck` of that seq: `dropped = false` forgets it (it
//! is counted), `dropped = true` adds its counts back into the counters (the server refused it
//! and counted nothing; they go out in a later report). When a stream ends, whatever is still
//! here is sent again, same seqs and in seq order, right after the next stream's Hello and
//! before any new report; the server counts each seq once. At most [`WINDOW`] reports wait for
//! an answer: while that many do, no counts are taken, so they keep adding up in the counters
//! (whose memory is bounded by the number of endpoints) and nothing is lost.
//!
//! A report is at most [`MAX_REPORT_BYTES`] encoded: counts that would make a larger one (tens
//! of thousands of endpoints in one interval) go out as several reports, each numbered and kept
//! like any other, so that none is larger than the control plane decodes (a report it cannot
//! decode would end the stream, and the same report sent again would end the next one).
//!
//! Counts are reported under the policy version they were made under. When the policies are
//! replaced and their counts cannot go out at once (the window is full, the stream has no
//! room), they are held here as a report of their own, with its version and span, and go out
//! before any newer counts; so does a refused report of a version no longer in force. At most
//! [`HELD`] reports are held: past that the oldest one's counts go into the counters, to be
//! reported under the version in force then (kept, not lost, but credited to a later version;
//! that takes [`HELD`] swaps while the control plane acknowledges nothing, since counts of one
//! version held at different times join one report). The counts that
//! calls which outlived their policies made after the swap ([`Registry::outlived`]) are held
//! so too, as reports of those policies' versions, when the next report is taken.
//!
//! All of that only on a stream whose response says the control plane acknowledges reports
//! ([`retryplane_proto::METRICS_ACK_METADATA`]). A control plane that predates `MetricsAck`
//! never answers: there reports go out unnumbered (seq 0) and are not kept, and reports kept
//! from an earlier stream give their counts back to the counters for the next report, since
//! such a server would count a resent report again.

use std::collections::VecDeque;

use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::sync::mpsc;
use tracing::debug;

use super::message;
use crate::metrics::Registry;

/// Most reports sent and not yet acknowledged.
pub(crate) const WINDOW: usize = 8;

/// Largest report, encoded: a quarter of the largest message the control plane decodes
/// ([`retryplane_proto::MAX_MESSAGE_BYTES`]), so a report with its envelope is always inside
/// what an agent stream takes ([`retryplane_proto::MAX_AGENT_MESSAGE_BYTES`]).
pub(crate) const MAX_REPORT_BYTES: usize = retryplane_proto::MAX_MESSAGE_BYTES / 4;

/// Most reports held with the version they were made under (see the module's docs).
pub(crate) const HELD: usize = 16;

/// The unacknowledged reports, in seq order, and the next seq.
#[derive(Debug)]
pub(crate) struct Outbox {
    next_seq: u64,
    pending: VecDeque<pb::MetricsReport>,
    /// Reports of counts made under policies no longer in force, filled in (version and span)
    /// and not yet queued, oldest first: they go out before the counters' counts. One taken
    /// back from a refused report keeps its old seq until it is queued again (see
    /// [`Outbox::hold_report`]).
    held: VecDeque<pb::MetricsReport>,
    /// Set at shutdown ([`Outbox::closing`]): the window no longer holds reports back.
    closing: bool,
    /// The version and earliest start (Unix ms) of the reports whose counts were taken back
    /// into the counters ([`Outbox::take_back`]): the next report of the counters of that
    /// version starts there, not at the end of the refused one, so that a refused backlog is
    /// sent again over the time it was made in (the control plane spreads a report's counts by
    /// its span). When `Agent::set_policies` moved them from the counters to those of calls
    /// that outlived their version ([`Registry::retire`]), the report of those takes it.
    taken_back_from: Option<TakenBack>,
}

impl Default for Outbox {
    fn default() -> Self {
        Self {
            next_seq: 1,
            pending: VecDeque::with_capacity(WINDOW),
            held: VecDeque::new(),
            closing: false,
            taken_back_from: None,
        }
    }
}

/// Counts of `version` made from `from` (Unix ms) on were put back into the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TakenBack {
    version: u64,
    from: u64,
}

/// What [`Outbox::send_by`] queued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Queued {
    /// How many reports.
    pub(crate) count: usize,
    /// When the last of them found room: the close gives the control plane a grace from then
    /// to read it.
    pub(crate) last_at: Option<tokio::time::Instant>,
}

impl Queued {
    /// One more, queued now.
    fn one(&mut self) {
        self.count += 1;
        self.last_at = Some(tokio::time::Instant::now());
    }
}

/// Why a report was not queued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NotSent {
    /// Nothing to report.
    Empty,
    /// [`WINDOW`] reports wait for an answer; the counts stay in the counters.
    WindowFull,
    /// The stream could not take the report; its counts were added back.
    StreamFull,
}

impl Outbox {
    /// At shutdown, before the last report: from now on a report goes out even when the
    /// window is full, since no later report would carry the counts held back. It is kept like
    /// any other, and the control plane counts it once.
    pub(crate) fn closing(&mut self) {
        self.closing = true;
    }

    /// Whether [`WINDOW`] reports wait for an answer.
    pub(crate) fn is_full(&self) -> bool {
        self.pending.len() >= WINDOW
    }

    /// The reports waiting for an answer, oldest first.
    #[cfg(test)]
    pub(crate) fn pending_seqs(&self) -> Vec<u64> {
        self.pending.iter().map(|r| r.seq).collect()
    }

    /// The reports not acknowledged: queued or sent and not answered, and held.
    pub(crate) fn unacknowledged(&self) -> u64 {
        u64::try_from(self.pending.len() + self.held.len()).unwrap_or(u64::MAX)
    }

    /// The reports held with their versions, oldest first.
    #[cfg(test)]
    pub(crate) fn held_versions(&self) -> Vec<u64> {
        self.held.iter().map(|r| r.policy_version).collect()
    }

    /// Takes the counts from `registry` into a report (filled in by `fill`: window and policy
    /// version) and queues it on `tx`, after any held reports (which keep their own version and
    /// window; counts are taken only once every held report is queued). When `numbered` (the stream's control plane acknowledges
    /// reports), the report gets the next seq and is kept until acknowledged, and nothing is
    /// taken while the window is full; otherwise it goes out with seq 0, is not kept, and
    /// `Ok(0)` is returned. A report the stream cannot take is added back and uses no seq.
    ///
    /// Counts larger than [`MAX_REPORT_BYTES`] go out as several reports (in endpoint order),
    /// as many as the window and the stream take; the counts of the others are added back for
    /// a later report, with this report's start. Returns the seq of the last report queued
    /// once any part of the counters' counts is; an error when none is, though held reports
    /// may have been queued before it (the counters' counts then all wait).
    pub(crate) fn send(
        &mut self,
        registry: &Registry,
        tx: &mpsc::Sender<pb::AgentMessage>,
        numbered: bool,
        mut fill: impl FnMut(&mut pb::MetricsReport),
    ) -> Result<u64, NotSent> {
        // Held even while the window is full, within [`HELD`]: the outlived counters, one set
        // per version replaced, would otherwise pile up until it opens.
        self.hold_outlived(registry, &mut fill);
        if numbered && self.is_full() && !self.closing {
            return Err(NotSent::WindowFull);
        }
        let mut last_held = None;
        while let Some(report) = self.held.pop_front() {
            let room = !(numbered && self.is_full() && !self.closing);
            let not_sent = match tx.try_reserve() {
                Ok(permit) if room => {
                    last_held = Some(self.queue_report(permit, numbered, report));
                    continue;
                }
                Ok(_) => NotSent::WindowFull,
                Err(_) => NotSent::StreamFull,
            };
            self.held.push_front(report);
            return Err(not_sent);
        }
        let endpoints = registry.take();
        if endpoints.is_empty() {
            return last_held.ok_or(NotSent::Empty);
        }
        let mut fill = self.with_taken_back(fill);
        // Ok once any part of the counters' counts is queued: the rest wait for a later report.
        let mut sent = None;
        let mut parts = split(endpoints, MAX_REPORT_BYTES).into_iter();
        while let Some(part) = parts.next() {
            let room = !(numbered && self.is_full() && !self.closing);
            let not_sent = match tx.try_reserve() {
                Ok(permit) if room => {
                    sent = Some(self.queue(permit, numbered, part, &mut fill));
                    continue;
                }
                Ok(_) => NotSent::WindowFull,
                Err(_) => NotSent::StreamFull,
            };
            give_back(registry, &part, parts);
            if sent.is_some() {
                // Queued in part: the caller's next report starts where this one ends, but
                // what waits was made from this one's start.
                let mut report = pb::MetricsReport::default();
                fill.fill(&mut report);
                self.taken_back(Some(TakenBack {
                    version: report.policy_version,
                    from: report.window_start_unix_ms,
                }));
            } else {
                self.taken_back(fill.from);
            }
            return sent.ok_or(not_sent);
        }
        sent.ok_or(NotSent::Empty)
    }

    /// [`Outbox::send`] at shutdown (after [`Outbox::closing`]): each report (each part of
    /// counts too large for one) waits for room on `tx` until `deadline`; the counts of those
    /// that find none by then are added back. What was queued.
    ///
    /// `fill()` makes a report's `fill`, reading the version in force as it is made; `steady`
    /// runs what it is given with no swap of the policies in between (`Shared::between_swaps`).
    /// The version is read as the counters are taken, after the wait for room for the reports
    /// held before, and the counts of calls that outlived their version are taken again then:
    /// `Agent::set_policies` during that wait moves the version's counts there and puts its own
    /// in force.
    pub(crate) async fn send_by<F: FnMut(&mut pb::MetricsReport)>(
        &mut self,
        registry: &Registry,
        tx: &mpsc::Sender<pb::AgentMessage>,
        numbered: bool,
        deadline: tokio::time::Instant,
        steady: impl Fn(&mut dyn FnMut()),
        fill: impl Fn() -> F,
    ) -> Queued {
        let mut queued = Queued::default();
        steady(&mut || self.hold_outlived(registry, &mut fill()));
        if !self.send_held_by(tx, numbered, deadline, &mut queued).await {
            return queued;
        }
        let mut taken = None;
        steady(&mut || {
            self.hold_outlived(registry, &mut fill());
            taken = Some((registry.take(), fill()));
        });
        let Some((endpoints, fill)) = taken else {
            return queued;
        };
        if !self.send_held_by(tx, numbered, deadline, &mut queued).await {
            registry.restore(&endpoints);
            return queued;
        }
        if endpoints.is_empty() {
            return queued;
        }
        let mut fill = self.with_taken_back(fill);
        let mut parts = split(endpoints, MAX_REPORT_BYTES).into_iter();
        while let Some(part) = parts.next() {
            // A permit, not a send: a wait given up loses nothing.
            let Ok(Ok(permit)) = tokio::time::timeout_at(deadline, tx.reserve()).await else {
                give_back(registry, &part, parts);
                self.taken_back(fill.from);
                return queued;
            };
            self.queue(permit, numbered, part, &mut fill);
            queued.one();
        }
        queued
    }

    /// Queues the held reports, each waiting for room on `tx` until `deadline`, counting them
    /// in `queued`; `false` when one found none (it and those after it stay held).
    async fn send_held_by(
        &mut self,
        tx: &mpsc::Sender<pb::AgentMessage>,
        numbered: bool,
        deadline: tokio::time::Instant,
        queued: &mut Queued,
    ) -> bool {
        while let Some(report) = self.held.pop_front() {
            let Ok(Ok(permit)) = tokio::time::timeout_at(deadline, tx.reserve()).await else {
                self.held.push_front(report);
                return false;
            };
            self.queue_report(permit, numbered, report);
            queued.one();
        }
        true
    }

    /// Takes the counts from `registry` and holds them as reports filled in by `fill` (the
    /// version they were made under and their window), to go out before any later counts: for
    /// counts that could not go out as their policies were replaced.
    pub(crate) fn hold(&mut self, registry: &Registry, fill: impl FnMut(&mut pb::MetricsReport)) {
        let mut fill = self.with_taken_back(fill);
        for endpoints in split(registry.take(), MAX_REPORT_BYTES) {
            let mut report = pb::MetricsReport {
                endpoints,
                ..Default::default()
            };
            fill.fill(&mut report);
            report.seq = 0;
            self.hold_report(registry, report);
        }
    }

    /// `fill` for a report of the counters' counts, made to start no later than the counts
    /// taken back into them (see [`Outbox::taken_back_from`]), which it takes.
    fn with_taken_back<F: FnMut(&mut pb::MetricsReport)>(&mut self, fill: F) -> FromTakenBack<F> {
        FromTakenBack {
            fill,
            from: self.taken_back_from.take(),
        }
    }

    /// Counts of `back.version` made from `back.from` (Unix ms) on were put back into the
    /// counters. Only one version's at a time: those of a version replaced since went out
    /// with its last report (or are held), which took this.
    fn taken_back(&mut self, back: Option<TakenBack>) {
        let Some(back) = back.filter(|b| b.from > 0) else {
            return;
        };
        self.taken_back_from = Some(match self.taken_back_from {
            Some(t) if t.version == back.version => TakenBack {
                version: back.version,
                from: t.from.min(back.from),
            },
            _ => back,
        });
    }

    /// Takes the counts of calls that outlived the policies they ran on
    /// ([`Registry::take_outlived`]) and holds them as reports of those policies' versions
    /// (filled in by `fill`, their version put back), to go out before the counters' counts.
    fn hold_outlived(
        &mut self,
        registry: &Registry,
        fill: &mut impl FnMut(&mut pb::MetricsReport),
    ) {
        for (version, endpoints) in registry.take_outlived() {
            // Counts taken back from a refused report of this version and then moved here by
            // `Agent::set_policies` ([`Registry::retire`]): made over the refused one's span.
            let from = match self.taken_back_from {
                Some(back) if back.version == version => {
                    self.taken_back_from = None;
                    Some(back.from)
                }
                _ => None,
            };
            for endpoints in split(endpoints, MAX_REPORT_BYTES) {
                let mut report = pb::MetricsReport {
                    endpoints,
                    ..Default::default()
                };
                fill(&mut report);
                report.policy_version = version;
                report.seq = 0;
                if let Some(from) = from {
                    report.window_start_unix_ms = match report.window_start_unix_ms {
                        0 => from,
                        start => start.min(from),
                    };
                }
                self.hold_report(registry, report);
            }
        }
    }

    /// Holds `report` (filled in) in the order its counts were taken: one taken back from a
    /// report sent before (its seq kept until it is queued again) before any held since, in
    /// seq order (whatever was held before it was sent went out before it: held reports go
    /// first, oldest first); one taken from the counters now (seq 0) after all. Past
    /// [`HELD`], the oldest held report's counts go into `registry`.
    ///
    /// A report taken from the counters now joins a held one of the same version taken so
    /// too, when the two fit in one report: calls that outlived a version go on counting
    /// under it at every report while the window is full, and one held report each would
    /// push the counts held at the swap out of [`HELD`] within [`HELD`] intervals.
    fn hold_report(&mut self, registry: &Registry, report: pb::MetricsReport) {
        let report = match self.join_held(report) {
            Ok(()) => return,
            Err(report) => report,
        };
        let at = if report.seq == 0 {
            self.held.len()
        } else {
            self.held
                .iter()
                .position(|h| h.seq == 0 || h.seq > report.seq)
                .unwrap_or(self.held.len())
        };
        self.held.insert(at, report);
        while self.held.len() > HELD {
            // The oldest version's (the first of them): a late count of a version evicted
            // before (a call that outlived it) goes into the counters itself, not pushing a
            // newer version's counts there. Pushed versions only go up; version 0 (the
            // program's own policies, or the fallback) is as old as the pushed one held
            // before it.
            let mut before = 0;
            let ages: Vec<u64> = self
                .held
                .iter()
                .map(|h| {
                    if h.policy_version != 0 {
                        before = h.policy_version;
                    }
                    before
                })
                .collect();
            let oldest = ages
                .iter()
                .enumerate()
                .min_by_key(|&(_, age)| age)
                .map_or(0, |(i, _)| i);
            if let Some(oldest) = self.held.remove(oldest) {
                debug!(
                    version = oldest.policy_version,
                    "too many metrics reports held; the oldest one's counts go into the next report"
                );
                registry.restore(&oldest.endpoints);
            }
        }
    }

    /// Adds `report` (taken from the counters now: seq 0) to the newest held report of its
    /// version taken so too, spanning both, when the sum fits in [`MAX_REPORT_BYTES`];
    /// `report` back otherwise.
    fn join_held(&mut self, report: pb::MetricsReport) -> Result<(), pb::MetricsReport> {
        if report.seq != 0 {
            return Err(report);
        }
        let Some(held) = self
            .held
            .iter_mut()
            .rev()
            .find(|h| h.seq == 0 && h.policy_version == report.policy_version)
        else {
            return Err(report);
        };
        let endpoints = crate::metrics::summed(&held.endpoints, &report.endpoints);
        let size: usize = endpoints
            .iter()
            .map(|e| prost::encoding::message::encoded_len(4, e))
            .sum();
        if size > MAX_REPORT_BYTES {
            return Err(report);
        }
        held.endpoints = endpoints;
        // A start of 0 is no start (a wall clock near 1970): the other's stands.
        held.window_start_unix_ms = match (held.window_start_unix_ms, report.window_start_unix_ms) {
            (0, start) | (start, 0) => start,
            (a, b) => a.min(b),
        };
        held.window_end_unix_ms = held.window_end_unix_ms.max(report.window_end_unix_ms);
        Ok(())
    }

    /// Counts taken back from a report that was not counted: into `registry` when they were
    /// made under the version in force (`current`), else held under their own.
    fn take_back(&mut self, registry: &Registry, report: pb::MetricsReport, current: u64) {
        if report.policy_version == current {
            registry.restore(&report.endpoints);
            self.taken_back(Some(TakenBack {
                version: report.policy_version,
                from: report.window_start_unix_ms,
            }));
        } else {
            self.hold_report(registry, report);
        }
    }

    /// Queues a report of `endpoints` in the room `permit` holds on the stream: numbered and
    /// kept until acknowledged when `numbered`. Its seq (0 when not numbered).
    fn queue<F: FnMut(&mut pb::MetricsReport)>(
        &mut self,
        permit: mpsc::Permit<'_, pb::AgentMessage>,
        numbered: bool,
        endpoints: Vec<pb::EndpointCounters>,
        fill: &mut FromTakenBack<F>,
    ) -> u64 {
        let mut report = pb::MetricsReport {
            endpoints,
            ..Default::default()
        };
        fill.fill(&mut report);
        self.queue_report(permit, numbered, report)
    }

    /// Queues `report` (filled in) in the room `permit` holds on the stream, numbered and kept
    /// until acknowledged when `numbered`. Its seq (0 when not numbered).
    fn queue_report(
        &mut self,
        permit: mpsc::Permit<'_, pb::AgentMessage>,
        numbered: bool,
        mut report: pb::MetricsReport,
    ) -> u64 {
        report.seq = if numbered { self.next_seq } else { 0 };
        let seq = report.seq;
        if numbered {
            self.next_seq += 1;
            self.pending.push_back(report.clone());
        }
        permit.send(message(Kind::Metrics(report)));
        seq
    }

    /// The control plane answered report `seq`: forget it, and when it was `dropped` take its
    /// counts back: into `registry` when they were made under the version in force
    /// (`current`), else held under theirs. An answer to a seq not waiting (answered already,
    /// or never sent) changes nothing.
    pub(crate) fn ack(&mut self, registry: &Registry, seq: u64, dropped: bool, current: u64) {
        let Some(i) = self.pending.iter().position(|r| r.seq == seq) else {
            debug!(seq, "metrics ack for no pending report ignored");
            return;
        };
        if let Some(report) = self.pending.remove(i)
            && dropped
        {
            debug!(
                seq,
                "metrics report refused by the control plane; counts kept"
            );
            self.take_back(registry, report, current);
        }
    }

    /// On a stream to a control plane that does not acknowledge reports: forgets every waiting
    /// report and takes its counts back (into `registry`, or held under their version when
    /// that is not `current`), to go out in the next (unnumbered) reports. Whether the earlier
    /// control plane counted them is unknown; this one would count a resent report every time,
    /// so they are counted again at most once.
    pub(crate) fn give_back(&mut self, registry: &Registry, current: u64) {
        let pending = std::mem::take(&mut self.pending);
        for report in pending {
            self.take_back(registry, report, current);
        }
    }

    /// Queues every waiting report on a new stream's `tx`, in seq order. `tx` is fresh and
    /// holds at least `WINDOW + 1` messages (Hello and these), so this fails only when the
    /// stream is already gone; what was not queued is sent on the next stream.
    pub(crate) fn resend(&self, tx: &mpsc::Sender<pb::AgentMessage>) -> bool {
        for report in &self.pending {
            if tx.try_send(message(Kind::Metrics(report.clone()))).is_err() {
                return false;
            }
        }
        true
    }
}

/// A report's `fill`, and the earliest start of the counts taken back into the counters that
/// the report carries.
struct FromTakenBack<F> {
    fill: F,
    from: Option<TakenBack>,
}

impl<F: FnMut(&mut pb::MetricsReport)> FromTakenBack<F> {
    /// `fill`, then the start of the counts taken back when the report is of their version.
    fn fill(&mut self, report: &mut pb::MetricsReport) {
        (self.fill)(report);
        // A start of 0 is no start (a wall clock near 1970): the counts taken back keep theirs.
        if let Some(back) = self.from
            && back.version == report.policy_version
            && (report.window_start_unix_ms == 0 || back.from < report.window_start_unix_ms)
        {
            report.window_start_unix_ms = back.from;
        }
    }
}

/// `endpoints` in order, cut into parts whose encoded size in a report is at most `max` bytes
/// (an endpoint larger than that alone makes a part).
fn split(endpoints: Vec<pb::EndpointCounters>, max: usize) -> Vec<Vec<pb::EndpointCounters>> {
    let mut parts = Vec::with_capacity(1);
    let mut part = Vec::new();
    let mut size = 0;
    for e in endpoints {
        // As a `MetricsReport.endpoints` entry (field 4): tag, length and message.
        let len = prost::encoding::message::encoded_len(4, &e);
        if !part.is_empty() && size + len > max {
            parts.push(std::mem::take(&mut part));
            size = 0;
        }
        size += len;
        part.push(e);
    }
    if !part.is_empty() {
        parts.push(part);
    }
    parts
}

/// Adds the counts of `part` and of the `rest` not sent back into `registry`.
fn give_back(
    registry: &Registry,
    part: &[pb::EndpointCounters],
    rest: impl Iterator<Item = Vec<pb::EndpointCounters>>,
) {
    registry.restore(part);
    for rest in rest {
        registry.restore(&rest);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::metrics::Counters;

    fn count_calls(r: &Registry, n: u64) {
        let c = r.counters(&Arc::from("a"));
        for _ in 0..n {
            Counters::inc(&c.calls);
        }
    }

    /// Counts `n` calls on each of `endpoints` endpoints with names of 250 bytes.
    fn count_many(r: &Registry, endpoints: usize, n: u64) {
        for i in 0..endpoints {
            let c = r.counters(&Arc::from(format!("{i:0>250}").as_str()));
            for _ in 0..n {
                Counters::inc(&c.calls);
            }
        }
    }

    /// The counters of calls on endpoint "a" that outlived `version`.
    fn outlived_a(r: &Registry, version: u64) -> Arc<Counters> {
        r.outlived(version, &Arc::from("a"))
    }

    /// Counts `n` calls on endpoint "a" that outlived `version` (and ended).
    fn count_outlived_calls(r: &Registry, version: u64, n: u64) {
        let c = outlived_a(r, version);
        for _ in 0..n {
            Counters::inc(&c.calls);
        }
    }

    type Tx = mpsc::Sender<pb::AgentMessage>;
    type Rx = mpsc::Receiver<pb::AgentMessage>;

    /// Counters and an empty outbox.
    fn outbox() -> (Registry, Outbox) {
        (Registry::default(), Outbox::default())
    }

    /// Counters, an empty outbox and a stream with room for `room` messages.
    fn set_up(room: usize) -> (Registry, Outbox, Tx, Rx) {
        let (r, o) = outbox();
        let (tx, rx) = mpsc::channel(room);
        (r, o, tx, rx)
    }

    /// A stream of room for one message, taken by a keepalive.
    fn full_stream() -> (Tx, Rx) {
        let (tx, rx) = mpsc::channel(1);
        tx.try_send(message(Kind::Keepalive(pb::Keepalive {})))
            .unwrap();
        (tx, rx)
    }

    /// A stream (of room for `room` messages) that is already gone.
    fn gone_stream(room: usize) -> Tx {
        let (tx, rx) = mpsc::channel(room);
        drop(rx);
        tx
    }

    fn no_fill(_: &mut pb::MetricsReport) {}

    /// A `fill` that says `version`.
    fn under(version: u64) -> impl FnMut(&mut pb::MetricsReport) {
        move |r| r.policy_version = version
    }

    /// A report's `fill`: `version`, from `start` to `end`.
    fn span_of(version: u64, start: u64, end: u64) -> impl FnMut(&mut pb::MetricsReport) {
        move |r| {
            r.policy_version = version;
            r.window_start_unix_ms = start;
            r.window_end_unix_ms = end;
        }
    }

    /// For each of `seqs`, one call counted and sent in a numbered report filled in by
    /// `fill(seq)`, which gets that seq.
    fn send_one_call_each<F: FnMut(&mut pb::MetricsReport)>(
        r: &Registry,
        o: &mut Outbox,
        tx: &Tx,
        seqs: impl IntoIterator<Item = u64>,
        fill: impl Fn(u64) -> F,
    ) {
        for seq in seqs {
            count_calls(r, 1);
            assert_eq!(o.send(r, tx, true, fill(seq)), Ok(seq));
        }
    }

    /// The policies are replaced while the window is full (`send_or_hold`): the report of the
    /// version replaced (filled in by `fill()`) is not sent and its counts are held.
    fn swap_with_the_window_full<F: FnMut(&mut pb::MetricsReport)>(
        r: &Registry,
        o: &mut Outbox,
        tx: &Tx,
        fill: impl Fn() -> F,
    ) {
        assert_eq!(o.send(r, tx, true, fill()), Err(NotSent::WindowFull));
        o.hold(r, fill());
    }

    /// `n` calls counted and sent in the first report (seq 1), filled in by `fill`, which the
    /// control plane refuses (`dropped`) while `current` is in force.
    fn refuse_the_first_report_of(
        r: &Registry,
        o: &mut Outbox,
        tx: &Tx,
        rx: &mut Rx,
        n: u64,
        fill: impl FnMut(&mut pb::MetricsReport),
        current: u64,
    ) {
        count_calls(r, n);
        assert_eq!(o.send(r, tx, true, fill), Ok(1));
        let _ = reports_on(rx);
        o.ack(r, 1, true, current);
    }

    /// The metrics reports queued on `rx`.
    fn reports_on(rx: &mut Rx) -> Vec<pb::MetricsReport> {
        let mut out = Vec::new();
        while let Ok(m) = rx.try_recv() {
            let Some(Kind::Metrics(r)) = m.kind else {
                panic!("a metrics report");
            };
            out.push(r);
        }
        out
    }

    /// The reports of `version` queued on `rx` (the others are taken too).
    fn reports_of(rx: &mut Rx, version: u64) -> Vec<pb::MetricsReport> {
        reports_on(rx)
            .into_iter()
            .filter(|r| r.policy_version == version)
            .collect()
    }

    /// The reports queued on `rx`: (seq, calls).
    fn sent(rx: &mut Rx) -> Vec<(u64, u64)> {
        reports_on(rx)
            .iter()
            .map(|r| (r.seq, r.endpoints[0].calls))
            .collect()
    }

    /// The reports queued on `rx`: (seq, version, calls).
    fn sent_with_versions(rx: &mut Rx) -> Vec<(u64, u64, u64)> {
        reports_on(rx)
            .iter()
            .map(|r| (r.seq, r.policy_version, r.endpoints[0].calls))
            .collect()
    }

    fn calls_of(endpoints: &[pb::EndpointCounters]) -> u64 {
        endpoints.iter().map(|e| e.calls).sum()
    }

    fn calls_in(reports: &[pb::MetricsReport]) -> u64 {
        reports.iter().map(|r| calls_of(&r.endpoints)).sum()
    }

    /// The size of `report`'s endpoints, encoded (what [`MAX_REPORT_BYTES`] bounds).
    fn encoded_size(report: &pb::MetricsReport) -> usize {
        report
            .endpoints
            .iter()
            .map(|e| prost::encoding::message::encoded_len(4, e))
            .sum()
    }

    #[test]
    fn counts_held_at_a_full_window_go_out_under_their_version_before_later_counts() {
        let (r, mut o, tx, mut rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |_| under(1));
        count_calls(&r, 5);
        // Version 2 replaces version 1 while the window is full.
        swap_with_the_window_full(&r, &mut o, &tx, || under(1));
        assert_eq!(o.held_versions(), [1]);
        assert_eq!(r.pending("a").calls, 0, "held, not left in the counters");
        count_calls(&r, 7);
        sent_with_versions(&mut rx);
        assert_eq!(o.send(&r, &tx, true, under(2)), Err(NotSent::WindowFull));
        o.ack(&r, 1, false, 2);
        // One place: the held report takes it; the counts made under version 2 wait.
        assert_eq!(o.send(&r, &tx, true, under(2)), Err(NotSent::WindowFull));
        assert_eq!(sent_with_versions(&mut rx), [(9, 1, 5)]);
        o.ack(&r, 2, false, 2);
        assert_eq!(o.send(&r, &tx, true, under(2)), Ok(10));
        assert_eq!(sent_with_versions(&mut rx), [(10, 2, 7)]);
        assert!(o.held_versions().is_empty());
    }

    #[tokio::test]
    async fn counts_of_calls_that_outlived_their_version_go_out_under_it_before_the_counters() {
        let (r, mut o, tx, mut rx) = set_up(64);
        count_calls(&r, 4);
        let call_on_1 = outlived_a(&r, 1);
        Counters::inc(&call_on_1.calls);
        count_outlived_calls(&r, 2, 2);
        assert_eq!(o.send(&r, &tx, true, under(3)), Ok(3));
        assert_eq!(
            sent_with_versions(&mut rx),
            [(1, 1, 1), (2, 2, 2), (3, 3, 4)],
            "oldest version first, each its own report, then the counters under the version in force"
        );
        // The call still running on version 1 counts again: out in the next report, under 1.
        Counters::inc(&call_on_1.calls);
        drop(call_on_1);
        assert_eq!(o.send(&r, &tx, true, under(3)), Ok(4));
        assert_eq!(sent_with_versions(&mut rx), [(4, 1, 1)]);
        // At shutdown too.
        count_outlived_calls(&r, 2, 1);
        o.closing();
        let deadline = tokio::time::Instant::now();
        let queued = o
            .send_by(&r, &tx, true, deadline, |f| f(), || under(3))
            .await;
        assert_eq!(queued.count, 1);
        assert_eq!(sent_with_versions(&mut rx), [(5, 2, 1)]);
    }

    #[test]
    fn while_the_window_is_full_the_counts_of_calls_that_outlived_their_versions_take_bounded_memory()
     {
        let (r, mut o, tx, _rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |_| under(1));
        // The control plane acknowledges nothing and pushes 1,000 versions; at each, a call
        // still on the version replaced counts once more (its give-up, say) and ends.
        for version in 1..=1_000 {
            Counters::inc(&outlived_a(&r, version).gave_up_attempts);
            // The swap to `version + 1` (`send_or_hold`).
            swap_with_the_window_full(&r, &mut o, &tx, || under(version));
        }
        assert!(o.held_versions().len() <= HELD, "held reports are bounded");
        // No call holds any of them; yet every version's counters are kept until the window
        // opens: memory grows with the number of swaps, not bounded by HELD or the endpoints.
        let kept = r.take_outlived().len();
        assert!(
            kept <= HELD,
            "{kept} versions' counters of calls that outlived them are kept while the window is full"
        );
    }

    #[test]
    fn a_refused_report_of_an_earlier_version_goes_out_again_under_it() {
        let (r, mut o, tx, mut rx) = set_up(16);
        count_calls(&r, 3);
        assert_eq!(o.send(&r, &tx, true, under(1)), Ok(1));
        count_calls(&r, 4);
        assert_eq!(o.send(&r, &tx, true, under(2)), Ok(2));
        sent_with_versions(&mut rx);
        // Both refused once version 2 is in force: version 1's counts are held under it,
        // version 2's go back into the counters.
        o.ack(&r, 1, true, 2);
        o.ack(&r, 2, true, 2);
        assert_eq!(o.held_versions(), [1]);
        assert_eq!(r.pending("a").calls, 4);
        assert_eq!(o.send(&r, &tx, true, under(2)), Ok(4));
        assert_eq!(sent_with_versions(&mut rx), [(3, 1, 3), (4, 2, 4)]);
    }

    #[test]
    fn reports_given_back_keep_their_version_when_it_is_no_longer_in_force() {
        let (r, mut o, tx, mut rx) = set_up(16);
        count_calls(&r, 3);
        o.send(&r, &tx, true, under(1)).unwrap();
        count_calls(&r, 4);
        o.send(&r, &tx, true, under(2)).unwrap();
        sent_with_versions(&mut rx);
        // The next control plane does not acknowledge reports; version 2 is in force.
        o.give_back(&r, 2);
        assert_eq!(o.send(&r, &tx, false, under(2)), Ok(0));
        assert_eq!(sent_with_versions(&mut rx), [(0, 1, 3), (0, 2, 4)]);
    }

    #[test]
    fn past_the_most_held_the_oldest_counts_go_into_the_counters_not_lost() {
        let (r, mut o) = outbox();
        for version in 1..=HELD as u64 + 2 {
            count_calls(&r, version);
            o.hold(&r, under(version));
        }
        let held = o.held_versions();
        assert_eq!(held.len(), HELD);
        assert_eq!(held[0], 3, "{held:?}");
        // Version 1's counts went into the counters, then out with version 18's held report;
        // version 2's are in the counters.
        assert_eq!(r.pending("a").calls, 2);
        let (tx, mut rx) = mpsc::channel(64);
        let mut total = 0;
        while o.send(&r, &tx, false, under(100)).is_ok() {
            for (_, _, calls) in sent_with_versions(&mut rx) {
                total += calls;
            }
        }
        let made: u64 = (1..=HELD as u64 + 2).sum();
        assert_eq!(total, made, "every count went out once");
    }

    /// The module's docs: held reports go out "before any newer counts", oldest first. A held
    /// report sent and then refused goes back behind the reports held after it, and so its
    /// counts (version 1's) go out after version 2's, and are the first to go into the
    /// counters past [`HELD`] no longer as the oldest.
    #[test]
    fn a_refused_held_report_goes_out_again_before_the_later_versions_held_after_it() {
        let (r, mut o, tx, mut rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |_| under(1));
        // Version 2 replaces version 1, then version 3 version 2, the window full each time.
        count_calls(&r, 5);
        o.hold(&r, under(1));
        count_calls(&r, 7);
        o.hold(&r, under(2));
        assert_eq!(o.held_versions(), [1, 2]);
        sent_with_versions(&mut rx);
        // One place: version 1's held report takes it (seq 9); refused once version 3 is in
        // force.
        o.ack(&r, 1, false, 3);
        assert_eq!(o.send(&r, &tx, true, under(3)), Err(NotSent::WindowFull));
        assert_eq!(sent_with_versions(&mut rx), [(9, 1, 5)]);
        o.ack(&r, 9, true, 3);
        assert_eq!(
            o.held_versions(),
            [1, 2],
            "version 1's counts were made before version 2's: still held first"
        );
        for seq in 2..=WINDOW as u64 {
            o.ack(&r, seq, false, 3);
        }
        o.send(&r, &tx, true, under(3)).unwrap();
        let versions: Vec<u64> = sent_with_versions(&mut rx).iter().map(|s| s.1).collect();
        assert_eq!(versions, [1, 2], "oldest first");
    }

    #[test]
    fn reports_refused_in_any_order_are_held_in_the_order_they_were_sent_before_later_ones() {
        let (r, mut o, tx, mut rx) = set_up(64);
        count_calls(&r, 1);
        o.hold(&r, under(1));
        count_calls(&r, 2);
        o.hold(&r, under(2));
        assert_eq!(o.send(&r, &tx, true, under(3)), Ok(2));
        assert_eq!(sent_with_versions(&mut rx), [(1, 1, 1), (2, 2, 2)]);
        count_calls(&r, 4);
        o.hold(&r, under(3));
        // Refused last first, once version 4 is in force.
        o.ack(&r, 2, true, 4);
        o.ack(&r, 1, true, 4);
        assert_eq!(o.held_versions(), [1, 2, 3]);
        assert_eq!(o.send(&r, &tx, true, under(4)), Ok(5));
        assert_eq!(
            sent_with_versions(&mut rx),
            [(3, 1, 1), (4, 2, 2), (5, 3, 4)]
        );
    }

    /// Every count made goes out exactly once, under the version it was made under, through
    /// random runs of calls, reports, swaps (as `send_or_hold` does them), acks, refusals
    /// (`dropped`), a stream without room, and streams lost and opened again to a control
    /// plane that acknowledges (resending what waits), with fewer swaps than [`HELD`].
    #[test]
    fn through_swaps_refusals_and_lost_streams_every_count_is_credited_once_to_its_version() {
        use std::collections::{BTreeMap, HashSet};
        for run in 0..300u64 {
            let mut rng = run.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let (r, mut o, mut tx, mut rx) = set_up(3);
            let mut version = 1;
            let mut made: BTreeMap<u64, u64> = BTreeMap::new();
            let mut credited: BTreeMap<u64, u64> = BTreeMap::new();
            // The control plane: seqs it counted, and its answers not yet read by the agent.
            let mut counted: HashSet<u64> = HashSet::new();
            let mut answers: Vec<(u64, bool)> = Vec::new();
            let mut log = Vec::new();
            let read = |rx: &mut mpsc::Receiver<pb::AgentMessage>,
                        answers: &mut Vec<(u64, bool)>,
                        counted: &mut HashSet<u64>,
                        credited: &mut BTreeMap<u64, u64>,
                        drop_one_in: u64| {
                while let Ok(m) = rx.try_recv() {
                    let Some(Kind::Metrics(report)) = m.kind else {
                        continue;
                    };
                    let calls: u64 = report.endpoints.iter().map(|e| e.calls).sum();
                    if counted.contains(&report.seq) {
                        answers.push((report.seq, false));
                    } else if drop_one_in > 0 && next_drop(report.seq, drop_one_in) {
                        answers.push((report.seq, true));
                    } else {
                        counted.insert(report.seq);
                        *credited.entry(report.policy_version).or_default() += calls;
                        answers.push((report.seq, false));
                    }
                }
            };
            fn next_drop(seq: u64, one_in: u64) -> bool {
                seq.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 60 < 16 / one_in
            }
            let mut swaps = 0;
            for _ in 0..200 {
                match next(9) {
                    0 | 1 => {
                        let n = 1 + next(5);
                        count_calls(&r, n);
                        *made.entry(version).or_default() += n;
                        log.push(format!("count {n} v{version}"));
                    }
                    2 => {
                        let s = o.send(&r, &tx, true, under(version));
                        log.push(format!("send {s:?}"));
                    }
                    3 if swaps < HELD as u64 - 2 => {
                        let s = o.send(&r, &tx, true, under(version));
                        o.hold(&r, under(version));
                        version += 1;
                        swaps += 1;
                        log.push(format!("swap to v{version} (send {s:?})"));
                    }
                    4 | 5 => {
                        read(&mut rx, &mut answers, &mut counted, &mut credited, 3);
                        log.push("plane reads".into());
                    }
                    6 => {
                        let k = next(answers.len() as u64 + 1) as usize;
                        for (seq, dropped) in answers.drain(..k.min(answers.len())) {
                            o.ack(&r, seq, dropped, version);
                            log.push(format!("ack {seq} dropped={dropped}"));
                        }
                    }
                    7 => {
                        // The stream is lost: what it carried was read, its answers are not.
                        read(&mut rx, &mut answers, &mut counted, &mut credited, 3);
                        answers.clear();
                        let (t, x) = mpsc::channel(WINDOW + 1);
                        (tx, rx) = (t, x);
                        assert!(o.resend(&tx));
                        log.push("stream lost; resent".into());
                    }
                    _ => {}
                }
            }
            // The control plane takes everything from now on.
            for _ in 0..200 {
                let _ = o.send(&r, &tx, true, under(version));
                read(&mut rx, &mut answers, &mut counted, &mut credited, 0);
                for (seq, dropped) in answers.drain(..) {
                    o.ack(&r, seq, dropped, version);
                }
                if o.pending_seqs().is_empty() && o.held_versions().is_empty() {
                    break;
                }
            }
            let _ = o.send(&r, &tx, true, under(version));
            read(&mut rx, &mut answers, &mut counted, &mut credited, 0);
            assert_eq!(
                credited,
                made,
                "run {run}: counts credited per version vs made\n{}",
                log.join("\n")
            );
        }
    }

    #[test]
    fn a_held_report_the_stream_cannot_take_stays_held() {
        let (r, mut o) = outbox();
        count_calls(&r, 3);
        o.hold(&r, under(1));
        let (tx, mut rx) = full_stream();
        count_calls(&r, 2);
        assert_eq!(o.send(&r, &tx, true, under(2)), Err(NotSent::StreamFull));
        assert_eq!(o.held_versions(), [1]);
        assert_eq!(
            r.pending("a").calls,
            2,
            "the later counts wait in the counters"
        );
        assert!(o.pending_seqs().is_empty(), "no seq used");
        rx.try_recv().unwrap();
        // Room for one: the held report takes it, the later counts still wait.
        assert_eq!(o.send(&r, &tx, true, under(2)), Err(NotSent::StreamFull));
        assert_eq!(sent_with_versions(&mut rx), [(1, 1, 3)]);
        assert!(o.held_versions().is_empty());
        assert_eq!(r.pending("a").calls, 2);
        assert_eq!(o.send(&r, &tx, true, under(2)), Ok(2));
        assert_eq!(sent_with_versions(&mut rx), [(2, 2, 2)]);
    }

    #[test]
    fn seqs_count_up_from_one_and_an_ack_forgets_the_report() {
        let (r, mut o, tx, mut rx) = set_up(16);
        assert_eq!(o.send(&r, &tx, true, no_fill), Err(NotSent::Empty));
        count_calls(&r, 2);
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(1));
        count_calls(&r, 3);
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(2));
        assert_eq!(sent(&mut rx), [(1, 2), (2, 3)]);
        assert_eq!(o.pending_seqs(), [1, 2]);
        o.ack(&r, 2, false, 0);
        assert_eq!(o.pending_seqs(), [1]);
        o.ack(&r, 2, false, 0);
        o.ack(&r, 9, true, 0);
        assert_eq!(o.pending_seqs(), [1], "unknown seqs are ignored");
        assert_eq!(r.pending("a").calls, 0, "an ack adds nothing back");
        o.ack(&r, 1, false, 0);
        assert!(o.pending_seqs().is_empty());
        assert_eq!(r.pending("a").calls, 0);
    }

    #[test]
    fn a_dropped_report_goes_back_into_the_counters_and_out_in_a_later_report() {
        let (r, mut o, tx, mut rx) = set_up(16);
        count_calls(&r, 4);
        o.send(&r, &tx, true, no_fill).unwrap();
        count_calls(&r, 1);
        o.ack(&r, 1, true, 0);
        assert!(o.pending_seqs().is_empty());
        assert_eq!(r.pending("a").calls, 5);
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(2));
        assert_eq!(sent(&mut rx), [(1, 4), (2, 5)]);
        // A second answer to the dropped seq adds nothing.
        o.ack(&r, 1, true, 0);
        assert_eq!(r.pending("a").calls, 0);
    }

    #[test]
    fn a_full_window_takes_nothing_until_an_ack_frees_a_place() {
        let (r, mut o, tx, mut rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |_| no_fill);
        assert!(o.is_full());
        count_calls(&r, 7);
        assert_eq!(o.send(&r, &tx, true, no_fill), Err(NotSent::WindowFull));
        assert_eq!(r.pending("a").calls, 7, "the counts stay in the counters");
        assert_eq!(sent(&mut rx).len(), WINDOW);
        o.ack(&r, 3, false, 0);
        let next = u64::try_from(WINDOW).unwrap() + 1;
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(next));
        assert_eq!(sent(&mut rx), [(next, 7)]);
        assert_eq!(r.pending("a").calls, 0);
        // The last report of a shutdown goes out past a full window, and is kept.
        assert!(o.is_full());
        count_calls(&r, 2);
        o.closing();
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(next + 1));
        assert_eq!(sent(&mut rx), [(next + 1, 2)]);
        assert_eq!(o.pending_seqs().last(), Some(&(next + 1)));
    }

    #[test]
    fn a_report_the_stream_cannot_take_goes_back_and_uses_no_seq() {
        let (r, mut o) = outbox();
        count_calls(&r, 3);
        let closed = gone_stream(1);
        assert_eq!(o.send(&r, &closed, true, no_fill), Err(NotSent::StreamFull));
        assert_eq!(r.pending("a").calls, 3);
        assert!(o.pending_seqs().is_empty());
        let (tx, mut rx) = mpsc::channel(4);
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(1));
        assert_eq!(sent(&mut rx), [(1, 3)]);
    }

    #[test]
    fn counts_too_large_for_one_report_go_out_in_several_each_within_the_limit() {
        use prost::Message as _;
        let (r, mut o, tx, mut rx) = set_up(64);
        // About 6 MiB of counts: more than the control plane decodes in one message.
        let endpoints = 24_000;
        count_many(&r, endpoints, 1);
        let last = o.send(&r, &tx, true, no_fill).unwrap();
        let reports = reports_on(&mut rx);
        assert!(reports.len() > 1, "{} report(s)", reports.len());
        for report in &reports {
            let len = pb::AgentMessage {
                kind: Some(Kind::Metrics(report.clone())),
            }
            .encoded_len();
            assert!(
                len <= retryplane_proto::MAX_MESSAGE_BYTES / 2,
                "{len} bytes"
            );
        }
        let seqs: Vec<u64> = reports.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, (1..=last).collect::<Vec<_>>(), "numbered in order");
        assert_eq!(o.pending_seqs(), seqs, "each kept until acknowledged");
        assert_eq!(calls_in(&reports), endpoints as u64, "every count once");
        assert!(r.take().is_empty());
    }

    /// At shutdown every part waits for room: through a queue of one, drained as it goes, all
    /// of them go; with the deadline passed and no room, none is lost from the counters.
    #[tokio::test(start_paused = true)]
    async fn at_shutdown_each_part_waits_for_room_until_the_deadline() {
        let (r, mut o, tx, mut rx) = set_up(1);
        o.closing();
        let endpoints = 24_000;
        count_many(&r, endpoints, 1);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
        let drain = async {
            let mut calls = 0;
            while let Some(m) = rx.recv().await {
                if let Some(Kind::Metrics(report)) = m.kind {
                    calls += calls_of(&report.endpoints);
                }
            }
            calls
        };
        let send = async {
            let all = o
                .send_by(&r, &tx, true, deadline, |f| f(), || no_fill)
                .await;
            drop(tx);
            all.count
        };
        let (parts, calls) = tokio::join!(send, drain);
        assert!(parts > 1, "{parts} part(s)");
        assert_eq!(calls, endpoints as u64, "every count once");
        assert!(o.pending_seqs().len() > 1, "in several parts, each kept");
        assert!(r.take().is_empty());

        let (tx, _rx) = full_stream();
        count_many(&r, endpoints, 1);
        let past = tokio::time::Instant::now();
        assert_eq!(
            o.send_by(&r, &tx, true, past, |f| f(), || no_fill).await,
            Queued::default()
        );
        assert_eq!(
            calls_of(&r.take()),
            endpoints as u64,
            "the counts wait in the counters"
        );
    }

    #[test]
    fn parts_of_a_large_report_past_the_window_wait_in_the_counters() {
        let (r, mut o, tx, mut rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..WINDOW as u64, |_| no_fill);
        // One place left in the window, and counts for several reports.
        count_many(&r, 24_000, 2);
        let last = u64::try_from(WINDOW).unwrap();
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(last));
        assert!(o.is_full());
        let sent_calls = calls_in(&reports_on(&mut rx));
        let kept = calls_of(&r.take());
        assert!(kept > 0, "the rest waits for a place");
        assert_eq!(
            sent_calls + kept,
            u64::try_from(WINDOW).unwrap() - 1 + 48_000
        );
    }

    /// The parts of a report that found no place go back into the counters, made from that
    /// report's start: the caller's next report starts where the one sent in part ends, and
    /// the parts that waited go out in it, so their own start must come with them (made over
    /// the next interval alone, they read as a burst).
    #[test]
    fn parts_of_a_large_report_that_wait_keep_the_reports_start() {
        let (r, mut o, tx, mut rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..WINDOW as u64, |_| no_fill);
        reports_on(&mut rx);
        count_many(&r, 24_000, 2);
        let last = u64::try_from(WINDOW).unwrap();
        assert_eq!(o.send(&r, &tx, true, span_of(1, 1_000, 2_000)), Ok(last));
        // A place again; the next report spans 2000..3000.
        o.ack(&r, 1, false, 1);
        assert!(o.send(&r, &tx, true, span_of(1, 2_000, 3_000)).is_ok());
        let next = reports_on(&mut rx);
        let next = next.last().unwrap();
        assert_eq!(
            (next.window_start_unix_ms, next.window_end_unix_ms),
            (1_000, 3_000),
            "counts made from 1000 on, in the report that found no place"
        );
    }

    /// On an unnumbered stream (a control plane that does
    /// not acknowledge), a large report of which the stream takes only some parts: the parts
    /// that wait go out in the next report with the first one's start, and every endpoint's
    /// counts go out exactly once.
    #[test]
    fn unnumbered_parts_of_a_large_report_that_wait_keep_the_reports_start_and_every_count() {
        let (r, mut o) = outbox();
        count_many(&r, 24_000, 2);
        let (tx, mut rx) = mpsc::channel(2);
        assert_eq!(o.send(&r, &tx, false, span_of(1, 1_000, 2_000)), Ok(0));
        let first = reports_on(&mut rx);
        assert_eq!(first.len(), 2, "two parts found room");
        let (tx, mut rx) = mpsc::channel(64);
        assert_eq!(o.send(&r, &tx, false, span_of(1, 2_000, 3_000)), Ok(0));
        let next = reports_on(&mut rx);
        assert!(!next.is_empty());
        for report in &next {
            assert_eq!(report.seq, 0);
            assert_eq!(
                (report.window_start_unix_ms, report.window_end_unix_ms),
                (1_000, 3_000)
            );
        }
        let mut seen = std::collections::HashMap::new();
        for e in first.iter().chain(&next).flat_map(|r| &r.endpoints) {
            *seen.entry(e.endpoint.clone()).or_insert(0) += e.calls;
        }
        assert_eq!(seen.len(), 24_000);
        assert!(seen.values().all(|&c| c == 2), "no count lost or doubled");
    }

    #[test]
    fn a_new_stream_gets_the_unanswered_reports_again_in_seq_order() {
        let (r, mut o, tx, rx) = set_up(16);
        for n in 1..=4 {
            count_calls(&r, n);
            o.send(&r, &tx, true, no_fill).unwrap();
        }
        o.ack(&r, 2, false, 0);
        drop((tx, rx));
        // The next stream: Hello first, then the three unanswered reports, same seqs.
        let (tx, mut rx) = mpsc::channel(WINDOW + 1);
        tx.try_send(message(Kind::Hello(pb::Hello::default())))
            .unwrap();
        assert!(o.resend(&tx));
        assert!(matches!(rx.try_recv().unwrap().kind, Some(Kind::Hello(_))));
        assert_eq!(sent(&mut rx), [(1, 1), (3, 3), (4, 4)]);
        count_calls(&r, 5);
        assert_eq!(
            o.send(&r, &tx, true, no_fill),
            Ok(5),
            "new reports after them"
        );
        // A stream that is already gone keeps them for the next one.
        let gone = gone_stream(16);
        assert!(!o.resend(&gone));
        assert_eq!(o.pending_seqs(), [1, 3, 4, 5]);
    }

    #[test]
    fn without_acks_reports_go_out_unnumbered_and_kept_ones_give_their_counts_back() {
        let (r, mut o, tx, mut rx) = set_up(64);
        count_calls(&r, 2);
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(1));
        count_calls(&r, 3);
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(2));
        assert_eq!(sent(&mut rx), [(1, 2), (2, 3)]);
        // The next stream's control plane does not acknowledge reports.
        o.give_back(&r, 0);
        assert!(o.pending_seqs().is_empty());
        assert_eq!(r.pending("a").calls, 5);
        // More reports than the window holds, none kept, none waiting for an answer.
        for n in 1..=u64::try_from(WINDOW).unwrap() + 2 {
            count_calls(&r, n);
            assert_eq!(o.send(&r, &tx, false, no_fill), Ok(0));
        }
        assert!(o.pending_seqs().is_empty());
        let reports = sent(&mut rx);
        assert_eq!(reports.len(), WINDOW + 2);
        assert!(reports.iter().all(|(seq, _)| *seq == 0));
        assert_eq!(reports[0].1, 5 + 1, "the given-back counts go out first");
        // An unnumbered report the stream cannot take goes back too.
        count_calls(&r, 4);
        let closed = gone_stream(1);
        assert_eq!(
            o.send(&r, &closed, false, no_fill),
            Err(NotSent::StreamFull)
        );
        assert_eq!(r.pending("a").calls, 4);
        // Numbering resumes where it stopped when a stream acknowledges again.
        assert_eq!(o.send(&r, &tx, true, no_fill), Ok(3));
    }

    /// The module's docs: counts held under their version are credited to a later one
    /// only after [`HELD`] swaps while the control plane acknowledges nothing. One swap is
    /// enough when a call that outlived the version keeps counting: each report while the
    /// window is full holds its new counts as one more report of that version, and the
    /// seventeenth pushes the counts held at the swap into the counters, which the next report
    /// credits to the version in force.
    #[test]
    fn one_swap_and_a_call_that_outlived_it_do_not_push_the_swaps_counts_under_the_next_version() {
        let (r, mut o, tx, _rx) = set_up(64);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |_| under(1));
        // Version 2 replaces version 1 while the window is full: 5 calls made on 1 are held.
        count_calls(&r, 5);
        swap_with_the_window_full(&r, &mut o, &tx, || under(1));
        assert_eq!(o.held_versions(), [1]);
        // A call still on version 1 retries once in each of the next 20 intervals (the
        // control plane acknowledges nothing meanwhile).
        let call_on_1 = outlived_a(&r, 1);
        for _ in 0..20 {
            Counters::inc(&call_on_1.retries);
            assert_eq!(o.send(&r, &tx, true, under(2)), Err(NotSent::WindowFull));
        }
        let credited_to_2 = r.pending("a");
        assert_eq!(
            (credited_to_2.calls, credited_to_2.retries),
            (0, 0),
            "counts made on version 1 are in the counters, to be reported under version 2 \
             after one swap (held: {:?})",
            o.held_versions()
        );
    }

    /// A refused report's counts go out again over the span they were made in
    /// (`taken_back_from`), also when `Agent::set_policies` on an agent of a control plane
    /// retires them (`Registry::retire`) before the next report: then they go out as counts of
    /// calls that outlived their version, over the next report's span alone (read as a burst),
    /// and that refused span is given to the new version's counts instead.
    #[test]
    fn a_refused_reports_counts_retired_by_set_policies_go_out_over_their_own_span() {
        let (r, mut o, tx, mut rx) = set_up(64);
        // Refused while version 5 is in force: back into the counters.
        let refused = span_of(5, 1_000, 11_000);
        refuse_the_first_report_of(&r, &mut o, &tx, &mut rx, 10, refused, 5);
        // `Agent::set_policies`: version 0 replaces 5, whose counts are moved apart.
        r.retire(5);
        count_calls(&r, 1);
        assert!(o.send(&r, &tx, true, span_of(0, 11_000, 21_000)).is_ok());
        // (version, start, calls)
        let out: Vec<_> = reports_on(&mut rx)
            .iter()
            .map(|rep| {
                (
                    rep.policy_version,
                    rep.window_start_unix_ms,
                    rep.endpoints[0].calls,
                )
            })
            .collect();
        assert_eq!(
            out,
            [(5, 1_000, 10), (0, 11_000, 1)],
            "(version, window start, calls): the refused counts over the span they were made in"
        );
    }

    /// A report with no start (`window_start_unix_ms` 0: the control plane reads it as
    /// covering no known time, `aggregate::raw_span`) joined into a held one of its version
    /// keeps the held one's known start: taken by `min`, the held counts, made over a known
    /// span, went out as made at no known time. A start of 0 comes from `window` only with a
    /// wall clock before 1970 plus the span, so this is an edge.
    #[test]
    fn a_report_with_no_start_joined_to_a_held_one_does_not_take_the_held_ones_span() {
        let (r, mut o, tx, mut rx) = set_up(64);
        count_calls(&r, 3);
        o.hold(&r, span_of(1, 1_000, 2_000));
        // A call that outlived version 1 counts on; the next report has no start.
        count_outlived_calls(&r, 1, 1);
        assert!(o.send(&r, &tx, true, span_of(2, 0, 3_000)).is_ok());
        let v1 = reports_of(&mut rx, 1);
        assert_eq!(calls_in(&v1), 4);
        assert!(
            v1.iter()
                .filter(|r| r.endpoints[0].calls >= 3)
                .all(|r| r.window_start_unix_ms == 1_000),
            "the 3 calls held over 1000..2000 keep their start: {v1:?}"
        );
    }

    /// 30 swaps while the control plane
    /// acknowledges nothing, calls outliving every version counting at every interval. No
    /// count is lost or doubled, at most HELD reports are held, none is past
    /// MAX_REPORT_BYTES, and the counts of the versions still held go out under their own.
    #[test]
    fn swaps_and_outliving_calls_with_a_full_window_lose_and_double_no_count() {
        let (r, mut o, tx, mut rx) = set_up(1024);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |seq| {
            span_of(1, seq * 10, seq * 10 + 10)
        });
        let mut total = WINDOW as u64;
        let mut t = 1_000;
        for v in 1..=30u64 {
            count_calls(&r, 5);
            total += 5;
            // The swap from v to v + 1 with the window full: v's counts held.
            swap_with_the_window_full(&r, &mut o, &tx, || span_of(v, t, t + 10));
            t += 10;
            // Calls on every version so far go on counting.
            for u in 1..=v {
                count_outlived_calls(&r, u, 1);
                total += 1;
            }
            assert_eq!(
                o.send(&r, &tx, true, span_of(v + 1, t, t + 10)),
                Err(NotSent::WindowFull)
            );
            t += 10;
            assert!(o.held_versions().len() <= HELD);
        }
        let mut reports = reports_on(&mut rx);
        assert_eq!(reports.len(), WINDOW);
        // The control plane acknowledges everything from now on.
        for _ in 0..64 {
            for seq in o.pending_seqs() {
                o.ack(&r, seq, false, 31);
            }
            match o.send(&r, &tx, true, span_of(31, t, t + 10)) {
                Err(NotSent::Empty) => break,
                _ => t += 10,
            }
            reports.extend(reports_on(&mut rx));
        }
        reports.extend(reports_on(&mut rx));
        for rep in &reports {
            assert!(encoded_size(rep) <= MAX_REPORT_BYTES);
            assert!(rep.window_start_unix_ms <= rep.window_end_unix_ms);
        }
        assert_eq!(calls_in(&reports), total, "every call counted once");
    }

    /// past HELD versions the oldest one's counts go into the counters (the module's
    /// docs). Counts that a call outliving that evicted version makes afterwards come back as
    /// a new held report of it at the end of `held`, and the bound then evicts the report at
    /// the front: the counts held at the swap of a newer version (here version 2's 5 calls),
    /// which go out under the version in force, while the evicted version's later count
    /// keeps its own. The oldest version's counts should be the ones to go.
    #[test]
    fn a_call_outliving_an_evicted_version_does_not_push_a_newer_versions_counts_out() {
        let (r, mut o, tx, mut rx) = set_up(1024);
        send_one_call_each(&r, &mut o, &tx, 1..=WINDOW as u64, |_| under(1));
        let _ = reports_on(&mut rx);
        // Version 1 has a call that outlives it (in its pause).
        let call_on_1 = outlived_a(&r, 1);
        // HELD + 1 swaps with the window full: versions 1..=17 held, 1 evicted.
        for v in 1..=HELD as u64 + 1 {
            count_calls(&r, 5);
            o.hold(&r, under(v));
        }
        assert_eq!(o.held_versions(), (2..=HELD as u64 + 1).collect::<Vec<_>>());
        // The call on version 1 retries once more.
        Counters::inc(&call_on_1.calls);
        assert_eq!(
            o.send(&r, &tx, true, under(HELD as u64 + 2)),
            Err(NotSent::WindowFull)
        );
        assert_eq!(
            r.pending("a").calls,
            6,
            "only version 1's calls (5 evicted before, and the late one, evicted itself) wait \
             in the counters for the version in force; held: {:?}",
            o.held_versions()
        );
        assert_eq!(o.held_versions(), (2..=HELD as u64 + 1).collect::<Vec<_>>());
        assert!(
            o.held_versions().contains(&2),
            "version 2's counts are held: {:?}",
            o.held_versions()
        );
    }

    /// a held report and counts of its version
    /// whose sum is past MAX_REPORT_BYTES stay two reports, each within it, no count lost.
    #[test]
    fn counts_that_would_make_a_held_report_too_large_are_held_apart() {
        let (r, mut o, tx, mut rx) = set_up(64);
        const N: usize = 50_000;
        for i in 0..N {
            Counters::inc(&r.counters(&Arc::from(format!("e{i:06}"))).calls);
        }
        o.hold(&r, span_of(1, 1_000, 2_000));
        assert_eq!(o.held_versions(), [1]);
        for i in 0..N {
            Counters::inc(&r.outlived(1, &Arc::from(format!("f{i:06}"))).calls);
        }
        assert!(o.send(&r, &tx, true, span_of(2, 2_000, 3_000)).is_ok());
        let reports = reports_on(&mut rx);
        assert_eq!(reports.len(), 2, "not joined: the sum is past the limit");
        for rep in &reports {
            let size = encoded_size(rep);
            assert!(size <= MAX_REPORT_BYTES, "{size}");
            assert_eq!(rep.policy_version, 1);
        }
        assert_eq!(calls_in(&reports), 2 * N as u64);
    }

    /// Past HELD the report evicted is the oldest version's. Version 0 is not the oldest by
    /// its number: it is the static policies (`Agent::set_policies`) or the fallback, and
    /// policies the program set after pushed version 3 was replaced, and then replaced by push
    /// 5, were in force after versions 1 to 3. Version 1's counts, held earliest, go (ranked by
    /// number, version 0's went).
    #[test]
    fn past_held_a_version_0_report_held_after_pushed_ones_is_not_the_first_to_go() {
        let (r, mut o) = outbox();
        // Pushes 1, 2, 3 replaced (held); the program's policies (version 0) replaced by push
        // 5 (held); pushes 5..=16 replaced (held): 16 held.
        let order: Vec<u64> = [1, 2, 3, 0].into_iter().chain(5..=16).collect();
        for &v in &order {
            count_calls(&r, 1);
            o.hold(&r, under(v));
        }
        assert_eq!(o.held_versions(), order);
        // Push 18 replaces 17: one report too many.
        count_calls(&r, 1);
        o.hold(&r, under(17));
        assert_eq!(o.held_versions().len(), HELD);
        assert!(
            o.held_versions().contains(&0),
            "the counts made on the program's policies (after versions 1..=3) are held; \
             held: {:?}",
            o.held_versions()
        );
        assert!(
            !o.held_versions().contains(&1),
            "the oldest counts (version 1's) went: held {:?}",
            o.held_versions()
        );
    }

    /// `join_held` keeps the non-zero start when one side has none (0). The other
    /// two places that give a report the start of counts taken back from a refused one do not:
    /// `FromTakenBack::fill` moves the start back only when the taken-back start is below the
    /// report's, never below 0. Counts refused over 1000..2000 put back into the counters go
    /// out in a report with no start: as made at no known time.
    #[test]
    fn taken_back_counts_reported_with_a_report_of_no_start_keep_their_start() {
        let (r, mut o, tx, mut rx) = set_up(64);
        // Refused; version 2 still in force: back into the counters, from 1000.
        let refused = span_of(2, 1_000, 2_000);
        refuse_the_first_report_of(&r, &mut o, &tx, &mut rx, 3, refused, 2);
        count_calls(&r, 1);
        assert_eq!(o.send(&r, &tx, true, span_of(2, 0, 3_000)), Ok(2));
        let reps = reports_on(&mut rx);
        assert_eq!(calls_in(&reps), 4);
        assert_eq!(
            reps[0].window_start_unix_ms, 1_000,
            "the refused counts were made from 1000: {reps:?}"
        );
    }

    /// The same in `hold_outlived`: counts taken back from a refused report of version
    /// 2 (1000..2000), then moved to the counters of calls that outlived it
    /// (`Agent::set_policies`, `Registry::retire`), are held with `min(start, 1000)`: a report
    /// filled in with no start (0) takes 0, and the refused counts go out as made at no known
    /// time.
    #[test]
    fn taken_back_counts_moved_to_outlived_keep_their_start_under_a_fill_of_no_start() {
        let (r, mut o, tx, mut rx) = set_up(64);
        let refused = span_of(2, 1_000, 2_000);
        refuse_the_first_report_of(&r, &mut o, &tx, &mut rx, 3, refused, 2);
        // The program sets its policies: version 2's counts move aside.
        r.retire(2);
        assert!(o.send(&r, &tx, true, span_of(0, 0, 3_000)).is_ok());
        let v2 = reports_of(&mut rx, 2);
        assert_eq!(calls_in(&v2), 3);
        assert!(
            v2.iter().all(|r| r.window_start_unix_ms == 1_000),
            "the refused counts were made from 1000: {v2:?}"
        );
    }

    /// Shutdown: the held reports go out, the counts of calls that
    /// outlived their version made during that wait are held, the counters are taken, and the
    /// wait for room for the newly held report runs out: the counters' counts are put back,
    /// the new held report stays held, and only the first is counted as queued.
    #[tokio::test]
    async fn send_by_running_out_of_room_after_taking_the_counters_puts_them_back() {
        let (r, mut o, tx, mut rx) = set_up(1);
        count_calls(&r, 2);
        o.hold(&r, under(1));
        let on_2 = outlived_a(&r, 2);
        count_calls(&r, 5);
        o.closing();
        let turns = std::cell::Cell::new(0);
        let steady = |f: &mut dyn FnMut()| {
            turns.set(turns.get() + 1);
            if turns.get() == 2 {
                // A call on version 2 counts during the wait for room for the held report.
                Counters::inc(&on_2.calls);
            }
            f();
        };
        let past = tokio::time::Instant::now();
        let queued = o.send_by(&r, &tx, true, past, steady, || under(3)).await;
        assert_eq!(turns.get(), 2);
        assert_eq!(queued.count, 1);
        assert_eq!(sent_with_versions(&mut rx), [(1, 1, 2)]);
        assert_eq!(o.held_versions(), [2]);
        assert_eq!(r.pending("a").calls, 5, "the counters' counts wait there");
    }
}
