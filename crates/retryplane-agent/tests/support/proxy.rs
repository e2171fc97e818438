//! A loopback TCP proxy between agents and the control plane that a test can hold (stop
//! forwarding one direction) and cut (close every connection, dropping what was held): a stream
//! lost with messages in flight, on demand.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The proxy; it stops when dropped.
pub struct Proxy {
    /// Where agents connect.
    pub addr: SocketAddr,
    up: watch::Sender<bool>,
    down: watch::Sender<bool>,
    cuts: watch::Sender<u64>,
    task: JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// A proxy on `127.0.0.1:0` to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (up, _) = watch::channel(false);
        let (down, _) = watch::channel(false);
        let (cuts, _) = watch::channel(0);
        let (hold_up, hold_down, cut) = (up.clone(), down.clone(), cuts.clone());
        let task = tokio::spawn(async move {
            while let Ok((agent, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = agent.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (agent_r, agent_w) = agent.into_split();
                let (server_r, server_w) = server.into_split();
                tokio::spawn(pump(
                    agent_r,
                    server_w,
                    hold_up.subscribe(),
                    cut.subscribe(),
                ));
                tokio::spawn(pump(
                    server_r,
                    agent_w,
                    hold_down.subscribe(),
                    cut.subscribe(),
                ));
            }
        });
        Proxy {
            addr,
            up,
            down,
            cuts,
            task,
        }
    }

    /// Holds (or forwards again) what agents send: it waits in the proxy until released, or is
    /// lost in a [`Proxy::cut`].
    pub fn hold_up(&self, on: bool) {
        self.up.send_replace(on);
    }

    /// Holds (or forwards again) what the control plane sends.
    pub fn hold_down(&self, on: bool) {
        self.down.send_replace(on);
    }

    /// Closes every open connection, dropping whatever is held, then stops holding; new
    /// connections are forwarded.
    pub fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
        self.hold_up(false);
        self.hold_down(false);
    }
}

/// Forwards `from` to `to` until either side ends or the proxy is cut; while `hold` is on,
/// bytes read wait (a cut drops them).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut hold: watch::Receiver<bool>,
    mut cut: watch::Receiver<u64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            biased;
            _ = cut.changed() => return,
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
        };
        tokio::select! {
            biased;
            _ = cut.changed() => return,
            held = hold.wait_for(|on| !*on) => if held.is_err() { return },
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
