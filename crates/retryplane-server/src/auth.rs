//! Bearer tokens for the agent and admin services (issue 3: roles, secrets compared in constant
//! time).
//!
//! A tokens file names every credential and its role:
//!
//! ```yaml
//! tokens:
//!   - {name: checkout-agents, role: agent, secret: "at least sixteen characters",
//!      agent_ids: ["checkout-*"], services: [checkout], max_agents: 500}
//!   - {name: alice, role: admin, secret: "another long random string"}
//!   - {name: dashboards, role: viewer, secret: "a third long random string"}
//! ```
//!
//! An agent token may name the agent ids it connects as (`agent_ids`: ids, or prefixes ending
//! in `*`); a Hello with another id is refused with `PERMISSION_DENIED`, so one team's agent
//! token cannot take (and keep) another team's agent ids. Without `agent_ids` a token may
//! connect as any agent id, first come, first served among agent tokens. It may name the
//! services its agents report as (`services`, written as `agent_ids` is): a Hello naming
//! another is refused the same way, so one team's token cannot report under another's service
//! (and so skew its figures or hide its alert). It may also cap how
//! many agents are connected with it at once (`max_agents`; a Hello past it is refused with
//! `RESOURCE_EXHAUSTED`, as past the control plane's `--max-agents`, and so are its streams
//! waiting for their Hello past twice that number), so that one team's runaway deployment
//! cannot take every agent slot of the control plane, nor (with a small `max_agents`) every
//! handshake place. Any of these fields written without a value is refused, never read as
//! "any".
//!
//! Every gRPC call to the agent or admin service carries `authorization: Bearer <secret>`. The
//! presented secret is hashed (SHA-256) and compared with the hash of *every* token's secret
//! with [`subtle::ConstantTimeEq`], without stopping at a match, so the time taken tells nothing
//! about which token, or how much of one, matched. A missing or unknown secret gets
//! `UNAUTHENTICATED`; a known token of the wrong role gets `PERMISSION_DENIED` (an agent token
//! cannot call the admin service, and an admin token cannot pose as an agent). A `viewer`
//! token calls the admin service's reads only; Apply and Rollback refuse it
//! ([`Role::Viewer`]). The admin service reads the caller's [`TokenName`] from the request
//! extensions to record who made a version.
//!
//! Health and reflection are not guarded: they reveal nothing that is not public. With no tokens
//! file there is no authentication at all, and the server only binds loopback addresses unless
//! told `--insecure` (see [`crate::server`]).
//!
//! The file is read again on [`TokenSet::reload`] (`retryplane serve` does it on `SIGHUP`), so
//! a token can be added, rotated or revoked without a restart. A file that cannot be used then
//! is refused and the tokens in force stay. Calls are checked against the tokens in force when
//! they start; an agent stream, which lasts, is also ended (`UNAUTHENTICATED`) by the reload
//! that takes its secret away (or gives it another role), even while it waits for its Hello
//! or for room to send, so a revoked agent is sent nothing more instead of receiving policies
//! until its next reconnect.
//!
//! Secrets and header values are never logged or put into an error message.

use retryplane_policy::diag::LogPath;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};
use tokio::sync::watch;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Shortest secret accepted, in bytes. A secret must also neither start nor end with white
/// space (the presented one is trimmed) nor hold a control character: such a secret could never
/// match, so the tokens file is refused.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret accepted, in bytes: a request's headers, the secret's among them, must fit
/// what the listeners take (hyper's 16 KiB by default), so a longer secret could never be sent.
pub const MAX_SECRET_LEN: usize = 4096;
/// Largest tokens file read.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// What a token may call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The agent stream service.
    Agent,
    /// The admin service, every call.
    Admin,
    /// The admin service's reads only: Validate, Get, History, FleetStatus, Stats and a dry
    /// run of Apply (`retryplane diff`), for dashboards and on-call tooling that must not
    /// change the policies. Apply and Rollback answer `PERMISSION_DENIED`.
    Viewer,
}

impl Role {
    /// `agent`, `admin` or `viewer`, as written in the tokens file.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Admin => "admin",
            Role::Viewer => "viewer",
        }
    }

    /// Whether a token of this role is let into a service guarded for `service`: a viewer
    /// into the admin service (whose writes check [`Role::may_change`] themselves).
    fn enters(self, service: Role) -> bool {
        self == service || (self == Role::Viewer && service == Role::Admin)
    }

    /// Whether a caller admitted with this role may change the policies.
    pub fn may_change(self) -> bool {
        self == Role::Admin
    }

    /// The roles a service guarded for this role lets in, for messages.
    fn admitted(self) -> &'static str {
        match self {
            Role::Agent => "`agent`",
            Role::Admin | Role::Viewer => "`admin` (or `viewer`, for reads)",
        }
    }
}

/// The name of the token that authenticated a request, put into its extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenName(pub String);

