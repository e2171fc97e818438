//! The admin commands: talk to a running control plane over `retryplane.v1.AdminService`
//! (SPEC §3, §5).
//!
//! - `apply FILE` publishes a policy file (API mode) and prints what changed;
//! - `diff FILE` shows what `apply` would change, without changing anything;
//! - `get` prints the current (or a past) version as a policy file or as JSON;
//! - `history` lists every stored version, newest first;
//! - `rollback VERSION` publishes the content of a past version as a new version;
//! - `status` shows every agent the server knows, how far the fleet is on the current version,
//!   and the endpoints whose retry ratio is past its threshold;
//! - `stats` prints the fleet's retry metrics per (service, endpoint) and per endpoint;
//! - `top` is a live view of the same metrics, worst retry ratio first.
//!
//! Every one takes `--server URL` (`RETRYPLANE_SERVER`, default [`DEFAULT_SERVER`]) and
//! `--token TOKEN` (`RETRYPLANE_TOKEN`), sent as `authorization: Bearer TOKEN` and never
//! printed (`--help` does not show the values of either variable); an empty value of either
//! counts as not given. The `user:password@` of a `--server` URL is not used: it is left out of
//! what is sent (HTTP/2 forbids it there), with a note on stderr saying so; an `@` after the
//! host is refused ([`no_at_after_host`]). Messages name the
//! server by its URL with the password shown as `***` ([`shown_url`]). Connecting gives up
//! after [`CONNECT_TIMEOUT`], a call after [`REQUEST_TIMEOUT`]. Each command runs its calls on
//! a current-thread tokio runtime of its own ([`block_on`]).
//!
//! # Errors and exit codes
//!
//! A gRPC error prints `retryplane: error: CODE_NAME: message` on stderr (and, for
//! `UNIMPLEMENTED`, which another listener of the control plane answers, `UNAUTHENTICATED`,
//! `DEADLINE_EXCEEDED` and `UNAVAILABLE`, a `retryplane: hint: …` line saying what to check);
//! a connection that breaks before an answer, or a server on `--server` that does not speak
//! gRPC, is `UNAVAILABLE: the connection to URL failed before an answer: …`; a call with no
//! answer within [`REQUEST_TIMEOUT`] is `DEADLINE_EXCEEDED: no answer from the server within
//! 30 s`. Exit `1` when the
//! server answered and refused: an invalid policy (its diagnostics are printed like
//! `retryplane validate` prints them), a version conflict, a change that removes every endpoint
//! or endpoints in use,
//! a missing or wrong token, an unknown version (see [`refused`]). Exit `2` for usage errors,
//! files that cannot be read, a server that cannot be reached or timed out, and server faults.

pub mod apply;
mod change;
mod client;
pub mod diff;
pub mod get;
pub mod history;
mod json;
mod metrics;
pub mod rollback;
pub mod stats;
pub mod status;
mod time;

pub use metrics::GIVE_UPS_HELP;
pub mod top;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use retryplane_policy::codes::GrpcCode;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Endpoint;
use tonic::{Code, Status};

use crate::output;
use crate::{Outcome, Report};

/// The admin listener of a control plane started with its defaults on this machine.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7471";

/// How long to wait for the TCP connection to the server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one admin call may take, connection included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// `--server` and `--token`, shared by every admin command.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// The control plane's admin address (`http://HOST:PORT`; `http://` and port 7471 when not
    /// given). White space around it is dropped. Not given or empty: RETRYPLANE_SERVER, and
    /// http://127.0.0.1:7471 when that is unset or empty too.
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    /// Admin token, sent as `authorization: Bearer TOKEN`. Not given or empty:
    /// RETRYPLANE_TOKEN, and no token when that is unset or empty too.
    #[arg(long, value_name = "TOKEN")]
    token: Option<Token>,
}

