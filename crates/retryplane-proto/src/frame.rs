//! `retryplane.v1.ServerMessage` with its snapshot kept encoded.
//!
//! The control plane sends the same snapshot to every agent. Encoding it once and sharing the
//! bytes is what keeps a push to thousands of streams cheap, so the Rust type of
//! `ServerMessage` (mapped with `extern_path` in `build.rs`) holds the encoded `Snapshot` as
//! [`Bytes`]: on the wire a length-delimited bytes field with tag 1 is exactly a `Snapshot`
//! message field with tag 1, so other languages see the `.proto` as written. The other arms of
//! the oneof, `metrics_ack` (tag 2) and `keepalive` (tag 3), are ordinary message fields; the
//! constructors set one arm
//! only, as a oneof would.

use bytes::Bytes;
use prost::Message;

use crate::pb;

/// `retryplane.v1.ServerMessage`; `snapshot` is an encoded [`pb::Snapshot`].
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ServerMessage {
    /// The encoded snapshot (the `kind.snapshot` oneof arm of the `.proto`).
    #[prost(bytes = "bytes", optional, tag = "1")]
    pub snapshot: Option<Bytes>,
    /// The answer to a numbered metrics report (the `kind.metrics_ack` oneof arm).
    #[prost(message, optional, tag = "2")]
    pub metrics_ack: Option<pb::MetricsAck>,
    /// A heartbeat of the control plane's (the `kind.keepalive` oneof arm; see
    /// [`crate::liveness`]).
    #[prost(message, optional, tag = "3")]
    pub keepalive: Option<pb::Keepalive>,
}

impl ServerMessage {
    /// A message carrying `snapshot`, encoded now, once.
    pub fn with_snapshot(snapshot: &pb::Snapshot) -> Self {
        Self {
            snapshot: Some(Bytes::from(snapshot.encode_to_vec())),
            metrics_ack: None,
            keepalive: None,
        }
    }

    /// The encoded length of a message carrying `head` with `policies` as its policies, counted
    /// without building or encoding that message (a large document is not copied); `head`'s own
    /// `policies`, if any, are not counted. Compare it with [`crate::MAX_MESSAGE_BYTES`].
    pub fn snapshot_message_len(head: &pb::Snapshot, policies: &pb::PolicyDocument) -> usize {
        // A length-delimited field: a one-byte key (tags 1 and 3), its length, its bytes.
        let field_len = |len: usize| 1 + prost::length_delimiter_len(len) + len;
        let head_len = head.encoded_len()
            - head
                .policies
                .as_ref()
                .map_or(0, |own| field_len(own.encoded_len()));
        field_len(head_len + field_len(policies.encoded_len()))
    }

    /// The most bytes a snapshot message of `policies` can take, whatever the control plane
    /// that sends it puts in the other fields: the largest version and metrics interval, a
    /// 64-character content hash (hex SHA-256) and a nonce of [`MAX_NONCE_LEN`] bytes. Counted,
    /// not encoded. What [`check_agent_limit`] compares with [`crate::MAX_MESSAGE_BYTES`].
    pub fn largest_snapshot_message_len(policies: &pb::PolicyDocument) -> usize {
        let head = pb::Snapshot {
            version: u64::MAX,
            content_hash: "0".repeat(64),
            policies: None,
            nonce: "0".repeat(MAX_NONCE_LEN),
            metrics_interval_ms: u64::MAX,
        };
        Self::snapshot_message_len(&head, policies)
    }

    /// A message carrying `ack` alone.
    pub fn with_metrics_ack(ack: pb::MetricsAck) -> Self {
        Self {
            snapshot: None,
            metrics_ack: Some(ack),
            keepalive: None,
        }
    }

    /// A heartbeat alone.
    pub fn keepalive() -> Self {
        Self {
            snapshot: None,
            metrics_ack: None,
            keepalive: Some(pb::Keepalive {}),
        }
    }

    /// The snapshot, decoded; `Ok(None)` when the message carries none.
    pub fn decode_snapshot(&self) -> Result<Option<pb::Snapshot>, prost::DecodeError> {
        self.snapshot
            .as_ref()
            .map(|b| pb::Snapshot::decode(b.clone()))
            .transpose()
    }

    /// The version and nonce of a snapshot that does not decode whole, when those two fields
    /// do: the other fields are skipped undecoded, so a bad `policies` still lets the agent
    /// answer a NACK the control plane can match to what it sent.
    pub fn snapshot_version_and_nonce(&self) -> Option<(u64, String)> {
        let head = SnapshotHead::decode(self.snapshot.clone()?).ok()?;
        Some((head.version, head.nonce))
    }
}

/// The longest nonce a control plane puts in a snapshot, in bytes. `retryplane serve`'s are
/// about 30 (an 8-digit instance and the version); the bound leaves room, so that whether a
/// document fits agents does not depend on which control plane, or which settings, serve it.
pub const MAX_NONCE_LEN: usize = 64;

