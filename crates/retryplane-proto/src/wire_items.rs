//! How many endpoints and routes the policy document of a Validate or Apply request holds, read
//! from its encoded bytes without decoding it. prost decodes every bare endpoint (two bytes on
//! the wire) into a struct of about 420 bytes, so a 4 MiB request of them took about 880 MB
//! before [`crate::convert::check_items`] could refuse it; counting first lets the control
//! plane refuse such a request at the cost of one pass over its bytes.
//!
//! Written by hand: prost has no visitor over encoded fields, and the walk needs only the field
//! numbers and lengths (`prost::encoding` reads each varint).

use prost::encoding::decode_varint;

/// `PolicySource.yaml` and `PolicySource.document` (one `oneof`: the last one sent wins).
const SOURCE_YAML: u64 = 1;
const SOURCE_DOCUMENT: u64 = 2;
/// `ValidateRequest.source` and `ApplyRequest.source`.
const REQUEST_SOURCE: u64 = 1;
/// `PolicyDocument.endpoints`.
const DOCUMENT_ENDPOINTS: u64 = 2;
/// `Endpoint.routes`.
const ENDPOINT_ROUTES: u64 = 3;

/// The items ([`crate::convert::MAX_ITEMS`]'s count: two for each endpoint and route; list
/// entries are not counted here) of the document in `request`, the encoded bytes of a
/// `ValidateRequest` or an `ApplyRequest`, as prost would decode it: occurrences of a message
/// field merged, a `yaml` source after a document replacing it. At most what
/// [`crate::convert::check_items`] counts of the decoded document, so a request this refuses
/// that one would refuse too. `None` when the bytes are not a well-formed message (the decode
/// then says why).
pub fn request_items(request: &[u8]) -> Option<usize> {
    let mut endpoints_and_routes = 0usize;
    each_field(request, |field, value| {
        if field == REQUEST_SOURCE
            && let Value::Bytes(source) = value
        {
            each_field(source, |field, value| match (field, value) {
                (SOURCE_YAML, _) => {
                    endpoints_and_routes = 0;
                    Some(())
                }
                (SOURCE_DOCUMENT, Value::Bytes(document)) => {
                    endpoints_and_routes =
                        endpoints_and_routes.saturating_add(in_document(document)?);
                    Some(())
                }
                _ => Some(()),
            })?;
        }
        Some(())
    })?;
    Some(endpoints_and_routes.saturating_mul(2))
}

/// Endpoints and routes in an encoded `PolicyDocument`.
fn in_document(document: &[u8]) -> Option<usize> {
    let mut n = 0usize;
    each_field(document, |field, value| {
        if field == DOCUMENT_ENDPOINTS
            && let Value::Bytes(endpoint) = value
        {
            let mut routes = 0usize;
            each_field(endpoint, |field, _| {
                routes += usize::from(field == ENDPOINT_ROUTES);
                Some(())
            })?;
            n = n.saturating_add(1 + routes);
        }
        Some(())
    })?;
    Some(n)
}

/// One encoded field's value: a length-delimited one's bytes, or another wire type's.
enum Value<'a> {
    Bytes(&'a [u8]),
    Other,
}

