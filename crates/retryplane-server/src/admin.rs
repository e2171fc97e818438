//! The admin service (SPEC §3): Validate, Apply, Get, History, Rollback, FleetStatus, Stats.
//!
//! A thin layer over [`ControlPlane`]: it turns a request into a [`ChangeRequest`] and the
//! outcome or error into a response or a status; versions, diffs and safety checks are decided
//! below it. Writes record the admin token's name ([`TokenName`], put there by
//! [`crate::auth::Guard`]) as the version's author.
//!
//! `Validate` answers `valid: false` for what Apply would refuse as invalid: policies with an
//! error diagnostic, and policies whose snapshot would be larger than agents decode (an error
//! on `<root>` with Apply's message).
//!
//! `History` answers a page of at most [`HISTORY_PAGE`] versions (and about
//! [`HISTORY_PAGE_BYTES`]), with where the next page starts, so a long history never makes an
//! answer larger than a client decodes.
//!
//! # Status codes
//!
//! - `PERMISSION_DENIED`: Apply (not its dry run) or Rollback with a `viewer` token, which
//!   reads only (checked first);
//! - `INVALID_ARGUMENT`: no source, a YAML source over 1 MiB, policies whose snapshot would be
//!   a message larger than agents decode (4 MiB; the message names the sizes and the limit),
//!   a document holding more than a policy file can (also a Rollback to a version stored
//!   before that limit, which is not published again), or invalid policies. For invalid
//!   policies the message is the diagnostics, one per line,
//!   as `LINE:COLUMN: SEVERITY: PATH: MESSAGE` (`0:0` for a typed document, which has no
//!   places), as many as fit [`MAX_MESSAGE_WIRE_BYTES`] and then
//!   `… and K more problems; Validate (retryplane validate) lists them all`: `Validate`
//!   answers every diagnostic in its response body, which has no such limit;
//! - `FAILED_PRECONDITION`: a write in file mode (the message names the file), or a change that
//!   removes every endpoint without `force` (the message names as many of the removed
//!   endpoints as fit, then `… and K more endpoints`, and `--force`; in file mode, where only a
//!   dry run gets this far, it says instead that nothing can force such a save);
//! - `ABORTED`: `expected_version` is not the current version — another change came first; read
//!   the current version and retry (the gRPC code for a failed read-modify-write). Checked
//!   before the removal check, so a stale version never asks for `--force`;
//! - `NOT_FOUND`: a version that is not stored, or `Get` on an empty store;
//! - `INTERNAL`: the store failed. A change's answer says why (the store error's message and
//!   causes: paths and the disk's words) and whether the change was stored: "not stored" once
//!   the store, read back, does not hold it; "may still have been stored" when it could not be
//!   read back. Reads' answers leave the details to the server's log.

use std::sync::Arc;

use prost::Message as _;
use retryplane_policy::render::to_yaml;
use retryplane_policy::yaml::{Loc, MAX_FILE_BYTES};
use retryplane_policy::{Diagnostic, PolicyDocument};
use retryplane_proto::convert;
use retryplane_proto::pb::{self, admin_service_server::AdminService, policy_source::Kind};
use tokio::sync::OwnedSemaphorePermit;
use tonic::{Request, Response, Status};
use tracing::{error, info};

use crate::ErrorChain;
use crate::aggregate::window::Window;
use crate::aggregate::{Filter, Limit};
use crate::auth::{Credential, TokenName};
use crate::control::{
    ChangeContent, ChangeError, ChangeOutcome, ChangeRequest, ControlPlane, Mode, check_size,
};
use crate::store::{Source, StoreError, VersionMeta, VersionRecord};
use crate::turns::{self, Turns};

/// Validate, Apply (dry runs too) and Rollback calls checked at once; the others wait their
/// turn. Checking a document near the size limit (11,000 endpoints) takes about 25 MB while
/// it runs, so a viewer's dry runs sent by the dozen took the process past a gigabyte. One of
/// the turns is kept for changes (Apply, Rollback) by callers who may make them
/// (`crate::turns`).
pub const MAX_CONCURRENT_CHECKS: usize = 4;

/// The `retryplane.v1.AdminService` implementation.
#[derive(Clone, Debug)]
pub struct AdminApi {
    control: Arc<ControlPlane>,
    /// [`MAX_CONCURRENT_CHECKS`] turns, one of them kept for changes by callers who may make
    /// them (a read-only token's Validate calls held every turn, and an Apply waited).
    checks: Turns,
}

