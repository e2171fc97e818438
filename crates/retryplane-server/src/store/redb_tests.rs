//! Tests of the embedded backend beyond the [`VersionStore`] contract: reopening, locking, and
//! refusing inconsistent data on open.

use std::ops::Bound;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ::redb::BackendError;
use prost::Message as _;

use retryplane_proto::{convert::content_hash, pb};

use super::redb::REOPEN_INTERVAL;
use super::tests::{publish_new, version_of};
use super::{RedbStore, Source, StoreError, VersionStore};

const VERSIONS: ::redb::TableDefinition<'_, u64, &[u8]> = ::redb::TableDefinition::new("versions");
const META: ::redb::TableDefinition<'_, &str, u64> = ::redb::TableDefinition::new("meta");

/// Writes into the store's file directly, as something other than the store would.
fn tamper(dir: &Path, change: impl FnOnce(&::redb::WriteTransaction)) {
    let db = ::redb::Database::create(dir.join("retryplane.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    change(&txn);
    txn.commit().unwrap();
}

/// Creates a store in `dir` holding version 1, and closes it.
fn store_with_one_version(dir: &Path) {
    let store = RedbStore::open(dir).unwrap();
    publish_new(&store, "a");
}

fn open_err(dir: &Path) -> StoreError {
    RedbStore::open(dir).map(|_| ()).unwrap_err()
}

#[test]
fn open_creates_the_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a/b");
    let store = RedbStore::open(&data).unwrap();
    assert_eq!(store.path(), data.join("retryplane.redb"));
    assert!(store.path().is_file());
}

#[test]
fn a_file_where_the_data_directory_should_be_is_named_as_such_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::write(&data, b"not a directory").unwrap();
    let err = RedbStore::open(&data).err().map(|e| e.to_string());
    assert_eq!(
        err,
        Some(format!(
            "the data directory {} exists and is not a directory",
            data.display()
        ))
    );
    assert_eq!(std::fs::read(&data).unwrap(), b"not a directory");
}

#[test]
fn reopening_after_drop_serves_the_same_version_and_hash() {
    let dir = tempfile::tempdir().unwrap();
    let (before, history) = {
        let store = RedbStore::open(dir.path()).unwrap();
        publish_new(&store, "a");
        store
            .publish(version_of("b", Source::Rollback { from: 1 }), None)
            .unwrap();
        (
            store.current().unwrap().unwrap(),
            store.history(0, None).unwrap(),
        )
    };
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap().unwrap(), before);
    assert_eq!(store.history(0, None).unwrap(), history);
    assert_eq!(before.meta.version, 2);
    assert_eq!(
        before.meta.content_hash,
        version_of("b", Source::File).content_hash
    );
    assert_eq!(publish_new(&store, "c"), 3);
}

#[test]
fn a_document_keeps_its_endpoint_order_and_hash_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let mut new = version_of("b", Source::File);
    new.document.endpoints.push(pb::Endpoint {
        name: "a".to_owned(),
        ..Default::default()
    });
    // The canonical hash sorts endpoints; the stored document does not.
    new.content_hash = content_hash(&new.document);
    let published = RedbStore::open(dir.path())
        .unwrap()
        .publish(new.clone(), None)
        .unwrap();
    assert!(published.is_new());

    let store = RedbStore::open(dir.path()).unwrap();
    let current = store.current().unwrap().unwrap();
    assert_eq!(current.document, new.document);
    assert_eq!(current.meta.content_hash, new.content_hash);
}

/// The store file deleted under an open store (an operator's `rm`, a volume's clean-up)
/// takes redb's lock with it; the directory's own lock still refuses a second store there,
/// and is let go with the first.
#[cfg(unix)]
#[test]
fn a_store_whose_file_was_deleted_still_holds_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    std::fs::remove_file(store.path()).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::InUse { dir: d, linked: None } if d == dir.path()),
        "{err:?}"
    );
    assert!(!store.path().exists(), "no second store was made");
    drop(store);
    RedbStore::open(dir.path()).unwrap();
}

/// A store file that is a link, whose target another store holds: the error says the link's
/// target is what is in use, not the directory (whose own lock was free).
#[cfg(unix)]
#[test]
fn a_store_file_linked_to_one_in_use_is_named_by_its_target() {
    let first = tempfile::tempdir().unwrap();
    let store = RedbStore::open(first.path()).unwrap();
    let second = tempfile::tempdir().unwrap();
    let link = second.path().join(store.path().file_name().unwrap());
    std::os::unix::fs::symlink(store.path(), &link).unwrap();
    let err = open_err(second.path());
    let target = std::fs::canonicalize(store.path()).unwrap();
    assert!(
        matches!(&err, StoreError::InUse { dir, linked: Some(to) } if dir == second.path() && *to == target),
        "{err:?}"
    );
    assert!(
        err.to_string().ends_with(&format!(
            "is a link to {}, which another retryplane process holds",
            target.display()
        )),
        "{err}"
    );
}

