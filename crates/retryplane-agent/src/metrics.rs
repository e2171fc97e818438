//! Per-endpoint retry counters (SPEC §4), lock-free on the call path.
//!
//! Each [`crate::Endpoint`] handle holds its endpoint's [`Counters`]; a call only does relaxed
//! atomic adds. The stream task takes deltas with `swap(0)` when it is about to send a report
//! and, if the report cannot be handed to the stream, adds them back, so counts made while
//! disconnected accumulate (in the same fixed set of counters: the memory is bounded by the
//! number of endpoints) until a report is accepted. Nothing is counted twice.
//!
//! A call is counted in `calls` (and its first attempt in `attempts`) when its second attempt
//! starts, or when it ends or is dropped before that: a call still in its first attempt, or in the
//! pause after it, when a report is taken is in a later report. A first-try success is one add to
//! `success_first_try`, which is added into `calls` and `attempts` whenever counts are read or
//! taken (and taken back out by a restore). Only calls made are counted: a request the layer's
//! de-duplication answered with a copy of another call's response made none and is not here. Every
//! call that ends is counted in one outcome: a success, a give-up (`circuit_open` for a refusal),
//! or `cancelled` when its cancellation token ended it or its future was dropped before it had
//! another (at any point: before its first attempt, during an attempt, a pause or a credential
//! refresh). A call whose attempt or classifier panicked is dropped so, and counted `cancelled`
//! too.
//!
//! Every count of a call goes under the version of the policies it runs on (it reads them once,
//! SPEC §2). The endpoint's counters hold the counts made under the version in force: when new
//! policies come, the counts made so far are reported under the old version, and a call still
//! running on the old policies counts from then on in that version's counters for calls that
//! outlived it ([`Registry::outlived`], keyed by version and endpoint, made by the first such
//! count and dropped once no call holds them), reported as that version's in reports of their
//! own. Only the count a call makes as the swap happens may land on either side of it.
//!
//! A report handed to the stream is not forgotten: it is numbered and kept until the control
//! plane acknowledges it (`crate::stream::outbox`), sent again on the next stream if the
//! connection drops first (the control plane counts each number once), and added back here if
//! the control plane refused it (its rate limit). While the few reports allowed to wait for an
//! answer do, no counts are taken: they keep adding up here. So every count reaches the control
//! plane exactly once, as long as the process lives and the control plane keeps its record of
//! the agent (see `retryplane_server::report_seq`). At shutdown the last report goes out even
//! when the window is full; what is left after it is lost: reports still unacknowledged once
//! the stream's close grace has passed (the control plane has most likely counted them), the
//! counts of a report it refuses (its rate limit) during that grace, and counts made while no
//! stream is up. A control plane that does not acknowledge reports gets
//! them unnumbered, counted as they come (see `crate::stream::outbox`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use retryplane_policy::engine::GiveUpCause;
use retryplane_proto::pb;