/// A secret: never shown by `Debug` or `Display`.
#[derive(Clone)]
pub struct Token(String);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// The token itself, for the one place that sends it.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// The token of a `--token` flag, or, when it is not given or empty, of the environment
    /// variable `variable` (see [`flag_or_env`]); `None` when neither holds one. Whether it
    /// opens with `Bearer ` is kept for the note of a refusal ([`bearer_note`]).
    pub(crate) fn from_flag_or_env(
        flag: Option<Token>,
        variable: &str,
    ) -> anyhow::Result<Option<Token>> {
        let token = flag_or_env(flag.map(|Token(t)| t), variable)?
            .map(|t| Token(t.trim_ascii().to_owned()));
        if let Some(Token(t)) = &token {
            BEARER_GIVEN.store(
                t.get(..7)
                    .is_some_and(|start| start.eq_ignore_ascii_case("bearer ")),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        Ok(token)
    }
}

/// The value of a flag an environment variable stands in for: the flag's, unless it is not
/// given or empty (white space only: a script's `--server "$CP_URL"` with the variable unset),
/// then the variable's, unless it is unset or empty too. The one place that reads the variables
/// of `--server` and the `--token`s: clap's own `env` reads a variable only when the flag is
/// missing, and takes one that is not UTF-8 for a bad command line. Such a value is an error
/// naming the variable here, never dropped in silence (a call would go to the default server,
/// or out with no token) and never shown.
pub(crate) fn flag_or_env(flag: Option<String>, variable: &str) -> anyhow::Result<Option<String>> {
    if let Some(value) = flag
        && !value.trim_ascii().is_empty()
    {
        return Ok(Some(value));
    }
    match std::env::var(variable) {
        Ok(value) => Ok((!value.trim_ascii().is_empty()).then_some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("the environment variable {variable} is not valid UTF-8")
        }
    }
}

impl FromStr for Token {
    type Err = std::convert::Infallible;

    /// Leading and trailing whitespace is dropped, as the server drops it from a presented
    /// token: a token read from a file or a variable often ends in a line break.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Token(s.trim_ascii().to_owned()))
    }
}

/// Where the server is and how to authenticate, checked once.
#[derive(Clone, Debug)]
pub struct Server {
    /// The URL as given (normalised with `http://` when it had no scheme), for messages: the
    /// password of its userinfo, if any, is `***`, and its query is cut
    /// ([`crate::shown::without_query`]).
    pub url: String,
    /// Where the URL came from when the command line does not show it, for the message of a
    /// failed connect ([`ORIGIN_VARIABLE`], [`ORIGIN_DEFAULT`]); empty for `--server`.
    pub origin: &'static str,
    /// The endpoint with its timeouts.
    endpoint: Endpoint,
    /// `Bearer TOKEN`, marked sensitive so that it is never shown.
    authorization: Option<MetadataValue<Ascii>>,
}

/// [`Server::origin`] of a URL from `RETRYPLANE_SERVER`.
pub const ORIGIN_VARIABLE: &str = " (from RETRYPLANE_SERVER)";

/// [`Server::origin`] of the default URL.
pub const ORIGIN_DEFAULT: &str = " (the default address: give the control plane's admin address with --server or RETRYPLANE_SERVER)";

/// The admin listener's port of `retryplane serve`, used when `--server` names none.
const DEFAULT_PORT: u16 = 7471;

pub(crate) use retryplane_agent::shown_url;
use retryplane_agent::{url_scheme, written_port};

/// A `--server` value as a URL: white space around it dropped (a value read from a file or a
/// secret often ends in a line break, as a token does), `http://` put before one that names no
/// scheme (`cp:7472`), and a scheme written in capitals lowered, since schemes are
/// case-insensitive (RFC 3986 §3.1: `HTTP://cp` is `http://cp`).
pub(crate) fn with_scheme(given: String) -> String {
    let given = given.trim_ascii();
    match url_scheme(given) {
        Some(scheme) if scheme.chars().any(|c| c.is_ascii_uppercase()) => {
            format!("{}{}", scheme.to_ascii_lowercase(), &given[scheme.len()..])
        }
        Some(_) => given.to_owned(),
        // Not a scheme before the `://` (`cp/?x=http://y`): as given, and refused for it later.
        None if given.contains("://") => given.to_owned(),
        None => format!("http://{given}"),
    }
}

