//! `retryplane request` runs as the real binary against a scripted HTTP/1.1 upstream on
//! `127.0.0.1:0` (a few lines of tokio, one response per connection), and against a real
//! control plane for `--server`.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

mod support;

use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

/// Fast, deterministic pauses: 10 ms, 20 ms, 40 ms, …
const POLICY: &str = "\
version: 1
defaults:
  backoff: {base: 10ms, max: 1s, multiplier: 2.0, jitter: none}
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
  retry_after: {honor: true, max: 2s}
endpoints:
  api:
    max_attempts: 3
";

/// A script step: a 200 head announcing 100 bytes, 3 of them, then a reset (RST).
const RESET_MID_BODY: u16 = 0;

/// A script step: no answer at all; the connection is held open (a hung upstream).
const HANG: u16 = 1;

/// One request as the upstream saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// A scripted upstream: each connection reads one request and answers with the next
/// `(status, extra header lines)` of the script, then 200. Status [`RESET_MID_BODY`] sends a
/// 200 head and part of its body, then resets the connection.
struct Upstream {
    _runtime: Runtime,
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Upstream {
    fn start(script: &[(u16, &str)]) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let script: Arc<Mutex<VecDeque<(u16, String)>>> = Arc::new(Mutex::new(
            script.iter().map(|(s, h)| (*s, (*h).to_owned())).collect(),
        ));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        runtime.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let step = script.lock().unwrap().pop_front();
                let (status, extra) = step.unwrap_or((200, String::new()));
                let log = log.clone();
                tokio::spawn(async move { serve_one(stream, status, &extra, &log).await });
            }
        });
        Self {
            _runtime: runtime,
            addr,
            seen,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Reads one request, records it in `log` before it answers (a client that has its answer
/// finds the request recorded), and answers by `status`.
async fn serve_one(
    mut stream: TcpStream,
    status: u16,
    extra: &str,
    log: &Mutex<Vec<Seen>>,
) -> Option<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let method = lines.next()?.split(' ').next()?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map_or(0, |(_, v)| v.parse().unwrap());
    while buf.len() < head_end + len {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[head_end..].to_vec();
    log.lock().unwrap().push(Seen {
        method,
        headers,
        body,
    });
    if status == HANG {
        // Held until the client gives up on it and closes its side.
        let _ = stream.read(&mut chunk).await;
        return Some(());
    }
    if status == RESET_MID_BODY {
        let head = "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc";
        stream.write_all(head.as_bytes()).await.ok()?;
        stream.flush().await.ok()?;
        stream.set_zero_linger().ok()?;
        return Some(());
    }
    let response =
        format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n{extra}\r\nok");
    stream.write_all(response.as_bytes()).await.ok()?;
    stream.shutdown().await.ok()
}

/// `retryplane request --policy POLICY --output json ARGS...`, run in a temporary directory.
fn request(args: &[&str]) -> (Value, i32) {
    request_under(POLICY, args)
}

/// `retryplane request --policy POLICY --endpoint api ARGS...` (the policy written to a
/// temporary file), stopped after 30 s.
fn request_output(policy: &str, args: &[&str]) -> std::process::Output {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, policy).unwrap();
    support::cli(&[])
        .args(["request", "--policy"])
        .arg(&path)
        .args(["--endpoint", "api"])
        .args(args)
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap()
}

/// [`request`] under the policy file `policy` (endpoint `api`), stopped after 30 s.
fn request_under(policy: &str, args: &[&str]) -> (Value, i32) {
    let out = request_output(policy, &[&["--output", "json"], args].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout} / {}", String::from_utf8_lossy(&out.stderr)));
    (value, out.status.code().unwrap())
}

/// `n` attempts that each failed to connect, as [`attempts`] gives them.
fn connect_errors(n: u32) -> Vec<Value> {
    (1..=n)
        .map(|n| json!({"attempt": n, "status": null, "error": "connect"}))
        .collect()
}

/// The attempts without their pauses, and the pauses apart.
fn attempts(v: &Value) -> (Vec<Value>, Vec<Value>) {
    let list = v["attempts"].as_array().unwrap();
    let pauses = list.iter().map(|a| a["pause_ms"].clone()).collect();
    let shapes = list
        .iter()
        .map(|a| json!({"attempt": a["attempt"], "status": a["status"], "error": a["error"]}))
        .collect();
    (shapes, pauses)
}

#[test]
fn two_503s_then_200_succeed_on_the_third_attempt_with_the_pauses() {
    let up = Upstream::start(&[(503, ""), (503, "")]);
    let (v, code) = request(&[&up.url("/v1/items?q=1")]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["outcome"], "success");
    assert_eq!(v["cause"], Value::Null);
    assert_eq!(v["status"], 200);
    let (shapes, pauses) = attempts(&v);
    assert_eq!(
        shapes,
        [
            json!({"attempt": 1, "status": 503, "error": null}),
            json!({"attempt": 2, "status": 503, "error": null}),
            json!({"attempt": 3, "status": 200, "error": null}),
        ]
    );
    assert_eq!(pauses, [json!(10), json!(20), Value::Null]);
    assert!(v["elapsed_ms"].as_u64().unwrap() >= 30);
    let keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
    assert_eq!(
        keys,
        ["attempts", "cause", "elapsed_ms", "outcome", "status"]
    );
    assert_eq!(up.seen().len(), 3);
}

#[test]
fn a_404_is_a_failure_not_retried_and_exits_1() {
    let up = Upstream::start(&[(404, "")]);
    let (v, code) = request(&[&up.url("/missing")]);
    assert_eq!(code, 1);
    assert_eq!(v["outcome"], "failure");
    assert_eq!(v["cause"], "not_retryable");
    assert_eq!(v["status"], 404);
    let (shapes, pauses) = attempts(&v);
    assert_eq!(
        shapes,
        [json!({"attempt": 1, "status": 404, "error": null})]
    );
    assert_eq!(pauses, [Value::Null]);
}

#[test]
fn post_without_idempotency_key_is_not_retried_and_with_it_is() {
    let up = Upstream::start(&[(503, "")]);
    let (v, code) = request(&["--data", "{\"amount\":1}", &up.url("/v1/charges")]);
    assert_eq!(code, 1);
    assert_eq!(v["cause"], "not_retryable");
    assert_eq!(v["status"], 503);
    assert_eq!(v["attempts"].as_array().unwrap().len(), 1);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].body, b"{\"amount\":1}");

    let up = Upstream::start(&[(503, "")]);
    let (v, code) = request(&[
        "-X",
        "post",
        "-H",
        "Idempotency-Key: k-123",
        "--data",
        "x",
        &up.url("/v1/charges"),
    ]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["attempts"].as_array().unwrap().len(), 2);
    let seen = up.seen();
    assert!(seen.iter().all(|s| s.body == b"x"));
    assert!(seen.iter().all(|s| {
        s.headers
            .iter()
            .any(|(n, v)| n == "idempotency-key" && v == "k-123")
    }));
}

