//! `retryplane explain FILE --endpoint NAME [--method M] [--path P | --grpc /pkg.Svc/Method]`:
//! what one call gets from a policy file (SPEC §5).
//!
//! The call is named explicitly: `--method`/`--path` for HTTP (`--method` alone means path
//! `/`, `--path` alone means `GET`), `--grpc /pkg.Service/Method` for gRPC, nothing at all for
//! the endpoint's own policy without routes. The output ([`text`], or one JSON object) holds:
//!
//! - the endpoint and the route that matched (its index and `match`, or none);
//! - whether the call is retried at all (idempotent method, or only with the key header);
//! - the effective policy, one leaf field a line, with the layer it came from (`built-in`,
//!   `defaults`, `endpoint`, `route`) and where the file sets it;
//! - the schedule per retry: pause ceiling, jitter range, worst-case start time and whether
//!   that fits the deadline (see [`report::Schedule`] for the exact definition);
//! - the worst-case load multiplier, with and without the retry budget.
//!
//! Exit codes: `0` explained (warnings allowed; those about this endpoint that hold for the call
//! are shown: see `still_applies`; those about a route the call does not take are counted, not
//! shown), `1`
//! the file has errors (printed exactly as `validate` prints them, text or JSON), `2` usage or
//! I/O error, including an endpoint the file does not define (the message lists the known
//! ones): like a file that does not exist, it is a wrong argument, not a wrong policy.

mod fields;
mod report;
mod text;

use std::path::PathBuf;

use anyhow::{Context, bail};
use retryplane_policy::Target;
use retryplane_policy::diag::Diagnostic;
use retryplane_policy::document::{EndpointDoc, PolicyDocument};
use retryplane_policy::parse::{check_method, parse_grpc_route};
use retryplane_policy::validate;
use serde::Serialize;

use crate::input::{Source, no_such_endpoint};
use crate::output::{self, Format, JsonDiagnostic};
use crate::{Outcome, Report};

/// `retryplane explain` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Policy file; `-` reads standard input.
    #[arg(value_name = "FILE")]
    file: PathBuf,
    /// The endpoint (the logical upstream name).
    #[arg(long, value_name = "NAME")]
    endpoint: String,
    /// HTTP method of the call [default: GET when only --path is given].
    #[arg(long, short = 'X', value_name = "METHOD", conflicts_with = "grpc")]
    method: Option<String>,
    /// HTTP path of the call, without the query string, matched as the agent matches it:
    /// any spelling of a path is that path (`/v1/ch%61rges` is `/v1/charges`, `/über` is
    /// `/%C3%BCber`). Dot segments and `\` are resolved first, as clients that parse URLs
    /// (`retryplane request`, reqwest, curl) send the path (`/a/../b` is `/b`)
    /// [default: / when only --method is given].
    #[arg(long, value_name = "PATH", conflicts_with = "grpc")]
    path: Option<String>,
    /// A gRPC call instead of HTTP.
    #[arg(long, value_name = "/PKG.SERVICE/METHOD")]
    grpc: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "output")]
    format: Format,
}

/// What to explain, checked once.
#[derive(Debug)]
pub struct Settings {
    /// The policy file.
    pub source: Source,
    /// The endpoint name.
    pub endpoint: String,
    /// The call the policy is looked up for.
    pub call: Call,
    /// Output format.
    pub format: Format,
    /// `--path` as given, when it is sent as another path (dot segments, `\`): said in a note.
    pub path_as_given: Option<String>,
    /// `--method` as given, when it is explained upper-cased (`post` as `POST`): said in a
    /// note, since methods are case-sensitive on the wire and a policy's are written so.
    pub method_as_given: Option<String>,
}

/// The call a policy is looked up for; owns what [`Target`] borrows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Call {
    /// An HTTP request.
    Http {
        /// Upper case.
        method: String,
        /// Starts with `/`, no query string.
        path: String,
    },
    /// A gRPC call, `/pkg.Service/Method`.
    Grpc {
        /// `/pkg.Service/Method`
        path: String,
    },
    /// No call given: the endpoint's own policy, routes not consulted.
    Endpoint,
}