/// Why a tokens file cannot be used. Messages name the file and never contain a secret.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// The file cannot be read.
    #[error("cannot read the tokens file {}", file.display())]
    Read {
        /// The tokens file.
        file: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("the tokens file {} is larger than {MAX_FILE_BYTES} bytes", file.display())]
    TooLarge {
        /// The tokens file.
        file: PathBuf,
    },
    /// The file is not a YAML document of the expected shape.
    #[error("the tokens file {} is malformed: {message}", file.display())]
    Parse {
        /// The tokens file.
        file: PathBuf,
        /// What the YAML parser said.
        message: String,
    },
    /// The file parses but some tokens are unusable; every problem is listed.
    #[error("the tokens file {} is invalid: {}", file.display(), problems.join("; "))]
    Invalid {
        /// The tokens file.
        file: PathBuf,
        /// One line per problem, such as ``line 9: tokens[2] (`ci`): secret is shorter than 16 bytes`` (the line where the entry starts).
        problems: Vec<String>,
    },
    /// A read that began later was put in force first (this one was slow: a file on a network
    /// mount that answered late), so this one's tokens, older, are not.
    #[error(
        "the read of the tokens file {} ended after a later one was put in force; the later one's tokens stay",
        file.display()
    )]
    Superseded {
        /// The tokens file.
        file: PathBuf,
    },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    /// Each with where it is written, so that a problem names its line.
    tokens: Vec<serde_saphyr::Spanned<RawToken>>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToken {
    name: String,
    role: String,
    secret: String,
    /// `None`: not written; `Some(RawAgentIds::Null)`: written without a value.
    #[serde(default, deserialize_with = "present")]
    agent_ids: Option<RawAgentIds>,
    /// As `agent_ids`, for the services a Hello may name.
    #[serde(default, deserialize_with = "present")]
    services: Option<RawAgentIds>,
    /// `None`: not written; `Some(RawMax::Null)`: written without a value.
    #[serde(default, deserialize_with = "present")]
    max_agents: Option<RawMax>,
}

/// `max_agents` as written: a whole number (in digits, or a string of them), nothing, or
/// anything else (a negative or fractional number, a list, a map), each checked in the file's
/// words rather than refused by the YAML reader without naming the entry.
enum RawMax {
    Count(u64),
    /// A whole number past `u64`.
    TooLarge,
    Null,
    Other,
}

