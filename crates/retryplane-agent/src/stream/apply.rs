//! What the agent does with a pushed snapshot: check it, swap it in, answer.
//!
//! Checked by the rule a cache file is checked by at start ([`judge`]: the item limit, the
//! content hash and the shared validator); a good one is swapped into the `ArcSwap` (keeping
//! endpoint state whose settings did not change) and ACKed; a bad one is NACKed with the
//! reason and the policies in force stay.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use retryplane_proto::pb::ServerMessage;
use retryplane_proto::pb::{self, agent_message::Kind};
use tracing::{info, warn};

use crate::agent::Shared;
use crate::judge::{self, Refused};
use crate::snapshot::{PolicySnapshot, Source};

/// Most errors quoted in a NACK.
const NACK_ERRORS: usize = 3;

/// The answer to a snapshot and, when it was applied, the bytes for the cache file.
#[derive(Debug)]
pub(crate) struct Handled {
    pub(crate) reply: Kind,
    pub(crate) cache: Option<Vec<u8>>,
}

/// The NACK of a snapshot that does not decode whole but whose version and nonce do: the
/// policies in force stay, and the control plane records why.
pub(crate) fn undecodable(version: u64, nonce: String, error: &prost::DecodeError) -> Handled {
    refuse(
        version,
        nonce,
        format!("the snapshot does not decode: {error}"),
    )
}

/// The NACK of a snapshot in `m` whose endpoints and routes, counted on its bytes, pass what a
/// policy file can hold: refused before it is decoded (380,000 bare endpoints took about
/// 520 MB to decode), as its cache file would be ([`apply`] checks list entries after the
/// decode). `None` for any other message, and for one whose version and nonce do not decode
/// (the decode then reports it).
pub(crate) fn too_many_on_the_wire(m: &ServerMessage) -> Option<Handled> {
    let Err(refused) = judge::on_the_wire(m.snapshot.as_ref()?) else {
        return None;
    };
    let (version, nonce) = m.snapshot_version_and_nonce()?;
    Some(refuse(version, nonce, nack_reason(refused, None)))
}

/// The most fields a NACK names that this agent does not know.
const NACK_UNKNOWN: usize = 3;

/// What a NACK says of a snapshot [`judge`] refused; `encoded` is the snapshot's bytes, where
/// fields this agent does not know are found when they explain a content hash that does not
/// match (a control plane newer than the agent, whose policies use a field the agent lacks).
fn nack_reason(refused: Refused, encoded: Option<&[u8]>) -> String {
    match refused {
        Refused::TooMany(too_many) => too_many.message,
        Refused::NoPolicies => "the snapshot holds no policies".into(),
        Refused::HashMismatch => {
            // Only those of the policies: the hash covers nothing else.
            let unknown = encoded.map_or_else(Vec::new, |bytes| {
                retryplane_proto::unknown_fields::find_in(
                    "retryplane.v1.Snapshot",
                    "policies",
                    bytes,
                    NACK_UNKNOWN,
                )
            });
            if unknown.is_empty() {
                return "the content hash does not match the policies".into();
            }
            let named: Vec<String> = unknown.iter().map(ToString::to_string).collect();
            format!(
                "the policies use fields this agent (retryplane-agent {}) does not know, so \
                 it cannot apply them as written: {}; upgrade the agent, or use such fields \
                 only once every agent knows them",
                env!("CARGO_PKG_VERSION"),
                named.join("; ")
            )
        }
        Refused::Invalid(errors) => {
            // Counted whole: a long list ends with a line saying how many more there are.
            let (count, _) = retryplane_policy::diag::counts(&errors);
            let mut text: Vec<String> = errors
                .iter()
                .filter(|d| retryplane_policy::diag::unlisted(d).is_none())
                .take(NACK_ERRORS)
                .map(ToString::to_string)
                .collect();
            if count > text.len() {
                text.push(format!("and {} more", count - text.len()));
            }
            text.join("; ")
        }
    }
}

/// The NACK of version `version` (nonce `nonce`), logged; the policies in force stay.
fn refuse(version: u64, nonce: String, error: String) -> Handled {
    warn!(version, %error, "snapshot refused; keeping the policies in force");
    Handled {
        reply: Kind::Nack(pb::Nack {
            version,
            nonce,
            error,
        }),
        cache: None,
    }
}

