//! The wire form carries every value, and what it cannot carry is refused with its path.

use retryplane_policy::diff::{diff, same_content};
use retryplane_policy::load;

use super::*;

const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

fn example() -> PolicyDocument {
    let loaded = load(EXAMPLE.as_bytes());
    let set = loaded.policies.unwrap_or_else(|| {
        panic!("example is invalid: {:#?}", loaded.diagnostics);
    });
    (**set.document()).clone()
}

fn endpoint(name: &str, overlay: pb::Overlay) -> pb::Endpoint {
    pb::Endpoint {
        name: name.to_owned(),
        overlay: Some(overlay),
        routes: vec![],
    }
}

fn doc(endpoints: Vec<pb::Endpoint>) -> pb::PolicyDocument {
    pb::PolicyDocument {
        defaults: None,
        endpoints,
    }
}

/// The `(path, message)` of every conversion error.
fn errors(doc: pb::PolicyDocument) -> Vec<(String, String)> {
    match PolicyDocument::try_from(doc) {
        Ok(d) => panic!("accepted: {d:#?}"),
        Err(e) => e.errors.into_iter().map(|d| (d.path, d.message)).collect(),
    }
}

fn paths(doc: pb::PolicyDocument) -> Vec<String> {
    errors(doc).into_iter().map(|(p, _)| p).collect()
}

#[test]
fn the_example_file_round_trips_through_the_wire() {
    let original = example();
    let wire = pb::PolicyDocument::from(&original);
    let back = PolicyDocument::try_from(wire.clone()).unwrap();
    assert!(same_content(&original, &back));
    assert_eq!(diff(&original, &back), vec![]);
    assert_eq!(pb::PolicyDocument::from(&back), wire);
}

#[test]
fn the_wire_form_keeps_units_enums_and_empty_lists() {
    let src = "version: 1\nendpoints:\n  a:\n    deadline: 1m\n    backoff: {jitter: decorrelated}\n    retry_on: {grpc_status: [UNAVAILABLE], errors: []}\n    routes:\n      - match: {grpc: /s.v1.S/*}\n";
    let d = load(src.as_bytes()).policies.unwrap();
    let wire = pb::PolicyDocument::from(&**d.document());
    assert_eq!(wire.defaults, None);
    let ep = &wire.endpoints[0];
    let o = ep.overlay.as_ref().unwrap();
    assert_eq!(o.deadline_ms, Some(60_000));
    assert_eq!(
        o.backoff.as_ref().unwrap().jitter,
        pb::Jitter::Decorrelated as i32
    );
    let retry_on = o.retry_on.as_ref().unwrap();
    assert_eq!(retry_on.http_status, None);
    assert_eq!(retry_on.grpc_status.as_ref().unwrap().codes, [14]);
    assert_eq!(
        retry_on.errors,
        Some(pb::ErrorClassList { classes: vec![] })
    );
    assert_eq!(o.budget, None);
    assert_eq!(
        ep.routes[0].r#match,
        Some(pb::RouteMatch {
            kind: Some(pb::route_match::Kind::Grpc(pb::GrpcMatch {
                service: "s.v1.S".into(),
                method: String::new(),
            })),
        })
    );
    assert_eq!(ep.routes[0].overlay, None);
}

#[test]
fn validate_runs_the_file_validator_on_wire_documents() {
    let (set, warnings) = validate(pb::PolicyDocument::from(&example())).unwrap();
    assert_eq!(warnings, vec![]);
    assert_eq!(set.len(), 5);
    let bad = doc(vec![endpoint(
        "payments",
        pb::Overlay {
            max_attempts: Some(0),
            ..Default::default()
        },
    )]);
    let errs = validate(bad).unwrap_err();
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].path, "endpoints.payments.max_attempts");
    assert_eq!(errs[0].loc, Loc::UNKNOWN);
}