/// A policy document whose snapshot would be a message longer than agents decode
/// ([`crate::MAX_MESSAGE_BYTES`]): every agent would refuse every push of it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the policies encode to {document_len} bytes, a snapshot message of up to {message_len} bytes; agents decode messages of at most {limit} bytes: make the policies smaller (fewer endpoints or routes, shorter names)"
)]
pub struct TooLargeForAgents {
    /// The encoded policy document.
    pub document_len: usize,
    /// The snapshot message the document makes, at most
    /// ([`ServerMessage::largest_snapshot_message_len`]).
    pub message_len: usize,
    /// The most an agent decodes.
    pub limit: usize,
}

/// `Err` when a snapshot of `policies` could be longer than agents decode
/// ([`crate::MAX_MESSAGE_BYTES`]). The control plane refuses such a change (Apply, Validate, a
/// policy file) and `retryplane validate` reports it, so a file that passes validation is one
/// the control plane takes.
pub fn check_agent_limit(policies: &pb::PolicyDocument) -> Result<(), TooLargeForAgents> {
    let message_len = ServerMessage::largest_snapshot_message_len(policies);
    if message_len > crate::MAX_MESSAGE_BYTES {
        return Err(TooLargeForAgents {
            document_len: policies.encoded_len(),
            message_len,
            limit: crate::MAX_MESSAGE_BYTES,
        });
    }
    Ok(())
}

/// The two fields of `retryplane.v1.Snapshot` an answer echoes; the rest is skipped.
#[derive(Clone, PartialEq, ::prost::Message)]
struct SnapshotHead {
    #[prost(uint64, tag = "1")]
    version: u64,
    #[prost(string, tag = "4")]
    nonce: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape the `.proto` describes, as prost would generate it.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct AsGenerated {
        #[prost(oneof = "Kind", tags = "1, 2, 3")]
        kind: Option<Kind>,
    }

