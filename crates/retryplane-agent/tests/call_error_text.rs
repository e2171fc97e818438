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

/// A call cancelled while its second attempt is in flight: that attempt (the last one, the
/// text counts it among the 2) came to nothing, yet the text says it was answered 503 (the
/// first attempt's answer). The text must not give an earlier attempt's ending as the last's.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_call_cancelled_during_a_retry_does_not_say_its_last_attempt_was_answered() {
    let agent = support::agent(&support::policy(
        "max_attempts: 3\nper_try_timeout: 10s\ndeadline: 30s",
    ));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Status(503), Step::Hang]);
    let token = retryplane_agent::CancellationToken::new();
    let call = tokio::spawn({
        let (up, token) = (up.clone(), token.clone());
        async move {
            ep.call(CallMeta::http("GET", "/").with_cancel(token), up.attempt())
                .await
        }
    });
    // The first attempt is answered 503; the second starts after its 100 ms pause and hangs.
    // (Bounded: the paused clock jumps to each timer; 100 steps of 10 ms cover the pause.)
    for _ in 0..100 {
        if up.attempts() >= 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(up.attempts(), 2, "the second attempt started");
    token.cancel();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.attempts, 2);
    let text = with_sources(&err);
    assert!(
        !text.contains("the last attempt was answered 503"),
        "the second attempt was cancelled in flight, never answered: {text}"
    );
}

/// tonic's own request timeout (a channel's `Endpoint::timeout`, `CANCELLED: Timeout
/// expired`) is the client giving up waiting: nothing answered. The text says the last attempt
/// "was answered CANCELLED", as if the server had sent that code.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_call_whose_last_attempt_hit_tonics_request_timeout_does_not_say_it_was_answered() {
    let agent = support::agent(&support::policy("max_attempts: 1"));
    let ep = agent.endpoint("ep");
    let err = ep
        .call(CallMeta::grpc("/svc.S/M"), |_| async {
            Err::<tonic::Response<()>, _>(tonic::Status::from_error(Box::new(
                tonic::TimeoutExpired(()),
            )))
        })
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        !text.contains("was answered"),
        "no answer came: tonic's client timed out: {text}"
    );
}
