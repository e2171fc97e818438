//! Many callers, each call on a handle of its own (so endpoints are let go at every report
//! and push) or on one held handle, while the control plane pushes a version every few
//! milliseconds and reports go out every 100 ms: the control plane's counts add up to the calls
//! made, and each version's to the calls that ran on it. Version `n` makes `n + 1` attempts, so
//! a call's attempts say which version it ran on.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_agent::{Agent, CallMeta};
use retryplane_proto::pb;
use support::plane::{admin, apply, builder, eventually, plane_with};
use support::{Fut, response};

/// Version `n`: every endpoint makes `n + 1` attempts, 2 ms apart.
fn policies(n: u64) -> String {
    format!(
        "version: 1\ndefaults:\n  max_attempts: {}\n  backoff: {{base: 2ms, max: 2ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  named: {{}}\n",
        n + 1
    )
}

/// Every series' counts per version, summed over the endpoints.
async fn per_version(running: &retryplane_server::server::Running) -> BTreeMap<u64, pb::Counters> {
    let stats = admin(running)
        .await
        .stats(pb::StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut out: BTreeMap<u64, pb::Counters> = BTreeMap::new();
    for s in stats.series.into_iter().filter(|s| s.service == "checkout") {
        // Under u64::MAX: the series' lifetime, all versions.
        let l = s.lifetime.unwrap_or_default();
        let e = out.entry(u64::MAX).or_default();
        e.calls += l.calls;
        e.attempts += l.attempts;
        e.gave_up_attempts += l.gave_up_attempts;
        for v in s.versions {
            let l = v.lifetime.unwrap_or_default();
            let e = out.entry(v.policy_version).or_default();
            e.calls += l.calls;
            e.attempts += l.attempts;
            e.gave_up_attempts += l.gave_up_attempts;
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counts_add_up_per_version_with_pushes_reports_and_forgotten_endpoints_under_load() {
    // Rounds with pushes closer and closer together.
    for gap_ms in [150, 70, 40, 20, 10, 5] {
        round(Duration::from_millis(gap_ms)).await;
    }
}

async fn round(gap: Duration) {
    // The control plane keeps at most 4 versions of a series apart.
    const VERSIONS: u64 = 4;
    const CALLERS: u64 = 8;
    let dir = tempfile::tempdir().unwrap();
    let running = plane_with(dir.path(), &policies(1), None, |c| {
        c.metrics_interval = Duration::from_millis(100);
    })
    .await;
    let agent: Agent = builder(running.agent_addr, "a").connect().unwrap();
    eventually("the agent on v1", || async {
        agent.policies().version() == 1
    })
    .await;
    // (version by attempts made) -> calls that ran on it, as the callers saw them.
    let truth: Arc<Mutex<BTreeMap<u64, u64>>> = Arc::default();
    let upstream_attempts = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut callers = Vec::new();
    for id in 0..CALLERS {
        let agent = agent.clone();
        let truth = truth.clone();
        let upstream_attempts = upstream_attempts.clone();
        let stop = stop.clone();
        callers.push(tokio::spawn(async move {
            let held = agent.endpoint("held");
            let mut n = 0_u64;
            // Bounded: at most 20,000 calls a caller.
            while !stop.load(Ordering::Relaxed) && n < 20_000 {
                n += 1;
                let own;
                let ep = if n.is_multiple_of(2) {
                    &held
                } else {
                    own = agent.endpoint(&format!("host-{}", (id * 7 + n) % 40));
                    &own
                };
                let made = Arc::new(AtomicU64::new(0));
                let m = made.clone();
                let u = upstream_attempts.clone();
                let err = ep
                    .call(CallMeta::http("GET", "/"), move |_| -> Fut {
                        m.fetch_add(1, Ordering::Relaxed);
                        u.fetch_add(1, Ordering::Relaxed);
                        Box::pin(async { Ok(response(503, None)) })
                    })
                    .await
                    .map(|_| ())
                    .unwrap_err();
                let attempts = u64::from(err.attempts);
                assert_eq!(attempts, made.load(Ordering::Relaxed));
                *truth.lock().unwrap().entry(attempts - 1).or_default() += 1;
            }
        }));
    }
    for v in 2..=VERSIONS {
        tokio::time::sleep(gap).await;
        assert_eq!(apply(&running, policies(v)).await, v);
    }
    eventually("the agent on the last version", || async {
        agent.policies().version() == VERSIONS
    })
    .await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await.unwrap();
    }
    let truth = truth.lock().unwrap().clone();
    let calls: u64 = truth.values().sum();
    let attempts = upstream_attempts.load(Ordering::Relaxed);
    // Every count is reported before shutdown ends (the last report at the latest).
    // Bounded: 15 s.
    let mut last = BTreeMap::new();
    for _ in 0..150 {
        last = per_version(&running).await;
        if last.get(&u64::MAX).map_or(0, |c| c.calls) >= calls {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "gap {gap:?}: made {calls} calls ({truth:?}), {attempts} attempts; reported before shutdown {last:?}"
    );
    agent.shutdown().await;
    let mut got = per_version(&running).await;
    running.shutdown().await.unwrap();
    let lifetime = got.remove(&u64::MAX).unwrap_or_default();
    let total = |f: fn(&pb::Counters) -> u64| f(&lifetime);
    assert_eq!(
        (
            total(|c| c.calls),
            total(|c| c.attempts),
            total(|c| c.gave_up_attempts)
        ),
        (calls, attempts, calls),
        "(calls, attempts, give-ups) reported against made; per version {got:?}"
    );
    let reported: BTreeMap<u64, (u64, u64)> = got
        .iter()
        .filter(|(_, c)| c.calls > 0 || c.attempts > 0)
        .map(|(v, c)| (*v, (c.calls, c.attempts)))
        .collect();
    let made: BTreeMap<u64, (u64, u64)> = truth
        .iter()
        .map(|(v, calls)| (*v, (*calls, calls * (v + 1))))
        .collect();
    assert_eq!(
        reported, made,
        "version -> (calls, attempts): reported against what ran on it"
    );
}