impl<'de> serde::Deserialize<'de> for RawMax {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawMax;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`max_agents` as a whole number")
            }
            fn visit_u64<E>(self, v: u64) -> Result<RawMax, E> {
                Ok(RawMax::Count(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<RawMax, E> {
                Ok(u64::try_from(v).map_or(RawMax::Other, RawMax::Count))
            }
            // A whole number past `u64` is refused as too large (it was "not a whole number of
            // at least 1", which it is).
            fn visit_u128<E>(self, v: u128) -> Result<RawMax, E> {
                Ok(u64::try_from(v).map_or(RawMax::TooLarge, RawMax::Count))
            }
            fn visit_i128<E>(self, v: i128) -> Result<RawMax, E> {
                Ok(match u64::try_from(v) {
                    Ok(v) => RawMax::Count(v),
                    Err(_) if v > 0 => RawMax::TooLarge,
                    Err(_) => RawMax::Other,
                })
            }
            // Digits past what an integer holds reach here as a float: a whole number too,
            // and too large.
            fn visit_f64<E>(self, v: f64) -> Result<RawMax, E> {
                Ok(
                    if v >= u64::MAX as f64 && (v.is_infinite() || v.fract() == 0.0) {
                        RawMax::TooLarge
                    } else {
                        RawMax::Other
                    },
                )
            }
            fn visit_bool<E>(self, _: bool) -> Result<RawMax, E> {
                Ok(RawMax::Other)
            }
            fn visit_str<E>(self, v: &str) -> Result<RawMax, E> {
                Ok(whole_number(v).map_or(RawMax::Other, RawMax::Count))
            }
            fn visit_unit<E>(self) -> Result<RawMax, E> {
                Ok(RawMax::Null)
            }
            fn visit_none<E>(self) -> Result<RawMax, E> {
                Ok(RawMax::Null)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<RawMax, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<RawMax, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(RawMax::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawMax, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(RawMax::Other)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A field that is written: `Some`, whatever its value (`T` reads a missing value itself).
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A whole number written as text (quoted, or a spelling the YAML reader leaves as text, such
/// as `0X10`), in the spellings of a YAML integer: white space around it, a `+`, `_` between
/// digits, a `0x`, `0o` or `0b` prefix in either case.
fn whole_number(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text.strip_prefix('+').unwrap_or(text).replace('_', "");
    let lower = digits.to_ascii_lowercase();
    let (radix, digits) = [("0x", 16), ("0o", 8), ("0b", 2)]
        .into_iter()
        .find_map(|(prefix, radix)| lower.strip_prefix(prefix).map(|rest| (radix, rest)))
        .unwrap_or((10, lower.as_str()));
    if digits.is_empty() || digits.starts_with(['+', '-']) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// `agent_ids` as written: a list (an entry left without a value is `None`), one id where a
/// list was meant, or nothing at all (`agent_ids:` with its last id commented out). Each is
/// checked in the file's words ([`AgentIds::check`]) rather than refused by the YAML reader,
/// and none of them may lift the token's restriction to any id.
enum RawAgentIds {
    List(Vec<Option<String>>),
    One,
    Map,
    Null,
}

impl<'de> serde::Deserialize<'de> for RawAgentIds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawAgentIds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`agent_ids` as a list of agent ids (`agent_ids: [checkout-*]`)")
            }
            fn visit_unit<E>(self) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::Null)
            }
            fn visit_none<E>(self) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::Null)
            }
            fn visit_some<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<RawAgentIds, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_str<E>(self, _: &str) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_bool<E>(self, _: bool) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_u64<E>(self, _: u64) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_i64<E>(self, _: i64) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_u128<E>(self, _: u128) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_i128<E>(self, _: i128) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_f64<E>(self, _: f64) -> Result<RawAgentIds, E> {
                Ok(RawAgentIds::One)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawAgentIds, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(RawAgentIds::Map)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<RawAgentIds, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<Option<String>>()? {
                    ids.push(id);
                }
                Ok(RawAgentIds::List(ids))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// One credential: its name, role, the SHA-256 of its secret and, for an agent token, the
/// agent ids it may connect as (`None`: any).
struct Token {
    name: String,
    role: Role,
    digest: [u8; 32],
    agent_ids: Option<AgentIds>,
    /// For an agent token, the services its agents may name in their Hello (`None`: any).
    services: Option<AgentIds>,
    /// For an agent token, how many agents may be connected with it at once (`None`: only the
    /// control plane's `--max-agents`).
    max_agents: Option<usize>,
}

/// The agent ids an agent token may connect as (its `agent_ids` in the tokens file): each an
/// id, or a prefix followed by `*` for every id that starts with it (`checkout-*`).
#[derive(Debug)]
struct AgentIds(Vec<String>);

impl AgentIds {
    /// Whether `id` is one of these ids or starts with one of these prefixes.
    fn allow(&self, id: &str) -> bool {
        self.0
            .iter()
            .any(|pattern| match pattern.strip_suffix('*') {
                Some(prefix) => id.starts_with(prefix),
                None => id == pattern,
            })
    }

    /// The patterns of a token's `agent_ids` (or `services`: `field`) as written, or `None`
    /// after adding to `problems` (`at` names the token) a line for each of their problems.
    fn check(
        raw: &RawAgentIds,
        field: &PatternField,
        at: &str,
        problems: &mut Vec<String>,
    ) -> Option<Self> {
        let PatternField {
            name,
            noun,
            a_noun,
            plural,
            any,
        } = field;
        let before = problems.len();
        let list = match raw {
            RawAgentIds::Null => {
                problems.push(format!(
                    "{at}: `{name}` has no value (its {plural} commented out?), so no agent could \
                     connect with this token; list them, or leave the field out to let it \
                     {any}"
                ));
                return None;
            }
            RawAgentIds::One => {
                problems.push(format!(
                    "{at}: `{name}` is one value, not a list; write it as a list \
                     (`{name}: [checkout-*]`)"
                ));
                return None;
            }
            RawAgentIds::Map => {
                problems.push(format!(
                    "{at}: `{name}` is a map, not a list; write its {plural} as a list \
                     (`{name}: [checkout-*]`)"
                ));
                return None;
            }
            RawAgentIds::List(list) => list,
        };
        if list.is_empty() {
            problems.push(format!(
                "{at}: `{name}` is empty, so no agent could connect with this token; leave \
                 the field out to let it {any}"
            ));
        }
        let mut patterns = Vec::with_capacity(list.len());
        for (j, pattern) in list.iter().enumerate() {
            let pattern = pattern.as_deref().unwrap_or_default();
            // A secret put in this place (an entry's values swapped) is not quoted: the
            // message reaches a terminal and the log.
            let shown = if could_be_a_secret(pattern) {
                "(not shown: it could be a secret)".to_owned()
            } else {
                format!("`{}`", pattern.escape_debug())
            };
            let problem = if pattern.is_empty() {
                Some(
                    "is empty (an id in quotes, such as `\"*\"`, where YAML reads `*` as an \
                      alias)"
                        .to_owned(),
                )
            } else if pattern.strip_suffix('*').unwrap_or(pattern).contains('*') {
                Some(format!(
                    "{shown} holds a `*` before its end; a `*` may only end a prefix \
                     (`checkout-*`)"
                ))
            } else if retryplane_policy::diag::has_control(pattern) {
                // What a Hello's agent id may not hold ([`retryplane_proto::check_hello`]).
                Some(format!(
                    "{shown} holds a control character, which no {noun} may hold"
                ))
            } else if pattern.trim_end_matches('*').len() > retryplane_proto::MAX_HELLO_FIELD_BYTES
            {
                Some(format!(
                    "{shown} is longer than {a_noun} may be ({} bytes)",
                    retryplane_proto::MAX_HELLO_FIELD_BYTES
                ))
            } else {
                None
            };
            if let Some(problem) = problem {
                problems.push(format!("{at}: {name}[{j}] {problem}"));
            }
            patterns.push(pattern.to_owned());
        }
        (problems.len() == before).then_some(Self(patterns))
    }
}

/// What [`AgentIds::check`] calls a field of patterns in its messages.
struct PatternField {
    /// The field's name in the tokens file.
    name: &'static str,
    /// What one of its entries names ("agent id").
    noun: &'static str,
    /// The same with its article ("an agent id").
    a_noun: &'static str,
    /// What its entries are ("ids").
    plural: &'static str,
    /// What a token without the field may do.
    any: &'static str,
}

const AGENT_IDS: PatternField = PatternField {
    name: "agent_ids",
    noun: "agent id",
    a_noun: "an agent id",
    plural: "ids",
    any: "connect as any agent id",
};

const SERVICES: PatternField = PatternField {
    name: "services",
    noun: "service",
    a_noun: "a service",
    plural: "services",
    any: "report as any service",
};

/// How many of a token's patterns a refusal lists: a status message goes out in a header,
/// which a client refuses past its limit (16 KiB for hyper's), so a token with hundreds of ids
/// must still be refused with its status.
const SHOWN_PATTERNS: usize = 8;

/// Lists the patterns as written, the first [`SHOWN_PATTERNS`] of them and how many more:
/// `` `checkout-*`, `batch-7` ``.
impl fmt::Display for AgentIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pattern) in self.0.iter().take(SHOWN_PATTERNS).enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}`{}`", pattern.escape_debug())?;
        }
        if let Some(more) = self.0.len().checked_sub(SHOWN_PATTERNS).filter(|m| *m > 0) {
            write!(f, " and {more} more")?;
        }
        Ok(())
    }
}

/// Every credential of a tokens file.
pub struct Tokens {
    tokens: Vec<Token>,
}

/// Lists names and roles, never secrets.
impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.tokens.iter().map(|t| (&t.name, t.role)))
            .finish()
    }
}