/// `url` without the `user:password@` of its authority, and whether it had one: the control
/// plane takes a token, never a password, and HTTP/2 forbids userinfo in a request's
/// `:authority` (RFC 9113 §8.3.1), where it would otherwise go out on every call. A URL that
/// does not parse is returned as given (the caller reports it, through [`shown_url`]).
pub(crate) fn without_userinfo(url: &str) -> (String, bool) {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return (url.to_owned(), false);
    };
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return (url.to_owned(), false);
    };
    let Some((_userinfo, host)) = authority.as_str().rsplit_once('@') else {
        return (url.to_owned(), false);
    };
    // `Uri` adds a `/` path to `http://host`; keep the text as given after the authority.
    let end = url
        .find(authority.as_str())
        .map_or(url.len(), |i| i + authority.as_str().len());
    let after = &url[end..];
    (format!("{scheme}://{host}{after}"), true)
}

/// Refuses a `--server` URL that still holds an `@` once its userinfo is left out
/// ([`without_userinfo`]): in a path or query it is of no use, since only the scheme, host and port of
/// a control-plane URL are used; and a password holding `/`, `?` or `#` ends the authority
/// early (`http://user:1234/pw@host` is host `user`, port 1234), so the call, token and all,
/// would go to the user name's host. The URL is not quoted: it may hold a password.
/// `name` is where the URL came from (`--server`, or the variable), as messages say it.
pub(crate) fn no_at_after_host(url: &str, name: &str, token_hint: &str) -> anyhow::Result<()> {
    // Before the port is read (a password's start would be taken for one) and only for a URL
    // that parses: one that does not is reported as such, without its password.
    let (url, _) = without_userinfo(url);
    if url.parse::<http::Uri>().is_ok() && url.contains('@') {
        bail!(
            "{name}: an `@` after the host (in a path or query, or in a password holding `/`, \
             `?` or `#`) is not allowed: only the scheme, host and port are used; {token_hint}"
        );
    }
    Ok(())
}

/// Says on stderr that the path, query or fragment of a `--server` URL
/// (`http://gw/retryplane?x=1`) is not used, when it has any: gRPC calls go
/// to `/retryplane.v1.…` at the server's root, whatever the URL holds after its authority, so
/// a gateway that routes by path or query does not see them. `url` has no userinfo left
/// ([`without_userinfo`]); the parts are named by [`retryplane_agent::unused_url_parts`].
pub(crate) fn path_not_used(url: &str) {
    if let Some(parts) = retryplane_agent::unused_url_parts(url) {
        output::note(format_args!(
            "retryplane: note: the {parts} of a --server URL {} not used: calls go to the \
             server's root (only the scheme, host and port count)",
            if parts.contains(" and ") { "are" } else { "is" }
        ));
    }
}

/// Whether the token this command was given opens with `Bearer ` (one command, one token).
static BEARER_GIVEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// After the server answered `UNAUTHENTICATED`: says on stderr when the token opens with
/// `Bearer ` (copied from a header): the prefix is added for it, so the server got `Bearer
/// Bearer …`. Only then: a secret of a tokens file may open so, and works as given.
pub(crate) fn bearer_note() {
    if BEARER_GIVEN.load(std::sync::atomic::Ordering::Relaxed) {
        output::note(format_args!(
            "retryplane: note: the token given opens with `Bearer `, which is added for it \
             (sent as `authorization: Bearer TOKEN`): give the secret alone"
        ));
    }
}

