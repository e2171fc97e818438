//! Retry policies as plain data, and the decisions they make.
//!
//! This crate is the pure core of retryplane: it parses and validates policy files (SPEC §1),
//! resolves the effective policy of a call (defaults → endpoint → route), and implements the retry
//! semantics of SPEC §2 — backoff with jitter, `Retry-After` and gRPC pushback, the retry budget,
//! the circuit breaker and the per-call decision engine. It does no I/O and owns no runtime: time
//! comes in as values (`tokio::time::Instant`), randomness through an injected [`rng::Rng`], so
//! the control plane, the agent and the CLI all run the same code and tests are deterministic.

#![forbid(unsafe_code)]

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod codes;
pub mod diag;
pub mod diff;
pub mod document;
pub mod duration;
pub mod engine;
mod line;
pub mod model;
pub mod parse;
pub mod render;
pub mod retry_after;
pub mod rng;
pub mod set;
pub mod uri_path;
pub mod validate;
mod window;
pub mod yaml;
mod yaml_scan;

pub use diag::{Diagnostic, Severity};
pub use document::{PolicyDocument, Target};
pub use model::*;
pub use set::{EndpointPolicy, InvalidPolicy, Loaded, PolicySet, load, load_all, too_large};
