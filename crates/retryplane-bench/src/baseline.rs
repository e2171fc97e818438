//! `--baseline`: the plain tonic fan-out (`retryplane-bench-plain-server`) and `retryplane
//! serve` measured alternately in the same run, each on a fresh server process with the same
//! agents and settings, and every figure as retryplane ÷ plain of the same pair.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::ser::SerializeMap as _;

use crate::measure::{BETWEEN_SERVERS, Config, Outcome, run};
use crate::report::{Format, kib, thousands};

/// One compared figure of an [`Outcome`].
struct Figure {
    /// The JSON key of its ratio: the [`Outcome`] field's name.
    key: &'static str,
    /// The text report's row label.
    label: &'static str,
    /// Decimals in the text report.
    decimals: usize,
    get: fn(&Outcome) -> f64,
}

/// The figures compared, in report order.
const FIGURES: [Figure; 10] = [
    Figure {
        key: "published_p50_ms",
        label: "publish → every agent p50, ms",
        decimals: 1,
        get: |o| o.published_p50_ms,
    },
    Figure {
        key: "published_p99_ms",
        label: "publish → every agent p99, ms",
        decimals: 1,
        get: |o| o.published_p99_ms,
    },
    Figure {
        key: "all_p50_ms",
        label: "Apply call → every agent p50, ms",
        decimals: 1,
        get: |o| o.all_p50_ms,
    },
    Figure {
        key: "all_p99_ms",
        label: "Apply call → every agent p99, ms",
        decimals: 1,
        get: |o| o.all_p99_ms,
    },
    Figure {
        key: "spread_p50_ms",
        label: "fan-out (first → last) p50, ms",
        decimals: 1,
        get: |o| o.spread_p50_ms,
    },
    Figure {
        key: "spread_p99_ms",
        label: "fan-out (first → last) p99, ms",
        decimals: 1,
        get: |o| o.spread_p99_ms,
    },
    Figure {
        key: "first_p50_ms",
        label: "first arrival p50, ms",
        decimals: 1,
        get: |o| o.first_p50_ms,
    },
    Figure {
        key: "server_cpu_ms_per_round",
        label: "server CPU per round, ms",
        decimals: 0,
        get: |o| o.server_cpu_ms_per_round,
    },
    Figure {
        key: "kib_per_agent",
        label: "memory per agent, connected, KiB",
        decimals: 1,
        get: |o| o.kib_per_agent,
    },
    Figure {
        key: "kib_per_agent_after_pushes",
        label: "memory per agent, after rounds, KiB",
        decimals: 1,
        get: |o| o.kib_per_agent_after_pushes,
    },
];

/// `retryplane ÷ plain`, or `None` when that is no ratio: a plain figure of zero or below (a
/// CPU time under the 10 ms tick, an RSS that did not grow), a negative retryplane figure, or
/// a value that is not finite.
pub fn ratio(retryplane: f64, plain: f64) -> Option<f64> {
    let meaningful =
        plain.is_finite() && retryplane.is_finite() && plain > 0.0 && retryplane >= 0.0;
    meaningful.then(|| retryplane / plain)
}

/// Every figure's ratio for one pair, in [`FIGURES`] order; serialised as a JSON object keyed
/// by the [`Outcome`] field names (`null` for no ratio).
#[derive(Clone, Debug, PartialEq)]
pub struct Ratios(Vec<Option<f64>>);

impl Ratios {
    /// The ratios of one pair.
    pub fn of(plain: &Outcome, retryplane: &Outcome) -> Self {
        Self(
            FIGURES
                .iter()
                .map(|f| ratio((f.get)(retryplane), (f.get)(plain)))
                .collect(),
        )
    }

    /// The ratio of the figure whose key is `key`.
    pub fn get(&self, key: &str) -> Option<f64> {
        let i = FIGURES.iter().position(|f| f.key == key)?;
        self.0.get(i).copied().flatten()
    }
}

impl serde::Serialize for Ratios {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(FIGURES.len()))?;
        for (figure, value) in FIGURES.iter().zip(&self.0) {
            map.serialize_entry(figure.key, value)?;
        }
        map.end()
    }
}

/// Both servers' figures for one configuration: `plain[i]` and `retryplane[i]` ran as pair
/// `i`, plain first.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Comparison {
    /// Agents.
    pub agents: usize,
    /// Endpoints per policy.
    pub endpoints: usize,
    /// HTTP/2 connections.
    pub connections: usize,
    /// The plain tonic server's figures, one per pair.
    pub plain: Vec<Outcome>,
    /// `retryplane serve`'s figures, one per pair.
    pub retryplane: Vec<Outcome>,
    /// retryplane ÷ plain per figure, one per pair.
    pub ratios: Vec<Ratios>,
}

