//! Located YAML tree → [`PolicyDocument`]: shapes, types, names and units.
//!
//! This pass checks what the tree looks like (known fields, value types, durations with units,
//! status codes, gRPC code and jitter names, duplicate keys) and keeps going after a problem, so
//! one run reports every problem in the file. Range and cross-field checks run afterwards on the
//! document ([`crate::validate`]), the same checks the admin API and the agent use.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ops::Range;
use std::time::Duration;

use crate::codes::{self, GrpcCode};
use crate::diag::{Diagnostic, did_you_mean, near_typo, suggest_field};
use crate::document::{
    AlertOverlay, BackoffOverlay, BreakerOverlay, BudgetOverlay, EndpointDoc, FIELD_PATHS, Field,
    Overlay, PolicyDocument, RetryAfterOverlay, RetryOnOverlay, RouteDoc, RouteMatch,
};
use crate::duration::parse_duration;
use crate::model::{ErrorClass, Jitter};
use crate::yaml::{Loc, Node, Value};
use crate::yaml_scan::{in_decimal, whole_number_not_in_decimal};

const TOP_FIELDS: [&str; 3] = ["version", "defaults", "endpoints"];
/// Fields of every layer; `defaults:` and endpoints also take [`ENDPOINT_FIELDS`].
const POLICY_FIELDS: [&str; 10] = [
    "max_attempts",
    "backoff",
    "deadline",
    "per_try_timeout",
    "retry_on",
    "idempotent_methods",
    "idempotency_key_header",
    "retry_after",
    "budget",
    "circuit_breaker",
];
/// Fields of `defaults:` and endpoints only: the control plane evaluates them per endpoint.
const ENDPOINT_FIELDS: [&str; 1] = ["alert"];
/// Why a route cannot set `alert`.
pub const ROUTE_ALERT: &str = "alert is set per endpoint, not per route: the control plane compares the retries / calls of the whole endpoint; set it on the endpoint or in `defaults:`";
const ALERT_FIELDS: [&str; 1] = ["retry_ratio"];
const BACKOFF_FIELDS: [&str; 4] = ["base", "max", "multiplier", "jitter"];
const RETRY_ON_FIELDS: [&str; 3] = ["http_status", "grpc_status", "errors"];
const RETRY_AFTER_FIELDS: [&str; 2] = ["honor", "max"];
const BUDGET_FIELDS: [&str; 4] = ["enabled", "ratio", "min_per_second", "window"];
const BREAKER_FIELDS: [&str; 6] = [
    "enabled",
    "failure_ratio",
    "min_requests",
    "window",
    "open_for",
    "half_open_probes",
];
const MATCH_FIELDS: [&str; 3] = ["method", "path_prefix", "grpc"];
/// The sections of a policy and their fields: a field written outside its section is told
/// which section takes it.
const SECTIONS: [(&str, &[&str]); 7] = [
    ("backoff", &BACKOFF_FIELDS),
    ("retry_on", &RETRY_ON_FIELDS),
    ("retry_after", &RETRY_AFTER_FIELDS),
    ("budget", &BUDGET_FIELDS),
    ("circuit_breaker", &BREAKER_FIELDS),
    ("alert", &ALERT_FIELDS),
    ("match", &MATCH_FIELDS),
];

/// What else an unknown field inside a route's `match:` may be guessed as: a setting of the
/// route, which [`in_match`] then says where to write.
const MATCH_ELSEWHERE: [&[&str]; 2] = [&POLICY_FIELDS, &ENDPOINT_FIELDS];

/// The fields of a route's sections, which an unknown field inside its `match:` is guessed as
/// only when it is a near typo of a long one ([`near_typo`]): `grpc_statuses` is `retry_on`'s
/// `grpc_status`, not the `grpc` it starts. Short ones (`base`, `max`) and guesses by words
/// would offer a section's field for names that have nothing to do with it (`min`, `base_path`).
const MATCH_TYPOS: [&[&str]; 6] = [
    &BACKOFF_FIELDS,
    &RETRY_ON_FIELDS,
    &RETRY_AFTER_FIELDS,
    &BUDGET_FIELDS,
    &BREAKER_FIELDS,
    &ALERT_FIELDS,
];

/// What [`Walker::type_error`] is told a number field expects.
const NUMBER_KINDS: [&str; 3] = ["a whole number", "a number", "an HTTP status code"];

/// What to say of the string `s` (quoted, or tagged `!!str`) where `expected` goes: when it is
/// one of [`NUMBER_KINDS`], how to write the number `s` holds so that the field takes it;
/// nothing elsewhere, or when written plainly it would not be taken either (`"3.5"` for a whole
/// number, which the check after the fix would refuse all the same).
fn quoted_number_hint(s: &str, expected: &str) -> Option<String> {
    const PLAINLY: &str = " (a string: write the number without quotes or `!!str`)";
    if !NUMBER_KINDS.contains(&expected) {
        return None;
    }
    let t = s.trim();
    if expected == "a number" {
        // Not `"1e999"`, which written plainly is refused as not finite.
        let finite = t.parse::<f64>().is_ok_and(f64::is_finite);
        return (is_yaml_float(t) && finite).then(|| PLAINLY.to_owned());
    }
    // A whole number: as the reader takes it, or in another form that holds one (`"007"`,
    // `"3.0"`, `"3e0"`, which written plainly would read as floats and be refused too).
    if is_decimal_integer(t) {
        return Some(PLAINLY.to_owned());
    }
    let f: f64 = t.parse().ok()?;
    (is_yaml_float(t) && f.fract() == 0.0 && f.abs() < 1e15).then(|| {
        format!(
            " (a string: write `{}` without quotes or `!!str`)",
            f as i64
        )
    })
}

/// Whether `s` is a whole number as the reader takes one: decimal digits, no leading zero, an
/// optional `-`.
fn is_decimal_integer(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
}

/// Whether `s` is a float of YAML 1.2's core schema (`0.5`, `.5`, `5.`, `1e-2`, `-3`, `+1.5`),
/// which the reader takes as a number written plainly. (`.inf` and `.nan` are left out: no
/// field takes them.)
fn is_yaml_float(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(at) => (&s[..at], Some(&s[at + 1..])),
        None => (s, None),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok =
        digits(whole) && digits(fraction) && !(whole.is_empty() && fraction.is_empty());
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !e.is_empty() && digits(e)
    });
    mantissa_ok && exponent_ok
}

/// Whether `name` is a field of a policy layer (`defaults:` or an endpoint).
fn is_policy_field(name: &str) -> bool {
    POLICY_FIELDS.contains(&name) || ENDPOINT_FIELDS.contains(&name)
}

/// No field belongs elsewhere: every unknown one is offered the nearest known one.
fn no_hint(_: &str) -> Option<String> {
    None
}

/// ` (a field of `backoff` or `retry_after`: write it under one of them)`, when `path` is a
/// policy (`defaults`, an endpoint or a route) and `name` a field of its sections; nothing
/// otherwise. A field written a level too high is told where it goes, rather than offered a
/// field it happens to start (`max` is not `max_attempts`). Inside a section, the usual
/// suggestion applies (`grpc` in `retry_on` is `grpc_status`, not `match.grpc`).
fn section_of(name: &str, path: &str) -> Option<String> {
    let here = path.rsplit('.').next().unwrap_or(path);
    if SECTIONS.iter().any(|(section, _)| *section == here) {
        return None;
    }
    // Only a route has a `match`.
    let route = path.ends_with(']');
    let sections: Vec<String> = SECTIONS
        .iter()
        .filter(|(section, fields)| (route || *section != "match") && fields.contains(&name))
        .map(|(section, _)| format!("`{section}`"))
        .collect();
    match sections.as_slice() {
        [] => None,
        [one] => Some(format!(" (a field of {one}: write it under it)")),
        [rest @ .., last] => Some(format!(
            " (a field of {} or {last}: write it under one of them)",
            rest.join(", ")
        )),
    }
}

