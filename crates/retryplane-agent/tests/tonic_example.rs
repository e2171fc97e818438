//! The tonic example's code path against a control plane started in this process.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../examples/tonic_client.rs"]
mod example;

use retryplane_agent::Agent;

#[tokio::test]
async fn a_generated_client_called_through_the_handle_gets_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let running = example::start_control_plane(dir.path()).await;
    let client = example::connect(&running).await;
    let policies = retryplane_policy::load(example::POLICY.as_bytes())
        .policies
        .unwrap();
    let agent = Agent::from_policies(policies);
    let handle = agent.endpoint("control-plane");
    let version = example::current_version(&handle, &client).await.unwrap();
    assert!(version >= 1, "{version}");
    assert_eq!(handle.pending_counts().attempts, 1);
    running.shutdown().await.unwrap();
    // With the control plane gone, the failed call is handed on as the channel's own status.
    let status = example::current_version_or_status(&handle, &client)
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    let pushback = status.metadata().get("grpc-retry-pushback-ms");
    assert_eq!(
        pushback.and_then(|v| v.to_str().ok()),
        Some("-1"),
        "do not retry"
    );
    assert_eq!(handle.pending_counts().attempts, 4, "three more attempts");
}
