//! The `retryplane.v1.AgentService` route, served without tonic's generated server.
//!
//! tonic's generated `AgentServiceServer` encodes each outbound message into a per-stream
//! buffer; this route exists so that every stream sends the publisher's one shared frame
//! instead (see [`crate::frame_body`] for the measured cost that removes), and reads its
//! inbound messages with [`crate::inbound::Messages`] rather than tonic's decoder, which
//! reserved each message's announced length and kept that buffer for the stream's life (see
//! that module for the limits and statuses). Everything else is what the generated server
//! does: `Connect` is [`AgentStreamService::connect`] unchanged, a refusal before the stream
//! starts is a trailers-only response, another method is `UNIMPLEMENTED`, and a compressed
//! request is refused as tonic refuses it (no compression is enabled). The route implements
//! [`NamedService`], so the server's router, the auth interceptor, health and reflection treat
//! it as they treat a generated service.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use retryplane_proto::liveness::{HEARTBEAT_METADATA, Life};
use retryplane_proto::pb;
use tonic::body::Body;
use tonic::metadata::GRPC_CONTENT_TYPE;
use tonic::server::NamedService;
use tonic::{Request, Status};

use crate::agent_stream::AgentStreamService;
use crate::auth::{Credential, TokenName};
use crate::frame_body::SharedFrameBody;
use crate::inbound::{Messages, Room};

/// The gRPC path of `Connect`.
pub const CONNECT_PATH: &str = "/retryplane.v1.AgentService/Connect";

/// The agent service as a `tower::Service` over HTTP requests.
#[derive(Clone, Debug)]
pub struct AgentRoute {
    service: AgentStreamService,
    max_decoding_message_size: usize,
    /// Where every stream's messages under way are charged.
    room: Arc<Room>,
}

impl AgentRoute {
    /// Serves `service`, refusing inbound messages larger than `max_decoding_message_size`
    /// bytes (as `max_decoding_message_size` does on a generated server) or than
    /// [`MAX_AGENT_MESSAGE_BYTES`](retryplane_proto::MAX_AGENT_MESSAGE_BYTES), and a first
    /// message over [`MAX_HELLO_MESSAGE_BYTES`](crate::inbound::MAX_HELLO_MESSAGE_BYTES), each
    /// at its header; a message under way holds its bytes only with room among the service's
    /// [`StreamLimits::max_inbound_bytes`](crate::agent_stream::StreamLimits) (see [`Room`]).
    pub fn new(service: AgentStreamService, max_decoding_message_size: usize) -> Self {
        let limit = max_decoding_message_size.min(retryplane_proto::MAX_AGENT_MESSAGE_BYTES);
        let (limits, counts) = service.inbound_limits();
        let room = Room::new(limits.max_inbound_bytes, limit, counts.clone());
        Self {
            service,
            max_decoding_message_size: limit,
            room: Arc::new(room),
        }
    }
}

impl NamedService for AgentRoute {
    const NAME: &'static str = pb::agent_service_server::SERVICE_NAME;
}

/// Refuses a request whose messages are compressed: none of tonic's compression features is
/// built in, and tonic's own server answers such a request the same way.
fn check_encoding<B>(request: &http::Request<B>) -> Result<(), Status> {
    match request.headers().get("grpc-encoding") {
        None => Ok(()),
        Some(value) if value.as_bytes() == b"identity" => Ok(()),
        Some(value) => {
            let name = String::from_utf8_lossy(value.as_bytes());
            let mut status = Status::unimplemented(format!(
                "Content is compressed with `{name}` which isn't supported"
            ));
            status.metadata_mut().insert(
                "grpc-accept-encoding",
                tonic::metadata::MetadataValue::from_static("identity"),
            );
            Err(status)
        }
    }
}