impl AdminApi {
    /// A service over `control`.
    pub fn new(control: Arc<ControlPlane>) -> Self {
        Self {
            control,
            checks: Turns::new(MAX_CONCURRENT_CHECKS - 1, 1),
        }
    }

    /// The version served, as it was stored, when `version` asks for it (0 for the current
    /// one, or its number): what `Get` answers from memory while the store fails.
    fn served(&self, version: u64) -> Option<VersionRecord> {
        let served = self.control.publisher.current()?;
        (version == 0 || version == served.version).then(|| VersionRecord {
            meta: served.meta.clone(),
            document: (*served.document).clone(),
        })
    }

    /// File mode: the verdict on the policy file's last judged read, as `FleetStatus` gives it.
    fn policy_file(&self) -> Option<pb::PolicyFileRead> {
        let Mode::File(path) = &self.control.mode else {
            return None;
        };
        let read = self.control.file_read()?;
        Some(pb::PolicyFileRead {
            path: path.display().to_string(),
            served: read.outcome.is_ok(),
            read_unix_ms: read.read_unix_ms,
            problem: read.outcome.err().unwrap_or_default(),
        })
    }

    /// What the last check of the store found, as `FleetStatus` gives it.
    fn store_state(&self) -> pb::StoreState {
        let state = self.control.store_health.state();
        let failing = state.failing.is_some();
        let (since, problem) = state
            .failing
            .map_or((0, String::new()), |f| (f.since_unix_ms, f.problem));
        pb::StoreState {
            checked_unix_ms: state.checked_unix_ms,
            failing,
            failing_since_unix_ms: since,
            problem,
        }
    }

    /// A turn to check a document ([`MAX_CONCURRENT_CHECKS`]): for a change (Apply, Rollback)
    /// by a caller who `may_change` the policies ([`caller_may_change`]), of the shared turns
    /// or the kept one; for a check (Validate, a dry run), of the shared ones.
    async fn check_turn(&self, may_change: bool) -> Result<OwnedSemaphorePermit, Status> {
        self.checks
            .acquire(1, may_change)
            .await
            .map_err(|_| Status::unavailable("control plane shutting down; try again"))
    }

    /// Runs `check` (a Validate, a dry run) as a task of its own that holds a turn until the
    /// check is over. The check's work runs on blocking threads, which go on when the call is
    /// dropped (a client's deadline passed, a reset): the turn must not be given back before.
    async fn in_turn<T: Send + 'static>(
        &self,
        may_change: bool,
        check: impl Future<Output = Result<T, Status>> + Send + 'static,
    ) -> Result<T, Status> {
        let turn = self.check_turn(may_change).await?;
        tokio::spawn(async move {
            let answer = check.await;
            drop(turn);
            answer
        })
        .await
        .map_err(unfinished)?
    }

    /// Apply, once it has its turn.
    async fn apply_in_turn(
        &self,
        request: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        let author = author(&request);
        let too_many = too_many_on_the_wire(&request);
        let unknown = unknown_on_the_wire(&request, "nothing was applied");
        let req = request.into_inner();
        // Refused with the words `ControlPlane::apply` refuses a decoded document that size
        // with (`ChangeError::TooManyItems`), and counted here, as invalid YAML is.
        let content = match (too_many, unknown) {
            (Some(too_many), _) => Err(Status::invalid_argument(diagnostic_lines(&[too_many]))),
            (None, Some(unknown)) => Err(Status::invalid_argument(diagnostic_lines(&unknown))),
            (None, None) => document_of(source_kind(req.source)?).await,
        };
        let content = match content {
            Ok(content) => content,
            Err(invalid) => {
                // Invalid YAML and a document refused on the wire never reach the control
                // plane, which counts the other refusals.
                if !req.dry_run && invalid.code() == tonic::Code::InvalidArgument {
                    self.control.metrics.rejected_changes.inc();
                }
                return Err(invalid);
            }
        };
        // A forced dry run answers with the diff in file mode too: `retryplane diff` asks for one.
        let change = ChangeRequest {
            content,
            source: Source::Admin,
            author,
            expected_version: req.expected_version,
            dry_run: req.dry_run,
            force: req.force,
            keep_endpoints: false,
        };
        self.change(change).await
    }

    /// Refuses writes in file mode.
    fn check_writable(&self) -> Result<(), Status> {
        match &self.control.mode {
            Mode::File(path) => Err(Status::failed_precondition(format!(
                "policies are owned by the file {}: edit it, or start the server with --api",
                path.display()
            ))),
            Mode::Api => Ok(()),
        }
    }

    /// Applies `request`, answering with the outcome (whose warnings, for a YAML source, are
    /// the file's, with line and column).
    async fn change(&self, request: ChangeRequest) -> Result<Response<pb::ApplyResponse>, Status> {
        self.change_or(request, Ok).await
    }

    /// [`Self::change`], with `own` given a refusal first: it answers `Err` with its own status,
    /// or `Ok` with the refusal for [`change_status`] to answer.
    async fn change_or(
        &self,
        request: ChangeRequest,
        own: impl FnOnce(ChangeError) -> Result<ChangeError, Status>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        let file_mode = matches!(self.control.mode, Mode::File(_));
        match self.control.apply(request).await {
            Ok(outcome) => Ok(Response::new(apply_response(outcome))),
            Err(refused) => Err(change_status(own(refused)?, file_mode)),
        }
    }
}

