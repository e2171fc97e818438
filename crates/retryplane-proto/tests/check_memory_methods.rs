//! What checking a typed document whose `idempotent_methods` is long costs in memory: the
//! control plane checks every typed `Validate` (a viewer may send one) and `Apply` with
//! [`convert::validate`]. Alone in its binary: it reads the process's peak resident size.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use retryplane_proto::{convert, pb};

#[path = "support/peak_rss.rs"]
mod peak_rss;
use peak_rss::peak_rss;

fn methods(methods: Vec<String>) -> pb::PolicyDocument {
    pb::PolicyDocument {
        defaults: None,
        endpoints: vec![pb::Endpoint {
            name: "payments".to_owned(),
            overlay: Some(pb::Overlay {
                idempotent_methods: Some(pb::MethodList { methods }),
                ..Default::default()
            }),
            routes: vec![],
        }],
    }
}

/// 600,000 × `POST` (3.6 MB: it fits a request): the list is refused as longer than 64, once,
/// but each `POST` is still warned of ("not idempotent by definition"), each warning with its
/// own path and message, a few hundred bytes apiece, all built before the check drops the
/// warnings of a refused document and cuts the rest to 1,000. The repeats of a status or a
/// code are warned of once since 44fc776; the repeats of `POST` are not.
#[test]
#[cfg(target_os = "linux")]
fn checking_a_typed_document_repeating_post_costs_memory_in_proportion_to_it() {
    let doc = methods(vec!["POST".to_owned(); 600_000]);
    let bytes = prost::Message::encoded_len(&doc) as u64;
    assert!(bytes < retryplane_proto::MAX_MESSAGE_BYTES as u64);
    let before = peak_rss();
    let errors = convert::validate(doc).err().unwrap();
    let grown = peak_rss().saturating_sub(before);
    assert!(errors.len() <= retryplane_policy::diag::MAX_LISTED + 1);
    assert!(
        grown <= 32 * bytes,
        "checking a document of {bytes} bytes grew the peak by {} MB",
        grown >> 20
    );
}
