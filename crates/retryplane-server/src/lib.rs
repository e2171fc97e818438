//! The retryplane control plane (`retryplane serve`, SPEC §3).
//!
//! A versioned snapshot store plus thin gRPC and HTTP layers (STYLE.md #9): the [`store`] decides
//! versions and keeps every one of them in an embedded database; [`control`] is the one path by
//! which policies change (validate, safety checks, store, publish); the [`agent_stream`] service
//! only fans the current snapshot out to connected agents, records their ACKs and NACKs and
//! acknowledges their numbered metrics reports, counting each once ([`report_seq`]); its route,
//! [`agent_route`], sends each version's one shared [`frame_body`] frame to every stream; the
//! [`admin`] service validates, applies, diffs and rolls back; [`http`] serves health and
//! Prometheus metrics; [`aggregate`] sums the agents' metric reports into windows and alerts;
//! [`server`] wires listeners, auth, the file watcher and shutdown.

#![forbid(unsafe_code)]

pub mod admin;
pub mod agent_route;
pub mod agent_stream;
pub mod aggregate;
pub mod auth;
pub mod control;
pub mod fleet;
pub mod frame_body;
pub mod http;
pub mod metrics;
pub mod publisher;
pub mod report_seq;
pub mod server;
pub mod store;
pub mod text_format;
pub mod watch;

#[cfg(test)]
mod test_logs;

/// An error and every cause under it, `error: cause: cause`, as `anyhow` prints `{:#}`: what
/// log lines show of an error whose own message is only a summary (a store failure's cause is
/// the disk's error).
#[derive(Clone, Copy, Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}