impl Comparison {
    /// Pairs `plain[i]` with `retryplane[i]` for the configuration `cfg`.
    pub fn new(cfg: &Config, plain: Vec<Outcome>, retryplane: Vec<Outcome>) -> Self {
        let ratios = plain
            .iter()
            .zip(&retryplane)
            .map(|(p, r)| Ratios::of(p, r))
            .collect();
        Self {
            agents: cfg.agents,
            endpoints: cfg.endpoints,
            connections: cfg.connections,
            plain,
            retryplane,
            ratios,
        }
    }
}

/// Whether pair `pair` (from 1) runs retryplane before plain: every even pair.
fn plain_goes_second(pair: usize) -> bool {
    pair.is_multiple_of(2)
}

/// Runs `cfg` `pairs` times on each server: plain (`plain_bin`) then retryplane
/// (`cfg.server_bin`) in odd pairs, retryplane then plain in even ones; each run on a fresh
/// server process. Any failed run fails the configuration.
pub async fn run_pairs(cfg: &Config, plain_bin: &Path, pairs: usize) -> anyhow::Result<Comparison> {
    let plain_cfg = Config {
        server_bin: plain_bin.to_owned(),
        ..cfg.clone()
    };
    let mut plain = Vec::with_capacity(pairs);
    let mut retryplane = Vec::with_capacity(pairs);
    for pair in 1..=pairs {
        // Plain first in odd pairs, retryplane first in even ones (ABBA), so a load that
        // drifts during the runs does not always fall on the same server.
        let mut order = [
            ("plain tonic", &plain_cfg, &mut plain),
            ("retryplane", cfg, &mut retryplane),
        ];
        if plain_goes_second(pair) {
            order.reverse();
        }
        let last_of_pair = order[1].0;
        for (name, config, into) in order {
            eprintln!("  pair {pair}/{pairs}: {name}…");
            let outcome = run(config)
                .await
                .with_context(|| format!("pair {pair}, {name} server"))?;
            eprintln!(
                "  pair {pair}/{pairs}: {name} (started {} UTC, load {:.2}): publish to every \
                 agent p50 {:.1} ms p99 {:.1} ms, Apply call to every agent p50 {:.1} ms p99 \
                 {:.1} ms, fan-out p99 {:.1} ms, server CPU {:.0} ms per round, {:.1} KiB per \
                 agent",
                outcome.started_utc,
                outcome.load_at_start,
                outcome.published_p50_ms,
                outcome.published_p99_ms,
                outcome.all_p50_ms,
                outcome.all_p99_ms,
                outcome.spread_p99_ms,
                outcome.server_cpu_ms_per_round,
                outcome.kib_per_agent
            );
            into.push(outcome);
            if !(pair == pairs && name == last_of_pair) {
                // Let the sockets of the last server close before the next one starts.
                tokio::time::sleep(BETWEEN_SERVERS).await;
            }
        }
    }
    Ok(Comparison::new(cfg, plain, retryplane))
}

fn fixed(value: f64, decimals: usize) -> String {
    format!("{value:.decimals$}")
}

fn times(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "–".to_owned(), |r| format!("{r:.2}×"))
}

/// One configuration as a markdown table: a row per figure, per pair the plain figure, the
/// retryplane figure and their ratio.
fn table(c: &Comparison) -> String {
    let snapshot = c
        .retryplane
        .first()
        .or(c.plain.first())
        .map_or(0, |o| o.snapshot_bytes);
    let rounds = c.retryplane.first().map_or(0, |o| o.rounds);
    let mut s = format!(
        "{} agents × {} endpoints, {} connections, snapshot {:.1} KiB, {rounds} rounds, {} \
         pair{} (plain tonic first in odd pairs, retryplane first in even ones, each on a fresh \
         server); ratio = retryplane ÷ plain of the same pair\n",
        thousands(c.agents),
        thousands(c.endpoints),
        c.connections,
        kib(snapshot),
        c.ratios.len(),
        if c.ratios.len() == 1 { "" } else { "s" },
    );
    s.push_str("| figure |");
    for pair in 1..=c.ratios.len() {
        let _ = write!(s, " {pair}: plain | retryplane | ratio |");
    }
    s.push_str("\n|---|");
    s.push_str(&"---:|---:|---:|".repeat(c.ratios.len()));
    s.push('\n');
    for figure in &FIGURES {
        let _ = write!(s, "| {} |", figure.label);
        for ((p, r), ratios) in c.plain.iter().zip(&c.retryplane).zip(&c.ratios) {
            let _ = write!(
                s,
                " {} | {} | {} |",
                fixed((figure.get)(p), figure.decimals),
                fixed((figure.get)(r), figure.decimals),
                times(ratios.get(figure.key)),
            );
        }
        s.push('\n');
    }
    for (pair, (p, r)) in c.plain.iter().zip(&c.retryplane).enumerate() {
        let (first, second) = if plain_goes_second(pair + 1) {
            (("retryplane", r), ("plain", p))
        } else {
            (("plain", p), ("retryplane", r))
        };
        let _ = writeln!(
            s,
            "pair {}: {} at {} UTC (load {:.2}), then {} at {} UTC (load {:.2})",
            pair + 1,
            first.0,
            first.1.started_utc,
            first.1.load_at_start,
            second.0,
            second.1.started_utc,
            second.1.load_at_start,
        );
    }
    s
}

