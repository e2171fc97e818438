//! Addresses and names as operators write them: `serve`'s listen flags, the control-plane URL
//! of `request --server`, the admin commands and the agent library, and `request`'s upstream
//! URL. Only 127.0.0.1 and ::1 are used.

#![cfg(unix)]
// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

use retryplane_agent::Agent;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, BufReader};
use tokio::process::Command;
use tokio::time::timeout;

mod process;

/// The longest any step waits.
const BOUND: Duration = Duration::from_secs(30);

const POLICY: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 2\n";

/// What the CLI does with the command line `cmd` sets up, with none of its variables set and
/// nothing on standard input.
async fn cli(cmd: impl FnOnce(&mut Command) -> &mut Command) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_retryplane"));
    command
        .env_remove("RETRYPLANE_SERVER")
        .env_remove("RETRYPLANE_TOKEN")
        .env_remove("RETRYPLANE_AGENT_TOKEN")
        .stdin(Stdio::null());
    timeout(BOUND, cmd(&mut command).output())
        .await
        .unwrap()
        .unwrap()
}

/// What `retryplane serve` with `listen` as its agent listener does: `Ok(agent address)` when
/// it starts (it is then stopped), `Err(stderr)` when it exits first.
async fn serve_with_listen(listen: &str) -> Result<String, String> {
    serve_with_listeners(&[
        "--listen",
        listen,
        "--admin-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ])
    .await
}

/// What `retryplane serve` with the listener flags `listeners` does: `Ok(first line of
/// stdout)` when it starts (it is then stopped), `Err(stderr)` when it exits first.
async fn serve_with_listeners(listeners: &[&str]) -> Result<String, String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), POLICY).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir.path())
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(listeners)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = timeout(BOUND, lines.next_line()).await.unwrap().unwrap();
    match first {
        Some(line) => {
            child.start_kill().unwrap();
            timeout(BOUND, child.wait()).await.unwrap().unwrap();
            Ok(line)
        }
        None => {
            let mut stderr = String::new();
            let mut pipe = child.stderr.take().unwrap();
            timeout(BOUND, pipe.read_to_string(&mut stderr))
                .await
                .unwrap()
                .unwrap();
            timeout(BOUND, child.wait()).await.unwrap().unwrap();
            Err(stderr)
        }
    }
}

/// `localhost:7470` is how many operators write a loopback listener (Prometheus and most
/// servers take a name there). `serve` refuses it with clap's bare "invalid socket address
/// syntax", which does not say that a name is the problem nor what to write instead.
#[tokio::test]
async fn serve_takes_localhost_as_a_listen_address_or_says_it_wants_an_ip_address() {
    match serve_with_listen("localhost:0").await {
        Ok(line) => assert!(
            line.starts_with("agent: 127.0.0.1:") || line.starts_with("agent: [::1]:"),
            "{line}"
        ),
        Err(stderr) => assert!(
            stderr.contains("IP address"),
            "a refused name should say an IP address is wanted (127.0.0.1:PORT, [::1]:PORT): \
             {stderr}"
        ),
    }
}

/// A listen address without a port, or with one past 65535, gets the same bare "invalid
/// socket address syntax", where `--server` says "no port after the `:`" and "the port must
/// be a number from 1 to 65535".
#[tokio::test]
async fn a_listen_address_without_a_port_or_with_one_past_65535_says_the_port_is_wrong() {
    for listen in ["127.0.0.1", "[::1]", "127.0.0.1:70000", "[::1]:70000"] {
        let stderr = serve_with_listen(listen)
            .await
            .expect_err("not a listen address");
        assert!(
            stderr.contains("port"),
            "--listen {listen}: the error should name the port: {stderr}"
        );
    }
}

/// `[::ffff:127.0.0.1]` (IPv4-mapped 127.0.0.1) only takes connections from 127.0.0.1, but the
/// no-tokens check takes it for an exposed address, and its message tells the operator to
/// "listen on a loopback address", which it is.
#[tokio::test]
async fn serve_takes_an_ipv4_mapped_loopback_address_without_a_tokens_file() {
    let started = serve_with_listen("[::ffff:127.0.0.1]:0").await;
    assert!(
        started
            .as_ref()
            .is_ok_and(|line| line.starts_with("agent: [::ffff:127.0.0.1]:")),
        "{started:?}"
    );
}

