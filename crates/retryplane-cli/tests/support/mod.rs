//! What the CLI's end-to-end tests share: a real control plane on `127.0.0.1:0` in this
//! process, the `retryplane` binary pointed at it, and output helpers. Each test file uses part
//! of it.
#![allow(dead_code, reason = "each test file uses part of the shared set-up")]

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use assert_cmd::Command;
use assert_cmd::assert::Assert;
use retryplane_server::server::{Running, ServeConfig, start};
use serde_json::Value;
use tempfile::TempDir;
use tokio::runtime::Runtime;

/// The longest one run of the binary may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(20);

/// A control plane running on a runtime of its own while the test thread runs the binary.
pub struct TestServer {
    /// Runs the server (and whatever a test runs next to it).
    pub runtime: Runtime,
    running: Option<Running>,
    /// The temporary directory: the policy file, the tokens, the data, the binary's cwd.
    pub dir: TempDir,
    /// The admin API's URL.
    pub url: String,
}

impl TestServer {
    /// Starts a server with `policies.yaml` holding `policy_file` (when given) and `tokens`
    /// turning authentication on, after `configure` has adjusted the config.
    pub fn start(
        policy_file: Option<&str>,
        tokens: Option<&str>,
        configure: impl FnOnce(&mut ServeConfig),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        if let Some(policy) = policy_file {
            fs::write(dir.path().join("policies.yaml"), policy).unwrap();
        }
        let tokens_file = tokens.map(|t| {
            let path = dir.path().join("tokens.yaml");
            fs::write(&path, t).unwrap();
            path
        });
        let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let mut cfg = ServeConfig {
            config_file: dir.path().join("policies.yaml"),
            data_dir: dir.path().join("data"),
            listen: any,
            admin_listen: any,
            http_listen: any,
            tokens_file,
            ..ServeConfig::default()
        };
        configure(&mut cfg);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let running = runtime.block_on(start(cfg)).unwrap();
        let url = format!("http://{}", running.admin_addr());
        Self {
            runtime,
            running: Some(running),
            dir,
            url,
        }
    }

    /// The running server.
    pub fn running(&self) -> &Running {
        self.running.as_ref().unwrap()
    }

    /// Shuts the server down now, rather than when the test ends.
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            self.runtime.block_on(running.shutdown()).unwrap();
        }
    }

    /// `retryplane ARGS... --server URL`, run in the temporary directory, with no token or
    /// server from the environment of the test, and failing after [`WAIT`].
    pub fn retryplane(&self, args: &[&str]) -> Command {
        let mut cmd = self.retryplane_here(args);
        cmd.args(["--server", &self.url]);
        cmd
    }

    /// [`cli`] run in the temporary directory: no `--server` of this server's.
    pub fn retryplane_here(&self, args: &[&str]) -> Command {
        let mut cmd = cli(args);
        cmd.current_dir(self.dir.path());
        cmd
    }

    /// `retryplane ARGS... --output json` against this server, which must exit 0: its output.
    pub fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend(["--output", "json"]);
        json_of(&self.retryplane(&all).assert().code(0))
    }

    /// `retryplane history --output json` against this server, which must exit 0.
    pub fn history(&self) -> Value {
        self.json(&["history"])
    }

    /// [`TestServer::retryplane`] with its stdout and stderr written to one file, as at a
    /// terminal, so that their order shows: its exit code and what the file holds.
    pub fn retryplane_one_stream(&self, args: &[&str]) -> (Option<i32>, String) {
        let path = self.dir.path().join("one-stream.out");
        let file = fs::File::create(&path).unwrap();
        let mut cmd = cli_process(args);
        cmd.args(["--server", &self.url])
            .current_dir(self.dir.path())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        let status = self.runtime.block_on(async {
            let mut child = tokio::process::Command::from(cmd)
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            // An `Elapsed` here: the command did not end within WAIT.
            tokio::time::timeout(WAIT, child.wait())
                .await
                .unwrap()
                .unwrap()
        });
        (status.code(), fs::read_to_string(&path).unwrap())
    }

    /// Writes `contents` to `name` in the temporary directory.
    pub fn write(&self, name: &str, contents: &str) {
        fs::write(self.dir.path().join(name), contents).unwrap();
    }
}

/// `retryplane ARGS...` with none of the variables it reads taken from the environment of the
/// test (tokens, server, `RUST_LOG`), failing after [`WAIT`].
pub fn cli(args: &[&str]) -> Command {
    let mut cmd = Command::from_std(cli_process(args));
    cmd.timeout(WAIT);
    cmd
}

/// [`cli`] as a process to spawn, for a test that acts while it runs (its output piped).
pub fn cli_process(args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin!("retryplane"));
    for var in [
        "RETRYPLANE_TOKEN",
        "RETRYPLANE_SERVER",
        "RETRYPLANE_AGENT_TOKEN",
        "RUST_LOG",
    ] {
        cmd.env_remove(var);
    }
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            let _ = self.runtime.block_on(running.shutdown());
        }
    }
}

/// What the binary printed on stdout.
pub fn stdout_of(assert: &Assert) -> String {
    String::from_utf8(assert.get_output().stdout.clone()).unwrap()
}

/// The binary's stdout as JSON.
pub fn json_of(assert: &Assert) -> Value {
    serde_json::from_slice(&assert.get_output().stdout).unwrap()
}

/// A loopback URL where every connection is refused, for as long as this is kept: its port is
/// bound but never listens. (A port freed after a bind could be taken by another test's
/// listener, or be the one the kernel picks as the client's own port, which connects to itself.)
pub struct DeadServer {
    url: String,
    _bound: tokio::net::TcpSocket,
}

impl std::ops::Deref for DeadServer {
    type Target = str;

    fn deref(&self) -> &str {
        &self.url
    }
}

impl AsRef<std::ffi::OsStr> for DeadServer {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.url.as_ref()
    }
}

impl std::fmt::Display for DeadServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

/// A [`DeadServer`] on a port of its own.
pub fn dead_server() -> DeadServer {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .unwrap();
    let port = socket.local_addr().unwrap().port();
    DeadServer {
        url: format!("http://127.0.0.1:{port}"),
        _bound: socket,
    }
}

/// A valid policy file under the 1 MiB limit whose snapshot is over the 4 MiB agents decode:
/// one 900 KB path prefix, repeated by aliases in six routes.
pub fn too_large_for_agents() -> String {
    let prefix = format!("/{}", "a".repeat(900_000));
    let mut yaml = format!(
        "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {{method: GET, path_prefix: &p {prefix}}}\n"
    );
    for method in ["PUT", "POST", "DELETE", "PATCH", "HEAD"] {
        yaml.push_str(&format!(
            "      - match: {{method: {method}, path_prefix: *p}}\n"
        ));
    }
    yaml
}
