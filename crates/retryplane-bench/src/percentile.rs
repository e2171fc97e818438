//! The nearest-rank percentile the benches report, shared by the fan-out and admin benches.

/// The nearest-rank `p` percentile (0 < p <= 1) of `values`; 0 when empty.
pub fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    // Nearest rank: the smallest value with at least p of the values at or below it.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rank = (p * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), 10.0);
        assert_eq!(percentile(&mut v, 0.99), 20.0);
        let mut v: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.99), 990.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
