//! The agent's own connector (`stream::counted`) behaves as tonic's `endpoint.connect()` did:
//! any scheme the agent's URL check lets through, host names and IPv6 literals, and the same
//! errors when nothing listens or the connection hangs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use retryplane_agent::StreamError;
use support::script::Script;
use tokio::time::Instant;

/// Whether an agent given `url` (its control plane: `script`) opens a stream within 5 s; the
/// agent's stream error if not.
async fn opens_a_stream(script: &mut Script, id: &str, url: String) -> Result<(), String> {
    let agent = support::plane::builder(script.addr, id)
        .url(url)
        .connect()
        .expect("the agent's URL check takes the URL");
    let opened = tokio::time::timeout(Duration::from_secs(5), script.reconnected()).await;
    let error = agent.stream_error();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent.shutdown()).await;
    opened
        .map(drop)
        .map_err(|_| format!("no stream within 5 s; the agent's stream error: {error:?}"))
}

/// The first stream error of an agent of the control plane at `addr` (`within` at most), and
/// how long it took.
async fn first_error(addr: SocketAddr, within: Duration) -> (StreamError, Duration) {
    let started = Instant::now();
    let agent = support::plane::builder(addr, "a").connect().unwrap();
    let error = loop {
        if let Some(e) = agent.stream_error() {
            break e;
        }
        assert!(
            started.elapsed() < within,
            "no stream error within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let took = started.elapsed();
    agent.shutdown().await;
    (error, took)
}

/// `check_url` lets `grpc://`, the usual name of clear-text gRPC, through as `http://`, and so
/// does the connector: `grpc://host:port` reaches the control plane. (A connector that
/// enforced `http` failed every try, for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_whose_scheme_is_not_http_still_reaches_the_control_plane() {
    let mut script = Script::start().await;
    let url = format!("grpc://{}", script.addr);
    opens_a_stream(&mut script, "a", url).await.unwrap();
}

/// Nothing listens: "Connection refused". The connection hangs (SYN never answered): the 5 s
/// connect timeout ends the try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_when_refused_and_when_the_connect_times_out() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (refused, _) = first_error(dead, Duration::from_secs(5)).await;
    assert!(
        refused.message.contains("Connection refused"),
        "{refused:?}"
    );
    let (hanging, _held) = support::full_backlog().await;
    let (_, took) = first_error(hanging.local_addr().unwrap(), Duration::from_secs(12)).await;
    assert!(took < Duration::from_secs(7), "{took:?}");
}

/// A host name (`localhost`) connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_connects() {
    let mut script = Script::start().await;
    let url = format!("http://localhost:{}", script.addr.port());
    opens_a_stream(&mut script, "a", url).await.unwrap();
}

/// `HTTP://` (upper case) and an IPv6 literal `http://[::1]:PORT` connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upper_case_scheme_and_ipv6_literal_connect() {
    let mut script = Script::start().await;
    let url = format!("HTTP://{}", script.addr);
    opens_a_stream(&mut script, "a", url).await.unwrap();
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
    let url = format!("http://[::1]:{port}");
    opens_a_stream(&mut script, "b", url).await.unwrap();
}

/// A listener that takes each connection and closes it (a balancer with no control plane
/// behind it): every session makes one connection, and sessions come the backoff apart, never
/// two connections for one try (tonic's channel dials again at once when its connection fails
/// under a request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_try_makes_one_connection_against_a_listener_that_closes_them() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let times = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let accept = {
        let times = times.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                times.lock().unwrap().push(Instant::now());
                drop(s);
            }
        })
    };
    let agent = retryplane_agent::Agent::builder()
        .url(format!("http://{addr}"))
        .service("s")
        .rng_seed(7)
        .reconnect_backoff(retryplane_agent::ReconnectBackoff::new(
            Duration::from_millis(40),
            Duration::from_millis(80),
            Duration::from_secs(10),
        ))
        .connect()
        .unwrap();
    let started = Instant::now();
    while times.lock().unwrap().len() < 13 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            times.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    agent.shutdown().await;
    accept.abort();
    let times = times.lock().unwrap().clone();
    let gaps: Vec<u128> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    // The backoff's first ceiling is 40 ms, and a full jitter draws from half of it up.
    assert!(gaps.iter().all(|&g| g >= 15), "gaps (ms): {gaps:?}");
}
