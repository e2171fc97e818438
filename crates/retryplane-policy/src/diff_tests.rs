//! Diffs by value: places never count, values always do.

use super::*;
use crate::load;

const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

fn doc(src: &str) -> PolicyDocument {
    let loaded = load(src.as_bytes());
    let set = loaded.policies.unwrap_or_else(|| {
        panic!("invalid test document: {:#?}", loaded.diagnostics);
    });
    (**set.document()).clone()
}

fn details(changes: &[Change], scope: &str) -> Vec<String> {
    changes
        .iter()
        .find(|c| c.scope.to_string() == scope)
        .map(|c| c.details.clone())
        .unwrap_or_else(|| panic!("no change for {scope}: {changes:#?}"))
}

#[test]
fn identical_documents_have_no_changes() {
    let a = doc(EXAMPLE);
    assert_eq!(diff(&a, &a.clone()), vec![]);
    assert!(same_content(&a, &a));
    assert_eq!(summary(&diff(&a, &a)), "no changes");
}

#[test]
fn a_file_saved_again_with_new_comments_and_layout_has_no_changes() {
    let a = doc(EXAMPLE);
    let relocated = format!(
        "# a new header comment\n\n\n{}",
        EXAMPLE.replace("  payments:\n", "  # card payments\n\n  payments:\n")
    );
    let b = doc(&relocated);
    assert_ne!(a, b, "places differ");
    assert_eq!(diff(&a, &b), vec![]);
    assert!(same_content(&a, &b));
}

#[test]
fn flow_and_block_style_of_the_same_values_are_the_same_content() {
    let a = doc("version: 1\nendpoints:\n  a: {backoff: {base: 1s, max: 2s}}\n");
    let b = doc("version: 1\nendpoints:\n  a:\n    backoff:\n      base: 1000ms\n      max: 2s\n");
    assert!(same_content(&a, &b));
    assert_eq!(diff(&a, &b), vec![]);
}

#[test]
fn lists_that_read_as_sets_in_another_order_or_repeated_are_no_change() {
    let a = doc(
        "version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [500, 503], grpc_status: [UNAVAILABLE, RESOURCE_EXHAUSTED], errors: [connect, reset]}\n    idempotent_methods: [GET, PUT]\n",
    );
    let b = doc(
        "version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [503, 500, 503], grpc_status: [RESOURCE_EXHAUSTED, UNAVAILABLE], errors: [reset, connect]}\n    idempotent_methods: [PUT, GET]\n",
    );
    assert_eq!(diff(&a, &b), []);
    let c = doc(
        "version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [503, 502], grpc_status: [RESOURCE_EXHAUSTED, UNAVAILABLE], errors: [reset, connect]}\n    idempotent_methods: [PUT, GET]\n",
    );
    assert_eq!(
        details(&diff(&a, &c), "a"),
        ["retry_on.http_status: [500, 503] -> [503, 502]"]
    );
}

#[test]
fn reordered_endpoints_are_the_same_content() {
    let a = doc("version: 1\nendpoints:\n  a: {max_attempts: 2}\n  b: {}\n");
    let b = doc("version: 1\nendpoints:\n  b: {}\n  a: {max_attempts: 2}\n");
    assert!(same_content(&a, &b));
    assert_eq!(diff(&a, &b), vec![]);
}

#[test]
fn an_added_endpoint_lists_what_it_sets() {
    let a = doc("version: 1\nendpoints:\n  a: {}\n");
    let b = doc(
        "version: 1\nendpoints:\n  a: {}\n  b:\n    max_attempts: 2\n    routes:\n      - match: {grpc: /s.v1.S/*}\n        deadline: 5s\n",
    );
    let changes = diff(&a, &b);
    assert_eq!(
        changes,
        vec![Change {
            scope: Scope::Endpoint("b".into()),
            kind: ChangeKind::Added,
            details: vec![
                "max_attempts: 2".into(),
                "routes[0] added: /s.v1.S/*".into(),
                "routes[0].deadline: 5s".into(),
            ],
        }]
    );
    assert_eq!(summary(&changes), "+1 endpoint (b), -0, 0 modified");
    assert!(!same_content(&a, &b));
}

