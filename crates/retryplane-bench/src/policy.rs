//! The policies the bench publishes: `E` endpoints of a realistic size (a few fields, a
//! backoff and one route each), with one defaults field that depends on the round so every
//! publish is new content.

use std::fmt::Write as _;

use anyhow::{Context as _, bail};

/// The policy file of round `round` with `endpoints` endpoints. Round 0 is the seed.
pub fn policy_yaml(endpoints: usize, round: u64) -> String {
    let mut s = String::with_capacity(256 + endpoints * 256);
    // The only field that changes between rounds: a new content hash, one `defaults` diff.
    let deadline_ms = 15_000 + round;
    let _ = write!(
        s,
        "version: 1\n\
         defaults:\n  \
           max_attempts: 3\n  \
           deadline: {deadline_ms}ms\n  \
           per_try_timeout: 2s\n  \
           backoff: {{base: 100ms, max: 5s, multiplier: 2.0, jitter: full}}\n  \
           retry_on:\n    \
             http_status: [408, 425, 429, 500, 502, 503, 504]\n    \
             errors: [connect, reset, timeout]\n\
         endpoints:\n"
    );
    for i in 0..endpoints {
        let _ = write!(
            s,
            "  svc-{i:05}:\n    \
               max_attempts: {attempts}\n    \
               deadline: {deadline}s\n    \
               per_try_timeout: {per_try}ms\n    \
               backoff: {{base: {base}ms, max: 2s, jitter: decorrelated}}\n    \
               routes:\n      \
                 - match: {{method: GET, path_prefix: /v1/svc-{i:05}/items}}\n        \
                   max_attempts: {route_attempts}\n        \
                   retry_on:\n          \
                     http_status: [429, 503]\n",
            attempts = 2 + i % 4,
            deadline = 5 + i % 10,
            per_try = 500 + (i % 5) * 100,
            base = 50 + (i % 4) * 25,
            route_attempts = 2 + i % 2,
        );
    }
    s
}

/// Checks `yaml` with the same loader as `retryplane validate`, so a bad generated file fails
/// here with its diagnostics instead of as a server that will not start.
pub fn check(yaml: &str, endpoints: usize) -> anyhow::Result<()> {
    let loaded = retryplane_policy::load(yaml.as_bytes());
    if loaded.has_errors() {
        let problems: Vec<String> = loaded.diagnostics.iter().map(|d| d.to_string()).collect();
        bail!(
            "the generated policy file is invalid:\n{}",
            problems.join("\n")
        );
    }
    let set = loaded
        .policies
        .context("the generated policy file compiled to nothing")?;
    let got = set.document().endpoints.len();
    if got != endpoints {
        bail!("the generated policy file has {got} endpoints, expected {endpoints}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_policies_are_valid_and_differ_per_round() {
        for endpoints in [1, 10, 1_000] {
            check(&policy_yaml(endpoints, 0), endpoints).unwrap();
            check(&policy_yaml(endpoints, 7), endpoints).unwrap();
        }
        assert_ne!(policy_yaml(10, 1), policy_yaml(10, 2));
    }
}
