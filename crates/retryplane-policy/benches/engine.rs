//! Hot-path benchmarks of the retry engine, each measured beside tower's
//! `tower::retry::budget::TpsBudget` in the same run, so results can be read as ratios on a
//! shared, noisy machine.
//!
//! Groups:
//! - `success_path`: one logical call that succeeds at once, as the agent runs it: look the
//!   endpoint up by name in a 1,000-endpoint `PolicySet`, resolve the route for the request,
//!   start a `RetryCall`, `start_attempt` (breaker permit, budget deposit), `on_outcome(200)`
//!   → `Return`. `now` is read once per call with `tokio::time::Instant::now()` (tower's
//!   `deposit` reads the clock too), and again with `now` fixed to show the clock's share.
//!   Variants drop the lookup, the breaker and the budget to show where the time goes.
//!   Baselines: `TpsBudget::deposit`, a bare `HashMap` lookup, the clock read alone.
//! - `failure_path`: the same call answered by a 503 → `Retry` (budget check and withdrawal,
//!   breaker failure count, jittered backoff), beside `TpsBudget` deposit + withdraw. The
//!   endpoint's budget reserve is huge and its breaker's `min_requests` out of reach, so every
//!   iteration takes the same path.
//! - `budget_2_threads`: deposit + withdraw pairs on one shared [`RetryBudget`] vs one shared
//!   `TpsBudget`, from 2 threads at once (time per pair per thread), and from 1 thread.
//! - `parse`: [`load`] of `config/policies.yaml`, of the generated 1,000-endpoint file and of
//!   10,000 endpoints with defaults only, and how fast hostile inputs (an alias bomb, 100k nested
//!   brackets, a 2 MiB file) are refused; also an alias bomb and 100-deep nesting after 55,000
//!   tiny endpoints (about 700 KB), beside the load and the YAML pass of that padding alone, and
//!   an alias bomb after flow lists of about 199,000 events (the most the event limit allows).
//!
//! Run (see BENCHMARKS.md at the repository root for results):
//!
//! ```text
//! cargo bench -p retryplane-policy --bench engine -- --warm-up-time 1 --measurement-time 3
//! cargo bench -p retryplane-policy --bench engine -- success_path   # one group
//! # the hot-path groups timed by the thread's CPU time (time-slicing does not count):
//! RETRYPLANE_BENCH_CPU_TIME=1 cargo bench -p retryplane-policy --bench engine -- success_path
//! ```

// The criterion macros generate undocumented public items.
#![allow(missing_docs)]
#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

mod support;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::Duration;

use criterion::{Bencher, Criterion, criterion_group, criterion_main};
use retryplane_policy::budget::RetryBudget;
use retryplane_policy::engine::Decision;
use retryplane_policy::rng::SeededRng;
use retryplane_policy::{BudgetConfig, load};
use support::cpu_clock::{cpu_time_mode, thread_cpu_time};
use support::{
    ENDPOINTS, FAILING, HOT, OK, TARGET, UNAVAILABLE, engine_call, full_call, hot,
    thousand_endpoints, thousand_endpoints_yaml,
};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

/// `b.iter(f)`, or in [`cpu_time_mode`] the same loop timed by this thread's CPU time.
fn timed<O>(b: &mut Bencher<'_>, mut f: impl FnMut() -> O) {
    if cpu_time_mode() {
        b.iter_custom(|iters| {
            let start = thread_cpu_time();
            for _ in 0..iters {
                black_box(f());
            }
            thread_cpu_time().saturating_sub(start)
        });
    } else {
        b.iter(f);
    }
}

