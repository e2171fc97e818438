//! A real Prometheus server scrapes the control plane while real agents make real HTTP calls
//! with known numbers of retries; the figures read back through Prometheus' query API must be
//! exact (issue: fleet observability).
//!
//! Needs the `prometheus` binary: `scripts/test` installs Debian's package when it is missing;
//! `RETRYPLANE_PROMETHEUS` may name another binary.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::routing::get;
use retryplane_agent::{Agent, CallMeta, ReconnectBackoff};
use retryplane_server::server::{Running, ServeConfig, start};
use tokio::process::{Child, Command};

/// How long one wait may take. Prometheus scrapes every second and its first scrape can come a
/// few seconds after it starts.
const WAIT: Duration = Duration::from_secs(60);

/// Fast, deterministic pauses; no budget or breaker, so every failure is retried.
const POLICY: &str = "version: 1
defaults:
  max_attempts: 3
  backoff: {base: 1ms, max: 2ms, jitter: none}
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
endpoints:
  ep: {}
";

/// The Prometheus binary: `RETRYPLANE_PROMETHEUS`, else `prometheus` on `PATH`.
fn prometheus_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("RETRYPLANE_PROMETHEUS") {
        return PathBuf::from(p);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("prometheus"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "this test needs a Prometheus server: run `scripts/test` (it installs Debian's \
             `prometheus` package) or set RETRYPLANE_PROMETHEUS to a prometheus binary"
        )
    })
}

/// Runs `promtool check metrics` (beside the Prometheus binary, else on `PATH`) on `text`
/// and fails with what it said unless it found nothing to say.
async fn promtool_checks_clean(text: &str) {
    use tokio::io::AsyncWriteExt as _;
    let beside = prometheus_binary().with_file_name("promtool");
    let promtool = if beside.is_file() {
        beside
    } else {
        PathBuf::from("promtool")
    };
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", promtool.display()));
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(text.as_bytes()).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {:?}\n{said}\n{text}",
        out.status
    );
}

/// A port that was free a moment ago (Prometheus takes an address, not a listener).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Prometheus server on loopback scraping `target` every second; killed on drop.
struct Prometheus {
    addr: SocketAddr,
    _child: Child,
    http: reqwest::Client,
}

