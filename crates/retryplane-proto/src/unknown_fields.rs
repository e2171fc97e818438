//! The fields of an encoded `retryplane.v1` message that this build does not know, found on
//! its bytes: prost skips them in silence, so a message from a newer build (a CLI, or a
//! control plane, that knows a field this one does not) would otherwise be taken without it.
//! The control plane refuses a `Validate` or `Apply` request that holds such a field (it
//! would store a policy without what its author wrote), and an agent names them when it
//! refuses a snapshot whose content hash they change.
//!
//! Written by hand over the wire format ([`crate::wire_items`]'s reader): prost keeps no
//! unknown fields, and a reflective decode (`prost-reflect`) would build the whole message
//! again, where this walk allocates nothing but what it reports. The table of known fields is
//! generated from the same `.proto` files as the code (`build.rs`).

use std::fmt;

use crate::wire_items::{Fields, Value};

/// One message type's known fields.
pub(crate) struct Schema {
    /// Its full name (`retryplane.v1.Endpoint`).
    name: &'static str,
    fields: &'static [Known],
}

/// A field the `.proto` files declare.
pub(crate) struct Known {
    number: u32,
    name: &'static str,
    /// The index in [`MESSAGES`] of its message type, for a message field.
    message: Option<usize>,
    /// A list (or map) field: its entries are shown with their index.
    repeated: bool,
}

include!(concat!(env!("OUT_DIR"), "/retryplane_v1_schema.rs"));

/// How deep the walk goes into nested messages (prost's own recursion limit).
const MAX_DEPTH: u32 = 100;

/// A field this build does not know: its number, and where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownField {
    /// The path of the message that holds it, from the top message (`source.document.endpoints[2].overlay`;
    /// empty for the top message itself).
    pub path: String,
    /// Its type (`retryplane.v1.Overlay`).
    pub message: &'static str,
    /// The field's number.
    pub number: u32,
}

impl fmt::Display for UnknownField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field {} of {}", self.number, self.message)?;
        if !self.path.is_empty() {
            write!(f, " at `{}`", self.path)?;
        }
        Ok(())
    }
}

/// The first `max` fields this build does not know in `message`, an encoded message of the
/// type `type_name` (its full name, `retryplane.v1.ApplyRequest`), in the order of the bytes.
/// Bytes past where the message stops decoding are not looked at (the decode refuses them).
/// An unknown `type_name` finds nothing.
pub fn find(type_name: &str, message: &[u8], max: usize) -> Vec<UnknownField> {
    let mut found = Vec::new();
    if let Some(top) = MESSAGES.iter().position(|m| m.name == type_name) {
        let mut path = String::new();
        walk(top, message, &mut path, &mut found, max, 0);
    }
    found
}

/// [`find`] within the message field `field` (its name) of `message` alone, an encoded
/// `type_name`: the fields this build does not know of what that field holds, their paths
/// starting with its name. Nothing when `type_name` has no such message field.
pub fn find_in(type_name: &str, field: &str, message: &[u8], max: usize) -> Vec<UnknownField> {
    let mut found = Vec::new();
    let Some(schema) = MESSAGES.iter().find(|m| m.name == type_name) else {
        return found;
    };
    let Some((number, Some(inner))) = schema
        .fields
        .iter()
        .find(|f| f.name == field)
        .map(|f| (f.number, f.message))
    else {
        return found;
    };
    for (n, value) in Fields::new(message) {
        if let (true, Value::Len(bytes)) = (n == number, value) {
            let mut path = field.to_owned();
            walk(inner, bytes, &mut path, &mut found, max, 1);
        }
    }
    found
}

