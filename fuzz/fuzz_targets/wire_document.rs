//! A policy document off the wire (an admin `Apply`/`Validate`, or a `Snapshot` an agent is
//! pushed or reads from its cache file): any bytes decoded as `retryplane.v1.PolicyDocument`,
//! converted and validated, must never panic, and a document that converts must convert back
//! to its wire form and again to the same content hash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use retryplane_policy::{PolicyDocument, Severity};
use retryplane_proto::{convert, pb};

fuzz_target!(|data: &[u8]| {
    let Ok(mut doc) = pb::PolicyDocument::decode(data) else {
        return;
    };
    // As the admin API takes it: a size check (a document past it is refused there, so it is
    // not converted here either: its conversion took seconds), `-0.0` read as `0.0`, the hash
    // of what was sent.
    if convert::check_items(&doc).is_err() {
        return;
    }
    let _ = convert::unsigned_zeros(&mut doc);
    let sent_hash = convert::content_hash(&doc);
    let mut as_set = doc.clone();
    convert::lists_as_sets(&mut as_set);
    let _ = convert::content_hash(&as_set);

    // The structural conversion alone (what `retryplane diff` and the control plane's cache of
    // the current version run) and the whole check (what Apply and an agent run).
    let structural = PolicyDocument::try_from(doc.clone());
    match convert::validate(doc) {
        Ok((set, warnings)) => {
            assert!(structural.is_ok(), "validated but did not convert");
            assert!(warnings.iter().all(|w| w.severity == Severity::Warning));
            // Back to the wire, and once more through the conversion: the same content hash.
            let back = pb::PolicyDocument::from(set.document().as_ref());
            let first = convert::content_hash(&back);
            let again = match PolicyDocument::try_from(back.clone()) {
                Ok(again) => again,
                Err(e) => panic!("a validated document converted back does not convert: {e}"),
            };
            let back_again = pb::PolicyDocument::from(&again);
            assert_eq!(first, convert::content_hash(&back_again), "content hash changed");
            assert_eq!(back, back_again, "wire form changed on a second round trip");
            // And it still validates.
            if let Err(errors) = convert::validate(back) {
                panic!(
                    "a validated document converted back is invalid: {}",
                    errors.first().map(ToString::to_string).unwrap_or_default()
                );
            }
            if std::env::var_os("RP_FUZZ_STRICT").is_some() {
                // Stronger: what was sent (after unsigned_zeros) hashes as its round trip.
                assert_eq!(sent_hash, first, "sent hash differs from round-trip hash");
            }
        }
        Err(errors) => {
            assert!(!errors.is_empty(), "refused with no diagnostic");
            assert!(
                errors.iter().any(|d| d.severity == Severity::Error),
                "refused with warnings only"
            );
        }
    }
});
