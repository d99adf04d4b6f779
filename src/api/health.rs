//! Health probes (no authentication): the process is up; the database is reachable and
//! migrated.

use actix_web::{HttpResponse, get, web};
use serde_json::json;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::ApiError;
use crate::api::AppState;
use crate::services::health;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(healthz).service(readyz);
}

/// The process is up.
#[utoipa::path(tag = "health", responses((status = 200, description = "Up", content_type = "application/json", example = json!({"status": "ok"}))))]
#[get("/healthz")]
async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// The problem, with `ready: false` and the `reason` beside it (what an orchestrator or a
/// person reads first when the store is down: why, and for how long).
fn not_ready(err: ApiError) -> HttpResponse {
    let res = actix_web::ResponseError::error_response(&err);
    let mut body = serde_json::to_value(err.problem()).unwrap_or_else(|_| json!({}));
    body["ready"] = json!(false);
    body["reason"] = json!(err.detail);
    res.set_body(body.to_string()).map_into_boxed_body()
}

/// The database is reachable and every migration is applied. The body also says how agent
/// resource limits are enforced on this host (`limits`) and whether agents are sandboxed
/// (`sandbox`: mode, whether the host can, why not, network mode).
#[utoipa::path(tag = "health", responses(
    (status = 200, description = "Ready", content_type = "application/json", example = json!({"status": "ready", "limits": "cgroup v1 (memory, pids, cpu)", "sandbox": {"mode": "enforce", "available": true, "reason": null, "network": "proxy"}})),
    (status = 503, description = "Not ready", body = crate::api::error::Problem)))]
#[get("/readyz")]
async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    match health::ready(&state.services.data, &state.services.access).await {
        Ok(()) => HttpResponse::Ok().json(json!({
            "status": "ready",
            "limits": state.services.fleet.agents.ledger().limits_mechanism(),
            "sandbox": state.services.fleet.agents.sandbox().map(|s| s.status()),
        })),
        Err(e) => not_ready(ApiError::from(e)),
    }
}
