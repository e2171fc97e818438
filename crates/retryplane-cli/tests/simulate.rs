//! `retryplane simulate`, run for real on small fleets (debug builds stay fast).

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;

use assert_cmd::Command;
use predicates::prelude::*;
use serde_json::Value;
use tempfile::TempDir;

const POLICY: &str = "\
version: 1
endpoints:
  payments:
    max_attempts: 4
  inventory: {}
";

fn dir() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    fs::write(
        dir.path().join("bad.yaml"),
        "version: 1\nendpoints:\n  payments:\n    max_attempts: 0\n",
    )
    .unwrap();
    dir
}

/// `retryplane simulate --policy p.yaml --endpoint payments` on 50 clients for 12 s with a 3 s
/// outage at 4 s; `extra` flags replace those defaults or add to them.
fn simulate(dir: &Path, extra: &[&str]) -> Command {
    let mut args: Vec<&str> = vec![
        "--policy",
        "p.yaml",
        "--endpoint",
        "payments",
        "--clients",
        "50",
        "--duration",
        "12s",
        "--scenario",
        "outage:4s+3s",
    ];
    for pair in extra.chunks(2) {
        match args.iter().position(|a| *a == pair[0]) {
            Some(i) => args[i + 1] = pair[1],
            None => args.extend_from_slice(pair),
        }
    }
    let mut cmd = Command::cargo_bin("retryplane").unwrap();
    cmd.current_dir(dir)
        .arg("simulate")
        .args(args)
        .timeout(std::time::Duration::from_secs(120));
    cmd
}

fn stdout(cmd: &mut Command) -> String {
    let out = cmd.assert().success().get_output().stdout.clone();
    String::from_utf8(out).unwrap()
}

#[test]
fn text_output_has_a_column_per_variant_and_every_figure() {
    let dir = dir();
    let text = stdout(&mut simulate(dir.path(), &[]));
    let header = text.lines().find(|l| l.contains("no-budget")).unwrap();
    for name in ["policy", "no-budget", "no-jitter", "naive"] {
        assert!(header.contains(name), "{header}");
    }
    for row in [
        "logical calls",
        "upstream attempts",
        "amplification",
        "incident mean",
        "incident peak",
        "success",
        "latency p50",
        "latency p99",
        "gave up: budget_exhausted",
        "gave up: circuit_open",
        "time to recover",
    ] {
        assert!(text.contains(row), "no row {row:?} in\n{text}");
    }
    assert!(text.starts_with("endpoint payments: 50 clients × 1/s for 12s, outage:4s+3s"));
}

#[test]
fn every_figure_printed_is_explained_in_the_help() {
    let dir = dir();
    let text = stdout(&mut simulate(dir.path(), &[]));
    let help = stdout(
        Command::cargo_bin("retryplane")
            .unwrap()
            .args(["simulate", "--help"]),
    );
    let rows = text
        .lines()
        .skip_while(|l| !l.contains("no-budget"))
        .skip(1)
        .take_while(|l| !l.is_empty());
    let mut seen = 0;
    for row in rows {
        let label = row.trim().split("  ").next().unwrap();
        let explained = if label.starts_with("gave up: ") {
            "gave up: CAUSE"
        } else {
            label
                .trim_end_matches(" (1s)")
                .trim_end_matches(" p50")
                .trim_end_matches(" p99")
        };
        assert!(help.contains(explained), "{label:?} is not in\n{help}");
        seen += 1;
    }
    assert!(seen >= 10, "{text}");
    // The words a figure may read instead of a number.
    for word in ["not in run", "n/a"] {
        assert!(help.contains(word), "{word:?} is not in\n{help}");
    }
}

