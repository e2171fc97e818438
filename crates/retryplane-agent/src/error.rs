//! What can go wrong: building an agent ([`AgentError`]) and making a call ([`CallError`]).

use std::fmt;
use std::path::PathBuf;

use retryplane_policy::codes::GrpcCode;
use retryplane_policy::engine::{GiveUpCause, Outcome};
use retryplane_policy::model::ErrorClass;

/// Why the agent's stream to the control plane last ended or could not start
/// ([`crate::Agent::stream_error`]). The agent keeps reconnecting whatever it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct StreamError {
    /// The gRPC status the control plane answered or ended the stream with; `None` when no
    /// answer came (the connection failed or was cut).
    pub code: Option<tonic::Code>,
    /// What happened, for people: the status and its message, or the connection error.
    pub message: String,
}

/// A snapshot the agent refused (NACKed), with why ([`crate::Agent::last_refusal`]): the
/// policies in force stayed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("version {version} refused: {error}")]
pub struct Refusal {
    /// The version the control plane pushed.
    pub version: u64,
    /// The reason, as the NACK sent it: the first problems the agent's check found (an
    /// invalid policy, a content hash that does not match, a snapshot that does not decode).
    pub error: String,
}

/// Why an agent could not be built. Messages never include the token.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The control-plane URL is not a valid URI.
    #[error("invalid control-plane URL")]
    InvalidUrl(#[source] tonic::transport::Error),
    /// The control-plane URL cannot be used as given: it has no scheme (no connection could
    /// ever be made); it asks for TLS with `https://`, which the agent does not speak yet (the
    /// token would go out in clear text); it holds a `user:password@` part (which would go out
    /// in every call's `:authority`; the control plane takes a token); or its port is not a
    /// number from 1 to 65535, or it names no port at all (the connection would quietly go to
    /// port 80); or it names no host (`http://:7470`, `http://[]:7470`); or it holds an `@`
    /// after the host; or its scheme is neither `http` nor `grpc` (it would be served as
    /// `http://` whatever it says; `grpcs://` asks for TLS, as `https://` does); or it is a
    /// `unix:` socket. The reason never quotes the URL.
    #[error("the control-plane URL must be http://host:port: {reason}")]
    UnsupportedUrl {
        /// What is wrong with it (never the URL itself, which may hold credentials).
        reason: String,
    },
    /// The token is one no control plane holds: it is empty, starts or ends with white space,
    /// or holds a character other than printable ASCII and the space (a control character, a
    /// letter outside ASCII), as a tokens file's secrets cannot.
    #[error(
        "the token cannot be a control plane's: it is empty, starts or ends with white space, \
         or holds a character other than printable ASCII and the space"
    )]
    InvalidToken,
    /// The token file given to [`crate::AgentBuilder::token_file`] cannot be read, or holds
    /// no token a control plane could hold (see [`AgentError::InvalidToken`]). The reason never
    /// quotes the file.
    #[error("cannot use the agent token file {}: {reason}", path.display())]
    TokenFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why not.
        reason: String,
    },
    /// The agent's identity (its agent id, service name or labels) is one the control plane
    /// refuses: a field past its bound, a control character, too many labels. The reason names
    /// the field.
    #[error("the agent's Hello would be refused by the control plane: {0}")]
    InvalidHello(retryplane_proto::BadHello),
    /// No control-plane URL was given to [`crate::AgentBuilder::connect`].
    #[error("no control-plane URL given")]
    MissingUrl,
    /// No service name (or only white space) was given to [`crate::AgentBuilder::connect`]
    /// ([`crate::AgentBuilder::service`]): the control plane lists and counts agents by it.
    #[error("no service name given (AgentBuilder::service)")]
    MissingService,
    /// [`crate::AgentBuilder::cache_file`] was given an empty path (an unset setting read as
    /// `""`, say): no cache could ever be written there. Give a file's path, or no cache file.
    #[error("the cache file's path is empty (AgentBuilder::cache_file)")]
    EmptyCachePath,
    /// [`crate::AgentBuilder::connect`] was called outside a tokio runtime.
    #[error("the agent must be started inside a tokio runtime")]
    NoRuntime,
    /// The policy file cannot be read.
    #[error("cannot read the policy file {}", path.display())]
    ReadPolicyFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The policy file has errors.
    #[error("the policy file {} is invalid: {} error(s), first: {first}", path.display(), errors)]
    InvalidPolicyFile {
        /// The file.
        path: PathBuf,
        /// How many errors.
        errors: usize,
        /// The first error, as `retryplane validate` prints it after the file's name:
        /// `LINE:COLUMN: error: PATH: message`.
        first: String,
    },
}