/// For a route's setting, or a field of one of its sections, written inside its `match:`: what
/// it is and where it goes instead, as far as a route can set it. Asked before a field of
/// `match` is guessed, so that `grpc_status` is told it belongs to `retry_on` rather than
/// offered `grpc`, which it merely starts.
fn in_match(f: &str) -> Option<String> {
    const BESIDE: &str = "beside `match:`, at the same indentation";
    const SHARED: [&str; 2] = ["budget", "circuit_breaker"];
    match f {
        "budget" | "circuit_breaker" => {
            return Some(format!(
                "`{f}` is not part of what a route matches; it is per endpoint, shared by its routes, and a route can only turn it off: write `{f}: {{enabled: false}}` {BESIDE}"
            ));
        }
        "alert" => {
            return Some(format!(
                "`alert` is not part of what a route matches; {ROUTE_ALERT}"
            ));
        }
        f if POLICY_FIELDS.contains(&f) => {
            return Some(format!(
                "`{f}` is a setting of the route, not part of what it matches: write it {BESIDE}"
            ));
        }
        _ => {}
    }
    let sections: Vec<&str> = SECTIONS
        .iter()
        .filter(|(section, fields)| *section != "match" && fields.contains(&f))
        .map(|(section, _)| *section)
        .collect();
    // `budget`, `budget or circuit_breaker`, …, each name followed by `suffix`.
    let listed = |suffix: &str, and_or: &str| -> String {
        let names: Vec<String> = sections.iter().map(|s| format!("`{s}{suffix}`")).collect();
        match names.as_slice() {
            [rest @ .., last] if !rest.is_empty() => {
                format!("{} {and_or} {last}", rest.join(", "))
            }
            _ => names.concat(),
        }
    };
    let one = sections.len() == 1;
    let of = format!("`{f}` is a field of {}", listed("", "or"));
    let under = format!(
        "under {}{}, {BESIDE}",
        if one { "" } else { "one of " },
        listed(":", "or")
    );
    match sections.as_slice() {
        [] => None,
        ["alert"] => Some(format!(
            "{of}, not part of what a route matches; {ROUTE_ALERT}"
        )),
        s if s.iter().all(|s| SHARED.contains(s)) => Some(format!(
            "{of}, not part of what a route matches; {} per endpoint, shared by its routes, and a route can only turn {} off: write `enabled: false` {under}",
            if one {
                format!("{} is", listed("", "and"))
            } else {
                format!("{} are", listed("", "and"))
            },
            if one { "it" } else { "them" },
        )),
        _ => Some(format!(
            "{of}, a setting of the route, not part of what it matches: write it {under}"
        )),
    }
}

/// Walks a tree, collecting diagnostics.
struct Walker {
    diags: Vec<Diagnostic>,
    /// The diagnostics (by index into `diags`) of layers left out of the document.
    detached: Vec<Range<usize>>,
    /// Unknown keys given a "did you mean" guess so far (see [`MAX_GUESSES`]).
    guesses: usize,
}

/// How many unknown keys of a file get a "did you mean" guess: twice the problems a file's
/// report shows. Each costs tens of microseconds (an edit distance to every field name), so a
/// 1 MiB file of 65,000 misspelt fields took 1.6–2.9 s; past this many, the rest are reported
/// without one.
const MAX_GUESSES: usize = 2 * crate::diag::MAX_LISTED;

/// The longest unknown key a guess is made for: every field name is far shorter, and a long key
/// (one anchored and repeated as a key by aliases, say) was split into words per copy.
const MAX_GUESSED_KEY: usize = 64;

/// The field path of the file's top level.
const ROOT: &str = "<root>";

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// Converts a located tree to a document; problems go to `diags`. Returns `None` when the
/// tree is not a mapping at all.
pub fn document(root: &Node, diags: &mut Vec<Diagnostic>) -> Option<PolicyDocument> {
    document_and_detached(root, diags).map(|(doc, _)| doc)
}

/// [`document`], and the diagnostics it added that are about layers it left out of the
/// document (a second endpoint of a name already used, a route whose `match` was refused), as
/// ranges of indices into `diags`: their paths may be those of a layer the document keeps (a
/// duplicate endpoint's are the first one's), but they say nothing about its values.
pub(crate) fn document_and_detached(
    root: &Node,
    diags: &mut Vec<Diagnostic>,
) -> Option<(PolicyDocument, Vec<Range<usize>>)> {
    let mut w = Walker {
        diags: std::mem::take(diags),
        detached: Vec::new(),
        guesses: 0,
    };
    let doc = w.top(root);
    *diags = w.diags;
    doc.map(|doc| (doc, w.detached))
}

impl Walker {
    /// A problem at `path`; the top level of the file (an empty path) is called `<root>`, so
    /// every diagnostic names a place.
    fn error(&mut self, loc: Loc, path: &str, message: impl Into<String>) {
        let path = if path.is_empty() { ROOT } else { path };
        self.diags.push(Diagnostic::error(loc, path, message));
    }

    fn type_error(&mut self, node: &Node, path: &str, expected: &str) {
        // A whole number not in decimal digits (`0x1F7`, `+3`) is read as its text (see
        // `yaml::as_written`): say what it is and how to write it, rather than "a string".
        // A note of more than 256 bytes is cut, with `…` after it: no digits are offered for it.
        if let Value::Str(s) = &node.value
            && whole_number_not_in_decimal(s.strip_suffix('…').unwrap_or(s))
        {
            // How to write it only where a number goes; elsewhere, what it is.
            let message = if NUMBER_KINDS.contains(&expected) {
                let write = in_decimal(s).map_or_else(String::new, |d| format!(" (write `{d}`)"));
                format!(
                    "expected {expected}, found `{s}`: whole numbers are written in decimal \
                     digits, with no `+`, `0x`, `0o` or `0b`{write}"
                )
            } else {
                // Not "the number": the text may have been quoted.
                format!("expected {expected}, found `{s}`")
            };
            self.error(node.loc, path, message);
            return;
        }
        let hint = match &node.value {
            // `"3"` where a number goes: the number, quoted (a plain `3` reads as a number).
            Value::Str(s) if let Some(hint) = quoted_number_hint(s, expected) => hint,
            // A YAML 1.1 number (`1_000`) reads as a string in YAML 1.2: say how to write it.
            Value::Str(s) if is_underscored_number(s) => {
                format!(" (`{s}`: a number is written without `_` in YAML 1.2)")
            }
            // A list without its brackets (`503,504`).
            Value::Str(s) if expected.starts_with("a list") && s.contains(',') => {
                let items: Vec<&str> = s.split(',').map(str::trim).collect();
                format!(
                    " (`{s}`: a list is written in brackets, `[{}]`)",
                    items.join(", ")
                )
            }
            // A decimal comma (`0,2`), or a thousands separator (`1,000`).
            Value::Str(s) if is_comma_number(s) => match expected {
                "a number" => format!(
                    " (`{s}`: a decimal is written with a dot, `{}`)",
                    s.replacen(',', ".", 1)
                ),
                _ => format!(" (`{s}`: a number is written without `,`)"),
            },
            // A whole number the YAML reader took for a float (`0503`, `503.0`, `5.03e2`).
            Value::Float(f)
                if expected == "an HTTP status code"
                    && f.is_finite()
                    && f.fract() == 0.0
                    && (0.0..1e6).contains(f) =>
            {
                format!(
                    " (write it as `{}`: digits only, no leading zero, dot or exponent)",
                    *f as u32
                )
            }
            _ => String::new(),
        };
        self.error(
            node.loc,
            path,
            format!("expected {expected}, found {}{hint}", node.value.kind()),
        );
    }

