//! Rendering reads back as the same values.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::codes::GrpcCode;
use crate::diff::same_content;
use crate::document::{AlertOverlay, EndpointDoc, FIELD_PATHS, RouteDoc};
use crate::load;
use crate::model::{ErrorClass, Jitter};

const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

/// Parses rendered text with the file parser alone (no range checks), so documents holding
/// values the validator refuses still round-trip.
fn reparse(text: &str) -> PolicyDocument {
    let root = crate::yaml::parse(text.as_bytes())
        .unwrap_or_else(|e| panic!("rendered text is not YAML: {e}\n{text}"));
    let mut diags = Vec::new();
    let doc = crate::parse::document(&root, &mut diags);
    assert_eq!(diags, vec![], "rendered text:\n{text}");
    doc.unwrap_or_else(|| panic!("no document from:\n{text}"))
}

/// The document of a valid file, rendered, loads with no errors and the same values.
fn assert_round_trips_valid(src: &str) {
    let loaded = load(src.as_bytes());
    let Some(set) = &loaded.policies else {
        panic!("invalid source: {:#?}", loaded.diagnostics);
    };
    let doc = (**set.document()).clone();
    let text = to_yaml(&doc);
    let again = load(text.as_bytes());
    let errors: Vec<_> = again.diagnostics.iter().filter(|d| d.is_error()).collect();
    assert!(errors.is_empty(), "{errors:#?}\n{text}");
    assert_eq!(again.diagnostics.len(), loaded.diagnostics.len(), "{text}");
    let back = again.policies.expect("valid rendering");
    assert!(same_content(&doc, back.document()), "{text}");
}

#[test]
fn the_example_file_round_trips_and_stays_valid() {
    assert_round_trips_valid(EXAMPLE);
}

#[test]
fn grpc_routes_and_disabled_sections_round_trip() {
    assert_round_trips_valid(
        "version: 1\ndefaults:\n  budget: {enabled: false}\n  retry_on: {errors: []}\nendpoints:\n  search:\n    circuit_breaker: {enabled: false, window: 5s}\n    budget: {enabled: true, ratio: 0.05}\n    routes:\n      - match: {grpc: /search.v1.SearchService/Query}\n        max_attempts: 2\n        budget: {enabled: false}\n      - match: {grpc: /search.v1.Indexer/*}\n        max_attempts: 1\n      - match: {path_prefix: /health}\n        retry_on: {grpc_status: [UNAVAILABLE, ABORTED]}\n",
    );
}

#[test]
fn names_yaml_would_misread_are_quoted_and_round_trip() {
    assert_round_trips_valid(
        "version: 1\nendpoints:\n  \"on\": {}\n  \"123\": {}\n  \"1.5\": {}\n  \"null\": {}\n  \"No\": {}\n  -x: {}\n",
    );
}

