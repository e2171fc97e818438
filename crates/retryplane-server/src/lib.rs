//! The retryplane control plane (`retryplane serve`, SPEC §3).
//!
//! A versioned snapshot store plus thin gRPC and HTTP layers: the [`store`] decides
//! versions and keeps every one of them in an embedded database, and [`store_check`] checks it
//! while the control plane runs; [`control`] is the one path by
//! which policies change (validate, safety checks, store, publish); the [`agent_stream`] service
//! only fans the current snapshot out to connected agents, records their ACKs and NACKs and
//! acknowledges their numbered metrics reports, counting each once ([`report_seq`]); its route,
//! [`agent_route`], sends each version's one shared [`frame_body`] frame to every stream; the
//! [`fleet`] lists who is connected and what each runs, and counts the agents on each version
//! ([`running`]); the [`admin`] service validates, applies, diffs and rolls back; [`http`]
//! serves health and Prometheus metrics; [`aggregate`] sums the agents' metric reports into
//! windows and alerts, split by the versions the most agents run; [`server`] wires listeners,
//! auth, the file watcher and shutdown.

#![forbid(unsafe_code)]

/// This build's version: the crate's (`0.1.0`), the commit it was built from (12 hex digits,
/// or `unknown` outside a git checkout) and that commit's date, as `retryplane --version`,
/// the start-up log and `retryplane_server_build_info` give them.
pub const BUILD: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("RETRYPLANE_COMMIT"),
    ", ",
    env!("RETRYPLANE_COMMIT_DATE"),
    ")"
);

/// The commit this build was built from (see [`BUILD`]).
pub const COMMIT: &str = env!("RETRYPLANE_COMMIT");

pub mod admin;
pub mod agent_route;
pub mod agent_stream;
pub mod aggregate;
pub mod auth;
mod conn_idle;
pub mod control;
pub mod decode_turns;
pub mod fleet;
pub mod frame_body;
pub mod http;
mod idle;
pub mod inbound;
pub mod metrics;
pub mod oversized;
pub mod places;
mod preface;
pub mod publisher;
pub mod report_seq;
pub mod running;
pub mod server;
pub mod store;
pub mod store_check;
pub mod text_format;
mod turns;
pub mod watch;
mod writers;

#[cfg(test)]
mod test_disk;
#[cfg(test)]
mod test_logs;

/// Refuses `path` if it is a FIFO or a socket, before it is opened: opening a FIFO waits for a
/// writer, for good, and the task or thread that opened it (the watcher, start-up, the loop
/// that waits for signals) with it. `what` names the file in the error ("the policy file",
/// "the tokens file"), `instead` says what to do ("save the policies in a regular file").
pub(crate) fn refuse_fifo_or_socket(
    path: &std::path::Path,
    what: &str,
    instead: &str,
) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt as _;
        let kind = std::fs::metadata(path)?.file_type();
        if kind.is_fifo() || kind.is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{what} is a FIFO or a socket, not a file; {instead}"),
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = (path, what, instead);
    Ok(())
}

/// An error and every cause under it, `error: cause: cause`, as `anyhow` prints `{:#}`: what
/// log lines show of an error whose own message is only a summary (a store failure's cause is
/// the disk's error). A cause whose text the error above it already ends with is not repeated
/// (hyper's connect error wraps another that says the same: "tcp connect error: tcp connect
/// error: Connection refused").
#[derive(Clone, Copy, Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut above = self.0.to_string();
        f.write_str(&above)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            let text = e.to_string();
            if !above.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            above = text;
            cause = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod error_chain_tests {
    use super::ErrorChain;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    fn chain(layers: &[&'static str]) -> Layer {
        layers
            .iter()
            .rev()
            .fold(None, |below, text| Some(Layer(text, below.map(Box::new))))
            .unwrap()
    }

    #[test]
    fn a_cause_is_not_repeated_when_the_error_above_already_says_it() {
        let e = chain(&[
            "transport error",
            "tcp connect error",
            "tcp connect error",
            "Connection refused (os error 111)",
        ]);
        assert_eq!(
            ErrorChain(&e).to_string(),
            "transport error: tcp connect error: Connection refused (os error 111)"
        );
        let e = chain(&["cannot read a: No such file", "No such file"]);
        assert_eq!(ErrorChain(&e).to_string(), "cannot read a: No such file");
        let e = chain(&["store failed", "I/O error", "disk full"]);
        assert_eq!(
            ErrorChain(&e).to_string(),
            "store failed: I/O error: disk full"
        );
    }
}

#[cfg(test)]
mod build_tests {
    /// Built from a git checkout, the commit is 12 hex digits and its date is a date; from
    /// anything else, both are `unknown`.
    #[test]
    fn the_build_names_its_commit_and_date() {
        let date = env!("RETRYPLANE_COMMIT_DATE");
        if super::COMMIT == "unknown" {
            assert_eq!(date, "unknown");
            return;
        }
        // 12 from git; a packager may give the whole hash.
        assert!(
            super::COMMIT.len() >= 7 && super::COMMIT.bytes().all(|b| b.is_ascii_hexdigit()),
            "{}",
            super::COMMIT
        );
        assert!(date.len() == 10 && date.as_bytes()[4] == b'-', "{date}");
        assert!(super::BUILD.starts_with(env!("CARGO_PKG_VERSION")));
        assert!(super::BUILD.contains(super::COMMIT));
    }
}
