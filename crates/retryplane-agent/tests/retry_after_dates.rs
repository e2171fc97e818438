//! `Retry-After` as an HTTP date when the upstream's clock is off this host's. README: "an
//! HTTP date counts from the answer's own `Date` (and its `Age`, for an answer a cache kept)
//! when it has one, so a clock skew between the hosts is not added to it".

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, SystemTime};

use http::header::{AGE, DATE, HeaderName, RETRY_AFTER};
use retryplane_agent::policy::retry_after::format_http_date;
use retryplane_agent::{Classification, Classify as _, Outcome};

/// The `Retry-After` delay of a 503 with these headers.
fn hint(headers: &[(HeaderName, &str)]) -> Duration {
    let mut builder = http::Response::builder().status(503);
    for (name, value) in headers {
        builder = builder.header(name, *value);
    }
    match builder.body(()).unwrap().classify() {
        Classification::Outcome(Outcome::Http {
            retry_after: Some(Ok(d)),
            ..
        }) => d,
        other => panic!("a Retry-After date that reads: {other:?}"),
    }
}

#[test]
fn an_age_that_does_not_read_does_not_throw_away_the_answers_date() {
    // The upstream's clock is an hour ahead of this host's; it asks for a retry in 5 s. Its
    // answer has a `Date`, and an `Age` that is no number of seconds (or two of them, which
    // cannot be told apart from one such value): the `Date` alone still says when the answer
    // was made (at worst it is older than that, and the pause comes out longer, never
    // shorter). Read against this host's clock instead, the hint is an hour and 5 s: past any
    // `retry_after.max`, so the call gives up where it should have retried in 5 s.
    let upstream_now = SystemTime::now() + Duration::from_secs(3600);
    let date = format_http_date(upstream_now);
    let asked = format_http_date(upstream_now + Duration::from_secs(5));
    for ages in [&["1.5"][..], &["-1"], &["ten"], &["0", "0"]] {
        let mut headers = vec![(DATE, date.as_str()), (RETRY_AFTER, asked.as_str())];
        headers.extend(ages.iter().map(|a| (AGE, *a)));
        let d = hint(&headers);
        assert!(
            d <= Duration::from_secs(5),
            "with Age {ages:?}, an upstream asking for 5 s is waited for {d:?}: the skew \
             between the clocks is added to it"
        );
    }
}
