//! The current snapshot, encoded once and shared by every agent stream.
//!
//! Encoding a large snapshot per stream costs more than everything else a push does, so the
//! publisher encodes each version once, as the complete gRPC frame of its
//! [`pb::ServerMessage`] ([`crate::frame_body`]); every stream sends a clone of that handle (a
//! reference count), so one allocation serves every connection.

use std::sync::Arc;

use bytes::Bytes;
use retryplane_proto::pb;
use tokio::sync::watch;
use tonic::Status;
use tracing::{error, warn};

use crate::frame_body::{FrameError, encode_frame};
use crate::store::{VersionMeta, VersionRecord};

/// One published version, ready to send.
#[derive(Debug)]
pub struct Snapshot {
    /// The version number.
    pub version: u64,
    /// Content hash (hex SHA-256 of the encoded document).
    pub content_hash: String,
    /// Echoed by agents in Ack/Nack; identifies this push.
    pub nonce: String,
    /// The policies.
    pub document: Arc<pb::PolicyDocument>,
    /// The version's record as it was stored (source, author, time, diff summary): kept so
    /// that the version served can still be read out when the store cannot be (`Get`).
    pub meta: VersionMeta,
    /// The gRPC frame of the `ServerMessage` every stream sends, built once.
    frame: Result<Bytes, FrameError>,
}

impl Snapshot {
    /// What a stream sends for this version: the shared frame (a reference-count clone), or,
    /// for a snapshot too large for agents to decode (a version stored
    /// before Apply refused such policies), the `RESOURCE_EXHAUSTED` status that ends the
    /// stream, naming the size and the limit.
    pub fn frame(&self) -> Result<Bytes, Status> {
        self.frame
            .clone()
            .map_err(|e| Status::resource_exhausted(e.to_string()))
    }
}

/// Holds the current snapshot and wakes streams when it changes.
#[derive(Debug)]
pub struct Publisher {
    tx: watch::Sender<Option<Arc<Snapshot>>>,
    instance: String,
    metrics_interval_ms: u64,
}

impl Publisher {
    /// A publisher with nothing published yet. `metrics_interval_ms` is sent to agents in every
    /// snapshot.
    pub fn new(metrics_interval_ms: u64) -> Self {
        let (tx, _) = watch::channel(None);
        Self {
            tx,
            // Distinguishes pushes of the same version by different server runs.
            instance: format!("{:08x}", fastrand::u32(..)),
            metrics_interval_ms,
        }
    }

    /// The metrics interval sent to agents, in milliseconds.
    pub fn metrics_interval_ms(&self) -> u64 {
        self.metrics_interval_ms
    }

    /// Makes `record` the current snapshot and wakes every stream. Versions only go forward:
    /// a record older than the current snapshot is not published (logged), nor the one served
    /// again (a version's content never changes: nothing to wake anyone for), and the current
    /// snapshot is returned instead.
    pub fn publish(&self, record: &VersionRecord) -> Arc<Snapshot> {
        self.publish_then(record, || {})
    }

    /// [`Publisher::publish`], running `before_wake` once `record` is known to be published and
    /// before any stream is woken (not at all when it is not published): what a stream's
    /// observer reads about the new version (gauges, thresholds) is then set when it sees it.
    pub fn publish_then(
        &self,
        record: &VersionRecord,
        before_wake: impl FnOnce(),
    ) -> Arc<Snapshot> {
        if let Some(current) = self.current()
            && current.version >= record.meta.version
        {
            if current.version > record.meta.version {
                warn!(
                    current = current.version,
                    refused = record.meta.version,
                    "an older version was not published over the current one"
                );
            }
            return current;
        }
        let nonce = self.nonce(record.meta.version);
        let snapshot = pb::Snapshot {
            version: record.meta.version,
            content_hash: record.meta.content_hash.clone(),
            policies: Some(record.document.clone()),
            nonce: nonce.clone(),
            metrics_interval_ms: self.metrics_interval_ms,
        };
        let frame = encode_frame(&pb::ServerMessage::with_snapshot(&snapshot));
        if let Err(e) = &frame {
            error!(version = record.meta.version, error = %e, "cannot frame the snapshot; streams end with an error");
        }
        let published = Arc::new(Snapshot {
            version: record.meta.version,
            content_hash: record.meta.content_hash.clone(),
            nonce,
            document: Arc::new(record.document.clone()),
            meta: record.meta.clone(),
            frame,
        });
        before_wake();
        self.tx.send_replace(Some(published.clone()));
        published
    }

    /// The nonce of `version`'s push by this publisher.
    fn nonce(&self, version: u64) -> String {
        format!("{}-{version}", self.instance)
    }

