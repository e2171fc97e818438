//! A quick first pass over the YAML parser's events that finds hostile input before the full pass.
//!
//! Why a pass of our own: the full pass ([`crate::yaml::parse`], serde-saphyr deserializing every
//! node into a located value) enforces the same limits, but it costs about three to four times the
//! parser's bare event stream, and it finds a limit only when it gets there. An alias bomb or a
//! deep nest placed after 700 KB of valid YAML took about 0.2 s to refuse. This pass reads the same
//! parser's events (`granit-parser`, which serde-saphyr itself uses) and keeps only counters: the
//! nesting depth, the number of events, and for each anchor how many nodes, how many levels and
//! how many bytes of scalar text its value would add where an alias repeats it. Nothing is built,
//! nothing is expanded.
//!
//! serde-saphyr's own `budget::check_yaml_budget` is a similar event pass for depth and counts,
//! but it does not account alias expansion and reports no place, so this one does all three in
//! one pass instead of running that and a second pass for aliases.
//!
//! It refuses only the limits a hostile file uses to cost time or memory: nesting depth, events,
//! and alias expansion (in nodes and in bytes of text). Everything else (syntax errors, several documents, the anchor,
//! alias and merge-key counts) is left to the full pass, which reports it in its own words; on a
//! syntax error this pass stops and says nothing.
//!
//! On the way it also notes ([`Notes`]) what only the source shows and the full pass's values
//! lose, for [`crate::yaml::parse`] to act on after that pass: which whole numbers were not
//! written in decimal digits, and a second merge key in one mapping.

use serde_saphyr::granit_parser::{Event, Parser, ScalarStyle, Tag};

use crate::yaml::{Loc, MAX_ALIAS_BYTES, MAX_ALIAS_EVENTS, MAX_DEPTH, MAX_EVENTS};

/// Which limit a file breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Breach {
    /// Mappings and lists nest deeper than [`MAX_DEPTH`], directly or through an alias.
    Depth,
    /// More than [`MAX_EVENTS`] events.
    Events,
    /// Aliases would replay more than [`MAX_ALIAS_EVENTS`] nodes in all.
    Aliases,
    /// Aliases would replay more than [`MAX_ALIAS_BYTES`] bytes of scalar text in all.
    AliasBytes,
}

/// What an anchored value adds where an alias repeats it.
#[derive(Clone, Copy)]
struct Anchored {
    /// Nodes (scalars, lists and mappings) in the value, aliases inside it counted expanded.
    nodes: u64,
    /// Levels of lists and mappings in the value: 0 for a scalar.
    height: usize,
    /// Bytes of scalar text (keys included) in the value, aliases inside it counted expanded.
    bytes: u64,
}

/// An open list or mapping.
struct Open {
    /// The anchor id it defines, 0 for none.
    anchor: usize,
    /// `nodes` when it started.
    nodes_before: u64,
    /// `bytes` when it started.
    bytes_before: u64,
    /// The deepest level reached inside it so far, relative to it (1 for itself).
    height: usize,
    /// Whether it is a mapping (whose children are key, value, key, value, ...).
    mapping: bool,
    /// Children completed so far.
    children: u64,
    /// Where its first merge key (`<<`) stands, if it has one.
    merged: Option<Loc>,
    /// Where it starts.
    at: Loc,
}

/// A merge key (`<<`) written a second time in one mapping, which the parser takes as a second
/// merge where any other key written twice is a duplicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MergeAgain {
    /// Where the second one stands.
    pub(crate) at: Loc,
    /// Where the first one stands.
    pub(crate) first: Loc,
    /// Where the mapping starts (the place of its node in the parsed tree).
    pub(crate) mapping: Loc,
}