#[test]
fn renders_only_what_each_layer_sets_in_file_order() {
    let src = "version: 1\nendpoints:\n  payments:\n    per_try_timeout: 1500ms\n    backoff: {jitter: none, base: 1s}\n    budget: {enabled: false}\n    routes:\n      - match: {method: POST, path_prefix: /v1/charges}\n        max_attempts: 2\n      - match: {grpc: /p.v1.P/*}\n  inventory: {}\n";
    let doc = (**load(src.as_bytes()).policies.expect("valid").document()).clone();
    assert_eq!(
        to_yaml(&doc),
        "version: 1
endpoints:
  payments:
    backoff:
      base: 1s
      jitter: none
    per_try_timeout: 1500ms
    budget:
      enabled: false
    routes:
      - match: {method: POST, path_prefix: /v1/charges}
        max_attempts: 2
      - match: {grpc: \"/p.v1.P/*\"}
  inventory: {}
"
    );
}

#[test]
fn a_document_with_no_endpoints_still_renders_as_a_mapping() {
    assert_eq!(
        to_yaml(&PolicyDocument::default()),
        "version: 1\nendpoints: {}\n"
    );
}

#[test]
fn scalars_are_quoted_only_when_yaml_would_misread_them() {
    for plain in [
        "GET",
        "Idempotency-Key",
        "/v1/charges",
        "shipping-partner",
        "a.b_c",
    ] {
        assert_eq!(scalar(plain), plain);
    }
    let quoted = [
        ("on", "\"on\""),
        ("OFF", "\"OFF\""),
        ("True", "\"True\""),
        ("~", "\"~\""),
        ("null", "\"null\""),
        ("123", "\"123\""),
        ("1.5", "\"1.5\""),
        ("1e3", "\"1e3\""),
        (".inf", "\".inf\""),
        ("NaN", "\"NaN\""),
        ("-1", "\"-1\""),
        ("", "\"\""),
        ("a:b", "\"a:b\""),
        ("a b", "\"a b\""),
        ("#x", "\"#x\""),
        ("say \"hi\"\\", "\"say \\\"hi\\\"\\\\\""),
        ("tab\there\n", "\"tab\\there\\n\""),
        ("\u{1}\u{85}\u{2028}", "\"\\x01\\x85\\u2028\""),
        ("café", "\"café\""),
    ];
    for (input, want) in quoted {
        assert_eq!(scalar(input), want, "{input:?}");
    }
}

#[test]
fn leaf_values_cover_every_field_path() {
    let f = |d| Some(Field::new(Duration::from_millis(d)));
    let mut o = Overlay {
        max_attempts: Some(Field::new(2)),
        deadline: f(1),
        per_try_timeout: f(1),
        idempotent_methods: Some(Field::new(vec![Field::new("GET".into())])),
        idempotency_key_header: Some(Field::new("K".into())),
        ..Overlay::default()
    };
    o.backoff.base = f(1);
    o.backoff.max = f(1);
    o.backoff.multiplier = Some(Field::new(1.0));
    o.backoff.jitter = Some(Field::new(Jitter::None));
    o.retry_on.http_status = Some(Field::new(vec![]));
    o.retry_on.grpc_status = Some(Field::new(vec![]));
    o.retry_on.errors = Some(Field::new(vec![]));
    o.retry_after.honor = Some(Field::new(true));
    o.retry_after.max = f(1);
    o.budget.enabled = Some(Field::new(true));
    o.budget.ratio = Some(Field::new(0.5));
    o.budget.min_per_second = Some(Field::new(1));
    o.budget.window = f(1);
    o.circuit_breaker.enabled = Some(Field::new(true));
    o.circuit_breaker.failure_ratio = Some(Field::new(0.5));
    o.circuit_breaker.min_requests = Some(Field::new(1));
    o.circuit_breaker.window = f(1);
    o.circuit_breaker.open_for = f(1);
    o.circuit_breaker.half_open_probes = Some(Field::new(1));
    o.alert.retry_ratio = Some(Field::new(0.05));
    let paths: Vec<&str> = leaf_values(&o).into_iter().map(|(p, _)| p).collect();
    assert_eq!(paths, FIELD_PATHS);
    let set: Vec<&str> = o.set_fields().into_iter().map(|(p, _)| p).collect();
    assert_eq!(paths, set);
}

#[test]
fn floats_read_back_exactly() {
    for v in [2.0, 0.1, 1.5, 1e-7, 1e16, 123_456.789, 5e-324, f64::MAX] {
        let text = float(&v);
        let src = format!("version: 1\nendpoints:\n  a: {{budget: {{ratio: {text}}}}}\n");
        let doc = reparse(&src);
        let got = doc.endpoints[0]
            .overlay
            .budget
            .ratio
            .as_ref()
            .map(|f| f.value);
        assert_eq!(got, Some(v), "{text}");
    }
    // Exponent forms as YAML 1.1 readers take them for numbers too (a dot, a signed exponent).
    assert_eq!(float(&1e-7), "1.0e-7");
    assert_eq!(float(&1.5e20), "1.5e+20");
    assert_eq!(float(&0.1), "0.1");
}

// === property: any document a file can hold round-trips ===

fn field<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Field<T>> {
    s.prop_map(Field::new)
}

fn opt<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Option<Field<T>>> {
    proptest::option::of(field(s))
}

fn list<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Option<Field<Vec<Field<T>>>>> {
    opt(proptest::collection::vec(field(s), 0..4))
}

fn duration() -> impl Strategy<Value = Duration> {
    (0u64..=86_400_000).prop_map(Duration::from_millis)
}

fn finite() -> impl Strategy<Value = f64> {
    use proptest::num::f64::{NEGATIVE, NORMAL, POSITIVE, SUBNORMAL, ZERO};
    POSITIVE | NEGATIVE | NORMAL | SUBNORMAL | ZERO
}

fn overlay() -> impl Strategy<Value = Overlay> {
    let grpc = (1..=16i32).prop_map(|i| GrpcCode::from_i32(i).unwrap_or(GrpcCode::Unavailable));
    let top = (
        opt(any::<u32>()),
        opt(duration()),
        opt(duration()),
        list(any::<String>()),
        opt(any::<String>()),
    );
    let backoff = (
        opt(duration()),
        opt(duration()),
        opt(finite()),
        opt(proptest::sample::select(Jitter::ALL.to_vec())),
    );
    let retry_on = (
        list(400u16..=599),
        list(grpc),
        list(proptest::sample::select(ErrorClass::ALL.to_vec())),
    );
    let retry_after = (opt(any::<bool>()), opt(duration()));
    let budget = (
        opt(any::<bool>()),
        opt(finite()),
        opt(any::<u32>()),
        opt(duration()),
    );
    let breaker = (
        (opt(any::<bool>()), opt(finite()), opt(any::<u32>())),
        (opt(duration()), opt(duration()), opt(any::<u32>())),
    );
    let alert = opt(finite());
    (top, backoff, retry_on, retry_after, budget, breaker, alert).prop_map(
        |(
            (m, d, p, im, ik),
            (bb, bm, bx, bj),
            (rh, rg, re),
            (rah, ram),
            (ue, ur, um, uw),
            cb,
            al,
        )| {
            let ((ce, cr, cm), (cw, co, ch)) = cb;
            let mut o = Overlay {
                max_attempts: m,
                deadline: d,
                per_try_timeout: p,
                idempotent_methods: im,
                idempotency_key_header: ik,
                ..Overlay::default()
            };
            (
                o.backoff.base,
                o.backoff.max,
                o.backoff.multiplier,
                o.backoff.jitter,
            ) = (bb, bm, bx, bj);
            (
                o.retry_on.http_status,
                o.retry_on.grpc_status,
                o.retry_on.errors,
            ) = (rh, rg, re);
            (o.retry_after.honor, o.retry_after.max) = (rah, ram);
            (
                o.budget.enabled,
                o.budget.ratio,
                o.budget.min_per_second,
                o.budget.window,
            ) = (ue, ur, um, uw);
            let b = &mut o.circuit_breaker;
            (b.enabled, b.failure_ratio, b.min_requests) = (ce, cr, cm);
            (b.window, b.open_for, b.half_open_probes) = (cw, co, ch);
            o.alert.retry_ratio = al;
            o
        },
    )
}

fn route_match() -> impl Strategy<Value = RouteMatch> {
    let http = (
        proptest::option::of("[A-Z][A-Z0-9_-]{0,7}"),
        any::<String>().prop_map(|s| format!("/{s}")),
    )
        .prop_map(|(method, path_prefix)| RouteMatch::Http {
            method,
            path_prefix,
        });
    let grpc = (
        "[a-z][a-z0-9_]{0,5}(\\.[A-Za-z_][A-Za-z0-9_]{0,5}){0,2}",
        proptest::option::of("[A-Za-z_][A-Za-z0-9_]{0,7}"),
    )
        .prop_map(|(service, method)| RouteMatch::Grpc { service, method });
    prop_oneof![http, grpc]
}

fn document() -> impl Strategy<Value = PolicyDocument> {
    // A file cannot set `alert` on a route.
    let route = (field(route_match()), overlay()).prop_map(|(matcher, mut overlay)| {
        overlay.alert = AlertOverlay::default();
        RouteDoc {
            matcher,
            prefix_loc: crate::yaml::Loc::UNKNOWN,
            overlay,
            index: 0,
        }
    });
    let endpoint = (
        field(any::<String>()),
        overlay(),
        proptest::collection::vec(route, 0..3),
    )
        .prop_map(|(name, overlay, mut routes)| {
            for (i, route) in routes.iter_mut().enumerate() {
                route.index = i;
            }
            EndpointDoc {
                name,
                overlay,
                routes,
            }
        });
    (overlay(), proptest::collection::vec(endpoint, 1..4)).prop_map(|(defaults, endpoints)| {
        let mut seen = HashSet::new();
        let endpoints = endpoints
            .into_iter()
            .filter(|e| seen.insert(e.name.value.clone()))
            .collect();
        PolicyDocument {
            defaults,
            endpoints,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn any_document_a_file_can_hold_reads_back_the_same(doc in document()) {
        let text = to_yaml(&doc);
        let back = reparse(&text);
        prop_assert!(same_content(&doc, &back), "{text}\n{back:#?}");
        prop_assert_eq!(crate::diff::diff(&doc, &back), vec![]);
    }

    #[test]
    fn any_document_reads_back_the_same_from_its_compact_rendering(doc in document()) {
        let text = to_yaml_compact(&doc);
        let back = reparse(&text);
        prop_assert!(same_content(&doc, &back), "{text}\n{back:#?}");
        prop_assert_eq!(crate::diff::diff(&doc, &back), vec![]);
    }
}

#[test]
fn alert_renders_as_a_block_mapping_and_round_trips() {
    let src = "version: 1\ndefaults:\n  alert: {retry_ratio: 0.05}\nendpoints:\n  payments:\n    max_attempts: 4\n    alert: {retry_ratio: 0.02}\n  inventory: {}\n";
    let doc = (**load(src.as_bytes()).policies.expect("valid").document()).clone();
    assert_eq!(
        to_yaml(&doc),
        "version: 1
defaults:
  alert:
    retry_ratio: 0.05
endpoints:
  payments:
    max_attempts: 4
    alert:
      retry_ratio: 0.02
  inventory: {}
"
    );
    assert_round_trips_valid(src);
}

#[test]
fn the_compact_rendering_puts_each_endpoint_on_one_line() {
    let src = "version: 1
defaults:
  max_attempts: 2
endpoints:
  payments:
    max_attempts: 4
    backoff: {base: 50ms, max: 1s}
    deadline: 3s
    retry_on: {http_status: [503], errors: [connect]}
    routes:
      - match: {method: POST, path_prefix: /v1/charges}
        max_attempts: 2
        budget: {ratio: 0.1}
      - match: {grpc: /pkg.Svc/Get}
  inventory: {}
";
    let doc = reparse(src);
    assert_eq!(
        to_yaml_compact(&doc),
        "version: 1
defaults:
  max_attempts: 2
endpoints:
 payments: {max_attempts: 4,backoff: {base: 50ms,max: 1s},deadline: 3s,retry_on: {http_status: [503],errors: [connect]},routes: [{match: {method: POST, path_prefix: /v1/charges},max_attempts: 2,budget: {ratio: 0.1}},{match: {grpc: /pkg.Svc/Get}}]}
 inventory: {}
"
    );
}

/// A valid file near the size limit, one endpoint a line as a generator writes it: what `get`
/// prints of it must be a file the limit takes again (block style would add about a fifth).
#[test]
fn a_file_near_the_size_limit_renders_within_it() {
    let mut src = String::from("version: 1\nendpoints:\n");
    let mut n = 0;
    while src.len() < crate::yaml::MAX_FILE_BYTES - 200 {
        let _ = writeln!(
            src,
            "  endpoint-{n:06}: {{max_attempts: 4, backoff: {{base: 50ms, max: 2s}}, retry_on: {{http_status: [503]}}}}"
        );
        n += 1;
    }
    assert!(to_yaml_block(&reparse(&src)).len() > crate::yaml::MAX_FILE_BYTES);
    let loaded = load(src.as_bytes());
    let doc = (**loaded.policies.expect("valid").document()).clone();
    let text = to_yaml(&doc);
    assert!(
        text.len() <= crate::yaml::MAX_FILE_BYTES,
        "{} bytes",
        text.len()
    );
    let back = load(text.as_bytes())
        .policies
        .expect("the rendering is a valid file");
    assert!(same_content(&doc, back.document()));
}

/// `src`, a valid file, rendered: within the size limit, and the same policies again.
fn renders_within_the_limit(src: &str) {
    assert!(src.len() <= crate::yaml::MAX_FILE_BYTES);
    let loaded = load(src.as_bytes());
    let doc = (**loaded.policies.expect("valid").document()).clone();
    let text = to_yaml(&doc);
    assert!(
        text.len() <= crate::yaml::MAX_FILE_BYTES,
        "a valid {}-byte file renders as {} bytes",
        src.len(),
        text.len()
    );
    let back = load(text.as_bytes())
        .policies
        .expect("the rendering is a valid file");
    assert!(same_content(&doc, back.document()));
}

#[test]
fn a_file_near_the_limit_written_tighter_still_renders_within_it() {
    // One space of indent, as a generator may write it.
    let mut src = String::from("version: 1\nendpoints:\n");
    let mut n = 0;
    while src.len() < crate::yaml::MAX_FILE_BYTES - 64 {
        let _ = writeln!(src, " e{n:06}: {{max_attempts: 4}}");
        n += 1;
    }
    renders_within_the_limit(&src);
    // JSON on one line, as `jq -c` writes it (JSON is YAML).
    let mut src = String::from("{\"version\":1,\"endpoints\":{");
    let mut n = 0;
    while src.len() < crate::yaml::MAX_FILE_BYTES - 128 {
        if n > 0 {
            src.push(',');
        }
        let _ = write!(src, "\"endpoint-number-{n:08}\":{{\"max_attempts\":4}}");
        n += 1;
    }
    src.push_str("}}\n");
    renders_within_the_limit(&src);
}
