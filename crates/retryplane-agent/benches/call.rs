//! `Endpoint::call` on the success path against the bare call and other retry wrappers, all
//! measured the same way in the same run.
//!
//! The call is what an HTTP client gives back: an `async fn` that returns
//! `Ok(http::Response<()>)` with status 200 at once (the agent classifies it as it would a real
//! response: status and `Retry-After`). Every variant runs a batch of `iters` calls inside one
//! `block_on` of a current-thread tokio runtime (`Endpoint::call` needs one for its per-try
//! timeout), so the figure is the time per call and the executor's cost is paid once per batch.
//!
//! Groups:
//! - `single_thread`:
//!   - `bare`: the call alone;
//!   - `tower_retry`: `tower::retry::Retry` with a policy that never retries an `Ok`
//!     (`poll_ready` + `call`, as a tower user does);
//!   - `tower_retry_tps_budget`: the same policy holding a `TpsBudget` (`deposit` on `Ok`,
//!     `withdraw` before a retry), tower's own retry budget;
//!   - `backon`: `(|| call()).retry(ExponentialBuilder::default())` (tokio sleeper);
//!   - `retryplane_call`: `Endpoint::call(CallMeta::http("GET", "/v1/items/12345"), ..)` on
//!     an agent whose policy set has 1,000 endpoints: the endpoint in the middle, route 2 of 2
//!     matches. Budget and circuit breaker are on (the defaults), counters count. The
//!     `CallMeta` is built per call, as a user does;
//!   - `retryplane_call_endpoint_meta`: the same with `CallMeta::endpoint()` (no route);
//!   - `retryplane_call_no_budget_no_breaker`: `CallMeta::endpoint()` on an endpoint whose
//!     budget and breaker are off (`svc-0501`): what those two cost on the success path;
//!   - `retryplane_call_handle_per_call`: `agent.endpoint(name)` then `call`, a new handle for
//!     every call: what a caller pays that does not keep its handle (the lookup of the
//!     endpoint's core by name, and the reference counts of a new handle);
//!   - `bare_waiting_once` and `retryplane_call_waiting_once`: the same two with an upstream
//!     that returns `Pending` once before its answer (it yields to the runtime), as a call over
//!     a network does: the per-try timer is armed only then, so these show its cost, which a
//!     call that answers at its first poll does not pay;
//!   - `parts/*`, pieces of `retryplane_call` alone, to show where its time goes: a read of
//!     tokio's clock (a call that succeeds at once makes one), building and dropping the `CallMeta`, and the bare
//!     call inside `tokio::time::timeout_at` (the per-try timeout; never fires here).
//! - `two_threads`: `bare`, `tower_retry`, `tower_retry_tps_budget` (one budget shared by both
//!   threads), `backon`, `retryplane_call` (one agent, one endpoint) and
//!   `retryplane_call_handle_per_call` (one agent) on 2 threads at once, each with its own
//!   runtime; and `retryplane_call_swapping`, the same while a third thread swaps the agent's
//!   policy set every 10 ms with `Agent::set_policies` (two sets that differ in
//!   `max_attempts`, timeouts and deadlines). The figure is wall time per call per thread.
//!
//! With `RETRYPLANE_BENCH_CPU_TIME=1` every batch is timed by its thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`) instead of the wall clock, so that time-slicing by other
//! processes on a shared machine does not count (in `two_threads`: the larger of the two
//! threads' CPU times, so contention between them still counts).
//!
//! `call_latency` (the other bench of this crate) gives the per-call latency percentiles with
//! and without the swaps, and checks that no call sees a mix of the two sets.
//!
//! Run (results in BENCHMARKS.md):
//!
//! ```text
//! cargo bench -p retryplane-agent --bench call
//! cargo bench -p retryplane-agent --bench call -- single_thread   # one group
//! RETRYPLANE_BENCH_CPU_TIME=1 cargo bench -p retryplane-agent --bench call
//! ```

// The criterion macros generate undocumented public items.
#![allow(missing_docs)]
#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

#[allow(
    dead_code,
    reason = "shared with the call_latency bench, which uses more of it"
)]
mod support;

