//! U+0000 never enters the server: PostgreSQL cannot store it in text or jsonb, and no
//! field of the API has a use for it. A request whose path, query or JSON body carries
//! one is answered 422 `validation_failed` naming the field, before any handler runs.

use actix_web::HttpMessage;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::web::{Bytes, BytesMut};
use futures::StreamExt;
use serde_json::Value;

use super::error::ApiError;

const MESSAGE: &str = "must not contain U+0000";

/// The largest body the API reads (`limits.max_body_bytes`), for this middleware.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

pub async fn reject_nul(
    mut req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    match refusal(&mut req).await {
        // Answered here (not raised), so the outer middleware still tags the answer with
        // its request id.
        Some(e) => Ok(req.error_response(e).map_into_right_body()),
        None => next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body),
    }
}

/// Why `req` is refused before any handler, if it is; otherwise its body, read to look
/// into it, is put back for the extractors.
async fn refusal(req: &mut ServiceRequest) -> Option<actix_web::Error> {
    if let Some(field) = nul_in_path(req.path()).or_else(|| nul_in_query(req.query_string())) {
        return Some(ApiError::validation(&field, MESSAGE).into());
    }
    if matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH) {
        let limit = req.app_data::<BodyLimit>().map_or(usize::MAX, |l| l.0);
        let mut payload = req.take_payload();
        let mut body = BytesMut::new();
        while let Some(chunk) = payload.next().await {
            match chunk {
                Ok(chunk) => body.extend_from_slice(&chunk),
                Err(e) => return Some(e.into()),
            }
            if body.len() > limit {
                return Some(
                    ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "payload_too_large",
                        format!("the body is larger than {limit} bytes"),
                    )
                    .into(),
                );
            }
        }
        let body = body.freeze();
        if let Some(field) = nul_in_json(&body) {
            return Some(ApiError::validation(&field, MESSAGE).into());
        }
        req.set_payload(replay(body));
    }
    None
}

/// The body again, for the extractors after this middleware.
pub(crate) fn replay(body: Bytes) -> Payload {
    let stream: std::pin::Pin<Box<dyn futures::Stream<Item = _>>> =
        Box::pin(futures::stream::once(async move { Ok(body) }));
    Payload::from(stream)
}

/// In JSON text a NUL can only be written as the escape `\u0000`; look for one that is
/// not itself escaped, and only then parse to name the field.
fn nul_in_json(body: &[u8]) -> Option<String> {
    let mut i = 0;
    let mut found = false;
    while i < body.len() {
        if body[i] == b'\\' {
            if body[i + 1..].starts_with(b"u0000") {
                found = true;
                break;
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    if !found {
        return None;
    }
    // A body that does not parse is left to the JSON extractor's 400.
    let value: Value = serde_json::from_slice(body).ok()?;
    field_with_nul(&value, String::new())
}

pub(crate) fn field_with_nul(value: &Value, at: String) -> Option<String> {
    let join = |key: &str| {
        if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        }
    };
    match value {
        Value::String(s) if s.contains('\0') => {
            Some(if at.is_empty() { "body".into() } else { at })
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| field_with_nul(v, format!("{at}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            if k.contains('\0') {
                Some(join(&k.replace('\0', "\u{fffd}")))
            } else {
                field_with_nul(v, join(k))
            }
        }),
        _ => None,
    }
}

/// A NUL reaches a query as `%00`; the field is the parameter's name.
fn nul_in_query(query: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if has_encoded_nul(name) || has_encoded_nul(value) {
            Some(decode_lossy(name))
        } else {
            None
        }
    })
}

/// A NUL in the path (`%00`): the field is the route's parameter at that place.
fn nul_in_path(path: &str) -> Option<String> {
    if !has_encoded_nul(path) {
        return None;
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let index = segments.iter().position(|s| has_encoded_nul(s))?;
    Some(route_param(&segments, index).unwrap_or_else(|| "path".into()))
}

fn has_encoded_nul(s: &str) -> bool {
    s.contains("%00")
}

/// The name of the parameter at `index` in the documented route these segments match.
fn route_param(segments: &[&str], index: usize) -> Option<String> {
    let doc = super::docs::document();
    doc.paths.paths.keys().find_map(|pattern| {
        let parts: Vec<&str> = pattern.trim_matches('/').split('/').collect();
        let matches = parts.len() == segments.len()
            && parts
                .iter()
                .zip(segments)
                .all(|(p, s)| p.starts_with('{') || p == s);
        let part = parts.get(index)?;
        (matches && part.starts_with('{')).then(|| part.trim_matches(['{', '}']).to_owned())
    })
}

fn decode_lossy(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) => hex(*hi).zip(hex(*lo)).map(|(h, l)| h << 4 | l),
            _ => None,
        };
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).replace('\0', "\u{fffd}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_field_of_a_nul_in_a_body() {
        let at = |s: &str| nul_in_json(s.as_bytes());
        assert_eq!(at(r#"{"text": "a\u0000b"}"#).as_deref(), Some("text"));
        assert_eq!(
            at(r#"{"labels": {"ci": "x\u0000"}}"#).as_deref(),
            Some("labels.ci")
        );
        assert_eq!(
            at(r#"{"mcp": {"s": {"args": ["ok", "\u0000"]}}}"#).as_deref(),
            Some("mcp.s.args[1]")
        );
        assert_eq!(at(r#"{"k\u0000": 1}"#).as_deref(), Some("k\u{fffd}"));
        assert_eq!(at(r#""\u0000""#).as_deref(), Some("body"));
        // An escaped backslash followed by `u0000` is text, not a NUL.
        assert_eq!(at(r#"{"text": "a\\u0000b"}"#), None);
        assert_eq!(at(r#"{"text": "plain"}"#), None);
        // Not JSON: left to the extractor.
        assert_eq!(at(r#"{"text": "\u0000"#), None);
    }

    #[test]
    fn finds_the_field_of_a_nul_in_a_query_or_path() {
        assert_eq!(
            nul_in_query("limit=5&label=a%00b").as_deref(),
            Some("label")
        );
        assert_eq!(nul_in_query("limit=5&cursor=x"), None);
        assert_eq!(nul_in_query("a%00=1").as_deref(), Some("a\u{fffd}"));
        assert_eq!(
            nul_in_path("/v1/agents/agt_%00/wait").as_deref(),
            Some("id")
        );
        assert_eq!(
            nul_in_path("/v1/agents/agt_1/permissions/perm%00").as_deref(),
            Some("request_id")
        );
        assert_eq!(nul_in_path("/v1/agents/agt_1"), None);
        assert_eq!(nul_in_path("/nowhere/%00").as_deref(), Some("path"));
    }
}
