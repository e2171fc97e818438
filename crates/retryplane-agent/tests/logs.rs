//! The agent's log lines never carry header values, tokens or bodies (SPEC §2), and each
//! attempt's debug line has what SPEC §2 lists: endpoint, attempt, outcome class, pause,
//! deadline left. The agent's tracing output (target `retryplane_agent`, debug and up) is
//! captured into a buffer while calls carry secrets in every place a request can.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http::header::{AUTHORIZATION, HeaderValue};
use http::request::Parts;
use http_body_util::Full;
use retryplane_agent::layer::{BoxError, RefreshCredentials, RetryLayer};
use retryplane_agent::{Agent, CallMeta, ReconnectBackoff};
use support::{agent, policy, status_upstream};
use tower::{Layer as _, ServiceExt as _};

/// Every secret the calls carry; none may appear in the log.
const SECRETS: [&str; 7] = [
    "AUTH-HEADER-SECRET",
    "API-KEY-HEADER-SECRET",
    "QUERY-SECRET",
    "BODY-SECRET",
    "REFRESHED-TOKEN-SECRET",
    "HOOK-ERROR-SECRET",
    "AGENT-TOKEN-SECRET",
];

fn request() -> Request<Full<Bytes>> {
    Request::builder()
        .method("PUT")
        .uri("http://up/v1/things?api_key=QUERY-SECRET")
        .header(AUTHORIZATION, "Bearer AUTH-HEADER-SECRET")
        .header("x-api-key", "API-KEY-HEADER-SECRET")
        .body(Full::new(Bytes::from_static(b"{\"card\":\"BODY-SECRET\"}")))
        .unwrap()
}

/// Sets a new token, or fails with an error that holds a secret.
#[derive(Clone)]
struct Hook {
    fail: bool,
}

impl RefreshCredentials for Hook {
    async fn refresh(&self, parts: &mut Parts) -> Result<(), BoxError> {
        if self.fail {
            return Err("token service: HOOK-ERROR-SECRET".into());
        }
        parts.headers.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Bearer REFRESHED-TOKEN-SECRET"),
        );
        Ok(())
    }
}

/// The first captured line that contains every one of `parts`.
fn line_with<'a>(log: &'a str, parts: &[&str]) -> Option<&'a str> {
    log.lines().find(|l| parts.iter().all(|p| l.contains(p)))
}

