//! The current snapshot, encoded once and shared by every agent stream.
//!
//! Encoding a large snapshot per stream costs more than everything else a push does, so the
//! publisher encodes each version once into a [`pb::ServerMessage`] whose snapshot is kept as
//! bytes; every stream clones the handle (a reference count) and tonic copies the same bytes
//! onto each connection.

use std::sync::Arc;

use retryplane_proto::pb;
use tokio::sync::watch;

use crate::store::VersionRecord;

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
    /// The message every stream sends, encoded once.
    pub message: pb::ServerMessage,
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

    /// Makes `record` the current snapshot and wakes every stream.
    pub fn publish(&self, record: &VersionRecord) -> Arc<Snapshot> {
        let nonce = format!("{}-{}", self.instance, record.meta.version);
        let snapshot = pb::Snapshot {
            version: record.meta.version,
            content_hash: record.meta.content_hash.clone(),
            policies: Some(record.document.clone()),
            nonce: nonce.clone(),
            metrics_interval_ms: self.metrics_interval_ms,
        };
        let published = Arc::new(Snapshot {
            version: record.meta.version,
            content_hash: record.meta.content_hash.clone(),
            nonce,
            document: Arc::new(record.document.clone()),
            message: pb::ServerMessage::with_snapshot(&snapshot),
        });
        self.tx.send_replace(Some(published.clone()));
        published
    }

    /// The current snapshot, if any has been published.
    pub fn current(&self) -> Option<Arc<Snapshot>> {
        self.tx.borrow().clone()
    }

    /// A receiver that sees every later publish.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Snapshot>>> {
        self.tx.subscribe()
    }
}
