//! Server hints about when to retry (SPEC §2 step 7): pure parsing, no clock of its own.
//!
//! - HTTP `Retry-After` (RFC 9110 §10.2.3) is either delta-seconds (`1*DIGIT`) or an HTTP-date
//!   in any of the three formats RFC 9110 §5.6.7 makes recipients accept (IMF-fixdate, obsolete
//!   RFC 850, asctime). [`parse_retry_after`] turns either into a pause relative to the `now` it is
//!   given; a malformed or negative value is an error the caller ignores (and logs).
//! - gRPC `grpc-retry-pushback-ms` (gRFC A6) is a non-negative decimal number of milliseconds;
//!   [`parse_grpc_pushback`] maps a negative or unparseable value to [`Pushback::DoNotRetry`], as
//!   A6 requires.
//!
//! Both tolerate ASCII whitespace around the value (HTTP optional whitespace; gRPC's C core also
//! skips it) and saturate huge values at [`MAX_HINT`] instead of overflowing. Header values are
//! never logged, so no error here carries the value it was given.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The longest hint either parser returns (`u32::MAX` seconds, about 136 years); larger values
/// saturate here. Any real `retry_after.max` is far below it.
pub const MAX_HINT: Duration = Duration::from_secs(u32::MAX as u64);

/// Why a `Retry-After` value was refused. Messages never include the value itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RetryAfterError {
    /// Nothing but whitespace.
    #[error("Retry-After is empty")]
    Empty,
    /// A number with a minus sign.
    #[error("Retry-After is negative")]
    Negative,
    /// A number with a fractional part; delta-seconds are whole seconds.
    #[error("Retry-After has a fraction: only whole seconds are allowed")]
    Fraction,
    /// Neither delta-seconds nor an HTTP-date.
    #[error("Retry-After is neither delta-seconds nor an HTTP-date")]
    Malformed,
}

/// Parses a `Retry-After` value into the pause it asks for, counted from `now`.
///
/// Delta-seconds (`120`) give that many seconds; an HTTP-date gives the time from `now` until it,
/// or zero if it is not after `now`. Whitespace around the value is ignored; a sign, a fraction, an
/// empty value or anything else is an error.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Result<Duration, RetryAfterError> {
    let s = value.trim_ascii();
    if s.is_empty() {
        return Err(RetryAfterError::Empty);
    }
    if let Some(n) = parse_digits(s) {
        return Ok(Duration::from_secs(n).min(MAX_HINT));
    }
    if s.strip_prefix('-').is_some_and(looks_numeric) {
        return Err(RetryAfterError::Negative);
    }
    if looks_numeric(s) {
        return Err(RetryAfterError::Fraction);
    }
    let date = httpdate::parse_http_date(s).map_err(|_| RetryAfterError::Malformed)?;
    let wait = date.duration_since(now).unwrap_or(Duration::ZERO);
    Ok(wait.min(MAX_HINT))
}

/// An HTTP `Date` value (any of the three formats RFC 9110 §5.6.7 makes recipients accept):
/// the instant it names, or `None` if it is not one. A `Retry-After` date is read against an
/// answer's `Date` when it has one, so that the clocks of the two hosts need not agree.
pub fn parse_date(value: &str) -> Option<SystemTime> {
    httpdate::parse_http_date(value.trim_ascii()).ok()
}

/// What a `grpc-retry-pushback-ms` value tells the client (gRFC A6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushback {
    /// Retry after exactly this long (it replaces the computed pause).
    After(Duration),
    /// The server asks the client not to retry this call at all.
    DoNotRetry,
}

/// Parses a `grpc-retry-pushback-ms` value.
///
/// One or more ASCII digits, optionally surrounded by ASCII whitespace, is a pause in
/// milliseconds (huge values saturate at [`MAX_HINT`]). Anything else — a minus sign, a fraction,
/// an empty value, garbage — means [`Pushback::DoNotRetry`]. A leading `+` is refused too: A6
/// defines the value as a plain decimal integer and an unparseable one errs on not retrying.
pub fn parse_grpc_pushback(value: &str) -> Pushback {
    match parse_digits(value.trim_ascii()) {
        Some(n) => Pushback::After(Duration::from_millis(n).min(MAX_HINT)),
        None => Pushback::DoNotRetry,
    }
}

