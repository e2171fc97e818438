//! A [`PolicyDocument`] written back as a policy file (SPEC §1).
//!
//! Hand-written on purpose: we need a stable, minimal, comment-free rendering of our own
//! schema — only the fields each layer sets, durations with their units, the layers in the
//! order the file format uses — and a generic serializer would emit every unset `Option` as
//! `null` (which the parser rightly refuses) and reorder or reformat at will. The control plane
//! uses it to show a stored version (`Get`) and the CLI to print documents that came from the
//! API; [`crate::diff`] uses the same value rendering for its detail lines.
//!
//! Guarantee (tested): loading `to_yaml(doc)` gives back a document equal in value to `doc`
//! ([`crate::diff::same_content`]), for every document whose values a file can hold.

use std::fmt::Write as _;
use std::time::Duration;

use crate::document::{EndpointDoc, Field, Overlay, PolicyDocument, RouteMatch};
use crate::duration::format_duration;

/// Renders `doc` as policy-file YAML: `version: 1`, then `defaults:` (when it sets anything),
/// then `endpoints:` in document order, each layer with only the fields it sets.
///
/// In block style, one field a line; or, when that is over the size a policy file may be
/// ([`crate::yaml::MAX_FILE_BYTES`]), each endpoint on one line in flow style
/// (`payments: {max_attempts: 4, backoff: {base: 50ms}}`), as a generator writes a large
/// file, so that such a file renders within the limit again (block style adds about a fifth),
/// as does one written with one space of indent or as JSON on one line. A document can still
/// render over the limit: one a file wrote with aliases, or one sent through the API. Check
/// the length.
pub fn to_yaml(doc: &PolicyDocument) -> String {
    let block = to_yaml_block(doc);
    if block.len() <= crate::yaml::MAX_FILE_BYTES {
        return block;
    }
    let compact = to_yaml_compact(doc);
    if compact.len() < block.len() {
        compact
    } else {
        block
    }
}

/// `version: 1`, the defaults in block style, then `endpoints:` with each endpoint written by
/// `endpoint` (or `endpoints: {}`): what both renderings share.
fn rendered(doc: &PolicyDocument, mut endpoint: impl FnMut(&mut String, &EndpointDoc)) -> String {
    let mut out = String::from("version: 1\n");
    if !leaf_values(&doc.defaults).is_empty() {
        out.push_str("defaults:\n");
        overlay(&mut out, &doc.defaults, 2);
    }
    if doc.endpoints.is_empty() {
        out.push_str("endpoints: {}\n");
        return out;
    }
    out.push_str("endpoints:\n");
    for ep in &doc.endpoints {
        endpoint(&mut out, ep);
    }
    out
}

/// [`to_yaml`] in block style throughout.
fn to_yaml_block(doc: &PolicyDocument) -> String {
    rendered(doc, |out, ep| {
        let name = scalar(&ep.name.value);
        if leaf_values(&ep.overlay).is_empty() && ep.routes.is_empty() {
            let _ = writeln!(out, "  {name}: {{}}");
            return;
        }
        let _ = writeln!(out, "  {name}:");
        overlay(out, &ep.overlay, 4);
        if !ep.routes.is_empty() {
            out.push_str("    routes:\n");
            for route in &ep.routes {
                let _ = writeln!(out, "      - match: {}", route_match(&route.matcher.value));
                overlay(out, &route.overlay, 8);
            }
        }
    })
}

/// [`to_yaml`] with each endpoint (its fields and routes) on one line in flow style, as tight
/// as YAML reads it (one space of indent, no space after a comma), so that it is no longer than
/// a file written so, or as JSON on one line; the defaults stay in block style (one layer).
fn to_yaml_compact(doc: &PolicyDocument) -> String {
    rendered(doc, |out, ep| {
        let mut items = flow_fields(&ep.overlay);
        if !ep.routes.is_empty() {
            let routes: Vec<String> = ep
                .routes
                .iter()
                .map(|route| {
                    let mut route_items =
                        vec![format!("match: {}", route_match(&route.matcher.value))];
                    route_items.extend(flow_fields(&route.overlay));
                    format!("{{{}}}", route_items.join(","))
                })
                .collect();
            items.push(format!("routes: [{}]", routes.join(",")));
        }
        let _ = writeln!(out, " {}: {{{}}}", scalar(&ep.name.value), items.join(","));
    })
}

