//! End to end: a real control plane on loopback and real agents (real time, bounded polls).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, CancellationToken, Cause, Source};
use support::Upstream;
use support::plane::{
    agent, apply, attempts_of, builder, eventually, failing, listed_connected, metric, plane,
    plane_with, stats, succeed, yaml,
};
use support::proxy::Proxy;

async fn on_version(agents: &[&Agent], version: u64) {
    eventually(&format!("every agent on version {version}"), || async {
        agents.iter().all(|a| a.policies().version() == version)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_alters_the_next_calls_behaviour() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(2), None).await;
    let a = agent(running.agent_addr, "a", None);
    let b = agent(running.agent_addr, "b", None);
    on_version(&[&a, &b], 1).await;
    assert_eq!(a.policies().source(), Source::ControlPlane);
    assert_eq!(attempts_of(&a).await, 2);
    assert_eq!(attempts_of(&b).await, 2);
    assert_eq!(apply(&running, yaml(4)).await, 2);
    on_version(&[&a, &b], 2).await;
    assert_eq!(attempts_of(&a).await, 4);
    assert_eq!(attempts_of(&b).await, 4);
    a.shutdown().await;
    b.shutdown().await;
    running.shutdown().await.unwrap();
}

/// A service can wait for the control plane's policies, and hears of a version pushed later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_watching_the_policies_sees_the_pushed_versions() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(2), None).await;
    let a = agent(running.agent_addr, "a", None);
    let mut policies = a.watch_policies();
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        policies.wait_for(|p| p.source() == Source::ControlPlane),
    )
    .await
    .expect("the control plane's policies within 10 s")
    .unwrap()
    .version();
    assert_eq!(first, 1);
    assert_eq!(apply(&running, yaml(4)).await, 2);
    let pushed = tokio::time::timeout(Duration::from_secs(10), policies.changed())
        .await
        .expect("a change within 10 s")
        .unwrap();
    // A reconnect may apply version 1 again first; version 2 follows.
    let second = if pushed.version() == 2 {
        pushed
    } else {
        tokio::time::timeout(
            Duration::from_secs(10),
            policies.wait_for(|p| p.version() == 2),
        )
        .await
        .expect("version 2 within 10 s")
        .unwrap()
    };
    assert_eq!(second.source(), Source::ControlPlane);
    assert_eq!(attempts_of(&a).await, 4, "what the watch shows is in force");
    a.shutdown().await;
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_keep_their_policies_without_the_control_plane_and_reconnect_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(3), None).await;
    let addr = running.agent_addr;
    let a = agent(addr, "a", None);
    let b = agent(addr, "b", None);
    on_version(&[&a, &b], 1).await;
    running.shutdown().await.unwrap();
    eventually("both agents see the stream drop", || async {
        !a.is_connected() && !b.is_connected()
    })
    .await;
    assert_eq!(a.policies().version(), 1);
    assert_eq!(attempts_of(&a).await, 3, "still on the pushed policy");
    assert_eq!(attempts_of(&b).await, 3);
    // Counts made while disconnected reach the next control plane.
    let up = Upstream::new([]);
    a.endpoint("ep")
        .call(CallMeta::http("GET", "/"), up.attempt())
        .await
        .unwrap();

    let running = plane(dir.path(), &yaml(3), Some(addr)).await;
    eventually("both agents reconnect", || async {
        a.is_connected() && b.is_connected()
    })
    .await;
    assert_eq!(apply(&running, yaml(5)).await, 2);
    on_version(&[&a, &b], 2).await;
    assert_eq!(attempts_of(&a).await, 5);
    eventually("the counts made while disconnected arrive", || async {
        stats(&running).await.is_some_and(|s| {
            // a: 1 failing call (3 attempts) + 1 success offline, 1 failing call (5) online;
            // b: 1 failing call (3 attempts) offline.
            s.calls == 4 && s.attempts == 12 && s.success_first_try == 1 && s.gave_up_attempts == 3
        })
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_starts_on_its_cache_file_without_the_control_plane() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    let running = plane(dir.path(), &yaml(4), None).await;
    let addr = running.agent_addr;
    let a = agent(addr, "a", Some(&cache));
    on_version(&[&a], 1).await;
    eventually("the cache file is written", || async { cache.exists() }).await;
    a.shutdown().await;
    drop(a);
    running.shutdown().await.unwrap();

    let restarted = agent(addr, "a", Some(&cache));
    let p = restarted.policies();
    assert_eq!((p.source(), p.version()), (Source::Cache, 1));
    assert_eq!(attempts_of(&restarted).await, 4);
    restarted.shutdown().await;

    let fresh = agent(addr, "fresh", Some(&dir.path().join("none.cache")));
    assert_eq!(fresh.policies().source(), Source::Fallback);
    assert_eq!(
        attempts_of(&fresh).await,
        2,
        "the fallback policy retries once"
    );
    fresh.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_sent_by_agents_add_up_exactly_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(3), None).await;
    let a = agent(running.agent_addr, "a", None);
    let b = agent(running.agent_addr, "b", None);
    on_version(&[&a, &b], 1).await;
    for agent in [&a, &b] {
        for round in 0..5 {
            let up = Upstream::new(vec![support::Step::Status(503); round % 3]);
            agent
                .endpoint("ep")
                .call(CallMeta::http("GET", "/"), up.attempt())
                .await
                .unwrap();
        }
        attempts_of(agent).await;
        // Cancelled by its caller before it began: a call with no attempt.
        let token = CancellationToken::new();
        token.cancel();
        let meta = CallMeta::http("GET", "/").with_cancel(token);
        let up = Upstream::new([]);
        let err = agent.endpoint("ep").call(meta, up.attempt()).await;
        assert_eq!(err.unwrap_err().cause, Cause::Cancelled);
    }
    // Per agent: 7 calls; attempts 1+2+3+1+2 + 3 = 12; retries 6; first-try 2; after-retry 3;
    // one gave up on attempts; one cancelled; backoff 5+(5+10)+5+5+(5+10)+... computed below.
    eventually("the server's totals equal what the agents did", || async {
        stats(&running).await.is_some_and(|s| {
            s.calls == 14
                && s.cancelled == 2
                && s.attempts == 24
                && s.retries == 12
                && s.success_first_try == 4
                && s.success_after_retry == 6
                && s.gave_up_attempts == 2
                && s.backoff_ms == 2 * (5 + 15 + 5 + 15)
        })
    })
    .await;
    assert_eq!(
        a.endpoint("ep").pending_counts().calls,
        0,
        "nothing left unsent"
    );
    a.shutdown().await;
    b.shutdown().await;
    // Every report was acknowledged.
    assert_eq!(
        (a.unacknowledged_reports(), b.unacknowledged_reports()),
        (0, 0)
    );
    let s = stats(&running).await.unwrap();
    assert_eq!(s.calls, 14, "shutdown sends nothing twice");
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_add_up_exactly_when_streams_are_lost_with_reports_or_acks_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(3), None).await;
    let proxy = Proxy::start(running.agent_addr).await;
    let a = agent(proxy.addr, "a", None);
    on_version(&[&a], 1).await;
    let calls = || async { stats(&running).await.map_or(0, |s| s.calls) };

    // A report lost on the way: the agent sends it into a stream that then dies.
    proxy.hold_up(true);
    succeed(&a, 3).await;
    eventually("the agent sends the report", || async {
        a.endpoint("ep").pending_counts().calls == 0
    })
    .await;
    assert_eq!(calls().await, 0, "held in the proxy");
    proxy.cut();
    eventually(
        "the report reaches the server on the next stream",
        || async { calls().await >= 3 },
    )
    .await;

    // An acknowledgement lost on the way back: the server counted the report, the agent does
    // not know and sends it again on the next stream.
    eventually("the agent is connected", || async { a.is_connected() }).await;
    proxy.hold_down(true);
    succeed(&a, 4).await;
    eventually("the server counts the report", || async {
        calls().await >= 7
    })
    .await;
    proxy.cut();
    eventually("the agent reconnects", || async { a.is_connected() }).await;

    // The next report follows anything sent again on the same stream.
    succeed(&a, 2).await;
    eventually("the last report arrives", || async { calls().await >= 9 }).await;
    let s = stats(&running).await.unwrap();
    assert_eq!(
        (s.calls, s.attempts, s.success_first_try),
        (9, 9, 9),
        "every call counted exactly once"
    );
    a.shutdown().await;
    assert_eq!(stats(&running).await.unwrap().calls, 9);
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_too_large_for_one_message_reach_the_server_in_several_reports() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane_with(dir.path(), &yaml(3), None, |cfg| {
        // No periodic report during the calls: they all go out in one, when version 2 comes.
        cfg.metrics_interval = Duration::from_secs(600);
        cfg.max_series = 100_000;
        cfg.max_series_per_service = 100_000;
    })
    .await;
    let a = agent(running.agent_addr, "a", None);
    on_version(&[&a], 1).await;
    // 22,000 endpoints with long names: about 5.7 MB of counts, over the 4 MiB a message may
    // be. In one report, the server would end the stream on it, and again on every resend.
    for i in 0..22_000 {
        a.endpoint(&format!("{i:0>250}"))
            .call(CallMeta::http("GET", "/"), Upstream::new([]).attempt())
            .await
            .unwrap();
    }
    succeed(&a, 1).await;
    assert_eq!(apply(&running, yaml(4)).await, 2);
    on_version(&[&a], 2).await;
    eventually("the counts reach the server", || async {
        stats(&running).await.is_some_and(|s| s.calls == 1)
    })
    .await;
    assert!(a.is_connected(), "{:?}", a.stream_error());
    assert!(a.stream_error().is_none(), "{:?}", a.stream_error());
    a.shutdown().await;
    running.shutdown().await.unwrap();
}

