//! What an agent says in its log when it has no stream to its control plane: at start, the
//! policies it runs (the cached ones, or the fallback policy and why), and a refusal that trying
//! again will not fix (a token, a Hello, a URL), at warn once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::Path;

use prost::Message as _;
use retryplane_agent::{Agent, Source};

/// The agent's info-and-up log lines while an agent with `cache` (if any) starts with no
/// control plane and fails its first connection, and the source of its policies.
async fn start(cache: Option<&Path>) -> (String, Source) {
    let (sink, _guard) = support::capture_logs("retryplane_agent=info");
    // Nothing listens there.
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap();
    drop(nothing);
    let agent: Agent = support::plane::agent(addr, "a", cache);
    support::plane::eventually("the first connection fails", || async {
        agent.stream_error().is_some()
    })
    .await;
    let source = agent.policies().source();
    agent.shutdown().await;
    let text = sink.text();
    (text, source)
}

#[tokio::test(flavor = "current_thread")]
async fn a_start_on_the_fallback_policy_says_so_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, bytes: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let header = b"retryplane agent policy cache 1\n".as_slice();
    let truncated = file("truncated.cache", &[header, b"\x08\x07\x12\x40"].concat());
    let foreign = file("garbage.cache", b"\x00\x01not a cache at all");
    let empty = file("empty.cache", b"");
    // (case, cache file, what the line about the cache file says)
    let cases = [
        ("no cache file", None, None),
        (
            "a missing file",
            Some(dir.path().join("missing.cache")),
            Some("no policy cache yet"),
        ),
        (
            "a missing directory",
            Some(dir.path().join("no-such-dir/agent.cache")),
            Some("directory does not exist"),
        ),
        (
            "an empty file",
            Some(empty),
            Some("the policy cache is empty"),
        ),
        ("a truncated file", Some(truncated), Some("not usable")),
        ("a foreign file", Some(foreign), Some("not a policy cache")),
        (
            "a directory",
            Some(dir.path().to_owned()),
            Some("not a regular file"),
        ),
    ];
    for (what, path, says) in cases {
        let (log, source) = start(path.as_deref()).await;
        assert_eq!(source, Source::Fallback, "{what}");
        assert!(
            log.lines().any(|l| l.contains("INFO")
                && l.contains("starting on the fallback policy")
                && l.contains("max_attempts=2")),
            "{what}: {log}"
        );
        if let (Some(path), Some(says)) = (path, says) {
            let file = format!("file={}", path.display());
            assert!(
                log.lines().any(|l| l.contains(&file) && l.contains(says)),
                "{what}: {log}"
            );
        }
    }
    // A usable cache: its policies, and no word of the fallback.
    let good = file(
        "good.cache",
        &[header, &support::script::snapshot(7, 4).encode_to_vec()].concat(),
    );
    let (log, source) = start(Some(&good)).await;
    assert_eq!(source, Source::Cache);
    assert!(log.contains("starting on cached policies"), "{log}");
    assert!(!log.contains("fallback"), "{log}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_refusal_that_trying_again_will_not_fix_is_said_once_at_warn() {
    const SECRET: &str = "agent-secret-0123456789";
    const WRONG: &str = "wrong-secret-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.yaml");
    let file = format!("tokens:\n  - {{name: a, role: agent, secret: {SECRET}}}\n");
    std::fs::write(&tokens, file).unwrap();
    let running = support::plane::plane_with(dir.path(), &support::plane::yaml(2), None, |cfg| {
        cfg.tokens_file = Some(tokens.clone());
        // Tighter than the agent's own check of its Hello (the default bound), so that a
        // Hello the agent sends is refused here.
        cfg.stream_limits.max_field_len = 32;
    })
    .await;
    let (sink, _guard) = support::capture_logs("retryplane_agent=debug");
    let text = || sink.text();
    let bad = support::plane::builder(running.agent_addr, "bad")
        .token(WRONG)
        .connect()
        .unwrap();
    support::plane::eventually("several tries", || async {
        text().matches("UNAUTHENTICATED").count() >= 5
    })
    .await;
    let code = bad.stream_error().and_then(|e| e.code);
    assert_eq!(code, Some(tonic::Code::Unauthenticated));
    bad.shutdown().await;
    let log = text();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(warned[0].contains("the token the agent is given"), "{log}");
    assert!(!log.contains(WRONG), "{log}");

    // A Hello the control plane refuses (an agent id longer than its bound), and a URL that is not the
    // agent listener (the admin one): the same, with what to check.
    for (url, id, check, code) in [
        (
            format!("http://{}", running.agent_addr),
            "x".repeat(40),
            "its Hello's id, service and labels",
            tonic::Code::InvalidArgument,
        ),
        (
            format!("http://{}", running.admin_addr),
            "a".to_owned(),
            "agent listener",
            tonic::Code::Unimplemented,
        ),
    ] {
        sink.clear();
        let refused = support::plane::builder(running.agent_addr, &id)
            .url(url)
            .token(SECRET)
            .connect()
            .unwrap();
        support::plane::eventually("several tries", || async {
            text().matches("stream refused").count() >= 5
        })
        .await;
        assert_eq!(refused.stream_error().and_then(|e| e.code), Some(code));
        refused.shutdown().await;
        let log = text();
        let warned: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warned.len(), 1, "{log}");
        assert!(warned[0].contains(check), "{log}");
    }

    // With the right token: no warning.
    sink.clear();
    let good = support::plane::builder(running.agent_addr, "good")
        .token(SECRET)
        .connect()
        .unwrap();
    support::plane::eventually("connected", || async { good.is_connected() }).await;
    good.shutdown().await;
    assert!(!text().contains("WARN"), "{}", text());
    running.shutdown().await.unwrap();
}

