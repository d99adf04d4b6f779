//! Request ids: every request gets one (or keeps a sane `X-Request-Id` it sent), it is in
//! every log line of the request and in the response's `X-Request-Id`. And a panic in a
//! handler is an answer (500), never a dropped connection.

use std::panic::AssertUnwindSafe;

use actix_web::HttpMessage;
use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use futures::FutureExt;
use tracing::Instrument;

use super::error::ApiError;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request's id, in its extensions (the audit log records it).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// The pattern of the route a request matched (`/v1/agents/{id}`), found once per request
/// and kept in its extensions: the request span, the access check and the metrics all
/// ask for it.
#[derive(Debug, Clone)]
struct RoutePattern(Option<String>);

pub fn route_pattern(req: &actix_web::HttpRequest) -> Option<String> {
    if let Some(RoutePattern(p)) = req.extensions().get::<RoutePattern>() {
        return p.clone();
    }
    // A declared route is found without the router's regular expressions.
    let pattern = super::access::declared_pattern(req.path())
        .map(str::to_owned)
        .or_else(|| req.match_pattern());
    req.extensions_mut().insert(RoutePattern(pattern.clone()));
    pattern
}

pub async fn request_id(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
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
    // The route's pattern (`GET /v1/agents/{id}`) names the span in a trace viewer (the
    // method alone when no route matched); the concrete path stays a field.
    let route = route_pattern(req.request());
    let otel_name = match &route {
        Some(r) => format!("{} {r}", req.method()),
        None => req.method().to_string(),
    };
    let span = tracing::info_span!("request", request_id = %id, method = %req.method(),
        path = %req.path(), route = route.as_deref(), status = tracing::field::Empty,
        trace_id = tracing::field::Empty, otel.name = %otel_name, otel.kind = "server",
        otel.status_code = tracing::field::Empty);
    let trace_id = crate::telemetry::trace_id(&span);
    if let Some(t) = &trace_id {
        span.record("trace_id", t.as_str());
    }
    let started = std::time::Instant::now();
    req.extensions_mut().insert(RequestId(id.clone()));
    let res = next.call(req).instrument(span.clone()).await?;
    span.record("status", res.status().as_u16());
    if res.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    span.in_scope(|| {
        tracing::debug!(
            status = res.status().as_u16(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "request done"
        )
    });
    let mut res = with_request_id(res, &id, trace_id.as_deref()).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut().insert(REQUEST_ID, v);
    }
    Ok(res)
}

/// A problem+json answer names the request it answers (`request_id`, and `trace_id` when
/// traces are exported), so a report quoting the body leads to the request's log lines
/// and trace.
async fn with_request_id(
    res: ServiceResponse<impl MessageBody + 'static>,
    id: &str,
    trace_id: Option<&str>,
) -> ServiceResponse<BoxBody> {
    let is_problem = res
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == b"application/problem+json");
    if !is_problem {
        return res.map_into_boxed_body();
    }
    let (req, res) = res.into_parts();
    let (head, body) = res.into_parts();
    let bytes = actix_web::body::to_bytes(body).await.unwrap_or_default();
    let body = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(mut problem)) => {
            problem.insert("request_id".into(), serde_json::Value::from(id));
            if let Some(t) = trace_id {
                problem.insert("trace_id".into(), serde_json::Value::from(t));
            }
            serde_json::to_vec(&problem).unwrap_or_else(|_| bytes.to_vec())
        }
        _ => bytes.to_vec(),
    };
    ServiceResponse::new(req, head.set_body(BoxBody::new(body)))
}

/// A handler that panics answers an opaque 500 (the panic is logged with the request id)
/// instead of dropping the client's connection without a response.
pub async fn catch_panic(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    match AssertUnwindSafe(next.call(req)).catch_unwind().await {
        Ok(res) => res.map(ServiceResponse::map_into_boxed_body),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(ApiError::internal(anyhow::anyhow!("the request handler panicked: {what}")).into())
        }
    }
}

#[cfg(test)]
mod tests {
    use actix_web::{App, HttpResponse, test, web};

    use super::*;

    #[actix_web::test]
    async fn a_panicking_handler_answers_500_problem_json() {
        let app = test::init_service(
            App::new()
                .wrap(actix_web::middleware::from_fn(catch_panic))
                .route(
                    "/boom",
                    web::get().to(|| async {
                        if true {
                            panic!("index out of range");
                        }
                        HttpResponse::Ok().finish()
                    }),
                )
                .route("/fine", web::get().to(HttpResponse::Ok)),
        )
        .await;
        // The server turns a middleware's error into the response; do the same here.
        let err = test::try_call_service(&app, test::TestRequest::get().uri("/boom").to_request())
            .await
            .expect_err("the panic becomes an error");
        let res = err.error_response();
        assert_eq!(res.status(), 500);
        assert_eq!(
            res.headers().get("content-type").unwrap(),
            "application/problem+json"
        );
        let body = actix_web::body::to_bytes(res.into_body()).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["code"], "internal");
        assert!(
            !body["detail"].as_str().unwrap().contains("index"),
            "nothing leaks"
        );
        let res =
            test::call_service(&app, test::TestRequest::get().uri("/fine").to_request()).await;
        assert_eq!(res.status(), 200);
    }
}
