//! The embedded [`VersionStore`]: one redb file under the data directory.
//!
//! # Layout
//!
//! The file is `<data dir>/retryplane.redb` and holds two tables:
//!
//! - `versions: u64 -> &[u8]`: version number → one encoded [`StoredRecord`], a private protobuf
//!   message (format 1) holding the metadata, the document's encoding as bytes, and the
//!   lowercase hex SHA-256 of those bytes. The checksum is the store's own and is independent of
//!   the content hash, which is the caller's (see the parent module). Keeping the document as
//!   bytes lets a record be verified without re-encoding it, and lets `history` skip decoding
//!   documents.
//! - `meta: &str -> u64`: the key `"current"` holds the current version. Versions are contiguous,
//!   `1..=current`.
//!
//! # Durability and consistency
//!
//! A publish reads `current`, appends the record and moves `current` in one write transaction,
//! committed with [`Durability::Immediate`] (redb's default: durable when `commit` returns, and a
//! process killed at any point reopens on either the old or the new commit). The open checks
//! the file's integrity (redb page checksums) and then the store's own invariants — `current`
//! names the last of `1..=current` stored records, and that record decodes and its document
//! matches its checksum — and refuses to serve anything else with [`StoreError::Corrupt`]. Every
//! record read later is decoded and verified the same way.
//!
//! redb locks the file: a second open, from another process or this one, fails with
//! [`StoreError::InUse`].

use std::path::{Path, PathBuf};

use prost::Message as _;
use redb::{
    Database, DatabaseError, Durability, ReadableDatabase as _, ReadableTable,
    ReadableTableMetadata, StorageError, TableDefinition,
};
use retryplane_proto::pb;
use sha2::{Digest as _, Sha256};

use super::{
    NewVersion, Plan, Published, Source, StoreError, VersionMeta, VersionRecord, VersionStore,
    history_len, meta_of, plan,
};

/// The store's file name inside the data directory.
const FILE_NAME: &str = "retryplane.redb";
/// Version number → encoded [`StoredRecord`].
const VERSIONS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("versions");
/// Store-wide values; only [`CURRENT`] so far.
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// The key of the current version in [`META`].
const CURRENT: &str = "current";
/// The [`StoredRecord::format`] this code writes and reads.
const RECORD_FORMAT: u32 = 1;

/// One stored version, as encoded in the `versions` table.
#[derive(Clone, PartialEq, prost::Message)]
struct StoredRecord {
    /// Layout of this message; [`RECORD_FORMAT`].
    #[prost(uint32, tag = "1")]
    format: u32,
    /// Equal to the record's key.
    #[prost(uint64, tag = "2")]
    version: u64,
    /// The content hash the version was published with.
    #[prost(string, tag = "3")]
    content_hash: String,
    /// `"file"`, `"admin"` or `"rollback"`.
    #[prost(string, tag = "4")]
    source: String,
    /// For `"rollback"`: the version whose content was restored.
    #[prost(uint64, tag = "5")]
    rolled_back_from: u64,
    /// The admin token's name, if any.
    #[prost(string, optional, tag = "6")]
    author: Option<String>,
    /// Milliseconds since the Unix epoch.
    #[prost(uint64, tag = "7")]
    created_unix_ms: u64,
    /// One-line description of the change.
    #[prost(string, tag = "8")]
    summary: String,
    /// Lowercase hex SHA-256 of `document`.
    #[prost(string, tag = "9")]
    document_sha256: String,
    /// The encoded `pb::PolicyDocument`.
    #[prost(bytes = "vec", tag = "10")]
    document: Vec<u8>,
}

/// The embedded [`VersionStore`], backed by a redb file under the data directory.
#[derive(Debug)]
pub struct RedbStore {
    db: Database,
    path: PathBuf,
}

