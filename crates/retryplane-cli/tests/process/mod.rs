//! `retryplane serve` as a process for the tests that need the real binary: start it on a temp
//! directory, read its addresses, ask its HTTP listener, stop it with SIGTERM.

#![allow(dead_code, reason = "each test file uses part of it")]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, Command};

/// The longest any step of these helpers waits.
pub const BOUND: Duration = Duration::from_secs(30);

/// `retryplane serve` on `dir` (`policy` written to `policies.yaml`, data directory `data`),
/// every listener on port 0, with `extra` flags, its log (at `warn`) to `stderr`; returns once
/// it has printed its three addresses, as (name, address): `agent`, `admin`, `http`.
pub async fn serve(
    dir: &Path,
    policy: &str,
    extra: &[&str],
    stderr: Stdio,
) -> (Child, Vec<(String, String)>) {
    serve_logging(dir, policy, extra, stderr, "warn").await
}

/// [`serve`], its log filtered by `filter` (`RUST_LOG`).
pub async fn serve_logging(
    dir: &Path,
    policy: &str,
    extra: &[&str],
    stderr: Stdio,
    filter: &str,
) -> (Child, Vec<(String, String)>) {
    std::fs::write(dir.join("policies.yaml"), policy).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir)
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_LOG", filter)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addrs = Vec::new();
    while addrs.len() < 3 {
        let line = tokio::time::timeout(BOUND, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let (name, addr) = line.split_once(": ").unwrap();
        addrs.push((name.to_owned(), addr.to_owned()));
    }
    let names: Vec<&str> = addrs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["agent", "admin", "http"]);
    (child, addrs)
}

/// The whole answer (head and body) to `GET path` on the HTTP listener at `addr`.
pub async fn http_get(addr: &str, path: &str) -> String {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(BOUND, socket.read_to_string(&mut response))
        .await
        .unwrap()
        .unwrap();
    response
}

/// Sends SIGTERM and expects a clean exit.
pub async fn terminate(mut child: Child) {
    let pid = child.id().unwrap().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}
