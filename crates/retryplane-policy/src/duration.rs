//! Durations as written in policy files: a number and a unit (`250ms`, `2s`, `1.5m`, `1h`).
//!
//! Hand-written rather than taken from `humantime`: the accepted grammar is part of the policy
//! contract (a unit is required, only `ms`, `s`, `m`, `h`, no compound forms, millisecond
//! resolution), and the error messages must say exactly what is wrong.

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// No unit after the number, such as `100`.
    #[error(
        "duration `{0}` needs a unit: ms, s, m or h (such as {example})",
        example = unit_example(.0)
    )]
    MissingUnit(String),
    /// A unit other than the four accepted.
    #[error("duration `{value}` has an unknown unit `{unit}`: use ms, s, m or h")]
    UnknownUnit {
        /// The whole string.
        value: String,
        /// The unit as written.
        unit: String,
    },
    /// Not a number followed by a unit.
    #[error("`{0}` is not a duration: write a number and a unit, such as `250ms` or `2s`")]
    Malformed(String),
    /// A negative value.
    #[error("duration `{0}` is negative")]
    Negative(String),
    /// Larger than a day or finer than a millisecond.
    #[error("duration `{0}` is out of range: between 1ms and 24h, in whole milliseconds")]
    OutOfRange(String),
}

/// The examples a number written without a unit is given: itself in milliseconds and in
/// seconds, those of the two that are durations (`1.5` → `1.5s` alone: no duration is finer
/// than a millisecond), or a plain example when neither is (a number past a day). Both, so
/// that the reader chooses: a `deadline: 3` meant as seconds and copied as `3ms` from a
/// single example would time out every call.
fn unit_example(number: &str) -> String {
    let number = number.trim();
    let examples: Vec<String> = ["ms", "s"]
        .iter()
        .map(|unit| format!("{number}{unit}"))
        .filter(|candidate| parse_duration(candidate).is_ok())
        .map(|candidate| format!("`{candidate}`"))
        .collect();
    if examples.is_empty() {
        return "`250ms`".to_owned();
    }
    examples.join(" or ")
}

/// The longest duration a policy may hold.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// Parses a policy duration. Zero is accepted here (`0s`); whether zero is allowed is up to the
/// field's validation.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let s = input.trim();
    if s.starts_with('-') {
        return Err(DurationError::Negative(input.to_owned()));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    // A number has a digit: `.s` is no zero, nor is YAML's `.inf` a number of `inf`.
    if !number.bytes().any(|b| b.is_ascii_digit())
        || number.chars().filter(|c| *c == '.').count() > 1
    {
        return Err(DurationError::Malformed(input.to_owned()));
    }
    if unit.is_empty() {
        return Err(DurationError::MissingUnit(input.to_owned()));
    }
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        other if other.chars().all(|c| c.is_ascii_alphabetic()) => {
            return Err(DurationError::UnknownUnit {
                value: input.to_owned(),
                unit: other.to_owned(),
            });
        }
        _ => return Err(DurationError::Malformed(input.to_owned())),
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let out_of_range = || DurationError::OutOfRange(input.to_owned());
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| out_of_range())?
    };
    let mut millis = whole
        .checked_mul(millis_per_unit)
        .ok_or_else(out_of_range)?;
    if !frac.is_empty() {
        // Exact decimal arithmetic: digits past a millisecond must be zero.
        let mut scale = millis_per_unit;
        for digit in frac.bytes() {
            let d = u64::from(digit - b'0');
            if !scale.is_multiple_of(10) {
                if d != 0 {
                    return Err(out_of_range());
                }
                continue;
            }
            scale /= 10;
            // A whole part near `u64::MAX` milliseconds plus its fraction must not wrap to a
            // small duration.
            millis = d
                .checked_mul(scale)
                .and_then(|add| millis.checked_add(add))
                .ok_or_else(out_of_range)?;
        }
    }
    let duration = Duration::from_millis(millis);
    if duration > MAX_DURATION {
        return Err(out_of_range());
    }
    Ok(duration)
}