#[test]
fn a_second_open_of_the_same_directory_reports_it_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let _store = RedbStore::open(dir.path()).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::InUse { dir: d, linked: None } if d == dir.path()),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("in use by another retryplane process"),
        "{message}"
    );
    assert!(
        message.contains(&dir.path().display().to_string()),
        "{message}"
    );
}

#[test]
fn garbage_in_the_current_record_is_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    tamper(dir.path(), |txn| {
        let mut versions = txn.open_table(VERSIONS).unwrap();
        versions
            .insert(1, b"\xff\xff\xff garbage".as_slice())
            .unwrap();
    });
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::Corrupt(m) if m.contains("version 1")),
        "{err:?}"
    );
}

#[test]
fn a_record_written_by_a_newer_release_is_refused_as_such_not_as_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    tamper(dir.path(), |txn| {
        use ::redb::ReadableTable as _;
        let mut versions = txn.open_table(VERSIONS).unwrap();
        let mut bytes = versions.get(1).unwrap().unwrap().value().to_vec();
        // The record starts with its format: field 1, a varint, 2.
        assert_eq!(bytes[..2], [0x08, 0x02]);
        bytes[1] = 0x03;
        versions.insert(1, bytes.as_slice()).unwrap();
    });
    let err = open_err(dir.path());
    assert!(
        matches!(
            err,
            StoreError::NewerFormat {
                version: 1,
                format: 3,
                supported: 2
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("newer retryplane"), "{err}");
}

#[test]
fn a_record_whose_document_does_not_match_its_checksum_is_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    tamper(dir.path(), |txn| {
        use ::redb::ReadableTable as _;
        let mut versions = txn.open_table(VERSIONS).unwrap();
        let mut bytes = versions.get(1).unwrap().unwrap().value().to_vec();
        // The document's (compressed) bytes come last.
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        versions.insert(1, bytes.as_slice()).unwrap();
    });
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::Corrupt(m) if m.contains("hashes to")),
        "{err:?}"
    );
}

/// A store an older release wrote (records of format 1, documents not compressed) is read as
/// it was, and the versions published into it later are compressed beside them.
#[test]
fn records_of_the_uncompressed_format_are_read_beside_compressed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (before, history) = {
        let store = RedbStore::open(dir.path()).unwrap();
        publish_new(&store, "a");
        (
            store.current().unwrap().unwrap(),
            store.history(0, None).unwrap(),
        )
    };
    let encoded = before.document.encode_to_vec();
    tamper(dir.path(), |txn| {
        use ::redb::ReadableTable as _;
        let mut versions = txn.open_table(VERSIONS).unwrap();
        let record = versions.get(1).unwrap().unwrap().value().to_vec();
        let old = super::redb::with_document(&record, 1, encoded.clone());
        assert_eq!(old[..2], [0x08, 0x01]);
        versions.insert(1, old.as_slice()).unwrap();
    });
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap().unwrap(), before);
    assert_eq!(store.history(0, None).unwrap(), history);
    publish_new(&store, "b");
    assert_eq!(store.get(1).unwrap().unwrap(), before);
    assert_eq!(store.current().unwrap().unwrap().meta.version, 2);
    drop(store);
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.get(1).unwrap().unwrap(), before);
    assert_eq!(store.history(0, None).unwrap().len(), 2);
}

/// Each version keeps its whole document, compressed: endpoints that share their settings
/// take a fraction of their encoding.
#[test]
fn a_document_is_stored_compressed() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    let document = pb::PolicyDocument {
        defaults: None,
        endpoints: (0..1_000)
            .map(|i| pb::Endpoint {
                name: format!("svc-{i:04}"),
                overlay: Some(pb::Overlay {
                    max_attempts: Some(3),
                    deadline_ms: Some(2_000),
                    per_try_timeout_ms: Some(500),
                    idempotency_key_header: Some("Idempotency-Key".to_owned()),
                    ..Default::default()
                }),
                routes: Vec::new(),
            })
            .collect(),
    };
    let encoded = document.encode_to_vec();
    store
        .publish(
            super::NewVersion {
                content_hash: content_hash(&document),
                document: document.clone(),
                source: Source::Admin,
                author: None,
                summary: String::new(),
                created_unix_ms: 1_700_000_000_000,
            },
            None,
        )
        .unwrap();
    drop(store);
    let mut stored = 0;
    tamper(dir.path(), |txn| {
        use ::redb::ReadableTable as _;
        let versions = txn.open_table(VERSIONS).unwrap();
        stored = versions.get(1).unwrap().unwrap().value().len();
    });
    assert!(
        stored * 5 < encoded.len(),
        "{stored} bytes stored for an encoding of {}",
        encoded.len()
    );
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap().unwrap().document, document);
}