/// Says once on stderr that the `user:password@` of a `--server` URL is not sent.
pub(crate) fn userinfo_not_used(flag_hint: &str) {
    output::note(format_args!(
        "retryplane: note: the user:password@ part of a --server URL is not used (nor sent); \
         {flag_hint}"
    ));
}

/// `url` with `port` when it names a host and no port (`http://cp.internal`), since the
/// control plane's listeners are not on HTTP's port 80; as given otherwise, an invalid URL
/// included (the caller reports it). A port that is written but is not one (`:99999`, `:`)
/// is an error: the connection would otherwise silently go to port 80.
/// `name` is where the URL came from, as messages say it.
pub(crate) fn with_default_port(url: String, port: u16, name: &str) -> anyhow::Result<String> {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return Ok(url);
    };
    let Some(authority) = uri.authority() else {
        return Ok(url);
    };
    if retryplane_agent::names_no_host(&uri) {
        bail!(
            "{name} {}: the URL names no host: write http://HOST:PORT",
            crate::shown::without_query(&url)
        );
    }
    // The text may hold a password that the parser does not see as one (a `/`, `?` or `#` in it
    // ends the authority early, and what follows the user's name is taken for the port): a
    // port that is no port is then not quoted, as it may be part of the password.
    let hides_password = shown_url(&url) != url;
    match written_port(authority.as_str()) {
        None => {
            let path = uri.path_and_query().map_or("", |p| p.as_str());
            let scheme = uri.scheme_str().unwrap_or("http");
            Ok(format!("{scheme}://{authority}:{port}{path}"))
        }
        Some(written) if written.parse::<u16>().is_ok_and(|p| p > 0) => Ok(url),
        Some("") => bail!(
            "{name} {}: no port after the `:`: give one from 1 to 65535",
            crate::shown::without_query(&url)
        ),
        // Not quoted when the URL holds a password: what was taken for the port may be part of it.
        Some(_) if hides_password => bail!(
            "{name} {}: the port must be a number from 1 to 65535",
            crate::shown::without_query(&url)
        ),
        Some(written) => {
            bail!(
                "{name} {}: the port must be a number from 1 to 65535, not `{written}`",
                crate::shown::without_query(&url)
            )
        }
    }
}

impl TryFrom<ServerArgs> for Server {
    type Error = anyhow::Error;