/// The author recorded for a write: the admin token's name, if authentication is on.
/// `PERMISSION_DENIED` for a caller whose token may not change the policies (a `viewer`);
/// without authentication everyone may.
fn check_may_change<T>(request: &Request<T>) -> Result<(), Status> {
    match request.extensions().get::<Credential>() {
        Some(credential) if !credential.role().may_change() => {
            let name = author(request).unwrap_or_default();
            // By name only: a token that tries to write where it may only read is worth a look.
            info!(token = %name, role = credential.role().as_str(), "a change refused: the token reads only");
            Err(Status::permission_denied(format!(
                "token `{name}` has role `{}`, which reads only; changing the policies needs role `admin`",
                credential.role().as_str()
            )))
        }
        _ => Ok(()),
    }
}

/// Whether the caller of `request` may change the policies ([`turns::may_change`]): such a
/// caller may take a turn kept for it.
fn caller_may_change<T>(request: &Request<T>) -> bool {
    turns::may_change(request.extensions().get::<Credential>())
}

fn author<T>(request: &Request<T>) -> Option<String> {
    request.extensions().get::<TokenName>().map(|t| t.0.clone())
}

/// `Some(s)` unless `s` is empty (an unset filter).
fn given(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

/// A `RollbackRequest.expected_version`: 0 is no check (a rollback needs a stored version, so
/// an empty store is never what its caller expects).
fn expected(version: u64) -> Option<u64> {
    (version != 0).then_some(version)
}

/// The most versions one `History` answer holds; more are read a page at a time
/// (`HistoryResponse.next_before`).
pub const HISTORY_PAGE: usize = 1_000;

/// About the most bytes of versions one `History` answer holds (at least one version is
/// always sent): far below the 4 MiB a client decodes, whatever token names and summaries
/// the versions carry.
pub const HISTORY_PAGE_BYTES: usize = 1024 * 1024;

/// About the most bytes of agents one `FleetStatus` answer holds (at least one agent is always
/// sent): with the alerting endpoints and the counts, below the 4 MiB a client decodes.
pub const MAX_FLEET_PAGE_BYTES: usize = 3 * 1024 * 1024;

/// The most a status message may take on the wire. gRPC sends the message percent-encoded in
/// the `grpc-message` trailer, and clients limit a response's metadata: gRPC core (Python, C++,
/// ...) and grpc-go start refusing it past 8 KiB in all, and past 16 KiB the call fails with a
/// protocol error instead of the status. 6 KiB leaves room for the other trailers.
pub const MAX_MESSAGE_WIRE_BYTES: usize = 6 * 1024;

/// How many bytes `text` takes in the `grpc-message` trailer: tonic percent-encodes control
/// characters, bytes outside ASCII and ` "#%<>`?{}` (three bytes each) and sends the rest as is.
/// Counted by hand rather than by encoding, since only the length matters here.
fn wire_len(text: &str) -> usize {
    text.bytes()
        .map(|b| match b {
            0x00..=0x1f | 0x7f..=0xff => 3,
            b' ' | b'"' | b'#' | b'%' | b'<' | b'>' | b'`' | b'?' | b'{' | b'}' => 3,
            _ => 1,
        })
        .sum()
}

/// `items` joined by `separator`, whole items only, within `budget` wire bytes ([`wire_len`]):
/// when they do not all fit, the first ones that do and then `… and K more NOUN` (and `tail`,
/// if not empty, after it). `noun` is singular; an `s` makes it plural.
pub(crate) fn capped_list(
    items: &[String],
    separator: &str,
    budget: usize,
    noun: &str,
    tail: &str,
) -> String {
    capped_list_of_more(items, 0, separator, budget, noun, tail)
}

/// [`capped_list`] of `items` and `hidden` more not given (counted in the closing line, which
/// is there whenever `hidden` is not 0).
fn capped_list_of_more(
    items: &[String],
    hidden: usize,
    separator: &str,
    budget: usize,
    noun: &str,
    tail: &str,
) -> String {
    let lengths: Vec<usize> = items.iter().map(|item| wire_len(item)).collect();
    let separator_len = wire_len(separator);
    let joined_len = |shown: usize| {
        lengths[..shown].iter().sum::<usize>() + separator_len * shown.saturating_sub(1)
    };
    if hidden == 0 && joined_len(items.len()) <= budget {
        return items.join(separator);
    }
    let more = |shown: usize| {
        let left = items.len() - shown + hidden;
        let plural = if left == 1 { "" } else { "s" };
        format!("… and {left} more {noun}{plural}{tail}")
    };
    // Each item shown costs its length and a separator; stop before the one that no longer
    // leaves room for the closing line.
    let mut shown = 0;
    let mut used = 0;
    while shown < items.len() {
        let next = used + lengths[shown] + separator_len;
        if next + wire_len(&more(shown + 1)) > budget {
            break;
        }
        used = next;
        shown += 1;
    }
    let mut text = items[..shown].join(separator);
    if shown > 0 {
        text.push_str(separator);
    }
    text.push_str(&more(shown));
    text
}

/// One diagnostic per line, `LINE:COLUMN: SEVERITY: PATH: MESSAGE`, as many as fit a status
/// message ([`MAX_MESSAGE_WIRE_BYTES`]).
fn diagnostic_lines(diagnostics: &[Diagnostic]) -> String {
    // A check lists at most `diag::MAX_LISTED` problems and a line saying how many more: that
    // line is counted, not shown.
    let mut hidden = 0;
    let lines: Vec<String> = diagnostics
        .iter()
        .filter(|d| match retryplane_policy::diag::unlisted(d) {
            Some((errors, warnings)) => {
                hidden += errors + warnings;
                false
            }
            None => true,
        })
        .map(ToString::to_string)
        .collect();
    let tail = if hidden == 0 {
        "; Validate (retryplane validate) lists them all".to_owned()
    } else {
        format!(
            "; Validate (retryplane validate) lists the first {}",
            retryplane_policy::diag::MAX_LISTED
        )
    };
    capped_list_of_more(
        &lines,
        hidden,
        "\n",
        MAX_MESSAGE_WIRE_BYTES,
        "problem",
        &tail,
    )
}

/// What follows the list of removed endpoints when the change could be forced.
/// (Whether the change leaves the fleet empty or replaces every endpoint by others, none that
/// agents call now keeps its policy.)
const FORCE_IT: &str =
    ": none that agents call now would keep its policy; pass --force to do it anyway";
/// What follows it in file mode, where nothing can force a save.
const NO_FORCE_IN_FILE_MODE: &str = ": a saved file that does this is refused in file mode, and \
     nothing can force it; to replace every endpoint, add the new ones first, save, then \
     remove the old ones";

/// The refusal of a change that removes every endpoint, naming as many of them as fit a status
/// message ([`MAX_MESSAGE_WIRE_BYTES`]), then `after`.
fn removes_everything_message(names: &[String], after: &str) -> String {
    const BEFORE: &str = "the change removes every endpoint (";
    let budget =
        MAX_MESSAGE_WIRE_BYTES.saturating_sub(wire_len(BEFORE) + wire_len(")") + wire_len(after));
    format!(
        "{BEFORE}{}){after}",
        capped_list(names, ", ", budget, "endpoint", "")
    )
}

fn pb_diagnostics(diagnostics: &[Diagnostic]) -> Vec<pb::Diagnostic> {
    diagnostics.iter().map(pb::Diagnostic::from).collect()
}

/// Logs a store failure and answers INTERNAL without its details.
fn internal(e: &StoreError) -> Status {
    error!(error = %ErrorChain(e), "admin request failed in the version store");
    Status::internal(
        "the version store failed; see the control plane's log (`retryplane status` shows \
         whether the store fails its checks)",
    )
}

/// The status for a refused change (see the module docs). In file mode only a save changes the
/// policies (a write here is refused before it gets this far, a dry run is not), and nothing
/// forces a save that removes every endpoint: that refusal says so, rather than "--force".
fn change_status(e: ChangeError, file_mode: bool) -> Status {
    match e {
        ChangeError::Invalid(diagnostics) => {
            Status::invalid_argument(diagnostic_lines(&diagnostics))
        }
        e @ ChangeError::TooLarge { .. } => Status::invalid_argument(e.to_string()),
        ChangeError::TooManyItems(too_many) => {
            Status::invalid_argument(diagnostic_lines(&[too_many]))
        }
        // Asked only by the policy file watcher, never through this API.
        e @ ChangeError::MaybePartial(_) => Status::failed_precondition(e.to_string()),
        ChangeError::RemovesEverything(names) => {
            let after = if file_mode {
                NO_FORCE_IN_FILE_MODE
            } else {
                FORCE_IT
            };
            Status::failed_precondition(removes_everything_message(&names, after))
        }
        ChangeError::RemovesInUse(used) => {
            // As many of them as fit a status message.
            let message = |max| {
                format!(
                    "the change removes {}; their calls would run on the defaults; pass --force \
                     to do it anyway",
                    crate::control::in_use_in_brief(&used, max)
                )
            };
            let fits = (0..=5)
                .rev()
                .map(message)
                .find(|m| wire_len(m) <= MAX_MESSAGE_WIRE_BYTES)
                .unwrap_or_else(|| message(0));
            Status::failed_precondition(fits)
        }
        ChangeError::Conflict {
            expected,
            current,
            holds_it,
            made_by,
        } => Status::aborted(format!(
            "version conflict: expected {}, but the current version is {current}{}; {}",
            if expected == 0 {
                "an empty store (no version yet)".to_owned()
            } else {
                format!("version {expected} to be current")
            },
            made_by.map_or_else(String::new, |by| format!(" ({by})")),
            if holds_it {
                format!(
                    "version {current} already holds this content (was this change stored \
                     before its answer was lost?): there is nothing to apply"
                )
            } else {
                "get the current version and retry".to_owned()
            }
        )),
        ChangeError::Store(StoreError::NoSuchVersion { version }) => {
            Status::not_found(format!("version {version} does not exist"))
        }
        // The store, read back after the failure, does not hold the change: the caller is told
        // so, and why (a full disk, a store file replaced under the control plane).
        ChangeError::Store(e) => {
            error!(error = %ErrorChain(&e), "admin change failed in the version store; not stored");
            Status::internal(format!("the change was not stored: {}", ErrorChain(&e)))
        }
        // A commit can fail after it reached the disk, and the control plane then serves it
        // (once it can read the store again): the caller is not told "not applied".
        ChangeError::StoreUncertain(e) => {
            error!(error = %ErrorChain(&e), "admin change failed in the version store, which could not be read back");
            Status::internal(format!(
                "the version store failed ({}) and could not be read back: the change may still \
                 have been stored: `retryplane history` shows what is once the store reads again, \
                 and `retryplane get` the version agents are served now",
                ErrorChain(&e)
            ))
        }
        ChangeError::Unfinished(why) => {
            error!(error = %why, "an admin change's check did not finish");
            Status::internal("the change's check did not finish; see the control plane's log")
        }
    }
}

fn apply_response(outcome: ChangeOutcome) -> pb::ApplyResponse {
    let (version, content_hash) = outcome.record.map_or((0, String::new()), |r| {
        (r.meta.version, r.meta.content_hash)
    });
    pb::ApplyResponse {
        version,
        content_hash,
        changed: outcome.changed,
        diff: outcome.diff.iter().map(pb::DiffEntry::from).collect(),
        warnings: pb_diagnostics(&outcome.warnings),
        new_content_hash: outcome.content_hash,
        would_change: outcome.would_change,
    }
}

/// A source, checked for presence and size.
fn source_kind(source: Option<pb::PolicySource>) -> Result<Kind, Status> {
    let kind = source
        .and_then(|s| s.kind)
        .ok_or_else(|| Status::invalid_argument("source is required: set yaml or document"))?;
    if let Kind::Yaml(yaml) = &kind
        && yaml.len() > MAX_FILE_BYTES
    {
        return Err(Status::invalid_argument(format!(
            "the YAML source is {} bytes; the limit is {MAX_FILE_BYTES}",
            yaml.len()
        )));
    }
    Ok(kind)
}

/// The size error of a call whose message held more than a policy file can on the wire (its
/// `source` was cut out before the decode: [`crate::decode_turns::TooManyItems`]), as
/// [`convert::check_items`] gives it for a decoded document.
fn too_many_on_the_wire<T>(request: &Request<T>) -> Option<Diagnostic> {
    request
        .extensions()
        .get::<crate::decode_turns::TooManyItems>()
        .map(|too_many| convert::too_many_items(too_many.0))
}

/// The errors of a call whose message held fields this control plane does not know
/// ([`crate::decode_turns::UnknownFields`]): `what` says what was not done.
fn unknown_on_the_wire<T>(request: &Request<T>, what: &str) -> Option<Vec<Diagnostic>> {
    let unknown = request
        .extensions()
        .get::<crate::decode_turns::UnknownFields>()?;
    Some(
        unknown
            .0
            .iter()
            .map(|field| {
                Diagnostic::error(
                    Loc::UNKNOWN,
                    "<request>",
                    format!(
                        "{field} is not known to this control plane ({}): the request comes \
                         from a newer client; {what}",
                        crate::BUILD
                    ),
                )
            })
            .collect(),
    )
}

/// Validate's answer to `request` (see [`AdminApi::in_turn`]).
async fn validated(
    request: Request<pb::ValidateRequest>,
) -> Result<Response<pb::ValidateResponse>, Status> {
    if let Some(too_many) = too_many_on_the_wire(&request) {
        return Ok(Response::new(pb::ValidateResponse {
            valid: false,
            diagnostics: pb_diagnostics(&[too_many]),
        }));
    }
    if let Some(unknown) = unknown_on_the_wire(&request, "nothing was checked") {
        return Ok(Response::new(pb::ValidateResponse {
            valid: false,
            diagnostics: pb_diagnostics(&unknown),
        }));
    }
    let (valid, diagnostics) = match source_kind(request.into_inner().source)? {
        Kind::Yaml(yaml) => {
            off_runtime(move || {
                let loaded = retryplane_policy::load(yaml.as_bytes());
                // First and at 1:1, as `retryplane validate` reports it.
                let too_large = loaded.policies.and_then(|policies| {
                    let document = pb::PolicyDocument::from(policies.document().as_ref());
                    too_large(&document, Loc { line: 1, column: 1 })
                });
                let diagnostics: Vec<Diagnostic> =
                    too_large.into_iter().chain(loaded.diagnostics).collect();
                let valid = !diagnostics.iter().any(Diagnostic::is_error);
                (valid, diagnostics)
            })
            .await?
        }
        Kind::Document(document) => {
            off_runtime(move || {
                // Apply refuses a document too large for the agents before validating it;
                // Validate reports that first and the validation's findings after it.
                // More than a policy file can hold: not converted (its check would take
                // hundreds of megabytes).
                if let Err(too_many) = convert::check_items(&document) {
                    return (false, vec![too_many]);
                }
                let too_large = too_large(&document, Loc::UNKNOWN);
                let (valid, found) = match convert::validate(document) {
                    Ok((_, warnings)) => (true, warnings),
                    Err(errors) => (false, errors),
                };
                let valid = valid && too_large.is_none();
                (valid, too_large.into_iter().chain(found).collect())
            })
            .await?
        }
    };
    Ok(Response::new(pb::ValidateResponse {
        valid,
        diagnostics: pb_diagnostics(&diagnostics),
    }))
}

/// Runs CPU-bound work (loading or validating a policy) off the async threads: a large
/// document takes tens of milliseconds (about 75 ms to load 1,000 endpoints of YAML), which
/// would otherwise stall the agent streams that share a worker with this call.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(unfinished)
}

