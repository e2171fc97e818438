//! End to end, SPEC §4: a real agent makes calls with every outcome against a scripted
//! upstream, and the control plane's admin `Stats` and `/metrics` (both text formats) show
//! exactly what the calls did, under service and endpoint names that need escaping.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use retryplane_agent::{Agent, CallMeta, CancellationToken, ReconnectBackoff};
use retryplane_e2e::*;
use retryplane_proto::pb;

/// An upstream on loopback: `/seq/{key}/{codes}` answers the next of the comma-separated
/// `codes` for `key` (the last one repeats); a code written `429r5` carries `Retry-After: 5`.
async fn upstream() -> SocketAddr {
    type Seen = Arc<Mutex<HashMap<String, usize>>>;
    async fn seq(
        State(seen): State<Seen>,
        UrlPath((key, codes)): UrlPath<(String, String)>,
    ) -> (StatusCode, HeaderMap) {
        let n = {
            let mut seen = seen.lock().unwrap();
            let n = seen.entry(key).or_default();
            *n += 1;
            *n - 1
        };
        let codes: Vec<&str> = codes.split(',').collect();
        let code = codes[n.min(codes.len() - 1)];
        let (status, after) = code
            .split_once('r')
            .map_or((code, None), |(s, a)| (s, Some(a)));
        let mut headers = HeaderMap::new();
        if let Some(after) = after {
            headers.insert("retry-after", after.parse().unwrap());
        }
        (
            StatusCode::from_u16(status.parse().unwrap()).unwrap(),
            headers,
        )
    }
    let app = Router::new()
        .route("/seq/{key}/{codes}", get(seq))
        .with_state(Seen::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// One logical GET of `url` through `agent`'s `endpoint`; true when it ended in success.
async fn get_once(agent: &Agent, endpoint: &str, http: &reqwest::Client, url: &str) -> bool {
    agent
        .endpoint(endpoint)
        .call(CallMeta::http("GET", "/seq"), |_| async {
            let r = http.get(url).send().await?;
            let mut b = http::Response::builder().status(r.status());
            for (k, v) in r.headers() {
                b = b.header(k, v);
            }
            Ok::<_, reqwest::Error>(b.body(()).unwrap())
        })
        .await
        .is_ok()
}

const SERVICE: &str = "we\"ird\\svc é";
const EP: &str = "pay.v1";
/// An endpoint no policy names (agents may call any name), which needs escaping.
const ODD: &str = "pay\"ments\\n {x=\"1\"}";

fn policy() -> String {
    format!(
        "version: 1
defaults:
  max_attempts: 3
  backoff: {{base: 10ms, max: 40ms, jitter: none}}
  budget: {{enabled: false}}
  circuit_breaker: {{enabled: false}}
  retry_after: {{honor: true, max: 5s}}
endpoints:
  {}: {{}}
  br:
    max_attempts: 1
    circuit_breaker: {{enabled: true, failure_ratio: 0.5, min_requests: 2, window: 10s, open_for: 60s, half_open_probes: 1}}
",
        EP
    )
}

/// Unescapes a label value of the text formats (`\\`, `\"`, `\n`).
fn unescape(v: &str) -> String {
    let mut out = String::new();
    let mut chars = v.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some(o) => out.push(o),
                None => panic!("dangling escape in {v:?}"),
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Parses one sample line strictly: `name{k="v",...} value`.
fn parse_sample(line: &str) -> (String, Vec<(String, String)>, f64) {
    let (name_end, mut labels) = (line.find(['{', ' ']).unwrap(), Vec::new());
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    if let Some(body) = rest.strip_prefix('{') {
        let mut s = body;
        loop {
            if let Some(after) = s.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = s.find('=').unwrap();
            let key = s[..eq].to_owned();
            assert!(s[eq + 1..].starts_with('"'), "{line}");
            let v = &s[eq + 2..];
            let mut end = None;
            let mut escaped = false;
            for (i, c) in v.char_indices() {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, '\\') => escaped = true,
                    (false, '"') => {
                        end = Some(i);
                        break;
                    }
                    _ => {}
                }
            }
            let end = end.unwrap_or_else(|| panic!("unterminated label value: {line}"));
            labels.push((key, unescape(&v[..end])));
            s = &v[end + 1..];
            s = s.strip_prefix(',').unwrap_or(s);
        }
    }
    let value = rest
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("bad value: {line}"));
    (name, labels, value)
}