/// A web server that speaks HTTP/2 with prior knowledge and answers every request with a 404,
/// as one without the agent service does.
async fn h2_not_found() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = connection.accept().await {
                    let answer = http::Response::builder().status(404).body(()).unwrap();
                    let _ = respond.send_response(answer, true);
                }
            });
        }
    });
    addr
}

/// A web server at the agent's URL answers the stream with a 404, which tonic hands back as an
/// opened stream whose first read fails: the agent takes it for the refusal it is, never for a
/// stream that was up (no "connected" line, and the reason says the answer is not gRPC).
#[tokio::test(flavor = "current_thread")]
async fn a_web_servers_answer_is_a_refusal_not_an_opened_stream() {
    let web = h2_not_found().await;
    let (sink, _guard) = support::capture_logs("retryplane_agent=debug");
    let agent = Agent::builder()
        .url(format!("http://{web}"))
        .service("s")
        .reconnect_backoff(retryplane_agent::ReconnectBackoff::new(
            std::time::Duration::from_millis(5),
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(10),
        ))
        .connect()
        .unwrap();
    support::plane::eventually("three refusals", || async {
        sink.text().matches("the answer is not gRPC").count() >= 3
    })
    .await;
    let error = agent.stream_error().unwrap();
    agent.shutdown().await;
    assert!(
        error
            .message
            .starts_with("stream refused: the answer is not gRPC: UNIMPLEMENTED"),
        "{error:?}"
    );
    let text = sink.text();
    assert_eq!(
        text.matches("connected to the control plane").count(),
        0,
        "{text}"
    );
}

/// A plain HTTP/1.1 server at the agent's URL: the reason carries what went wrong below the
/// status (tonic's message alone is `operation was canceled`, `h2 protocol error: http2 error`
/// or `transport error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_server_at_the_url_is_named_by_the_cause_below_the_status() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let h1 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = h1.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = h1.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    .await;
                // Kept open until the client lets go: what it read is its only error.
                while s.read(&mut buf).await.is_ok_and(|n| n > 0) {}
            });
        }
    });
    let agent = Agent::builder()
        .url(format!("http://{addr}"))
        .service("s")
        .connect()
        .unwrap();
    support::plane::eventually("an error", || async { agent.stream_error().is_some() }).await;
    let error = agent.stream_error().unwrap();
    agent.shutdown().await;
    eprintln!("{error:?}");
    assert!(
        // What comes after it depends on whether the request was still waiting when h2 read
        // the HTTP/1 answer as a frame (`frame with invalid size`, `connection closed`, …):
        // either way, the transport error's causes follow the status's own message.
        error.message.contains("transport error: "),
        "{error:?}"
    );
}

/// An HTTP/2 server that answers every request `200`, `content-type: text/html`, and then
/// sends nothing more (a slow web page). Each answer sent is signalled.
async fn html_server() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        // Bounded: 20 connections.
        for _ in 0..20 {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                let mut held = Vec::new();
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "text/html")
                        .body(())
                        .unwrap();
                    if let Ok(send) = respond.send_response(response, false) {
                        held.push(send);
                    }
                    let _ = tx.send(());
                }
            });
        }
    });
    (addr, rx)
}