fn success_path(c: &mut Criterion) {
    let set = thousand_endpoints();
    let origin = Instant::now();
    let mut rng = SeededRng::with_seed(1);
    let mut g = c.benchmark_group("success_path");

    let (_, state) = hot(&set, HOT, origin);
    assert_eq!(
        full_call(&set, HOT, &state, OK, Instant::now(), &mut rng),
        Decision::Return
    );
    g.bench_function("retryplane/full_call", |b| {
        timed(b, || {
            black_box(full_call(&set, HOT, &state, OK, Instant::now(), &mut rng))
        });
    });

    let (_, state) = hot(&set, HOT, origin);
    let fixed = Instant::now();
    g.bench_function("retryplane/full_call_fixed_now", |b| {
        timed(b, || {
            black_box(full_call(&set, HOT, &state, OK, black_box(fixed), &mut rng))
        });
    });

    g.bench_function("retryplane/lookup_and_route_only", |b| {
        timed(b, || {
            let endpoint = set.endpoint(black_box(HOT)).expect("endpoint exists");
            black_box(endpoint.resolve(black_box(&TARGET)));
        });
    });

    let (policy, state) = hot(&set, HOT, origin);
    g.bench_function("retryplane/no_lookup", |b| {
        timed(b, || {
            black_box(engine_call(&policy, &state, OK, Instant::now(), &mut rng))
        });
    });

    let (mut no_breaker, state) = hot(&set, HOT, origin);
    no_breaker.circuit_breaker = None;
    g.bench_function("retryplane/no_lookup_no_breaker", |b| {
        timed(b, || {
            black_box(engine_call(
                &no_breaker,
                &state,
                OK,
                Instant::now(),
                &mut rng,
            ))
        });
    });

    let mut bare = no_breaker.clone();
    bare.budget = None;
    g.bench_function("retryplane/no_lookup_no_breaker_no_budget", |b| {
        timed(b, || {
            black_box(engine_call(&bare, &state, OK, Instant::now(), &mut rng))
        });
    });

    let (policy, _) = hot(&set, HOT, origin);
    let budget = RetryBudget::new(policy.budget.as_ref().expect("budget on"), origin);
    g.bench_function("retryplane/RetryBudget_deposit", |b| {
        timed(b, || budget.deposit(Instant::now()));
    });

    g.bench_function("tokio_Instant_now", |b| timed(b, Instant::now));

    let names: HashMap<String, usize> =
        (0..ENDPOINTS).map(|i| (format!("svc-{i:04}"), i)).collect();
    g.bench_function("std_HashMap_get", |b| {
        timed(b, || black_box(names.get(black_box(HOT))));
    });

    let tower = TpsBudget::default();
    g.bench_function("tower/TpsBudget_deposit", |b| timed(b, || tower.deposit()));
    g.finish();
}

fn failure_path(c: &mut Criterion) {
    let set = thousand_endpoints();
    let origin = Instant::now();
    let mut rng = SeededRng::with_seed(1);
    let mut g = c.benchmark_group("failure_path");

    let (_, state) = hot(&set, FAILING, origin);
    let first = full_call(&set, FAILING, &state, UNAVAILABLE, Instant::now(), &mut rng);
    assert!(matches!(first, Decision::Retry { .. }), "{first:?}");
    g.bench_function("retryplane/full_call", |b| {
        timed(b, || {
            let now = Instant::now();
            black_box(full_call(&set, FAILING, &state, UNAVAILABLE, now, &mut rng))
        });
    });

    let (_, state) = hot(&set, FAILING, origin);
    let fixed = Instant::now();
    g.bench_function("retryplane/full_call_fixed_now", |b| {
        timed(b, || {
            let now = black_box(fixed);
            black_box(full_call(&set, FAILING, &state, UNAVAILABLE, now, &mut rng))
        });
    });

    let (mut no_breaker, state) = hot(&set, FAILING, origin);
    no_breaker.circuit_breaker = None;
    g.bench_function("retryplane/no_lookup_no_breaker", |b| {
        timed(b, || {
            let now = Instant::now();
            black_box(engine_call(&no_breaker, &state, UNAVAILABLE, now, &mut rng))
        });
    });

    let tower = TpsBudget::new(Duration::from_secs(10), 1_000_000_000, 0.2);
    assert!(tower.withdraw());
    g.bench_function("tower/TpsBudget_deposit_withdraw", |b| {
        timed(b, || {
            tower.deposit();
            black_box(tower.withdraw())
        });
    });
    g.finish();
}

/// A budget config whose withdrawals always succeed, so every pair takes the same path.
fn roomy_budget() -> BudgetConfig {
    BudgetConfig {
        ratio: 0.2,
        min_per_second: 1_000_000_000,
        window: Duration::from_secs(10),
    }
}