#[test]
fn json_output_is_the_same_byte_for_byte_for_the_same_seed() {
    let dir = dir();
    let a = stdout(&mut simulate(
        dir.path(),
        &["--output", "json", "--seed", "9"],
    ));
    let b = stdout(&mut simulate(
        dir.path(),
        &["--output", "json", "--seed", "9"],
    ));
    assert_eq!(a, b);
    let c = stdout(&mut simulate(
        dir.path(),
        &["--output", "json", "--seed", "10"],
    ));
    assert_ne!(a, c);
    let v: Value = serde_json::from_str(&a).unwrap();
    assert_eq!(v["endpoint"], "payments");
    assert_eq!(v["max_attempts"], 4);
    assert_eq!(v["capacity_per_s"], 75.0);
    let variants = v["variants"].as_array().unwrap();
    let names: Vec<_> = variants
        .iter()
        .map(|v| v["variant"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["policy", "no-budget", "no-jitter", "naive"]);
    // The naive client sends every attempt during a total outage: 4 per call.
    let naive = &variants[3];
    let mean = naive["amplification"]["incident_mean"].as_f64().unwrap();
    assert!((3.9..=4.0).contains(&mean), "{mean}");
    assert_eq!(naive["recovery_s"], 0.0);
}

#[test]
fn plot_writes_the_same_svg_for_the_same_seed() {
    let dir = dir();
    let text = simulate(dir.path(), &["--plot", "a.svg"])
        .assert()
        .success()
        .stderr(predicate::str::contains("wrote a.svg"))
        .get_output()
        .stdout
        .clone();
    assert!(!text.is_empty());
    simulate(dir.path(), &["--plot", "b.svg"])
        .assert()
        .success();
    let a = fs::read_to_string(dir.path().join("a.svg")).unwrap();
    let b = fs::read_to_string(dir.path().join("b.svg")).unwrap();
    assert!(a.starts_with("<svg"), "{}", &a[..80]);
    assert!(a.contains("upstream attempts per second"));
    assert_eq!(a, b);
}

#[test]
fn invalid_flags_exit_2_with_a_message_naming_the_problem() {
    let dir = dir();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--scenario", "blackout:1s+2s"],
            "expected outage:START+LEN",
        ),
        (&["--scenario", "error-rate:2"], "between 0 and 1"),
        (&["--duration", "10"], "needs a unit"),
        (
            &["--clients", "0"],
            "clients must be from 1 to 100000, not 0",
        ),
        (
            &["--clients", "4000000000", "--rate", "0.000000001"],
            "clients must be from 1 to 100000, not 4000000000",
        ),
        (
            &["--rate", "0"],
            "rate must be a number of calls per second",
        ),
        (
            &["--capacity", "0"],
            "capacity must be a number of requests per second above 0",
        ),
        (
            &["--capacity", "1e306"],
            "capacity must be a number of requests per second above 0 and at most 1000000000",
        ),
        (&["--output", "xml"], "invalid value 'xml'"),
        (
            &["--scenario", "outage:20s+1s"],
            "at or after the end of the run (12s)",
        ),
    ];
    for (args, message) in cases {
        simulate(dir.path(), args)
            .assert()
            .code(2)
            .stdout("")
            .stderr(predicate::str::contains(*message));
    }
}

#[test]
fn an_invalid_policy_prints_its_diagnostics_like_validate_and_exits_1() {
    let dir = dir();
    let out = simulate(dir.path(), &["--policy", "bad.yaml"])
        .assert()
        .code(1)
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.starts_with("bad.yaml:4:19: error: endpoints.payments.max_attempts:"),
        "{text}"
    );
    let validate = Command::cargo_bin("retryplane")
        .unwrap()
        .current_dir(dir.path())
        .args(["validate", "bad.yaml"])
        .timeout(std::time::Duration::from_secs(30))
        .assert()
        .code(1)
        .get_output()
        .stdout
        .clone();
    assert_eq!(text.as_bytes(), validate.as_slice());
}