    #[derive(Clone, PartialEq, ::prost::Oneof)]
    #[allow(
        clippy::large_enum_variant,
        reason = "what prost generates for the oneof"
    )]
    enum Kind {
        #[prost(message, tag = "1")]
        Snapshot(pb::Snapshot),
        #[prost(message, tag = "2")]
        MetricsAck(pb::MetricsAck),
        #[prost(message, tag = "3")]
        Keepalive(pb::Keepalive),
    }

    #[test]
    fn a_snapshot_with_bad_policies_still_gives_its_version_and_nonce() {
        let snapshot = pb::Snapshot {
            version: 7,
            nonce: "n-7".into(),
            ..Default::default()
        };
        let mut bytes = snapshot.encode_to_vec();
        // Field 3 (policies), length 2, holding a truncated varint.
        bytes.extend_from_slice(&[0x1a, 0x02, 0x08, 0xff]);
        let message = ServerMessage {
            snapshot: Some(Bytes::from(bytes)),
            metrics_ack: None,
            keepalive: None,
        };
        assert!(message.decode_snapshot().is_err());
        assert_eq!(
            message.snapshot_version_and_nonce(),
            Some((7, "n-7".to_owned()))
        );
        // Garbage throughout gives nothing to answer.
        let garbage = ServerMessage {
            snapshot: Some(Bytes::from_static(&[0xff, 0xff])),
            metrics_ack: None,
            keepalive: None,
        };
        assert_eq!(garbage.snapshot_version_and_nonce(), None);
        assert_eq!(ServerMessage::default().snapshot_version_and_nonce(), None);
    }

    #[test]
    fn the_shared_encoding_is_the_wire_format_of_the_proto() {
        let snapshot = pb::Snapshot {
            version: 7,
            content_hash: "abc".into(),
            nonce: "n-7".into(),
            ..Default::default()
        };
        let ours = ServerMessage::with_snapshot(&snapshot).encode_to_vec();
        let theirs = AsGenerated {
            kind: Some(Kind::Snapshot(snapshot.clone())),
        }
        .encode_to_vec();
        assert_eq!(ours, theirs);
        let back = ServerMessage::decode(ours.as_slice()).unwrap();
        assert_eq!(back.decode_snapshot().unwrap(), Some(snapshot));
        assert_eq!(back.metrics_ack, None);
    }

    #[test]
    fn a_metrics_ack_has_the_wire_format_of_the_proto() {
        let ack = pb::MetricsAck {
            seq: 300,
            dropped: true,
        };
        let ours = ServerMessage::with_metrics_ack(ack).encode_to_vec();
        let theirs = AsGenerated {
            kind: Some(Kind::MetricsAck(ack)),
        }
        .encode_to_vec();
        assert_eq!(ours, theirs);
        let back = ServerMessage::decode(ours.as_slice()).unwrap();
        assert_eq!(back.metrics_ack, Some(ack));
        assert_eq!(back.decode_snapshot().unwrap(), None);
        let as_generated = AsGenerated::decode(ours.as_slice()).unwrap();
        assert_eq!(as_generated.kind, Some(Kind::MetricsAck(ack)));
    }

    #[test]
    fn a_keepalive_has_the_wire_format_of_the_proto() {
        let ours = ServerMessage::keepalive().encode_to_vec();
        let theirs = AsGenerated {
            kind: Some(Kind::Keepalive(pb::Keepalive {})),
        }
        .encode_to_vec();
        assert_eq!(ours, theirs);
        let back = ServerMessage::decode(ours.as_slice()).unwrap();
        assert_eq!(back.keepalive, Some(pb::Keepalive {}));
        assert_eq!((back.metrics_ack, back.snapshot), (None, None));
    }

    #[test]
    fn the_snapshot_message_len_is_the_encoded_len_without_encoding() {
        let name = |i: usize| format!("endpoint-{i}");
        for endpoints in [0, 1, 20, 3_000] {
            let policies = pb::PolicyDocument {
                endpoints: (0..endpoints)
                    .map(|i| pb::Endpoint {
                        name: name(i),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            };
            let head = pb::Snapshot {
                version: u64::MAX,
                content_hash: "0".repeat(64),
                policies: None,
                nonce: "0123abcd-18446744073709551615".into(),
                metrics_interval_ms: 10_000,
            };
            let whole = pb::Snapshot {
                policies: Some(policies.clone()),
                ..head.clone()
            };
            let encoded = ServerMessage::with_snapshot(&whole).encoded_len();
            assert_eq!(
                ServerMessage::snapshot_message_len(&head, &policies),
                encoded
            );
            // Policies already in the head are not counted twice.
            assert_eq!(
                ServerMessage::snapshot_message_len(&whole, &policies),
                encoded
            );
        }
    }

    /// A document of one endpoint whose one route's path prefix makes the encoded document
    /// `len` bytes long.
    fn document_of_len(len: usize) -> pb::PolicyDocument {
        let with_prefix = |prefix: String| pb::PolicyDocument {
            endpoints: vec![pb::Endpoint {
                name: "payments".into(),
                routes: vec![pb::Route {
                    r#match: Some(pb::RouteMatch {
                        kind: Some(pb::route_match::Kind::Http(pb::HttpMatch {
                            method: String::new(),
                            path_prefix: prefix,
                        })),
                    }),
                    overlay: None,
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        // Varint lengths grow with the prefix: shrink it until the whole fits `len` exactly.
        let mut prefix_len = len;
        loop {
            let document = with_prefix("a".repeat(prefix_len));
            let over = document.encoded_len() - len;
            if over == 0 {
                return document;
            }
            prefix_len -= over;
        }
    }

    #[test]
    fn the_largest_snapshot_message_len_bounds_every_head() {
        let policies = document_of_len(10_000);
        let largest = ServerMessage::largest_snapshot_message_len(&policies);
        for (version, nonce_len, interval) in [
            (1, 10, 1_000),
            (u64::MAX, 29, 10_000),
            (7, MAX_NONCE_LEN, u64::MAX),
            (u64::MAX, MAX_NONCE_LEN, u64::MAX),
        ] {
            let snapshot = pb::Snapshot {
                version,
                content_hash: "f".repeat(64),
                policies: Some(policies.clone()),
                nonce: "n".repeat(nonce_len),
                metrics_interval_ms: interval,
            };
            let len = ServerMessage::with_snapshot(&snapshot).encoded_len();
            assert!(len <= largest, "{version} {nonce_len} {interval}");
            if version == u64::MAX && nonce_len == MAX_NONCE_LEN && interval == u64::MAX {
                assert_eq!(len, largest);
            }
        }
    }

    #[test]
    fn the_agent_limit_refuses_a_document_whose_largest_snapshot_is_over_it() {
        // The head and the framing of the largest snapshot, for a document near the limit
        // (length prefixes take as many bytes for any length from 2 MiB to 256 MiB).
        let near = crate::MAX_MESSAGE_BYTES - 1_000;
        let overhead = ServerMessage::largest_snapshot_message_len(&document_of_len(near)) - near;
        let fits = document_of_len(crate::MAX_MESSAGE_BYTES - overhead);
        assert_eq!(
            ServerMessage::largest_snapshot_message_len(&fits),
            crate::MAX_MESSAGE_BYTES
        );
        assert_eq!(check_agent_limit(&fits), Ok(()));
        let over = document_of_len(crate::MAX_MESSAGE_BYTES - overhead + 1);
        let err = check_agent_limit(&over).unwrap_err();
        assert_eq!(
            err,
            TooLargeForAgents {
                document_len: crate::MAX_MESSAGE_BYTES - overhead + 1,
                message_len: crate::MAX_MESSAGE_BYTES + 1,
                limit: crate::MAX_MESSAGE_BYTES,
            }
        );
        assert!(
            err.to_string()
                .contains("agents decode messages of at most 4194304 bytes"),
            "{err}"
        );
    }
}