impl Call {
    /// The lookup key of the policy crate.
    pub fn target(&self) -> Target<'_> {
        match self {
            Call::Http { method, path } => Target::Http { method, path },
            Call::Grpc { path } => Target::Grpc { path },
            Call::Endpoint => Target::Endpoint,
        }
    }
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        let mut path_as_given = None;
        let method_as_given = args
            .method
            .as_ref()
            .filter(|m| m.to_ascii_uppercase() != **m)
            .cloned();
        let call = match (args.grpc, args.method, args.path) {
            (Some(grpc), _, _) => match parse_grpc_route(&grpc) {
                Ok((_, Some(_))) => Call::Grpc { path: grpc },
                Ok((_, None)) => bail!(
                    "--grpc {grpc}: explain shows one call; name a method, such as `{}`",
                    grpc.replace('*', "Method")
                ),
                // The route parser's words offer `/pkg.Service/*`, which a route may be and a
                // call may not.
                Err(_) => bail!(
                    "--grpc: `{}` is not a gRPC method's path: write `/pkg.Service/Method`",
                    grpc.escape_debug()
                ),
            },
            (None, None, None) => Call::Endpoint,
            (None, method, path) => {
                let method = method.map_or_else(|| "GET".to_owned(), |m| m.to_ascii_uppercase());
                check_method(&method).map_err(|e| anyhow::anyhow!("--method: {e}"))?;
                let path = path.unwrap_or_else(|| "/".to_owned());
                if !path.starts_with('/') {
                    bail!("--path must start with `/`, found `{path}`");
                }
                // Routes match the path only, as the agent does: drop `?query` and `#fragment`.
                let given = path.split(['?', '#']).next().unwrap_or("/");
                let path = as_sent(given);
                if !same_path(&path, given) {
                    path_as_given = Some(given.to_owned());
                }
                Call::Http { method, path }
            }
        };
        Ok(Self {
            source: Source::from_arg(args.file),
            endpoint: args.endpoint,
            call,
            format: args.format,
            path_as_given,
            method_as_given,
        })
    }
}

/// `path` (starting with `/`, no query) as a client that parses URLs sends it: dot segments
/// resolved (`%2e` spellings too) and `\` read as `/`, as `retryplane request` sends it (its
/// URL parser is reqwest's). A path the parser refuses is kept as given. Parsed as the path of
/// a whole URL, not joined to one: a path that starts with `//` is a path, not a host.
fn as_sent(path: &str) -> String {
    reqwest::Url::parse(&format!("http://h{path}"))
        .map_or_else(|_| path.to_owned(), |url| url.path().to_owned())
}

/// Whether two spellings name one path, as routes compare them (`/über` is `/%C3%BCber`).
fn same_path(a: &str, b: &str) -> bool {
    retryplane_policy::uri_path::starts_with(a, b) && retryplane_policy::uri_path::starts_with(b, a)
}

