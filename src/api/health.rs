//! Health probes (no authentication): the process is up; the database is reachable and
//! migrated.

use actix_web::{HttpResponse, get, web};
use serde_json::json;
use utoipa_actix_web::service_config::ServiceConfig;

use crate::server::AppState;
use crate::store;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(healthz).service(readyz);
}

/// The process is up.
#[utoipa::path(tag = "health", responses((status = 200, description = "Up", content_type = "application/json", example = json!({"status": "ok"}))))]
#[get("/healthz")]
async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// The database is reachable and every migration is applied.
#[utoipa::path(tag = "health", responses(
    (status = 200, description = "Ready", content_type = "application/json", example = json!({"status": "ready"})),
    (status = 503, description = "Not ready", body = crate::api::error::Problem)))]
#[get("/readyz")]
async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let latest = store::MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Result<Option<i64>, _> =
        sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&state.pool)
            .await;
    match applied {
        Ok(Some(v)) if v >= latest => HttpResponse::Ok().json(json!({"status": "ready"})),
        Ok(_) => {
            actix_web::ResponseError::error_response(&crate::api::error::ApiError::unavailable(
                "not_ready",
                "database migrations are not applied",
            ))
        }
        Err(_) => {
            actix_web::ResponseError::error_response(&crate::api::error::ApiError::unavailable(
                "database_unavailable",
                "the database is unreachable",
            ))
        }
    }
}