async fn scrape(addr: SocketAddr, openmetrics: bool) -> String {
    let mut req = reqwest::Client::new().get(format!("http://{addr}/metrics"));
    if openmetrics {
        req = req.header("accept", "application/openmetrics-text;version=1.0.0");
    }
    req.send().await.unwrap().text().await.unwrap()
}

/// Every sample of `text` labelled with `SERVICE`, by name and the labels besides service and
/// endpoint (as `k=v` joined), with its endpoint.
fn samples_of(text: &str, service: &str) -> HashMap<(String, String, String), f64> {
    let mut out = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, labels, value) = parse_sample(line);
        let get = |k: &str| labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        if get("service").as_deref() != Some(service) {
            continue;
        }
        let endpoint = get("endpoint").unwrap();
        let rest = labels
            .iter()
            .filter(|(k, _)| k != "service" && k != "endpoint")
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(
            out.insert((name.clone(), endpoint, rest), value).is_none(),
            "a sample twice: {line}"
        );
    }
    out
}

async fn series(plane: &Plane, endpoint: &str) -> Option<pb::SeriesStats> {
    let stats = plane
        .admin()
        .await
        .stats(pb::StatsRequest::default())
        .await
        .ok()?
        .into_inner();
    stats
        .series
        .into_iter()
        .find(|s| s.service == SERVICE && s.endpoint == endpoint)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_counter_the_calls_made_is_shown_exactly_in_stats_and_both_text_formats() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policy()).unwrap();
    let plane = Plane::start_with(dir, false, None, |c| {
        c.metrics_interval = Duration::from_millis(200);
    })
    .await;
    let up = upstream().await;
    let http = reqwest::Client::new();
    let agent = Agent::builder()
        .url(format!("http://{}", plane.running.agent_addr))
        .service(SERVICE)
        .agent_id("odd-1")
        .rng_seed(1)
        .metrics_interval(Duration::from_millis(200))
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(300),
            Duration::from_secs(10),
        ))
        .connect()
        .unwrap();
    eventually("agent on version 1", || async {
        agent.policies().version() == 1
    })
    .await;

    let u = |key: &str, codes: &str| format!("http://{up}/seq/{key}/{codes}");
    // 1. first-try success.
    assert!(get_once(&agent, EP, &http, &u("a", "200")).await);
    // 2. success after one retry: pause 10 ms.
    assert!(get_once(&agent, EP, &http, &u("b", "503,200")).await);
    // 3. attempts exhausted: pauses 10 + 20 ms.
    assert!(!get_once(&agent, EP, &http, &u("c", "503")).await);
    // 4. not retryable (404 is not in retry_on): no pause.
    assert!(!get_once(&agent, EP, &http, &u("d", "404")).await);
    // 5. a Retry-After of 1 s honored, then success: pause 1000 ms, one hint honored.
    assert!(get_once(&agent, EP, &http, &u("e", "429r1,200")).await);
    // 6. a Retry-After past retry_after.max: gives up, no pause.
    assert!(!get_once(&agent, EP, &http, &u("f", "429r120")).await);
    // 7. cancelled as its first pause (a Retry-After of 3 s) starts: the attempt cancels the
    // call's token once it has its answer, so the pause ends at once.
    let token = CancellationToken::new();
    let url = u("g", "503r3");
    let ended = agent
        .endpoint(EP)
        .call(
            CallMeta::http("GET", "/seq").with_cancel(token.clone()),
            |_| async {
                let r = http.get(&url).send().await?;
                token.cancel();
                let mut b = http::Response::builder().status(r.status());
                for (k, v) in r.headers() {
                    b = b.header(k, v);
                }
                Ok::<_, reqwest::Error>(b.body(()).unwrap())
            },
        )
        .await;
    assert_eq!(
        ended.err().map(|e| e.cause.to_string()).as_deref(),
        Some("cancelled")
    );
    // ODD: one first-try success.
    assert!(get_once(&agent, ODD, &http, &u("k", "200")).await);
    // br: two failures open the breaker; the third call is refused.
    assert!(!get_once(&agent, "br", &http, &u("h", "503")).await);
    assert!(!get_once(&agent, "br", &http, &u("i", "503")).await);
    assert!(!get_once(&agent, "br", &http, &u("j", "200")).await);

    // calls 7, attempts 1+2+3+1+2+1+1 = 11, retries 4, ...
    eventually("all of EP's calls reported", || async {
        series(&plane, EP)
            .await
            .is_some_and(|s| s.lifetime.is_some_and(|c| c.calls == 7 && c.cancelled == 1))
    })
    .await;
    eventually("all of br's calls reported", || async {
        series(&plane, "br")
            .await
            .is_some_and(|s| s.lifetime.is_some_and(|c| c.calls == 3))
    })
    .await;
    eventually("ODD's call reported", || async {
        series(&plane, ODD)
            .await
            .is_some_and(|s| s.lifetime.is_some_and(|c| c.calls == 1))
    })
    .await;
    let ep = series(&plane, EP).await.unwrap().lifetime.unwrap();
    let br = series(&plane, "br").await.unwrap().lifetime.unwrap();
    let want_ep = pb::Counters {
        calls: 7,
        attempts: 11,
        retries: 4,
        success_first_try: 1,
        success_after_retry: 2,
        gave_up_attempts: 1,
        gave_up_not_retryable: 1,
        gave_up_retry_after: 1,
        // Calls 5 and 7.
        retry_after_honored: 2,
        cancelled: 1,
        // Calls 2, 3 and 5; the cancelled call paused for no time.
        backoff_ms: 10 + 30 + 1000,
        ..Default::default()
    };
    assert_eq!(ep, want_ep);
    let want_br = pb::Counters {
        calls: 3,
        attempts: 2,
        gave_up_attempts: 2,
        circuit_open: 1,
        ..Default::default()
    };
    assert_eq!(br, want_br);

    for openmetrics in [false, true] {
        let text = scrape(plane.running.http_addr, openmetrics).await;
        let got = samples_of(&text, SERVICE);
        let want = |name: &str, endpoint: &str, rest: &str, v: f64| {
            let key = (name.to_owned(), endpoint.to_owned(), rest.to_owned());
            assert_eq!(
                got.get(&key),
                Some(&v),
                "openmetrics={openmetrics}: {key:?}\n{text}"
            );
        };
        want("retryplane_calls_total", EP, "", 7.0);
        want("retryplane_attempts_total", EP, "", 11.0);
        want("retryplane_retries_total", EP, "", 4.0);
        want("retryplane_success_first_try_total", EP, "", 1.0);
        want("retryplane_success_after_retry_total", EP, "", 2.0);
        want(
            "retryplane_giveups_total",
            EP,
            "cause=attempts_exhausted",
            1.0,
        );
        want("retryplane_giveups_total", EP, "cause=not_retryable", 1.0);
        want(
            "retryplane_giveups_total",
            EP,
            "cause=retry_after_too_long",
            1.0,
        );
        want(
            "retryplane_giveups_total",
            EP,
            "cause=budget_exhausted",
            0.0,
        );
        want(
            "retryplane_giveups_total",
            EP,
            "cause=deadline_exceeded",
            0.0,
        );
        want("retryplane_retry_after_honored_total", EP, "", 2.0);
        want("retryplane_cancelled_total", EP, "", 1.0);
        want("retryplane_backoff_seconds_total", EP, "", 1.04);
        want("retryplane_circuit_open_total", "br", "", 1.0);
        want("retryplane_calls_total", ODD, "", 1.0);
        want("retryplane_success_first_try_total", ODD, "", 1.0);
        want("retryplane_calls_total", "br", "", 3.0);
        want(
            "retryplane_giveups_total",
            "br",
            "cause=attempts_exhausted",
            2.0,
        );
        want("retryplane_retry_ratio", EP, "window=5m", 4.0 / 7.0);
        want("retryplane_retry_ratio_threshold", EP, "", 0.05);
        // Every sample's family has its TYPE line before it.
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_owned());
            } else if !line.starts_with('#') && !line.is_empty() {
                let (name, _, _) = parse_sample(line);
                assert!(
                    typed.contains(&name)
                        || typed.contains(name.trim_end_matches("_total"))
                        || typed.contains(name.trim_end_matches("_created"))
                        || typed.contains(name.trim_end_matches("_info")),
                    "openmetrics={openmetrics}: {name} has no TYPE before it"
                );
            }
        }
    }

    agent.shutdown().await;
    plane.running.shutdown().await.unwrap();
}

