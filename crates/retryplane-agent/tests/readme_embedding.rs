//! README.md's embedding of the agent, as a stranger writes it from the README and the
//! `Agent::builder` docs: `Agent::builder()` with URL, service, token and cache file, against
//! a control plane with a tokens file serving the repository's own `config/policies.yaml`;
//! `agent.endpoint("payments").call(meta, |attempt| ...)`; `CallMeta::deadline_within`; a
//! tower `RetryLayer` with both opt-ins (`with_auth_refresh`, `with_dedup`); and
//! `AgentBuilder::ephemeral`. The test compiles each shape and checks the policy in force is
//! the example file's (real time, bounded polls).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use http::request::Parts;
use retryplane_agent::layer::{BoxError, Dedup, RefreshCredentials, RetryLayer};
use retryplane_agent::{Agent, CallMeta, Source};
use retryplane_server::server::{ServeConfig, start};

/// The example policies the README's set-up serves.
const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

const AGENT_SECRET: &str = "readme-agent-secret-0123";

struct Refresh;

impl RefreshCredentials for Refresh {
    async fn refresh(&self, parts: &mut Parts) -> Result<(), BoxError> {
        parts.headers.insert(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_static("Bearer new"),
        );
        Ok(())
    }
}

/// The README's layer line compiles on an `http::Request` client.
fn layered<S>(agent: &Agent, client: S) -> impl Sized {
    use tower::Layer as _;
    RetryLayer::new(agent.endpoint("payments"))
        .with_auth_refresh(Refresh)
        .with_dedup(Dedup::default())
        .layer(client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_embedding_runs_the_example_policies_from_a_control_plane_with_tokens() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), EXAMPLE).unwrap();
    std::fs::write(
        dir.path().join("tokens.yaml"),
        format!(
            "tokens:\n  - {{name: checkout, role: agent, secret: \"{AGENT_SECRET}\", agent_ids: [\"checkout-*\"]}}\n"
        ),
    )
    .unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let running = start(ServeConfig {
        config_file: dir.path().join("policies.yaml"),
        data_dir: dir.path().join("data"),
        tokens_file: Some(dir.path().join("tokens.yaml")),
        listen: any,
        admin_listen: any,
        http_listen: any,
        ..ServeConfig::default()
    })
    .await
    .unwrap();

    // As in `Agent::builder`'s docs, with the cache file in the test's directory.
    let agent = Agent::builder()
        .url(format!("http://{}", running.agent_addr))
        .service("checkout")
        .agent_id("checkout-1")
        .token(AGENT_SECRET)
        .cache_file(dir.path().join("retryplane-policies.bin"))
        .connect()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while agent.policies().source() != Source::ControlPlane {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the agent never took the control plane's policies: {:?}",
            agent.stream_error()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The example's POST /v1/charges route: two attempts, and a 503 retried with the key.
    let sent = Arc::new(AtomicU32::new(0));
    let meta = CallMeta::http("POST", "/v1/charges")
        .idempotent(true)
        .deadline_within(Duration::from_secs(5));
    let counter = sent.clone();
    let answer = agent
        .endpoint("payments")
        .call(meta, move |_attempt| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                let mut r = http::Response::new(());
                *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                Ok::<_, std::io::Error>(r)
            }
        })
        .await;
    assert!(answer.is_err(), "every attempt answered 503");
    assert_eq!(
        sent.load(Ordering::SeqCst),
        2,
        "the route's max_attempts: 2"
    );

    let _ = layered(
        &agent,
        tower::service_fn(|_r: http::Request<String>| async {
            Ok::<_, std::io::Error>(http::Response::new(String::new()))
        }),
    );
    let _ephemeral = Agent::builder().ephemeral(true);

    agent.shutdown().await;
    running.shutdown().await.unwrap();
}
