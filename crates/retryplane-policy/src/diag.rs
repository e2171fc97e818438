//! Diagnostics: one problem in a policy, with its place and field path (SPEC §1, §5).

use std::borrow::Cow;
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
    /// `None` for `defaults`, the file's top level, and diagnostics from the wire. A name longer
    /// than any a policy allows is cut short here as in the path ([`endpoint_name_shown`]).
    pub endpoint: Option<String>,
}

impl Diagnostic {
    /// An error at `loc` on `path`.
    pub fn error(loc: Loc, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            loc,
            path: path_shown(path.into()),
            message: message_shown(message.into()),
            endpoint: None,
        }
    }

    /// A warning at `loc` on `path`.
    pub fn warning(loc: Loc, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            loc,
            path: path_shown(path.into()),
            message: message_shown(message.into()),
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

/// Whether `c` is a control character or a Unicode line or paragraph separator: what a name
/// shown in a terminal must not hold (it could break the line, move the cursor or change
/// colours), and what a name the control plane keeps is refused for.
pub fn is_control(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Whether `s` holds a character [`is_control`] refuses: a name that does could move the
/// cursor or change colours where `retryplane status` or `stats` print it.
pub fn has_control(s: &str) -> bool {
    s.chars().any(is_control)
}

/// Whether [`OneLine`] writes `c` as an escape: a control character ([`is_control`]), a
/// bidirectional formatting character, which could reorder the text shown after it (as in
/// "Trojan Source"), or a character that shows as nothing or as a blank (a zero-width space or
/// joiner, a word joiner, a byte-order mark, a soft hyphen, a Hangul filler, a tag character):
/// `checkout-1` followed by one must not pass for `checkout-1`. The bidi marks and the
/// joiners are common in Hebrew, Arabic and Indic text, so names holding them are kept, and
/// shown escaped.
pub fn is_escaped(c: char) -> bool {
    is_control(c)
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' // bidi marks
                | '\u{202a}'..='\u{202e}' // bidi embeddings and overrides
                | '\u{2066}'..='\u{2069}' // bidi isolates
                | '\u{00ad}' // soft hyphen
                | '\u{115f}' | '\u{1160}' | '\u{3164}' | '\u{ffa0}' // Hangul fillers
                | '\u{180e}' // Mongolian vowel separator
                | '\u{200b}'..='\u{200d}' // zero-width space, non-joiner, joiner
                | '\u{2060}'..='\u{2064}' // word joiner, invisible operators
                | '\u{206a}'..='\u{206f}' // deprecated format characters
                | '\u{feff}' // zero-width no-break space (byte-order mark)
                | '\u{e0000}'..='\u{e007f}' // tag characters
        )
}

/// Text with every control character, Unicode line and paragraph separator, bidi formatting
/// character and invisible character ([`is_escaped`]) written as a Rust escape (`\n`, `\t`,
/// `\u{1b}`, `\u{202e}`, `\u{200b}`), so it stays on one line, cannot drive a terminal or
/// reorder what follows, and shows what it holds; everything else, backslashes and non-ASCII
/// letters included, as is.
pub struct OneLine<'a>(pub &'a str);

impl fmt::Display for OneLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(is_escaped) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            write!(f, "{}", c.escape_default())?;
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// The most of a value a message quotes through [`Quoted`], in bytes.
pub const MAX_QUOTED: usize = 512;

/// A value quoted in a message: as [`OneLine`] writes it, cut after [`MAX_QUOTED`] bytes with `…`.
/// A message is cut to [`MAX_MESSAGE_SHOWN`] once built, but built whole first: a long value
/// quoted in the problem of each alias's copy of it was escaped in full every time (seconds for
/// a file of 111 KB). No value a policy needs is that long.
pub struct Quoted<'a>(pub &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (head, cut) = cut_at(self.0, MAX_QUOTED);
        OneLine(head).fmt(f)?;
        if cut {
            f.write_str("…")?;
        }
        Ok(())
    }
}

/// The first `max` bytes of `text` at most, cut back to a character boundary, and whether
/// anything was cut.
pub fn cut_at(text: &str, max: usize) -> (&str, bool) {
    if text.len() <= max {
        return (text, false);
    }
    (&text[..text.floor_char_boundary(max)], true)
}

/// `text` whole up to `max` bytes; past it, its first `max` bytes at most (cut back to a
/// character boundary) and `…`: a long text (a status message from the other end, a value
/// written in a file) shown or kept in part.
pub fn cut_marked(text: &str, max: usize) -> Cow<'_, str> {
    match cut_at(text, max) {
        (whole, false) => Cow::Borrowed(whole),
        (head, true) => Cow::Owned(format!("{head}…")),
    }
}

