//! Request ids: every request gets one (or keeps a sane `X-Request-Id` it sent), it is in
//! every log line of the request and in the response's `X-Request-Id`.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use tracing::Instrument;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

pub async fn request_id(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::now_v7().simple().to_string());
    let span = tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.path());
    let started = std::time::Instant::now();
    let mut res = next.call(req).instrument(span.clone()).await?;
    span.in_scope(|| {
        tracing::debug!(
            status = res.status().as_u16(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "request done"
        )
    });
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut().insert(REQUEST_ID, v);
    }
    Ok(res)
}
