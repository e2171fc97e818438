//! The `retryplane` binary, run for real on files in a temporary directory (SPEC §5).

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::fs;
use std::path::Path;

use assert_cmd::Command;
use assert_cmd::assert::Assert;
use predicates::prelude::*;
use serde_json::Value;
use tempfile::TempDir;

mod support;
use support::too_large_for_agents;

/// A temporary directory holding `files` (name, contents).
fn dir_with(files: &[(&str, &str)]) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, contents) in files {
        fs::write(dir.path().join(name), contents).unwrap();
    }
    dir
}

/// `retryplane ARGS...` run inside `dir`, so file names print as given.
fn retryplane(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = support::cli(args);
    cmd.current_dir(dir);
    cmd
}

/// The stdout of a finished, checked run.
fn stdout_of(assert: Assert) -> String {
    String::from_utf8(assert.get_output().stdout.clone()).unwrap()
}

/// The stdout of `retryplane ARGS...` run inside `dir`, which must exit with `code`.
fn output(dir: &Path, args: &[&str], code: i32) -> String {
    stdout_of(retryplane(dir, args).assert().code(code))
}

/// `retryplane explain FILE --endpoint ENDPOINT EXTRA...` run inside `dir`.
fn explain(dir: &Path, file: &str, endpoint: &str, extra: &[&str]) -> Command {
    let mut cmd = retryplane(dir, &["explain", file, "--endpoint", endpoint]);
    cmd.args(extra);
    cmd
}

/// The stdout of [`explain`], which must exit 0.
fn explained(dir: &Path, file: &str, endpoint: &str, extra: &[&str]) -> String {
    stdout_of(explain(dir, file, endpoint, extra).assert().code(0))
}

/// The row of `field` in the `policy` array of `explain --format json`.
fn policy_row(explained: &Value, field: &str) -> Value {
    explained["policy"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["field"] == field)
        .cloned()
        .unwrap_or_else(|| panic!("no row for {field} in {explained}"))
}

const VALID: &str = "\
version: 1
endpoints:
  payments:
    max_attempts: 4
  inventory: {}
";

/// Three errors: line 3 col 17, line 7 col 19, line 9 col 21.
const THREE_ERRORS: &str = "\
version: 1
defaults:
  max_attempts: 0
endpoints:
  payments:
    backoff:
      multiplier: 0.5
    retry_on:
      http_status: [200]
";

const WARNINGS_ONLY: &str = "\
version: 1
endpoints:
  payments:
    max_attempts: 6
";

/// The worked schedule of SPEC §2: base 100ms, multiplier 2, max 2s, 7 attempts.
const WORKED: &str = "\
version: 1
endpoints:
  worked:
    max_attempts: 7
    deadline: 1m
    per_try_timeout: 1s
    backoff: {base: 100ms, multiplier: 2.0, max: 2s, jitter: none}
";

const LAYERED: &str = "\
version: 1
defaults:
  deadline: 20s
