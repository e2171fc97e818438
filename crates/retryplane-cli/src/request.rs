//! `retryplane request --policy FILE --endpoint NAME [-X METHOD] [-H 'Name: value']...
//! [--data BODY] [--output text|json] URL`: one HTTP call made through the agent under the
//! endpoint's policy (SPEC §2, §5).
//!
//! With `--server URL` instead of `--policy` (one of the two is required), an agent connects to
//! the control plane's *agent* listener (`retryplane serve`'s `--listen`, 127.0.0.1:7470 by
//! default; not the admin listener the admin commands' `--server` names) and the call waits for
//! its first snapshot, at most [`SNAPSHOT_WAIT`]; a refusal that another try would only repeat
//! (no or a wrong token, the admin listener named instead) ends the wait at once, and the
//! error says what the control plane answered and what to do. Before the command exits the agent sends its
//! counts of the call and closes its stream ([`SHUTDOWN_WAIT`] at most), so `retryplane stats`
//! shows the call and `status` shows the agent as gone; when the control plane did not
//! acknowledge the counts by then (it went away, or is stalled), a note on stderr says so.
//!
//! `-H` takes curl's forms: `Name: value`, sent (two of a name are both sent, but `host` takes
//! one, and with `--data` the client's `content-length` cannot be replaced); `Name;`, which
//! sends `Name` with an empty value; and `Name:` (nothing after the colon), which, as in curl,
//! only leaves out a header the HTTP client would add by itself, never one a `-H` gives a
//! value. The client's own `accept: */*`, `host`, with `--data` `content-length`, and for a URL
//! with a `user:password@` `authorization: Basic …` cannot be left out here: `Name:` for one of
//! them, with no `-H` giving it a value, is an error rather than a header sent anyway. A `-H`
//! that is wrong is named by its position (`the 2nd -H`), never quoted: what fails to parse as a
//! name may be a value.
//!
//! The `user:password@` of a `--server` URL is not used (the agent sends its token): it is left
//! out of what the agent sends, with a note on stderr. An `@` after the host (in a path or
//! query, or in a password holding `/`, `?` or `#`, which ends the host early) is refused.
//!
//! The method is `-X`, else `POST` with `--data`, else `GET` (as curl). Redirects are not
//! followed: a 3xx is the upstream's answer. The response body is read (so a reset mid-body is a
//! failed attempt) and discarded: stdout gets one line per attempt and the outcome, or with
//! `--output json` the SPEC §5 object `{outcome, cause, status, attempts, elapsed_ms}`. A call
//! that fails on an error rather than an HTTP status also says on stderr what its last attempt
//! ran into (`retryplane: error: request failed: …`: connection refused, a name that does not
//! resolve, a TLS handshake, an answer that is not HTTP), which its class alone does not.
//! Header values, the URL's query and the body are never printed, nor the password of a URL's
//! userinfo (`user:***@host` in messages).
//!
//! Ctrl-C (SIGINT) during the call cancels it, as a caller dropping it would: the outcome is
//! printed with the cause `cancelled` (the attempt it cut shows no answer; in JSON, no error
//! class), with `--server` its counts are reported, and the command exits 1.
//!
//! Exit codes: `0` success, `1` the call failed under the policy, `2` usage or configuration
//! error (bad flags, an unreadable or invalid policy file, an unknown endpoint, no snapshot from
//! the control plane in time).

mod connect_by;
mod report;

use std::cell::RefCell;
use std::fmt;
use std::path::PathBuf;
use std::rc::Rc;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use retryplane_agent::{
    Agent, AttemptInfo, CallMeta, CancellationToken, Cause, Classification, Classify,
    CounterValues, GiveUpCause, Outcome, Source,
};
use retryplane_policy::document::Target;
use retryplane_policy::duration::format_duration;
use retryplane_policy::model::{ErrorClass, RetryPolicy};
use retryplane_policy::retry_after::Pushback;
use tokio::time::Instant;

use crate::admin::Token;
use crate::input::{self, no_such_endpoint};
use crate::output::{self, Format};
use crate::{Outcome as Exit, Report};
use connect_by::ConnectBy;
use report::{Attempt, Summary};

/// The agent listener's port of `retryplane serve`, used when `--server` names none.
const AGENT_PORT: u16 = 7470;

/// How long `--server` waits for the control plane's first snapshot.
pub const SNAPSHOT_WAIT: Duration = Duration::from_secs(5);

/// How long `--server` waits, at the end, for the agent to send its last report and close its
/// stream (the agent's own wait for the control plane is shorter; this bounds the rest).
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(3);

