//! What an agent does with a large pushed snapshot before it can swap it in, step by step:
//! decode the bytes, check the content hash, and validate and compile the document
//! (`convert::validate`, the same validator as files and the admin API).
//!
//! The document has 4,001 endpoints (a third with two routes and a backoff, the rest with two
//! fields), as a large fleet's snapshot. `decode` is the baseline each run measures: the other
//! figures are read as ratios to it (BENCHMARKS.md, "Agent: applying a snapshot").
//!
//! ```text
//! cargo bench -p retryplane-proto --bench snapshot
//! ```

// The criterion macros generate undocumented public items.
#![allow(missing_docs)]
#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

use std::fmt::Write as _;
use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use prost::Message;
use retryplane_proto::{convert, pb};

/// Endpoints in the benched document.
const ENDPOINTS: usize = 4_001;

fn document() -> pb::PolicyDocument {
    let mut y =
        String::from("version: 1\ndefaults:\n  max_attempts: 3\n  deadline: 15s\nendpoints:\n");
    for i in 0..ENDPOINTS {
        if i % 3 == 0 {
            write!(
                y,
                "  svc-{i:05}:\n    max_attempts: 4\n    backoff: {{base: 50ms, max: 2s}}\n    \
                 routes:\n      - match: {{method: POST, path_prefix: /v1/orders}}\n        \
                 max_attempts: 2\n      - match: {{method: GET, path_prefix: /v1/items}}\n        \
                 per_try_timeout: 500ms\n"
            )
            .expect("a String takes every write");
        } else {
            writeln!(y, "  svc-{i:05}: {{max_attempts: 2, deadline: 5s}}")
                .expect("a String takes every write");
        }
    }
    let set = retryplane_policy::load(y.as_bytes())
        .policies
        .expect("the generated file is valid");
    pb::PolicyDocument::from(&**set.document())
}

fn snapshot(c: &mut Criterion) {
    let doc = document();
    let bytes = doc.encode_to_vec();
    let mut g = c.benchmark_group("snapshot_4001");
    g.sample_size(20);
    g.bench_function("decode", |b| {
        b.iter(|| pb::PolicyDocument::decode(black_box(&bytes[..])).expect("decodes"));
    });
    g.bench_function("content_hash", |b| {
        b.iter(|| convert::content_hash(black_box(&doc)));
    });
    g.bench_function("validate", |b| {
        b.iter_batched(
            || doc.clone(),
            |d| convert::validate(d).expect("valid"),
            BatchSize::LargeInput,
        );
    });
    g.finish();
}

criterion_group!(benches, snapshot);
criterion_main!(benches);