/// The control plane closes a connection that has carried no stream for its idle timeout: an
/// agent's connection always carries its stream, which goes on, receiving pushes and sending
/// its counts, without a reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_keeps_its_connection_past_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let idle = Duration::from_millis(200);
    let running = plane_with(dir.path(), &yaml(3), None, |cfg| {
        cfg.connection_idle_timeout = idle;
    })
    .await;
    let a = agent(running.agent_addr, "a", None);
    on_version(&[&a], 1).await;
    // Several idle timeouts pass (time passing is what is tested here).
    tokio::time::sleep(idle * 5).await;
    assert!(a.is_connected(), "{:?}", a.stream_error());
    assert_eq!(apply(&running, yaml(4)).await, 2);
    on_version(&[&a], 2).await;
    succeed(&a, 1).await;
    eventually("the counts reach the server", || async {
        stats(&running).await.is_some_and(|s| s.calls == 1)
    })
    .await;
    assert!(a.is_connected(), "{:?}", a.stream_error());
    assert!(a.stream_error().is_none(), "{:?}", a.stream_error());
    assert_eq!(listed_connected(&running, "a").await, Some(true));
    a.shutdown().await;
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_that_goes_silent_is_found_by_keepalive_and_the_agent_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(3), None).await;
    let proxy = Proxy::start(running.agent_addr).await;
    // The default ping (20 s, 10 s to answer) would not notice within the wait below.
    let a = builder(proxy.addr, "silent")
        .keepalive(Duration::from_secs(1), Duration::from_secs(1))
        .connect()
        .unwrap();
    on_version(&[&a], 1).await;

    // The control plane goes silent: the connection stays open and nothing comes through.
    proxy.hold_up(true);
    proxy.hold_down(true);
    eventually("keepalive finds the dead connection", || async {
        !a.is_connected()
    })
    .await;
    assert_eq!(attempts_of(&a).await, 3, "the policy in force is kept");

    // The network heals: the agent connects again and takes the next version.
    proxy.cut();
    eventually("the agent reconnects", || async { a.is_connected() }).await;
    apply(&running, yaml(5)).await;
    on_version(&[&a], 2).await;
    assert_eq!(attempts_of(&a).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_goes_silent_is_dropped_by_the_server_keepalive_and_shown_disconnected() {
    const CONNECTED: &str = "retryplane_server_agents_connected";
    let dir = tempfile::tempdir().unwrap();
    // With the default keepalive (a ping after 20 s, 10 s to answer) the server would not
    // notice within the waits below.
    let running = plane_with(dir.path(), &yaml(3), None, |cfg| {
        cfg.keepalive_interval = Duration::from_millis(200);
        cfg.keepalive_timeout = Duration::from_millis(200);
    })
    .await;
    let proxy = Proxy::start(running.agent_addr).await;
    // The agent's own pings are too slow to matter: only the server can notice.
    let a = builder(proxy.addr, "mute")
        .keepalive(Duration::from_secs(3600), Duration::from_secs(3600))
        .connect()
        .unwrap();
    on_version(&[&a], 1).await;
    eventually("the server lists the agent as connected", || async {
        listed_connected(&running, "mute").await == Some(true)
            && metric(&running, CONNECTED).await == Some(1.0)
    })
    .await;

    // The agent goes silent: its connection stays open, nothing comes back, not even PING acks.
    proxy.hold_up(true);
    proxy.hold_down(true);
    eventually("the server drops the silent agent", || async {
        listed_connected(&running, "mute").await == Some(false)
            && metric(&running, CONNECTED).await == Some(0.0)
    })
    .await;

    // The network heals: the agent connects again and shows as connected.
    proxy.cut();
    eventually("the agent is listed as connected again", || async {
        listed_connected(&running, "mute").await == Some(true)
            && metric(&running, CONNECTED).await == Some(1.0)
    })
    .await;
    a.shutdown().await;
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_handle_keeps_the_agent_running_after_the_agent_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(2), None).await;
    let a = agent(running.agent_addr, "a", None);
    on_version(&[&a], 1).await;
    let ep = a.endpoint("ep");
    drop(a);
    assert_eq!(apply(&running, yaml(4)).await, 2);
    eventually("the handle runs on version 2", || async {
        let count = Arc::new(AtomicU32::new(0));
        let err = ep
            .call(CallMeta::http("GET", "/"), failing(count))
            .await
            .unwrap_err();
        err.attempts == 4
    })
    .await;
    assert_eq!(listed_connected(&running, "a").await, Some(true));
    // The last handle gone, the agent's stream ends.
    drop(ep);
    eventually("the agent is shown disconnected", || async {
        listed_connected(&running, "a").await == Some(false)
    })
    .await;
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_sent_no_snapshot_reports_at_the_interval_of_the_control_plane_it_joins() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    // The first control plane has agents report hourly; its snapshot puts that in the cache.
    let running = plane_with(dir.path(), &yaml(3), None, |cfg| {
        cfg.metrics_interval = Duration::from_secs(3600);
    })
    .await;
    let a = agent(running.agent_addr, "a", Some(&cache));
    on_version(&[&a], 1).await;
    eventually("the cache holds version 1", || async {
        std::fs::metadata(&cache).is_ok_and(|m| m.len() > 0)
    })
    .await;
    a.shutdown().await;
    running.shutdown().await.unwrap();

    // The same store served again with a 200 ms interval: the agent, started from its cache,
    // is up to date and is sent no snapshot. It must still report at 200 ms, not hourly.
    let running = plane_with(dir.path(), &yaml(3), None, |cfg| {
        cfg.metrics_interval = Duration::from_millis(200);
    })
    .await;
    let a = agent(running.agent_addr, "a", Some(&cache));
    eventually("the agent connects", || async { a.is_connected() }).await;
    assert_eq!(a.policies().version(), 1);
    succeed(&a, 1).await;
    eventually("the call is reported well before an hour", || async {
        stats(&running).await.is_some_and(|s| s.calls == 1)
    })
    .await;
    assert_eq!(
        metric(&running, "retryplane_server_pushes_total").await,
        Some(0.0),
        "no snapshot was sent"
    );
    a.shutdown().await;
    running.shutdown().await.unwrap();
}

