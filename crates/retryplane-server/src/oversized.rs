//! The admin service's answer to a request message over the size limit: `RESOURCE_EXHAUSTED`,
//! as the agent service answers (and gRPC's own servers do), not the `OUT_OF_RANGE` tonic's
//! generated server gives it, so that a client sees one code for one fault on either listener.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::server::NamedService;

/// The start of the message tonic (0.14, `codec/decode.rs`) gives a message over its limit, as
/// `grpc-message` carries it (percent-encoded: tonic encodes spaces); tonic gives no other way
/// to tell it from a handler's own `OUT_OF_RANGE`. The test
/// `an_oversized_admin_message_is_resource_exhausted` fails if it changes.
const TOO_LARGE: &[u8] = b"Error,%20decoded%20message%20length%20too%20large";

/// `S` (a generated gRPC server), with a message over its decoding limit answered
/// `RESOURCE_EXHAUSTED`; every other answer as `S` gives it.
#[derive(Clone, Debug)]
pub struct OversizedIsExhausted<S> {
    inner: S,
}

impl<S> OversizedIsExhausted<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S: NamedService> NamedService for OversizedIsExhausted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for OversizedIsExhausted<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let answer = self.inner.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            // An error before the handler ran comes in the head ("Trailers-Only") or, as
            // tonic's unary server sends this one, in the trailers after an empty body.
            exhausted_if_too_large(response.headers_mut());
            Ok(response.map(|body| Body::new(TrailersMapped { inner: body })))
        })
    }
}

/// Makes `RESOURCE_EXHAUSTED` of the status in `headers` (a head or trailers) if it is tonic's
/// `OUT_OF_RANGE` for a message over the limit.
fn exhausted_if_too_large(headers: &mut HeaderMap) {
    let too_large = headers.get("grpc-status").is_some_and(|s| s == "11")
        && headers
            .get("grpc-message")
            .is_some_and(|m| m.as_bytes().starts_with(TOO_LARGE));
    if too_large {
        headers.insert("grpc-status", HeaderValue::from_static("8"));
    }
}

/// A response body whose trailers go through [`exhausted_if_too_large`].
struct TrailersMapped {
    inner: Body,
}

impl http_body::Body for TrailersMapped {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.inner).poll_frame(cx).map(|frame| {
            frame.map(|frame| {
                frame.map(|mut frame| {
                    if let Some(trailers) = frame.trailers_mut() {
                        exhausted_if_too_large(trailers);
                    }
                    frame
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