/// Loads the file and explains the call; see the module docs for the exit codes.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    // Every diagnostic: the endpoint's warnings are picked out of them below, and may come
    // past the first `MAX_LISTED` of the file.
    let mut loaded = settings.source.load_all_for_agents()?;
    let file = settings.source.to_string();
    let Some(policies) = &loaded.policies else {
        retryplane_policy::diag::cap(&mut loaded.diagnostics);
        return output::invalid_file_report(&file, &loaded.diagnostics, settings.format);
    };
    let doc = policies.document();
    let Some(endpoint) = doc.endpoint(&settings.endpoint) else {
        return Err(no_such_endpoint(
            &file,
            &settings.endpoint,
            &policies.names(),
        ));
    };
    // A path that no HTTP route matches but a gRPC route of the endpoint would: the user
    // most likely meant the gRPC call.
    let matched = |call: &Call| {
        endpoint
            .routes
            .iter()
            .any(|r| r.matcher.value.matches(&call.target()))
    };
    if let (Some(given), Call::Http { method, .. }) = (&settings.method_as_given, &settings.call) {
        output::note(format_args!(
            "note: --method `{}` is explained as `{method}`, as the agent's `CallMeta::http` reads \
             it; HTTP methods are case-sensitive on the wire, so a request sent with `{}` as \
             its method (through the tower layer, say) is not a {method} to the policy",
            given.escape_debug(),
            given.escape_debug()
        ));
    }
    if let (Some(given), Call::Http { path, .. }) = (&settings.path_as_given, &settings.call) {
        output::note(format_args!(
            "note: --path `{}` is sent as `{}` by clients that parse URLs (`retryplane \
             request`, reqwest, curl); explained for `{}`",
            given.escape_debug(),
            path.escape_debug(),
            path.escape_debug()
        ));
    }
    if let Call::Http { method, path } = &settings.call
        && parse_grpc_route(path).is_ok_and(|(_, m)| m.is_some())
        && !matched(&settings.call)
        && matched(&Call::Grpc { path: path.clone() })
    {
        output::note(format_args!(
            "note: `{path}` is looked up as an HTTP {method} path; for a gRPC call use --grpc {path}"
        ));
    }
    let explanation = report::explain(&file, doc, endpoint, &settings.call);
    let (warnings, other_routes) = warnings_for(
        &loaded.diagnostics,
        doc,
        endpoint,
        &settings.call,
        &explanation,
    );
    let stdout = match settings.format {
        Format::Text => text::render(&explanation, &warnings, other_routes),
        Format::Json => output::json(&JsonOutput {
            explanation: &explanation,
            warnings: warnings
                .iter()
                .map(|d| JsonDiagnostic::new(&file, d))
                .collect(),
            other_routes_warnings: other_routes,
        })
        .context("cannot render the explanation as JSON")?,
    };
    Ok(Report {
        stdout,
        outcome: Outcome::Success,
    })
}

/// The JSON document: the explanation and the warnings about this endpoint.
#[derive(Serialize)]
struct JsonOutput<'a> {
    #[serde(flatten)]
    explanation: &'a report::Explanation,
    warnings: Vec<JsonDiagnostic<'a>>,
    /// How many warnings are about routes of the endpoint the call does not take (left out of
    /// `warnings`; `retryplane validate` lists them).
    other_routes_warnings: usize,
}

/// The warnings in `diagnostics` about `endpoint`'s policy for `call` (`explanation` is the
/// call's), and how many more are about routes of the endpoint the call does not take: a
/// warning about such a route is about another call's policy, whether it is about a value
/// written there or about how its fields combine, so it is counted, not returned.
fn warnings_for<'d>(
    diagnostics: &'d [Diagnostic],
    doc: &PolicyDocument,
    endpoint: &EndpointDoc,
    call: &Call,
    explanation: &report::Explanation,
) -> (Vec<&'d Diagnostic>, usize) {
    let name = &endpoint.name.value;
    let cross = CrossField {
        of_layers: [
            validate::cross_field_problems(doc, None),
            validate::endpoint_cross_field_problems(doc, endpoint),
        ]
        .concat(),
        of_call: validate::cross_field_problems(doc, Some((endpoint, &call.target()))),
    };
    let ep_path = retryplane_policy::diag::endpoint_path(name);
    let taken = explanation.route.as_ref().map(|r| r.index);
    let mut other_routes = 0;
    let warnings = diagnostics
        .iter()
        .filter(|d| concerns(d, name))
        .filter(|d| match route_of(&d.path, &ep_path) {
            Some(i) if Some(i) != taken => {
                other_routes += 1;
                false
            }
            _ => true,
        })
        .filter(|d| still_applies(d, &explanation.policy, &cross))
        .collect();
    (warnings, other_routes)
}

/// The warnings in `diagnostics` (of the file named `file` as given) about the policy of
/// `endpoint` itself, routes not consulted (what `simulate` runs), as `explain --endpoint NAME`
/// with no call lists them.
pub fn endpoint_warnings<'d>(
    file: &str,
    diagnostics: &'d [Diagnostic],
    doc: &PolicyDocument,
    endpoint: &EndpointDoc,
) -> Vec<&'d Diagnostic> {
    let explanation = report::explain(file, doc, endpoint, &Call::Endpoint);
    warnings_for(diagnostics, doc, endpoint, &Call::Endpoint, &explanation).0
}