    /// The entries of a mapping whose keys are in `known`, first occurrence of each; reports
    /// non-string keys, duplicates and unknown keys (with a suggestion). `misplaced` gives, for
    /// an unknown name that belongs elsewhere, the message to give instead (asked only for
    /// unknown names, so nothing is built for a file without them). Linear in the number of keys.
    fn fields<'n>(
        &mut self,
        node: &'n Node,
        path: &str,
        known: &[&str],
        misplaced: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<(&'n str, &'n Node, Loc)> {
        self.fields_guessing(node, path, known, &[], &[], misplaced)
    }

    /// [`Walker::fields`], where an unknown name may also be guessed as one of `elsewhere`
    /// (names that are not keys of this mapping), unless it is a [`near_typo`] of one of `typos`
    /// first; such a guess is followed by what `misplaced` says of it, if anything (where to
    /// write it instead). A dotted name made of a section here and one of its fields is told to
    /// nest.
    fn fields_guessing<'n>(
        &mut self,
        node: &'n Node,
        path: &str,
        known: &[&str],
        elsewhere: &[&[&str]],
        typos: &[&[&str]],
        misplaced: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<(&'n str, &'n Node, Loc)> {
        let Value::Map(entries) = &node.value else {
            if node.value != Value::Null {
                self.type_error(node, path, "a mapping");
            }
            return Vec::new();
        };
        let mut out: Vec<(&'n str, &'n Node, Loc)> = Vec::new();
        // Every key seen (unknown ones too, so a second copy is still called a duplicate), with
        // its first place. SipHash with a random key: the file may come from anyone.
        let mut seen: HashMap<&'n str, Loc> = HashMap::new();
        let mut previous: Option<&Node> = None;
        for (key, value) in entries {
            let after = previous.replace(value);
            let Value::Str(name) = &key.value else {
                // `{ratio: 0,2}`: the comma ended the entry `ratio: 0`, and `2` became a key
                // with no value; `{http_status: 503, 504}`: a list without its brackets.
                let hint = match (&key.value, &value.value, after) {
                    (Value::Int(k), Value::Null, Some(v))
                        if v.loc.line == key.loc.line
                            && matches!(v.value, Value::Int(_) | Value::Float(_)) =>
                    {
                        flow_comma_hint(v, key, *k)
                    }
                    _ => String::new(),
                };
                self.error(
                    key.loc,
                    path,
                    format!("keys must be strings, found {}{hint}", key.value.kind()),
                );
                continue;
            };
            let field_path = join(path, name);
            match seen.entry(name.as_str()) {
                Entry::Occupied(first) => {
                    let first = *first.get();
                    self.error(
                        key.loc,
                        &field_path,
                        format!("duplicate key `{name}` (first set at {first})"),
                    );
                    continue;
                }
                Entry::Vacant(slot) => {
                    slot.insert(key.loc);
                }
            }
            if !known.contains(&name.as_str()) {
                if let Some(why) = misplaced(name) {
                    self.error(key.loc, &field_path, why);
                } else if let Some((section, field)) = name.split_once('.')
                    && known.contains(&section)
                    && SECTIONS
                        .iter()
                        .any(|(s, fields)| *s == section && fields.contains(&field))
                {
                    // A flat `backoff.max: 1s`, as in a key=value file.
                    self.error(
                        key.loc,
                        &field_path,
                        format!(
                            "unknown field `{name}`: a key is not a path; write `{field}` under `{section}:` (`{section}: {{{field}: …}}`)"
                        ),
                    );
                } else {
                    let hint = section_of(name, path).unwrap_or_else(|| {
                        if self.guesses >= MAX_GUESSES || name.len() > MAX_GUESSED_KEY {
                            return String::new();
                        }
                        self.guesses += 1;
                        // A name is not offered as a guess for itself (`backoff.max` is among
                        // the guesses, as a path).
                        let candidates = known
                            .iter()
                            .chain(elsewhere.iter().copied().flatten())
                            .filter(|c| **c != name.as_str());
                        let guess = near_typo(name, typos.iter().copied().flatten().copied())
                            .or_else(|| suggest_field(name, candidates.copied()));
                        match guess {
                            None => String::new(),
                            Some(guess) => match misplaced(guess) {
                                Some(why) => format!(" (did you mean `{guess}`?): {why}"),
                                None => format!(" (did you mean `{guess}`?)"),
                            },
                        }
                    });
                    self.error(
                        key.loc,
                        &field_path,
                        format!("unknown field `{name}`{hint}"),
                    );
                }
                continue;
            }
            out.push((name.as_str(), value, key.loc));
        }
        out
    }

    fn top(&mut self, root: &Node) -> Option<PolicyDocument> {
        if !matches!(root.value, Value::Map(_)) {
            let found = if root.value == Value::Null {
                "an empty file".to_owned()
            } else {
                root.value.kind().to_owned()
            };
            self.error(
                root.loc,
                ROOT,
                format!(
                    "a policy file is a mapping with `version: 1` and `endpoints:`, found {found}"
                ),
            );
            return None;
        }
        let mut doc = PolicyDocument::default();
        let (mut version, mut endpoints) = (false, false);
        // A policy field at the top level belongs under `defaults:` (or an endpoint).
        let misplaced = |f: &str| {
            is_policy_field(f).then(|| {
                format!(
                    "a policy field goes under `defaults:` (for every endpoint) or under an endpoint, not at the top level (did you mean `defaults.{f}`?)"
                )
            })
        };
        for (key, value, _) in self.fields(root, "", &TOP_FIELDS, &misplaced) {
            match key {
                "version" => {
                    version = true;
                    if value.value != Value::Int(1) {
                        // `01`, `02` and `1.0` read as floats: say how to write a whole number.
                        let hint = match value.value {
                            Value::Float(f) if f.is_finite() && f.fract() == 0.0 => {
                                " (write it with no leading zero or decimal point)"
                            }
                            // `"1"`: the right number, quoted, reads as text.
                            Value::Str(ref s) if s.trim() == "1" => {
                                " (a quoted string: write the number without quotes)"
                            }
                            // `0x1`, `+1`: read as text (see `yaml::as_written`).
                            Value::Str(ref s) if whole_number_not_in_decimal(s) => {
                                " (write it in decimal digits)"
                            }
                            _ => "",
                        };
                        self.error(
                            value.loc,
                            "version",
                            format!(
                                "unsupported schema version: expected 1, found {}{hint}",
                                scalar_text(value)
                            ),
                        );
                    }
                }
                "defaults" => doc.defaults = self.overlay(value, "defaults", Layer::Defaults),
                "endpoints" => {
                    endpoints = true;
                    doc.endpoints = self.endpoints(value);
                }
                _ => {}
            }
        }
        self.second_blocks(root);
        self.misspelt_blocks(root);
        if !version {
            self.error(root.loc, "version", "missing `version: 1`");
        }
        if !endpoints {
            self.error(root.loc, "endpoints", "the file defines no `endpoints:`");
        }
        Some(doc)
    }

