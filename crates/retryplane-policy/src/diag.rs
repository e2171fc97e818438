//! Diagnostics: one problem in a policy, with its place and field path (SPEC §1, §5).

use std::fmt;

use crate::yaml::Loc;

/// How bad a problem is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// The policy cannot be used.
    Error,
    /// The policy works but is probably not what was meant.
    Warning,
}

impl Severity {
    /// `error` or `warning`, as printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// One problem found in a policy.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// Where it is written; unknown for policies that came from no file.
    pub loc: Loc,
    /// The field path, such as `endpoints.payments.backoff.max`; `<root>` for the file itself.
    pub path: String,
    /// What is wrong, and where useful what to write instead.
    pub message: String,
    /// The endpoint whose settings the problem is in, by name, when a policy file's check
    /// knows it: an endpoint name may contain `.`, so [`Self::path`] alone cannot tell
    /// `endpoints.pay.v2.max_attempts` of endpoint `pay.v2` from a field `v2` of endpoint `pay`.
    /// `None` for `defaults`, the file's top level, and diagnostics from the wire.
    pub endpoint: Option<String>,
}

impl Diagnostic {
    /// An error at `loc` on `path`.
    pub fn error(loc: Loc, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            loc,
            path: path.into(),
            message: message.into(),
            endpoint: None,
        }
    }

    /// A warning at `loc` on `path`.
    pub fn warning(loc: Loc, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            loc,
            path: path.into(),
            message: message.into(),
            endpoint: None,
        }
    }

    /// Whether this is an error.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// `LINE:COLUMN: SEVERITY: PATH: MESSAGE` — the CLI prefixes the file name. Paths and messages
/// carry names as a file wrote them (a key `"a\nb"`), so their control characters are escaped
/// ([`OneLine`]): a diagnostic is one line in a log or a terminal whatever the file holds.
impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}: {}: {}",
            self.loc,
            self.severity.as_str(),
            OneLine(&self.path),
            OneLine(&self.message)
        )
    }
}

/// Whether `c` is a control character or a Unicode line or paragraph separator: what
/// [`OneLine`] escapes, and what a name shown in a terminal must not hold (it could break the
/// line, move the cursor or change colours).
pub fn is_control(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Text with every control character (and the Unicode line and paragraph separators) written
/// as a Rust escape (`\n`, `\t`, `\u{1b}`), so it stays on one line and cannot drive a
/// terminal; everything else, backslashes and non-ASCII letters included, as is.
pub struct OneLine<'a>(pub &'a str);

impl fmt::Display for OneLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(is_control) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            write!(f, "{}", c.escape_default())?;
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// Sorts by position, errors before warnings at the same place, and drops exact repeats.
pub fn normalize(diags: &mut Vec<Diagnostic>) {
    diags.sort_by(|a, b| {
        (a.loc, a.severity, &a.path, &a.message).cmp(&(b.loc, b.severity, &b.path, &b.message))
    });
    diags.dedup();
}

/// Marks `diags` (those found while checking one endpoint) as being about `endpoint`, except
/// the ones on another layer (a cross-field problem blamed on `defaults`).
pub(crate) fn tag_endpoint(diags: &mut [Diagnostic], endpoint: &str, path: &str) {
    for d in diags {
        let within = d
            .path
            .strip_prefix(path)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']));
        if within {
            d.endpoint = Some(endpoint.to_owned());
        }
    }
}

