use std::path::PathBuf;
use std::sync::Arc;

use prost::Message as _;
use retryplane_proto::pb::diff_entry::Change as DiffChange;
use tonic::Code;

use super::*;
use crate::store::{MemoryStore, VersionStore};

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n  search: {}\n";
const V2: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n  search: {}\n";
const OTHER: &str = "version: 1\nendpoints:\n  inventory: {}\n";

fn api(mode: Mode) -> AdminApi {
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    AdminApi::new(Arc::new(ControlPlane::for_tests(store, mode)))
}

fn yaml(text: &str) -> Option<pb::PolicySource> {
    Some(pb::PolicySource {
        kind: Some(Kind::Yaml(text.to_owned())),
        origin: String::new(),
    })
}

fn apply_request(text: &str) -> pb::ApplyRequest {
    pb::ApplyRequest {
        source: yaml(text),
        ..Default::default()
    }
}

/// A request as the auth guard passes it on for the admin token `alice`.
fn as_alice<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request
        .extensions_mut()
        .insert(TokenName("alice".to_owned()));
    request
}

async fn apply(api: &AdminApi, request: pb::ApplyRequest) -> Result<pb::ApplyResponse, Status> {
    api.apply(as_alice(request)).await.map(Response::into_inner)
}

async fn history(api: &AdminApi) -> Vec<pb::VersionInfo> {
    api.history(Request::new(pb::HistoryRequest {
        limit: 0,
        ..Default::default()
    }))
    .await
    .unwrap()
    .into_inner()
    .versions
}

async fn get(api: &AdminApi, version: u64) -> Result<pb::GetResponse, Status> {
    api.get(Request::new(pb::GetRequest { version }))
        .await
        .map(Response::into_inner)
}

#[tokio::test]
async fn file_mode_refuses_apply_and_rollback_naming_the_file() {
    let api = api(Mode::File(PathBuf::from("config/policies.yaml")));
    let status = apply(&api, apply_request(V1)).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        "policies are owned by the file config/policies.yaml: edit it, or start the server with --api"
    );
    let status = api
        .rollback(as_alice(pb::RollbackRequest {
            version: 1,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn file_mode_dry_runs_of_a_change_that_removes_every_endpoint_say_no_force_helps() {
    // A version stored (as a save would), then a file-mode server over the same store.
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    let seeding = AdminApi::new(Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api)));
    apply(&seeding, apply_request(V1)).await.unwrap();
    let api = AdminApi::new(Arc::new(ControlPlane::for_tests(
        store,
        Mode::File(PathBuf::from("config/policies.yaml")),
    )));
    let dry_run = pb::ApplyRequest {
        dry_run: true,
        ..apply_request(OTHER)
    };
    let status = apply(&api, dry_run.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(
        status.message(),
        "the change removes every endpoint (payments, search): a saved file that does this \
         is refused in file mode, and nothing can force it; to replace every endpoint, add \
         the new ones first, save, then remove the old ones"
    );
    // `retryplane diff` forces its dry run, to show the diff whatever it is.
    let forced = pb::ApplyRequest {
        force: true,
        ..dry_run
    };
    let diff = apply(&api, forced).await.unwrap();
    assert_eq!(diff.diff.len(), 3, "{:?}", diff.diff);
}

#[tokio::test]
async fn file_mode_still_answers_reads() {
    let api = api(Mode::File(PathBuf::from("config/policies.yaml")));
    let valid = api
        .validate(Request::new(pb::ValidateRequest { source: yaml(V1) }))
        .await
        .unwrap()
        .into_inner();
    assert!(valid.valid);
    assert!(history(&api).await.is_empty());
    assert_eq!(get(&api, 0).await.unwrap_err().code(), Code::NotFound);
    let fleet = api
        .fleet_status(Request::new(pb::FleetStatusRequest::default()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fleet.current_version, 0);
    let stats = api
        .stats(Request::new(pb::StatsRequest::default()))
        .await
        .unwrap();
    assert!(stats.into_inner().endpoints.is_empty());
}

#[tokio::test]
async fn first_apply_is_version_1_by_the_token_name() {
    let api = api(Mode::Api);
    let applied = apply(&api, apply_request(V1)).await.unwrap();
    assert_eq!((applied.version, applied.changed), (1, true));
    assert_eq!(applied.content_hash.len(), 64);
    assert_eq!(applied.diff.len(), 2, "{:?}", applied.diff);
    assert!(
        applied
            .diff
            .iter()
            .all(|d| d.change == DiffChange::Added as i32)
    );
    let versions = history(&api).await;
    assert_eq!(versions.len(), 1);
    assert_eq!(
        (versions[0].source.as_str(), versions[0].author.as_str()),
        ("admin", "alice")
    );
    let fleet = api
        .fleet_status(Request::new(pb::FleetStatusRequest::default()))
        .await
        .unwrap();
    assert_eq!(fleet.into_inner().current_version, 1);
}

#[tokio::test]
async fn the_same_content_again_is_unchanged() {
    let api = api(Mode::Api);
    let first = apply(&api, apply_request(V1)).await.unwrap();
    let again = apply(&api, apply_request(&format!("# comment\n{V1}")))
        .await
        .unwrap();
    assert_eq!((again.version, again.changed), (1, false));
    assert_eq!(again.content_hash, first.content_hash);
    assert!(again.diff.is_empty());
    assert_eq!(history(&api).await.len(), 1);
}

#[tokio::test]
async fn dry_run_returns_the_diff_and_stores_nothing() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    let dry = apply(
        &api,
        pb::ApplyRequest {
            dry_run: true,
            ..apply_request(V2)
        },
    )
    .await
    .unwrap();
    assert_eq!((dry.version, dry.changed), (1, false));
    assert_eq!(dry.diff.len(), 1);
    assert_eq!(dry.diff[0].endpoint, "payments");
    assert_eq!(dry.diff[0].change, DiffChange::Modified as i32);
    assert_eq!(history(&api).await.len(), 1);
}

#[tokio::test]
async fn removing_every_endpoint_needs_force() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    let status = apply(&api, apply_request(OTHER)).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("--force"), "{}", status.message());
    assert_eq!(history(&api).await.len(), 1);
    let forced = apply(
        &api,
        pb::ApplyRequest {
            force: true,
            ..apply_request(OTHER)
        },
    )
    .await
    .unwrap();
    assert_eq!((forced.version, forced.changed), (2, true));
}

