//! The HTTP API: one module per resource, each handler registered with `.service()` and
//! `#[utoipa::path]` so the OpenAPI document cannot miss it, and declared in
//! `access::ROUTES` with the operation it performs, so every request is authenticated and
//! its token scope checked before the handler runs. Handlers are thin: extract (the
//! `Principal`), call one service function, map the result.
//! This is the only layer that knows HTTP: request and response types belong to the
//! services, and their errors become problem+json in `error`.

pub mod access;
pub mod agents;
pub mod audit;
mod auth;
pub mod client_addr;
pub mod cluster;
pub mod device;
pub mod docs;
pub mod error;
pub mod health;
pub mod hooks;
mod idempotency;
pub mod identity;
pub mod input;
pub mod mcp;
pub mod metrics;
pub mod middleware;
pub mod network;
pub mod openapi;
pub mod projects;
pub mod providers;
pub mod secrets;
pub mod sessions;
pub mod sse;
mod state;
pub mod teams;
pub mod triggers;
pub mod ui;
pub mod usage;
pub mod users;
pub mod workspaces;

pub use state::AppState;

use actix_web::error::{JsonPayloadError, PathError, QueryPayloadError};
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, web};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use error::ApiError;

/// Register every route (and the extractor error handlers) on `cfg`.
pub fn configure(cfg: &mut ServiceConfig, max_body_bytes: usize) {
    cfg.app_data(
        web::JsonConfig::default()
            .limit(max_body_bytes)
            .content_type_required(false)
            .error_handler(json_error),
    )
    .app_data(web::PayloadConfig::new(max_body_bytes))
    .app_data(input::BodyLimit(max_body_bytes))
    .app_data(web::QueryConfig::default().error_handler(query_error))
    .app_data(web::PathConfig::default().error_handler(path_error));
    health::configure(cfg);
    metrics::configure(cfg);
    sessions::configure(cfg);
    device::configure_public(cfg);
    triggers::configure_public(cfg);
    cfg.service(
        utoipa_actix_web::scope("/v1")
            .wrap(actix_web::middleware::from_fn(cluster::forward))
            .wrap(actix_web::middleware::from_fn(input::reject_nul))
            .wrap(actix_web::middleware::from_fn(access::enforce))
            // The router tries each pattern in turn until one matches: the routes a busy
            // team calls most (prompts, waits, streams) come first.
            .configure(agents::configure)
            .configure(sse::configure)
            .configure(identity::configure)
            .configure(device::configure)
            .configure(teams::configure)
            .configure(users::configure)
            .configure(audit::configure)
            .configure(projects::configure)
            .configure(workspaces::configure)
            .configure(providers::configure)
            .configure(secrets::configure)
            .configure(network::configure)
            .configure(usage::configure)
            .configure(hooks::configure)
            .configure(triggers::configure)
            .configure(cluster::configure),
    );
}

fn json_error(err: JsonPayloadError, _req: &HttpRequest) -> actix_web::Error {
    let e = match &err {
        JsonPayloadError::OverflowKnownLength { .. } | JsonPayloadError::Overflow { .. } => {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                err.to_string(),
            )
        }
        JsonPayloadError::ContentType => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as application/json",
        ),
        JsonPayloadError::Deserialize(de) if de.is_data() => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            de.to_string(),
        ),
        JsonPayloadError::Deserialize(de) => {
            ApiError::bad_request("invalid_json", format!("malformed JSON: {de}"))
        }
        _ => ApiError::bad_request("invalid_body", err.to_string()),
    };
    e.into()
}

fn query_error(err: QueryPayloadError, _req: &HttpRequest) -> actix_web::Error {
    ApiError::bad_request("invalid_query", err.to_string()).into()
}

fn path_error(err: PathError, _req: &HttpRequest) -> actix_web::Error {
    ApiError::not_found(&format!("resource ({err})")).into()
}

/// Parse a prefixed id from a path; a malformed id is a missing resource.
pub fn parse_id<T: std::str::FromStr>(raw: &str, what: &str) -> Result<T, ApiError> {
    raw.parse().map_err(|_| ApiError::not_found(what))
}

/// `?limit=&cursor=` on every list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Items per page (default 50, at most 200).
    pub limit: Option<u32>,
    /// `next_cursor` from the previous page.
    pub cursor: Option<String>,
}

impl PageQuery {
    pub fn limit(&self) -> i64 {
        i64::from(self.limit.unwrap_or(50).clamp(1, 200))
    }

    /// The cursor as an id of type `T`; a cursor that is not one is a client error.
    pub fn after<T: std::str::FromStr>(&self) -> Result<Option<T>, ApiError> {
        match &self.cursor {
            None => Ok(None),
            Some(c) => c.parse().map(Some).map_err(|_| {
                ApiError::bad_request("invalid_cursor", "the cursor is not one this list returned")
            }),
        }
    }
}

/// A page of a list.
#[derive(Debug, Serialize, ToSchema)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next_cursor: Option<String>,
}

impl<T> Page<T> {
    /// Build a page from `limit + 1` fetched rows; the cursor is the last item's id.
    pub fn from_rows(mut rows: Vec<T>, limit: i64, cursor_of: impl Fn(&T) -> String) -> Self {
        let more = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let next_cursor = if more {
            rows.last().map(cursor_of)
        } else {
            None
        };
        Self {
            items: rows,
            next_cursor,
        }
    }
}