/// A value of a log field (`agent=…`) that its text cannot make into other fields: as
/// [`OneLine`] writes it when it is a plain word, and otherwise (empty, or holding whitespace,
/// `=`, `"`, `\\` or a character [`OneLine`] escapes) in double quotes, with `"` and `\\`
/// escaped. An agent id `web-1 service=payments` showed as two fields of the log line, and a
/// name spelling out `\u{202e}` as the character it names.
pub struct LogValue<'a>(pub &'a str);

impl fmt::Display for LogValue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plain = !self.0.is_empty()
            && !self.0.contains(|c: char| {
                c.is_whitespace() || matches!(c, '=' | '"' | '\\') || is_escaped(c)
            });
        if plain {
            return f.write_str(self.0);
        }
        f.write_str("\"")?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                c if is_escaped(c) => write!(f, "{}", c.escape_default())?,
                c => write!(f, "{c}")?,
            }
        }
        f.write_str("\"")
    }
}

/// A path as a log field's value: its text (lossy where it is not UTF-8) written as
/// [`LogValue`] writes it, so a path holding a space or `=` stays one field of the line.
pub struct LogPath<'a>(pub &'a std::path::Path);

impl fmt::Display for LogPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        LogValue(&self.0.to_string_lossy()).fmt(f)
    }
}

/// Sorts by position, errors before warnings at the same place, and drops exact repeats.
pub fn normalize(diags: &mut Vec<Diagnostic>) {
    diags.sort_by(|a, b| {
        (a.loc, a.severity, &a.path, &a.message).cmp(&(b.loc, b.severity, &b.path, &b.message))
    });
    diags.dedup();
}

/// The most diagnostics one check lists; past it, one more says how many were left out
/// ([`more_not_listed`]). A problem can take a byte or two of input (a bad code in a list)
/// and a few hundred bytes to say: unbounded, a document of a few megabytes made an answer,
/// a log and a process's memory of gigabytes.
pub const MAX_LISTED: usize = 1_000;

/// The diagnostic that closes a list cut at [`MAX_LISTED`]: `errors` more errors and
/// `warnings` more warnings (an error if any is).
pub fn more_not_listed(errors: usize, warnings: usize) -> Diagnostic {
    let what = match (errors, warnings) {
        (0, w) => format!("{w} more warning(s)"),
        (e, 0) => format!("{e} more error(s)"),
        (e, w) => format!("{e} more error(s) and {w} more warning(s)"),
    };
    let message = format!("{what}{}", not_listed_tail());
    if errors > 0 {
        Diagnostic::error(Loc::UNKNOWN, "<document>", message)
    } else {
        Diagnostic::warning(Loc::UNKNOWN, "<document>", message)
    }
}

/// The tail of [`more_not_listed`]'s message.
fn not_listed_tail() -> String {
    format!(" not listed (the first {MAX_LISTED} problems are)")
}

/// The errors and warnings a [`more_not_listed`] line says were left out; `None` for any
/// other diagnostic.
pub fn unlisted(d: &Diagnostic) -> Option<(usize, usize)> {
    if d.path != "<document>" || d.loc != Loc::UNKNOWN {
        return None;
    }
    let counts = d.message.strip_suffix(&not_listed_tail())?;
    let (mut errors, mut warnings) = (0, 0);
    for part in counts.split(" and ") {
        let (n, what) = part.split_once(" more ")?;
        let n = n.parse().ok()?;
        match what {
            "error(s)" => errors = n,
            "warning(s)" => warnings = n,
            _ => return None,
        }
    }
    Some((errors, warnings))
}

/// How many errors and warnings `diags` stand for: those listed, and those a closing
/// [`more_not_listed`] line says were left out.
pub fn counts(diags: &[Diagnostic]) -> (usize, usize) {
    diags
        .iter()
        .fold((0, 0), |(errors, warnings), d| match unlisted(d) {
            Some((e, w)) => (errors + e, warnings + w),
            None if d.is_error() => (errors + 1, warnings),
            None => (errors, warnings + 1),
        })
}