/// `calls` calls to each of `endpoints` reported by an agent of `service`, now.
fn calls_reported(control: &ControlPlane, service: &str, endpoints: &[&str], calls: u64) {
    let report = pb::MetricsReport {
        policy_version: 1,
        endpoints: endpoints
            .iter()
            .map(|e| pb::EndpointCounters {
                endpoint: (*e).to_owned(),
                calls,
                attempts: calls,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let aggregates = &control.aggregates;
    aggregates.ingest(
        &aggregates.service(service),
        &report,
        tokio::time::Instant::now(),
    );
}

/// A change that removes an endpoint agents are calling (a misspelt name in an incident)
/// leaves those calls on the defaults: refused unless forced, dry runs too, naming it with
/// its calls and services; forced, it goes through with a warning. An endpoint no agent
/// called is removed as before.
#[tokio::test]
async fn removing_an_endpoint_agents_call_needs_force() {
    let control = Arc::new(ControlPlane::for_tests(
        Arc::new(MemoryStore::new()),
        Mode::Api,
    ));
    let api = AdminApi::new(control.clone());
    apply(&api, apply_request(V1)).await.unwrap();
    calls_reported(&control, "checkout", &["payments"], 30);
    calls_reported(&control, "billing", &["payments"], 12);
    let misspelt = "version: 1\nendpoints:\n  paymnets:\n    max_attempts: 2\n  search: {}\n";
    for dry_run in [false, true] {
        let status = apply(
            &api,
            pb::ApplyRequest {
                dry_run,
                ..apply_request(misspelt)
            },
        )
        .await
        .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(
            status.message(),
            "the change removes 1 endpoint(s) that agents called in the last 5 minutes: \
             payments (42 calls by billing, checkout); their calls would run on the defaults; \
             pass --force to do it anyway",
            "dry run {dry_run}"
        );
    }
    assert_eq!(history(&api).await.len(), 1);
    // `search` had no calls: removing it needs nothing.
    let no_search = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
    let applied = apply(&api, apply_request(no_search)).await.unwrap();
    assert_eq!((applied.version, applied.warnings.len()), (2, 0));
    let forced = apply(
        &api,
        pb::ApplyRequest {
            force: true,
            ..apply_request(misspelt)
        },
    )
    .await
    .unwrap();
    assert_eq!((forced.version, forced.changed), (3, true));
    assert_eq!(forced.warnings.len(), 1, "{:?}", forced.warnings);
    assert!(
        forced.warnings[0]
            .message
            .contains("payments (42 calls by billing, checkout)"),
        "{:?}",
        forced.warnings
    );
}

/// Past the control plane's series limits, calls are counted in the `other` series, whose
/// endpoints are not known: a removed endpoint not found in use by a series of its own (it has
/// none, or an idle one) may be among them, and its removal is refused as one in use, saying
/// so.
#[tokio::test]
async fn removing_an_endpoint_whose_calls_may_be_in_the_other_series_needs_force() {
    let control = Arc::new(ControlPlane::for_tests(
        Arc::new(MemoryStore::new()),
        Mode::Api,
    ));
    let api = AdminApi::new(control.clone());
    apply(&api, apply_request(V1)).await.unwrap();
    // `billing` has an idle series of `payments` (a report with no call in it, an attempt of
    // an earlier call's): it says nothing of other services' calls to it.
    let idle = pb::MetricsReport {
        policy_version: 1,
        endpoints: vec![pb::EndpointCounters {
            endpoint: "payments".to_owned(),
            attempts: 1,
            ..Default::default()
        }],
        ..Default::default()
    };
    let aggregates = &control.aggregates;
    aggregates.ingest(
        &aggregates.service("billing"),
        &idle,
        tokio::time::Instant::now(),
    );
    assert_eq!(aggregates.series_count(), 1, "billing's series of payments");
    // Other services fill every series; `checkout`'s calls to `payments` go to `other`.
    let names: Vec<String> = (0..control.aggregates.max_series())
        .map(|i| format!("e{i}"))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    for chunk in names.chunks(10) {
        calls_reported(&control, &format!("bulk-{}", chunk[0]), chunk, 1);
    }
    calls_reported(&control, "checkout", &["payments"], 9000);
    let misspelt = "version: 1\nendpoints:\n  paymnets:\n    max_attempts: 2\n  search: {}\n";
    let status = apply(&api, apply_request(misspelt)).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    // 9000 and more: a bulk report that found no room is in `other` too.
    let message = status.message();
    assert!(
        message.starts_with(
            "the change removes 1 endpoint(s) that agents called, or may have called, in the \
             last 5 minutes: payments (its calls may be among the 900"
        ) && message.ends_with(
            " counted in the \"other\" series); their calls would run on the defaults; pass \
             --force to do it anyway"
        ),
        "{message}"
    );
    assert_eq!(history(&api).await.len(), 1);
}

/// In file mode the file decides: a dry run of a change that removes an endpoint in use is
/// not refused (a save of it would be published), and says so in a warning.
#[tokio::test]
async fn file_mode_dry_runs_warn_of_removing_an_endpoint_agents_call() {
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    let seeding = AdminApi::new(Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api)));
    apply(&seeding, apply_request(V1)).await.unwrap();
    let control = Arc::new(ControlPlane::for_tests(
        store,
        Mode::File(PathBuf::from("config/policies.yaml")),
    ));
    calls_reported(&control, "checkout", &["payments"], 1);
    let api = AdminApi::new(control);
    let dry_run = pb::ApplyRequest {
        dry_run: true,
        ..apply_request("version: 1\nendpoints:\n  search: {}\n")
    };
    let answer = apply(&api, dry_run).await.unwrap();
    assert!(answer.would_change);
    assert_eq!(answer.warnings.len(), 1, "{:?}", answer.warnings);
    assert!(
        answer.warnings[0]
            .message
            .contains("payments (1 call by checkout)"),
        "{:?}",
        answer.warnings
    );
}

#[tokio::test]
async fn a_stale_expected_version_is_aborted() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    apply(&api, apply_request(V2)).await.unwrap();
    let stale = pb::ApplyRequest {
        expected_version: Some(1),
        ..apply_request(V1)
    };
    let status = apply(&api, stale).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert!(
        status.message().contains("expected version 1"),
        "{}",
        status.message()
    );
    let current = pb::ApplyRequest {
        expected_version: Some(2),
        ..apply_request(V1)
    };
    assert_eq!(apply(&api, current).await.unwrap().version, 3);
}

/// A change sent again after its answer was lost (a CI job's retry after `UNAVAILABLE`), with
/// the expected version it had: still a conflict, whose message says the current version holds
/// this content, not that someone else changed the policies.
#[tokio::test]
async fn a_conflict_with_a_version_holding_the_same_content_says_so() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    let change = || pb::ApplyRequest {
        expected_version: Some(1),
        ..apply_request(V2)
    };
    assert_eq!(apply(&api, change()).await.unwrap().version, 2);
    let again = apply(&api, change()).await.unwrap_err();
    assert_eq!(again.code(), Code::Aborted);
    assert!(
        again
            .message()
            .contains("version 2 already holds this content"),
        "{}",
        again.message()
    );
    // Another content: the plain conflict.
    let other = pb::ApplyRequest {
        expected_version: Some(1),
        ..apply_request(OTHER)
    };
    let status = apply(&api, other).await.unwrap_err();
    assert_eq!(
        status.message(),
        "version conflict: expected version 1 to be current, but the current version is 2 \
         (admin change by alice); get the current version and retry",
    );
}