use std::future::{Ready, poll_fn, ready};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use criterion::{Criterion, criterion_group, criterion_main};
use retryplane_agent::{Agent, CallMeta, Endpoint};
use support::cpu_clock::cpu_time_mode;
use support::{
    CHECK, HOT, Stopwatch, Swapper, agent, meta, runtime, upstream, upstream_waiting_once,
};
use tokio::time::Instant;
use tower::Service;
use tower::retry::Retry;
use tower::retry::budget::{Budget, TpsBudget};

type Answer = Result<http::Response<()>, std::io::Error>;

/// A tower retry policy that retries errors only, optionally under a `TpsBudget`.
#[derive(Clone)]
struct TowerPolicy {
    budget: Option<Arc<TpsBudget>>,
}

impl<Res, E> tower::retry::Policy<(), Res, E> for TowerPolicy {
    type Future = Ready<()>;

    fn retry(&mut self, _req: &mut (), result: &mut Result<Res, E>) -> Option<Self::Future> {
        match (result, &self.budget) {
            (Ok(_), Some(budget)) => {
                budget.deposit();
                None
            }
            (Ok(_), None) => None,
            (Err(_), Some(budget)) => budget.withdraw().then(|| ready(())),
            (Err(_), None) => Some(ready(())),
        }
    }

    fn clone_request(&mut self, _req: &()) -> Option<()> {
        Some(())
    }
}

/// What one benchmark runs.
#[derive(Clone)]
enum Kind {
    Bare,
    Tower(TowerPolicy),
    Backon,
    Retryplane(Endpoint),
    RetryplaneEndpointMeta(Endpoint),
    RetryplaneHandlePerCall(Agent),
    RetryplaneWaitingOnce(Endpoint),
    BareWaitingOnce,
    ClockRead,
    MetaOnly,
    TimeoutOnly,
}

async fn tower_batch(policy: TowerPolicy, iters: u64) {
    let mut svc = Retry::new(policy, tower::service_fn(|()| upstream()));
    for _ in 0..iters {
        let r = async {
            poll_fn(|cx| svc.poll_ready(cx)).await?;
            svc.call(()).await
        };
        black_box::<Answer>(r.await).expect("200");
    }
}

/// `iters` calls of `kind`, one after the other.
async fn batch(kind: &Kind, iters: u64) {
    match kind {
        Kind::Bare => {
            for _ in 0..iters {
                black_box(upstream().await).expect("200");
            }
        }
        Kind::Tower(policy) => tower_batch(policy.clone(), iters).await,
        Kind::Backon => {
            for _ in 0..iters {
                let r = upstream.retry(ExponentialBuilder::default()).await;
                black_box(r).expect("200");
            }
        }
        Kind::Retryplane(ep) => {
            for _ in 0..iters {
                black_box(ep.call(meta(), |_| upstream()).await).expect("200");
            }
        }
        Kind::RetryplaneEndpointMeta(ep) => {
            for _ in 0..iters {
                black_box(ep.call(CallMeta::endpoint(), |_| upstream()).await).expect("200");
            }
        }
        Kind::RetryplaneHandlePerCall(agent) => {
            for _ in 0..iters {
                let ep = agent.endpoint(black_box(HOT));
                black_box(ep.call(meta(), |_| upstream()).await).expect("200");
            }
        }
        Kind::BareWaitingOnce => {
            for _ in 0..iters {
                black_box(upstream_waiting_once().await).expect("200");
            }
        }
        Kind::RetryplaneWaitingOnce(ep) => {
            for _ in 0..iters {
                black_box(ep.call(meta(), |_| upstream_waiting_once()).await).expect("200");
            }
        }
        Kind::ClockRead => {
            for _ in 0..iters {
                black_box(Instant::now());
            }
        }
        Kind::MetaOnly => {
            for _ in 0..iters {
                black_box(meta());
            }
        }
        Kind::TimeoutOnly => {
            let until = Instant::now() + Duration::from_secs(60);
            for _ in 0..iters {
                let r = tokio::time::timeout_at(black_box(until), upstream()).await;
                black_box(r).expect("in time").expect("200");
            }
        }
    }
}

