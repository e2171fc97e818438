//! The answers to snapshots that wait for room on the stream.
//!
//! The agent's loop does not wait for room to answer a snapshot: it reads on (the control
//! plane's keepalives, bytes and acks must be heard while a slow uplink drains), and the
//! answers wait here until the stream takes them. Only what the control plane needs is kept:
//! the last ACK (what the agent runs: a late ACK of an earlier push tells the control plane so)
//! and, after it, a NACK of a later push (the answer to its last push). An ACK supersedes every
//! answer before it; a NACK, an earlier NACK.

use retryplane_proto::pb::{self, agent_message::Kind};

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Unsent {
    ack: Option<pb::AgentMessage>,
    nack: Option<pb::AgentMessage>,
}

impl Unsent {
    /// Whether an answer waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.ack.is_none() && self.nack.is_none()
    }

    /// Keeps `answer` (an `Ack` or a `Nack`), dropping what it supersedes.
    pub(crate) fn push(&mut self, answer: pb::AgentMessage) {
        if matches!(answer.kind, Some(Kind::Ack(_))) {
            self.ack = Some(answer);
            self.nack = None;
        } else {
            self.nack = Some(answer);
        }
    }

    /// The next answer to send: the ACK first.
    pub(crate) fn pop(&mut self) -> Option<pb::AgentMessage> {
        self.ack.take().or_else(|| self.nack.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(version: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            kind: Some(Kind::Ack(pb::Ack {
                version,
                nonce: format!("n-{version}"),
            })),
        }
    }

    fn nack(version: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            kind: Some(Kind::Nack(pb::Nack {
                version,
                nonce: format!("n-{version}"),
                error: "refused".into(),
            })),
        }
    }

    fn drain(unsent: &mut Unsent) -> Vec<pb::AgentMessage> {
        std::iter::from_fn(|| unsent.pop()).collect()
    }

    #[test]
    fn a_nack_keeps_the_ack_before_it_which_goes_first() {
        let mut u = Unsent::default();
        assert!(u.is_empty());
        u.push(ack(16));
        u.push(ack(17));
        u.push(nack(18));
        assert!(!u.is_empty());
        assert_eq!(drain(&mut u), [ack(17), nack(18)]);
        assert!(u.is_empty());
    }

    #[test]
    fn an_ack_supersedes_everything_and_a_nack_an_earlier_nack() {
        let mut u = Unsent::default();
        u.push(ack(1));
        u.push(nack(2));
        u.push(ack(3));
        assert_eq!(drain(&mut u), [ack(3)]);
        u.push(nack(4));
        u.push(nack(5));
        assert_eq!(drain(&mut u), [nack(5)]);
    }
}