/// Walks `bytes`, a message of `MESSAGES[index]` at `path`, into `found`.
fn walk(
    index: usize,
    bytes: &[u8],
    path: &mut String,
    found: &mut Vec<UnknownField>,
    max: usize,
    depth: u32,
) {
    let Some(schema) = MESSAGES.get(index) else {
        return;
    };
    // How many times each repeated message field came so far: its next entry's index.
    let mut seen: Vec<(u32, usize)> = Vec::new();
    for (number, value) in Fields::new(bytes) {
        if found.len() >= max {
            return;
        }
        let Some(known) = schema.fields.iter().find(|k| k.number == number) else {
            found.push(UnknownField {
                path: path.clone(),
                message: schema.name,
                number,
            });
            continue;
        };
        let (Some(inner), Value::Len(inner_bytes)) = (known.message, value) else {
            continue;
        };
        if depth >= MAX_DEPTH {
            continue;
        }
        let at = match seen.iter_mut().find(|(n, _)| *n == number) {
            Some((_, count)) => {
                *count += 1;
                *count - 1
            }
            None => {
                seen.push((number, 1));
                0
            }
        };
        let len = path.len();
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(known.name);
        // A list's entries by their index (a single message written twice is merged, as
        // prost merges it: the index tells the two writes apart).
        if known.repeated || at > 0 {
            use fmt::Write as _;
            let _ = write!(path, "[{at}]");
        }
        walk(inner, inner_bytes, path, found, max, depth + 1);
        path.truncate(len);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use prost::Message as _;

    use super::*;
    use crate::pb;

    /// A field (number, varint 1) appended to `bytes`.
    fn with_field(mut bytes: Vec<u8>, number: u32) -> Vec<u8> {
        prost::encoding::uint64::encode(number, &1, &mut bytes);
        bytes
    }

    fn overlay(max_attempts: u32) -> pb::Overlay {
        pb::Overlay {
            max_attempts: Some(max_attempts),
            ..Default::default()
        }
    }

    #[test]
    fn every_generated_message_is_in_the_table() {
        for name in [
            "retryplane.v1.ApplyRequest",
            "retryplane.v1.ValidateRequest",
            "retryplane.v1.Snapshot",
            "retryplane.v1.PolicyDocument",
            "retryplane.v1.Endpoint",
            "retryplane.v1.Hello",
        ] {
            assert!(MESSAGES.iter().any(|m| m.name == name), "{name}");
        }
        // Every message field names a message of the table.
        for m in MESSAGES {
            for f in m.fields {
                assert!(
                    f.message.is_none_or(|i| i < MESSAGES.len()),
                    "{}.{}",
                    m.name,
                    f.name
                );
            }
        }
    }

    #[test]
    fn a_message_of_known_fields_has_none_unknown() {
        let doc = pb::PolicyDocument {
            defaults: Some(overlay(3)),
            endpoints: vec![
                pb::Endpoint {
                    name: "a".into(),
                    overlay: Some(overlay(2)),
                    routes: vec![pb::Route::default(); 2],
                },
                pb::Endpoint::default(),
            ],
        };
        let request = pb::ApplyRequest {
            source: Some(pb::PolicySource {
                kind: Some(pb::policy_source::Kind::Document(doc)),
                origin: "test".into(),
            }),
            dry_run: true,
            ..Default::default()
        };
        assert_eq!(
            find("retryplane.v1.ApplyRequest", &request.encode_to_vec(), 10),
            []
        );
    }

    /// An unknown field deep in a document is named by its path, the entry of a list by its
    /// index; one on the top message by the message alone.
    #[test]
    fn unknown_fields_are_named_by_their_path() {
        let endpoint = |name: &str, extra: Option<u32>| {
            let mut overlay = overlay(2).encode_to_vec();
            if let Some(number) = extra {
                overlay = with_field(overlay, number);
            }
            let mut bytes = Vec::new();
            prost::encoding::string::encode(1, &name.to_owned(), &mut bytes);
            prost::encoding::bytes::encode(2, &overlay, &mut bytes);
            bytes
        };
        let mut document = Vec::new();
        prost::encoding::bytes::encode(2, &endpoint("a", None), &mut document);
        prost::encoding::bytes::encode(2, &endpoint("b", Some(40)), &mut document);
        let mut source = Vec::new();
        prost::encoding::bytes::encode(2, &document, &mut source);
        let mut request = Vec::new();
        prost::encoding::bytes::encode(1, &source, &mut request);
        let request = with_field(request, 99);
        // It decodes, the unknown fields skipped.
        pb::ApplyRequest::decode(request.as_slice()).unwrap();
        let found = find("retryplane.v1.ApplyRequest", &request, 10);
        let shown: Vec<String> = found.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "field 40 of retryplane.v1.Overlay at `source.document.endpoints[1].overlay`",
                "field 99 of retryplane.v1.ApplyRequest",
            ]
        );
        assert_eq!(find("retryplane.v1.ApplyRequest", &request, 1).len(), 1);
        // Within the source alone: the request's own field 99 is not named.
        let within: Vec<String> = find_in("retryplane.v1.ApplyRequest", "source", &request, 10)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            within,
            ["field 40 of retryplane.v1.Overlay at `source.document.endpoints[1].overlay`"]
        );
        assert_eq!(
            find_in("retryplane.v1.ApplyRequest", "dry_run", &request, 10),
            []
        );
        assert_eq!(find("retryplane.v1.NoSuch", &request, 10), []);
    }
}