impl<B> tonic::codegen::Service<http::Request<B>> for AgentRoute
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != CONNECT_PATH {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let service = self.service.clone();
        let limit = self.max_decoding_message_size;
        let room = self.room.clone();
        let interval = http::HeaderValue::from(service.metrics_interval_ms());
        Box::pin(async move {
            if let Err(status) = check_encoding(&request) {
                return Ok(status.into_http());
            }
            // The agent's bytes and messages, as heard (for an agent that sends heartbeats).
            let life = Life::new(tokio::time::Instant::now());
            let token = request
                .extensions()
                .get::<Credential>()
                .map(Credential::digest);
            let name = request.extensions().get::<TokenName>().map(|t| t.0.clone());
            let charger = room.for_stream(token, name);
            let mut request =
                request.map(|body| Messages::new(life.watch(body), limit).charging(charger));
            request.extensions_mut().insert(life);
            let request = Request::from_http(request);
            Ok(match service.connect(request).await {
                Ok(frames) => {
                    // Whole: the agent counts the data bytes of its connection as they come, so a
                    // large snapshot on a slow link shows it alive without smaller pieces
                    // (which cost every push a write per piece; see
                    // `retryplane_proto::liveness`).
                    let mut response = http::Response::new(Body::new(SharedFrameBody::new(frames)));
                    let headers = response.headers_mut();
                    headers.insert(CONTENT_TYPE, GRPC_CONTENT_TYPE);
                    // Every numbered metrics report on this stream is answered.
                    headers.insert(
                        retryplane_proto::METRICS_ACK_METADATA,
                        http::HeaderValue::from_static("1"),
                    );
                    // So an agent that is sent no snapshot reports at this interval too.
                    headers.insert(retryplane_proto::METRICS_INTERVAL_METADATA, interval);
                    // Keepalives are sent, and silence ends the stream, for an agent whose
                    // Hello asks (`retryplane_proto::liveness`).
                    headers.insert(HEARTBEAT_METADATA, http::HeaderValue::from_static("1"));
                    response
                }
                Err(status) => status.into_http(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::time::Duration;

    use http_body::Frame;
    use http_body_util::{BodyExt as _, StreamBody};
    use prost::Message as _;
    use retryplane_proto::pb::agent_message::Kind;
    use tokio::sync::{mpsc, watch};
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::Code;
    use tonic::codegen::Service as _;

    use super::*;
    use crate::agent_stream::{StreamContext, StreamLimits};
    use crate::aggregate::Aggregator;
    use crate::fleet::Fleet;
    use crate::frame_body::{HEADER_LEN, encode_frame};
    use crate::metrics::ServerMetrics;
    use crate::publisher::Publisher;
    use crate::store::VersionRecord;

    type Inbound = StreamBody<ReceiverStream<Result<Frame<Bytes>, Infallible>>>;

    fn route() -> (AgentRoute, Arc<Publisher>, watch::Sender<bool>) {
        let publisher = Arc::new(Publisher::new(10_000));
        let (shutdown, shutdown_rx) = watch::channel(false);
        let fleet = Arc::new(Fleet::new(100));
        let aggregates = Aggregator::new(100, tokio::time::Instant::now(), fleet.running());
        let ctx = StreamContext {
            publisher: publisher.clone(),
            fleet,
            metrics: Arc::new(ServerMetrics::new()),
            aggregates: Arc::new(aggregates),
            limits: StreamLimits::default(),
            shutdown: shutdown_rx,
            tokens: None,
            after_register: None,
        };
        let route = AgentRoute::new(AgentStreamService::new(Arc::new(ctx)), 1 << 20);
        (route, publisher, shutdown)
    }

    fn publish(publisher: &Publisher, version: u64) {
        let document = pb::PolicyDocument {
            defaults: None,
            endpoints: vec![pb::Endpoint {
                name: "payments".to_owned(),
                ..Default::default()
            }],
        };
        publisher.publish(&VersionRecord::of_version(version, document));
    }

    /// A Connect request whose inbound stream stays open while the returned sender lives.
    fn connect(
        path: &str,
        agent_id: &str,
    ) -> (
        http::Request<Inbound>,
        mpsc::Sender<Result<Frame<Bytes>, Infallible>>,
    ) {
        let (tx, rx) = mpsc::channel(4);
        let hello = pb::AgentMessage {
            kind: Some(Kind::Hello(pb::Hello {
                agent_id: agent_id.to_owned(),
                service: "checkout".to_owned(),
                ..Default::default()
            })),
        };
        tx.try_send(Ok(Frame::data(encode_frame(&hello).unwrap())))
            .unwrap();
        let request = http::Request::builder()
            .method("POST")
            .uri(path)
            .header(CONTENT_TYPE, "application/grpc")
            .body(StreamBody::new(ReceiverStream::new(rx)))
            .unwrap();
        (request, tx)
    }

    async fn next_data(body: &mut Body) -> Bytes {
        let frame = body.frame().await.unwrap().unwrap();
        frame.into_data().unwrap()
    }

    /// The status the stream ends with: its next frame, trailers.
    async fn final_status(body: &mut Body) -> Status {
        let frame = body.frame().await.unwrap().unwrap();
        Status::from_header_map(&frame.into_trailers().unwrap()).unwrap()
    }

    #[tokio::test]
    async fn every_stream_sends_the_one_frame_the_publisher_built() {
        let (mut route, publisher, _shutdown) = route();
        publish(&publisher, 1);
        let (first, _keep_first) = connect(CONNECT_PATH, "a-1");
        let (second, _keep_second) = connect(CONNECT_PATH, "a-2");
        let first = route.call(first).await.unwrap();
        let second = route.call(second).await.unwrap();
        assert_eq!(first.headers()[CONTENT_TYPE], "application/grpc");
        assert_eq!(first.headers()[retryplane_proto::METRICS_ACK_METADATA], "1");
        let (mut first, mut second) = (first.into_body(), second.into_body());
        let shared = publisher.current().unwrap().frame().unwrap();
        let (a, b) = (next_data(&mut first).await, next_data(&mut second).await);
        assert_eq!(a.as_ptr(), b.as_ptr(), "two streams, two allocations");
        assert_eq!(a.as_ptr(), shared.as_ptr(), "the stream copied the frame");
        assert_eq!(a, shared);
        let message = pb::ServerMessage::decode(&a[HEADER_LEN..]).unwrap();
        assert_eq!(message.decode_snapshot().unwrap().unwrap().version, 1);
        // The next version too: one new allocation, shared again.
        publish(&publisher, 2);
        let (a, b) = (next_data(&mut first).await, next_data(&mut second).await);
        assert_eq!(a.as_ptr(), b.as_ptr());
        assert_ne!(a.as_ptr(), shared.as_ptr());
    }

    #[tokio::test]
    async fn a_stream_ended_for_a_compressed_message_without_an_encoding_is_logged_at_warn() {
        let (log, guard) = crate::test_logs::capture("retryplane_server=warn");
        let (mut route, publisher, _shutdown) = route();
        publish(&publisher, 1);
        let (request, inbound) = connect(CONNECT_PATH, "a-1");
        let mut body = route.call(request).await.unwrap().into_body();
        next_data(&mut body).await;
        // Compressed-flag 1 on a stream that names no grpc-encoding: the agent's fault, kept
        // INTERNAL as gRPC's compression spec requires.
        let flagged = Bytes::from_static(&[1, 0, 0, 0, 3, 1, 2, 3]);
        inbound.send(Ok(Frame::data(flagged))).await.unwrap();
        let status = final_status(&mut body).await;
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        drop(guard);
        let logged = log.text();
        assert!(
            logged.contains("ending an agent stream") && logged.contains("compressed-flag 1"),
            "{logged}"
        );
    }

    #[tokio::test]
    async fn a_message_of_a_kind_this_server_does_not_know_is_skipped() {
        let (mut route, publisher, _shutdown) = route();
        publish(&publisher, 1);
        let (request, inbound) = connect(CONNECT_PATH, "a-1");
        let mut body = route.call(request).await.unwrap().into_body();
        next_data(&mut body).await;
        // `AgentMessage` with a field 5 (a kind added after this server), length 0.
        let unknown = Bytes::from_static(&[0, 0, 0, 0, 2, 0x2a, 0x00]);
        inbound.send(Ok(Frame::data(unknown))).await.unwrap();
        // The stream still reads what follows: a second Hello is refused as such.
        let hello = pb::AgentMessage {
            kind: Some(Kind::Hello(pb::Hello {
                agent_id: "a-1".to_owned(),
                ..Default::default()
            })),
        };
        let hello = encode_frame(&hello).unwrap();
        inbound.send(Ok(Frame::data(hello))).await.unwrap();
        let status = final_status(&mut body).await;
        assert_eq!(
            (status.code(), status.message()),
            (Code::InvalidArgument, "Hello may only be the first message")
        );
    }

    #[tokio::test]
    async fn shutdown_ends_the_stream_with_unavailable_trailers() {
        let (mut route, publisher, shutdown) = route();
        publish(&publisher, 1);
        let (request, _keep) = connect(CONNECT_PATH, "a-1");
        let mut body = route.call(request).await.unwrap().into_body();
        next_data(&mut body).await;
        shutdown.send_replace(true);
        let status = final_status(&mut body).await;
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(status.message(), "control plane shutting down; reconnect");
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn shutdown_ends_a_stream_whose_peer_stopped_reading() {
        let (mut route, publisher, shutdown) = route();
        publish(&publisher, 1);
        let (request, _keep) = connect(CONNECT_PATH, "a-1");
        // The body is not read: the peer has stopped reading.
        let response = route.call(request).await.unwrap();
        tokio::task::yield_now().await;
        assert_eq!(publisher.subscribers(), 1, "the stream's task runs");
        for version in 2..=5 {
            publish(&publisher, version);
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
        }
        shutdown.send_replace(true);
        tokio::time::timeout(Duration::from_secs(5), async {
            while publisher.subscribers() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the stream's task ends although nobody reads its body");
        // Read now, the body holds what was queued, then the closing status.
        let mut body = response.into_body();
        let trailers = loop {
            let frame = body.frame().await.unwrap().unwrap();
            match frame.into_data() {
                Ok(data) => {
                    let message = pb::ServerMessage::decode(&data[HEADER_LEN..]).unwrap();
                    assert!(message.decode_snapshot().unwrap().is_some());
                }
                Err(frame) => break frame.into_trailers().unwrap(),
            }
        };
        let status = Status::from_header_map(&trailers).unwrap();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }

    #[tokio::test]
    async fn a_refusal_before_the_stream_starts_is_a_trailers_only_response() {
        let (mut route, publisher, _shutdown) = route();
        publish(&publisher, 1);
        let (request, _keep) = connect(CONNECT_PATH, "");
        let response = route.call(request).await.unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert_eq!(status.message(), "Hello.agent_id is empty");
        assert!(response.into_body().frame().await.is_none());
    }

    /// A first message larger than any Hello is refused at its header, before its bytes are
    /// kept; a later message is refused at the route's limit, and the stream ends with it.
    #[tokio::test]
    async fn a_first_message_over_a_hellos_size_is_refused_at_its_header() {
        let (mut route, publisher, _shutdown) = route();
        publish(&publisher, 1);
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
        let mut big = vec![0];
        big.extend_from_slice(&(100u32 * 1024).to_be_bytes());
        tx.try_send(Ok(Frame::data(Bytes::from(big)))).unwrap();
        let request = http::Request::builder()
            .method("POST")
            .uri(CONNECT_PATH)
            .header(CONTENT_TYPE, "application/grpc")
            .body(StreamBody::new(ReceiverStream::new(rx)))
            .unwrap();
        let response = route.call(request).await.unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status
                .message()
                .contains("the first message (the Hello) of 102400 bytes"),
            "{status:?}"
        );
        // After the Hello, the route's limit (1 MiB here).
        let (request, inbound) = connect(CONNECT_PATH, "a-1");
        let mut body = route.call(request).await.unwrap().into_body();
        next_data(&mut body).await;
        let mut big = vec![0];
        big.extend_from_slice(&((1u32 << 20) + 1).to_be_bytes());
        inbound
            .send(Ok(Frame::data(Bytes::from(big))))
            .await
            .unwrap();
        let status = final_status(&mut body).await;
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert_eq!(
            status.message(),
            "a message of 1048577 bytes is over the 1048576 bytes this control plane takes"
        );
    }

    #[tokio::test]
    async fn another_method_is_unimplemented() {
        let (mut route, _publisher, _shutdown) = route();
        let (request, _keep) = connect("/retryplane.v1.AgentService/Other", "a-1");
        let response = route.call(request).await.unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::Unimplemented);
    }

    #[tokio::test]
    async fn a_compressed_request_is_refused() {
        let (mut route, publisher, _shutdown) = route();
        publish(&publisher, 1);
        let (mut request, _keep) = connect(CONNECT_PATH, "a-1");
        request
            .headers_mut()
            .insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
        let response = route.call(request).await.unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
        assert!(status.message().contains("gzip"), "{status:?}");
    }

    #[test]
    fn the_route_has_the_generated_service_name_and_path() {
        assert_eq!(AgentRoute::NAME, "retryplane.v1.AgentService");
        assert_eq!(CONNECT_PATH, format!("/{}/Connect", AgentRoute::NAME));
    }
}
