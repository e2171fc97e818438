//! Results as one text line, JSON, or a markdown table against the targets.

use std::fmt::Write as _;

use anyhow::Context as _;

use crate::measure::{Config, Outcome};

/// How results are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One line per configuration; `--matrix` prints a markdown table.
    Text,
    /// One JSON object per configuration; `--matrix` prints an array.
    Json,
}

/// Issue 3's server memory target per connected agent, KB.
pub const MEMORY_TARGET_KB: f64 = 16.0;
/// The figure for a plain tonic fan-out (not re-measured here), KB per agent.
pub const MEMORY_BASELINE_KB: f64 = 33.0;

/// Issue 3's p99 time-to-every-agent target and its plain-tonic figure for a configuration.
pub fn time_target(agents: usize, endpoints: usize) -> Option<(f64, &'static str)> {
    match (agents, endpoints) {
        (1_000, 10) => Some((10.0, "16 ms")),
        (10_000, 10) => Some((100.0, "150 ms (at 9,000)")),
        (1_000, 1_000) => Some((60.0, "350 ms")),
        _ => None,
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "meets" } else { "misses" }
}

/// One configuration's result.
pub fn one(o: &Outcome, format: Format) -> anyhow::Result<String> {
    if format == Format::Json {
        return serde_json::to_string(o).context("cannot encode the result as JSON");
    }
    let target = match time_target(o.agents, o.endpoints) {
        Some((ms, _)) => format!(
            " (target p99 <= {ms} ms: from the publish {}, from the Apply call {}, first to last {})",
            verdict(o.published_p99_ms <= ms),
            verdict(o.all_p99_ms <= ms),
            verdict(o.spread_p99_ms <= ms)
        ),
        None => String::new(),
    };
    Ok(format!(
        "agents={} endpoints={} connections={} rounds={} snapshot={:.1}KiB | publish to every \
         agent: p50 {:.2} ms, p99 {:.2} ms{target} | Apply call to every agent: p50 {:.2} ms, \
         p99 {:.2} ms | per agent: p50 {:.2} ms, p99 {:.2} ms | first \
         arrival p50 {:.2} ms, fan-out (first to last) p50 {:.2} ms p99 {:.2} ms, Apply RPC p50 \
         {:.2} ms (dry run {:.2} ms) | CPU per round: server {:.0} ms, bench {:.0} ms | \
         server memory per agent: {:.1} KiB connected, {:.1} KiB after the rounds (target <= \
         {MEMORY_TARGET_KB} KB: {}; RSS {} -> {} -> {} KiB)",
        o.agents,
        o.endpoints,
        o.connections,
        o.rounds,
        kib(o.snapshot_bytes),
        o.published_p50_ms,
        o.published_p99_ms,
        o.all_p50_ms,
        o.all_p99_ms,
        o.agent_p50_ms,
        o.agent_p99_ms,
        o.first_p50_ms,
        o.spread_p50_ms,
        o.spread_p99_ms,
        o.apply_rpc_p50_ms,
        o.dry_run_p50_ms,
        o.server_cpu_ms_per_round,
        o.bench_cpu_ms_per_round,
        o.kib_per_agent,
        o.kib_per_agent_after_pushes,
        verdict(o.kib_per_agent <= MEMORY_TARGET_KB),
        o.rss_idle_kib,
        o.rss_connected_kib,
        o.rss_after_kib,
    ))
}

/// Bytes as KiB.
#[allow(clippy::cast_precision_loss)]
pub fn kib(bytes: usize) -> f64 {
    bytes as f64 / 1024.0
}

/// Every configuration of `--matrix`.
pub fn matrix(
    results: &[(Config, anyhow::Result<Outcome>)],
    format: Format,
) -> anyhow::Result<String> {
    if format == Format::Json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(|(cfg, result)| match result {
                Ok(o) => serde_json::json!({
                    "agents": cfg.agents,
                    "endpoints": cfg.endpoints,
                    "result": o,
                    "target_p99_ms": time_target(cfg.agents, cfg.endpoints).map(|t| t.0),
                    "target_kib_per_agent": MEMORY_TARGET_KB,
                }),
                Err(e) => serde_json::json!({
                    "agents": cfg.agents,
                    "endpoints": cfg.endpoints,
                    "error": format!("{e:#}"),
                }),
            })
            .collect();
        return serde_json::to_string_pretty(&rows).context("cannot encode the results as JSON");
    }
    let mut s = String::new();
    s.push_str(
        "| agents × endpoints | conns | snapshot | publish → every agent p50 / p99 \
         | Apply call → every agent p50 / p99 | fan-out, first → last arrival p50 / p99 | target p99 | plain tonic (issue's figure) \
         | per agent p50 / p99 | Apply RPC p50 (dry run) | CPU per round: server / bench \
         | memory per agent: connected / after rounds | memory target |\n",
    );
    s.push_str("|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|\n");
    for (cfg, result) in results {
        let config = format!("{} × {}", thousands(cfg.agents), thousands(cfg.endpoints));
        let target = time_target(cfg.agents, cfg.endpoints);
        match result {
            Ok(o) => {
                let time_target = match target {
                    Some((ms, _)) => format!(
                        "≤ {ms} ms: from the publish **{}**, from the Apply call **{}**, \
                         first → last **{}**",
                        verdict(o.published_p99_ms <= ms),
                        verdict(o.all_p99_ms <= ms),
                        verdict(o.spread_p99_ms <= ms)
                    ),
                    None => "none".to_owned(),
                };
                let _ = writeln!(
                    s,
                    "| {config} | {} | {:.1} KiB | {:.1} / {:.1} ms | {:.1} / {:.1} ms \
                     | {:.1} / {:.1} ms | {time_target} | {} | {:.1} / {:.1} ms | {:.1} ms ({:.1} ms) \
                     | {:.0} / {:.0} ms | {:.1} / {:.1} KiB | ≤ {MEMORY_TARGET_KB} KB ({MEMORY_BASELINE_KB} KB \
                     plain tonic): **{}** |",
                    o.connections,
                    kib(o.snapshot_bytes),
                    o.published_p50_ms,
                    o.published_p99_ms,
                    o.all_p50_ms,
                    o.all_p99_ms,
                    o.spread_p50_ms,
                    o.spread_p99_ms,
                    target.map_or("–", |t| t.1),
                    o.agent_p50_ms,
                    o.agent_p99_ms,
                    o.apply_rpc_p50_ms,
                    o.dry_run_p50_ms,
                    o.server_cpu_ms_per_round,
                    o.bench_cpu_ms_per_round,
                    o.kib_per_agent,
                    o.kib_per_agent_after_pushes,
                    verdict(o.kib_per_agent <= MEMORY_TARGET_KB),
                );
            }
            Err(e) => {
                let error = format!("{e:#}").replace('\n', " ").replace('|', "\\|");
                let _ = writeln!(
                    s,
                    "| {config} | {} | failed: {error} | | | | | | | | | | |",
                    cfg.connections
                );
            }
        }
    }
    Ok(s)
}

/// `n` with thousands separators (`10,000`).
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(10), "10");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(10_000), "10,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }
}
