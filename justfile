# Mirrors the two commands in README.md; `just` is optional.

# The main job: the control plane on the example policies (file mode, store in ./data).
run:
    cargo run --release -p retryplane-cli -- serve

# The whole test suite, as CI runs it.
test:
    bash scripts/test

# What CI checks before the tests.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --locked -- -D warnings

# Benchmarks (see BENCHMARKS.md).
bench:
    cargo bench -p retryplane-policy --bench engine
    cargo bench -p retryplane-policy --bench hot_path
    cargo bench -p retryplane-agent --bench call
    cargo bench -p retryplane-agent --bench call_latency
    cargo bench -p retryplane-agent --bench layer
    cargo bench -p retryplane-proto --bench snapshot
    cargo bench -p retryplane-server --bench ingest
    cargo bench -p retryplane-sim --bench simulate

# The control plane's fan-out and ingestion benches: the server runs as its own process
# (target/release/retryplane, or under $CARGO_TARGET_DIR when set, built first).
bench-fanout:
    cargo build --release -p retryplane-cli -p retryplane-bench
    "${CARGO_TARGET_DIR:-target}"/release/retryplane-bench-fanout --matrix

bench-ingest:
    cargo build --release -p retryplane-cli -p retryplane-bench
    "${CARGO_TARGET_DIR:-target}"/release/retryplane-bench-ingest --agents 10000 --endpoints 20 --services 100 --seconds 20
