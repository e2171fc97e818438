//! The endpoints and routes of a policy document, counted on the encoded bytes of the message
//! that carries it (a `Validate` or `Apply` request, or a `Snapshot`) before it is decoded. A
//! document of bare endpoints takes two bytes an endpoint on the wire and about 420 once
//! decoded: a 4 MiB request decoded to about 880 MB before
//! [`check_items`](crate::convert::check_items) could refuse it. Counted here, such a request
//! has its policy cut out before the decode ([`without_source`]), and the call is refused with
//! the error `check_items` gives a decoded one; an agent's cache file that holds such a
//! snapshot is refused before its decode ([`snapshot_items_at_least`]).
//!
//! Written by hand: prost decodes whole messages only, and this reads the tags down to the
//! document, then `endpoints` → `routes`, and skips the rest, allocating nothing.

/// `source` in `ValidateRequest` and `ApplyRequest`.
const SOURCE: u32 = 1;
/// `document` in `PolicySource`.
const DOCUMENT: u32 = 2;
/// `endpoints` in `PolicyDocument`.
const ENDPOINTS: u32 = 2;
/// `routes` in `Endpoint`.
const ROUTES: u32 = 3;
/// `policies` in `Snapshot`.
const POLICIES: u32 = 3;

/// How deep groups (a wire form proto3 never writes, skipped by prost) may nest: prost's own
/// recursion limit. Deeper, the decode fails, and the count stops there.
const MAX_GROUP_DEPTH: u32 = 100;

/// The items ([`MAX_ITEMS`](crate::convert::MAX_ITEMS)'s count) of the endpoints and routes of
/// the `ValidateRequest` or `ApplyRequest` encoded in `message`: 2 for each endpoint and route
/// of every `source.document` the bytes hold, also those merged into one (a `source` written
/// twice) and those a later field replaces (a `yaml` after a `document`: the decode builds the
/// document first, and `check_items` never sees it). List entries are not counted: for a
/// request of one document, this is what `check_items` counts of its endpoints and routes,
/// never more. Bytes that do not decode are counted up to where they stop (some that prost
/// refuses, such as a scalar `source` or a varint's tenth byte over 1, are read on).
pub fn items_at_least(message: &[u8]) -> usize {
    items_under(message, &[SOURCE, DOCUMENT])
}

/// The items ([`MAX_ITEMS`](crate::convert::MAX_ITEMS)'s count) of the endpoints and routes of
/// the `Snapshot` encoded in `message` (an agent's cache file holds one), as
/// [`items_at_least`] counts them: 2 for each endpoint and route of every `policies` the bytes
/// hold, list entries not counted, bytes that do not decode counted up to where they stop.
pub fn snapshot_items_at_least(message: &[u8]) -> usize {
    items_under(message, &[POLICIES])
}

/// The items of every policy document found at `path` (field numbers of length-delimited
/// fields, one for each level, the last one the document's) in `message`.
fn items_under(message: &[u8], path: &[u32]) -> usize {
    let Some((&first, rest)) = path.split_first() else {
        return document_items(message);
    };
    let mut items = 0usize;
    for (number, value) in Fields::new(message) {
        if let (true, Value::Len(inner)) = (number == first, value) {
            items = items.saturating_add(items_under(inner, rest));
        }
    }
    items
}

/// 2 for each endpoint and route of the encoded `PolicyDocument` in `document`.
fn document_items(document: &[u8]) -> usize {
    let mut items = 0usize;
    for (number, value) in Fields::new(document) {
        let (ENDPOINTS, Value::Len(endpoint)) = (number, value) else {
            continue;
        };
        items = items.saturating_add(2);
        for (number, value) in Fields::new(endpoint) {
            if let (ROUTES, Value::Len(_)) = (number, value) {
                items = items.saturating_add(2);
            }
        }
    }
    items
}

/// `message` without its `source` fields, the rest as it was (a request's other fields, and
/// bytes past where it stops decoding, which fail the decode as before): what is decoded of a
/// request refused for its size.
pub fn without_source(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let mut fields = Fields::new(message);
    loop {
        let start = message.len() - fields.rest.len();
        let Some((number, _)) = fields.next() else {
            break;
        };
        let end = message.len() - fields.rest.len();
        if number != SOURCE {
            out.extend_from_slice(&message[start..end]);
        }
    }
    out.extend_from_slice(fields.rest);
    out
}