/// Cuts `diags` to [`MAX_LISTED`], closing it with [`more_not_listed`]: errors first (a
/// file's warnings must not hide the error that makes it invalid), then warnings, each in
/// their order; the list kept stays in its order.
pub fn cap(diags: &mut Vec<Diagnostic>) {
    if diags.len() <= MAX_LISTED {
        return;
    }
    let errors = diags.iter().filter(|d| d.is_error()).count();
    let warnings = diags.len() - errors;
    let kept_errors = errors.min(MAX_LISTED);
    let kept_warnings = MAX_LISTED - kept_errors;
    let (mut errors_left, mut warnings_left) = (kept_errors, kept_warnings);
    diags.retain(|d| {
        let left = if d.is_error() {
            &mut errors_left
        } else {
            &mut warnings_left
        };
        let keep = *left > 0;
        *left = left.saturating_sub(1);
        keep
    });
    diags.shrink_to_fit();
    diags.push(more_not_listed(
        errors - kept_errors,
        warnings - kept_warnings,
    ));
}
/// The longest endpoint name a policy allows, in bytes.
pub const MAX_ENDPOINT_NAME: usize = 128;

/// An endpoint name as diagnostics name it: as written when it is no longer than any name a
/// policy allows ([`MAX_ENDPOINT_NAME`]); else its first 128 bytes at most (cut back to a
/// character boundary), `…`, `#` and eight hex digits of a hash of the whole name. Every
/// problem found inside an endpoint carries its name in its path, so a name of most of a
/// megabyte, copied into each of thousands of problems, would take gigabytes. The hash keeps
/// two long names that start alike apart (a problem under one must not hide the other's), and
/// the `…` keeps a cut name from ever being a valid one.
pub fn endpoint_name_shown(name: &str) -> Cow<'_, str> {
    if name.len() <= MAX_ENDPOINT_NAME {
        return Cow::Borrowed(name);
    }
    Cow::Owned(cut_tagged(name, MAX_ENDPOINT_NAME))
}

/// The first `max` bytes of `text` at most (cut back to a character boundary), `…`, `#` and
/// eight hex digits of a hash of the whole.
fn cut_tagged(text: &str, max: usize) -> String {
    let end = text.floor_char_boundary(max);
    // 32-bit FNV-1a, written out: the tag must be the same in every build (a CLI and a control
    // plane built with other toolchains name the file's problems alike), which std's hasher
    // does not promise, and it only tells names apart, so no hashing crate is needed.
    let tag = text.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    });
    format!("{}…#{tag:08x}", &text[..end])
}

/// The longest field path a diagnostic keeps whole. Every path a valid policy has is far
/// shorter (endpoint names are cut at [`MAX_ENDPOINT_NAME`] already); a longer one holds a key
/// written as a long value (an alias of a long scalar used as a key, say).
pub const MAX_PATH_SHOWN: usize = 1024;

/// The longest message a diagnostic keeps whole: the messages quote what was written, and one
/// value can be quoted many times (aliases of one long scalar), so a message quoting most of a
/// megabyte, once per alias, would make a file's report a hundred times its size.
pub const MAX_MESSAGE_SHOWN: usize = 2048;

/// `path` as a diagnostic keeps it: whole up to [`MAX_PATH_SHOWN`] bytes, else cut as
/// [`endpoint_name_shown`] cuts a name (a hash keeps two long paths that start alike apart).
fn path_shown(path: String) -> String {
    if path.len() <= MAX_PATH_SHOWN {
        return path;
    }
    cut_tagged(&path, MAX_PATH_SHOWN)
}

/// `message` as a diagnostic keeps it: whole up to [`MAX_MESSAGE_SHOWN`] bytes, else its
/// start and its end (where the hint on what to write usually stands) around `…`.
fn message_shown(message: String) -> String {
    if message.len() <= MAX_MESSAGE_SHOWN {
        return message;
    }
    let head = message.floor_char_boundary(MAX_MESSAGE_SHOWN / 2);
    let tail = message.ceil_char_boundary(message.len() - MAX_MESSAGE_SHOWN / 4);
    format!(
        "{} … ({} bytes not shown) … {}",
        &message[..head],
        tail - head,
        &message[tail..]
    )
}

/// The path of the endpoint `name`: `endpoints.NAME`, with a name longer than any a policy
/// allows shown as [`endpoint_name_shown`] does.
pub fn endpoint_path(name: &str) -> String {
    format!("endpoints.{}", endpoint_name_shown(name))
}

/// Marks `diags` (those found while checking one endpoint) as being about `endpoint`, except
/// the ones on another layer (a cross-field problem blamed on `defaults`). A name longer
/// than any a policy allows is kept cut short ([`endpoint_name_shown`]).
pub(crate) fn tag_endpoint(diags: &mut [Diagnostic], endpoint: &str, path: &str) {
    let endpoint = endpoint_name_shown(endpoint);
    let endpoint = endpoint.as_ref();
    for d in diags {
        if is_within(&d.path, path) {
            d.endpoint = Some(endpoint.to_owned());
        }
    }
}