#[test]
fn a_removed_endpoint_is_reported_after_the_others() {
    let a = doc("version: 1\nendpoints:\n  a: {}\n  b: {}\n  c: {}\n");
    let b = doc("version: 1\nendpoints:\n  c: {max_attempts: 2}\n");
    let changes = diff(&a, &b);
    let kinds: Vec<(Option<&str>, ChangeKind)> = changes
        .iter()
        .map(|c| (c.scope.endpoint(), c.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            (Some("c"), ChangeKind::Modified),
            (Some("a"), ChangeKind::Removed),
            (Some("b"), ChangeKind::Removed)
        ]
    );
    assert_eq!(summary(&changes), "+0 endpoints, -2 (a, b), 1 modified (c)");
}

/// A count names three endpoints, and past three says how many more.
#[test]
fn a_summary_names_three_endpoints_a_count_then_how_many_more() {
    let none = doc("version: 1\nendpoints:\n  z: {}\n");
    let three = doc("version: 1\nendpoints:\n  z: {}\n  a: {}\n  b: {}\n  c: {}\n");
    let four = doc("version: 1\nendpoints:\n  z: {}\n  a: {}\n  b: {}\n  c: {}\n  d: {}\n");
    assert_eq!(
        summary(&diff(&none, &three)),
        "+3 endpoints (a, b, c), -0, 0 modified"
    );
    assert_eq!(
        summary(&diff(&none, &four)),
        "+4 endpoints (a, b, c, … 1 more), -0, 0 modified"
    );
    assert_eq!(
        summary(&diff(&four, &none)),
        "+0 endpoints, -4 (a, b, c, … 1 more), 0 modified"
    );
}

/// `n` endpoints `ep-<i>` for `i` in `range`, each with `max_attempts` from `attempts(i)`.
fn many(range: std::ops::Range<usize>, attempts: impl Fn(usize) -> usize) -> PolicyDocument {
    let mut src = String::from("version: 1\nendpoints:\n");
    for i in range {
        src.push_str(&format!("  ep-{i}: {{max_attempts: {}}}\n", attempts(i)));
    }
    doc(&src)
}

#[test]
fn a_large_document_is_diffed_endpoint_by_endpoint() {
    // 5,000 endpoints: 0..1000 removed, 1000..5000 kept, every 10th of them modified,
    // 5000..6000 added, and the new file lists its endpoints in reverse order.
    let old = many(0..5_000, |_| 3);
    let mut new = many(1_000..6_000, |i| if i % 10 == 0 { 4 } else { 3 });
    new.endpoints.reverse();
    let changes = diff(&old, &new);
    let of = |kind| changes.iter().filter(|c| c.kind == kind).count();
    assert_eq!(of(ChangeKind::Added), 1_000);
    assert_eq!(of(ChangeKind::Removed), 1_000);
    assert_eq!(of(ChangeKind::Modified), 400);
    assert_eq!(
        summary(&changes),
        "+1000 endpoints (ep-5999, ep-5998, ep-5997, … 997 more), -1000 (ep-0, ep-1, ep-2, … 997 more), 400 modified (ep-4990, ep-4980, ep-4970, … 397 more)"
    );
    // Added and modified in the new file's order, then removed in the old file's order.
    let scopes: Vec<&str> = changes.iter().filter_map(|c| c.scope.endpoint()).collect();
    assert_eq!(&scopes[..3], ["ep-5999", "ep-5998", "ep-5997"]);
    assert_eq!(scopes[1_000], "ep-4990");
    assert_eq!(details(&changes, "ep-4990"), ["max_attempts: 3 -> 4"]);
    assert_eq!(details(&changes, "ep-5999"), ["max_attempts: 3"]);
    assert_eq!(&scopes[1_400..1_402], ["ep-0", "ep-1"]);
    assert_eq!(scopes.last(), Some(&"ep-999"));
    assert_eq!(diff(&new, &new), vec![]);
}

