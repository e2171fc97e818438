//! gRPC through the layer: describing a request ([`call_meta`]), declaring it idempotent
//! ([`Idempotent`]) and wrapping a tonic `Channel` ([`into_tonic_request`]).

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request};
use http_body::Body;
use std::time::Duration;
use tokio::time::Instant;

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

/// A request extension that gives the caller's own deadline, counted from when the layer's
/// future first runs: the call (every attempt, pause and retry, and the read of the request
/// body) ends by the earlier of it and the policy's `deadline`, and gives up with
/// `deadline_exceeded` when it passes, as [`CallMeta::deadline_within`] does for
/// [`Endpoint::call`](crate::Endpoint::call). A gRPC request's `grpc-timeout` is one too: with
/// both, the earlier counts, each attempt's `grpc-timeout` says what is left of it, and the
/// answer's body ends by it. On an HTTP request it bounds the call until the answer's head, as
/// the policy's deadline does, and no header says it. A service that serves HTTP hands its own
/// caller's deadline on with it. A request that carries one is not de-duplicated.
///
/// ```
/// use std::time::Duration;
/// use retryplane_agent::layer::Within;
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Within(Duration::from_millis(800)));
/// ```
///
/// A [`CancellationToken`](crate::CancellationToken) in the request's extensions cancels the
/// call during an attempt, a pause or the wait before a retry, as [`CallMeta::with_cancel`]
/// does (not while the request body is still read, nor while the first attempt waits for the
/// service below to be ready: the call's deadline bounds those). A cancelled gRPC call is
/// `CANCELLED`; a cancelled HTTP call returns the last answer, marked
/// [`GaveUp`](super::GaveUp) `cancelled`, or [`RetryError::NoAnswer`](super::RetryError). A
/// request that carries one is not de-duplicated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Within(pub Duration);

/// Whether `parts` is a gRPC request (`content-type: application/grpc…`).
pub(crate) fn is_grpc(parts: &Parts) -> bool {
    parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The caller's deadline a gRPC request carries in its `grpc-timeout` header, if it carries a
/// valid one: 1 to 8 ASCII digits and a unit, `H`, `M`, `S`, `m`, `u` or `n` (gRPC over
/// HTTP/2). Read here because tonic keeps its own parser private; an invalid value is left for
/// the server to refuse, and the policy's deadline alone applies.
pub(crate) fn grpc_timeout(parts: &Parts) -> Option<Duration> {
    let value = parts.headers.get("grpc-timeout")?.as_bytes();
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // At most 99,999,999: hours of it fit a `u64` of seconds.
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b"H" => Duration::from_secs(n * 3600),
        b"M" => Duration::from_secs(n * 60),
        b"S" => Duration::from_secs(n),
        b"m" => Duration::from_millis(n),
        b"u" => Duration::from_micros(n),
        b"n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Sets a gRPC request's `grpc-timeout` to what is left, at `now`, of the caller's `deadline`
/// (from the `grpc-timeout` the caller set): each attempt tells the upstream how long the
/// caller still waits, as gRPC clients do on their retries (gRFC A6), rather than the budget
/// the caller started with.
pub(crate) fn set_grpc_timeout(headers: &mut HeaderMap, deadline: Instant, now: Instant) {
    let left = deadline.saturating_duration_since(now);
    headers.insert("grpc-timeout", encode_grpc_timeout(left));
}

/// `left` as a `grpc-timeout` value: at most 8 digits, in the finest unit they can hold, rounded
/// down (the upstream must not think it has more time than the caller), and at least `1n`
/// (the protocol's values are positive). Written here because tonic keeps its encoder private.
fn encode_grpc_timeout(left: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let nanos = left.as_nanos().max(1);
    let units: [(u128, &str); 6] = [
        (1, "n"),
        (1_000, "u"),
        (1_000_000, "m"),
        (1_000_000_000, "S"),
        (60_000_000_000, "M"),
        (3_600_000_000_000, "H"),
    ];
    let (value, unit) = units
        .iter()
        .map(|&(per, unit)| (nanos / per, unit))
        .find(|&(value, _)| value <= MAX)
        .unwrap_or((MAX, "H"));
    HeaderValue::from_maybe_shared(Bytes::from(format!("{value}{unit}")))
        .unwrap_or_else(|_| HeaderValue::from_static("99999999H"))
}

/// How the layer describes a request whose path is `path` (borrowed from a copy of its URI,
/// since the head moves on): a gRPC request as [`CallMeta::grpc`] (its routes are
/// `/pkg.Service/Method`), anything else by its method as sent (`CallMeta::http_as_sent`); an [`Idempotent`] extension
/// overrides the idempotency either gives; the caller's deadline is the earlier of a gRPC
/// request's `grpc-timeout` and a [`Within`] extension, and a `CancellationToken` extension
/// cancels the call. Header names are not recorded here.
pub(crate) fn call_meta<'a>(parts: &Parts, path: &'a str) -> CallMeta<'a> {
    let grpc = is_grpc(parts);
    let mut meta = if grpc {
        CallMeta::grpc(path)
    } else {
        CallMeta::http_as_sent(&parts.method, path)
    };
    // The caller's deadline bounds the whole call, retries and pauses included (gRFC A6):
    // below the layer, tonic enforces a `grpc-timeout` on each attempt only.
    let grpc_within = if grpc { grpc_timeout(parts) } else { None };
    let within = match (grpc_within, parts.extensions.get::<Within>()) {
        (Some(a), Some(Within(b))) => Some(a.min(*b)),
        (a, b) => a.or(b.map(|Within(b)| *b)),
    };
    if let Some(within) = within {
        meta = meta.deadline_within(within);
    }
    if let Some(token) = parts.extensions.get::<crate::CancellationToken>() {
        meta = meta.with_cancel(token.clone());
    }
    match parts.extensions.get::<Idempotent>() {
        Some(Idempotent(declared)) => meta.idempotent(*declared),
        None => meta,
    }
}

