//! The server hints of SPEC §2 step 7 (`retry_after.rs`): HTTP `Retry-After` (delta-seconds or
//! an HTTP-date in any of RFC 9110's three formats) and gRPC `grpc-retry-pushback-ms`. Neither
//! parser may panic; every pause is at most `MAX_HINT`; the documented forms are accepted with
//! the documented values, whatever `now` is.
#![no_main]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use retryplane_policy::retry_after::{
    MAX_HINT, Pushback, RetryAfterError, format_http_date, parse_date, parse_grpc_pushback,
    parse_retry_after,
};

/// 9999-12-31T23:59:59Z, the last second an HTTP-date can hold.
const LAST: u64 = 253_402_300_799;

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    for (i, slot) in b.iter_mut().enumerate() {
        *slot = data.get(at + i).copied().unwrap_or(0);
    }
    u64::from_le_bytes(b)
}

/// `1*DIGIT` with no sign, the one form both parsers take as a number.
fn digits(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| {
        s.bytes()
            .fold(0u64, |n, b| n.saturating_mul(10).saturating_add(u64::from(b - b'0')))
    })
}

fn check_value(value: &str, now: SystemTime) {
    let trimmed = value.trim_ascii();
    let got = parse_retry_after(value, now);
    if let Ok(d) = got {
        assert!(d <= MAX_HINT, "Retry-After pause {d:?} above MAX_HINT");
    }
    if let Some(n) = digits(trimmed) {
        assert_eq!(got, Ok(Duration::from_secs(n).min(MAX_HINT)), "delta-seconds");
    } else if trimmed.is_empty() {
        assert_eq!(got, Err(RetryAfterError::Empty));
    } else if trimmed.starts_with('-') && got.is_ok() {
        panic!("a value with a minus sign was accepted: {got:?}");
    }
    // A date `Retry-After` reads exactly as `parse_date` reads the same text.
    if digits(trimmed).is_none()
        && let Ok(d) = got
    {
        let date = parse_date(value).expect("Retry-After read a date that parse_date refuses");
        assert_eq!(d, date.duration_since(now).unwrap_or(Duration::ZERO).min(MAX_HINT));
    }
    match parse_grpc_pushback(value) {
        Pushback::After(d) => {
            assert!(d <= MAX_HINT);
            let n = digits(trimmed).expect("pushback accepted something other than digits");
            assert_eq!(d, Duration::from_millis(n).min(MAX_HINT));
        }
        Pushback::DoNotRetry => assert!(digits(trimmed).is_none(), "digits refused"),
    }
}

const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// The RFC 850 and asctime forms of an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
fn other_forms(imf: &str) -> (Option<String>, String) {
    let p: Vec<&str> = imf.split(' ').collect();
    let (wd, day, mon, year, time) = (&p[0][..3], p[1], p[2], p[3], p[4]);
    let long = DAYS.iter().find(|d| d.starts_with(wd)).unwrap();
    let y: u32 = year.parse().unwrap();
    let rfc850 = (1970..2070)
        .contains(&y)
        .then(|| format!("{long}, {day}-{mon}-{:02} {time} GMT", y % 100));
    let d: u32 = day.parse().unwrap();
    let asctime = format!("{wd} {mon} {d:>2} {time} {year}");
    (rfc850, asctime)
}

fuzz_target!(|data: &[u8]| {
    let mode = data.first().copied().unwrap_or(0);
    // `now` anywhere an answer's `Date` plus its `Age` can put it, sub-seconds included.
    let now_ms = u64_at(data, 1) % ((LAST + (1 << 31)) * 1_000);
    let now = UNIX_EPOCH + Duration::from_millis(now_ms);
    match mode % 3 {
        0 => {
            // Any text.
            let value = String::from_utf8_lossy(data.get(9..).unwrap_or(&[]));
            check_value(&value, now);
        }
        1 => {
            // A date in each format must be read as that instant.
            let t = u64_at(data, 9) % (LAST + 1);
            let at = UNIX_EPOCH + Duration::from_secs(t);
            let imf = format_http_date(at + Duration::from_millis(u64::from(mode) * 3));
            assert_eq!(parse_date(&imf), Some(at), "IMF-fixdate {imf}");
            let want = at.duration_since(now).unwrap_or(Duration::ZERO).min(MAX_HINT);
            let (rfc850, asctime) = other_forms(&imf);
            let mut forms = vec![imf, asctime];
            forms.extend(rfc850);
            for form in forms {
                assert_eq!(parse_date(&form), Some(at), "{form}");
                assert_eq!(parse_retry_after(&form, now), Ok(want), "{form}");
                let padded = format!(" \t{form}\t ");
                assert_eq!(parse_retry_after(&padded, now), Ok(want), "{padded:?}");
                check_value(&form, now);
            }
        }
        _ => {
            // Delta-seconds / milliseconds: digits (leading zeros, any length) with blanks.
            let rest = data.get(9..).unwrap_or(&[]);
            let mut value = String::new();
            for &b in rest {
                value.push(match b % 4 {
                    0 => ' ',
                    1 => '\t',
                    _ => char::from(b'0' + b % 10),
                });
            }
            let inner = value.trim_matches([' ', '\t']);
            check_value(&value, now);
            if let Some(n) = digits(inner) {
                assert_eq!(
                    parse_retry_after(&value, now),
                    Ok(Duration::from_secs(n).min(MAX_HINT))
                );
                assert_eq!(
                    parse_grpc_pushback(&value),
                    Pushback::After(Duration::from_millis(n).min(MAX_HINT))
                );
            }
        }
    }
});
