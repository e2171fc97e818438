//! `/metrics` in Prometheus' text format 0.0.4, for scrapers that do not ask for OpenMetrics.
//!
//! The figures are encoded by prometheus-client, which writes OpenMetrics text only (0.26 has
//! no 0.0.4 encoder, and the `prometheus` crate's encoder reads its own registry, not this
//! one). Prometheus itself asks for OpenMetrics, and gets it; anything else that scrapes (curl,
//! older agents, collectors that parse 0.0.4 only) gets the format SPEC §4 names. So this file
//! rewrites the encoder's output by the documented differences between the two formats, which
//! are few and mechanical, instead of keeping a second encoder:
//! - a counter family `foo` is `foo_total` in its `# HELP` and `# TYPE` lines (its samples are
//!   already `foo_total`), and its `foo_created` samples are dropped;
//! - `unknown` is `untyped`; an `info` family `foo` is a gauge `foo_info`; `stateset` and
//!   `gaugehistogram` are `untyped`;
//! - `# UNIT` lines, exemplars (`… # {labels} value`) and the closing `# EOF` are dropped;
//! - a `# HELP` text keeps OpenMetrics' `\\` and `\n` escapes, and an escaped `\"` becomes `"`
//!   (0.0.4 escapes no quote there).
//!
//! Label values are escaped the same way in both formats, so samples pass unchanged.

use axum::http::HeaderValue;

/// The `Content-Type` of `/metrics` in the 0.0.4 text format.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a request with this `Accept` header gets OpenMetrics: when it lists
/// `application/openmetrics-text` with a quality above 0 and at least that of any `text/plain`
/// it lists. No header, `*/*`, or `text/plain` get the 0.0.4 text format.
pub fn wants_openmetrics(accept: Option<&HeaderValue>) -> bool {
    let Some(accept) = accept.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let (mut openmetrics, mut text) = (None::<f32>, None::<f32>);
    for range in accept.split(',') {
        let mut params = range.split(';').map(str::trim);
        let media = params.next().unwrap_or_default().to_ascii_lowercase();
        let quality = params
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(1.0, |(_, q)| q.trim().parse::<f32>().unwrap_or(0.0));
        let best = match media.as_str() {
            "application/openmetrics-text" => &mut openmetrics,
            "text/plain" => &mut text,
            _ => continue,
        };
        *best = Some(best.map_or(quality, |q| q.max(quality)));
    }
    match openmetrics {
        Some(q) if q > 0.0 => text.is_none_or(|t| q >= t),
        _ => false,
    }
}

/// What an OpenMetrics `# TYPE` is in the 0.0.4 format: the family's name there and its type.
fn family_0_0_4<'a>(name: &'a str, kind: &'a str) -> (String, &'a str) {
    match kind {
        "counter" => (format!("{name}_total"), "counter"),
        "info" => (format!("{name}_info"), "gauge"),
        "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
        _ => (name.to_owned(), "untyped"),
    }
}

/// `openmetrics` (prometheus-client's output) in the 0.0.4 text format; see the module docs.
pub fn from_openmetrics(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // prometheus-client writes `# HELP` before `# TYPE`: the help waits for the type, which
    // decides the name it is written under.
    let mut help: Option<(&str, &str)> = None;
    // The family being read and its OpenMetrics type.
    let mut family: Option<(&str, &str)> = None;
    let write_help = |out: &mut String, name: &str, text: &str| {
        out.push_str("# HELP ");
        out.push_str(name);
        out.push(' ');
        out.push_str(&text.replace("\\\"", "\""));
        out.push('\n');
    };
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            if let Some((name, text)) = help.take() {
                write_help(&mut out, name, text);
            }
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (renamed, kind_0_0_4) = family_0_0_4(name, kind);
            match help.take() {
                Some((help_name, text)) if help_name == name => {
                    write_help(&mut out, &renamed, text);
                }
                Some((help_name, text)) => write_help(&mut out, help_name, text),
                None => {}
            }
            out.push_str("# TYPE ");
            out.push_str(&renamed);
            out.push(' ');
            out.push_str(kind_0_0_4);
            out.push('\n');
            family = Some((name, kind));
            continue;
        }
        if line.starts_with("# UNIT ") {
            continue;
        }
        if let Some((name, text)) = help.take() {
            write_help(&mut out, name, text);
        }
        if line.starts_with('#') || line.is_empty() {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if let Some((name, kind)) = family
            && matches!(kind, "counter" | "histogram" | "summary")
            && line
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix("_created"))
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        {
            continue;
        }
        out.push_str(without_exemplar(line));
        out.push('\n');
    }
    if let Some((name, text)) = help {
        write_help(&mut out, name, text);
    }
    out
}

/// A sample line without its exemplar (` # {…} value`), which 0.0.4 has no place for. The
/// `#` of an exemplar comes after the labels, whose values may hold a `#` themselves, so the
/// search starts after the closing `}` of the labels (if any).
fn without_exemplar(line: &str) -> &str {
    let after_labels = match line.find('{') {
        Some(open) => closing_brace(line, open).map_or(line.len(), |close| close + 1),
        None => 0,
    };
    match line[after_labels..].find(" # ") {
        Some(at) => &line[..after_labels + at],
        None => line,
    }
}

/// The index of the `}` closing the label set opened at `open`, skipping quoted values (with
/// their `\"` escapes).
fn closing_brace(line: &str, open: usize) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in line.char_indices().skip_while(|(i, _)| *i <= open) {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => quoted = false,
            (false, _, '"') => quoted = true,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_with_total_and_the_openmetrics_only_lines_go() {
        let openmetrics = "\
# HELP requests Requests \\\"served\\\".
# TYPE requests counter
# UNIT requests requests
requests_total{path=\"/a # b\",x=\"q\\\"}\"} 3 # {trace=\"1\"} 1.0
requests_created{path=\"/a\"} 1.7e9
requests_created_total_not{a=\"b\"} 1
# HELP up Whether it is up.
# TYPE up gauge
up 1
# HELP build Build information.
# TYPE build info
build_info{version=\"1.2\"} 1
# HELP odd Something.
# TYPE odd unknown
odd 2
# EOF
";
        let text = from_openmetrics(openmetrics);
        assert_eq!(
            text,
            "\
# HELP requests_total Requests \"served\".
# TYPE requests_total counter
requests_total{path=\"/a # b\",x=\"q\\\"}\"} 3
requests_created_total_not{a=\"b\"} 1
# HELP up Whether it is up.
# TYPE up gauge
up 1
# HELP build_info Build information.
# TYPE build_info gauge
build_info{version=\"1.2\"} 1
# HELP odd Something.
# TYPE odd untyped
odd 2
"
        );
    }

    #[test]
    fn the_accept_header_chooses_the_format() {
        let wants = |accept: Option<&str>| {
            wants_openmetrics(accept.map(|a| HeaderValue::from_str(a).unwrap()).as_ref())
        };
        assert!(!wants(None));
        assert!(!wants(Some("*/*")));
        assert!(!wants(Some("text/plain")));
        assert!(!wants(Some("text/plain;version=0.0.4")));
        assert!(wants(Some("application/openmetrics-text")));
        // What Prometheus 2.x sends.
        assert!(wants(Some(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        )));
        assert!(!wants(Some(
            "text/plain;version=0.0.4;q=0.9, application/openmetrics-text;q=0.5"
        )));
        assert!(!wants(Some("application/openmetrics-text;q=0")));
        assert!(wants(Some(
            "Application/OpenMetrics-Text; q=0.3, */*;q=0.1"
        )));
    }
}
