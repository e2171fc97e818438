//! Parsers of command-line values that several subcommands share.

use std::time::Duration;

use retryplane_policy::duration::{DurationError, parse_duration};

/// A whole number of 1 or more, at most `max`; the error says which rule it breaks, in words
/// (clap's own range check says `0 is not in 1..18446744073709551615`).
fn at_least_one_upto(text: &str, max: u64) -> Result<u64, String> {
    let n = match text.parse::<u64>() {
        Ok(n) => n,
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
            return Err(format!("must be at most {max}"));
        }
        // A whole number all the same: only its sign is wrong.
        Err(_)
            if text
                .strip_prefix('-')
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())) =>
        {
            return Err("must be 1 or more".to_owned());
        }
        Err(_) => return Err("not a whole number: write 1 or more".to_owned()),
    };
    if n == 0 {
        return Err("must be 1 or more".to_owned());
    }
    if n > max {
        return Err(format!("must be at most {max}"));
    }
    Ok(n)
}

/// A count or version number of 1 or more ([`at_least_one_upto`]).
pub(crate) fn at_least_one(text: &str) -> Result<u64, String> {
    at_least_one_upto(text, u64::MAX)
}

/// [`at_least_one`], for a `u32`.
pub(crate) fn at_least_one_u32(text: &str) -> Result<u32, String> {
    let n = at_least_one_upto(text, u64::from(u32::MAX))?;
    u32::try_from(n).map_err(|_| format!("must be at most {}", u32::MAX))
}

/// [`at_least_one`], for a `usize`.
pub(crate) fn at_least_one_usize(text: &str) -> Result<usize, String> {
    let max = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
    let n = at_least_one_upto(text, max)?;
    usize::try_from(n).map_err(|_| format!("must be at most {max}"))
}

/// A policy-style duration within `range` (`said` is the range in words).
pub(crate) fn duration_in(
    text: &str,
    range: std::ops::RangeInclusive<Duration>,
    said: &str,
) -> Result<Duration, String> {
    let duration = parse_duration(text).map_err(|e| match e {
        // Its example keeps the number (`0` → `0ms`), which may well be out of range here.
        DurationError::MissingUnit(_) => {
            format!("duration `{text}` needs a unit (ms, s, m or h): {said}")
        }
        // Past a day or finer than a millisecond: the flag's own range, not a policy file's.
        DurationError::OutOfRange(_) => {
            format!("`{text}` is out of range: {said}, in whole milliseconds")
        }
        e => e.to_string(),
    })?;
    if range.contains(&duration) {
        Ok(duration)
    } else {
        Err(format!("`{text}` is out of range: {said}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_of_one_or_more_says_in_words_what_is_wrong() {
        assert_eq!(at_least_one("1"), Ok(1));
        assert_eq!(at_least_one("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(at_least_one("0"), Err("must be 1 or more".to_owned()));
        assert_eq!(
            at_least_one("x"),
            Err("not a whole number: write 1 or more".to_owned())
        );
        assert_eq!(at_least_one("-1"), Err("must be 1 or more".to_owned()));
        assert_eq!(
            at_least_one("-"),
            Err("not a whole number: write 1 or more".to_owned())
        );
        assert_eq!(
            at_least_one("18446744073709551616"),
            Err("must be at most 18446744073709551615".to_owned())
        );
        assert_eq!(at_least_one_u32("4294967295"), Ok(u32::MAX));
        assert_eq!(
            at_least_one_u32("4294967296"),
            Err("must be at most 4294967295".to_owned())
        );
        assert_eq!(at_least_one_usize("7"), Ok(7));
        assert_eq!(at_least_one_usize("0"), Err("must be 1 or more".to_owned()));
    }
}
