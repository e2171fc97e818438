//! A generated tonic client called through an endpoint handle: retryplane's own admin client
//! (`AdminServiceClient`) asks a control plane started in this process for its current version,
//! under the retry policy of the endpoint `control-plane`.
//!
//! ```sh
//! cargo run -p retryplane-agent --example tonic_client
//! ```
//!
//! The pattern: clone the generated client inside the attempt closure (tonic clients are cheap
//! handles on one channel), describe the call with [`CallMeta::grpc`] and let
//! [`Endpoint::call`] classify each `tonic::Status` (code and `grpc-retry-pushback-ms`).
//! Each attempt is bounded by the policy's `per_try_timeout`, not by the channel's
//! `Endpoint::timeout`: tonic's own timeout comes back as `CANCELLED`, which `Endpoint::call`
//! judges by its code and does not retry (see its docs).

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use retryplane_agent::{Agent, CallError, CallMeta, Endpoint};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tonic::transport::Channel;

/// The policy of the example: `Get` is a read, so it is declared idempotent below.
pub const POLICY: &str = "\
version: 1
endpoints:
  control-plane:
    max_attempts: 3
    per_try_timeout: 1s
";

/// The error of a failed `Get` call: the cause, and the last status or response. A handler
/// that answers gRPC itself can hand it on with `?`: it converts into a `tonic::Status` with the
/// upstream's code (or one that says how the call ended) and, for a call that gave up,
/// `grpc-retry-pushback-ms: -1`, so that its caller does not retry what was retried already
/// (see [`current_version_or_status`]).
pub type GetError = CallError<tonic::Response<pb::GetResponse>, tonic::Status>;

/// Asks the control plane for its current version through `handle`: retried on `UNAVAILABLE`
/// and the other codes of the policy's `retry_on`.
pub async fn current_version(
    handle: &Endpoint,
    client: &AdminServiceClient<Channel>,
) -> Result<u64, GetError> {
    let meta = CallMeta::grpc("/retryplane.v1.AdminService/Get").idempotent(true);
    let response = handle
        .call(meta, |_attempt| {
            let mut client = client.clone();
            async move { client.get(pb::GetRequest { version: 0 }).await }
        })
        .await?;
    Ok(response.into_inner().info.map_or(0, |info| info.version))
}

/// [`current_version`] for a gRPC handler of your own: a failed call becomes the
/// `tonic::Status` it answers with.
pub async fn current_version_or_status(
    handle: &Endpoint,
    client: &AdminServiceClient<Channel>,
) -> Result<u64, tonic::Status> {
    Ok(current_version(handle, client).await?)
}

/// Starts a control plane on `127.0.0.1:0` in file mode on `POLICY`, in `dir`.
pub async fn start_control_plane(dir: &std::path::Path) -> retryplane_server::server::Running {
    use retryplane_server::server::{ServeConfig, start};
    let any = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 0));
    std::fs::write(dir.join("policies.yaml"), POLICY).unwrap();
    start(ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        ..ServeConfig::default()
    })
    .await
    .unwrap()
}

/// The generated client on a channel to the control plane's admin listener.
pub async fn connect(running: &retryplane_server::server::Running) -> AdminServiceClient<Channel> {
    let channel = Channel::from_shared(format!("http://{}", running.admin_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    AdminServiceClient::new(channel)
}

#[tokio::main]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let running = start_control_plane(dir.path()).await;
    let client = connect(&running).await;

    let policies = retryplane_agent::policy::load(POLICY.as_bytes())
        .policies
        .unwrap();
    let agent = Agent::from_policies(policies);
    let handle = agent.endpoint("control-plane");
    match current_version(&handle, &client).await {
        Ok(version) => println!("current version: {version}"),
        Err(e) => println!("{e} (last status: {:?})", e.error().map(|s| s.code())),
    }
    running.shutdown().await.unwrap();
}
