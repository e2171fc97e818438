//! The `retryplane.v1` wire contract (SPEC §3).
//!
//! The generated protobuf and gRPC code is private to this crate and re-exported as [`pb`];
//! [`convert`] turns policy messages into [`retryplane_policy::PolicyDocument`]s and back, and
//! runs the same validator as `retryplane validate`, so a document is checked the same way
//! whether it came from a file, the admin API or the agent stream. [`rank`] is the order of
//! ranked `Stats` series, shared by the control plane and the CLI. [`liveness`] is the stream's
//! end-to-end heartbeat rule, kept by both sides.

#![forbid(unsafe_code)]

mod frame;
mod hello;

pub use frame::{MAX_NONCE_LEN, TooLargeForAgents, check_agent_limit};
pub use hello::{BadHello, MAX_HELLO_FIELD_BYTES, MAX_HELLO_LABELS, check_hello};

pub mod convert;
pub mod liveness;
pub mod rank;
pub mod unknown_fields;
pub mod wire_items;

mod generated {
    #![allow(missing_docs, clippy::all, clippy::pedantic, rust_2018_idioms)]
    tonic::include_proto!("retryplane.v1");
}

/// Generated messages, clients and servers of `retryplane.v1`.
pub mod pb {
    pub use super::frame::ServerMessage;
    pub use super::generated::*;
}

/// Whether `secret` holds only what gRPC metadata carries in a value (its spec's `ASCII-Value`:
/// printable ASCII and the space): a token's secret, in the tokens file and in what an agent or
/// the CLI sends as `authorization: Bearer <secret>`. gRPC clients refuse to send anything else.
pub fn is_metadata_text(secret: &str) -> bool {
    secret.chars().all(|c| matches!(c, ' '..='~'))
}

/// The encoded `FileDescriptorSet` of `retryplane.v1`, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/retryplane_v1_descriptor.bin"));

/// Response metadata of `AgentService.Connect` by which the control plane says it answers every
/// numbered metrics report with a `MetricsAck` (value `1`). An agent numbers its reports, keeps
/// them until acknowledged and sends them again on its next stream only when the stream's
/// response carries it; from a control plane that does not send it (one that predates
/// `MetricsAck`), the agent sends its reports unnumbered, so nothing waits for an answer that
/// never comes and nothing is counted twice.
pub const METRICS_ACK_METADATA: &str = "retryplane-metrics-ack";

/// Response metadata of `AgentService.Connect` carrying the control plane's metrics interval,
/// in milliseconds (the `Snapshot.metrics_interval_ms` its snapshots carry). An agent that is
/// up to date when it connects is sent no snapshot, so without this it would go on reporting
/// at the interval of its cache file or of an earlier control plane, possibly faster than this
/// one's report rate limit. An agent takes it as a snapshot's; a control plane that predates
/// it sends none, and the agent keeps the interval it has.
pub const METRICS_INTERVAL_METADATA: &str = "retryplane-metrics-interval-ms";

/// Response metadata of `AdminService.Get` (value `1`) when the version store failed and the
/// version served was answered from the control plane's memory: the store needs attention, and
/// other versions cannot be read until it is mended.
pub const FROM_MEMORY_METADATA: &str = "retryplane-from-memory";

/// The largest `retryplane.v1` message either side decodes: 4 MiB, gRPC's usual default. An
/// agent refuses a `ServerMessage` longer than this, so the control plane refuses a change whose
/// snapshot message could be longer ([`check_agent_limit`]), `retryplane validate` reports such a
/// file, and the control plane decodes requests up to this size unless configured otherwise.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The longest service or endpoint name the control plane keeps a metrics series for, in
/// bytes; it counts a longer one in its `other` series. An agent reports the counts of an
/// endpoint whose name is longer under a cut of it ([`reported_name`]), so that no name makes
/// a report larger than the control plane takes.
pub const MAX_SERIES_NAME_BYTES: usize = 256;

/// The name an agent reports an endpoint's counts under: `name` itself when it is at most
/// [`MAX_SERIES_NAME_BYTES`] long, else its shortest start, cut at a character boundary, that
/// is longer than that (at most 4 bytes more), so that the control plane still counts it in
/// `other`. Endpoints whose long names start alike share one entry (their counts go to the
/// same series either way).
pub fn reported_name(name: &str) -> &str {
    if name.len() <= MAX_SERIES_NAME_BYTES {
        return name;
    }
    let mut end = MAX_SERIES_NAME_BYTES + 1;
    while !name.is_char_boundary(end) {
        end += 1;
    }
    &name[..end]
}

/// The largest `AgentMessage` the control plane takes on an agent stream: an agent's largest
/// metrics report (a quarter of [`MAX_MESSAGE_BYTES`]; counts past it go out as several
/// reports) and 64 KiB for its envelope. The control plane keeps a message's bytes as they
/// come, so this bounds what one stream's message under way can make it hold.
pub const MAX_AGENT_MESSAGE_BYTES: usize = MAX_MESSAGE_BYTES / 4 + 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_name_is_reported_cut_yet_still_over_the_series_limit() {
        assert_eq!(reported_name("payments"), "payments");
        let exact = "a".repeat(MAX_SERIES_NAME_BYTES);
        assert_eq!(reported_name(&exact), exact);
        let long = "b".repeat(2 << 20);
        assert_eq!(reported_name(&long).len(), MAX_SERIES_NAME_BYTES + 1);
        // 3-byte characters: the cut ends at the first boundary past the limit.
        let wide = "€".repeat(200);
        let cut = reported_name(&wide);
        assert!(cut.len() > MAX_SERIES_NAME_BYTES && cut.len() <= MAX_SERIES_NAME_BYTES + 4);
        assert!(wide.starts_with(cut));
    }
}