/// Why a logical call ended without a value to return: it gave up, it was cancelled, or its
/// classifier called an error a success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The retry rules stopped the call (SPEC §2).
    GaveUp(GiveUpCause),
    /// The call's cancellation token fired.
    Cancelled,
    /// The classifier called the last attempt's error a success (the one given to
    /// [`crate::Endpoint::call_with`], or a [`crate::Classify`] impl: a `tonic::Status` whose
    /// code is `OK`): the call ended there and was counted as a success (breaker, counters,
    /// log), and the error, which cannot be returned as the call's value, is in
    /// [`CallError::last`].
    Succeeded,
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::GaveUp(c) => f.write_str(c.as_str()),
            Cause::Cancelled => f.write_str("cancelled"),
            Cause::Succeeded => f.write_str("succeeded"),
        }
    }
}

/// What the last attempt of a call that returned a [`CallError`] produced.
#[derive(Debug)]
pub enum Last<T, E> {
    /// A response the policy counts as a failure (a 503, say), as the upstream sent it.
    Response(T),
    /// The error the attempt returned.
    Error(E),
    /// The attempt ran out of time (per-try timeout or deadline) and was dropped.
    TimedOut,
}

/// A logical call that ended without a value to return (it failed, was cancelled, or its
/// classifier took an error for a success: [`Cause`]): why, and what the last attempt produced.
///
/// Its `Display` says both, and how the last attempt was classified (`call failed after 2
/// attempt(s): attempts_exhausted; the last attempt was answered 503`, `…; the last attempt
/// timed out`); an error the last attempt returned is its [`std::error::Error::source`].
pub struct CallError<T, E> {
    /// Why the call stopped.
    pub cause: Cause,
    /// The last attempt's result; `None` when no attempt was made (circuit open) or the call
    /// was cancelled before the first attempt ended.
    pub last: Option<Last<T, E>>,
    /// Attempts made.
    pub attempts: u32,
    /// How the last attempt was classified, for `Display` (the answer's status or code, or the
    /// transport error's class); `None` for an error the classifier called fatal.
    pub(crate) class: Option<LastClass>,
}

/// How a failed call's last attempt was classified: what its `Display` says of it. Kept apart
/// from the engine's [`Outcome`] (which carries the parsed Retry-After) to keep the call's
/// error small.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LastClass {
    /// An HTTP status.
    Http(u16),
    /// A gRPC code.
    Grpc(GrpcCode),
    /// A transport failure.
    Transport(ErrorClass),
}

impl LastClass {
    /// The class of an attempt's outcome.
    pub(crate) fn of(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Http { status, .. } => LastClass::Http(*status),
            Outcome::Grpc { code, .. } => LastClass::Grpc(*code),
            Outcome::Transport(class) => LastClass::Transport(*class),
        }
    }
}

impl<T, E> CallError<T, E> {
    /// A call error of `cause` after `attempts` attempts, the last of which produced `last`
    /// (for a caller's own test doubles; the agent's carry how the last attempt was
    /// classified too, which its `Display` says).
    pub fn new(cause: Cause, last: Option<Last<T, E>>, attempts: u32) -> Self {
        Self {
            cause,
            last,
            attempts,
            class: None,
        }
    }

