//! Admin messages as JSON, built by hand (the generated types do not derive `Serialize`).
//!
//! A policy document keeps the shape of a policy file: `defaults` and `endpoints` with the
//! fields each layer sets and nothing else (an absent field is inherited), routes under
//! `routes` with their `match`. Values keep the wire's units, named in the keys (`base_ms`,
//! `deadline_ms`); enumerations are written as in a file (`"jitter": "full"`,
//! `"errors": ["connect"]`, `"grpc_status": ["UNAVAILABLE"]`). Endpoints are an array, in the
//! document's order, each with its `name`.

use retryplane_policy::codes::GrpcCode;
use retryplane_proto::pb;
use serde_json::{Map, Value, json};

use super::time::rfc3339_utc;

/// The whole document: `{"defaults": {...}, "endpoints": [{"name": ..., ...}]}`.
pub fn document(doc: &pb::PolicyDocument) -> Value {
    let endpoints: Vec<Value> = doc
        .endpoints
        .iter()
        .map(|ep| {
            let mut o = Map::new();
            o.insert("name".to_owned(), json!(ep.name));
            if let Some(overlay) = &ep.overlay {
                push_overlay(&mut o, overlay);
            }
            if !ep.routes.is_empty() {
                o.insert(
                    "routes".to_owned(),
                    ep.routes.iter().map(route).collect::<Vec<_>>().into(),
                );
            }
            Value::Object(o)
        })
        .collect();
    let mut defaults = Map::new();
    if let Some(overlay) = &doc.defaults {
        push_overlay(&mut defaults, overlay);
    }
    json!({"defaults": defaults, "endpoints": endpoints})
}

/// `{version, content_hash, source, author, created_unix_ms, created, summary,
/// rolled_back_from}`; `author` and `rolled_back_from` are `null` when unset.
pub fn version_info(info: &pb::VersionInfo) -> Map<String, Value> {
    let mut o = Map::new();
    o.insert("version".to_owned(), json!(info.version));
    o.insert("content_hash".to_owned(), json!(info.content_hash));
    o.insert("source".to_owned(), json!(info.source));
    o.insert("author".to_owned(), non_empty(&info.author));
    o.insert("created_unix_ms".to_owned(), json!(info.created_unix_ms));
    o.insert(
        "created".to_owned(),
        json!(rfc3339_utc(info.created_unix_ms)),
    );
    o.insert("summary".to_owned(), json!(info.summary));
    o.insert(
        "rolled_back_from".to_owned(),
        match info.rolled_back_from {
            0 => Value::Null,
            v => json!(v),
        },
    );
    o
}

/// The string, or `null` when empty.
pub fn non_empty(text: &str) -> Value {
    if text.is_empty() {
        Value::Null
    } else {
        json!(text)
    }
}

fn route(r: &pb::Route) -> Value {
    let mut o = Map::new();
    let mut m = Map::new();
    match r.r#match.as_ref().and_then(|m| m.kind.as_ref()) {
        Some(pb::route_match::Kind::Http(h)) => {
            let mut http = Map::new();
            insert_str(&mut http, "method", &h.method);
            insert_str(&mut http, "path_prefix", &h.path_prefix);
            m.insert("http".to_owned(), Value::Object(http));
        }
        Some(pb::route_match::Kind::Grpc(g)) => {
            let mut grpc = Map::new();
            insert_str(&mut grpc, "service", &g.service);
            insert_str(&mut grpc, "method", &g.method);
            m.insert("grpc".to_owned(), Value::Object(grpc));
        }
        None => {}
    }
    o.insert("match".to_owned(), Value::Object(m));
    if let Some(overlay) = &r.overlay {
        push_overlay(&mut o, overlay);
    }
    Value::Object(o)
}