fn digest(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

impl Tokens {
    /// Reads and checks the tokens file at `path`.
    pub fn load(path: &Path) -> Result<Self, TokensError> {
        use std::io::Read as _;
        let read = |source| TokensError::Read {
            file: path.to_owned(),
            source,
        };
        // Read at start, before the server listens, and on SIGHUP: a FIFO would hold either.
        crate::refuse_fifo_or_socket(path, "the tokens file", "save the tokens in a regular file")
            .map_err(read)?;
        let file = std::fs::File::open(path).map_err(read)?;
        let mut text = String::new();
        (&file)
            .take(MAX_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read)?;
        // Once read: a path that cannot be read (a directory) is refused for that alone.
        warn_if_loose(path, &file);
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(TokensError::TooLarge {
                file: path.to_owned(),
            });
        }
        Self::parse(&text, path)
    }

    /// Checks the text of a tokens file; `file` only names it in errors.
    pub fn parse(text: &str, file: &Path) -> Result<Self, TokensError> {
        let mut options = serde_saphyr::Options::default();
        // A snippet of the source could show a secret.
        options.with_snippet = false;
        let raw: RawFile =
            serde_saphyr::from_str_with_options(text, options).map_err(|e| TokensError::Parse {
                file: file.to_owned(),
                message: parse_message(e.without_snippet()),
            })?;
        let mut problems = Vec::new();
        if raw.tokens.is_empty() {
            problems.push("`tokens` is empty: define at least one token".to_owned());
        }
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut digests: HashMap<[u8; 32], usize> = HashMap::new();
        let mut tokens = Vec::with_capacity(raw.tokens.len());
        for (i, spanned) in raw.tokens.iter().enumerate() {
            let t = &spanned.value;
            let line = match spanned.referenced.line() {
                0 => String::new(),
                n => format!("line {n}: "),
            };
            // A name that could be a secret (a name and a secret swapped) is not quoted: the
            // message reaches a terminal and the log.
            let at = if could_be_a_secret(&t.name) {
                format!(
                    "{line}tokens[{i}] (name not shown: {MIN_SECRET_LEN} bytes or more, it could \
                     be a secret)"
                )
            } else {
                format!("{line}tokens[{i}] (`{}`)", t.name.escape_debug())
            };
            if t.name.trim().is_empty() {
                problems.push(format!("{line}tokens[{i}]: name is empty"));
            } else if let Some(first) = names.insert(&t.name, i) {
                problems.push(format!("{at}: name is already used by tokens[{first}]"));
            }
            // The name is shown to people: in `history`'s author column, in logs, in a refusal.
            if t.name.contains(char::is_control) {
                problems.push(format!(
                    "{at}: name holds a control character (a line break, an escape); names are \
                     shown in listings and messages"
                ));
            } else if t.name.contains(retryplane_policy::diag::is_escaped) {
                problems.push(format!(
                    "{at}: name holds an invisible or bidirectional formatting character (a \
                     zero-width space, a byte-order mark); names must be told apart where they \
                     are shown"
                ));
            }
            if t.name != t.name.trim() && !t.name.trim().is_empty() {
                problems.push(format!(
                    "{at}: name starts or ends with white space; names must be told apart where \
                     they are shown"
                ));
            }
            let role = match t.role.as_str() {
                "agent" => Some(Role::Agent),
                "admin" => Some(Role::Admin),
                "viewer" => Some(Role::Viewer),
                other => {
                    // Quoted only when it reads as a misspelt role: a value swapped with the
                    // secret must not reach a terminal or the log.
                    let looks_like_a_role =
                        other.len() <= 12 && other.bytes().all(|b| b.is_ascii_alphabetic());
                    let shown = if looks_like_a_role {
                        format!(" `{other}`")
                    } else {
                        String::from(" (not shown: it could be a secret)")
                    };
                    problems.push(format!(
                        "{at}: unknown role{shown} (expected `agent`, `admin` or `viewer`)"
                    ));
                    None
                }
            };
            // The presented secret is trimmed (see `bearer`) and a header carries no control
            // character but the tab: such a secret could never match.
            if t.secret.starts_with(char::is_whitespace) || t.secret.ends_with(char::is_whitespace)
            {
                problems.push(format!(
                    "{at}: secret starts or ends with white space, which an authorization header \
                     cannot carry; remove it"
                ));
            }
            // gRPC metadata values are printable ASCII and the space (its spec's `ASCII-Value`):
            // a client library refuses to send anything else (grpcio does).
            if !retryplane_proto::is_metadata_text(&t.secret) {
                problems.push(format!(
                    "{at}: secret holds a character other than printable ASCII and the space (a \
                     control character, a tab, a letter outside ASCII), which gRPC clients \
                     cannot send in a header"
                ));
            }
            if t.secret.len() < MIN_SECRET_LEN {
                problems.push(format!(
                    "{at}: secret is shorter than {MIN_SECRET_LEN} bytes"
                ));
            }
            if t.secret.len() > MAX_SECRET_LEN {
                problems.push(format!(
                    "{at}: secret is {} bytes, longer than the {MAX_SECRET_LEN} bytes a request's \
                     headers can carry to the control plane",
                    t.secret.len()
                ));
            }
            let digest = digest(t.secret.as_bytes());
            if let Some(first) = digests.insert(digest, i) {
                problems.push(format!(
                    "{at}: same secret as tokens[{first}]; every token needs its own secret"
                ));
            }
            let not_an_agents = |field: &str, problems: &mut Vec<String>| {
                if let Some(other) = role.filter(|r| *r != Role::Agent) {
                    problems.push(format!(
                        "{at}: `{field}` is for agent tokens; a token of role `{}` does not \
                         connect as an agent",
                        other.as_str()
                    ));
                }
            };
            let agent_ids = t.agent_ids.as_ref().and_then(|raw| {
                not_an_agents("agent_ids", &mut problems);
                AgentIds::check(raw, &AGENT_IDS, &at, &mut problems)
            });
            let services = t.services.as_ref().and_then(|raw| {
                not_an_agents("services", &mut problems);
                AgentIds::check(raw, &SERVICES, &at, &mut problems)
            });
            let max_agents = match &t.max_agents {
                None => None,
                Some(written) => {
                    not_an_agents("max_agents", &mut problems);
                    let none = |what: &str, problems: &mut Vec<String>| {
                        problems.push(format!(
                            "{at}: `max_agents` is {what}, so no agent could connect with this \
                             token; leave the field out for no limit of its own"
                        ));
                        None
                    };
                    match written {
                        RawMax::Null => none("without a value", &mut problems),
                        RawMax::Count(0) => none("0", &mut problems),
                        RawMax::TooLarge => {
                            problems.push(format!(
                                "{at}: `max_agents` is past any count this file takes (at most \
                                 {}); leave the field out for no limit of its own",
                                u64::MAX
                            ));
                            None
                        }
                        RawMax::Other => {
                            problems.push(format!(
                                "{at}: `max_agents` must be a whole number of at least 1 (how \
                                 many agents may be connected with this token at once)"
                            ));
                            None
                        }
                        // Past `usize` on a 32-bit machine: no limit of its own, in practice.
                        RawMax::Count(max) => Some(usize::try_from(*max).unwrap_or(usize::MAX)),
                    }
                }
            };
            if let Some(role) = role {
                tokens.push(Token {
                    name: t.name.clone(),
                    role,
                    digest,
                    agent_ids,
                    services,
                    max_agents,
                });
            }
        }
        if problems.is_empty() {
            Ok(Self { tokens })
        } else {
            Err(TokensError::Invalid {
                file: file.to_owned(),
                problems,
            })
        }
    }

    /// Whether a token of `role` still has the secret `credential` was checked against.
    pub(crate) fn admits(&self, credential: &Credential) -> bool {
        self.find_digest(&credential.digest)
            .is_some_and(|token| token.role == credential.role)
    }

    /// Why the token holding `credential`'s secret may not connect as the agent `agent_id`
    /// (`PERMISSION_DENIED`, naming the token and the ids it may use): `None` when it may, or
    /// when no token holds that secret any more ([`Tokens::admits`] tells that).
    pub(crate) fn refuses_agent_id(
        &self,
        credential: &Credential,
        agent_id: &str,
    ) -> Option<Status> {
        let token = self.find_digest(&credential.digest)?;
        let ids = token
            .agent_ids
            .as_ref()
            .filter(|ids| !ids.allow(agent_id))?;
        Some(Status::permission_denied(format!(
            "token `{}` may not connect as agent id `{}`: its `agent_ids` in the tokens file \
             are {ids}",
            token.name,
            agent_id.escape_debug()
        )))
    }

    /// Why the token holding `credential`'s secret may not report as the service `service`
    /// (`PERMISSION_DENIED`, naming the token and the services it may name): `None` when it
    /// may, or when no token holds that secret any more.
    pub(crate) fn refuses_service(&self, credential: &Credential, service: &str) -> Option<Status> {
        let token = self.find_digest(&credential.digest)?;
        let services = token
            .services
            .as_ref()
            .filter(|services| !services.allow(service))?;
        Some(Status::permission_denied(format!(
            "token `{}` may not report as service `{}`: its `services` in the tokens file are \
             {services}",
            token.name,
            service.escape_debug()
        )))
    }

    /// The `max_agents` of the token holding `credential`'s secret (`None`: it sets none, or
    /// no token holds that secret any more).
    pub(crate) fn max_agents(&self, credential: &Credential) -> Option<usize> {
        self.find_digest(&credential.digest)?.max_agents
    }

    /// The name and `max_agents` of the token holding `credential`'s secret, if one still
    /// does.
    pub(crate) fn name_and_max_agents(
        &self,
        credential: &Credential,
    ) -> Option<(String, Option<usize>)> {
        self.find_digest(&credential.digest)
            .map(|token| (token.name.clone(), token.max_agents))
    }

    /// The name of the token whose secret hashes to `digest`, if any (compared in constant
    /// time, as every lookup here).
    pub(crate) fn name_of_digest(&self, digest: &[u8; 32]) -> Option<&str> {
        self.find_digest(digest).map(|token| token.name.as_str())
    }

    /// Number of tokens of the `agent` role.
    pub(crate) fn agent_tokens(&self) -> usize {
        self.tokens.iter().filter(|t| t.role == Role::Agent).count()
    }

    /// What no token of these lets anyone do, said as a warning: connect an agent (no `agent`
    /// token), or, in API mode (`api_mode`), change the policies (no `admin` token). A file
    /// of viewers only, or of admins only in file mode, is a choice and not warned of.
    pub(crate) fn missing_roles(&self, api_mode: bool) -> Vec<&'static str> {
        let has = |role| self.tokens.iter().any(|t| t.role == role);
        let mut missing = Vec::new();
        if !has(Role::Agent) {
            missing.push("the tokens file holds no `agent` token: no agent can connect");
        }
        if api_mode && !has(Role::Admin) {
            missing.push(
                "the tokens file holds no `admin` token: no one can apply, roll back or change \
                 the policies through the admin API",
            );
        }
        missing
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens (never true for a loaded file).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The token whose secret is `secret`, comparing against every token in constant time.
    fn find(&self, secret: &[u8]) -> Option<&Token> {
        self.find_digest(&digest(secret))
    }

    /// The token whose secret hashes to `presented`, comparing against every token in
    /// constant time.
    fn find_digest(&self, presented: &[u8; 32]) -> Option<&Token> {
        // 0 = none; otherwise index + 1 of the matching token. Every token is compared.
        let mut found: u64 = 0;
        for (i, token) in self.tokens.iter().enumerate() {
            let candidate = u64::try_from(i).map_or(0, |i| i + 1);
            found.conditional_assign(&candidate, token.digest.ct_eq(presented));
        }
        let index = usize::try_from(found.checked_sub(1)?).ok()?;
        self.tokens.get(index)
    }
}

