//! Loading whole files: diagnostics, precedence, lookup, and robustness on hostile input.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::diag::Severity;
use crate::model::Jitter;

const EXAMPLE: &str = include_str!("../../../config/policies.yaml");

fn errors(src: &str) -> Vec<String> {
    load(src.as_bytes())
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(ToString::to_string)
        .collect()
}

#[test]
fn the_example_file_is_valid_without_warnings() {
    let loaded = load(EXAMPLE.as_bytes());
    assert_eq!(loaded.diagnostics, vec![], "{:#?}", loaded.diagnostics);
    let set = loaded.policies.expect("valid");
    assert_eq!(
        set.names(),
        [
            "events",
            "inventory",
            "payments",
            "search",
            "shipping-partner"
        ]
    );
}

#[test]
fn three_bad_fields_give_three_located_errors() {
    let src = "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n    deadline: 10\n    backoff: {jitter: fulll}\n";
    assert_eq!(
        errors(src),
        [
            "4:19: error: endpoints.payments.max_attempts: must be from 1 (never retry) to 10, found 0",
            "5:15: error: endpoints.payments.deadline: duration `10` needs a unit: ms, s, m or h (such as `10ms` or `10s`)",
            "6:23: error: endpoints.payments.backoff.jitter: unknown jitter `fulll`: use none, full, equal or decorrelated (did you mean `full`?)",
        ]
    );
}

