//! The order of ranked series: how the control plane picks the worst ones for a `Stats` request
//! with a `limit`, and how `retryplane top` orders the rows it shows. Both use this one function,
//! so the rows a limited answer keeps are the ones the CLI puts first.

use std::cmp::Ordering;

/// What a (service, endpoint) series is ranked by, over one window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rank<'a> {
    /// `retries / calls` in the window; `None` when the window has no calls.
    pub retry_ratio: Option<f64>,
    /// Whether the series' retry-ratio alert is firing.
    pub firing: bool,
    /// The calling service.
    pub service: &'a str,
    /// The endpoint.
    pub endpoint: &'a str,
}

impl<'a> Rank<'a> {
    /// The rank of a series with `retries` and `calls` in the window.
    pub fn new(
        retries: u64,
        calls: u64,
        firing: bool,
        service: &'a str,
        endpoint: &'a str,
    ) -> Self {
        Self {
            retry_ratio: retry_ratio(retries, calls),
            firing,
            service,
            endpoint,
        }
    }
}

/// `retries / calls`, or `None` without calls.
pub fn retry_ratio(retries: u64, calls: u64) -> Option<f64> {
    (calls > 0).then(|| retries as f64 / calls as f64)
}

/// Worst first: the highest retry ratio first, series without calls in the window last; then
/// firing alerts first; then by service and endpoint, so that the order is the same from one
/// refresh to the next.
pub fn worst_first(a: &Rank<'_>, b: &Rank<'_>) -> Ordering {
    let by_ratio = match (a.retry_ratio, b.retry_ratio) {
        (Some(x), Some(y)) => y.total_cmp(&x),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    };
    by_ratio
        .then_with(|| b.firing.cmp(&a.firing))
        .then_with(|| (a.service, a.endpoint).cmp(&(b.service, b.endpoint)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_ratio_first_then_firing_then_names_and_no_calls_last() {
        let mut ranks = [
            Rank::new(0, 0, true, "a", "idle-firing"),
            Rank::new(0, 0, false, "a", "idle"),
            Rank::new(1, 100, false, "a", "low"),
            Rank::new(30, 100, false, "b", "high"),
            Rank::new(10, 100, false, "b", "mid"),
            Rank::new(10, 100, false, "a", "mid"),
            Rank::new(10, 100, true, "c", "mid-firing"),
        ];
        ranks.sort_by(worst_first);
        let order: Vec<(&str, &str)> = ranks.iter().map(|r| (r.service, r.endpoint)).collect();
        assert_eq!(
            order,
            [
                ("b", "high"),
                ("c", "mid-firing"),
                ("a", "mid"),
                ("b", "mid"),
                ("a", "low"),
                ("a", "idle-firing"),
                ("a", "idle"),
            ]
        );
    }

    #[test]
    fn no_calls_is_no_ratio_and_a_zero_ratio_still_ranks_above_it() {
        assert_eq!(retry_ratio(5, 0), None);
        assert_eq!(retry_ratio(0, 4), Some(0.0));
        let zero = Rank::new(0, 4, false, "z", "z");
        let none = Rank::new(0, 0, true, "a", "a");
        assert_eq!(worst_first(&zero, &none), Ordering::Less);
    }
}