    /// The SPEC §2 give-up cause; `None` when the call was cancelled, or ended on an error its
    /// classifier called a success ([`Cause::Succeeded`]).
    pub fn gave_up(&self) -> Option<GiveUpCause> {
        match self.cause {
            Cause::GaveUp(c) => Some(c),
            Cause::Cancelled | Cause::Succeeded => None,
        }
    }

    /// The last response, if the last attempt produced one.
    pub fn response(&self) -> Option<&T> {
        match &self.last {
            Some(Last::Response(t)) => Some(t),
            _ => None,
        }
    }

    /// The last error, if the last attempt returned one.
    pub fn error(&self) -> Option<&E> {
        match &self.last {
            Some(Last::Error(e)) => Some(e),
            _ => None,
        }
    }

    /// The last attempt's result, owned ([`CallError::last`]).
    pub fn into_last(self) -> Option<Last<T, E>> {
        self.last
    }

    /// The last response, owned, if the last attempt produced one: a `503` to hand on to your
    /// own caller as it came.
    pub fn into_response(self) -> Option<T> {
        match self.last {
            Some(Last::Response(t)) => Some(t),
            _ => None,
        }
    }

    /// The last error, owned, if the last attempt returned one.
    pub fn into_error(self) -> Option<E> {
        match self.last {
            Some(Last::Error(e)) => Some(e),
            _ => None,
        }
    }
}

/// The metadata (and, through the tower layer, the response header) that says why a gRPC call
/// gave up: its [`Cause`].
pub(crate) const GAVE_UP_KEY: &str = "retryplane-gave-up";
/// The metadata (and header) that says after how many attempts.
pub(crate) const ATTEMPTS_KEY: &str = "retryplane-attempts";

impl Cause {
    /// The code a gRPC client reports for a call that ended this way with no status of the
    /// upstream's to hand on (`timed_out`: its last attempt ran out of time).
    pub(crate) fn grpc_code(self, timed_out: bool) -> tonic::Code {
        match self {
            _ if timed_out => tonic::Code::DeadlineExceeded,
            Cause::GaveUp(GiveUpCause::DeadlineExceeded) => tonic::Code::DeadlineExceeded,
            Cause::GaveUp(GiveUpCause::CircuitOpen) => tonic::Code::Unavailable,
            Cause::Cancelled => tonic::Code::Cancelled,
            _ => tonic::Code::Unknown,
        }
    }
}

/// A gRPC call's error as a `tonic::Status` for a handler to answer its own caller with, with
/// `?`. Its code is the upstream's when the last attempt returned a status (`UNKNOWN` for an
/// `OK` the classifier took for a failure or a success; `DEADLINE_EXCEEDED` for tonic's own
/// request timeout, which it reports as `CANCELLED`, as the tower layer answers it); else the
/// code a gRPC client reports for how the call ended (`DEADLINE_EXCEEDED` when time ran out,
/// `UNAVAILABLE` when the circuit is open, `CANCELLED` for a cancelled call, `UNKNOWN`
/// otherwise). Its message is the upstream's, or this error's `Display`.
///
/// The upstream's metadata is not handed on: its `grpc-retry-pushback-ms` speaks of the
/// upstream, not of this service. A call that gave up says so instead, so that the caller's
/// own retry policy does not multiply the attempts already made: `grpc-retry-pushback-ms: -1`
/// (gRPC's "do not retry"), with `retryplane-gave-up` (the cause) and `retryplane-attempts`,
/// as the tower layer's answers carry. A cancelled call carries the last two only. The
/// upstream's error details go with its metadata. To hand on the upstream's status as it came
/// instead, take it with [`CallError::into_error`]. A proxy between this service and its
/// caller that does not read gRPC's pushback does not hold its own retries back for it.
impl<T> From<CallError<T, tonic::Status>> for tonic::Status {
    fn from(e: CallError<T, tonic::Status>) -> Self {
        let (cause, attempts) = (e.cause, e.attempts);
        let timed_out = matches!(e.last, Some(Last::TimedOut));
        let message = e.to_string();
        let mut status = match e.last {
            Some(Last::Error(upstream)) => {
                let code = match upstream.code() {
                    tonic::Code::Ok => tonic::Code::Unknown,
                    tonic::Code::Cancelled
                        if cause != Cause::Cancelled
                            && crate::classify::tonic_timeout_in_chain(&upstream) =>
                    {
                        tonic::Code::DeadlineExceeded
                    }
                    code => code,
                };
                tonic::Status::new(code, upstream.message())
            }
            _ => tonic::Status::new(cause.grpc_code(timed_out), message),
        };
        mark_gave_up(status.metadata_mut(), cause, attempts);
        status
    }
}

