//! What the control plane's integration tests share: a policy file in a temporary directory
//! with the server's listeners on 127.0.0.1:0, and a channel to one of them.

#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use retryplane_server::server::ServeConfig;
use tonic::transport::Channel;

/// A policy file with one endpoint.
pub const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";

/// A configuration for `dir`'s `policies.yaml` and `data/`, every listener on 127.0.0.1:0.
pub fn config(dir: &Path) -> ServeConfig {
    let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        ..ServeConfig::default()
    }
}

/// A temporary directory whose `policies.yaml` holds `contents`, and its [`config`].
pub fn with_file(contents: &str) -> (tempfile::TempDir, ServeConfig) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), contents).unwrap();
    let cfg = config(dir.path());
    (dir, cfg)
}

/// A channel to `addr`, connected.
pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}