/// A field's value, as far as the count needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    /// Length-delimited: a message, a string, bytes or a packed list.
    Len(&'a [u8]),
    /// A varint, a fixed-size value or a group (skipped).
    Other,
}

/// The fields of one encoded message, in order, until its end or bytes that do not decode
/// (left in `rest`).
pub(crate) struct Fields<'a> {
    pub(crate) rest: &'a [u8],
}

impl<'a> Fields<'a> {
    pub(crate) fn new(message: &'a [u8]) -> Self {
        Self { rest: message }
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = (u32, Value<'a>);

    /// The next field, or `None` at the end or at bytes that do not decode (then `rest` is
    /// left where that field began).
    fn next(&mut self) -> Option<Self::Item> {
        let mut buf = self.rest;
        let (number, wire_type) = tag(&mut buf)?;
        let value = value(&mut buf, number, wire_type, 1)?;
        self.rest = buf;
        Some((number, value))
    }
}

/// The value of a field (`number`, `wire_type`) at the start of `buf`, which is moved past it;
/// a group, skipped, is `depth` groups deep. `None` for bytes that do not decode.
fn value<'a>(buf: &mut &'a [u8], number: u32, wire_type: u8, depth: u32) -> Option<Value<'a>> {
    match wire_type {
        2 => {
            let len = usize::try_from(varint(buf)?).ok()?;
            let (value, rest) = buf.split_at_checked(len)?;
            *buf = rest;
            Some(Value::Len(value))
        }
        3 => {
            skip_group(buf, number, depth)?;
            Some(Value::Other)
        }
        _ => {
            skip_scalar(buf, wire_type)?;
            Some(Value::Other)
        }
    }
}

/// A field's tag: its number (1 or more, as prost takes them) and wire type.
fn tag(buf: &mut &[u8]) -> Option<(u32, u8)> {
    let key = varint(buf)?;
    let key = u32::try_from(key).ok()?;
    let number = key >> 3;
    let wire_type = u8::try_from(key & 7).ok()?;
    (number > 0).then_some((number, wire_type))
}

/// A varint of at most ten bytes.
fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&byte, rest) = buf.split_first()?;
        *buf = rest;
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// Skips a varint (0), fixed64 (1) or fixed32 (5) value; `None` for any other wire type.
fn skip_scalar(buf: &mut &[u8], wire_type: u8) -> Option<()> {
    match wire_type {
        0 => varint(buf).map(drop),
        1 => {
            *buf = buf.get(8..)?;
            Some(())
        }
        5 => {
            *buf = buf.get(4..)?;
            Some(())
        }
        _ => None,
    }
}