/// The route a diagnostic's `path` is in, for an endpoint whose path is `ep_path`:
/// `Some(2)` for `endpoints.pay.routes[2]` and anything under it.
fn route_of(path: &str, ep_path: &str) -> Option<usize> {
    let rest = path.strip_prefix(ep_path)?.strip_prefix(".routes[")?;
    let (index, after) = rest.split_once(']')?;
    if !(after.is_empty() || after.starts_with('.')) {
        return None;
    }
    index.parse().ok()
}

/// Whether `d` is about `endpoint`'s policy: it is in that endpoint (by the name the check
/// recorded, not by its path: `endpoints.pay.v2.max_attempts` is endpoint `pay.v2`'s, not
/// `pay`'s) or in `defaults`.
fn concerns(d: &Diagnostic, endpoint: &str) -> bool {
    match &d.endpoint {
        Some(name) => name == endpoint,
        None => d
            .path
            .strip_prefix("defaults")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.')),
    }
}

/// The problems of how several fields combine: of the `defaults:` alone and of every call the
/// endpoint can take (its own policy, each route's), and of the call explained.
struct CrossField {
    of_layers: Vec<Diagnostic>,
    of_call: Vec<Diagnostic>,
}

/// Whether two diagnostics say the same thing at the same place.
fn same(a: &Diagnostic, b: &Diagnostic) -> bool {
    a.loc == b.loc && a.path == b.path && a.message == b.message
}

