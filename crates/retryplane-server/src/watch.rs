//! File mode hot reload (SPEC §3): a saved edit of the policy file is validated and published.
//!
//! The watch is on the file's *parent directory*, not the file: editors and `sed -i` save by
//! writing a new file and renaming it over the old one, which replaces the inode a file watch
//! would be attached to. Events are filtered by file name and debounced — a reload starts after
//! [`DEBOUNCE`] without further events — so a save that arrives as several writes (or a rename
//! plus a chmod) is read once, complete.
//!
//! A reload reads the file (at most [`MAX_FILE_BYTES`] + 1 bytes; the validator reports a larger
//! file), loads it with the validator `retryplane validate` runs, and hands the document to
//! [`ControlPlane::apply`] as [`Source::File`]. An invalid save is logged, one warning per
//! problem as `FILE:LINE:COLUMN: error: PATH: message`, counted in
//! `retryplane_server_rejected_changes`, and the last good version stays served. Content equal
//! to the current version's publishes nothing.
//!
//! notify calls back on its own thread; the callback only forwards a wake-up into a
//! one-slot tokio channel with `try_send` (a full slot already means "look again").

use std::ffi::OsString;
use std::io::{self, Read as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use retryplane_policy::Loaded;
use retryplane_policy::yaml::MAX_FILE_BYTES;
use retryplane_proto::pb;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::control::{ChangeError, ChangeRequest, ControlPlane};
use crate::store::Source;

/// Quiet time after the last event before the file is read.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// Why the file cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The path names no file.
    #[error("the policy file path {} has no file name", .0.display())]
    NoFileName(PathBuf),
    /// The directory cannot be watched.
    #[error("cannot watch the directory {} for changes to the policy file", dir.display())]
    Watch {
        /// The watched directory.
        dir: PathBuf,
        /// What notify said.
        #[source]
        source: notify::Error,
    },
}

/// Reads and loads a policy file, off the async threads. `Err` only when it cannot be read.
pub async fn read_policy_file(path: &Path) -> io::Result<Loaded> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(&path)?;
        let mut bytes = Vec::new();
        // One byte more than allowed, so the validator reports an oversized file.
        let limit = u64::try_from(MAX_FILE_BYTES).map_or(u64::MAX, |m| m + 1);
        file.take(limit).read_to_end(&mut bytes)?;
        Ok(retryplane_policy::load(&bytes))
    })
    .await
    .map_err(io::Error::other)?
}

/// Logs every diagnostic of `file` at warn, as `FILE:LINE:COLUMN: SEVERITY: PATH: MESSAGE`.
pub fn log_diagnostics(file: &Path, loaded: &Loaded) {
    for diag in &loaded.diagnostics {
        warn!("{}:{diag}", file.display());
    }
}

/// Starts watching `file`; the task reloads it on every (debounced) save until `shutdown`
/// becomes true or its sender is dropped. Call inside a tokio runtime.
pub fn spawn(
    control: Arc<ControlPlane>,
    file: PathBuf,
    debounce: Duration,
    shutdown: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, WatchError> {
    let name = file
        .file_name()
        .map(OsString::from)
        .ok_or_else(|| WatchError::NoFileName(file.clone()))?;
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let (tx, rx) = mpsc::channel(1);
    let watched = name.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
        match event {
            Ok(event) if concerns(&event, &watched) => {
                // Full: a wake-up is already pending. Closed: the task is gone.
                let _ = tx.try_send(());
            }
            Ok(_) => {}
            Err(e) => debug!(error = %e, "file watch error"),
        }
    })
    .map_err(|source| WatchError::Watch {
        dir: dir.clone(),
        source,
    })?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|source| WatchError::Watch {
            dir: dir.clone(),
            source,
        })?;
    info!(file = %file.display(), "watching the policy file for changes");
    Ok(tokio::spawn(run(
        control, file, debounce, rx, shutdown, watcher,
    )))
}

/// Whether `event` may have changed the file called `name`. Reads (ours included) do not.
fn concerns(event: &Event, name: &OsString) -> bool {
    let read_only = matches!(
        event.kind,
        EventKind::Access(
            AccessKind::Open(_) | AccessKind::Read | AccessKind::Close(AccessMode::Read)
        )
    );
    !read_only
        && event
            .paths
            .iter()
            .any(|p| p.file_name() == Some(name.as_os_str()))
}

async fn run(
    control: Arc<ControlPlane>,
    file: PathBuf,
    debounce: Duration,
    mut events: mpsc::Receiver<()>,
    mut shutdown: watch::Receiver<bool>,
    // Watching stops when the watcher is dropped, with this task.
    _watcher: RecommendedWatcher,
) {
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            event = events.recv() => if event.is_none() { return },
        }
        // Debounce: wait for a quiet period.
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                event = tokio::time::timeout(debounce, events.recv()) => match event {
                    Ok(Some(())) => {}
                    Ok(None) => return,
                    Err(_quiet) => break,
                },
            }
        }
        reload(&control, &file).await;
    }
}

/// Reads `file` and applies it; on any problem logs it and keeps the current version.
pub async fn reload(control: &ControlPlane, file: &Path) {
    let serving = || {
        control.publisher.current().map_or_else(
            || "nothing".to_owned(),
            |s| format!("version {}", s.version),
        )
    };
    let loaded = match read_policy_file(file).await {
        Ok(loaded) => loaded,
        Err(e) => {
            warn!(file = %file.display(), error = %e, "cannot read the policy file; still serving {}", serving());
            return;
        }
    };
    log_diagnostics(file, &loaded);
    let Some(policies) = loaded.policies else {
        control.metrics.rejected_changes.inc();
        warn!(file = %file.display(), "the policy file has errors; the change is rejected and {} stays served", serving());
        return;
    };
    let request = ChangeRequest {
        document: pb::PolicyDocument::from(policies.document().as_ref()),
        source: Source::File,
        author: None,
        expected_version: None,
        dry_run: false,
        force: false,
    };
    match control.apply(request).await {
        Ok(outcome) if !outcome.changed => {
            debug!(file = %file.display(), "the policy file was saved without changes");
        }
        Ok(_) => {}
        Err(ChangeError::RemovesEverything(names)) => warn!(
            file = %file.display(),
            "the saved file removes every endpoint ({names}); refused, {} stays served. To replace \
             every endpoint, add the new ones first, save, then remove the old ones",
            serving()
        ),
        Err(e) => {
            warn!(file = %file.display(), error = %e, "the saved policy file was not applied; {} stays served", serving())
        }
    }
}

#[cfg(test)]
#[path = "watch_tests.rs"]
mod tests;