/// Skips a group's fields through its end tag (`number`, wire type 4), `depth` groups deep.
fn skip_group(buf: &mut &[u8], number: u32, depth: u32) -> Option<()> {
    if depth > MAX_GROUP_DEPTH {
        return None;
    }
    loop {
        let (inner, wire_type) = tag(buf)?;
        if wire_type == 4 {
            return (inner == number).then_some(());
        }
        value(buf, inner, wire_type, depth + 1)?;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use proptest::prelude::*;
    use prost::Message as _;

    use super::*;
    use crate::pb;

    /// A document of `endpoints` endpoints of `routes` routes each.
    fn document(endpoints: usize, routes: usize) -> pb::PolicyDocument {
        pb::PolicyDocument {
            defaults: None,
            endpoints: (0..endpoints)
                .map(|i| pb::Endpoint {
                    name: format!("e{i}"),
                    overlay: None,
                    routes: vec![pb::Route::default(); routes],
                })
                .collect(),
        }
    }

    fn apply(document: pb::PolicyDocument) -> pb::ApplyRequest {
        pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Document(document)),
                origin: "f.yaml".to_owned(),
            }),
            expected_version: Some(7),
            dry_run: true,
            force: true,
        }
    }

    #[test]
    fn counts_two_items_for_each_endpoint_and_route_of_a_plain_request() {
        let request = apply(document(3, 2)).encode_to_vec();
        assert_eq!(items_at_least(&request), 18);
        let validate = pb::ValidateRequest {
            source: apply(document(5, 0)).source,
        };
        assert_eq!(items_at_least(&validate.encode_to_vec()), 10);
        let yaml = pb::ValidateRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Yaml("endpoints: {}".to_owned())),
                origin: String::new(),
            }),
        };
        assert_eq!(items_at_least(&yaml.encode_to_vec()), 0);
    }

    /// An unknown field of every wire type, a group among them, before and inside the
    /// document: skipped, and the endpoints after them counted (an unknown group once made an
    /// earlier try count nothing).
    #[test]
    fn unknown_fields_and_groups_are_skipped_not_the_end() {
        let mut doc = Vec::new();
        // Field 9: a varint, a fixed64, a fixed32, a group holding a group, then bytes.
        doc.extend_from_slice(&[9 << 3, 0x96, 0x01]);
        doc.extend_from_slice(&[(9 << 3) | 1, 1, 2, 3, 4, 5, 6, 7, 8]);
        doc.extend_from_slice(&[(9 << 3) | 5, 1, 2, 3, 4]);
        doc.extend_from_slice(&[(9 << 3) | 3, (10 << 3) | 3, (10 << 3) | 4, (9 << 3) | 4]);
        doc.extend_from_slice(&[(9 << 3) | 2, 2, 0xff, 0xff]);
        document(4, 1).encode(&mut doc).unwrap();
        let mut source = vec![(12 << 3) | 3, (12 << 3) | 4];
        prost::encoding::bytes::encode(2, &doc, &mut source);
        let mut request = Vec::new();
        prost::encoding::bytes::encode(1, &source, &mut request);
        // prost takes it, and finds what the count found.
        let decoded = pb::ValidateRequest::decode(request.as_slice()).unwrap();
        let Some(pb::policy_source::Kind::Document(d)) = decoded.source.unwrap().kind else {
            panic!("no document");
        };
        assert_eq!(d.endpoints.len(), 4);
        assert_eq!(items_at_least(&request), 16);
    }

    /// A second `source` field in the message merges into the first (its endpoints added):
    /// both counted, as the decode builds them. (A second gRPC message in the body is refused
    /// before the count: `DecodeTurns` in the server.)
    #[test]
    fn a_source_written_twice_counts_both() {
        let mut request = apply(document(2, 0)).encode_to_vec();
        request.extend(apply(document(3, 0)).encode_to_vec());
        let decoded = pb::ApplyRequest::decode(request.as_slice()).unwrap();
        let Some(pb::policy_source::Kind::Document(d)) = decoded.source.unwrap().kind else {
            panic!("no document");
        };
        assert_eq!(d.endpoints.len(), 5);
        assert_eq!(items_at_least(&request), 10);
    }

    #[test]
    fn without_source_keeps_the_other_fields_and_what_does_not_decode() {
        let request = apply(document(3, 1)).encode_to_vec();
        let cut = without_source(&request);
        let decoded = pb::ApplyRequest::decode(cut.as_slice()).unwrap();
        assert_eq!(
            decoded,
            pb::ApplyRequest {
                source: None,
                expected_version: Some(7),
                dry_run: true,
                force: true,
            }
        );
        // A truncated field stays, and the decode still fails on it.
        let mut broken = request.clone();
        broken.extend_from_slice(&[(3 << 3) | 2, 9, 1]);
        let cut = without_source(&broken);
        assert!(pb::ApplyRequest::decode(cut.as_slice()).is_err());
        assert_eq!(items_at_least(&cut), 0);
    }

    /// Groups 100 deep are skipped as prost skips them; 101 deep, prost refuses the message
    /// and the count stops. (Inside the document prost's depth counts the messages around the
    /// group too, so it refuses groups shallower than the count does: the count never stops
    /// where prost reads on.)
    #[test]
    fn groups_as_deep_as_prost_takes_are_skipped() {
        for (depth, counted) in [(MAX_GROUP_DEPTH, 4), (MAX_GROUP_DEPTH + 1, 0)] {
            let mut request = Vec::new();
            for _ in 0..depth {
                request.push((9 << 3) | 3);
            }
            for _ in 0..depth {
                request.push((9 << 3) | 4);
            }
            request.extend(apply(document(2, 0)).encode_to_vec());
            assert_eq!(items_at_least(&request), counted, "{depth}");
            let decoded = pb::ApplyRequest::decode(request.as_slice());
            assert_eq!(decoded.is_ok(), counted > 0, "{depth}");
        }
    }

    fn snapshot(policies: pb::PolicyDocument) -> pb::Snapshot {
        pb::Snapshot {
            version: 3,
            content_hash: "ab".repeat(32),
            policies: Some(policies),
            nonce: "n-1".to_owned(),
            metrics_interval_ms: 10_000,
        }
    }

    /// A snapshot's `policies`, also written twice (merged by the decode), counted as a
    /// request's document is; a request's count finds nothing in a snapshot's bytes, nor the
    /// other way round.
    #[test]
    fn a_snapshots_policies_are_counted_where_the_snapshot_holds_them() {
        let plain = snapshot(document(3, 2)).encode_to_vec();
        assert_eq!(snapshot_items_at_least(&plain), 18);
        let mut twice = plain.clone();
        twice.extend(snapshot(document(2, 0)).encode_to_vec());
        let decoded = pb::Snapshot::decode(twice.as_slice()).unwrap();
        assert_eq!(decoded.policies.unwrap().endpoints.len(), 5);
        assert_eq!(snapshot_items_at_least(&twice), 22);
        let request = apply(document(3, 2)).encode_to_vec();
        assert_eq!(snapshot_items_at_least(&request), 0);
        assert_eq!(items_at_least(&plain), 0);
    }

    /// The endpoints and routes of a document kept by the decode of a request (`snapshot`
    /// false) or a snapshot in `bytes`, as the count counts them; `None` when it does not
    /// decode or holds no document.
    fn held(bytes: &[u8], snapshot: bool) -> Option<usize> {
        let document = if snapshot {
            pb::Snapshot::decode(bytes).ok()?.policies?
        } else {
            match pb::ApplyRequest::decode(bytes).ok()?.source?.kind? {
                pb::policy_source::Kind::Document(d) => d,
                pb::policy_source::Kind::Yaml(_) => return None,
            }
        };
        Some(
            document
                .endpoints
                .iter()
                .map(|e| 2 + 2 * e.routes.len())
                .sum(),
        )
    }

    proptest! {
        /// Whatever the bytes (a plain request or snapshot, cut, with noise spliced in): the
        /// count is exact for the plain message, counts no byte twice (each item is at least a
        /// tag and a length: never more items than bytes), and misses nothing the decode keeps
        /// (an endpoint or route it kept but the count missed is what let an earlier try
        /// through).
        #[test]
        fn misses_nothing_the_decode_keeps(
            snapshot_bytes in any::<bool>(),
            endpoints in 0usize..6,
            routes in 0usize..3,
            cut in any::<prop::sample::Index>(),
            noise in prop::collection::vec(any::<u8>(), 0..24),
            at in any::<prop::sample::Index>(),
        ) {
            type Count = fn(&[u8]) -> usize;
            let (plain, count): (Vec<u8>, Count) = if snapshot_bytes {
                (snapshot(document(endpoints, routes)).encode_to_vec(), snapshot_items_at_least)
            } else {
                (apply(document(endpoints, routes)).encode_to_vec(), items_at_least)
            };
            prop_assert_eq!(count(&plain), 2 * endpoints * (1 + routes));
            let mut bytes = plain.clone();
            bytes.truncate(cut.index(plain.len() + 1));
            let at = at.index(bytes.len() + 1);
            bytes.splice(at..at, noise);
            let counted = count(&bytes);
            prop_assert!(counted <= bytes.len(), "{} items in {} bytes", counted, bytes.len());
            if let Some(held) = held(&bytes, snapshot_bytes) {
                prop_assert!(counted >= held, "counted {}, the decode keeps {}", counted, held);
            }
        }
    }
}
