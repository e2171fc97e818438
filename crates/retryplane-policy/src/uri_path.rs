//! How a route's `path_prefix` is compared with a request's path.
//!
//! Two spellings of one path are one path (RFC 3986 §6.2.2): a percent-encoded unreserved
//! character (`%61`) is that character (`a`), the hex digits of an escape are compared without
//! case (`%2f` is `%2F`), and a non-ASCII byte written raw (`ü` in a policy file, or in a path
//! given to `CallMeta::http`) is its escape (`%C3%BC`, as a request built from a URL carries
//! it). So `{path_prefix: /v1/charges}` matches `/v1/ch%61rges` as well, and `/über` matches
//! `/%C3%BCber`. An escaped reserved character stays distinct from the character itself
//! (`%2F` is not a `/`), as the RFC has it. A `%` not followed by two hex digits is a plain `%`
//! (`validate` warns about one in a prefix: a request carries a `%` as `%25`, which is not a
//! plain `%`). Dot segments (`/a/../b`) are not compared here: a call's path is resolved first
//! ([`as_served`]), as the server it goes to reads it.
//!
//! Written here rather than taken from a URL crate: the comparison runs on every call for
//! every route tried, and it needs no allocation and no decoding at all for the paths nearly
//! every request has (no `%`, ASCII only), which a general decoder does not promise.

use std::borrow::Cow;

use crate::document::bytes_eq;

/// Whether `path` starts with `prefix`, as the paths they name (see the module docs).
///
/// Inlined into route matching: the common cases (the bytes agree; or neither side has a `%`
/// or a non-ASCII byte where they are compared) cost a comparison and a short scan.
#[inline(always)]
pub fn starts_with(path: &str, prefix: &str) -> bool {
    let (p, x) = (path.as_bytes(), prefix.as_bytes());
    if p.get(..x.len()).is_some_and(|head| bytes_eq(head, x)) {
        // The same bytes are the same units, but for a `%` in the prefix's last two bytes:
        // a stray one there (`/a%4`) may start an escape in the path (`/a%41`).
        return !x.ends_with(b"%") && x.get(x.len().wrapping_sub(2)) != Some(&b'%')
            || starts_with_units(p, x);
    }
    // Without a `%` or a non-ASCII byte, a path's units are its bytes: the comparison above
    // is the answer. The path's units that could meet the prefix's lie in its first
    // `prefix.len()` bytes when it has none of those there.
    let head = &p[..p.len().min(x.len())];
    if !has_escapes(head) && !has_escapes(x) {
        return false;
    }
    starts_with_units(p, x)
}

/// Whether `s` has a `%` or a non-ASCII byte. A fold rather than `any`: no early exit, so the
/// compiler can compare whole words at once (prefixes and paths are short).
#[inline(always)]
fn has_escapes(s: &[u8]) -> bool {
    s.iter()
        .fold(false, |seen, &b| seen | (b == b'%') | (b >= 0x80))
}

#[cold]
#[inline(never)]
fn starts_with_units(path: &[u8], prefix: &[u8]) -> bool {
    let mut path = Units(path);
    Units(prefix).all(|unit| path.next() == Some(unit))
}

/// `prefix` in the one spelling [`starts_with`] treats all of its spellings as: unreserved
/// characters unescaped, other escapes in upper-case hex, non-ASCII bytes escaped, a `%` that
/// starts no escape written `%%` (so a canonical form is for comparing, not for a request). Borrowed
/// when `prefix` is already so written. Two prefixes name the same paths if and only if their
/// canonical forms are equal, and one covers the other's paths if and only if its canonical
/// form starts the other's (what `validate` needs to find a route that can never match).
pub fn canonical(prefix: &str) -> Cow<'_, str> {
    if !has_escapes(prefix.as_bytes()) {
        return Cow::Borrowed(prefix);
    }
    let mut out = String::with_capacity(prefix.len() + 8);
    for Unit { byte, escaped } in Units(prefix.as_bytes()) {
        if escaped {
            push_escape(&mut out, byte);
        } else if byte == b'%' {
            // A plain `%` (one that starts no escape) as `%%`: then no unit's spelling starts
            // another's (`%`, `%%`, `%XX`), so one canonical form starts another exactly when
            // its units start the other's (`/100%` does not start `/100%25`).
            out.push_str("%%");
        } else {
            // Only ASCII bytes are unescaped (a non-ASCII byte is always an escaped unit).
            out.push(char::from(byte));
        }
    }
    if out == prefix {
        Cow::Borrowed(prefix)
    } else {
        Cow::Owned(out)
    }
}

