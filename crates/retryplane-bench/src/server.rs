//! The real `retryplane serve` as a child process: API mode, a temp data dir, a seed policy,
//! every listener on `127.0.0.1:0`; its bound addresses read from stdout, its memory from
//! `/proc/<pid>/status`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

use crate::WAIT;

/// A running server process. Killed (by its handle) by [`ServerProcess::stop`], or when
/// dropped.
pub struct ServerProcess {
    child: Child,
    pid: u32,
    /// The agent gRPC listener.
    pub agent_addr: SocketAddr,
    /// The admin gRPC listener.
    pub admin_addr: SocketAddr,
    /// The HTTP listener (`/readyz`, `/metrics`).
    pub http_addr: SocketAddr,
    /// Kept open so the server never writes to a closed pipe.
    _stdout: Lines<BufReader<ChildStdout>>,
    stderr_file: PathBuf,
    /// Holds the policy file, the data dir and the server's log; removed on drop.
    _dir: tempfile::TempDir,
}

/// The server binary a bench starts: `explicit` (given as `flag`), else `name` beside this
/// executable. Made absolute against the current directory, since the server runs in a
/// temporary directory of its own; an error names `flag` when there is no file there.
pub fn server_binary(explicit: Option<PathBuf>, name: &str, flag: &str) -> anyhow::Result<PathBuf> {
    let path = match explicit {
        Some(path) => path,
        None => std::env::current_exe()
            .context("cannot find this executable's path")?
            .with_file_name(name),
    };
    let path = std::path::absolute(&path)
        .with_context(|| format!("cannot resolve the path {}", path.display()))?;
    anyhow::ensure!(
        path.is_file(),
        "no server binary at {}: build it with `cargo build --release -p retryplane-cli -p \
         retryplane-bench`, or pass {flag}",
        path.display()
    );
    Ok(path)
}

impl ServerProcess {
    /// Starts `bin serve --api` seeded with `seed_yaml` and waits until it is ready. A relative
    /// `bin` is read against the current directory, not the server's own.
    pub async fn start(bin: &Path, seed_yaml: &str) -> anyhow::Result<Self> {
        Self::start_with_tokens(bin, seed_yaml, None).await
    }

    /// [`ServerProcess::start`], with the tokens file `tokens_yaml` (`--tokens`) when given.
    pub async fn start_with_tokens(
        bin: &Path,
        seed_yaml: &str,
        tokens_yaml: Option<&str>,
    ) -> anyhow::Result<Self> {
        Self::start_with(bin, seed_yaml, tokens_yaml, &[]).await
    }

