//! A failed call's error as a caller prints it (`{}`, or with its sources): what the last
//! attempt came to, as well as why the call stopped.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use retryplane_agent::CallMeta;
use support::{Step, Upstream};

fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A service that prints its errors can tell an upstream that answers 503 from one that never
/// answers: the text says how the last attempt ended, not only why the call stopped.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_failed_call_printed_says_whether_its_last_attempt_timed_out_or_was_answered() {
    let agent = support::agent(&support::policy(
        "max_attempts: 2\ndeadline: 10s\nper_try_timeout: 500ms",
    ));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Hang, Step::Hang]);
    let timed_out = ep
        .call(CallMeta::http("GET", "/"), up.attempt())
        .await
        .unwrap_err();
    let up = Upstream::new([Step::Status(503), Step::Status(503)]);
    let answered = ep
        .call(CallMeta::http("GET", "/"), up.attempt())
        .await
        .unwrap_err();
    let (timed_out, answered) = (with_sources(&timed_out), with_sources(&answered));
    assert_ne!(timed_out, answered);
    assert_eq!(
        timed_out,
        "call failed after 2 attempt(s): attempts_exhausted; the last attempt timed out"
    );
    assert_eq!(
        answered,
        "call failed after 2 attempt(s): attempts_exhausted; the last attempt was answered 503"
    );
}