/// The YAML reader's message for a tokens file it refused, in the words of this file: its
/// message for a duplicate key names a setting of the library, which an operator cannot set.
/// Anything it quotes from the file that could be a secret is left out (see [`unquoted`]).
fn parse_message(e: &serde_saphyr::Error) -> String {
    let message = match e {
        serde_saphyr::Error::DuplicateMappingKey { key, location } => format!(
            "duplicate key{} at line {}, column {}",
            key.as_ref().map(|k| format!(" `{k}`")).unwrap_or_default(),
            location.line(),
            location.column()
        ),
        other => other.to_string(),
    };
    unquoted(&message)
}

/// `message` with what it quotes from the file left out when that could be a secret: the
/// reader quotes what it found (`unknown field `secret=…``, when `=` was typed for `:`), and
/// does not escape a quote inside it, so quotes cannot be paired reliably. A message that
/// quotes one plain word (at most 12 ASCII letters and `_`: a field name such as `secrte`,
/// far shorter than any secret) stays whole, so a misspelt field is still named. Any other
/// message keeps what comes before its first quote and its place in the file.
fn unquoted(message: &str) -> String {
    fn is_word(s: &str) -> bool {
        (1..=12).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphabetic() || b == b'_')
    }
    let is_quote = |c: char| c == '`' || c == '"';
    let quotes: Vec<usize> = message.match_indices(is_quote).map(|(i, _)| i).collect();
    match quotes[..] {
        [] => return message.to_owned(),
        [open, close]
            if message[open..=open] == message[close..=close]
                && is_word(&message[open + 1..close]) =>
        {
            return message.to_owned();
        }
        _ => {}
    }
    let first = quotes[0];
    let last = quotes[quotes.len() - 1];
    // `… at line 2, column 30`, when it comes after the last quote.
    let place = message[last..]
        .rfind(" at line ")
        .map_or("", |at| &message[last + at..]);
    format!("{}(not shown){place}", &message[..first])
}