macro_rules! counters {
    ($($(#[$doc:meta])* $field:ident),* $(,)?) => {
        /// One endpoint's counters.
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub(crate) $field: AtomicU64,)*
            /// The nanoseconds below a whole millisecond of every pause counted in
            /// `backoff_ms`, added up (never taken): see [`Counters::add_backoff`].
            backoff_sub_ms: AtomicU64,
        }

        /// A plain copy of one endpoint's counters (values or deltas).
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct CounterValues {
            $(
                $(#[$doc])*
                pub $field: u64,
            )*
        }

        impl Counters {
            /// Takes every count as stored, leaving zeros.
            fn take_stored(&self) -> CounterValues {
                CounterValues { $($field: self.$field.swap(0, Relaxed),)* }
            }

            /// Adds stored counts back.
            fn add_stored(&self, v: &CounterValues) {
                $(self.$field.fetch_add(v.$field, Relaxed);)*
            }

            /// Reads the stored counts without taking them.
            fn peek_stored(&self) -> CounterValues {
                CounterValues { $($field: self.$field.load(Relaxed),)* }
            }
        }

        impl CounterValues {
            fn is_zero(&self) -> bool {
                true $(&& self.$field == 0)*
            }

            /// Adds `other`'s counts to these.
            fn add(&mut self, other: &CounterValues) {
                $(self.$field = self.$field.wrapping_add(other.$field);)*
            }

            fn to_pb(&self, endpoint: &str) -> pb::EndpointCounters {
                pb::EndpointCounters {
                    endpoint: endpoint.to_owned(),
                    $($field: self.$field,)*
                }
            }

            fn from_pb(c: &pb::EndpointCounters) -> Self {
                Self { $($field: c.$field,)* }
            }
        }
    };
}

// Each field's doc is its `EndpointCounters` field's (proto/retryplane/v1/agent.proto).
counters!(
    /// Logical calls (SPEC §4): one per call, however many attempts, counted even when
    /// nothing was sent (an open breaker refused it).
    calls,
    /// Attempts made (first tries and retries): requests handed to the upstream's client, one
    /// it refused to send included.
    attempts,
    /// Attempts after the first.
    retries,
    /// Calls that succeeded on their first attempt.
    success_first_try,
    /// Calls that succeeded on a later attempt.
    success_after_retry,
    /// Calls given up: `max_attempts` reached.
    gave_up_attempts,
    /// Calls given up: the retry budget refused the retry.
    gave_up_budget,
    /// Calls given up: the next pause would end past the deadline, or the deadline passed.
    gave_up_deadline,
    /// Calls given up: the upstream's `Retry-After` (or gRPC pushback) was longer than
    /// `retry_after.max`.
    gave_up_retry_after,
    /// Calls given up: the failure is not retryable (status not listed, not idempotent, a
    /// request body that cannot be sent again, or a gRPC pushback that says do not retry).
    gave_up_not_retryable,
    /// Calls the circuit breaker ended: refused before their first attempt, or stopped before
    /// a retry by a breaker that opened meanwhile (SPEC §4 counts them apart from give-ups).
    circuit_open,
    /// Time spent pausing between attempts, in whole milliseconds (what is left below one
    /// goes into a later report).
    backoff_ms,
    /// Pauses that followed a `Retry-After` or gRPC pushback hint.
    retry_after_honored,
    /// Calls that ended with no outcome: the caller cancelled them or dropped the call's
    /// future. Not among SPEC §4's counters; with it, every call that has ended is counted
    /// once in `success_first_try`, `success_after_retry`, a `gave_up_*`, `circuit_open` or
    /// `cancelled`.
    cancelled,
);

impl Counters {
    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Relaxed);
    }

    /// Counts a call whose first attempt succeeded: one increment instead of three. The
    /// stored `calls` and `attempts` leave such calls out; [`Counters::take`] and
    /// [`Counters::peek`] add `success_first_try` back into both, so every figure read or sent
    /// is the full count (SPEC §4).
    pub(crate) fn first_try_success(&self) {
        Self::inc(&self.success_first_try);
    }

    /// Takes every count, leaving zeros.
    fn take(&self) -> CounterValues {
        derived(self.take_stored())
    }

    /// Adds `v` back (a report that was not sent): the inverse of [`Counters::take`].
    fn add(&self, v: &CounterValues) {
        let mut stored = v.clone();
        stored.calls = v.calls.wrapping_sub(v.success_first_try);
        stored.attempts = v.attempts.wrapping_sub(v.success_first_try);
        self.add_stored(&stored);
    }

    /// Reads without taking.
    pub(crate) fn peek(&self) -> CounterValues {
        derived(self.peek_stored())
    }

    /// Adds a pause taken to `backoff_ms`. Its whole milliseconds go in at once; what is left
    /// below a millisecond is added up apart, and each time that sum passes another whole
    /// millisecond, one more goes into `backoff_ms`. So the figure is the total time paused, cut
    /// to the millisecond once, rather than each pause cut to the millisecond (a pause of 1.9 ms
    /// would count 1, and a thousand jittered pauses under 1 ms would count nothing).
    pub(crate) fn add_backoff(&self, paused: Duration) {
        const NANOS_PER_MS: u64 = 1_000_000;
        let whole = u64::try_from(paused.as_millis()).unwrap_or(u64::MAX);
        let below = u64::from(paused.subsec_nanos()) % NANOS_PER_MS;
        let carried = if below == 0 {
            0
        } else {
            // The sum only grows (an atomic add wraps at 2^64 ns, 584 years of remainders);
            // `below` is under a millisecond, so it passes at most one more.
            let before = self.backoff_sub_ms.fetch_add(below, Relaxed);
            u64::from(before % NANOS_PER_MS + below >= NANOS_PER_MS)
        };
        let ms = whole.saturating_add(carried);
        if ms > 0 {
            self.backoff_ms.fetch_add(ms, Relaxed);
        }
    }

    /// Counts a call that gave up with `cause`.
    pub(crate) fn gave_up(&self, cause: GiveUpCause) {
        let c = match cause {
            GiveUpCause::NotRetryable => &self.gave_up_not_retryable,
            GiveUpCause::AttemptsExhausted => &self.gave_up_attempts,
            GiveUpCause::BudgetExhausted => &self.gave_up_budget,
            GiveUpCause::DeadlineExceeded => &self.gave_up_deadline,
            GiveUpCause::RetryAfterTooLong => &self.gave_up_retry_after,
            GiveUpCause::CircuitOpen => &self.circuit_open,
        };
        Self::inc(c);
    }
}