impl Prometheus {
    async fn start(dir: &Path, target: SocketAddr) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: retryplane\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(prometheus_binary())
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("prometheus starts");
        let prometheus = Prometheus {
            addr,
            _child: child,
            http: reqwest::Client::new(),
        };
        let ready = format!("http://{addr}/-/ready");
        poll("prometheus is ready", || async {
            let r = prometheus.http.get(&ready).send().await;
            r.is_ok_and(|r| r.status().is_success())
        })
        .await;
        prometheus
    }

    /// The answer of Prometheus' query API to the instant query `query`, as JSON.
    async fn query(&self, query: &str) -> Result<serde_json::Value, String> {
        let r = self
            .http
            .get(format!("http://{}/api/v1/query", self.addr))
            .query(&[("query", query)])
            .send()
            .await
            .map_err(|e| e.to_string())?;
        r.json().await.map_err(|e| e.to_string())
    }

    /// The value of an instant query that returns one sample, if it returns exactly one.
    async fn value(&self, query: &str) -> Option<f64> {
        let body = self.query(query).await.ok()?;
        let result = body["data"]["result"].as_array()?;
        match result.as_slice() {
            [one] => one["value"][1].as_str()?.parse().ok(),
            _ => None,
        }
    }

    /// Whether Prometheus takes `query` (its query API answers `success`, whatever it finds).
    async fn accepts(&self, query: &str) -> Result<(), String> {
        let body = self.query(query).await?;
        match body["status"].as_str() {
            Some("success") => Ok(()),
            _ => Err(body.to_string()),
        }
    }

    /// Waits until `query` returns `want` exactly.
    async fn wait_for(&self, query: &str, want: f64) {
        let mut last = None;
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            last = self.value(query).await.or(last);
            if last == Some(want) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{query}: want {want}, Prometheus last said {last:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Polls `check` every 100 ms until it holds, failing after [`WAIT`].
async fn poll<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An upstream on loopback: `/ok` answers 200; `/fail/{n}/{key}` answers 503 to the first `n`
/// requests for `key`, then 200.
async fn upstream() -> SocketAddr {
    type Seen = Arc<Mutex<HashMap<String, u32>>>;
    async fn fail(
        State(seen): State<Seen>,
        UrlPath((n, key)): UrlPath<(u32, String)>,
    ) -> StatusCode {
        let mut seen = seen.lock().unwrap();
        let count = seen.entry(key).or_default();
        *count += 1;
        if *count <= n {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::OK
        }
    }
    let app = Router::new()
        .route("/ok", get(|| async { StatusCode::OK }))
        .route("/fail/{n}/{key}", get(fail))
        .with_state(Seen::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn plane(dir: &Path) -> Running {
    std::fs::write(dir.join("policies.yaml"), POLICY).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    start(ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        metrics_interval: Duration::from_millis(200),
        ..ServeConfig::default()
    })
    .await
    .unwrap()
}

fn agent(addr: SocketAddr, service: &str) -> Agent {
    Agent::builder()
        .url(format!("http://{addr}"))
        .service(service)
        .agent_id(format!("{service}-1"))
        .rng_seed(1)
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(300),
            Duration::from_secs(10),
        ))
        .connect()
        .unwrap()
}

/// One logical GET of `url` through `agent`'s `ep`; true when it ended in success.
async fn get_once(agent: &Agent, http: &reqwest::Client, url: &str) -> bool {
    let path = url
        .split_once("//")
        .map_or(url, |(_, rest)| rest.find('/').map_or("/", |i| &rest[i..]));
    agent
        .endpoint("ep")
        .call(CallMeta::http("GET", path), |_| async {
            let r = http.get(url).send().await?;
            Ok::<_, reqwest::Error>(
                http::Response::builder()
                    .status(r.status())
                    .body(())
                    .unwrap(),
            )
        })
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_reads_back_exactly_what_agents_did() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path()).await;
    let prometheus = Prometheus::start(dir.path(), running.http_addr).await;
    let up = upstream().await;
    let http = reqwest::Client::new();

    let checkout = agent(running.agent_addr, "checkout");
    let search = agent(running.agent_addr, "search");
    poll("both agents on version 1", || async {
        checkout.policies().version() == 1 && search.policies().version() == 1
    })
    .await;

    // checkout: 30 calls that succeed at once, 10 that succeed on the second attempt.
    // calls 40, attempts 50, retries 10: a retry ratio of 25 %, over the 5 % default.
    for i in 0..30 {
        assert!(get_once(&checkout, &http, &format!("http://{up}/ok?{i}")).await);
    }
    for i in 0..10 {
        assert!(get_once(&checkout, &http, &format!("http://{up}/fail/1/c{i}")).await);
    }
    // search: 60 calls that succeed at once, 1 on the second attempt, 1 that gives up after 3
    // attempts: calls 62, attempts 60 + 2 + 3 = 65, retries 3 (4.8 %, under 5 %).
    for i in 0..60 {
        assert!(get_once(&search, &http, &format!("http://{up}/ok?{i}")).await);
    }
    assert!(get_once(&search, &http, &format!("http://{up}/fail/1/s")).await);
    assert!(!get_once(&search, &http, &format!("http://{up}/fail/9/s-down")).await);

    let c = r#"service="checkout",endpoint="ep""#;
    let s = r#"service="search",endpoint="ep""#;
    prometheus
        .wait_for(&format!("retryplane_calls_total{{{c}}}"), 40.0)
        .await;
    prometheus
        .wait_for(&format!("retryplane_calls_total{{{s}}}"), 62.0)
        .await;
    for (query, want) in [
        (format!("retryplane_attempts_total{{{c}}}"), 50.0),
        (format!("retryplane_retries_total{{{c}}}"), 10.0),
        (format!("retryplane_success_first_try_total{{{c}}}"), 30.0),
        (format!("retryplane_success_after_retry_total{{{c}}}"), 10.0),
        (format!("retryplane_attempts_total{{{s}}}"), 65.0),
        (format!("retryplane_retries_total{{{s}}}"), 3.0),
        (
            format!(r#"retryplane_giveups_total{{{s},cause="attempts_exhausted"}}"#),
            1.0,
        ),
        (format!(r#"sum(retryplane_giveups_total{{{c}}})"#), 0.0),
        (
            r#"sum(retryplane_calls_total{endpoint="ep"})"#.to_owned(),
            102.0,
        ),
        (
            format!(r#"retryplane_retry_ratio{{{c},window="5m"}}"#),
            0.25,
        ),
        (format!("retryplane_retry_ratio_alert{{{c}}}"), 1.0),
        (format!("retryplane_retry_ratio_alert{{{s}}}"), 0.0),
        (format!("retryplane_retry_ratio_threshold{{{c}}}"), 0.05),
        (r#"retryplane_agents{applied_version="1"}"#.to_owned(), 2.0),
        ("retryplane_server_store_healthy".to_owned(), 1.0),
    ] {
        prometheus.wait_for(&query, want).await;
    }

    // README's alerts on failed calls and on a failing store, as README gives them (their
    // lines joined), are PromQL this Prometheus takes.
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    for alert in [
        "increase(retryplane_giveups_total[5m]) > 0 or ((retryplane_giveups_total > 0 unless \
         retryplane_giveups_total offset 5m) and on(job, instance) up offset 5m)",
        "increase(retryplane_circuit_open_total[5m]) > 0 or ((retryplane_circuit_open_total > 0 \
         unless retryplane_circuit_open_total offset 5m) and on(job, instance) up offset 5m)",
        "retryplane_server_store_healthy == 0",
    ] {
        assert!(readme.contains(alert), "README no longer gives `{alert}`");
        if let Err(said) = prometheus.accepts(alert).await {
            panic!("Prometheus refuses README's `{alert}`: {said}");
        }
    }

    // A scraper that does not ask for OpenMetrics (reqwest sends `Accept: */*`) gets
    // Prometheus' text format 0.0.4, which promtool, from the same package, checks clean.
    let plain = http
        .get(format!("http://{}/metrics", running.http_addr))
        .send()
        .await
        .unwrap();
    assert_eq!(
        plain.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = plain.text().await.unwrap();
    assert!(
        text.contains(&format!("retryplane_calls_total{{{c}}} 40\n")),
        "{text}"
    );
    promtool_checks_clean(&text).await;

    checkout.shutdown().await;
    search.shutdown().await;
    running.shutdown().await.unwrap();
}