/// Formats a duration the way a policy file would write it: the largest unit that keeps it
/// exact (`1m`, `90s`, `1500ms`).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{}µs", d.as_micros());
    }
    for (unit, size) in [("h", 3_600_000u128), ("m", 60_000), ("s", 1_000)] {
        if ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_number_without_a_unit_is_given_examples_that_are_durations() {
        let example = |s: &str| {
            let message = parse_duration(s).unwrap_err().to_string();
            let start = message.find("(such as `").unwrap() + "(such as `".len();
            message[start..message.len() - 2]
                .split("` or `")
                .next()
                .unwrap()
                .to_owned()
        };
        assert_eq!(
            parse_duration("100").unwrap_err().to_string(),
            "duration `100` needs a unit: ms, s, m or h (such as `100ms` or `100s`)"
        );
        assert_eq!(example("0"), "0ms");
        assert_eq!(example("1.5"), "1.5s");
        assert_eq!(example("0.5"), "0.5s");
        assert_eq!(example("100000000"), "250ms");
        for given in ["0", "1.5", "0.5", "100000000", "7"] {
            assert!(parse_duration(&example(given)).is_ok(), "{given}");
        }
    }

    #[test]
    fn accepts_each_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0.25m"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn a_bare_number_needs_a_unit() {
        assert_eq!(
            parse_duration("100"),
            Err(DurationError::MissingUnit("100".into()))
        );
    }

    #[test]
    fn rejects_unknown_units_negative_and_garbage() {
        assert!(matches!(
            parse_duration("5sec"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_duration("-1s"),
            Err(DurationError::Negative(_))
        ));
        assert!(matches!(
            parse_duration("ms"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("1..2s"),
            Err(DurationError::Malformed(_))
        ));
        for no_digit in [".s", ".ms", ".inf", ".nan", ".Inf", "."] {
            assert!(
                matches!(parse_duration(no_digit), Err(DurationError::Malformed(_))),
                "{no_digit}: {:?}",
                parse_duration(no_digit)
            );
        }
        assert_eq!(parse_duration(".5s"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5.s"), Ok(Duration::from_secs(5)));
        assert!(matches!(
            parse_duration("1.0001s"),
            Err(DurationError::OutOfRange(_))
        ));
        assert!(matches!(
            parse_duration("25h"),
            Err(DurationError::OutOfRange(_))
        ));
        assert!(matches!(
            parse_duration("99999999999999999999h"),
            Err(DurationError::OutOfRange(_))
        ));
    }

    #[test]
    fn a_huge_duration_is_out_of_range_not_wrapped() {
        // Each of these used to wrap around `u64::MAX` milliseconds to a small duration (or to
        // zero), and was accepted as such.
        for s in [
            "5124095576030.9h",
            "18446744073709551.617s",
            "18446744073709551.616s",
            "18446744073709551.615s",
            "307445734561825.9m",
        ] {
            assert_eq!(
                parse_duration(s),
                Err(DurationError::OutOfRange(s.into())),
                "{s}"
            );
        }
    }

    proptest::proptest! {
        /// Any decimal number of any unit parses to exactly its value in milliseconds when that
        /// is at most a day and whole, and is refused as out of range otherwise; never a
        /// different value.
        #[test]
        fn a_parsed_duration_is_the_value_written(
            pick in 0u8..3,
            any_whole in proptest::prelude::any::<u64>(),
            small in 0u64..200_000,
            below_edge in 0u64..3,
            frac in "[0-9]{0,6}",
            unit in proptest::sample::select(vec![("ms", 1u128), ("s", 1_000), ("m", 60_000), ("h", 3_600_000)]),
        ) {
            // Small values, any value, and values just below where the unit's milliseconds
            // reach `u64::MAX` (where a fraction could wrap).
            let edge = u64::MAX / u64::try_from(unit.1).unwrap_or(1);
            let whole = match pick {
                0 => small,
                1 => any_whole,
                _ => edge - below_edge,
            };
            let text = if frac.is_empty() {
                format!("{whole}{}", unit.0)
            } else {
                format!("{whole}.{frac}{}", unit.0)
            };
            // The exact value in units of 10^-6 ms.
            let scale = 10u128.pow(6);
            let frac_micro: u128 = if frac.is_empty() {
                0
            } else {
                frac.parse::<u128>().unwrap_or(0) * 10u128.pow(6 - u32::try_from(frac.len()).unwrap_or(6))
            };
            let exact = (u128::from(whole) * scale + frac_micro) * unit.1;
            let millis = exact / scale;
            let whole_ms = exact.is_multiple_of(scale);
            let max = MAX_DURATION.as_millis();
            match parse_duration(&text) {
                Ok(d) => {
                    proptest::prop_assert!(whole_ms && millis <= max, "{text} accepted as {d:?}");
                    proptest::prop_assert_eq!(d.as_millis(), millis, "{}", text);
                }
                Err(e) => {
                    proptest::prop_assert_eq!(e, DurationError::OutOfRange(text.clone()));
                    proptest::prop_assert!(!whole_ms || millis > max, "{} refused", text);
                }
            }
        }
    }

    #[test]
    fn formats_with_the_largest_exact_unit() {
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(90)), "90s");
        assert_eq!(format_duration(Duration::from_secs(120)), "2m");
        assert_eq!(format_duration(Duration::ZERO), "0s");
        for s in ["250ms", "2s", "1m", "1h", "15s"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
    }
}