/// Turns a request the layer sends into the request a tonic `Channel` takes
/// (`http::Request<tonic::body::Body>`): the body is boxed. Put it between the layer and the
/// channel with `map_request`, and hand the stack to a generated client (any client
/// `tonic-prost-build` generates; here the standard health service's, from the `tonic-health`
/// crate):
///
/// ```no_run
/// # async fn f(agent: retryplane_agent::Agent) -> Result<(), Box<dyn std::error::Error>> {
/// use retryplane_agent::layer::{Idempotent, RetryLayer, into_tonic_request};
/// use tonic::transport::Channel;
/// use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
///
/// let channel = Channel::from_static("http://127.0.0.1:50051").connect().await?;
/// let service = tower::ServiceBuilder::new()
///     .layer(RetryLayer::new(agent.endpoint("inventory")))
///     .map_request(into_tonic_request)
///     .service(channel);
/// let mut client = HealthClient::new(service);
///
/// // `Check` is a read: declared idempotent, it is retried on UNAVAILABLE.
/// let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
/// request.extensions_mut().insert(Idempotent(true));
/// let response = client.check(request).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(timeout: &str) -> Parts {
        let (parts, ()) = http::Request::builder()
            .header("content-type", "application/grpc")
            .header("grpc-timeout", timeout)
            .body(())
            .unwrap()
            .into_parts();
        parts
    }

    #[test]
    fn grpc_timeout_reads_every_unit_and_refuses_what_the_protocol_does_not_allow() {
        let read = |t: &str| grpc_timeout(&parts(t));
        assert_eq!(read("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(read("3M"), Some(Duration::from_secs(180)));
        assert_eq!(read("4S"), Some(Duration::from_secs(4)));
        assert_eq!(read("150m"), Some(Duration::from_millis(150)));
        assert_eq!(read("7u"), Some(Duration::from_micros(7)));
        assert_eq!(read("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(
            read("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        for bad in [
            "",
            "m",
            "100",
            "123456789m",
            "-1m",
            "1.5S",
            "10x",
            "10 m",
            "1mm",
        ] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
        let (no_header, ()) = http::Request::new(()).into_parts();
        assert_eq!(grpc_timeout(&no_header), None);
    }

    #[test]
    fn an_attempts_grpc_timeout_is_what_is_left_rounded_down_in_the_finest_unit_that_fits() {
        let encode = |d: Duration| encode_grpc_timeout(d).to_str().unwrap().to_owned();
        assert_eq!(encode(Duration::ZERO), "1n");
        assert_eq!(encode(Duration::from_nanos(99_999_999)), "99999999n");
        assert_eq!(encode(Duration::from_nanos(100_000_001)), "100000u");
        assert_eq!(encode(Duration::from_millis(1_500)), "1500000u");
        assert_eq!(encode(Duration::from_secs(15)), "15000000u");
        assert_eq!(encode(Duration::from_micros(123_456_789)), "123456m");
        assert_eq!(encode(Duration::from_secs(100_000_000)), "1666666M");
        assert_eq!(encode(Duration::from_secs(100_000_000 * 3600)), "99999999H");
        assert_eq!(encode(Duration::MAX), "99999999H");
        // Whatever it writes, the layer's own reader gives back at most what was left.
        for left in [
            Duration::from_nanos(1),
            Duration::from_millis(150),
            Duration::from_secs(7),
            Duration::from_secs(86_400),
        ] {
            let read = grpc_timeout(&parts(&encode(left))).unwrap();
            assert!(
                read <= left && left - read < left / 100_000 + Duration::from_nanos(1),
                "{left:?} {read:?}"
            );
        }

        let now = Instant::now();
        let mut headers = HeaderMap::new();
        headers.insert("grpc-timeout", HeaderValue::from_static("2S"));
        set_grpc_timeout(&mut headers, now + Duration::from_millis(250), now);
        assert_eq!(headers["grpc-timeout"], "250000u");
        assert_eq!(headers.get_all("grpc-timeout").iter().count(), 1);
        set_grpc_timeout(&mut headers, now, now + Duration::from_secs(1));
        assert_eq!(headers["grpc-timeout"], "1n");
    }
}