/// Stored bytes that are not DEFLATE, or that inflate past any document's size, behind a
/// checksum that matches them (a bug of a writer, not the disk's damage), are corrupt.
#[test]
fn a_document_that_cannot_be_decompressed_or_inflates_too_far_is_corrupt() {
    for (document, says) in [
        (b"not deflate at all".to_vec(), "cannot be decompressed"),
        (
            super::compress_document(&vec![0; (64 << 20) + 1]).unwrap(),
            "decompresses to more than",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        store_with_one_version(dir.path());
        tamper(dir.path(), |txn| {
            use ::redb::ReadableTable as _;
            let mut versions = txn.open_table(VERSIONS).unwrap();
            let record = versions.get(1).unwrap().unwrap().value().to_vec();
            let bad = super::redb::with_document(&record, 2, document.clone());
            versions.insert(1, bad.as_slice()).unwrap();
        });
        let err = open_err(dir.path());
        assert!(
            matches!(&err, StoreError::Corrupt(m) if m.contains("version 1") && m.contains(says)),
            "{err:?}"
        );
    }
}

#[test]
fn a_current_version_without_its_record_is_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    tamper(dir.path(), |txn| {
        txn.open_table(META).unwrap().insert("current", 2).unwrap();
    });
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::Corrupt(m) if m.contains("current version is 2")),
        "{err:?}"
    );
}

#[test]
fn records_without_a_current_version_are_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    tamper(dir.path(), |txn| {
        txn.open_table(META).unwrap().remove("current").unwrap();
    });
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::Corrupt(m) if m.contains("no current")),
        "{err:?}"
    );
}

#[test]
fn a_file_that_is_not_a_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("retryplane.redb"), vec![0x5a; 8192]).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, StoreError::Corrupt(m) if m.contains("not a redb file") && m.ends_with("move it aside")),
        "{err:?}"
    );
}

#[test]
fn a_store_file_cut_short_inside_its_header_is_corrupt_not_unreadable() {
    for keep in [9, 100, 200] {
        let dir = tempfile::tempdir().unwrap();
        store_with_one_version(dir.path());
        let file = dir.path().join("retryplane.redb");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..keep]).unwrap();
        let err = open_err(dir.path());
        assert!(
            matches!(&err, StoreError::Corrupt(m) if m.contains("is truncated") && m.ends_with("move it aside")),
            "{keep}: {err:?}"
        );
        assert_eq!(
            std::fs::read(&file).unwrap(),
            &bytes[..keep],
            "left as it was"
        );
    }
}

#[test]
fn a_damaged_page_is_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    let file = dir.path().join("retryplane.redb");
    let mut bytes = std::fs::read(&file).unwrap();
    // Every page but the header: redb's checksums catch it instead of trusting the file.
    for offset in (4096..bytes.len()).step_by(4096) {
        bytes[offset + 100..offset + 200].fill(0xa5);
    }
    std::fs::write(&file, bytes).unwrap();
    let err = open_err(dir.path());
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
}

/// A disk that fills up on demand: while `full` is set, every write, sync and resize fails as
/// on a full disk. Reads and locks go to redb's own file backend.
#[derive(Debug)]
struct FillingDisk {
    file: ::redb::backends::FileBackend,
    full: Arc<AtomicBool>,
    /// When not 0: the sync that many syncs from now fails (once), as on a disk that fills up
    /// between a commit's writes and its last flush.
    fail_sync_in: Arc<AtomicUsize>,
}

impl FillingDisk {
    fn space(&self) -> std::io::Result<()> {
        if self.full.load(Ordering::SeqCst) {
            Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "No space left on device",
            ))
        } else {
            Ok(())
        }
    }
}

impl ::redb::StorageBackend for FillingDisk {
    fn len(&self) -> std::io::Result<u64> {
        self.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.file.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.space()?;
        self.file.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.space()?;
        let countdown = self
            .fail_sync_in
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if countdown == Ok(1) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "No space left on device",
            ));
        }
        self.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.space()?;
        self.file.write(offset, data)
    }

    fn close(&self) -> std::io::Result<()> {
        self.file.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}

/// A store in `dir` on a [`FillingDisk`] that fills up while `full` is set, on every open;
/// `opens` counts the opens (the first one included).
fn store_on_a_filling_disk(
    dir: &Path,
    full: &Arc<AtomicBool>,
    opens: &Arc<AtomicUsize>,
) -> RedbStore {
    store_on_a_failing_disk(dir, full, opens, &Arc::default())
}

/// [`store_on_a_filling_disk`], whose syncs also fail as `fail_sync_in` says.
fn store_on_a_failing_disk(
    dir: &Path,
    full: &Arc<AtomicBool>,
    opens: &Arc<AtomicUsize>,
    fail_sync_in: &Arc<AtomicUsize>,
) -> RedbStore {
    let full = full.clone();
    let opens = opens.clone();
    let fail_sync_in = fail_sync_in.clone();
    RedbStore::open_with(
        dir,
        Box::new(move |path| {
            opens.fetch_add(1, Ordering::SeqCst);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)?;
            let disk = FillingDisk {
                file: ::redb::backends::FileBackend::new(file)?,
                full: full.clone(),
                fail_sync_in: fail_sync_in.clone(),
            };
            ::redb::Database::builder()
                .set_check_integrity_on_open(true)
                .create_with_backend(disk)
        }),
    )
    .unwrap()
}