/// Whether the field path `path` is `prefix` or a field or item of it (`endpoints.a.backoff` and
/// `endpoints.a.routes[0]` are within `endpoints.a`; `endpoints.ab` is not).
pub(crate) fn is_within(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// The closest of `candidates` to `word`, if close enough to be a likely typo; else the one
/// candidate that `word` shortens or lengthens by whole `_`-separated words (`http` or
/// `http_status_code` for `http_status`), if only one does. For names users choose (endpoints)
/// and fixed lists (codes, classes); a policy's field names go by [`suggest_field`].
pub fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    let mut close: Option<(usize, &'a str)> = None;
    let mut by_words: Option<Option<&'a str>> = None;
    for c in candidates {
        let c_lower = c.to_ascii_lowercase();
        if let Some(d) = close_enough(&lower, &c_lower)
            && close.is_none_or(|(best, _)| d < best)
        {
            close = Some((d, c));
        }
        if extends_by_words(&lower, &c_lower) || extends_by_words(&c_lower, &lower) {
            // A second candidate makes it a guess: none.
            by_words = Some(if by_words.is_none() { Some(c) } else { None });
        }
    }
    close.map(|(_, c)| c).or(by_words.flatten())
}

/// [`suggest`] for a policy's field names, whose words mean the same wherever they appear: the
/// closest typo; else, among the candidates that share two or more words with `word` (in any
/// order) or that it shortens or lengthens by whole words, the one sharing the most words; else
/// the one candidate that `word` names with words in front (`http_method` for `method`). So the
/// extra words count: `deadline_per_try` is `per_try_timeout` (two words in common), not the
/// `deadline` it merely starts. A candidate may be a field of a section written
/// `section.field`, whose words are both parts': `max_backoff` is `backoff.max`. A tie is no
/// guess, except between fields of one section, which guess the section (`retry_on_status` is
/// `retry_on`, whose fields `http_status` and `grpc_status` it names as well).
/// (Endpoint names are not held to this: `orders_api_v1` is not `payments_api_v1`.)
pub fn suggest_field<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    let words: Vec<&str> = lower.split('_').filter(|w| !w.is_empty()).collect();
    let mut close: Option<(usize, &'a str)> = None;
    // The most words shared by a candidate that qualifies, and that candidate if only one
    // shares that many.
    let mut by_words: (usize, Option<&'a str>) = (0, None);
    // The candidates that `word` names with words in front, merged as ties are: the last resort.
    let mut qualified: Option<Option<&'a str>> = None;
    for c in candidates {
        let c_lower = c.to_ascii_lowercase();
        // A section's field is as close as its own name would be (`backoff_max`), and is
        // guessed by words only when `word` names the whole section: `retry_max` is not
        // `retry_after.max`.
        let (section, field) = c_lower.split_once('.').unwrap_or(("", &c_lower));
        let names_section = section
            .split('_')
            .all(|w| w.is_empty() || words.contains(&w));
        if let Some(d) = close_enough_to(&lower, &c_lower, field.len())
            && close.is_none_or(|(best, _)| d < best)
        {
            close = Some((d, c));
        }
        if !names_section {
            continue;
        }
        if ends_with_words(&lower, &c_lower) {
            qualified = Some(match qualified {
                None => Some(c),
                Some(other) => other.and_then(|other| common_guess(other, c)),
            });
        }
        let shared = shared_words(&words, &c_lower);
        let qualifies = shared >= 2
            || (shared >= 1
                && (extends_by_words(&lower, &c_lower) || extends_by_words(&c_lower, &lower)));
        if !qualifies || shared < by_words.0 {
            continue;
        }
        by_words = if shared > by_words.0 {
            (shared, Some(c))
        } else {
            // A second candidate sharing as many words: no guess, unless both are one section's.
            (shared, by_words.1.and_then(|other| common_guess(other, c)))
        };
    }
    close.map(|(_, c)| c).or(by_words.1).or(qualified.flatten())
}

/// What two equally good guesses have in common: the same name listed twice, or the section
/// both are fields of (`retry_on` for `retry_on.http_status` and `retry_on.grpc_status`, or for
/// `retry_on` itself and one of its fields); `None` otherwise.
fn common_guess<'a>(a: &'a str, b: &'a str) -> Option<&'a str> {
    let section = |s: &'a str| s.split_once('.').map_or(s, |(section, _)| section);
    section(a)
        .eq_ignore_ascii_case(section(b))
        .then_some(section(a))
}

/// The one of `candidates` that `word` is a near typo of: at most 2 edits from a candidate of 6
/// characters or more, and nearer than any other. Stricter than [`suggest`]: for names that are
/// only worth offering when the typo is plain (a section's field named inside `match:`).
pub(crate) fn near_typo<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let word = word.to_ascii_lowercase();
    let mut best: Option<(usize, &'a str)> = None;
    let mut tied = false;
    for c in candidates.into_iter().filter(|c| c.len() >= 6) {
        let Some(d) = distance_within(&word, c, 2) else {
            continue;
        };
        match best {
            Some((b, other)) if d == b => tied |= other != c,
            Some((b, _)) if d > b => {}
            _ => {
                best = Some((d, c));
                tied = false;
            }
        }
    }
    best.filter(|_| !tied).map(|(_, c)| c)
}

/// The edit distance from `word` to `candidate`, if small enough to be a likely typo.
fn close_enough(word: &str, candidate: &str) -> Option<usize> {
    close_enough_to(word, candidate, candidate.len())
}

/// [`close_enough`], allowing edits in proportion to `len` bytes of the candidate (a section's
/// field: its own name, not its section's), but never more than a short candidate has
/// characters; as many only for a word holding each of them (`bd` for `db`: a swap is two
/// edits), so that `X` or `FOO` is no typo of `OK`, nor `api` of `a`.
fn close_enough_to(word: &str, candidate: &str, len: usize) -> Option<usize> {
    let chars = candidate.chars().count();
    distance_within(word, candidate, 2.max(len / 3))
        .filter(|&d| d < chars || (d == chars && candidate.chars().all(|c| word.contains(c))))
}

/// The edit distance from `word` to `candidate` if it is at most `limit`. The distance is at
/// least the difference in length, so a word too long to be within `limit` is not compared at
/// all: the comparison costs the product of the two lengths, and a key or code name in a
/// hostile file can be most of a megabyte long.
fn distance_within(word: &str, candidate: &str, limit: usize) -> Option<usize> {
    let candidate_chars = candidate.chars().count();
    let bound = candidate_chars.saturating_add(limit);
    if word.chars().take(bound.saturating_add(1)).count() > bound {
        return None;
    }
    let d = strsim::levenshtein(word, candidate);
    (d <= limit).then_some(d)
}

/// How many of the distinct `words` are among the words of `candidate`, separated by `_` or,
/// between a section and its field, `.`.
fn shared_words(words: &[&str], candidate: &str) -> usize {
    // The size of the same intersection, counted over the candidate's few words: counted over
    // `words` (a hostile key can hold tens of thousands), the distinctness check is quadratic.
    let theirs: Vec<&str> = candidate.split(['_', '.']).collect();
    theirs
        .iter()
        .enumerate()
        .filter(|(i, w)| !theirs[..*i].contains(w) && words.contains(w))
        .count()
}

/// Whether `long` is `short` followed by `_` and more.
fn extends_by_words(long: &str, short: &str) -> bool {
    !short.is_empty()
        && long
            .strip_prefix(short)
            .is_some_and(|rest| rest.starts_with('_'))
}

/// Whether `long` is more words, then `_`, then `short` (`http_method` for `method`).
fn ends_with_words(long: &str, short: &str) -> bool {
    !short.is_empty()
        && long
            .strip_suffix(short)
            .is_some_and(|rest| rest.len() > 1 && rest.ends_with('_'))
}

/// ` (did you mean `x`?)` or nothing.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    suggest(word, candidates).map_or_else(String::new, |s| format!(" (did you mean `{s}`?)"))
}

/// [`did_you_mean`] for a policy's field names ([`suggest_field`]).
pub fn did_you_mean_field<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    suggest_field(word, candidates).map_or_else(String::new, |s| format!(" (did you mean `{s}`?)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_endpoint_name_is_cut_at_a_character_boundary() {
        assert_eq!(endpoint_path("payments"), "endpoints.payments");
        let exact = "a".repeat(MAX_ENDPOINT_NAME);
        assert_eq!(endpoint_path(&exact), format!("endpoints.{exact}"));
        // 2-byte letters: the 128th byte is in the middle of the 64th.
        let accented = format!("a{}", "é".repeat(100));
        let shown = endpoint_name_shown(&accented);
        assert!(
            shown.starts_with(&format!("{}…#", &accented[..127])),
            "{shown}"
        );
        assert_eq!(shown.len(), 127 + "…#".len() + 8, "{shown}");
        assert_eq!(endpoint_path(&accented), format!("endpoints.{shown}"));
        // Two long names that start alike are told apart.
        let a = format!("{}x", "a".repeat(MAX_ENDPOINT_NAME));
        let b = format!("{}y", "a".repeat(MAX_ENDPOINT_NAME));
        assert_ne!(endpoint_name_shown(&a), endpoint_name_shown(&b));
        // The same tag in every build: FNV-1a of the whole name.
        assert_eq!(
            endpoint_name_shown(&a),
            format!("{}…#e4632007", "a".repeat(128))
        );
    }

    #[test]
    fn a_long_value_quoted_once_per_alias_is_cut_in_every_problem() {
        // One scalar of 120 KB, quoted by 32 aliases as methods (each "not a method" and
        // "listed twice") and by 32 as keys (each "unknown field", in the message and the
        // path): about as many copies of it as aliases may make (8 MiB of text in all).
        let long = "x y".repeat(40_000);
        let aliases = ["*k"; 32].join(", ");
        let keys: String = (0..32).map(|_| "    *k : 1\n").collect();
        let src = format!(
            "version: 1\nendpoints:\n  a:\n    idempotency_key_header: &k \"{long}\"\n    idempotent_methods: [{aliases}]\n  b:\n{keys}"
        );
        let loaded = crate::load(src.as_bytes());
        let shown: usize = loaded
            .diagnostics
            .iter()
            .map(|d| d.message.len() + d.path.len())
            .sum();
        let some: Vec<_> = loaded
            .diagnostics
            .iter()
            .map(|d| d.message.get(..200))
            .collect();
        assert!(loaded.diagnostics.len() >= 64, "{some:#?}");
        // Each problem keeps a few KB of what the copies it quotes hold (64 × 15 KB).
        assert!(
            shown < 64 * (MAX_MESSAGE_SHOWN + MAX_PATH_SHOWN + 128) && shown < 64 * long.len() / 2,
            "{shown} bytes of problems from a {}-byte file",
            src.len()
        );
        for d in &loaded.diagnostics {
            assert!(
                d.message.len() <= MAX_MESSAGE_SHOWN + 64,
                "{}",
                d.message.len()
            );
            assert!(d.path.len() <= MAX_PATH_SHOWN + 16, "{}", d.path.len());
        }
    }

    #[test]
    fn a_text_is_cut_at_a_character_boundary_and_marked_only_when_cut() {
        assert_eq!(cut_at("abc", 3), ("abc", false));
        assert_eq!(cut_at("abcd", 3), ("abc", true));
        // `é` is two bytes: a cut inside it goes back before it.
        assert_eq!(cut_at("abé", 3), ("ab", true));
        assert_eq!(cut_marked("abé", 4), Cow::Borrowed("abé"));
        assert_eq!(cut_marked("abéd", 3), "ab…");
        assert_eq!(cut_marked("", 0), "");
    }

    /// A quoted value is written whole up to [`MAX_QUOTED`] bytes, escaped, and past it cut at a
    /// character's boundary with `…`.
    #[test]
    fn a_quoted_value_is_cut_after_its_first_bytes() {
        assert_eq!(Quoted("/v1\n").to_string(), "/v1\\n");
        let exact = "a".repeat(MAX_QUOTED);
        assert_eq!(Quoted(&exact).to_string(), exact);
        let long = format!("{}é{}", "a".repeat(MAX_QUOTED - 1), "b".repeat(10_000));
        assert_eq!(
            Quoted(&long).to_string(),
            format!("{}…", "a".repeat(MAX_QUOTED - 1))
        );
        // A file's long path prefix, repeated by aliases: each problem quotes its start only.
        let prefix = "/\\u0001%zz *".repeat(2_000);
        let mut src = format!(
            "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {{path_prefix: &p \"{prefix}\"}}\n"
        );
        for _ in 0..20 {
            src.push_str("      - match: {path_prefix: *p}\n");
        }
        let loaded = crate::load(src.as_bytes());
        let warnings: Vec<&Diagnostic> = loaded
            .diagnostics
            .iter()
            .filter(|d| d.path.ends_with("path_prefix"))
            .collect();
        assert_eq!(warnings.len(), 63, "three a route");
        for d in warnings {
            assert!(d.message.len() < 3 * MAX_QUOTED + 300, "{}", d.message);
            assert!(!d.message.contains("bytes not shown"), "{}", d.message);
        }
    }

    #[test]
    fn a_long_message_keeps_its_start_and_its_end_and_a_long_path_its_tag() {
        let short = "`GET ` is not an HTTP method".to_owned();
        assert_eq!(message_shown(short.clone()), short);
        let long = format!(
            "`{}` is not an HTTP method; write a token",
            "é".repeat(5_000)
        );
        let shown = message_shown(long.clone());
        assert!(shown.starts_with("`éé"), "{shown}");
        assert!(
            shown.ends_with("is not an HTTP method; write a token"),
            "{shown}"
        );
        assert!(shown.contains(" bytes not shown) … "), "{shown}");
        assert!(shown.len() <= MAX_MESSAGE_SHOWN + 64);
        let a = path_shown(format!("endpoints.a.{}x", "k".repeat(2_000)));
        let b = path_shown(format!("endpoints.a.{}y", "k".repeat(2_000)));
        assert_ne!(a, b, "two long paths that start alike stay apart");
        assert!(a.len() <= MAX_PATH_SHOWN + 16, "{}", a.len());
        let kept = "endpoints.payments.routes[0].max_attempts".to_owned();
        assert_eq!(path_shown(kept.clone()), kept);
    }

    #[test]
    fn suggests_close_names_only() {
        let fields = ["max_attempts", "backoff", "deadline"];
        assert_eq!(suggest("max_attempt", fields), Some("max_attempts"));
        assert_eq!(suggest("dedline", fields), Some("deadline"));
        assert_eq!(suggest("colour", fields), None);
        assert_eq!(suggest("unavailable", ["UNAVAILABLE"]), Some("UNAVAILABLE"));
        // Short names: a swap or a letter more is a typo; a word sharing no letter is not.
        assert_eq!(suggest("bd", ["db"]), Some("db"));
        assert_eq!(suggest("3s", ["s3"]), Some("s3"));
        assert_eq!(suggest("aa", ["a"]), Some("a"));
        assert_eq!(suggest("x", ["ok"]), None);
        assert_eq!(suggest("foo", ["ok"]), None);
        assert_eq!(suggest("od", ["db"]), None);
        assert_eq!(suggest("bob", ["db"]), None);
        assert_eq!(suggest("api", ["a"]), None);
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
    fn the_words_a_field_name_adds_count_towards_the_guess() {
        let policy = [
            "max_attempts",
            "deadline",
            "per_try_timeout",
            "retry_on",
            "backoff",
        ];
        // Not the `deadline` it starts: the other two words name `per_try_timeout`.
        let field = |word| suggest_field(word, policy);
        assert_eq!(field("deadline_per_try"), Some("per_try_timeout"));
        assert_eq!(field("per_try_deadline"), Some("per_try_timeout"));
        // One word shared with a field it does not start or end: no rival to the one it does.
        assert_eq!(field("deadline_try"), Some("deadline"));
        assert_eq!(field("deadline_timeout"), Some("deadline"));
        assert_eq!(field("backoff_max"), Some("backoff"));
        assert_eq!(
            suggest_field("open", ["failure_ratio", "open_for"]),
            Some("open_for")
        );
        assert_eq!(
            suggest_field("grpc_method", ["method", "path_prefix", "grpc"]),
            Some("grpc")
        );
        // As many words of each: no guess.
        assert_eq!(field("max_attempts_per_try"), None);
        // One word in common and not at the start: no guess.
        assert_eq!(field("timeout"), None);
        // A word more that no other candidate has still shortens to the field.
        assert_eq!(field("deadline_ms"), Some("deadline"));
    }

    #[test]
    fn a_near_typo_is_of_one_long_candidate_at_most_two_edits_away() {
        let fields = ["grpc_status", "http_status", "base", "max", "multiplier"];
        assert_eq!(near_typo("grpc_statuses", fields), Some("grpc_status"));
        assert_eq!(near_typo("HTTP_STATUS", fields), Some("http_status"));
        assert_eq!(near_typo("multipler", fields), Some("multiplier"));
        // Short candidates are never offered, nor one 3 edits away.
        assert_eq!(near_typo("min", fields), None);
        assert_eq!(near_typo("grpc_statusess", fields), None);
        // As near to two: no guess.
        assert_eq!(
            near_typo("xttp_status", ["http_status", "xttp_statux"]),
            None
        );
    }

    #[test]
    fn a_field_of_a_section_is_guessed_by_its_words_in_any_order() {
        let layer = [
            "max_attempts",
            "backoff",
            "deadline",
            "per_try_timeout",
            "retry_on",
            "retry_after",
            "backoff.base",
            "backoff.max",
            "retry_on.http_status",
            "retry_on.grpc_status",
            "retry_after.max",
        ];
        let field = |word| suggest_field(word, layer);
        assert_eq!(field("max_backoff"), Some("backoff.max"));
        assert_eq!(field("backoff_max"), Some("backoff.max"));
        assert_eq!(field("base_backoff"), Some("backoff.base"));
        // Two fields of one section as good as each other: the section.
        assert_eq!(field("retry_on_status"), Some("retry_on"));
        // A word of a section's name is not the section: `retry_max` is not `retry_after.max`.
        assert_eq!(field("retry_max"), None);
        assert_eq!(field("max_delay"), None);
        assert_eq!(field("max_retries"), None);
        assert_eq!(field("timeout"), None);
        // A section's field is as close as its own name: not every name within 6 edits.
        assert_eq!(field("retry_on_codes"), Some("retry_on"));
    }

    #[test]
    fn a_field_named_with_words_in_front_is_the_last_guess() {
        let matcher = ["method", "path_prefix", "grpc", "http_status", "max", "max"];
        let field = |word| suggest_field(word, matcher);
        assert_eq!(field("http_method"), Some("method"));
        // The field a name starts wins over the one it ends with.
        assert_eq!(field("grpc_method"), Some("grpc"));
        // The same name twice is one guess.
        assert_eq!(field("maxx"), Some("max"));
        assert_eq!(field("max_value"), Some("max"));
        // Words at the front, not a part of one.
        assert_eq!(field("httpmethod"), None);
        assert_eq!(field("status"), None);
    }

    #[test]
    fn names_users_choose_and_fixed_lists_are_not_guessed_by_shared_words() {
        let endpoints = ["payments_api_v1", "search_api_v2", "inventory"];
        assert_eq!(suggest("orders_api_v1", endpoints), None);
        assert_eq!(
            suggest(
                "billing_service_grpc",
                ["user_service_grpc", "order_service_http"]
            ),
            None
        );
        assert_eq!(
            suggest(
                "INTERNAL_NOT_FOUND",
                ["INTERNAL", "NOT_FOUND", "UNAVAILABLE"]
            ),
            Some("INTERNAL")
        );
        assert_eq!(
            suggest("connect_timeout", ["connect", "reset", "timeout"]),
            Some("connect")
        );
    }

    #[test]
    fn one_line_escapes_bidirectional_formatting_characters() {
        assert_eq!(
            OneLine("pay\u{202e}stnemyap\u{2066}x\u{200f}").to_string(),
            "pay\\u{202e}stnemyap\\u{2066}x\\u{200f}"
        );
        assert!(!"ok-é".chars().any(is_escaped));
        // Escaped where shown, not refused: the marks are common in Hebrew and Arabic text.
        assert!(!"\u{200f}צוות".chars().any(is_control));
    }

    #[test]
    fn one_line_shows_invisible_characters() {
        assert_eq!(
            OneLine("checkout-1\u{200b}").to_string(),
            "checkout-1\\u{200b}"
        );
        assert_eq!(OneLine("\u{feff}shop").to_string(), "\\u{feff}shop");
        assert_eq!(OneLine("a\u{e0041}").to_string(), "a\\u{e0041}");
        // A variation selector (emoji presentation) is left as is.
        assert_eq!(OneLine("ok\u{fe0f}").to_string(), "ok\u{fe0f}");
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
    fn a_log_value_is_quoted_unless_it_is_a_plain_word() {
        assert_eq!(LogValue("web-1").to_string(), "web-1");
        assert_eq!(LogValue("платежі").to_string(), "платежі");
        assert_eq!(
            LogValue("web-1 service=payments").to_string(),
            "\"web-1 service=payments\""
        );
        assert_eq!(LogValue("").to_string(), "\"\"");
        assert_eq!(LogValue("a\"b").to_string(), "\"a\\\"b\"");
        // The character and its spelling out are told apart.
        assert_eq!(LogValue("\u{202e}x").to_string(), "\"\\u{202e}x\"");
        assert_eq!(LogValue("\\u{202e}x").to_string(), "\"\\\\u{202e}x\"");
        assert_eq!(LogValue("a\nb").to_string(), "\"a\\nb\"");
    }

    #[test]
    fn a_log_path_is_quoted_when_it_would_not_be_one_field() {
        use std::path::Path;
        let plain = Path::new("/var/lib/retryplane/retryplane.redb");
        assert_eq!(LogPath(plain).to_string(), plain.display().to_string());
        assert_eq!(
            LogPath(Path::new("/srv/state dir/retryplane.redb")).to_string(),
            "\"/srv/state dir/retryplane.redb\""
        );
        assert_eq!(
            LogPath(Path::new("/srv/a=b\nc")).to_string(),
            "\"/srv/a=b\\nc\""
        );
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
