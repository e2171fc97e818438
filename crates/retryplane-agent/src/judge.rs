//! The one rule for whether a snapshot's policies may run, shared by the stream (a snapshot the
//! control plane pushes) and the cache file (one an earlier run stored), so that the agent
//! never runs a snapshot it would refuse to start from, nor refuses at start one it ran.
//!
//! The checks run cheapest first, each on what the one before let through:
//! 1. [`on_the_wire`]: endpoints and routes counted on the encoded snapshot, before it is
//!    decoded (380,000 bare endpoints took about 520 MB to decode);
//! 2. [`policies`], once it is decoded: policies present, list entries counted
//!    ([`convert::check_items`]), the content hash, then the shared validator
//!    ([`convert::validate`]).
//!
//! Each caller words the [`Refused`] for its reader: the stream in a NACK, the cache in a log
//! line that names the file.

use retryplane_policy::{Diagnostic, PolicySet};
use retryplane_proto::{convert, pb, wire_items};

/// Why a snapshot's policies may not run.
#[derive(Debug)]
pub(crate) enum Refused {
    /// More endpoints and routes than a policy file can hold ([`convert::MAX_ITEMS`]): the
    /// error [`convert::check_items`] gives.
    TooMany(Diagnostic),
    /// The snapshot holds no policies.
    NoPolicies,
    /// The content hash does not match the policies.
    HashMismatch,
    /// The validator's errors, in its order (never empty).
    Invalid(Vec<Diagnostic>),
}

/// Refuses the encoded snapshot `snapshot` (the bytes of a `pb::Snapshot`) when its endpoints
/// and routes, counted on the bytes, pass what a policy file can hold. List entries are not
/// counted here; [`policies`] counts them after the decode.
pub(crate) fn on_the_wire(snapshot: &[u8]) -> Result<(), Refused> {
    let items = wire_items::snapshot_items_at_least(snapshot);
    if items > convert::MAX_ITEMS {
        return Err(Refused::TooMany(convert::too_many_items(items)));
    }
    Ok(())
}

/// The compiled policies of a decoded snapshot whose policies are `policies` and whose
/// content hash is `content_hash`, with the validator's warnings; or why they may not run.
pub(crate) fn policies(
    policies: Option<pb::PolicyDocument>,
    content_hash: &str,
) -> Result<(PolicySet, Vec<Diagnostic>), Refused> {
    let doc = policies.ok_or(Refused::NoPolicies)?;
    convert::check_items(&doc).map_err(Refused::TooMany)?;
    if convert::content_hash(&doc) != content_hash {
        return Err(Refused::HashMismatch);
    }
    convert::validate(doc).map_err(Refused::Invalid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn doc(yaml: &str) -> pb::PolicyDocument {
        let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
        pb::PolicyDocument::from(set.document().as_ref())
    }

    /// `count` bare endpoints: past the limit when `count` is over half of it (an endpoint
    /// counts as two items).
    fn bare_endpoints(count: usize) -> pb::PolicyDocument {
        let mut d = doc("version: 1\nendpoints:\n  a: {}\n");
        d.endpoints = (0..count)
            .map(|i| pb::Endpoint {
                name: format!("e{i}"),
                ..Default::default()
            })
            .collect();
        d
    }

    #[test]
    fn good_policies_run_with_their_warnings() {
        let d = doc("version: 1\nendpoints:\n  a: {max_attempts: 5}\n");
        let hash = convert::content_hash(&d);
        let (set, _) = policies(Some(d), &hash).unwrap();
        assert_eq!(set.endpoint("a").unwrap().policy.max_attempts, 5);
    }

    #[test]
    fn each_fault_is_named() {
        assert!(matches!(policies(None, ""), Err(Refused::NoPolicies)));
        let d = doc("version: 1\nendpoints:\n  a: {}\n");
        assert!(matches!(
            policies(Some(d), &"0".repeat(64)),
            Err(Refused::HashMismatch)
        ));
        let mut d = doc("version: 1\nendpoints:\n  a: {}\n");
        d.endpoints[0]
            .overlay
            .get_or_insert_with(Default::default)
            .max_attempts = Some(0);
        let hash = convert::content_hash(&d);
        match policies(Some(d), &hash) {
            Err(Refused::Invalid(errors)) => {
                assert!(errors[0].to_string().contains("max_attempts"), "{errors:?}");
            }
            other => panic!("expected the validator's errors, got {other:?}"),
        }
    }

    /// Too many items are refused before the hash is compared, so a snapshot over the limit
    /// gets the same answer from the stream and from its cache file whatever its hash: the
    /// count is the cheaper check, and the reason a large set will never be run.
    #[test]
    fn too_many_items_are_refused_before_the_hash_is_compared() {
        let large = bare_endpoints(convert::MAX_ITEMS / 2 + 1);
        let hash = convert::content_hash(&large);
        assert!(matches!(
            policies(Some(large.clone()), &hash),
            Err(Refused::TooMany(_))
        ));
        assert!(matches!(
            policies(Some(large), &"0".repeat(64)),
            Err(Refused::TooMany(_))
        ));
        let at_limit = bare_endpoints(convert::MAX_ITEMS / 2);
        let hash = convert::content_hash(&at_limit);
        assert!(policies(Some(at_limit), &hash).is_ok());
    }

    #[test]
    fn the_count_on_the_wire_refuses_what_the_decoded_count_does() {
        for (count, refused) in [
            (convert::MAX_ITEMS / 2, false),
            (convert::MAX_ITEMS / 2 + 1, true),
        ] {
            let d = bare_endpoints(count);
            let snap = pb::Snapshot {
                version: 3,
                content_hash: convert::content_hash(&d),
                policies: Some(d),
                nonce: "n".into(),
                metrics_interval_ms: 0,
            };
            match on_the_wire(&snap.encode_to_vec()) {
                Err(Refused::TooMany(d)) => {
                    assert!(refused, "{count} refused: {}", d.message);
                    assert!(d.message.contains("too large"), "{}", d.message);
                }
                Ok(()) => assert!(!refused, "{count} let through"),
                Err(other) => panic!("{other:?}"),
            }
        }
    }
}