    fn try_from(args: ServerArgs) -> anyhow::Result<Self> {
        // An empty value counts as not given, in the flag and in the variable.
        let from_flag = args
            .server
            .as_deref()
            .is_some_and(|s| !s.trim_ascii().is_empty());
        let token_hint = "give the admin token with --token or RETRYPLANE_TOKEN";
        let (url, origin) = match flag_or_env(args.server, "RETRYPLANE_SERVER")? {
            None => (DEFAULT_SERVER.to_owned(), ORIGIN_DEFAULT),
            Some(server) if from_flag => (with_scheme(server), ""),
            Some(server) => (with_scheme(server), ORIGIN_VARIABLE),
        };
        // A URL the command line does not show is named by the variable it came from.
        let name = if origin == ORIGIN_VARIABLE {
            "RETRYPLANE_SERVER"
        } else {
            "--server"
        };
        let address = || -> anyhow::Result<(String, Endpoint)> {
            if !url.starts_with("http://") {
                bail!(
                    "{name} {}: only http:// is supported (TLS on the admin listener comes \
                     later)",
                    crate::shown::without_query(&url)
                );
            }
            no_at_after_host(&url, name, token_hint)?;
            let url = with_default_port(url.clone(), DEFAULT_PORT, name)?;
            let shown = crate::shown::without_query(&url);
            let (url, had_userinfo) = without_userinfo(&url);
            if had_userinfo {
                userinfo_not_used(token_hint);
            }
            path_not_used(&url);
            let endpoint = Endpoint::from_shared(url)
                .with_context(|| format!("{name} {shown}: not a valid URL"))?
                .connect_timeout(CONNECT_TIMEOUT)
                .timeout(REQUEST_TIMEOUT);
            Ok((shown, endpoint))
        };
        let (shown, endpoint) = address()?;
        let authorization = match Token::from_flag_or_env(args.token, "RETRYPLANE_TOKEN")? {
            None => None,
            Some(Token(token)) => {
                // A header value may also carry bytes past ASCII, which no secret of a tokens
                // file holds: the server would answer "unknown token". Said here, and without
                // the token (the parser's error would quote it).
                let not_ascii = || {
                    anyhow::anyhow!(
                        "--token (or RETRYPLANE_TOKEN): a token holds only printable ASCII \
                         characters and spaces, as the secrets of a tokens file do; this one \
                         holds another character (a letter outside ASCII, a tab, a control \
                         character)"
                    )
                };
                if !retryplane_proto::is_metadata_text(&token) {
                    return Err(not_ascii());
                }
                let mut value =
                    MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| not_ascii())?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(Self {
            url: shown,
            origin,
            endpoint,
            authorization,
        })
    }
}

/// Runs `work` on a current-thread tokio runtime made for this one command.
pub fn block_on<T>(work: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(work)
}

/// Prints `retryplane: error: CODE_NAME: message` on stderr and returns the exit outcome of
/// `status`, with `stdout` to print before it (diagnostics, for instance).
pub fn failed(status: &Status, stdout: String) -> Report {
    let (code, message) = code_and_message(status);
    failed_with(code, &message, stdout)
}

/// Whether `status` is the client's own [`REQUEST_TIMEOUT`], as tonic reports it:
/// `CANCELLED: Timeout expired`.
pub(crate) fn timed_out(status: &Status) -> bool {
    status.code() == Code::Cancelled && status.message() == tonic::TimeoutExpired(()).to_string()
}

/// The code and message to show for `status`. The client's own [`REQUEST_TIMEOUT`] reaches
/// us as tonic's `CANCELLED: Timeout expired`; it is shown as what it is, `DEADLINE_EXCEEDED`
/// with the time waited (a server that takes the connection and never answers).
fn code_and_message(status: &Status) -> (Code, String) {
    if timed_out(status) {
        return (
            Code::DeadlineExceeded,
            format!(
                "no answer from the server within {} s",
                REQUEST_TIMEOUT.as_secs()
            ),
        );
    }
    let message = match status.message() {
        "" => status.code().description(),
        message => message,
    };
    (status.code(), message.to_owned())
}

/// `CODE_NAME: message` on one line, for a status shown without failing the command.
pub fn status_line(status: &Status) -> String {
    let (code, message) = code_and_message(status);
    let message = message.split_whitespace().collect::<Vec<_>>().join(" ");
    format!("{}: {message}", code_name(code))
}

/// [`failed`] with a message of our own (a summary of diagnostics printed on stdout, say).
/// A code whose usual cause is the command line (see [`hint`]) gets a second line,
/// `retryplane: hint: …`, saying what to check.
pub fn failed_with(code: Code, message: &str, stdout: String) -> Report {
    output::error(format_args!("{}: {message}", code_name(code)));
    if let Some(hint) = hint(code) {
        output::note(format_args!("retryplane: hint: {hint}"));
    }
    if code == Code::Unauthenticated {
        bearer_note();
    }
    Report {
        stdout,
        outcome: if refused(code) {
            Outcome::Failure
        } else {
            Outcome::Error
        },
    }
}

/// What to check when the server answers `code` to an admin call, when the usual cause is the
/// command line: `--server` naming another listener of the control plane (the agent one, whose
/// gRPC server has no admin service, or the HTTP one, which answers a gRPC call
/// `UNIMPLEMENTED`), or no admin token.
fn hint(code: Code) -> Option<&'static str> {
    match code {
        Code::Unimplemented => Some(
            "the server does not offer this admin call: --server takes the admin listener of \
             `retryplane serve` (--admin-listen, port 7471 by default), not its agent listener \
             (--listen, 7470) or its HTTP listener (--http-listen, 7472)",
        ),
        Code::DeadlineExceeded => Some(
            "is --server the admin listener of a running `retryplane serve` (--admin-listen, \
             port 7471 by default)? A server that accepts the connection and never answers \
             ends like this",
        ),
        Code::Unavailable => Some(
            "is --server the admin listener of a running `retryplane serve` (--admin-listen, \
             port 7471 by default)? A connection that breaks, or a server of another kind on \
             that port, ends like this",
        ),
        // A read (`get`, `history`, `status`, `stats`, `top`, `diff`) takes a viewer token too.
        Code::Unauthenticated => Some(
            "give a token of role admin (or viewer, for a command that only reads) with --token \
             or RETRYPLANE_TOKEN",
        ),
        _ => None,
    }
}