/// What is wrong with a tokens file of permission bits `mode`, if anything: writable by its
/// group or every user (whoever may write it can give themselves an admin token at the next
/// SIGHUP), and readable by every user (every secret in it can be read), both named when both
/// hold. Readable by its group is left alone: a mounted secret shared with a group is read so.
fn loose_mode(mode: u32) -> Option<&'static str> {
    let writable = mode & 0o022 != 0;
    let readable = mode & 0o004 != 0;
    match (writable, readable) {
        (true, true) => Some(
            "the tokens file may be changed by users other than its owner (its group or every \
             user may write it), and whoever writes it can give themselves an admin token at \
             the next reload; every user may also read it, and every secret in it; make it \
             readable and writable by its owner only (chmod 600, or a mounted secret's mode \
             0400)",
        ),
        (true, false) => Some(
            "the tokens file may be changed by users other than its owner (its group or every \
             user may write it), and whoever writes it can give themselves an admin token at \
             the next reload; make it writable by its owner only (chmod 600, or a mounted \
             secret's mode 0400)",
        ),
        (false, true) => Some(
            "the tokens file is readable by every user; make it readable by its owner only \
             (chmod 600, or a mounted secret's mode 0400)",
        ),
        (false, false) => None,
    }
}

/// A directory a reload reads the tokens file through, as [`loose_place`] judges it.
#[derive(Debug)]
struct DirSeen {
    /// Its path, for the warning.
    path: PathBuf,
    /// Its owner's user id.
    owner: u32,
    /// Its permission bits (with the sticky bit).
    mode: u32,
}

/// Who may own a tokens file and its directories: the control plane's user (`server_user`)
/// and root, said once when they are one.
fn trusted_owners(server_user: u32) -> String {
    if server_user == 0 {
        "root (the control plane's user)".to_owned()
    } else {
        format!("the control plane's user ({server_user}) or root")
    }
}

/// What is wrong with where a tokens file is, if anything: some of the checks OpenSSH's
/// `StrictModes` makes of a key file. The file owned by `file_owner`, a user other than
/// `server_user` (the control plane's own) and root: its owner may change it, mode and all.
/// A directory of `dirs` (the path's own, and the one the opened file is in, when a symbolic
/// link leads there) owned by such a user, or that its group or every user may write without
/// the sticky bit: they may put another file in its place. A sticky directory is let be (a
/// Kubernetes secret volume's root is `drwxrwxrwt`); directories above these are not looked
/// at. The caller leaves out what is on a read-only file system (`file_owner` `None`, and
/// such directories), where nobody here can change it: a container's bind mount, whose owner
/// is the host's user.
fn loose_place(file_owner: Option<u32>, server_user: u32, dirs: &[DirSeen]) -> Vec<String> {
    let trusted = |user: u32| user == server_user || user == 0;
    let owners = trusted_owners(server_user);
    let mut found = Vec::new();
    if let Some(owner) = file_owner
        && !trusted(owner)
    {
        found.push(format!(
            "the tokens file is owned by user {owner}, not by {owners}: its owner can give \
             themselves an admin token at the next reload; chown it to the control plane's \
             user, or mount it read-only"
        ));
    }
    for dir in dirs {
        let shown = dir.path.display();
        if !trusted(dir.owner) {
            found.push(format!(
                "the directory {shown} holding the tokens file is owned by user {}, not by \
                 {owners}: its owner can put another tokens file in its place before the next \
                 reload; keep the file in a directory {owners} owns",
                dir.owner
            ));
        } else if dir.mode & 0o022 != 0 && dir.mode & 0o1000 == 0 {
            found.push(format!(
                "the directory {shown} holding the tokens file may be written by users other \
                 than its owner (its group or every user), who can put another tokens file in \
                 its place before the next reload; keep it in a directory only its owner may \
                 write (or one with the sticky bit, as /tmp)"
            ));
        }
    }
    found
}