/// Formats `t` as an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), dropping sub-seconds.
///
/// Times before 1970 or after 9999 cannot be written and are clamped to those years' ends.
pub fn format_http_date(t: SystemTime) -> String {
    /// 9999-12-31T23:59:59Z, the last second an HTTP-date can hold.
    const LAST: Duration = Duration::from_secs(253_402_300_799);
    let since_epoch = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    httpdate::fmt_http_date(UNIX_EPOCH + since_epoch.min(LAST))
}

/// The value of `s` if it is `1*DIGIT`, saturating at `u64::MAX`.
fn parse_digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.bytes().fold(0u64, |n, b| {
        n.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    }))
}

/// Whether `s` is digits with at most one decimal point (`15`, `1.5`, `.5`, `2.`), at least one digit.
fn looks_numeric(s: &str) -> bool {
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    (whole.len() + frac.len()) > 0
        && whole
            .bytes()
            .chain(frac.bytes())
            .all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 1994-11-06T08:49:37Z, the date in RFC 9110's examples.
    const RFC_DATE_SECS: u64 = 784_111_777;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn secs(s: u64) -> Result<Duration, RetryAfterError> {
        Ok(Duration::from_secs(s))
    }

    #[test]
    fn delta_seconds_are_whole_seconds_whatever_now_is() {
        let now = at(RFC_DATE_SECS);
        assert_eq!(parse_retry_after("120", now), secs(120));
        assert_eq!(parse_retry_after("0", now), secs(0));
        assert_eq!(parse_retry_after("007", UNIX_EPOCH), secs(7));
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        let now = at(RFC_DATE_SECS - 5);
        assert_eq!(parse_retry_after(" \t30 ", now), secs(30));
        assert_eq!(
            parse_retry_after("  Sun, 06 Nov 1994 08:49:37 GMT\t", now),
            secs(5)
        );
        assert_eq!(
            parse_retry_after("3 0", now),
            Err(RetryAfterError::Malformed)
        );
    }

    #[test]
    fn huge_delta_seconds_saturate_instead_of_overflowing() {
        let now = at(0);
        assert_eq!(parse_retry_after("4294967295", now), Ok(MAX_HINT));
        assert_eq!(parse_retry_after("4294967296", now), Ok(MAX_HINT));
        assert_eq!(parse_retry_after(&"9".repeat(400), now), Ok(MAX_HINT));
    }

    #[test]
    fn each_http_date_format_counts_from_now() {
        let now = at(RFC_DATE_SECS - 120);
        for value in [
            "Sun, 06 Nov 1994 08:49:37 GMT",  // IMF-fixdate
            "Sunday, 06-Nov-94 08:49:37 GMT", // obsolete RFC 850
            "Sun Nov  6 08:49:37 1994",       // asctime
        ] {
            assert_eq!(parse_retry_after(value, now), secs(120), "{value}");
        }
    }

    #[test]
    fn a_date_counts_from_a_now_with_sub_seconds() {
        let now = at(RFC_DATE_SECS - 10) + Duration::from_millis(250);
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            Ok(Duration::from_millis(9_750))
        );
    }

    #[test]
    fn a_date_in_the_past_or_now_gives_zero() {
        let value = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(parse_retry_after(value, at(RFC_DATE_SECS)), secs(0));
        assert_eq!(parse_retry_after(value, at(RFC_DATE_SECS + 3600)), secs(0));
        assert_eq!(parse_retry_after(value, at(2_000_000_000)), secs(0));
    }

    #[test]
    fn negative_values_are_refused() {
        for value in ["-1", "-0", " -30 ", "-1.5", "-.5"] {
            assert_eq!(
                parse_retry_after(value, UNIX_EPOCH),
                Err(RetryAfterError::Negative),
                "{value}"
            );
        }
    }

    #[test]
    fn fractions_are_refused() {
        for value in ["1.5", "0.0", ".5", "2."] {
            assert_eq!(
                parse_retry_after(value, UNIX_EPOCH),
                Err(RetryAfterError::Fraction),
                "{value}"
            );
        }
    }

    #[test]
    fn empty_and_garbage_are_refused() {
        assert_eq!(
            parse_retry_after("", UNIX_EPOCH),
            Err(RetryAfterError::Empty)
        );
        assert_eq!(
            parse_retry_after(" \t ", UNIX_EPOCH),
            Err(RetryAfterError::Empty)
        );
        for value in [
            "abc",
            "+5",
            "5s",
            "1e3",
            "-",
            "-abc",
            ".",
            "1.2.3",
            "١٢",
            "Mon, 06 Nov 1994 08:49:37 GMT", // wrong weekday
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 31 Feb 1994 08:49:37 GMT",
        ] {
            assert_eq!(
                parse_retry_after(value, UNIX_EPOCH),
                Err(RetryAfterError::Malformed),
                "{value}"
            );
        }
    }

    #[test]
    fn error_messages_never_echo_the_header_value() {
        for value in ["secret-token", "-4242", "42.42", "   "] {
            let err = parse_retry_after(value, UNIX_EPOCH)
                .unwrap_err()
                .to_string();
            assert!(!err.contains("42") && !err.contains("secret"), "{err}");
        }
    }

    #[test]
    fn format_http_date_writes_imf_fixdate_and_clamps_instead_of_panicking() {
        assert_eq!(
            format_http_date(at(RFC_DATE_SECS) + Duration::from_millis(999)),
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
        assert_eq!(
            format_http_date(UNIX_EPOCH - Duration::from_secs(1)),
            "Thu, 01 Jan 1970 00:00:00 GMT"
        );
        assert_eq!(
            format_http_date(at(300_000_000_000)),
            "Fri, 31 Dec 9999 23:59:59 GMT"
        );
    }

    #[test]
    fn pushback_of_whole_milliseconds_says_after() {
        assert_eq!(parse_grpc_pushback("0"), Pushback::After(Duration::ZERO));
        assert_eq!(
            parse_grpc_pushback("1500"),
            Pushback::After(Duration::from_millis(1500))
        );
        assert_eq!(
            parse_grpc_pushback(&"9".repeat(40)),
            Pushback::After(MAX_HINT)
        );
    }

    #[test]
    fn pushback_tolerates_surrounding_whitespace() {
        assert_eq!(
            parse_grpc_pushback(" 5"),
            Pushback::After(Duration::from_millis(5))
        );
        assert_eq!(
            parse_grpc_pushback("5\t "),
            Pushback::After(Duration::from_millis(5))
        );
    }

    #[test]
    fn pushback_negative_or_unparseable_says_do_not_retry() {
        for value in [
            "-1", "-0", "abc", "", "  ", "1.5", "+5", "5ms", "5 5", "0x10",
        ] {
            assert_eq!(
                parse_grpc_pushback(value),
                Pushback::DoNotRetry,
                "{value:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn formatted_dates_parse_back_to_the_same_offset(
            now in 0u64..4_000_000_000,
            k in 0u64..(10 * 366 * 86_400),
        ) {
            let value = format_http_date(at(now + k));
            prop_assert_eq!(parse_retry_after(&value, at(now)), secs(k));
        }

        #[test]
        fn delta_seconds_round_trip(n: u32) {
            prop_assert_eq!(parse_retry_after(&n.to_string(), UNIX_EPOCH), secs(n.into()));
            prop_assert_eq!(
                parse_grpc_pushback(&n.to_string()),
                Pushback::After(Duration::from_millis(n.into()))
            );
        }

        #[test]
        fn parsers_never_panic_on_any_input(value in ".{0,64}", now: u64) {
            let _ = parse_retry_after(&value, at(now % 300_000_000_000));
            let _ = parse_grpc_pushback(&value);
        }
    }
}
