//! Which numbered metrics reports of one agent id were counted, so that a report sent again
//! after a lost stream is counted once (`MetricsReport.seq`, `MetricsAck` in `agent.proto`).
//!
//! Kept in the agent's [`crate::fleet`] entry, which outlives its streams: a reconnect, and a
//! second stream that replaces the first, see the same record, so a late report of the old
//! stream and the same report sent again on the new one cannot both be counted. Per instance
//! (`Hello.instance_id`, drawn anew by each agent process) the record is the highest seq counted
//! and a 64-bit mask of which of the 64 seqs up to it were counted; a seq more than 63 below the
//! highest counts as counted. The agent keeps at most a handful of reports unacknowledged and
//! sends them again in order before anything newer, so a report it sends again is always well
//! inside those 64. The [`MAX_INSTANCES`] instances that said Hello last are kept: an older
//! stream of a replaced process is still told apart while it drains.
//!
//! Memory: `MAX_INSTANCES` × 24 bytes per fleet entry, and fleet entries are bounded
//! ([`crate::fleet::MAX_DISCONNECTED`] disconnected ones). When an agent's entry is pruned its
//! record goes with it; a report it sends again after that is counted again.

/// Instances remembered per agent id (the newest Hello first).
pub const MAX_INSTANCES: usize = 4;

/// What to do with a numbered report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportVerdict {
    /// Not counted before and admitted: count it now (it is recorded as counted).
    Count,
    /// Counted before: do not count it again; acknowledge it.
    Duplicate,
    /// Not counted before and refused (the rate limit): count nothing, record nothing.
    Refused,
}

/// The counted seqs of one instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Window {
    instance: u64,
    /// The highest seq counted (0: none yet).
    highest: u64,
    /// Bit `i` set: seq `highest - i` was counted.
    counted: u64,
}

impl Window {
    fn fresh(instance: u64) -> Self {
        Self {
            instance,
            ..Self::default()
        }
    }

    fn contains(&self, seq: u64) -> bool {
        if seq > self.highest {
            return false;
        }
        let back = self.highest - seq;
        back >= 64 || self.counted & (1 << back) != 0
    }

    fn record(&mut self, seq: u64) {
        if seq > self.highest {
            let shift = seq - self.highest;
            self.counted = if shift >= 64 {
                0
            } else {
                self.counted << shift
            };
            self.counted |= 1;
            self.highest = seq;
        } else {
            let back = self.highest - seq;
            if back < 64 {
                self.counted |= 1 << back;
            }
        }
    }
}

/// The counted reports of one agent id, for its last [`MAX_INSTANCES`] instances.
#[derive(Clone, Debug, Default)]
pub struct ReportSeqs {
    /// Most recently used first.
    windows: Vec<Window>,
}

impl ReportSeqs {
    /// `instance` said Hello: it becomes the most recent (a new one starts with nothing
    /// counted; the oldest is forgotten past [`MAX_INSTANCES`]).
    pub fn hello(&mut self, instance: u64) {
        self.window(instance);
    }

    /// The window of `instance`, moved to the front (created if unknown).
    fn window(&mut self, instance: u64) -> &mut Window {
        let found = self.windows.iter().position(|w| w.instance == instance);
        let w = match found {
            Some(i) => self.windows.remove(i),
            None => Window::fresh(instance),
        };
        self.windows.insert(0, w);
        self.windows.truncate(MAX_INSTANCES);
        &mut self.windows[0]
    }

    /// Decides report `seq` (> 0) of `instance`: a duplicate is never admitted; otherwise
    /// `admit` is asked (the rate limit) and an admitted report is recorded as counted.
    pub fn claim(
        &mut self,
        instance: u64,
        seq: u64,
        admit: impl FnOnce() -> bool,
    ) -> ReportVerdict {
        let w = self.window(instance);
        if w.contains(seq) {
            ReportVerdict::Duplicate
        } else if admit() {
            w.record(seq);
            ReportVerdict::Count
        } else {
            ReportVerdict::Refused
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ReportVerdict::{Count, Duplicate, Refused};

    fn yes() -> bool {
        true
    }

    #[test]
    fn each_seq_is_counted_once() {
        let mut r = ReportSeqs::default();
        assert_eq!(r.claim(7, 1, yes), Count);
        assert_eq!(r.claim(7, 2, yes), Count);
        assert_eq!(r.claim(7, 1, yes), Duplicate);
        assert_eq!(r.claim(7, 2, yes), Duplicate);
        assert_eq!(r.claim(7, 3, yes), Count);
    }

    #[test]
    fn a_duplicate_does_not_ask_the_rate_limit() {
        let mut r = ReportSeqs::default();
        assert_eq!(r.claim(7, 1, yes), Count);
        assert_eq!(r.claim(7, 1, || panic!("asked")), Duplicate);
    }

    #[test]
    fn a_refused_report_is_not_recorded_and_counts_when_sent_again() {
        let mut r = ReportSeqs::default();
        assert_eq!(r.claim(7, 1, || false), Refused);
        assert_eq!(r.claim(7, 2, yes), Count);
        // Seq 1 sent again (its refusal was not heard) lies below the highest: still counted.
        assert_eq!(r.claim(7, 1, yes), Count);
        assert_eq!(r.claim(7, 1, yes), Duplicate);
    }

    #[test]
    fn seqs_arriving_out_of_order_are_each_counted_once() {
        let mut r = ReportSeqs::default();
        for seq in [5, 3, 4, 1, 2, 63 + 5] {
            assert_eq!(r.claim(1, seq, yes), Count, "seq {seq}");
        }
        for seq in [1, 2, 3, 4, 5, 68] {
            assert_eq!(r.claim(1, seq, yes), Duplicate, "seq {seq}");
        }
        assert_eq!(
            r.claim(1, 6, yes),
            Count,
            "63 below the highest is still tracked"
        );
        // A jump of 64 or more leaves everything older counted.
        assert_eq!(r.claim(1, 200, yes), Count);
        assert_eq!(r.claim(1, 136, yes), Duplicate);
        assert_eq!(r.claim(1, 137, yes), Count);
    }

    #[test]
    fn a_new_instance_starts_afresh_and_the_old_one_is_remembered() {
        let mut r = ReportSeqs::default();
        assert_eq!(r.claim(1, 1, yes), Count);
        r.hello(2);
        assert_eq!(r.claim(2, 1, yes), Count);
        assert_eq!(
            r.claim(1, 1, yes),
            Duplicate,
            "the old process's late report"
        );
        assert_eq!(r.claim(2, 1, yes), Duplicate);
    }

    #[test]
    fn only_the_latest_instances_are_kept() {
        let mut r = ReportSeqs::default();
        for instance in 1..=u64::try_from(MAX_INSTANCES).unwrap() + 1 {
            r.hello(instance);
            assert_eq!(r.claim(instance, 1, yes), Count);
        }
        assert_eq!(r.windows.len(), MAX_INSTANCES);
        assert_eq!(r.claim(1, 1, yes), Count, "instance 1 was forgotten");
        assert_eq!(r.claim(3, 1, yes), Duplicate);
    }
}