/// `retryplane request` flags, as parsed. Exactly one of `--policy` and `--server` says where
/// the policy comes from (SPEC §5).
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("policy_from").required(true).args(["policy", "server"])))]
pub struct Args {
    /// Policy file; `-` reads standard input.
    #[arg(long, value_name = "FILE", conflicts_with = "server")]
    policy: Option<PathBuf>,
    /// Use the policy a control plane serves its agents: the URL of its agent listener (not
    /// the admin one), for example http://127.0.0.1:7470, the default of `retryplane serve`
    /// (port 7470 when the URL names none).
    /// The call's counts are reported to it before the command exits (a note on stderr says
    /// when it did not acknowledge them before the command stopped waiting, 3 s at most).
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    /// Agent token for --server, sent as `authorization: Bearer TOKEN`. Not given or empty:
    /// RETRYPLANE_AGENT_TOKEN, and no token when that is unset or empty too.
    #[arg(long, value_name = "TOKEN")]
    token: Option<Token>,
    /// The endpoint whose policy the call runs under.
    #[arg(long, value_name = "NAME")]
    endpoint: String,
    /// HTTP method [default: POST with --data, else GET].
    #[arg(short = 'X', long = "request", value_name = "METHOD")]
    method: Option<String>,
    /// A request header, `Name: value` (repeatable; two of a name are both sent, but `Host`
    /// takes one and with --data `Content-Length` is the client's). As in curl,
    /// `Name;` sends `Name` with an empty value, and `Name:` with no value only leaves out a
    /// header the HTTP client would add itself, never one an -H gives (the client's `Accept`,
    /// `Host`, with --data `Content-Length` and for a URL with user:password@ `Authorization`
    /// cannot be left out: that is an error unless an -H gives it a value).
    #[arg(short = 'H', long = "header", value_name = "'NAME: VALUE'")]
    headers: Vec<Secret>,
    /// The request body; `@FILE` sends FILE's bytes as they are (`@-`: standard input), as
    /// curl's --data-binary does.
    #[arg(long, value_name = "BODY|@FILE")]
    data: Option<Secret>,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: Format,
    /// The URL to call (`http://` or `https://`).
    url: String,
}

/// The largest body `--data @FILE` reads: the call keeps it to send again on a retry.
const MAX_BODY_FILE: u64 = 64 << 20;

/// The body `--data` gives: the text itself, or the bytes of the file after an `@` (`@-`:
/// standard input).
fn body_of(Secret(data): Secret) -> anyhow::Result<Bytes> {
    use std::io::Read as _;
    let Some(path) = data.strip_prefix('@').filter(|p| !p.is_empty()) else {
        return Ok(Bytes::from(data));
    };
    let mut bytes = Vec::new();
    let read = if path == "-" {
        std::io::stdin()
            .lock()
            .take(MAX_BODY_FILE + 1)
            .read_to_end(&mut bytes)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(MAX_BODY_FILE + 1).read_to_end(&mut bytes))
    };
    let shown = if path == "-" { "standard input" } else { path };
    read.with_context(|| format!("--data @{path}: cannot read {shown}"))?;
    if bytes.len() as u64 > MAX_BODY_FILE {
        bail!(
            "--data @{path}: {shown} is larger than {} MiB, the most a request body may be",
            MAX_BODY_FILE >> 20
        );
    }
    Ok(Bytes::from(bytes))
}

