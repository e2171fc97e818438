//! Server→agent messages as pre-framed gRPC bytes, shared by every stream (a snapshot), or
//! framed for one stream (a metrics ack: [`encode_frame`] too, a few bytes).
//!
//! Why this is hand-written: tonic's response encoder (`tonic::codec::EncodeBody`) writes every
//! message of every stream into that stream's own `BytesMut`. For the agent stream that means a
//! copy of the same snapshot per agent, and the per-stream buffer keeps the copy's allocation
//! alive until the stream's next message (BENCHMARKS.md, "Control plane fan-out": about one
//! snapshot plus 9 KiB of server memory per agent). tonic 0.14 offers no seam that takes a
//! shared [`Bytes`] as a message (an `Encoder` only ever writes into tonic's buffer), so this
//! module replaces the encoder for that one reason: the publisher frames each version once
//! ([`encode_frame`]: the 5-byte gRPC message header, then the encoded message) and every
//! stream's [`SharedFrameBody`] sends a clone of that [`Bytes`] — a reference count, not a copy.
//!
//! The final status is turned into trailers by `tonic::Status` (`grpc-status`, and
//! `grpc-message` percent-encoded as the gRPC HTTP/2 protocol asks); the inbound direction is
//! read by [`crate::inbound::Messages`].

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{BufMut as _, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use retryplane_proto::MAX_MESSAGE_BYTES;
use tokio::sync::mpsc;
use tonic::Status;

/// Bytes before each gRPC message: the compressed flag and the big-endian `u32` length.
pub const HEADER_LEN: usize = 5;

/// What a stream's task hands to its response body: a shared frame to send, or the status that
/// ends the stream.
pub type Outbound = Result<Bytes, Status>;

/// Why a message cannot be framed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FrameError {
    /// The encoded message is longer than an agent decodes
    /// ([`retryplane_proto::MAX_MESSAGE_BYTES`]): every agent would refuse it.
    #[error(
        "an encoded message of {len} bytes is longer than agents decode (at most {limit} bytes): \
         make the policies smaller (fewer endpoints or routes, shorter names)"
    )]
    OverAgentLimit {
        /// The encoded length.
        len: usize,
        /// The most an agent decodes.
        limit: usize,
    },
    /// prost could not encode the message. Its error is in the message and not given as the
    /// source too, so a report that walks the chain does not say it twice.
    #[error("cannot encode the message: {0}")]
    Encode(prost::EncodeError),
}

/// `message` as one uncompressed gRPC frame: flag `0`, the big-endian `u32` length, the
/// encoded message. Built once per published version and shared by every stream. A message
/// longer than agents decode ([`retryplane_proto::MAX_MESSAGE_BYTES`]) is not framed: an agent
/// would fail to decode it, drop the stream and reconnect to the same message.
pub fn encode_frame(message: &impl prost::Message) -> Result<Bytes, FrameError> {
    let len = message.encoded_len();
    let over = || FrameError::OverAgentLimit {
        len,
        limit: MAX_MESSAGE_BYTES,
    };
    if len > MAX_MESSAGE_BYTES {
        return Err(over());
    }
    // Within the agents' limit, the length fits the frame's `u32`.
    let wire_len = u32::try_from(len).map_err(|_| over())?;
    let mut buf = BytesMut::with_capacity(HEADER_LEN + len);
    buf.put_u8(0);
    buf.put_u32(wire_len);
    message.encode(&mut buf).map_err(FrameError::Encode)?;
    Ok(buf.freeze())
}

/// The response body of one agent stream: each frame the stream's task sends, as is, then the
/// trailers of the status the stream ends with (`OK` when the task ends without one).
#[derive(Debug)]
pub struct SharedFrameBody {
    rx: mpsc::Receiver<Outbound>,
    ended: bool,
}

impl SharedFrameBody {
    /// A body fed by `rx`.
    pub fn new(rx: mpsc::Receiver<Outbound>) -> Self {
        Self { rx, ended: false }
    }