/// The full counts from stored ones: a first-try success is stored in `success_first_try`
/// alone (see [`Counters::first_try_success`]). Each field is a sum of deltas, so a success
/// counted between two fields' swaps lands in one report or the next, never in none or two.
fn derived(mut stored: CounterValues) -> CounterValues {
    stored.calls = stored.calls.wrapping_add(stored.success_first_try);
    stored.attempts = stored.attempts.wrapping_add(stored.success_first_try);
    stored
}

/// Every endpoint's counters. The map is touched when a handle is made and when a report is
/// taken, never on the call path.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    endpoints: RwLock<HashMap<Arc<str>, Arc<Counters>>>,
    /// The counters of calls that outlived the policies they run on, by version and endpoint
    /// (see [`Registry::outlived`]). Touched by such calls once each, and when a report is
    /// taken; an entry goes once its counts are taken and no call holds it.
    outlived: Mutex<HashMap<Outlived, Arc<Counters>>>,
}

/// A version and an endpoint: the key of the counters of calls that outlived the version.
type Outlived = (u64, Arc<str>);

impl Registry {
    /// The counters of `endpoint`, created on first use.
    pub(crate) fn counters(&self, endpoint: &Arc<str>) -> Arc<Counters> {
        if let Some(c) = self
            .endpoints
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(endpoint)
        {
            return c.clone();
        }
        self.endpoints
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(endpoint.clone())
            .or_default()
            .clone()
    }

    /// The counters of `endpoint`'s calls on the policies of `version` once those are no
    /// longer in force (a call in its pause as a push comes): counted apart from the endpoint's
    /// counters, which the next report credits to the version in force, and reported under
    /// `version` ([`Registry::take_outlived`]).
    #[cold]
    pub(crate) fn outlived(&self, version: u64, endpoint: &Arc<str>) -> Arc<Counters> {
        self.outlived
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((version, endpoint.clone()))
            .or_default()
            .clone()
    }

    /// Moves every endpoint's counts into the counters of calls that outlived `version`, to be
    /// reported under it: for counts made under `version` as it is replaced by a writer that
    /// does not report them first.
    pub(crate) fn retire(&self, version: u64) {
        let map = self.endpoints.read().unwrap_or_else(|e| e.into_inner());
        for (name, c) in map.iter() {
            let v = c.take();
            if !v.is_zero() {
                self.outlived(version, name).add(&v);
            }
        }
    }

    /// Adds to `counts` what calls on `endpoint` that outlived their policies counted and no
    /// report took yet.
    pub(crate) fn add_outlived(&self, endpoint: &str, counts: &mut CounterValues) {
        let map = self.outlived.lock().unwrap_or_else(|e| e.into_inner());
        for ((_, name), c) in map.iter() {
            if &**name == endpoint {
                counts.add(&c.peek());
            }
        }
    }

    /// Takes the non-zero deltas of calls that outlived their policies, by version (oldest
    /// first), each sorted by endpoint. Counters no call holds any more are dropped.
    pub(crate) fn take_outlived(&self) -> Vec<(u64, Vec<pb::EndpointCounters>)> {
        let mut map = self.outlived.lock().unwrap_or_else(|e| e.into_inner());
        let mut by_version: BTreeMap<u64, Vec<pb::EndpointCounters>> = BTreeMap::new();
        map.retain(|(version, name), c| {
            // Held by no call (only calls clone it, under this lock): nothing more comes.
            let done = Arc::strong_count(c) == 1;
            let v = c.take();
            if !v.is_zero() {
                by_version.entry(*version).or_default().push(v.to_pb(name));
            }
            !done
        });
        drop(map);
        by_version
            .into_iter()
            .map(|(version, mut endpoints)| {
                endpoints.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
                (version, endpoints)
            })
            .collect()
    }