#[test]
fn data_at_a_file_sends_the_file_s_bytes_and_a_file_that_cannot_be_read_is_a_usage_error() {
    let dir = TempDir::new().unwrap();
    let file = dir.path().join("body.bin");
    let bytes = b"{\"a\": 1}\r\n\xff\x00tail\n";
    fs::write(&file, bytes).unwrap();
    let up = Upstream::start(&[]);
    let at_file = format!("@{}", file.display());
    let (v, code) = request(&["--data", &at_file, &up.url("/e")]);
    assert_eq!(code, 0, "{v}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].body, bytes, "the file's bytes as they are");

    let missing = format!("@{}", dir.path().join("missing").display());
    let policy = dir.path().join("policy.yaml");
    fs::write(&policy, POLICY).unwrap();
    let out = support::cli(&[])
        .args([
            "request",
            "--endpoint",
            "api",
            "--data",
            &missing,
            "--policy",
        ])
        .arg(&policy)
        .arg(up.url("/e"))
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--data @") && stderr.contains("cannot read"),
        "{stderr}"
    );
}

#[test]
fn an_empty_data_body_is_sent_with_a_length_of_zero() {
    for method in ["POST", "PUT"] {
        let up = Upstream::start(&[]);
        let (v, code) = request(&["-X", method, "--data", "", &up.url("/e")]);
        assert_eq!(code, 0, "{v}");
        let seen = up.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].method, method);
        let lengths: Vec<_> = seen[0]
            .headers
            .iter()
            .filter(|(n, _)| n == "content-length")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(lengths, ["0"], "{method}: {:?}", seen[0].headers);
        assert!(seen[0].body.is_empty());
    }
}

#[test]
fn a_url_refused_is_shown_without_its_query_or_fragment() {
    for (url, why) in [
        (
            "http://127.0.0.1:99999/x?token=s3cr3t",
            "http://127.0.0.1:99999/x?…: not a valid URL",
        ),
        (
            "ftp://127.0.0.1/x#s3cr3t",
            "ftp://127.0.0.1/x#…: only http:// and https:// URLs are supported",
        ),
        // An `@` in the query could end a password holding the `?`: the scheme alone.
        (
            "http://127.0.0.1:99999?email=a@b.c&token=s3cr3t",
            "http://…: not a valid URL",
        ),
        // Unless a `/` ends a host:port first (a password holds no `/`).
        (
            "http://127.0.0.1:99999/x?email=a@b.c&token=s3cr3t",
            "http://127.0.0.1:99999/x?…: not a valid URL",
        ),
        (
            "http://u:p?s3cr3t@127.0.0.1:99999/x",
            "http://…: not a valid URL",
        ),
        // No `:` before the `?`: no password, so the host is shown.
        (
            "http://exa mple.com/?to=a@b.c&token=s3cr3t",
            "http://exa mple.com/?…: not a valid URL",
        ),
        // A header typed where the URL goes.
        (
            "Authorization: Bearer s3cr3t",
            "Authorization: ***: the URL names no scheme",
        ),
        // A host with a bad port, and no scheme: shown, so that the port can be seen.
        (
            "localhost:99999/stock",
            "localhost:99999/stock: the URL names no scheme",
        ),
    ] {
        let (code, stderr) = request_stderr(&[url]);
        assert_eq!(code, Some(2), "{url}");
        assert!(
            stderr.starts_with(&format!("retryplane: error: {why}")),
            "{url}: {stderr}"
        );
        assert!(!stderr.contains("s3cr3t"), "{url}: {stderr}");
    }
}