fn says_no_space(error: &StoreError) -> bool {
    crate::ErrorChain(error)
        .to_string()
        .contains("No space left on device")
}

/// A restart during a disk-full incident: opening a store writes nothing, so it serves what it
/// holds (writes fail until there is room). Needs root (skipped otherwise).
#[cfg(target_os = "linux")]
#[test]
fn a_store_opens_on_a_full_disk_and_serves_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let Some(disk) = crate::test_disk::SmallDisk::mount(dir.path(), "1m") else {
        return;
    };
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(publish_new(&store, "a"), 1);
    drop(store);
    disk.fill();
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
    drop(store);
    drop(disk);
}

/// The store's file deleted (a cleanup script, a restore done under a running control plane):
/// a publish would go into a file no later start opens, and be lost. Refused, saying so; reads
/// go on. The same for another file put at the path.
#[cfg(unix)]
#[test]
fn a_store_whose_file_was_deleted_or_replaced_stores_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(publish_new(&store, "a"), 1);
    let path = dir.path().join("retryplane.redb");
    std::fs::remove_file(&path).unwrap();
    let refused = store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert!(
        matches!(&refused, StoreError::FileReplaced { path: p, .. } if *p == path),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("deleted or replaced"),
        "{refused}"
    );
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
    std::fs::write(&path, b"another file").unwrap();
    let refused = store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert!(
        matches!(refused, StoreError::FileReplaced { .. }),
        "{refused:?}"
    );
    assert_eq!(store.history(0, None).unwrap().len(), 1);
}

/// The check the control plane runs between changes ([`VersionStore::check`]) passes on a
/// store that reads and can be written, and fails once its file is deleted or replaced, which
/// nothing else shows until the next change (or a restart that creates a new, empty store).
#[cfg(unix)]
#[test]
fn the_check_fails_once_the_store_file_is_deleted_or_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    store.check().unwrap();
    assert_eq!(publish_new(&store, "a"), 1);
    store.check().unwrap();
    let path = dir.path().join("retryplane.redb");
    std::fs::remove_file(&path).unwrap();
    let failed = store.check().unwrap_err();
    assert!(
        matches!(&failed, StoreError::FileReplaced { path: p, .. } if *p == path),
        "{failed:?}"
    );
    // Where to copy the old file from: the descriptor that holds it, on Linux.
    #[cfg(target_os = "linux")]
    {
        let StoreError::FileReplaced {
            descriptor: Some(fd),
            ..
        } = &failed
        else {
            panic!("no descriptor found: {failed:?}");
        };
        let held = std::fs::read(format!("/proc/self/fd/{fd}")).unwrap();
        assert!(
            held.len() > 4_096,
            "the old store file, whole: {} bytes",
            held.len()
        );
        assert!(
            failed
                .to_string()
                .contains(&format!("/fd/{fd} before the restart")),
            "{failed}"
        );
    }
    std::fs::write(&path, b"another file").unwrap();
    let failed = store.check().unwrap_err();
    assert!(
        matches!(failed, StoreError::FileReplaced { .. }),
        "{failed:?}"
    );
}

/// The file system under an open store turned read-only, as ext4 does after a disk error: the
/// check says so, a change is refused before its commit, and every version stays readable. (A
/// commit that failed on it closed the database to read the file afresh, which the read-only
/// file system refused: every read failed from then on.) Needs root (skipped otherwise).
#[cfg(target_os = "linux")]
#[test]
fn a_store_whose_file_system_turns_read_only_refuses_changes_and_still_reads() {
    let dir = tempfile::tempdir().unwrap();
    let Some(disk) = crate::test_disk::Ext4Disk::mount(dir.path()) else {
        return;
    };
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(publish_new(&store, "a"), 1);
    assert_eq!(publish_new(&store, "b"), 2);
    disk.fail();
    let read_only = |error: &StoreError| matches!(error, StoreError::NotWritable { why, .. } if why.contains("read-only"));
    let failed = store.check().unwrap_err();
    assert!(read_only(&failed), "{failed:?}");
    let refused = store
        .publish(version_of("c", Source::Admin), None)
        .unwrap_err();
    assert!(read_only(&refused), "{refused:?}");
    assert!(
        refused.to_string().contains("cannot be written"),
        "{refused}"
    );
    assert_eq!(store.current().unwrap().unwrap().meta.version, 2);
    assert_eq!(store.get(1).unwrap().unwrap().meta.version, 1);
    assert_eq!(store.history(0, None).unwrap().len(), 2);
    let failed = store.check().unwrap_err();
    assert!(read_only(&failed), "{failed:?}");
    drop(store);
    drop(disk);
}