/// Whether `path` has a `.`, a `%` or a `\`: only such a path may be served as another
/// ([`as_served`]). A fold rather than `any`, as `has_escapes`: the route lookup scans every
/// call's path with it (about 6 ns of the agent's benchmark call, a 15-byte path; reading eight
/// bytes at a time was no faster: BENCHMARKS.md, "2026-12-05, 20:47–21:08").
#[inline(always)]
pub fn may_be_served_as_another(path: &str) -> bool {
    path.as_bytes().iter().fold(false, |seen, &b| {
        seen | (b == b'.') | (b == b'%') | (b == b'\\')
    })
}

/// `path` as a server reads it before it serves it, for route matching: each `\` read as `/`
/// (as URL parsers do, WHATWG's and reqwest's, and the servers that follow them, IIS, Node),
/// then its dot segments resolved ([`without_dot_segments`]). Borrowed when that changes
/// nothing.
pub fn as_served(path: &str) -> Cow<'_, str> {
    if !path.contains('\\') {
        return without_dot_segments(path);
    }
    let slashed = path.replace('\\', "/");
    match without_dot_segments(&slashed) {
        Cow::Owned(p) => Cow::Owned(p),
        Cow::Borrowed(_) => Cow::Owned(slashed),
    }
}

/// `path` with its dot segments resolved (RFC 3986 §5.2.4: `/a/./b` is `/a/b`, `/a/b/../c` is
/// `/a/c`, `/a/..` is `/`), a dot in any spelling (`%2E`, `%2e`: an escaped unreserved
/// character is that character, RFC 3986 §6.2.2.2), as a server reads the path before it
/// serves it: a route must not be chosen by a prefix the path only seems to have
/// (`/v1/search/../charges` is a call to `/v1/charges`). Other segments are kept as written
/// (empty ones too: `//a` is not `/a`). Borrowed when there is none, and for a path that does
/// not start with `/` (an origin-form path always does).
pub fn without_dot_segments(path: &str) -> Cow<'_, str> {
    if !path.starts_with('/') || !path.split('/').any(|seg| dots(seg).is_some()) {
        return Cow::Borrowed(path);
    }
    let mut kept: Vec<&str> = Vec::new();
    let mut segments = path[1..].split('/').peekable();
    while let Some(seg) = segments.next() {
        let dot = dots(seg);
        match dot {
            Some(1) => {}
            Some(_) => {
                kept.pop();
            }
            None => kept.push(seg),
        }
        // A dot segment last leaves the path ending in `/` (`/a/b/..` is `/a/`).
        if dot.is_some() && segments.peek().is_none() {
            kept.push("");
        }
    }
    let mut out = String::with_capacity(path.len());
    for seg in kept {
        out.push('/');
        out.push_str(seg);
    }
    Cow::Owned(out)
}

/// `Some(1)` for a segment that is `.`, `Some(2)` for `..`, in any spelling; `None` otherwise.
fn dots(seg: &str) -> Option<usize> {
    // At most two dots, each one byte or three (`%2E`).
    if seg.is_empty() || seg.len() > 6 {
        return None;
    }
    let mut n = 0;
    for unit in Units(seg.as_bytes()) {
        if unit.byte != b'.' {
            return None;
        }
        n += 1;
    }
    (n <= 2).then_some(n)
}

/// The byte offset of the first `%` in `s` not followed by two hex digits, if any: such a
/// `%` is not an escape, and a request carries a `%` as `%25`.
pub fn stray_percent(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    (0..b.len()).find(|&i| b[i] == b'%' && escape_at(b, i).is_none())
}

/// Writes `byte` percent-encoded (`%XX`, upper-case hex) to `out`.
pub(crate) fn push_escape(out: &mut String, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(byte >> 4)]));
    out.push(char::from(HEX[usize::from(byte & 0xF)]));
}