/// A flag value that may hold a secret (a header value, a body): never shown by
/// `Debug`.
#[derive(Clone)]
pub struct Secret(String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// Where the policy comes from.
#[derive(Debug)]
pub enum PolicyFrom {
    /// A policy file (or stdin).
    File(input::Source),
    /// The control plane's agent listener (its URL without any `user:password@`), with an
    /// optional token, and the URL as messages show it (as given, the password as `***`).
    Server(String, Option<Token>, String),
}

/// The call to make, checked once.
#[derive(Debug)]
pub struct Settings {
    policy: PolicyFrom,
    endpoint: String,
    method: Method,
    url: reqwest::Url,
    headers: HeaderMap,
    body: Option<Bytes>,
    format: Format,
}

/// With `RUST_LOG` set, the agent's log lines (one per attempt and an ignored malformed
/// `Retry-After` at debug, a call that failed at warn; never header values or bodies) go to
/// stderr, under that filter. Without it nothing is logged: the output is the report alone.
fn init_logging() {
    let Ok(spec) = std::env::var("RUST_LOG") else {
        return;
    };
    match tracing_subscriber::EnvFilter::try_new(&spec) {
        Ok(filter) => {
            // Set already (never, in the binary) is not worth failing the request over.
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .log_internal_errors(false)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .try_init();
        }
        Err(e) => crate::output::note(format_args!(
            "retryplane: RUST_LOG is not a valid filter ({e}); nothing is logged"
        )),
    }
}

/// The request's URL as an error shows it: without its password and query
/// ([`crate::shown::without_query`]), or as `Name: ***` when it is a header typed where
/// the URL goes (`Authorization: Bearer …` parses as a URL of scheme `authorization`).
fn shown_target(url: &str) -> String {
    crate::shown::header_shown(url).unwrap_or_else(|| crate::shown::without_query(url))
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        let method = match &args.method {
            Some(m) => Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                // A header typed after `-X` instead of `-H` is shown without its value.
                .map_err(|_| anyhow::anyhow!("-X {}: not an HTTP method", shown_target(m)))?,
            None if args.data.is_some() => Method::POST,
            None => Method::GET,
        };
        // After an `-H 'Name:'` with no value, a URL without a scheme may be that header's
        // value, split from it by the shell (`-H X-Api-Key: s3cret`, quotes forgotten).
        let split = args
            .headers
            .iter()
            .any(|Secret(h)| h.trim_end().ends_with(':'))
            && !args.url.contains("://");
        let shown = || {
            if split {
                "***".to_owned()
            } else {
                shown_target(&args.url)
            }
        };
        // White space around the URL is dropped (the parser drops it too), and `http:/host`
        // is `http://host` (WHATWG URL, as browsers and curl read it).
        let text = args.url.trim_ascii();
        let url = match reqwest::Url::parse(text) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => url,
            parsed => {
                // `localhost:8080/x` parses with `localhost` for its scheme, `[::1]:8080/x` not
                // at all, `Authorization: Bearer …` (a header typed where the URL goes) with
                // `authorization`: said to name no scheme, as no scheme is followed by a port
                // or a space. Not taken as `http://` as curl would: the text may be a header's
                // value (see `split`), which must not become a host name to look up.
                if split || names_no_scheme(text) {
                    bail!(
                        "{}: the URL names no scheme: write http:// or https:// before the host",
                        shown()
                    );
                }
                match parsed {
                    // `mailto:`, `ftp://`: a scheme, not one of ours.
                    Ok(_) => bail!("{}: only http:// and https:// URLs are supported", shown()),
                    Err(e) => {
                        return Err(anyhow::Error::new(e))
                            .with_context(|| format!("{}: not a valid URL", shown()));
                    }
                }
            }
        };
        if url.port() == Some(0) {
            bail!("{}: the port must be a number from 1 to 65535", shown());
        }
        let headers = headers_of(&args.headers, args.data.is_some(), has_userinfo(&url))?;
        let policy = match (args.policy, args.server) {
            (Some(path), _) => PolicyFrom::File(input::Source::from_arg(path)),
            (None, Some(url)) => {
                // Unlike the admin commands' `--server`, this one has no variable or default to
                // fall back to: an empty one (a script's `--server "$CP"` with the variable
                // unset) is said to be empty, not quoted as the `http://` put before it.
                if url.trim_ascii().is_empty() {
                    bail!(
                        "--server is empty: give the control plane's agent listener, \
                         http://HOST:PORT (port {AGENT_PORT} when not given)"
                    );
                }
                let url = crate::admin::with_scheme(url);
                // The agent's token would go out in clear text on a URL that asked for TLS.
                if !url.starts_with("http://") {
                    bail!(
                        "--server {}: only http:// is supported (TLS on the agent listener \
                         comes later)",
                        crate::shown::without_query(&url)
                    );
                }
                let token_hint = "give the agent token with --token or RETRYPLANE_AGENT_TOKEN";
                crate::admin::no_at_after_host(&url, "--server", token_hint)?;
                let url = crate::admin::with_default_port(url, AGENT_PORT, "--server")?;
                let shown = crate::shown::without_query(&url);
                let (url, had_userinfo) = crate::admin::without_userinfo(&url);
                if had_userinfo {
                    crate::admin::userinfo_not_used(token_hint);
                }
                crate::admin::path_not_used(&url);
                // An empty value counts as not given, as for the admin commands: an empty
                // `--token` falls back to `RETRYPLANE_AGENT_TOKEN`, and an empty variable is no
                // token (nothing is sent rather than an empty credential).
                let token = Token::from_flag_or_env(args.token, "RETRYPLANE_AGENT_TOKEN")?;
                PolicyFrom::Server(url, token, shown)
            }
            // Unreachable: clap refuses a command line without either (`policy_from` is required).
            (None, None) => bail!("say where the policy comes from: --policy FILE or --server URL"),
        };
        if matches!(policy, PolicyFrom::File(input::Source::Stdin))
            && args.data.as_ref().is_some_and(|Secret(d)| d == "@-")
        {
            bail!("--policy - and --data @- both read standard input; give one of them a file");
        }
        Ok(Self {
            policy,
            endpoint: args.endpoint,
            method,
            url,
            headers,
            body: args.data.map(body_of).transpose()?,
            format: args.output,
        })
    }
}

/// What one `-H` asks for, in curl's forms.
#[derive(Debug)]
enum HeaderFlag {
    /// `Name: value`, or `Name;` (an empty value).
    Send(HeaderName, HeaderValue),
    /// `Name:` with nothing (or only spaces) after the colon: no such header is sent.
    Leave(HeaderName),
}

/// Whether `url` has a `user[:password]@`, which the HTTP client sends as
/// `authorization: Basic …`.
fn has_userinfo(url: &reqwest::Url) -> bool {
    !url.username().is_empty() || url.password().is_some()
}