    /// Whether `nonce` is the nonce this publisher gives `version`'s push.
    pub fn is_nonce_of(&self, nonce: &str, version: u64) -> bool {
        nonce == self.nonce(version)
    }

    /// The current snapshot, if any has been published.
    pub fn current(&self) -> Option<Arc<Snapshot>> {
        self.tx.borrow().clone()
    }

    /// A receiver that sees every later publish.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Snapshot>>> {
        self.tx.subscribe()
    }

    /// How many receivers follow the publisher: one per running agent stream task, plus the
    /// server's own watchers (health until the first publish).
    pub fn subscribers(&self) -> usize {
        self.tx.receiver_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: u64) -> VersionRecord {
        VersionRecord::of_version(version, pb::PolicyDocument::default())
    }

    #[test]
    fn versions_only_go_forward() {
        let publisher = Publisher::new(10_000);
        let mut seen = publisher.subscribe();
        assert_eq!(publisher.publish(&record(2)).version, 2);
        assert!(seen.has_changed().unwrap());
        seen.mark_unchanged();
        // A late publish of an older version (a stale read) changes nothing and wakes no one.
        assert_eq!(publisher.publish(&record(1)).version, 2);
        assert!(!seen.has_changed().unwrap());
        assert_eq!(publisher.current().unwrap().version, 2);
        // Nor does the version served, again.
        assert_eq!(publisher.publish(&record(2)).version, 2);
        assert!(!seen.has_changed().unwrap());
        assert_eq!(publisher.publish(&record(3)).version, 3);
        assert_eq!(publisher.current().unwrap().version, 3);
    }

    #[test]
    fn publish_then_runs_before_any_stream_is_woken_and_only_for_a_published_version() {
        let publisher = Publisher::new(10_000);
        let seen = publisher.subscribe();
        let mut ran = Vec::new();
        publisher.publish_then(&record(2), || {
            assert!(!seen.has_changed().unwrap(), "woken first");
            ran.push(2);
        });
        assert!(seen.has_changed().unwrap());
        publisher.publish_then(&record(1), || ran.push(1));
        publisher.publish_then(&record(2), || ran.push(22));
        assert_eq!(ran, [2]);
    }

    #[test]
    fn a_stored_version_too_large_for_agents_ends_streams_with_resource_exhausted() {
        use retryplane_proto::MAX_MESSAGE_BYTES;

        // Stored before Apply refused such documents: a route path prefix of 4 MiB.
        let document = pb::PolicyDocument {
            endpoints: vec![pb::Endpoint {
                name: "payments".into(),
                routes: vec![pb::Route {
                    r#match: Some(pb::RouteMatch {
                        kind: Some(pb::route_match::Kind::Http(pb::HttpMatch {
                            method: String::new(),
                            path_prefix: format!("/{}", "a".repeat(MAX_MESSAGE_BYTES)),
                        })),
                    }),
                    overlay: None,
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let publisher = Publisher::new(10_000);
        let (log, guard) = crate::test_logs::capture("retryplane_server=warn");
        let published = publisher.publish(&VersionRecord::of_version(7, document));
        drop(guard);
        // Not `unwrap_err`, which would print 4 MiB of frame.
        let Err(status) = published.frame() else {
            panic!("a snapshot too large for agents was framed");
        };
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        let len = prost::Message::encoded_len(publisher.current().unwrap().document.as_ref());
        assert!(len > MAX_MESSAGE_BYTES);
        let message = status.message();
        assert!(
            message.contains("longer than agents decode (at most 4194304 bytes)"),
            "{message}"
        );
        let said_len: usize = message
            .strip_prefix("an encoded message of ")
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{message}"));
        assert!(said_len > len, "{message}");
        let log = log.text();
        assert_eq!(log.matches(" ERROR ").count(), 1, "{log}");
        assert!(log.contains("version=7"), "{log}");
    }

    #[test]
    fn every_frame_is_within_the_largest_snapshot_message_len() {
        // The size check agents' limit is held to (`check_agent_limit`) must bound what this
        // publisher sends, whatever the version and the metrics interval.
        let document = pb::PolicyDocument {
            endpoints: vec![pb::Endpoint {
                name: "payments".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let largest = pb::ServerMessage::largest_snapshot_message_len(&document);
        for interval_ms in [1, 10_000, u64::MAX] {
            let publisher = Publisher::new(interval_ms);
            for version in [1, 300, u64::MAX] {
                assert!(publisher.nonce(version).len() <= retryplane_proto::MAX_NONCE_LEN);
                let published =
                    publisher.publish(&VersionRecord::of_version(version, document.clone()));
                let frame = published.frame().unwrap();
                // The frame is the 5-byte gRPC header and then the message.
                assert!(frame.len() - 5 <= largest, "version {version}");
            }
        }
    }
}