#[tokio::test]
async fn expected_version_zero_applies_only_to_an_empty_store() {
    let api = api(Mode::Api);
    let first = pb::ApplyRequest {
        expected_version: Some(0),
        ..apply_request(V1)
    };
    assert_eq!(apply(&api, first).await.unwrap().version, 1);
    let second = pb::ApplyRequest {
        expected_version: Some(0),
        ..apply_request(V2)
    };
    let status = apply(&api, second).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert!(
        status.message().contains("expected an empty store"),
        "{}",
        status.message()
    );
    // No expected version: no check.
    let unchecked = pb::ApplyRequest {
        expected_version: None,
        ..apply_request(V2)
    };
    assert_eq!(apply(&api, unchecked).await.unwrap().version, 2);
}

#[tokio::test]
async fn a_stale_expected_version_is_aborted_before_the_removal_check() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    apply(&api, apply_request(V2)).await.unwrap();
    let aborted = |status: Status| {
        assert_eq!(status.code(), Code::Aborted, "{status:?}");
        assert!(
            status.message().contains("expected version 1"),
            "{}",
            status.message()
        );
    };
    // OTHER removes every endpoint: with or without --force, a stale version is the answer.
    for force in [false, true] {
        for dry_run in [false, true] {
            let stale = pb::ApplyRequest {
                expected_version: Some(1),
                force,
                dry_run,
                ..apply_request(OTHER)
            };
            aborted(apply(&api, stale).await.unwrap_err());
        }
    }
    // A rollback to content that removes every endpoint, against a stale version.
    apply(
        &api,
        pb::ApplyRequest {
            force: true,
            ..apply_request(OTHER)
        },
    )
    .await
    .unwrap();
    let status = api
        .rollback(as_alice(pb::RollbackRequest {
            version: 1,
            expected_version: 1,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(history(&api).await.len(), 3);
}

#[tokio::test]
async fn rollback_publishes_the_old_content_as_a_new_version() {
    let api = api(Mode::Api);
    let v1 = apply(&api, apply_request(V1)).await.unwrap();
    apply(&api, apply_request(V2)).await.unwrap();
    let rolled = api
        .rollback(as_alice(pb::RollbackRequest {
            version: 1,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((rolled.version, rolled.changed), (3, true));
    assert_eq!(rolled.content_hash, v1.content_hash);
    let newest = &history(&api).await[0];
    assert_eq!((newest.version, newest.source.as_str()), (3, "rollback"));
    assert_eq!(newest.rolled_back_from, 1);
    assert_eq!(
        get(&api, 3).await.unwrap().policies,
        get(&api, 1).await.unwrap().policies
    );
}

#[tokio::test]
async fn unknown_versions_are_not_found() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    assert_eq!(get(&api, 7).await.unwrap_err().code(), Code::NotFound);
    let status = api
        .rollback(as_alice(pb::RollbackRequest {
            version: 7,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn get_returns_the_document_and_its_yaml() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V2)).await.unwrap();
    let got = get(&api, 0).await.unwrap();
    assert_eq!(got.info.unwrap().version, 1);
    assert!(got.policies.is_some());
    assert!(got.yaml.contains("max_attempts: 4"), "{}", got.yaml);
    let reloaded = retryplane_policy::load(got.yaml.as_bytes());
    assert!(!reloaded.has_errors(), "{:?}", reloaded.diagnostics);
}

#[tokio::test]
async fn invalid_yaml_is_invalid_argument_with_line_and_column() {
    let api = api(Mode::Api);
    let bad = "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n    dedline: 1s\n";
    let status = apply(&api, apply_request(bad)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let lines: Vec<&str> = status.message().lines().collect();
    assert_eq!(lines.len(), 2, "{}", status.message());
    assert!(
        lines[0].starts_with("4:19: error: endpoints.payments.max_attempts: "),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with("5:5: error: endpoints.payments.dedline: "),
        "{}",
        lines[1]
    );
    assert!(history(&api).await.is_empty());
}

/// An Apply of a typed document (not YAML) whose `payments` has `max_attempts: 0`.
fn invalid_typed_request() -> pb::ApplyRequest {
    pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(Kind::Document(pb::PolicyDocument {
                defaults: None,
                endpoints: vec![pb::Endpoint {
                    name: "payments".to_owned(),
                    overlay: Some(pb::Overlay {
                        max_attempts: Some(0),
                        ..Default::default()
                    }),
                    routes: Vec::new(),
                }],
            })),
            origin: String::new(),
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn an_invalid_typed_document_is_invalid_argument() {
    let api = api(Mode::Api);
    let request = invalid_typed_request();
    let status = apply(&api, request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .starts_with("0:0: error: endpoints.payments.max_attempts: "),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn rejected_changes_count_invalid_applies_of_every_kind_and_no_dry_run() {
    let api = api(Mode::Api);
    let rejected = || api.control.metrics.rejected_changes.get();
    apply(&api, apply_request(V1)).await.unwrap();
    let bad_yaml = "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n";
    let dry = |request: pb::ApplyRequest| pb::ApplyRequest {
        dry_run: true,
        ..request
    };
    // Dry runs (`retryplane diff`) change nothing and are not counted.
    let status = apply(&api, dry(apply_request(bad_yaml))).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = apply(&api, dry(apply_request(OTHER))).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(rejected(), 0, "dry runs");
    // Invalid YAML, an invalid typed document, a change that removes every endpoint.
    let status = apply(&api, apply_request(bad_yaml)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(rejected(), 1, "invalid YAML");
    let typed = invalid_typed_request();
    let status = apply(&api, typed).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(rejected(), 2, "an invalid typed document");
    let status = apply(&api, apply_request(OTHER)).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(rejected(), 3, "a change that removes every endpoint");
}

/// A valid typed Apply of `payments` with one route, whose path prefix is long enough that the
/// request takes exactly `len` bytes.
fn typed_request_of_len(len: usize) -> pb::ApplyRequest {
    let request = |prefix_len: usize| pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(Kind::Document(pb::PolicyDocument {
                defaults: None,
                endpoints: vec![pb::Endpoint {
                    name: "payments".to_owned(),
                    overlay: None,
                    routes: vec![pb::Route {
                        r#match: Some(pb::RouteMatch {
                            kind: Some(pb::route_match::Kind::Http(pb::HttpMatch {
                                method: String::new(),
                                path_prefix: format!("/{}", "a".repeat(prefix_len)),
                            })),
                        }),
                        overlay: None,
                    }],
                }],
            })),
            origin: String::new(),
        }),
        ..Default::default()
    };
    // Lengths near `len` take as many bytes to encode, so one correction is exact.
    let first = request(len).encoded_len();
    let exact = request(len - (first - len));
    assert_eq!(exact.encoded_len(), len);
    exact
}

#[tokio::test]
async fn a_document_whose_snapshot_agents_cannot_decode_is_refused_and_stores_nothing() {
    use retryplane_proto::MAX_MESSAGE_BYTES;

    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    // As large as the admin API decodes (its default limit), so it would be accepted.
    let request = typed_request_of_len(MAX_MESSAGE_BYTES);
    let Some(Kind::Document(document)) = request.source.clone().and_then(|s| s.kind) else {
        unreachable!("a typed request");
    };
    let message_len = pb::ServerMessage::largest_snapshot_message_len(&document);
    assert!(message_len > MAX_MESSAGE_BYTES, "{message_len}");
    let dry_run = pb::ApplyRequest {
        dry_run: true,
        ..request.clone()
    };
    for request in [dry_run, request] {
        let status = apply(&api, request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{}", status.message());
        assert_eq!(
            status.message(),
            format!(
                "the policies encode to {} bytes, a snapshot message of up to {message_len} \
                 bytes; agents decode messages of at most 4194304 bytes: make the policies \
                 smaller (fewer endpoints or routes, shorter names)",
                document.encoded_len()
            )
        );
    }
    assert_eq!(history(&api).await.len(), 1);
    assert_eq!(api.control.publisher.current().map(|s| s.version), Some(1));
    assert_eq!(
        api.control.metrics.rejected_changes.get(),
        1,
        "the Apply, not the dry run"
    );
}

/// A typed document holding more than a policy file can (`convert::MAX_ITEMS`) is refused by
/// Apply and reported by Validate before it is converted, and nothing is stored.
#[tokio::test]
async fn a_document_holding_more_than_a_file_can_is_refused_before_it_is_checked() {
    let api = api(Mode::Api);
    let source = Some(pb::PolicySource {
        kind: Some(Kind::Document(crate::store::over_the_item_limit())),
        origin: String::new(),
    });
    let refused = apply(
        &api,
        pb::ApplyRequest {
            source: source.clone(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("the document is too large"),
        "{}",
        refused.message()
    );
    let checked = api
        .validate(Request::new(pb::ValidateRequest { source }))
        .await
        .unwrap()
        .into_inner();
    assert!(!checked.valid);
    assert_eq!(checked.diagnostics.len(), 1, "{:?}", checked.diagnostics);
    assert!(checked.diagnostics[0].message.contains("at most 200000"));
    assert!(history(&api).await.is_empty());
}

/// A version stored before the item limit (written to the store directly here), holding more
/// than Apply takes now, is not published again by a rollback: refused, counted, nothing
/// stored.
#[tokio::test]
async fn a_rollback_to_a_stored_version_holding_more_than_a_file_can_is_refused() {
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    crate::store::store_over_the_item_limit(store.as_ref());
    let api = AdminApi::new(Arc::new(ControlPlane::for_tests(store, Mode::Api)));
    let replace = pb::ApplyRequest {
        force: true,
        ..apply_request(V1)
    };
    apply(&api, replace).await.unwrap();
    let rejected = api.control.metrics.rejected_changes.get();
    let refused = api
        .rollback(as_alice(pb::RollbackRequest {
            version: 1,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused
            .message()
            .starts_with("version 1 cannot be published again: the document is too large"),
        "{}",
        refused.message()
    );
    assert_eq!(api.control.metrics.rejected_changes.get(), rejected + 1);
    assert_eq!(history(&api).await.len(), 2);
}

#[tokio::test]
async fn validate_reports_a_document_too_large_for_agents_with_apply_s_message() {
    let api = api(Mode::Api);
    let request = typed_request_of_len(retryplane_proto::MAX_MESSAGE_BYTES);
    let refused = apply(&api, request.clone()).await.unwrap_err();
    let checked = api
        .validate(Request::new(pb::ValidateRequest {
            source: request.source,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(!checked.valid);
    let errors: Vec<_> = checked
        .diagnostics
        .iter()
        .filter(|d| d.severity == pb::diagnostic::Severity::Error as i32)
        .map(|d| (d.path.as_str(), d.message.as_str()))
        .collect();
    assert_eq!(errors, [("<root>", refused.message())]);
    assert!(history(&api).await.is_empty());
}

#[tokio::test]
async fn validate_reports_a_yaml_file_too_large_for_agents_first_at_1_1_as_the_cli_does() {
    let api = api(Mode::Api);
    let checked = api
        .validate(Request::new(pb::ValidateRequest {
            source: yaml(&crate::server::tests::too_large_for_agents()),
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(!checked.valid);
    let first = &checked.diagnostics[0];
    assert_eq!((first.line, first.column), (1, 1));
    assert_eq!(first.path, "<root>");
    assert!(
        first
            .message
            .contains("agents decode messages of at most 4194304 bytes"),
        "{first:?}"
    );
}

#[tokio::test]
async fn a_source_over_1_mib_or_none_is_invalid_argument() {
    let api = api(Mode::Api);
    let huge = format!("{V1}#{}\n", "x".repeat(MAX_FILE_BYTES));
    let status = apply(&api, apply_request(&huge)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("limit"), "{}", status.message());
    let status = apply(&api, pb::ApplyRequest::default()).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
}

/// A typed document carries each status code in one byte, and each bad one is a problem of
/// its own with its path and message, about 227 bytes on the wire: a 200 KB document of bad
/// codes was answered with 45 MB, and one at the 4 MiB the admin service decodes took the
/// process past 3 GB to answer 900 MB (four such checks run at once, for a viewer's token).
/// The answer must stay within what a gRPC client decodes by default.
#[tokio::test]
async fn validate_answers_a_typed_document_of_many_bad_codes_within_a_bounded_message() {
    let api = api(Mode::Api);
    let codes = 200_000;
    let document = pb::PolicyDocument {
        defaults: None,
        endpoints: vec![pb::Endpoint {
            name: "n".repeat(128),
            overlay: Some(pb::Overlay {
                retry_on: Some(pb::RetryOn {
                    http_status: Some(pb::StatusList {
                        codes: vec![1; codes],
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            routes: vec![],
        }],
    };
    let source = Some(pb::PolicySource {
        kind: Some(Kind::Document(document)),
        origin: String::new(),
    });
    let request = pb::ValidateRequest { source };
    assert!(
        request.encoded_len() < 256 * 1024,
        "{}",
        request.encoded_len()
    );
    let checked = api
        .validate(Request::new(request))
        .await
        .unwrap()
        .into_inner();
    assert!(!checked.valid);
    assert!(
        checked.encoded_len() <= retryplane_proto::MAX_MESSAGE_BYTES,
        "{} diagnostics in an answer of {} bytes",
        checked.diagnostics.len(),
        checked.encoded_len()
    );
}

#[tokio::test]
async fn validate_reports_every_problem_and_stores_nothing() {
    let api = api(Mode::Api);
    let bad = "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n    dedline: 1s\n";
    let checked = api
        .validate(Request::new(pb::ValidateRequest { source: yaml(bad) }))
        .await
        .unwrap()
        .into_inner();
    assert!(!checked.valid);
    assert_eq!(checked.diagnostics.len(), 2);
    assert_eq!(
        (checked.diagnostics[0].line, checked.diagnostics[0].column),
        (4, 19)
    );
    assert!(history(&api).await.is_empty());
}

#[tokio::test]
async fn history_is_newest_first_and_limited() {
    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    apply(&api, apply_request(V2)).await.unwrap();
    let all: Vec<u64> = history(&api).await.iter().map(|v| v.version).collect();
    assert_eq!(all, [2, 1]);
    let limited = api
        .history(Request::new(pb::HistoryRequest {
            limit: 1,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(limited.versions.len(), 1);
    assert_eq!(limited.versions[0].version, 2);
}

/// `message` as the auth guard passes it on for a token of `role` named `carol`.
fn with_role<T>(role: crate::auth::Role, message: T) -> Request<T> {
    use tonic::service::Interceptor as _;
    let path = std::path::Path::new("tokens.yaml");
    let text = format!(
        "tokens: [{{name: carol, role: {}, secret: carol-secret-0123456789}}]",
        role.as_str()
    );
    let tokens = crate::auth::Tokens::parse(&text, path).unwrap();
    let set = Arc::new(crate::auth::TokenSet::of(path, tokens));
    let mut authorized = Request::new(());
    authorized.metadata_mut().insert(
        "authorization",
        "Bearer carol-secret-0123456789".parse().unwrap(),
    );
    let passed = crate::auth::Guard::new(Some(set), crate::auth::Role::Admin)
        .call(authorized)
        .unwrap();
    let (metadata, extensions, ()) = passed.into_parts();
    Request::from_parts(metadata, extensions, message)
}

#[tokio::test]
async fn a_viewer_reads_and_dry_runs_but_cannot_apply_or_roll_back() {
    use crate::auth::Role;

    let api = api(Mode::Api);
    apply(&api, apply_request(V1)).await.unwrap();
    let denied = api
        .apply(with_role(Role::Viewer, apply_request(V2)))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert_eq!(
        denied.message(),
        "token `carol` has role `viewer`, which reads only; changing the policies needs role `admin`"
    );
    let rollback = pb::RollbackRequest {
        version: 1,
        ..Default::default()
    };
    let denied = api
        .rollback(with_role(Role::Viewer, rollback))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert_eq!(history(&api).await.len(), 1, "nothing was stored");
    let dry_run = pb::ApplyRequest {
        dry_run: true,
        ..apply_request(V2)
    };
    let diff = api
        .apply(with_role(Role::Viewer, dry_run))
        .await
        .unwrap()
        .into_inner();
    assert!(!diff.diff.is_empty());
    let read = api
        .history(with_role(Role::Viewer, pb::HistoryRequest::default()))
        .await
        .unwrap();
    assert_eq!(read.into_inner().versions.len(), 1);
    api.get(with_role(Role::Viewer, pb::GetRequest { version: 1 }))
        .await
        .unwrap();
    // An admin token changes them.
    let applied = api
        .apply(with_role(Role::Admin, apply_request(V2)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(applied.version, 2);
}

fn new_version(i: u64, summary: String) -> crate::store::NewVersion {
    crate::store::NewVersion {
        document: pb::PolicyDocument::default(),
        content_hash: format!("{i:064x}"),
        source: Source::Admin,
        author: None,
        summary,
        created_unix_ms: i,
    }
}

#[tokio::test]
async fn history_answers_a_page_at_a_time_and_says_where_the_next_starts() {
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    let total = 2 * HISTORY_PAGE as u64 + 500;
    for i in 1..=total {
        store.publish(new_version(i, String::new()), None).unwrap();
    }
    let api = AdminApi::new(Arc::new(ControlPlane::for_tests(store, Mode::Api)));
    let page = |limit, before| {
        let api = &api;
        async move {
            let answer = api
                .history(Request::new(pb::HistoryRequest { limit, before }))
                .await
                .unwrap()
                .into_inner();
            let versions: Vec<u64> = answer.versions.iter().map(|v| v.version).collect();
            (versions, answer.next_before)
        }
    };
    // All of them: three pages, each newest first, each continuing where the last stopped.
    let mut all = Vec::new();
    let mut before = 0;
    for _ in 0..3 {
        let (versions, next) = page(0, before).await;
        assert!(versions.len() <= HISTORY_PAGE);
        all.extend(versions);
        before = next;
    }
    assert_eq!(before, 0, "nothing left after the third page");
    assert_eq!(all, (1..=total).rev().collect::<Vec<_>>());
    // A limit over one page: the rest of it on the next, and nothing more.
    let (first, next) = page(1_200, 0).await;
    assert_eq!(first.len(), HISTORY_PAGE);
    let (second, last) = page(200, next).await;
    assert_eq!(
        second,
        (total - 1_199..=total - 1_000).rev().collect::<Vec<_>>()
    );
    assert_eq!(last, 0);
    // A limit within one page asks for nothing more.
    assert_eq!(page(3, 0).await, (vec![total, total - 1, total - 2], 0));
    // Past the oldest, nothing.
    assert_eq!(page(0, 1).await, (Vec::new(), 0));
}

#[test]
fn a_history_page_stays_under_its_byte_bound_and_always_holds_one_version() {
    let store = MemoryStore::new();
    for i in 1..=5 {
        let summary = "x".repeat(if i == 5 {
            2 * HISTORY_PAGE_BYTES
        } else {
            300 * 1024
        });
        store.publish(new_version(i, summary), None).unwrap();
    }
    let metas = store.history(0, None).unwrap();
    // Version 5 alone is over the bound: it is sent alone.
    let answer = history_page(&metas, 0);
    assert_eq!(answer.versions.len(), 1);
    assert_eq!(answer.next_before, 5);
    let answer = history_page(&metas[1..], 0);
    let versions: Vec<u64> = answer.versions.iter().map(|v| v.version).collect();
    assert_eq!(versions, [4, 3, 2]);
    assert!(answer.encoded_len() <= HISTORY_PAGE_BYTES + 16);
    assert_eq!(answer.next_before, 2);
}

#[tokio::test]
async fn stats_refuses_an_unknown_order_window_and_fleet_status_can_send_counts_only() {
    let api = api(Mode::Api);
    // Three series: `b` retries most, `c` not at all.
    let aggregates = &api.control.aggregates;
    let checkout = aggregates.service("checkout");
    let counters = |endpoint: &str, calls, retries| pb::EndpointCounters {
        endpoint: endpoint.to_owned(),
        calls,
        attempts: calls + retries,
        retries,
        ..Default::default()
    };
    let report = pb::MetricsReport {
        policy_version: 1,
        endpoints: vec![
            counters("a", 10, 1),
            counters("b", 10, 5),
            counters("c", 10, 0),
        ],
        ..Default::default()
    };
    aggregates.ingest(&checkout, &report, tokio::time::Instant::now());
    for seconds in [0, 60, 300, 900] {
        let request = pb::StatsRequest {
            limit: 2,
            order_window_seconds: seconds,
            series_only: true,
            ..Default::default()
        };
        let stats = api.stats(Request::new(request)).await.unwrap().into_inner();
        let names: Vec<&str> = stats.series.iter().map(|s| s.endpoint.as_str()).collect();
        assert_eq!(
            names,
            ["b", "a"],
            "{seconds}: worst first, cut to the limit"
        );
        assert_eq!(stats.matched_series, 3);
        assert!(stats.endpoints.is_empty(), "series only");
    }
    let every = api
        .stats(Request::new(pb::StatsRequest::default()))
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = every.series.iter().map(|s| s.endpoint.as_str()).collect();
    assert_eq!(
        names,
        ["a", "b", "c"],
        "without a limit: by name, all of them"
    );
    assert_eq!(every.endpoints.len(), 3);
    let status = api
        .stats(Request::new(pb::StatsRequest {
            limit: 5,
            order_window_seconds: 120,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "order_window_seconds is 120; the windows are 60, 300 and 900 seconds"
    );

    let hello = |id: &str| pb::Hello {
        agent_id: id.to_owned(),
        service: "checkout".to_owned(),
        ..Default::default()
    };
    let fleet = &api.control.fleet;
    let _a = fleet.register(&hello("a"), None, None).unwrap();
    let b = fleet.register(&hello("b"), None, None).unwrap();
    fleet.disconnected("b", b.generation);
    let status = |counts_only| {
        let api = &api;
        async move {
            api.fleet_status(Request::new(pb::FleetStatusRequest {
                counts_only,
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner()
        }
    };
    let full = status(false).await;
    assert_eq!(full.agents.len(), 2);
    assert_eq!((full.connected_agents, full.known_agents), (1, 2));
    let counts = status(true).await;
    assert!(counts.agents.is_empty());
    assert_eq!((counts.connected_agents, counts.known_agents), (1, 2));
}

/// Serves `api` alone on 127.0.0.1:0 and returns a client of it: statuses then travel as
/// real trailers, with the limits clients put on them.
async fn loopback_client(
    api: AdminApi,
) -> pb::admin_service_client::AdminServiceClient<tonic::transport::Channel> {
    use pb::admin_service_server::AdminServiceServer;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AdminServiceServer::new(api))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    pb::admin_service_client::AdminServiceClient::new(channel)
}

/// A file of `count` endpoints named `name(i)`, each with `max_attempts: max_attempts`.
fn endpoints(count: usize, name: impl Fn(usize) -> String, max_attempts: u32) -> String {
    let mut yaml = "version: 1\nendpoints:\n".to_owned();
    for i in 0..count {
        yaml.push_str(&format!(
            "  {}: {{max_attempts: {max_attempts}}}\n",
            name(i)
        ));
    }
    yaml
}

#[test]
fn a_capped_list_keeps_whole_items_and_counts_the_rest() {
    let items = ["alpha".to_owned(), "béta".to_owned(), "gamma".repeat(10)];
    assert_eq!(
        capped_list(&items, ", ", 100, "endpoint", ""),
        items.join(", ")
    );
    // "alpha, " is 9 bytes on the wire (the space is %20), "… and 2 more endpoints" 38.
    let cut = capped_list(&items, ", ", 47, "endpoint", "");
    assert_eq!(cut, "alpha, … and 2 more endpoints");
    assert_eq!(wire_len(&cut), 47);
    assert_eq!(
        capped_list(&items, ", ", 46, "endpoint", "!"),
        "… and 3 more endpoints!"
    );
    // Non-ASCII and spaces count as sent: three bytes each.
    assert_eq!(wire_len("a é"), 1 + 3 + 3 * 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_problems_reach_the_caller_as_a_capped_status_ending_with_how_many_more() {
    let bad = endpoints(200, |i| format!("checkout-service-{i:04}"), 0);
    let all = retryplane_policy::load(bad.as_bytes()).diagnostics;
    assert_eq!(all.len(), 200);
    let mut client = loopback_client(api(Mode::Api)).await;
    let status = client.apply(apply_request(&bad)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let message = status.message();
    assert!(
        wire_len(message) <= MAX_MESSAGE_WIRE_BYTES,
        "{}",
        message.len()
    );
    let lines: Vec<&str> = message.lines().collect();
    let (last, shown) = lines.split_last().unwrap();
    assert!(shown.len() > 10, "{message}");
    // Whole diagnostics, in order, then the count of the rest.
    for (line, diagnostic) in shown.iter().zip(&all) {
        assert_eq!(*line, diagnostic.to_string());
    }
    assert_eq!(
        *last,
        format!(
            "… and {} more problems; Validate (retryplane validate) lists them all",
            200 - shown.len()
        )
    );
    // Validate still answers every one.
    let validated = client
        .validate(pb::ValidateRequest { source: yaml(&bad) })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(validated.diagnostics.len(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_thousand_long_named_endpoints_is_refused_with_a_capped_list() {
    let name = |i: usize| format!("{}-{i:04}", "a-rather-long-endpoint-name".repeat(4));
    let api = api(Mode::Api);
    apply(&api, apply_request(&endpoints(1_000, name, 2)))
        .await
        .unwrap();
    let mut client = loopback_client(api).await;
    let status = client.apply(apply_request(OTHER)).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let message = status.message();
    assert!(
        wire_len(message) <= MAX_MESSAGE_WIRE_BYTES,
        "{}",
        message.len()
    );
    assert!(
        message.starts_with(&format!(
            "the change removes every endpoint ({}, {}, ",
            name(0),
            name(1)
        )),
        "{message}"
    );
    let shown = message.matches(", a-rather").count() + 1;
    assert!(
        message.ends_with(&format!(
            ", … and {} more endpoints): none that agents call now would keep its policy; \
             pass --force to do it anyway",
            1_000 - shown
        )),
        "{message}"
    );
}

#[test]
fn either_refusal_of_removing_every_endpoint_fits_a_status_message() {
    let names: Vec<String> = (0..1_000)
        .map(|i| format!("{}-{i:04}", "a rather long endpoint name".repeat(4)))
        .collect();
    for after in [FORCE_IT, NO_FORCE_IN_FILE_MODE] {
        let message = removes_everything_message(&names, after);
        assert!(
            wire_len(&message) <= MAX_MESSAGE_WIRE_BYTES,
            "{} > {MAX_MESSAGE_WIRE_BYTES}",
            wire_len(&message)
        );
        assert!(
            message.ends_with(&format!(" more endpoints){after}")),
            "{message}"
        );
    }
}

/// A document from a wire client that writes a zero as `-0.0` is the content of one that
/// writes `0.0` (as a file's would be): not a new version, and stored without the sign.
#[tokio::test]
async fn a_document_that_only_changes_a_zeros_sign_is_no_change() {
    let admin = api(Mode::Api);
    let document = |ratio: f64| pb::ApplyRequest {
        source: Some(pb::PolicySource {
            kind: Some(Kind::Document(pb::PolicyDocument {
                endpoints: vec![pb::Endpoint {
                    name: "payments".to_owned(),
                    overlay: Some(pb::Overlay {
                        budget: Some(pb::Budget {
                            ratio: Some(ratio),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            })),
            origin: String::new(),
        }),
        ..Default::default()
    };
    let first = apply(&admin, document(0.0)).await.unwrap();
    assert_eq!(first.version, 1);
    let again = apply(&admin, document(-0.0)).await.unwrap();
    assert_eq!((again.version, again.content_hash), (1, first.content_hash));
    // Into an empty store, `-0.0` is stored as `0.0`.
    let fresh = api(Mode::Api);
    let stored = apply(&fresh, document(-0.0)).await.unwrap();
    let got = get(&fresh, stored.version).await.unwrap();
    let ratio = got.policies.unwrap().endpoints[0]
        .overlay
        .as_ref()
        .and_then(|o| o.budget.as_ref())
        .and_then(|b| b.ratio);
    assert!(ratio.is_some_and(f64::is_sign_positive), "{ratio:?}");
}

/// A version stored with a `-0.0` (as files were read before `-0.0` became `0.0`) keeps its
/// hash; applying the same file again, now read without the sign, changes nothing.
#[tokio::test]
async fn a_stored_negative_zero_and_the_same_file_read_again_are_no_change() {
    let store: Arc<dyn VersionStore> = Arc::new(MemoryStore::new());
    let admin = AdminApi::new(Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api)));
    let file = "version: 1\nendpoints:\n  payments:\n    budget: {ratio: -0.0}\n";
    let mut stored = {
        let set = retryplane_policy::load(file.as_bytes()).policies.unwrap();
        pb::PolicyDocument::from(set.document().as_ref())
    };
    let budget = stored.endpoints[0]
        .overlay
        .as_mut()
        .and_then(|o| o.budget.as_mut())
        .unwrap();
    budget.ratio = Some(-0.0);
    store
        .publish(
            crate::store::NewVersion {
                content_hash: convert::content_hash(&stored),
                document: stored,
                source: crate::store::Source::Admin,
                author: None,
                summary: "stored with -0.0".into(),
                created_unix_ms: 1,
            },
            None,
        )
        .unwrap();
    let dry = apply(
        &admin,
        pb::ApplyRequest {
            dry_run: true,
            ..apply_request(file)
        },
    )
    .await
    .unwrap();
    assert!(!dry.would_change && dry.diff.is_empty(), "{dry:?}");
    // One hash for one content: the stored version's.
    assert_eq!(dry.new_content_hash, dry.content_hash, "{dry:?}");
    let again = apply(&admin, apply_request(file)).await.unwrap();
    assert_eq!((again.version, again.changed), (1, false), "{again:?}");
    assert_eq!(history(&admin).await.len(), 1);
}

#[tokio::test]
async fn an_applied_files_warnings_come_back_with_their_places() {
    // `max_attempts: 6` is allowed, with a warning at its line and column.
    let text = "version: 1\nendpoints:\n  payments:\n    max_attempts: 6\n";
    let api = api(Mode::Api);
    for dry_run in [true, false] {
        let response = apply(
            &api,
            pb::ApplyRequest {
                dry_run,
                ..apply_request(text)
            },
        )
        .await
        .unwrap();
        let [warning] = response.warnings.as_slice() else {
            panic!("one warning expected: {:?}", response.warnings);
        };
        assert_eq!(warning.path, "endpoints.payments.max_attempts");
        assert_eq!((warning.line, warning.column), (4, 19), "{warning:?}");
    }
}

#[tokio::test]
async fn fleet_status_pages_by_agent_id() {
    let api = api(Mode::Api);
    let mut registrations = Vec::new();
    for id in ["d", "a", "c", "e", "b"] {
        let hello = pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            ..Default::default()
        };
        registrations.push(api.control.fleet.register(&hello, None, None).unwrap());
    }
    let page = |size: u32, token: &str| {
        let request = pb::FleetStatusRequest {
            page_size: size,
            page_token: token.to_owned(),
            ..Default::default()
        };
        let api = &api;
        async move {
            let answer = api
                .fleet_status(Request::new(request))
                .await
                .unwrap()
                .into_inner();
            let ids: Vec<String> = answer.agents.iter().map(|a| a.agent_id.clone()).collect();
            (ids, answer.next_page_token, answer.known_agents)
        }
    };
    assert_eq!(
        page(2, "").await,
        (vec!["a".into(), "b".into()], "b".into(), 5)
    );
    assert_eq!(
        page(2, "b").await,
        (vec!["c".into(), "d".into()], "d".into(), 5)
    );
    assert_eq!(page(2, "d").await, (vec!["e".into()], String::new(), 5));
    assert_eq!(
        page(3, "c").await,
        (vec!["d".into(), "e".into()], String::new(), 5)
    );
    // Exactly one page's worth left: no token, since nothing follows.
    assert_eq!(page(1, "d").await, (vec!["e".into()], String::new(), 5));
    // No size: every agent, as before paging.
    let (all, next, _) = page(0, "").await;
    assert_eq!((all.len(), next), (5, String::new()));
    drop(registrations);
}

#[tokio::test]
async fn documents_are_checked_a_few_at_a_time() {
    let api = api(Mode::Api);
    // Every turn taken, as by calls checking large documents.
    let turns: Vec<_> = every_turn(&api).await;
    let validate = || api.validate(Request::new(pb::ValidateRequest { source: yaml(V1) }));
    let dry_run = || {
        api.apply(Request::new(pb::ApplyRequest {
            dry_run: true,
            ..apply_request(V1)
        }))
    };
    // A check of a small document takes a few milliseconds; these wait for a turn.
    let waited = std::time::Duration::from_millis(300);
    assert!(tokio::time::timeout(waited, validate()).await.is_err());
    assert!(tokio::time::timeout(waited, dry_run()).await.is_err());
    drop(turns);
    assert!(validate().await.unwrap().into_inner().valid);
    dry_run().await.unwrap();
}

/// Takes every one of `api`'s turns to check a document.
async fn every_turn(api: &AdminApi) -> Vec<tokio::sync::OwnedSemaphorePermit> {
    let mut turns = Vec::new();
    for _ in 0..MAX_CONCURRENT_CHECKS {
        turns.push(api.check_turn(true).await.unwrap());
    }
    turns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_dropped_by_its_caller_keeps_its_turn_until_it_is_over() {
    let api = api(Mode::Api);
    // Large enough that its check takes a while after the call is dropped.
    let endpoints: String = (0..6_000)
        .map(|i| format!("  endpoint-{i:05}: {{max_attempts: 3, deadline: 5s}}\n"))
        .collect();
    let large = format!("version: 1\nendpoints:\n{endpoints}");
    // Every shared turn (the kept one is for changes).
    for _ in 1..MAX_CONCURRENT_CHECKS {
        let call = api.validate(Request::new(pb::ValidateRequest {
            source: yaml(&large),
        }));
        // The caller's deadline passes while the check runs.
        let dropped = tokio::time::timeout(std::time::Duration::from_millis(5), call).await;
        assert!(
            dropped.is_err(),
            "the check of a large document took under 5 ms"
        );
    }
    assert_eq!(
        api.checks.available_permits(),
        1,
        "the dropped calls' checks still run, and leave the kept turn"
    );
    // Each turn comes back once its check is over.
    let back = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while api.checks.available_permits() < MAX_CONCURRENT_CHECKS {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(back.is_ok(), "the turns came back");
}

#[tokio::test]
async fn a_write_refused_for_its_role_or_the_mode_is_refused_without_waiting_for_a_turn() {
    let waited = std::time::Duration::from_millis(300);
    let api_mode = api(Mode::Api);
    let turns = every_turn(&api_mode).await;
    let viewer = tokio::time::timeout(
        waited,
        api_mode.apply(with_role(crate::auth::Role::Viewer, apply_request(V2))),
    )
    .await;
    assert_eq!(
        viewer.expect("refused at once").unwrap_err().code(),
        Code::PermissionDenied
    );
    drop(turns);
    let file = api(Mode::File(PathBuf::from("config/policies.yaml")));
    let turns = every_turn(&file).await;
    let file_apply = tokio::time::timeout(waited, apply(&file, apply_request(V2))).await;
    assert_eq!(
        file_apply.expect("refused at once").unwrap_err().code(),
        Code::FailedPrecondition
    );
    drop(turns);
}

#[tokio::test]
async fn a_refusal_of_more_problems_than_validate_lists_counts_them_all_and_does_not_promise_them()
{
    // 1,500 endpoints with `max_attempts: 0`: 1,500 errors. The file's check keeps the first
    // 1,000 and one line "500 more error(s) not listed". The refusal then shows as many lines
    // as fit and ends "… and N more problems; Validate (retryplane validate) lists them all":
    // N counts the closing line as one problem (1,001 - shown, not 1,500 - shown), and
    // Validate lists only the first 1,000.
    let bad = endpoints(1_500, |i| format!("checkout-service-{i:04}"), 0);
    let status = apply(&api(Mode::Api), apply_request(&bad))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let lines: Vec<&str> = status.message().lines().collect();
    let (last, shown) = lines.split_last().unwrap();
    assert!(
        last.starts_with(&format!("… and {} more problems", 1_500 - shown.len())),
        "{last}"
    );
    assert!(!last.contains("lists them all"), "{last}");
}

/// With every shared check turn held (a read-only token's Validate calls in a loop), a viewer's
/// Validate waits, and so does an admin's; an admin's Apply takes the turn kept for changes.
#[tokio::test]
async fn an_apply_is_not_held_up_by_a_read_only_tokens_checks() {
    use crate::auth::Role;
    let api = api(Mode::Api);
    let mut held = Vec::new();
    for _ in 1..MAX_CONCURRENT_CHECKS {
        held.push(api.checks.acquire(1, false).await.unwrap());
    }
    let viewer = api.validate(with_role(
        Role::Viewer,
        pb::ValidateRequest { source: yaml(V1) },
    ));
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(100), viewer)
            .await
            .is_err(),
        "a viewer's Validate was checked with every shared turn held"
    );
    // An admin's Validate is a check only: it waits too.
    let admins_check = api.validate(with_role(
        Role::Admin,
        pb::ValidateRequest { source: yaml(V1) },
    ));
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(100), admins_check)
            .await
            .is_err(),
        "an admin's Validate took the turn kept for changes"
    );
    let applied = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        api.apply(with_role(Role::Admin, apply_request(V1))),
    )
    .await
    .expect("the Apply waited behind the viewer's checks")
    .unwrap()
    .into_inner();
    assert_eq!(applied.version, 1);
    drop(held);
}

/// A store that works until it is broken, then fails every call, as a store file truncated or
/// deleted under the control plane does.
struct BreakableStore {
    inner: MemoryStore,
    broken: std::sync::atomic::AtomicBool,
}

impl BreakableStore {
    fn check(&self) -> Result<(), crate::store::StoreError> {
        if self.broken.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(crate::store::StoreError::Corrupt("truncated".to_owned()));
        }
        Ok(())
    }
}

impl VersionStore for BreakableStore {
    fn current(&self) -> Result<Option<crate::store::VersionRecord>, crate::store::StoreError> {
        self.check()?;
        self.inner.current()
    }

    fn get(
        &self,
        version: u64,
    ) -> Result<Option<crate::store::VersionRecord>, crate::store::StoreError> {
        self.check()?;
        self.inner.get(version)
    }

    fn history(
        &self,
        limit: usize,
        before: Option<u64>,
    ) -> Result<Vec<VersionMeta>, crate::store::StoreError> {
        self.check()?;
        self.inner.history(limit, before)
    }

    fn publish(
        &self,
        new: crate::store::NewVersion,
        expected: Option<u64>,
    ) -> Result<crate::store::Published, crate::store::StoreError> {
        self.check()?;
        self.inner.publish(new, expected)
    }
}

#[tokio::test]
async fn a_failed_store_still_gives_the_version_served_from_memory() {
    // f13: with the store file truncated under a running control plane, agents were still
    // served v2, but `get` failed: the one copy left besides the agents' caches could not be
    // saved before a restart.
    let store = Arc::new(BreakableStore {
        inner: MemoryStore::new(),
        broken: std::sync::atomic::AtomicBool::new(false),
    });
    let api = AdminApi::new(Arc::new(ControlPlane::for_tests(store.clone(), Mode::Api)));
    apply(&api, apply_request(V1)).await.unwrap();
    apply(&api, apply_request(V2)).await.unwrap();
    let answer = api
        .get(Request::new(pb::GetRequest { version: 0 }))
        .await
        .unwrap();
    assert!(
        !answer
            .metadata()
            .contains_key(retryplane_proto::FROM_MEMORY_METADATA)
    );
    let stored = answer.into_inner();
    store
        .broken
        .store(true, std::sync::atomic::Ordering::SeqCst);

    // The version served, by number or as the current one: as it was stored, meta included,
    // and marked as answered from memory (the CLI says the store is failing).
    for version in [0, 2] {
        let answer = api
            .get(Request::new(pb::GetRequest { version }))
            .await
            .unwrap();
        assert_eq!(
            answer
                .metadata()
                .get(retryplane_proto::FROM_MEMORY_METADATA),
            Some(&tonic::metadata::MetadataValue::from_static("1"))
        );
        let got = answer.into_inner();
        assert_eq!(got, stored, "Get({version}) from memory");
        let info = got.info.unwrap();
        assert_eq!((info.version, info.author.as_str()), (2, "alice"));
    }
    // Any other version is in the store only: its failure is said as before.
    let status = get(&api, 1).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(
        status.message(),
        "the version store failed; see the control plane's log (`retryplane status` shows \
         whether the store fails its checks)"
    );
}