/// `retryplane request --server http://cp` uses the agent listener's port, 7470; the agent
/// library's own message says its URL "must be http://host:port", yet it takes
/// `http://127.0.0.1` and dials port 80 for ever (every try a connect error), so a URL that
/// works with the CLI leaves every embedded agent on its fallback policy. Either refuse it
/// (as the message says) or take port 7470 as the CLI does.
#[tokio::test]
async fn an_agent_url_without_a_port_is_refused_as_its_message_says() {
    for url in ["http://127.0.0.1", "http://[::1]", "http://localhost/"] {
        match Agent::builder().url(url).service("checkout").connect() {
            Ok(agent) => {
                agent.shutdown().await;
                panic!("{url}: taken, and dialled on port 80");
            }
            Err(e) => assert!(e.to_string().contains("port"), "{url}: {e}"),
        }
    }
}

/// `http://:PORT` names no host. The agent library takes it, and `request --server` and the
/// admin commands try to resolve the empty name: after the 5 s wait, "dns error: failed to
/// lookup address information: Name or service not known", which does not say that the host
/// is missing from the URL.
#[tokio::test]
async fn an_agent_url_without_a_host_is_refused() {
    let agent = Agent::builder()
        .url("http://:7470")
        .service("checkout")
        .connect();
    if let Ok(agent) = agent {
        agent.shutdown().await;
        panic!("the agent took http://:7470, a URL with no host");
    }
}

/// The CLI's side of the above: `request --server http://:PORT` and `history --server
/// http://:PORT`.
#[tokio::test]
async fn a_server_url_without_a_host_is_refused_naming_the_host() {
    for args in [
        &[
            "request",
            "--server",
            "http://:7470",
            "--endpoint",
            "payments",
            "http://127.0.0.1:9/",
        ][..],
        &["history", "--server", "http://:7471"][..],
    ] {
        let out = cli(|c| c.args(args)).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("host"),
            "{args:?}: the error should say the URL names no host: {stderr}"
        );
    }
}

/// An empty `request --server` (a script's `--server "$CP"` with the variable unset) is said to
/// be empty, not quoted as an `http://` the user never wrote.
#[tokio::test]
async fn an_empty_request_server_is_said_to_be_empty() {
    for server in ["", "  "] {
        let out = cli(|c| {
            c.args(["request", "--server", server, "--endpoint", "payments"])
                .arg("http://127.0.0.1:9/")
        })
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{server:?}: {stderr}");
        assert!(stderr.contains("--server is empty"), "{server:?}: {stderr}");
        assert!(
            !stderr.contains("http://:") && !stderr.contains("--server http://"),
            "{stderr}"
        );
    }
}

/// `retryplane request`'s upstream written as curl takes it, without a scheme: `localhost:PORT/x`
/// is refused with "only http:// and https:// URLs are supported" (the URL parser took
/// `localhost` for the scheme) and `[::1]:PORT/x` with "relative URL without a base", while
/// `--server` puts `http://` before the same forms. Either take them as `http://` (then the
/// closed port gives connect errors, exit 1) or say that the scheme is missing.
#[tokio::test]
async fn an_upstream_url_without_a_scheme_is_taken_as_http_or_refused_as_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    for url in [format!("localhost:{closed}/x"), format!("[::1]:{closed}/x")] {
        let out = cli(|c| {
            c.current_dir(dir.path())
                .args(["request", "--policy", "p.yaml", "--endpoint", "payments"])
                .args(["--output", "json", &url])
        })
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let taken_as_http = out.status.code() == Some(1) && stdout.contains("\"connect\"");
        assert!(
            taken_as_http || stderr.contains("scheme"),
            "{url}: exit {:?}, stdout {stdout}, stderr {stderr}",
            out.status.code()
        );
    }
}