    /// Takes every non-zero delta, sorted by endpoint. The counters of an endpoint no handle
    /// holds any more (see `crate::call::Cores::forget_unheld`) go once their counts are taken.
    pub(crate) fn take(&self) -> Vec<pb::EndpointCounters> {
        let mut map = self.endpoints.write().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        map.retain(|name, c| {
            // Held by no handle (only `counters` clones it, under this lock): nothing more
            // comes.
            let done = Arc::strong_count(c) == 1;
            let v = c.take();
            if !v.is_zero() {
                out.push(v.to_pb(name));
            }
            !done
        });
        drop(map);
        out.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        out
    }

    /// Adds back deltas that were taken but not sent.
    pub(crate) fn restore(&self, deltas: &[pb::EndpointCounters]) {
        for d in deltas {
            let name: Arc<str> = Arc::from(d.endpoint.as_str());
            self.counters(&name).add(&CounterValues::from_pb(d));
        }
    }

    /// How many endpoints' counters are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.endpoints
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The counts not yet sent for `endpoint` (a handle reads its own counters instead).
    #[cfg(test)]
    pub(crate) fn pending(&self, endpoint: &str) -> CounterValues {
        self.endpoints
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(endpoint)
            .map(|c| c.peek())
            .unwrap_or_default()
    }
}