/// Runs `op` `iters` times on each of `threads` threads, started together; returns the wall
/// time from the common start to the last thread's end.
#[allow(
    clippy::disallowed_types,
    reason = "wall time of a multi-threaded sample; nothing here pauses tokio's clock"
)]
fn on_threads(threads: usize, iters: u64, op: impl Fn() + Sync) -> Duration {
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                start.wait();
                for _ in 0..iters {
                    op();
                }
            });
        }
        start.wait();
        std::time::Instant::now()
    })
    // `scope` returns once every thread has finished.
    .elapsed()
}

fn budget_threads(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    n: usize,
) {
    let label = if n == 1 {
        "1_thread".to_owned()
    } else {
        format!("{n}_threads")
    };
    let origin = Instant::now();
    let ours = RetryBudget::new(&roomy_budget(), origin);
    assert!(ours.try_withdraw(origin));
    g.bench_function(
        format!("retryplane/RetryBudget/{label}"),
        |b: &mut Bencher<'_>| {
            b.iter_custom(|iters| {
                on_threads(n, iters, || {
                    ours.deposit(Instant::now());
                    black_box(ours.try_withdraw(Instant::now()));
                })
            });
        },
    );

    let ours = RetryBudget::new(&roomy_budget(), origin);
    let fixed = Instant::now();
    g.bench_function(
        format!("retryplane/RetryBudget_fixed_now/{label}"),
        |b: &mut Bencher<'_>| {
            b.iter_custom(|iters| {
                on_threads(n, iters, || {
                    let now = black_box(fixed);
                    ours.deposit(now);
                    black_box(ours.try_withdraw(now));
                })
            });
        },
    );

    let tower = TpsBudget::new(Duration::from_secs(10), 1_000_000_000, 0.2);
    assert!(tower.withdraw());
    g.bench_function(format!("tower/TpsBudget/{label}"), |b: &mut Bencher<'_>| {
        b.iter_custom(|iters| {
            on_threads(n, iters, || {
                tower.deposit();
                black_box(tower.withdraw());
            })
        });
    });
}

fn budget_2_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("budget_2_threads");
    budget_threads(&mut g, 2);
    budget_threads(&mut g, 1);
    g.finish();
}

/// Nine levels of ten aliases each: 10⁹ scalars if expanded.
fn alias_bomb() -> String {
    let mut y =
        String::from("version: 1\nl0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for level in 1..9 {
        let prev = level - 1;
        let refs = vec![format!("*l{prev}"); 10].join(", ");
        y.push_str(&format!("l{level}: &l{level} [{refs}]\n"));
    }
    y.push_str("endpoints:\n  svc: {max_attempts: *l8}\n");
    y
}

