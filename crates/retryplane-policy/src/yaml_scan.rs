//! A quick first pass over the YAML parser's events that finds hostile input before the full pass.
//!
//! Why a pass of our own: the full pass ([`crate::yaml::parse`], serde-saphyr deserializing every
//! node into a located value) enforces the same limits, but it costs about three to four times the
//! parser's bare event stream, and it finds a limit only when it gets there. An alias bomb or a
//! deep nest placed after 700 KB of valid YAML took about 0.2 s to refuse. This pass reads the same
//! parser's events (`granit-parser`, which serde-saphyr itself uses) and keeps only counters: the
//! nesting depth, the number of events, and for each anchor how many nodes and how many levels its
//! value would add where an alias repeats it. Nothing is built, nothing is expanded.
//!
//! serde-saphyr's own `budget::check_yaml_budget` is a similar event pass for depth and counts,
//! but it does not account alias expansion and reports no place, so this one does all three in
//! one pass instead of running that and a second pass for aliases.
//!
//! It decides only the three limits a hostile file uses to cost time or memory: nesting depth,
//! events, and alias expansion. Everything else (syntax errors, several documents, the anchor,
//! alias and merge-key counts) is left to the full pass, which reports it in its own words; on a
//! syntax error this pass stops and says nothing.

use serde_saphyr::granit_parser::{Event, Parser};

use crate::yaml::{Loc, MAX_ALIAS_EVENTS, MAX_DEPTH, MAX_EVENTS};

/// Which limit a file breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Breach {
    /// Mappings and lists nest deeper than [`MAX_DEPTH`], directly or through an alias.
    Depth,
    /// More than [`MAX_EVENTS`] events.
    Events,
    /// Aliases would replay more than [`MAX_ALIAS_EVENTS`] nodes in all.
    Aliases,
}

/// What an anchored value adds where an alias repeats it.
#[derive(Clone, Copy)]
struct Anchored {
    /// Nodes (scalars, lists and mappings) in the value, aliases inside it counted expanded.
    nodes: u64,
    /// Levels of lists and mappings in the value: 0 for a scalar.
    height: usize,
}

/// An open list or mapping.
struct Open {
    /// The anchor id it defines, 0 for none.
    anchor: usize,
    /// `nodes` when it started.
    nodes_before: u64,
    /// The deepest level reached inside it so far, relative to it (1 for itself).
    height: usize,
}

/// Scans `text` and returns the first limit it breaks, with where, or `None` when it breaks none
/// of the three (or is not valid YAML, which the full pass reports).
pub(crate) fn scan(text: &str) -> Option<(Breach, Loc)> {
    let mut events: usize = 0;
    // Nodes the document would have with every alias expanded.
    let mut nodes: u64 = 0;
    // Nodes replayed by aliases.
    let mut replayed: u64 = 0;
    // Indexed by anchor id (the parser numbers anchors from 1 in order); `None` until the
    // anchored value is complete.
    let mut anchors: Vec<Option<Anchored>> = Vec::new();
    let mut open: Vec<Open> = Vec::new();
    for item in Parser::new_from_str(text) {
        let Ok((event, span)) = item else {
            return None;
        };
        let at = || Loc {
            line: u32::try_from(span.start.line()).unwrap_or(u32::MAX),
            column: u32::try_from(span.start.col().saturating_add(1)).unwrap_or(u32::MAX),
        };
        // The value (scalar or repeated by an alias) just completed: its nodes and height.
        let completed: Option<(usize, Anchored)> = match event {
            Event::Scalar(_, _, anchor, _) => {
                nodes += 1;
                Some((
                    anchor,
                    Anchored {
                        nodes: 1,
                        height: 0,
                    },
                ))
            }
            Event::Alias(id) => {
                let Some(value) = anchors.get(id).copied().flatten() else {
                    // An alias to an anchor still open (a recursive value) or unknown: the full
                    // pass refuses it.
                    return None;
                };
                if open.len() + value.height > MAX_DEPTH {
                    return Some((Breach::Depth, at()));
                }
                replayed = replayed.saturating_add(value.nodes);
                if replayed > MAX_ALIAS_EVENTS as u64 {
                    return Some((Breach::Aliases, at()));
                }
                nodes = nodes.saturating_add(value.nodes);
                Some((0, value))
            }
            Event::SequenceStart(_, anchor, _) | Event::MappingStart(_, anchor, _) => {
                if open.len() >= MAX_DEPTH {
                    return Some((Breach::Depth, at()));
                }
                open.push(Open {
                    anchor,
                    nodes_before: nodes,
                    height: 1,
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
                    },
                )
            }),
            _ => continue,
        };
        events += 1;
        if events > MAX_EVENTS {
            return Some((Breach::Events, at()));
        }
        if let Some((anchor, value)) = completed {
            if let Some(parent) = open.last_mut() {
                parent.height = parent.height.max(value.height + 1);
            }
            if anchor > 0 {
                if anchors.len() <= anchor {
                    anchors.resize(anchor + 1, None);
                }
                anchors[anchor] = Some(value);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breach(text: &str) -> Option<Breach> {
        scan(text).map(|(b, _)| b)
    }

    #[test]
    fn valid_files_pass() {
        let example = include_str!("../../../config/policies.yaml");
        assert_eq!(scan(example), None);
        assert_eq!(breach("a: &x {b: [1, 2]}\nc: *x\nd: *x\n"), None);
    }

    #[test]
    fn depth_counts_lists_and_mappings() {
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(breach(&nest(MAX_DEPTH)), None);
        assert_eq!(breach(&nest(MAX_DEPTH + 1)), Some(Breach::Depth));
        let block: String = (0..30).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        let (b, at) = scan(&block).unwrap();
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
        let (b, at) = scan(&deep).unwrap();
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
        let (b, at) = scan(&y).unwrap();
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
        assert_eq!(scan("a: [\n"), None);
        assert_eq!(scan("a: *nowhere\n"), None);
        // An alias to a value still open (a recursive value), after a later anchor completed.
        assert_eq!(scan("a: &a [&b x, *b, *a]\n"), None);
    }
}
