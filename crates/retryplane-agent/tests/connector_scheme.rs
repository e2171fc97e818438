//! The agent's own connector (`stream::counted`) behaves as tonic's `endpoint.connect()` did.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::script::Script;
use tokio::time::Instant;

/// `check_url` lets through every scheme but `https` (and documents that it refuses only URLs
/// with which no connection can ever be made). tonic's own connector does not enforce
/// `http` (`enforce_http(false)`), so `grpc://host:port` reached the control plane; the new
/// connector is a default `HttpConnector` (`enforce_http` true): every try fails with
/// "invalid URL, scheme is not http", for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_r5_a_url_whose_scheme_is_not_http_still_reaches_the_control_plane() {
    let mut script = Script::start().await;
    let agent = support::plane::builder(script.addr, "a")
        .url(format!("grpc://{}", script.addr))
        .connect()
        .expect("check_url takes a grpc:// URL");
    let opened = tokio::time::timeout(Duration::from_secs(5), script.reconnected()).await;
    let error = agent.stream_error();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent.shutdown()).await;
    assert!(
        opened.is_ok(),
        "no stream within 5 s; the agent's stream error: {error:?}"
    );
}

/// What the agent says when nothing listens, and when the connection hangs (connect timeout),
/// printed to compare with the previous commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_r5_errors_when_refused_and_when_the_connect_times_out() {
    // Refused.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let agent = support::plane::builder(dead, "a").connect().unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        if let Some(e) = agent.stream_error() {
            break e;
        }
        assert!(Instant::now() < until, "no stream error");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    agent.shutdown().await;
    println!("REFUSED: {refused:?}");
    // Hanging connect (SYN never answered): the 5 s connect timeout.
    let (l, _held) = support::full_backlog().await;
    let addr = l.local_addr().unwrap();
    let started = Instant::now();
    let agent = support::plane::builder(addr, "b").connect().unwrap();
    let until = Instant::now() + Duration::from_secs(12);
    let hung = loop {
        if let Some(e) = agent.stream_error() {
            break e;
        }
        assert!(
            Instant::now() < until,
            "no stream error within 12 s: connect timeout lost"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let took = started.elapsed();
    agent.shutdown().await;
    println!("HUNG after {took:?}: {hung:?}");
    assert!(
        refused.message.contains("Connection refused"),
        "{refused:?}"
    );
    assert!(took < Duration::from_secs(7), "{took:?}");
}

/// A host name (`localhost`) connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_r5_a_host_name_connects() {
    let mut script = Script::start().await;
    let agent = support::plane::builder(script.addr, "a")
        .url(format!("http://localhost:{}", script.addr.port()))
        .connect()
        .unwrap();
    let opened = tokio::time::timeout(Duration::from_secs(5), script.reconnected()).await;
    let error = agent.stream_error();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent.shutdown()).await;
    assert!(opened.is_ok(), "{error:?}");
}

/// `HTTP://` (upper case) and an IPv6 literal `http://[::1]:PORT` connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_r5_upper_case_scheme_and_ipv6_literal_connect() {
    let mut script = Script::start().await;
    let agent = support::plane::builder(script.addr, "a")
        .url(format!("HTTP://{}", script.addr))
        .connect()
        .unwrap();
    let opened = tokio::time::timeout(Duration::from_secs(5), script.reconnected()).await;
    let error = agent.stream_error();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent.shutdown()).await;
    assert!(opened.is_ok(), "HTTP://: {error:?}");
    // IPv6: a plain TCP forwarder from [::1] to the script's 127.0.0.1 listener.
    let Ok(v6) = tokio::net::TcpListener::bind("[::1]:0").await else {
        println!("no IPv6 loopback here: skipped");
        return;
    };
    let port = v6.local_addr().unwrap().port();
    let to = script.addr;
    tokio::spawn(async move {
        while let Ok((mut a, _)) = v6.accept().await {
            tokio::spawn(async move {
                let mut b = tokio::net::TcpStream::connect(to).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut a, &mut b).await;
            });
        }
    });
    let agent = support::plane::builder(script.addr, "b")
        .url(format!("http://[::1]:{port}"))
        .connect()
        .unwrap();
    let opened = tokio::time::timeout(Duration::from_secs(5), script.reconnected()).await;
    let error = agent.stream_error();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent.shutdown()).await;
    assert!(opened.is_ok(), "[::1]: {error:?}");
}