/// Writes into a status's metadata why a call ended after `attempts` attempts, as an answer
/// the tower layer gave up on says it: `grpc-retry-pushback-ms: -1` for a call that gave up
/// (whoever the status is handed on to does not retry what was retried already), and
/// `retryplane-gave-up` and `retryplane-attempts` for any call that did not succeed.
pub(crate) fn mark_gave_up(
    metadata: &mut tonic::metadata::MetadataMap,
    cause: Cause,
    attempts: u32,
) {
    if let Cause::GaveUp(_) = cause {
        metadata.insert(
            crate::classify::GRPC_PUSHBACK_KEY,
            tonic::metadata::MetadataValue::from_static("-1"),
        );
    }
    if cause != Cause::Succeeded {
        if let Ok(why) = cause.to_string().parse() {
            metadata.insert(GAVE_UP_KEY, why);
        }
        metadata.insert(ATTEMPTS_KEY, attempts.into());
    }
}

// Bodies and headers stay out of Debug: only the shape of `last` is shown.
impl<T, E> fmt::Debug for CallError<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let last = match &self.last {
            None => "none",
            Some(Last::Response(_)) => "response",
            Some(Last::Error(_)) => "error",
            Some(Last::TimedOut) => "timed out",
        };
        f.debug_struct("CallError")
            .field("cause", &self.cause)
            .field("last", &last)
            .field("attempts", &self.attempts)
            .finish()
    }
}

impl<T, E> fmt::Display for CallError<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.cause == Cause::Succeeded {
            return write!(
                f,
                "call succeeded after {} attempt(s): the classifier took the last attempt's \
                 error for a success",
                self.attempts
            );
        }
        write!(
            f,
            "call failed after {} attempt(s): {}",
            self.attempts, self.cause
        )?;
        // Which of a timeout, an answer or a transport error the last attempt came to: the
        // cause alone (`attempts_exhausted`) reads the same for an upstream that answers 503
        // and one that never answers. No body or header: only the class.
        // A call cancelled during an attempt holds the one before's ending.
        let which = match self.cause {
            Cause::Cancelled => "the last attempt to end",
            Cause::GaveUp(_) | Cause::Succeeded => "the last attempt",
        };
        match (&self.last, self.class) {
            (None, _) => Ok(()),
            (Some(Last::TimedOut), _) => write!(f, "; {which} timed out"),
            (Some(_), Some(LastClass::Http(status))) => {
                write!(f, "; {which} was answered {status}")
            }
            // Not "answered": a gRPC client gives codes of its own (tonic's request timeout
            // is `CANCELLED`, a broken connection `UNAVAILABLE`).
            (Some(_), Some(LastClass::Grpc(code))) => {
                write!(f, "; {which} ended with {}", code.name())
            }
            (Some(_), Some(LastClass::Transport(class))) => {
                write!(f, "; {which} failed ({})", class.as_str())
            }
            (Some(_), None) => write!(f, "; {which} failed"),
        }
    }
}

impl<T, E: std::error::Error + 'static> std::error::Error for CallError<T, E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error().map(|e| e as _)
    }
}

