//! What checking a pushed document costs in memory. An agent checks every snapshot it is
//! sent, and its cache at start, with [`convert::validate`]; so does the control plane for a
//! typed `Apply` or `Validate`. Alone in its binary: it reads the process's peak resident size.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use retryplane_proto::{convert, pb};

#[path = "support/peak_rss.rs"]
mod peak_rss;
use peak_rss::peak_rss;

/// A valid document (the control plane publishes it: it fits the agents' 4 MiB) whose one
/// list repeats `404` 400,000 times, in 800 KB. Each repeat is a warning twice over ("a
/// client error", "listed twice"), every one with its own path and message, about 300 bytes
/// in memory, only for the repeats to be dropped as exact copies at the end (a typed document
/// has no places): the check peaked at about 250 MB, and a 3.8 MB document at 1.2 GB, on the
/// control plane and again on every agent it reaches (and at every agent's start, from its
/// cache). Checking it must cost memory in proportion to the document, not 300 times it. (The
/// control plane now takes at most as many list entries as a policy file can hold,
/// `convert::check_items`; an agent still checks what it is sent, whatever its size.)
#[test]
#[cfg(target_os = "linux")]
fn checking_a_document_that_repeats_one_status_costs_memory_in_proportion_to_it() {
    let doc = pb::PolicyDocument {
        defaults: None,
        endpoints: vec![pb::Endpoint {
            name: "payments".to_owned(),
            overlay: Some(pb::Overlay {
                retry_on: Some(pb::RetryOn {
                    http_status: Some(pb::StatusList {
                        codes: vec![404; 400_000],
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            routes: vec![],
        }],
    };
    let bytes = prost::Message::encoded_len(&doc) as u64;
    assert!(retryplane_proto::check_agent_limit(&doc).is_ok());
    let before = peak_rss();
    let (_set, warnings) = convert::validate(doc).unwrap();
    let grown = peak_rss().saturating_sub(before);
    assert!(
        grown <= 32 * bytes,
        "checking a document of {bytes} bytes ({} warnings kept) grew the peak by {} MB",
        warnings.len(),
        grown >> 20
    );
}
