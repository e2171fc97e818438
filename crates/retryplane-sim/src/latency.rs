//! How long logical calls took, kept in a histogram so a run's memory does not grow with its
//! calls.
//!
//! A run can make 20 million calls per variant, and the four variants run at once: keeping
//! every call's latency took about 160 MB per variant (820 MB resident for the whole command
//! at that size). [`hdrhistogram`] keeps them in a few MB whatever the count, with four
//! significant figures: a percentile read from it is within 0.01 % of the exact nearest-rank
//! value (under 2 µs at 15 ms, under 0.1 ms at 1.5 s), below what the report prints.

use hdrhistogram::Histogram;

/// Significant figures kept: relative error ≤ 1/16,384 for every value.
const SIGNIFICANT_FIGURES: u8 = 4;

/// The largest latency kept as itself, 2^50 ns (about 13 days): longer ones (none: a run lasts
/// at most a day, and a call's pauses are bounded by its policy) are kept as this.
const LONGEST: u64 = 1 << 50;

/// Latencies of logical calls, in nanoseconds of virtual time.
#[derive(Clone, Debug, PartialEq)]
pub struct Latencies(Histogram<u64>);

impl Default for Latencies {
    fn default() -> Self {
        // `Histogram::new` refuses only more than 5 significant figures; it grows to the
        // largest value recorded.
        #[allow(clippy::expect_used)]
        let histogram = Histogram::new(SIGNIFICANT_FIGURES).expect("4 significant figures");
        Self(histogram)
    }
}

impl Latencies {
    /// Adds one call that took `nanos`.
    pub fn record(&mut self, nanos: u64) {
        let nanos = nanos.min(LONGEST);
        // Growing to 2^50 cannot fail on a 64-bit target (it fails only when the buckets
        // would not fit in a `usize`); if it ever did, the value is kept as the largest one
        // the histogram holds.
        if self.0.record(nanos).is_err() {
            self.0.saturating_record(nanos);
        }
    }

    /// Calls recorded.
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// Whether no call was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The latency at rank `ceil(p × n)` (nearest rank), as the middle of the histogram's
    /// bucket that holds it; 0 when no call was recorded.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.0.is_empty() {
            return 0;
        }
        self.0.median_equivalent(self.0.value_at_quantile(p))
    }
}

impl FromIterator<u64> for Latencies {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Self {
        let mut latencies = Self::default();
        for nanos in iter {
            latencies.record(nanos);
        }
        latencies
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Latencies = (1..=100).rev().collect();
        assert_eq!(v.len(), 100);
        assert_eq!(v.percentile(0.5), 50);
        assert_eq!(v.percentile(0.99), 99);
        assert_eq!(
            std::iter::once(7).collect::<Latencies>().percentile(0.99),
            7
        );
        assert_eq!(Latencies::default().percentile(0.5), 0);
        assert!(Latencies::default().is_empty());
    }

    #[test]
    fn percentiles_are_within_a_hundredth_of_a_percent_of_the_exact_ones() {
        // Spread over six orders of magnitude (1 µs to 10 s), as a run's latencies are: the
        // nearest-rank value of the sorted list, against the histogram's.
        let mut exact: Vec<u64> = (0..200_000u64)
            .map(|i| 1_000 + i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % 10_000_000_000)
            .collect();
        let kept: Latencies = exact.iter().copied().collect();
        exact.sort_unstable();
        for p in [0.001, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0] {
            let rank = ((p * exact.len() as f64).ceil() as usize).clamp(1, exact.len());
            let want = exact[rank - 1] as f64;
            let got = kept.percentile(p) as f64;
            assert!(
                (got - want).abs() <= want * 1e-4,
                "p{p}: {got} against the exact {want}"
            );
        }
    }

    #[test]
    fn the_memory_kept_does_not_grow_with_the_calls() {
        let mut v = Latencies::default();
        for i in 0..1_000_000u64 {
            v.record(20_000_000 + i % 1_000_000_000);
        }
        let grown = v.0.distinct_values();
        for i in 0..1_000_000u64 {
            v.record(20_000_000 + i % 1_000_000_000);
        }
        assert_eq!(v.0.distinct_values(), grown);
        assert!(grown < 1 << 20, "{grown} buckets");
        // And a value past the longest kept is counted as the longest.
        v.record(u64::MAX);
        assert_eq!(v.len(), 2_000_001);
        assert_eq!(v.0.max(), v.0.highest_equivalent(LONGEST));
    }
}