impl<T, E: Into<crate::layer::BoxError>> CallError<T, E> {
    /// This error with the last attempt's error boxed in a [`BoxedError`], which is a
    /// `std::error::Error` whatever `E` was: a call whose attempts return a
    /// `Box<dyn Error + Send + Sync>` (which is no `std::error::Error` itself) gives a
    /// `CallError` that `?` takes into an `anyhow::Result` or a `Box<dyn Error + Send + Sync>`.
    ///
    /// ```
    /// # use retryplane_agent::{CallError, Cause, GiveUpCause, Last};
    /// type BoxError = Box<dyn std::error::Error + Send + Sync>;
    /// fn handler(e: CallError<(), BoxError>) -> Result<(), BoxError> {
    ///     Err(e).map_err(CallError::boxed)?
    /// }
    /// # let e = CallError::new(Cause::GaveUp(GiveUpCause::AttemptsExhausted),
    /// #     Some(Last::Error("refused".into())), 3);
    /// let error = handler(e).unwrap_err();
    /// assert!(error.to_string().starts_with("call failed after 3 attempt(s)"));
    /// assert_eq!(error.source().unwrap().to_string(), "refused");
    /// ```
    pub fn boxed(self) -> CallError<T, BoxedError> {
        CallError {
            cause: self.cause,
            last: self.last.map(|last| match last {
                Last::Response(response) => Last::Response(response),
                Last::Error(e) => Last::Error(BoxedError(e.into())),
                Last::TimedOut => Last::TimedOut,
            }),
            attempts: self.attempts,
            class: self.class,
        }
    }
}

/// A boxed error as a `std::error::Error` ([`CallError::boxed`]): its `Display` and source
/// are the boxed error's (so a chain is not told the same twice); the boxed error itself, to
/// downcast, is `.0`.
#[derive(Debug)]
pub struct BoxedError(pub crate::layer::BoxError);