#[test]
fn a_wire_route_may_only_turn_the_shared_budget_and_breaker_off() {
    let mut off = endpoint("a", pb::Overlay::default());
    off.routes = vec![pb::Route {
        r#match: http("GET", "/x"),
        overlay: Some(pb::Overlay {
            budget: Some(pb::Budget {
                enabled: Some(false),
                ..Default::default()
            }),
            circuit_breaker: Some(pb::CircuitBreaker {
                enabled: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }];
    assert!(validate(doc(vec![off])).is_ok());
    let mut on = endpoint("a", pb::Overlay::default());
    on.routes = vec![pb::Route {
        r#match: http("GET", "/x"),
        overlay: Some(pb::Overlay {
            budget: Some(pb::Budget {
                enabled: Some(true),
                ..Default::default()
            }),
            circuit_breaker: Some(pb::CircuitBreaker {
                min_requests: Some(5),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }];
    let errs = validate(doc(vec![on])).unwrap_err();
    let got: Vec<(&str, bool)> = errs
        .iter()
        .map(|d| {
            (
                d.path.as_str(),
                d.message.contains("a route can only turn it off"),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("endpoints.a.routes[0].budget.enabled", true),
            ("endpoints.a.routes[0].circuit_breaker.min_requests", true),
        ]
    );
}

#[test]
fn the_content_hash_ignores_comments_and_endpoint_order_but_not_values() {
    let original = pb::PolicyDocument::from(&example());
    let hash = content_hash(&original);
    assert_eq!(hash.len(), 64);
    assert!(
        hash.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );

    let recommented = EXAMPLE
        .replace("# ", "#  ")
        .replace("\nendpoints:", "\n\n# endpoints\nendpoints:");
    let again = load(recommented.as_bytes()).policies.unwrap();
    assert_eq!(
        content_hash(&pb::PolicyDocument::from(&**again.document())),
        hash
    );

    let mut reordered = original.clone();
    reordered.endpoints.reverse();
    assert_eq!(content_hash(&reordered), hash);

    let changed = load(
        EXAMPLE
            .replace("max_attempts: 4", "max_attempts: 5")
            .as_bytes(),
    )
    .policies
    .unwrap();
    assert_ne!(
        content_hash(&pb::PolicyDocument::from(&**changed.document())),
        hash
    );
}

/// `-0.0` equals `0.0`: a document that only writes a zero's sign differently has the same
/// content and hash (so it is not published again under a new version), whether the sign
/// comes from a file or straight from a wire client, and converts to a positive zero.
#[test]
fn a_negative_zero_hashes_and_converts_as_zero_in_every_number_field() {
    let overlay = |z: f64| pb::Overlay {
        backoff: Some(pb::Backoff {
            multiplier: Some(z),
            ..Default::default()
        }),
        budget: Some(pb::Budget {
            ratio: Some(z),
            ..Default::default()
        }),
        circuit_breaker: Some(pb::CircuitBreaker {
            failure_ratio: Some(z),
            ..Default::default()
        }),
        alert: Some(pb::Alert {
            retry_ratio: Some(z),
        }),
        ..Default::default()
    };
    let plus = doc(vec![endpoint("a", overlay(0.0))]);
    let minus = doc(vec![endpoint("a", overlay(-0.0))]);
    // The hash is of the bits as they are (what a version stored with `-0.0`, or an agent's
    // cache of it, was hashed with); `unsigned_zeros` makes the wire document one content.
    assert_ne!(content_hash(&minus), content_hash(&plus));
    let mut unsigned = minus.clone();
    unsigned_zeros(&mut unsigned);
    assert_eq!(content_hash(&unsigned), content_hash(&plus));
    let mut everywhere = pb::PolicyDocument {
        defaults: Some(overlay(-0.0)),
        ..minus.clone()
    };
    everywhere.endpoints[0].routes.push(pb::Route {
        overlay: Some(overlay(-0.0)),
        ..Default::default()
    });
    unsigned_zeros(&mut everywhere);
    assert_eq!(
        everywhere,
        pb::PolicyDocument {
            defaults: Some(overlay(0.0)),
            endpoints: vec![pb::Endpoint {
                routes: vec![pb::Route {
                    overlay: Some(overlay(0.0)),
                    ..Default::default()
                }],
                ..plus.endpoints[0].clone()
            }],
        }
    );
    assert!(
        format!("{everywhere:?}").matches("-0.0").count() == 0,
        "{everywhere:?}"
    );
    let converted = PolicyDocument::try_from(minus).expect("converts");
    let o = &converted.endpoints[0].overlay;
    for v in [
        &o.backoff.multiplier,
        &o.budget.ratio,
        &o.circuit_breaker.failure_ratio,
        &o.alert.retry_ratio,
    ] {
        let v = v.as_ref().map(|f| f.value);
        assert!(v.is_some_and(|v| v.is_sign_positive()), "{v:?}");
    }

    // From files: `-0.0`, `0.0` and `0` are one content.
    let file = |z: &str| {
        let src = format!(
            "version: 1\nendpoints:\n  a:\n    budget: {{ratio: {z}}}\n    circuit_breaker: {{failure_ratio: {z}}}\n    alert: {{retry_ratio: {z}}}\n"
        );
        let set = load(src.as_bytes()).policies.expect("valid");
        content_hash(&pb::PolicyDocument::from(&**set.document()))
    };
    assert_eq!(file("-0.0"), file("0"));
    assert_eq!(file("0.0"), file("0"));
}

#[test]
fn the_content_hash_ignores_empty_sections_sent_by_other_clients() {
    let lean = doc(vec![endpoint("a", pb::Overlay::default())]);
    let mut padded = lean.clone();
    padded.defaults = Some(pb::Overlay {
        backoff: Some(pb::Backoff::default()),
        ..Default::default()
    });
    padded.endpoints[0].overlay = Some(pb::Overlay {
        budget: Some(pb::Budget::default()),
        ..Default::default()
    });
    assert_eq!(content_hash(&lean), content_hash(&padded));
}

#[test]
fn an_unknown_jitter_number_is_refused_at_its_path() {
    let bad = doc(vec![endpoint(
        "payments",
        pb::Overlay {
            backoff: Some(pb::Backoff {
                jitter: 9,
                ..Default::default()
            }),
            ..Default::default()
        },
    )]);
    assert_eq!(paths(bad), ["endpoints.payments.backoff.jitter"]);
}

#[test]
fn out_of_range_codes_classes_and_durations_are_refused_item_by_item() {
    let bad = pb::PolicyDocument {
        defaults: Some(pb::Overlay {
            deadline_ms: Some(24 * 3_600_000 + 1),
            retry_on: Some(pb::RetryOn {
                http_status: Some(pb::StatusList {
                    codes: vec![503, 200, 700],
                }),
                grpc_status: Some(pb::StatusList {
                    codes: vec![14, 0, 17],
                }),
                errors: Some(pb::ErrorClassList {
                    classes: vec![1, 0, 7],
                }),
            }),
            ..Default::default()
        }),
        endpoints: vec![endpoint("a", pb::Overlay::default())],
    };
    assert_eq!(
        paths(bad),
        [
            "defaults.deadline",
            "defaults.retry_on.http_status[1]",
            "defaults.retry_on.http_status[2]",
            "defaults.retry_on.grpc_status[1]",
            "defaults.retry_on.grpc_status[2]",
            "defaults.retry_on.errors[1]",
            "defaults.retry_on.errors[2]",
        ]
    );
}

#[test]
fn the_longest_duration_is_accepted() {
    let ok = doc(vec![endpoint(
        "a",
        pb::Overlay {
            deadline_ms: Some(24 * 3_600_000),
            ..Default::default()
        },
    )]);
    assert!(PolicyDocument::try_from(ok).is_ok());
}

#[test]
fn endpoints_need_a_unique_name() {
    let bad = doc(vec![
        endpoint("", pb::Overlay::default()),
        endpoint("a", pb::Overlay::default()),
        endpoint("a", pb::Overlay::default()),
    ]);
    assert_eq!(
        errors(bad),
        [
            ("endpoints[0]".into(), "an endpoint needs a name".into()),
            (
                "endpoints.a".into(),
                "duplicate endpoint `a` (first defined at endpoints[1])".into()
            ),
        ]
    );
}

fn route(m: Option<pb::RouteMatch>) -> pb::Route {
    pb::Route {
        r#match: m,
        overlay: None,
    }
}

fn http(method: &str, path_prefix: &str) -> Option<pb::RouteMatch> {
    Some(pb::RouteMatch {
        kind: Some(pb::route_match::Kind::Http(pb::HttpMatch {
            method: method.into(),
            path_prefix: path_prefix.into(),
        })),
    })
}

fn grpc(service: &str, method: &str) -> Option<pb::RouteMatch> {
    Some(pb::RouteMatch {
        kind: Some(pb::route_match::Kind::Grpc(pb::GrpcMatch {
            service: service.into(),
            method: method.into(),
        })),
    })
}

#[test]
fn routes_need_a_well_formed_match() {
    let mut ep = endpoint("a", pb::Overlay::default());
    ep.routes = vec![
        route(None),
        route(Some(pb::RouteMatch { kind: None })),
        route(http("", "")),
        route(http("get", "/x")),
        route(http("GET", "x")),
        route(grpc("bad service", "M")),
        route(grpc("pkg.S", "a.b")),
        route(grpc("pkg.S", "*")),
        route(http("GET", "")),
        route(grpc("pkg.S", "")),
    ];
    assert_eq!(
        paths(doc(vec![ep])),
        [
            "endpoints.a.routes[0].match",
            "endpoints.a.routes[1].match",
            "endpoints.a.routes[2].match.http",
            "endpoints.a.routes[3].match.http.method",
            "endpoints.a.routes[4].match.http.path_prefix",
            "endpoints.a.routes[5].match.grpc",
            "endpoints.a.routes[6].match.grpc",
            "endpoints.a.routes[7].match.grpc.method",
        ]
    );
}

#[test]
fn a_method_alone_matches_every_path_and_an_empty_grpc_method_every_method() {
    let mut ep = endpoint("a", pb::Overlay::default());
    ep.routes = vec![route(http("GET", "")), route(grpc("pkg.S", ""))];
    let d = PolicyDocument::try_from(doc(vec![ep])).unwrap();
    let matchers: Vec<_> = d.endpoints[0]
        .routes
        .iter()
        .map(|r| r.matcher.value.clone())
        .collect();
    assert_eq!(
        matchers,
        [
            RouteMatch::Http {
                method: Some("GET".into()),
                path_prefix: "/".into()
            },
            RouteMatch::Grpc {
                service: "pkg.S".into(),
                method: None
            },
        ]
    );
}

#[test]
fn every_problem_in_a_document_is_reported_at_once() {
    let mut bad_route = endpoint(
        "payments",
        pb::Overlay {
            backoff: Some(pb::Backoff {
                jitter: -1,
                multiplier: Some(f64::NAN),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    bad_route.routes = vec![route(None)];
    let bad = pb::PolicyDocument {
        defaults: Some(pb::Overlay {
            budget: Some(pb::Budget {
                window_ms: Some(u64::MAX),
                ..Default::default()
            }),
            ..Default::default()
        }),
        endpoints: vec![bad_route, endpoint("", pb::Overlay::default())],
    };
    let err = PolicyDocument::try_from(bad).unwrap_err();
    let got: Vec<&str> = err.errors.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(
        got,
        [
            "defaults.budget.window",
            "endpoints.payments.backoff.multiplier",
            "endpoints.payments.backoff.jitter",
            "endpoints.payments.routes[0].match",
            "endpoints[1]",
        ]
    );
    assert!(
        err.errors
            .iter()
            .all(|d| d.is_error() && d.loc == Loc::UNKNOWN)
    );
    assert!(
        err.to_string()
            .starts_with("invalid policy document: 5 error(s), first: ")
    );
}

#[test]
fn diagnostics_cross_the_wire_unchanged() {
    let d = Diagnostic::warning(
        Loc { line: 3, column: 7 },
        "endpoints.a.max_attempts",
        "6 attempts multiply load",
    );
    let wire = pb::Diagnostic::from(&d);
    assert_eq!(wire.severity, pb::diagnostic::Severity::Warning as i32);
    assert_eq!((wire.line, wire.column), (3, 7));
    assert_eq!(Diagnostic::from(&wire), d);
    let unknown = pb::Diagnostic {
        severity: 0,
        ..wire
    };
    assert!(Diagnostic::from(&unknown).is_error());
}

#[test]
fn diff_entries_carry_scope_kind_and_details() {
    let old = example();
    let mut new = old.clone();
    new.endpoints.retain(|e| e.name.value != "events");
    let changes = diff(&old, &new);
    let entries: Vec<pb::DiffEntry> = changes.iter().map(pb::DiffEntry::from).collect();
    assert_eq!(
        entries,
        [pb::DiffEntry {
            endpoint: "events".into(),
            change: pb::diff_entry::Change::Removed as i32,
            details: vec![],
            defaults: Some(false),
        }]
    );
    let back: Vec<Change> = entries.iter().map(Change::from).collect();
    assert_eq!(back, changes);
}

#[test]
fn the_defaults_block_and_an_endpoint_named_defaults_stay_apart_on_the_wire() {
    let changes = [
        Change {
            scope: Scope::Defaults,
            kind: ChangeKind::Modified,
            details: vec!["deadline: 15s -> 20s".into()],
        },
        Change {
            scope: Scope::Endpoint("defaults".into()),
            kind: ChangeKind::Added,
            details: vec![],
        },
    ];
    let entries: Vec<pb::DiffEntry> = changes.iter().map(pb::DiffEntry::from).collect();
    assert_eq!(
        entries
            .iter()
            .map(|e| (e.endpoint.as_str(), e.defaults))
            .collect::<Vec<_>>(),
        [("defaults", Some(true)), ("defaults", Some(false))]
    );
    let back: Vec<Change> = entries.iter().map(Change::from).collect();
    assert_eq!(back, changes);
    // From a control plane that predates the field: `defaults` is the block, as it meant.
    let old_server = pb::DiffEntry {
        defaults: None,
        ..entries[0].clone()
    };
    assert_eq!(Change::from(&old_server).scope, Scope::Defaults);
    let old_endpoint = pb::DiffEntry {
        endpoint: "payments".into(),
        defaults: None,
        ..entries[0].clone()
    };
    assert_eq!(
        Change::from(&old_endpoint).scope,
        Scope::Endpoint("payments".into())
    );
}

/// A document written before `alert` existed, covering every section and a route.
const PRE_ALERT: &str = "version: 1
defaults:
  max_attempts: 3
  backoff: {base: 100ms, max: 5s, multiplier: 2.0, jitter: full}
  deadline: 15s
  per_try_timeout: 2s
  retry_on: {http_status: [429, 503], grpc_status: [UNAVAILABLE], errors: [connect]}
  idempotent_methods: [GET, PUT]
  idempotency_key_header: Idempotency-Key
  retry_after: {honor: true, max: 30s}
  budget: {ratio: 0.2, min_per_second: 10, window: 10s}
  circuit_breaker: {failure_ratio: 0.5, min_requests: 20, window: 10s, open_for: 30s, half_open_probes: 3}
endpoints:
  payments:
    max_attempts: 4
    routes:
      - match: {method: POST, path_prefix: /v1/charges}
        max_attempts: 2
  inventory: {}
";

/// The content hash of [`PRE_ALERT`], computed before `alert` was added to the wire form: a
/// stored version without alert settings keeps its hash.
const PRE_ALERT_HASH: &str = "52806d43cc19f100112a58e1e7d9c0bddb85a3e314d23950a3ee081f43f7a9c9";

fn wire(src: &str) -> pb::PolicyDocument {
    let loaded = load(src.as_bytes());
    let set = loaded.policies.unwrap_or_else(|| {
        panic!("invalid test document: {:#?}", loaded.diagnostics);
    });
    pb::PolicyDocument::from(&**set.document())
}

#[test]
fn documents_without_alert_keep_the_hash_they_had_before_alert_existed() {
    let before = wire(PRE_ALERT);
    assert_eq!(content_hash(&before), PRE_ALERT_HASH);
    // Other clients may send an empty `alert` section: still the same content.
    let mut padded = before.clone();
    padded.defaults.as_mut().unwrap().alert = Some(pb::Alert::default());
    padded.endpoints[1].overlay = Some(pb::Overlay {
        alert: Some(pb::Alert::default()),
        ..Default::default()
    });
    assert_eq!(content_hash(&padded), PRE_ALERT_HASH);
}

#[test]
fn alert_settings_change_the_hash() {
    let base = content_hash(&wire(PRE_ALERT));
    let with_default = PRE_ALERT.replace(
        "  max_attempts: 3\n",
        "  max_attempts: 3\n  alert: {retry_ratio: 0.05}\n",
    );
    let with_endpoint = PRE_ALERT.replace(
        "  inventory: {}",
        "  inventory: {alert: {retry_ratio: 0.05}}",
    );
    let hashes = [
        base,
        content_hash(&wire(&with_default)),
        content_hash(&wire(&with_endpoint)),
        content_hash(&wire(&with_endpoint.replace("0.05", "0.1"))),
    ];
    for (i, a) in hashes.iter().enumerate() {
        for b in &hashes[i + 1..] {
            assert_ne!(a, b);
        }
    }
}

#[test]
fn alert_round_trips_yaml_model_wire_model_yaml() {
    let src = "version: 1\ndefaults:\n  alert: {retry_ratio: 0.05}\nendpoints:\n  payments:\n    alert:\n      retry_ratio: 0.02\n    routes:\n      - match: {method: POST}\n        max_attempts: 2\n  inventory: {}\n";
    let original = load(src.as_bytes()).policies.unwrap();
    let w = pb::PolicyDocument::from(&**original.document());
    let alert = |o: &Option<pb::Overlay>| o.as_ref().and_then(|o| o.alert);
    assert_eq!(
        alert(&w.defaults),
        Some(pb::Alert {
            retry_ratio: Some(0.05)
        })
    );
    assert_eq!(
        alert(&w.endpoints[0].overlay),
        Some(pb::Alert {
            retry_ratio: Some(0.02)
        })
    );
    assert_eq!(alert(&w.endpoints[0].routes[0].overlay), None);
    assert_eq!(w.endpoints[1].overlay, None);

    let (set, warnings) = validate(w.clone()).unwrap();
    assert_eq!(warnings, vec![]);
    assert_eq!(set.alert_retry_ratio("payments"), Some(0.02));
    assert_eq!(set.alert_retry_ratio("inventory"), Some(0.05));
    assert!(same_content(original.document(), set.document()));
    assert_eq!(pb::PolicyDocument::from(&**set.document()), w);
    let yaml = retryplane_policy::render::to_yaml(set.document());
    let again = load(yaml.as_bytes()).policies.unwrap();
    assert!(
        same_content(original.document(), again.document()),
        "{yaml}"
    );
    assert_eq!(
        content_hash(&pb::PolicyDocument::from(&**again.document())),
        content_hash(&w)
    );
}

#[test]
fn alert_on_a_wire_route_and_out_of_range_ratios_are_refused_at_their_paths() {
    let mut on_route =
        wire("version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: /x}\n");
    on_route.endpoints[0].routes[0].overlay = Some(pb::Overlay {
        alert: Some(pb::Alert {
            retry_ratio: Some(0.1),
        }),
        ..Default::default()
    });
    let errs = validate(on_route).unwrap_err();
    let got: Vec<(&str, &str)> = errs
        .iter()
        .map(|d| (d.path.as_str(), d.message.as_str()))
        .collect();
    assert_eq!(
        got,
        [(
            "endpoints.a.routes[0].alert.retry_ratio",
            retryplane_policy::parse::ROUTE_ALERT
        )]
    );

    let with = |v: f64| {
        doc(vec![endpoint(
            "a",
            pb::Overlay {
                alert: Some(pb::Alert {
                    retry_ratio: Some(v),
                }),
                ..Default::default()
            },
        )])
    };
    assert_eq!(
        errors(with(f64::NAN)),
        [(
            "endpoints.a.alert.retry_ratio".to_owned(),
            "must be a finite number".to_owned()
        )]
    );
    let errs = validate(with(1.5)).unwrap_err();
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].path, "endpoints.a.alert.retry_ratio");
    assert!(errs[0].message.contains("found 1.5"), "{}", errs[0].message);
    assert!(validate(with(0.0)).is_ok());
}

#[test]
fn a_policy_set_from_the_wire_runs_the_validator() {
    let wire = pb::PolicyDocument::from(&example());
    let set = retryplane_policy::PolicySet::try_from(wire).unwrap();
    assert_eq!(set.len(), 5);
    // Structurally fine, out of range: the document converts, the set is refused.
    let bad = doc(vec![endpoint(
        "a",
        pb::Overlay {
            max_attempts: Some(0),
            ..Default::default()
        },
    )]);
    assert!(PolicyDocument::try_from(bad.clone()).is_ok());
    let refused = retryplane_policy::PolicySet::try_from(bad).unwrap_err();
    assert_eq!(refused.errors.len(), 1, "{refused:?}");
    assert_eq!(refused.errors[0].path, "endpoints.a.max_attempts");
}

/// A wire document of more endpoints, routes and list entries than a policy file can hold is
/// found by `check_items`, which the control plane runs on what it is sent before converting it
/// (a viewer's Validate of 380,000 bare endpoints took 440 MB to check); one at the limit
/// passes.
#[test]
fn a_document_past_what_a_file_can_hold_is_found_before_it_is_converted() {
    let bare = |i: usize| pb::Endpoint {
        name: format!("e{i}"),
        overlay: None,
        routes: vec![],
    };
    let codes = pb::Overlay {
        retry_on: Some(pb::RetryOn {
            http_status: Some(pb::StatusList {
                codes: vec![503; 9],
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    // Bare endpoints count two each, one with nine codes eleven; a route two more.
    let mut routed = endpoint("routed", pb::Overlay::default());
    routed.routes.push(pb::Route::default());
    assert_eq!(
        items(&doc(vec![routed, endpoint("coded", codes.clone())])),
        4 + 11
    );
    let mut endpoints: Vec<_> = (0..(MAX_ITEMS - 12) / 2).map(bare).collect();
    endpoints.push(endpoint("coded", codes));
    let at_limit = doc(endpoints.clone());
    assert_eq!(items(&at_limit), MAX_ITEMS - 1);
    assert!(check_items(&at_limit).is_ok());
    endpoints.push(bare(MAX_ITEMS));
    let past = doc(endpoints);
    let error = check_items(&past).unwrap_err();
    assert_eq!(error.path, "<document>");
    assert!(
        error.message.contains(&format!("{} items", MAX_ITEMS + 1)),
        "{}",
        error.message
    );
    // The conversion itself reads it (a version stored before the limit).
    assert!(PolicyDocument::try_from(past).is_ok());
}

/// A policy file never holds more than `check_items` allows, so the control plane counts only
/// typed documents: the file's reader (serde-saphyr's budget) bounds its nodes by the same
/// number, the nodes an alias or a merge key repeats included, and each item is at least one
/// node (an endpoint is a key and its value, a route a mapping of several, a list entry one
/// scalar). A list repeated by an alias or a merge key past the limit is refused by the reader;
/// one an alias repeats just within it loads and passes.
#[test]
fn a_policy_file_never_holds_more_than_check_items_allows() {
    let file = |repeated: usize, own: usize| {
        let list = |n: usize| vec!["503"; n].join(",");
        format!(
            "version: 1\nendpoints:\n  a: {{retry_on: {{http_status: &codes [{}]}}}}\n  \
             b: {{retry_on: {{http_status: *codes}}}}\n  c: {{retry_on: {{http_status: [{}]}}}}\n",
            list(repeated),
            list(own)
        )
    };
    // Within the reader's count of events (about 199,000), past MAX_ITEMS once the alias is
    // replayed (218,006 items): refused by the reader, for its nodes.
    let refused = retryplane_policy::load(file(19_000, 180_000).as_bytes());
    assert!(refused.policies.is_none());
    assert!(
        refused.diagnostics[0].message.contains("YAML nodes"),
        "{:?}",
        refused.diagnostics[0]
    );
    // The same through a merge key that copies an endpoint's mapping into another.
    let merged = format!(
        "version: 1\nendpoints:\n  a: &e {{retry_on: {{http_status: [{}]}}}}\n  \
         b: {{<<: *e}}\n  c: {{retry_on: {{http_status: [{}]}}}}\n",
        vec!["503"; 19_000].join(","),
        vec!["503"; 180_000].join(",")
    );
    let refused = retryplane_policy::load(merged.as_bytes());
    assert!(refused.policies.is_none());
    assert!(
        refused.diagnostics[0].message.contains("YAML nodes"),
        "{:?}",
        refused.diagnostics[0]
    );
    let loaded = retryplane_policy::load(file(19_000, 160_000).as_bytes());
    let Some(policies) = loaded.policies else {
        panic!("{:?}", loaded.diagnostics.first());
    };
    let document = pb::PolicyDocument::from(policies.document().as_ref());
    assert_eq!(items(&document), 6 + 2 * 19_000 + 160_000);
    assert!(check_items(&document).is_ok());
}
