//! The agent's errors as a caller prints them: with `{}` alone, or with their sources (`{:#}`
//! of anyhow, eyre's report, a loop over `source()`), each cause said once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use retryplane_agent::{Agent, AgentError};

/// `e` and its sources, `: `-separated, as anyhow's `{:#}` writes them.
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

#[tokio::test(flavor = "current_thread")]
async fn a_refused_hello_printed_with_its_sources_says_the_reason_once() {
    let refused = Agent::builder()
        .url("http://127.0.0.1:9")
        .service("a\nb")
        .connect();
    let e = match refused {
        Err(e @ AgentError::InvalidHello(_)) => e,
        other => panic!("expected InvalidHello, got {:?}", other.err()),
    };
    let shown = with_sources(&e);
    assert_eq!(
        shown
            .matches("Hello.service holds a control character")
            .count(),
        1,
        "{shown}"
    );
}