/// One logical GET through `endpoint`: `None` on success, else the cause and the attempts.
async fn cause_of(
    agent: &Agent,
    endpoint: &str,
    http: &reqwest::Client,
    url: &str,
) -> Option<(String, u32)> {
    agent
        .endpoint(endpoint)
        .call(CallMeta::http("GET", "/seq"), |_| async {
            let r = http.get(url).send().await?;
            Ok::<_, reqwest::Error>(
                http::Response::builder()
                    .status(r.status())
                    .body(())
                    .unwrap(),
            )
        })
        .await
        .err()
        .map(|e| (e.cause.to_string(), e.attempts))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_deadline_and_breaker_give_ups_are_counted_as_the_calls_ended() {
    let policy = "version: 1
defaults:
  max_attempts: 3
  backoff: {base: 10ms, max: 10ms, jitter: none}
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
endpoints:
  dl: {deadline: 50ms, per_try_timeout: 50ms, backoff: {base: 100ms, max: 100ms}}
  bud: {budget: {enabled: true, ratio: 0.0, min_per_second: 1, window: 1s}}
  br2:
    circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, window: 10s, open_for: 60s, half_open_probes: 1}
";
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policy).unwrap();
    let plane = Plane::start_with(dir, false, None, |c| {
        c.metrics_interval = Duration::from_millis(200);
    })
    .await;
    let up = upstream().await;
    let http = reqwest::Client::new();
    let agent = Agent::builder()
        .url(format!("http://{}", plane.running.agent_addr))
        .service("svc")
        .agent_id("svc-1")
        .rng_seed(1)
        .connect()
        .unwrap();
    eventually("agent on version 1", || async {
        agent.policies().version() == 1
    })
    .await;
    let u = |key: &str, codes: &str| format!("http://{up}/seq/{key}/{codes}");
    let dl = cause_of(&agent, "dl", &http, &u("a", "503")).await;
    assert_eq!(dl, Some(("deadline_exceeded".to_owned(), 1)));
    let mut bud = Vec::new();
    for i in 0..4 {
        bud.push(cause_of(&agent, "bud", &http, &u(&format!("b{i}"), "503,200")).await);
    }
    let br2 = cause_of(&agent, "br2", &http, &u("c", "503")).await;
    // Two failures open the breaker: the second retry is refused by it.
    assert_eq!(br2, Some(("circuit_open".to_owned(), 2)));
    let br2_refused = cause_of(&agent, "br2", &http, &u("d", "200")).await;
    assert_eq!(br2_refused, Some(("circuit_open".to_owned(), 0)));

    let stats = |endpoint: &'static str| {
        let plane = &plane;
        async move {
            plane
                .admin()
                .await
                .stats(pb::StatsRequest::default())
                .await
                .unwrap()
                .into_inner()
                .series
                .into_iter()
                .find(|s| s.service == "svc" && s.endpoint == endpoint)
                .and_then(|s| s.lifetime)
        }
    };
    eventually("every call reported", || async {
        stats("dl").await.is_some_and(|c| c.calls == 1)
            && stats("bud").await.is_some_and(|c| c.calls == 4)
            && stats("br2").await.is_some_and(|c| c.calls == 2)
    })
    .await;
    let d = stats("dl").await.unwrap();
    assert_eq!(
        (d.attempts, d.retries, d.gave_up_deadline, d.backoff_ms),
        (1, 0, 1, 0)
    );
    let b = stats("bud").await.unwrap();
    let budget_refused = u64::try_from(bud.iter().filter(|c| c.is_some()).count()).unwrap();
    assert!(budget_refused > 0, "{bud:?}");
    assert_eq!(
        (b.gave_up_budget, b.success_after_retry, b.success_first_try),
        (budget_refused, 4 - budget_refused, 0),
        "{b:?}"
    );
    assert_eq!(b.retries, 4 - budget_refused);
    let c = stats("br2").await.unwrap();
    assert_eq!(
        (c.calls, c.attempts, c.retries, c.circuit_open, c.backoff_ms),
        (2, 2, 1, 2, 10),
        "{c:?}"
    );
    agent.shutdown().await;
    plane.running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_made_before_and_after_a_new_version_are_shown_under_each_version() {
    let v1 = "version: 1\nendpoints:\n  ep: {max_attempts: 3, backoff: {base: 1ms, max: 1ms, jitter: none}}\n";
    let v2 = "version: 1\nendpoints:\n  ep: {max_attempts: 2, backoff: {base: 1ms, max: 1ms, jitter: none}}\n";
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), v1).unwrap();
    let plane = Plane::start_with(dir, false, None, |c| {
        c.metrics_interval = Duration::from_secs(5);
    })
    .await;
    let up = upstream().await;
    let http = reqwest::Client::new();
    let agent = Agent::builder()
        .url(format!("http://{}", plane.running.agent_addr))
        .service("svc")
        .agent_id("svc-1")
        .rng_seed(1)
        .connect()
        .unwrap();
    eventually("agent on version 1", || async {
        agent.policies().version() == 1
    })
    .await;
    let u = |key: &str, codes: &str| format!("http://{up}/seq/{key}/{codes}");
    for i in 0..3 {
        cause_of(&agent, "ep", &http, &u(&format!("a{i}"), "503")).await;
    }
    std::fs::write(plane.policy_path(), v2).unwrap();
    eventually("agent on version 2", || async {
        agent.policies().version() == 2
    })
    .await;
    for i in 0..2 {
        cause_of(&agent, "ep", &http, &u(&format!("b{i}"), "503")).await;
    }
    let versions = || async {
        let s = plane
            .admin()
            .await
            .stats(pb::StatsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .series
            .into_iter()
            .find(|s| s.endpoint == "ep")?;
        let mut out: Vec<(u64, u64, u64)> = s
            .versions
            .iter()
            .map(|v| {
                let c = v.lifetime.unwrap_or_default();
                (v.policy_version, c.calls, c.attempts)
            })
            .collect();
        out.sort_unstable();
        Some(out)
    };
    eventually("both versions' calls reported", || async {
        versions()
            .await
            .is_some_and(|v| v.iter().map(|x| x.1).sum::<u64>() == 5)
    })
    .await;
    assert_eq!(versions().await.unwrap(), vec![(1, 3, 9), (2, 2, 4)]);
    agent.shutdown().await;
    plane.running.shutdown().await.unwrap();
}