/// A store file marked immutable (`chattr +i`), which fails every write to the open file: the
/// check and a change say so, reads go on, and once the mark is gone changes are stored
/// again, without a restart. Needs root and a file system that keeps the mark (skipped
/// otherwise).
#[cfg(target_os = "linux")]
#[test]
fn a_store_file_marked_immutable_refuses_changes_until_the_mark_is_gone() {
    use rustix::fs::{IFlags, ioctl_getflags, ioctl_setflags};

    /// Takes the mark off again, whatever the test did: the temporary directory cannot be
    /// removed with an immutable file in it.
    struct Unmark(std::fs::File);
    impl Drop for Unmark {
        fn drop(&mut self) {
            if let Ok(flags) = ioctl_getflags(&self.0) {
                let _ = ioctl_setflags(&self.0, flags - IFlags::IMMUTABLE);
            }
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(publish_new(&store, "a"), 1);
    let file = std::fs::File::open(dir.path().join("retryplane.redb")).unwrap();
    let flags = ioctl_getflags(&file).unwrap();
    if let Err(e) = ioctl_setflags(&file, flags | IFlags::IMMUTABLE) {
        eprintln!("skipped: cannot mark a file immutable ({e}; needs root)");
        return;
    }
    let mark = Unmark(file);
    let immutable = |error: &StoreError| matches!(error, StoreError::NotWritable { why, .. } if why.contains("immutable"));
    let failed = store.check().unwrap_err();
    assert!(immutable(&failed), "{failed:?}");
    let refused = store
        .publish(version_of("b", Source::Admin), None)
        .unwrap_err();
    assert!(immutable(&refused), "{refused:?}");
    assert_eq!(store.history(0, None).unwrap().len(), 1);
    assert_eq!(store.get(1).unwrap().unwrap().meta.version, 1);
    // The mark gone, the running store takes changes again.
    drop(mark);
    store.check().unwrap();
    assert_eq!(publish_new(&store, "b"), 2);
    // A restart while the file is marked is refused, saying why.
    drop(store);
    let file = std::fs::File::open(dir.path().join("retryplane.redb")).unwrap();
    ioctl_setflags(&file, ioctl_getflags(&file).unwrap() | IFlags::IMMUTABLE).unwrap();
    let mark = Unmark(file);
    let Err(refused) = RedbStore::open(dir.path()) else {
        panic!("opened an immutable store file");
    };
    assert!(immutable(&refused), "{refused:?}");
    drop(mark);
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.history(0, None).unwrap().len(), 2);
}

/// The read-back of a failed commit ([`VersionStore::current_in_file`]) never comes from a
/// copy of the file in memory, which is read through the page cache and may hold a commit
/// whose flush failed: it fails while the file cannot be opened, where `current` answers from
/// the copy.
#[tokio::test(start_paused = true)]
async fn a_failed_commit_is_read_back_from_the_file_not_from_a_copy() {
    let dir = tempfile::tempdir().unwrap();
    let full = Arc::new(AtomicBool::new(false));
    let opens = Arc::new(AtomicUsize::new(0));
    let store = store_on_a_filling_disk(dir.path(), &full, &opens);
    assert_eq!(publish_new(&store, "a"), 1);
    full.store(true, Ordering::SeqCst);
    store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert_eq!(
        store.current().unwrap().unwrap().meta.version,
        1,
        "from the copy"
    );
    let error = store.current_in_file().unwrap_err();
    assert!(says_no_space(&error), "{error:?}");
    full.store(false, Ordering::SeqCst);
    tokio::time::advance(REOPEN_INTERVAL).await;
    assert_eq!(store.current_in_file().unwrap().unwrap().meta.version, 1);
}

/// A store reached through a symbolic link (the data directory's file linked to a volume) is
/// the file the link leads to: publishes go on.
#[cfg(unix)]
#[test]
fn a_store_behind_a_link_is_checked_by_the_file_it_leads_to() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    {
        let store = RedbStore::open(elsewhere.path()).unwrap();
        assert_eq!(publish_new(&store, "a"), 1);
    }
    let link = dir.path().join("retryplane.redb");
    std::os::unix::fs::symlink(elsewhere.path().join("retryplane.redb"), &link).unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(publish_new(&store, "b"), 2);
    // Another link to the same file put in its place (made aside and renamed over it, as a
    // deploy swaps links): still the same store.
    let aside = dir.path().join("retryplane.redb.new");
    std::os::unix::fs::symlink(elsewhere.path().join("retryplane.redb"), &aside).unwrap();
    std::fs::rename(&aside, &link).unwrap();
    assert_eq!(publish_new(&store, "c"), 3);
}

