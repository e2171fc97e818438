//! A list of problems cut at `diag::MAX_LISTED` closes with a line standing for those left out
//! ("200 more error(s) not listed"): whatever counts the problems counts that line's numbers
//! (`diag::counts`), not the line as one problem.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use retryplane_policy::document::{EndpointDoc, Field, Overlay};
use retryplane_policy::{PolicyDocument, PolicySet};

/// A document of `n` endpoints, each with `max_attempts: 0` (one error each).
fn document_with_errors(n: usize) -> PolicyDocument {
    PolicyDocument {
        endpoints: (0..n)
            .map(|i| EndpointDoc {
                name: Field::new(format!("e{i}")),
                overlay: Overlay {
                    max_attempts: Some(Field::new(0)),
                    ..Overlay::default()
                },
                routes: Vec::new(),
            })
            .collect(),
        ..PolicyDocument::default()
    }
}

#[test]
fn an_invalid_policys_text_counts_every_error_of_a_list_cut_at_the_listing_limit() {
    // `invalid policy: N error(s), first: …` (what an agent's NACK of a snapshot says, through
    // `InvalidDocument`, and what callers of `PolicySet::from_document` print) took the cut
    // list's length: 1,001 for 1,200 errors, the closing line counted as one error.
    let Err(err) = PolicySet::from_document(document_with_errors(1_200)) else {
        panic!("1,200 errors refuse the document");
    };
    assert_eq!(
        retryplane_policy::diag::counts(&err.errors),
        (1_200, 0),
        "the list itself stands for 1,200"
    );
    let text = err.to_string();
    assert!(
        text.starts_with("invalid policy: 1200 error(s), first: "),
        "{text}"
    );
}