#[cfg(unix)]
fn warn_if_loose(path: &Path, file: &std::fs::File) {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let Ok(meta) = file.metadata() else {
        return;
    };
    if let Some(why) = loose_mode(meta.permissions().mode()) {
        tracing::warn!(file = %LogPath(path), "{why}");
    }
    // On a read-only file system nobody here can change the file, or a directory: a
    // container's bind mount or secret, whose owner is a user of the host.
    let writable = |flags: rustix::fs::StatVfsMountFlags| {
        !flags.contains(rustix::fs::StatVfsMountFlags::RDONLY)
    };
    let file_owner = rustix::fs::fstatvfs(file)
        .is_ok_and(|fs| writable(fs.f_flag))
        .then(|| meta.uid());
    // The directory the path names it in, and the one the opened file is in (where a
    // symbolic link led, a mounted secret's `..data` say): a reload reads the path again
    // through both. The opened file's own path, not the path resolved again, which a swap
    // of the link since the read would change.
    let own = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    };
    let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .or_else(|_| std::fs::canonicalize(path))
        .ok()
        .and_then(|p| p.parent().map(Path::to_owned));
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let mut dirs = Vec::new();
    for dir in std::iter::once(own).chain(opened) {
        let Ok(d) = std::fs::metadata(&dir) else {
            continue;
        };
        if seen.contains(&(d.dev(), d.ino())) {
            continue;
        }
        seen.push((d.dev(), d.ino()));
        if rustix::fs::statvfs(&dir).is_ok_and(|fs| writable(fs.f_flag)) {
            dirs.push(DirSeen {
                path: dir,
                owner: d.uid(),
                mode: d.permissions().mode(),
            });
        }
    }
    let server_user = rustix::process::geteuid().as_raw();
    for why in loose_place(file_owner, server_user, &dirs) {
        tracing::warn!(file = %LogPath(path), "{why}");
    }
}

#[cfg(not(unix))]
fn warn_if_loose(_path: &Path, _file: &std::fs::File) {}

/// The tokens in force, read from a tokens file and read again on [`TokenSet::reload`].
#[derive(Debug)]
pub struct TokenSet {
    file: PathBuf,
    current: watch::Sender<Arc<Tokens>>,
    /// Reloads begun, each numbered: the latest begun that has ended is the one in force.
    begun: std::sync::atomic::AtomicU64,
    /// The number of the reload in force (0: the first read).
    installed: std::sync::Mutex<u64>,
}

impl TokenSet {
    /// Reads `file` ([`Tokens::load`]).
    pub fn load(file: &Path) -> Result<Self, TokensError> {
        let tokens = Tokens::load(file)?;
        Ok(Self::of(file, tokens))
    }

    /// `tokens` in force, as if read from `file`.
    pub fn of(file: &Path, tokens: Tokens) -> Self {
        Self {
            file: file.to_owned(),
            current: watch::Sender::new(Arc::new(tokens)),
            begun: std::sync::atomic::AtomicU64::new(0),
            installed: std::sync::Mutex::new(0),
        }
    }

    /// The tokens file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The tokens in force.
    pub fn current(&self) -> Arc<Tokens> {
        self.current.borrow().clone()
    }

    /// Reads the file again and puts its tokens in force: later calls are checked against
    /// them, and agent streams whose secret they no longer hold (with the agent role) end with
    /// `UNAUTHENTICATED`. A file that cannot be used changes nothing; the error says why.
    /// Returns the number of tokens now in force. Reloads may run at once (on threads of their
    /// own, a slow one beside those after it): the tokens of a read that ends after a later one
    /// was put in force are not ([`TokensError::Superseded`]).
    pub fn reload(&self) -> Result<usize, TokensError> {
        let reload = self.begin_reload();
        let tokens = Tokens::load(&self.file)?;
        self.put_in_force(reload, tokens)
    }

    /// The number of a reload that begins now.
    fn begin_reload(&self) -> u64 {
        self.begun
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            .saturating_add(1)
    }

    /// Puts `tokens`, read by reload number `reload`, in force unless a later one is already.
    fn put_in_force(&self, reload: u64, tokens: Tokens) -> Result<usize, TokensError> {
        let mut installed = self.installed.lock().unwrap_or_else(|e| e.into_inner());
        if reload < *installed {
            return Err(TokensError::Superseded {
                file: self.file.clone(),
            });
        }
        *installed = reload;
        let count = tokens.len();
        self.current.send_replace(Arc::new(tokens));
        Ok(count)
    }

    /// A receiver that sees every reload.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Arc<Tokens>> {
        self.current.subscribe()
    }
}

/// What a request authenticated with: the hash of its secret (never the secret) and the role
/// it was admitted for. Put into the request's extensions, so a long call (an agent stream) can
/// be ended when a reload takes the secret away ([`Tokens::admits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Credential {
    digest: [u8; 32],
    role: Role,
}

impl Credential {
    /// The role the request was admitted with.
    pub(crate) fn role(&self) -> Role {
        self.role
    }

    /// The SHA-256 digest of the secret the request presented.
    pub(crate) fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// A request admitted with `role` (tests of what callers of a role may do).
    #[cfg(test)]
    pub(crate) fn for_test(role: Role) -> Self {
        Self {
            digest: [0; 32],
            role,
        }
    }
}

/// A tonic interceptor that admits only tokens of one role; admits everything when there are
/// no tokens.
#[derive(Clone, Debug)]
pub struct Guard {
    tokens: Option<Arc<TokenSet>>,
    role: Role,
    refused: Option<prometheus_client::metrics::counter::Counter>,
    warning: Option<Arc<RefusalWarning>>,
}

