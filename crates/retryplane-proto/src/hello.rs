//! What a control plane admits in an agent's Hello: checked by the control plane when a stream
//! opens, and by the agent before it connects, so that an identity the control plane would
//! refuse on every try is refused once, at start, naming the field.

use retryplane_policy::diag::has_control;

use crate::pb;

/// The control plane's default bound on each Hello string (agent id, service, agent version,
/// last applied hash, each label key and value), in bytes.
pub const MAX_HELLO_FIELD_BYTES: usize = 256;

/// The control plane's default bound on the labels of one Hello.
pub const MAX_HELLO_LABELS: usize = 64;

/// Why a Hello is refused; the text names the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadHello(String);

/// Refuses a Hello without an agent id, with a field or label past the limits, or with a
/// control character (or a Unicode line or paragraph separator: such a name could move the
/// cursor or change colours where `retryplane status` or `stats` print it) in its agent id,
/// service, agent version, last applied hash or a label key or value.
pub fn check_hello(
    hello: &pb::Hello,
    max_field_len: usize,
    max_labels: usize,
) -> Result<(), BadHello> {
    let too_long = |s: &str| s.len() > max_field_len;
    if hello.agent_id.is_empty() {
        return Err(BadHello("Hello.agent_id is empty".to_owned()));
    }
    // The service first: the agent makes its default id from it, so a bad service is named as
    // such, not as a bad agent id.
    for (field, value) in [
        ("service", &hello.service),
        ("agent_id", &hello.agent_id),
        ("agent_version", &hello.agent_version),
        ("last_applied_hash", &hello.last_applied_hash),
    ] {
        if has_control(value) {
            return Err(BadHello(format!("Hello.{field} holds a control character")));
        }
        if too_long(value) {
            return Err(BadHello(format!(
                "Hello.{field} is {} bytes; Hello fields are limited to {max_field_len} bytes",
                value.len()
            )));
        }
    }
    if hello
        .labels
        .iter()
        .any(|(k, v)| has_control(k) || has_control(v))
    {
        return Err(BadHello(
            "Hello.labels: a label key or value holds a control character".to_owned(),
        ));
    }
    if hello.labels.len() > max_labels
        || hello.labels.iter().any(|(k, v)| too_long(k) || too_long(v))
    {
        return Err(BadHello(format!(
            "Hello carries at most {max_labels} labels of at most {max_field_len} bytes"
        )));
    }
    Ok(())
}