/// The answer to a call whose policy check panicked or was cancelled; logged.
fn unfinished(e: tokio::task::JoinError) -> Status {
    error!(error = %e, "an admin request's policy check did not finish");
    Status::internal("the policy check did not finish; see the control plane's log")
}

/// The error diagnostic for a document whose snapshot agents could not decode, with the message
/// Apply refuses it with ([`ChangeError::TooLarge`]); it has no place, so it is on `<root>`.
fn too_large(document: &pb::PolicyDocument, loc: Loc) -> Option<Diagnostic> {
    check_size(document)
        .err()
        .map(|e| Diagnostic::error(loc, "<root>", e.to_string()))
}

/// The `History` answer holding as many of `metas` (newest first, at most [`HISTORY_PAGE`]) as
/// fit [`HISTORY_PAGE_BYTES`], at least one; `next_before` is set when versions older than the
/// last one sent were asked for (`limit` 0, or more than were sent).
fn history_page(metas: &[VersionMeta], limit: usize) -> pb::HistoryResponse {
    let mut versions = Vec::with_capacity(metas.len());
    let mut bytes = 0;
    for meta in metas {
        let info = pb::VersionInfo::from(meta);
        bytes += info.encoded_len();
        if !versions.is_empty() && bytes > HISTORY_PAGE_BYTES {
            break;
        }
        versions.push(info);
    }
    // Versions are numbered from 1 without gaps, so older ones exist below any but 1.
    let more_wanted = limit == 0 || versions.len() < limit;
    let next_before = match versions.last() {
        Some(last) if last.version > 1 && more_wanted => last.version,
        _ => 0,
    };
    pb::HistoryResponse {
        versions,
        next_before,
    }
}

