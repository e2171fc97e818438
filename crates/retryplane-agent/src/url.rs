//! Control-plane URLs as they may be shown (the password of a `user:password@` part hidden), and
//! the port an authority writes.
//!
//! Written here rather than taken from a URL crate: it must work on text that does not parse as
//! a URL (a password may hold `/`, `?`, `#` or `@`, which end or split the authority for a
//! parser), and a parser would show such a password as part of the path.

/// `url` as it may be shown in a message or a log: the password of its userinfo, if any,
/// replaced by `***` (`http://user:***@host:7471`). Works on the text as given, so that a URL
/// that does not parse is shown without its password too. A password may hold `/`, `?`, `#`,
/// `:` or `@`, so everything from the first `:` after the scheme up to the last `@` of the text
/// is hidden: a `@` in a path or query may hide more than the password, never less. The scheme
/// is only a `scheme://` at the very start (letters, digits, `+`, `-`, `.`).
pub fn shown_url(url: &str) -> String {
    let start = scheme_len(url);
    let rest = &url[start..];
    let Some(at) = rest.rfind('@') else {
        return url.to_owned();
    };
    let Some(colon) = rest[..at].find(':') else {
        return url.to_owned();
    };
    format!("{}{}:***{}", &url[..start], &rest[..colon], &rest[at..])
}

/// A URL as a message or a `Debug` shows it: the password hidden ([`shown_url`]), and the query
/// and fragment, which may carry tokens, left out (`?…` or `#…` in their place). They are cut before the
/// password is looked for, or an `@` in the query would pass for the end of a `user:password@`
/// and hide the `?` inside it. When a `:` comes between the `scheme://` and the first `?` or
/// `#` and an `@` after it, that `?` or `#` may be inside a password (a URL that does not parse
/// does not say which), and only the scheme is shown, unless a `/` ends a `host:port` first
/// (`http://api:8080/users?email=a@b`: a password holds no `/`).
pub fn shown_url_without_query(url: &str) -> String {
    let Some(cut) = url.find(['?', '#']) else {
        return shown_url(url);
    };
    let start = url_scheme(url).map_or(0, |s| s.len() + 3).min(cut);
    let before = &url[start..cut];
    let host_port = before.split_once('/').is_some_and(|(authority, _)| {
        !authority.contains('@')
            && authority
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
    });
    if before.contains(':') && url[cut..].contains('@') && !host_port {
        return match url_scheme(url) {
            Some(scheme) => format!("{scheme}://…"),
            None => "…".to_owned(),
        };
    }
    format!("{}{}…", shown_url(&url[..cut]), &url[cut..=cut])
}

/// The scheme of the `scheme://` that `url` starts with, as written (`HTTP` in `HTTP://cp`);
/// `None` when it starts with none (a `://` after anything but a valid scheme does not count).
pub fn url_scheme(url: &str) -> Option<&str> {
    scheme_len(url).checked_sub(3).map(|end| &url[..end])
}

/// The length of the `scheme://` that `url` starts with (RFC 3986: a letter, then letters,
/// digits, `+`, `-` or `.`); 0 without one.
fn scheme_len(url: &str) -> usize {
    let Some(i) = url.find("://") else {
        return 0;
    };
    let scheme = &url[..i];
    let valid = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if valid { i + 3 } else { 0 }
}

/// The port part of an authority (`user@host:port`, `[::1]:port`) as written, valid or not:
/// what follows a `:` after the host (after the `]` of an IPv6 address); `None` without one.
pub fn written_port(authority: &str) -> Option<&str> {
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, rest)| rest);
    let after_host = host_port
        .rfind(']')
        .map_or(host_port, |end| &host_port[end..]);
    after_host.rsplit_once(':').map(|(_, port)| port)
}

/// Whether `uri` names no host: none at all (`http://:7470`), or empty brackets
/// (`http://[]:7470`, which `http::Uri` reads as the host `[]`, a name to look up for ever).
pub fn names_no_host(uri: &http::Uri) -> bool {
    uri.host()
        .is_none_or(|host| host.is_empty() || host == "[]")
}

