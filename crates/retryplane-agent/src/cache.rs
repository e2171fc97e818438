//! The cache file: the last applied snapshot, encoded as a `retryplane.v1.Snapshot`, so a
//! restarted agent starts on its last good policies when the control plane is unreachable.
//!
//! Written atomically after every applied snapshot: a temporary file in the same directory is
//! written and fsynced, then renamed over the cache file, and the directory is fsynced, so a
//! crash leaves either the old file or the new one, never a torn one. Read at start; a missing,
//! unreadable, corrupt or invalid file is logged and ignored. The metrics interval the control
//! plane set in that snapshot applies again from the start, as it did before the restart: a
//! control plane that finds the agent up to date sends it nothing.

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use prost::Message as _;
use retryplane_proto::{convert, pb};
use tracing::{info, warn};

use crate::snapshot::{PolicySnapshot, Source};

/// Largest cache file read.
const MAX_BYTES: u64 = 16 * 1024 * 1024;

/// Writes `bytes` to `path` atomically.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "cache".to_owned());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable; not every platform can open a directory.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// What a valid cache file gives back.
#[derive(Debug)]
pub(crate) struct Cached {
    /// The last applied snapshot.
    pub(crate) snapshot: PolicySnapshot,
    /// The metrics interval the control plane set with it; `None` when it left it to the agent.
    pub(crate) metrics_interval: Option<Duration>,
}

/// The snapshot kept in `path`, if it is there and valid.
pub(crate) fn load(path: &Path) -> Option<Cached> {
    let bytes = match read(path) {
        Ok(Some(b)) => b,
        Ok(None) => return None,
        Err(e) => {
            warn!(file = %path.display(), error = %e, "cannot read the policy cache; ignored");
            return None;
        }
    };
    match decode(&bytes) {
        Ok(cached) => {
            info!(file = %path.display(), version = cached.snapshot.version(), "starting on cached policies");
            Some(cached)
        }
        Err(reason) => {
            warn!(file = %path.display(), %reason, "the policy cache is not usable; ignored");
            None
        }
    }
}

fn read(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read as _;
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    f.take(MAX_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(std::io::Error::other("the cache file is too large"));
    }
    Ok(Some(bytes))
}

fn decode(bytes: &[u8]) -> Result<Cached, String> {
    let snap = pb::Snapshot::decode(bytes).map_err(|e| format!("not a snapshot: {e}"))?;
    let doc = snap.policies.ok_or("the snapshot holds no policies")?;
    if convert::content_hash(&doc) != snap.content_hash {
        return Err("content hash does not match".into());
    }
    let (set, _) = convert::validate(doc).map_err(|errors| {
        format!(
            "invalid policies: {}",
            errors.first().map(ToString::to_string).unwrap_or_default()
        )
    })?;
    let metrics_interval = match snap.metrics_interval_ms {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    };
    Ok(Cached {
        snapshot: PolicySnapshot::build(set, snap.version, snap.content_hash, Source::Cache, None),
        metrics_interval,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_snapshot_loads_back_and_garbage_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.cache");
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  a: {max_attempts: 4}\n")
            .policies
            .unwrap();
        let doc = pb::PolicyDocument::from(set.document().as_ref());
        let snap = pb::Snapshot {
            version: 9,
            content_hash: convert::content_hash(&doc),
            policies: Some(doc),
            nonce: "n".into(),
            metrics_interval_ms: 0,
        };
        write_atomic(&path, &snap.encode_to_vec()).unwrap();
        let loaded = load(&path).unwrap();
        assert_eq!(
            (loaded.snapshot.version(), loaded.snapshot.source()),
            (9, Source::Cache)
        );
        assert_eq!(loaded.metrics_interval, None, "left to the agent");
        let set_by_server = pb::Snapshot {
            metrics_interval_ms: 250,
            ..snap
        };
        write_atomic(&path, &set_by_server.encode_to_vec()).unwrap();
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.metrics_interval, Some(Duration::from_millis(250)));
        std::fs::write(&path, b"garbage").unwrap();
        assert!(load(&path).is_none());
        assert!(load(&dir.path().join("missing")).is_none());
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }
}