/// What the source shows of a file's values that the parsed values lose.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Notes {
    /// Scalars whose text is a whole number in a form other than decimal digits (`0x1F7`,
    /// `0o17`, `0b11`, `+3`: see [`whole_number_not_in_decimal`]), each with where it is
    /// written and its text (cut past [`MAX_NOTED`] bytes), in the file's order. Noted whatever
    /// their style or tag: `yaml::as_written` reads as the text only a node the parser made a
    /// number, wherever an alias or a merge key copies it. (The integers of YAML 1.2's JSON
    /// schema are decimal digits with an optional `-`: the form a policy writes.)
    pub(crate) not_decimal: Vec<(Loc, String)>,
    /// Each merge key (`<<`) after the first in a mapping, in the file's order.
    pub(crate) merge_again: Vec<MergeAgain>,
}

/// The most of a noted scalar's text that a note keeps: more than any whole number a policy
/// holds or any endpoint name (128), so that only a hostile file's are cut.
const MAX_NOTED: usize = 256;

/// `text` as a note keeps it: whole up to [`MAX_NOTED`] bytes; past it, its first
/// [`MAX_NOTED`] bytes and `…`. Each node the full pass makes of a noted scalar gets a copy of
/// its note, and aliases may repeat a scalar of most of the file's 1 MiB thousands of times
/// (the full pass refuses that, but only once it has built many of them).
fn noted(text: &str) -> String {
    crate::diag::cut_marked(text, MAX_NOTED).into_owned()
}

/// Whether `tag` is YAML's `!!merge` (`tag:yaml.org,2002:merge`, written either way), which
/// makes a `<<` key a merge key whatever its style.
fn is_merge_tag(tag: &Tag) -> bool {
    const MERGE: &str = "tag:yaml.org,2002:merge";
    let (handle, suffix) = (tag.handle(), tag.suffix());
    // A verbatim tag (`!<tag:yaml.org,2002:merge>`) may come whole in either part.
    MERGE
        .strip_prefix(handle)
        .is_some_and(|rest| rest == suffix)
}

