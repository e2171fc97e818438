//! Tests of the [`VersionStore`] contract, run against every backend.
//!
//! The embedded backend's own tests (reopen, locking, corruption) are in `redb_tests.rs`.

use retryplane_proto::pb;

use retryplane_proto::convert::content_hash;

use super::{MemoryStore, NewVersion, Published, RedbStore, Source, StoreError, VersionStore};

/// A document with one endpoint, distinct for every `name`.
pub(super) fn doc(name: &str) -> pb::PolicyDocument {
    pb::PolicyDocument {
        defaults: Some(pb::Overlay {
            max_attempts: Some(3),
            ..Default::default()
        }),
        endpoints: vec![pb::Endpoint {
            name: name.to_owned(),
            overlay: None,
            routes: Vec::new(),
        }],
    }
}

pub(super) fn version_of(name: &str, source: Source) -> NewVersion {
    let document = doc(name);
    NewVersion {
        content_hash: content_hash(&document),
        document,
        source,
        author: Some("ops".to_owned()),
        summary: format!("+{name}"),
        created_unix_ms: 1_700_000_000_000,
    }
}

pub(super) fn publish_new(store: &dyn VersionStore, name: &str) -> u64 {
    match store
        .publish(version_of(name, Source::Admin), None)
        .unwrap()
    {
        Published::New(record) => record.meta.version,
        Published::Unchanged(record) => panic!("{name} was unchanged: {record:?}"),
    }
}

// === every backend ===

fn empty_store_has_no_current_version(store: &dyn VersionStore) {
    assert_eq!(store.current().unwrap(), None);
    assert_eq!(store.get(1).unwrap(), None);
    assert_eq!(store.get(0).unwrap(), None);
    assert!(store.history(0, None).unwrap().is_empty());
}

fn first_publish_is_version_one_and_the_next_is_two(store: &dyn VersionStore) {
    let first = store.publish(version_of("a", Source::File), None).unwrap();
    assert!(first.is_new());
    assert_eq!(first.record().meta.version, 1);
    assert_eq!(first.record().document, doc("a"));
    assert_eq!(store.current().unwrap().as_ref(), Some(first.record()));

    let second = store
        .publish(version_of("b", Source::Admin), Some(1))
        .unwrap();
    assert!(second.is_new());
    let current = store.current().unwrap().unwrap();
    assert_eq!(current.meta.version, 2);
    assert_eq!(current.meta.source, Source::Admin);
    assert_eq!(current.meta.author.as_deref(), Some("ops"));
    assert_eq!(current.meta.summary, "+b");
    assert_eq!(current.meta.created_unix_ms, 1_700_000_000_000);
    assert_eq!(current.document, doc("b"));
}

fn same_content_is_unchanged_and_writes_nothing(store: &dyn VersionStore) {
    publish_new(store, "a");
    let before = store.current().unwrap().unwrap();
    let mut again = version_of("a", Source::Admin);
    again.summary = "another summary".to_owned();
    let published = store.publish(again, Some(1)).unwrap();
    assert_eq!(published, Published::Unchanged(before.clone()));
    assert_eq!(store.history(0, None).unwrap().len(), 1);
    assert_eq!(store.current().unwrap(), Some(before));
}

fn stale_expected_version_is_a_conflict(store: &dyn VersionStore) {
    let err = store.publish(version_of("a", Source::Admin), Some(1));
    assert!(matches!(
        err,
        Err(StoreError::Conflict {
            expected: 1,
            current: 0
        })
    ));
    store
        .publish(version_of("a", Source::Admin), Some(0))
        .unwrap();
    publish_new(store, "b");

    // Even unchanged content is refused when the caller saw another version.
    for (name, expected) in [("c", 1), ("b", 1), ("c", 0), ("c", 3)] {
        let err = store.publish(version_of(name, Source::Admin), Some(expected));
        assert!(
            matches!(err, Err(StoreError::Conflict { current: 2, .. })),
            "{name} expecting {expected}: {err:?}"
        );
    }
    assert_eq!(store.history(0, None).unwrap().len(), 2);
}

fn history_is_newest_first_and_honours_the_limit(store: &dyn VersionStore) {
    for name in ["a", "b", "c", "d"] {
        publish_new(store, name);
    }
    let versions = |limit| -> Vec<u64> {
        let history = store.history(limit, None).unwrap();
        history.iter().map(|meta| meta.version).collect()
    };
    assert_eq!(versions(0), [4, 3, 2, 1]);
    assert_eq!(versions(2), [4, 3]);
    assert_eq!(versions(10), [4, 3, 2, 1]);
    let newest = &store.history(1, None).unwrap()[0];
    assert_eq!(newest, &store.current().unwrap().unwrap().meta);
}