#[tokio::test(start_paused = true)]
async fn writes_work_again_once_a_full_disk_has_room() {
    let dir = tempfile::tempdir().unwrap();
    let full = Arc::new(AtomicBool::new(false));
    let store = store_on_a_filling_disk(dir.path(), &full, &Arc::default());
    assert_eq!(publish_new(&store, "a"), 1);

    full.store(true, Ordering::SeqCst);
    let failed = store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert!(
        crate::ErrorChain(&failed)
            .to_string()
            .contains("No space left on device"),
        "{failed:?}"
    );
    // Still full: the reopen fails too, and says why.
    let still = store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert!(
        crate::ErrorChain(&still)
            .to_string()
            .contains("No space left on device"),
        "{still:?}"
    );

    // Room again: reads and writes work (from the next reopen on), on what was committed
    // before the disk filled up.
    full.store(false, Ordering::SeqCst);
    tokio::time::advance(REOPEN_INTERVAL).await;
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
    assert_eq!(publish_new(&store, "b"), 2);
    assert_eq!(store.history(0, None).unwrap().len(), 2);
    drop(store);
    assert_eq!(
        RedbStore::open(dir.path())
            .unwrap()
            .current()
            .unwrap()
            .unwrap()
            .meta
            .version,
        2
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_is_reopened_at_most_once_an_interval_and_recovers_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let full = Arc::new(AtomicBool::new(false));
    let opens = Arc::new(AtomicUsize::new(0));
    let store = store_on_a_filling_disk(dir.path(), &full, &opens);
    assert_eq!(publish_new(&store, "a"), 1);
    assert_eq!(opens.load(Ordering::SeqCst), 1);

    full.store(true, Ordering::SeqCst);
    let failed = store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert!(says_no_space(&failed), "{failed:?}");
    // Calls in quick succession, while the disk is full: the first reopens the file, which
    // fails, the disk still full, and reads go on from a copy of the file in memory, as it
    // was; writes fail at once with the disk's error, saying why, and never go into the copy.
    for call in 0..10 {
        match call % 3 {
            0 => {
                let error = store
                    .publish(version_of("b", Source::File), None)
                    .map(|_| ())
                    .unwrap_err();
                assert!(matches!(error, StoreError::Backend(_)), "{error:?}");
                assert!(says_no_space(&error), "call {call}: {error:?}");
                assert!(
                    crate::ErrorChain(&error)
                        .to_string()
                        .contains("reopened at most once every 1000 ms"),
                    "call {call}: {error:?}"
                );
            }
            1 => assert_eq!(store.current().unwrap().unwrap().meta.version, 1),
            _ => assert_eq!(store.history(0, None).unwrap().len(), 1),
        }
    }
    assert_eq!(store.get(1).unwrap().unwrap().meta.version, 1);
    assert_eq!(opens.load(Ordering::SeqCst), 2, "one reopen");
    let failed = store.check().unwrap_err();
    assert!(
        says_no_space(&failed),
        "the check fails on the copy: {failed:?}"
    );

    // Room again, but within the interval: writes still refused, without a reopen.
    full.store(false, Ordering::SeqCst);
    tokio::time::advance(REOPEN_INTERVAL - std::time::Duration::from_millis(1)).await;
    let error = store
        .publish(version_of("b", Source::File), None)
        .unwrap_err();
    assert!(says_no_space(&error), "{error:?}");
    assert_eq!(opens.load(Ordering::SeqCst), 2);

    // After the interval: the check opens the file again, and the store works again.
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    store.check().unwrap();
    assert_eq!(opens.load(Ordering::SeqCst), 3);
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
    assert_eq!(publish_new(&store, "b"), 2);
    assert_eq!(store.history(0, None).unwrap().len(), 2);
    assert_eq!(opens.load(Ordering::SeqCst), 3);
}

/// A store whose file cannot be opened again after a failed commit, and that is over the
/// size a copy in memory may take, fails its reads as before (rather than holding the file in
/// memory).
#[test]
fn no_copy_is_made_of_a_file_over_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(super::redb::MAX_COPY_BYTES + 1).unwrap();
    let Err(error) = super::redb::open_copy(&path) else {
        panic!("a copy of a file over the limit");
    };
    assert!(error.to_string().contains("backend failed"), "{error}");
    assert!(
        crate::ErrorChain(&error)
            .to_string()
            .contains("a copy in memory may take"),
        "{error:?}"
    );
}

/// The names of the files in `dir`, sorted.
fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_store_file_of_zeros_only_is_refused_and_left_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    let file = dir.path().join("retryplane.redb");
    // What a file system that lost its writes, or a failed copy, leaves of a store.
    let zeros = vec![0; usize::try_from(std::fs::metadata(&file).unwrap().len()).unwrap()];
    std::fs::write(&file, &zeros).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(
            err,
            StoreError::NotAStore {
                what: "holds only zero bytes",
                ..
            }
        ),
        "{err:?}"
    );
    let shown = err.to_string();
    assert!(shown.contains(&file.display().to_string()), "{shown}");
    assert!(shown.contains("move it aside"), "{shown}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        zeros,
        "the file is left as it was"
    );
    assert_eq!(files_in(dir.path()), ["retryplane.redb"]);
}

#[test]
fn an_empty_store_file_is_refused_and_left_empty() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("retryplane.redb");
    std::fs::write(&file, b"").unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(
            err,
            StoreError::NotAStore {
                what: "is empty",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 0);
    assert_eq!(files_in(dir.path()), ["retryplane.redb"]);
}

#[test]
fn a_new_store_leaves_only_its_file_in_the_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap(), None);
    assert_eq!(files_in(dir.path()), ["retryplane.redb"]);
    assert_eq!(publish_new(&store, "a"), 1);
    drop(store);
    let reopened = RedbStore::open(dir.path()).unwrap();
    assert_eq!(reopened.current().unwrap().unwrap().meta.version, 1);
}

