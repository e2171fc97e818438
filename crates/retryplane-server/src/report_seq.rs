//! Which numbered metrics reports of one agent id were counted, so that a report sent again
//! after a lost stream is counted once (`MetricsReport.seq`, `MetricsAck` in `agent.proto`).
//!
//! Kept in the agent's [`crate::fleet`] entry, which outlives its streams: a reconnect, and a
//! second stream that replaces the first, see the same record, so a late report of the old
//! stream and the same report sent again on the new one cannot both be counted. Per instance
//! (`Hello.instance_id`, drawn anew by each agent process) the record is the highest seq decided
//! and two 64-bit masks of which of the 64 seqs up to it were counted and which were refused
//! (the rate limit); a seq more than 63 below the highest is out of the window: answered as
//! counted and not counted ([`ReportVerdict::OutOfWindow`], counted apart). A refused seq stays
//! refused: the agent puts a refused report's counts back into its counters and sends them under
//! a new seq, so the same seq arriving later (a replaced stream's late copy, or a resend whose
//! refusal was not heard) must not be counted too. The agent keeps at most a handful of reports unacknowledged and
//! sends them again in order before anything newer, so a report it sends again is always well
//! inside those 64. The [`MAX_INSTANCES`] instances that said Hello last are kept: an older
//! stream of a replaced process is still told apart while it drains.
//!
//! Memory: `MAX_INSTANCES` × 32 bytes per fleet entry, and fleet entries are bounded
//! ([`crate::fleet::MAX_DISCONNECTED`] disconnected ones). When an agent's entry is forgotten
//! its record is kept a while longer, apart (the newest [`crate::fleet::MAX_FORGOTTEN`]), and
//! taken back if the agent comes back; a report it sends again after that is counted again.

/// Instances remembered per agent id (the newest Hello first): enough for processes that share
/// one agent id (pods of a Deployment given the same `agent_id`, whose streams replace each
/// other), so that a report one of them sends again after a lost acknowledgement is still known
/// as counted. At 4, a fifth process pushed the window out and such a report was counted again.
pub const MAX_INSTANCES: usize = 16;

/// What to do with a numbered report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportVerdict {
    /// Not counted before and admitted: count it now (it is recorded as counted).
    Count,
    /// Counted before: do not count it again; acknowledge it.
    Duplicate,
    /// Refused now (the rate limit): count nothing; the agent sends the counts again under a
    /// new seq.
    Refused,
    /// Refused before, and sent again (a replaced stream's late copy, a resend whose refusal
    /// was not heard): count nothing and answer it refused again; it was dropped once already.
    RefusedBefore,
    /// More than 63 below the highest seq decided for its instance: whether it was counted is
    /// no longer known, so it is answered as counted and not counted. The agent never sends
    /// one (it keeps a handful unacknowledged and sends them in order); a client that does
    /// loses those counts, which the control plane counts apart from duplicates.
    OutOfWindow,
}

/// The decided seqs of one instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Window {
    instance: u64,
    /// The highest seq decided, counted or refused (0: none yet).
    highest: u64,
    /// Bit `i` set: seq `highest - i` was counted.
    counted: u64,
    /// Bit `i` set: seq `highest - i` was refused.
    refused: u64,
}

impl Window {
    fn fresh(instance: u64) -> Self {
        Self {
            instance,
            ..Self::default()
        }
    }

    /// What was decided for `seq` before, if anything.
    fn decided(&self, seq: u64) -> Option<ReportVerdict> {
        if seq > self.highest {
            return None;
        }
        let back = self.highest - seq;
        if back >= 64 {
            Some(ReportVerdict::OutOfWindow)
        } else if self.counted & (1 << back) != 0 {
            Some(ReportVerdict::Duplicate)
        } else if self.refused & (1 << back) != 0 {
            Some(ReportVerdict::RefusedBefore)
        } else {
            None
        }
    }

    /// Records `seq` as counted, or as refused.
    fn record(&mut self, seq: u64, refused: bool) {
        if seq > self.highest {
            let shift = seq - self.highest;
            let slide = |mask: u64| if shift >= 64 { 0 } else { mask << shift };
            self.counted = slide(self.counted);
            self.refused = slide(self.refused);
            self.highest = seq;
        }
        let back = self.highest - seq;
        if back < 64 {
            let mask = if refused {
                &mut self.refused
            } else {
                &mut self.counted
            };
            *mask |= 1 << back;
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
    /// Whether any report was decided (counted or refused).
    pub fn any_decided(&self) -> bool {
        self.windows.iter().any(|w| w.highest > 0)
    }

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

    /// Decides report `seq` (> 0) of `instance`: a seq decided before gets the same answer
    /// (`Duplicate` once counted, `RefusedBefore` once refused) without asking `admit`; otherwise
    /// `admit` is asked (the rate limit) and the answer is recorded.
    pub fn claim(
        &mut self,
        instance: u64,
        seq: u64,
        admit: impl FnOnce() -> bool,
    ) -> ReportVerdict {
        let w = self.window(instance);
        if let Some(before) = w.decided(seq) {
            return before;
        }
        if admit() {
            w.record(seq, false);
            ReportVerdict::Count
        } else {
            w.record(seq, true);
            ReportVerdict::Refused
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ReportVerdict::{Count, Duplicate, OutOfWindow, Refused, RefusedBefore};

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
    fn a_refused_report_stays_refused() {
        let mut r = ReportSeqs::default();
        assert_eq!(r.claim(7, 1, || false), Refused);
        assert_eq!(r.claim(7, 2, yes), Count);
        // Seq 1 again (a replaced stream's late copy, or a resend whose refusal was not
        // heard): the agent sends its counts under a new seq, so this one must not count.
        assert_eq!(r.claim(7, 1, || panic!("asked")), RefusedBefore);
        assert_eq!(r.claim(7, 2, yes), Duplicate);
        // Refusals slide with the window like counts.
        assert_eq!(r.claim(7, 70, || false), Refused);
        assert_eq!(
            r.claim(7, 1, yes),
            OutOfWindow,
            "69 below: out of the window"
        );
        assert_eq!(r.claim(7, 70, yes), RefusedBefore);
        assert_eq!(r.claim(7, 69, yes), Count);
    }

    #[test]
    fn seqs_arriving_out_of_order_are_each_counted_once() {
        let mut r = ReportSeqs::default();
        for seq in [5, 3, 4, 1, 2, 63 + 5] {
            assert_eq!(r.claim(1, seq, yes), Count, "seq {seq}");
        }
        for seq in [1, 2, 3, 4] {
            assert_eq!(r.claim(1, seq, yes), OutOfWindow, "seq {seq}");
        }
        for seq in [5, 68] {
            assert_eq!(r.claim(1, seq, yes), Duplicate, "seq {seq}");
        }
        assert_eq!(
            r.claim(1, 6, yes),
            Count,
            "63 below the highest is still tracked"
        );
        // A jump of 64 or more leaves everything older out of the window.
        assert_eq!(r.claim(1, 200, yes), Count);
        assert_eq!(r.claim(1, 136, || panic!("asked")), OutOfWindow);
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