#[test]
fn a_modified_field_shows_old_and_new_values_in_file_syntax() {
    let a = doc(
        "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n    backoff: {base: 100ms}\n    retry_on: {http_status: [503]}\n",
    );
    let b = doc(
        "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n    backoff: {base: 1500ms, jitter: none}\n    retry_on: {http_status: [429, 503]}\n",
    );
    let changes = diff(&a, &b);
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].kind, ChangeKind::Modified);
    assert_eq!(
        details(&changes, "payments"),
        [
            "max_attempts: 3 -> 4",
            "backoff.base: 100ms -> 1500ms",
            "backoff.jitter: full (inherited) -> none",
            "retry_on.http_status: [503] -> [429, 503]",
        ]
    );
}

#[test]
fn an_unset_field_goes_back_to_inherited() {
    let a = doc(
        "version: 1\nendpoints:\n  a: {budget: {enabled: false}, idempotency_key_header: X-Id}\n",
    );
    let b = doc("version: 1\nendpoints:\n  a: {}\n");
    assert_eq!(
        details(&diff(&a, &b), "a"),
        [
            "idempotency_key_header: X-Id -> Idempotency-Key (inherited)",
            "budget.enabled: false -> true (inherited)",
        ]
    );
}

#[test]
fn an_empty_list_differs_from_an_absent_one() {
    let a = doc("version: 1\nendpoints:\n  a: {}\n");
    let b = doc("version: 1\nendpoints:\n  a: {retry_on: {errors: []}}\n");
    assert_eq!(
        details(&diff(&a, &b), "a"),
        ["retry_on.errors: [connect, reset, timeout] (inherited) -> []"]
    );
    assert!(!same_content(&a, &b));
}

const ROUTES: &str = "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {method: POST, path_prefix: /v1/charges}\n        max_attempts: 2\n      - match: {method: GET, path_prefix: /v1/charges}\n        per_try_timeout: 500ms\n";

#[test]
fn an_added_route_is_named_by_its_match() {
    let b = doc(&ROUTES.replace(
        "    routes:\n",
        "    routes:\n      - match: {path_prefix: /v1/refunds}\n",
    ));
    assert_eq!(
        details(&diff(&doc(ROUTES), &b), "payments"),
        ["routes[0] added: * /v1/refunds"]
    );
}

#[test]
fn a_removed_route_is_named_by_its_match() {
    let b = doc(
        "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {method: POST, path_prefix: /v1/charges}\n        max_attempts: 2\n",
    );
    assert_eq!(
        details(&diff(&doc(ROUTES), &b), "payments"),
        ["routes[1] removed: GET /v1/charges"]
    );
}

#[test]
fn a_modified_route_shows_its_changed_fields() {
    let b = doc(&ROUTES.replace("max_attempts: 2", "max_attempts: 3"));
    assert_eq!(
        details(&diff(&doc(ROUTES), &b), "payments"),
        ["routes[0].max_attempts: 2 -> 3"]
    );
}

#[test]
fn reordered_routes_are_a_change_because_the_first_match_wins() {
    let b = doc(
        "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {method: GET, path_prefix: /v1/charges}\n        per_try_timeout: 500ms\n      - match: {method: POST, path_prefix: /v1/charges}\n        max_attempts: 2\n",
    );
    let a = doc(ROUTES);
    assert_eq!(
        details(&diff(&a, &b), "payments"),
        [
            "routes[0] moved from routes[1]: GET /v1/charges",
            "routes[1] moved from routes[0]: POST /v1/charges",
        ]
    );
    assert!(!same_content(&a, &b));
}