impl RedbStore {
    /// Opens the store in `dir`, creating the directory and an empty store if needed, and
    /// checks its consistency (see the module docs).
    ///
    /// Fails with [`StoreError::InUse`] when another process holds the store, and with
    /// [`StoreError::Corrupt`] when its content is inconsistent.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
        let path = dir.join(FILE_NAME);
        let db = Database::builder()
            .set_check_integrity_on_open(true)
            .create(&path)
            .map_err(|error| match error {
                DatabaseError::DatabaseAlreadyOpen | DatabaseError::LockProtocolMismatch => {
                    StoreError::InUse {
                        dir: dir.to_owned(),
                    }
                }
                DatabaseError::Storage(StorageError::Io(error))
                    if error.kind() == std::io::ErrorKind::InvalidData =>
                {
                    StoreError::Corrupt(format!("{} is not a redb file: {error}", path.display()))
                }
                other => backend(other),
            })?;
        let store = Self { db, path };
        store.create_tables()?;
        store.check()?;
        Ok(store)
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the tables of a new store, so that read transactions find them.
    fn create_tables(&self) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(backend)?;
        txn.open_table(VERSIONS).map_err(backend)?;
        txn.open_table(META).map_err(backend)?;
        txn.commit().map_err(backend)
    }

    /// Checks the invariants listed in the module docs.
    fn check(&self) -> Result<(), StoreError> {
        let txn = self.db.begin_read().map_err(backend)?;
        let versions = txn.open_table(VERSIONS).map_err(backend)?;
        let meta = txn.open_table(META).map_err(backend)?;
        let current = read_current(&meta)?;
        let last = versions
            .last()
            .map_err(backend)?
            .map(|(key, _)| key.value());
        let count = versions.len().map_err(backend)?;
        match (current, last) {
            (None, None) => Ok(()),
            (Some(current), Some(last)) if current == last && count == current => {
                read_record(&versions, current)?
                    .map(|_| ())
                    .ok_or_else(|| corrupt_missing(current))
            }
            (Some(current), _) if count == 0 => Err(StoreError::Corrupt(format!(
                "the current version is {current}, but no version is stored"
            ))),
            (None, Some(last)) => Err(StoreError::Corrupt(format!(
                "{count} versions are stored, up to {last}, but no current version is recorded"
            ))),
            (current, last) => Err(StoreError::Corrupt(format!(
                "the current version is {}, but the {count} stored versions end at {}",
                current.unwrap_or(0),
                last.unwrap_or(0),
            ))),
        }
    }
}

impl VersionStore for RedbStore {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(backend)?;
        let versions = txn.open_table(VERSIONS).map_err(backend)?;
        let meta = txn.open_table(META).map_err(backend)?;
        read_current_record(&versions, &meta)
    }

    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(backend)?;
        let versions = txn.open_table(VERSIONS).map_err(backend)?;
        read_record(&versions, version)
    }

    fn history(&self, limit: usize) -> Result<Vec<VersionMeta>, StoreError> {
        let txn = self.db.begin_read().map_err(backend)?;
        let versions = txn.open_table(VERSIONS).map_err(backend)?;
        let count = usize::try_from(versions.len().map_err(backend)?).unwrap_or(usize::MAX);
        let take = history_len(count, limit);
        let mut metas = Vec::with_capacity(take);
        for entry in versions.iter().map_err(backend)?.rev().take(take) {
            let (key, value) = entry.map_err(backend)?;
            let (meta, _) = decode(key.value(), value.value())?;
            metas.push(meta);
        }
        Ok(metas)
    }

    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError> {
        let encoded = new.document.encode_to_vec();
        let mut txn = self.db.begin_write().map_err(backend)?;
        txn.set_durability(Durability::Immediate).map_err(backend)?;
        let published = {
            let mut versions = txn.open_table(VERSIONS).map_err(backend)?;
            let mut meta = txn.open_table(META).map_err(backend)?;
            let current = read_current_record(&versions, &meta)?;
            match plan(current.as_ref(), &new, expected)? {
                Plan::Unchanged(current) => Published::Unchanged(current.clone()),
                Plan::Append(version) => {
                    let record = VersionRecord {
                        meta: meta_of(&new, version),
                        document: new.document,
                    };
                    let bytes = encode(&record.meta, encoded);
                    versions
                        .insert(version, bytes.as_slice())
                        .map_err(backend)?;
                    meta.insert(CURRENT, version).map_err(backend)?;
                    Published::New(record)
                }
            }
        };
        // On an error above, dropping the transaction aborts it.
        match published {
            Published::New(_) => txn.commit().map_err(backend)?,
            Published::Unchanged(_) => txn.abort().map_err(backend)?,
        }
        Ok(published)
    }
}

// === encoding ===