/// A web page that never ends at the agent's URL: the session takes it for a refusal, with the
/// hint for a URL that is not the agent listener (UNIMPLEMENTED whatever tonic makes of the
/// page), and a shutdown meanwhile is not held by the read of the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_that_never_ends_is_a_refusal_that_holds_no_shutdown() {
    let (addr, mut answered) = html_server().await;
    let agent = support::plane::agent(addr, "html", None);
    tokio::time::timeout(std::time::Duration::from_secs(10), answered.recv())
        .await
        .expect("the agent opens its stream")
        .unwrap();
    // The session reads the page (for what tonic makes of it) for 2 s at most.
    support::plane::eventually("the refusal", || async { agent.stream_error().is_some() }).await;
    let error = agent.stream_error().unwrap();
    assert_eq!(error.code, Some(tonic::Code::Unimplemented), "{error:?}");
    assert!(
        error
            .message
            .starts_with("stream refused: the answer is not gRPC"),
        "{error:?}"
    );
    // The next try reads the page again: a shutdown then does not wait for it.
    tokio::time::timeout(std::time::Duration::from_secs(10), answered.recv())
        .await
        .expect("the agent tries again")
        .unwrap();
    let began = tokio::time::Instant::now();
    agent.shutdown().await;
    assert!(
        began.elapsed() < std::time::Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
}

/// A stream the control plane ends for a reason trying again will not fix (a tokens reload that
/// takes the agent id from its token's `agent_ids`), then refuses again at every reconnect for
/// the same reason: warned once, not once for the end and again for the first refusal.
#[tokio::test(flavor = "current_thread")]
async fn a_stream_ended_then_refused_for_the_same_reason_is_warned_once() {
    const SECRET: &str = "agent-secret-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.yaml");
    let file = |ids: &str| {
        format!("tokens:\n  - {{name: a, role: agent, secret: {SECRET}, agent_ids: [{ids}]}}\n")
    };
    std::fs::write(&tokens, file("ok-*")).unwrap();
    let running = support::plane::plane_with(dir.path(), &support::plane::yaml(2), None, |cfg| {
        cfg.tokens_file = Some(tokens.clone());
    })
    .await;
    let (sink, _guard) = support::capture_logs("retryplane_agent=debug");
    let text = || sink.text();
    let agent = support::plane::builder(running.agent_addr, "ok-1")
        .token(SECRET)
        .connect()
        .unwrap();
    support::plane::eventually("connected", || async { agent.is_connected() }).await;
    std::fs::write(&tokens, file("other-*")).unwrap();
    running.reload_tokens().unwrap();
    support::plane::eventually("the end and several refusals", || async {
        text().matches("PERMISSION_DENIED").count() >= 4
    })
    .await;
    agent.shutdown().await;
    let log = text();
    assert!(log.contains("stream ended: PERMISSION_DENIED"), "{log}");
    assert!(log.contains("stream refused: PERMISSION_DENIED"), "{log}");
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warned.len(), 1, "{log}");
    running.shutdown().await.unwrap();
}

/// A control-plane URL with a path and a query connects (only its scheme, host and port are
/// used), and the agent says at warn that the rest is not, without quoting it (a query may
/// hold a credential).
#[tokio::test(flavor = "current_thread")]
async fn a_url_with_a_path_and_query_is_warned_that_they_are_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let running =
        support::plane::plane_with(dir.path(), &support::plane::yaml(2), None, |_| {}).await;
    let (sink, _guard) = support::capture_logs("retryplane_agent=info");
    let agent = support::plane::builder(running.agent_addr, "a")
        .url(format!(
            "http://{}/retryplane?secret=s3cr3t",
            running.agent_addr
        ))
        .connect()
        .unwrap();
    support::plane::eventually("connected", || async { agent.is_connected() }).await;
    agent.shutdown().await;
    let log = sink.text();
    assert!(
        log.contains("the path and query of the control-plane URL are not used"),
        "{log}"
    );
    assert!(!log.contains("s3cr3t"), "{log}");
    running.shutdown().await.unwrap();
}

/// A control plane that refuses the stream at one of its limits (`RESOURCE_EXHAUSTED`: here its
/// most agents) is said to be reached and at a limit, not unreachable.
#[tokio::test(flavor = "current_thread")]
async fn a_control_plane_at_one_of_its_limits_is_not_said_to_be_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let running = support::plane::plane_with(dir.path(), &support::plane::yaml(2), None, |cfg| {
        cfg.max_agents = 1;
    })
    .await;
    let first = support::plane::builder(running.agent_addr, "first")
        .connect()
        .unwrap();
    support::plane::eventually("the first connected", || async { first.is_connected() }).await;
    let (sink, _guard) = support::capture_logs("retryplane_agent=debug");
    let text = || sink.text();
    let second = support::plane::builder(running.agent_addr, "second")
        .connect()
        .unwrap();
    support::plane::eventually("refused", || async {
        text().contains("RESOURCE_EXHAUSTED")
    })
    .await;
    assert_eq!(
        second.stream_error().and_then(|e| e.code),
        Some(tonic::Code::ResourceExhausted)
    );
    second.shutdown().await;
    let log = text();
    assert!(
        log.contains("the control plane refuses this agent's stream (at one of its limits)"),
        "{log}"
    );
    assert!(!log.contains("cannot reach the control plane"), "{log}");
    first.shutdown().await;
    running.shutdown().await.unwrap();
}