/// The headers the `-H` flags ask for, as curl reads them: every `Name: value` (and `Name;`) is
/// sent, and `Name:` only leaves out a header the HTTP client would add itself. Leaving out one
/// it adds whatever the flags say ([`sent_by_the_client`]) is an error, unless a `-H` gives that
/// name a value (which replaces the client's). `body`: whether the request has one; `userinfo`:
/// whether the URL has a `user:password@`.
fn headers_of(flags: &[Secret], body: bool, userinfo: bool) -> anyhow::Result<HeaderMap> {
    let mut headers = HeaderMap::new();
    // The `-H` that asked to leave out a header the client sends anyway, by name.
    let mut left_out: Vec<(HeaderName, usize)> = Vec::new();
    for (i, Secret(h)) in flags.iter().enumerate() {
        let position = i + 1;
        match parse_header(h)
            .map_err(|why| anyhow::anyhow!("the {} -H: {why}", ordinal(position)))?
        {
            HeaderFlag::Send(name, value) => {
                headers.append(name, value);
            }
            HeaderFlag::Leave(name) => {
                if sent_by_the_client(&name, body, userinfo).is_some() {
                    left_out.push((name, position));
                }
            }
        }
    }
    // Headers HTTP/1.1 allows once, or that the client sets itself whatever the flags say.
    if headers.get_all(http::header::HOST).iter().count() > 1 {
        bail!("two -H give `host` a value; a request has one host");
    }
    if body && headers.contains_key(http::header::CONTENT_LENGTH) {
        bail!(
            "an -H gives `content-length` a value; the HTTP client sends the length of the \
             --data body"
        );
    }
    if let Some((name, position)) = left_out.iter().find(|(n, _)| !headers.contains_key(n))
        && let Some(why) = sent_by_the_client(name, body, userinfo)
    {
        bail!(
            "the {} -H ('{name}:'): {why}, and cannot be left out",
            ordinal(*position)
        );
    }
    Ok(headers)
}

/// `1st`, `2nd`, `3rd`, `4th`, … `11th`, `12th`, `13th`, … `21st`.
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// `Name: value`, `Name:` or `Name;` → what to do. The error says what is wrong and quotes
/// nothing of the text: what fails to parse as a name may be a value (`Cookie session=…`).
fn parse_header(text: &str) -> Result<HeaderFlag, &'static str> {
    let (name, value) = match text.split_once(':') {
        Some((name, value)) => (name, Some(value.trim())),
        // `Name;` and nothing after it: the header, empty (curl's way of asking for one).
        None => match text.split_once(';') {
            Some((name, rest)) if rest.trim().is_empty() => (name, None),
            _ => {
                return Err(
                    "expected 'Name: value', 'Name:' (no such header) or 'Name;' (an empty one)",
                );
            }
        },
    };
    let name = name.trim();
    if name.is_empty() {
        return Err("no header name before the `:` or `;`");
    }
    let name = HeaderName::from_str(name).map_err(|_| {
        "the text before the `:` or `;` is not a valid header name (letters, digits and \
         !#$%&'*+-.^_`|~ only, no spaces)"
    })?;
    let value = match value {
        Some("") => return Ok(HeaderFlag::Leave(name)),
        Some(value) => value,
        None => "",
    };
    let mut value = HeaderValue::from_str(value)
        .map_err(|_| "the value holds characters not allowed in a header")?;
    value.set_sensitive(true);
    Ok(HeaderFlag::Send(name, value))
}

/// Why the HTTP client sends `name` whatever the flags say, if it does: `-H 'Name:'` cannot
/// leave it out (a `-H 'Name: value'` replaces it). `body`: whether the request has one;
/// `userinfo`: whether the URL has a `user:password@`.
fn sent_by_the_client(name: &HeaderName, body: bool, userinfo: bool) -> Option<&'static str> {
    match name.as_str() {
        "accept" => Some("the HTTP client sends `accept: */*` when no -H gives a value"),
        "host" => Some("the HTTP client sends `host` from the URL, as HTTP/1.1 requires"),
        "content-length" if body => Some("the HTTP client sends the length of the --data body"),
        "authorization" if userinfo => Some(
            "the HTTP client sends `authorization: Basic …` from the URL's user:password@ when \
             no -H gives a value",
        ),
        _ => None,
    }
}

/// Makes the call; see the module docs.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    init_logging();
    let agent = match &settings.policy {
        PolicyFrom::File(source) => from_file(source, &settings.endpoint)?,
        PolicyFrom::Server(..) => None,
    };
    crate::admin::block_on(async move {
        let agent = match (agent, &settings.policy) {
            (Some(agent), _) => agent,
            (None, PolicyFrom::Server(url, token, shown)) => {
                from_server(url, shown, token.as_ref(), &settings.endpoint).await?
            }
            (None, PolicyFrom::File(_)) => bail!("no policy"),
        };
        // The report goes out as soon as the call ends (not after the agent's counts are
        // flushed), and the lines that explain it after it: at a terminal they come under
        // the attempts they speak of.
        let printed = call(&agent, settings).await.and_then(|summary| {
            let stdout = match settings.format {
                Format::Text => summary.to_text(),
                Format::Json => summary.to_json()?,
            };
            output::stdout_then_notes(&stdout, &summary.notes).context("cannot write to stdout")?;
            Ok(summary.success)
        });
        if let PolicyFrom::Server(_, _, shown) = &settings.policy {
            let reported = shutdown(&agent).await;
            if !reported || counts_left(&agent, &settings.endpoint) {
                output::note(format_args!(
                    "retryplane: note: the call's counts may not be in the fleet's figures: the \
                     control plane at {shown} did not acknowledge them (it went away, or did not \
                     answer before the command stopped waiting, {} s at most)",
                    SHUTDOWN_WAIT.as_secs()
                ));
            }
        }
        Ok(Report {
            stdout: String::new(),
            outcome: if printed? {
                Exit::Success
            } else {
                Exit::Failure
            },
        })
    })
}