#[cfg(unix)]
#[test]
fn a_new_store_file_gets_the_mode_the_umask_gives() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::write(&plain, b"").unwrap();
    let store = RedbStore::open(&dir.path().join("data")).unwrap();
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(store.path()), mode(&plain));
}

#[test]
fn what_an_interrupted_first_start_left_does_not_stop_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    // A first start killed while it built the new store, on a full disk: the file's length,
    // never its header, under the temporary name.
    let leftover = dir.path().join(".retryplane.redb.new-AbC123");
    write_old(&leftover, &vec![0; 73_728]);
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap(), None);
    assert_eq!(publish_new(&store, "a"), 1);
    // Deleted once the store is open (and its lock held), here and at later starts.
    assert_eq!(files_in(dir.path()), ["retryplane.redb"]);
    drop(store);
    write_old(&leftover, &[0; 4096]);
    let other = dir.path().join(".retryplane.redb.other");
    write_old(&other, b"kept");
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
    assert_eq!(
        files_in(dir.path()),
        [".retryplane.redb.other", "retryplane.redb"]
    );
}

/// Writes `bytes` to `path`, last modified two minutes ago.
fn write_old(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    let file = std::fs::File::options().write(true).open(path).unwrap();
    let two_minutes_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
    file.set_modified(two_minutes_ago).unwrap();
}

#[test]
fn the_lock_redb_holds_on_a_store_it_builds_is_seen_by_a_file_lock() {
    // What keeps another server's store in the making from being taken for a leftover: a new
    // store is built under redb's lock, which a whole-file lock attempt sees. (redb 4 takes
    // byte-range locks, and this whole-file one for older versions of itself: a redb that no
    // longer takes it fails here, and the one-minute age rule is all that is left.)
    let dir = tempfile::tempdir().unwrap();
    let temp = dir.path().join(".retryplane.redb.new-Probe1");
    let db = ::redb::Database::builder().create(&temp).unwrap();
    let probe = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&temp)
        .unwrap();
    assert!(matches!(
        probe.try_lock(),
        Err(std::fs::TryLockError::WouldBlock)
    ));
    drop(probe);
    db.close().unwrap();
    let probe = std::fs::File::open(&temp).unwrap();
    assert!(probe.try_lock().is_ok());
}

#[test]
fn a_new_store_another_server_is_building_is_left_alone() {
    // Another server's first start in the same directory, building its store meanwhile: its
    // file is locked (as redb locks it), or was written a moment ago (between closing it and
    // renaming it). It then finds the store taken and fails as it would have; deleting its
    // file made it fail with a misleading "cannot create the store file".
    let dir = tempfile::tempdir().unwrap();
    let locked = dir.path().join(".retryplane.redb.new-Locked");
    write_old(&locked, &[1; 4096]);
    let held = std::fs::File::open(&locked).unwrap();
    held.lock().unwrap();
    let fresh = dir.path().join(".retryplane.redb.new-Fresh1");
    std::fs::write(&fresh, [1; 4096]).unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(
        files_in(dir.path()),
        [
            ".retryplane.redb.new-Fresh1",
            ".retryplane.redb.new-Locked",
            "retryplane.redb"
        ]
    );
    drop((store, held));
}

#[cfg(unix)]
#[test]
fn a_link_to_no_file_yet_gets_the_new_store_at_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let volume = dir.path().join("volume");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&volume).unwrap();
    // A link to a link to nothing yet.
    std::os::unix::fs::symlink("../volume/history.redb", data.join("next")).unwrap();
    std::os::unix::fs::symlink("next", data.join("retryplane.redb")).unwrap();
    let store = RedbStore::open(&data).unwrap();
    assert_eq!(publish_new(&store, "a"), 1);
    drop(store);
    assert!(
        std::fs::symlink_metadata(data.join("retryplane.redb"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(files_in(&volume), ["history.redb"]);
    // What an interrupted first start left where the link leads is deleted there.
    write_old(&volume.join(".retryplane.redb.new-Vol123"), &[0; 4096]);
    let store = RedbStore::open(&data).unwrap();
    assert_eq!(store.current().unwrap().unwrap().meta.version, 1);
    assert_eq!(files_in(&volume), ["history.redb"]);
}

#[test]
fn zeros_with_anything_else_in_them_are_still_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = vec![0; 73_728];
    bytes[70_000] = 1;
    std::fs::write(dir.path().join("retryplane.redb"), &bytes).unwrap();
    let err = open_err(dir.path());
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
    assert_eq!(
        std::fs::read(dir.path().join("retryplane.redb")).unwrap(),
        bytes,
        "the file is left as it was"
    );
}

#[test]
fn a_store_file_that_cannot_be_opened_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("retryplane.redb");
    // Fails to open whoever runs the test, root included.
    std::fs::create_dir(&file).unwrap();
    let err = open_err(dir.path());
    assert!(matches!(err, StoreError::OpenFile { .. }), "{err:?}");
    let shown = crate::ErrorChain(&err).to_string();
    assert!(shown.contains(&file.display().to_string()), "{shown}");
}