#[test]
fn a_header_typed_after_x_instead_of_h_is_not_shown() {
    let (code, stderr) =
        request_stderr(&["-X", "Authorization: Bearer s3cr3t", "http://127.0.0.1:9/"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("retryplane: error: -X Authorization: ***: not an HTTP method"),
        "{stderr}"
    );
    let (code, stderr) = request_stderr(&["-X", "FETCH ME", "http://127.0.0.1:9/"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("retryplane: error: -X FETCH ME: not an HTTP method"),
        "{stderr}"
    );
}

#[test]
fn a_url_after_an_h_with_no_value_may_be_its_split_value_and_is_not_shown() {
    let (code, stderr) = request_stderr(&["-H", "X-Api-Key:", "s3cr3t"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("retryplane: error: ***: the URL names no scheme"),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cr3t"), "{stderr}");
}

#[test]
fn post_with_an_empty_idempotency_key_is_not_retried() {
    // `Name:` sends no key at all, `Name;` an empty one: neither is a key.
    for (header, sent) in [
        ("Idempotency-Key:", false),
        ("Idempotency-Key:   ", false),
        ("Idempotency-Key;", true),
    ] {
        let up = Upstream::start(&[(503, "")]);
        let (v, code) = request(&["-H", header, "--data", "x", &up.url("/v1/charges")]);
        assert_eq!(code, 1, "{header:?}: {v}");
        assert_eq!(v["cause"], "not_retryable");
        assert_eq!(v["attempts"].as_array().unwrap().len(), 1);
        let seen = up.seen();
        assert_eq!(seen.len(), 1);
        let key = seen[0]
            .headers
            .iter()
            .find(|(n, _)| n == "idempotency-key")
            .map(|(_, v)| v.as_str());
        assert_eq!(key, sent.then_some(""), "{header:?}");
    }
}

#[test]
fn a_header_with_nothing_after_its_colon_is_not_sent_and_one_with_a_semicolon_is_sent_empty() {
    let up = Upstream::start(&[]);
    let (v, code) = request(&[
        "-H",
        "X-Gone:",
        "-H",
        "X-Blank:   ",
        "-H",
        "X-Empty;",
        "-H",
        "X-Kept: 1",
        "-H",
        "Accept: text/plain",
        &up.url("/"),
    ]);
    assert_eq!(code, 0, "{v}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    let headers = &seen[0].headers;
    let values = |name: &str| -> Vec<&str> {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    assert_eq!(values("x-gone"), Vec::<&str>::new(), "{headers:?}");
    assert_eq!(values("x-blank"), Vec::<&str>::new(), "{headers:?}");
    assert_eq!(values("x-empty"), [""], "{headers:?}");
    assert_eq!(values("x-kept"), ["1"], "{headers:?}");
    // A value given replaces the client's own `*/*`.
    assert_eq!(values("accept"), ["text/plain"], "{headers:?}");
}

#[test]
fn leaving_out_a_header_the_http_client_always_sends_is_refused() {
    let up = Upstream::start(&[]);
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, POLICY).unwrap();
    for (header, data, why) in [
        (
            "Accept:",
            None,
            "the 1st -H ('accept:'): the HTTP client sends `accept: */*` when no -H gives a value, and cannot be left out",
        ),
        (
            "Host:",
            None,
            "the 1st -H ('host:'): the HTTP client sends `host` from the URL, as HTTP/1.1 requires, and cannot be left out",
        ),
        (
            "Content-Length:",
            Some("x"),
            "the 1st -H ('content-length:'): the HTTP client sends the length of the --data body, and cannot be left out",
        ),
    ] {
        let mut cmd = support::cli(&[]);
        cmd.args(["request", "--policy"])
            .arg(&path)
            .args(["--endpoint", "api", "-H", header]);
        if let Some(data) = data {
            cmd.args(["--data", data]);
        }
        let out = cmd.arg(up.url("/")).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{header}");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!("retryplane: error: {why}\n")
        );
        assert!(out.stdout.is_empty());
    }
    // Without a body there is no length to leave out: nothing is sent, as for any header.
    let (v, code) = request(&["-H", "Content-Length:", &up.url("/")]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(up.seen().len(), 1);
}

/// `request --policy POLICY --endpoint api ARGS...`: the exit code and stderr.
fn request_stderr(args: &[&str]) -> (Option<i32>, String) {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, POLICY).unwrap();
    let out = support::cli(&[])
        .args(["request", "--policy"])
        .arg(&path)
        .args(["--endpoint", "api"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.stdout.is_empty());
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_header_that_does_not_parse_is_named_by_its_position_never_quoted() {
    let up = Upstream::start(&[]);
    for (headers, why) in [
        (
            ["X-Ok: 1", "Cookie session=s3cr3t;"],
            "the 2nd -H: the text before the `:` or `;` is not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only, no spaces)",
        ),
        (
            ["Cookie session=s3cr3t", "X-Ok: 1"],
            "the 1st -H: expected 'Name: value', 'Name:' (no such header) or 'Name;' (an empty one)",
        ),
        (
            ["X-Ok: 1", ": s3cr3t"],
            "the 2nd -H: no header name before the `:` or `;`",
        ),
        (
            ["X-Ok: 1", "X-Bad: s3cr3t\u{1}"],
            "the 2nd -H: the value holds characters not allowed in a header",
        ),
    ] {
        let (code, stderr) = request_stderr(&["-H", headers[0], "-H", headers[1], &up.url("/")]);
        assert_eq!(code, Some(2), "{headers:?}");
        assert_eq!(stderr, format!("retryplane: error: {why}\n"), "{headers:?}");
        assert!(!stderr.contains("s3cr3t"));
    }
    assert!(up.seen().is_empty());
}

#[test]
fn the_basic_authorization_of_a_url_with_userinfo_cannot_be_left_out() {
    let up = Upstream::start(&[]);
    let url = up.url("/").replace("http://", "http://user:s3cr3t@");
    let (code, stderr) = request_stderr(&["-H", "X-Ok: 1", "-H", "Authorization:", &url]);
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr,
        "retryplane: error: the 2nd -H ('authorization:'): the HTTP client sends \
         `authorization: Basic …` from the URL's user:password@ when no -H gives a value, and \
         cannot be left out\n"
    );
    assert!(up.seen().is_empty());
    // Without userinfo there is nothing to leave out: nothing is sent.
    let (v, code) = request(&["-H", "Authorization:", &up.url("/")]);
    assert_eq!(code, 0, "{v}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.iter().all(|(n, _)| n != "authorization"));
}

#[test]
fn name_colon_leaves_out_only_what_the_client_adds_never_a_header_flag() {
    // As in curl: `Name:` does nothing to a `-H` that gives `Name` a value, before or after it,
    // and two values of a name are both sent.
    let up = Upstream::start(&[]);
    let (v, code) = request(&[
        "-H",
        "accept: text/html",
        "-H",
        "accept:",
        "-H",
        "x-kept: 1",
        "-H",
        "x-kept:",
        "-H",
        "x-two: a",
        "-H",
        "x-two: b",
        &up.url("/"),
    ]);
    assert_eq!(code, 0, "{v}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    let headers = &seen[0].headers;
    let named = |name: &str| -> Vec<String> {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .collect()
    };
    assert_eq!(named("accept"), ["text/html"]);
    assert_eq!(named("x-kept"), ["1"]);
    assert_eq!(named("x-two"), ["a", "b"]);
    // A request has one host, and with --data the client sends the body's length.
    let (code, stderr) = request_stderr(&["-H", "Host: a", "-H", "Host: b", &up.url("/")]);
    assert_eq!(code, Some(2));
    assert_eq!(
        stderr,
        "retryplane: error: two -H give `host` a value; a request has one host\n"
    );
    let (code, stderr) = request_stderr(&["-H", "Content-Length: 5", "--data", "x", &up.url("/")]);
    assert_eq!(code, Some(2));
    assert_eq!(
        stderr,
        "retryplane: error: an -H gives `content-length` a value; the HTTP client sends the \
         length of the --data body\n"
    );
    assert_eq!(up.seen().len(), 1);
    // With no -H giving it a value, the client's own accept cannot be left out.
    let (code, stderr) = request_stderr(&["-H", "accept:", &up.url("/")]);
    assert_eq!(code, Some(2));
    assert_eq!(
        stderr,
        "retryplane: error: the 1st -H ('accept:'): the HTTP client sends `accept: */*` when no \
         -H gives a value, and cannot be left out\n"
    );
}

#[test]
fn a_429_with_retry_after_over_the_max_gives_up_as_retry_after_too_long() {
    let up = Upstream::start(&[(429, "retry-after: 60\r\n")]);
    let (v, code) = request(&[&up.url("/")]);
    assert_eq!(code, 1);
    assert_eq!(v["cause"], "retry_after_too_long");
    assert_eq!(v["status"], 429);
    assert_eq!(v["attempts"].as_array().unwrap().len(), 1);
}

#[test]
fn a_retry_after_over_the_max_is_named_with_the_policy_s_max() {
    let up = Upstream::start(&[(429, "retry-after: 60\r\n")]);
    let out = request_output(POLICY, &[&up.url("/")]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("attempt 1: HTTP 429\nfailure: retry_after_too_long (last: HTTP 429)"),
        "{stdout}"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "retryplane: the answer's Retry-After asked for a pause of 1m before a retry, over the \
         policy's retry_after.max of 2s\n"
    );
}

#[test]
fn a_closed_port_gives_connect_errors_until_attempts_run_out() {
    let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (v, code) = request(&[&format!("http://127.0.0.1:{port}/")]);
    assert_eq!(code, 1);
    assert_eq!(v["cause"], "attempts_exhausted");
    assert_eq!(v["status"], Value::Null);
    let (shapes, pauses) = attempts(&v);
    assert_eq!(shapes, connect_errors(3));
    assert_eq!(pauses, [json!(10), json!(20), Value::Null]);
}

/// A port on 127.0.0.1 whose listener's accept queue is full: the kernel drops further SYNs,
/// so a connect neither completes nor is refused (a host that drops packets). Kept while the
/// returned value lives.
fn black_hole(rt: &Runtime) -> (u16, impl Sized) {
    rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind((Ipv4Addr::LOCALHOST, 0).into()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut held = Vec::new();
        for _ in 0..16 {
            let connect = TcpStream::connect(addr);
            match tokio::time::timeout(std::time::Duration::from_millis(300), connect).await {
                Ok(stream) => held.push(stream.unwrap()),
                Err(_) => return (addr.port(), (listener, held)),
            }
        }
        panic!("every connect completed: the accept queue never filled");
    })
}

#[test]
fn a_connect_that_never_completes_is_a_connect_error_and_retried_whatever_the_method() {
    let rt = Runtime::new().unwrap();
    let (port, _held) = black_hole(&rt);
    let policy =
        format!("{POLICY}    per_try_timeout: 400ms\n    retry_on: {{errors: [connect]}}\n");
    let (v, code) = request_under(
        &policy,
        &["-X", "POST", &format!("http://127.0.0.1:{port}/")],
    );
    assert_eq!(code, 1, "{v}");
    assert_eq!(v["cause"], "attempts_exhausted", "{v}");
    let (shapes, _) = attempts(&v);
    assert_eq!(shapes, connect_errors(3));
}

#[test]
fn a_connect_cut_short_by_what_is_left_of_the_deadline_is_still_a_connect_error() {
    // Attempt 1 gives up connecting at 1.9 s (its limit, 2 s, less a margin); attempt 2 has
    // what is left of the 3 s deadline, under 1.1 s: its connect must give up before that
    // limit does, or it shows as a timeout and a POST is not retried. (With 1 s and 1.5 s, a
    // loaded machine once started attempt 2 too late to make one.)
    let rt = Runtime::new().unwrap();
    let (port, _held) = black_hole(&rt);
    let policy = format!(
        "{POLICY}    per_try_timeout: 2s\n    deadline: 3s\n    retry_on: {{errors: [connect, timeout]}}\n"
    );
    let (v, code) = request_under(
        &policy,
        &["-X", "POST", &format!("http://127.0.0.1:{port}/")],
    );
    assert_eq!(code, 1, "{v}");
    let (shapes, _) = attempts(&v);
    assert!(shapes.len() >= 2, "{v}");
    assert_eq!(
        shapes,
        connect_errors(u32::try_from(shapes.len()).unwrap()),
        "{v}"
    );
    assert_ne!(v["cause"], "not_retryable", "{v}");
}

#[test]
fn an_upstream_that_does_not_speak_http_says_so_on_stderr() {
    use std::io::{Read as _, Write as _};
    // An SSH server's greeting, whatever the client sent, then the connection is closed.
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0_u8; 1024];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.2\r\n");
        }
    });
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, POLICY).unwrap();
    let out = support::cli(&[])
        .args(["request", "--policy"])
        .arg(&path)
        .args(["--endpoint", "api", "--output", "json"])
        .arg(format!("http://{addr}/v1/items?key=s3cret"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cause"], "attempts_exhausted");
    assert_eq!(v["attempts"][2]["error"], "reset");
    // Before, stderr was empty: `reset` was all there was to go on.
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("retryplane: error: request failed: ") && stderr.contains("HTTP"),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cret"), "{stderr}");
}

#[test]
fn a_reset_while_the_body_is_read_is_a_reset_error_and_retried() {
    let up = Upstream::start(&[(RESET_MID_BODY, ""), (RESET_MID_BODY, "")]);
    let (v, code) = request(&[&up.url("/v1/items")]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["outcome"], "success");
    assert_eq!(v["status"], 200);
    let (shapes, _) = attempts(&v);
    assert_eq!(
        shapes,
        [
            json!({"attempt": 1, "status": null, "error": "reset"}),
            json!({"attempt": 2, "status": null, "error": "reset"}),
            json!({"attempt": 3, "status": 200, "error": null}),
        ]
    );
    assert_eq!(up.seen().len(), 3);
}

/// `retryplane request --endpoint api --policy POLICY ARGS...` with text output, run in a
/// temporary directory, with `RUST_LOG` set to `log` (unset for `None`).
fn request_text(log: Option<&str>, args: &[&str]) -> std::process::Output {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, POLICY).unwrap();
    let mut cmd = support::cli(&[]);
    if let Some(log) = log {
        cmd.env("RUST_LOG", log);
    }
    cmd.args(["request", "--endpoint", "api", "--policy"])
        .arg(&path)
        .args(args)
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap()
}

#[test]
fn text_output_has_one_line_per_attempt_and_the_outcome() {
    let up = Upstream::start(&[(503, "")]);
    let out = request_text(None, &["-H", "Authorization: Bearer s3cret", &up.url("/")]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "attempt 1: HTTP 503, retrying in 10 ms");
    assert_eq!(lines[1], "attempt 2: HTTP 200");
    assert!(lines[2].starts_with("success: HTTP 200 after 2 attempts in "));
    assert_eq!(lines.len(), 3);
    assert!(!text.contains("s3cret"));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cret"));
}

#[test]
fn a_trailers_only_grpc_failure_is_shown_by_its_code_not_as_a_bare_200() {
    let grpc = "content-type: application/grpc\r\ngrpc-status: 14\r\n";
    let up = Upstream::start(&[(200, grpc), (200, grpc), (200, grpc)]);
    let out = request_text(None, &[&up.url("/pkg.Svc/M")]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[..3],
        [
            "attempt 1: gRPC UNAVAILABLE (HTTP 200), retrying in 10 ms",
            "attempt 2: gRPC UNAVAILABLE (HTTP 200), retrying in 20 ms",
            "attempt 3: gRPC UNAVAILABLE (HTTP 200)",
        ],
        "{text}"
    );
    assert!(
        lines[3].starts_with(
            "failure: attempts_exhausted (last: gRPC UNAVAILABLE (HTTP 200)) after 3 attempts in "
        ),
        "{text}"
    );
    // The JSON object keeps SPEC §5's fields: the HTTP status.
    let up = Upstream::start(&[(200, grpc); 3]);
    let (v, code) = request(&[&up.url("/pkg.Svc/M")]);
    assert_eq!(code, 1);
    assert_eq!(v["status"], 200);
    assert_eq!(v["cause"], "attempts_exhausted");
}

#[test]
fn rust_log_shows_the_agents_lines_on_stderr_and_without_it_there_are_none() {
    for log in [None, Some("debug")] {
        let up = Upstream::start(&[(503, "retry-after: soon\r\n")]);
        let url = up.url("/?q=s3cret");
        let out = request_text(log, &["-H", "Authorization: Bearer s3cret", &url]);
        assert_eq!(out.status.code(), Some(0));
        let stderr = String::from_utf8_lossy(&out.stderr);
        match log {
            None => assert_eq!(stderr, "", "nothing is logged without RUST_LOG"),
            Some(_) => {
                let attempts = stderr
                    .lines()
                    .filter(|l| l.contains(" attempt ") && l.contains("endpoint=api"))
                    .count();
                assert_eq!(attempts, 2, "one line per attempt: {stderr}");
                assert!(stderr.contains("malformed Retry-After ignored"), "{stderr}");
                assert!(!stderr.contains("s3cret"), "{stderr}");
            }
        }
    }
}

#[test]
fn bad_flags_and_bad_config_exit_2() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, POLICY).unwrap();
    let bad = dir.path().join("bad.yaml");
    fs::write(
        &bad,
        "version: 1\nendpoints:\n  api:\n    max_attempts: 0\n",
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let cases: &[&[&str]] = &[
        &["request", "--policy", p, "http://127.0.0.1:1/"],
        &["request", "--policy", p, "--endpoint", "api"],
        &[
            "request",
            "--policy",
            p,
            "--endpoint",
            "api",
            "--output",
            "xml",
            "http://a/",
        ],
        &[
            "request",
            "--policy",
            p,
            "--server",
            "http://a",
            "--endpoint",
            "api",
            "http://a/",
        ],
        &[
            "request",
            "--policy",
            p,
            "--endpoint",
            "api",
            "-H",
            "no colon",
            "http://a/",
        ],
        &[
            "request",
            "--policy",
            p,
            "--endpoint",
            "api",
            "-X",
            "GE T",
            "http://a/",
        ],
        &["request", "--policy", p, "--endpoint", "api", "ftp://a/"],
        &["request", "--policy", p, "--endpoint", "nope", "http://a/"],
        &[
            "request",
            "--policy",
            bad.to_str().unwrap(),
            "--endpoint",
            "api",
            "http://a/",
        ],
        &[
            "request",
            "--policy",
            "/nonexistent.yaml",
            "--endpoint",
            "api",
            "http://a/",
        ],
    ];
    for args in cases {
        let out = support::cli(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn server_mode_uses_the_control_planes_policy() {
    let server = support::TestServer::start(Some(&POLICY.replace("3\n", "2\n")), None, |_| {});
    let runtime = &server.runtime;
    let up = Upstream::start(&[(503, ""), (503, "")]);
    let out = support::cli(&[])
        .args([
            "request",
            "--endpoint",
            "api",
            "--output",
            "json",
            "--server",
        ])
        .arg(format!("http://{}", server.running().agent_addr))
        .arg(up.url("/"))
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // max_attempts 2 from the control plane: two 503s exhaust it.
    assert_eq!(out.status.code(), Some(1), "{v}");
    assert_eq!(v["cause"], "attempts_exhausted");
    assert_eq!(v["attempts"].as_array().unwrap().len(), 2);

    // The agent sent its counts before the command exited (the first periodic report would
    // have come 10 s later): the control plane has the call, and no agent connected.
    let admin = &server.url;
    let admin_json = |args: &[&str]| -> Value {
        let out = support::cli(&[])
            .args(args)
            .args(["--output", "json", "--server", admin])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // Polled with a bound well under the 10 s the first periodic report would take.
    let ep = runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let stats = admin_json(&["stats", "--endpoint", "api"]);
            let ep = stats["endpoints"][0].clone();
            if ep["calls"] == 1 {
                break ep;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the call never reached the control plane: {stats}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    assert_eq!(
        (ep["attempts"].clone(), ep["retries"].clone()),
        (json!(2), json!(1))
    );
    // The agent closed its stream on the way out: the control plane sees it gone, and, as the
    // agent said it was ephemeral, does not list it as a disconnected agent of the fleet.
    let fleet = server.running().control().fleet.clone();
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while fleet.connected() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the agent is still connected: {:?}",
                fleet.status()
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    let status = admin_json(&["status"]);
    assert_eq!(status["agents"], json!([]), "{status}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("may not be in the fleet's figures"),
        "the counts were acknowledged: {stderr}"
    );
}

/// A control plane gone by the time the call ends (stopped while the upstream answers) never
/// gets the call's counts: the command says so on stderr, and its own outcome is the call's.
#[test]
fn server_mode_says_when_the_calls_counts_did_not_reach_the_control_plane() {
    use std::io::{Read as _, Write as _};
    use std::sync::mpsc;
    use std::time::Duration;

    let mut server = support::TestServer::start(Some(POLICY), None, |_| {});
    // An upstream that answers once told to.
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up_addr = upstream.local_addr().unwrap();
    let (arrived_tx, arrived) = mpsc::channel();
    let (answer, answer_rx) = mpsc::channel::<()>();
    let upstream_thread = std::thread::spawn(move || {
        let (mut conn, _) = upstream.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).unwrap();
        arrived_tx.send(()).unwrap();
        answer_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .unwrap();
    });
    let child = support::cli_process(&["request", "--endpoint", "api", "--server"])
        .arg(format!("http://{}", server.running().agent_addr))
        .arg(format!("http://{up_addr}/"))
        .spawn()
        .unwrap();
    arrived
        .recv_timeout(Duration::from_secs(30))
        .expect("the call reaches the upstream");
    server.stop();
    answer.send(()).unwrap();
    let out = child.wait_with_output().unwrap();
    upstream_thread.join().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("the call's counts may not be in the fleet's figures"),
        "{stderr}"
    );
}

#[test]
fn the_policy_must_come_from_a_file_or_a_server() {
    let out = support::cli(&[])
        .args(["request", "--endpoint", "api", "http://127.0.0.1:9/"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("--policy") && stderr.contains("--server"),
        "{stderr}"
    );
    // clap's own usage error: the command never gets as far as reading its flags.
    assert!(
        stderr.contains("the following required arguments were not provided"),
        "{stderr}"
    );
}

/// `retryplane request --endpoint api --server URL` to a port nothing listens on, the policy
/// asked of the control plane at `url`: its exit code and stderr, within 30 s.
fn request_via_server(url: &str) -> (Option<i32>, String) {
    let out = support::cli(&[])
        .args(["request", "--endpoint", "api", "--server", url])
        .arg("http://127.0.0.1:9/")
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn server_mode_on_a_control_plane_with_no_version_yet_says_so() {
    // API mode, an empty store and no seed file: the agent's stream is taken and stays quiet.
    let server = support::TestServer::start(None, None, |cfg| cfg.api_mode = true);
    let agent_url = format!("http://{}", server.running().agent_addr());
    let (code, stderr) = request_via_server(&agent_url);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("within 5 s: it took the agent's stream but has no version to send")
            && stderr.contains("until the first `retryplane apply`"),
        "{stderr}"
    );
}

/// A control plane that sends each agent stream one snapshot whose content does not match its
/// hash (which the real one never sends), then reads the stream to its end.
struct Tampering;

#[tonic::async_trait]
impl retryplane_proto::pb::agent_service_server::AgentService for Tampering {
    type ConnectStream = tokio_stream::wrappers::ReceiverStream<
        Result<retryplane_proto::pb::ServerMessage, tonic::Status>,
    >;

    async fn connect(
        &self,
        request: tonic::Request<tonic::Streaming<retryplane_proto::pb::AgentMessage>>,
    ) -> Result<tonic::Response<Self::ConnectStream>, tonic::Status> {
        use retryplane_proto::pb;
        let loaded = retryplane_policy::load(POLICY.as_bytes());
        let doc = pb::PolicyDocument::from(loaded.policies.unwrap().document().as_ref());
        let snapshot = pb::Snapshot {
            version: 3,
            content_hash: "0".repeat(64),
            policies: Some(doc),
            nonce: "nonce-3".to_owned(),
            metrics_interval_ms: 60_000,
        };
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            let _ = tx
                .send(Ok(pb::ServerMessage::with_snapshot(&snapshot)))
                .await;
            while let Ok(Some(_)) = inbound.message().await {}
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

#[test]
fn server_mode_says_the_policy_sent_was_refused_and_why() {
    // The agent of `request --server` NACKs a snapshot it cannot take: the command said the
    // control plane "has no version to send", and only a debug log said why.
    let runtime = Runtime::new().unwrap();
    let listener = runtime
        .block_on(TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let _server = runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(
                retryplane_proto::pb::agent_service_server::AgentServiceServer::new(Tampering),
            )
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let (code, stderr) = request_via_server(&format!("http://{addr}"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the control plane at http://{addr} sent a policy this command's agent refused \
             (version 3 refused: the content hash does not match the policies)"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("no version to send"), "{stderr}");
}

#[test]
fn server_mode_says_why_the_control_plane_gave_no_policy() {
    let server = support::TestServer::start(
        Some(POLICY),
        Some(
            "tokens:\n  - {name: fleet, role: agent, secret: agent-secret-0123456789}\n  - {name: alice, role: admin, secret: admin-secret-0123456789}\n",
        ),
        |_| {},
    );
    let agent_url = format!("http://{}", server.running().agent_addr());
    // `env_token` is `RETRYPLANE_AGENT_TOKEN`'s value (unset when `None`).
    let request_with = |server_url: &str, token: Option<&str>, env_token: Option<&str>| {
        let mut cmd = support::cli(&[]);
        match env_token {
            Some(t) => cmd.env("RETRYPLANE_AGENT_TOKEN", t),
            None => cmd.env_remove("RETRYPLANE_AGENT_TOKEN"),
        };
        cmd.args(["request", "--endpoint", "api", "--server", server_url])
            .timeout(std::time::Duration::from_secs(30));
        if let Some(token) = token {
            cmd.args(["--token", token]);
        }
        let out = cmd.arg("http://127.0.0.1:9/").output().unwrap();
        (out.status.code(), String::from_utf8(out.stderr).unwrap())
    };
    let request = |server_url: &str, token: Option<&str>| request_with(server_url, token, None);
    // No token: the refusal and what to do, without waiting out the 5 s.
    let (code, stderr) = request(&agent_url, None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("UNAUTHENTICATED") && stderr.contains("RETRYPLANE_AGENT_TOKEN"),
        "{stderr}"
    );
    // An admin token: not an agent's.
    let (code, stderr) = request(&agent_url, Some("admin-secret-0123456789"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("needs role `agent`")
            && stderr.contains("the token given is of another role"),
        "{stderr}"
    );
    // The admin listener instead of the agent listener.
    let (code, stderr) = request(&server.url, Some("agent-secret-0123456789"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("not an agent listener"), "{stderr}");
    // A token that ends in a line break (read from a file) is that token: it gets as far.
    let (code, stderr) = request(&server.url, Some("agent-secret-0123456789\n"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("not an agent listener"), "{stderr}");
    // An empty `--token` counts as not given: the token in `RETRYPLANE_AGENT_TOKEN` is sent
    // (here an admin token, which the refusal names), not no token at all.
    let (code, stderr) = request_with(&agent_url, Some(""), Some("admin-secret-0123456789"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("token `alice` has role `admin`"),
        "{stderr}"
    );
    // The HTTP listener (which answers 404) is named as the other likely mistake.
    let http_url = format!("http://{}", server.running().http_addr());
    let (code, stderr) = request(&http_url, Some("agent-secret-0123456789"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("not an agent listener")
            && stderr.contains("or its HTTP listener (--http-listen, 7472)"),
        "{stderr}"
    );
    // Nothing listening: the connection error, after the wait.
    let (code, stderr) = request(&support::dead_server(), None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("within 5 s: cannot connect"), "{stderr}");
}

#[test]
fn a_hung_upstream_gives_timeout_attempts_and_the_deadline_ends_the_call() {
    // Per-try timeout 1 s, deadline 1.9 s: attempt 1 times out at 1 s, the 100 ms pause, then
    // attempt 2 has the 800 ms left and times out at the deadline (800 ms of slack for a slow
    // machine before the pause would no longer fit).
    let up = Upstream::start(&[(HANG, ""), (HANG, ""), (HANG, "")]);
    let (v, code) = request_under(
        "version: 1\nendpoints:\n  api:\n    max_attempts: 5\n    per_try_timeout: 1s\n    \
         deadline: 1900ms\n    backoff: {base: 100ms, max: 100ms, jitter: none}\n",
        &[&up.url("/slow")],
    );
    assert_eq!(code, 1, "{v}");
    assert_eq!(v["outcome"], "failure");
    assert_eq!(v["cause"], "deadline_exceeded");
    assert_eq!(v["status"], Value::Null);
    let (shapes, pauses) = attempts(&v);
    assert_eq!(
        shapes,
        [
            json!({"attempt": 1, "status": null, "error": "timeout"}),
            json!({"attempt": 2, "status": null, "error": "timeout"}),
        ]
    );
    assert_eq!(pauses, [json!(100), Value::Null]);
    assert!(v["elapsed_ms"].as_u64().unwrap() >= 1900, "{v}");
}

#[test]
fn a_password_in_a_url_is_never_printed() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, POLICY).unwrap();
    let dead = support::dead_server();
    let with_password = dead.replace("http://", "http://alice:s3cret-pw@");
    let runs: &[&[&str]] = &[
        // The control plane's URL: no policy from it within the wait, which names it.
        &["--server", &with_password, &format!("{dead}/")],
        &["--server", "http://alice:s3cret-pw@127.0.0.1:", "http://a/"],
        &["--server", "https://alice:s3cret-pw@127.0.0.1", "http://a/"],
        // The URL called: refused by the upstream, or not one that can be called.
        &[
            "--policy",
            path.to_str().unwrap(),
            &format!("{with_password}/x"),
        ],
        &[
            "--policy",
            path.to_str().unwrap(),
            "http://alice:s3cret-pw@bad host/",
        ],
        &[
            "--policy",
            path.to_str().unwrap(),
            "ftp://alice:s3cret-pw@a/",
        ],
    ];
    for args in runs {
        let out = support::cli(&[])
            .args(["request", "--endpoint", "api"])
            .args(*args)
            .timeout(std::time::Duration::from_secs(30))
            .output()
            .unwrap();
        assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}");
        let shown = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!shown.contains("s3cret-pw"), "{args:?}: {shown}");
        if out.status.code() == Some(2) {
            assert!(shown.contains("alice:***@"), "{args:?}: {shown}");
        }
    }
}

#[test]
fn explain_and_request_take_the_same_route_for_a_path_with_dot_segments() {
    // `request` parses its URL, which resolves dot segments, and matches (and sends)
    // `/v1/items`; `explain --path` resolves them the same way, and says so.
    let policy = format!(
        "{POLICY}    routes:\n      - match: {{path_prefix: /v1/charges}}\n        max_attempts: 1\n"
    );
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("policy.yaml");
    fs::write(&path, &policy).unwrap();
    let out = support::cli(&[])
        .args(["explain", "--endpoint", "api", "--format", "json"])
        .arg(&path)
        .args(["--path", "/v1/charges/../items"])
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "note: --path `/v1/charges/../items` is sent as `/v1/items` by clients that parse URLs"
        ),
        "{stderr}"
    );
    let explained: Value = serde_json::from_slice(&out.stdout).unwrap();
    let explained_attempts = explained["policy"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["field"] == "max_attempts")
        .unwrap()["value"]
        .as_u64()
        .unwrap();

    let up = Upstream::start(&[(503, ""), (503, ""), (503, "")]);
    let (v, code) = request_under(&policy, &[&up.url("/v1/charges/../items")]);
    let made = u64::try_from(v["attempts"].as_array().unwrap().len()).unwrap();
    assert_eq!(
        (made, code),
        (explained_attempts, 1),
        "explain: {explained_attempts} attempts at most (route {}); request: {v}",
        explained["route"]
    );
}

#[test]
fn server_mode_with_an_agent_token_held_to_agent_ids_says_so_not_that_it_is_no_agent_token() {
    let server = support::TestServer::start(
        Some(POLICY),
        Some(
            "tokens:\n  - {name: checkout, role: agent, secret: agent-secret-0123456789, agent_ids: [checkout-*]}\n  - {name: alice, role: admin, secret: admin-secret-0123456789}\n",
        ),
        |_| {},
    );
    let agent_url = format!("http://{}", server.running().agent_addr());
    let out = support::cli(&[])
        .args(["request", "--endpoint", "api", "--server", &agent_url])
        .args(["--token", "agent-secret-0123456789"])
        .arg("http://127.0.0.1:9/")
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // It is an agent token: the refusal is of the agent id the command connects as
    // (`retryplane-cli-…`), which the hint must not contradict.
    assert!(stderr.contains("PERMISSION_DENIED"), "{stderr}");
    assert!(!stderr.contains("not an agent token"), "{stderr}");
}

/// Runs `request --output json` under `policy` against `up_addr`, sends it SIGINT once the
/// upstream says (on `arrived`) that the attempt to cut has come (`what`), and returns its JSON
/// after checking it exited 1.
#[cfg(unix)]
fn interrupted_request(
    policy: &std::path::Path,
    up_addr: std::net::SocketAddr,
    arrived: &std::sync::mpsc::Receiver<()>,
    what: &str,
) -> Value {
    let child = support::cli_process(&[
        "request",
        "--endpoint",
        "api",
        "--output",
        "json",
        "--policy",
    ])
    .arg(policy)
    .arg(format!("http://{up_addr}/"))
    .spawn()
    .unwrap();
    arrived
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect(what);
    let killed = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Ctrl-C (SIGINT) during an attempt cancels the call, as a caller dropping it would: the
/// command prints its outcome, `cancelled`, with the attempt it cut shown as having no
/// answer (no error class: it neither failed to connect nor timed out), and exits 1.
#[cfg(unix)]
#[test]
fn ctrl_c_cancels_the_call_and_prints_its_outcome() {
    use std::sync::mpsc;
    use std::time::Duration;

    let dir = TempDir::new().unwrap();
    let policy = dir.path().join("p.yaml");
    fs::write(
        &policy,
        "version: 1\nendpoints:\n  api:\n    deadline: 60s\n    per_try_timeout: 50s\n",
    )
    .unwrap();
    // An upstream that takes the request and never answers.
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up_addr = upstream.local_addr().unwrap();
    let (arrived_tx, arrived) = mpsc::channel();
    let holder = std::thread::spawn(move || {
        let (conn, _) = upstream.accept().unwrap();
        arrived_tx.send(()).unwrap();
        // Held until the command has ended (its side closes the connection).
        let mut conn = conn;
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let _ = std::io::copy(&mut conn, &mut std::io::sink());
    });
    let v = interrupted_request(&policy, up_addr, &arrived, "the call reaches the upstream");
    holder.join().unwrap();
    assert_eq!(v["cause"], "cancelled", "{v}");
    assert_eq!(
        v["attempts"],
        json!([{"attempt": 1, "status": null, "error": null, "pause_ms": null}]),
        "{v}"
    );
}

/// Ctrl-C during a retry, after a first attempt answered 503: the call's final status is the
/// cut attempt's, none (SPEC §5: "final HTTP status or null"), not the 503 the call kept.
#[cfg(unix)]
#[test]
fn ctrl_c_during_a_retry_leaves_no_final_status() {
    use std::io::{Read as _, Write as _};
    use std::sync::mpsc;
    use std::time::Duration;

    let dir = TempDir::new().unwrap();
    let policy = dir.path().join("p.yaml");
    fs::write(
        &policy,
        "version: 1\nendpoints:\n  api:\n    deadline: 60s\n    per_try_timeout: 50s\n    backoff: {base: 10ms, max: 10ms, jitter: none}\n",
    )
    .unwrap();
    // The first request gets a 503 (its connection closed), the second is held.
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up_addr = upstream.local_addr().unwrap();
    let (arrived_tx, arrived) = mpsc::channel();
    let holder = std::thread::spawn(move || {
        let (mut first, _) = upstream.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = first.read(&mut buf).unwrap();
        first
            .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .unwrap();
        drop(first);
        let (mut second, _) = upstream.accept().unwrap();
        arrived_tx.send(()).unwrap();
        second
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let _ = std::io::copy(&mut second, &mut std::io::sink());
    });
    let v = interrupted_request(&policy, up_addr, &arrived, "the retry reaches the upstream");
    holder.join().unwrap();
    assert_eq!(v["cause"], "cancelled", "{v}");
    assert_eq!(v["status"], Value::Null, "{v}");
    assert_eq!(v["attempts"][0]["status"], 503, "{v}");
    assert_eq!(v["attempts"][1]["status"], Value::Null, "{v}");
}

/// The stderr of `request_output`, once the call exited 1.
fn failed_stderr(policy: &str, args: &[&str]) -> String {
    let out = request_output(policy, args);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8(out.stderr).unwrap()
}

/// At a terminal, where stdout and stderr meet, the lines that explain a failure come under
/// the report they speak of, not above it.
#[test]
fn the_notes_of_a_failure_come_after_its_report() {
    let up = Upstream::start(&[(503, "")]);
    let dir = TempDir::new().unwrap();
    let policy = dir.path().join("policy.yaml");
    fs::write(&policy, POLICY).unwrap();
    let both = dir.path().join("out");
    let file = fs::File::create(&both).unwrap();
    let mut cmd = support::cli_process(&["request", "--endpoint", "api", "--policy"]);
    cmd.arg(&policy)
        .args(["--data", "x", &up.url("/v1/charges")])
        .stdout(file.try_clone().unwrap())
        .stderr(file);
    let rt = Runtime::new().unwrap();
    let status = rt.block_on(async {
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
            .await
            .expect("request did not end in 30 s")
            .unwrap()
    });
    assert_eq!(status.code(), Some(1));
    let out = fs::read_to_string(&both).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(lines[0], "attempt 1: HTTP 503", "{out}");
    assert!(lines[1].starts_with("failure: not_retryable"), "{out}");
    assert!(
        lines[2].starts_with("retryplane: HTTP 503 is one the policy retries"),
        "{out}"
    );
}

/// A failure that was not retried says why on stderr: the method and the missing key for a
/// failure the policy retries, a timeout's unknown outcome, or `retry_on` not listing it.
#[test]
fn a_failure_not_retried_says_why() {
    let up = Upstream::start(&[(503, "")]);
    assert_eq!(
        failed_stderr(POLICY, &["--data", "x", &up.url("/v1/charges")]),
        "retryplane: HTTP 503 is one the policy retries, but a POST is retried only with the \
         `Idempotency-Key` header, with a value that is not blank: POST is not among the \
         policy's idempotent methods (GET, HEAD, OPTIONS, PUT, DELETE)\n"
    );
    // A blank key is no key.
    let up = Upstream::start(&[(503, "")]);
    let blank = failed_stderr(
        POLICY,
        &[
            "-H",
            "Idempotency-Key;",
            "--data",
            "x",
            &up.url("/v1/charges"),
        ],
    );
    assert!(blank.contains("a POST is retried only with"), "{blank}");

    let up = Upstream::start(&[(HANG, "")]);
    let policy = format!("{POLICY}    per_try_timeout: 300ms\n");
    assert_eq!(
        failed_stderr(&policy, &["--data", "x", &up.url("/v1/charges")]),
        "retryplane: a timeout error is one the policy retries, but it leaves the outcome \
         unknown (the upstream may have handled the request), and a POST is retried only with \
         the `Idempotency-Key` header, with a value that is not blank: POST is not among the \
         policy's idempotent methods (GET, HEAD, OPTIONS, PUT, DELETE)\n"
    );

    let up = Upstream::start(&[(404, "")]);
    assert_eq!(
        failed_stderr(POLICY, &[&up.url("/missing")]),
        "retryplane: the policy's retry_on does not list HTTP 404\n"
    );

    let up = Upstream::start(&[(
        200,
        "content-type: application/grpc\r\ngrpc-status: 14\r\ngrpc-retry-pushback-ms: -1\r\n",
    )]);
    assert_eq!(
        failed_stderr(POLICY, &[&up.url("/pkg.Svc/M")]),
        "retryplane: the answer (gRPC UNAVAILABLE) said not to retry it \
         (grpc-retry-pushback-ms)\n"
    );
    // Hints not honoured: the engine did not hear it, and the note gives the reason it had.
    let up = Upstream::start(&[(
        200,
        "content-type: application/grpc\r\ngrpc-status: 5\r\ngrpc-retry-pushback-ms: -1\r\n",
    )]);
    let deaf = POLICY.replace("honor: true", "honor: false");
    assert_eq!(
        failed_stderr(&deaf, &[&up.url("/pkg.Svc/M")]),
        "retryplane: the policy's retry_on does not list gRPC NOT_FOUND\n"
    );

    // One attempt only: the key would not help, and the note does not send one for it.
    let up = Upstream::start(&[(503, "")]);
    let once = POLICY.replace("max_attempts: 3", "max_attempts: 1");
    assert_eq!(
        failed_stderr(&once, &["--data", "x", &up.url("/v1/charges")]),
        "retryplane: the policy's max_attempts is 1: no retry is made\n"
    );
}

/// A call given up on before its deadline passed (the next pause would have ended past it)
/// says how much was left, and the hint that asked for the pause.
#[test]
fn a_pause_past_the_deadline_is_said_with_what_was_left() {
    let up = Upstream::start(&[(503, "retry-after: 1\r\n")]);
    let policy = format!("{POLICY}    deadline: 1s\n    per_try_timeout: 500ms\n");
    let stderr = failed_stderr(&policy, &[&up.url("/")]);
    let left = stderr
        .strip_prefix("retryplane: the call gave up with ")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_default();
    assert!(
        left.ends_with("ms") && left[..left.len() - 2].bytes().all(|b| b.is_ascii_digit()),
        "whole milliseconds: {stderr}"
    );
    assert!(
        stderr.starts_with("retryplane: the call gave up with ")
            && stderr.ends_with(
                " of the policy's deadline of 1s left: the pause before the next attempt would \
                 have ended past it, the answer's Retry-After asking for 1s\n"
            ),
        "{stderr}"
    );
    // Without a hint: the backoff's own pause did not fit.
    let up = Upstream::start(&[(503, ""), (503, "")]);
    let policy = "version: 1\nendpoints:\n  api:\n    deadline: 1s\n    per_try_timeout: 1s\n    backoff: {base: 2s, max: \
                  2s, jitter: none}\n";
    let stderr = failed_stderr(policy, &[&up.url("/")]);
    assert!(
        stderr.ends_with(
            " of the policy's deadline of 1s left: the pause before the next attempt would \
             have ended past it\n"
        ),
        "{stderr}"
    );
}