/// An agent on a policy file; its problems and an unknown endpoint are configuration errors.
fn from_file(source: &input::Source, endpoint: &str) -> anyhow::Result<Option<Agent>> {
    let loaded = source.load()?;
    let file = source.to_string();
    let policies = match loaded.policies {
        Some(set) if !loaded.has_errors() => set,
        _ => {
            for d in loaded.diagnostics.iter().filter(|d| d.is_error()) {
                output::note(format_args!("{file}:{d}"));
            }
            bail!("{file} is not a valid policy file");
        }
    };
    if policies.endpoint(endpoint).is_none() {
        return Err(no_such_endpoint(&file, endpoint, &policies.names()));
    }
    Ok(Some(Agent::from_policies(policies)))
}

/// What to do about a control plane's refusal with `code` that trying again would not change;
/// `None` for any other code (the wait goes on).
fn refusal_hint(code: tonic::Code) -> Option<&'static str> {
    match code {
        tonic::Code::Unauthenticated => Some(
            "give the agent token with --token or RETRYPLANE_AGENT_TOKEN (admin commands read \
             RETRYPLANE_TOKEN; this one does not)",
        ),
        tonic::Code::PermissionDenied => Some(
            "the token given is of another role, or the control plane's tokens file holds it to \
             `services` that leave out this command's service, `retryplane-cli` (list it among \
             them), or to `agent_ids` that leave out its agent id, `retryplane-cli-` and 16 hex \
             digits (list `retryplane-cli-*` among them); the error above says which",
        ),
        // What the admin listener answers, and the HTTP one (a web server's 404 maps to it too).
        tonic::Code::Unimplemented => Some(
            "this is not an agent listener: --server takes the address of `retryplane serve \
             --listen` (port 7470 by default), not its admin listener (--admin-listen, 7471) or \
             its HTTP listener (--http-listen, 7472)",
        ),
        _ => None,
    }
}

/// An agent on the control plane's policies at `url`, once its first snapshot is in; `shown`
/// names the control plane in messages.
async fn from_server(
    url: &str,
    shown: &str,
    token: Option<&Token>,
    endpoint: &str,
) -> anyhow::Result<Agent> {
    // Ephemeral: the control plane does not list it once the command is done.
    let mut builder = Agent::builder()
        .url(url)
        .service("retryplane-cli")
        .ephemeral(true);
    if let Some(t) = token {
        builder = builder.token(t.secret());
    }
    let url = shown;
    let agent = builder
        .connect()
        .with_context(|| format!("--server {url}"))?;
    match first_snapshot(&agent, url, endpoint).await {
        Ok(()) => Ok(agent),
        Err(e) => {
            shutdown(&agent).await;
            Err(e)
        }
    }
}

/// Waits for `agent`'s first snapshot from the control plane at `url` (as shown in messages),
/// which must define `endpoint`.
async fn first_snapshot(agent: &Agent, url: &str, endpoint: &str) -> anyhow::Result<()> {
    let waited = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while agent.policies().source() != Source::ControlPlane {
        let error = agent.stream_error();
        // An answer that another try would only repeat ends the wait at once.
        if let Some(e) = &error
            && let Some(hint) = e.code.and_then(refusal_hint)
        {
            if e.code == Some(tonic::Code::Unauthenticated) {
                crate::admin::bearer_note();
            }
            bail!("the control plane at {url} refused the agent: {e}; {hint}");
        }
        // The control plane sends a refused version to the same agent only once: no point
        // waiting. (Waited out, it read as a control plane with nothing to send.)
        if let Some(refusal) = agent.last_refusal() {
            bail!(
                "the control plane at {url} sent a policy this command's agent refused \
                 ({refusal}); it keeps serving it to the fleet: check its agents with \
                 `retryplane status` on its admin listener"
            );
        }
        if waited.elapsed() >= SNAPSHOT_WAIT {
            // A stream that is open and quiet: the control plane has nothing to send yet.
            let why = match error {
                Some(e) => format!(": {e}"),
                None if agent.is_connected() => ": it took the agent's stream but has no \
                    version to send (a control plane in API mode with an empty store has none \
                    until the first `retryplane apply`; `retryplane status` on its admin \
                    listener says `no version yet`)"
                    .to_owned(),
                None => String::new(),
            };
            bail!(
                "no policy from the control plane at {url} within {} s{why}",
                SNAPSHOT_WAIT.as_secs()
            );
        }
        tick.tick().await;
    }
    let snapshot = agent.policies();
    if let Some(set) = snapshot.set()
        && set.endpoint(endpoint).is_none()
    {
        let source = format!("the control plane at {url}");
        return Err(no_such_endpoint(&source, endpoint, &set.names()));
    }
    Ok(())
}

/// Stops a connected agent: its last report goes out and its stream is closed, within
/// [`SHUTDOWN_WAIT`] (past it the command exits anyway; the report is then lost). Whether it
/// stopped within the bound.
async fn shutdown(agent: &Agent) -> bool {
    // Past the bound the command's answer matters more than the report: exit without it.
    tokio::time::timeout(SHUTDOWN_WAIT, agent.shutdown())
        .await
        .is_ok()
}

/// Whether a stopped `agent` kept counts of `endpoint` that no control plane acknowledged: in
/// reports not answered, or never put in one (no stream was up).
fn counts_left(agent: &Agent, endpoint: &str) -> bool {
    agent.unacknowledged_reports() > 0
        || agent.endpoint(endpoint).pending_counts() != CounterValues::default()
}