/// The closest of `candidates` to `word`, if close enough to be a likely typo; else the one
/// candidate that shares the most `_`-separated words with `word`, when it shares two or more,
/// or `word` shortens or lengthens it by whole words (`http` or `http_status_code` for
/// `http_status`). Ties make it a guess: none. So the extra words count: `deadline_per_try` is
/// `per_try_timeout` (two words in common), not the `deadline` it merely starts.
pub fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    let words: Vec<&str> = lower.split('_').filter(|w| !w.is_empty()).collect();
    let mut close: Option<(usize, &'a str)> = None;
    // The most words shared with `word`, and the one candidate sharing them if only one does
    // and it qualifies (two words or more, or whole words more or less).
    let mut by_words: (usize, Option<&'a str>) = (0, None);
    for c in candidates {
        let c_lower = c.to_ascii_lowercase();
        let d = strsim::levenshtein(&lower, &c_lower);
        if d <= 2.max(c.len() / 3) && close.is_none_or(|(best, _)| d < best) {
            close = Some((d, c));
        }
        let shared = shared_words(&words, &c_lower);
        if shared == 0 || shared < by_words.0 {
            continue;
        }
        let qualifies =
            shared >= 2 || extends_by_words(&lower, &c_lower) || extends_by_words(&c_lower, &lower);
        by_words = if shared > by_words.0 {
            (shared, qualifies.then_some(c))
        } else {
            // A second candidate sharing as many words: no guess.
            (shared, None)
        };
    }
    close.map(|(_, c)| c).or(by_words.1)
}

/// How many of the distinct `words` are among the `_`-separated words of `candidate`.
fn shared_words(words: &[&str], candidate: &str) -> usize {
    let theirs: Vec<&str> = candidate.split('_').collect();
    words
        .iter()
        .enumerate()
        .filter(|(i, w)| !words[..*i].contains(w) && theirs.contains(w))
        .count()
}

/// Whether `long` is `short` followed by `_` and more.
fn extends_by_words(long: &str, short: &str) -> bool {
    !short.is_empty()
        && long
            .strip_prefix(short)
            .is_some_and(|rest| rest.starts_with('_'))
}

/// ` (did you mean `x`?)` or nothing.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    suggest(word, candidates).map_or_else(String::new, |s| format!(" (did you mean `{s}`?)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        let fields = ["max_attempts", "backoff", "deadline"];
        assert_eq!(suggest("max_attempt", fields), Some("max_attempts"));
        assert_eq!(suggest("dedline", fields), Some("deadline"));
        assert_eq!(suggest("colour", fields), None);
        assert_eq!(suggest("unavailable", ["UNAVAILABLE"]), Some("UNAVAILABLE"));
    }

    #[test]
    fn suggests_a_name_with_a_word_more_or_less() {
        let retry_on = ["http_status", "grpc_status", "errors"];
        assert_eq!(suggest("http", retry_on), Some("http_status"));
        assert_eq!(suggest("grpc_status_codes", retry_on), Some("grpc_status"));
        assert_eq!(
            suggest("path", ["method", "path_prefix", "grpc"]),
            Some("path_prefix")
        );
        assert_eq!(
            suggest("RESOURCE", ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]),
            Some("RESOURCE_EXHAUSTED")
        );
        // Not a word boundary, or more than one candidate: no guess.
        assert_eq!(suggest("htt", retry_on), None);
        assert_eq!(suggest("retry", ["retry_on", "retry_after"]), None);
        // One word in common and not at the start: no guess.
        assert_eq!(suggest("timeout", ["deadline", "per_try_timeout"]), None);
        // A close typo still wins.
        assert_eq!(
            suggest("max_attempt", ["max", "max_attempts"]),
            Some("max_attempts")
        );
    }

    #[test]
    fn the_words_a_name_adds_count_towards_the_guess() {
        let policy = ["max_attempts", "deadline", "per_try_timeout", "retry_on"];
        // Not the `deadline` it starts: the other two words name `per_try_timeout`.
        assert_eq!(suggest("deadline_per_try", policy), Some("per_try_timeout"));
        assert_eq!(suggest("per_try_deadline", policy), Some("per_try_timeout"));
        // As many words of each: no guess.
        assert_eq!(suggest("deadline_try", policy), None);
        assert_eq!(suggest("max_attempts_per_try", policy), None);
        // A word more that no other candidate has still shortens to the field.
        assert_eq!(suggest("deadline_ms", policy), Some("deadline"));
    }

    #[test]
    fn one_line_escapes_control_characters_only() {
        assert_eq!(
            OneLine("a\nb\r\tc\u{1b}[0m\u{2028}").to_string(),
            "a\\nb\\r\\tc\\u{1b}[0m\\u{2028}"
        );
        assert_eq!(OneLine("платежі \\ ok").to_string(), "платежі \\ ok");
        assert_eq!(OneLine("").to_string(), "");
    }

    #[test]
    fn a_diagnostic_is_one_line_whatever_its_names_hold() {
        let d = Diagnostic::error(
            Loc { line: 2, column: 3 },
            "endpoints.pay\nments",
            "unknown field `\u{1b}[31mx`",
        );
        assert_eq!(
            d.to_string(),
            "2:3: error: endpoints.pay\\nments: unknown field `\\u{1b}[31mx`"
        );
    }

    #[test]
    fn displays_in_the_cli_format() {
        let d = Diagnostic::error(
            Loc { line: 3, column: 7 },
            "endpoints.payments.backoff.max",
            "must be at least backoff.base",
        );
        assert_eq!(
            d.to_string(),
            "3:7: error: endpoints.payments.backoff.max: must be at least backoff.base"
        );
    }
}
