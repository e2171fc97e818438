//! An agent that starts from its cache file says so in its Hello: the cached version and
//! content hash, so the control plane can tell whether it is behind. Against the scripted
//! control plane (`support::script`), which records the Hello as sent.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use prost::Message as _;
use retryplane_agent::{Agent, Source};
use retryplane_proto::pb::agent_message::Kind;
use support::plane::attempts_of;
use support::script::{Script, send, snapshot};

fn agent(script: &Script, cache: &std::path::Path) -> Agent {
    support::plane::agent(script.addr, "a", Some(cache))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_after_a_start_from_the_cache_carries_the_cached_version_and_hash() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    let cached = snapshot(7, 4);
    std::fs::write(&cache, cached.encode_to_vec()).unwrap();

    let mut script = Script::start().await;
    let agent = agent(&script, &cache);
    // On the cached policies before the control plane says anything.
    let p = agent.policies();
    assert_eq!((p.source(), p.version()), (Source::Cache, 7));
    assert_eq!(attempts_of(&agent).await, 4);

    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(hello.agent_id, "a");
    assert_eq!(hello.stream, 1, "the process's first stream");
    let instance_id = hello.instance_id;
    assert_eq!(hello.last_applied_version, 7);
    assert_eq!(hello.last_applied_hash, cached.content_hash);

    // A newer version is applied and ACKed, and the next Hello carries it.
    let v8 = snapshot(8, 2);
    send(&to_agent, &v8).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    drop(to_agent);
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(
        (hello.last_applied_version, hello.last_applied_hash.as_str()),
        (8, v8.content_hash.as_str())
    );
    // The same process's next stream, numbered after the first.
    assert_eq!((hello.instance_id, hello.stream), (instance_id, 2));

    script.shut_down(agent, to_agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_without_a_usable_cache_says_version_zero() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    // A snapshot whose content does not match its hash is not used.
    let mut tampered = snapshot(7, 4);
    tampered.content_hash = "0".repeat(64);
    std::fs::write(&cache, tampered.encode_to_vec()).unwrap();

    let mut script = Script::start().await;
    let agent = agent(&script, &cache);
    assert_eq!(agent.policies().source(), Source::Fallback);
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(
        (hello.last_applied_version, hello.last_applied_hash.as_str()),
        (0, "")
    );
    // Not a cache this agent wrote: an applied snapshot does not replace it.
    send(&to_agent, &snapshot(8, 2)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    // Shutdown waits for the cache writes asked for: none may have replaced it.
    script.shut_down(agent, to_agent).await;
    assert_eq!(std::fs::read(&cache).unwrap(), tampered.encode_to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_is_not_a_cache_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    // The policies file given as the cache file by mistake.
    let cache = dir.path().join("policies.yaml");
    let yaml = b"version: 1\nendpoints:\n  a: {max_attempts: 4}\n";
    std::fs::write(&cache, yaml).unwrap();

    let mut script = Script::start().await;
    let agent = agent(&script, &cache);
    assert_eq!(agent.policies().source(), Source::Fallback);
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(8, 2)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    assert_eq!(
        attempts_of(&agent).await,
        2,
        "the snapshot applies all the same"
    );
    // Shutdown waits for the cache writes asked for: none may have replaced it.
    script.shut_down(agent, to_agent).await;
    assert_eq!(std::fs::read(&cache).unwrap(), yaml);
}

/// An agent started on a cache file holding `bytes`, which it cannot use, runs the fallback
/// policy; the next snapshot applied (v8) replaces the file, and a restart with no control
/// plane starts on it.
async fn replaced_by_the_next_snapshot(bytes: &[u8]) {
    // The first line of every cache file the agent writes.
    const HEADER: &[u8] = b"retryplane agent policy cache 1\n";
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    std::fs::write(&cache, bytes).unwrap();

    let mut script = Script::start().await;
    let agent = agent(&script, &cache);
    assert_eq!(agent.policies().source(), Source::Fallback);
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(8, 2)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    support::plane::eventually("the cache file is replaced", || async {
        std::fs::read(&cache).unwrap() != bytes
    })
    .await;
    assert!(std::fs::read(&cache).unwrap().starts_with(HEADER));
    script.shut_down(agent, to_agent).await;

    // A restart with no control plane starts on it.
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap();
    drop(nothing);
    let restarted = support::plane::agent(addr, "a", Some(&cache));
    let p = restarted.policies();
    assert_eq!((p.source(), p.version()), (Source::Cache, 8));
    assert_eq!(attempts_of(&restarted).await, 2);
    restarted.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_cache_file_of_the_agents_own_is_replaced_by_the_next_snapshot() {
    // A cache file as the agent writes it, damaged on disk: its hash no longer matches.
    let mut damaged = snapshot(7, 4);
    damaged.content_hash = "0".repeat(64);
    let header = b"retryplane agent policy cache 1\n".as_slice();
    replaced_by_the_next_snapshot(&[header, &damaged.encode_to_vec()].concat()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_file_of_zero_bytes_only_is_replaced_by_the_next_snapshot() {
    // f13: what a file system that lost its writes leaves (the file's length kept, its bytes
    // zeros) was taken for another's file: left as it was and no cache kept for the run, so
    // the next start without a control plane was on the fallback again, every time.
    replaced_by_the_next_snapshot(&[0u8; 6905]).await;
}

/// A cache write that never finished (the agent killed, or the host losing power, between
/// creating its temporary file beside the cache file and renaming it over the cache) leaves
/// that temporary file, `.agent.cache.tmp-*`, up to the size of a cache (16 MiB). No agent ever
/// removes one: each such interruption adds another, for good, on the volume the cache is kept
/// on, until that volume is full and no cache can be written at all. (The control plane, in
/// the same case, deletes what an interrupted first start left once it is a minute old and no
/// process holds it.) An hour-old leftover of the agent's own naming is still there after a
/// run that wrote the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_cache_file_an_interrupted_write_left_is_removed() {
    const HEADER: &[u8] = b"retryplane agent policy cache 1\n";
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    // What a write killed half-way leaves: the header and part of a snapshot.
    let leftover = dir.path().join(".agent.cache.tmp-Ab12Cd");
    let part = snapshot(6, 3).encode_to_vec();
    std::fs::write(&leftover, [HEADER, &part[..part.len() / 2]].concat()).unwrap();
    let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&leftover)
        .unwrap()
        .set_modified(an_hour_ago)
        .unwrap();

    let mut script = Script::start().await;
    let agent = agent(&script, &cache);
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(8, 2)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    // Shutdown waits for the cache writes asked for.
    script.shut_down(agent, to_agent).await;
    assert!(std::fs::read(&cache).unwrap().starts_with(HEADER));
    assert!(
        !leftover.exists(),
        "the temporary file of an interrupted cache write is still there: {:?}",
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>()
    );
}

/// A cache write that fails for a while (the cache's volume full until its logs are rotated,
/// the volume briefly gone) is never tried again: the cache file keeps the version before
/// until the control plane publishes another one, which may be weeks later. Here the agent
/// runs on version 8, the disk takes writes again, the stream even reconnects (the agent is up
/// to date, so nothing is sent to it), and a restart while the control plane is unreachable
/// still starts on version 7. The failure is stood in for by the cache's directory moved aside
/// during the write and put back after it (the cache file, with version 7, in it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_write_that_failed_is_done_once_the_disk_takes_writes_again() {
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().join("cache");
    let aside = dir.path().join("cache.aside");
    std::fs::create_dir(&cache_dir).unwrap();
    let cache = cache_dir.join("agent.cache");
    // Version 7, as an earlier run cached it.
    std::fs::write(&cache, snapshot(7, 4).encode_to_vec()).unwrap();

    let mut script = Script::start().await;
    let agent = agent(&script, &cache);
    assert_eq!(agent.policies().version(), 7);
    let (to_agent, _) = script.reconnected().await;
    // The write of version 8 fails.
    std::fs::rename(&cache_dir, &aside).unwrap();
    send(&to_agent, &snapshot(8, 2)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 8),
        other => panic!("expected Ack v8, got {other:?}"),
    }
    // The ACK goes out once the write is done (failed, here), within the agent's 1 s bound.
    assert_eq!(attempts_of(&agent).await, 2, "version 8 is in force");
    // The disk takes writes again.
    std::fs::rename(&aside, &cache_dir).unwrap();
    // A reconnect: the agent is up to date, nothing is sent.
    drop(to_agent);
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(hello.last_applied_version, 8);
    // Up to 10 s for any retry of the write.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let bytes = std::fs::read(&cache).unwrap_or_default();
        if bytes != snapshot(7, 4).encode_to_vec() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    script.shut_down(agent, to_agent).await;

    // A restart with no control plane.
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap();
    drop(nothing);
    let restarted = support::plane::agent(addr, "a", Some(&cache));
    let p = restarted.policies();
    let started_on = (p.source(), p.version());
    restarted.shutdown().await;
    assert_eq!(
        started_on,
        (Source::Cache, 8),
        "the restart should start on version 8, which was in force, not on the version the \
         cache held before its write failed"
    );
}
