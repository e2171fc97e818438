//! [`RetryLayer`] and the [`Retry`] service it wraps around a client.

use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::{Layer, Service, ServiceExt as _};

use super::body::{Buffered, ReplayBody, buffer};
use super::{BoxError, DEFAULT_BODY_LIMIT, GaveUp, ResponseFuture, RetryError};
use crate::call::Endpoint;
use crate::classify::{Classify as _, classify_boxed};
use crate::error::{CallError, Last};
use crate::meta::CallMeta;

/// Wraps a `Service<http::Request<B>>` in [`Retry`]. Defaults: bodies up to
/// [`DEFAULT_BODY_LIMIT`] are buffered for replay.
#[derive(Clone, Debug)]
pub struct RetryLayer {
    endpoint: Endpoint,
    body_limit: usize,
}

impl RetryLayer {
    /// Every request through the layer is a logical call of `endpoint`.
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            body_limit: DEFAULT_BODY_LIMIT,
        }
    }

    /// The largest request body kept for replay; larger ones are sent once, never retried.
    pub fn with_body_limit(mut self, limit: usize) -> Self {
        self.body_limit = limit;
        self
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry {
            inner,
            endpoint: self.endpoint.clone(),
            body_limit: self.body_limit,
        }
    }
}

/// A client whose requests run under the endpoint's retry policy (see [`super`]).
#[derive(Clone, Debug)]
pub struct Retry<S> {
    inner: S,
    endpoint: Endpoint,
    body_limit: usize,
}

impl<S, B, RB> Service<Request<B>> for Retry<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Send + 'static,
{
    type Response = Response<RB>;
    type Error = BoxError;
    type Future = ResponseFuture<Response<RB>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let endpoint = self.endpoint.clone();
        let limit = self.body_limit;
        ResponseFuture::new(Box::pin(run(inner, endpoint, limit, request)))
    }
}

/// A request's head, copied for each attempt.
struct Head {
    method: http::Method,
    uri: http::Uri,
    version: http::Version,
    headers: http::HeaderMap,
    extensions: http::Extensions,
}

impl Head {
    fn request<B>(&self, body: B) -> Request<B> {
        let mut r = Request::new(body);
        *r.method_mut() = self.method.clone();
        *r.uri_mut() = self.uri.clone();
        *r.version_mut() = self.version;
        *r.headers_mut() = self.headers.clone();
        *r.extensions_mut() = self.extensions.clone();
        r
    }
}

async fn run<S, B, RB>(
    inner: S,
    endpoint: Endpoint,
    limit: usize,
    request: Request<B>,
) -> Result<Response<RB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<RB>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let head = Head {
        method: parts.method,
        uri: parts.uri,
        version: parts.version,
        headers: parts.headers,
        extensions: parts.extensions,
    };
    let meta = CallMeta::http(head.method.as_str(), head.uri.path());
    let classify = |r: &Result<Response<RB>, BoxError>| match r {
        Ok(response) => response.classify(),
        Err(e) => classify_boxed(&**e),
    };
    let result = match buffer(body, limit).await.map_err(Into::into)? {
        Buffered::Replayable(data, trailers) => {
            let meta = meta.with_headers(&head.headers);
            let (head, data, trailers) = (&head, &data, &trailers);
            // `inner` moves in: the closure must not share `S` across threads.
            let attempt = move |_| {
                let request = head.request(ReplayBody::buffered(data.clone(), trailers.clone()));
                let svc = inner.clone();
                async move { svc.oneshot(request).await.map_err(Into::into) }
            };
            endpoint.call_with(meta, classify, attempt).await
        }
        Buffered::Once(body) => {
            // Not idempotent and without the key: never retried.
            let meta = meta.idempotent(false);
            let mut body = Some(body);
            let head = &head;
            let attempt = move |_| {
                let request = body.take().map(|b| head.request(b));
                let svc = inner.clone();
                async move {
                    match request {
                        Some(r) => svc.oneshot(r).await.map_err(Into::into),
                        None => Err(BoxError::from("a streamed body cannot be sent twice")),
                    }
                }
            };
            endpoint.call_with(meta, classify, attempt).await
        }
    };
    result.or_else(gave_up)
}

/// The response or error a call that gave up returns.
fn gave_up<RB>(e: CallError<Response<RB>, BoxError>) -> Result<Response<RB>, BoxError> {
    let CallError {
        cause,
        last,
        attempts,
    } = e;
    match last {
        Some(Last::Response(mut response)) => {
            response.extensions_mut().insert(GaveUp { cause, attempts });
            Ok(response)
        }
        Some(Last::Error(e)) => Err(e),
        Some(Last::TimedOut) => Err(RetryError::TimedOut { cause, attempts }.into()),
        None => Err(RetryError::NoAnswer { cause }.into()),
    }
}
