//! YAML → a located tree, with the input limits of SPEC §1.
//!
//! `serde-saphyr` does the YAML (it bounds depth, alias replay and event counts, and never
//! panics on malformed input); we deserialize into a small untyped tree whose every node keeps
//! its line and column, so the policy checks can run over the whole file and report every
//! problem at once, each at its place. Duplicate keys are passed through to this tree and
//! reported by the policy checks, so a file with three duplicates gets three errors.
//!
//! Before that full pass, `yaml_scan` reads the parser's bare events once and refuses deep
//! nesting, alias bombs and too many nodes wherever they stand in the file, at a fraction of the
//! full pass's cost.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use crate::yaml_scan::Breach;

/// Files larger than this are refused before parsing.
pub const MAX_FILE_BYTES: usize = 1024 * 1024;
/// Deepest nesting of mappings and sequences accepted. A policy file needs [`NEEDED_DEPTH`].
pub const MAX_DEPTH: usize = 24;
/// The deepest nesting a policy file needs: `endpoints.NAME.routes[i].retry_on.http_status`.
pub const NEEDED_DEPTH: usize = 6;
/// Upper bound on events replayed by alias expansion (an alias "bomb" hits it quickly).
pub const MAX_ALIAS_EVENTS: usize = 20_000;
/// Upper bound on the bytes of scalar text aliases replay, all together: 8 MiB. A copy is
/// checked, and its values quoted in messages, as written text is, so a long anchored scalar
/// repeated by each alias (within [`MAX_ALIAS_EVENTS`] nodes) cost seconds of checks (65 MB of
/// copies: 3–6 s); sharing a block of settings among endpoints replays far less, and a file
/// that names one long path prefix in a few routes (a snapshot larger than agents decode can be
/// written so) stays within it.
pub const MAX_ALIAS_BYTES: usize = 8 * 1024 * 1024;
/// Upper bound on parser events in one file: each scalar, alias, and start or end of a mapping
/// or sequence is one. Also the bound on nodes (scalars, mappings and sequences), which a file
/// always reaches later.
pub const MAX_EVENTS: usize = 200_000;

/// A 1-based position in the source; `0:0` when unknown (a policy built from the API).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Loc {
    /// Line, from 1.
    pub line: u32,
    /// Column, from 1.
    pub column: u32,
}

impl Loc {
    /// The position of a value that came from no file.
    pub const UNKNOWN: Loc = Loc { line: 0, column: 0 };

    /// Whether the position is known.
    pub fn is_known(self) -> bool {
        self.line > 0
    }
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// A YAML value whose children carry their positions.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `~`, `null` or nothing.
    Null,
    /// `true` / `false` (also `True`, `FALSE`, ...); the YAML 1.1 forms `yes`, `no`, `on`,
    /// `off`, `y`, `n` are strings.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float, or an integer too large for `i64`; may be infinite or NaN (`.inf`, `.nan`,
    /// `1e999`).
    Float(f64),
    /// A string scalar.
    Str(String),
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping in source order; duplicate keys are kept.
    Map(Vec<(Node, Node)>),
}

/// A value and where it stands.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The value.
    pub value: Value,
    /// Where it is written.
    pub loc: Loc,
}