    /// A second (third…) `defaults:` or `endpoints:` of the file, which [`Walker::fields`]
    /// reports as a duplicate key and leaves out of the document: its own problems are reported
    /// too, as those of a second endpoint of one name are. They share the first's paths, so
    /// they are marked detached: the first's cross-field checks still run on the fields it sets.
    fn second_blocks(&mut self, root: &Node) {
        let Value::Map(entries) = &root.value else {
            return;
        };
        for block in ["defaults", "endpoints"] {
            let copies = entries
                .iter()
                .filter(|(key, _)| matches!(&key.value, Value::Str(k) if k == block))
                .skip(1);
            for (_, value) in copies {
                let first_diag = self.diags.len();
                if block == "defaults" {
                    let overlay = self.overlay(value, "defaults", Layer::Defaults);
                    crate::validate::check_detached(&overlay, "defaults", false, &mut self.diags);
                    self.detached.push(first_diag..self.diags.len());
                    continue;
                }
                let Value::Map(endpoints) = &value.value else {
                    self.type_error(
                        value,
                        "endpoints",
                        "a mapping of endpoint names to policies",
                    );
                    continue;
                };
                let mut seen: HashMap<String, Loc> = HashMap::new();
                for (key, value) in endpoints {
                    let Some(name) = self.endpoint_name(key, "endpoints") else {
                        continue;
                    };
                    let path = crate::diag::endpoint_path(&name);
                    let first_diag = self.diags.len();
                    self.name_in_block(&name, key.loc, &path, &mut seen);
                    self.detached_endpoint(&name, value, &path, first_diag);
                }
            }
        }
    }

    /// A block whose name is a near typo of `defaults` or `endpoints` (`endpoint:`, `default:`,
    /// `Endpoints:`), which [`Walker::fields`] reports as an unknown field with the name it
    /// guesses: what it holds (a mapping) is checked as that block's too, so that one run shows
    /// its fields' and names' own problems rather than a second run after the rename (not all:
    /// cross-field checks are left to that run). They are named by
    /// the key as written (`endpoint.a.max_attempts`), so that they are not taken for problems
    /// of the block the file runs with or of its endpoints (`explain` does not show them), and
    /// marked detached as a second block's are.
    fn misspelt_blocks(&mut self, root: &Node) {
        let Value::Map(entries) = &root.value else {
            return;
        };
        for (key, value) in entries {
            let Value::Str(written) = &key.value else {
                continue;
            };
            let Value::Map(inner) = &value.value else {
                continue;
            };
            if TOP_FIELDS.contains(&written.as_str()) {
                continue;
            }
            let first_diag = self.diags.len();
            match near_typo(written, TOP_FIELDS) {
                Some("defaults") => {
                    let overlay = self.overlay(value, written, Layer::Defaults);
                    crate::validate::check_detached(&overlay, written, false, &mut self.diags);
                }
                // Endpoints by name: a mapping of policy fields is no such block.
                Some("endpoints")
                    if !inner
                        .iter()
                        .any(|(k, _)| matches!(&k.value, Value::Str(f) if is_policy_field(f))) =>
                {
                    let mut seen: HashMap<String, Loc> = HashMap::new();
                    for (key, value) in inner {
                        let Some(name) = self.endpoint_name(key, written) else {
                            continue;
                        };
                        let path = format!("{written}.{}", crate::diag::endpoint_name_shown(&name));
                        self.name_in_block(&name, key.loc, &path, &mut seen);
                        self.endpoint_alone(value, &path);
                    }
                }
                _ => continue,
            }
            self.detached.push(first_diag..self.diags.len());
        }
    }

    /// The checks of an endpoint's name in a block left out of the document (a second or a
    /// misspelt `endpoints:`), as the block the file runs with gets them: its own rule (which
    /// that block's names meet in `validate`), and [`Walker::first_in_block`].
    fn name_in_block(&mut self, name: &str, at: Loc, path: &str, seen: &mut HashMap<String, Loc>) {
        crate::validate::check_endpoint_name(name, at, path, &mut self.diags);
        self.first_in_block(name, at, path, seen);
    }

    /// Whether `name`, written at `at`, is the first of its block (`seen`: each name's first
    /// place in it); a name written again is reported as a duplicate endpoint. Every
    /// `endpoints:` block, the one the file runs with and those left out, checks its names so.
    fn first_in_block(
        &mut self,
        name: &str,
        at: Loc,
        path: &str,
        seen: &mut HashMap<String, Loc>,
    ) -> bool {
        match seen.entry(name.to_owned()) {
            Entry::Occupied(first) => {
                let first = *first.get();
                self.error(
                    at,
                    path,
                    format!("duplicate endpoint `{name}` (first defined at {first})"),
                );
                false
            }
            Entry::Vacant(slot) => {
                slot.insert(at);
                true
            }
        }
    }

    /// An endpoint left out of the document (a second one of a name, or one of a second
    /// `endpoints:`), whose own problems are reported too, from `first_diag` on. They share the
    /// paths of the endpoint of that name the document keeps, if any, so they are marked
    /// detached: its cross-field checks still run on the fields it sets.
    fn detached_endpoint(&mut self, name: &str, value: &Node, path: &str, first_diag: usize) {
        self.endpoint_alone(value, path);
        crate::diag::tag_endpoint(&mut self.diags[first_diag..], name, path);
        self.detached.push(first_diag..self.diags.len());
    }

    /// The checks of one endpoint's policy and routes at `path`, for an endpoint the document
    /// does not keep.
    fn endpoint_alone(&mut self, value: &Node, path: &str) {
        let overlay = self.overlay(value, path, Layer::Endpoint);
        crate::validate::check_detached(&overlay, path, false, &mut self.diags);
        if let Some(routes) = get(value, "routes") {
            let routes_path = join(path, "routes");
            for route in self.routes(routes, &routes_path) {
                let route_path = format!("{routes_path}[{}]", route.index);
                crate::validate::check_detached(&route.overlay, &route_path, true, &mut self.diags);
            }
        }
    }

    /// An endpoint's name from its key (a string, or an integer written as one); reported at
    /// `block` (the name of the block it is in, as written) and `None` for any other kind of
    /// key.
    fn endpoint_name(&mut self, key: &Node, block: &str) -> Option<String> {
        match &key.value {
            Value::Str(s) => Some(s.clone()),
            Value::Int(i) => Some(i.to_string()),
            other => {
                self.error(
                    key.loc,
                    block,
                    format!("endpoint names are strings, found {}", other.kind()),
                );
                None
            }
        }
    }