/// How long the client tries to connect in an attempt whose time limit is `limit` (the
/// smaller of `per_try_timeout` and what is left of the deadline, which the agent hands the
/// attempt): a little less. A connect that never completes (a host that drops the SYN) then
/// fails as a connect error, which it is: the request never reached the upstream, so it is
/// retried whatever the method, as a refused connect is. Without it the attempt's limit would
/// cut the connect, and a timeout is an unknown outcome.
fn connect_timeout(limit: Duration) -> Duration {
    // Ahead of the attempt's own timer by enough to win the race, and no more than needed.
    let margin = (limit / 10).min(Duration::from_millis(100));
    limit.saturating_sub(margin).max(Duration::from_millis(1))
}

/// Runs the call through the agent, recording each attempt from inside the attempt closure.
async fn call(agent: &Agent, s: &Settings) -> anyhow::Result<Summary> {
    // Each attempt sets when its connects give up (see `connect_by`).
    let connect_by = ConnectBy::default();
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connector_layer(connect_by.clone())
        .build()
        .context("cannot build the HTTP client")?;
    let body = s.body.clone();
    let records: Rc<RefCell<Vec<Attempt>>> = Rc::default();
    // The time limit of the attempt running, until it ends: an attempt dropped before it is
    // one the call's cancellation cut, not its limit.
    let running: Rc<std::cell::Cell<Option<Instant>>> = Rc::default();
    // Ctrl-C (SIGINT) cancels the call, as a caller dropping it would: it ends `cancelled`,
    // counted so, and with --server its counts are reported before the command exits.
    let cancel = CancellationToken::new();
    let on_interrupt = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                cancel.cancel();
            }
        })
    };
    // The handler is installed at the task's first poll: before the call starts.
    tokio::task::yield_now().await;
    let meta = CallMeta::http(s.method.as_str(), s.url.path())
        .with_headers(&s.headers)
        .with_cancel(cancel);
    let started = Instant::now();
    let attempt = |info: AttemptInfo| {
        {
            let mut recs = records.borrow_mut();
            if let Some(prev) = recs.last_mut() {
                prev.pause = info.pause_before;
            }
            recs.push(Attempt::started(info.number));
        }
        connect_by.set(Instant::now() + connect_timeout(info.timeout));
        running.set(Instant::now().checked_add(info.timeout));
        let mut request = client
            .request(s.method.clone(), s.url.clone())
            .headers(s.headers.clone());
        if let Some(b) = &body {
            // An empty body goes out with no length at all unless it is set: a POST or PUT
            // should say `content-length: 0` (RFC 9110 §8.6), and some servers answer 411
            // without it; as with curl's `-d ''`, any method given --data says it. The flags
            // cannot set it with --data, so it is never sent twice.
            if b.is_empty() {
                request = request.header(http::header::CONTENT_LENGTH, 0);
            }
            request = request.body(b.clone());
        }
        let records = records.clone();
        let running = running.clone();
        async move {
            let result = send(request).await;
            running.set(None);
            if let Some(rec) = records.borrow_mut().last_mut() {
                match &result {
                    Ok(r) => {
                        (rec.status, rec.error) = (Some(r.status().as_u16()), None);
                        rec.grpc = trailers_only_code(r);
                    }
                    Err(e) => rec.error = error_class(e),
                }
            }
            result
        }
    };
    // The notes below read the policy after the call: none when another version came in
    // during it (with --server), as it may not be the one the call ran under.
    let version = agent.policies().version();
    let result = agent.endpoint(&s.endpoint).call(meta, attempt).await;
    let same_policy = agent.policies().version() == version;
    on_interrupt.abort();
    let elapsed = started.elapsed();
    let mut attempts = records.take();
    // Whether the cancellation cut an attempt (not a pause): the call's final status is then
    // that attempt's, none, not the answer it kept from the attempt before.
    let mut cut = false;
    if matches!(&result, Err(e) if e.cause == Cause::Cancelled)
        && running.get().is_some_and(|limit| Instant::now() < limit)
        && let Some(last) = attempts.last_mut()
    {
        last.error = Some(report::CANCELLED);
        cut = true;
    }
    Ok(match result {
        Ok(response) => Summary {
            success: true,
            cause: None,
            status: Some(response.status().as_u16()),
            attempts,
            elapsed,
            notes: Vec::new(),
        },
        Err(e) => {
            // What the last attempt ran into, which its class alone does not say: refused,
            // a name that does not resolve, a TLS handshake, an upstream that does not speak
            // HTTP. (An attempt its time limit dropped has no error: `timeout` says it all.)
            let mut notes = Vec::new();
            if let Some(err) = e.error() {
                notes.push(format!("retryplane: error: {}", ErrorChain(err)));
            }
            // A cause alone does not say what the policy found in the last answer: why it was
            // not retried, which pause was asked for, what was left of the deadline. Said,
            // so that the fix (the policy, the request or the upstream's hint) is plain.
            if let Cause::GaveUp(cause) = e.cause
                && !cut
            {
                let last = match e.response() {
                    Some(answer) => match answer.classify() {
                        Classification::Outcome(outcome) => Some(outcome),
                        _ => None,
                    },
                    None => attempts
                        .last()
                        .and_then(|a| a.error)
                        .and_then(|class| ErrorClass::ALL.into_iter().find(|c| c.as_str() == class))
                        .map(Outcome::Transport),
                };
                if let Some(last) = last
                    && same_policy
                    && let Some(why) =
                        why_it_gave_up(&policy_of(agent, s), s, cause, &last, elapsed)
                {
                    notes.push(format!("retryplane: {why}"));
                }
            }
            Summary {
                success: false,
                cause: Some(e.cause.to_string()),
                status: e.response().filter(|_| !cut).map(|r| r.status().as_u16()),
                attempts,
                elapsed,
                notes,
            }
        }
    })
}

