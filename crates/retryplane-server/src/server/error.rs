//! Why the server could not start or stopped.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::auth::TokensError;
use crate::control::ChangeError;
use crate::store::StoreError;
use crate::watch::WatchError;

/// Why `retryplane serve` could not start, or a server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The agent or admin listener (or both) on a non-loopback address without a tokens file
    /// and without `insecure`.
    #[error(
        "refusing to serve without a tokens file: {}. Pass --tokens FILE, listen on a loopback \
         address, or pass --insecure to do it anyway",
        exposures(.listeners)
    )]
    Exposed {
        /// Each listener exposed (`agent` or `admin`) and the address asked for it.
        listeners: Vec<(&'static str, SocketAddr)>,
    },
    /// Two listeners are given addresses that cannot both be bound: the same address, or the
    /// same port where one address is unspecified (`0.0.0.0`, `[::]`), which takes the port on
    /// every address. A port of 0 is excepted: each listener gets its own.
    #[error(
        "the {first} listener ({addr}) and the {second} listener ({other}) would share an \
         address: each listener needs its own port, or its own address (an unspecified address \
         such as 0.0.0.0 takes its port on every address)"
    )]
    SameAddress {
        /// `agent`, `admin` or `http`: the first of the two.
        first: &'static str,
        /// `admin` or `http`: the second of the two.
        second: &'static str,
        /// The first listener's address.
        addr: SocketAddr,
        /// The second listener's address.
        other: SocketAddr,
    },
    /// A setting that must be more than zero (a duration, a count) is zero.
    #[error("{setting} must be more than zero")]
    ZeroSetting {
        /// The [`super::ServeConfig`] field.
        setting: &'static str,
    },
    /// The room for agents' messages under way is smaller than the largest message an agent
    /// stream takes, which could then never come.
    #[error(
        "max_inbound_bytes ({value}) must be at least the largest message an agent stream takes \
         ({largest} bytes)"
    )]
    InboundRoom {
        /// The room given.
        value: usize,
        /// The largest message.
        largest: usize,
    },
    /// The metrics interval is outside what agents take (100 ms to 1 h; see
    /// [`super::MIN_METRICS_INTERVAL`]).
    #[error("metrics_interval must be from 100ms to 1h, not {value:?}")]
    MetricsInterval {
        /// The interval given.
        value: std::time::Duration,
    },
    /// The tokens file cannot be used.
    #[error(transparent)]
    Tokens(#[from] TokensError),
    /// The version store cannot be opened.
    #[error("cannot open the version store in {}", dir.display())]
    Store {
        /// The data directory.
        dir: PathBuf,
        /// What the store said.
        #[source]
        source: StoreError,
    },
    /// The stored current version cannot be read.
    #[error("cannot read the current version from the store")]
    ReadStore(#[source] StoreError),
    /// The policy file cannot be read and there is nothing stored to serve instead.
    #[error("cannot read the policy file {}, and the store holds no version to serve instead", file.display())]
    ReadConfig {
        /// The policy file.
        file: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The policy file has errors and there is nothing stored to serve instead.
    #[error(
        "the policy file {} is invalid, and the store holds no version to serve instead:\n{}",
        file.display(),
        problems.join("\n")
    )]
    InvalidConfig {
        /// The policy file.
        file: PathBuf,
        /// Every diagnostic, as `FILE:LINE:COLUMN: SEVERITY: PATH: MESSAGE`.
        problems: Vec<String>,
    },
    /// The policy file could not be stored.
    #[error("cannot apply the policy file {}", file.display())]
    Apply {
        /// The policy file.
        file: PathBuf,
        /// Why the change was refused.
        #[source]
        source: ChangeError,
    },
    /// The policy file cannot be watched.
    #[error(transparent)]
    Watch(#[from] WatchError),
    /// The reflection service cannot be built from the descriptor sets.
    #[error("cannot build the gRPC reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// A listener cannot be bound.
    #[error("cannot listen on {addr} ({listener})")]
    Bind {
        /// `agent`, `admin` or `http`.
        listener: &'static str,
        /// The address asked for.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A gRPC server failed.
    #[error("the {listener} gRPC server failed")]
    Grpc {
        /// `agent` or `admin`.
        listener: &'static str,
        /// What tonic said.
        #[source]
        source: tonic::transport::Error,
    },
    /// The HTTP server failed.
    #[error("the HTTP server failed")]
    Http(#[source] std::io::Error),
    /// A task panicked or was cancelled.
    #[error("the {task} task failed")]
    Task {
        /// Which task.
        task: &'static str,
        /// How it ended.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// What anyone could do through each of `listeners` served with no tokens file, joined.
fn exposures(listeners: &[(&'static str, SocketAddr)]) -> String {
    listeners
        .iter()
        .map(|&(listener, addr)| {
            let risk = match listener {
                "agent" => {
                    "read the policies, and send made-up metrics and fleet entries that show in \
                     stats, alerts and status"
                }
                _ => "read or change the policies",
            };
            format!("anyone who can reach the {listener} listener on {addr} could {risk}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}