    fn end(&mut self, status: &Status) -> Frame<Bytes> {
        self.ended = true;
        // Whatever the task sends after the final status is never sent.
        self.rx.close();
        Frame::trailers(trailers(status))
    }
}

/// The trailers that end a stream with `status`.
pub fn trailers(status: &Status) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(2);
    if status.add_header(&mut map).is_err() {
        // tonic percent-encodes the message, so this does not happen; keep at least the code.
        map.clear();
        map.insert(Status::GRPC_STATUS, HeaderValue::from(status.code() as i32));
    }
    map
}

impl http_body::Body for SharedFrameBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let frame = match ready!(this.rx.poll_recv(cx)) {
            Some(Ok(frame)) => Frame::data(frame),
            Some(Err(status)) => this.end(&status),
            None => this.end(&Status::ok("")),
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;
    use prost::Message as _;
    use retryplane_proto::pb;
    use tonic::Code;

    use super::*;

    fn message() -> pb::ServerMessage {
        pb::ServerMessage::with_snapshot(&pb::Snapshot {
            version: 3,
            content_hash: "cd".repeat(32),
            nonce: "n-3".into(),
            ..Default::default()
        })
    }

    #[test]
    fn a_frame_is_flag_zero_big_endian_length_and_the_message() {
        let message = message();
        let frame = encode_frame(&message).unwrap();
        let body = message.encode_to_vec();
        assert_eq!(frame.len(), HEADER_LEN + body.len());
        assert_eq!(frame[0], 0, "compressed flag");
        let len = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]);
        assert_eq!(usize::try_from(len).unwrap(), body.len());
        assert_eq!(&frame[HEADER_LEN..], body.as_slice());
        let back = pb::ServerMessage::decode(&frame[HEADER_LEN..]).unwrap();
        assert_eq!(back.decode_snapshot().unwrap().unwrap().version, 3);
    }

    #[test]
    fn a_length_above_255_uses_every_header_byte() {
        let big = pb::ServerMessage {
            snapshot: Some(Bytes::from(vec![7u8; 70_000])),
            ..Default::default()
        };
        let frame = encode_frame(&big).unwrap();
        let expected = u32::try_from(big.encoded_len()).unwrap().to_be_bytes();
        assert_eq!(&frame[1..HEADER_LEN], &expected);
        assert_ne!(expected[1], 0, "the test needs a length above 65,535");
    }

    #[tokio::test]
    async fn frames_pass_through_unchanged_then_the_status_becomes_trailers() {
        let (tx, rx) = mpsc::channel(4);
        let frame = encode_frame(&message()).unwrap();
        tx.send(Ok(frame.clone())).await.unwrap();
        tx.send(Err(Status::aborted("50% done; ünïcode")))
            .await
            .unwrap();
        let mut body = SharedFrameBody::new(rx);
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(data.as_ptr(), frame.as_ptr(), "the frame was copied");
        assert_eq!(data, frame);
        let trailers = body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(trailers["grpc-status"], "10");
        assert_eq!(
            trailers["grpc-message"],
            "50%25%20done;%20%C3%BCn%C3%AFcode"
        );
        let status = Status::from_header_map(&trailers).unwrap();
        assert_eq!(
            (status.code(), status.message()),
            (Code::Aborted, "50% done; ünïcode")
        );
        assert!(http_body::Body::is_end_stream(&body));
        assert!(body.frame().await.is_none());
        // The task learns that nothing more will be sent.
        assert!(tx.send(Ok(frame)).await.is_err());
    }

    #[tokio::test]
    async fn a_task_that_ends_without_a_status_ends_the_stream_with_ok() {
        let (tx, rx) = mpsc::channel(1);
        drop(tx);
        let mut body = SharedFrameBody::new(rx);
        let trailers = body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(trailers["grpc-status"], "0");
        assert!(!trailers.contains_key("grpc-message"));
        assert!(body.frame().await.is_none());
    }
}
