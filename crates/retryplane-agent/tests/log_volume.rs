//! How many lines the agent writes at its default level (`info`) while its control plane
//! cannot be reached.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

/// A control plane that is down for an hour (an outage, a maintenance window): the agent runs
/// on its policies and keeps trying, 15 to 30 s apart once its backoff is at its ceiling. Each
/// try wrote the same info line (`control plane stream lost; reconnecting`, though no stream
/// was ever up): about 160 an hour, 3,900 a day. It is said once until the reason changes,
/// and once at warn when it has lasted a minute. (Paused clock: the hour passes at once.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_control_plane_down_for_an_hour_is_not_said_again_every_half_minute() {
    let (sink, _guard) = support::capture_logs("retryplane_agent=info");
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap();
    drop(nothing);
    let agent = retryplane_agent::Agent::builder()
        .url(format!("http://{addr}"))
        .service("checkout")
        .rng_seed(1)
        .connect()
        .unwrap();
    let start = tokio::time::Instant::now();
    // Bounded: 360 steps of 10 s.
    for _ in 0..360 {
        tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    }
    assert!(start.elapsed() >= std::time::Duration::from_secs(3600));
    let log = sink.text();
    let same = log.lines().filter(|l| l.contains("reconnecting")).count();
    let warned = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("has not been reachable"))
        .count();
    agent.shutdown().await;
    assert_eq!(warned, 1, "said at warn once it lasted a minute:\n{log}");
    assert!(
        same <= 10,
        "{same} lines in an hour saying the control plane cannot be reached; the first:\n{}",
        log.lines().nth(1).unwrap_or_default()
    );
}