    fn endpoints(&mut self, node: &Node) -> Vec<EndpointDoc> {
        let mut out: Vec<EndpointDoc> = Vec::new();
        let Value::Map(entries) = &node.value else {
            self.type_error(node, "endpoints", "a mapping of endpoint names to policies");
            return out;
        };
        if entries.is_empty() {
            self.error(node.loc, "endpoints", "the file defines no endpoints");
        }
        // Each name's first place, to find duplicates in linear time (a file under the size
        // limits can hold about 60,000 endpoints). SipHash with a random key: the file may come
        // from anyone.
        let mut seen: HashMap<String, Loc> = HashMap::with_capacity(entries.len());
        for (key, value) in entries {
            let Some(name) = self.endpoint_name(key, "endpoints") else {
                continue;
            };
            let path = crate::diag::endpoint_path(&name);
            let first_diag = self.diags.len();
            if !self.first_in_block(&name, key.loc, &path, &mut seen) {
                self.detached_endpoint(&name, value, &path, first_diag);
                continue;
            }
            let overlay = self.overlay(value, &path, Layer::Endpoint);
            let routes = get(value, "routes")
                .map(|routes| self.routes(routes, &join(&path, "routes")))
                .unwrap_or_default();
            crate::diag::tag_endpoint(&mut self.diags[first_diag..], &name, &path);
            out.push(EndpointDoc {
                name: Field::at(name, key.loc),
                overlay,
                routes,
            });
        }
        out
    }

    fn routes(&mut self, node: &Node, path: &str) -> Vec<RouteDoc> {
        // `routes:` left empty (every route commented out) has no routes, as `routes: []`.
        // Unlike a list of `retry_on`, where null could mean "inherit" as well as "none",
        // routes are not inherited, so nothing else could be meant.
        if node.value == Value::Null {
            return Vec::new();
        }
        let Value::Seq(items) = &node.value else {
            self.type_error(node, path, "a list of routes");
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("{path}[{i}]");
            // A list item left empty (`- ` or `~`) is not a route; any other non-mapping is
            // reported by `overlay` below.
            if item.value == Value::Null {
                self.type_error(item, &path, "a route (a mapping with `match:`)");
                continue;
            }
            let first_diag = self.diags.len();
            let overlay = self.overlay(item, &path, Layer::Route);
            let matcher =
                get(item, "match").and_then(|m| self.route_match(m, &join(&path, "match")));
            match matcher {
                Some((matcher, prefix_loc)) => out.push(RouteDoc {
                    matcher,
                    prefix_loc,
                    overlay,
                    index: i,
                }),
                None => {
                    if matches!(item.value, Value::Map(_)) && get(item, "match").is_none() {
                        self.error(item.loc, &path, "a route needs a `match:`");
                    }
                    // Left out of the document; its settings are still checked.
                    crate::validate::check_detached(&overlay, &path, true, &mut self.diags);
                    self.detached.push(first_diag..self.diags.len());
                }
            }
        }
        out
    }

    /// A route's `match:`, and its `path_prefix` value's place (`match`'s own when it writes
    /// none).
    fn route_match(&mut self, node: &Node, path: &str) -> Option<(Field<RouteMatch>, Loc)> {
        // `match:` left empty matches nothing; any other non-mapping is reported by `fields`.
        if node.value == Value::Null {
            self.type_error(
                node,
                path,
                "a mapping of `method` and/or `path_prefix`, or `grpc`",
            );
            return None;
        }
        let entries = self.fields_guessing(
            node,
            path,
            &MATCH_FIELDS,
            &MATCH_ELSEWHERE,
            &MATCH_TYPOS,
            &in_match,
        );
        if !matches!(node.value, Value::Map(_)) {
            return None;
        }
        let (mut method, mut prefix, mut grpc) = (None, None, None);
        for (key, value, _) in entries {
            let p = join(path, key);
            let Some(s) = self.string(value, &p) else {
                continue;
            };
            match key {
                "method" => method = Some((s, value.loc)),
                "path_prefix" => prefix = Some((s, value.loc)),
                _ => grpc = Some((s, value.loc)),
            }
        }
        let mut prefix_loc = node.loc;
        let matcher = match (method, prefix, grpc) {
            (None, None, None) => {
                self.error(
                    node.loc,
                    path,
                    "set `method` and/or `path_prefix` (HTTP), or `grpc: /pkg.Service/Method`",
                );
                return None;
            }
            (Some(_), _, Some((_, loc))) | (_, Some(_), Some((_, loc))) => {
                self.error(
                    loc,
                    &join(path, "grpc"),
                    "a route matches HTTP (`method`, `path_prefix`) or gRPC (`grpc`), not both",
                );
                return None;
            }
            (None, None, Some((g, loc))) => match parse_grpc_route(&g) {
                Ok((service, method)) => RouteMatch::Grpc { service, method },
                Err(msg) => {
                    self.error(loc, &join(path, "grpc"), msg);
                    return None;
                }
            },
            (method, prefix, None) => {
                prefix_loc = prefix.as_ref().map_or(node.loc, |(_, loc)| *loc);
                let mut ok = true;
                if let Some((m, loc)) = &method
                    && let Err(msg) = check_method(m)
                {
                    self.error(*loc, &join(path, "method"), msg);
                    ok = false;
                }
                if let Some((p, loc)) = &prefix
                    && !p.starts_with('/')
                {
                    self.error(
                        *loc,
                        &join(path, "path_prefix"),
                        format!("a path prefix starts with `/`, found `{p}`"),
                    );
                    ok = false;
                }
                if !ok {
                    return None;
                }
                RouteMatch::Http {
                    method: method.map(|(m, _)| m),
                    path_prefix: prefix.map_or_else(|| "/".to_owned(), |(p, _)| p),
                }
            }
        };
        Some((Field::at(matcher, node.loc), prefix_loc))
    }

    fn overlay(&mut self, node: &Node, path: &str, layer: Layer) -> Overlay {
        let mut known: Vec<&str> = POLICY_FIELDS.to_vec();
        let misplaced: &[(&str, &str)] = match layer {
            Layer::Defaults => {
                known.extend(ENDPOINT_FIELDS);
                &[
                    (
                        "routes",
                        "`routes` belong to an endpoint, not to `defaults`",
                    ),
                    ("match", "`match` belongs to a route"),
                ]
            }
            Layer::Endpoint => {
                known.extend(ENDPOINT_FIELDS);
                known.push("routes");
                &[("match", "`match` belongs to a route, under `routes:`")]
            }
            Layer::Route => {
                known.push("match");
                &[
                    ("routes", "routes cannot be nested"),
                    ("alert", ROUTE_ALERT),
                ]
            }
        };
        // A guessed `section.field` is misplaced where its section is (`alert.retry_ratio` on
        // a route), and so is a field of a shared section other than `enabled` on a route.
        let route = matches!(layer, Layer::Route);
        let misplaced = |f: &str| {
            if route
                && let Some((section @ ("budget" | "circuit_breaker"), field)) = f.split_once('.')
                && field != "enabled"
                && SECTIONS
                    .iter()
                    .any(|(s, fields)| *s == section && fields.contains(&field))
            {
                return Some(format!(
                    "`{section}` is per endpoint, shared by its routes, and a route can only turn it off (`{section}: {{enabled: false}}`): set `{field}` on the endpoint or in `defaults:`"
                ));
            }
            let f = f.split_once('.').map_or(f, |(section, _)| section);
            misplaced
                .iter()
                .find(|(name, _)| *name == f)
                .map(|(_, why)| (*why).to_owned())
        };
        let mut o = Overlay::default();
        // Every field of the sections a layer can hold, as `section.field` (with the plain
        // fields, which are keys here already): what an unknown name may be guessed as when it
        // holds a field's words in another order (`max_backoff` is `backoff.max`). A route has
        // no `alert` (it is told so).
        let elsewhere: [&[&str]; 1] = [&FIELD_PATHS];
        for (key, value, _) in self.fields_guessing(node, path, &known, &elsewhere, &[], &misplaced)
        {
            let p = join(path, key);
            match key {
                "max_attempts" => o.max_attempts = self.max_attempts(value, &p),
                "deadline" => o.deadline = self.duration(value, &p),
                "per_try_timeout" => o.per_try_timeout = self.duration(value, &p),
                "backoff" => o.backoff = self.backoff(value, &p),
                "retry_on" => o.retry_on = self.retry_on(value, &p),
                "idempotent_methods" => {
                    o.idempotent_methods = self.list(value, &p, |w, item, p| w.string(item, p));
                }
                "idempotency_key_header" => {
                    o.idempotency_key_header =
                        self.string(value, &p).map(|s| Field::at(s, value.loc));
                }
                "retry_after" => o.retry_after = self.retry_after(value, &p),
                "budget" => o.budget = self.budget(value, &p),
                "circuit_breaker" => o.circuit_breaker = self.breaker(value, &p),
                "alert" => o.alert = self.alert(value, &p),
                _ => {}
            }
        }
        o
    }