fn kinds() -> Vec<(&'static str, Kind)> {
    let agent = agent();
    let ep = agent.endpoint(HOT);
    vec![
        ("bare", Kind::Bare),
        ("tower_retry", Kind::Tower(TowerPolicy { budget: None })),
        (
            "tower_retry_tps_budget",
            Kind::Tower(TowerPolicy {
                budget: Some(Arc::new(TpsBudget::default())),
            }),
        ),
        ("backon", Kind::Backon),
        ("retryplane_call", Kind::Retryplane(ep.clone())),
        (
            "retryplane_call_endpoint_meta",
            Kind::RetryplaneEndpointMeta(ep.clone()),
        ),
        (
            "retryplane_call_no_budget_no_breaker",
            Kind::RetryplaneEndpointMeta(agent.endpoint(CHECK)),
        ),
        ("bare_waiting_once", Kind::BareWaitingOnce),
        (
            "retryplane_call_waiting_once",
            Kind::RetryplaneWaitingOnce(ep),
        ),
        (
            "retryplane_call_handle_per_call",
            Kind::RetryplaneHandlePerCall(agent),
        ),
        ("parts/tokio_Instant_now", Kind::ClockRead),
        ("parts/CallMeta_http", Kind::MetaOnly),
        ("parts/bare_in_timeout_at", Kind::TimeoutOnly),
    ]
}

fn single_thread(c: &mut Criterion) {
    let rt = runtime();
    let cpu = cpu_time_mode();
    let mut g = c.benchmark_group("single_thread");
    for (name, kind) in kinds() {
        // Every variant really runs (and succeeds) before it is timed.
        rt.block_on(batch(&kind, 10));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let t0 = Stopwatch::start(cpu);
                    batch(&kind, iters).await;
                    t0.elapsed()
                })
            });
        });
    }
    g.finish();
}

/// `iters` calls of `kind` on each of 2 threads started together, each on its own
/// current-thread runtime; the longer of the two threads' times.
fn on_two_threads(kind: &Kind, iters: u64) -> Duration {
    let cpu = cpu_time_mode();
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let rt = runtime();
                    let kind = kind.clone();
                    start.wait();
                    rt.block_on(async {
                        let t0 = Stopwatch::start(cpu);
                        batch(&kind, iters).await;
                        t0.elapsed()
                    })
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a bench thread does not panic"))
            .max()
            .unwrap_or_default()
    })
}

fn two_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("two_threads");
    const ON_TWO_THREADS: [&str; 6] = [
        "bare",
        "tower_retry",
        "tower_retry_tps_budget",
        "backon",
        "retryplane_call",
        "retryplane_call_handle_per_call",
    ];
    let kinds = kinds()
        .into_iter()
        .filter(|(name, _)| ON_TWO_THREADS.contains(name));
    for (name, kind) in kinds {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| on_two_threads(&kind, iters))
        });
    }

    // The same calls, on an agent of their own, while a third thread swaps its policy set
    // every 10 ms (from the first sample on, warm-up included; not at all when filtered out).
    let agent = agent();
    let kind = Kind::Retryplane(agent.endpoint(HOT));
    let mut swapper = None;
    g.bench_function("retryplane_call_swapping", |b| {
        swapper.get_or_insert_with(|| Swapper::start(&agent));
        b.iter_custom(|iters| on_two_threads(&kind, iters))
    });
    if let Some(swapper) = swapper {
        let stats = swapper.stop();
        eprintln!(
            "two_threads/retryplane_call_swapping: {} swaps, set_policies mean {:?}, max {:?}",
            stats.swaps, stats.mean, stats.max
        );
        // `cargo test --benches` runs each bench once, in less than one swap interval; only a
        // measured run (`cargo bench` passes `--bench`) must have swapped.
        if std::env::args().any(|a| a == "--bench") {
            assert!(stats.swaps > 0, "the policies were swapped");
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    // Short by default so the whole file runs in about a minute; command-line flags override.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = single_thread, two_threads
}
criterion_main!(benches);