/// The fields `o` sets as the items of a flow mapping (`max_attempts: 4`,
/// `backoff: {base: 50ms,max: 1s}`), sections grouped as in block style. Every value
/// [`leaf_values`] gives is a flow-safe scalar or list: [`scalar`] leaves plain only
/// `[A-Za-z0-9_./-]`.
fn flow_fields(o: &Overlay) -> Vec<String> {
    let mut items: Vec<String> = Vec::new();
    let mut section: Option<(&str, Vec<String>)> = None;
    for (path, value) in leaf_values(o) {
        match path.split_once('.') {
            Some((sect, key)) => match &mut section {
                Some((open, keys)) if *open == sect => keys.push(format!("{key}: {value}")),
                _ => {
                    if let Some((open, keys)) = section.take() {
                        items.push(format!("{open}: {{{}}}", keys.join(",")));
                    }
                    section = Some((sect, vec![format!("{key}: {value}")]));
                }
            },
            None => {
                if let Some((open, keys)) = section.take() {
                    items.push(format!("{open}: {{{}}}", keys.join(",")));
                }
                items.push(format!("{path}: {value}"));
            }
        }
    }
    if let Some((open, keys)) = section {
        items.push(format!("{open}: {{{}}}", keys.join(",")));
    }
    items
}

/// Every leaf field `overlay` sets, as `(path, value)` with the value in policy-file syntax
/// (`250ms`, `[429, 503]`, `"on"`), in [`crate::document::FIELD_PATHS`] order — the same
/// paths as [`Overlay::set_fields`].
pub fn leaf_values(o: &Overlay) -> Vec<(&'static str, String)> {
    let (b, r, ra, bu, cb) = (
        &o.backoff,
        &o.retry_on,
        &o.retry_after,
        &o.budget,
        &o.circuit_breaker,
    );
    let candidates: [(&'static str, Option<String>); 25] = [
        ("max_attempts", show(&o.max_attempts, u32::to_string)),
        ("backoff.base", show(&b.base, dur)),
        ("backoff.max", show(&b.max, dur)),
        ("backoff.multiplier", show(&b.multiplier, float)),
        ("backoff.jitter", show(&b.jitter, |j| j.as_str().to_owned())),
        ("deadline", show(&o.deadline, dur)),
        ("per_try_timeout", show(&o.per_try_timeout, dur)),
        (
            "retry_on.http_status",
            show_list(&r.http_status, u16::to_string),
        ),
        (
            "retry_on.grpc_status",
            show_list(&r.grpc_status, |c| c.name().to_owned()),
        ),
        (
            "retry_on.errors",
            show_list(&r.errors, |e| e.as_str().to_owned()),
        ),
        (
            "idempotent_methods",
            show_list(&o.idempotent_methods, |m| scalar(m)),
        ),
        (
            "idempotency_key_header",
            show(&o.idempotency_key_header, |h| scalar(h)),
        ),
        ("retry_after.honor", show(&ra.honor, bool::to_string)),
        ("retry_after.max", show(&ra.max, dur)),
        ("budget.enabled", show(&bu.enabled, bool::to_string)),
        ("budget.ratio", show(&bu.ratio, float)),
        (
            "budget.min_per_second",
            show(&bu.min_per_second, u32::to_string),
        ),
        ("budget.window", show(&bu.window, dur)),
        (
            "circuit_breaker.enabled",
            show(&cb.enabled, bool::to_string),
        ),
        (
            "circuit_breaker.failure_ratio",
            show(&cb.failure_ratio, float),
        ),
        (
            "circuit_breaker.min_requests",
            show(&cb.min_requests, u32::to_string),
        ),
        ("circuit_breaker.window", show(&cb.window, dur)),
        ("circuit_breaker.open_for", show(&cb.open_for, dur)),
        (
            "circuit_breaker.half_open_probes",
            show(&cb.half_open_probes, u32::to_string),
        ),
        ("alert.retry_ratio", show(&o.alert.retry_ratio, float)),
    ];
    candidates
        .into_iter()
        .filter_map(|(path, value)| value.map(|v| (path, v)))
        .collect()
}

/// A route match as the flow mapping a file writes after `match:`
/// (`{method: POST, path_prefix: /v1/charges}`, `{grpc: "/pkg.Svc/*"}`).
pub fn route_match(m: &RouteMatch) -> String {
    match m {
        RouteMatch::Http {
            method: Some(method),
            path_prefix,
        } => format!(
            "{{method: {}, path_prefix: {}}}",
            scalar(method),
            scalar(path_prefix)
        ),
        RouteMatch::Http {
            method: None,
            path_prefix,
        } => format!("{{path_prefix: {}}}", scalar(path_prefix)),
        RouteMatch::Grpc { .. } => format!("{{grpc: {}}}", scalar(&m.to_string())),
    }
}

/// A string as a YAML scalar that reads back as that same string: plain when it is made of
/// `[A-Za-z0-9_./-]` and YAML would not take it for something else, double-quoted otherwise.
///
/// Quoted: anything with other characters (`:`, `*`, spaces, …), the empty string, YAML
/// keywords in any case (`true`, `no`, `on`, `null`, `~`, …), and anything that looks like a
/// number (starts with a digit, a sign or a dot, or parses as one: `123`, `1.5`, `inf`).
pub fn scalar(s: &str) -> String {
    const KEYWORDS: [&str; 12] = [
        "true", "false", "null", "yes", "no", "on", "off", "y", "n", "~", "nan", "inf",
    ];
    let plain_chars = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./-".contains(&b));
    let keyword = KEYWORDS.iter().any(|k| k.eq_ignore_ascii_case(s));
    let numeric = s.starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c))
        || s.parse::<f64>().is_ok();
    if plain_chars && !keyword && !numeric {
        s.to_owned()
    } else {
        quoted(s)
    }
}

