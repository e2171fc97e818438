//! The policies at start: the file in file mode, the seed of an empty store in API mode.
//!
//! File mode: a valid file is applied as [`Source::File`] (content equal to the stored current
//! version's stores nothing, so a restart with an unchanged file keeps version and hash). An
//! unreadable or invalid file (or one whose snapshot would be larger than agents decode) stops
//! the start when the store is empty — there would be nothing to serve — and otherwise is
//! logged while the stored version keeps being served, exactly as a bad save is while running.
//! So is a valid file the store cannot take (a full disk): it is not counted as read, so the
//! watcher applies it once the store can (at its next rescan at the latest).
//! A file another process holds open for writing ([`crate::writers`]) may be half of a save:
//! it is left to the watcher (started before this read), which reads it once its writer closes
//! it; meanwhile the stored version is served, or, with an empty store, the server runs
//! unready (nothing blocks the start, so a stop signal ends it as usual).
//!
//! API mode: the store is the source of truth. Only an empty store is seeded from the file; a
//! missing seed file stops the start when it was named (`ServeConfig::seed_required`), and
//! otherwise leaves the server unready until the first `retryplane apply`.

use retryplane_policy::diag::LogPath;
use std::io;
use std::path::Path;

use retryplane_policy::Loaded;
use tracing::{error, info, warn};

use super::{ServeConfig, ServeError};
use crate::control::{ChangeContent, ChangeRequest, ControlPlane};
use crate::store::Source;
use crate::watch::{FileAtStart, log_diagnostics, read_policy_file};

/// Loads the policies the server starts with; see the module docs. In file mode, says what
/// became of the file, for the watcher: its bytes once they are settled, or that it was left
/// to its writer; `None` when it was not read, or read but not settled (API mode, a read that
/// failed, a store that did not take it).
pub(super) async fn load_policies(
    control: &ControlPlane,
    cfg: &ServeConfig,
) -> Result<Option<FileAtStart>, ServeError> {
    let file = cfg.config_file.as_path();
    let current = control
        .blocking(|s| s.current())
        .await
        .map_err(ServeError::ReadStore)?;
    let stored = current.as_ref().map(|record| record.meta.version);
    // Whose change the current version is: in file mode, one the admin API made (a control
    // plane that ran with `--api` on this data directory) is replaced by the file's content.
    let applied_through_api = current
        .as_ref()
        .filter(|record| record.meta.source != crate::store::Source::File)
        .map(|record| (record.meta.version, record.meta.source.as_str()));
    let reload_ok = &control.metrics.config_last_reload_successful;
    if cfg.api_mode {
        // The file is not watched: nothing about it to alert on.
        reload_ok.set(1);
        if let Some(version) = stored {
            info!(
                version,
                "API mode: serving the stored version; the policy file is not read"
            );
            return Ok(None);
        }
        return match read_policy_file(file).await {
            Err(e) if e.kind() == io::ErrorKind::NotFound && !cfg.seed_required => {
                warn!(file = %LogPath(file), "API mode: the store is empty and there is no seed file; not ready until the first `retryplane apply`");
                Ok(None)
            }
            Err(source) => Err(read_error(file, source)),
            Ok((_, loaded)) => {
                apply_valid(control, file, loaded, None).await?;
                info!(file = %LogPath(file), "API mode: seeded the empty store from the policy file");
                Ok(None)
            }
        };
    }
    // A writer holds the file open (a deploy that restarts the control plane while `scp` or a
    // generator still writes it): what is there may be half of its save. The watcher, started
    // before this read, reads it once the writer closes it, as it does any save.
    if crate::writers::held_open_for_writing_off_thread(file).await {
        match stored {
            // Nothing failed: the stored version, a good read's, is served and the server
            // ready, as when a running server waits for a writer (an alert on the gauge would
            // fire at every restart that met `scp` writing the file).
            Some(version) => {
                reload_ok.set(1);
                info!(file = %LogPath(file), version, "the policy file is open for writing by another process; serving the stored version until its writer closes it");
            }
            None => {
                warn!(file = %LogPath(file), "the policy file is open for writing by another process and the store is empty: not ready until its writer closes it");
            }
        }
        return Ok(Some(FileAtStart::LeftToItsWriter));
    }
    let (bytes, loaded) = match (read_policy_file(file).await, stored) {
        (Ok(read), _) => read,
        (Err(source), None) => return Err(read_error(file, source)),
        (Err(e), Some(version)) => {
            error!(file = %LogPath(file), error = %e, version, "cannot read the policy file; serving the stored version");
            control.note_file_read(Err(crate::watch::cannot_read(&e)));
            return Ok(None);
        }
    };
    match stored {
        Some(version) if loaded.has_errors() => {
            log_diagnostics(file, &loaded);
            control.metrics.rejected_changes.inc();
            control.note_file_read(Err(crate::control::errors_in_brief(&loaded.diagnostics)));
            error!(file = %LogPath(file), version, "the policy file is invalid; serving the stored version until it is fixed");
        }
        _ => {
            if let Some((version, source)) = applied_through_api {
                warn!(file = %LogPath(file), version, source, "file mode: the current version came from the admin API, and the policy file is applied over it (a new version if it differs; refused if it removes every stored endpoint); start with `--api` to keep serving what the admin API applied");
            }
            match apply_valid(control, file, loaded, stored).await? {
                StartChange::Applied => control.note_file_read(Ok(())),
                StartChange::Refused(why) => control.note_file_read(Err(why)),
                // Not settled: the watcher reads the file again (at its next rescan at the
                // latest).
                StartChange::NotStored(why) => {
                    control.note_file_read(Err(why));
                    return Ok(None);
                }
            }
        }
    }
    Ok(Some(FileAtStart::Settled(bytes)))
}

