//! End-to-end: an agent's token file through a rotation of its secret, against the real control
//! plane, with the agent's log read. One test alone in its binary: tracing caches whether a
//! log line's callsite is wanted for the whole process, so a test that logs the same lines on
//! another thread with no subscriber can hide them from this one's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Duration;

use retryplane_e2e::*;

/// This thread's `retryplane_agent` log lines at info and above (the test's runtime is a
/// current-thread one, so the agent's stream task logs on this thread).
#[derive(Clone, Default)]
struct AgentLogs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for AgentLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AgentLogs {
    fn capture() -> (AgentLogs, tracing::subscriber::DefaultGuard) {
        let logs = AgentLogs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("retryplane_agent=info")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// A rotation done in the order README gives (the new secret added beside the old one, the
/// agent's file rewritten, the old secret dropped): the agent's stream ends with
/// UNAUTHENTICATED and it comes back with the new secret, saying so at info, not warning that
/// the control plane refuses it. When the token its file then holds is dropped too, that is
/// warned of, though the refusal's reason is the rotation's.
#[tokio::test(flavor = "current_thread")]
async fn a_rotation_in_order_moves_the_agent_without_a_warning() {
    const ADMIN: &str = "admin-secret-0123456789";
    let (logs, _guard) = AgentLogs::capture();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policy_yaml(1, 3)).unwrap();
    let tokens = dir.path().join("tokens.yaml");
    let write_tokens = |agents: &[(&str, &str)]| {
        let mut text = String::from("tokens:\n");
        for (name, secret) in agents {
            text.push_str(&format!(
                "  - {{name: {name}, role: agent, secret: {secret}}}\n"
            ));
        }
        text.push_str(&format!(
            "  - {{name: ops, role: admin, secret: {ADMIN}}}\n"
        ));
        std::fs::write(&tokens, text).unwrap();
    };
    write_tokens(&[("fleet-2025", "old-agent-secret-0123")]);
    let token_file = dir.path().join("agent-token");
    std::fs::write(&token_file, "old-agent-secret-0123\n").unwrap();
    let plane = Plane::start_in(dir, false, Some(tokens.clone())).await;
    let agent = token_file_agent(
        &plane,
        "rotated-2",
        &token_file,
        Duration::from_millis(10),
        2,
    )
    .await;

    // The new secret beside the old one; the file rewritten whole (a rename).
    write_tokens(&[
        ("fleet-2025", "old-agent-secret-0123"),
        ("fleet-2026", "new-agent-secret-0123"),
    ]);
    assert_eq!(plane.running.reload_tokens().unwrap(), Some(3));
    let staged = token_file.with_extension("new");
    std::fs::write(&staged, "new-agent-secret-0123\n").unwrap();
    std::fs::rename(&staged, &token_file).unwrap();
    // The old secret dropped: the open stream ends, and the agent comes back with the new one.
    write_tokens(&[("fleet-2026", "new-agent-secret-0123")]);
    assert_eq!(plane.running.reload_tokens().unwrap(), Some(2));
    eventually("the agent is back with the new secret", || async {
        status_with(&plane, ADMIN, "rotated-2")
            .await
            .is_some_and(|s| s.connected && s.token == "fleet-2026")
    })
    .await;
    let text = logs.text();
    assert!(
        text.contains("the token file holds another by now"),
        "the rotation is said: {text}"
    );
    assert!(!text.contains("WARN"), "nothing warned: {text}");

    // The new secret dropped in turn while the file still holds it: no rotation, and the
    // refusal is warned of, though its reason is the one the rotation ended with.
    write_tokens(&[("fleet-2027", "other-agent-secret-0123")]);
    assert_eq!(plane.running.reload_tokens().unwrap(), Some(2));
    eventually("the refusal of the file's token is warned of", || async {
        logs.text().contains("the control plane refuses this agent")
    })
    .await;
    // At the stream's end, not only at the next stream's refusal (`unknown token`).
    let text = logs.text();
    let warned = text
        .lines()
        .find(|l| l.contains("the control plane refuses this agent"))
        .unwrap();
    assert!(warned.contains("no longer an agent token"), "{text}");

    agent.shutdown().await;
    assert!(
        !logs.text().contains("secret-01"),
        "no secret is logged: {}",
        logs.text()
    );
}
