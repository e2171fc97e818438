//! The fan-out bench's "publish → every agent", measured as the
//! bench measures it (`measure::run`) against the plain tonic server, lies where it must: the
//! publish instant is after the Apply call started and no later than the first agent's
//! arrival, so per round `last - first <= last - publish <= last - t0`, and so for the p50 and
//! p99 over rounds. A sign or unit slip in the conversion between the system clock and the
//! bench's monotonic clock, or a round that read an earlier publish's time, breaks it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../src/agents.rs"]
mod agents;
#[allow(dead_code)]
#[path = "../src/measure.rs"]
mod measure;
#[allow(dead_code)]
#[path = "../src/policy.rs"]
mod policy;
#[allow(dead_code)]
#[path = "../src/server.rs"]
mod server;
#[allow(dead_code)]
#[path = "../src/stream.rs"]
mod stream;

use std::path::PathBuf;
use std::time::Duration;

/// The bound on every wait of the bench modules included here.
pub const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn publish_to_every_agent_lies_between_the_fan_out_and_the_apply_call_figure() {
    let cfg = measure::Config {
        agents: 8,
        endpoints: 3,
        connections: 2,
        rounds: 6,
        warmup: 1,
        server_bin: PathBuf::from(env!("CARGO_BIN_EXE_retryplane-bench-plain-server")),
    };
    let o = measure::run(&cfg).await.unwrap();
    for (name, spread, published, all) in [
        ("p50", o.spread_p50_ms, o.published_p50_ms, o.all_p50_ms),
        ("p99", o.spread_p99_ms, o.published_p99_ms, o.all_p99_ms),
    ] {
        assert!(
            published.is_finite() && spread <= published && published <= all,
            "{name}: first → last {spread} ms, publish → last {published} ms, Apply call → last {all} ms"
        );
    }
}