/// A `--server` URL with a path (`http://gw/retryplane`, a control plane behind a gateway that
/// routes by path) works as if the path were not there: gRPC calls go to `/retryplane.v1...`
/// at the root, the path silently dropped. The `user:password@` of the same URL gets a note
/// saying it is not used; the path gets none, and neither the help nor the README says so.
#[tokio::test]
async fn a_server_url_with_a_path_says_the_path_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addrs) = process::serve(dir.path(), POLICY, &[], Stdio::null()).await;
    let admin = &addrs[1].1;
    let out = cli(|c| c.args(["history", "--server", &format!("http://{admin}/retryplane")])).await;
    process::terminate(child).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() != Some(0) || stderr.contains("path"),
        "served as if --server had no path, and nothing said so: exit {:?}, stderr {stderr:?}",
        out.status.code()
    );
}

/// A control plane on an IPv6 socket that takes IPv4 too (`[::]`, the usual dual-stack
/// listener; here `[::ffff:127.0.0.1]`, which is the same for a client of 127.0.0.1) lists an
/// IPv4 agent's peer as `[::ffff:127.0.0.1]:PORT`, not `127.0.0.1:PORT`: an operator looking
/// for an agent by its address in `status` does not find it as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_an_ipv4_agent_on_a_dual_stack_listener_by_its_ipv4_address() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), POLICY).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir.path())
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(["--listen", "[::ffff:127.0.0.1]:0", "--insecure"])
        .args([
            "--admin-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let line = timeout(BOUND, lines.next_line()).await.unwrap().unwrap();
        addrs.push(
            line.expect("serve printed its addresses")
                .split_once(": ")
                .unwrap()
                .1
                .to_owned(),
        );
    }
    let port = addrs[0].rsplit_once(':').unwrap().1;
    let agent = Agent::builder()
        .url(format!("http://127.0.0.1:{port}"))
        .service("checkout")
        .agent_id("a-v4")
        .connect()
        .unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    while !agent.is_connected() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the agent never connected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = cli(|c| c.args(["status", "--output", "json", "--server", &addrs[1]])).await;
    agent.shutdown().await;
    child.start_kill().unwrap();
    timeout(BOUND, child.wait()).await.unwrap().unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peer = status["agents"][0]["peer"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(peer.starts_with("127.0.0.1:"), "peer {peer:?}");
}

/// Without a tokens file and without --insecure, every spelling of an
/// address that is not loopback is refused on the agent and on the admin listener before
/// anything is bound: the unspecified addresses of both families, their IPv4-mapped form, a
/// mapped private address, a link-local address with a zone, the IPv4-compatible form of
/// 127.0.0.1 (`::7f00:1`, not loopback) and the NAT64 form of 127.0.0.1. The IPv4-mapped
/// loopback addresses (any of 127/8, any zone, written out in full) are taken as loopback.
#[tokio::test]
async fn without_tokens_no_spelling_of_a_public_address_passes_for_loopback() {
    for addr in [
        "0.0.0.0:0",
        "[::]:0",
        "[::ffff:0.0.0.0]:0",
        "[0:0:0:0:0:ffff:0:0]:0",
        "[::ffff:10.0.0.1]:0",
        "[fe80::1%1]:0",
        "[::127.0.0.1]:0",
        "[64:ff9b::7f00:1]:0",
    ] {
        for flag in ["--listen", "--admin-listen"] {
            let mut args = vec!["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
            args.extend(["--http-listen", "127.0.0.1:0"]);
            let at = args.iter().position(|a| *a == flag).unwrap();
            args[at + 1] = addr;
            let stderr = serve_with_listeners(&args).await.expect_err(&format!(
                "{flag} {addr} served without tokens or --insecure"
            ));
            assert!(
                stderr.contains("refusing to serve without a tokens file"),
                "{flag} {addr}: {stderr}"
            );
        }
    }
    for addr in [
        "[::ffff:127.0.0.1]:0",
        "[::ffff:127.0.0.2]:0",
        "[0:0:0:0:0:ffff:7f00:1]:0",
        "[::ffff:127.0.0.1%1]:0",
        "[::1%1]:0",
    ] {
        let started = serve_with_listeners(&[
            "--listen",
            addr,
            "--admin-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .await;
        assert!(started.is_ok(), "{addr}: {started:?}");
    }
}

/// A listen address written as a URL (`http://127.0.0.1:7470`, copied from a `--server` or the
/// README) or with a stray `:` after the port is told "an IPv6 address goes in brackets", and
/// an IPv4 address in brackets, or an IPv6 one with its zone named (`%lo`, as `ip` shows it),
/// is told it is "not an IP address ... not a name": none of which is what is wrong.
#[tokio::test]
async fn a_listen_address_that_is_not_ipv6_is_not_told_about_ipv6_brackets_nor_called_a_name() {
    let mut misled = Vec::new();
    for (listen, must_not_say) in [
        ("http://127.0.0.1:0", "IPv6"),
        ("127.0.0.1:0:", "IPv6"),
        ("[127.0.0.1]:0", "not a name"),
        ("[::1%lo]:0", "not a name"),
    ] {
        let stderr = serve_with_listen(listen)
            .await
            .expect_err("not a listen address");
        if stderr.contains(must_not_say) {
            misled.push(format!(
                "--listen {listen}: {}",
                stderr.lines().next().unwrap_or("")
            ));
        }
    }
    assert!(misled.is_empty(), "{misled:#?}");
}

/// `[::ffff:127.0.0.1]:P` and `127.0.0.1:P` are one address (a mapped listener takes the IPv4
/// connections to 127.0.0.1), now that a mapped loopback address may be given without
/// --insecure: the check for listeners that share an address lets the pair through, and the
/// second bind fails with "Address already in use", which points at another process.
#[tokio::test]
async fn a_mapped_listener_and_its_ipv4_address_are_said_to_share_an_address() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    let mapped = format!("[::ffff:127.0.0.1]:{port}");
    let plain = format!("127.0.0.1:{port}");
    let stderr = serve_with_listeners(&[
        "--listen",
        &mapped,
        "--admin-listen",
        &plain,
        "--http-listen",
        "127.0.0.1:0",
    ])
    .await
    .expect_err("two listeners on one address");
    assert!(
        stderr.contains("would share an address"),
        "said as a port in use by another process: {stderr}"
    );
}

/// `http://[]:PORT` names no host either (empty brackets): the agent library takes it and
/// looks up the name `[]` for ever, and `history --server`/`request --server` try that lookup
/// and say "dns error ... Name or service not known" instead of "names no host".
#[tokio::test]
async fn a_url_whose_host_is_empty_brackets_is_refused_as_naming_no_host() {
    let agent = Agent::builder()
        .url("http://[]:7470")
        .service("checkout")
        .connect();
    if let Ok(agent) = agent {
        agent.shutdown().await;
        panic!("the agent took http://[]:7470, a URL with no host");
    }
    let out = cli(|c| c.args(["history", "--server", "http://[]:7471"])).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no host"), "{stderr}");
}

/// The new check that `request`'s upstream names a scheme looks for `scheme://` in the text as
/// given, before the URL parser: a URL that has a scheme is told it "names no scheme" when it
/// starts with white space (` http://…`, taken before, as the parser drops it, and as `--server`
/// drops it), has one slash (`http:/host`, taken before as `http://host`), or is not a
/// `scheme://` URL (`mailto:`, told before that only http:// and https:// are supported).
#[tokio::test]
async fn an_upstream_url_with_a_scheme_is_not_said_to_name_none() {
    let mut misled = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    for url in [
        format!(" http://127.0.0.1:{closed}/x"),
        format!("http:/127.0.0.1:{closed}/x"),
        "mailto:ops@example.com".to_owned(),
    ] {
        let out = cli(|c| {
            c.current_dir(dir.path())
                .args(["request", "--policy", "p.yaml", "--endpoint", "payments"])
                .args(["--output", "json", &url])
        })
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("names no scheme") {
            misled.push(format!("{url:?}: exit {:?}, {stderr}", out.status.code()));
        }
    }
    assert!(misled.is_empty(), "{misled:#?}");
}
