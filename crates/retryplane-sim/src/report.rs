//! The report as text (columns side by side) and as JSON.

use std::fmt::Write as _;

use crate::{Report, Variant, VariantReport};

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
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

/// `1.5` as `1.5`, `2.0` as `2`: the shortest form of an already rounded number.
pub(crate) fn number(x: f64) -> String {
    // Rust writes every digit of a very small or very large number (`1e-300` as 300 zeros):
    // those are written with an exponent, as a policy's numbers are.
    if x != 0.0 && !(1e-4..1e16).contains(&x.abs()) {
        retryplane_policy::render::float(&x)
    } else {
        format!("{x}")
    }
}

impl Report {
    /// The figures of `variant`, if it ran.
    pub fn variant(&self, variant: Variant) -> Option<&VariantReport> {
        self.variants.iter().find(|v| v.variant == variant.as_str())
    }

    /// Pretty JSON with a final newline. A variant that made no call has `null` for its
    /// ratios, share and latencies (see [`VariantReport`]'s `Serialize`).
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        Ok(text)
    }

    /// A header, one column per variant, then what each variant is.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "endpoint {}: {} clients × {}/s for {}s, {}, upstream capacity {}/s, latency {}ms, seed {}",
            self.endpoint,
            self.clients,
            number(self.rate_per_client),
            number(self.duration_s),
            self.scenario,
            number(self.capacity_per_s),
            number(self.latency_ms),
            self.seed
        );
        let _ = writeln!(
            out,
            "incident: {}s to {}s; max_attempts {}\n",
            number(self.incident.start_s),
            number(self.incident.end_s),
            self.max_attempts
        );
        let v = &self.variants;
        let mut rows: Vec<Vec<String>> = Vec::new();
        let mut row = |label: &str, cell: &dyn Fn(&VariantReport) -> String| {
            let mut r = vec![label.to_owned()];
            r.extend(v.iter().map(cell));
            rows.push(r);
        };
        row("", &|r| r.variant.to_owned());
        row("logical calls", &|r| thousands(r.logical_calls));
        row("upstream attempts", &|r| thousands(r.upstream_attempts));
        // A variant that made no call has no ratio, share or latency to show (its figures
        // read 0, which would say "every call failed at once").
        let or_na = |r: &VariantReport, figure: String| {
            if r.logical_calls == 0 {
                "n/a".to_owned()
            } else {
                figure
            }
        };
        row("amplification", &|r| {
            or_na(r, format!("{:.2}", r.amplification.overall))
        });
        row("  incident mean", &|r| {
            or_na(r, format!("{:.2}", r.amplification.incident_mean))
        });
        row("  incident peak (1s)", &|r| {
            or_na(r, format!("{:.2}", r.amplification.incident_peak))
        });
        row("peak attempts/s", &|r| thousands(r.peak_attempts_per_s));
        row("success", &|r| or_na(r, format!("{:.1}%", r.success_pct)));
        row("latency p50", &|r| or_na(r, latency(r.latency.p50_ms)));
        row("latency p99", &|r| or_na(r, latency(r.latency.p99_ms)));
        let causes: Vec<&str> = v
            .first()
            .map(|r| r.give_ups.keys().copied().collect())
            .unwrap_or_default();
        for cause in causes {
            row(&format!("gave up: {cause}"), &|r| {
                thousands(r.give_ups.get(cause).copied().unwrap_or(0))
            });
        }
        let ends = self.incident.ends_in_run;
        row("time to recover", &|r| match r.recovery_s {
            Some(s) => format!("{}s", number(s)),
            None if ends => "not in run".to_owned(),
            None => "n/a".to_owned(),
        });
        let widths: Vec<usize> = (0..=v.len())
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        for r in &rows {
            let mut line = format!("{:<w$}", r[0], w = widths[0]);
            for (c, cell) in r.iter().enumerate().skip(1) {
                let _ = write!(line, "  {cell:>w$}", w = widths[c]);
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.push('\n');
        for r in v {
            let _ = writeln!(out, "{:<9}  {}", r.variant, r.description);
        }
        out
    }
}

/// A latency as the text report shows it: in milliseconds under a second (`18.3ms`), in
/// seconds from one (`3.03s`, not `3034.8ms`; a deadline of hours gives `5400.0s`, not
/// `5400000.0ms`). JSON keeps milliseconds.
fn latency(ms: f64) -> String {
    if ms < 999.95 {
        format!("{ms:.1}ms")
    } else if ms < 99_995.0 {
        format!("{:.2}s", ms / 1000.0)
    } else {
        format!("{:.1}s", ms / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_of_a_second_or_more_are_shown_in_seconds() {
        assert_eq!(latency(0.0), "0.0ms");
        assert_eq!(latency(18.34), "18.3ms");
        assert_eq!(latency(999.94), "999.9ms");
        // What would round to 1000.0ms is a second.
        assert_eq!(latency(999.96), "1.00s");
        assert_eq!(latency(3034.8), "3.03s");
        assert_eq!(latency(99_994.0), "99.99s");
        assert_eq!(latency(99_996.0), "100.0s");
        assert_eq!(latency(5_400_000.0), "5400.0s");
    }

    #[test]
    fn thousands_are_separated_by_commas() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }
}