#[test]
fn a_defaults_change_comes_first_and_is_counted_apart() {
    let a = doc("version: 1\ndefaults: {deadline: 15s}\nendpoints:\n  a: {}\n");
    let b = doc("version: 1\ndefaults: {deadline: 20s}\nendpoints:\n  a: {}\n  b: {}\n");
    let changes = diff(&a, &b);
    assert_eq!(changes[0].scope, Scope::Defaults);
    assert_eq!(changes[0].kind, ChangeKind::Modified);
    assert_eq!(changes[0].details, ["deadline: 15s -> 20s"]);
    assert_eq!(
        summary(&changes),
        "+1 endpoint (b), -0, 0 modified, defaults modified"
    );
    assert_eq!(
        changes[0].to_string(),
        "defaults modified: deadline: 15s -> 20s"
    );
}

#[test]
fn grpc_codes_and_floats_are_written_as_in_a_file() {
    let a = doc(
        "version: 1\nendpoints:\n  a: {retry_on: {grpc_status: [UNAVAILABLE]}, backoff: {multiplier: 2}}\n",
    );
    let b = doc(
        "version: 1\nendpoints:\n  a: {retry_on: {grpc_status: [UNAVAILABLE, ABORTED]}, backoff: {multiplier: 1.5}}\n",
    );
    assert_eq!(
        details(&diff(&a, &b), "a"),
        [
            "backoff.multiplier: 2.0 -> 1.5",
            "retry_on.grpc_status: [UNAVAILABLE] -> [UNAVAILABLE, ABORTED]",
        ]
    );
}

#[test]
fn alert_changes_are_shown_like_other_fields() {
    let a = doc("version: 1\nendpoints:\n  a: {}\n  b:\n    alert: {retry_ratio: 0.05}\n");
    let b = doc(
        "version: 1\ndefaults:\n  alert: {retry_ratio: 0.1}\nendpoints:\n  a:\n    alert:\n      retry_ratio: 0.02\n  b: {}\n",
    );
    let changes = diff(&a, &b);
    assert_eq!(
        details(&changes, "defaults"),
        ["alert.retry_ratio: 0.05 (inherited) -> 0.1"]
    );
    assert_eq!(
        details(&changes, "a"),
        ["alert.retry_ratio: 0.05 (inherited) -> 0.02"]
    );
    assert_eq!(
        details(&changes, "b"),
        // What it inherits now: the new `defaults:`.
        ["alert.retry_ratio: 0.05 -> 0.1 (inherited)"]
    );
    assert!(!same_content(&a, &b));
    let added = diff(
        &a,
        &doc("version: 1\nendpoints:\n  c: {alert: {retry_ratio: 0.2}}\n"),
    );
    assert_eq!(details(&added, "c"), ["alert.retry_ratio: 0.2"]);
}

#[test]
fn an_endpoint_named_defaults_is_an_endpoint_not_the_defaults_block() {
    let a = doc("version: 1\nendpoints:\n  a: {}\n");
    let b = doc("version: 1\nendpoints:\n  a: {}\n  defaults: {max_attempts: 2}\n");
    let added = diff(&a, &b);
    assert_eq!(added[0].scope, Scope::Endpoint("defaults".into()));
    assert_eq!(
        summary(&added),
        "+1 endpoint (endpoints.defaults), -0, 0 modified"
    );
    assert_eq!(
        added[0].to_string(),
        "endpoints.defaults added: max_attempts: 2"
    );
    let c = doc(
        "version: 1\ndefaults: {deadline: 20s}\nendpoints:\n  a: {}\n  defaults: {max_attempts: 3}\n",
    );
    let both = diff(&b, &c);
    let shown: Vec<String> = both.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        [
            "defaults modified: deadline: 15s (inherited) -> 20s",
            "endpoints.defaults modified: max_attempts: 2 -> 3"
        ]
    );
    assert_eq!(
        summary(&both),
        "+0 endpoints, -0, 1 modified (endpoints.defaults), defaults modified"
    );
    let removed = diff(&c, &a);
    assert_eq!(
        summary(&removed),
        "+0 endpoints, -1 (endpoints.defaults), 0 modified, defaults modified"
    );
}