fn history_pages_through_the_versions_older_than_before(store: &dyn VersionStore) {
    for name in ["a", "b", "c", "d", "e"] {
        publish_new(store, name);
    }
    let versions = |limit, before| -> Vec<u64> {
        let history = store.history(limit, Some(before)).unwrap();
        history.iter().map(|meta| meta.version).collect()
    };
    assert_eq!(versions(2, 6), [5, 4]);
    assert_eq!(versions(2, 4), [3, 2]);
    assert_eq!(versions(2, 2), [1]);
    assert_eq!(versions(2, 1), Vec::<u64>::new());
    assert_eq!(versions(0, 4), [3, 2, 1]);
    assert_eq!(versions(0, u64::MAX), [5, 4, 3, 2, 1]);
    assert_eq!(versions(0, 0), Vec::<u64>::new());
}

fn past_versions_can_be_read_back(store: &dyn VersionStore) {
    for name in ["a", "b", "c"] {
        publish_new(store, name);
    }
    let second = store.get(2).unwrap().unwrap();
    assert_eq!(second.meta.version, 2);
    assert_eq!(second.document, doc("b"));
    assert_eq!(
        second.meta.content_hash,
        version_of("b", Source::File).content_hash
    );
    assert_eq!(store.get(4).unwrap(), None);
}

fn rollback_source_round_trips(store: &dyn VersionStore) {
    publish_new(store, "a");
    publish_new(store, "b");
    let rollback = version_of("a", Source::Rollback { from: 1 });
    let published = store.publish(rollback, Some(2)).unwrap();
    assert!(published.is_new(), "older content is a new version");
    let current = store.current().unwrap().unwrap();
    assert_eq!(current.meta.version, 3);
    assert_eq!(current.meta.source, Source::Rollback { from: 1 });
    assert_eq!(
        current.meta.content_hash,
        store.get(1).unwrap().unwrap().meta.content_hash
    );

    let info = pb::VersionInfo::from(&current.meta);
    assert_eq!(info.source, "rollback");
    assert_eq!(info.rolled_back_from, 1);
    assert_eq!(info.author, "ops");
}

fn rollback_from_a_version_that_is_not_stored_is_refused(store: &dyn VersionStore) {
    publish_new(store, "a");
    for from in [0, 2] {
        let err = store.publish(version_of("b", Source::Rollback { from }), None);
        assert!(matches!(err, Err(StoreError::NoSuchVersion { version }) if version == from));
    }
    assert_eq!(store.history(0, None).unwrap().len(), 1);
}

fn same_content_in_another_order_is_unchanged(store: &dyn VersionStore) {
    let mut two = version_of("a", Source::File);
    two.document.endpoints.push(pb::Endpoint {
        name: "b".to_owned(),
        ..Default::default()
    });
    two.content_hash = content_hash(&two.document);
    store.publish(two.clone(), None).unwrap();

    // The content hash is the caller's (endpoint order does not count), kept as given.
    two.document.endpoints.reverse();
    assert_ne!(two.document, store.current().unwrap().unwrap().document);
    assert_eq!(two.content_hash, content_hash(&two.document));
    assert!(!store.publish(two, None).unwrap().is_new());
}

fn concurrent_publishers_get_distinct_contiguous_versions(store: &dyn VersionStore) {
    std::thread::scope(|scope| {
        for thread in 0..4 {
            scope.spawn(move || {
                for i in 0..5 {
                    publish_new(store, &format!("t{thread}-{i}"));
                }
            });
        }
    });
    let mut versions: Vec<u64> = store
        .history(0, None)
        .unwrap()
        .iter()
        .map(|m| m.version)
        .collect();
    versions.reverse();
    assert_eq!(versions, (1..=20).collect::<Vec<_>>());
}

/// Runs each behaviour test against a fresh [`MemoryStore`] and a fresh [`RedbStore`].
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod memory_store {
            $(#[test] fn $name() { super::$name(&super::MemoryStore::new()) })*
        }
        mod redb_store {
            $(#[test] fn $name() {
                let dir = tempfile::tempdir().unwrap();
                super::$name(&super::RedbStore::open(dir.path()).unwrap())
            })*
        }
    };
}

on_every_backend!(
    empty_store_has_no_current_version,
    first_publish_is_version_one_and_the_next_is_two,
    same_content_is_unchanged_and_writes_nothing,
    stale_expected_version_is_a_conflict,
    history_is_newest_first_and_honours_the_limit,
    history_pages_through_the_versions_older_than_before,
    past_versions_can_be_read_back,
    rollback_source_round_trips,
    rollback_from_a_version_that_is_not_stored_is_refused,
    same_content_in_another_order_is_unchanged,
    concurrent_publishers_get_distinct_contiguous_versions,
);

#[test]
fn version_info_of_a_file_version_has_no_author_and_no_rollback() {
    let mut new = version_of("a", Source::File);
    new.author = None;
    let store = MemoryStore::new();
    let meta = store.publish(new, None).unwrap().into_record().meta;
    let info = pb::VersionInfo::from(&meta);
    assert_eq!(
        info,
        pb::VersionInfo {
            version: 1,
            content_hash: meta.content_hash.clone(),
            source: "file".to_owned(),
            author: String::new(),
            created_unix_ms: 1_700_000_000_000,
            summary: "+a".to_owned(),
            rolled_back_from: 0,
        }
    );
    assert_eq!(meta.content_hash.len(), 64);
    assert!(
        meta.content_hash
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );
}
