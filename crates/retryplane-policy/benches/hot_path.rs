//! The engine's success path by CPU time, best of several rounds, beside tower's
//! `TpsBudget::deposit` measured in the same rounds.
//!
//! What is timed is the same as in `engine.rs`'s `success_path` group (see there): a lookup among
//! 1,000 endpoints, the route, the budget deposit, the breaker and the decision for a `200`.
//! Each round runs every variant for `CALLS` calls in turn and times each by this thread's CPU
//! time (`CLOCK_THREAD_CPUTIME_ID`); the figure kept is each variant's fastest round.
//!
//! Why a second harness next to criterion: on a shared 2-core machine, criterion's estimate of
//! the same binary moves by 30–40 % between runs while other work runs (BENCHMARKS.md).
//! Time-slicing does not count in CPU time, but the cache and branch state the other work leaves
//! behind does; the fastest of many interleaved rounds is the figure that this disturbs least,
//! and since the baseline is timed in the same rounds, the ratio is what to read.
//!
//! ```text
//! cargo bench -p retryplane-policy --bench hot_path                 # 15 rounds
//! cargo bench -p retryplane-policy --bench hot_path -- --rounds 40  # 40 rounds
//! ```

#![allow(missing_docs)]
#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

mod support;

use std::hint::black_box;
use std::time::Duration;

use retryplane_policy::engine::Decision;
use retryplane_policy::rng::SeededRng;
use support::cpu_clock::thread_cpu_time;
use support::{HOT, OK, TARGET, engine_call, full_call, hot, thousand_endpoints};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

/// Calls per variant per round.
const CALLS: u32 = 2_000_000;
const DEFAULT_ROUNDS: u32 = 15;

/// `calls` calls of `f`, by this thread's CPU time. Generic, so that each variant's loop is
/// compiled with its closure inlined, as a call site in a service would be.
#[inline(never)]
fn time(calls: u32, mut f: impl FnMut()) -> Duration {
    let start = thread_cpu_time();
    for _ in 0..calls {
        f();
    }
    thread_cpu_time().saturating_sub(start)
}

fn main() {
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`) one short round
    // checks that the harness runs. `--rounds N` sets the rounds; other arguments (criterion's
    // filters and options, given to every bench) are ignored.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let measuring = args.iter().any(|a| a == "--bench");
    let rounds = match args.iter().position(|a| a == "--rounds") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse().ok())
            .expect("--rounds takes a number"),
        None if measuring => DEFAULT_ROUNDS,
        None => 1,
    };
    let calls = if measuring { CALLS } else { 1_000 };

    let set = thousand_endpoints();
    let origin = Instant::now();
    let fixed = Instant::now();
    let (policy, engine_state) = hot(&set, HOT, origin);
    let (_, call_state) = hot(&set, HOT, origin);
    let (_, clock_state) = hot(&set, HOT, origin);
    let tower = TpsBudget::default();
    let mut rngs = [1, 2, 3].map(SeededRng::with_seed);
    let [r1, r2, r3] = &mut rngs;
    assert_eq!(
        full_call(&set, HOT, &call_state, OK, fixed, r1),
        Decision::Return
    );

    const NAMES: [&str; 6] = [
        "tower/TpsBudget_deposit (baseline)",
        "retryplane/full_call_fixed_now",
        "retryplane/full_call (clock per call)",
        "retryplane/no_lookup_fixed_now",
        "retryplane/lookup_and_route_only",
        "tokio_Instant_now",
    ];
    let mut best = [Duration::MAX; NAMES.len()];
    for _ in 0..rounds {
        let times = [
            time(calls, || tower.deposit()),
            time(calls, || {
                black_box(full_call(&set, HOT, &call_state, OK, black_box(fixed), r1));
            }),
            time(calls, || {
                black_box(full_call(&set, HOT, &clock_state, OK, Instant::now(), r2));
            }),
            time(calls, || {
                black_box(engine_call(
                    &policy,
                    &engine_state,
                    OK,
                    black_box(fixed),
                    r3,
                ));
            }),
            time(calls, || {
                let endpoint = set.endpoint(black_box(HOT)).expect("endpoint exists");
                black_box(endpoint.resolve(black_box(&TARGET)));
            }),
            time(calls, || {
                black_box(Instant::now());
            }),
        ];
        for (b, t) in best.iter_mut().zip(times) {
            *b = (*b).min(t);
        }
    }

    let per_call = |d: Duration| d.as_secs_f64() * 1e9 / f64::from(calls);
    let baseline = per_call(best[0]);
    println!("best of {rounds} rounds × {calls} calls, CPU time per call:");
    for (name, b) in NAMES.iter().zip(best) {
        let ns = per_call(b);
        println!("{name:40} {ns:7.1} ns  {:5.2}×", ns / baseline);
    }
}