/// Whether a scalar's text is a whole number in a form other than decimal digits that the
/// YAML reader still takes as one: a radix prefix (`0x` of YAML 1.1 and 1.2, `0o` of YAML
/// 1.2, `0b` of YAML 1.1), either sign, or a `+` sign before decimal digits.
pub(crate) fn whole_number_not_in_decimal(text: &str) -> bool {
    let (signed, digits) = match text.strip_prefix(['+', '-']) {
        Some(rest) => (text.starts_with('+'), rest),
        None => (false, text),
    };
    match radix_of(digits) {
        Some((radix, body)) => !body.is_empty() && body.chars().all(|c| c.is_digit(radix)),
        None => signed && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// The radix a whole number's prefix names (`0x`, `0o`, `0b`, either case) and the digits after
/// it; `None` without one.
fn radix_of(digits: &str) -> Option<(u32, &str)> {
    // Every scalar of a file comes here: no allocation.
    let radix = match digits.as_bytes() {
        [b'0', b'x' | b'X', ..] => 16,
        [b'0', b'o' | b'O', ..] => 8,
        [b'0', b'b' | b'B', ..] => 2,
        _ => return None,
    };
    Some((radix, digits.get(2..).unwrap_or("")))
}

/// The value of a whole number [`whole_number_not_in_decimal`] takes, in decimal digits as a
/// policy writes it (`0x1F7` is `503`, `+3` is `3`); `None` for any other text, or one past
/// `i128`.
pub(crate) fn in_decimal(text: &str) -> Option<String> {
    if !whole_number_not_in_decimal(text) {
        return None;
    }
    let (negative, digits) = match text.strip_prefix(['+', '-']) {
        Some(rest) => (text.starts_with('-'), rest),
        None => (false, text),
    };
    let (radix, body) = radix_of(digits).unwrap_or((10, digits));
    let magnitude = i128::from_str_radix(body, radix).ok()?;
    Some(if negative { -magnitude } else { magnitude }.to_string())
}

/// Scans `text` and returns the first limit it breaks, with where, or what it noted when it
/// breaks none of the three. A file that is not valid YAML (which the full pass reports) gets
/// what was noted before the fault.
pub(crate) fn scan(text: &str) -> Result<Notes, (Breach, Loc)> {
    let mut notes = Notes::default();
    let mut events: usize = 0;
    // Nodes the document would have with every alias expanded.
    let mut nodes: u64 = 0;
    // Nodes replayed by aliases.
    let mut replayed: u64 = 0;
    // Bytes of scalar text the document would hold with every alias expanded, and those of
    // them replayed by aliases: every check after the parse reads each copy (a 42 KB anchored
    // path prefix repeated by 1,560 aliases took seconds to check), so a copy costs its bytes,
    // not one node.
    let mut bytes: u64 = 0;
    let mut replayed_bytes: u64 = 0;
    // Indexed by anchor id (the parser numbers anchors from 1 in order); `None` until the
    // anchored value is complete.
    let mut anchors: Vec<Option<Anchored>> = Vec::new();
    let mut open: Vec<Open> = Vec::new();
    for item in Parser::new_from_str(text) {
        let Ok((event, span)) = item else {
            return Ok(notes);
        };
        let at = || Loc {
            line: u32::try_from(span.start.line()).unwrap_or(u32::MAX),
            column: u32::try_from(span.start.col().saturating_add(1)).unwrap_or(u32::MAX),
        };
        // The value (scalar or repeated by an alias) just completed: its nodes and height.
        let completed: Option<(usize, Anchored)> = match event {
            Event::Scalar(ref value, style, anchor, ref tag) => {
                // Whatever its style or tag: only a node the parser made a number is read as
                // the text noted (`yaml::as_written`), so `'0x3'` and `!!str 0x3` stay text,
                // and `!!int 0x3` or a local tag's `!int 0x3` are held to the rule too.
                if whole_number_not_in_decimal(value) {
                    notes.not_decimal.push((at(), noted(value)));
                } else if value == "<<"
                    // A merge key as the parser takes one: plain, or tagged `!!merge`.
                    && (style == ScalarStyle::Plain && tag.is_none()
                        || tag.as_deref().is_some_and(is_merge_tag))
                    && let Some(map) = open.last_mut()
                    && map.mapping
                    && map.children % 2 == 0
                {
                    match map.merged {
                        Some(first) => notes.merge_again.push(MergeAgain {
                            at: at(),
                            first,
                            mapping: map.at,
                        }),
                        None => map.merged = Some(at()),
                    }
                }
                nodes += 1;
                let len = value.len() as u64;
                bytes = bytes.saturating_add(len);
                Some((
                    anchor,
                    Anchored {
                        nodes: 1,
                        height: 0,
                        bytes: len,
                    },
                ))
            }
            Event::Alias(id) => {
                let Some(value) = anchors.get(id).copied().flatten() else {
                    // An alias to an anchor still open (a recursive value) or unknown: the full
                    // pass refuses it.
                    return Ok(notes);
                };
                if open.len() + value.height > MAX_DEPTH {
                    return Err((Breach::Depth, at()));
                }
                replayed = replayed.saturating_add(value.nodes);
                if replayed > MAX_ALIAS_EVENTS as u64 {
                    return Err((Breach::Aliases, at()));
                }
                replayed_bytes = replayed_bytes.saturating_add(value.bytes);
                if replayed_bytes > MAX_ALIAS_BYTES as u64 {
                    return Err((Breach::AliasBytes, at()));
                }
                nodes = nodes.saturating_add(value.nodes);
                bytes = bytes.saturating_add(value.bytes);
                Some((0, value))
            }
            Event::SequenceStart(_, anchor, _) | Event::MappingStart(_, anchor, _) => {
                if open.len() >= MAX_DEPTH {
                    return Err((Breach::Depth, at()));
                }
                open.push(Open {
                    anchor,
                    nodes_before: nodes,
                    bytes_before: bytes,
                    height: 1,
                    mapping: matches!(event, Event::MappingStart(..)),
                    children: 0,
                    merged: None,
                    at: at(),
                });
                nodes += 1;
                None
            }
            Event::SequenceEnd | Event::MappingEnd => open.pop().map(|closed| {
                (
                    closed.anchor,
                    Anchored {
                        nodes: nodes - closed.nodes_before,
                        height: closed.height,
                        bytes: bytes - closed.bytes_before,
                    },
                )
            }),
            _ => continue,
        };
        events += 1;
        if events > MAX_EVENTS {
            return Err((Breach::Events, at()));
        }
        if let Some((anchor, value)) = completed {
            if let Some(parent) = open.last_mut() {
                parent.height = parent.height.max(value.height + 1);
                parent.children += 1;
            }
            if anchor > 0 {
                if anchors.len() <= anchor {
                    anchors.resize(anchor + 1, None);
                }
                anchors[anchor] = Some(value);
            }
        }
    }
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breach(text: &str) -> Option<Breach> {
        scan(text).err().map(|(b, _)| b)
    }

    #[test]
    fn valid_files_pass() {
        let example = include_str!("../../../config/policies.yaml");
        assert_eq!(scan(example), Ok(Notes::default()));
        assert_eq!(breach("a: &x {b: [1, 2]}\nc: *x\nd: *x\n"), None);
    }

    #[test]
    fn depth_counts_lists_and_mappings() {
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(breach(&nest(MAX_DEPTH)), None);
        assert_eq!(breach(&nest(MAX_DEPTH + 1)), Some(Breach::Depth));
        let block: String = (0..30).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        let (b, at) = scan(&block).unwrap_err();
        assert_eq!(b, Breach::Depth);
        assert_eq!(at.line, 25);
    }

    #[test]
    fn depth_counts_through_aliases() {
        // Each anchor nests the previous one a level deeper: a20 is 21 levels high, and the
        // alias to it stands 4 levels deep.
        let mut chain = String::from("a0: &a0 [x]\n");
        for i in 1..=20 {
            chain.push_str(&format!("a{i}: &a{i} [*a{}]\n", i - 1));
        }
        let ok = format!("{chain}b: [[*a20]]\n");
        assert_eq!(breach(&ok), None);
        let deep = format!("{chain}b: [[[*a20]]]\n");
        let (b, at) = scan(&deep).unwrap_err();
        assert_eq!((b, at.line), (Breach::Depth, 22));
    }

    #[test]
    fn alias_expansion_is_counted_in_nodes() {
        // 10 scalars and their list: 11 nodes per alias.
        let mut y = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\nb:\n");
        let allowed = MAX_ALIAS_EVENTS / 11;
        for _ in 0..allowed {
            y.push_str("- *a\n");
        }
        assert_eq!(breach(&y), None);
        y.push_str("- *a\n");
        let (b, at) = scan(&y).unwrap_err();
        assert_eq!(b, Breach::Aliases);
        assert_eq!(at.line as usize, 3 + allowed);
        // Nested: each level holds ten aliases of the one before.
        let mut bomb = String::from("l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n");
        for level in 1..5 {
            let refs = vec![format!("*l{}", level - 1); 10].join(", ");
            bomb.push_str(&format!("l{level}: &l{level} [{refs}]\n"));
        }
        assert_eq!(breach(&bomb), Some(Breach::Aliases));
    }

    /// A copy costs its text: a long anchored scalar (or a mapping holding one, or a key)
    /// repeated by aliases is refused once the copies pass [`MAX_ALIAS_BYTES`] in all, far
    /// below the node limit; a value repeated with the bytes under it is not.
    #[test]
    fn alias_expansion_is_counted_in_bytes_of_text() {
        let long = "x".repeat(320 * 1024);
        // 25 copies of 320 KiB are 8,000 KiB, within the bound; the 26th passes it.
        let copies = |n: usize, anchored: &str, alias: &str| {
            let mut y = format!("a: &a {anchored}\nb:\n");
            for _ in 0..n {
                y.push_str(&format!("- {alias}\n"));
            }
            y
        };
        assert_eq!(breach(&copies(25, &long, "*a")), None);
        let (b, at) = scan(&copies(26, &long, "*a")).unwrap_err();
        assert_eq!((b, at.line), (Breach::AliasBytes, 28));
        // Inside a mapping, key and value text both count.
        let map = format!("{{k: {long}}}");
        assert_eq!(breach(&copies(25, &map, "*a")), None);
        assert_eq!(breach(&copies(26, &map, "*a")), Some(Breach::AliasBytes));
        // An alias inside the anchored value counts expanded: `c` holds two copies of `a`.
        let nested = format!("a: &a {long}\nc: &c [*a, *a]\nd: [*c, *c, *c, *c, *c, *c]\n");
        assert_eq!(breach(&nested), None, "2 + 12 copies");
        let more = format!("{nested}e: [*c, *c, *c, *c, *c, *c]\n");
        assert_eq!(breach(&more), Some(Breach::AliasBytes), "2 + 24 copies");
        // Used as a key.
        let keys: String = (0..26).map(|i| format!("  ? *a\n  : {i}\n")).collect();
        let as_keys = format!("a: &a {long}\nb:\n{keys}");
        assert_eq!(breach(&as_keys), Some(Breach::AliasBytes));
    }

    #[test]
    fn events_are_counted() {
        let mut list = String::from("a: [");
        list.push_str(&"5,".repeat(MAX_EVENTS));
        list.push_str("]\n");
        assert_eq!(breach(&list), Some(Breach::Events));
        let mut fits = String::from("a: [");
        // The mapping's start, its key, the list's start and end, the mapping's end: 5 events.
        fits.push_str(&"5,".repeat(MAX_EVENTS - 5));
        fits.push_str("]\n");
        assert_eq!(breach(&fits), None);
    }

    #[test]
    fn syntax_errors_are_left_to_the_full_pass() {
        assert_eq!(breach("a: [\n"), None);
        assert_eq!(breach("a: *nowhere\n"), None);
        // An alias to a value still open (a recursive value), after a later anchor completed.
        assert_eq!(breach("a: &a [&b x, *b, *a]\n"), None);
    }

    fn not_decimal(text: &str) -> Vec<(u32, u32, String)> {
        let notes = scan(text).unwrap_or_default();
        notes
            .not_decimal
            .into_iter()
            .map(|(at, t)| (at.line, at.column, t))
            .collect()
    }

    #[test]
    fn whole_numbers_not_in_decimal_digits_are_noted_where_they_stand() {
        let text = "a: 0x1F7\nb: [0o17, 0b11, +3, -0x3, 0X1f]\nc: {d: 0xZ, e: 0x, f: +3.5}\n";
        assert_eq!(
            not_decimal(text),
            [
                (1, 4, "0x1F7".to_owned()),
                (2, 5, "0o17".to_owned()),
                (2, 11, "0b11".to_owned()),
                (2, 17, "+3".to_owned()),
                (2, 21, "-0x3".to_owned()),
                (2, 27, "0X1f".to_owned()),
            ]
        );
        // Whatever the style or tag (the full pass reads as text only a number).
        assert_eq!(
            not_decimal("a: [!!int 0x3, '+4', !foo 0b1, !!int 5, !!str 6]\n"),
            [
                (1, 11, "0x3".to_owned()),
                (1, 16, "+4".to_owned()),
                (1, 27, "0b1".to_owned()),
            ]
        );
        // Decimal digits, signed with `-` or not, and text are not noted.
        assert_eq!(not_decimal("a: [3, -3, 0, 03, 3.0, 1e3, x0x3, 0x3y]\n"), []);
        // Where it is written, not where an alias uses it; a key is noted as a value is.
        assert_eq!(
            not_decimal("a: &n 0x3\nb: *n\n+7: x\n"),
            [(1, 7, "0x3".to_owned()), (3, 1, "+7".to_owned())]
        );
    }

    #[test]
    fn whole_numbers_not_in_decimal_digits_are_given_in_decimal() {
        for (text, decimal) in [
            ("0x1F7", Some("503")),
            ("0X1f7", Some("503")),
            ("0o17", Some("15")),
            ("0b11", Some("3")),
            ("+3", Some("3")),
            ("-0x3", Some("-3")),
            ("+0x10", Some("16")),
            ("3", None),
            ("-3", None),
            ("0x", None),
            ("0o8", None),
            ("+3.5", None),
            ("0x1_0", None),
        ] {
            assert_eq!(in_decimal(text).as_deref(), decimal, "{text}");
        }
        // Past i128: noted, but with no decimal to offer.
        let huge = format!("0x{}", "F".repeat(40));
        assert!(whole_number_not_in_decimal(&huge));
        assert_eq!(in_decimal(&huge), None);
    }

    #[test]
    fn a_long_scalar_is_noted_cut() {
        // A whole number of most of the file: its note keeps 256 bytes of it, which each node
        // the full pass makes of it (an alias's copy too) copies.
        let long = format!("0x{}", "f".repeat(900_000));
        let notes = scan(&format!("s: &s {long}\nl: [*s]\n")).unwrap_or_default();
        assert_eq!(
            notes.not_decimal,
            [(
                Loc { line: 1, column: 7 },
                format!("{}…", &long[..MAX_NOTED])
            )]
        );
        assert_eq!(noted("+3"), "+3");
    }

    #[test]
    fn a_second_merge_key_in_one_mapping_is_noted() {
        let merge_again = |text: &str| {
            let notes = scan(text).unwrap_or_default();
            notes.merge_again.first().map(|m| m.at)
        };
        let twice = "a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  z: 3\n  <<: *b\n";
        let loc = |line, column| Loc { line, column };
        assert_eq!(
            scan(twice).unwrap_or_default().merge_again,
            [MergeAgain {
                at: loc(6, 3),
                first: loc(4, 3),
                mapping: loc(4, 3),
            }]
        );
        // Every one, in every mapping.
        let thrice = "a: &a {x: 1}\nb: {<<: *a, <<: *a, <<: *a}\nc: [{<<: *a, <<: *a}]\n";
        let ats: Vec<Loc> = scan(thrice)
            .unwrap_or_default()
            .merge_again
            .iter()
            .map(|m| m.at)
            .collect();
        assert_eq!(ats, [loc(2, 13), loc(2, 21), loc(3, 14)]);
        assert_eq!(
            merge_again("a: &a {x: 1}\nc: {<<: *a, <<: *a}\n"),
            Some(Loc {
                line: 2,
                column: 13
            })
        );
        // One merge key per mapping, a list of them, and `<<` as a value or quoted are fine.
        let once = "a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: *a}\nd: {<<: *b}\ne: {<<: [*a, *b]}\n";
        assert_eq!(merge_again(once), None);
        assert_eq!(merge_again("a: {b: <<, c: <<}\nd: ['<<', '<<']\n"), None);
        assert_eq!(merge_again("a: {<<: {x: 1}, '<<': 2}\n"), None);
        // A merge key inside a merged mapping's own value is in another mapping.
        assert_eq!(merge_again("a: {<<: {<<: {x: 1}}}\n"), None);
        // Tagged `!!merge`, even quoted, a `<<` key is a merge key for the parser too; another
        // tag makes it text.
        assert_eq!(
            merge_again("a: &a {x: 1}\nb: {<<: *a, !!merge <<: *a}\n"),
            Some(Loc {
                line: 2,
                column: 21
            })
        );
        assert_eq!(
            merge_again("a: &a {x: 1}\nb: {!!merge '<<': *a, <<: *a}\n"),
            Some(Loc {
                line: 2,
                column: 23
            })
        );
        assert_eq!(merge_again("a: {<<: {x: 1}, !!str <<: 2}\n"), None);
    }
}