endpoints:
  payments:
    per_try_timeout: 3s
    routes:
      - match: {method: POST, path_prefix: /v1/charges}
        max_attempts: 2
  search:
    routes:
      - match: {grpc: /search.v1.SearchService/Query}
        max_attempts: 4
      - match: {grpc: /search.v1.Indexer/*}
        max_attempts: 1
";

// === validate ===

#[test]
fn a_valid_file_exits_zero_and_prints_nothing_on_stdout() {
    let dir = dir_with(&[("good.yaml", VALID)]);
    retryplane(dir.path(), &["validate", "good.yaml"])
        .assert()
        .code(0)
        .stdout("")
        .stderr(predicate::str::contains("good.yaml: valid (0 warnings)"));
}

#[test]
fn three_bad_fields_give_exactly_three_lines_at_their_places() {
    let dir = dir_with(&[("bad.yaml", THREE_ERRORS)]);
    let out = output(dir.path(), &["validate", "bad.yaml"], 1);
    let lines: Vec<&str> = out.lines().collect();
    let prefixes = [
        "bad.yaml:3:17: error: defaults.max_attempts: ",
        "bad.yaml:7:19: error: endpoints.payments.backoff.multiplier: ",
        "bad.yaml:9:21: error: endpoints.payments.retry_on.http_status[0]: ",
    ];
    assert_eq!(lines.len(), 3, "{out}");
    for (line, prefix) in lines.iter().zip(prefixes) {
        assert!(
            line.starts_with(prefix),
            "{line:?} should start with {prefix:?}"
        );
        assert!(line.len() > prefix.len(), "{line:?} has no message");
    }
}

#[test]
fn json_format_is_one_array_with_every_field() {
    let dir = dir_with(&[("bad.yaml", THREE_ERRORS), ("good.yaml", VALID)]);
    let out = output(
        dir.path(),
        &["validate", "--format", "json", "bad.yaml", "good.yaml"],
        1,
    );
    let problems: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(problems.len(), 3);
    for p in &problems {
        assert_eq!(p["file"], "bad.yaml");
        assert_eq!(p["severity"], "error");
        assert!(p["line"].as_u64().unwrap() > 0);
        assert!(p["column"].as_u64().unwrap() > 0);
        assert!(
            p["path"].as_str().unwrap().starts_with("defaults.")
                || p["path"].as_str().unwrap().starts_with("endpoints.")
        );
        assert!(!p["message"].as_str().unwrap().is_empty());
    }
    assert_eq!(problems[0]["line"], 3);
    assert_eq!(problems[0]["column"], 17);
    assert_eq!(problems[0]["path"], "defaults.max_attempts");
}

/// Names written with control characters: a line break in an endpoint name and in a key.
const CONTROL_NAMES: &str = "version: 1\nendpoints:\n  \"pay\\nments\":\n    \"max\\nattempts\": 2\n    deadline: \"1\\u001b[2Jm\"\n";

#[test]
fn text_output_keeps_each_problem_on_one_line_whatever_the_names_hold() {
    let dir = dir_with(&[("names.yaml", CONTROL_NAMES)]);
    let out = output(dir.path(), &["validate", "names.yaml"], 1);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(
        lines[0],
        "names.yaml:3:3: error: endpoints.pay\\nments: endpoint names are 1 to 128 ASCII letters, digits, `-`, `_` or `.`"
    );
    assert_eq!(
        lines[1],
        "names.yaml:4:5: error: endpoints.pay\\nments.max\\nattempts: unknown field `max\\nattempts` (did you mean `max_attempts`?)"
    );
    assert!(
        lines[2].starts_with("names.yaml:5:15: error: endpoints.pay\\nments.deadline: "),
        "{}",
        lines[2]
    );
    assert!(lines[2].contains("1\\u{1b}[2Jm"), "{}", lines[2]);
    assert!(!out.contains('\u{1b}'), "{out:?}");
    // JSON carries the names as written.
    let json = output(
        dir.path(),
        &["validate", "--format", "json", "names.yaml"],
        1,
    );
    let problems: Vec<Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(problems[1]["path"], "endpoints.pay\nments.max\nattempts");
}

#[test]
fn json_format_prints_an_empty_array_for_a_clean_file() {
    let dir = dir_with(&[("good.yaml", VALID)]);
    retryplane(dir.path(), &["validate", "--format", "json", "good.yaml"])
        .assert()
        .code(0)
        .stdout("[]\n")
        .stderr("");
}

#[test]
fn warnings_pass_unless_denied() {
    let dir = dir_with(&[("warn.yaml", WARNINGS_ONLY)]);
    let line = "warn.yaml:4:19: warning: endpoints.payments.max_attempts: ";
    retryplane(dir.path(), &["validate", "warn.yaml"])
        .assert()
        .code(0)
        .stdout(predicate::str::starts_with(line));
    retryplane(dir.path(), &["validate", "--deny-warnings", "warn.yaml"])
        .assert()
        .code(1)
        .stdout(predicate::str::starts_with(line));
    // The same in JSON: the warning is printed either way, and only denied it fails.
    for (deny, code) in [(false, 0), (true, 1)] {
        let mut args = vec!["validate", "--format", "json", "warn.yaml"];
        if deny {
            args.insert(1, "--deny-warnings");
        }
        let out = output(dir.path(), &args, code);
        let problems: Vec<Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(problems.len(), 1, "{out}");
        assert_eq!(problems[0]["severity"], "warning");
        assert_eq!(problems[0]["path"], "endpoints.payments.max_attempts");
    }
}

#[test]
fn a_missing_file_exits_two_and_names_the_file() {
    let dir = dir_with(&[]);
    retryplane(dir.path(), &["validate", "nowhere.yaml"])
        .assert()
        .code(2)
        .stdout("")
        .stderr(predicate::str::contains("nowhere.yaml"));
}

#[test]
fn a_missing_file_does_not_stop_the_others_and_exit_two_wins() {
    let dir = dir_with(&[("bad.yaml", THREE_ERRORS)]);
    let assert = retryplane(dir.path(), &["validate", "nowhere.yaml", "bad.yaml"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("nowhere.yaml"));
    assert_eq!(stdout_of(assert).lines().count(), 3);
}

#[test]
fn of_two_files_only_the_bad_ones_problems_are_printed() {
    let dir = dir_with(&[("good.yaml", VALID), ("bad.yaml", THREE_ERRORS)]);
    let out = output(dir.path(), &["validate", "good.yaml", "bad.yaml"], 1);
    assert_eq!(out.lines().count(), 3);
    assert!(out.lines().all(|l| l.starts_with("bad.yaml:")), "{out}");
}

#[test]
fn an_unknown_field_suggests_the_known_one() {
    let dir = dir_with(&[(
        "typo.yaml",
        "version: 1\nendpoints:\n  payments:\n    max_attempt: 2\n",
    )]);
    retryplane(dir.path(), &["validate", "typo.yaml"])
        .assert()
        .code(1)
        .stdout(predicate::str::starts_with(
            "typo.yaml:4:5: error: endpoints.payments.max_attempt: ",
        ))
        .stdout(predicate::str::contains("did you mean `max_attempts`"));
}

/// A route that turns the endpoint's budget back on and gives the breaker a number: neither
/// would run (the endpoint's budget and breaker are shared by all its calls).
const ROUTE_SHARED: &str = "\
version: 1
endpoints:
  payments:
    budget: {enabled: false}
    routes:
      - match: {method: GET}
        budget: {enabled: true}
        circuit_breaker: {min_requests: 5}
";

#[test]
fn a_route_that_turns_the_shared_budget_on_or_tunes_the_breaker_is_refused() {
    let dir = dir_with(&[("route.yaml", ROUTE_SHARED)]);
    let out = output(dir.path(), &["validate", "route.yaml"], 1);
    assert_eq!(
        out,
        "route.yaml:7:27: error: endpoints.payments.routes[0].budget.enabled: budget is per endpoint, shared by its routes; a route can only turn it off (enabled: false): set it on the endpoint or in `defaults:`\n\
         route.yaml:8:41: error: endpoints.payments.routes[0].circuit_breaker.min_requests: circuit_breaker is per endpoint, shared by its routes; a route can only turn it off (enabled: false): set it on the endpoint or in `defaults:`\n"
    );
}

#[test]
fn explain_shows_a_route_turning_the_shared_budget_off() {
    let dir = dir_with(&[(
        "off.yaml",
        "version: 1\nendpoints:\n  payments:\n    routes:\n      - match: {method: POST}\n        budget: {enabled: false}\n",
    )]);
    let out = explained(dir.path(), "off.yaml", "payments", &["-X", "POST"]);
    assert_eq!(
        policy_line(&out, "budget.enabled"),
        ["budget.enabled", "false", "route", "off.yaml:6:27"]
    );
    let out = explained(dir.path(), "off.yaml", "payments", &["-X", "GET"]);
    assert_eq!(
        policy_line(&out, "budget.enabled"),
        ["budget.enabled", "true", "built-in"]
    );
}

/// The budget line says whose calls its rates are: each agent process's, not the fleet's.
#[test]
fn explain_says_the_budget_is_each_agent_process_s_own() {
    let dir = dir_with(&[("p.yaml", "version: 1\nendpoints:\n  payments: {}\n")]);
    let out = explained(dir.path(), "p.yaml", "payments", &[]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("budget "))
        .unwrap_or_else(|| panic!("no budget line in:\n{out}"));
    assert!(
        line.contains("calls/s up")
            && line.ends_with("; each agent process counts its own calls and retries"),
        "{line}"
    );
}

/// A ratio so small that no traffic reaches it is said to add nothing, not to apply "from
/// inf calls/s up".
#[test]
fn explain_says_a_ratio_too_small_to_matter_adds_nothing() {
    let dir = dir_with(&[(
        "tiny.yaml",
        "version: 1\nendpoints:\n  payments:\n    budget: {ratio: 1e-320}\n",
    )]);
    let out = explained(dir.path(), "tiny.yaml", "payments", &[]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("budget "))
        .unwrap_or_else(|| panic!("no budget line in:\n{out}"));
    assert!(!line.contains("inf"), "{line}");
    assert!(
        line.contains("adds nothing at any traffic: only the reserve of 10 retries/s"),
        "{line}"
    );
}

/// A budget with no reserve is not said to have a "below that" rate, and one with no ratio
/// either is said to allow no retry.
#[test]
fn explain_says_what_a_budget_without_a_reserve_allows() {
    let dir = dir_with(&[(
        "none.yaml",
        "version: 1\nendpoints:\n  z: {budget: {ratio: 0, min_per_second: 0}}\n  r: {budget: {ratio: 1, min_per_second: 0}, max_attempts: 10}\n",
    )]);
    let budget_line = |endpoint: &str| {
        let out = explained(dir.path(), "none.yaml", endpoint, &[]);
        out.lines()
            .find(|l| l.trim_start().starts_with("budget "))
            .unwrap_or_else(|| panic!("no budget line in:\n{out}"))
            .to_owned()
    };
    let z = budget_line("z");
    assert!(z.contains("allows no retry: ratio 0 and no reserve"), "{z}");
    let r = budget_line("r");
    assert!(
        r.contains("up to 2x at any traffic") && r.contains("no reserve") && !r.contains("below"),
        "{r}"
    );
}

/// The paths of the warnings in `explain --format json`'s output `out`, sorted.
fn sorted_warning_paths(out: &Value) -> Vec<String> {
    let mut paths: Vec<String> = out["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["path"].as_str().unwrap().to_owned())
        .collect();
    paths.sort();
    paths
}

/// The paths of the warnings `explain --format json` lists for `endpoint`.
fn warning_paths(dir: &Path, file: &str, endpoint: &str) -> Vec<String> {
    let out: Value =
        serde_json::from_str(&explained(dir, file, endpoint, &["--format", "json"])).unwrap();
    out["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["path"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn explain_shows_only_the_warnings_of_its_endpoint_when_names_contain_dots() {
    let dir = dir_with(&[(
        "dots.yaml",
        "version: 1\nendpoints:\n  pay: {}\n  pay.v2: {max_attempts: 8}\n",
    )]);
    assert_eq!(
        warning_paths(dir.path(), "dots.yaml", "pay"),
        Vec::<String>::new()
    );
    assert_eq!(
        warning_paths(dir.path(), "dots.yaml", "pay.v2"),
        ["endpoints.pay.v2.max_attempts"]
    );
    let text = explained(dir.path(), "dots.yaml", "pay", &[]);
    assert!(!text.contains("pay.v2"), "{text}");
}

#[test]
fn explain_leaves_out_a_defaults_warning_the_endpoint_or_route_overrides() {
    let dir = dir_with(&[(
        "over.yaml",
        "version: 1\ndefaults: {max_attempts: 6, idempotent_methods: [GET, POST]}\nendpoints:\n  a: {max_attempts: 2, idempotent_methods: [GET]}\n  b: {}\n  c:\n    routes:\n      - {match: {method: GET}, max_attempts: 2}\n",
    )]);
    let both = ["defaults.max_attempts", "defaults.idempotent_methods"];
    assert_eq!(
        warning_paths(dir.path(), "over.yaml", "a"),
        Vec::<String>::new(),
        "a sets both fields itself"
    );
    assert_eq!(warning_paths(dir.path(), "over.yaml", "b"), both);
    assert_eq!(warning_paths(dir.path(), "over.yaml", "c"), both);
    let get: Value = serde_json::from_str(&explained(
        dir.path(),
        "over.yaml",
        "c",
        &["--method", "GET", "--path", "/x", "--format", "json"],
    ))
    .unwrap();
    assert_eq!(get["warnings"].as_array().unwrap().len(), 1, "{get}");
    assert_eq!(
        get["warnings"][0]["path"], "defaults.idempotent_methods",
        "a GET takes max_attempts from its route"
    );
    let text = explained(dir.path(), "over.yaml", "a", &[]);
    assert!(!text.contains("warnings about this endpoint"), "{text}");
}

#[test]
fn explain_leaves_out_a_defaults_warning_on_several_fields_the_endpoint_or_route_makes_untrue() {
    // `defaults` alone: no budget with 5 attempts, and attempts that cannot start in 1s.
    let dir = dir_with(&[(
        "cross.yaml",
        "version: 1\ndefaults: {max_attempts: 5, deadline: 1s, per_try_timeout: 200ms, budget: {enabled: false}, backoff: {jitter: none}}\nendpoints:\n  few: {max_attempts: 2}\n  budgeted: {budget: {enabled: true}}\n  long: {deadline: 30s}\n  same: {}\n  routed:\n    routes:\n      - {match: {path_prefix: /short}, max_attempts: 2}\n",
    )]);
    let both = ["defaults.budget.enabled", "defaults.max_attempts"];
    let mut same = warning_paths(dir.path(), "cross.yaml", "same");
    same.sort();
    assert_eq!(
        same, both,
        "an endpoint that sets nothing has both problems"
    );
    assert_eq!(
        warning_paths(dir.path(), "cross.yaml", "few"),
        Vec::<String>::new(),
        "2 attempts: neither problem"
    );
    assert_eq!(
        warning_paths(dir.path(), "cross.yaml", "budgeted"),
        ["defaults.max_attempts"],
        "a budget, but the attempts still cannot all start"
    );
    assert_eq!(
        warning_paths(dir.path(), "cross.yaml", "long"),
        ["defaults.budget.enabled"],
        "a longer deadline, but still no budget"
    );
    let routed = |path: &str| -> Vec<String> {
        let out: Value = serde_json::from_str(&explained(
            dir.path(),
            "cross.yaml",
            "routed",
            &["--path", path, "--format", "json"],
        ))
        .unwrap();
        sorted_warning_paths(&out)
    };
    assert_eq!(
        routed("/short/x"),
        Vec::<String>::new(),
        "the route's 2 attempts"
    );
    assert_eq!(routed("/other"), both, "no route: the defaults' problems");
}

#[test]
fn explain_shows_a_routes_warnings_only_for_a_call_that_takes_the_route_and_counts_the_others() {
    // Route 0 writes two warned settings: 6 attempts (a value), and no budget with them (two
    // fields combined). Both are about route 0's calls, and only about them.
    let dir = dir_with(&[(
        "wr.yaml",
        "version: 1
endpoints:
  b:
    budget: {enabled: true}
    routes:
      - match: {method: GET}
        budget: {enabled: false}
        max_attempts: 6
",
    )]);
    let route = [
        "endpoints.b.routes[0].budget.enabled",
        "endpoints.b.routes[0].max_attempts",
    ];
    let json = |args: &[&str]| -> Value {
        let mut all = vec!["--format", "json"];
        all.extend_from_slice(args);
        serde_json::from_str(&explained(dir.path(), "wr.yaml", "b", &all)).unwrap()
    };
    let get = json(&["--method", "GET"]);
    assert_eq!(sorted_warning_paths(&get), route, "{get}");
    assert_eq!(get["other_routes_warnings"], 0);
    for args in [&["--method", "PUT"][..], &[]] {
        let out = json(args);
        assert_eq!(
            sorted_warning_paths(&out),
            Vec::<String>::new(),
            "{args:?}: {out}"
        );
        assert_eq!(out["other_routes_warnings"], 2, "{args:?}: {out}");
    }
    let text = explained(dir.path(), "wr.yaml", "b", &["--method", "PUT"]);
    assert!(!text.contains("warnings about this endpoint"), "{text}");
    assert!(
        text.contains(
            "2 warnings about routes this call does not take: `retryplane validate` lists them"
        ),
        "{text}"
    );
    let text = explained(dir.path(), "wr.yaml", "b", &["--method", "GET"]);
    assert!(text.contains("warnings about this endpoint"), "{text}");
    assert!(!text.contains("routes this call does not take"), "{text}");
}

#[test]
fn explain_shows_an_endpoint_or_route_warning_on_several_fields_only_for_a_call_it_holds_for() {
    let dir = dir_with(&[(
        "layers.yaml",
        "version: 1\nendpoints:\n  pay:\n    max_attempts: 5\n    budget: {enabled: false}\n    routes:\n      - {match: {path_prefix: /short}, max_attempts: 2}\n      - {match: {grpc: /pkg.Svc/Get}, max_attempts: 2}\n      - {match: {path_prefix: /bulk}, max_attempts: 6}\n",
    )]);
    let paths = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["--format", "json"];
        all.extend_from_slice(args);
        let out: Value =
            serde_json::from_str(&explained(dir.path(), "layers.yaml", "pay", &all)).unwrap();
        out["warnings"]
            .as_array()
            .unwrap()
            .iter()
            // Not the field warning on routes[2]'s 6 attempts: it is about a value written there.
            .filter(|w| {
                w["message"]
                    .as_str()
                    .unwrap()
                    .starts_with("budget disabled")
            })
            .map(|w| w["path"].as_str().unwrap().to_owned())
            .collect()
    };
    let endpoint_level = "endpoints.pay.budget.enabled";
    let bulk = "endpoints.pay.routes[2].max_attempts";
    assert_eq!(
        paths(&[]),
        [endpoint_level],
        "no route: the endpoint's 5 attempts"
    );
    assert_eq!(paths(&["--path", "/other"]), [endpoint_level]);
    assert_eq!(
        paths(&["--path", "/short/x"]),
        Vec::<String>::new(),
        "the route's 2 attempts: neither the endpoint's problem nor /bulk's"
    );
    assert_eq!(paths(&["--grpc", "/pkg.Svc/Get"]), Vec::<String>::new());
    assert_eq!(
        paths(&["--path", "/bulk/1"]),
        [bulk],
        "the route's 6 attempts"
    );
}

#[test]
fn explain_shows_an_unreachable_attempt_only_for_the_endpoint_whose_jitter_causes_it() {
    let dir = dir_with(&[(
        "jitter.yaml",
        "version: 1\ndefaults: {max_attempts: 5, deadline: 1s, per_try_timeout: 200ms}\nendpoints:\n  fast: {}\n  slow: {backoff: {jitter: none}}\n",
    )]);
    assert_eq!(
        warning_paths(dir.path(), "jitter.yaml", "fast"),
        Vec::<String>::new()
    );
    assert_eq!(
        warning_paths(dir.path(), "jitter.yaml", "slow"),
        ["endpoints.slow.backoff.jitter"]
    );
}

#[test]
fn a_ten_gigabyte_file_is_refused_without_being_read() {
    let dir = dir_with(&[]);
    let file = fs::File::create(dir.path().join("big.yaml")).unwrap();
    file.set_len(10 << 30).unwrap(); // sparse: costs no disk
    retryplane(dir.path(), &["validate", "big.yaml"])
        .assert()
        .code(1)
        .stdout(predicate::str::starts_with(
            "big.yaml:1:1: error: <root>: file is 10737418240 bytes",
        ));
}

#[test]
fn a_file_whose_snapshot_agents_cannot_decode_is_invalid_as_the_control_plane_says() {
    let yaml = too_large_for_agents();
    assert!(yaml.len() < 1 << 20);
    let dir = dir_with(&[("big.yaml", &yaml)]);
    let out = output(dir.path(), &["validate", "big.yaml"], 1);
    assert!(
        out.starts_with("big.yaml:1:1: error: <root>: the policies encode to "),
        "{out}"
    );
    assert!(
        out.contains("agents decode messages of at most 4194304 bytes"),
        "{out}"
    );
    assert_eq!(out.lines().count(), 1, "{out}");
    let json: Value = serde_json::from_str(&output(
        dir.path(),
        &["validate", "--format", "json", "big.yaml"],
        1,
    ))
    .unwrap();
    assert_eq!(json[0]["severity"], "error");
    assert_eq!(json[0]["path"], "<root>");
}

#[test]
fn a_dash_reads_the_policy_from_stdin() {
    let dir = dir_with(&[]);
    retryplane(dir.path(), &["validate", "-"])
        .write_stdin(THREE_ERRORS)
        .assert()
        .code(1)
        .stdout(predicate::str::starts_with("<stdin>:3:17: error: "));
}

#[test]
fn the_repository_policy_file_is_valid_even_with_warnings_denied() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/policies.yaml");
    let config = config.to_str().unwrap();
    retryplane(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &["validate", "--deny-warnings", config],
    )
    .assert()
    .code(0)
    .stdout("");
}

#[test]
fn no_file_at_all_is_a_usage_error() {
    let dir = dir_with(&[]);
    retryplane(dir.path(), &["validate"]).assert().code(2);
}

// === explain ===

/// The whitespace-separated cells of the policy line for `field`.
fn policy_line(out: &str, field: &str) -> Vec<String> {
    out.lines()
        .map(str::split_whitespace)
        .map(|cells| cells.map(str::to_owned).collect::<Vec<_>>())
        .find(|cells| cells.first().is_some_and(|c| c == field))
        .unwrap_or_else(|| panic!("no line for {field} in:\n{out}"))
}

#[test]
fn explain_prints_the_worked_schedule_ceilings_in_milliseconds() {
    let dir = dir_with(&[("worked.yaml", WORKED)]);
    let out = explained(dir.path(), "worked.yaml", "worked", &[]);
    // Rows: retry, attempt, ceiling, [low, high], worst-case start, fits.
    let ceilings: Vec<&str> = out
        .lines()
        .map(str::split_whitespace)
        .filter_map(|mut cells| {
            let retry = cells.next()?;
            retry.parse::<u32>().ok()?;
            cells.nth(1)
        })
        .collect();
    assert_eq!(
        ceilings,
        ["100ms", "200ms", "400ms", "800ms", "1600ms", "2000ms"],
        "{out}"
    );
    assert!(out.contains("7x"), "{out}");
}

#[test]
fn explain_shows_what_a_tight_fit_has_to_spare() {
    // Attempt 2 starts at 900 + 98 = 998 ms at worst: it fits, but a timer a little late can
    // use up the 2 ms (the call then gives up before it), so the row says how tight it is.
    let tight = "version: 1\nendpoints:\n  tight:\n    max_attempts: 3\n    deadline: 1000ms\n    per_try_timeout: 400ms\n    backoff: {base: 90ms, multiplier: 1.0, jitter: none}\n";
    let dir = dir_with(&[("tight.yaml", tight)]);
    let out = explained(dir.path(), "tight.yaml", "tight", &[]);
    let fits: Vec<String> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .filter_map(|l| l.split("ms  ").last().map(str::trim).map(str::to_owned))
        .collect();
    // 400 + 90 = 490 (510 to spare), 2 x 400 + 2 x 90 = 980 (20 to spare): plain `yes`.
    assert_eq!(fits, ["yes", "yes"], "{out}");
    let tighter = tight.replace("90ms", "98ms");
    let dir = dir_with(&[("tight.yaml", &tighter)]);
    let out = explained(dir.path(), "tight.yaml", "tight", &[]);
    assert!(out.contains("996ms  yes, 4ms to spare"), "{out}");
}

#[test]
fn explain_json_has_the_schedule_and_load_in_milliseconds() {
    let dir = dir_with(&[("worked.yaml", WORKED)]);
    let out = explained(dir.path(), "worked.yaml", "worked", &["--format", "json"]);
    let e: Value = serde_json::from_str(&out).unwrap();
    let retries = e["schedule"]["retries"].as_array().unwrap();
    let ceilings: Vec<u64> = retries
        .iter()
        .map(|r| r["ceiling_ms"].as_u64().unwrap())
        .collect();
    assert_eq!(ceilings, [100, 200, 400, 800, 1600, 2000]);
    // 1s per attempt plus every pause so far: 1100, 2300, 3700, 5500, 8100, 11100.
    assert_eq!(retries[5]["worst_case_start_ms"], 11_100);
    assert_eq!(retries[5]["fits_deadline"], true);
    assert_eq!(retries[0]["jitter_low_ms"], 100);
    assert_eq!(e["schedule"]["deadline_ms"], 60_000);
    assert_eq!(e["load"]["multiplier"], 7);
    assert_eq!(e["load"]["budget"]["multiplier"], 1.2);
    assert_eq!(e["route"], Value::Null);
    assert_eq!(e["warnings"][0]["path"], "endpoints.worked.max_attempts");
}

#[test]
fn explain_names_the_layer_each_value_comes_from() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    let args = ["-X", "POST", "--path", "/v1/charges/ch_1"];
    let out = explained(dir.path(), "layers.yaml", "payments", &args);
    assert!(
        out.contains("routes[0]: POST /v1/charges (layers.yaml:8:16)"),
        "{out}"
    );
    assert_eq!(
        policy_line(&out, "max_attempts"),
        ["max_attempts", "2", "route", "layers.yaml:9:23"]
    );
    assert_eq!(
        policy_line(&out, "per_try_timeout"),
        ["per_try_timeout", "3s", "endpoint", "layers.yaml:6:22"]
    );
    assert_eq!(
        policy_line(&out, "deadline"),
        ["deadline", "20s", "defaults", "layers.yaml:3:13"]
    );
    assert_eq!(
        policy_line(&out, "backoff.base"),
        ["backoff.base", "100ms", "built-in"]
    );
}

#[test]
fn explain_json_names_the_layer_and_place_of_each_value() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    let args = ["-X", "POST", "--path", "/v1/charges", "--format", "json"];
    let e: Value =
        serde_json::from_str(&explained(dir.path(), "layers.yaml", "payments", &args)).unwrap();
    let field = |name: &str| policy_row(&e, name);
    assert_eq!(field("max_attempts")["level"], "route");
    assert_eq!(field("max_attempts")["line"], 9);
    assert_eq!(field("deadline")["value"], 20_000);
    assert_eq!(field("deadline")["level"], "defaults");
    assert_eq!(field("backoff.jitter")["level"], "built-in");
    assert_eq!(field("backoff.jitter")["line"], Value::Null);
    assert_eq!(e["route"]["index"], 0);
    assert_eq!(e["route"]["match"], "POST /v1/charges");
    assert_eq!(e["policy"].as_array().unwrap().len(), 25);
}

const ALERTS: &str = "\
version: 1
defaults:
  alert: {retry_ratio: 0.1}
endpoints:
  payments:
    alert:
      retry_ratio: 0.02
    routes:
      - match: {method: POST}
        max_attempts: 2
  search: {}
";

#[test]
fn explain_shows_the_alert_ratio_and_the_layer_it_comes_from() {
    let dir = dir_with(&[("alerts.yaml", ALERTS), ("valid.yaml", VALID)]);
    let alert = |file: &str, endpoint: &str, extra: &[&str]| {
        policy_line(
            &explained(dir.path(), file, endpoint, extra),
            "alert.retry_ratio",
        )
    };
    // A route is used for the call, but the alert setting is the endpoint's.
    assert_eq!(
        alert("alerts.yaml", "payments", &["-X", "POST"]),
        ["alert.retry_ratio", "0.02", "endpoint", "alerts.yaml:7:20"]
    );
    assert_eq!(
        alert("alerts.yaml", "search", &[]),
        ["alert.retry_ratio", "0.1", "defaults", "alerts.yaml:3:24"]
    );
    assert_eq!(
        alert("valid.yaml", "inventory", &[]),
        ["alert.retry_ratio", "0.05", "built-in"]
    );
    let json = ["--format", "json"];
    let e: Value =
        serde_json::from_str(&explained(dir.path(), "alerts.yaml", "search", &json)).unwrap();
    let row = policy_row(&e, "alert.retry_ratio");
    assert_eq!(row["value"], 0.1);
    assert_eq!(row["level"], "defaults");
    assert_eq!(row["line"], 3);
}

#[test]
fn explain_says_a_non_idempotent_call_needs_the_key() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    let post = ["-X", "POST", "--path", "/v1/charges"];
    explain(dir.path(), "layers.yaml", "payments", &post)
        .assert()
        .code(0)
        .stdout(predicate::str::contains(
            "only when the request carries the `Idempotency-Key` header: POST is not in idempotent_methods",
        ));
    let get = ["--path", "/v1/charges", "--format", "json"];
    let e: Value =
        serde_json::from_str(&explained(dir.path(), "layers.yaml", "payments", &get)).unwrap();
    assert_eq!(e["call"]["method"], "GET");
    assert_eq!(e["retried"]["idempotent"], true);
    assert_eq!(e["route"], Value::Null, "the route is for POST only");
}

#[test]
fn explain_says_a_failed_connect_is_retried_only_when_connect_is_in_retry_on_errors() {
    const NO_CONNECT: &str = "\
version: 1
defaults:
  retry_on: {errors: [timeout]}
endpoints:
  payments: {}
  search:
    retry_on: {errors: [connect, reset]}
";
    let dir = dir_with(&[("errors.yaml", NO_CONNECT)]);
    let connect = "a failed connect, which never reached the server, is retried anyway";
    let post = ["-X", "POST"];
    let grpc = ["--grpc", "/search.v1.SearchService/Query"];
    for args in [&post[..], &grpc[..]] {
        let out = explained(dir.path(), "errors.yaml", "payments", args);
        assert!(!out.contains(connect), "{out}");
        let out = explained(dir.path(), "errors.yaml", "search", args);
        assert!(out.contains(connect), "{out}");
    }
    let json = ["-X", "POST", "--format", "json"];
    let e: Value =
        serde_json::from_str(&explained(dir.path(), "errors.yaml", "payments", &json)).unwrap();
    assert_eq!(
        e["retried"]["summary"],
        "only when the request carries the `Idempotency-Key` header: POST is not in idempotent_methods"
    );
}

#[test]
fn explain_matches_grpc_routes_and_shows_a_never_retried_method() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    let query = ["--grpc", "/search.v1.SearchService/Query"];
    let out = explained(dir.path(), "layers.yaml", "search", &query);
    assert!(
        out.contains("routes[0]: /search.v1.SearchService/Query"),
        "{out}"
    );
    assert_eq!(policy_line(&out, "max_attempts")[2], "route");
    let put = ["--grpc", "/search.v1.Indexer/Put"];
    explain(dir.path(), "layers.yaml", "search", &put)
        .assert()
        .code(0)
        .stdout(predicate::str::contains("routes[1]: /search.v1.Indexer/*"))
        .stdout(predicate::str::contains("no retries: max_attempts is 1"))
        .stdout(predicate::str::contains("1x: never retried"));
}

#[test]
fn explain_suggests_grpc_only_for_a_path_a_grpc_route_would_match() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    let grpc_path = ["--path", "/search.v1.SearchService/Query"];
    explain(dir.path(), "layers.yaml", "search", &grpc_path)
        .assert()
        .code(0)
        .stderr(predicate::str::contains(
            "for a gRPC call use --grpc /search.v1.SearchService/Query",
        ));
    // An ordinary REST path that no route matches is only that.
    explain(
        dir.path(),
        "layers.yaml",
        "search",
        &["--path", "/stock/42"],
    )
    .assert()
    .code(0)
    .stderr("");
}

#[test]
fn explain_shows_a_call_never_retried_when_retry_on_lists_nothing() {
    let src = "version: 1\nendpoints:\n  n:\n    retry_on: {http_status: [], grpc_status: [], errors: []}\n";
    let dir = dir_with(&[("n.yaml", src)]);
    explain(dir.path(), "n.yaml", "n", &["--method", "GET"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains(
            "never: retry_on lists no failure this call can have",
        ))
        .stdout(predicate::str::contains(
            "  no retries: retry_on lists no failure this call can have\n",
        ))
        .stdout(predicate::str::contains("1x: never retried"));
    // Only gRPC codes listed: retried for a gRPC call, and for an HTTP one too, whose answer
    // may be a "Trailers-Only" gRPC one (`grpc-status` in its head), judged by its code as
    // `retryplane request` and the agent judge it.
    let src = "version: 1\nendpoints:\n  g:\n    retry_on: {http_status: [], grpc_status: [UNAVAILABLE], errors: []}\n";
    let dir = dir_with(&[("g.yaml", src)]);
    explain(dir.path(), "g.yaml", "g", &["--method", "GET"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("3x: each call"));
    explain(dir.path(), "g.yaml", "g", &["--grpc", "/a.B/C"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("3x: each call"));
    // Only HTTP statuses listed: a gRPC call answered by a proxy's plain 503 is judged by it.
    let src = "version: 1\nendpoints:\n  h:\n    retry_on: {http_status: [503], grpc_status: [], errors: []}\n";
    let dir = dir_with(&[("h.yaml", src)]);
    explain(dir.path(), "h.yaml", "h", &["--grpc", "/a.B/C"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("3x: each call"));
}

#[test]
fn explain_of_an_unknown_endpoint_lists_the_known_ones_and_exits_two() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    explain(dir.path(), "layers.yaml", "paymnts", &[])
        .assert()
        .code(2)
        .stdout("")
        .stderr(predicate::str::contains("did you mean `payments`"))
        .stderr(predicate::str::contains("payments, search"));
}

#[test]
fn explain_of_an_invalid_file_prints_what_validate_prints_and_exits_one() {
    let dir = dir_with(&[("bad.yaml", THREE_ERRORS)]);
    let validate = output(dir.path(), &["validate", "bad.yaml"], 1);
    explain(dir.path(), "bad.yaml", "payments", &[])
        .assert()
        .code(1)
        .stdout(validate);
}

/// A `--grpc` that is not a method's path is refused naming the one form explain takes, not
/// the `/pkg.Service/*` a route may also be, which explain refuses in turn.
#[test]
fn explain_refuses_a_grpc_path_naming_the_form_it_takes() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    for (given, told) in [
        (
            "search.v1.Indexer/Put",
            "retryplane: error: --grpc: `search.v1.Indexer/Put` is not a gRPC method's path: \
             write `/pkg.Service/Method`\n",
        ),
        (
            "/search.v1.Indexer/*",
            "retryplane: error: --grpc /search.v1.Indexer/*: explain shows one call; name a \
             method, such as `/search.v1.Indexer/Method`\n",
        ),
    ] {
        explain(dir.path(), "layers.yaml", "search", &["--grpc", given])
            .assert()
            .code(2)
            .stderr(told);
    }
}

#[test]
fn explain_refuses_grpc_together_with_an_http_method() {
    let dir = dir_with(&[("layers.yaml", LAYERED)]);
    let args = ["--grpc", "/a.B/C", "-X", "GET"];
    explain(dir.path(), "layers.yaml", "search", &args)
        .assert()
        .code(2);
}

#[test]
fn explain_and_simulate_refuse_a_file_validate_refuses_as_too_large_for_agents() {
    // `validate` says this file has an error (its snapshot is past what agents decode) and
    // exits 1; `explain` and `simulate` promise to print "exactly what validate prints" and
    // exit 1 for a file with errors, but they check the file without that error.
    let yaml = too_large_for_agents();
    let dir = dir_with(&[("big.yaml", &yaml)]);
    let validate = output(dir.path(), &["validate", "big.yaml"], 1);
    explain(dir.path(), "big.yaml", "payments", &[])
        .assert()
        .code(1)
        .stdout(validate.clone());
    retryplane(
        dir.path(),
        &[
            "simulate",
            "--policy",
            "big.yaml",
            "--endpoint",
            "payments",
            "--clients",
            "1",
            "--duration",
            "60s",
        ],
    )
    .assert()
    .code(1)
    .stdout(validate);
}

#[test]
fn every_subcommand_prints_the_program_version_with_dash_v() {
    // `get --version N` names a policy version, so `get` takes `-V` alone; it printed a usage
    // error before.
    let dir = dir_with(&[]);
    let version = retryplane_server::BUILD;
    for sub in [
        "validate", "explain", "apply", "diff", "get", "history", "rollback", "status", "stats",
        "top", "serve", "simulate", "request",
    ] {
        let out = output(dir.path(), &[sub, "-V"], 0);
        assert_eq!(out, format!("retryplane-{sub} {version}\n"), "{sub}");
    }
}

/// A valid file of 1,200 endpoints warned of (8 attempts), then `zz`, warned of too.
fn many_warned_endpoints() -> String {
    let mut src = String::from("version: 1\nendpoints:\n");
    for i in 0..1_200 {
        src.push_str(&format!("  e{i}: {{max_attempts: 8}}\n"));
    }
    src.push_str("  zz: {max_attempts: 8}\n");
    src
}

#[test]
fn explain_shows_an_endpoints_warning_however_many_other_endpoints_are_warned_of() {
    // `explain` picks its endpoint's warnings out of the file's diagnostics, which are cut at
    // the first 1,000 of the whole file: `zz`'s warning, past them, is never shown, though it
    // is one warning about the one endpoint asked for.
    let dir = dir_with(&[("many.yaml", &many_warned_endpoints())]);
    assert_eq!(
        warning_paths(dir.path(), "many.yaml", "e0"),
        ["endpoints.e0.max_attempts"]
    );
    assert_eq!(
        warning_paths(dir.path(), "many.yaml", "zz"),
        ["endpoints.zz.max_attempts"]
    );
}

#[test]
fn validate_counts_every_warning_of_a_file_cut_at_the_listing_limit() {
    // 1,201 warnings: 1,000 are listed, then "201 more warning(s) not listed". The summary
    // on stderr says `valid (1001 warnings)`: the closing line counted as one warning, not
    // the 201 it stands for.
    let dir = dir_with(&[("many.yaml", &many_warned_endpoints())]);
    let assert = retryplane(dir.path(), &["validate", "many.yaml"])
        .assert()
        .code(0);
    let stderr = String::from_utf8(assert.get_output().stderr.clone()).unwrap();
    assert!(
        stderr.contains("many.yaml: valid (1201 warnings)"),
        "{stderr}"
    );
}

/// `completions bash` prints a script bash loads, which completes the commands and a
/// command's flags; an unknown shell is a usage error.
#[test]
fn the_bash_completion_script_loads_and_completes_commands_and_flags() {
    let dir = dir_with(&[]);
    let script = output(dir.path(), &["completions", "bash"], 0);
    fs::write(dir.path().join("retryplane.bash"), &script).unwrap();
    // Load it, then ask its function for what follows `retryplane ap` and `retryplane apply --exp`.
    // (No `set -e`: the script's own `compgen` finding nothing is not a failure.)
    let probe = r#"source ./retryplane.bash || exit 1
complete -p retryplane || exit 1
ask() { COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE};
  COMPREPLY=(); _retryplane retryplane "${COMP_WORDS[$COMP_CWORD]}" "${COMP_WORDS[$COMP_CWORD-1]}";
  echo "${COMPREPLY[*]}"; }
ask retryplane ap
ask retryplane apply --exp
ask retryplane apply retry
ask retryplane apply --expected-version ""
ask retryplane get --server ""
"#;
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(probe)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].ends_with(" retryplane"), "{stdout}");
    assert_eq!(lines[1], "apply", "{stdout}");
    assert_eq!(lines[2], "--expected-version", "{stdout}");
    // The file to apply is left to bash's own file completion (`-o default`: the script offers
    // nothing there); where a version or a URL goes, no file is offered (clap's default would
    // list them).
    assert!(lines[0].contains(" -o default "), "{stdout}");
    assert_eq!(lines[3..], ["", "", ""], "{stdout}");

    retryplane(dir.path(), &["completions", "tcsh"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("invalid value 'tcsh'"));
}

/// `--version` names the build: the crate's version, its commit and the commit's date.
#[test]
fn version_names_the_commit_and_its_date() {
    let dir = tempfile::tempdir().unwrap();
    let shown = output(dir.path(), &["--version"], 0);
    assert_eq!(shown, format!("retryplane {}\n", retryplane_server::BUILD));
    assert!(
        shown.contains(&format!("(commit {}, ", retryplane_server::COMMIT)),
        "{shown}"
    );
}