fn read_error(file: &Path, source: io::Error) -> ServeError {
    ServeError::ReadConfig {
        file: file.to_owned(),
        source,
    }
}

/// What became of the policy file at start, when the store holds a version.
enum StartChange {
    /// Applied, or equal to the stored version.
    Applied,
    /// Refused for removing every stored endpoint, or for being larger than agents decode
    /// (why, on one line).
    Refused(String),
    /// Valid, but the store could not take it (a full disk, say): the stored version is
    /// served, and the file is to be read again (why, on one line).
    NotStored(String),
}

/// Applies `loaded` as [`Source::File`]; `Err` when it has errors, or cannot be applied and
/// there is no `stored` version to serve instead (see [`StartChange`] for the other outcomes).
async fn apply_valid(
    control: &ControlPlane,
    file: &Path,
    loaded: Loaded,
    stored: Option<u64>,
) -> Result<StartChange, ServeError> {
    let Some(policies) = loaded.policies.as_ref() else {
        return Err(ServeError::InvalidConfig {
            file: file.to_owned(),
            problems: loaded
                .diagnostics
                .iter()
                .map(|d| format!("{}:{d}", file.display()))
                .collect(),
        });
    };
    log_diagnostics(file, &loaded);
    let request = ChangeRequest {
        content: ChangeContent::Loaded {
            policies: policies.clone(),
            warnings: loaded.diagnostics.clone(),
        },
        source: Source::File,
        author: None,
        expected_version: None,
        dry_run: false,
        force: false,
        keep_endpoints: false,
    };
    match control.apply(request).await {
        Ok(outcome) if !outcome.changed => {
            info!(file = %LogPath(file), "the policy file matches the stored version");
            Ok(StartChange::Applied)
        }
        Ok(outcome) => {
            // A file read at start that removes endpoints the store served before: a
            // `--config` that is not the file meant takes them from the whole fleet. Said
            // where an operator looks; an edit that removes none (a deploy's usual edit, then
            // restart) is the publish's usual info line.
            let removes = outcome
                .diff
                .iter()
                .any(|c| c.kind == retryplane_policy::diff::ChangeKind::Removed);
            if let (Some(before), Some(record), true) = (stored, outcome.record.as_ref(), removes) {
                warn!(file = %LogPath(file), before, version = record.meta.version, summary = %retryplane_policy::diag::LogValue(&record.meta.summary), "the policy file read at start removes endpoints the version served before it had: published as a new version (if this is not the file meant, restart with the right --config, or put the file back: file mode publishes what it holds)");
            }
            Ok(StartChange::Applied)
        }
        // The stored version keeps being served, as for a bad save while running.
        Err(crate::control::ChangeError::RemovesEverything(names)) => {
            // As many names as fit one readable line, as the watcher's warning has them.
            let names = crate::admin::capped_list(&names, ", ", 1_000, "endpoint", "");
            error!(file = %LogPath(file), "the policy file removes every stored endpoint ({names}); refused, serving the stored version. To replace every endpoint, add the new ones first, then remove the old ones");
            Ok(StartChange::Refused(crate::watch::removes_everything(
                &names,
            )))
        }
        Err(e @ crate::control::ChangeError::TooLarge(_)) if stored.is_some() => {
            error!(file = %LogPath(file), error = %e, version = stored, "the policy file was not applied; serving the stored version");
            Ok(StartChange::Refused(e.to_string()))
        }
        // As while running: the store keeps what it holds and is tried again at the next read.
        Err(
            crate::control::ChangeError::Store(e) | crate::control::ChangeError::StoreUncertain(e),
        ) if stored.is_some() => {
            error!(file = %LogPath(file), error = %crate::ErrorChain(&e), version = stored, "cannot store the policy file's version; serving the stored version and reading the file again later");
            Ok(StartChange::NotStored(crate::watch::cannot_store(&e)))
        }
        Err(source) => Err(ServeError::Apply {
            file: file.to_owned(),
            source,
        }),
    }
}