/// An endpoint named with megabytes (from request data, say) is reported under a cut of its
/// name, which the control plane counts in `other`: the report is no larger than the control
/// plane takes, so the agent's stream, its later reports and its ACKs go on. (Reported whole,
/// the name made a report the control plane refused, sent again first on every new stream.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_named_with_megabytes_does_not_cut_its_agent_off() {
    use retryplane_server::aggregate::Overflow;
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(3), None).await;
    let a = agent(running.agent_addr, "a", None);
    on_version(&[&a], 1).await;
    let huge = "x".repeat(2 << 20);
    let long = a.endpoint(&huge);
    assert_eq!(long.name().len(), 2 << 20, "the handle keeps its name");
    long.call(CallMeta::http("GET", "/"), Upstream::new([]).attempt())
        .await
        .unwrap();
    succeed(&a, 3).await;
    let aggregates = running.control().aggregates.clone();
    eventually(
        "the long name is counted in other, ep as itself",
        || async {
            aggregates.overflowed_by(Overflow::BadName) == 1
                && stats(&running).await.is_some_and(|s| s.calls == 3)
        },
    )
    .await;
    // The stream is still up: a policy change is applied and acknowledged.
    apply(&running, yaml(4)).await;
    eventually("the agent acknowledges version 2", || async {
        support::plane::agent_status(&running, "a")
            .await
            .is_some_and(|s| s.connected && s.applied_version == 2)
    })
    .await;
    succeed(&a, 2).await;
    eventually("later reports are counted", || async {
        stats(&running).await.is_some_and(|s| s.calls == 5)
    })
    .await;
    a.shutdown().await;
    assert_eq!(a.unacknowledged_reports(), 0);
    running.shutdown().await.unwrap();
}
