//! A password written in a URL on the command line (`http://user:password@host`) is never sent
//! nor printed: the real binary against an HTTP/2 server on `127.0.0.1:0` that records what
//! each call names as its authority, and clap's own messages.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;

use assert_cmd::Command;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const PASSWORD: &str = "s3cret-pw";

/// `retryplane` with no token or server from the environment of the test, failing after 30 s.
fn retryplane() -> Command {
    let mut cmd = Command::cargo_bin("retryplane").unwrap();
    cmd.env_remove("RETRYPLANE_SERVER")
        .env_remove("RETRYPLANE_TOKEN")
        .env_remove("RETRYPLANE_AGENT_TOKEN")
        .timeout(std::time::Duration::from_secs(30));
    cmd
}

/// Starts an HTTP/2 server on `127.0.0.1:0` that answers every call with gRPC's
/// `UNIMPLEMENTED` (a refusal both the admin commands and the agent stop at) and sends the
/// `:authority` and URI of each call on the channel. Returns its port.
async fn recording_h2_server() -> (u16, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((request, mut respond))) = conn.accept().await {
                    let authority = request.uri().authority().map(|a| a.to_string());
                    let _ = tx.send(format!("{authority:?} {}", request.uri()));
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .header("grpc-status", "12")
                        .body(())
                        .unwrap();
                    let _ = respond.send_response(response, true);
                }
            });
        }
    });
    (port, rx)
}

/// Runs the binary with `args` off the runtime, so that the server above keeps answering.
async fn run(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || retryplane().args(args).output().unwrap())
        .await
        .unwrap()
}

fn assert_no_password(out: &Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stdout.contains(PASSWORD), "stdout: {stdout}");
    assert!(!stderr.contains(PASSWORD), "stderr: {stderr}");
}

#[tokio::test]
async fn the_password_of_a_server_url_is_not_sent_to_the_control_plane() {
    let (port, mut seen) = recording_h2_server().await;
    let url = format!("http://admin:{PASSWORD}@127.0.0.1:{port}");
    let out = run(vec!["status".into(), "--server".into(), url.clone()]).await;
    assert_no_password(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the user:password@ part of a --server URL is not used"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("is not used").count(),
        1,
        "said once: {stderr}"
    );
    let call = seen
        .recv()
        .await
        .expect("the admin call reached the server");
    assert!(
        call.starts_with(&format!(
            "Some(\"127.0.0.1:{port}\") http://127.0.0.1:{port}/retryplane.v1.AdminService/"
        )),
        "{call}"
    );

    // The agent of `request --server`: its stream names no password either.
    let out = run(vec![
        "request".into(),
        "--server".into(),
        url,
        "--endpoint".into(),
        "api".into(),
        "http://127.0.0.1:9/".into(),
    ])
    .await;
    assert_no_password(&out);
    assert_eq!(out.status.code(), Some(2));
    let call = seen
        .recv()
        .await
        .expect("the agent's stream reached the server");
    assert!(
        call.starts_with(&format!(
            "Some(\"127.0.0.1:{port}\") http://127.0.0.1:{port}/"
        )),
        "{call}"
    );
    assert!(!call.contains(PASSWORD) && !call.contains('@'), "{call}");
}

#[test]
fn help_does_not_show_the_server_url_of_the_environment() {
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("retryplane"))
        .args(["status", "--help"])
        .env(
            "RETRYPLANE_SERVER",
            format!("http://admin:{PASSWORD}@127.0.0.1:1"),
        )
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("RETRYPLANE_SERVER"), "{stdout}");
    assert!(!stdout.contains("admin:"), "{stdout}");
    assert_no_password(&out);
}

#[test]
fn a_header_whose_h_was_forgotten_is_quoted_without_its_value() {
    for header in [
        format!("Authorization: Bearer {PASSWORD}"),
        format!("Authorization:Bearer {PASSWORD}"),
        format!("Authorization: next=https://a.example/; t={PASSWORD}"),
    ] {
        let out = retryplane()
            .args(["request", "--policy", "p.yaml", "--endpoint", "api"])
            .args(["http://127.0.0.1:1/x", &header])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: unexpected argument 'Authorization: ***' found"),
            "{stderr}"
        );
        assert_no_password(&out);
    }
    // The value of a flag is never taken for a header: shown as given.
    let out = retryplane()
        .args(["serve", "--metrics-interval", "interval: 10s"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: invalid value 'interval: 10s' for '--metrics-interval"),
        "{stderr}"
    );
    // A host:port is not a header: quoted as given.
    let stderr = stderr_of(&["status", "127.0.0.1:1"]);
    assert!(
        stderr.starts_with("error: unexpected argument '127.0.0.1:1' found"),
        "{stderr}"
    );
}

