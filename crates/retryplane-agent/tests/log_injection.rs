//! What the agent logs of a control plane's own words: a status message holding a line break
//! (`grpc-message` is percent-encoded on the wire, and tonic decodes it) is written into the
//! agent's log as it came, so whatever answers at the URL writes lines of its choosing there.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

/// A peer at the agent's URL that answers each stream with a Trailers-Only `UNAUTHENTICATED`
/// whose message breaks the line and forges one of the agent's own.
async fn refusing_peer() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        // Bounded: the first 20 connections.
        for _ in 0..20 {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .header("grpc-status", "16")
                        .header(
                            "grpc-message",
                            "bad%0A2026-01-01T00:00:00.000000Z  INFO retryplane_agent: FORGED",
                        )
                        .body(())
                        .unwrap();
                    let _ = respond.send_response(response, true);
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "current_thread")]
async fn a_status_message_with_a_line_break_does_not_make_a_line_of_its_own_in_the_log() {
    let (sink, _guard) = support::capture_logs("retryplane_agent=info");
    let addr = refusing_peer().await;
    let agent = support::plane::builder(addr, "a").connect().unwrap();
    support::plane::eventually("the stream refused", || async {
        agent.stream_error().is_some() && sink.text().contains("FORGED")
    })
    .await;
    agent.shutdown().await;
    let log = sink.text();
    let forged: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("2026-01-01T00:00:00.000000Z  INFO retryplane_agent: FORGED"))
        .collect();
    assert!(forged.is_empty(), "a line the peer wrote:\n{log}");
}