/// The policy in force now for the request's endpoint and path: the one the call ran under
/// when no other version came in during it (the caller checks).
fn policy_of(agent: &Agent, s: &Settings) -> Arc<RetryPolicy> {
    let snapshot = agent.policies();
    let target = Target::Http {
        method: s.method.as_str(),
        path: s.url.path(),
    };
    snapshot
        .set()
        .and_then(|set| set.resolve(&s.endpoint, &target))
        .cloned()
        .unwrap_or_else(|| snapshot.defaults().clone())
}

/// What the policy made of the last attempt's outcome `last`, for a call that gave up with
/// `cause` after `elapsed`, when the cause alone leaves it out: a failure not retried for its
/// method (no idempotency key) or because `retry_on` does not list it, a hint over
/// `retry_after.max`, a deadline given up on before it passed. `None` when the cause says it.
fn why_it_gave_up(
    policy: &RetryPolicy,
    s: &Settings,
    cause: GiveUpCause,
    last: &Outcome,
    elapsed: Duration,
) -> Option<String> {
    let what = match last {
        Outcome::Http { status, .. } => format!("HTTP {status}"),
        Outcome::Grpc { code, .. } => format!("gRPC {}", code.name()),
        Outcome::Transport(class) => format!("a {} error", class.as_str()),
    };
    let hint = last.hint().map(|(hint, pushback)| {
        let header = if pushback {
            "grpc-retry-pushback-ms"
        } else {
            "Retry-After"
        };
        (hint, header)
    });
    match cause {
        GiveUpCause::NotRetryable => {
            // Heard only when hints are honoured, as the engine hears it.
            if policy.retry_after.honor
                && matches!(
                    last,
                    Outcome::Grpc {
                        pushback: Some(Pushback::DoNotRetry),
                        ..
                    }
                )
            {
                return Some(format!(
                    "the answer ({what}) said not to retry it (grpc-retry-pushback-ms)"
                ));
            }
            if !last.listed_in(&policy.retry_on) {
                return Some(format!("the policy's retry_on does not list {what}"));
            }
            let method = s.method.as_str();
            let key = &*policy.idempotency_key_header;
            let has_key = s
                .headers
                .get_all(key)
                .iter()
                .any(|v| !v.as_bytes().trim_ascii().is_empty());
            if policy.is_idempotent(method) || has_key {
                return None;
            }
            // The key would not help: no retry is made whatever the method.
            if policy.max_attempts <= 1 {
                return Some(format!(
                    "the policy's max_attempts is {}: no retry is made",
                    policy.max_attempts
                ));
            }
            // A timeout or a reset leaves the outcome unknown: such a retry needs the key even
            // where a failed answer's would.
            let unknown = if matches!(
                last,
                Outcome::Transport(ErrorClass::Reset | ErrorClass::Timeout)
            ) {
                " it leaves the outcome unknown (the upstream may have handled the request), and"
            } else {
                ""
            };
            Some(format!(
                "{what} is one the policy retries, but{unknown} a {method} is retried only with \
                 the `{key}` header, with a value that is not blank: {method} is not among the \
                 policy's idempotent methods ({})",
                policy.idempotent_methods.join(", ")
            ))
        }
        GiveUpCause::RetryAfterTooLong => {
            let (hint, header) = hint?;
            let max = policy.retry_after.max;
            (hint > max).then(|| {
                format!(
                    "the answer's {header} asked for a pause of {} before a retry, over the \
                     policy's retry_after.max of {}",
                    format_duration(hint),
                    format_duration(max)
                )
            })
        }
        GiveUpCause::DeadlineExceeded => {
            // In whole milliseconds, as the attempts' pauses are shown; under one, the
            // deadline was as good as reached.
            let left = policy.deadline.checked_sub(elapsed)?;
            let left = Duration::from_millis(u64::try_from(left.as_millis()).unwrap_or(u64::MAX));
            if left.is_zero() {
                return None;
            }
            // Given up on before it passed: the next pause would have ended past it.
            let asked = match hint {
                Some((hint, header)) if policy.retry_after.honor && hint >= left => {
                    format!(
                        ", the answer's {header} asking for {}",
                        format_duration(hint)
                    )
                }
                _ => String::new(),
            };
            Some(format!(
                "the call gave up with {} of the policy's deadline of {} left: the pause \
                 before the next attempt would have ended past it{asked}",
                format_duration(left),
                format_duration(policy.deadline)
            ))
        }
        _ => None,
    }
}

/// Sends one request and reads the whole body, keeping none of it.
async fn send(request: reqwest::RequestBuilder) -> Result<http::Response<()>, reqwest::Error> {
    let mut response = request.send().await?;
    while response.chunk().await?.is_some() {}
    let mut out = http::Response::new(());
    *out.status_mut() = response.status();
    *out.headers_mut() = std::mem::take(response.headers_mut());
    Ok(out)
}