/// The stderr of `retryplane ARGS...`, which must exit 2.
fn stderr_of(args: &[&str]) -> String {
    let out = retryplane().args(args).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_server_url_is_shown_without_its_query_in_every_message() {
    for (args, said) in [
        (
            vec![
                "status",
                "--server",
                "https://cp.internal/?token=QUERYSECRET",
            ],
            "--server https://cp.internal/?…: only http:// is supported",
        ),
        (
            vec![
                "status",
                "--server",
                "http://cp.internal:abc/?token=QUERYSECRET",
            ],
            "--server http://cp.internal:abc/?…: the port must be a number",
        ),
        (
            vec![
                "status",
                "--server",
                "http://127.0.0.1:1/?token=QUERYSECRET",
            ],
            "http://127.0.0.1:1/?…",
        ),
        (
            vec![
                "request",
                "--server",
                "https://cp.internal/?token=QUERYSECRET",
                "--endpoint",
                "a",
                "http://127.0.0.1:1/",
            ],
            "--server https://cp.internal/?…: only http:// is supported",
        ),
    ] {
        let out = retryplane()
            .args(&args)
            .timeout(std::time::Duration::from_secs(30))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(said), "{args:?}: {stderr}");
        assert!(!stderr.contains("QUERYSECRET"), "{args:?}: {stderr}");
    }
    // A URL clap does not expect: its query is cut too, with or without a scheme; a `/`
    // after the port keeps the host though an `@` follows.
    for (arg, shown) in [
        (
            "http://127.0.0.1:1/?token=QUERYSECRET",
            "http://127.0.0.1:1/?…",
        ),
        ("cp.internal:7471/?token=QUERYSECRET", "cp.internal:7471/?…"),
        ("cp#access_token=QUERYSECRET", "cp#…"),
        (
            "http://cp:7471/?email=a@b&t=QUERYSECRET",
            "http://cp:7471/?…",
        ),
        ("X-Api-Key:QUERYSECRET", "X-Api-Key: ***"),
    ] {
        let stderr = stderr_of(&["status", arg]);
        assert!(
            stderr.starts_with(&format!("error: unexpected argument '{shown}' found")),
            "{arg}: {stderr}"
        );
        assert!(!stderr.contains("QUERYSECRET"), "{arg}: {stderr}");
    }
    // A header value the shell split from its `-H` (quotes forgotten), however the flag is
    // written; a short word is replaced only where it is quoted, not inside other words.
    for (flag, secret) in [
        (vec!["-H", "Authorization:"], "QUERYSECRET"),
        (vec!["--header=Authorization:"], "QUERYSECRET"),
        (vec!["-HAuthorization:"], "QUERYSECRET"),
        (vec!["-H", "Authorization:"], "t"),
    ] {
        let mut args = vec!["request", "--policy", "p.yaml", "--endpoint", "api"];
        args.extend(&flag);
        args.extend(["Bearer", secret, "http://127.0.0.1:1/"]);
        let stderr = stderr_of(&args);
        assert!(
            stderr.starts_with("error: unexpected argument '***' found"),
            "{flag:?}: {stderr}"
        );
        assert!(stderr.contains("Usage: retryplane request"), "{stderr}");
        assert!(!stderr.contains("QUERYSECRET"), "{stderr}");
    }
}

#[test]
fn a_url_clap_does_not_expect_is_quoted_without_its_password() {
    let url = format!("http://admin:{PASSWORD}@127.0.0.1:1");
    let out = retryplane().args(["status", &url]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: unexpected argument 'http://admin:***@127.0.0.1:1' found"),
        "{stderr}"
    );
    assert_no_password(&out);
    // `--help` still goes to stdout, exit 0.
    let out = retryplane().args(["--help"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage: retryplane"));
    assert!(out.stderr.is_empty());
}

#[tokio::test]
async fn a_server_url_with_an_at_after_its_host_is_refused_before_any_call() {
    // `http://localhost:PORT/PASSWORD@127.0.0.1:1` is, to a URL parser, host `localhost` and a
    // path: a password holding `/` would send the call, token and all, to the user name's host.
    // An `@` in a path is of no use either (only scheme, host and port are used).
    let (port, mut seen) = recording_h2_server().await;
    // A password holding `/`, `?` or `#` whose start is no port is told the same, not that
    // the port is wrong; so is one without a scheme.
    for url in [
        format!("http://localhost:{port}/{PASSWORD}@127.0.0.1:1"),
        format!("http://127.0.0.1:{port}/p@x"),
        format!("http://admin:{PASSWORD}@127.0.0.1:{port}/p@x"),
        format!("http://admin:pa/{PASSWORD}@127.0.0.1:{port}"),
        format!("http://admin:/{PASSWORD}@127.0.0.1:{port}"),
        format!("http://admin:pa?{PASSWORD}@127.0.0.1:{port}"),
        format!("http://admin:pa#{PASSWORD}@127.0.0.1:{port}"),
        format!("admin:pa/{PASSWORD}@127.0.0.1:{port}"),
    ] {
        let admin = run(vec![
            "status".into(),
            "--server".into(),
            url.clone(),
            "--token".into(),
            "t0ken".into(),
        ])
        .await;
        let request = run(vec![
            "request".into(),
            "--server".into(),
            url.clone(),
            "--endpoint".into(),
            "api".into(),
            "http://127.0.0.1:9/".into(),
        ])
        .await;
        for (out, hint) in [
            (&admin, "RETRYPLANE_TOKEN"),
            (&request, "RETRYPLANE_AGENT_TOKEN"),
        ] {
            assert_no_password(out);
            assert_eq!(out.status.code(), Some(2), "{url}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains("an `@` after the host"), "{url}: {stderr}");
            assert!(stderr.contains(hint), "{url}: {stderr}");
        }
    }
    assert!(seen.try_recv().is_err(), "no call may reach the server");
}

#[tokio::test]
async fn a_server_url_that_does_not_parse_is_said_to_be_invalid_without_its_password() {
    for url in [
        format!("http://admin:p^{PASSWORD}@127.0.0.1:9"),
        format!("http://admin:p {PASSWORD}@127.0.0.1:9"),
    ] {
        let out = run(vec!["status".into(), "--server".into(), url.clone()]).await;
        assert_no_password(&out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("not a valid URL"), "{url}: {stderr}");
    }
}