/// The canonical name of a gRPC code (`PERMISSION_DENIED`).
pub fn code_name(code: Code) -> &'static str {
    GrpcCode::from_i32(code as i32).map_or("UNKNOWN", GrpcCode::name)
}

/// Whether a code means "the server understood and said no" (exit 1) rather than "the call
/// did not work" (exit 2: unreachable, timed out, cancelled, a server fault).
pub fn refused(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::FailedPrecondition
            | Code::Aborted
            | Code::OutOfRange
            | Code::ResourceExhausted
    )
}

/// The first 12 hex digits of a content hash (a `sha256:` prefix is dropped).
pub fn short_hash(hash: &str) -> &str {
    let hex = hash.strip_prefix("sha256:").unwrap_or(hash);
    hex.char_indices().nth(12).map_or(hex, |(i, _)| &hex[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(url: &str, token: Option<&str>) -> anyhow::Result<Server> {
        Server::try_from(ServerArgs {
            server: Some(url.to_owned()),
            token: token.map(|t| Token(t.to_owned())),
        })
    }

    #[test]
    fn a_token_no_tokens_file_could_hold_is_refused_without_showing_it() {
        for token in [
            "bad token \u{fc}",
            "tab\there-0123456789",
            "bell\u{7}-0123456789",
        ] {
            let e = server("127.0.0.1:7471", Some(token))
                .unwrap_err()
                .to_string();
            assert!(e.contains("printable ASCII"), "{e}");
            assert!(!e.contains("bad token") && !e.contains("here-"), "{e}");
        }
        // Spaces inside are a secret's.
        assert!(server("127.0.0.1:7471", Some("with a space-0123456789")).is_ok());
    }

    #[test]
    fn every_command_line_definition_is_consistent() {
        use clap::CommandFactory as _;
        crate::Cli::command().debug_assert();
    }

    #[test]
    fn a_server_without_scheme_is_plain_http() {
        assert_eq!(
            server("127.0.0.1:7471", None).unwrap().url,
            "http://127.0.0.1:7471"
        );
        // No port: the admin listener's, not HTTP's 80.
        assert_eq!(
            server("127.0.0.1", None).unwrap().url,
            "http://127.0.0.1:7471/"
        );
        assert_eq!(
            server("http://[::1]", None).unwrap().url,
            "http://[::1]:7471/"
        );
        assert_eq!(
            server("http://cp.internal:9000", None).unwrap().url,
            "http://cp.internal:9000"
        );
        assert_eq!(
            server("", None).unwrap().url,
            DEFAULT_SERVER,
            "empty is unset"
        );
        assert!(server("https://cp.example:7471", None).is_err());
        assert!(server("http://bad host", None).is_err());
    }

    #[test]
    fn a_port_that_is_not_one_is_named_as_written_with_no_second_port_added() {
        for (given, written) in [
            ("127.0.0.1:99999", "http://127.0.0.1:99999"),
            ("http://[::1]:70000/", "http://[::1]:70000/"),
            ("cp.internal:0", "http://cp.internal:0"),
            ("cp.internal:7x", "http://cp.internal:7x"),
        ] {
            let e = format!("{:#}", server(given, None).unwrap_err());
            assert!(
                e.starts_with(&format!(
                    "--server {written}: the port must be a number from 1 to 65535"
                )),
                "{given}: {e}"
            );
        }
        let e = format!("{:#}", server("127.0.0.1:", None).unwrap_err());
        assert_eq!(
            e,
            "--server http://127.0.0.1:: no port after the `:`: give one from 1 to 65535"
        );
        // The agent listener's default is added the same way by `request --server`.
        assert_eq!(
            with_default_port("http://u@[::1]".to_owned(), 7470, "--server").unwrap(),
            "http://u@[::1]:7470/"
        );
        assert_eq!(
            with_default_port("http://[::1]:9000".to_owned(), 7470, "--server").unwrap(),
            "http://[::1]:9000"
        );
    }

    #[test]
    fn a_server_without_a_scheme_is_http_and_a_scheme_in_capitals_is_lowered() {
        for (given, url) in [
            ("cp:7472", "http://cp:7472"),
            ("HTTP://cp:7472", "http://cp:7472"),
            ("Http://u@cp:7472", "http://u@cp:7472"),
            ("http://cp:7472", "http://cp:7472"),
            // Not a scheme: as given (and refused for it later).
            ("cp/?x=HTTP://y", "cp/?x=HTTP://y"),
            ("HTTPS://cp", "https://cp"),
        ] {
            assert_eq!(with_scheme(given.to_owned()), url, "{given}");
        }
        let s = server("HTTP://127.0.0.1:9", None).unwrap();
        assert_eq!(s.endpoint.uri().to_string(), "http://127.0.0.1:9/");
        let e = server("HTTPS://127.0.0.1:9", None).unwrap_err();
        assert!(e.to_string().contains("only http://"), "{e}");
    }

    #[test]
    fn the_token_never_shows_in_debug_output_or_errors() {
        let s = server(DEFAULT_SERVER, Some("s3cret-token")).unwrap();
        assert!(!format!("{s:?}").contains("s3cret"));
        let args = ServerArgs {
            server: Some(DEFAULT_SERVER.to_owned()),
            token: Some(Token("s3cret".to_owned())),
        };
        assert!(!format!("{args:?}").contains("s3cret"));
        let e = server(DEFAULT_SERVER, Some("bad\ns3cret")).unwrap_err();
        assert!(!format!("{e:#}").contains("s3cret"));
    }

    #[test]
    fn a_password_in_a_url_is_shown_as_stars() {
        for (given, shown) in [
            // Up to the last `@`: more than the password when a query holds one, never less.
            ("http://u:pw@h:1/p?q=a@b", "http://u:***@b"),
            ("http://u:p:w@[::1]:7471", "http://u:***@[::1]:7471"),
            ("http://a@b:pw@h", "http://a@b:***@h"),
            ("u:pw@h:1", "u:***@h:1"),
            ("http://bad host:pw@x y/", "http://bad host:***@x y/"),
            // No password: as given.
            ("http://u@h:1", "http://u@h:1"),
            ("http://h:1/p", "http://h:1/p"),
            ("http://h:1", "http://h:1"),
            ("", ""),
        ] {
            assert_eq!(shown_url(given), shown, "{given}");
        }
        let s = server("http://admin:s3cret@127.0.0.1:1", None).unwrap();
        assert!(
            !s.endpoint.uri().to_string().contains('@'),
            "{:?}",
            s.endpoint.uri()
        );
        assert_eq!(s.url, "http://admin:***@127.0.0.1:1");
        let e = server("http://admin:s3cret@127.0.0.1:0", None).unwrap_err();
        assert!(!format!("{e:#}").contains("s3cret"), "{e:#}");
    }

    #[test]
    fn a_server_url_whose_password_ends_its_authority_early_is_refused_unquoted() {
        for given in [
            "http://admin:secretpw#x@h",
            "http://admin:secretpw?x@h",
            "http://admin:secretpw/x@h",
        ] {
            let err = with_default_port(given.to_owned(), 7471, "--server")
                .expect_err(given)
                .to_string();
            assert!(!err.contains("secretpw"), "{given}: {err}");
        }
        // An `@` in a path is no password: the port is taken as it is (and the URL refused
        // later, by `no_at_after_host`: only its scheme, host and port are used).
        assert_eq!(
            with_default_port("http://h:1/p@x".to_owned(), 7471, "--server").unwrap(),
            "http://h:1/p@x"
        );
        assert_eq!(
            with_default_port("http://admin:pw@h".to_owned(), 7471, "--server").unwrap(),
            "http://admin:pw@h:7471/"
        );
    }

    #[test]
    fn the_userinfo_of_a_server_url_is_not_sent() {
        assert_eq!(
            without_userinfo("http://admin:s3cret@127.0.0.1:1"),
            ("http://127.0.0.1:1".to_owned(), true)
        );
        assert_eq!(
            without_userinfo("http://u@[::1]:7470/"),
            ("http://[::1]:7470/".to_owned(), true)
        );
        assert_eq!(
            without_userinfo("http://127.0.0.1:1"),
            ("http://127.0.0.1:1".to_owned(), false)
        );
    }

    #[test]
    fn refusals_exit_1_and_transport_failures_exit_2() {
        assert!(refused(Code::InvalidArgument));
        assert!(refused(Code::Aborted));
        assert!(refused(Code::PermissionDenied));
        assert!(refused(Code::Unauthenticated));
        assert!(!refused(Code::Unavailable));
        assert!(!refused(Code::DeadlineExceeded));
        assert!(!refused(Code::Internal));
        assert_eq!(code_name(Code::PermissionDenied), "PERMISSION_DENIED");
        assert_eq!(code_name(Code::Unavailable), "UNAVAILABLE");
    }

    #[test]
    fn a_wrong_listener_or_a_missing_token_gets_a_hint() {
        assert!(hint(Code::Unimplemented).is_some_and(|h| h.contains("--admin-listen")));
        assert!(hint(Code::Unauthenticated).is_some_and(|h| h.contains("RETRYPLANE_TOKEN")));
        assert!(hint(Code::Unavailable).is_some_and(|h| h.contains("--admin-listen")));
        assert_eq!(hint(Code::PermissionDenied), None);
        assert_eq!(hint(Code::Aborted), None);
    }

    #[test]
    fn the_request_timeout_is_shown_as_a_deadline_with_the_time_waited() {
        // What tonic answers when `REQUEST_TIMEOUT` passes without an answer.
        let timed_out = Status::cancelled(tonic::TimeoutExpired(()).to_string());
        let (code, message) = code_and_message(&timed_out);
        assert_eq!(code, Code::DeadlineExceeded);
        assert_eq!(message, "no answer from the server within 30 s");
        assert!(hint(code).is_some_and(|h| h.contains("--admin-listen")));
        assert_eq!(
            status_line(&timed_out),
            "DEADLINE_EXCEEDED: no answer from the server within 30 s"
        );
        // Still exit 2: the call did not work.
        assert!(!refused(code));
        // Another cancellation keeps its code and message.
        let cancelled = Status::cancelled("the server went away");
        assert_eq!(
            code_and_message(&cancelled),
            (Code::Cancelled, "the server went away".to_owned())
        );
    }

    #[test]
    fn hashes_are_shortened_to_12_hex_digits() {
        assert_eq!(short_hash("0123456789abcdef0123"), "0123456789ab");
        assert_eq!(short_hash("sha256:0123456789abcdef"), "0123456789ab");
        assert_eq!(short_hash("abc"), "abc");
    }
}