/// What to apply: a typed document as it came (its `-0.0` read as `0.0`), or, for YAML, the
/// compiled policies with the file's warnings (with places), which the control plane does not
/// validate again; INVALID_ARGUMENT with every diagnostic when the YAML has errors.
async fn document_of(kind: Kind) -> Result<ChangeContent, Status> {
    match kind {
        Kind::Document(mut document) => {
            // More than a policy file can hold: `ControlPlane::apply` refuses it before
            // anything else looks at it. This walk is linear and allocates nothing.
            // A file reads `-0.0` as `0.0`; so does a document, or a change of a zero's sign
            // alone would get a new hash and version.
            let _ = convert::unsigned_zeros(&mut document);
            Ok(ChangeContent::Document(Box::new(document)))
        }
        Kind::Yaml(yaml) => {
            off_runtime(move || {
                let loaded = retryplane_policy::load(yaml.as_bytes());
                match loaded.policies {
                    Some(policies) => Ok(ChangeContent::Loaded {
                        policies,
                        warnings: loaded.diagnostics,
                    }),
                    None => Err(Status::invalid_argument(diagnostic_lines(
                        &loaded.diagnostics,
                    ))),
                }
            })
            .await?
        }
    }
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn validate(
        &self,
        request: Request<pb::ValidateRequest>,
    ) -> Result<Response<pb::ValidateResponse>, Status> {
        // A check only: the kept turn is for changes.
        self.in_turn(false, validated(request)).await
    }

    async fn apply(
        &self,
        request: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        // A dry run writes nothing, so it also answers in file mode (`retryplane diff`).
        if request.get_ref().dry_run {
            let api = self.clone();
            return self
                .in_turn(false, async move { api.apply_in_turn(request).await })
                .await;
        }
        let may_change = caller_may_change(&request);
        // Refused before it waits for a turn, as a rollback is.
        check_may_change(&request).inspect_err(|_| {
            self.control.metrics.auth_refused.inc();
        })?;
        self.check_writable()?;
        // A change keeps its own rules for a dropped call (see `ControlPlane::apply`): the turn
        // is held by the call.
        let _turn = self.check_turn(may_change).await?;
        self.apply_in_turn(request).await
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        let version = request.into_inner().version;
        let stored = self
            .control
            .blocking(move |s| {
                if version == 0 {
                    s.current()
                } else {
                    s.get(version)
                }
            })
            .await;
        let (record, from_memory) = match stored {
            Ok(record) => (record, false),
            // The store failed (a file truncated or gone under the control plane): the
            // version served is still in memory, and is often the one copy left besides the
            // agents' caches, so it is answered from there, for the operator to save.
            Err(e) => {
                let Some(served) = self.served(version) else {
                    return Err(internal(&e));
                };
                error!(
                    error = %ErrorChain(&e),
                    version = served.meta.version,
                    "the version store failed; answered Get with the version served, from memory"
                );
                (Some(served), true)
            }
        };
        let record = record.ok_or_else(|| {
            Status::not_found(if version == 0 {
                "no version is stored yet".to_owned()
            } else {
                format!("version {version} does not exist")
            })
        })?;
        let yaml = PolicyDocument::try_from(record.document.clone())
            .map(|doc| to_yaml(&doc))
            .map_err(|e| {
                error!(version = record.meta.version, error = %e, "a stored document does not convert");
                Status::internal("a stored version cannot be rendered; see the control plane's log")
            })?;
        let mut response = Response::new(pb::GetResponse {
            info: Some(pb::VersionInfo::from(&record.meta)),
            policies: Some(record.document),
            yaml,
        });
        if from_memory {
            response.metadata_mut().insert(
                retryplane_proto::FROM_MEMORY_METADATA,
                tonic::metadata::MetadataValue::from_static("1"),
            );
        }
        Ok(response)
    }

    async fn history(
        &self,
        request: Request<pb::HistoryRequest>,
    ) -> Result<Response<pb::HistoryResponse>, Status> {
        let request = request.into_inner();
        let limit = usize::try_from(request.limit).unwrap_or(usize::MAX);
        let page = if limit == 0 {
            HISTORY_PAGE
        } else {
            limit.min(HISTORY_PAGE)
        };
        let before = (request.before != 0).then_some(request.before);
        let metas = self
            .control
            .blocking(move |s| s.history(page, before))
            .await
            .map_err(|e| internal(&e))?;
        Ok(Response::new(history_page(&metas, limit)))
    }

    async fn rollback(
        &self,
        request: Request<pb::RollbackRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        check_may_change(&request).inspect_err(|_| {
            self.control.metrics.auth_refused.inc();
        })?;
        self.check_writable()?;
        let _turn = self.check_turn(caller_may_change(&request)).await?;
        let author = author(&request);
        let req = request.into_inner();
        let from = req.version;
        if from == 0 {
            return Err(Status::invalid_argument(
                "the version to roll back to is required",
            ));
        }
        let record = self
            .control
            .blocking(move |s| s.get(from))
            .await
            .map_err(|e| internal(&e))?
            .ok_or_else(|| Status::not_found(format!("version {from} does not exist")))?;
        let change = ChangeRequest {
            content: ChangeContent::Document(Box::new(record.document)),
            source: Source::Rollback { from },
            author,
            expected_version: expected(req.expected_version),
            dry_run: false,
            force: req.force,
            keep_endpoints: false,
        };
        // A version stored before the item limit may hold more than Apply takes now: not
        // published again (each agent would decode it whole, and refuse it).
        self.change_or(change, |refused| match refused {
            ChangeError::TooManyItems(too_many) => Err(Status::invalid_argument(format!(
                "version {from} cannot be published again: {}",
                too_many.message
            ))),
            other => Ok(other),
        })
        .await
    }

    /// A page of agents (every one when `page_size` is 0) of at most [`MAX_FLEET_PAGE_BYTES`],
    /// with a `next_page_token` when more follow: however large the fleet and its Hellos, the
    /// answer fits a client's usual 4 MiB limit, and a call copies no more than that.
    async fn fleet_status(
        &self,
        request: Request<pb::FleetStatusRequest>,
    ) -> Result<Response<pb::FleetStatusResponse>, Status> {
        let req = request.into_inner();
        let size = match req.page_size {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        let page = self.control.fleet.status_page(
            !req.counts_only,
            &req.page_token,
            size,
            MAX_FLEET_PAGE_BYTES,
        );
        let (connected, known) = (page.connected, page.known);
        Ok(Response::new(pb::FleetStatusResponse {
            current_version: self.control.publisher.current().map_or(0, |s| s.version),
            agents: page.agents,
            next_page_token: page.next,
            // Judged over every series: for the first page only, not again for each page.
            alerting_endpoints: if req.page_token.is_empty() {
                self.control
                    .aggregates
                    .alerting_endpoints(tokio::time::Instant::now())
            } else {
                Vec::new()
            },
            connected_agents: u32::try_from(connected).unwrap_or(u32::MAX),
            known_agents: u32::try_from(known).unwrap_or(u32::MAX),
            policy_file: self.policy_file(),
            started_unix_ms: self.control.fleet.started_unix_ms(),
            store: Some(self.store_state()),
        }))
    }

    async fn stats(
        &self,
        request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let req = request.into_inner();
        let window = order_window(req.order_window_seconds)?;
        let limit = (req.limit > 0).then(|| Limit {
            count: usize::try_from(req.limit).unwrap_or(usize::MAX),
            window,
        });
        let filter = Filter {
            service: given(&req.service),
            endpoint: given(&req.endpoint),
            firing_only: req.firing_only,
        };
        Ok(Response::new(self.control.aggregates.stats_limited(
            tokio::time::Instant::now(),
            filter,
            limit,
            req.series_only,
        )))
    }
}

/// The window of `StatsRequest.order_window_seconds`: 60 (or 0), 300 or 900.
fn order_window(seconds: u32) -> Result<Window, Status> {
    match seconds {
        0 => Ok(Window::OneMinute),
        other => Window::from_seconds(other).ok_or_else(|| {
            Status::invalid_argument(format!(
                "order_window_seconds is {other}; the windows are 60, 300 and 900 seconds"
            ))
        }),
    }
}

#[cfg(test)]
#[path = "admin_tests.rs"]
mod tests;