/// Whether a warning still applies to the call explained, whose effective policy is `rows`.
/// One about how several fields combine (`budget disabled with max_attempts 5`), wherever it
/// is blamed, only if the call's own policy has the same problem: not for an endpoint or a
/// route that sets `max_attempts: 2`, nor for a route the call does not take. A
/// `defaults.FIELD` one only while some value under `FIELD` still comes from the defaults (an
/// endpoint or a route that sets the field itself replaces what the warning is about). Any
/// other warning (about a value the endpoint or one of its routes writes), and one about a
/// field no row shows, applies.
fn still_applies(d: &Diagnostic, rows: &[report::FieldRow], cross: &CrossField) -> bool {
    if cross.of_layers.iter().any(|c| same(c, d)) {
        return cross.of_call.iter().any(|c| same(c, d));
    }
    let Some(field) = d.path.strip_prefix("defaults.") else {
        return true;
    };
    // `idempotent_methods[2]` is about the list `idempotent_methods`.
    let field = field.split('[').next().unwrap_or(field);
    let under = |row: &str| {
        row == field
            || row
                .strip_prefix(field)
                .is_some_and(|rest| rest.starts_with('.'))
            || field
                .strip_prefix(row)
                .is_some_and(|rest| rest.starts_with('.'))
    };
    let mut shown = rows.iter().filter(|r| under(r.field)).peekable();
    shown.peek().is_none() || shown.any(|r| r.level == "defaults")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(method: Option<&str>, path: Option<&str>, grpc: Option<&str>) -> Args {
        Args {
            file: "p.yaml".into(),
            endpoint: "payments".into(),
            method: method.map(Into::into),
            path: path.map(Into::into),
            grpc: grpc.map(Into::into),
            format: Format::Text,
        }
    }

    fn call(method: Option<&str>, path: Option<&str>, grpc: Option<&str>) -> anyhow::Result<Call> {
        Settings::try_from(args(method, path, grpc)).map(|s| s.call)
    }

    #[test]
    fn a_path_is_explained_as_clients_that_parse_urls_send_it() {
        let given = |path: &str| {
            let settings = Settings::try_from(args(None, Some(path), None)).unwrap();
            let Call::Http { path, .. } = settings.call else {
                panic!("not an HTTP call")
            };
            (path, settings.path_as_given)
        };
        for (typed, sent) in [
            ("/v1/charges/../items", "/v1/items"),
            ("/v1/charges/%2e%2e/x", "/v1/x"),
            ("/v1\\charges", "/v1/charges"),
            ("/v1/./a/", "/v1/a/"),
            // A path, not a host, as the agent reads it.
            ("//evil/v1/search/../charges", "//evil/v1/charges"),
        ] {
            assert_eq!(given(typed), (sent.to_owned(), Some(typed.to_owned())));
        }
        // Another spelling of the same path is that path: no note.
        assert_eq!(given("/über?x=1"), ("/%C3%BCber".to_owned(), None));
        assert_eq!(given("/v1/items"), ("/v1/items".to_owned(), None));
    }

    /// A method given in lower case is explained upper-cased, with a note (case-sensitive on
    /// the wire); one given as written needs none.
    #[test]
    fn a_method_explained_upper_cased_is_noted() {
        let given = |method: &str| {
            let settings = Settings::try_from(args(Some(method), None, None)).unwrap();
            let Call::Http { method, .. } = settings.call else {
                panic!("not an HTTP call")
            };
            (method, settings.method_as_given)
        };
        assert_eq!(given("post"), ("POST".to_owned(), Some("post".to_owned())));
        assert_eq!(given("POST"), ("POST".to_owned(), None));
    }

    #[test]
    fn method_and_path_default_to_get_and_root() {
        let http = |m: &str, p: &str| Call::Http {
            method: m.into(),
            path: p.into(),
        };
        assert_eq!(
            call(None, Some("/v1/x"), None).unwrap(),
            http("GET", "/v1/x")
        );
        assert_eq!(call(Some("post"), None, None).unwrap(), http("POST", "/"));
        assert_eq!(
            call(Some("GET"), Some("/a?b=c#d"), None).unwrap(),
            http("GET", "/a")
        );
        assert_eq!(call(None, None, None).unwrap(), Call::Endpoint);
    }

    #[test]
    fn bad_targets_are_usage_errors() {
        assert!(call(None, Some("v1/x"), None).is_err());
        assert!(call(Some("GE T"), None, None).is_err());
        assert!(call(None, None, Some("/pkg.Svc/*")).is_err());
        assert!(call(None, None, Some("pkg.Svc/M")).is_err());
        assert_eq!(
            call(None, None, Some("/pkg.Svc/M")).unwrap(),
            Call::Grpc {
                path: "/pkg.Svc/M".into()
            }
        );
    }

    #[test]
    fn a_route_is_read_from_a_diagnostics_path_only_under_its_own_endpoint() {
        let ep = retryplane_policy::diag::endpoint_path("pay");
        assert_eq!(route_of("endpoints.pay.routes[2]", &ep), Some(2));
        assert_eq!(
            route_of("endpoints.pay.routes[0].budget.enabled", &ep),
            Some(0)
        );
        assert_eq!(route_of("endpoints.pay.routes[10].match", &ep), Some(10));
        assert_eq!(route_of("endpoints.pay.max_attempts", &ep), None);
        assert_eq!(route_of("endpoints.pay.v2.routes[1]", &ep), None);
        assert_eq!(route_of("endpoints.payments.routes[1]", &ep), None);
        assert_eq!(route_of("endpoints.pay.routes[1]x", &ep), None);
        assert_eq!(route_of("defaults.max_attempts", &ep), None);
    }

    #[test]
    fn warnings_concern_defaults_and_the_endpoint_only() {
        let warnings = |src: &str| -> Vec<(String, bool)> {
            retryplane_policy::load(src.as_bytes())
                .diagnostics
                .iter()
                .map(|d| (d.path.clone(), concerns(d, "pay")))
                .collect()
        };
        // `pay.v2`'s warning is not `pay`'s, though its path starts with `endpoints.pay.`.
        assert_eq!(
            warnings(
                "version: 1\ndefaults: {max_attempts: 7}\nendpoints:\n  pay: {routes: [{match: {method: GET}, max_attempts: 6}]}\n  pay.v2: {max_attempts: 8}\n  payments: {max_attempts: 9}\n"
            ),
            [
                ("defaults.max_attempts".to_owned(), true),
                ("endpoints.pay.routes[0].max_attempts".to_owned(), true),
                ("endpoints.pay.v2.max_attempts".to_owned(), false),
                ("endpoints.payments.max_attempts".to_owned(), false),
            ]
        );
    }
}