    fn backoff(&mut self, node: &Node, path: &str) -> BackoffOverlay {
        let mut o = BackoffOverlay::default();
        for (key, value, _) in self.fields(node, path, &BACKOFF_FIELDS, &no_hint) {
            let p = join(path, key);
            match key {
                "base" => o.base = self.duration(value, &p),
                "max" => o.max = self.duration(value, &p),
                "multiplier" => o.multiplier = self.number(value, &p),
                _ => {
                    o.jitter = self
                        .string(value, &p)
                        .and_then(|s| match Jitter::from_name(&s) {
                            Some(j) => Some(Field::at(j, value.loc)),
                            None => {
                                let names = Jitter::ALL.map(Jitter::as_str);
                                self.error(value.loc, &p, format!(
                                "unknown jitter `{s}`: use none, full, equal or decorrelated{}",
                                did_you_mean(&s, names)
                            ));
                                None
                            }
                        });
                }
            }
        }
        o
    }

    fn retry_on(&mut self, node: &Node, path: &str) -> RetryOnOverlay {
        let mut o = RetryOnOverlay::default();
        for (key, value, _) in self.fields(node, path, &RETRY_ON_FIELDS, &no_hint) {
            let p = join(path, key);
            match key {
                "http_status" => o.http_status = self.list(value, &p, Walker::http_status),
                "grpc_status" => o.grpc_status = self.list(value, &p, Walker::grpc_code),
                _ => o.errors = self.list(value, &p, Walker::error_class),
            }
        }
        o
    }

    fn retry_after(&mut self, node: &Node, path: &str) -> RetryAfterOverlay {
        let mut o = RetryAfterOverlay::default();
        for (key, value, _) in self.fields(node, path, &RETRY_AFTER_FIELDS, &no_hint) {
            let p = join(path, key);
            match key {
                "honor" => o.honor = self.boolean(value, &p),
                _ => o.max = self.duration(value, &p),
            }
        }
        o
    }

    fn budget(&mut self, node: &Node, path: &str) -> BudgetOverlay {
        let mut o = BudgetOverlay::default();
        for (key, value, _) in self.fields(node, path, &BUDGET_FIELDS, &no_hint) {
            let p = join(path, key);
            match key {
                "enabled" => o.enabled = self.boolean(value, &p),
                "ratio" => o.ratio = self.ratio(value, &p),
                "min_per_second" => o.min_per_second = self.count(value, &p, 0),
                _ => o.window = self.duration(value, &p),
            }
        }
        o
    }

    fn breaker(&mut self, node: &Node, path: &str) -> BreakerOverlay {
        let mut o = BreakerOverlay::default();
        for (key, value, _) in self.fields(node, path, &BREAKER_FIELDS, &no_hint) {
            let p = join(path, key);
            match key {
                "enabled" => o.enabled = self.boolean(value, &p),
                "failure_ratio" => o.failure_ratio = self.ratio(value, &p),
                "min_requests" => o.min_requests = self.count(value, &p, 1),
                "window" => o.window = self.duration(value, &p),
                "open_for" => o.open_for = self.duration(value, &p),
                _ => o.half_open_probes = self.count(value, &p, 1),
            }
        }
        o
    }

    fn alert(&mut self, node: &Node, path: &str) -> AlertOverlay {
        let mut o = AlertOverlay::default();
        if matches!(node.value, Value::Int(_) | Value::Float(_)) {
            self.error(
                node.loc,
                path,
                format!(
                    "`alert` is a mapping of alert settings: write `alert: {{retry_ratio: {}}}`",
                    scalar_text(node)
                ),
            );
            return o;
        }
        for (key, value, _) in self.fields(node, path, &ALERT_FIELDS, &no_hint) {
            let p = join(path, key);
            if key == "retry_ratio" {
                o.retry_ratio = self.ratio(value, &p);
            }
        }
        o
    }

    // === scalars ===

    fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match &node.value {
            Value::Str(s) => Some(s.clone()),
            _ => {
                self.type_error(node, path, "a string");
                None
            }
        }
    }

    fn boolean(&mut self, node: &Node, path: &str) -> Option<Field<bool>> {
        match node.value {
            Value::Bool(b) => Some(Field::at(b, node.loc)),
            // `yes`, `on` and the like are strings (YAML 1.2): say what was written.
            Value::Str(_) => {
                self.error(
                    node.loc,
                    path,
                    format!(
                        "expected a boolean (true or false), found a string {}",
                        scalar_text(node)
                    ),
                );
                None
            }
            _ => {
                self.type_error(node, path, "a boolean (true or false)");
                None
            }
        }
    }

    /// A whole number that fits a `u32`; one that does not is refused with the range the
    /// field accepts, from `min` (the validator refuses what fits but is below `min`).
    fn count(&mut self, node: &Node, path: &str, min: u32) -> Option<Field<u32>> {
        match node.value {
            Value::Int(i) => match u32::try_from(i) {
                Ok(v) => Some(Field::at(v, node.loc)),
                Err(_) => {
                    self.error(
                        node.loc,
                        path,
                        format!(
                            "must be a whole number from {min} to {}, found {i}",
                            u32::MAX
                        ),
                    );
                    None
                }
            },
            // A whole number too large for an integer is read as a float: it gets the range
            // too (not the float, which would name another number). A whole number written as
            // a float (`3.0`, `1e3`) is asked for in digits; any other number is named.
            Value::Float(f) => {
                let message = if let Some(beyond) = beyond_an_integer(f) {
                    format!(
                        "must be a whole number from {min} to {}, found {beyond}",
                        u32::MAX
                    )
                } else if f.is_finite() && f.fract() == 0.0 {
                    "expected a whole number written in digits, with no leading zero (`3`, not `03`, `3.0` or `3e0`)".to_owned()
                } else {
                    format!(
                        "expected a whole number, found {}",
                        crate::render::float(&f)
                    )
                };
                self.error(node.loc, path, message);
                None
            }
            _ => {
                self.type_error(node, path, "a whole number");
                None
            }
        }
    }

    /// `max_attempts`: a number outside `u32` gets the same message as one the validator
    /// refuses (1 to 10), not the range of the type.
    fn max_attempts(&mut self, node: &Node, path: &str) -> Option<Field<u32>> {
        let found = match node.value {
            Value::Int(i) if u32::try_from(i).is_err() => i.to_string(),
            Value::Float(f) => match beyond_an_integer(f) {
                Some(beyond) => beyond.to_owned(),
                None => return self.count(node, path, 1),
            },
            _ => return self.count(node, path, 1),
        };
        self.error(node.loc, path, crate::validate::max_attempts_range(found));
        None
    }

    /// A finite number; `-0.0` is read as `0.0`, the same value, so that it compiles, converts
    /// and hashes as `0` does (a file that only writes a zero's sign differently is unchanged).
    fn number(&mut self, node: &Node, path: &str) -> Option<Field<f64>> {
        match node.value {
            Value::Int(i) => Some(Field::at(i as f64, node.loc)),
            Value::Float(f) if f.is_finite() => {
                Some(Field::at(crate::model::unsigned_zero(f), node.loc))
            }
            Value::Float(_) => {
                self.error(node.loc, path, "must be a finite number");
                None
            }
            _ => {
                self.type_error(node, path, "a number");
                None
            }
        }
    }

    /// A ratio: a plain number (its range is checked later). A percentage such as `5%` is
    /// refused with the number to write instead.
    fn ratio(&mut self, node: &Node, path: &str) -> Option<Field<f64>> {
        if let Value::Str(s) = &node.value
            && let Some(pct_text) = s.strip_suffix('%')
            && let Ok(pct) = pct_text.trim().parse::<f64>()
            && pct.is_finite()
        {
            // The hundredth of the number as written (`0.00001%` is exactly `1.0e-7`), which a
            // division by 100 rounds.
            let ratio = hundredth(pct_text.trim()).unwrap_or(pct / 100.0);
            let written = crate::render::float(&ratio);
            let message = if (0.0..=1.0).contains(&ratio) {
                format!("a ratio is a plain number from 0 to 1: write {written} for `{s}`")
            } else {
                // Not "write 1.5", which the next run would refuse as out of range.
                format!("a ratio is a plain number from 0 to 1: `{s}` would be {written}")
            };
            self.error(node.loc, path, message);
            return None;
        }
        self.number(node, path)
    }

    fn duration(&mut self, node: &Node, path: &str) -> Option<Field<Duration>> {
        let text = match &node.value {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            // As a policy shows it: `1.0e+300`, not 301 digits.
            Value::Float(f) => crate::render::float(f),
            _ => {
                self.type_error(node, path, "a duration such as `250ms` or `2s`");
                return None;
            }
        };
        match parse_duration(&text) {
            Ok(d) => Some(Field::at(d, node.loc)),
            Err(e) => {
                self.error(node.loc, path, e.to_string());
                None
            }
        }
    }

    fn list<T>(
        &mut self,
        node: &Node,
        path: &str,
        mut item: impl FnMut(&mut Self, &Node, &str) -> Option<T>,
    ) -> Option<Field<Vec<Field<T>>>> {
        let Value::Seq(items) = &node.value else {
            if node.value == Value::Null {
                // Left empty: it could mean "none" as well as "inherit", so neither is guessed.
                self.type_error(
                    node,
                    path,
                    "a list (`[]` for none; leave the field out to inherit it)",
                );
            } else {
                self.type_error(node, path, "a list");
            }
            return None;
        };
        // Items in error are reported and left out; the rest stay so that later checks
        // (warnings on the good items) still run.
        let mut out = Vec::with_capacity(items.len());
        for (i, n) in items.iter().enumerate() {
            if let Some(v) = item(self, n, &format!("{path}[{i}]")) {
                out.push(Field::at(v, n.loc));
            }
        }
        Some(Field::at(out, node.loc))
    }

    fn http_status(&mut self, node: &Node, path: &str) -> Option<u16> {
        let Value::Int(code) = node.value else {
            self.type_error(node, path, "an HTTP status code");
            return None;
        };
        if !codes::is_http_status(code) {
            self.error(
                node.loc,
                path,
                format!("unknown HTTP status {code}: status codes are 100 to 599"),
            );
            return None;
        }
        if code < 400 {
            self.error(
                node.loc,
                path,
                format!("status {code} is not a failure: only 4xx and 5xx can be retried"),
            );
            return None;
        }
        u16::try_from(code).ok()
    }

    fn grpc_code(&mut self, node: &Node, path: &str) -> Option<GrpcCode> {
        // A code written as its number (`14`, as the wire and most logs show it; `0xE` too,
        // which is read as its text): say its name.
        let number = match &node.value {
            Value::Int(number) => Some(*number),
            Value::Str(s) => in_decimal(s).and_then(|d| d.parse::<i64>().ok()),
            _ => None,
        };
        if let Some(number) = number {
            let message = match i32::try_from(number).ok().and_then(GrpcCode::from_i32) {
                Some(GrpcCode::Ok) => "gRPC status codes are written by name: 0 is `OK`, which \
                                       is success and cannot be retried"
                    .to_owned(),
                Some(code) => format!(
                    "gRPC status codes are written by name: write `{}` for {number}",
                    code.name()
                ),
                None => format!(
                    "gRPC status codes are written by name (such as `UNAVAILABLE`), and \
                     {number} is none of gRPC's codes (0 to 16)"
                ),
            };
            self.error(node.loc, path, message);
            return None;
        }
        let name = self.string(node, path)?;
        let code = GrpcCode::from_name(&name);
        match code {
            Some(GrpcCode::Ok) => {
                self.error(node.loc, path, "OK is success and cannot be retried");
                None
            }
            Some(c) => Some(c),
            None => {
                self.error(
                    node.loc,
                    path,
                    format!(
                        "unknown gRPC status code `{name}`{}",
                        // Never `OK`: it is refused here too.
                        did_you_mean(&name, GrpcCode::names().filter(|n| *n != "OK"))
                    ),
                );
                None
            }
        }
    }

    fn error_class(&mut self, node: &Node, path: &str) -> Option<ErrorClass> {
        let name = self.string(node, path)?;
        let class = ErrorClass::from_name(&name);
        if class.is_none() {
            self.error(
                node.loc,
                path,
                format!(
                    "unknown error class `{name}`: use connect, reset or timeout{}",
                    did_you_mean(&name, ErrorClass::ALL.map(ErrorClass::as_str))
                ),
            );
        }
        class
    }
}

#[derive(Clone, Copy)]
enum Layer {
    Defaults,
    Endpoint,
    Route,
}