/// Adds the fields `ov` sets to `o`.
fn push_overlay(o: &mut Map<String, Value>, ov: &pb::Overlay) {
    insert_opt(o, "max_attempts", ov.max_attempts);
    if let Some(b) = &ov.backoff {
        let mut m = Map::new();
        insert_opt(&mut m, "base_ms", b.base_ms);
        insert_opt(&mut m, "max_ms", b.max_ms);
        insert_opt(&mut m, "multiplier", b.multiplier);
        if b.jitter != pb::Jitter::Unspecified as i32 {
            let name = pb::Jitter::try_from(b.jitter).map_or_else(
                |_| json!(b.jitter),
                |j| short_name(j.as_str_name(), "JITTER_"),
            );
            m.insert("jitter".to_owned(), name);
        }
        insert_object(o, "backoff", m);
    }
    insert_opt(o, "deadline_ms", ov.deadline_ms);
    insert_opt(o, "per_try_timeout_ms", ov.per_try_timeout_ms);
    if let Some(r) = &ov.retry_on {
        let mut m = Map::new();
        if let Some(list) = &r.http_status {
            m.insert("http_status".to_owned(), json!(list.codes));
        }
        if let Some(list) = &r.grpc_status {
            let names: Vec<Value> = list.codes.iter().map(|&c| grpc_code(c)).collect();
            m.insert("grpc_status".to_owned(), names.into());
        }
        if let Some(list) = &r.errors {
            let names: Vec<Value> = list
                .classes
                .iter()
                .map(|&c| {
                    pb::ErrorClass::try_from(c).map_or_else(
                        |_| json!(c),
                        |e| short_name(e.as_str_name(), "ERROR_CLASS_"),
                    )
                })
                .collect();
            m.insert("errors".to_owned(), names.into());
        }
        insert_object(o, "retry_on", m);
    }
    if let Some(list) = &ov.idempotent_methods {
        o.insert("idempotent_methods".to_owned(), json!(list.methods));
    }
    if let Some(header) = &ov.idempotency_key_header {
        o.insert("idempotency_key_header".to_owned(), json!(header));
    }
    if let Some(r) = &ov.retry_after {
        let mut m = Map::new();
        insert_opt(&mut m, "honor", r.honor);
        insert_opt(&mut m, "max_ms", r.max_ms);
        insert_object(o, "retry_after", m);
    }
    if let Some(b) = &ov.budget {
        let mut m = Map::new();
        insert_opt(&mut m, "enabled", b.enabled);
        insert_opt(&mut m, "ratio", b.ratio);
        insert_opt(&mut m, "min_per_second", b.min_per_second);
        insert_opt(&mut m, "window_ms", b.window_ms);
        insert_object(o, "budget", m);
    }
    if let Some(c) = &ov.circuit_breaker {
        let mut m = Map::new();
        insert_opt(&mut m, "enabled", c.enabled);
        insert_opt(&mut m, "failure_ratio", c.failure_ratio);
        insert_opt(&mut m, "min_requests", c.min_requests);
        insert_opt(&mut m, "window_ms", c.window_ms);
        insert_opt(&mut m, "open_for_ms", c.open_for_ms);
        insert_opt(&mut m, "half_open_probes", c.half_open_probes);
        insert_object(o, "circuit_breaker", m);
    }
    if let Some(a) = &ov.alert {
        let mut m = Map::new();
        insert_opt(&mut m, "retry_ratio", a.retry_ratio);
        insert_object(o, "alert", m);
    }
}

/// `UNAVAILABLE` for 14; the number itself when it names no code.
fn grpc_code(code: u32) -> Value {
    i32::try_from(code)
        .ok()
        .and_then(GrpcCode::from_i32)
        .map_or_else(|| json!(code), |c| json!(c.name()))
}

/// `JITTER_FULL` → `full`.
fn short_name(name: &str, prefix: &str) -> Value {
    json!(
        name.strip_prefix(prefix)
            .unwrap_or(name)
            .to_ascii_lowercase()
    )
}

fn insert_opt<T: Into<Value>>(o: &mut Map<String, Value>, key: &str, value: Option<T>) {
    if let Some(v) = value {
        o.insert(key.to_owned(), v.into());
    }
}

fn insert_str(o: &mut Map<String, Value>, key: &str, value: &str) {
    if !value.is_empty() {
        o.insert(key.to_owned(), json!(value));
    }
}

