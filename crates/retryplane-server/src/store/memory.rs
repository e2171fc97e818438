//! An in-memory [`VersionStore`], for tests of the components built on the store.
//!
//! Same rules as the embedded store (version numbering, unchanged content, expected-version
//! conflicts, rollback sources), no persistence.

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{
    NewVersion, Plan, Published, StoreError, VersionMeta, VersionRecord, VersionStore, history_len,
    meta_of, plan,
};

/// A [`VersionStore`] that keeps every version in memory; empty when created.
#[derive(Debug, Default)]
pub struct MemoryStore {
    /// Version `n` at index `n - 1`.
    versions: Mutex<Vec<VersionRecord>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn versions(&self) -> MutexGuard<'_, Vec<VersionRecord>> {
        // A publish pushes only after every check passed, so the vector is consistent even if a
        // holder of the lock panicked.
        self.versions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl VersionStore for MemoryStore {
    fn current(&self) -> Result<Option<VersionRecord>, StoreError> {
        Ok(self.versions().last().cloned())
    }

    fn get(&self, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        let index = usize::try_from(version.wrapping_sub(1)).unwrap_or(usize::MAX);
        Ok(self.versions().get(index).cloned())
    }

    fn history(&self, limit: usize, before: Option<u64>) -> Result<Vec<VersionMeta>, StoreError> {
        let versions = self.versions();
        // Version v is at index v - 1: the versions older than `before` are the first
        // `before - 1`.
        let older = before.map_or(versions.len(), |before| {
            usize::try_from(before.saturating_sub(1))
                .map_or(versions.len(), |n| n.min(versions.len()))
        });
        let take = history_len(older, limit);
        Ok(versions[..older]
            .iter()
            .rev()
            .take(take)
            .map(|record| record.meta.clone())
            .collect())
    }

    fn publish(&self, new: NewVersion, expected: Option<u64>) -> Result<Published, StoreError> {
        let mut versions = self.versions();
        match plan(versions.last(), &new, expected)? {
            Plan::Unchanged(current) => Ok(Published::Unchanged(current.clone())),
            Plan::Append(version) => {
                let record = VersionRecord {
                    meta: meta_of(&new, version),
                    document: new.document,
                };
                versions.push(record.clone());
                Ok(Published::New(record))
            }
        }
    }
}
