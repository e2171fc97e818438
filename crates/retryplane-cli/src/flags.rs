//! Parsers of command-line values that several subcommands share.

use std::time::Duration;

use retryplane_policy::duration::{DurationError, parse_duration};

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
