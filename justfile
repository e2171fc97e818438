# Mirrors the two commands in README.md; `just` is optional.

# The main job: explain the example policy of one endpoint.
run endpoint="payments":
    cargo run --release -p retryplane-cli -- explain config/policies.yaml --endpoint {{endpoint}}

# The whole test suite, as CI runs it.
test:
    cargo test --workspace --locked

# What CI checks before the tests.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --locked -- -D warnings

# Benchmarks (see BENCHMARKS.md).
bench:
    cargo bench -p retryplane-policy --bench engine