/// Every diagnostic, errors and warnings, as printed.
fn all(src: &str) -> Vec<String> {
    load(src.as_bytes())
        .diagnostics
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn a_refused_field_gets_no_second_error_from_the_built_in_value_in_its_place() {
    // `base: 10` has no unit: the cross-field check must not compare `max` with the built-in
    // 100ms that stands in for it.
    assert_eq!(
        all("version: 1\nendpoints:\n  a:\n    backoff: {base: 10, max: 50ms}\n"),
        [
            "4:21: error: endpoints.a.backoff.base: duration `10` needs a unit: ms, s, m or h (such as `10ms` or `10s`)"
        ]
    );
    assert_eq!(
        all("version: 1\nendpoints:\n  a:\n    deadline: 1s\n    per_try_timeout: 5\n"),
        [
            "5:22: error: endpoints.a.per_try_timeout: duration `5` needs a unit: ms, s, m or h (such as `5ms` or `5s`)"
        ]
    );
    // A whole section refused: its fields are unknown too.
    let section = all(
        "version: 1\ndefaults:\n  backoff: {jitter: none}\nendpoints:\n  a:\n    backoff: fast\n    max_attempts: 4\n    deadline: 300ms\n    per_try_timeout: 100ms\n",
    );
    assert_eq!(
        section,
        ["6:14: error: endpoints.a.backoff: expected a mapping, found a string"]
    );
    // A refused value in a lower layer that a higher layer replaces does not hide the higher
    // layer's own problem.
    assert_eq!(
        errors(
            "version: 1\ndefaults:\n  backoff: {base: 10}\nendpoints:\n  a:\n    backoff: {base: 1s, max: 500ms}\n"
        ),
        [
            "3:19: error: defaults.backoff.base: duration `10` needs a unit: ms, s, m or h (such as `10ms` or `10s`)",
            "6:30: error: endpoints.a.backoff.max: backoff.max (500ms) is shorter than backoff.base (1s)",
        ]
    );
}

#[test]
fn a_value_out_of_range_gets_no_second_problem_from_a_cross_field_check() {
    // `deadline: 0s` is one error, not also a deadline shorter than `per_try_timeout` and a
    // schedule that can never start inside it.
    assert_eq!(
        all("version: 1\nendpoints:\n  a:\n    deadline: 0s\n"),
        ["4:15: error: endpoints.a.deadline: must be longer than zero"]
    );
    assert_eq!(
        all("version: 1\nendpoints:\n  a:\n    backoff: {max: 0s}\n"),
        ["4:20: error: endpoints.a.backoff.max: must be longer than zero"]
    );
    assert_eq!(
        all("version: 1\nendpoints:\n  a:\n    max_attempts: 11\n    budget: {enabled: false}\n"),
        ["4:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found 11"]
    );
    // Inherited from `defaults:`, it is still reported once, where it is written.
    assert_eq!(
        all("version: 1\ndefaults: {deadline: 0s}\nendpoints:\n  a: {}\n  b: {}\n"),
        ["2:22: error: defaults.deadline: must be longer than zero"]
    );
    // A layer that replaces the refused value has its own problems checked.
    assert_eq!(
        all("version: 1\ndefaults: {deadline: 0s}\nendpoints:\n  a: {deadline: 1s}\n"),
        [
            "2:22: error: defaults.deadline: must be longer than zero",
            "4:17: error: endpoints.a.deadline: per_try_timeout (2s) is longer than the deadline (1s)",
        ]
    );
}

#[test]
fn a_non_finite_number_is_an_error_at_its_place_among_the_others() {
    let src = "version: 1\nendpoints:\n  a:\n    max_attempts: 0\n    backoff: {multiplier: .inf}\n    deadline: 100\n  b:\n    budget: {ratio: .nan, min_per_second: 1e999}\n";
    assert_eq!(
        errors(src),
        [
            "4:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found 0",
            "5:27: error: endpoints.a.backoff.multiplier: must be a finite number",
            "6:15: error: endpoints.a.deadline: duration `100` needs a unit: ms, s, m or h (such as `100ms` or `100s`)",
            "8:21: error: endpoints.b.budget.ratio: must be a finite number",
            "8:43: error: endpoints.b.budget.min_per_second: must be a whole number from 0 to 4294967295, found a larger one",
        ]
    );
}

#[test]
fn a_count_written_in_more_digits_than_a_float_holds_is_too_large_not_infinite() {
    // 400 nines read as infinity: the message names the range, not a `.inf` never written.
    let src = format!(
        "version: 1\nendpoints:\n  a:\n    max_attempts: {}\n    budget: {{min_per_second: -{}}}\n",
        "9".repeat(400),
        "9".repeat(400)
    );
    assert_eq!(
        errors(&src),
        [
            "4:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found a larger one",
            "5:30: error: endpoints.a.budget.min_per_second: must be a whole number from 0 to 4294967295, found a smaller one",
        ]
    );
}

#[test]
fn a_count_too_large_for_an_integer_gets_the_range_and_a_fraction_is_named() {
    let src = "version: 1\nendpoints:\n  a:\n    max_attempts: 9223372036854775808\n    circuit_breaker: {min_requests: 99999999999999999999999, half_open_probes: -9223372036854775809}\n  b:\n    max_attempts: 2.5\n    budget: {min_per_second: 1e3}\n";
    assert_eq!(
        errors(src),
        [
            "4:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found a larger one",
            "5:37: error: endpoints.a.circuit_breaker.min_requests: must be a whole number from 1 to 4294967295, found a larger one",
            "5:80: error: endpoints.a.circuit_breaker.half_open_probes: must be a whole number from 1 to 4294967295, found a smaller one",
            "7:19: error: endpoints.b.max_attempts: expected a whole number, found 2.5",
            "8:30: error: endpoints.b.budget.min_per_second: expected a whole number written in digits, with no leading zero (`3`, not `03`, `3.0` or `3e0`)",
        ]
    );
}

#[test]
fn a_yaml_1_1_number_with_underscores_is_a_string_and_refused_with_a_hint() {
    let src = "version: 1\nendpoints:\n  a:\n    max_attempts: 1_0\n    retry_on: {http_status: [5_03]}\n    budget: {ratio: 0.1_5}\n";
    assert_eq!(
        errors(src),
        [
            "4:19: error: endpoints.a.max_attempts: expected a whole number, found a string (`1_0`: a number is written without `_` in YAML 1.2)",
            "5:30: error: endpoints.a.retry_on.http_status[0]: expected an HTTP status code, found a string (`5_03`: a number is written without `_` in YAML 1.2)",
            "6:21: error: endpoints.a.budget.ratio: expected a number, found a string (`0.1_5`: a number is written without `_` in YAML 1.2)",
        ]
    );
}

#[test]
fn a_number_written_with_a_comma_is_refused_with_a_hint() {
    let src = "version: 1\nendpoints:\n  a:\n    budget: {ratio: 0,2}\n  b:\n    max_attempts: 1,000\n    budget:\n      ratio: 0,25\n    retry_on: {http_status: [\"5,03\"]}\n  c:\n    budget: {min_per_second: 3, 5: 1}\n";
    assert_eq!(
        errors(src),
        [
            "4:23: error: endpoints.a.budget: keys must be strings, found an integer (`0,2`: in `{ }` a comma separates entries; a decimal is written with a dot, `0.2`)",
            "6:19: error: endpoints.b.max_attempts: expected a whole number, found a string (`1,000`: a number is written without `,`)",
            "8:14: error: endpoints.b.budget.ratio: expected a number, found a string (`0,25`: a decimal is written with a dot, `0.25`)",
            "9:30: error: endpoints.b.retry_on.http_status[0]: expected an HTTP status code, found a string (`5,03`: a number is written without `,`)",
            "11:33: error: endpoints.c.budget: keys must be strings, found an integer",
        ]
    );
}

#[test]
fn a_list_written_without_brackets_gets_a_hint_for_the_list_not_a_number() {
    let src = "version: 1\nendpoints:\n  a:\n    retry_on:\n      http_status: 503,504\n  b:\n    retry_on: {http_status: 503, 504}\n  c:\n    budget:\n      ratio: 0.2\n      5:\n";
    assert_eq!(
        errors(src),
        [
            "5:20: error: endpoints.a.retry_on.http_status: expected a list, found a string (`503,504`: a list is written in brackets, `[503, 504]`)",
            "7:29: error: endpoints.b.retry_on.http_status: expected a list, found an integer",
            "7:34: error: endpoints.b.retry_on: keys must be strings, found an integer (in `{ }` a comma separates entries: a list is written in brackets, `[503, 504]`)",
            "11:7: error: endpoints.c.budget: keys must be strings, found an integer",
        ]
    );
}

#[test]
fn settings_that_do_not_do_what_they_say_are_warned_and_probes_past_the_breakers_count_refused() {
    let src = "version: 1\ndefaults:\n  budget: {ratio: 0, min_per_second: 3, window: 333ms}\nendpoints:\n  a:\n    idempotency_key_header: content-type\n    circuit_breaker: {half_open_probes: 16777216}\n    routes:\n      - match: {path_prefix: /v1/*}\n        max_attempts: 2\n  b:\n    budget: {min_per_second: 3, window: 334ms}\n";
    assert_eq!(
        all(src),
        [
            "3:38: warning: defaults.budget.min_per_second: the reserve allows no retry: 3 retries/s over a 333ms window is less than one, and the reserve is counted per window, rounded down; lengthen budget.window or raise budget.min_per_second",
            "6:29: warning: endpoints.a.idempotency_key_header: `content-type` is sent with most requests, not only by clients that mean it as an idempotency key: any request carrying it, POST included, would be retried after a timeout or a reset; name a header of its own (`Idempotency-Key`)",
            "7:41: error: endpoints.a.circuit_breaker.half_open_probes: must be from 1 to 16777215, found 16777216",
            "9:30: warning: endpoints.a.routes[0].match.path_prefix: `/v1/*` is matched as written: `*` is no wildcard in a path prefix (a prefix already matches every path that starts with it: write `/v1/`)",
        ]
    );
}

/// A header that clients or tracing set on every request (a gRPC deadline, a trace id) is no
/// idempotency key either: every gRPC call with a deadline would count as keyed.
#[test]
fn headers_set_on_every_request_are_warned_as_idempotency_keys() {
    for header in ["grpc-timeout", "traceparent", "X-Request-Id"] {
        let src = format!("version: 1\nendpoints:\n  a:\n    idempotency_key_header: {header}\n");
        let all = all(&src);
        assert_eq!(all.len(), 1, "{all:?}");
        assert!(
            all[0].starts_with(&format!(
                "4:29: warning: endpoints.a.idempotency_key_header: `{header}` is sent with most requests"
            )),
            "{all:?}"
        );
    }
    // A name of its own is fine.
    assert!(
        all("version: 1\nendpoints:\n  a:\n    idempotency_key_header: Idempotency-Key\n")
            .is_empty()
    );
}

/// A budget with no ratio and no reserve refuses every retry: said where it is set, unless
/// the endpoint never retries anyway.
#[test]
fn a_budget_that_allows_no_retry_at_all_is_warned() {
    let src = "version: 1\nendpoints:\n  z:\n    budget: {ratio: 0, min_per_second: 0}\n  two:\n    max_attempts: 2\n    budget: {min_per_second: 0, ratio: 0.0}\n  once:\n    max_attempts: 1\n    budget: {ratio: 0, min_per_second: 0}\n  reserve:\n    budget: {ratio: 0, min_per_second: 1}\n  ratio:\n    budget: {ratio: 0.1, min_per_second: 0}\n";
    assert_eq!(
        all(src),
        [
            "4:21: warning: endpoints.z.budget.ratio: the budget allows no retry: with ratio 0 and min_per_second 0, attempts 2 to 3 never start; set max_attempts: 1 to say so, or raise budget.ratio or budget.min_per_second",
            "7:40: warning: endpoints.two.budget.ratio: the budget allows no retry: with ratio 0 and min_per_second 0, attempt 2 never starts; set max_attempts: 1 to say so, or raise budget.ratio or budget.min_per_second",
        ]
    );
}

#[test]
fn a_star_inside_a_path_prefix_is_warned_without_a_narrower_suggestion() {
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: /v1/*/items}\n        max_attempts: 2\n      - match: {path_prefix: /v2/**}\n        max_attempts: 2\n";
    assert_eq!(
        all(src),
        [
            "5:30: warning: endpoints.a.routes[0].match.path_prefix: `/v1/*/items` is matched as written: `*` is no wildcard in a path prefix (a prefix matches by its start only: write a route for each value of the `*`, or `/v1/`, which matches every path that starts with it)",
            "7:30: warning: endpoints.a.routes[1].match.path_prefix: `/v2/**` is matched as written: `*` is no wildcard in a path prefix (a prefix already matches every path that starts with it: write `/v2/`)",
        ]
    );
}

#[test]
fn a_path_prefix_no_request_can_carry_as_written_is_warned_with_its_encoded_form() {
    let src = "version: 1\nendpoints:\n  u:\n    routes:\n      - match: {path_prefix: \"/a b\"}\n        max_attempts: 1\n      - match: {path_prefix: \"/q r?x=1\"}\n        max_attempts: 1\n      - match: {path_prefix: \"/v1/über|x[0]\"}\n        max_attempts: 1\n";
    assert_eq!(
        all(src),
        [
            "5:30: warning: endpoints.u.routes[0].match.path_prefix: `/a b` matches no request: a request carries a space or a control character in its path percent-encoded: write `/a%20b`",
            "7:30: warning: endpoints.u.routes[1].match.path_prefix: `/q r?x=1` matches no request: routes match a request's path alone, without its query or fragment: write `/q%20r`",
        ]
    );
    assert!(load(src.as_bytes()).policies.is_some(), "warnings only");
}

#[test]
fn an_endpoint_s_numbers_for_a_budget_or_breaker_that_is_off_are_warned() {
    let src = "version: 1\ndefaults:\n  budget: {enabled: false, ratio: 0.3}\n  max_attempts: 3\nendpoints:\n  b:\n    budget: {ratio: 0.5}\n    circuit_breaker: {enabled: false, min_requests: 5}\n  c:\n    budget: {enabled: true, ratio: 0.5}\n    circuit_breaker: {open_for: 5s}\n";
    assert_eq!(
        all(src),
        [
            "7:21: warning: endpoints.b.budget.ratio: has no effect: the budget is off (defaults.budget.enabled is false); set `budget.enabled: true` on this endpoint to use it",
            "8:53: warning: endpoints.b.circuit_breaker.min_requests: has no effect: this endpoint turns the circuit breaker off (`circuit_breaker.enabled: false`)",
        ]
    );
}

#[test]
fn an_invalid_idempotency_key_header_is_quoted() {
    let src = "version: 1\nendpoints:\n  f:\n    idempotency_key_header: \"Idem Key\"\n";
    assert_eq!(
        errors(src),
        [
            "4:29: error: endpoints.f.idempotency_key_header: `Idem Key` is not a valid HTTP header name (letters, digits and ``!#$%&'*+-.^_`|~``, no space)"
        ]
    );
}

#[test]
fn prefixes_are_compared_in_any_spelling_and_a_stray_percent_is_warned() {
    let src = "version: 1\nendpoints:\n  u:\n    routes:\n      - match: {path_prefix: /v1/charges}\n        max_attempts: 1\n      - match: {path_prefix: \"/v1/ch%61rges/x\"}\n        max_attempts: 2\n      - match: {path_prefix: \"/%C3%BCber\"}\n        max_attempts: 3\n      - match: {path_prefix: /über/x}\n        max_attempts: 4\n      - match: {path_prefix: \"/100%\"}\n        max_attempts: 5\n";
    assert_eq!(
        all(src),
        [
            "7:16: warning: endpoints.u.routes[1].match: this route can never match: routes[0] comes first and matches every call it matches",
            "11:16: warning: endpoints.u.routes[3].match: this route can never match: routes[2] comes first and matches every call it matches",
            "13:30: warning: endpoints.u.routes[4].match.path_prefix: `/100%` has a `%` that starts no escape (`%` and two hex digits): a request carries a `%` as `%25`: write `/100%25`",
        ]
    );
    let set = load(src.as_bytes()).policies.expect("warnings only");
    let attempts = |path: &str| {
        set.resolve(
            "u",
            &Target::Http {
                method: "GET",
                path,
            },
        )
        .map(|p| p.max_attempts)
    };
    assert_eq!(attempts("/v1/ch%61rges/9"), Some(1));
    assert_eq!(attempts("/%C3%BCber/9"), Some(3));
    assert_eq!(attempts("/%c3%bcber"), Some(3));
    // A stray `%` is a plain one: not the `%25` a request carries (the warning says so).
    assert_eq!(attempts("/100%25"), Some(3));
    assert_eq!(attempts("/100%/x"), Some(5));
}

#[test]
fn a_path_is_matched_as_the_server_serves_it() {
    let src = "version: 1\nendpoints:\n  u:\n    max_attempts: 1\n    routes:\n      - match: {path_prefix: /v1/search}\n        max_attempts: 4\n      - match: {path_prefix: /v1.2/}\n        max_attempts: 3\n";
    let set = load(src.as_bytes()).policies.unwrap();
    let attempts = |path: &str| {
        set.resolve(
            "u",
            &Target::Http {
                method: "POST",
                path,
            },
        )
        .map(|p| p.max_attempts)
    };
    // A prefix the path only seems to have: the server serves `/v1/charges`.
    for path in [
        "/v1/search/../charges",
        "/v1/search/%2e%2E/charges",
        "/v1/search\\..\\charges",
        "/v1/search/./../charges",
    ] {
        assert_eq!(attempts(path), Some(1), "{path}");
    }
    // And one it has, reached through dots or a `\`.
    for path in [
        "/v1/charges/../search",
        "/v1\\search",
        "/v1/./search/x",
        "/v1.2/items",
        "/a/../v1.2/b.json",
    ] {
        assert!(attempts(path) > Some(1), "{path}");
    }
}

/// `resolve_index` then `policy_at` gives what `resolve` gives, for every kind of target:
/// routes matched as they are, as served (dot segments, `\`), by method, gRPC, and none.
#[test]
fn a_resolved_index_names_the_policy_resolve_gives() {
    let src = "version: 1\nendpoints:\n  u:\n    max_attempts: 1\n    routes:\n      - match: {path_prefix: /v1/search}\n        max_attempts: 4\n      - match: {path_prefix: /v1.2/, method: GET}\n        max_attempts: 3\n      - match: {grpc: /pkg.S/M}\n        max_attempts: 5\n  plain: {max_attempts: 2}\n";
    let set = load(src.as_bytes()).policies.unwrap();
    let http = |method, path| Target::Http { method, path };
    for name in ["u", "plain"] {
        let endpoint = set.endpoint(name).unwrap();
        for (target, index) in [
            (http("POST", "/v1/search/x"), 0),
            (http("POST", "/v1/search/../charges"), 3),
            (http("POST", "/v1/search/%2e%2E/charges"), 3),
            (http("POST", "/v1\\search"), 0),
            (http("POST", "/v1/charges/../search"), 0),
            (http("GET", "/a/../v1.2/b.json"), 1),
            (http("POST", "/v1.2/b.json"), 3),
            (Target::Grpc { path: "/pkg.S/M" }, 2),
            (Target::Grpc { path: "/pkg.S/N" }, 3),
            (Target::Endpoint, 3),
        ] {
            let found = endpoint.resolve_index(&target);
            assert!(
                Arc::ptr_eq(endpoint.policy_at(found), endpoint.resolve(&target)),
                "{name} {target:?}"
            );
            if name == "u" {
                assert_eq!(found, index, "{target:?}");
            } else {
                assert_eq!(found, 0, "no routes: {target:?}");
            }
        }
    }
}

#[test]
fn yes_and_on_are_strings_a_boolean_field_refuses_them_and_an_endpoint_may_have_the_name() {
    let src = "version: 1\nendpoints:\n  a:\n    retry_after: {honor: yes}\n    budget: {enabled: off}\n    circuit_breaker: {enabled: 1}\n";
    assert_eq!(
        errors(src),
        [
            "4:26: error: endpoints.a.retry_after.honor: expected a boolean (true or false), found a string `yes`",
            "5:23: error: endpoints.a.budget.enabled: expected a boolean (true or false), found a string `off`",
            "6:32: error: endpoints.a.circuit_breaker.enabled: expected a boolean (true or false), found an integer",
        ]
    );
    let src = "version: 1\nendpoints:\n  yes: {}\n  no: {}\n  on: {}\n  off: {}\n  y: {}\n  a: {retry_after: {honor: false}, budget: {enabled: true}}\n";
    let loaded = load(src.as_bytes());
    assert_eq!(loaded.diagnostics, vec![], "{:#?}", loaded.diagnostics);
    assert_eq!(
        loaded.policies.expect("valid").names(),
        ["a", "no", "off", "on", "y", "yes"]
    );
}

#[test]
fn a_version_written_as_a_float_or_with_a_leading_zero_says_how_to_write_it() {
    for (version, read) in [
        ("1.0", "1.0"),
        ("01", "1.0"),
        ("02", "2.0"),
        ("010", "10.0"),
    ] {
        assert_eq!(
            errors(&format!("version: {version}\nendpoints:\n  a: {{}}\n")),
            [format!(
                "1:10: error: version: unsupported schema version: expected 1, found {read} \
                 (write it with no leading zero or decimal point)"
            )],
            "{version}"
        );
    }
    assert_eq!(
        errors("version: 1.5\nendpoints:\n  a: {}\n"),
        ["1:10: error: version: unsupported schema version: expected 1, found 1.5"]
    );
    assert_eq!(
        errors("version: 2\nendpoints:\n  a: {}\n"),
        ["1:10: error: version: unsupported schema version: expected 1, found 2"]
    );
    for quoted in ["\"1\"", "'1'"] {
        assert_eq!(
            errors(&format!("version: {quoted}\nendpoints:\n  a: {{}}\n")),
            [
                "1:10: error: version: unsupported schema version: expected 1, found `1` \
              (a quoted string: write the number without quotes)"
            ],
            "{quoted}"
        );
    }
    assert_eq!(
        errors("version: \"2\"\nendpoints:\n  a: {}\n"),
        ["1:10: error: version: unsupported schema version: expected 1, found `2`"]
    );
}

/// A number written in quotes (or tagged `!!str`) where a number goes is told how to write it so
/// that the field takes it: without quotes, or, for a whole number written in a form the reader
/// takes as a float (`"007"`, `"3.0"`, `"1e3"`), as its digits. Text that is no number, a number
/// the field would refuse written plainly too (`"10.5"` for a whole number), and a quoted number
/// where text goes get no such hint.
#[test]
fn a_quoted_number_where_a_number_goes_is_told_how_to_write_it() {
    let src = "version: 1
endpoints:
  a:
    max_attempts: \"3\"
    retry_on: {http_status: ['503', \"504\"]}
    budget: {ratio: \"0.2\", min_per_second: !!str 10}
    alert: {retry_ratio: \"-0.5\"}
  b:
    max_attempts: \"three\"
    budget: {ratio: \"0.\", min_per_second: \"1e3\"}
  c:
    max_attempts: \"007\"
    retry_on: {http_status: [\"0503\"]}
    budget: {ratio: \".5\", min_per_second: \"10.5\"}
    alert: {retry_ratio: \"1e-2\"}
  d:
    max_attempts: \" 3.0 \"
    budget: {ratio: \"1e\", min_per_second: \"-\"}
    backoff: {multiplier: \"+1.5\"}
    alert: {retry_ratio: \"1e999\"}
  \"3\":
    idempotency_key_header: \"3\"
";
    let plainly = "(a string: write the number without quotes or `!!str`)";
    let write = |n: &str| format!("(a string: write `{n}` without quotes or `!!str`)");
    assert_eq!(
        errors(src),
        [
            format!("4:19: error: endpoints.a.max_attempts: expected a whole number, found a string {plainly}"),
            format!("5:30: error: endpoints.a.retry_on.http_status[0]: expected an HTTP status code, found a string {plainly}"),
            format!("5:37: error: endpoints.a.retry_on.http_status[1]: expected an HTTP status code, found a string {plainly}"),
            format!("6:21: error: endpoints.a.budget.ratio: expected a number, found a string {plainly}"),
            format!("6:50: error: endpoints.a.budget.min_per_second: expected a whole number, found a string {plainly}"),
            format!("7:26: error: endpoints.a.alert.retry_ratio: expected a number, found a string {plainly}"),
            "9:19: error: endpoints.b.max_attempts: expected a whole number, found a string".to_owned(),
            format!("10:21: error: endpoints.b.budget.ratio: expected a number, found a string {plainly}"),
            format!("10:43: error: endpoints.b.budget.min_per_second: expected a whole number, found a string {}", write("1000")),
            format!("12:19: error: endpoints.c.max_attempts: expected a whole number, found a string {}", write("7")),
            format!("13:30: error: endpoints.c.retry_on.http_status[0]: expected an HTTP status code, found a string {}", write("503")),
            format!("14:21: error: endpoints.c.budget.ratio: expected a number, found a string {plainly}"),
            "14:43: error: endpoints.c.budget.min_per_second: expected a whole number, found a string".to_owned(),
            format!("15:26: error: endpoints.c.alert.retry_ratio: expected a number, found a string {plainly}"),
            format!("17:19: error: endpoints.d.max_attempts: expected a whole number, found a string {}", write("3")),
            "18:21: error: endpoints.d.budget.ratio: expected a number, found a string".to_owned(),
            "18:43: error: endpoints.d.budget.min_per_second: expected a whole number, found a string".to_owned(),
            format!("19:27: error: endpoints.d.backoff.multiplier: expected a number, found a string {plainly}"),
            "20:26: error: endpoints.d.alert.retry_ratio: expected a number, found a string".to_owned(),
        ]
    );
}

#[test]
fn counts_out_of_range_name_the_range_of_the_field() {
    assert_eq!(
        errors("version: 1\nendpoints:\n  a:\n    max_attempts: -1\n"),
        ["4:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found -1"]
    );
    assert_eq!(
        errors("version: 1\nendpoints:\n  a:\n    max_attempts: 99999999999\n"),
        [
            "4:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found 99999999999"
        ]
    );
    assert_eq!(
        errors(
            "version: 1\nendpoints:\n  a:\n    circuit_breaker: {min_requests: -1}\n    budget: {min_per_second: -1}\n"
        ),
        [
            "4:37: error: endpoints.a.circuit_breaker.min_requests: must be a whole number from 1 to 4294967295, found -1",
            "5:30: error: endpoints.a.budget.min_per_second: must be a whole number from 0 to 4294967295, found -1",
        ]
    );
}

#[test]
fn duplicate_endpoints_are_an_error_not_a_silent_overwrite() {
    let src =
        "version: 1\nendpoints:\n  payments: {max_attempts: 2}\n  payments: {max_attempts: 5}\n";
    assert_eq!(
        errors(src),
        ["4:3: error: endpoints.payments: duplicate endpoint `payments` (first defined at 3:3)"]
    );
}

#[test]
fn a_duplicate_endpoint_has_its_own_problems_reported_too() {
    let src = "version: 1\nendpoints:\n  payments: {max_attempts: 2}\n  payments:\n    max_attempts: 0\n    backoff: {multiplier: 0.5}\n    routes:\n      - match: {method: GET}\n        max_attempts: 11\n";
    assert_eq!(
        errors(src),
        [
            "4:3: error: endpoints.payments: duplicate endpoint `payments` (first defined at 3:3)",
            "5:19: error: endpoints.payments.max_attempts: must be from 1 (never retry) to 10, found 0",
            "6:27: error: endpoints.payments.backoff.multiplier: must be from 1.0 to 100.0, found 0.5",
            "9:23: error: endpoints.payments.routes[0].max_attempts: must be from 1 (never retry) to 10, found 11",
        ]
    );
}

#[test]
fn a_route_whose_match_is_refused_still_has_its_settings_checked() {
    let src = "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {method: get}\n        max_attempts: 0\n        budget: {ratio: 0.5}\n        retry_on: {grpc_status: [NOT_A_CODE]}\n";
    let errors = errors(src);
    assert_eq!(errors.len(), 4, "{errors:#?}");
    for (line, path) in [
        (5, "routes[0].match.method"),
        (6, "routes[0].max_attempts"),
        (7, "routes[0].budget.ratio"),
        (8, "routes[0].retry_on.grpc_status"),
    ] {
        let prefix = format!("{line}:");
        let path = format!("endpoints.payments.{path}");
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with(&prefix) && e.contains(&path)),
            "no error on {path} at line {line}: {errors:#?}"
        );
    }
}

#[test]
fn an_empty_match_or_an_empty_route_is_an_error_not_dropped() {
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: ~\n        max_attempts: 1\n      - ~\n      -\n      - match:\n      - match: []\n      - 5\n";
    assert_eq!(
        errors(src),
        [
            "5:16: error: endpoints.a.routes[0].match: expected a mapping of `method` and/or `path_prefix`, or `grpc`, found null",
            "7:9: error: endpoints.a.routes[1]: expected a route (a mapping with `match:`), found null",
            "8:8: error: endpoints.a.routes[2]: expected a route (a mapping with `match:`), found null",
            "9:14: error: endpoints.a.routes[3].match: expected a mapping of `method` and/or `path_prefix`, or `grpc`, found null",
            "10:16: error: endpoints.a.routes[4].match: expected a mapping, found a list",
            "11:9: error: endpoints.a.routes[5]: expected a mapping, found an integer",
        ]
    );
    assert!(load(src.as_bytes()).policies.is_none());
}

#[test]
fn routes_left_empty_are_no_routes_and_anything_else_but_a_list_is_an_error() {
    // Every route commented out leaves `routes:` null: the endpoint has no routes, as with
    // `routes: []`, and nothing is reported.
    let src = "version: 1\nendpoints:\n  a:\n    max_attempts: 2\n    routes:\n      # - match: {method: GET}\n      #   max_attempts: 4\n  b:\n    routes: ~\n";
    let loaded = load(src.as_bytes());
    assert_eq!(loaded.diagnostics, vec![], "{:#?}", loaded.diagnostics);
    let set = loaded.policies.expect("valid");
    for name in ["a", "b"] {
        assert!(set.endpoint(name).expect(name).routes.is_empty(), "{name}");
    }
    assert_eq!(set.endpoint("a").expect("a").policy.max_attempts, 2);
    assert_eq!(
        errors("version: 1\nendpoints:\n  a:\n    routes: {match: {method: GET}}\n"),
        ["4:13: error: endpoints.a.routes: expected a list of routes, found a mapping"]
    );
    // A `retry_on` list left empty stays an error: "none" and "inherit" are both plausible.
    assert_eq!(
        errors("version: 1\nendpoints:\n  a:\n    retry_on:\n      http_status:\n"),
        [
            "5:18: error: endpoints.a.retry_on.http_status: expected a list (`[]` for none; leave the field out to inherit it), found null"
        ]
    );
}

#[test]
fn a_route_after_a_refused_one_is_named_by_its_place_in_the_file() {
    // routes[0] is refused (lower-case method); routes[1] has a `max` without a unit. Every
    // message about the second route names routes[1], and its refused `max` is not replaced
    // by the defaults' 150ms for a cross-field check.
    let src = "version: 1\ndefaults:\n  backoff: {max: 150ms}\nendpoints:\n  a:\n    routes:\n      - match: {method: get}\n      - match: {method: PUT}\n        backoff: {base: 200ms, max: 1}\n";
    assert_eq!(
        all(src),
        [
            "7:25: error: endpoints.a.routes[0].match.method: HTTP methods are case-sensitive: write `GET`",
            "9:37: error: endpoints.a.routes[1].backoff.max: duration `1` needs a unit: ms, s, m or h (such as `1ms` or `1s`)",
        ]
    );
    // The repeated-match warning names both routes by their place in the file too.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: ~\n      - match: {method: PUT}\n      - match: {method: PUT}\n";
    assert_eq!(
        all(src),
        [
            "5:16: error: endpoints.a.routes[0].match: expected a mapping of `method` and/or `path_prefix`, or `grpc`, found null",
            "7:16: warning: endpoints.a.routes[2].match: this route can never match: routes[1] has the same match and comes first",
        ]
    );
}

#[test]
fn a_route_that_an_earlier_broader_route_hides_is_a_warning() {
    // First match wins: routes[1] is hidden by routes[0] (any method, a shorter prefix),
    // routes[3] by routes[2] (the same method, prefix `/`), routes[5] by every method of its
    // service. routes[2] (GET anywhere, but routes[0] only takes /v1), routes[6] (another
    // service) and routes[7] (another method) can be reached.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: /v1}\n      - match: {method: GET, path_prefix: /v1/x}\n      - match: {method: GET}\n      - match: {method: GET, path_prefix: /v2}\n      - match: {grpc: /p.S/*}\n      - match: {grpc: /p.S/M}\n      - match: {grpc: /p.T/M}\n      - match: {method: POST, path_prefix: /v2}\n";
    assert_eq!(
        all(src),
        [
            "6:16: warning: endpoints.a.routes[1].match: this route can never match: routes[0] comes first and matches every call it matches",
            "8:16: warning: endpoints.a.routes[3].match: this route can never match: routes[2] comes first and matches every call it matches",
            "10:16: warning: endpoints.a.routes[5].match: this route can never match: routes[4] comes first and matches every call it matches",
        ]
    );
    // A narrower route before a broader one is how overrides are written: no warning. Nor is
    // a prefix that only shares a start with an earlier one.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: POST, path_prefix: /v1/charges}\n      - match: {path_prefix: /v1/charge-x}\n      - match: {path_prefix: /v1}\n      - match: {grpc: /p.S/M}\n      - match: {grpc: /p.S/*}\n";
    assert_eq!(all(src), Vec::<String>::new());
    // The first of several broader routes is named.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: GET, path_prefix: /v1}\n      - match: {path_prefix: /v}\n      - match: {method: GET, path_prefix: /v1/x}\n";
    assert_eq!(
        all(src),
        [
            "7:16: warning: endpoints.a.routes[2].match: this route can never match: routes[0] comes first and matches every call it matches"
        ]
    );
}

#[test]
fn a_breaker_failure_ratio_is_a_ratio_from_zero_to_one() {
    // 0 is in range (SPEC: a ratio outside 0..=1 is the error): the breaker opens on any
    // failure once `min_requests` attempts are counted.
    let src =
        "version: 1\nendpoints:\n  a:\n    circuit_breaker: {failure_ratio: 0, min_requests: 5}\n";
    let loaded = load(src.as_bytes());
    assert_eq!(loaded.diagnostics, vec![]);
    let set = loaded.policies.expect("valid");
    let breaker = set.endpoint("a").unwrap().policy.circuit_breaker.clone();
    assert_eq!(breaker.map(|b| b.failure_ratio), Some(0.0));
    for (value, found) in [("-0.1", "-0.1"), ("1.5", "1.5")] {
        let src = format!(
            "version: 1\nendpoints:\n  a:\n    circuit_breaker: {{failure_ratio: {value}}}\n"
        );
        assert_eq!(
            errors(&src),
            [format!(
                "4:38: error: endpoints.a.circuit_breaker.failure_ratio: must be from 0.0 (open on any failure once min_requests is met) to 1.0 (only when every attempt fails), found {found}"
            )]
        );
    }
}

#[test]
fn an_unknown_grpc_code_is_offered_a_close_code_never_ok_and_nothing_for_a_stranger() {
    let src =
        "version: 1\nendpoints:\n  a:\n    retry_on: {grpc_status: [FOO, X, UNAVAILBLE, OKK]}\n";
    assert_eq!(
        errors(src),
        [
            "4:30: error: endpoints.a.retry_on.grpc_status[0]: unknown gRPC status code `FOO`",
            "4:35: error: endpoints.a.retry_on.grpc_status[1]: unknown gRPC status code `X`",
            "4:38: error: endpoints.a.retry_on.grpc_status[2]: unknown gRPC status code `UNAVAILBLE` (did you mean `UNAVAILABLE`?)",
            "4:50: error: endpoints.a.retry_on.grpc_status[3]: unknown gRPC status code `OKK`",
        ]
    );
}

#[test]
fn an_unknown_field_is_offered_the_field_it_shortens_or_the_place_it_belongs() {
    let src = "version: 1\nmax_attempts: 2\nendpoints:\n  a:\n    retry_on: {http: [503], grpc_status_codes: [UNAVAILABLE]}\n    routes:\n      - match: {path: /x}\n";
    assert_eq!(
        errors(src),
        [
            "2:1: error: max_attempts: a policy field goes under `defaults:` (for every endpoint) or under an endpoint, not at the top level (did you mean `defaults.max_attempts`?)",
            "5:16: error: endpoints.a.retry_on.http: unknown field `http` (did you mean `http_status`?)",
            "5:29: error: endpoints.a.retry_on.grpc_status_codes: unknown field `grpc_status_codes` (did you mean `grpc_status`?)",
            "7:16: error: endpoints.a.routes[0].match: set `method` and/or `path_prefix` (HTTP), or `grpc: /pkg.Service/Method`",
            "7:17: error: endpoints.a.routes[0].match.path: unknown field `path` (did you mean `path_prefix`?)",
        ]
    );
}

#[test]
fn a_section_field_written_a_level_too_high_is_told_its_section() {
    // Not offered `max_attempts` for `max`, which it merely starts.
    let src = "version: 1\nendpoints:\n  a:\n    max: 5s\n    ratio: 0.1\n    retry_on: {grpc: [UNAVAILABLE]}\n    routes:\n      - match: {grpc: /p.S/M}\n        method: GET\n";
    assert_eq!(
        errors(src),
        [
            "4:5: error: endpoints.a.max: unknown field `max` (a field of `backoff` or `retry_after`: write it under one of them)",
            "5:5: error: endpoints.a.ratio: unknown field `ratio` (a field of `budget`: write it under it)",
            // Inside a section, the usual suggestion.
            "6:16: error: endpoints.a.retry_on.grpc: unknown field `grpc` (did you mean `grpc_status`?)",
            "9:9: error: endpoints.a.routes[0].method: unknown field `method` (a field of `match`: write it under it)",
        ]
    );
}

#[test]
fn a_route_setting_written_inside_its_match_is_told_where_it_goes() {
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: POST, max_attempts: 2}\n";
    assert_eq!(
        errors(src),
        [
            "5:31: error: endpoints.a.routes[0].match.max_attempts: `max_attempts` is a setting of the route, not part of what it matches: write it beside `match:`, at the same indentation"
        ]
    );
}

#[test]
fn a_field_of_a_route_section_written_inside_its_match_is_told_its_section() {
    // Not offered `grpc` for `grpc_status`: a match has no status.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: GET, grpc_status: [UNAVAILABLE], max: 1s}\n      - match: {method: GET, ratio: 0.1, enabled: false, retry_ratio: 0.1}\n";
    assert_eq!(
        errors(src),
        [
            "5:30: error: endpoints.a.routes[0].match.grpc_status: `grpc_status` is a field of `retry_on`, a setting of the route, not part of what it matches: write it under `retry_on:`, beside `match:`, at the same indentation",
            "5:58: error: endpoints.a.routes[0].match.max: `max` is a field of `backoff` or `retry_after`, a setting of the route, not part of what it matches: write it under one of `backoff:` or `retry_after:`, beside `match:`, at the same indentation",
            "6:30: error: endpoints.a.routes[1].match.ratio: `ratio` is a field of `budget`, not part of what a route matches; `budget` is per endpoint, shared by its routes, and a route can only turn it off: write `enabled: false` under `budget:`, beside `match:`, at the same indentation",
            "6:42: error: endpoints.a.routes[1].match.enabled: `enabled` is a field of `budget` or `circuit_breaker`, not part of what a route matches; `budget` and `circuit_breaker` are per endpoint, shared by its routes, and a route can only turn them off: write `enabled: false` under one of `budget:` or `circuit_breaker:`, beside `match:`, at the same indentation",
            "6:58: error: endpoints.a.routes[1].match.retry_ratio: `retry_ratio` is a field of `alert`, not part of what a route matches; alert is set per endpoint, not per route: the control plane compares the retries / calls of the whole endpoint; set it on the endpoint or in `defaults:`",
        ]
    );
}

#[test]
fn a_budget_or_breaker_written_inside_a_match_is_told_a_route_can_only_turn_it_off() {
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: GET, budget: {enabled: false}, circuit_breaker: {}, alert: {}}\n";
    assert_eq!(
        errors(src),
        [
            "5:30: error: endpoints.a.routes[0].match.budget: `budget` is not part of what a route matches; it is per endpoint, shared by its routes, and a route can only turn it off: write `budget: {enabled: false}` beside `match:`, at the same indentation",
            "5:56: error: endpoints.a.routes[0].match.circuit_breaker: `circuit_breaker` is not part of what a route matches; it is per endpoint, shared by its routes, and a route can only turn it off: write `circuit_breaker: {enabled: false}` beside `match:`, at the same indentation",
            "5:77: error: endpoints.a.routes[0].match.alert: `alert` is not part of what a route matches; alert is set per endpoint, not per route: the control plane compares the retries / calls of the whole endpoint; set it on the endpoint or in `defaults:`",
        ]
    );
}

#[test]
fn a_field_named_after_two_others_is_offered_the_one_it_shares_most_words_with() {
    let src = "version: 1\nendpoints:\n  a:\n    deadline_per_try: 1s\n    deadline_ms: 100\n";
    assert_eq!(
        errors(src),
        [
            "4:5: error: endpoints.a.deadline_per_try: unknown field `deadline_per_try` (did you mean `per_try_timeout`?)",
            "5:5: error: endpoints.a.deadline_ms: unknown field `deadline_ms` (did you mean `deadline`?)",
        ]
    );
}

#[test]
fn a_near_miss_inside_a_match_is_offered_what_it_is_close_to_or_nothing() {
    // A match has no status: `grpc_statuses` is `retry_on`'s field, and told where it goes,
    // not the `grpc` it starts. `http_method` is the `method` it ends with. `grpc_method` is
    // still `grpc`; `prefix` and `status` are close to nothing a match or a route has.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: GET, http_method: GET, grpc_statuses: [UNAVAILABLE]}\n      - match: {grpc: /a.B/C, grpc_method: /a.B/C, prefix: /v1, status: [503]}\n";
    assert_eq!(
        errors(src),
        [
            "5:30: error: endpoints.a.routes[0].match.http_method: unknown field `http_method` (did you mean `method`?)",
            "5:48: error: endpoints.a.routes[0].match.grpc_statuses: unknown field `grpc_statuses` (did you mean `grpc_status`?): `grpc_status` is a field of `retry_on`, a setting of the route, not part of what it matches: write it under `retry_on:`, beside `match:`, at the same indentation",
            "6:31: error: endpoints.a.routes[1].match.grpc_method: unknown field `grpc_method` (did you mean `grpc`?)",
            "6:52: error: endpoints.a.routes[1].match.prefix: unknown field `prefix`",
            "6:65: error: endpoints.a.routes[1].match.status: unknown field `status`",
        ]
    );
}

#[test]
fn a_match_offers_no_short_section_field_and_a_flat_dotted_key_is_told_to_nest() {
    // `base`, `max` and `ratio` are fields of sections, but a match offers a section's field
    // only for a near typo of a long one: `base_path`, `name` and `min` get no guess.
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {method: GET, base_path: /v1, name: x, min: 1}\n";
    assert_eq!(
        errors(src),
        [
            "5:30: error: endpoints.a.routes[0].match.base_path: unknown field `base_path`",
            "5:46: error: endpoints.a.routes[0].match.name: unknown field `name`",
            "5:55: error: endpoints.a.routes[0].match.min: unknown field `min`",
        ]
    );
    // A key is not a path: `backoff.max: 1s` is told to nest, not offered itself. On a route,
    // a field of the endpoint's shared budget is told where it goes.
    let src = "version: 1\ndefaults:\n  backoff.max: 1s\nendpoints:\n  a:\n    routes:\n      - match: {method: GET}\n        budget_ratio: 0.2\n";
    assert_eq!(
        errors(src),
        [
            "3:3: error: defaults.backoff.max: unknown field `backoff.max`: a key is not a path; write `max` under `backoff:` (`backoff: {max: …}`)",
            "8:9: error: endpoints.a.routes[0].budget_ratio: unknown field `budget_ratio` (did you mean `budget.ratio`?): `budget` is per endpoint, shared by its routes, and a route can only turn it off (`budget: {enabled: false}`): set `ratio` on the endpoint or in `defaults:`",
        ]
    );
    // Only a section's own field is told to nest, and a typo of `enabled` on a route is not
    // told to move to the endpoint.
    let src = "version: 1\ndefaults:\n  deadline.max: 1s\n  backoff.maxx: 1s\nendpoints:\n  a:\n    routes:\n      - match: {method: GET}\n        circuit_breaker.enabld: false\n";
    assert_eq!(
        errors(src),
        [
            "3:3: error: defaults.deadline.max: unknown field `deadline.max`",
            "4:3: error: defaults.backoff.maxx: unknown field `backoff.maxx` (did you mean `backoff.max`?)",
            "9:9: error: endpoints.a.routes[0].circuit_breaker.enabld: unknown field `circuit_breaker.enabld` (did you mean `circuit_breaker.enabled`?)",
        ]
    );
}

#[test]
fn a_sections_field_named_in_another_word_order_is_offered_by_its_path() {
    let src = "version: 1\ndefaults:\n  max_backoff: 5s\n  budget_ratio: 0.1\n  retry_on_status: [503]\n  max_delay: 5s\n  retry_max: 3\n  timeout: 1s\n  max_retries: 3\nendpoints:\n  a:\n    routes:\n      - match: {method: GET}\n        base_backoff: 1s\n        alert_ratio: 0.1\n";
    assert_eq!(
        errors(src),
        [
            "3:3: error: defaults.max_backoff: unknown field `max_backoff` (did you mean `backoff.max`?)",
            "4:3: error: defaults.budget_ratio: unknown field `budget_ratio` (did you mean `budget.ratio`?)",
            // `http_status` and `grpc_status` alike: their section.
            "5:3: error: defaults.retry_on_status: unknown field `retry_on_status` (did you mean `retry_on`?)",
            // `backoff.max` or `retry_after.max`; `max_attempts`?; `deadline` or
            // `per_try_timeout`? Too far from any one field to guess.
            "6:3: error: defaults.max_delay: unknown field `max_delay`",
            "7:3: error: defaults.retry_max: unknown field `retry_max`",
            "8:3: error: defaults.timeout: unknown field `timeout`",
            "9:3: error: defaults.max_retries: unknown field `max_retries`",
            "14:9: error: endpoints.a.routes[0].base_backoff: unknown field `base_backoff` (did you mean `backoff.base`?)",
            "15:9: error: endpoints.a.routes[0].alert_ratio: unknown field `alert_ratio` (did you mean `alert.retry_ratio`?): alert is set per endpoint, not per route: the control plane compares the retries / calls of the whole endpoint; set it on the endpoint or in `defaults:`",
        ]
    );
}

#[test]
fn a_second_defaults_block_is_a_duplicate_with_its_own_problems_reported_too() {
    let src = "version: 1\ndefaults:\n  max_attempts: 3\nendpoints:\n  a: {}\ndefaults:\n  max_attempts: 0\n  deadline: banana\n  deadline_ms: 3\n";
    assert_eq!(
        errors(src),
        [
            "6:1: error: defaults: duplicate key `defaults` (first set at 2:1)",
            "7:17: error: defaults.max_attempts: must be from 1 (never retry) to 10, found 0",
            "8:13: error: defaults.deadline: `banana` is not a duration: write a number and a unit, such as `250ms` or `2s`",
            "9:3: error: defaults.deadline_ms: unknown field `deadline_ms` (did you mean `deadline`?)",
        ]
    );
    // The first block is the one the file runs with; the second's problems do not mark its
    // fields, whose own checks still run.
    let src = "version: 1\ndefaults:\n  deadline: 1s\n  per_try_timeout: 2s\nendpoints:\n  a: {}\ndefaults:\n  deadline: 0s\n";
    assert_eq!(
        errors(src),
        [
            "4:20: error: defaults.per_try_timeout: per_try_timeout (2s) is longer than the deadline (1s)",
            "7:1: error: defaults: duplicate key `defaults` (first set at 2:1)",
            "8:13: error: defaults.deadline: must be longer than zero",
        ]
    );
}

#[test]
fn a_second_endpoints_block_is_a_duplicate_with_its_own_problems_reported_too() {
    let src = "version: 1\nendpoints:\n  a: {max_attempts: 2}\nendpoints:\n  a:\n    max_attempts: 0\n  b:\n    routes:\n      - match: {method: GET}\n        deadline: banana\n";
    assert_eq!(
        errors(src),
        [
            "4:1: error: endpoints: duplicate key `endpoints` (first set at 2:1)",
            "6:19: error: endpoints.a.max_attempts: must be from 1 (never retry) to 10, found 0",
            "10:19: error: endpoints.b.routes[0].deadline: `banana` is not a duration: write a number and a unit, such as `250ms` or `2s`",
        ]
    );
}

#[test]
fn a_misspelt_block_has_its_own_problems_reported_in_the_same_run() {
    // `endpoint:` and `default:` are unknown fields, with the name to write; what they hold is
    // checked as that block's, named as written, so one run shows every problem a rename
    // would leave.
    let src = "version: 1\ndefault:\n  max_atempts: 3\nendpoint:\n  a:\n    max_attempts: 0\n    backof: {base: 1s}\n";
    assert_eq!(
        errors(src),
        [
            "1:1: error: endpoints: the file defines no `endpoints:`",
            "2:1: error: default: unknown field `default` (did you mean `defaults`?)",
            "3:3: error: default.max_atempts: unknown field `max_atempts` (did you mean `max_attempts`?)",
            "4:1: error: endpoint: unknown field `endpoint` (did you mean `endpoints`?)",
            "6:19: error: endpoint.a.max_attempts: must be from 1 (never retry) to 10, found 0",
            "7:5: error: endpoint.a.backof: unknown field `backof` (did you mean `backoff`?)",
        ]
    );
    // Its names are held to their rule, once each in the block, as a second block's are.
    assert_eq!(
        errors(
            "version: 1\nendpoints: {a: {}}\nendpoint:\n  b: {}\n  b: {}\n  caf\u{e9}: {}\nendpoints:\n  c: {}\n  c: {}\n"
        ),
        [
            "3:1: error: endpoint: unknown field `endpoint` (did you mean `endpoints`?)",
            "5:3: error: endpoint.b: duplicate endpoint `b` (first defined at 4:3)",
            "6:3: error: endpoint.caf\u{e9}: endpoint names are 1 to 128 ASCII letters, digits, `-`, `_` or `.`",
            "7:1: error: endpoints: duplicate key `endpoints` (first set at 2:1)",
            "9:3: error: endpoints.c: duplicate endpoint `c` (first defined at 8:3)",
        ]
    );
    // A key of the misspelt block that is no name is named at that block.
    assert_eq!(
        errors("version: 1\nendpoints: {a: {}}\nendpoint: {true: {}}\n"),
        [
            "3:1: error: endpoint: unknown field `endpoint` (did you mean `endpoints`?)",
            "3:12: error: endpoint: endpoint names are strings, found a boolean",
        ]
    );
    // Beside the block the file runs with, which keeps its own checks, and whose endpoint of
    // the same name is not blamed (nor tagged, so `explain` does not show them). A name that
    // only shares a word (`old_endpoints`), is no block's, or holds policy fields rather than
    // endpoints, or no mapping, says nothing more.
    let src = "version: 1\nendpoints:\n  a: {deadline: 1s, per_try_timeout: 2s}\nEndpoints: {a: {max_attempts: 0}}\nendpoint: 5\nversoin: {a: {max_attempts: 0}}\nold_endpoints: {a: {max_attempts: 0}}\nendpoint_: {max_attempts: 0}\n";
    let loaded = load(src.as_bytes());
    let errors: Vec<String> = loaded.diagnostics.iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            "3:38: error: endpoints.a.per_try_timeout: per_try_timeout (2s) is longer than the deadline (1s)",
            "4:1: error: Endpoints: unknown field `Endpoints` (did you mean `endpoints`?)",
            "4:31: error: Endpoints.a.max_attempts: must be from 1 (never retry) to 10, found 0",
            "5:1: error: endpoint: unknown field `endpoint` (did you mean `endpoints`?)",
            "6:1: error: versoin: unknown field `versoin` (did you mean `version`?)",
            "7:1: error: old_endpoints: unknown field `old_endpoints` (did you mean `endpoints`?)",
            "8:1: error: endpoint_: unknown field `endpoint_` (did you mean `endpoints`?)",
        ]
    );
    let tagged: Vec<&str> = loaded
        .diagnostics
        .iter()
        .filter(|d| d.endpoint.as_deref() == Some("a"))
        .map(|d| d.path.as_str())
        .collect();
    assert_eq!(tagged, ["endpoints.a.per_try_timeout"]);
}

#[test]
fn duplicate_keys_in_a_policy_are_an_error() {
    let src = "version: 1\nendpoints:\n  a:\n    deadline: 10s\n    deadline: 20s\n";
    assert_eq!(
        errors(src),
        ["5:5: error: endpoints.a.deadline: duplicate key `deadline` (first set at 4:5)"]
    );
}

#[test]
fn a_repeated_unknown_key_is_reported_once_unknown_then_as_a_duplicate() {
    let src = "version: 1\nendpoints:\n  a:\n    dedline: 10s\n    dedline: 20s\n";
    let errs = errors(src);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(errs[0].starts_with("4:5: error: endpoints.a.dedline: unknown field `dedline`"));
    assert_eq!(
        errs[1],
        "5:5: error: endpoints.a.dedline: duplicate key `dedline` (first set at 4:5)"
    );
}

/// `n` endpoints `e0` … with defaults only, about 12 bytes each.
fn tiny_endpoints(n: usize) -> String {
    let mut y = String::from("version: 1\nendpoints:\n");
    for i in 0..n {
        y.push_str(&format!("  e{i}: {{}}\n"));
    }
    y
}

/// About the most endpoints a file under the size and event limits can hold. Duplicates used to
/// be found by a scan of every earlier endpoint, which took seconds here (see BENCHMARKS.md).
#[test]
fn sixty_thousand_endpoints_load_without_errors() {
    let src = tiny_endpoints(60_000);
    assert!(src.len() < 1024 * 1024, "{} bytes", src.len());
    let loaded = load(src.as_bytes());
    assert_eq!(loaded.diagnostics, vec![]);
    let set = loaded.policies.expect("valid");
    assert_eq!(set.len(), 60_000);
    assert!(set.endpoint("e59999").is_some());
    // A duplicate at the end of a long file is still found, with the first place.
    let dup = format!("{src}  e1: {{}}\n");
    assert_eq!(
        errors(&dup),
        ["60003:3: error: endpoints.e1: duplicate endpoint `e1` (first defined at 4:3)"]
    );
}

#[test]
fn a_file_without_endpoints_is_an_error() {
    assert_eq!(
        errors("version: 1\n"),
        ["1:1: error: endpoints: the file defines no `endpoints:`"]
    );
    assert_eq!(
        errors("version: 1\nendpoints: {}\n"),
        ["2:12: error: endpoints: the file defines no endpoints"]
    );
    assert_eq!(errors("").len(), 1);
}

#[test]
fn four_xx_statuses_that_do_not_improve_are_warnings() {
    let loaded = load(b"version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [404, 503]}\n");
    assert!(loaded.policies.is_some());
    assert_eq!(loaded.diagnostics.len(), 1);
    assert_eq!(loaded.diagnostics[0].severity, Severity::Warning);
    assert_eq!(
        loaded.diagnostics[0].path,
        "endpoints.a.retry_on.http_status"
    );
}

#[test]
fn cross_field_errors_are_reported_once_where_the_field_is_written() {
    // The defaults' problem is inherited by both endpoints but reported once, at the defaults.
    let src = "version: 1\ndefaults:\n  per_try_timeout: 20s\nendpoints:\n  a: {}\n  b: {}\n";
    assert_eq!(
        errors(src),
        [
            "3:20: error: defaults.per_try_timeout: per_try_timeout (20s) is longer than the deadline (15s)"
        ]
    );
}

#[test]
fn an_endpoint_name_error_says_the_letters_are_ascii_and_the_length_when_too_long() {
    assert_eq!(
        errors("version: 1\nendpoints:\n  caf\u{e9}: {}\n"),
        [
            "3:3: error: endpoints.caf\u{e9}: endpoint names are 1 to 128 ASCII letters, digits, `-`, `_` or `.`"
        ]
    );
    // Named by its first 128 bytes and a hash (see `a_huge_endpoint_name_is_not_copied…`).
    let long = "a".repeat(130);
    let shown = crate::diag::endpoint_name_shown(&long);
    assert!(shown.starts_with(&format!("{}…#", &long[..128])), "{shown}");
    assert_eq!(
        errors(&format!("version: 1\nendpoints:\n  {long}: {{}}\n")),
        [format!(
            "3:3: error: endpoints.{shown}: endpoint names are 1 to 128 ASCII letters, digits, `-`, `_` or `.`; this one is 130 bytes long"
        )]
    );
}

#[test]
fn a_value_listed_twice_is_a_warning_in_every_list() {
    let src = "version: 1\nendpoints:\n  a:\n    retry_on:\n      http_status: [503, 503]\n      grpc_status: [UNAVAILABLE, UNAVAILABLE]\n      errors: [connect, connect]\n    idempotent_methods: [GET, GET]\n";
    assert_eq!(
        all(src),
        [
            "5:26: warning: endpoints.a.retry_on.http_status: 503 is listed twice",
            "6:34: warning: endpoints.a.retry_on.grpc_status: UNAVAILABLE is listed twice",
            "7:25: warning: endpoints.a.retry_on.errors: connect is listed twice",
            "8:31: warning: endpoints.a.idempotent_methods: GET is listed twice",
        ]
    );
}

#[test]
fn a_whole_number_not_in_decimal_digits_is_refused_with_the_digits_to_write() {
    // YAML 1.2's core schema reads each of these as a whole number; a policy writes them in
    // decimal digits, as it must `03` and `3.0`, so each is read as its text and refused.
    let src = "version: 1\nendpoints:\n  a:\n    max_attempts: 0x3\n    retry_on: {http_status: [0x1F7, 0o767, +503], grpc_status: [0xE]}\n    budget: {ratio: 0b1, min_per_second: +10}\n";
    assert_eq!(
        errors(src),
        [
            "4:19: error: endpoints.a.max_attempts: expected a whole number, found `0x3`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `3`)",
            "5:30: error: endpoints.a.retry_on.http_status[0]: expected an HTTP status code, found `0x1F7`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `503`)",
            "5:37: error: endpoints.a.retry_on.http_status[1]: expected an HTTP status code, found `0o767`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `503`)",
            "5:44: error: endpoints.a.retry_on.http_status[2]: expected an HTTP status code, found `+503`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `503`)",
            "5:65: error: endpoints.a.retry_on.grpc_status[0]: gRPC status codes are written by name: write `UNAVAILABLE` for 14",
            "6:21: error: endpoints.a.budget.ratio: expected a number, found `0b1`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `1`)",
            "6:42: error: endpoints.a.budget.min_per_second: expected a whole number, found `+10`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `10`)",
        ]
    );
    // Through an alias too, and `version:` says how to write it.
    let src = "version: +1\nendpoints:\n  a: {max_attempts: &n 0x2}\n  b: {max_attempts: *n}\n";
    assert_eq!(
        errors(src),
        [
            "1:10: error: version: unsupported schema version: expected 1, found `+1` (write it in decimal digits)",
            "3:24: error: endpoints.a.max_attempts: expected a whole number, found `0x2`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `2`)",
            "4:21: error: endpoints.b.max_attempts: expected a whole number, found `0x2`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `2`)",
        ]
    );
}

#[test]
fn a_whole_number_not_in_decimal_digits_is_refused_wherever_an_alias_or_a_merge_copies_it() {
    // Each copy is refused at the place it is used, as a copy of `03` is.
    let src = "version: 1\nendpoints:\n  a:\n    retry_on: &r {http_status: [0x1F7]}\n  b:\n    retry_on: *r\n  c: &c {max_attempts: +2}\n  d: {<<: *c}\n  e: {max_attempts: !int 0o3}\n";
    assert_eq!(
        errors(src),
        [
            "4:33: error: endpoints.a.retry_on.http_status[0]: expected an HTTP status code, found `0x1F7`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `503`)",
            "6:15: error: endpoints.b.retry_on.http_status[0]: expected an HTTP status code, found `0x1F7`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `503`)",
            "7:24: error: endpoints.c.max_attempts: expected a whole number, found `+2`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `2`)",
            "8:11: error: endpoints.d.max_attempts: expected a whole number, found `+2`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `2`)",
            "9:26: error: endpoints.e.max_attempts: expected a whole number, found `0o3`: whole numbers are written in decimal digits, with no `+`, `0x`, `0o` or `0b` (write `3`)",
        ]
    );
    // Where no number goes, no digits are offered.
    assert_eq!(
        errors("version: 1\nendpoints:\n  a: {retry_on: 0x10}\n"),
        ["3:17: error: endpoints.a.retry_on: expected a mapping, found `0x10`"]
    );
}

#[test]
fn an_endpoint_named_like_a_hex_number_keeps_its_name_as_written() {
    let loaded = load(b"version: 1\nendpoints:\n  0x10: {}\n  -0o7: {}\n  12: {}\n");
    assert_eq!(loaded.diagnostics, []);
    let set = loaded.policies.expect("valid");
    assert_eq!(set.names(), ["-0o7", "0x10", "12"]);
}

#[test]
fn a_second_merge_key_in_one_mapping_is_a_duplicate_key_reported_with_the_other_problems() {
    let src = "version: 1\nendpoints:\n  a: &a {max_attempts: 2}\n  b: &b {max_attempts: 4}\n  c:\n    <<: *a\n    <<: *b\n    deadline: banana\n  d:\n    routes:\n      - {match: {method: GET}, <<: *a, <<: *b}\n<<: {x: 1}\n<<: {y: 2}\n";
    assert_eq!(
        errors(src),
        [
            "7:5: error: endpoints.c.<<: duplicate key `<<` (first set at 6:5): merge several mappings with one key and a list, `<<: [*a, *b]`, the first one's fields winning",
            "8:15: error: endpoints.c.deadline: `banana` is not a duration: write a number and a unit, such as `250ms` or `2s`",
            "11:40: error: endpoints.d.routes[0].<<: duplicate key `<<` (first set at 11:32): merge several mappings with one key and a list, `<<: [*a, *b]`, the first one's fields winning",
            "12:5: error: x: unknown field `x`",
            "13:1: error: <<: duplicate key `<<` (first set at 12:1): merge several mappings with one key and a list, `<<: [*a, *b]`, the first one's fields winning",
            "13:5: error: y: unknown field `y`",
        ]
    );
    // Named as the checks name places: a long endpoint name cut as they cut it, in a misspelt
    // block too, and a list at the top sorted with the file's other problem.
    let long = "n".repeat(200);
    let long_names = format!(
        "version: 1\nendpoints:\n  {long}: {{<<: {{}}, <<: {{}}, max_attempts: 0}}\nendpoint:\n  {long}: {{<<: {{}}, <<: {{}}, max_attempts: 0}}\n"
    );
    let shown = crate::diag::endpoint_name_shown(&long).into_owned();
    let paths: Vec<String> = load(long_names.as_bytes())
        .diagnostics
        .iter()
        .map(|d| d.path.clone())
        .collect();
    assert_eq!(
        paths,
        [
            format!("endpoints.{shown}"),
            format!("endpoints.{shown}.<<"),
            format!("endpoints.{shown}.max_attempts"),
            "endpoint".to_owned(),
            format!("endpoint.{shown}"),
            format!("endpoint.{shown}.<<"),
            format!("endpoint.{shown}.max_attempts"),
        ]
    );
    assert_eq!(
        errors("- {<<: {}, <<: {}}\n"),
        [
            "1:1: error: <root>: a policy file is a mapping with `version: 1` and `endpoints:`, found a list",
            "1:12: error: [0].<<: duplicate key `<<` (first set at 1:4): merge several mappings with one key and a list, `<<: [*a, *b]`, the first one's fields winning",
        ]
    );
    // Thousands of them behind a long list: each named, from one walk of the tree (a walk per
    // merge key took minutes for such a file).
    let many = format!(
        "version: 1\nendpoints: {{a: {{}}}}\nx: [{}]\ny: {{{}}}\n",
        "1,".repeat(50_000),
        "<<: {}, ".repeat(2_000)
    );
    let dups = load_all(many.as_bytes())
        .diagnostics
        .iter()
        .filter(|d| d.path == "y.<<")
        .count();
    assert_eq!(dups, 1_999);
    let one = "version: 1\nendpoints:\n  a: &a {max_attempts: 2}\n  b: &b {max_attempts: 4}\n  c:\n    <<: [*a, *b]\n";
    assert_eq!(errors(one), Vec::<String>::new());
    // `yaml::parse` alone refuses the first one.
    let refused = crate::yaml::parse(src.as_bytes()).expect_err("refused");
    assert_eq!(refused.loc, crate::yaml::Loc { line: 7, column: 5 });
    assert!(
        refused
            .message
            .starts_with("invalid YAML: duplicate key `<<` (first set at 6:5)"),
        "{}",
        refused.message
    );
}

#[test]
fn a_status_written_as_a_float_says_how_to_write_it() {
    for written in ["0503", "503.0", "5.03e2"] {
        assert_eq!(
            errors(&format!(
                "version: 1\nendpoints:\n  a:\n    retry_on: {{http_status: [{written}]}}\n"
            )),
            [
                "4:30: error: endpoints.a.retry_on.http_status[0]: expected an HTTP status code, found a number (write it as `503`: digits only, no leading zero, dot or exponent)"
            ],
            "{written}"
        );
    }
}

#[test]
fn a_list_of_more_methods_than_a_policy_needs_is_refused() {
    let methods = |n: usize| {
        let list: Vec<String> = (0..n).map(|i| format!("M{i}")).collect();
        format!(
            "version: 1\nendpoints:\n  a:\n    idempotent_methods: [{}]\n",
            list.join(", ")
        )
    };
    assert_eq!(all(&methods(64)), Vec::<String>::new());
    assert_eq!(
        errors(&methods(65)),
        [
            "4:25: error: endpoints.a.idempotent_methods: lists 65 methods; at most 64 (every call on the endpoint looks its method up in this list)"
        ]
    );
    // A repeated value is said once, at its second place, however often it is repeated: a
    // warning for each repeat made a document of a million repeats two million warnings.
    let repeated = format!(
        "version: 1\nendpoints:\n  a:\n    retry_on: {{http_status: [{}]}}\n",
        ["503"; 3].join(", ")
    );
    assert_eq!(
        all(&repeated),
        ["4:35: warning: endpoints.a.retry_on.http_status: 503 is listed twice"]
    );
}

#[test]
fn a_key_or_endpoint_written_twice_still_has_what_it_keeps_checked() {
    // A key written twice keeps its first value: the policy would hold it, so what is wrong
    // with it is said too.
    assert_eq!(
        all("version: 1\ndefaults:\n  deadline: 1s\n  deadline: 20s\nendpoints:\n  a: {}\n"),
        [
            "3:13: error: defaults.deadline: per_try_timeout (2s) is longer than the deadline (1s)",
            "4:3: error: defaults.deadline: duplicate key `deadline` (first set at 3:3)"
        ]
    );
    // An endpoint written twice: the second is refused under the first one's paths, and the
    // first one's own problems are still reported.
    assert_eq!(
        all("version: 1\nendpoints:\n  p: {deadline: 1s}\n  p: {deadline: 0s}\n"),
        [
            "3:17: error: endpoints.p.deadline: per_try_timeout (2s) is longer than the deadline (1s)",
            "4:3: error: endpoints.p: duplicate endpoint `p` (first defined at 3:3)",
            "4:17: error: endpoints.p.deadline: must be longer than zero"
        ]
    );
    // The second one's refusals are not the first one's: a field the first does not set is
    // still checked against the others (here the built-in deadline).
    assert_eq!(
        all(
            "version: 1\nendpoints:\n  p: {per_try_timeout: 30s}\n  p: {deadline: 0s, backoff: 5}\n"
        ),
        [
            "3:24: error: endpoints.p.per_try_timeout: per_try_timeout (30s) is longer than the deadline (15s)",
            "4:3: error: endpoints.p: duplicate endpoint `p` (first defined at 3:3)",
            "4:17: error: endpoints.p.deadline: must be longer than zero",
            "4:30: error: endpoints.p.backoff: expected a mapping, found an integer",
        ]
    );
}

#[test]
fn a_zero_deadline_is_one_error_not_three() {
    // Refused where it is written; no per_try_timeout or schedule can fit it, so those checks
    // would only repeat it, in the endpoint and in each endpoint that inherits it.
    assert_eq!(
        all("version: 1\nendpoints:\n  a:\n    deadline: 0s\n"),
        ["4:15: error: endpoints.a.deadline: must be longer than zero"]
    );
    assert_eq!(
        all("version: 1\ndefaults:\n  deadline: 0s\nendpoints:\n  a: {}\n  b: {max_attempts: 5}\n"),
        ["3:13: error: defaults.deadline: must be longer than zero"]
    );
}

#[test]
fn an_unreachable_attempt_is_blamed_on_the_layer_whose_jitter_or_cap_causes_it() {
    // With the built-in full jitter the shortest pause is zero: only `slow`, whose jitter is
    // none, has attempts that can never start.
    let src = "version: 1\ndefaults: {max_attempts: 5, deadline: 1s, per_try_timeout: 200ms}\nendpoints:\n  fast: {}\n  slow: {backoff: {jitter: none}}\n";
    assert_eq!(
        all(src),
        [
            "5:28: warning: endpoints.slow.backoff.jitter: attempt 5 can never start inside the deadline (1s): the shortest possible pauses before it add up to the deadline or more"
        ]
    );
    // The same for a cap that lets the pauses grow.
    let src = "version: 1\ndefaults: {max_attempts: 5, deadline: 1s, per_try_timeout: 200ms, backoff: {jitter: none, max: 100ms}}\nendpoints:\n  fast: {}\n  slow: {backoff: {max: 1s}}\n";
    assert_eq!(
        all(src),
        [
            "5:25: warning: endpoints.slow.backoff.max: attempt 5 can never start inside the deadline (1s): the shortest possible pauses before it add up to the deadline or more"
        ]
    );
    // Several attempts are named as a range.
    let src = "version: 1\ndefaults: {max_attempts: 6, deadline: 1s, per_try_timeout: 200ms, backoff: {jitter: none}}\nendpoints:\n  slow: {}\n";
    assert_eq!(
        all(src),
        [
            "2:26: warning: defaults.max_attempts: 6 attempts multiply load by up to 6x during an outage; more than 5 rarely helps",
            "2:26: warning: defaults.max_attempts: attempts 5 to 6 can never start inside the deadline (1s): the shortest possible pauses before them add up to the deadline or more"
        ]
    );
}

#[test]
fn precedence_is_builtin_then_defaults_then_endpoint_then_route() {
    let src = r"
version: 1
defaults:
  backoff: {base: 50ms}
  deadline: 20s
endpoints:
  payments:
    max_attempts: 4
    backoff: {jitter: none}
    routes:
      - match: {method: POST, path_prefix: /v1/charges}
        max_attempts: 2
      - match: {grpc: /pay.v1.Payments/*}
        deadline: 3s
";
    let set = load(src.as_bytes()).policies.expect("valid");
    let ep = set.endpoint("payments").expect("payments");
    let post = ep.resolve(&Target::Http {
        method: "POST",
        path: "/v1/charges/ch_1",
    });
    assert_eq!(post.max_attempts, 2); // route
    assert_eq!(post.backoff.jitter, Jitter::None); // endpoint, inherited by the route
    assert_eq!(post.backoff.base, Duration::from_millis(50)); // defaults
    assert_eq!(post.backoff.max, Duration::from_secs(5)); // built-in
    assert_eq!(post.deadline, Duration::from_secs(20));
    let get = ep.resolve(&Target::Http {
        method: "GET",
        path: "/v1/charges",
    });
    assert_eq!(get.max_attempts, 4);
    let grpc = ep.resolve(&Target::Grpc {
        path: "/pay.v1.Payments/Charge",
    });
    assert_eq!(grpc.deadline, Duration::from_secs(3));
    assert_eq!(grpc.max_attempts, 4);
    let other = ep.resolve(&Target::Grpc {
        path: "/pay.v1.Refunds/Refund",
    });
    assert_eq!(other.deadline, Duration::from_secs(20));
}

#[test]
fn an_endpoint_that_turns_the_budget_back_on_keeps_the_numbers_of_defaults() {
    let src = r"
version: 1
defaults:
  budget: {enabled: false, ratio: 0.5}
endpoints:
  a:
    budget: {enabled: true}
  b: {}
";
    let set = load(src.as_bytes()).policies.expect("valid");
    let a = set.endpoint("a").expect("a");
    assert_eq!(a.policy.budget.as_ref().map(|b| b.ratio), Some(0.5));
    assert_eq!(set.endpoint("b").expect("b").policy.budget, None);
}

#[test]
fn a_route_can_turn_the_shared_budget_and_breaker_off_for_its_calls() {
    let src = r"
version: 1
endpoints:
  a:
    budget: {ratio: 0.3}
    routes:
      - match: {path_prefix: /x}
        budget: {enabled: false}
        circuit_breaker: {enabled: false}
";
    let set = load(src.as_bytes()).policies.expect("valid");
    let ep = set.endpoint("a").expect("a");
    let x = ep.resolve(&Target::Http {
        method: "GET",
        path: "/x",
    });
    assert_eq!((&x.budget, &x.circuit_breaker), (&None, &None));
    let other = ep.resolve(&Target::Http {
        method: "GET",
        path: "/y",
    });
    assert_eq!(other.budget.as_ref().map(|b| b.ratio), Some(0.3));
    assert!(other.circuit_breaker.is_some());
}

/// The checked document of a valid file, to edit as code would.
fn document_of(file: &[u8]) -> crate::document::PolicyDocument {
    load(file)
        .policies
        .expect("valid")
        .document()
        .as_ref()
        .clone()
}

#[test]
fn a_document_with_two_endpoints_of_one_name_is_refused() {
    let mut doc = document_of(EXAMPLE.as_bytes());
    let copy = doc.endpoints[0].clone();
    let name = copy.name.value.clone();
    doc.endpoints.push(copy);
    let err = PolicySet::from_document(doc).expect_err("a second endpoint of one name");
    assert_eq!(err.errors.len(), 1, "{:?}", err.errors);
    assert_eq!(err.errors[0].path, format!("endpoints.{name}"));
    assert!(err.errors[0].message.starts_with("duplicate endpoint"));
}

#[test]
fn documents_from_no_file_run_the_same_checks() {
    let mut doc = document_of(EXAMPLE.as_bytes());
    doc.endpoints[0].overlay.max_attempts = Some(crate::document::Field::new(11));
    let err = PolicySet::from_document(doc).expect_err("invalid");
    assert_eq!(err.errors.len(), 1);
    assert_eq!(err.errors[0].path, "endpoints.payments.max_attempts");
    assert!(!err.errors[0].loc.is_known());
}

#[test]
fn a_problem_at_the_top_level_names_the_root() {
    // A null key at the top level (found by `mutated_valid_files_never_panic`).
    let loaded = load(b"version: 1\n:\nendpoints:\n  a: {}\n");
    let d = &loaded.diagnostics[0];
    assert_eq!(
        (
            d.loc.line,
            d.loc.column,
            d.path.as_str(),
            d.message.as_str()
        ),
        (2, 1, "<root>", "keys must be strings, found null")
    );
    assert!(loaded.policies.is_none());
}

#[test]
fn hostile_inputs_are_refused_quickly() {
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..20u8 {
        let (p, c) = ((b'a' + i - 1) as char, (b'a' + i) as char);
        bomb.push_str(&format!(
            "{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        ));
    }
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let big = "#".repeat(2 * 1024 * 1024);
    for input in [
        bomb.as_bytes(),
        deep.as_bytes(),
        big.as_bytes(),
        b"\xff\xfe\x00",
    ] {
        // Timing is asserted in the benchmark, not here; this proves termination and no panic.
        let loaded = load(input);
        assert!(loaded.has_errors());
        assert!(loaded.policies.is_none());
    }
}

#[test]
fn a_huge_unknown_name_is_refused_quickly_with_no_guess() {
    // An explicit key (`? key`) may be any length, and so may a code or jitter name: the
    // "did you mean" comparison with each known name must not cost the name's length times
    // theirs. Before it skipped names too long to be a typo, these took seconds each.
    let huge = "k".repeat(300_000);
    // Many different words: the guess by shared words must not be quadratic in them either.
    let words = (0..40_000)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join("_");
    let codes = "UNAVAILABLE".repeat(25_000);
    let jitter = "full".repeat(75_000);
    let inputs = [
        (
            format!("version: 1\nendpoints:\n  a:\n    ? {huge}\n    : 1\n"),
            "unknown field",
        ),
        (
            format!("version: 1\nendpoints:\n  a:\n    ? {words}\n    : 1\n"),
            "unknown field",
        ),
        (
            format!("version: 1\nendpoints:\n  a:\n    retry_on: {{grpc_status: [{codes}]}}\n"),
            "unknown gRPC status code",
        ),
        (
            format!("version: 1\nendpoints:\n  a:\n    backoff: {{jitter: {jitter}}}\n"),
            "unknown jitter",
        ),
    ];
    let began = tokio::time::Instant::now();
    for (src, what) in &inputs {
        let loaded = load(src.as_bytes());
        let [d] = loaded.diagnostics.as_slice() else {
            panic!("one problem expected: {:?}", loaded.diagnostics.len());
        };
        assert!(d.message.contains(what), "{}", &d.message[..80]);
        assert!(!d.message.contains("did you mean"), "{}", &d.message[..80]);
    }
    // Generous for a debug build on a busy machine; it took over 30 s before.
    let took = began.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn a_huge_endpoint_name_is_not_copied_into_every_problem_under_it() {
    // 100 KB of name over 1,000 problems (as many as are listed) would be 100 MB of paths; a
    // 1 MiB file could ask for tens of gigabytes.
    let name = "n".repeat(100_000);
    let mut src = format!("version: 1\nendpoints:\n  ? {name}\n  :\n");
    for i in 0..500 {
        src.push_str(&format!("    k{i}: 1\n"));
    }
    src.push_str("    routes:\n");
    for _ in 0..500 {
        src.push_str("      - match: {method: GET}\n");
    }
    let loaded = load(src.as_bytes());
    let diags = &loaded.diagnostics;
    assert_eq!(diags.len(), 1 + 500 + 499, "{:?}", &diags[..3]);
    let cut = crate::diag::endpoint_name_shown(&name);
    assert!(cut.starts_with(&format!("{}…#", &name[..128])), "{cut}");
    let shown = format!("endpoints.{cut}");
    assert_eq!(diags[0].path, shown);
    assert_eq!(
        diags[0].message,
        "endpoint names are 1 to 128 ASCII letters, digits, `-`, `_` or `.`; this one is 100000 bytes long"
    );
    assert_eq!(diags[1].path, format!("{shown}.k0"));
    assert_eq!(diags[501].path, format!("{shown}.routes[1].match"));
    for d in diags {
        assert!(d.path.starts_with(&shown), "{}", &d.path[..140]);
        assert_eq!(d.endpoint.as_deref(), Some(cut.as_ref()));
    }
    let bytes: usize = diags.iter().map(|d| d.path.len() + d.message.len()).sum();
    assert!(bytes < 1_000_000, "{bytes} bytes of diagnostics");
}

#[test]
fn two_long_endpoint_names_that_start_alike_keep_their_own_problems() {
    // Cut to their first 128 bytes alone, both would have one path: the first's refused
    // `deadline` hid the second's cross-field check.
    let first = format!("{}x", "a".repeat(128));
    let second = format!("{}y", "a".repeat(128));
    let src = format!(
        "version: 1\ndefaults:\n  deadline: 1s\nendpoints:\n  {first}:\n    deadline: bogus\n  {second}:\n    per_try_timeout: 5s\n"
    );
    let loaded = load(src.as_bytes());
    let second_path = crate::diag::endpoint_path(&second);
    assert!(
        loaded
            .diagnostics
            .iter()
            .any(|d| d.path == format!("{second_path}.per_try_timeout")
                && d.message.contains("longer than the deadline")),
        "{:#?}",
        loaded.diagnostics
    );
}

#[test]
fn a_grpc_code_written_as_its_number_is_told_its_name() {
    assert_eq!(
        errors(
            "version: 1\nendpoints:\n  a:\n    retry_on:\n      grpc_status: [14, UNAVAILABLE, 0, 99]\n"
        ),
        [
            "5:21: error: endpoints.a.retry_on.grpc_status[0]: gRPC status codes are written by name: write `UNAVAILABLE` for 14",
            "5:38: error: endpoints.a.retry_on.grpc_status[2]: gRPC status codes are written by name: 0 is `OK`, which is success and cannot be retried",
            "5:41: error: endpoints.a.retry_on.grpc_status[3]: gRPC status codes are written by name (such as `UNAVAILABLE`), and 99 is none of gRPC's codes (0 to 16)",
        ]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let loaded = load(&bytes);
        prop_assert_eq!(loaded.policies.is_some(), !loaded.has_errors());
    }

    /// Text made of YAML's own tokens (indentation, flow brackets, anchors, aliases, merge
    /// keys, tags, block scalars, quotes) and policy keys, so the parser, the quick scan and
    /// the checks get far past the first byte; random bytes are nearly all refused as UTF-8.
    #[test]
    fn yaml_shaped_text_never_panics(tokens in prop::collection::vec(prop::sample::select(vec![
        "version: 1\n", "endpoints:\n", "defaults:\n", "  a:\n", "  b: ", "    ", "  ", "\n",
        "max_attempts: ", "deadline: ", "backoff: ", "routes:\n", "- match: ", "{method: GET}",
        "retry_on: ", "budget: ", "circuit_breaker: ", "alert: ", "3", "0", "-1", "1e999", "2.5",
        "100ms", "10", "true", "~", "[", "]", "{", "}", ", ", ": ", "- ", "&x ", "*x", "&y ", "*y",
        "<<: ", "!!str ", "!!int ", "? ", "|\n", ">-\n", "\"", "'", "#", "---\n", "...\n",
        "\u{2028}", "\t", "é", "\u{feff}",
    ]), 0..64)) {
        let text: String = tokens.concat();
        let loaded = load(text.as_bytes());
        prop_assert_eq!(loaded.policies.is_some(), !loaded.has_errors());
        for d in &loaded.diagnostics {
            prop_assert!(!d.to_string().contains('\n'), "one line: {d}");
        }
    }

    #[test]
    fn route_matching_agrees_with_plain_string_comparison(
        want in "[A-Z]{0,3}|GET|DELETE",
        method in "[A-Z]{0,3}|GET|DELETE",
        prefix in "/[ab/]{0,12}",
        path in "/[ab/]{0,16}",
    ) {
        let http = crate::document::RouteMatch::Http {
            method: Some(want.clone()),
            path_prefix: prefix.clone(),
        };
        let target = Target::Http { method: &method, path: &path };
        prop_assert_eq!(http.matches(&target), want == method && path.starts_with(&prefix));
        let grpc = crate::document::RouteMatch::Grpc {
            service: prefix.trim_matches('/').to_owned(),
            method: Some(want.clone()),
        };
        let call = format!("{path}/{method}");
        let expected = call
            .strip_prefix('/')
            .and_then(|p| p.split_once('/'))
            .is_some_and(|(svc, m)| svc == prefix.trim_matches('/') && m == want);
        prop_assert_eq!(grpc.matches(&Target::Grpc { path: &call }), expected);
    }

    #[test]
    fn inline_string_comparison_agrees_with_eq(
        a in "[ab]{0,40}",
        position in any::<prop::sample::Index>(),
        flip_one in any::<bool>(),
        other in "[ab]{0,40}",
    ) {
        // `a` with one byte flipped (in any word, or in the overlapping tail; `a` itself when
        // empty), or an unrelated string; and `a` against itself.
        let b = if flip_one {
            let mut bytes = a.clone().into_bytes();
            if !bytes.is_empty() {
                let at = position.index(bytes.len());
                bytes[at] = if bytes[at] == b'a' { b'b' } else { b'a' };
            }
            String::from_utf8(bytes).expect("ascii")
        } else {
            other
        };
        prop_assert_eq!(crate::document::str_eq(&a, &b), a == b);
        prop_assert!(crate::document::str_eq(&a, &a.clone()));
    }

    #[test]
    fn mutated_valid_files_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8)
    ) {
        let mut bytes = EXAMPLE.as_bytes().to_vec();
        for (at, byte, op) in edits {
            if bytes.is_empty() { break; }
            let i = at.index(bytes.len());
            match op {
                0 => bytes[i] = byte,
                1 => { bytes.remove(i); }
                _ => bytes.insert(i, byte),
            }
        }
        let loaded = load(&bytes);
        prop_assert_eq!(loaded.policies.is_some(), !loaded.has_errors());
        for d in &loaded.diagnostics {
            prop_assert!(!d.path.is_empty());
            prop_assert!(!d.message.is_empty());
        }
    }
}

#[test]
fn a_route_may_only_turn_the_shared_budget_and_breaker_off() {
    // The endpoint's budget and breaker are built from the endpoint's settings and shared by
    // all its calls: anything else a route says about them would be shown but never run.
    let src = "version: 1\nendpoints:\n  a:\n    budget: {enabled: false}\n    routes:\n      - match: {path_prefix: /x}\n        budget: {enabled: true, ratio: 0.5}\n        circuit_breaker: {enabled: false, window: 5s}\n      - match: {path_prefix: /y}\n        circuit_breaker: {enabled: true}\n";
    let budget = "budget is per endpoint, shared by its routes; a route can only turn it off (enabled: false): set it on the endpoint or in `defaults:`";
    let breaker = "circuit_breaker is per endpoint, shared by its routes; a route can only turn it off (enabled: false): set it on the endpoint or in `defaults:`";
    assert_eq!(
        errors(src),
        [
            format!("7:27: error: endpoints.a.routes[0].budget.enabled: {budget}"),
            format!("7:40: error: endpoints.a.routes[0].budget.ratio: {budget}"),
            format!("8:51: error: endpoints.a.routes[0].circuit_breaker.window: {breaker}"),
            format!("10:36: error: endpoints.a.routes[1].circuit_breaker.enabled: {breaker}"),
        ]
    );
}

// === numbers ===

#[test]
fn a_negative_zero_is_read_as_zero_in_every_number_field() {
    let src = "version: 1\nendpoints:\n  a:\n    budget: {ratio: -0.0}\n    circuit_breaker: {failure_ratio: -0.0}\n    alert: {retry_ratio: -0.0}\n";
    let set = load(src.as_bytes()).policies.expect("valid");
    let o = &set.document().endpoints[0].overlay;
    for (field, v) in [
        ("budget.ratio", &o.budget.ratio),
        (
            "circuit_breaker.failure_ratio",
            &o.circuit_breaker.failure_ratio,
        ),
        ("alert.retry_ratio", &o.alert.retry_ratio),
    ] {
        let v = v.as_ref().map(|f| f.value);
        assert!(
            v.is_some_and(|v| v == 0.0 && v.is_sign_positive()),
            "{field}: {v:?}"
        );
    }
    let p = &set.endpoint("a").expect("a").policy;
    let ratios = [
        p.budget.as_ref().map(|b| b.ratio),
        p.circuit_breaker.as_ref().map(|c| c.failure_ratio),
        set.alert_retry_ratio("a"),
    ];
    for v in ratios {
        assert!(v.is_some_and(|v| v.is_sign_positive()), "{ratios:?}");
    }
    // A multiplier of zero is refused either way, and is shown as the zero it is.
    assert_eq!(
        errors("version: 1\nendpoints:\n  a: {backoff: {multiplier: -0.0}}\n"),
        ["3:29: error: endpoints.a.backoff.multiplier: must be from 1.0 to 100.0, found 0.0"]
    );
}

// === alert.retry_ratio ===

#[test]
fn alert_retry_ratio_is_built_in_then_defaults_then_endpoint() {
    let none = load(b"version: 1\nendpoints:\n  a: {}\n")
        .policies
        .expect("valid");
    assert_eq!(none.alert_retry_ratio("a"), Some(0.05));
    assert_eq!(none.default_alert().retry_ratio, 0.05);

    let src = "version: 1\ndefaults:\n  alert:\n    retry_ratio: 0.1\nendpoints:\n  a:\n    alert:\n      retry_ratio: 0.02\n    routes:\n      - match: {path_prefix: /x}\n        max_attempts: 2\n  b: {max_attempts: 4}\n";
    let set = load(src.as_bytes()).policies.expect("valid");
    assert_eq!(set.alert_retry_ratio("a"), Some(0.02));
    assert_eq!(set.alert_retry_ratio("b"), Some(0.1));
    assert_eq!(set.alert("b").map(|a| a.retry_ratio), Some(0.1));
    assert_eq!(set.alert_retry_ratio("nope"), None);
    assert_eq!(set.default_alert().retry_ratio, 0.1);
    // The policies calls run under are the same with or without alert settings.
    let plain = load(b"version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: /x}\n        max_attempts: 2\n  b: {max_attempts: 4}\n")
        .policies
        .expect("valid");
    for name in ["a", "b"] {
        assert_eq!(set.endpoint(name), plain.endpoint(name), "{name}");
    }
}

#[test]
fn alert_retry_ratio_bounds_are_zero_and_one_inclusive() {
    for ok in ["0", "0.0", "1", "1.0", "0.05"] {
        let src = format!("version: 1\nendpoints:\n  a: {{alert: {{retry_ratio: {ok}}}}}\n");
        assert_eq!(errors(&src), Vec::<String>::new(), "{ok}");
    }
    let src = "version: 1\ndefaults:\n  alert: {retry_ratio: -0.01}\nendpoints:\n  a:\n    alert:\n      retry_ratio: 1.5\n";
    assert_eq!(
        errors(src),
        [
            "3:24: error: defaults.alert.retry_ratio: must be from 0.0 (flag any retry) to 1.0 (one retry per call), found -0.01",
            "7:20: error: endpoints.a.alert.retry_ratio: must be from 0.0 (flag any retry) to 1.0 (one retry per call), found 1.5",
        ]
    );
}

#[test]
fn alert_on_a_route_is_an_error_that_says_where_it_belongs() {
    let src = "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: /x}\n        alert: {retry_ratio: 0.1}\n";
    assert_eq!(
        errors(src),
        [
            "6:9: error: endpoints.a.routes[0].alert: alert is set per endpoint, not per route: the control plane compares the retries / calls of the whole endpoint; set it on the endpoint or in `defaults:`"
        ]
    );
}

#[test]
fn alert_on_a_route_of_a_document_from_no_file_is_refused_too() {
    let mut doc = document_of(
        b"version: 1\nendpoints:\n  a:\n    routes:\n      - match: {path_prefix: /x}\n",
    );
    doc.endpoints[0].routes[0].overlay.alert.retry_ratio = Some(crate::document::Field::new(0.1));
    let err = PolicySet::from_document(doc).expect_err("invalid");
    let got: Vec<(&str, &str)> = err
        .errors
        .iter()
        .map(|d| (d.path.as_str(), d.message.as_str()))
        .collect();
    assert_eq!(
        got,
        [(
            "endpoints.a.routes[0].alert.retry_ratio",
            crate::parse::ROUTE_ALERT
        )]
    );
}

#[test]
fn alert_fields_are_checked_by_name_type_and_form() {
    let src = "version: 1\nendpoints:\n  a:\n    alert: {retry_rato: 0.1}\n  b:\n    alert: {retry_ratio: 5%}\n  c:\n    alert: 0.05\n  d:\n    alert: {retry_ratio: high}\n  e:\n    alert: [0.05]\n";
    assert_eq!(
        errors(src),
        [
            "4:13: error: endpoints.a.alert.retry_rato: unknown field `retry_rato` (did you mean `retry_ratio`?)",
            "6:26: error: endpoints.b.alert.retry_ratio: a ratio is a plain number from 0 to 1: write 0.05 for `5%`",
            "8:12: error: endpoints.c.alert: `alert` is a mapping of alert settings: write `alert: {retry_ratio: 0.05}`",
            "10:26: error: endpoints.d.alert.retry_ratio: expected a number, found a string",
            "12:12: error: endpoints.e.alert: expected a mapping, found a list",
        ]
    );
}

#[test]
fn other_ratios_refuse_percentages_the_same_way() {
    let src = "version: 1\nendpoints:\n  a:\n    budget: {ratio: 20%}\n    circuit_breaker: {failure_ratio: 50 %}\n";
    assert_eq!(
        errors(src),
        [
            "4:21: error: endpoints.a.budget.ratio: a ratio is a plain number from 0 to 1: write 0.2 for `20%`",
            "5:38: error: endpoints.a.circuit_breaker.failure_ratio: a ratio is a plain number from 0 to 1: write 0.5 for `50 %`",
        ]
    );
}

fn compiled(name: &str) -> Arc<EndpointPolicy> {
    let policy = Arc::new(Overlay::resolve(std::iter::empty::<&Overlay>()));
    Arc::new(EndpointPolicy {
        name: Arc::from(name),
        policy,
        routes: Arc::from([]),
    })
}

#[test]
fn the_endpoint_table_finds_every_name_and_nothing_else() {
    for n in [0usize, 1, 2, 3, 7, 8, 9, 1000] {
        let names: Vec<String> = (0..n).map(|i| format!("svc-{i:04}")).collect();
        let table = Endpoints::new(names.iter().map(|name| compiled(name)).collect());
        assert_eq!(table.len, n);
        assert!(table.slots.len() >= 2 * n && table.slots.len().is_power_of_two());
        for name in &names {
            let found = table.get(name).map(|e| e.name.to_string());
            assert_eq!(found.as_deref(), Some(name.as_str()), "{n} endpoints");
        }
        // Same lengths and prefixes as the names, and the empty name: absent, and the probe ends.
        for missing in ["svc-9999", "svc-", "", "svc-00000", "SVC-0000"] {
            assert!(table.get(missing).is_none(), "{missing} among {n}");
        }
        let mut listed: Vec<&str> = table.iter().map(|e| &*e.name).collect();
        listed.sort_unstable();
        assert_eq!(listed, names.iter().map(String::as_str).collect::<Vec<_>>());
    }
}

#[test]
fn the_endpoint_table_keeps_the_last_of_two_endpoints_of_one_name() {
    let mut second = EndpointPolicy::clone(&compiled("a"));
    second.routes = Arc::from([Route {
        matcher: RouteMatch::Grpc {
            service: "p.S".into(),
            method: None,
        },
        policy: Arc::new(Overlay::resolve(std::iter::empty::<&Overlay>())),
    }]);
    let table = Endpoints::new(vec![compiled("a"), compiled("b"), Arc::new(second)]);
    assert_eq!(table.len, 2);
    assert_eq!(table.get("a").map(|e| e.routes.len()), Some(1));
    assert!(table.get("b").is_some());
}

proptest! {
    /// Whatever the names (many of them sharing a first slot, since slots are few), every one
    /// is found and a name not in the table is not.
    #[test]
    fn the_endpoint_table_agrees_with_a_hash_set(
        names in proptest::collection::hash_set("[a-c]{0,3}", 0..40),
        probe in "[a-d]{0,4}",
    ) {
        let table = Endpoints::new(names.iter().map(|name| compiled(name)).collect());
        prop_assert_eq!(table.len, names.len());
        for name in &names {
            prop_assert_eq!(table.get(name).map(|e| e.name.to_string()), Some(name.clone()));
        }
        prop_assert_eq!(table.get(&probe).is_some(), names.contains(&probe));
    }
}

#[test]
fn a_name_with_the_same_full_hash_as_another_is_still_told_apart() {
    let mut table = Endpoints::new(vec![compiled("x"), compiled("y")]);
    let hash = table.hash("b");
    let at = hash as usize & table.mask;
    table.slots.iter_mut().for_each(|slot| *slot = None);
    // "a" stored where "b" would be, under "b"'s hash: only the name comparison tells them apart.
    table.slots[at] = Some(Slot {
        hash,
        endpoint: compiled("a"),
    });
    assert!(table.get("b").is_none());
    table.slots[at] = Some(Slot {
        hash,
        endpoint: compiled("b"),
    });
    assert_eq!(table.get("b").map(|e| &*e.name), Some("b"));
}

#[test]
fn a_set_shows_its_endpoints_not_its_empty_slots() {
    let table = Endpoints::new(vec![compiled("only")]);
    let shown = format!("{table:?}");
    assert!(
        shown.contains("\"only\"") && !shown.contains("None"),
        "{shown}"
    );
}

#[test]
fn an_oversized_file_is_one_error_at_the_top_whoever_reads_it() {
    let loaded = too_large(Some(10 << 30));
    assert!(loaded.policies.is_none());
    assert_eq!(loaded.diagnostics.len(), 1);
    assert!(loaded.diagnostics[0].is_error());
    assert!(loaded.diagnostics[0].message.contains("10737418240 bytes"));
    // A bounded read that stops at the limit refuses the file as `load` does.
    let big = vec![b' '; crate::yaml::MAX_FILE_BYTES + 1];
    let size = u64::try_from(big.len()).unwrap();
    assert_eq!(load(&big).diagnostics, too_large(Some(size)).diagnostics);
}

#[test]
fn a_multiplier_only_decorrelated_jitter_takes_is_warned_where_it_is_written() {
    // Warned: c's (no route of c changes its jitter), d's (decorrelated from `defaults:`).
    // Not warned: `defaults:`'s own (endpoints the file does not name take it with `full`),
    // b's (its route takes it with `none`).
    let src = "version: 1\ndefaults:\n  backoff: {multiplier: 3}\nendpoints:\n  a:\n    backoff: {jitter: decorrelated}\n  b:\n    backoff: {multiplier: 2, jitter: decorrelated}\n    routes:\n      - match: {method: GET}\n        backoff: {jitter: none}\n  c:\n    backoff: {multiplier: 2, jitter: decorrelated}\n";
    let warned = |src: &str| -> Vec<String> {
        all(src)
            .into_iter()
            .filter(|d| d.contains("multiplier"))
            .collect()
    };
    assert_eq!(
        warned(src),
        [
            "13:27: warning: endpoints.c.backoff.multiplier: does nothing: every policy that takes it has `jitter: decorrelated`, which draws each pause from the one before (up to three times it) and never reads the multiplier; remove it, or choose another jitter",
        ]
    );
    let src = "version: 1\ndefaults:\n  backoff: {multiplier: 3, jitter: decorrelated}\nendpoints:\n  a: {}\n  d:\n    backoff: {multiplier: 2}\n";
    assert_eq!(
        warned(src),
        [
            "3:25: warning: defaults.backoff.multiplier: does nothing: every policy that takes it has `jitter: decorrelated`, which draws each pause from the one before (up to three times it) and never reads the multiplier; remove it, or choose another jitter",
            "7:27: warning: endpoints.d.backoff.multiplier: does nothing: every policy that takes it has `jitter: decorrelated`, which draws each pause from the one before (up to three times it) and never reads the multiplier; remove it, or choose another jitter",
        ]
    );
    // An endpoint that turns the jitter to `full` makes `defaults:`'s act.
    let src = "version: 1\ndefaults:\n  backoff: {multiplier: 3, jitter: decorrelated}\nendpoints:\n  a:\n    backoff: {jitter: full}\n";
    assert_eq!(warned(src), Vec::<String>::new());
}

#[test]
fn a_file_of_more_problems_than_are_listed_says_how_many_more_there_are() {
    // 1,500 bad codes: each a problem of its own, a few hundred bytes to say for two of input.
    let codes = vec!["1"; 1_500].join(",");
    let src = format!("version: 1\nendpoints:\n  a:\n    retry_on: {{http_status: [{codes}]}}\n");
    let shown = all(&src);
    assert_eq!(shown.len(), crate::diag::MAX_LISTED + 1);
    assert_eq!(
        shown.last().map(String::as_str),
        Some("0:0: error: <document>: 500 more error(s) not listed (the first 1000 problems are)")
    );
}

#[test]
fn a_compiled_list_holds_each_value_once_in_the_order_first_written() {
    let src =
        "version: 1\nendpoints:\n  a:\n    retry_on: {http_status: [503, 502, 503, 502, 503]}\n";
    let loaded = load(src.as_bytes());
    let set = loaded.policies.unwrap();
    let policy = &set.endpoint("a").unwrap().policy;
    assert_eq!(&*policy.retry_on.http_status, &[503, 502]);
}

#[test]
fn a_file_cut_at_the_listing_limit_still_shows_its_errors() {
    // 1,200 endpoints warned of (6 attempts), then one error at the end of the file: the list
    // is cut at 1,000 in file order, so the only error (what makes the file invalid, what
    // `validate` exits 1 for) is never shown, only counted ("1 more error(s) not listed").
    // A check that refuses a document lists its errors first (`PolicySet::check` keeps only
    // them); `load` (what `validate`, `explain` and the agent's cache read go by) must not
    // hide every error behind warnings.
    let mut src = String::from("version: 1\nendpoints:\n");
    for i in 0..1_200 {
        src.push_str(&format!("  e{i}: {{max_attempts: 6}}\n"));
    }
    src.push_str("  zz: {max_attempts: 0}\n");
    let loaded = load(src.as_bytes());
    assert!(loaded.has_errors());
    let listed_errors: Vec<String> = loaded
        .diagnostics
        .iter()
        .filter(|d| d.is_error() && d.path != "<document>")
        .map(ToString::to_string)
        .collect();
    assert!(
        listed_errors
            .iter()
            .any(|e| e.contains("endpoints.zz.max_attempts")),
        "the file's one error is not listed: {:?}",
        loaded.diagnostics.last()
    );
}

#[test]
fn a_compiled_idempotent_methods_list_holds_each_method_once() {
    // The other lists are held each value once since 44fc776 (and `explain` shows them so);
    // `idempotent_methods` is still held as written: `explain` shows `[PUT, GET, PUT]`.
    let src = "version: 1\nendpoints:\n  a:\n    idempotent_methods: [PUT, GET, PUT]\n";
    let loaded = load(src.as_bytes());
    let set = loaded.policies.unwrap();
    let policy = &set.endpoint("a").unwrap().policy;
    let methods: Vec<&str> = policy.idempotent_methods.iter().map(|m| &**m).collect();
    assert_eq!(methods, ["PUT", "GET"]);
}

#[test]
fn a_repeated_post_in_idempotent_methods_is_warned_of_once() {
    // Like a repeated 4xx status (warned of as a client error at its first place only), a
    // repeated POST should be said not idempotent once: each repeat gets the warning again,
    // so a list of a million POSTs (a typed document) builds a million warnings.
    let src = "version: 1\nendpoints:\n  a:\n    idempotent_methods: [POST, POST, POST]\n";
    assert_eq!(
        all(src),
        [
            "4:26: warning: endpoints.a.idempotent_methods: POST is not idempotent by definition: retrying it may apply a change twice; prefer the idempotency key header",
            "4:32: warning: endpoints.a.idempotent_methods: POST is listed twice",
        ]
    );
}

/// A file's first 2,000 unknown keys get a "did you mean" guess, the rest none (each guess costs
/// an edit distance to every field name: 65,000 of them took seconds); a key longer than any
/// field name by far gets none either (as before: now without being split into words per copy).
#[test]
fn guesses_are_made_for_a_files_first_unknown_keys_and_short_ones_only() {
    let mut src = String::from("version: 1\nendpoints:\n");
    for i in 0..1_001 {
        src.push_str(&format!("  e{i}: {{max_atempts: 1, dedline: 1s}}\n"));
    }
    src.push_str(&format!(
        "  long: {{max_attempts{}: 1}}\n",
        "_max_attempts".repeat(5)
    ));
    let loaded = crate::load(src.as_bytes());
    let guessed = |d: &&Diagnostic| d.message.contains("did you mean");
    let unknown: Vec<&Diagnostic> = loaded
        .diagnostics
        .iter()
        .filter(|d| d.message.starts_with("unknown field"))
        .collect();
    // 1,000 listed of 2,003 problems; the first listed are guessed.
    assert_eq!(unknown.len(), 1_000);
    assert!(unknown.iter().all(guessed));
    // Past the 2,000th, and for the long key, no guess: look at the whole list.
    let all = crate::set::load_all(src.as_bytes());
    let unguessed: Vec<&str> = all
        .diagnostics
        .iter()
        .filter(|d| d.message.starts_with("unknown field") && !guessed(d))
        .map(|d| d.path.as_str())
        .collect();
    assert_eq!(
        unguessed,
        [
            "endpoints.e1000.max_atempts",
            "endpoints.e1000.dedline",
            &format!("endpoints.long.max_attempts{}", "_max_attempts".repeat(5)),
        ]
    );
}