/// What a control-plane URL (`url`, without userinfo) holds past its authority that no call
/// uses, since gRPC calls go to `/retryplane.v1.…` at the server's root: its path (other than
/// `/`), query and fragment, named in words (`path and query`). `None` when it holds none of
/// them, or does not parse (its caller reports that).
pub fn unused_url_parts(url: &str) -> Option<String> {
    let uri = url.parse::<http::Uri>().ok()?;
    let mut parts = Vec::new();
    if !matches!(uri.path(), "" | "/") {
        parts.push("path");
    }
    if uri.query().is_some() {
        parts.push("query");
    }
    // `Uri` drops a fragment; with no userinfo, a `#` can only start one.
    if url.contains('#') {
        parts.push("fragment");
    }
    match parts.as_slice() {
        [] => None,
        [one] => Some((*one).to_owned()),
        [init @ .., last] => Some(format!("{} and {last}", init.join(", "))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query or fragment is left out, and a password hidden; where a `?` may be inside a
    /// password, only the scheme is shown.
    #[test]
    fn a_url_is_shown_without_its_query_fragment_or_password() {
        for (given, shown) in [
            ("http://cp:7470", "http://cp:7470"),
            ("http://cp:7470/?token=qs-secret", "http://cp:7470/?…"),
            ("http://cp:7470?access_token=qs-secret", "http://cp:7470?…"),
            ("http://cp:7470/#frag-secret", "http://cp:7470/#…"),
            ("http://u:pw@cp:7470/?token=x", "http://u:***@cp:7470/?…"),
            ("http://u:p?w@cp:7470", "http://…"),
            ("http://api:8080/users?email=a@b", "http://api:8080/users?…"),
        ] {
            assert_eq!(shown_url_without_query(given), shown, "{given}");
        }
    }

    /// What a URL holds past its host that a call leaves out is named part by part: a query
    /// (`?token=x`, a credential someone hoped would be sent) as well as a path.
    #[test]
    fn a_urls_path_query_and_fragment_are_named_as_not_used() {
        for (url, said) in [
            ("http://127.0.0.1:1", None),
            ("http://127.0.0.1:1/", None),
            ("http://127.0.0.1:1/p", Some("path")),
            ("http://127.0.0.1:1/?token=x", Some("query")),
            ("http://127.0.0.1:1?token=x", Some("query")),
            ("http://127.0.0.1:1/#top", Some("fragment")),
            ("http://127.0.0.1:1/p?a=1", Some("path and query")),
            (
                "http://127.0.0.1:1/p?a=1#f",
                Some("path, query and fragment"),
            ),
            ("not a url", None),
        ] {
            assert_eq!(unused_url_parts(url).as_deref(), said, "{url}");
        }
    }

    #[test]
    fn a_url_with_nothing_or_empty_brackets_for_its_host_names_none() {
        for (url, none) in [
            ("http://:7470", true),
            ("http://[]:7470", true),
            ("http://user@:7470", true),
            ("http://[::1]:7470", false),
            ("http://cp:7470", false),
        ] {
            let uri: http::Uri = url.parse().unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(names_no_host(&uri), none, "{url}");
        }
    }

    #[test]
    fn a_scheme_is_read_as_written_only_at_the_start() {
        assert_eq!(url_scheme("HTTP://cp:7471"), Some("HTTP"));
        assert_eq!(url_scheme("svc+h2://cp"), Some("svc+h2"));
        assert_eq!(url_scheme("cp:7471"), None);
        assert_eq!(url_scheme("cp/?x=http://y"), None);
        assert_eq!(url_scheme("://cp"), None);
    }

    #[test]
    fn a_password_holding_url_delimiters_is_hidden_whole() {
        for (given, shown) in [
            ("http://admin:pa/ss@h:1", "http://admin:***@h:1"),
            ("http://admin:pa#ss@h:1", "http://admin:***@h:1"),
            ("http://admin:pa?ss@h:1", "http://admin:***@h:1"),
            ("admin:pa/ss@h", "admin:***@h"),
            // A `://` in a query is not the scheme's.
            ("u:pw@h/?x=http://y", "u:***@h/?x=http://y"),
            ("http://u:p@[::1]:1/", "http://u:***@[::1]:1/"),
            // No password, or no userinfo: as given.
            ("http://u@h/", "http://u@h/"),
            ("http://h:1/p?x=http://y", "http://h:1/p?x=http://y"),
            ("h:1", "h:1"),
        ] {
            assert_eq!(shown_url(given), shown, "{given}");
        }
    }
}