/// Adds `m` under `key` unless it is empty (a message present with no field set).
fn insert_object(o: &mut Map<String, Value>, key: &str, m: Map<String, Value>) {
    if !m.is_empty() {
        o.insert(key.to_owned(), Value::Object(m));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlay() -> pb::Overlay {
        pb::Overlay {
            max_attempts: Some(4),
            backoff: Some(pb::Backoff {
                base_ms: Some(100),
                jitter: pb::Jitter::Full as i32,
                ..Default::default()
            }),
            retry_on: Some(pb::RetryOn {
                http_status: Some(pb::StatusList {
                    codes: vec![503, 429],
                }),
                grpc_status: Some(pb::StatusList {
                    codes: vec![14, 99],
                }),
                errors: Some(pb::ErrorClassList {
                    classes: vec![pb::ErrorClass::Connect as i32],
                }),
            }),
            budget: Some(pb::Budget {
                enabled: Some(false),
                ..Default::default()
            }),
            retry_after: Some(pb::RetryAfter::default()),
            alert: Some(pb::Alert {
                retry_ratio: Some(0.02),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn documents_keep_the_shape_of_a_policy_file() {
        let doc = pb::PolicyDocument {
            defaults: Some(pb::Overlay {
                deadline_ms: Some(15_000),
                ..Default::default()
            }),
            endpoints: vec![
                pb::Endpoint {
                    name: "payments".to_owned(),
                    overlay: Some(overlay()),
                    routes: vec![pb::Route {
                        r#match: Some(pb::RouteMatch {
                            kind: Some(pb::route_match::Kind::Http(pb::HttpMatch {
                                method: "POST".to_owned(),
                                path_prefix: "/v1/charges".to_owned(),
                            })),
                        }),
                        overlay: Some(pb::Overlay {
                            max_attempts: Some(2),
                            ..Default::default()
                        }),
                    }],
                },
                pb::Endpoint {
                    name: "inventory".to_owned(),
                    ..Default::default()
                },
            ],
        };
        assert_eq!(
            document(&doc),
            json!({
                "defaults": {"deadline_ms": 15000},
                "endpoints": [
                    {
                        "name": "payments",
                        "max_attempts": 4,
                        "backoff": {"base_ms": 100, "jitter": "full"},
                        "retry_on": {
                            "http_status": [503, 429],
                            "grpc_status": ["UNAVAILABLE", 99],
                            "errors": ["connect"]
                        },
                        "budget": {"enabled": false},
                        "alert": {"retry_ratio": 0.02},
                        "routes": [
                            {"match": {"http": {"method": "POST", "path_prefix": "/v1/charges"}},
                             "max_attempts": 2}
                        ]
                    },
                    {"name": "inventory"}
                ]
            })
        );
    }

    #[test]
    fn an_empty_list_is_kept_because_it_differs_from_an_inherited_one() {
        let ov = pb::Overlay {
            retry_on: Some(pb::RetryOn {
                http_status: Some(pb::StatusList { codes: vec![] }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut o = Map::new();
        push_overlay(&mut o, &ov);
        assert_eq!(Value::Object(o), json!({"retry_on": {"http_status": []}}));
    }

    #[test]
    fn version_info_has_null_for_what_is_unset() {
        let info = pb::VersionInfo {
            version: 7,
            content_hash: "ab12".to_owned(),
            source: "admin".to_owned(),
            author: String::new(),
            created_unix_ms: 1_764_473_825_123,
            summary: "+1 endpoint, -0, 0 modified".to_owned(),
            rolled_back_from: 0,
        };
        assert_eq!(
            Value::Object(version_info(&info)),
            json!({
                "version": 7,
                "content_hash": "ab12",
                "source": "admin",
                "author": null,
                "created_unix_ms": 1_764_473_825_123_u64,
                "created": "2025-11-30T03:37:05Z",
                "summary": "+1 endpoint, -0, 0 modified",
                "rolled_back_from": null
            })
        );
    }
}