#[test]
fn a_negative_zero_built_in_code_is_no_change_from_zero() {
    let zero = doc(
        "version: 1\nendpoints:\n  a: {budget: {ratio: 0}, circuit_breaker: {failure_ratio: 0.0}}\n",
    );
    let mut minus = zero.clone();
    let o = &mut minus.endpoints[0].overlay;
    o.budget.ratio = Some(crate::document::Field::new(-0.0));
    o.circuit_breaker.failure_ratio = Some(crate::document::Field::new(-0.0));
    assert!(same_content(&zero, &minus));
    assert_eq!(diff(&zero, &minus), vec![]);
}

/// A field a layer does not set shows what it inherits on that side: an endpoint from that
/// side's `defaults:`, a route from its endpoint as that side has it.
#[test]
fn an_inherited_side_shows_the_value_it_inherits_there() {
    let a = doc(
        "version: 1\ndefaults: {max_attempts: 4}\nendpoints:\n  p:\n    deadline: 3s\n    routes:\n      - match: {method: POST}\n        deadline: 2500ms\n",
    );
    let b = doc(
        "version: 1\ndefaults: {max_attempts: 5}\nendpoints:\n  p:\n    deadline: 4s\n    max_attempts: 2\n    routes:\n      - match: {method: POST}\n        max_attempts: 1\n",
    );
    assert_eq!(
        details(&diff(&a, &b), "p"),
        [
            "max_attempts: 4 (inherited) -> 2",
            "deadline: 3s -> 4s",
            "routes[0].max_attempts: 4 (inherited) -> 1",
            "routes[0].deadline: 2500ms -> 4s (inherited)",
        ]
    );
}

/// Fields set to the value they inherited (or no longer set, inheriting the same value) change
/// the document, not what a call gets: two or more of a kind are one line, at the place of the
/// first; one alone is shown as any change.
#[test]
fn fields_set_to_the_values_they_inherit_are_folded_into_one_line() {
    let bare = doc("version: 1\nendpoints:\n  a: {}\n");
    let restated = doc(
        "version: 1\ndefaults:\n  max_attempts: 3\n  deadline: 15s\n  per_try_timeout: 2s\n  \
         backoff: {base: 100ms}\nendpoints:\n  a: {}\n",
    );
    assert_eq!(
        details(&diff(&bare, &restated), "defaults"),
        [
            "4 fields set to the values they inherited (max_attempts, backoff.base, deadline, per_try_timeout)"
        ]
    );
    assert_eq!(
        details(&diff(&restated, &bare), "defaults"),
        [
            "4 fields no longer set, inheriting the same values (max_attempts, backoff.base, deadline, per_try_timeout)"
        ]
    );
    // One alone, and beside a real change: each as it is.
    let one =
        doc("version: 1\ndefaults:\n  max_attempts: 3\n  deadline: 20s\nendpoints:\n  a: {}\n");
    assert_eq!(
        details(&diff(&bare, &one), "defaults"),
        [
            "max_attempts: 3 (inherited) -> 3",
            "deadline: 15s (inherited) -> 20s"
        ]
    );
    // A route's fields, with its prefix.
    let route = |extra: &str| {
        doc(&format!(
            "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {{path_prefix: /x}}\n{extra}"
        ))
    };
    assert_eq!(
        details(
            &diff(
                &route(""),
                &route("        max_attempts: 3\n        deadline: 15s\n")
            ),
            "a"
        ),
        ["2 fields set to the values they inherited (routes[0].max_attempts, routes[0].deadline)"]
    );
}