/// One configuration's comparison.
pub fn one(c: &Comparison, format: Format) -> anyhow::Result<String> {
    match format {
        Format::Json => serde_json::to_string(c).context("cannot encode the result as JSON"),
        Format::Text => Ok(table(c)),
    }
}

/// Every configuration of `--matrix --baseline`: a table each (text), or an array of
/// comparison objects (json); a failed configuration is its error.
pub fn matrix(
    results: &[(Config, anyhow::Result<Comparison>)],
    format: Format,
) -> anyhow::Result<String> {
    if format == Format::Json {
        let rows = results
            .iter()
            .map(|(cfg, result)| match result {
                Ok(c) => serde_json::to_value(c).context("cannot encode a result as JSON"),
                Err(e) => Ok(serde_json::json!({
                    "agents": cfg.agents,
                    "endpoints": cfg.endpoints,
                    "error": format!("{e:#}"),
                })),
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        return serde_json::to_string_pretty(&rows).context("cannot encode the results as JSON");
    }
    let tables: Vec<String> = results
        .iter()
        .map(|(cfg, result)| match result {
            Ok(c) => table(c),
            Err(e) => format!(
                "{} agents × {} endpoints: failed: {}\n",
                thousands(cfg.agents),
                thousands(cfg.endpoints),
                format!("{e:#}").replace('\n', " ")
            ),
        })
        .collect();
    Ok(tables.join("\n"))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn cfg() -> Config {
        Config {
            agents: 1_000,
            endpoints: 10,
            connections: 10,
            rounds: 20,
            warmup: 2,
            server_bin: PathBuf::from("retryplane"),
        }
    }

    /// An outcome whose every compared figure is `scale` times a base value.
    fn outcome(scale: f64) -> Outcome {
        Outcome {
            started_utc: "16:00:00".to_owned(),
            load_at_start: 1.5,
            agents: 1_000,
            endpoints: 10,
            connections: 10,
            rounds: 20,
            snapshot_bytes: 2_048,
            published_p50_ms: 7.0 * scale,
            published_p99_ms: 14.0 * scale,
            all_p50_ms: 10.0 * scale,
            all_p99_ms: 20.0 * scale,
            agent_p50_ms: 5.0 * scale,
            agent_p99_ms: 9.0 * scale,
            first_p50_ms: 2.0 * scale,
            spread_p50_ms: 8.0 * scale,
            spread_p99_ms: 16.0 * scale,
            apply_rpc_p50_ms: 1.0,
            dry_run_p50_ms: 0.5,
            server_cpu_ms_per_round: 30.0 * scale,
            bench_cpu_ms_per_round: 12.0,
            rss_idle_kib: 10_000,
            rss_connected_kib: 40_000,
            rss_after_kib: 50_000,
            kib_per_agent: 30.0 * scale,
            kib_per_agent_after_pushes: 40.0 * scale,
        }
    }

    #[test]
    fn a_ratio_needs_a_positive_plain_figure() {
        assert_eq!(ratio(30.0, 15.0), Some(2.0));
        assert_eq!(ratio(0.0, 15.0), Some(0.0));
        assert_eq!(ratio(30.0, 0.0), None, "CPU under one tick");
        assert_eq!(ratio(30.0, -1.0), None, "RSS that shrank");
        assert_eq!(ratio(-3.0, 15.0), None);
        assert_eq!(ratio(f64::NAN, 15.0), None);
        assert_eq!(ratio(1.0, f64::INFINITY), None);
    }

    #[test]
    fn ratios_divide_each_figure_of_the_same_pair() {
        let mut retryplane = outcome(3.0);
        retryplane.kib_per_agent = 15.0;
        let mut plain = outcome(1.5);
        plain.server_cpu_ms_per_round = 0.0;
        let ratios = Ratios::of(&plain, &retryplane);
        assert_eq!(ratios.get("all_p50_ms"), Some(2.0));
        assert_eq!(ratios.get("spread_p99_ms"), Some(2.0));
        assert_eq!(ratios.get("first_p50_ms"), Some(2.0));
        assert_eq!(ratios.get("kib_per_agent"), Some(15.0 / 45.0));
        assert_eq!(ratios.get("server_cpu_ms_per_round"), None);
        assert_eq!(ratios.get("no_such_figure"), None);
        let json = serde_json::to_value(&ratios).unwrap();
        let keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys.len(), FIGURES.len());
        assert_eq!(json["all_p99_ms"], 2.0);
        assert!(json["server_cpu_ms_per_round"].is_null());
    }

    #[test]
    fn a_comparison_pairs_runs_in_order() {
        let c = Comparison::new(
            &cfg(),
            vec![outcome(1.0), outcome(2.0)],
            vec![outcome(3.0), outcome(3.0)],
        );
        assert_eq!(c.ratios.len(), 2);
        assert_eq!(c.ratios[0].get("all_p99_ms"), Some(3.0));
        assert_eq!(c.ratios[1].get("all_p99_ms"), Some(1.5));

        let json: serde_json::Value =
            serde_json::from_str(&one(&c, Format::Json).unwrap()).unwrap();
        assert_eq!(json["agents"], 1_000);
        assert_eq!(json["plain"].as_array().unwrap().len(), 2);
        assert_eq!(json["retryplane"][1]["all_p99_ms"], 60.0);
        assert_eq!(json["ratios"][1]["all_p50_ms"], 1.5);
    }

    #[test]
    fn the_text_table_has_a_row_per_figure_and_columns_per_pair() {
        let c = Comparison::new(
            &cfg(),
            vec![outcome(1.0), outcome(2.0)],
            vec![outcome(3.0), outcome(3.0)],
        );
        let text = one(&c, Format::Text).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with(
            "1,000 agents × 10 endpoints, 10 connections, snapshot 2.0 KiB, 20 rounds, 2 pairs"
        ));
        // Heading, header, separator, one row per figure, one line per pair with its order.
        assert_eq!(lines.len(), 3 + FIGURES.len() + 2);
        assert_eq!(
            lines[3 + FIGURES.len()],
            "pair 1: plain at 16:00:00 UTC (load 1.50), then retryplane at 16:00:00 UTC (load 1.50)"
        );
        assert!(
            lines[4 + FIGURES.len()].starts_with("pair 2: retryplane at"),
            "even pairs run retryplane first: {}",
            lines[4 + FIGURES.len()]
        );
        assert_eq!(lines[1].matches("plain").count(), 2);
        assert_eq!(
            lines[3],
            "| publish → every agent p50, ms | 7.0 | 21.0 | 3.00× | 14.0 | 21.0 | 1.50× |"
        );
        let cpu = lines
            .iter()
            .find(|l| l.starts_with("| server CPU"))
            .unwrap();
        assert_eq!(
            *cpu,
            "| server CPU per round, ms | 30 | 90 | 3.00× | 60 | 90 | 1.50× |"
        );
    }

    #[test]
    fn the_matrix_shows_failed_configurations() {
        let ok = Comparison::new(&cfg(), vec![outcome(1.0)], vec![outcome(2.0)]);
        let mut big = cfg();
        big.agents = 10_000;
        let results = vec![
            (cfg(), Ok(ok)),
            (big, Err(anyhow::anyhow!("pair 1\nno server"))),
        ];
        let text = matrix(&results, Format::Text).unwrap();
        assert!(text.contains("| fan-out (first → last) p99, ms | 16.0 | 32.0 | 2.00× |"));
        assert!(text.ends_with("10,000 agents × 10 endpoints: failed: pair 1 no server\n"));
        let json: serde_json::Value =
            serde_json::from_str(&matrix(&results, Format::Json).unwrap()).unwrap();
        assert_eq!(json[0]["ratios"][0]["all_p50_ms"], 2.0);
        assert_eq!(json[1]["agents"], 10_000);
        assert_eq!(json[1]["error"], "pair 1\nno server");
    }
}