#[test]
fn an_unknown_endpoint_exits_2_and_lists_the_known_ones() {
    let dir = dir();
    simulate(dir.path(), &["--endpoint", "paymnts"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("did you mean `payments`"))
        .stderr(predicate::str::contains("inventory, payments"));
}

#[test]
fn a_plot_that_cannot_be_written_exits_2() {
    let dir = dir();
    simulate(dir.path(), &["--plot", "no/such/dir/a.svg"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("cannot write no/such/dir/a.svg"));
}

/// The plot's file is checked before the policy is even read, so that a run (which can take a
/// while) is not made only for its report to be thrown away; a file that exists is left as it
/// is when the run does not happen.
#[test]
fn a_plot_that_cannot_be_written_is_refused_before_the_run() {
    let dir = dir();
    // `bad.yaml` is invalid (exit 1 once read): the plot's path is refused first.
    simulate(
        dir.path(),
        &["--policy", "bad.yaml", "--plot", "no/such/dir/a.svg"],
    )
    .assert()
    .code(2)
    .stdout("")
    .stderr(predicate::str::contains("cannot write no/such/dir/a.svg"));
    // A writable path: the invalid file is what is reported, and neither a new plot file nor
    // an existing one's content is touched.
    fs::write(dir.path().join("old.svg"), "old").unwrap();
    for plot in ["new.svg", "old.svg"] {
        simulate(dir.path(), &["--policy", "bad.yaml", "--plot", plot])
            .assert()
            .code(1);
    }
    assert!(!dir.path().join("new.svg").exists());
    assert_eq!(
        fs::read_to_string(dir.path().join("old.svg")).unwrap(),
        "old"
    );
}

/// `--latency` and `--duration` say the range the simulation takes, not a policy file's:
/// an upstream that answers at once is allowed, a latency past a minute is not.
#[test]
fn latency_and_duration_flags_say_their_own_range() {
    let dir = dir();
    simulate(dir.path(), &["--latency", "0ms", "--clients", "10"])
        .assert()
        .code(0);
    for (flag, value, said) in [
        ("--latency", "1h", "`1h` is out of range: from 0ms to 60s"),
        ("--latency", "25h", "`25h` is out of range: from 0ms to 60s"),
        ("--duration", "0s", "`0s` is out of range: from 1ms to 24h"),
        (
            "--duration",
            "25h",
            "`25h` is out of range: from 1ms to 24h",
        ),
    ] {
        simulate(dir.path(), &[flag, value])
            .assert()
            .code(2)
            .stderr(predicate::str::contains(said));
    }
}

#[test]
fn a_fleet_too_quiet_to_call_during_the_incident_still_gets_its_report() {
    // One client calling once in 1,000 s: no call, or one that ends before the outage does.
    let dir = dir();
    for seed in ["1", "2", "4"] {
        let out = stdout(&mut simulate(
            dir.path(),
            &["--clients", "1", "--rate", "0.001", "--seed", seed],
        ));
        assert!(out.contains("time to recover"), "{out}");
        assert!(out.contains("not in run"), "{out}");
    }
}

/// A run in which no call is made shows no success share, latency or amplification (each
/// would read 0, as if every call had failed at once), as it shows no time to recover.
#[test]
fn a_run_with_no_call_shows_its_ratios_and_latencies_as_not_applicable() {
    let dir = dir();
    let text = stdout(&mut simulate(
        dir.path(),
        &["--clients", "1", "--rate", "1e-9"],
    ));
    for label in [
        "logical calls",
        "amplification",
        "  incident mean",
        "  incident peak (1s)",
        "success",
        "latency p50",
        "latency p99",
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label} row: {text}"));
        let cells: Vec<&str> = line[label.len()..].split_whitespace().collect();
        let want = if label == "logical calls" { "0" } else { "n/a" };
        assert!(
            !cells.is_empty() && cells.iter().all(|c| *c == want),
            "{label}: {line}"
        );
    } // JSON says the same with `null`.
    let json = stdout(&mut simulate(
        dir.path(),
        &["--clients", "1", "--rate", "1e-9", "--output", "json"],
    ));
    // Each variant's fields in their order, its name first (as a run with calls has them).
    let at = |key: &str| json.find(&format!("\"{key}\": ")).unwrap();
    assert!(at("variant") < at("description") && at("amplification") < at("success_pct"));
    let v: Value = serde_json::from_str(&json).unwrap();
    let variants = v["variants"].as_array().unwrap();
    assert!(!variants.is_empty());
    for variant in variants {
        assert_eq!(variant["logical_calls"], 0);
        for figure in [
            &variant["amplification"]["overall"],
            &variant["amplification"]["incident_mean"],
            &variant["amplification"]["incident_peak"],
            &variant["success_pct"],
            &variant["latency"]["p50_ms"],
            &variant["latency"]["p99_ms"],
        ] {
            assert!(figure.is_null(), "{variant}");
        }
    }
}

#[test]
fn a_tiny_rate_is_written_with_an_exponent_not_hundreds_of_zeros() {
    let dir = dir();
    let text = stdout(&mut simulate(dir.path(), &["--rate", "1e-300"]));
    let header = text.lines().next().unwrap();
    assert!(header.contains("× 1.0e-300/s"), "{header}");
    assert!(header.len() < 200, "{} chars: {header}", header.len());
}

#[test]
fn the_warnings_that_hold_for_the_simulated_policy_go_to_stderr_and_no_others() {
    let dir = tempfile::tempdir().unwrap();
    // `payments` takes the defaults' 7 attempts; `inventory` sets 2, so the defaults' warning
    // is not about its policy; the route's warnings are about calls simulate does not run.
    fs::write(
        dir.path().join("p.yaml"),
        "version: 1\ndefaults:\n  max_attempts: 7\nendpoints:\n  payments:\n    routes:\n      - match: {method: GET}\n        max_attempts: 6\n  inventory: {max_attempts: 2}\n  other: {max_attempts: 9}\n",
    )
    .unwrap();
    let out = simulate(dir.path(), &["--output", "json"])
        .assert()
        .success();
    let output = out.get_output();
    let stderr = String::from_utf8(output.stderr.clone()).unwrap();
    assert_eq!(
        stderr,
        "p.yaml:3:17: warning: defaults.max_attempts: 7 attempts multiply load by up to 7x during an outage; more than 5 rarely helps\n"
    );
    // Standard output is the report alone.
    let _: Value = serde_json::from_slice(&output.stdout).unwrap();
    simulate(dir.path(), &["--endpoint", "inventory"])
        .assert()
        .success()
        .stderr("");
}