/// One character of a path, as compared: a byte, and whether it is percent-encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Unit {
    byte: u8,
    escaped: bool,
}

/// The units of a path, in order.
struct Units<'a>(&'a [u8]);

impl Iterator for Units<'_> {
    type Item = Unit;

    fn next(&mut self) -> Option<Unit> {
        let (&b, rest) = self.0.split_first()?;
        if b == b'%'
            && let Some(v) = escape_at(self.0, 0)
        {
            self.0 = &self.0[3..];
            return Some(Unit {
                byte: v,
                escaped: !is_unreserved(v),
            });
        }
        self.0 = rest;
        Some(Unit {
            byte: b,
            escaped: b >= 0x80,
        })
    }
}

/// The byte `%XX` at `s[i..]` stands for, if `s[i]` starts such an escape.
fn escape_at(s: &[u8], i: usize) -> Option<u8> {
    match s.get(i..i + 3)? {
        [b'%', hi, lo] => Some(hex(*hi)? << 4 | hex(*lo)?),
        _ => None,
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// RFC 3986 §2.3: `ALPHA / DIGIT / "-" / "." / "_" / "~"`.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_resolved_as_rfc_3986_has_it() {
        for (path, resolved) in [
            // RFC 3986 §5.2.4's examples, and §5.4's that apply to a path alone.
            ("/a/b/c/./../../g", "/a/g"),
            ("/b/c/./g", "/b/c/g"),
            ("/b/c/../g", "/b/g"),
            ("/b/c/..", "/b/"),
            ("/b/c/../", "/b/"),
            ("/b/c/.", "/b/c/"),
            ("/b/c/./", "/b/c/"),
            ("/..", "/"),
            ("/../../g", "/g"),
            ("/.", "/"),
            ("/a/..", "/"),
            // Any spelling of a dot.
            ("/v1/search/%2e%2E/charges", "/v1/charges"),
            ("/v1/search/.%2e/charges", "/v1/charges"),
            ("/v1/%2E/charges", "/v1/charges"),
            // Empty segments kept.
            ("//a/../b", "//b"),
            ("/a//../b", "/a/b"),
        ] {
            assert_eq!(without_dot_segments(path), resolved, "{path}");
        }
        for kept in [
            "/v1/charges",
            "/a/.b/c.json",
            "/a/.../b",
            "/a/%2E%2E%2E",
            "/a/%2Fb",
            "",
            "*",
            "a/../b",
            "/",
            "/a/b/",
        ] {
            assert!(
                matches!(without_dot_segments(kept), Cow::Borrowed(p) if p == kept),
                "{kept}"
            );
        }
    }

    #[test]
    fn a_backslash_is_a_slash_to_the_server_and_only_a_path_that_may_change_is_looked_at() {
        assert_eq!(as_served("/v1/search\\..\\charges"), "/v1/charges");
        assert_eq!(as_served("/v1\\charges"), "/v1/charges");
        assert_eq!(as_served("/v1/search/../charges"), "/v1/charges");
        assert!(matches!(
            as_served("/v1/a.json"),
            Cow::Borrowed("/v1/a.json")
        ));
        for (path, may) in [
            ("/v1/items/12345", false),
            ("/", false),
            ("/v1.2/x", true),
            ("/a%2Fb", true),
            ("/a\\b", true),
        ] {
            assert_eq!(may_be_served_as_another(path), may, "{path}");
            // A path that may not be served as another is served as it is.
            if !may {
                assert_eq!(as_served(path), path);
            }
        }
    }

    #[test]
    fn the_bytes_as_written_match_as_before() {
        assert!(starts_with("/v1/charges/12", "/v1/charges"));
        assert!(starts_with("/v1/charges", "/v1/charges"));
        assert!(starts_with("/anything", "/"));
        assert!(!starts_with("/v1/charge", "/v1/charges"));
        assert!(!starts_with("/v1/items", "/v1/charges"));
        assert!(!starts_with("", "/"));
    }

    #[test]
    fn an_escaped_unreserved_character_is_the_character() {
        assert!(starts_with("/v1/ch%61rges", "/v1/charges"));
        assert!(starts_with("/v1/ch%61rges/9", "/v1/charges"));
        assert!(starts_with("/%76%31/charges", "/v1/charges"));
        assert!(starts_with("/v1/ch%7E", "/v1/ch~"));
        // Written escaped in the policy, sent plain.
        assert!(starts_with("/v1/charges", "/v1/ch%61rges"));
        assert!(!starts_with("/v1/ch%62rges", "/v1/charges"));
    }

    #[test]
    fn escapes_compare_without_case_and_reserved_ones_stay_escaped() {
        assert!(starts_with("/files/a%2fb", "/files/a%2Fb"));
        assert!(starts_with("/files/a%2Fb", "/files/a%2fb"));
        // `%2F` is not a path separator.
        assert!(!starts_with("/files/a%2Fb", "/files/a/b"));
        assert!(!starts_with("/files/a/b", "/files/a%2Fb"));
        // A stray `%` is a plain one, whatever follows it in the path: not the `%25` a
        // request carries for a `%` (`validate` says to write that), nor another escape.
        assert!(!starts_with("/100%25", "/100%"));
        assert!(!starts_with("/100%41", "/100%"));
        assert!(!starts_with("/a%41", "/a%4"));
        assert!(starts_with("/100%/x", "/100%"));
        assert!(starts_with("/%3100%", "/100%"));
    }

    #[test]
    fn non_ascii_written_raw_is_its_escape() {
        assert!(starts_with("/%C3%BCber/x", "/über"));
        assert!(starts_with("/%c3%bcber", "/über"));
        assert!(starts_with("/über/x", "/%C3%BCber"));
        assert!(starts_with("/über", "/über"));
        assert!(!starts_with("/%C3%BCbel", "/über"));
    }

    #[test]
    fn a_prefix_longer_than_a_path_with_escapes_is_matched_by_units() {
        // Three bytes of the path are one unit: the path is shorter in units than in bytes.
        assert!(starts_with("/%61", "/a"));
        assert!(!starts_with("/%61", "/ab"));
        assert!(starts_with("/a", "/%61"));
        assert!(!starts_with("/", "/%61"));
    }

    #[test]
    fn a_stray_percent_is_a_plain_one() {
        assert!(starts_with("/100%/x", "/100%"));
        assert!(starts_with("/a%zz", "/a%z"));
        assert!(starts_with("/a%4", "/a%4"));
        assert_eq!(stray_percent("/100%"), Some(4));
        assert_eq!(stray_percent("/a%4"), Some(2));
        assert_eq!(stray_percent("/a%zz%41"), Some(2));
        assert_eq!(stray_percent("/a%41%2f"), None);
        assert_eq!(stray_percent("/plain"), None);
    }

    #[test]
    fn canonical_is_one_spelling_of_all() {
        assert!(matches!(
            canonical("/v1/charges"),
            Cow::Borrowed("/v1/charges")
        ));
        assert!(matches!(canonical("/a%2Fb"), Cow::Borrowed("/a%2Fb")));
        assert_eq!(canonical("/v1/ch%61rges"), "/v1/charges");
        assert_eq!(canonical("/a%2fb"), "/a%2Fb");
        assert_eq!(canonical("/über"), "/%C3%BCber");
        assert_eq!(canonical("/%c3%bcber"), "/%C3%BCber");
        assert_eq!(canonical("/100%"), "/100%%");
        assert_eq!(canonical("/%3100%"), "/100%%");
    }

    /// `starts_with` agrees with comparing canonical forms, over spellings of a few paths.
    #[test]
    fn matching_agrees_with_canonical_forms() {
        let spellings = [
            "/100%",
            "/%3100%",
            "/100%25",
            "/a%4",
            "/a%41",
            "/v1/charges",
            "/v1/ch%61rges",
            "/v1/ch%41rges",
            "/v1/chArges",
            "/v1",
            "/v%31",
            "/über",
            "/%C3%BCber",
            "/%c3%bc",
            "/a%2Fb",
            "/a%2fb",
            "/a/b",
            "/",
            "",
        ];
        for path in spellings {
            for prefix in spellings.iter().filter(|p| !p.is_empty()) {
                let want = canonical(path).starts_with(canonical(prefix).as_ref());
                assert_eq!(starts_with(path, prefix), want, "{path} vs {prefix}");
            }
        }
    }
}
