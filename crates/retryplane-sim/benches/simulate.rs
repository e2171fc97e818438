//! How long a simulation takes: the issue's target is 10,000 clients × 120 s (all four
//! variants, the default `outage:30s+20s`) in at most 5 s on the project's 2-core machine.
//!
//! - `simulate/10k_clients_120s/<endpoint>`: [`simulate`] of `config/policies.yaml`'s
//!   `payments` (breaker trips: most calls fail fast during the outage) and `inventory`
//!   (breaker rarely trips: three attempts per call), 1 call/s per client, default upstream.
//!   This is what `retryplane simulate --clients 10000` runs, less reading the file and
//!   printing.
//! - `variant/10k_clients_120s/<variant>`: one variant's run alone, on one thread.
//!
//! Run (see BENCHMARKS.md at the repository root for results):
//!
//! ```text
//! cargo bench -p retryplane-sim --bench simulate
//! ```

// The criterion macros generate undocumented public items.
#![allow(missing_docs)]
#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use retryplane_policy::{RetryPolicy, load};
use retryplane_sim::{Config, Variant, run, simulate};
use tokio::time::Instant;

const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

fn endpoint(name: &str) -> RetryPolicy {
    let set = load(EXAMPLE.as_bytes())
        .policies
        .expect("config/policies.yaml is valid");
    (*set.endpoint(name).expect("the endpoint exists").policy).clone()
}

fn config() -> Config {
    Config {
        clients: 10_000,
        capacity: Config::default_capacity(10_000, 1.0),
        ..Config::default()
    }
}

fn whole(c: &mut Criterion) {
    let mut g = c.benchmark_group("simulate/10k_clients_120s");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));
    for name in ["payments", "inventory"] {
        let policy = endpoint(name);
        let config = config();
        g.bench_function(name, |b| {
            b.iter(|| simulate(name, black_box(&policy), &config).expect("valid config"));
        });
    }
    g.finish();
}

fn one_variant(c: &mut Criterion) {
    let mut g = c.benchmark_group("variant/10k_clients_120s");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    let base = endpoint("payments");
    let config = config();
    for variant in Variant::ALL {
        let policy = variant.apply(&base);
        g.bench_function(variant.as_str(), |b| {
            b.iter(|| run::run(black_box(&policy), &config, Instant::now()));
        });
    }
    g.finish();
}

criterion_group!(benches, whole, one_variant);
criterion_main!(benches);
