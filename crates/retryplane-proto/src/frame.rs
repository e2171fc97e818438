//! `retryplane.v1.ServerMessage` with its snapshot kept encoded.
//!
//! The control plane sends the same snapshot to every agent. Encoding it once and sharing the
//! bytes is what keeps a push to thousands of streams cheap, so the Rust type of
//! `ServerMessage` (mapped with `extern_path` in `build.rs`) holds the encoded `Snapshot` as
//! [`Bytes`]: on the wire a length-delimited bytes field with tag 1 is exactly a `Snapshot`
//! message field with tag 1, so other languages see the `.proto` as written. The other arm of
//! the oneof, `metrics_ack` (tag 2), is an ordinary message field; the constructors set one arm
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
}

impl ServerMessage {
    /// A message carrying `snapshot`, encoded now, once.
    pub fn with_snapshot(snapshot: &pb::Snapshot) -> Self {
        Self {
            snapshot: Some(Bytes::from(snapshot.encode_to_vec())),
            metrics_ack: None,
        }
    }

    /// A message carrying `ack` alone.
    pub fn with_metrics_ack(ack: pb::MetricsAck) -> Self {
        Self {
            snapshot: None,
            metrics_ack: Some(ack),
        }
    }

    /// The snapshot, decoded; `Ok(None)` when the message carries none.
    pub fn decode_snapshot(&self) -> Result<Option<pb::Snapshot>, prost::DecodeError> {
        self.snapshot
            .as_ref()
            .map(|b| pb::Snapshot::decode(b.clone()))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape the `.proto` describes, as prost would generate it.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct AsGenerated {
        #[prost(oneof = "Kind", tags = "1, 2")]
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
}