impl Value {
    /// A short name of the value's kind for messages ("a mapping", "a string").
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Str(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

/// Why a file could not be turned into a tree.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct YamlError {
    /// Where, as near as known.
    pub loc: Loc,
    /// What is wrong.
    pub message: String,
}

/// What a file over [`MAX_FILE_BYTES`] is refused with: its `size` in bytes, when known (a
/// reader that stops at the limit knows only that it is larger).
pub fn too_large_message(size: Option<u64>) -> String {
    let size = size.map_or_else(|| format!("more than {MAX_FILE_BYTES}"), |s| s.to_string());
    format!("file is {size} bytes; policy files are limited to {MAX_FILE_BYTES} bytes (1 MiB)")
}

/// Parses policy-file bytes into a located tree, enforcing the size, encoding, depth and alias
/// limits. Never panics; bounded time on any input. A merge key (`<<`) written twice in one
/// mapping is an error at the second ([`crate::load`] reports each as a duplicate key, with the
/// file's other problems).
pub fn parse(bytes: &[u8]) -> Result<Node, YamlError> {
    let (root, merges_again) = parse_noting(bytes)?;
    match merges_again.first() {
        Some(again) => Err(YamlError {
            loc: again.at,
            message: format!("invalid YAML: {}", merge_again_message(again.first)),
        }),
        None => Ok(root),
    }
}

/// What a merge key written a second time in one mapping is refused with: the parser merges
/// both, the first one's keys winning, where any other key written twice is a duplicate; one
/// merge key with a list says the same thing, and in which order.
pub(crate) fn merge_again_message(first: Loc) -> String {
    format!(
        "duplicate key `<<` (first set at {first}): merge several mappings with one key and a \
         list, `<<: [*a, *b]`, the first one's fields winning"
    )
}

/// [`parse`], with each merge key written a second time in one mapping handed back rather
/// than refused (the tree holds what the parser merged).
pub(crate) fn parse_noting(
    bytes: &[u8],
) -> Result<(Node, Vec<crate::yaml_scan::MergeAgain>), YamlError> {
    if bytes.len() > MAX_FILE_BYTES {
        return Err(YamlError {
            loc: Loc { line: 1, column: 1 },
            message: too_large_message(u64::try_from(bytes.len()).ok()),
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let (good, _) = bytes.split_at(e.valid_up_to());
        YamlError {
            loc: loc_of_offset(good),
            message: "file is not valid UTF-8".to_owned(),
        }
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.trim().is_empty() {
        let empty = Node {
            value: Value::Null,
            loc: Loc { line: 1, column: 1 },
        };
        return Ok((empty, Vec::new()));
    }
    // A hostile part (deep nesting, an alias bomb, too many nodes) is found by a pass over the
    // parser's bare events first: the full pass below would find it too, but only after building
    // every located value before it (see `yaml_scan`).
    let notes = match crate::yaml_scan::scan(text) {
        Ok(notes) => notes,
        Err((breach, loc)) => {
            let text = match breach {
                Breach::Depth => too_deep(),
                Breach::Events => too_many_events(),
                Breach::Aliases => aliases_expand_too_far(),
                Breach::AliasBytes => format!(
                    "aliases repeat more than {MAX_ALIAS_BYTES} bytes (8 MiB) of text; a policy \
                     file needs no aliases"
                ),
            };
            return Err(YamlError {
                loc,
                message: format!("invalid YAML: {text}"),
            });
        }
    };
    let mut options = serde_saphyr::Options::default();
    options.duplicate_keys = serde_saphyr::DuplicateKeyPolicy::PassThrough;
    options.with_snippet = false;
    // YAML 1.2 booleans only: `yes`, `no`, `on`, `off`, `y` and `n` are strings, so an
    // endpoint may be called `on`, and `honor: yes` is refused rather than guessed at.
    options.strict_booleans = true;
    // YAML 1.2 numbers only: `1_000` (YAML 1.1) is a string, which a number field refuses
    // (with a hint) rather than reading a thousand.
    options.underscored_numbers_as_strings = true;
    // `.inf`, `.nan` and `1e999` become floats, which the policy checks refuse at their place
    // along with every other problem, rather than one error for the whole file.
    options.non_finite_float_policy = serde_saphyr::NonFiniteFloatPolicy::PassThrough;
    // A backstop: the scan above bounds what aliases replay in nodes (a list or mapping one,
    // its start and end two events here), and refuses at the alias that passes the bound; at
    // the scan's own number this counted events and refused 18,900 nodes, at the anchor.
    options.alias_limits.max_total_replayed_events = 2 * MAX_ALIAS_EVENTS;
    options.alias_limits.max_replay_stack_depth = MAX_DEPTH;
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = MAX_DEPTH;
    budget.max_events = MAX_EVENTS;
    budget.max_nodes = MAX_EVENTS;
    budget.max_documents = 1;
    // The parser's own alias-bomb heuristic refuses 100 aliases or more when they outnumber
    // the anchors tenfold: a file that shares one anchored block among 100 endpoints. What an
    // alias may cost is bounded by the replayed-node limit above (and `yaml_scan`'s first pass)
    // instead.
    budget.alias_anchor_min_aliases = usize::MAX;
    options.budget = Some(budget);
    let in_force = NotesInForce::set(notes.not_decimal);
    let spanned: Spanned<Value> =
        serde_saphyr::from_str_with_options(text, options).map_err(|e| {
            let loc = e
                .location()
                .map(|l| Loc {
                    line: clamp(l.line()),
                    column: clamp(l.column()),
                })
                .filter(|l| l.is_known())
                .unwrap_or(Loc { line: 1, column: 1 });
            if is_scan_error(&e, |kind| {
                matches!(
                    kind,
                    serde_saphyr::granit_parser::ErrorKind::TabInPlainScalar
                )
            }) && let Some(tab) = indenting_tab_after(text, loc)
            {
                return YamlError {
                    loc: tab,
                    message: "invalid YAML: a tab indents this line (YAML indents with spaces)"
                        .to_owned(),
                };
            }
            let mut message = limit_message(&e).unwrap_or_else(|| first_line(&e.to_string()));
            if let Some(tab) = tab_indenting(text, &message, loc) {
                return YamlError {
                    loc: tab,
                    message: "invalid YAML: a tab indents this line (YAML indents with spaces)"
                        .to_owned(),
                };
            }
            if message.ends_with(NOT_ALLOWED_HERE) && key_too_long_before(text, loc) {
                message.push_str(LONG_KEY);
            }
            message.push_str(&syntax_hint(text, &message, loc));
            YamlError { loc, message }
        })?;
    let root = node(spanned);
    drop(in_force);
    Ok((root, notes.merge_again))
}

thread_local! {
    /// The scan's notes of whole numbers not in decimal digits ([`crate::yaml_scan::Notes`])
    /// for the file this thread is reading, which [`node`] consults.
    ///
    /// Why a thread-local: `Value`'s `Deserialize` is called by serde-saphyr's `Spanned` with
    /// no context of ours (no `DeserializeSeed` reaches it), and only there is the place a
    /// value was *written* known (`Spanned::defined`: for a value copied by an alias or a merge
    /// key, its anchored original; the node keeps the place it is *used*).
    static NOT_DECIMAL: RefCell<Vec<(Loc, String)>> = const { RefCell::new(Vec::new()) };
}

/// The notes in force for one read: set before it, and when dropped (an error or a panic
/// included) the ones in force before it are put back (none, unless a read ever starts
/// inside another) and this read's are freed, not kept as a thread's spare capacity.
struct NotesInForce {
    before: Vec<(Loc, String)>,
}

impl NotesInForce {
    fn set(notes: Vec<(Loc, String)>) -> NotesInForce {
        let before = NOT_DECIMAL.with(|n| std::mem::replace(&mut *n.borrow_mut(), notes));
        NotesInForce { before }
    }
}

impl Drop for NotesInForce {
    fn drop(&mut self) {
        let before = std::mem::take(&mut self.before);
        NOT_DECIMAL.with(|n| *n.borrow_mut() = before);
    }
}

/// `value`, or its text when the notes in force list the place it was written (`defined`):
/// a whole number in a form other than decimal digits, read as its text as the reader takes
/// YAML 1.1's `1_000`. `0x1F7`, `0o17`, `0b11` and `+3` are then refused by a number field
/// with the decimal digits to write, and an endpoint named `0x10` keeps that name rather than
/// `16`, wherever an alias or a merge key copies them.
///
/// Why: a policy's whole numbers are written in decimal digits (`03`, `3.0` and `3e0`, which
/// the reader takes as floats, are refused too), and a hex status code or a `+` sign in a
/// policy file is more likely a slip than a choice; one rule for every form is clearer than
/// taking some.
fn as_written(value: Value, defined: Loc) -> Value {
    if !matches!(value, Value::Int(_) | Value::Float(_)) {
        return value;
    }
    NOT_DECIMAL.with(|notes| {
        let notes = notes.borrow();
        // The scan lists them in the file's order, which is the order of their places.
        match notes
            .binary_search_by(|(at, _)| at.cmp(&defined))
            .ok()
            .and_then(|i| notes.get(i))
        {
            Some((_, text)) => Value::Str(text.clone()),
            None => value,
        }
    })
}

/// What the parser says of a `:` it does not take as a key's, a key of more than 1,024
/// characters included (YAML's limit on a key written without `? `).
const NOT_ALLOWED_HERE: &str = "mapping values are not allowed in this context";

/// Said after [`NOT_ALLOWED_HERE`] when the key before that `:` is the cause.
const LONG_KEY: &str = " (the key before this `:` is longer than the 1,024 characters YAML allows \
     a key written without `? `; an endpoint name is at most 128 characters)";

/// Whether what stands before the `:` at `loc` on its line (the key, with its indent, a `- `
/// or `{` before it) is more than 1,024 characters long.
fn key_too_long_before(text: &str, loc: Loc) -> bool {
    let Some(line) = yaml_lines(text)
        .get(loc.line.saturating_sub(1) as usize)
        .copied()
    else {
        return false;
    };
    let before = line.chars().take(loc.column.saturating_sub(1) as usize);
    let key = before.collect::<String>();
    let key = key.trim_start().trim_start_matches(['-', '{', ' ']);
    key.chars().count() > 1_024
}

/// Whether `e` is the YAML scanner's own error, of a kind `is_kind` takes.
fn is_scan_error(
    e: &serde_saphyr::Error,
    is_kind: impl Fn(&serde_saphyr::granit_parser::ErrorKind) -> bool,
) -> bool {
    use serde_saphyr::Error as E;
    let mut e = e;
    while let E::AliasError { error, .. } | E::WithSnippet { error, .. } = e {
        e = error;
    }
    matches!(e, E::ExternalMessage { source, .. }
        if matches!(&**source, serde_saphyr::ExternalMessageSource::Parser(scan) if is_kind(scan.kind())))
}

/// The first tab in the indentation of a line after `from`'s that holds more than blanks, at
/// or left of the indentation of `from`'s line (a tab further right continues the value, which
/// the scanner takes): where the scanner's "found a tab" inside a plain value is (it reports
/// where the value starts, which may be lines above: `max_attempts: 3` on one line, a
/// tab-indented `deadline: 1s` a few lines below, read as the value's continuation).
fn indenting_tab_after(text: &str, from: Loc) -> Option<Loc> {
    fn indent(line: &str) -> &str {
        &line[..line.len() - line.trim_start_matches([' ', '\t']).len()]
    }
    let first = usize::try_from(from.line).ok()?;
    let lines = yaml_lines(text);
    let key_indent = indent(lines.get(first.checked_sub(1)?)?).len();
    lines
        .iter()
        .enumerate()
        .skip(first)
        .find_map(|(index, line)| {
            let indent = indent(line);
            let column = indent.find('\t').filter(|&c| c <= key_indent)?;
            (indent.len() < line.trim_end().len()).then(|| Loc {
                line: u32::try_from(index + 1).unwrap_or(u32::MAX),
                column: u32::try_from(column + 1).unwrap_or(u32::MAX),
            })
        })
}

/// The lines of `text` as YAML breaks them: at `\r\n`, `\n` or a `\r` alone (which
/// `str::lines` does not break at).
fn yaml_lines(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut lines = Vec::new();
    let (mut start, mut i) = (0, 0);
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => {
                lines.push(&text[start..i]);
                start = i + 1;
            }
            b'\r' => {
                lines.push(&text[start..i]);
                if bytes.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    if start < text.len() {
        lines.push(&text[start..]);
    }
    lines
}

/// Where a tab is in the indentation of `at`'s own line, at or left of `at`: what the
/// scanner's "tabs disallowed within this context" (`message`) means there. `None` for any
/// other error (a tab may begin a quoted scalar's next line, for one).
fn tab_indenting(text: &str, message: &str, at: Loc) -> Option<Loc> {
    if !message.contains("tabs disallowed") {
        return None;
    }
    let lines = yaml_lines(text);
    let line = lines.get(usize::try_from(at.line).ok()?.checked_sub(1)?)?;
    let indent = &line[..line.len() - line.trim_start_matches([' ', '\t']).len()];
    let column = indent.find('\t')?;
    (u32::try_from(column).ok()? < at.column).then(|| Loc {
        line: at.line,
        column: u32::try_from(column + 1).unwrap_or(u32::MAX),
    })
}

/// What the parser's words for a syntax error at `at` leave out, as a parenthesis to append
/// to `message` (empty when there is nothing to add): for a flow mapping or list the parser
/// could not go on in, where its bracket opened and whether it is closed at all (the parser
/// says the same of one never closed, reported a line later, and of one missing a comma);
/// for a block mapping's missing key, that the line is indented as no line above it is.
///
/// Written here rather than taken from the parser: its errors carry one place only, the
/// point where it gave up. [`scan_structure`] reads the text as far as these hints need.
fn syntax_hint(text: &str, message: &str, at: Loc) -> String {
    let flow = message.contains("while parsing a flow");
    let block = message.contains("while parsing a block mapping, did not find expected key");
    if !flow && !block {
        return String::new();
    }
    let lines = yaml_lines(text);
    let scan = scan_structure(&lines);
    if flow {
        // The parser stopped on a bracket (one a plain scalar cannot hold): it says enough.
        if scan.brackets.iter().any(|b| b.open == at) {
            return String::new();
        }
        // The innermost bracket open at `at`: the last opened before it and not closed by it.
        let Some(open) = scan
            .brackets
            .iter()
            .rfind(|b| b.open < at && b.close.is_none_or(|c| c >= at))
        else {
            return String::new();
        };
        return match open.close {
            None => format!(
                " (the `{}` at {}:{} is not closed)",
                open.kind, open.open.line, open.open.column
            ),
            Some(close) => format!(
                " (the `{}` at {}:{} closes at {}:{}: is a `,` missing between two of its \
                 entries?)",
                open.kind, open.open.line, open.open.column, close.line, close.column
            ),
        };
    }
    let Some(index) = usize::try_from(at.line).ok().and_then(|l| l.checked_sub(1)) else {
        return String::new();
    };
    let indent = |line: &str| line.len() - line.trim_start_matches(' ').len();
    let Some(line) = lines.get(index) else {
        return String::new();
    };
    let own = indent(line);
    let mut above: Vec<usize> = lines
        .iter()
        .zip(&scan.structure)
        .take(index)
        .filter(|(line, structure)| {
            let rest = line.trim_start_matches(' ');
            **structure && !rest.is_empty() && !rest.starts_with('#')
        })
        .map(|(line, _)| indent(line))
        .collect();
    above.sort_unstable();
    above.dedup();
    if above.is_empty() || above.contains(&own) {
        return String::new();
    }
    let listed: Vec<String> = above.iter().map(usize::to_string).collect();
    format!(
        " (this line is indented {own} spaces, as no line above it is: {})",
        listed.join(", ")
    )
}

/// A flow bracket found by [`scan_structure`]: `{` or `[`, where it opened, and where the
/// bracket that closes it is (`None` when none does).
#[derive(Debug, PartialEq)]
struct Bracket {
    kind: char,
    open: Loc,
    close: Option<Loc>,
}

/// What [`scan_structure`] found.
#[derive(Debug)]
struct Structure {
    /// Every flow bracket, in the order they open.
    brackets: Vec<Bracket>,
    /// For each line, whether it begins as YAML structure: not inside a quoted scalar begun
    /// on a line before, nor a block scalar's (`|`, `>`) content.
    structure: Vec<bool>,
}

/// Reads `lines` as far as the syntax hints need: the flow brackets and which lines begin as
/// structure. Quoted scalars (across lines too), comments and block scalars' content are
/// skipped; outside a flow collection, a bracket or a quote counts only where a node begins
/// (at a line's start, or after `: `, `- `, `? `, `,`, `[` or `{`), so that a plain scalar's
/// text (`see [docs}`) is not taken for one. A reading for hints, not a parser: the parser
/// has refused the file already.
fn scan_structure(lines: &[&str]) -> Structure {
    let mut brackets: Vec<Bracket> = Vec::new();
    let mut structure = Vec::with_capacity(lines.len());
    // Indexes into `brackets` of those open.
    let mut open: Vec<usize> = Vec::new();
    let mut quote: Option<char> = None;
    // The indent of the line a block scalar's indicator ends, while its content goes on.
    let mut block_of: Option<usize> = None;
    let loc = |index: usize, column: usize| Loc {
        line: u32::try_from(index + 1).unwrap_or(u32::MAX),
        column: u32::try_from(column + 1).unwrap_or(u32::MAX),
    };
    for (index, line) in lines.iter().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        if let Some(of) = block_of {
            if line.trim().is_empty() || indent > of {
                structure.push(false);
                continue;
            }
            block_of = None;
        }
        structure.push(quote.is_none());
        // The last character that is not white space on this line, outside quotes, and
        // whether white space came after it; and whether only a line's lead (its indent and
        // `- ` entries) has come so far.
        let mut previous: Option<char> = None;
        let mut spaced = true;
        let mut lead = true;
        // Columns in characters, as the parser counts them.
        let mut chars = line.chars().enumerate().peekable();
        while let Some((column, c)) = chars.next() {
            // Outside a flow, `,` is text and `-` marks an entry only in the line's lead; inside
            // one, a value may follow its `:` at once (`{"a":"b"}`).
            let in_flow = !open.is_empty();
            let node_start = previous.is_none()
                || (in_flow && matches!(previous, Some(',' | '[' | '{')))
                || ((spaced || in_flow) && previous == Some(':'))
                || (spaced && previous == Some('?'))
                || (spaced && lead && previous == Some('-'));
            if quote.is_none() && !matches!(c, ' ' | '\t' | '-') {
                lead = false;
            }
            // A tag or an anchor (`!!str `, `&name `) before a node leaves it a node's start.
            if quote.is_none() && node_start && matches!(c, '!' | '&') {
                while chars.peek().is_some_and(|&(_, n)| n != ' ' && n != '\t') {
                    chars.next();
                }
                continue;
            }
            match (quote, c) {
                (Some('"'), '\\') => {
                    chars.next();
                    continue;
                }
                (Some(q), c) if c == q => {
                    // `''` inside single quotes is one quote, not the end.
                    if q == '\'' && chars.peek().is_some_and(|&(_, n)| n == '\'') {
                        chars.next();
                    } else {
                        quote = None;
                        previous = Some(c);
                        spaced = false;
                    }
                    continue;
                }
                (Some(_), _) => continue,
                (None, ' ' | '\t') => {
                    spaced = true;
                    continue;
                }
                (None, '#') if spaced => break,
                (None, '"' | '\'') if node_start => quote = Some(c),
                (None, '{' | '[') if node_start || !open.is_empty() => {
                    open.push(brackets.len());
                    brackets.push(Bracket {
                        kind: c,
                        open: loc(index, column),
                        close: None,
                    });
                }
                (None, '}' | ']') => {
                    if let Some(at) = open.pop()
                        && let Some(bracket) = brackets.get_mut(at)
                    {
                        bracket.close = Some(loc(index, column));
                    }
                }
                _ => {}
            }
            previous = Some(c);
            spaced = false;
        }
        // A block scalar's indicator ends the line (`key: |`, `- >-`, `|2`): its content,
        // the lines indented more than this one, is text.
        if quote.is_none() && open.is_empty() {
            let code = match line.find(" #") {
                Some(at) => &line[..at],
                None => line,
            };
            let code = code.trim_end();
            let (mut before, last) = code.rsplit_once(' ').unwrap_or(("", code));
            // A tag or an anchor may stand before the indicator (`key: &text |`).
            while let Some((rest, token)) = before.trim_end().rsplit_once(' ')
                && token.starts_with(['!', '&'])
            {
                before = rest;
            }
            let before = before.trim_end();
            if last.starts_with(['|', '>'])
                && last[1..]
                    .bytes()
                    .all(|b| b == b'-' || b == b'+' || b.is_ascii_digit())
                && (before.is_empty() || before.ends_with(':') || before.ends_with('-'))
            {
                // Its content is indented more than the node it belongs to: on a list entry's
                // line (`- key: |`), the entry's key, not the `-`.
                let key = line.len()
                    - line
                        .trim_start_matches(' ')
                        .trim_start_matches(['-', ' '])
                        .len();
                block_of = Some(if before.ends_with(':') { key } else { indent });
            }
        }
    }
    Structure {
        brackets,
        structure,
    }
}

fn clamp(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// What a limit the parser enforces means to a policy author, when `e` is one: which limit
/// (nesting depth, alias expansion, size in nodes) and its number.
fn limit_message(e: &serde_saphyr::Error) -> Option<String> {
    use serde_saphyr::Error as E;
    use serde_saphyr::budget::BudgetBreach as B;
    let mut e = e;
    while let E::AliasError { error, .. } | E::WithSnippet { error, .. } = e {
        e = error;
    }
    // The scanner's own bound on nested flow collections (`[[[…`), above ours.
    let scanner_depth = is_scan_error(e, |kind| {
        matches!(
            kind,
            serde_saphyr::granit_parser::ErrorKind::RecursionLimitExceeded
        )
    });
    let text = match e {
        E::Budget {
            breach: B::Depth { .. },
            ..
        } => too_deep(),
        E::ExternalMessage { .. } if scanner_depth => too_deep(),
        E::Budget {
            breach: B::Events { .. } | B::Nodes { .. },
            ..
        } => too_many_events(),
        E::Budget {
            breach: B::Documents { .. },
            ..
        } => "a policy file holds exactly one YAML document".to_owned(),
        E::AliasReplayStackDepthExceeded { .. } => {
            format!("aliases refer to aliases more than {MAX_DEPTH} deep")
        }
        E::Budget {
            breach:
                B::Anchors { .. } | B::RecordedAnchorEvents { .. } | B::RecordedAnchorBytes { .. },
            ..
        } => "the document defines more anchors (`&name`) than the parser allows; a policy file needs none".to_owned(),
        E::Budget {
            breach: B::MergeKeys { .. },
            ..
        } => "the document uses more merge keys (`<<`) than the parser allows; a policy file needs none".to_owned(),
        E::Budget {
            breach: B::Aliases { .. } | B::AliasAnchorRatio { .. },
            ..
        } => "the document uses more aliases (`*name`) than the parser allows; a policy file needs none".to_owned(),
        E::AliasReplayLimitExceeded { .. }
        | E::AliasExpansionLimitExceeded { .. }
        | E::AliasReplayCounterOverflow { .. } => aliases_expand_too_far(),
        _ => return None,
    };
    Some(format!("invalid YAML: {text}"))
}

fn too_deep() -> String {
    format!(
        "mappings and lists nest more than {MAX_DEPTH} deep; a policy file needs {NEEDED_DEPTH}"
    )
}

fn too_many_events() -> String {
    format!(
        "the document has more than {MAX_EVENTS} YAML nodes (each scalar, alias, and start or end of a mapping or list counts one)"
    )
}

fn aliases_expand_too_far() -> String {
    format!(
        "aliases expand to more than {MAX_ALIAS_EVENTS} YAML nodes; a policy file needs no aliases"
    )
}

/// The parser's message without the position it appends (we print positions ourselves), and
/// with the wording of a limit [`limit_message`] does not know made plain.
fn first_line(message: &str) -> String {
    let mut line = message.lines().next().unwrap_or("syntax error").trim();
    if let Some(at) = line.rfind(" at line ") {
        line = &line[..at];
    }
    let line = if line.contains("Documents") {
        "a policy file holds exactly one YAML document"
    } else if line.contains("budget breached") || line.contains("limit exceeded") {
        "the document is larger than the parser's limits allow"
    } else {
        line
    };
    format!("invalid YAML: {line}")
}

fn loc_of_offset(prefix: &[u8]) -> Loc {
    let line = prefix.iter().filter(|b| **b == b'\n').count() + 1;
    let line_start = prefix
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |i| i + 1);
    let column = String::from_utf8_lossy(&prefix[line_start..])
        .chars()
        .count()
        + 1;
    Loc {
        line: u32::try_from(line).unwrap_or(u32::MAX),
        column: u32::try_from(column).unwrap_or(u32::MAX),
    }
}

fn node(spanned: Spanned<Value>) -> Node {
    let loc = |l: serde_saphyr::Location| Loc {
        line: clamp(l.line()),
        column: clamp(l.column()),
    };
    Node {
        value: as_written(spanned.value, loc(spanned.defined)),
        loc: loc(spanned.referenced),
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(i64::try_from(v).map_or(Value::Float(v as f64), Value::Int))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        Ok(i64::try_from(v).map_or(Value::Float(v as f64), Value::Int))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        Ok(i64::try_from(v).map_or(Value::Float(v as f64), Value::Int))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Value, E> {
        Ok(Value::Str(String::from_utf8_lossy(v).into_owned()))
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Value>>()? {
            items.push(node(item));
        }
        Ok(Value::Seq(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<Value>>()? {
            let value = map.next_value::<Spanned<Value>>()?;
            entries.push((node(key), node(value)));
        }
        Ok(Value::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(node: &Node) -> &[(Node, Node)] {
        match &node.value {
            Value::Map(m) => m,
            other => panic!("expected a map, got {other:?}"),
        }
    }

    /// The numbers and texts of a tree: `(whole numbers and floats left, texts)`.
    fn numbers_and_texts(node: &Node, numbers: &mut usize, texts: &mut Vec<String>) {
        match &node.value {
            Value::Int(_) | Value::Float(_) => *numbers += 1,
            Value::Str(s) => texts.push(s.clone()),
            Value::Seq(items) => {
                for item in items {
                    numbers_and_texts(item, numbers, texts);
                }
            }
            Value::Map(entries) => {
                for (key, value) in entries {
                    numbers_and_texts(key, numbers, texts);
                    numbers_and_texts(value, numbers, texts);
                }
            }
            Value::Null | Value::Bool(_) => {}
        }
    }

    /// The scan notes a number where the event parser says it starts, and the tree looks a
    /// node up where serde-saphyr says it was written: both must name the same place, or a
    /// note misses and the number is taken. Every number in these files is written in a form
    /// other than decimal digits, so none may be left a number, however the text before it on
    /// its line, its style, its tag or a copy of it by an alias or a merge key is made. (A
    /// parser upgrade that moved either place fails here.)
    #[test]
    fn every_number_not_in_decimal_digits_is_read_as_text_wherever_it_stands() {
        let prefixes = [
            "",
            "\u{feff}",
            "# é 日本 🦀\n",
            "x: \"é 日本 🦀\"\n",
            "x: [\t1a]\n",
            "? complex\n: key\n",
        ];
        let bodies = [
            "a: 0x1F7\n",
            "a: [0o17, +3, 0b11]\n",
            "a: {b: 0x1, c: [+2, {d: 0o3}]}\n",
            "a:\r\n  b: 0x10\r\n  c:\r\n    - +4\r\n",
            "a:\n  - b: \t+5\n  -   c:    0x6\n",
            "é: {日本: +7, 🦀: 0x8}\n",
            "a: !!int 0x9\nb: !int +10\n",
            "0x11: +12\n? +13\n: 0o14\n",
            "a: &n 0x15\nb: *n\nc: [*n, *n]\n",
            "a: &m {b: 0x16, c: [+17]}\nd: *m\ne: {<<: *m, f: 0o20}\ng: {<<: [*m]}\n",
            "a: [\n  0x18,\n  +19\n  ]\n",
            "a: {b: 0x1A\n  , c: +27}\n",
        ];
        for prefix in prefixes {
            for body in bodies {
                let text = format!("{prefix}{body}");
                let root = parse(text.as_bytes()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                let (mut numbers, mut texts) = (0, Vec::new());
                numbers_and_texts(&root, &mut numbers, &mut texts);
                assert_eq!(numbers, 0, "a number left in {text:?}: {root:?}");
                assert!(
                    texts
                        .iter()
                        .any(|t| crate::yaml_scan::whole_number_not_in_decimal(t)),
                    "{text:?}"
                );
            }
        }
    }

    #[test]
    fn every_node_knows_its_line_and_column() {
        let root = parse(b"version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n").unwrap();
        let top = map(&root);
        assert_eq!(top[0].0.loc, Loc { line: 1, column: 1 });
        assert_eq!(top[0].1.value, Value::Int(1));
        assert_eq!(
            top[0].1.loc,
            Loc {
                line: 1,
                column: 10
            }
        );
        let payments = &map(&top[1].1)[0];
        assert_eq!(payments.0.loc, Loc { line: 3, column: 3 });
        let attempts = &map(&payments.1)[0];
        assert_eq!(attempts.0.loc, Loc { line: 4, column: 5 });
        assert_eq!(attempts.1.value, Value::Int(4));
    }

    #[test]
    fn duplicate_keys_are_kept_for_the_checks_to_report() {
        let root = parse(b"a: 1\na: 2\n").unwrap();
        assert_eq!(map(&root).len(), 2);
    }

    #[test]
    fn scalars_get_their_yaml_types() {
        let root = parse(b"a: 2.0\nb: 100ms\nc: true\nd: ~\ne: [1, x]\n").unwrap();
        let kinds: Vec<_> = map(&root).iter().map(|(_, v)| v.value.kind()).collect();
        assert_eq!(
            kinds,
            ["a number", "a string", "a boolean", "null", "a list"]
        );
    }

    #[test]
    fn non_finite_floats_are_values_not_a_syntax_error() {
        let root = parse(b"a: .inf\nb: -.inf\nc: .nan\nd: 1e999\ne: '.inf'\n").unwrap();
        let values: Vec<_> = map(&root).iter().map(|(_, v)| &v.value).collect();
        assert_eq!(values[0], &Value::Float(f64::INFINITY));
        assert_eq!(values[1], &Value::Float(f64::NEG_INFINITY));
        assert!(matches!(values[2], Value::Float(f) if f.is_nan()));
        assert_eq!(values[3], &Value::Float(f64::INFINITY));
        assert_eq!(values[4], &Value::Str(".inf".to_owned()));
    }

    #[test]
    fn only_yaml_1_2_booleans_are_booleans() {
        let root = parse(b"a: true\nb: False\nc: yes\nd: off\ne: y\nf: NO\non: 1\n").unwrap();
        let values: Vec<_> = map(&root).iter().map(|(_, v)| v.value.clone()).collect();
        assert_eq!(
            values,
            [
                Value::Bool(true),
                Value::Bool(false),
                Value::Str("yes".into()),
                Value::Str("off".into()),
                Value::Str("y".into()),
                Value::Str("NO".into()),
                Value::Int(1),
            ]
        );
        assert_eq!(map(&root)[6].0.value, Value::Str("on".into()));
    }

    #[test]
    fn oversized_files_are_refused_before_parsing() {
        let big = vec![b'#'; MAX_FILE_BYTES + 1];
        let err = parse(&big).unwrap_err();
        assert!(err.message.contains("1 MiB"), "{err}");
    }

    #[test]
    fn invalid_utf8_is_located() {
        let err = parse(b"version: 1\nendpoints:\n  pay\xffments: {}\n").unwrap_err();
        assert_eq!(err.loc, Loc { line: 3, column: 6 });
        assert!(err.message.contains("UTF-8"));
    }

    /// One anchored value shared by many endpoints is fine: only what aliases replay is
    /// limited, not how many aliases there are to each anchor.
    #[test]
    fn one_anchor_may_be_shared_by_many_aliases() {
        let mut text = String::from(
            "version: 1\ndefaults: {idempotency_key_header: &k Idempotency-Key}\nendpoints:\n",
        );
        for i in 0..1_000 {
            text.push_str(&format!("  e{i}: {{idempotency_key_header: *k}}\n"));
        }
        assert!(parse(text.as_bytes()).is_ok());
    }

    #[test]
    fn syntax_errors_are_located() {
        let err = parse(b"version: 1\nendpoints: [\n").unwrap_err();
        assert!(err.loc.is_known());
        assert!(err.message.starts_with("invalid YAML"), "{err}");
    }

    /// A tab that indents a line a plain value could continue onto is reported on its own
    /// line and column, not where the value it would continue starts (the scanner's place).
    /// A key longer than YAML allows one written without `? ` (an endpoint name pasted from a
    /// URL, say): the parser's error says only that a `:` is not allowed there, so the cause
    /// is said after it; an error of that wording for another cause says nothing more.
    #[test]
    fn a_key_longer_than_yaml_allows_is_named_as_the_cause() {
        for key in ["n".repeat(1_030), format!("\"{}\"", "n".repeat(5_000))] {
            let src = format!("version: 1\nendpoints:\n  {key}: {{}}\n");
            let err = parse(src.as_bytes()).unwrap_err();
            assert!(err.message.ends_with(LONG_KEY), "{err}");
            assert_eq!(err.loc.line, 3, "{err}");
        }
        let err = parse(b"version: 1\nendpoints: a: b\n").unwrap_err();
        assert!(err.message.ends_with(NOT_ALLOWED_HERE), "{err}");
    }

    #[test]
    fn a_tab_that_indents_a_line_is_located_at_the_tab() {
        const TAB: &str = "invalid YAML: a tab indents this line (YAML indents with spaces)";
        let head = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";
        for (tail, line, column) in [
            // Blank lines between, and a tab first.
            ("\n\n\tdeadline: 1s\n", 7, 1),
            // Spaces, then the tab.
            ("    deadline: 1s\n  \tx: 1\n", 6, 3),
        ] {
            let err = parse(format!("{head}{tail}").as_bytes()).unwrap_err();
            assert_eq!(
                (err.loc, err.message.as_str()),
                (Loc { line, column }, TAB),
                "{tail:?}"
            );
        }
        // A line of blanks and tabs alone is no problem.
        assert!(parse(format!("{head}\t\n").as_bytes()).is_ok());
        // A tab right of the key's indentation continues the value, which the scanner takes:
        // the one reported is the tab on the line after.
        let continued = "version: 1\ndescription: a\n  \tb\n";
        assert!(parse(continued.as_bytes()).is_ok());
        let err = parse(format!("{continued}\tc: 1\n").as_bytes()).unwrap_err();
        assert_eq!(
            (err.loc, err.message.as_str()),
            (Loc { line: 4, column: 1 }, TAB)
        );
    }

    /// A tab that indents the line the scanner stops on (not one after a key's value) is said
    /// so, at the tab; another error on a line a tab begins keeps its own words (a quoted
    /// scalar's next line may begin with a tab).
    #[test]
    fn a_tab_that_indents_the_line_the_scanner_stops_on_is_said_so() {
        let err = parse(b"version: 1\nendpoints:\n\tpayments: {}\n").unwrap_err();
        assert_eq!(
            (err.loc, err.message.as_str()),
            (
                Loc { line: 3, column: 1 },
                "invalid YAML: a tab indents this line (YAML indents with spaces)"
            )
        );
        let src = "version: 1\nendpoints:\n  p:\n    description: \"a\n\tb\" x\n";
        let err = parse(src.as_bytes()).unwrap_err();
        assert_eq!(
            (err.loc, err.message.as_str()),
            (
                Loc { line: 5, column: 5 },
                "invalid YAML: invalid trailing content after double-quoted scalar"
            )
        );
    }

    /// A flow mapping or list not closed is reported where the parser gave up (a line after
    /// it), and the message says where its bracket opened, past quoted brackets and comments.
    #[test]
    fn an_unclosed_flow_bracket_is_named_where_it_opened() {
        for (src, hint) in [
            (
                "version: 1\nendpoints:\n  payments: {max_attempts: 3\n  other: {}\n",
                " (the `{` at 3:13 is not closed)",
            ),
            (
                "version: 1\nendpoints: # {not this}\n  payments: {description: \"a { b\", \
                 max_attempts: 3 # }\n  other: {}\n",
                " (the `{` at 3:13 is not closed)",
            ),
        ] {
            let err = parse(src.as_bytes()).unwrap_err();
            assert!(
                err.message
                    .starts_with("invalid YAML: while parsing a flow")
                    && err.message.ends_with(hint),
                "{src:?}: {err}"
            );
        }
        // A bracket closed by the other kind is reported at the bracket itself: nothing added.
        let src = "version: 1\nendpoints:\n  p: {retry_on: {http_status: [502, 503}, x: 1}\n";
        let err = parse(src.as_bytes()).unwrap_err();
        assert_eq!(
            (err.loc, err.message.as_str()),
            (
                Loc {
                    line: 3,
                    column: 31
                },
                "invalid YAML: mismatched bracket '[' closed by '}'"
            )
        );
        // Brackets and quotes that are text, not structure: inside a quoted scalar over two
        // lines, in a plain scalar, in a block scalar's content.
        for (src, hint) in [
            (
                "version: 1\nendpoints:\n  p: {description: \"first line\n    and { here\", max_attempts: 3\n  q: {}\n",
                " (the `{` at 3:6 is not closed)",
            ),
            (
                "version: 1\nendpoints:\n  p:\n    description: see [docs}\n  q: {max_attempts: 3\n  r: {}\n",
                " (the `{` at 5:6 is not closed)",
            ),
            (
                "version: 1\nendpoints:\n  p:\n    description: |\n      a [b}\n  q: {max_attempts: 3\n  r: {}\n",
                " (the `{` at 6:6 is not closed)",
            ),
            // An anchor before the bracket.
            (
                "version: 1\nendpoints:\n  p: &a {max_attempts: 3\n  q: {}\n",
                " (the `{` at 3:9 is not closed)",
            ),
            // Line breaks of a `\r` alone, as YAML reads them.
            (
                "version: 1\rendpoints:\r  p: {max_attempts: 3\r  q: {}\r",
                " (the `{` at 3:6 is not closed)",
            ),
        ] {
            let err = parse(src.as_bytes()).unwrap_err();
            assert!(err.message.ends_with(hint), "{src:?}: {err}");
        }
        // A closed bracket missing a comma between two entries, on one line or over several.
        for (src, hint) in [
            (
                "version: 1\nendpoints:\n  p: {max_attempts: 3 deadline: 1s}\n",
                " (the `{` at 3:6 closes at 3:35: is a `,` missing between two of its entries?)",
            ),
            (
                "version: 1\nendpoints:\n  p: {max_attempts: 3,\n    deadline: 1s\n    per_try_timeout: 1s,\n  }\n",
                " (the `{` at 3:6 closes at 6:3: is a `,` missing between two of its entries?)",
            ),
            // A tag before a quoted scalar, and keys and values quoted as JSON writes them.
            (
                "version: 1\nendpoints:\n  p: {description: !!str \"a {b\", max_attempts: 3 deadline: 1s}\n",
                " (the `{` at 3:6 closes at 3:62: is a `,` missing between two of its entries?)",
            ),
            (
                "version: 1\nendpoints:\n  p: {\"description\":\"x}\", \"max_attempts\": 3 \"deadline\": 1s}\n",
                " (the `{` at 3:6 closes at 3:59: is a `,` missing between two of its entries?)",
            ),
            // Columns in characters, as the parser's: `ééé` is three, not six bytes.
            (
                "version: 1\nendpoints:\n  p: {description: ééé, x: {a: 1 b: 2}}\n",
                " (the `{` at 3:28 closes at 3:38: is a `,` missing between two of its entries?)",
            ),
        ] {
            let err = parse(src.as_bytes()).unwrap_err();
            assert!(err.message.ends_with(hint), "{src:?}: {err}");
        }
    }

    /// A block mapping's missing key, on a line indented as no line above it, says so.
    #[test]
    fn a_line_indented_as_no_line_above_it_is_said_so() {
        let src = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n\n   # note\n   deadline: 1s\n";
        let err = parse(src.as_bytes()).unwrap_err();
        assert_eq!(err.loc.line, 7, "{err}");
        assert!(
            err.message.ends_with(
                "did not find expected key (this line is indented 3 spaces, as no line above it \
                 is: 0, 2, 4)"
            ),
            "{err}"
        );
        // A block scalar's content is text, an anchored one's and one on a list entry's line
        // too: its indent is not listed.
        let src = "version: 1\nendpoints:\n  p:\n    description: &d |\n       seven\n    max_attempts: 3\n   deadline: 1s\n";
        let err = parse(src.as_bytes()).unwrap_err();
        assert!(err.message.ends_with("is: 0, 2, 4)"), "{err}");
        let src = "version: 1\nendpoints:\n  p:\n    routes:\n      - description: |\n          text\n        match: {path: /a}\n     x: 1\n";
        let err = parse(src.as_bytes()).unwrap_err();
        assert!(err.message.ends_with("is: 0, 2, 4, 6, 8)"), "{err}");
        let src = "version: 1\nendpoints:\n  p:\n    description: |\n       seven\n    max_attempts: 3\n   deadline: 1s\n";
        let err = parse(src.as_bytes()).unwrap_err();
        assert!(err.message.ends_with("is: 0, 2, 4)"), "{err}");
        // Indented as a line above: nothing added.
        let err = parse(b"version: 1\nendpoints:\n  a: {}\n  - b\n").unwrap_err();
        assert!(!err.message.contains("as no line above"), "{err}");
    }

    const TOO_DEEP: &str =
        "invalid YAML: mappings and lists nest more than 24 deep; a policy file needs 6";
    const TOO_MANY_NODES: &str = "invalid YAML: the document has more than 200000 YAML nodes (each scalar, alias, and start or end of a mapping or list counts one)";
    const ALIASES: &str = "invalid YAML: aliases expand to more than 20000 YAML nodes; a policy file needs no aliases";

    #[test]
    fn deep_nesting_is_refused_as_such() {
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(parse(deep.as_bytes()).unwrap_err().message, TOO_DEEP);
        let deep_block: String = (0..200).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert_eq!(parse(deep_block.as_bytes()).unwrap_err().message, TOO_DEEP);
        // 24 levels are fine, 25 are not.
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(parse(nest(MAX_DEPTH).as_bytes()).is_ok());
        assert_eq!(
            parse(nest(MAX_DEPTH + 1).as_bytes()).unwrap_err().message,
            TOO_DEEP
        );
    }

    #[test]
    fn too_many_nodes_are_refused_as_such() {
        // 70,000 endpoints (about 900 KB): 210,000 events.
        let mut many = String::from("version: 1\nendpoints:\n");
        for i in 0..70_000 {
            many.push_str(&format!("  e{i}: {{}}\n"));
        }
        assert!(many.len() < MAX_FILE_BYTES);
        let err = parse(many.as_bytes()).unwrap_err();
        assert_eq!(err.message, TOO_MANY_NODES);
        assert!(err.loc.line > 60_000, "{:?}", err.loc);
        // One list of 250,000 statuses (1 MB).
        let mut list = String::from("a: [");
        list.push_str(&"500,".repeat(250_000));
        list.push_str("]\n");
        assert!(list.len() < MAX_FILE_BYTES);
        assert_eq!(parse(list.as_bytes()).unwrap_err().message, TOO_MANY_NODES);
    }

    /// A long path prefix anchored once and repeated as each route's: the copies' text is
    /// refused past 8 MiB, at the alias that passes it, before any check reads them.
    #[test]
    fn aliases_repeating_long_text_are_refused_as_such() {
        let mut src = format!(
            "version: 1\nendpoints:\n  a:\n    routes:\n      - match: {{path_prefix: &p \"/{}\"}}\n",
            "%zz".repeat(14_000)
        );
        for _ in 0..1_560 {
            src.push_str("      - match: {path_prefix: *p}\n");
        }
        assert!(src.len() < MAX_FILE_BYTES);
        let err = parse(src.as_bytes()).unwrap_err();
        assert_eq!(
            (err.loc, err.message.as_str()),
            (
                Loc {
                    line: 205,
                    column: 30
                },
                "invalid YAML: aliases repeat more than 8388608 bytes (8 MiB) of text; a policy \
                 file needs no aliases"
            )
        );
    }

    /// The bound on what aliases replay is README's 20,000 nodes, counted as the scan counts
    /// them (a mapping one node), and refused at the alias that passes it: 2,700 copies of a
    /// mapping of three entries (18,900 nodes, 21,600 events) are taken.
    #[test]
    fn the_alias_bound_counts_nodes_and_is_refused_at_the_alias() {
        let copies = |n: usize| {
            let mut y = String::from("x: &m {a: 1, b: 2, c: 3}\nl:\n");
            for _ in 0..n {
                y.push_str("- *m\n");
            }
            y
        };
        assert!(parse(copies(2_700).as_bytes()).is_ok());
        let err = parse(copies(2_900).as_bytes()).unwrap_err();
        assert_eq!(err.message, ALIASES);
        // 7 nodes a copy: the 2,858th passes 20,000 (the first alias is on line 3).
        assert_eq!(
            err.loc,
            Loc {
                line: 2_860,
                column: 3
            }
        );
    }

    #[test]
    fn alias_bombs_are_refused() {
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let prev = (b'a' + i - 1) as char;
            let cur = (b'a' + i) as char;
            bomb.push_str(&format!(
                "{cur}: &{cur} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        let err = parse(bomb.as_bytes()).unwrap_err();
        assert_eq!(err.message, ALIASES);
        // Aliases that nest lists past the depth limit: the depth is what is refused.
        let mut chain = String::from("a0: &a0 [x]\n");
        for i in 1..40 {
            chain.push_str(&format!("a{i}: &a{i} [*a{}]\n", i - 1));
        }
        assert_eq!(parse(chain.as_bytes()).unwrap_err().message, TOO_DEEP);
    }

    #[test]
    fn anchors_and_merge_keys_past_the_limits_are_refused_as_such() {
        // 50,001 anchors and no alias (about 1 MB with short lines, under the node limit).
        let mut anchors = String::from("l:\n");
        for i in 0..50_001 {
            anchors.push_str(&format!("- &{i} 0\n"));
        }
        assert!(anchors.len() < MAX_FILE_BYTES);
        assert_eq!(
            parse(anchors.as_bytes()).unwrap_err().message,
            "invalid YAML: the document defines more anchors (`&name`) than the parser allows; a policy file needs none"
        );
        // 10,001 merge keys of inline mappings (no alias to expand).
        let mut merges = String::from("l:\n");
        for _ in 0..10_001 {
            merges.push_str("- <<: {x: 1}\n");
        }
        assert_eq!(
            parse(merges.as_bytes()).unwrap_err().message,
            "invalid YAML: the document uses more merge keys (`<<`) than the parser allows; a policy file needs none"
        );
    }

    #[test]
    fn multiple_documents_are_refused() {
        assert_eq!(
            parse(b"a: 1\n---\nb: 2\n").unwrap_err().message,
            "invalid YAML: a policy file holds exactly one YAML document"
        );
    }
}
