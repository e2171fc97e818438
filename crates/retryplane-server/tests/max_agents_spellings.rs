//! A tokens file's `max_agents` spellings that the control plane read as a number before
//! a57bab8 (which reads the field with `deserialize_any` and parses a string itself with
//! `str::parse`): each should still load, with the same limit, or an upgrade refuses a tokens
//! file that was in force (the server will not start, or a reload is refused).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use retryplane_server::auth::Tokens;

#[test]
fn a_max_agents_in_a_quoted_or_uppercase_radix_spelling_that_loaded_before_still_loads() {
    let mut refused = Vec::new();
    for written in [
        "\"0x10\"",
        "\"1_000\"",
        "\"0o10\"",
        "\" 3\"",
        "0X10",
        "0O10",
        "0B11",
    ] {
        let text = format!(
            "tokens: [{{name: a, role: agent, secret: agent-secret-0123456789, max_agents: {written}}}]"
        );
        if let Err(e) = Tokens::parse(&text, Path::new("t.yaml")) {
            refused.push(format!("{written}: {e}"));
        }
    }
    assert!(refused.is_empty(), "refused:\n{}", refused.join("\n"));
}
