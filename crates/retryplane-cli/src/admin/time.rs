//! Unix milliseconds as RFC 3339 UTC dates.
//!
//! Hand-written rather than a date crate: UTC needs no time-zone data, this is the only date
//! the CLI prints, and the conversion is Howard Hinnant's `civil_from_days`
//! (<https://howardhinnant.github.io/date_algorithms.html>), exact over the proleptic Gregorian
//! calendar for every non-negative day count.

/// `2025-11-30T03:37:05Z`: a Unix time in milliseconds, to the second (the milliseconds are
/// dropped, not rounded).
pub fn rfc3339_utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, of_day) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    )
}

/// The wall clock in Unix milliseconds (0 before 1970): for what is shown, never for a
/// decision that tests must control.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// [`rfc3339_utc`], or `-` for 0 (never).
pub fn rfc3339_or_dash(unix_ms: u64) -> String {
    if unix_ms == 0 {
        "-".to_owned()
    } else {
        rfc3339_utc(unix_ms)
    }
}

/// (year, month 1..=12, day 1..=31) of the day `days` after 1970-01-01.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Shift the epoch to 0000-03-01, so that the leap day ends each 400-year era's year.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z - era * 146_097; // 0..=146_096
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153; // 0 = March .. 11 = February
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_and_known_dates_print_in_utc() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(999), "1970-01-01T00:00:00Z");
        // `date -u -d @1764473825` → Sun Nov 30 03:37:05 UTC 2025.
        assert_eq!(rfc3339_utc(1_764_473_825_123), "2025-11-30T03:37:05Z");
        // The last second of a leap year, and the day after February 28 in one.
        assert_eq!(rfc3339_utc(1_735_689_599_000), "2024-12-31T23:59:59Z");
        assert_eq!(rfc3339_utc(1_709_164_800_000), "2024-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400_000), "2000-02-29T00:00:00Z");
        // 2100 is not a leap year.
        assert_eq!(rfc3339_utc(4_107_542_400_000), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn every_day_follows_the_previous_one() {
        let mut previous = civil_from_days(0);
        for days in 1..(200 * 366) {
            let (y, m, d) = civil_from_days(days);
            let (py, pm, pd) = previous;
            let next_day = (y, m, d) == (py, pm, pd + 1);
            let next_month = (y, m, d) == (py, pm + 1, 1);
            let next_year = (y, m, d) == (py + 1, 1, 1) && (pm, pd) == (12, 31);
            assert!(
                next_day || next_month || next_year,
                "{previous:?} -> {:?}",
                (y, m, d)
            );
            previous = (y, m, d);
        }
    }

    #[test]
    fn zero_means_never() {
        assert_eq!(rfc3339_or_dash(0), "-");
        assert_eq!(rfc3339_or_dash(1000), "1970-01-01T00:00:01Z");
    }
}
