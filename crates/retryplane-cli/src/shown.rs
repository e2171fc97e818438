//! How the CLI shows text that may hold a secret: a URL's password and query, a header's value.
//!
//! Hand-written: what is a URL, a header or a `host:port` here is decided on text that did not
//! parse (a usage error quotes the argument as typed), which no URL or HTTP crate reads.

/// A URL as a message shows it: the password hidden and the query and fragment left out
/// ([`retryplane_agent::shown_url_without_query`], which the agent's `Debug` uses too).
pub(crate) use retryplane_agent::shown_url_without_query as without_query;

/// `text` with every command-line argument in it that holds a URL with a password (or the
/// value after the `=` of one, `--flag=URL`) replaced by its `user:***@host` form, and, with
/// `headers`, every argument written as a header, `Name: value` (an `-H` whose flag was
/// forgotten, say an `Authorization`), by `Name: ***`.
pub(crate) fn without_passwords(text: &str, args: &[String], headers: bool) -> String {
    let mut secret: Vec<(&str, String)> = args
        .iter()
        .flat_map(|a| [Some(a.as_str()), a.split_once('=').map(|(_, v)| v)])
        .flatten()
        .filter_map(|a| {
            if headers && let Some(shown) = header_shown(a) {
                return Some((a, shown));
            }
            // A query is cut (it may hold a token), with or without a scheme (`cp:7471/?t=…`).
            let shown = without_query(a);
            (shown != a).then_some((a, shown))
        })
        .collect();
    // Longest first, so that a value is not replaced inside the `--flag=URL` that holds it.
    secret.sort_by_key(|(a, _)| std::cmp::Reverse(a.len()));
    let mut text = text.to_owned();
    for (a, shown) in secret {
        text = text.replace(a, &shown);
    }
    // A split header's words may be short (`t`, `1`): only where clap quotes them whole.
    if headers {
        for word in split_header_values(args) {
            text = replace_quoted(&text, word, "***");
        }
    }
    text
}

