//! gRPC through the layer: describing a request ([`call_meta`]), declaring it idempotent
//! ([`Idempotent`]) and wrapping a tonic `Channel` ([`into_tonic_request`]).

use bytes::Bytes;
use http::Request;
use http::request::Parts;
use http_body::Body;

use super::{BoxError, ReplayBody};
use crate::meta::CallMeta;

/// A request extension that declares the request idempotent (or not), overriding what the
/// layer would decide from the method: the same as [`CallMeta::idempotent`] for
/// [`Endpoint::call`](crate::Endpoint::call).
///
/// gRPC calls are never idempotent by default (SPEC §2: the caller declares it), so a gRPC call
/// through the layer is retried on a failure with an answer (`UNAVAILABLE`, say) only when it
/// carries `Idempotent(true)` or the policy's idempotency key header. With a tonic client, set
/// it on the `tonic::Request`: tonic hands its extensions to the HTTP request.
///
/// ```
/// use retryplane_agent::layer::Idempotent;
///
/// let mut request = tonic::Request::new(());
/// request.extensions_mut().insert(Idempotent(true));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Idempotent(pub bool);

/// Whether `parts` is a gRPC request (`content-type: application/grpc…`).
pub(crate) fn is_grpc(parts: &Parts) -> bool {
    parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// How the layer describes a request whose path is `path` (borrowed from a copy of its URI,
/// since the head moves on): a gRPC request as [`CallMeta::grpc`] (its routes are
/// `/pkg.Service/Method`), anything else as [`CallMeta::http`]; an [`Idempotent`] extension
/// overrides the idempotency either gives. Header names are not recorded here.
pub(crate) fn call_meta<'a>(parts: &Parts, path: &'a str) -> CallMeta<'a> {
    let meta = if is_grpc(parts) {
        CallMeta::grpc(path)
    } else {
        CallMeta::http(parts.method.as_str(), path)
    };
    match parts.extensions.get::<Idempotent>() {
        Some(Idempotent(declared)) => meta.idempotent(*declared),
        None => meta,
    }
}

/// Turns a request the layer sends into the request a tonic `Channel` takes
/// (`http::Request<tonic::body::Body>`): the body is boxed. Put it between the layer and the
/// channel with `map_request`, and hand the stack to a generated client:
///
/// ```no_run
/// # async fn f(agent: retryplane_agent::Agent) -> Result<(), Box<dyn std::error::Error>> {
/// use retryplane_agent::layer::{Idempotent, RetryLayer, into_tonic_request};
/// use retryplane_proto::pb::{GetRequest, admin_service_client::AdminServiceClient};
/// use tonic::transport::Channel;
///
/// let channel = Channel::from_static("http://127.0.0.1:50051").connect().await?;
/// let service = tower::ServiceBuilder::new()
///     .layer(RetryLayer::new(agent.endpoint("control-plane")))
///     .map_request(into_tonic_request)
///     .service(channel);
/// let mut client = AdminServiceClient::new(service);
///
/// // `Get` is a read: declared idempotent, it is retried on UNAVAILABLE.
/// let mut request = tonic::Request::new(GetRequest { version: 0 });
/// request.extensions_mut().insert(Idempotent(true));
/// let response = client.get(request).await?;
/// # let _ = response;
/// # Ok(())
/// # }
/// ```
///
/// The layer buffers a request body (up to its limit) before the first send: use it for
/// unary calls. A streaming request is sent only once its stream ends or passes the limit, so
/// a bidirectional stream that waits for an answer before it sends more never starts.
pub fn into_tonic_request<B>(request: Request<ReplayBody<B>>) -> Request<tonic::body::Body>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    request.map(tonic::body::Body::new)
}