/// The warn line of [`Guard::warning`]: at most one every [`REFUSAL_WARN_INTERVAL`], saying
/// how many refusals went unlogged since the one before (`unlogged_before`).
#[derive(Debug, Default)]
struct RefusalWarning {
    /// When the last line was written, and the refusals since that were not.
    last: std::sync::Mutex<(Option<tokio::time::Instant>, u64)>,
}

/// The least time between two warn lines of one [`Guard`]: a caller that retries a refused
/// login in a loop fills no log.
pub const REFUSAL_WARN_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

impl RefusalWarning {
    /// The refusals not logged since the last line, if a line is due now (the count is reset);
    /// `None` (and one more not logged) if not.
    fn due(&self) -> Option<u64> {
        let now = tokio::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.0 {
            Some(at) if now.saturating_duration_since(at) < REFUSAL_WARN_INTERVAL => {
                last.1 = last.1.saturating_add(1);
                None
            }
            _ => {
                let unlogged = std::mem::take(&mut last.1);
                last.0 = Some(now);
                Some(unlogged)
            }
        }
    }
}

impl Guard {
    /// Admits callers holding a token of `role` from the tokens in force in `tokens`; everyone
    /// when `tokens` is `None`.
    pub fn new(tokens: Option<Arc<TokenSet>>, role: Role) -> Self {
        Self {
            tokens,
            role,
            refused: None,
            warning: None,
        }
    }

    /// Counts each caller refused in `refused` (`retryplane_server_auth_refused_total`), so
    /// that an agent or a script with a wrong token shows on the server's side too.
    #[must_use]
    pub fn counting(mut self, refused: prometheus_client::metrics::counter::Counter) -> Self {
        self.refused = Some(refused);
        self
    }

    /// Logs refused callers at warn (else at debug), at most one line every
    /// [`REFUSAL_WARN_INTERVAL`] with the count of those left out: the listener, the caller's
    /// address, the status and its reason (which names a known token of the wrong role, never
    /// a secret). For the agent listener, where a refused agent runs on its cached or fallback
    /// policies and says so only in its own logs (an admin secret pasted into an agent's
    /// config, a revoked token still deployed).
    #[must_use]
    pub fn warning(mut self) -> Self {
        self.warning = Some(Arc::default());
        self
    }

    /// The name of the token that `request` authenticates with, or the status refusing it.
    fn check<T>(&self, request: &Request<T>) -> Result<Option<(String, Credential)>, Status> {
        let Some(tokens) = &self.tokens else {
            return Ok(None);
        };
        let tokens = tokens.current();
        let secret = bearer(request).ok_or_else(|| {
            Status::unauthenticated(
                "missing credentials: send the metadata `authorization: Bearer <secret>`",
            )
        })?;
        let token = tokens
            .find(secret)
            .ok_or_else(|| Status::unauthenticated("unknown token"))?;
        if !token.role.enters(self.role) {
            return Err(Status::permission_denied(format!(
                "token `{}` has role `{}`; this service needs role {}",
                token.name,
                token.role.as_str(),
                self.role.admitted()
            )));
        }
        Ok(Some((
            token.name.clone(),
            Credential {
                digest: token.digest,
                role: token.role,
            },
        )))
    }
}

/// The secret of an `authorization: Bearer <secret>` header (scheme case-insensitive).
fn bearer<T>(request: &Request<T>) -> Option<&[u8]> {
    let value = request.metadata().get("authorization")?.as_bytes();
    let (scheme, secret) = value.split_at_checked(7)?;
    let secret = secret.trim_ascii();
    (scheme.eq_ignore_ascii_case(b"bearer ") && !secret.is_empty()).then_some(secret)
}

impl Interceptor for Guard {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let checked = self.check(&request).inspect_err(|status| {
            if let Some(refused) = &self.refused {
                refused.inc();
            }
            // The reason only: never the token.
            let peer = || {
                request.remote_addr().map_or_else(
                    || "unknown".to_owned(),
                    |peer| crate::agent_stream::canonical_peer(peer).to_string(),
                )
            };
            match self.warning.as_deref().map(RefusalWarning::due) {
                Some(Some(unlogged)) => tracing::warn!(service = self.role.as_str(), peer = %peer(), code = ?status.code(), reason = status.message(), unlogged_before = unlogged, "refused a caller for its token"),
                // Within the interval: at debug, so that one caller refused in a loop does
                // not hide another from a log that keeps debug lines.
                Some(None) => tracing::debug!(service = self.role.as_str(), peer = %peer(), code = ?status.code(), reason = status.message(), "refused a caller for its token"),
                None => tracing::debug!(service = self.role.as_str(), peer = %peer(), code = ?status.code(), reason = status.message(), "refused a caller for its token"),
            }
        })?;
        if let Some((name, credential)) = checked {
            request.extensions_mut().insert(TokenName(name));
            request.extensions_mut().insert(credential);
            // Its connection is in use (see `crate::conn_idle`).
            if let Some(admitted) = request.extensions().get::<crate::conn_idle::Admitted>()
                && !admitted.admit()
            {
                return Err(Status::unavailable(
                    "the connection was closed to make room for another; call again",
                ));
            }
        }
        Ok(request)
    }
}

/// Whether a value written where a name goes could be a secret put in its place (a name and a
/// secret swapped): whether it is as long as a secret may be ([`MIN_SECRET_LEN`]). Nothing
/// shorter can be a secret the file accepts; anything as long may be one, whatever it looks
/// like (hex, base64, a UUID, a passphrase of words), so it is not quoted: messages name such
/// an entry by its place (`tokens[2]`) alone.
fn could_be_a_secret(name: &str) -> bool {
    name.len() >= MIN_SECRET_LEN
}

#[cfg(test)]
#[path = "auth_tests.rs"]
mod tests;