/// Calls `f` with each field of the encoded message `buf` (its number and value), in order;
/// `None` when the bytes are malformed (a varint cut short, a length past the end, a group or
/// an unknown wire type) or `f` returns `None`.
fn each_field(mut buf: &[u8], mut f: impl FnMut(u64, Value<'_>) -> Option<()>) -> Option<()> {
    while !buf.is_empty() {
        let key = decode_varint(&mut buf).ok()?;
        let field = key >> 3;
        let value = match key & 7 {
            0 => {
                decode_varint(&mut buf).ok()?;
                Value::Other
            }
            1 => {
                buf = buf.get(8..)?;
                Value::Other
            }
            2 => {
                let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                let bytes = buf.get(..len)?;
                buf = buf.get(len..)?;
                Value::Bytes(bytes)
            }
            5 => {
                buf = buf.get(4..)?;
                Value::Other
            }
            _ => return None,
        };
        f(field, value)?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use prost::Message as _;

    use super::*;
    use crate::convert::check_items;
    use crate::pb;

    fn endpoint(routes: usize) -> pb::Endpoint {
        pb::Endpoint {
            name: "a".to_owned(),
            routes: vec![pb::Route::default(); routes],
            ..Default::default()
        }
    }

    fn apply(source: pb::policy_source::Kind) -> pb::ApplyRequest {
        pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(source),
                origin: "file.yaml".to_owned(),
            }),
            dry_run: true,
            ..Default::default()
        }
    }

    /// The count agrees with `check_items`' for documents without lists, whatever the request.
    #[test]
    fn counts_endpoints_and_routes_as_the_decoded_document_holds_them() {
        let document = pb::PolicyDocument {
            defaults: Some(pb::Overlay::default()),
            endpoints: vec![endpoint(0), endpoint(3), endpoint(1)],
        };
        let request = apply(pb::policy_source::Kind::Document(document.clone()));
        let bytes = request.encode_to_vec();
        assert_eq!(request_items(&bytes), Some(2 * (3 + 4)));
        let validate = pb::ValidateRequest {
            source: request.source.clone(),
        };
        assert_eq!(request_items(&validate.encode_to_vec()), Some(14));
        assert!(check_items(&document).is_ok());
        // YAML, or nothing: none.
        let yaml = apply(pb::policy_source::Kind::Yaml("version: 1".to_owned()));
        assert_eq!(request_items(&yaml.encode_to_vec()), Some(0));
        assert_eq!(request_items(&[]), Some(0));
    }

    /// As prost decodes: a source sent twice is merged (their documents' endpoints appended),
    /// and YAML sent after a document replaces it.
    #[test]
    fn occurrences_merge_and_a_later_yaml_source_replaces_the_document() {
        let document = |n| {
            apply(pb::policy_source::Kind::Document(pb::PolicyDocument {
                endpoints: vec![endpoint(0); n],
                ..Default::default()
            }))
        };
        let yaml = apply(pb::policy_source::Kind::Yaml("version: 1".to_owned()));
        let twice = [document(2).encode_to_vec(), document(3).encode_to_vec()].concat();
        assert_eq!(request_items(&twice), Some(10));
        let decoded = pb::ApplyRequest::decode(twice.as_slice()).unwrap();
        let Some(pb::policy_source::Kind::Document(merged)) = decoded.source.unwrap().kind else {
            panic!("a document");
        };
        assert_eq!(merged.endpoints.len(), 5);
        let then_yaml = [document(2).encode_to_vec(), yaml.encode_to_vec()].concat();
        assert_eq!(request_items(&then_yaml), Some(0));
        let decoded = pb::ApplyRequest::decode(then_yaml.as_slice()).unwrap();
        assert!(matches!(
            decoded.source.unwrap().kind,
            Some(pb::policy_source::Kind::Yaml(_))
        ));
        let then_document = [yaml.encode_to_vec(), document(2).encode_to_vec()].concat();
        assert_eq!(request_items(&then_document), Some(4));
    }

    /// Malformed bytes are not counted (the decode reports them).
    #[test]
    fn malformed_bytes_are_not_counted() {
        let bytes = apply(pb::policy_source::Kind::Document(pb::PolicyDocument {
            endpoints: vec![endpoint(1)],
            ..Default::default()
        }))
        .encode_to_vec();
        assert_eq!(request_items(&bytes[..bytes.len() - 1]), None);
        assert_eq!(
            request_items(&[0x0a, 0x05, 0x00]),
            None,
            "length past the end"
        );
        assert_eq!(request_items(&[0x0b]), None, "a group");
        assert_eq!(request_items(&[0x80]), None, "a varint cut short");
    }

    /// 100,001 bare endpoints, 200 KB on the wire: counted past the limit without decoding.
    #[test]
    fn a_request_of_bare_endpoints_is_counted_past_the_limit() {
        let request = apply(pb::policy_source::Kind::Document(pb::PolicyDocument {
            endpoints: vec![pb::Endpoint::default(); crate::convert::MAX_ITEMS / 2 + 1],
            ..Default::default()
        }));
        let bytes = request.encode_to_vec();
        assert!(bytes.len() < 300_000);
        assert_eq!(request_items(&bytes), Some(crate::convert::MAX_ITEMS + 2));
    }
}