fn nested_brackets() -> String {
    format!(
        "version: 1\nendpoints: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    )
}

/// `n` endpoints with defaults only, about 12 bytes each: the most endpoints a file under the
/// size and event limits can hold is about 60,000.
fn many_tiny_endpoints(n: usize) -> String {
    let mut y = String::from("version: 1\nendpoints:\n");
    for i in 0..n {
        y.push_str(&format!("  e{i}: {{}}\n"));
    }
    y
}

/// 55,000 tiny endpoints (about 700 KB, 165,000 YAML events) followed by `tail`: hostile input
/// placed after a large valid prefix is refused only once the parser reaches it.
fn padded(tail: &str) -> String {
    let mut y = many_tiny_endpoints(55_000);
    y.push_str(tail);
    y
}

/// [`alias_bomb`]'s anchors after the padding, as top-level keys.
fn padded_alias_bomb() -> String {
    let mut tail = String::from("l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for level in 1..9 {
        let prev = level - 1;
        let refs = vec![format!("*l{prev}"); 10].join(", ");
        tail.push_str(&format!("l{level}: &l{level} [{refs}]\n"));
    }
    tail.push_str("boom: *l8\n");
    padded(&tail)
}

/// The alias bomb after flow lists holding as many events as the limit allows (about 199,000
/// scalars, 620 KB): the most events any pass must read before it reaches a hostile part.
fn flow_lists_then_alias_bomb() -> String {
    let mut y = String::from("version: 1\nendpoints:\n  a: {}\npad:\n");
    let per_list = 1_000;
    let lists = 199;
    for _ in 0..lists {
        y.push_str("- [");
        y.push_str(&"1,".repeat(per_list));
        y.push_str("]\n");
    }
    y.push_str("l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for level in 1..9 {
        let prev = level - 1;
        let refs = vec![format!("*l{prev}"); 10].join(", ");
        y.push_str(&format!("l{level}: &l{level} [{refs}]\n"));
    }
    y
}

/// An endpoint nested 100 deep after the padding.
fn padded_nesting() -> String {
    padded(&format!("  deep: {}{}\n", "[".repeat(100), "]".repeat(100)))
}

fn two_mib() -> String {
    let mut y = String::from("version: 1\nendpoints:\n  svc: {}\n");
    while y.len() < 2 * 1024 * 1024 {
        y.push_str("# padding padding padding padding padding padding padding padding\n");
    }
    y
}

fn parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse");
    g.sample_size(20);
    let big = thousand_endpoints_yaml();
    for (name, text) in [("example_file", EXAMPLE), ("1000_endpoints", big.as_str())] {
        assert!(load(text.as_bytes()).policies.is_some(), "{name} loads");
        g.bench_function(format!("load/{name}"), |b| {
            b.iter(|| black_box(load(black_box(text.as_bytes()))));
        });
    }
    // Duplicate names are found with a hash map: linear in the number of endpoints. This was
    // quadratic once (see BENCHMARKS.md); the bench catches a regression.
    let tiny = many_tiny_endpoints(10_000);
    assert!(tiny.len() < 1024 * 1024);
    assert!(
        load(tiny.as_bytes()).policies.is_some(),
        "tiny endpoints load"
    );
    g.sample_size(10);
    g.bench_function("load/many_tiny_endpoints_10k", |b| {
        b.iter(|| black_box(load(black_box(tiny.as_bytes()))));
    });
    // Hostile input after a large valid prefix: the quick event scan finds it, so it costs about
    // what the parser's bare events of the prefix cost.
    let padding = padded("");
    assert!(padding.len() < 1024 * 1024);
    assert!(
        load(padding.as_bytes()).policies.is_some(),
        "the padding alone loads"
    );
    g.bench_function("load/padding_55k", |b| {
        b.iter(|| black_box(load(black_box(padding.as_bytes()))));
    });
    // The YAML pass alone (the quick event scan for hostile parts, then the located values; no
    // checks, no compiling).
    g.bench_function("yaml/padding_55k", |b| {
        b.iter(|| {
            black_box(retryplane_policy::yaml::parse(black_box(
                padding.as_bytes(),
            )))
        });
    });
    // The baseline for a refusal: the YAML parser's bare event stream over the padding, which
    // any pass that reads the file in order pays before it reaches the hostile part.
    g.bench_function("yaml/padding_55k_parser_events", |b| {
        b.iter(|| {
            let mut events = 0_usize;
            for item in serde_saphyr::granit_parser::Parser::new_from_str(black_box(&padding)) {
                if item.is_ok() {
                    events += 1;
                }
            }
            black_box(events)
        });
    });
    // Each hostile file is checked to be refused before its refusal is timed.
    let refuse = |g: &mut criterion::BenchmarkGroup<'_, _>, name: &str, text: String| {
        let loaded = load(text.as_bytes());
        assert!(loaded.policies.is_none(), "{name} is refused");
        let first = loaded
            .diagnostics
            .first()
            .expect("a refused file has a diagnostic");
        eprintln!("parse/refuse/{name} ({} bytes): {first}", text.len());
        g.bench_function(format!("refuse/{name}"), |b| {
            b.iter(|| black_box(load(black_box(text.as_bytes()))));
        });
    };
    for (name, text) in [
        ("padded_alias_bomb", padded_alias_bomb()),
        ("padded_nesting_100", padded_nesting()),
        (
            "flow_lists_199k_events_alias_bomb",
            flow_lists_then_alias_bomb(),
        ),
    ] {
        assert!(text.len() < 1024 * 1024, "{name} is under the size limit");
        refuse(&mut g, name, text);
    }
    g.sample_size(20);
    refuse(&mut g, "alias_bomb", alias_bomb());
    refuse(&mut g, "nested_brackets_100k", nested_brackets());
    refuse(&mut g, "file_2MiB", two_mib());
    g.finish();
}

criterion_group!(benches, success_path, failure_path, budget_2_threads, parse);
criterion_main!(benches);
