//! A wire document with more errors than a check lists (`diag::MAX_LISTED`, 1,000): the text
//! of its refusal (`InvalidDocument`, what an agent's NACK of a snapshot and a typed Apply say)
//! counts every error, as `diag::counts` does, not the cut list's closing line as one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use retryplane_policy::PolicySet;
use retryplane_proto::pb;

#[test]
fn an_invalid_wire_documents_text_counts_every_error_past_the_listing_limit() {
    let doc = pb::PolicyDocument {
        defaults: None,
        endpoints: (0..1_200)
            .map(|i| pb::Endpoint {
                name: format!("e{i}"),
                overlay: Some(pb::Overlay {
                    max_attempts: Some(0),
                    ..Default::default()
                }),
                routes: vec![],
            })
            .collect(),
    };
    let Err(err) = PolicySet::try_from(doc) else {
        panic!("1,200 errors refuse it");
    };
    assert_eq!(retryplane_policy::diag::counts(&err.errors), (1_200, 0));
    let text = err.to_string();
    assert!(
        text.starts_with("invalid policy document: 1200 error(s), first: "),
        "{text}"
    );
}