/// `text` with `word` replaced by `by` wherever it stands whole between single quotes, as
/// clap quotes an argument, colour codes around it or inside the quotes allowed.
fn replace_quoted(text: &str, word: &str, by: &str) -> String {
    /// `s` without the colour codes (`ESC [ … m`) it ends with.
    fn trim_end_codes(mut s: &str) -> &str {
        while let Some(i) = s.rfind('\x1b') {
            let code = &s[i..];
            if code.len() > 2 && code.starts_with("\x1b[") && code.ends_with('m') {
                s = &s[..i];
            } else {
                break;
            }
        }
        s
    }
    /// `s` without the colour codes it starts with.
    fn trim_start_codes(mut s: &str) -> &str {
        while s.starts_with("\x1b[") {
            match s.find('m') {
                Some(end) => s = &s[end + 1..],
                None => break,
            }
        }
        s
    }
    if word.is_empty() {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(word) {
        let (before, after) = (&rest[..i], &rest[i + word.len()..]);
        let quoted = trim_end_codes(&format!("{out}{before}")).ends_with('\'')
            && trim_start_codes(after).starts_with('\'');
        out.push_str(before);
        out.push_str(if quoted { by } else { word });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// The words after an `-H 'Name:'` (or `-HName:`, `--header Name:`, `--header=Name:`, or a
/// bare `Name:` whose `-H` was forgotten too) that the shell split from it (`-H
/// Authorization: Bearer s3cret`, quotes forgotten): each such header's value, up to the next
/// flag or URL.
fn split_header_values(args: &[String]) -> Vec<&str> {
    let mut words = Vec::new();
    let mut rest = args.iter().map(String::as_str).peekable();
    while let Some(arg) = rest.next() {
        let value = match arg {
            "-H" | "--header" => rest.peek().copied(),
            // A header typed with neither its `-H` nor quotes (`X-Api-Key: s3cret`): only a
            // name a host would not have (`localhost: 7471` is an address's typo).
            _ if !arg.starts_with('-') => arg
                .strip_suffix(':')
                .and_then(|name| header_like(name).then_some(arg)),
            _ => arg
                .strip_prefix("--header=")
                .or_else(|| arg.strip_prefix("-H").filter(|v| !v.is_empty())),
        };
        let Some(value) = value.map(str::trim_end) else {
            continue;
        };
        // `Name:` with a stand-in value, since a header without one is not a header's shape.
        if !value.ends_with(':') || header_shown(&format!("{value}x")).is_none() {
            continue;
        }
        if matches!(arg, "-H" | "--header") {
            rest.next();
        }
        while let Some(word) = rest.next_if(|a| !a.starts_with('-') && !a.contains("://")) {
            words.push(word);
        }
    }
    words
}

/// `Name: ***` for an argument written as a header with a value, as `-H` takes one (`Name:
/// value`, `Name:value`, spaces around either), which may be a credential; `None` for any
/// other argument. Not a header: a URL (`scheme://`), a `host:port`, `host:port/path` or
/// `host:port?query` (digits right after the colon, a bad port included, so that the URL
/// check can name it), and a name of digits and dots (an IPv4 address). Except that these
/// are headers whatever follows the colon:
/// - a name with a capital letter (`X-Api-Key:1234`): host names are written in lower case;
/// - a name with a word that credentials go by ([`names_a_credential`]: `x-api-key:4711`,
///   `private-token:1234/abcd`, `password:1234`). A host named so (`auth:8080/login`,
///   `vault-token:8200`) is hidden too, on purpose: these rules read text that did not
///   parse, and hiding an address costs less than printing a secret.
pub(crate) fn header_shown(arg: &str) -> Option<String> {
    let (name, after) = arg.split_once(':')?;
    let port = after.split(['/', '?', '#']).next().unwrap_or(after);
    let is_address = after.starts_with("//")
        || !header_like(name) && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
        || name.trim().bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let (name, value) = (name.trim(), after.trim());
    let is_name = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    (is_name && !value.is_empty() && !is_address).then(|| format!("{name}: ***"))
}

/// Whether `name` is a header's whatever follows its colon: it has a capital letter (host
/// names are written in lower case) or says it carries a credential ([`names_a_credential`]).
fn header_like(name: &str) -> bool {
    name.bytes().any(|b| b.is_ascii_uppercase()) || names_a_credential(name.trim())
}

/// Whether a name (any case) says it carries a credential: it holds one of the parts
/// credentials are named with (`key`, `token`, `auth`, `session`, `pass`, `otp`…:
/// `x-api-key`, `x-apitoken`, `sessionid`, `x-passcode`, `x-github-otp`), or one of its words
/// (between `-` and `_`) is a short one that is only a credential's as a whole word (`sid`,
/// `pin`).
/// A host named so (`keycloak`, `author-service`) is then hidden too; see [`header_shown`].
fn names_a_credential(name: &str) -> bool {
    const PARTS: &[&str] = &[
        "key",
        "token",
        "secret",
        "pass",
        "auth",
        "session",
        "sessid",
        "cookie",
        "credential",
        "signature",
        "bearer",
        "otp",
        "mfa",
    ];
    const WORDS: &[&str] = &["sid", "pin"];
    let name = name.to_ascii_lowercase();
    PARTS.iter().any(|part| name.contains(part))
        || name.split(['-', '_']).any(|word| WORDS.contains(&word))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_an_argument_quoted_by_clap_is_hidden() {
        let args = [
            "retryplane".to_owned(),
            "--server=http://a:pw1@h".to_owned(),
            "http://admin:s3cret@127.0.0.1:1".to_owned(),
        ];
        let text = "error: unexpected argument 'http://admin:s3cret@127.0.0.1:1' found; \
                    'http://a:pw1@h'";
        let shown = without_passwords(text, &args, true);
        assert_eq!(
            shown,
            "error: unexpected argument 'http://admin:***@127.0.0.1:1' found; 'http://a:***@h'"
        );
    }

    #[test]
    fn the_value_after_a_bare_header_name_is_hidden() {
        // `-H` and the quotes both forgotten: clap takes `X-Api-Key:` for the URL and quotes
        // the value as the unexpected argument.
        let args: Vec<String> = [
            "retryplane",
            "request",
            "--endpoint",
            "pay",
            "X-Api-Key:",
            "s3cretvalue",
            "http://127.0.0.1:9/",
        ]
        .map(String::from)
        .to_vec();
        let text = "error: unexpected argument 's3cretvalue' found";
        assert_eq!(
            without_passwords(text, &args, true),
            "error: unexpected argument '***' found"
        );
        // A `host:` typed alone is not a header: what follows it is shown.
        let args: Vec<String> = ["retryplane", "status", "localhost:", "7471"]
            .map(String::from)
            .to_vec();
        let text = "error: unexpected argument '7471' found";
        assert_eq!(without_passwords(text, &args, true), text);
    }

    #[test]
    fn a_word_is_replaced_only_where_it_is_quoted_whole() {
        let text = "error: unexpected argument 't' found; \x1b[33m'\x1b[1mt\x1b[0m'\x1b[0m; it";
        assert_eq!(
            replace_quoted(text, "t", "***"),
            "error: unexpected argument '***' found; \x1b[33m'\x1b[1m***\x1b[0m'\x1b[0m; it"
        );
    }

    #[test]
    fn an_argument_is_a_header_as_minus_h_takes_one_but_an_address_is_not() {
        for (arg, shown) in [
            ("Authorization: Bearer s3cret", Some("Authorization: ***")),
            ("Authorization:Bearer s3cret", Some("Authorization: ***")),
            ("Authorization:\tBearer s3cret", Some("Authorization: ***")),
            ("Authorization : Bearer s3cret", Some("Authorization: ***")),
            (" X-Api-Key:s3cret", Some("X-Api-Key: ***")),
            ("Cookie:session=s3cret", Some("Cookie: ***")),
            ("X-Api-Key: 8675309", Some("X-Api-Key: ***")),
            (
                "Cookie: next=https://app.example/home; session=s3cret",
                Some("Cookie: ***"),
            ),
            ("X-Api-Key:8675309", Some("X-Api-Key: ***")),
            ("x-api-key:8675309", Some("x-api-key: ***")),
            ("authorization:1234", Some("authorization: ***")),
            ("cookie: 42", Some("cookie: ***")),
            ("x-vault-token:4711", Some("x-vault-token: ***")),
            (
                "x-amz-security-token:4711",
                Some("x-amz-security-token: ***"),
            ),
            (
                "ocp-apim-subscription-key:1234",
                Some("ocp-apim-subscription-key: ***"),
            ),
            ("x-auth:1234", Some("x-auth: ***")),
            ("x-api-key:1234/abcd+ef==", Some("x-api-key: ***")),
            ("x-api-key:12345#frag", Some("x-api-key: ***")),
            ("authorization:8080/v1/check", Some("authorization: ***")),
            ("password:12345678", Some("password: ***")),
            ("secret:1234", Some("secret: ***")),
            ("passwd:20261202", Some("passwd: ***")),
            ("credentials:1234567", Some("credentials: ***")),
            ("token:1234/abcd+ef==", Some("token: ***")),
            ("token:4711/aGVsbG8gd29ybGQ=", Some("token: ***")),
            ("session:5678/AbCdEf+/==", Some("session: ***")),
            ("x-auth-token:123456", Some("x-auth-token: ***")),
            ("private-token:31337", Some("private-token: ***")),
            ("api-token:4711/aGVsbG8gd29ybGQ=", Some("api-token: ***")),
            ("access-token:4242?sig=abc", Some("access-token: ***")),
            ("x-apikey:12345678", Some("x-apikey: ***")),
            ("x-authorization:54321", Some("x-authorization: ***")),
            ("x-github-otp:123456", Some("x-github-otp: ***")),
            ("auth:8080/login", Some("auth: ***")),
            ("x-apitoken:4711/aGVsbG8gd29ybGQ=", Some("x-apitoken: ***")),
            ("x-totp:482913", Some("x-totp: ***")),
            ("sessionid:98765432", Some("sessionid: ***")),
            ("x-accesstoken:12345678", Some("x-accesstoken: ***")),
            ("phpsessid:12345678", Some("phpsessid: ***")),
            ("x-passcode:123456", Some("x-passcode: ***")),
            ("x-mfa:482913", Some("x-mfa: ***")),
            ("pin:4829", Some("pin: ***")),
            ("api-gateway:8080", None),
            ("sidecar:15000", None),
            ("localhost:99999/stock", None),
            ("shopping:8080/cart", None),
            ("127.0.0.1: 7470", None),
            ("localhost:7470", None),
            ("localhost:8080?debug=1", None),
            ("api.internal:8080/v1/pay", None),
            ("10.0.0.1:abc", None),
            ("[::1]:7470", None),
            ("http://h:1/x", None),
            ("Name:", None),
            ("no colon", None),
        ] {
            assert_eq!(header_shown(arg).as_deref(), shown, "{arg:?}");
        }
    }
}
