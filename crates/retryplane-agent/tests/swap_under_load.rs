//! Policy pushes while calls run on a multi-thread runtime: what a swap keeps of an endpoint's
//! retry budget and circuit breaker (SPEC §2 steps 2 and 6; README, "Retry semantics").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, Cause, GiveUpCause};
use retryplane_policy::PolicySet;
use support::response;

fn set(yaml: &str) -> PolicySet {
    let loaded = retryplane_policy::load(yaml.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    loaded.policies.unwrap()
}

/// Endpoint `ep`: 1-2 ms pauses, a budget of `budget`, no breaker, and `extra` fields.
fn yaml(budget: &str, extra: &str) -> String {
    format!(
        "version: 1\ndefaults:\n  backoff: {{base: 1ms, max: 2ms, multiplier: 2.0, jitter: none}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    budget: {budget}\n{extra}"
    )
}

struct Counts {
    calls: AtomicU64,
    retries: AtomicU64,
    exhausted: AtomicU64,
}

/// `tasks` tasks making `calls` calls each against an upstream that always answers 503, while
/// another task replaces the policies with `versions` in turn every 300 µs until they end.
async fn storm(agent: Arc<Agent>, versions: Vec<PolicySet>, tasks: u64, calls: u64) -> Counts {
    let counts = Arc::new(Counts {
        calls: AtomicU64::new(0),
        retries: AtomicU64::new(0),
        exhausted: AtomicU64::new(0),
    });
    let done = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (agent, done) = (agent.clone(), done.clone());
        tokio::spawn(async move {
            for i in 0.. {
                if done.load(Ordering::Relaxed) || i > 200_000 {
                    break;
                }
                agent.set_policies(versions[i % versions.len()].clone());
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
        })
    };
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (agent, counts) = (agent.clone(), counts.clone());
        handles.push(tokio::spawn(async move {
            let ep = agent.endpoint("ep");
            for _ in 0..calls {
                counts.calls.fetch_add(1, Ordering::Relaxed);
                let c = counts.clone();
                let res = ep
                    .call(CallMeta::http("GET", "/x"), move |info| {
                        if info.number > 1 {
                            c.retries.fetch_add(1, Ordering::Relaxed);
                        }
                        async move {
                            tokio::task::yield_now().await;
                            Ok::<_, std::io::Error>(response(503, None))
                        }
                    })
                    .await;
                let err = res.unwrap_err();
                if err.cause == Cause::GaveUp(GiveUpCause::BudgetExhausted) {
                    counts.exhausted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for h in handles {
        tokio::time::timeout(Duration::from_secs(120), h)
            .await
            .expect("calls end")
            .unwrap();
    }
    done.store(true, Ordering::Relaxed);
    swapper.await.unwrap();
    Arc::try_unwrap(counts).ok().unwrap()
}

/// Pushes that change `max_attempts` and `deadline` but not the budget keep the endpoint's one
/// budget: over a 10-minute window (the whole test), the retries sent stay within
/// `ratio × calls` (no reserve), however the pushes fall among the calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pushes_that_keep_the_budget_settings_keep_one_budget_for_calls_on_either_side() {
    let budget = "{ratio: 0.1, min_per_second: 0, window: 10m}";
    let versions = vec![
        set(&yaml(budget, "    max_attempts: 4\n")),
        set(&yaml(budget, "    max_attempts: 3\n    deadline: 14s\n")),
    ];
    let agent = Arc::new(Agent::from_policies_seeded(versions[0].clone(), 1));
    let c = storm(agent, versions, 8, 400).await;
    let (calls, retries) = (c.calls.into_inner(), c.retries.into_inner());
    assert!(c.exhausted.into_inner() > 0, "the budget ran out");
    assert!(
        retries <= calls / 10,
        "{retries} retries for {calls} calls with ratio 0.1"
    );
}

/// Pushes that change the budget's settings, here only its window (10 and 11 minutes, both
/// longer than the test): README says a new version "takes over the calls and retries the
/// old one counted ... rather than handing every agent a fresh allowance; calls started
/// before the change draw on the old budget until they end". Every retry in this test is
/// inside both windows, so `ratio × calls` bounds them under either version.
#[tokio::test(start_paused = true)]
async fn pushes_that_change_the_budget_settings_hand_out_no_fresh_allowance() {
    let versions = vec![
        set(&yaml(
            "{ratio: 0.1, min_per_second: 0, window: 10m}",
            "    max_attempts: 4\n",
        )),
        set(&yaml(
            "{ratio: 0.1, min_per_second: 0, window: 11m}",
            "    max_attempts: 4\n",
        )),
    ];
    let agent = Arc::new(Agent::from_policies_seeded(versions[0].clone(), 1));
    let c = storm(agent, versions, 8, 400).await;
    let (calls, retries) = (c.calls.into_inner(), c.retries.into_inner());
    assert!(
        retries <= calls / 10,
        "{retries} retries for {calls} calls with ratio 0.1 under both versions"
    );
}

/// The budget's counterpart: an upstream that stops answering (2 s timeouts), twenty callers
/// in steady traffic, and a push every second that changes the budget's window (60 s, then
/// 61 s: a reserve of 60 or 61 retries, `ratio: 0`). Each push's budget takes over the
/// retries counted so far, but the calls started before it take their retries (2 s and more
/// later) on the budget they started on, which no later budget counts. Over the first 60 s,
/// all inside one window, the endpoint should send at most 61 retries.
#[tokio::test(start_paused = true)]
async fn pushes_that_change_the_budget_settings_during_an_outage_hand_out_no_fresh_reserve() {
    let budget = |window: u32| {
        format!(
            "version: 1\ndefaults:\n  backoff: {{base: 100ms, max: 1s, multiplier: 2.0, jitter: none}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: 4\n    per_try_timeout: 2s\n    budget: {{ratio: 0.0, min_per_second: 1, window: {window}s}}\n"
        )
    };
    let versions = [set(&budget(60)), set(&budget(61))];
    let agent = Arc::new(Agent::from_policies_seeded(versions[0].clone(), 1));
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(50);
    let retries = Arc::new(AtomicU64::new(0));
    let swapper = {
        let agent = agent.clone();
        tokio::spawn(async move {
            for i in 1..50usize {
                tokio::time::sleep_until(start + Duration::from_secs(i as u64)).await;
                agent.set_policies(versions[i % 2].clone());
            }
        })
    };
    let mut handles = Vec::new();
    for n in 0..20u64 {
        let (agent, retries) = (agent.clone(), retries.clone());
        handles.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(315 * n)).await;
            let ep = agent.endpoint("ep");
            for _ in 0..1_000 {
                if tokio::time::Instant::now() >= end {
                    break;
                }
                let r = retries.clone();
                let _ = ep
                    .call(CallMeta::http("GET", "/x"), move |info| {
                        if info.number > 1 {
                            r.fetch_add(1, Ordering::Relaxed);
                        }
                        std::future::pending::<Result<http::Response<()>, std::io::Error>>()
                    })
                    .await;
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    swapper.await.unwrap();
    let retries = retries.load(Ordering::Relaxed);
    assert!(
        retries <= 61,
        "{retries} retries within 50 s; the reserve is 60 or 61 per window of 60 or 61 s"
    );
}

/// One push that tightens the budget: ten calls under v1 (reserve 12) wait for the answers to
/// their first attempts when v2 (reserve 10) comes. They fail and retry on v1's budget; v2's
/// budget, which took over v1's counts before those retries, never counts them, so calls
/// started under v2 get its whole reserve as well: 20 retries within a second, where the
/// reserve is 12 before the push and 10 after (README: tightening "refuses at once rather
/// than handing every agent a fresh allowance").
#[tokio::test(start_paused = true)]
async fn retries_of_calls_started_before_a_push_count_against_the_budget_that_took_over() {
    let v1 = set(&yaml(
        "{ratio: 0.0, min_per_second: 1, window: 12s}",
        "    max_attempts: 2\n",
    ));
    let v2 = set(&yaml(
        "{ratio: 0.0, min_per_second: 1, window: 10s}",
        "    max_attempts: 2\n",
    ));
    let agent = Arc::new(Agent::from_policies_seeded(v1, 1));
    let retries = Arc::new(AtomicU64::new(0));
    let first = Arc::new(AtomicU64::new(0));
    let call = |agent: Arc<Agent>, retries: Arc<AtomicU64>, first: Arc<AtomicU64>| async move {
        let _ = agent
            .endpoint("ep")
            .call(CallMeta::http("GET", "/x"), move |info| {
                if info.number > 1 {
                    retries.fetch_add(1, Ordering::Relaxed);
                } else {
                    first.fetch_add(1, Ordering::Relaxed);
                }
                async {
                    // The answer takes 5 ms.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok::<_, std::io::Error>(response(503, None))
                }
            })
            .await;
    };
    let before: Vec<_> = (0..10)
        .map(|_| tokio::spawn(call(agent.clone(), retries.clone(), first.clone())))
        .collect();
    // Every call of v1 has sent its first attempt and waits for the answer.
    for _ in 0..10_000 {
        if first.load(Ordering::Relaxed) == 10 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(first.load(Ordering::Relaxed), 10);
    assert_eq!(retries.load(Ordering::Relaxed), 0);
    agent.set_policies(v2);
    for h in before {
        h.await.unwrap();
    }
    for _ in 0..20 {
        call(agent.clone(), retries.clone(), first.clone()).await;
    }
    let retries = retries.load(Ordering::Relaxed);
    assert!(
        retries <= 12,
        "{retries} retries within 1 s; the reserve is 12 (v1), then 10 (v2), per window"
    );
}

/// An upstream that stops answering (every attempt hits its 2 s `per_try_timeout`), twenty
/// callers, and a push every second that changes the breaker's settings (`min_requests` 20,
/// then 21, and back). Without the pushes the breaker opens about 2 s in, once 20 attempts
/// have timed out. With them, each push makes a breaker that takes over the counts of the one
/// before as they are at the push; but the calls started before it report their timeouts, 2 s
/// later, to the breaker they started on, and no later breaker ever counts them. Each breaker
/// sees only the failures of the calls started in its own second, about ten, so none reaches
/// 20, and the upstream gets every attempt for the whole 30 s: about 300 timeouts against a
/// `min_requests` of 20.
#[tokio::test(start_paused = true)]
async fn pushes_that_change_the_breaker_settings_during_an_outage_still_let_it_open() {
    let breaker = |min: u32| {
        format!(
            "version: 1\ndefaults:\n  backoff: {{base: 100ms, max: 1s, multiplier: 2.0, jitter: none}}\n  budget: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: 3\n    per_try_timeout: 2s\n    circuit_breaker: {{failure_ratio: 0.5, min_requests: {min}, window: 10s, open_for: 30s, half_open_probes: 1}}\n"
        )
    };
    let versions = [set(&breaker(20)), set(&breaker(21))];
    let agent = Arc::new(Agent::from_policies_seeded(versions[0].clone(), 1));
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(30);
    let attempts = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let swapper = {
        let agent = agent.clone();
        tokio::spawn(async move {
            for i in 1..30usize {
                tokio::time::sleep_until(start + Duration::from_secs(i as u64)).await;
                agent.set_policies(versions[i % 2].clone());
            }
        })
    };
    let mut handles = Vec::new();
    for n in 0..20u64 {
        let (agent, attempts, refused) = (agent.clone(), attempts.clone(), refused.clone());
        handles.push(tokio::spawn(async move {
            // The callers start 315 ms apart, as steady traffic would: a call lasts about
            // 6.3 s (three 2 s timeouts and two pauses), so about three calls start a second.
            tokio::time::sleep(Duration::from_millis(315 * n)).await;
            let ep = agent.endpoint("ep");
            for _ in 0..1_000 {
                if tokio::time::Instant::now() >= end {
                    break;
                }
                let a = attempts.clone();
                let err = ep
                    .call(CallMeta::http("GET", "/x"), move |_| {
                        a.fetch_add(1, Ordering::Relaxed);
                        std::future::pending::<Result<http::Response<()>, std::io::Error>>()
                    })
                    .await
                    .unwrap_err();
                if err.cause == Cause::GaveUp(GiveUpCause::CircuitOpen) {
                    refused.fetch_add(1, Ordering::Relaxed);
                    // A caller that is refused waits a little before it calls again.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    swapper.await.unwrap();
    let (attempts, refused) = (
        attempts.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    assert!(
        refused > 0 && attempts <= 21 + 20,
        "{attempts} attempts timed out at the upstream and {refused} calls were refused; \
         min_requests is 20 or 21, 20 callers"
    );
}