/// `s` in double quotes, with `"`, `\` and every character YAML does not allow raw escaped.
fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if printable(c) => out.push(c),
            c if u32::from(c) <= 0xFF => {
                let _ = write!(out, "\\x{:02X}", u32::from(c));
            }
            c if u32::from(c) <= 0xFFFF => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => {
                let _ = write!(out, "\\U{:08X}", u32::from(c));
            }
        }
    }
    out.push('"');
    out
}

/// YAML's printable set, less the characters some readers take as line breaks or a BOM.
fn printable(c: char) -> bool {
    matches!(u32::from(c), 0x20..=0x7E | 0xA0..=0xD7FF | 0xE000..=0xFFFD | 0x1_0000..)
        && !matches!(c, '\u{2028}' | '\u{2029}' | '\u{FEFF}')
}

fn overlay(out: &mut String, o: &Overlay, indent: usize) {
    let pad = " ".repeat(indent);
    let mut section = "";
    for (path, value) in leaf_values(o) {
        match path.split_once('.') {
            Some((sect, key)) => {
                if sect != section {
                    let _ = writeln!(out, "{pad}{sect}:");
                    section = sect;
                }
                let _ = writeln!(out, "{pad}  {key}: {value}");
            }
            None => {
                section = "";
                let _ = writeln!(out, "{pad}{path}: {value}");
            }
        }
    }
}

fn show<T>(field: &Option<Field<T>>, f: impl Fn(&T) -> String) -> Option<String> {
    field.as_ref().map(|x| f(&x.value))
}

fn show_list<T>(field: &Option<Field<Vec<Field<T>>>>, f: impl Fn(&T) -> String) -> Option<String> {
    field.as_ref().map(|list| {
        let items: Vec<String> = list.value.iter().map(|i| f(&i.value)).collect();
        format!("[{}]", items.join(", "))
    })
}

fn dur(d: &Duration) -> String {
    format_duration(*d)
}

/// The shortest text that reads back as the same number, with a `.0` on whole numbers
/// (`2.0`, `0.25`) and, in exponent form, a dot in the mantissa and a sign on the exponent
/// (`1.0e-7`, `1.5e+20`: YAML 1.1 readers, such as Python's, take `1e-7` for a string);
/// `.nan` and `±.inf` for the values no valid policy holds. `-0.0` (only a document built in
/// code can hold it) is `0.0`, as a file reads it: a diff shows no change where the content
/// and its hash have none.
pub fn float(v: &f64) -> String {
    if v.is_nan() {
        ".nan".to_owned()
    } else if v.is_infinite() {
        if *v > 0.0 { ".inf" } else { "-.inf" }.to_owned()
    } else {
        let text = format!("{:?}", crate::model::unsigned_zero(*v));
        match text.split_once('e') {
            None => text,
            Some((mantissa, exponent)) => {
                let dot = if mantissa.contains('.') { "" } else { ".0" };
                let sign = if exponent.starts_with('-') { "" } else { "+" };
                format!("{mantissa}{dot}e{sign}{exponent}")
            }
        }
    }
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