    /// [`ServerProcess::start_with_tokens`], with `extra` arguments to `serve` after the
    /// bench's own.
    pub async fn start_with(
        bin: &Path,
        seed_yaml: &str,
        tokens_yaml: Option<&str>,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        // The child runs in `dir`: a relative path would be looked up there.
        let bin = std::path::absolute(bin)
            .with_context(|| format!("cannot resolve the path {}", bin.display()))?;
        let dir = tempfile::tempdir().context("cannot create a temp dir for the server")?;
        std::fs::write(dir.path().join("policies.yaml"), seed_yaml)
            .context("cannot write the seed policy file")?;
        let mut tokens_args = Vec::new();
        if let Some(tokens) = tokens_yaml {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dir.path().join("tokens.yaml"))
                .context("cannot create the tokens file")?;
            file.write_all(tokens.as_bytes())
                .context("cannot write the tokens file")?;
            tokens_args = vec!["--tokens", "tokens.yaml"];
        }
        let stderr_file = dir.path().join("server.log");
        let stderr = std::fs::File::create(&stderr_file).context("cannot create the server log")?;
        let mut child = Command::new(&bin)
            .current_dir(dir.path())
            .args([
                "serve",
                "--api",
                "--config",
                "policies.yaml",
                "--data-dir",
                "data",
            ])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--http-listen", "127.0.0.1:0"])
            .args(&tokens_args)
            .args(extra)
            // Per-agent connect lines at `info` would cost the server time during the set-up.
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| {
                format!(
                    "cannot start the server {} (build it with `cargo build --release -p \
                     retryplane-cli -p retryplane-bench`, or pass its path: --server-bin, or \
                     --baseline-bin for the plain server)",
                    bin.display()
                )
            })?;
        let pid = child.id().context("the server exited at once")?;
        let stdout = child
            .stdout
            .take()
            .context("no stdout pipe to the server")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut addrs = Vec::with_capacity(3);
        while addrs.len() < 3 {
            let line = tokio::time::timeout(WAIT, lines.next_line())
                .await
                .with_context(|| {
                    format!(
                        "the server printed no addresses within {WAIT:?}; its log:\n{}",
                        tail(&stderr_file)
                    )
                })?
                .context("cannot read the server's stdout")?;
            let Some(line) = line else {
                bail!(
                    "the server exited before printing its addresses; its log:\n{}",
                    tail(&stderr_file)
                );
            };
            let (name, addr) = line
                .split_once(": ")
                .with_context(|| format!("unexpected server output {line:?}"))?;
            let addr: SocketAddr = addr
                .parse()
                .with_context(|| format!("unexpected address in server output {line:?}"))?;
            addrs.push((name.to_owned(), addr));
        }
        let find = |want: &str| {
            addrs
                .iter()
                .find(|(name, _)| name == want)
                .map(|(_, addr)| *addr)
                .with_context(|| format!("the server printed no {want} address"))
        };
        let server = Self {
            agent_addr: find("agent")?,
            admin_addr: find("admin")?,
            http_addr: find("http")?,
            child,
            pid,
            _stdout: lines,
            stderr_file,
            _dir: dir,
        };
        server.wait_ready().await?;
        Ok(server)
    }

    /// Waits for `/readyz` to answer 200 (a snapshot is loaded).
    async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Ok(response) = self.http_get("/readyz").await
                && response.starts_with("HTTP/1.1 200")
            {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "the server was not ready within {WAIT:?}; its log:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `GET path` on the HTTP listener; the whole response, headers included.
    pub async fn http_get(&self, path: &str) -> anyhow::Result<String> {
        tokio::time::timeout(WAIT, async {
            let mut socket = tokio::net::TcpStream::connect(self.http_addr).await?;
            let request =
                format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n");
            socket.write_all(request.as_bytes()).await?;
            let mut response = String::new();
            socket.read_to_string(&mut response).await?;
            Ok::<_, std::io::Error>(response)
        })
        .await
        .with_context(|| format!("GET {path}: no answer within {WAIT:?}"))?
        .with_context(|| format!("GET {path} failed"))
    }

    /// The value of the Prometheus sample `name` (no labels) on `/metrics`.
    pub async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let response = self.http_get("/metrics").await?;
        response
            .lines()
            .find_map(|line| {
                let (key, value) = line.split_once(' ')?;
                (key == name).then(|| value.trim().parse::<f64>().ok())?
            })
            .with_context(|| format!("no sample {name} on /metrics"))
    }

    /// The server's resident set size in KiB (`VmRSS`), Linux only.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        self.status_kib("VmRSS")
    }

    /// The server's largest resident set size so far in KiB (`VmHWM`), Linux only.
    pub fn peak_rss_kib(&self) -> anyhow::Result<u64> {
        self.status_kib("VmHWM")
    }

    /// The `field` of `/proc/<pid>/status`, in KiB.
    fn status_kib(&self, field: &str) -> anyhow::Result<u64> {
        let path = format!("/proc/{}/status", self.pid);
        let status = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {path} (server memory is measured on Linux)"))?;
        status
            .lines()
            .find_map(|line| {
                let rest = line.strip_prefix(field)?.strip_prefix(':')?;
                rest.trim().strip_suffix("kB")?.trim().parse().ok()
            })
            .with_context(|| format!("no {field} line in {path}"))
    }

    /// CPU time the server has used so far (user + system, every thread), in milliseconds.
    pub fn cpu_ms(&self) -> anyhow::Result<f64> {
        cpu_ms(&format!("/proc/{}/stat", self.pid))
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        tail(&self.stderr_file)
    }

    /// Kills the server (this process's own child, by its handle) and reaps it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!(
                "the server had already exited ({status}); its log:\n{}",
                self.log_tail()
            );
        }
        self.child.start_kill().context("cannot kill the server")?;
        tokio::time::timeout(WAIT, self.child.wait())
            .await
            .with_context(|| format!("the server did not exit within {WAIT:?} of SIGKILL"))?
            .context("cannot reap the server")?;
        Ok(())
    }
}

/// Clock ticks per second of `/proc/*/stat` times (`USER_HZ`, 100 on every Linux ABI).
const USER_HZ: f64 = 100.0;

/// User + system CPU time of the process whose `stat` file is `path`, in milliseconds
/// (10 ms resolution).
pub fn cpu_ms(path: &str) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    // The command name, in parentheses, may hold spaces; the fields after it do not.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // `utime` and `stime` are fields 14 and 15; the first field after ')' is field 3.
    let ticks = |i: usize| -> anyhow::Result<f64> {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("unexpected format of {path}"))
    };
    Ok((ticks(11)? + ticks(12)?) * 1000.0 / USER_HZ)
}

/// The last 20 lines of the file at `path`, or why it cannot be read.
fn tail(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(20);
            lines[start..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}
