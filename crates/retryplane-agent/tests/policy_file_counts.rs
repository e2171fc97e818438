//! `Agent::from_file` on a file with more problems than a check lists (`diag::MAX_LISTED`,
//! 1,000): the error's count stands for every error, as `retryplane validate` counts them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use retryplane_agent::{Agent, AgentError};

#[test]
fn an_invalid_policy_files_error_counts_every_error_past_the_listing_limit() {
    // 1,200 endpoints with `max_attempts: 0`: the list is cut at 1,000 and closed by
    // "200 more error(s) not listed", which `errors` counted as one error (1,001).
    let dir = std::env::temp_dir().join(format!(
        "retryplane-policy-file-counts-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policies.yaml");
    let mut yaml = String::from("version: 1\nendpoints:\n");
    for i in 0..1_200 {
        yaml.push_str(&format!("  e{i}: {{max_attempts: 0}}\n"));
    }
    std::fs::write(&path, yaml).unwrap();
    let result = Agent::from_file(&path);
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Err(AgentError::InvalidPolicyFile { errors, first, .. }) => {
            assert_eq!(errors, 1_200, "first: {first}");
            assert!(first.contains("max_attempts"), "{first}");
        }
        Err(other) => panic!("expected InvalidPolicyFile, got {other:?}"),
        Ok(_) => panic!("expected InvalidPolicyFile, got an agent"),
    }
}