/// The gRPC code the agent judged `answer` by, when it is a "Trailers-Only" gRPC answer
/// (`grpc-status` in its headers) whose code is not `OK`: a `200` the call counted as a
/// failure, which the HTTP status alone would not explain.
fn trailers_only_code(answer: &http::Response<()>) -> Option<&'static str> {
    match answer.classify() {
        Classification::Outcome(Outcome::Grpc { code, .. }) => Some(code.name()),
        _ => None,
    }
}

/// `connect`, `reset` or `timeout`, as the agent classifies the error.
fn error_class(e: &reqwest::Error) -> Option<&'static str> {
    match e.classify() {
        Classification::Outcome(Outcome::Transport(class)) => Some(class.as_str()),
        _ => None,
    }
}

/// An error and its sources on one line, without the URL (it may carry a query string).
struct ErrorChain<'a>(&'a reqwest::Error);

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request failed")?;
        match std::error::Error::source(self.0) {
            Some(source) => write!(f, ": {}", retryplane_server::ErrorChain(source)),
            None => Ok(()),
        }
    }
}

/// Whether `text` starts with no scheme (RFC 3986: a letter, then letters, digits, `+`, `-` or
/// `.`, then `:`), or with what only looks like one: a host before its port (`localhost:8080`),
/// a header's name before its value (`Authorization: …`).
fn names_no_scheme(text: &str) -> bool {
    let Some((scheme, rest)) = text.split_once(':') else {
        return true;
    };
    let is_scheme = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    !is_scheme || rest.starts_with(|c: char| c.is_ascii_digit() || c.is_ascii_whitespace())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn server_of(flags: &[&str]) -> String {
        let cli = Cli::try_parse_from(
            ["retryplane", "--endpoint", "api"]
                .iter()
                .chain(flags)
                .chain(&["http://127.0.0.1:9/"]),
        )
        .unwrap();
        match Settings::try_from(cli.args).unwrap().policy {
            PolicyFrom::Server(url, _, _) => url,
            PolicyFrom::File(_) => panic!("not --server"),
        }
    }

    fn token_of(flags: &[&str]) -> Option<String> {
        let cli = Cli::try_parse_from(
            ["retryplane", "--endpoint", "api", "--server", "127.0.0.1"]
                .iter()
                .chain(flags)
                .chain(&["http://127.0.0.1:9/"]),
        )
        .unwrap();
        match Settings::try_from(cli.args).unwrap().policy {
            PolicyFrom::Server(_, token, _) => token.map(|t| t.secret().to_owned()),
            PolicyFrom::File(_) => panic!("not --server"),
        }
    }

    #[test]
    fn an_empty_agent_token_is_no_token() {
        assert_eq!(token_of(&["--token", ""]), None);
        assert_eq!(token_of(&[]), None);
        assert_eq!(
            token_of(&["--token", "a-long-agent-secret"]).as_deref(),
            Some("a-long-agent-secret")
        );
        // Read from a file, with its line break: the admin commands' token type trims it.
        assert_eq!(
            token_of(&["--token", "a-long-agent-secret\n"]).as_deref(),
            Some("a-long-agent-secret")
        );
        assert_eq!(token_of(&["--token", " \n"]), None);
    }

    #[test]
    fn a_policy_and_a_body_both_from_standard_input_are_refused() {
        let settings = |policy: &str, data: &str| {
            let cli = Cli::try_parse_from([
                "retryplane",
                "--endpoint",
                "api",
                "--policy",
                policy,
                "--data",
                data,
                "http://127.0.0.1:9/",
            ])
            .unwrap();
            Settings::try_from(cli.args)
        };
        let err = settings("-", "@-").unwrap_err();
        assert!(
            err.to_string().contains("both read standard input"),
            "{err}"
        );
        // One of them from standard input is fine (the body read is not reached here: a
        // body given as text).
        assert!(settings("-", "@").is_ok());
        assert!(settings("policies.yaml", "text").is_ok());
    }

    #[test]
    fn a_server_url_that_asks_for_tls_is_refused_rather_than_sent_in_clear_text() {
        let cli = Cli::try_parse_from([
            "retryplane",
            "--endpoint",
            "api",
            "--server",
            "https://cp.internal",
            "http://127.0.0.1:9/",
        ])
        .unwrap();
        let err = Settings::try_from(cli.args).unwrap_err();
        assert!(err.to_string().contains("only http://"), "{err}");
    }

    #[test]
    fn a_server_without_a_port_is_the_agent_listeners_default_port() {
        assert_eq!(
            server_of(&["--server", "127.0.0.1"]),
            "http://127.0.0.1:7470/"
        );
        assert_eq!(
            server_of(&["--server", "http://cp.internal"]),
            "http://cp.internal:7470/"
        );
        assert_eq!(
            server_of(&["--server", "http://cp.internal:9000"]),
            "http://cp.internal:9000"
        );
        // A scheme is case-insensitive.
        assert_eq!(
            server_of(&["--server", "HTTP://cp.internal:9000"]),
            "http://cp.internal:9000"
        );
    }
}