/// The counts of `a` and `b` added up by endpoint, sorted by endpoint (for two reports of one
/// version joined into one).
pub(crate) fn summed(
    a: &[pb::EndpointCounters],
    b: &[pb::EndpointCounters],
) -> Vec<pb::EndpointCounters> {
    let mut by_name: BTreeMap<&str, CounterValues> = BTreeMap::new();
    for c in a.iter().chain(b) {
        by_name
            .entry(c.endpoint.as_str())
            .or_default()
            .add(&CounterValues::from_pb(c));
    }
    by_name.into_iter().map(|(name, v)| v.to_pb(name)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_counts_the_total_paused_not_each_pause_cut_to_the_millisecond() {
        let c = Counters::default();
        for _ in 0..3 {
            c.add_backoff(Duration::from_micros(500));
        }
        assert_eq!(c.peek().backoff_ms, 1, "1.5 ms in all");
        c.add_backoff(Duration::from_micros(1_900));
        assert_eq!(c.peek().backoff_ms, 3, "3.4 ms in all");
        c.add_backoff(Duration::from_micros(600));
        assert_eq!(c.peek().backoff_ms, 4, "4.0 ms in all");
        // Taking the counts leaves what is below a millisecond to the next report.
        assert_eq!(c.take().backoff_ms, 4);
        for _ in 0..1_000 {
            c.add_backoff(Duration::from_nanos(999));
        }
        assert_eq!(c.take().backoff_ms, 0, "0.999 ms");
        c.add_backoff(Duration::from_nanos(1_001));
        assert_eq!(c.take().backoff_ms, 1, "1.000 ms");
        c.add_backoff(Duration::from_secs(2));
        assert_eq!(c.take().backoff_ms, 2_000);
    }

    #[test]
    fn the_sum_below_a_millisecond_wrapping_carries_at_most_one() {
        let c = Counters::default();
        c.backoff_sub_ms.store(u64::MAX - 100_000, Relaxed);
        c.add_backoff(Duration::from_micros(500));
        assert!(c.take().backoff_ms <= 1);
    }

    #[test]
    fn deltas_taken_and_restored_are_neither_lost_nor_doubled() {
        let r = Registry::default();
        let a = r.counters(&Arc::from("a"));
        Counters::inc(&a.calls);
        Counters::inc(&a.calls);
        a.gave_up(GiveUpCause::BudgetExhausted);
        let taken = r.take();
        assert_eq!(taken.len(), 1);
        assert_eq!((taken[0].calls, taken[0].gave_up_budget), (2, 1));
        assert!(r.take().is_empty(), "taken counts are gone");
        Counters::inc(&a.calls);
        r.restore(&taken);
        let again = r.take();
        assert_eq!((again[0].calls, again[0].gave_up_budget), (3, 1));
    }

    #[test]
    fn outlived_counts_go_by_version_apart_from_the_endpoints_and_go_once_no_call_holds_them() {
        let r = Registry::default();
        let a: Arc<str> = Arc::from("a");
        let b: Arc<str> = Arc::from("b");
        Counters::inc(&r.counters(&a).calls);
        let a3 = r.outlived(3, &a);
        let b3 = r.outlived(3, &b);
        let a2 = r.outlived(2, &a);
        assert!(
            Arc::ptr_eq(&a3, &r.outlived(3, &a)),
            "one set per version and endpoint"
        );
        Counters::inc(&a3.retries);
        Counters::inc(&b3.attempts);
        a2.gave_up(GiveUpCause::AttemptsExhausted);
        // (version, [(endpoint, retries, attempts, gave_up_attempts)])
        type Taken = Vec<(u64, Vec<(String, u64, u64, u64)>)>;
        let taken: Taken = r
            .take_outlived()
            .into_iter()
            .map(|(v, e)| {
                let e = e
                    .into_iter()
                    .map(|c| (c.endpoint, c.retries, c.attempts, c.gave_up_attempts))
                    .collect();
                (v, e)
            })
            .collect();
        assert_eq!(
            taken,
            vec![
                (2, vec![("a".to_owned(), 0, 0, 1)]),
                (
                    3,
                    vec![("a".to_owned(), 1, 0, 0), ("b".to_owned(), 0, 1, 0)]
                ),
            ]
        );
        // The endpoint's own counts are not among them, nor taken.
        assert_eq!(r.pending("a").calls, 1);
        // Still held by calls: kept, and what they count next goes out next time.
        drop((a2, b3));
        Counters::inc(&a3.cancelled);
        let again = r.take_outlived();
        assert_eq!(again.len(), 1);
        assert_eq!((again[0].0, again[0].1[0].cancelled), (3, 1));
        assert_eq!(r.outlived.lock().unwrap().len(), 1, "only (3, a) is held");
        drop(a3);
        assert!(r.take_outlived().is_empty());
        assert!(
            r.outlived.lock().unwrap().is_empty(),
            "dropped once no call holds it"
        );
    }

    #[test]
    fn a_first_try_success_is_one_call_one_attempt_in_every_figure() {
        let r = Registry::default();
        let a = r.counters(&Arc::from("a"));
        a.first_try_success();
        a.first_try_success();
        // A call that needed a retry is counted in full.
        Counters::inc(&a.calls);
        Counters::inc(&a.attempts);
        Counters::inc(&a.attempts);
        Counters::inc(&a.retries);
        Counters::inc(&a.success_after_retry);
        let pending = r.pending("a");
        assert_eq!(
            (pending.calls, pending.attempts, pending.success_first_try),
            (3, 4, 2)
        );
        let taken = r.take();
        assert_eq!(
            (taken[0].calls, taken[0].attempts, taken[0].retries),
            (3, 4, 1)
        );
        assert_eq!(taken[0].success_first_try, 2);
        assert_eq!(r.pending("a"), CounterValues::default());

        // Restored, then one more first-try success: nothing lost or doubled.
        r.restore(&taken);
        assert_eq!(r.pending("a"), pending);
        a.first_try_success();
        let again = r.take();
        assert_eq!(
            (
                again[0].calls,
                again[0].attempts,
                again[0].success_first_try
            ),
            (4, 5, 3)
        );
        assert!(r.take().is_empty());
    }

    #[test]
    fn counts_made_while_reports_are_taken_and_restored_are_neither_lost_nor_doubled() {
        // One thread counts calls (half first-try successes, half with a retry, each with a
        // 0.3 ms pause) while another takes reports, sending two of three and restoring the
        // third, as the stream task does. Miri-sized under `cargo miri test`.
        const N: u64 = if cfg!(miri) { 40 } else { 100_000 };
        let r = Registry::default();
        let a = r.counters(&Arc::from("a"));
        let mut sent = CounterValues::default();
        std::thread::scope(|s| {
            let counting = s.spawn(|| {
                for i in 0..N {
                    if i % 2 == 0 {
                        a.first_try_success();
                    } else {
                        Counters::inc(&a.calls);
                        Counters::inc(&a.attempts);
                        Counters::inc(&a.attempts);
                        Counters::inc(&a.retries);
                        Counters::inc(&a.success_after_retry);
                    }
                    a.add_backoff(Duration::from_micros(300));
                }
            });
            let mut round = 0u64;
            while !counting.is_finished() || round < 3 {
                let taken = r.take();
                if round % 3 == 2 {
                    r.restore(&taken);
                } else {
                    taken
                        .iter()
                        .for_each(|c| sent.add(&CounterValues::from_pb(c)));
                }
                round += 1;
                std::thread::yield_now();
            }
        });
        sent.add(&r.pending("a"));
        let half = N / 2;
        assert_eq!(
            (
                sent.calls,
                sent.attempts,
                sent.retries,
                sent.success_first_try,
                sent.success_after_retry,
                sent.backoff_ms
            ),
            (N, half + 2 * half, half, half, half, N * 300 / 1_000)
        );
    }
}