/// Checks `snap` and, if it is good, makes it the agent's policies. `before_swap` is given the
/// policies in force once the new ones are built, in the writers' turn, just before the swap:
/// the counts made under them are reported then, so that calls made on other threads while a
/// large set is checked and built count under the version they were made under.
pub(crate) fn apply(
    shared: &Shared,
    snap: pb::Snapshot,
    encoded: Option<&[u8]>,
    default_interval: Duration,
    before_swap: impl FnOnce(&PolicySnapshot),
) -> Handled {
    // Judged as a cache file holding it would be at the next start, so the agent never runs
    // what it could not start from again (a version stored before the control plane had the
    // item limit, say).
    let (set, warnings) = match judge::policies(snap.policies.clone(), &snap.content_hash) {
        Ok(ok) => ok,
        Err(refused) => {
            return refuse(snap.version, snap.nonce, nack_reason(refused, encoded));
        }
    };
    let cache = crate::cache::encode(&snap);
    // The version in force, when the control plane's is below it, or the same number with
    // other content: a rollback is a new, higher version, so either is another store's
    // numbering (one lost and begun again at 1, or another control plane behind the same
    // address).
    let mut went_back = None;
    shared.update_policies(|current| {
        if matches!(current.source(), Source::ControlPlane | Source::Cache)
            && (current.version() > snap.version
                || (current.version() == snap.version
                    && current.content_hash() != snap.content_hash))
        {
            went_back = Some(current.version());
        }
        let next = PolicySnapshot::build(
            set,
            snap.version,
            snap.content_hash.clone(),
            Source::ControlPlane,
            Some(current),
        );
        // Calls that outlive the outgoing policies count apart from here on, so that what
        // `before_swap` takes as theirs is all they count under their version's name.
        shared.announce(snap.version);
        before_swap(current);
        next
    });
    let interval = match snap.metrics_interval_ms {
        0 => default_interval,
        ms => Duration::from_millis(ms),
    };
    shared.metrics_interval_ms.store(
        u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
        Relaxed,
    );
    match went_back {
        Some(before) if before == snap.version => warn!(
            version = snap.version,
            warnings = warnings.len(),
            "policies applied: the version number in force before, with other content; was \
             the control plane's store lost or replaced? Its version numbers no longer follow \
             the ones this agent ran"
        ),
        Some(before) => warn!(
            version = snap.version,
            before,
            warnings = warnings.len(),
            "policies applied: a version below the one in force before; was the control \
             plane's store lost or replaced? Its version numbers no longer follow the ones \
             this agent ran"
        ),
        None => info!(
            version = snap.version,
            warnings = warnings.len(),
            "policies applied"
        ),
    }
    Handled {
        reply: Kind::Ack(pb::Ack {
            version: snap.version,
            nonce: snap.nonce,
        }),
        cache: Some(cache),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Agent;
    use retryplane_proto::convert;

    fn snapshot(version: u64, yaml: &str) -> pb::Snapshot {
        let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
        let doc = pb::PolicyDocument::from(set.document().as_ref());
        pb::Snapshot {
            version,
            content_hash: convert::content_hash(&doc),
            policies: Some(doc),
            nonce: format!("n-{version}"),
            metrics_interval_ms: 250,
        }
    }

    fn agent() -> Agent {
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  a: {}\n")
            .policies
            .unwrap();
        Agent::from_policies_seeded(set, 1)
    }

    #[tokio::test(start_paused = true)]
    async fn a_valid_snapshot_is_swapped_in_and_acked_with_its_nonce() {
        let agent = agent();
        let h = apply(
            agent.shared(),
            snapshot(4, "version: 1\nendpoints:\n  a: {max_attempts: 5}\n"),
            None,
            Duration::from_secs(10),
            |_| {},
        );
        assert!(matches!(&h.reply, Kind::Ack(a) if a.version == 4 && a.nonce == "n-4"));
        assert!(h.cache.is_some());
        let p = agent.policies();
        assert_eq!((p.version(), p.source()), (4, Source::ControlPlane));
        assert_eq!(
            p.set().unwrap().endpoint("a").unwrap().policy.max_attempts,
            5
        );
        assert_eq!(agent.shared().metrics_interval_ms.load(Relaxed), 250);
    }

    /// A version below the one in force is applied (the control plane is the source of
    /// truth) and warned of, and so is the same number with other content: its store was
    /// lost or replaced. A higher one is not, nor the same version again.
    #[tokio::test(start_paused = true)]
    async fn a_version_below_the_one_in_force_is_applied_and_warned_of() {
        let (logs, _guard) = crate::test_logs::Logs::capture();
        let agent = agent();
        let yaml = "version: 1\nendpoints:\n  a: {max_attempts: 5}\n";
        let other = "version: 1\nendpoints:\n  a: {max_attempts: 2}\n";
        for (version, yaml) in [(57, yaml), (1, yaml), (2, yaml), (2, yaml), (2, other)] {
            let h = apply(
                agent.shared(),
                snapshot(version, yaml),
                None,
                Duration::from_secs(10),
                |_| {},
            );
            assert!(matches!(&h.reply, Kind::Ack(a) if a.version == version));
        }
        assert_eq!(agent.policies().version(), 2);
        assert_eq!(
            agent
                .policies()
                .set()
                .unwrap()
                .endpoint("a")
                .unwrap()
                .policy
                .max_attempts,
            2
        );
        let text = logs.text();
        let warned: Vec<_> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warned.len(), 2, "{text}");
        assert!(
            warned[0].contains("a version below the one in force before")
                && warned[0].contains("version=1")
                && warned[0].contains("before=57"),
            "{text}"
        );
        assert!(
            warned[1].contains("the version number in force before, with other content")
                && warned[1].contains("version=2"),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_nack_of_more_errors_than_a_check_lists_counts_them_all() {
        // 1,200 endpoints with `max_attempts: 0`: the check lists 1,000 and a closing line.
        let agent = agent();
        let mut bad = snapshot(5, "version: 1\nendpoints:\n  a: {}\n");
        if let Some(doc) = bad.policies.as_mut() {
            let template = doc.endpoints[0].clone();
            doc.endpoints = (0..1_200)
                .map(|i| {
                    let mut e = template.clone();
                    e.name = format!("e{i:04}");
                    e.overlay.get_or_insert_with(Default::default).max_attempts = Some(0);
                    e
                })
                .collect();
            bad.content_hash = convert::content_hash(doc);
        }
        let h = apply(agent.shared(), bad, None, Duration::from_secs(10), |_| {});
        let Kind::Nack(n) = &h.reply else {
            panic!("expected a NACK, got {:?}", h.reply);
        };
        assert!(n.error.ends_with("; and 1197 more"), "{}", n.error);
    }

    #[tokio::test(start_paused = true)]
    async fn nack_keeps_the_last_good_policy() {
        let agent = agent();
        apply(
            agent.shared(),
            snapshot(4, "version: 1\nendpoints:\n  a: {max_attempts: 5}\n"),
            None,
            Duration::from_secs(10),
            |_| {},
        );
        let mut bad = snapshot(5, "version: 1\nendpoints:\n  a: {}\n");
        if let Some(doc) = bad.policies.as_mut() {
            let overlay = doc.endpoints[0]
                .overlay
                .get_or_insert_with(Default::default);
            overlay.max_attempts = Some(0);
            bad.content_hash = convert::content_hash(doc);
        }
        let h = apply(agent.shared(), bad, None, Duration::from_secs(10), |_| {});
        match &h.reply {
            Kind::Nack(n) => {
                assert_eq!((n.version, n.nonce.as_str()), (5, "n-5"));
                assert!(n.error.contains("max_attempts"), "{}", n.error);
            }
            other => panic!("expected a NACK, got {other:?}"),
        }
        assert!(h.cache.is_none(), "a refused snapshot is not cached");
        let p = agent.policies();
        assert_eq!(p.version(), 4);
        assert_eq!(
            p.set().unwrap().endpoint("a").unwrap().policy.max_attempts,
            5
        );
    }

    /// A snapshot from a control plane newer than the agent, whose policies use a field the
    /// agent does not know: the agent reads the policies without it, so their hash does not
    /// match, and the NACK names the field rather than calling the snapshot damaged.
    #[tokio::test(start_paused = true)]
    async fn a_nack_of_policies_with_fields_this_agent_does_not_know_names_them() {
        use prost::Message as _;
        let agent = agent();
        let written = snapshot(5, "version: 1\nendpoints:\n  a: {max_attempts: 2}\n");
        // The first endpoint's overlay with field 40 added, as a newer build writes it; its
        // hash is the newer build's (not what this agent computes without the field).
        let doc = written.policies.clone().unwrap();
        let mut overlay = doc.endpoints[0].overlay.clone().unwrap().encode_to_vec();
        prost::encoding::uint64::encode(40, &7, &mut overlay);
        let mut endpoint = Vec::new();
        prost::encoding::string::encode(1, &doc.endpoints[0].name, &mut endpoint);
        prost::encoding::bytes::encode(2, &overlay, &mut endpoint);
        let mut policies = Vec::new();
        prost::encoding::bytes::encode(2, &endpoint, &mut policies);
        let mut encoded = pb::Snapshot {
            policies: None,
            content_hash: "0".repeat(64),
            ..written
        }
        .encode_to_vec();
        prost::encoding::bytes::encode(3, &policies, &mut encoded);
        // A field of the snapshot itself, outside what the hash covers: not named.
        prost::encoding::uint64::encode(50, &1, &mut encoded);
        let read = pb::Snapshot::decode(encoded.as_slice()).unwrap();
        assert_eq!(read.policies.as_ref(), Some(&doc), "read without the field");

        let h = apply(
            agent.shared(),
            read.clone(),
            Some(&encoded),
            Duration::from_secs(10),
            |_| {},
        );
        let Kind::Nack(n) = &h.reply else {
            panic!("expected a NACK, got {:?}", h.reply);
        };
        assert!(
            n.error.contains("the policies use fields this agent")
                && n.error.contains(
                    "field 40 of retryplane.v1.Overlay at `policies.endpoints[0].overlay`"
                )
                && !n.error.contains("retryplane.v1.Snapshot"),
            "{}",
            n.error
        );
        // Without the field, the same mismatch is the content hash's.
        let h = apply(agent.shared(), read, None, Duration::from_secs(10), |_| {});
        let Kind::Nack(n) = &h.reply else {
            panic!("expected a NACK, got {:?}", h.reply);
        };
        assert_eq!(n.error, "the content hash does not match the policies");
    }

    /// A snapshot holding more than a policy file can (a version stored before the control
    /// plane had the limit) is refused as its cache file would be at the next start, so the
    /// agent never runs policies it could not start from again.
    #[tokio::test(start_paused = true)]
    async fn a_snapshot_holding_more_than_a_policy_file_can_is_nacked_as_its_cache_would_be() {
        let agent = agent();
        let mut large = snapshot(6, "version: 1\nendpoints:\n  a: {}\n");
        if let Some(doc) = large.policies.as_mut() {
            doc.endpoints = (0..=convert::MAX_ITEMS / 2)
                .map(|i| pb::Endpoint {
                    name: format!("e{i}"),
                    ..Default::default()
                })
                .collect();
            large.content_hash = convert::content_hash(doc);
        }
        let cached = crate::cache::encode(&large);
        // Refused on its bytes, before the decode, with its version and nonce.
        let framed = ServerMessage::with_snapshot(&large);
        match too_many_on_the_wire(&framed).map(|h| h.reply) {
            Some(Kind::Nack(n)) => {
                assert_eq!((n.version, n.nonce.as_str()), (6, "n-6"));
                assert!(n.error.contains("too large"), "{}", n.error);
            }
            other => panic!("expected a NACK, got {other:?}"),
        }
        assert!(
            too_many_on_the_wire(&ServerMessage::with_snapshot(&snapshot(
                7,
                "version: 1\nendpoints:\n  a: {}\n"
            )))
            .is_none()
        );
        // And after it, were it decoded.
        let h = apply(agent.shared(), large, None, Duration::from_secs(10), |_| {});
        match &h.reply {
            Kind::Nack(n) => assert!(n.error.contains("too large"), "{}", n.error),
            other => panic!("expected a NACK, got {other:?}"),
        }
        assert!(h.cache.is_none());
        assert_eq!(agent.policies().version(), 0);
        assert!(crate::cache::decode_for_test(&cached).is_err());
        // Past the limit in list entries alone (not counted on the wire), with a hash that
        // does not match: "too large", as its cache file would be, whatever the hash.
        let mut listed = snapshot(8, "version: 1\nendpoints:\n  a: {}\n");
        if let Some(doc) = listed.policies.as_mut() {
            doc.endpoints[0].overlay = Some(pb::Overlay {
                retry_on: Some(pb::RetryOn {
                    http_status: Some(pb::StatusList {
                        codes: vec![503; convert::MAX_ITEMS - 1],
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        listed.content_hash = "0".repeat(64);
        let cached = crate::cache::encode(&listed);
        assert!(too_many_on_the_wire(&ServerMessage::with_snapshot(&listed)).is_none());
        let h = apply(
            agent.shared(),
            listed,
            None,
            Duration::from_secs(10),
            |_| {},
        );
        match &h.reply {
            Kind::Nack(n) => assert!(n.error.contains("too large"), "{}", n.error),
            other => panic!("expected a NACK, got {other:?}"),
        }
        assert!(crate::cache::decode_for_test(&cached).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_snapshot_whose_hash_does_not_match_is_nacked() {
        let agent = agent();
        let mut snap = snapshot(2, "version: 1\nendpoints:\n  a: {max_attempts: 5}\n");
        snap.content_hash = "0".repeat(64);
        let h = apply(agent.shared(), snap, None, Duration::from_secs(10), |_| {});
        assert!(matches!(&h.reply, Kind::Nack(n) if n.error.contains("hash")));
        assert_eq!(agent.policies().version(), 0);
    }
}