/// Encodes a record from its metadata and the document's encoding.
fn encode(meta: &VersionMeta, document: Vec<u8>) -> Vec<u8> {
    StoredRecord {
        format: RECORD_FORMAT,
        version: meta.version,
        content_hash: meta.content_hash.clone(),
        source: meta.source.as_str().to_owned(),
        rolled_back_from: meta.source.rolled_back_from().unwrap_or(0),
        author: meta.author.clone(),
        created_unix_ms: meta.created_unix_ms,
        summary: meta.summary.clone(),
        document_sha256: sha256_hex(&document),
        document,
    }
    .encode_to_vec()
}

/// Decodes the record stored under `key` into its metadata and the document's encoding, and
/// checks the document against its checksum.
fn decode(key: u64, bytes: &[u8]) -> Result<(VersionMeta, Vec<u8>), StoreError> {
    let bad = |what: String| StoreError::Corrupt(format!("the record of version {key} {what}"));
    let stored =
        StoredRecord::decode(bytes).map_err(|error| bad(format!("cannot be decoded: {error}")))?;
    if stored.format != RECORD_FORMAT {
        return Err(bad(format!(
            "has format {}, but this build reads format {RECORD_FORMAT} only",
            stored.format
        )));
    }
    if stored.version != key {
        return Err(bad(format!("says it is version {}", stored.version)));
    }
    let source = match (stored.source.as_str(), stored.rolled_back_from) {
        ("file", _) => Source::File,
        ("admin", _) => Source::Admin,
        ("rollback", from) => Source::Rollback { from },
        (other, _) => return Err(bad(format!("has an unknown source {other:?}"))),
    };
    let computed = sha256_hex(&stored.document);
    if computed != stored.document_sha256 {
        return Err(bad(format!(
            "has a document checksum of {}, but its document hashes to {computed}",
            stored.document_sha256
        )));
    }
    let meta = VersionMeta {
        version: stored.version,
        content_hash: stored.content_hash,
        source,
        author: stored.author,
        created_unix_ms: stored.created_unix_ms,
        summary: stored.summary,
    };
    Ok((meta, stored.document))
}

/// Lowercase hex SHA-256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut hex, byte| {
            // Writing to a String cannot fail.
            let _ = write!(hex, "{byte:02x}");
            hex
        })
}

// === reading ===

/// The version `"current"` names, if any.
fn read_current(meta: &impl ReadableTable<&'static str, u64>) -> Result<Option<u64>, StoreError> {
    Ok(meta
        .get(CURRENT)
        .map_err(backend)?
        .map(|value| value.value()))
}

/// The record of the current version, if any; a dangling `"current"` is corrupt.
fn read_current_record(
    versions: &impl ReadableTable<u64, &'static [u8]>,
    meta: &impl ReadableTable<&'static str, u64>,
) -> Result<Option<VersionRecord>, StoreError> {
    match read_current(meta)? {
        None => Ok(None),
        Some(current) => read_record(versions, current)?
            .map(Some)
            .ok_or_else(|| corrupt_missing(current)),
    }
}

/// The record of `version`, decoded and verified, if stored.
fn read_record(
    versions: &impl ReadableTable<u64, &'static [u8]>,
    version: u64,
) -> Result<Option<VersionRecord>, StoreError> {
    let Some(value) = versions.get(version).map_err(backend)? else {
        return Ok(None);
    };
    let (meta, document) = decode(version, value.value())?;
    let document = pb::PolicyDocument::decode(document.as_slice()).map_err(|error| {
        StoreError::Corrupt(format!(
            "the document of version {version} cannot be decoded: {error}"
        ))
    })?;
    Ok(Some(VersionRecord { meta, document }))
}

// === errors ===

/// A `"current"` that names no stored record.
fn corrupt_missing(current: u64) -> StoreError {
    StoreError::Corrupt(format!(
        "the current version is {current}, but its record is missing"
    ))
}

/// Maps a redb error: corruption it detects is [`StoreError::Corrupt`], the rest
/// [`StoreError::Backend`].
fn backend(error: impl Into<redb::Error>) -> StoreError {
    match error.into() {
        redb::Error::Corrupted(message) => StoreError::Corrupt(message),
        other => StoreError::Backend(Box::new(other)),
    }
}