/// The first value under `key`, when `node` is a mapping.
fn get<'n>(node: &'n Node, key: &str) -> Option<&'n Node> {
    match &node.value {
        Value::Map(m) => m
            .iter()
            .find(|(k, _)| matches!(&k.value, Value::Str(s) if s == key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// The paths of the mappings that start at the places `wanted` in the tree (`endpoints.c`,
/// `defaults.backoff`, `endpoints.a.routes[0]`, empty for the file's own), named as the checks
/// name places: for a problem the YAML reader notes by place (a merge key written twice in a
/// mapping). A place no mapping node starts at (a mapping merged into another has none of its
/// own) is left out. One walk of the tree whatever the number of places, a path built only for
/// a place found (a file may hold 10,000 merge keys behind 100,000 other nodes); the tree is
/// at most [`crate::yaml::MAX_DEPTH`] deep.
pub(crate) fn paths_of_mappings(root: &Node, wanted: &[Loc]) -> HashMap<Loc, String> {
    /// One step from the root.
    enum Step<'n> {
        Key(&'n str),
        Int(i64),
        Index(usize),
    }
    fn render(steps: &[Step<'_>]) -> String {
        let mut path = String::new();
        // The second step under `endpoints:` (or a near typo of it) names an endpoint: shown
        // as the checks show it (a name past 128 bytes cut, with a hash).
        let endpoints = matches!(steps.first(), Some(Step::Key(k))
            if *k == "endpoints" || near_typo(k, TOP_FIELDS) == Some("endpoints"));
        for (i, step) in steps.iter().enumerate() {
            path = match step {
                Step::Index(n) => format!("{path}[{n}]"),
                Step::Key(k) if i == 1 && endpoints => {
                    join(&path, &crate::diag::endpoint_name_shown(k))
                }
                Step::Key(k) => join(&path, k),
                Step::Int(n) => join(&path, &n.to_string()),
            };
        }
        path
    }
    fn walk<'n>(
        node: &'n Node,
        wanted: &[Loc],
        steps: &mut Vec<Step<'n>>,
        found: &mut HashMap<Loc, String>,
    ) {
        match &node.value {
            Value::Map(entries) => {
                if wanted.binary_search(&node.loc).is_ok() && !found.contains_key(&node.loc) {
                    found.insert(node.loc, render(steps));
                }
                for (key, value) in entries {
                    let step = match &key.value {
                        Value::Str(k) => Step::Key(k),
                        Value::Int(n) => Step::Int(*n),
                        _ => continue,
                    };
                    steps.push(step);
                    walk(value, wanted, steps, found);
                    steps.pop();
                }
            }
            Value::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    steps.push(Step::Index(i));
                    walk(item, wanted, steps, found);
                    steps.pop();
                }
            }
            _ => {}
        }
    }
    let mut sorted = wanted.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut found = HashMap::new();
    if !sorted.is_empty() {
        walk(root, &sorted, &mut Vec::new(), &mut found);
    }
    found
}

fn scalar_text(node: &Node) -> String {
    match &node.value {
        Value::Int(i) => i.to_string(),
        // `1.0` prints as `1.0`, not `1`: a float written where an integer belongs shows as one.
        Value::Float(f) => format!("{f:?}"),
        Value::Str(s) => format!("`{s}`"),
        Value::Bool(b) => b.to_string(),
        other => other.kind().to_owned(),
    }
}

/// An HTTP method is an upper-case token (`GET`, `POST`, or an extension such as `PURGE`).
pub fn check_method(m: &str) -> Result<(), String> {
    if m.is_empty()
        || !m
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
    {
        return Err(format!("`{m}` is not an HTTP method"));
    }
    if m.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(format!(
            "HTTP methods are case-sensitive: write `{}`",
            m.to_ascii_uppercase()
        ));
    }
    Ok(())
}

/// For a whole number beyond `i64` (an integer the YAML reader could only hold as a float, so
/// its exact digits are gone), how to name it in a message; `None` for any other number. An
/// infinity counts: digits past about 309 of them read as one (`.inf` for a number written
/// in 400 digits would name what was never written), and `.inf` itself is larger too.
fn beyond_an_integer(f: f64) -> Option<&'static str> {
    if f.is_nan() || (f.is_finite() && f.fract() != 0.0) {
        None
    } else if f >= 9_223_372_036_854_775_808.0 {
        Some("a larger one")
    } else if f <= -9_223_372_036_854_775_808.0 {
        Some("a smaller one")
    } else {
        None
    }
}

/// The hundredth of the decimal number `text` (a percentage as written), read from its digits
/// rather than divided by 100, which rounds: `1e-5` gives the `1e-7` a division misses. The
/// exponent, if any, is lowered by 2.
fn hundredth(text: &str) -> Option<f64> {
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(at) => (&text[..at], text[at + 1..].parse::<i64>().ok()?),
        None => (text, 0),
    };
    format!("{mantissa}e{}", exponent.checked_sub(2)?)
        .parse()
        .ok()
}

/// What to say of an integer key `key` with no value that follows the number `value` on its
/// line in a flow mapping: written right after the comma (`0,2`), a decimal with a comma;
/// else (`503, 504`), a list without its brackets.
fn flow_comma_hint(value: &Node, key: &Node, key_int: i64) -> String {
    let written = match value.value {
        Value::Int(v) => v.to_string(),
        Value::Float(v) => crate::render::float(&v),
        _ => return String::new(),
    };
    let right_after = u32::try_from(written.len())
        .ok()
        .and_then(|len| value.loc.column.checked_add(len + 1))
        == Some(key.loc.column);
    if right_after && key_int >= 0 && matches!(value.value, Value::Int(_)) {
        format!(
            " (`{written},{key_int}`: in `{{ }}` a comma separates entries; a decimal is written \
             with a dot, `{written}.{key_int}`)"
        )
    } else {
        format!(
            " (in `{{ }}` a comma separates entries: a list is written in brackets, \
             `[{written}, {key_int}]`)"
        )
    }
}

/// `0,2`, `-1,5`, `1,000`: digits, one comma, digits; what a number written with a decimal
/// comma or a thousands separator reads as in YAML (a string).
fn is_comma_number(s: &str) -> bool {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    digits.split_once(',').is_some_and(|(whole, part)| {
        !whole.is_empty()
            && !part.is_empty()
            && whole.bytes().all(|b| b.is_ascii_digit())
            && part.bytes().all(|b| b.is_ascii_digit())
    })
}

/// A YAML 1.1 number with `_` between its digits (`1_000`, `0.000_1`, `0xFF_FF`), which YAML
/// 1.2 reads as a string.
fn is_underscored_number(s: &str) -> bool {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    digits.contains('_')
        && digits.bytes().next().is_some_and(|b| b.is_ascii_digit())
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && {
            let plain: String = digits.chars().filter(|c| *c != '_').collect();
            plain.parse::<f64>().is_ok()
                || plain
                    .strip_prefix("0x")
                    .is_some_and(|h| u64::from_str_radix(h, 16).is_ok())
                || plain
                    .strip_prefix("0o")
                    .is_some_and(|o| u64::from_str_radix(o, 8).is_ok())
        }
}

/// `/pkg.Service/Method` or `/pkg.Service/*`.
pub fn parse_grpc_route(s: &str) -> Result<(String, Option<String>), String> {
    let bad =
        || format!("`{s}` is not a gRPC route: write `/pkg.Service/Method` or `/pkg.Service/*`");
    let (service, method) = s
        .strip_prefix('/')
        .and_then(|r| r.split_once('/'))
        .ok_or_else(bad)?;
    let ident = |x: &str| {
        !x.is_empty()
            && x.split('.').all(|part| {
                !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            })
    };
    if !ident(service) {
        return Err(bad());
    }
    match method {
        "*" => Ok((service.to_owned(), None)),
        m if ident(m) && !m.contains('.') => Ok((service.to_owned(), Some(m.to_owned()))),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_paths_guessed_are_every_field_of_every_section_a_layer_has() {
        let mut derived: Vec<String> = SECTIONS
            .iter()
            .filter(|(section, _)| *section != "match")
            .flat_map(|(section, fields)| fields.iter().map(move |f| format!("{section}.{f}")))
            .collect();
        let mut dotted: Vec<&str> = FIELD_PATHS
            .iter()
            .copied()
            .filter(|p| p.contains('.'))
            .collect();
        derived.sort();
        dotted.sort_unstable();
        assert_eq!(derived, dotted);
        // The plain ones are keys of every layer already.
        assert!(
            FIELD_PATHS
                .iter()
                .filter(|p| !p.contains('.'))
                .all(|p| POLICY_FIELDS.contains(p))
        );
    }
}