#[cfg(unix)]
#[test]
fn a_store_file_without_read_permission_is_named_in_the_error() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    store_with_one_version(dir.path());
    let file = dir.path().join("retryplane.redb");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::File::open(&file).is_ok() {
        eprintln!("skipped: this user reads a file of mode 000 (root?), so it cannot be refused");
        return;
    }
    let err = open_err(dir.path());
    assert!(matches!(err, StoreError::OpenFile { .. }), "{err:?}");
    let shown = crate::ErrorChain(&err).to_string();
    assert!(shown.contains(&file.display().to_string()), "{shown}");
    assert!(shown.contains("Permission denied"), "{shown}");
}

/// A commit whose flush fails at any point (the disk filling up in the middle of it) may have
/// stored the version or not; either way, the handle that reported the failure reads what the
/// file holds, as the next start will: never the state from before a commit that is on disk.
#[tokio::test(start_paused = true)]
async fn after_a_failed_commit_the_store_reads_what_its_file_holds() {
    let mut stored_anyway = 0;
    for nth_sync in 1..=4 {
        let dir = tempfile::tempdir().unwrap();
        let fail_sync_in = Arc::new(AtomicUsize::new(0));
        let store =
            store_on_a_failing_disk(dir.path(), &Arc::default(), &Arc::default(), &fail_sync_in);
        assert_eq!(publish_new(&store, "a"), 1);
        fail_sync_in.store(nth_sync, Ordering::SeqCst);
        let Err(failed) = store.publish(version_of("b", Source::Admin), None) else {
            continue;
        };
        assert!(says_no_space(&failed), "{failed:?}");
        let read = store
            .current()
            .unwrap()
            .map(|r| (r.meta.version, r.meta.content_hash));
        drop(store);
        let on_disk = RedbStore::open(dir.path())
            .unwrap()
            .current()
            .unwrap()
            .map(|r| (r.meta.version, r.meta.content_hash));
        assert_eq!(read, on_disk, "the sync {nth_sync} of the commit failed");
        if on_disk.is_some_and(|(version, _)| version == 2) {
            stored_anyway += 1;
        }
    }
    // The case this is about: a commit reported failed that the file holds.
    assert!(stored_anyway > 0, "no failed sync left the version stored");
}

#[test]
fn a_start_that_finds_the_newest_commit_damaged_says_it_fell_back_to_the_one_before() {
    // f13: a store copied while the control plane ran (or left by a crash), whose newest
    // commit then has a damaged page, opened at the commit before it: v2, acknowledged, was
    // gone, with no word of it, and agents that ran v2 were sent v1.
    let running = tempfile::tempdir().unwrap();
    let store = RedbStore::open(running.path()).unwrap();
    let file = running.path().join("retryplane.redb");
    assert_eq!(publish_new(&store, "a"), 1);
    let before = std::fs::read(&file).unwrap();
    assert_eq!(publish_new(&store, "b"), 2);
    let mut after = std::fs::read(&file).unwrap();
    drop(store);
    // The same copy undamaged: at its newest commit, and nothing said.
    let whole = tempfile::tempdir().unwrap();
    std::fs::write(whole.path().join("retryplane.redb"), &after).unwrap();
    {
        let (logs, _guard) = crate::test_logs::capture("warn");
        let opened = RedbStore::open(whole.path()).unwrap();
        assert_eq!(opened.current().unwrap().unwrap().meta.version, 2);
        assert!(!logs.text().contains("did not verify"), "{}", logs.text());
    }
    // A page (past the header) the second commit wrote.
    let page = (1..after.len() / 4096)
        .find(|&p| {
            let at = p * 4096..(p + 1) * 4096;
            before.get(at.clone()) != after.get(at)
        })
        .unwrap();
    // Every page past the header damaged: no commit verifies, the start fails, and nothing
    // says the store was opened at an older one (d58: the warning came before the fallback
    // was tried).
    let mut ruined = after.clone();
    for offset in (4096..ruined.len()).step_by(4096) {
        ruined[offset + 100..offset + 200].fill(0xa5);
    }
    let lost = tempfile::tempdir().unwrap();
    std::fs::write(lost.path().join("retryplane.redb"), &ruined).unwrap();
    {
        let (logs, _guard) = crate::test_logs::capture("warn");
        let err = open_err(lost.path());
        assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
        assert!(!logs.text().contains("did not verify"), "{}", logs.text());
    }
    after[page * 4096 + 200..page * 4096 + 208].fill(0xa5);
    let copy = tempfile::tempdir().unwrap();
    std::fs::write(copy.path().join("retryplane.redb"), &after).unwrap();

    let (logs, _guard) = crate::test_logs::capture("warn");
    let reopened = RedbStore::open(copy.path()).unwrap();
    assert_eq!(reopened.current().unwrap().unwrap().meta.version, 1);
    let text = logs.text();
    assert!(
        text.contains("the store's newest commit did not verify"),
        "{text}"
    );
}