impl fmt::Display for BoxedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for BoxedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(last: Option<Last<(), std::io::Error>>, class: Option<LastClass>) -> String {
        CallError {
            cause: Cause::GaveUp(GiveUpCause::NotRetryable),
            last,
            attempts: 1,
            class,
        }
        .to_string()
    }

    #[test]
    fn a_call_error_says_how_its_last_attempt_was_classified() {
        let start = "call failed after 1 attempt(s): not_retryable";
        let error = || Some(Last::Error(std::io::Error::other("refused")));
        assert_eq!(
            text(error(), Some(LastClass::Grpc(GrpcCode::Unavailable))),
            format!("{start}; the last attempt ended with UNAVAILABLE")
        );
        assert_eq!(
            text(error(), Some(LastClass::Transport(ErrorClass::Connect))),
            format!("{start}; the last attempt failed (connect)")
        );
        assert_eq!(
            text(error(), None),
            format!("{start}; the last attempt failed")
        );
        assert_eq!(
            text(Some(Last::Response(())), Some(LastClass::Http(429))),
            format!("{start}; the last attempt was answered 429")
        );
        // No attempt ended (a breaker that was open, a call cancelled during its first).
        assert_eq!(text(None, None), start);
    }

    #[test]
    fn a_grpc_call_error_becomes_the_upstreams_code_or_the_code_of_its_end_and_says_do_not_retry() {
        let of = |cause, last| -> tonic::Status {
            CallError::<(), tonic::Status>::new(cause, last, 2).into()
        };
        let meta = |status: &tonic::Status, key: &str| {
            status
                .metadata()
                .get(key)
                .map(|v| v.to_str().unwrap_or_default().to_owned())
        };
        let mut upstream = tonic::Status::unavailable("down");
        upstream
            .metadata_mut()
            .insert("grpc-retry-pushback-ms", "100".parse().unwrap());
        upstream
            .metadata_mut()
            .insert("x-upstream", "secret".parse().unwrap());
        let handed = of(
            Cause::GaveUp(GiveUpCause::AttemptsExhausted),
            Some(Last::Error(upstream)),
        );
        assert_eq!(
            (handed.code(), handed.message()),
            (tonic::Code::Unavailable, "down")
        );
        // Not the upstream's metadata: ours, which tells the caller not to retry again.
        assert_eq!(meta(&handed, "x-upstream"), None);
        assert_eq!(
            meta(&handed, "grpc-retry-pushback-ms").as_deref(),
            Some("-1")
        );
        assert_eq!(
            meta(&handed, "retryplane-gave-up").as_deref(),
            Some("attempts_exhausted")
        );
        assert_eq!(meta(&handed, "retryplane-attempts").as_deref(), Some("2"));
        let codes = [
            (
                Cause::GaveUp(GiveUpCause::AttemptsExhausted),
                Some(Last::TimedOut),
                tonic::Code::DeadlineExceeded,
            ),
            (
                Cause::GaveUp(GiveUpCause::DeadlineExceeded),
                None,
                tonic::Code::DeadlineExceeded,
            ),
            (
                Cause::GaveUp(GiveUpCause::CircuitOpen),
                None,
                tonic::Code::Unavailable,
            ),
            (Cause::Cancelled, None, tonic::Code::Cancelled),
            (
                Cause::GaveUp(GiveUpCause::AttemptsExhausted),
                Some(Last::Response(())),
                tonic::Code::Unknown,
            ),
            // An `OK` taken for a failure is no `OK` to answer with.
            (
                Cause::GaveUp(GiveUpCause::NotRetryable),
                Some(Last::Error(tonic::Status::ok(""))),
                tonic::Code::Unknown,
            ),
            // tonic's own request timeout (`CANCELLED` from the client): time ran out.
            (
                Cause::GaveUp(GiveUpCause::NotRetryable),
                Some(Last::Error(tonic::Status::from_error(Box::new(
                    tonic::TimeoutExpired(()),
                )))),
                tonic::Code::DeadlineExceeded,
            ),
            // A call this service cancelled stays cancelled, whatever ended its last attempt.
            (
                Cause::Cancelled,
                Some(Last::Error(tonic::Status::from_error(Box::new(
                    tonic::TimeoutExpired(()),
                )))),
                tonic::Code::Cancelled,
            ),
        ];
        for (cause, last, code) in codes {
            let upstreams = matches!(last, Some(Last::Error(_)));
            let status = of(cause, last);
            assert_eq!(status.code(), code, "{cause}");
            if !upstreams {
                assert!(
                    status
                        .message()
                        .starts_with("call failed after 2 attempt(s): "),
                    "{status:?}"
                );
            }
        }
        // Cancelled: said, but no word against retrying (the caller's own doing).
        let cancelled = of(Cause::Cancelled, None);
        assert_eq!(meta(&cancelled, "grpc-retry-pushback-ms"), None);
        assert_eq!(
            meta(&cancelled, "retryplane-gave-up").as_deref(),
            Some("cancelled")
        );
        // A success the classifier called so: nothing of a give-up.
        let succeeded = of(
            Cause::Succeeded,
            Some(Last::Error(tonic::Status::not_found("none"))),
        );
        assert_eq!(succeeded.code(), tonic::Code::NotFound);
        assert!(succeeded.metadata().is_empty(), "{succeeded:?}");
    }

    #[test]
    fn the_last_result_can_be_taken_whole() {
        let answered = CallError::<u16, std::io::Error>::new(
            Cause::GaveUp(GiveUpCause::AttemptsExhausted),
            Some(Last::Response(503)),
            3,
        );
        assert_eq!(answered.into_response(), Some(503));
        let failed = || {
            CallError::<u16, std::io::Error>::new(
                Cause::GaveUp(GiveUpCause::AttemptsExhausted),
                Some(Last::Error(std::io::Error::other("reset"))),
                3,
            )
        };
        assert_eq!(
            failed().into_error().map(|e| e.to_string()),
            Some("reset".to_owned())
        );
        assert_eq!(failed().into_response(), None);
        assert!(matches!(failed().into_last(), Some(Last::Error(_))));
    }
}