#[tokio::test(flavor = "current_thread")]
async fn no_log_line_carries_a_header_value_a_token_or_a_body() {
    let (sink, _guard) = support::capture_logs("retryplane_agent=debug");

    // Fast, deterministic pauses: base 5 ms, ×2.
    let agent = agent(&policy(
        "max_attempts: 3\nbackoff: {base: 5ms, max: 20ms, multiplier: 2.0, jitter: none}",
    ));
    let layer = RetryLayer::new(agent.endpoint("ep"));

    // A call retried once, then one that gives up after every attempt (the warn line).
    let ok = layer
        .clone()
        .layer(status_upstream(&[503]).0)
        .oneshot(request())
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let failed = layer
        .clone()
        .layer(status_upstream(&[503, 503, 503]).0)
        .oneshot(request())
        .await
        .unwrap();
    assert_eq!(failed.status(), 503);

    // A 401 with a credential refresh that works, and one whose hook fails.
    for fail in [false, true] {
        let client = layer
            .clone()
            .with_auth_refresh(Hook { fail })
            .layer(status_upstream(&[401]).0);
        client.oneshot(request()).await.unwrap();
    }

    // A failing call through a handle, with the meta built from the request (its path with
    // the query string, which the warn line must leave out).
    let req = request();
    let meta = CallMeta::http(req.method().as_str(), "/v1/things?api_key=QUERY-SECRET")
        .with_headers(req.headers());
    let up = support::Upstream::new(vec![support::Step::Status(503); 3]);
    let err = up.call(&agent, meta).await.unwrap_err();
    assert_eq!(err.attempts, 3);

    // An agent with a token whose control plane is not there: it logs its reconnects.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let connected = Agent::builder()
        .url(url)
        .token("AGENT-TOKEN-SECRET")
        .service("checkout")
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(5),
            Duration::from_millis(20),
            Duration::from_secs(1),
        ))
        .rng_seed(1)
        .connect()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while line_with(&sink.text(), &["cannot reach the control plane"]).is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reconnect logged:\n{}",
            sink.text()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    connected.shutdown().await;

    let log = sink.text();
    for secret in SECRETS {
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
    // The per-attempt lines: endpoint, attempt, class, pause (when one follows), deadline left.
    let retried = line_with(
        &log,
        &[
            "DEBUG",
            "attempt",
            "endpoint=ep",
            "attempt=1",
            "class=503",
            "pause_ms=5",
            "deadline_left_ms=",
        ],
    );
    assert!(
        retried.is_some(),
        "no per-attempt line of a retried attempt:\n{log}"
    );
    let second = line_with(
        &log,
        &[
            "DEBUG",
            "endpoint=ep",
            "attempt=2",
            "class=200",
            "deadline_left_ms=",
        ],
    );
    assert!(
        second.is_some(),
        "no per-attempt line of the successful retry:\n{log}"
    );
    let gave_up = line_with(
        &log,
        &[
            "WARN",
            "call failed",
            "endpoint=ep",
            "method=\"PUT\"",
            "path=\"/v1/things\"",
            "attempts=3",
            "class=503",
            "cause=",
        ],
    );
    assert!(
        gave_up.is_some(),
        "no warn line for the failed call:\n{log}"
    );
    // Only a refusal's line says how many refusals it stands for.
    assert!(
        gave_up.is_some_and(|line| !line.contains("refused_since_last_line")),
        "{log}"
    );
    assert!(
        line_with(
            &log,
            &[
                "credentials refreshed, sending again",
                "class=\"refresh_wanted\"",
                "deadline_left_ms="
            ]
        )
        .is_some(),
        "{log}"
    );
    assert!(
        line_with(
            &log,
            &[
                "credentials not refreshed, the answer stands",
                "class=\"refresh_wanted\"",
                "deadline_left_ms="
            ]
        )
        .is_some(),
        "{log}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_failed_call_whose_body_could_not_be_sent_again_says_so() {
    let (sink, _guard) = support::capture_logs("retryplane_agent=warn");
    let agent = agent(&policy(
        "max_attempts: 3\nidempotent_methods: [PUT]\nbackoff: {base: 1ms, max: 1ms}",
    ));
    let layer = RetryLayer::new(agent.endpoint("ep"));
    // The body (22 bytes) fits the default limit: retried, and its failure says nothing more.
    let kept = layer.clone().layer(status_upstream(&[503, 503, 503]).0);
    assert_eq!(kept.oneshot(request()).await.unwrap().status(), 503);
    // Over a 4-byte limit it is sent once, and the 503 is not retried.
    let once = layer
        .with_body_limit(4)
        .layer(status_upstream(&[503, 503, 503]).0);
    assert_eq!(once.oneshot(request()).await.unwrap().status(), 503);
    let log = sink.text();
    let failed: Vec<&str> = log.lines().filter(|l| l.contains("call failed")).collect();
    assert_eq!(failed.len(), 2, "{log}");
    assert!(
        failed[0].contains("attempts=3") && !failed[0].contains("replayable"),
        "{log}"
    );
    assert!(
        failed[1].contains("attempts=1")
            && failed[1].contains("cause=not_retryable")
            && failed[1].contains("replayable=false"),
        "{log}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn calls_refused_by_an_open_breaker_get_one_warn_line_per_second() {
    let (sink, _guard) = support::capture_logs("retryplane_agent=warn");

    let agent = agent(&policy(
        "max_attempts: 1\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}",
    ));
    let ep = agent.endpoint("ep");
    for _ in 0..2 {
        let up = support::Upstream::new([support::Step::Status(503)]);
        ep.call(CallMeta::http("GET", "/"), up.attempt())
            .await
            .unwrap_err();
    }
    let refused = |log: &str| {
        log.lines()
            .filter(|l| l.contains("call failed") && l.contains("circuit"))
            .count()
    };
    let refuse = || async {
        let up = support::Upstream::new([]);
        ep.call(CallMeta::http("GET", "/"), up.attempt())
            .await
            .unwrap_err();
    };
    for _ in 0..100 {
        refuse().await;
    }
    assert_eq!(refused(&sink.text()), 1, "{}", sink.text());
    tokio::time::advance(Duration::from_millis(999)).await;
    refuse().await;
    assert_eq!(refused(&sink.text()), 1);
    tokio::time::advance(Duration::from_millis(1)).await;
    refuse().await;
    let log = sink.text();
    assert_eq!(refused(&log), 2, "{log}");
    assert!(
        line_with(&log, &["call failed", "refused_since_last_line=100"]).is_some(),
        "{log}"
    );
    // Every refusal is still counted.
    assert_eq!(ep.pending_counts().circuit_open, 102);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn pushes_that_retune_a_budget_while_the_breaker_is_open_add_no_warn_lines_nor_lose_refusals()
{
    // Incident tuning: the breaker of `ep` is open, and the control plane pushes a new budget
    // for it every 100 ms (the breaker's settings unchanged, so it stays open). Each push gives
    // the endpoint a new runtime state, whose one-line-per-second limit starts afresh: every
    // push lets one more warn line through, and the refusals counted at debug since the last
    // line are dropped with the old state (the next line says 0).
    let (sink, _guard) = support::capture_logs("retryplane_agent=warn");
    let breaker =
        "circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}";
    let with_budget = |ratio: u32| {
        let loaded = retryplane_policy::load(
            policy(&format!(
                "max_attempts: 1\n{breaker}\nbudget: {{enabled: true, ratio: 0.{ratio}}}"
            ))
            .as_bytes(),
        );
        loaded.policies.unwrap()
    };
    let agent = Agent::from_policies_seeded(with_budget(1), 7);
    let ep = agent.endpoint("ep");
    for _ in 0..2 {
        let up = support::Upstream::new([support::Step::Status(503)]);
        ep.call(CallMeta::http("GET", "/"), up.attempt())
            .await
            .unwrap_err();
    }
    let refuse = || async {
        let up = support::Upstream::new([]);
        let err = ep
            .call(CallMeta::http("GET", "/"), up.attempt())
            .await
            .unwrap_err();
        assert_eq!(err.attempts, 0, "refused by the open breaker");
    };
    // One line for the first refusal, then 9 pushes 100 ms apart with 10 refusals after each.
    refuse().await;
    for push in 2..=10 {
        tokio::time::advance(Duration::from_millis(100)).await;
        agent.set_policies(with_budget(push % 9 + 1));
        for _ in 0..10 {
            refuse().await;
        }
    }
    tokio::time::advance(Duration::from_millis(100)).await;
    refuse().await;
    let log = sink.text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("call failed") && l.contains("circuit"))
        .collect();
    assert_eq!(ep.pending_counts().circuit_open, 92);
    assert_eq!(
        lines.len(),
        2,
        "92 refusals over one second: one line, then one a second later with the 90 between \
         them:\n{}",
        lines.join("\n")
    );
    assert!(
        lines[1].contains("refused_since_last_line=90"),
        "{}",
        lines[1]
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_breaker_that_closes_and_opens_again_across_two_pushes_keeps_one_warn_line_a_second() {
    // A held handle on `ep` (not named by the policies: it runs under `defaults:`), whose
    // breaker (no budget) opens, refuses six calls (one warn line, five at debug), lets a
    // probe through 200 ms later, closes, and opens again. Two pushes meanwhile that change
    // nothing of `ep`'s (another endpoint's `max_attempts`): the first lets go of the entry
    // the handle kept, the second drops `ep`'s state as idle (closed, counting nothing), and
    // the state made afresh for the next call has a refusal-log limit of its own. The next
    // refusal, 200 ms after the first line, gets a second warn line saying 0 refusals since
    // the last one, when five were logged at debug only in between.
    let (sink, _guard) = support::capture_logs("retryplane_agent=warn");
    let with_other = |attempts: u32| {
        let yaml = format!(
            "version: 1\ndefaults:\n  max_attempts: 1\n  budget: {{enabled: false}}\n  \
             circuit_breaker: {{enabled: true, failure_ratio: 0.5, min_requests: 2, \
             open_for: 200ms, half_open_probes: 1}}\nendpoints:\n  other: {{max_attempts: \
             {attempts}}}\n"
        );
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
    };
    let agent = Agent::from_policies_seeded(with_other(1), 7);
    let ep = agent.endpoint("ep");
    let fail_twice = || async {
        for _ in 0..2 {
            let up = support::Upstream::new([support::Step::Status(503)]);
            ep.call(CallMeta::http("GET", "/"), up.attempt())
                .await
                .unwrap_err();
        }
    };
    let refuse = || async {
        let up = support::Upstream::new([]);
        let err = ep
            .call(CallMeta::http("GET", "/"), up.attempt())
            .await
            .unwrap_err();
        assert_eq!(err.attempts, 0, "refused by the open breaker");
    };
    fail_twice().await;
    for _ in 0..6 {
        refuse().await;
    }
    tokio::time::advance(Duration::from_millis(200)).await;
    let probe = support::Upstream::new([support::Step::Status(200)]);
    ep.call(CallMeta::http("GET", "/"), probe.attempt())
        .await
        .unwrap();
    agent.set_policies(with_other(2));
    agent.set_policies(with_other(3));
    fail_twice().await;
    refuse().await;
    let log = sink.text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("call failed") && l.contains("cause=circuit_open"))
        .collect();
    assert_eq!(ep.pending_counts().circuit_open, 7);
    assert_eq!(
        lines.len(),
        1,
        "7 refusals within 200 ms: one warn line, the next one a second after it, counting \
         the 6 between them:\n{}",
        lines.join("\n")
    );
}
