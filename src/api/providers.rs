//! Providers: which agent CLIs this server can run, whether they are usable now, their
//! modes and models.

use actix_web::{get, web};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use crate::auth::Principal;
use crate::providers::{Availability, ModeInfo, ModelInfo, ProviderCapabilities};
use crate::server::AppState;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(list_providers).service(list_models);
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "mock", "label": "Mock agent", "protocol": "acp", "available": true,
    "unavailable_reason": null, "capabilities": {"resume": true, "set_mode": true, "set_model": true,
    "permissions": true, "mcp_servers": true},
    "modes": [{"id": "default", "label": "Default", "description": null, "unattended": false},
              {"id": "unattended", "label": "Unattended", "description": null, "unattended": true}],
    "default_mode": "default"}))]
pub struct ProviderView {
    pub id: String,
    pub label: String,
    pub protocol: String,
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub capabilities: ProviderCapabilities,
    pub modes: Vec<ModeInfo>,
    pub default_mode: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderList {
    pub items: Vec<ProviderView>,
}

#[utoipa::path(tag = "providers", security(("bearer" = [])), responses((status = 200, body = ProviderList, example = json!({"items": [{"id": "mock", "label": "Mock agent", "protocol": "acp", "available": true, "unavailable_reason": null, "capabilities": {"resume": true, "set_mode": true, "set_model": true, "permissions": true, "mcp_servers": true}, "modes": [{"id": "default", "label": "Default", "description": null, "unattended": false}, {"id": "unattended", "label": "Unattended", "description": null, "unattended": true}], "default_mode": "default"}]}))))]
#[get("/providers")]
async fn list_providers(
    state: web::Data<AppState>,
    _principal: Principal,
) -> web::Json<ProviderList> {
    let mut items = Vec::new();
    for p in state.agents.registry().all() {
        let info = p.info();
        let (available, unavailable_reason) = match p.availability().await {
            Availability::Available => (true, None),
            Availability::Unavailable(r) => (false, Some(r)),
        };
        items.push(ProviderView {
            id: info.id,
            label: info.label,
            protocol: info.protocol,
            available,
            unavailable_reason,
            capabilities: info.capabilities,
            modes: info.modes,
            default_mode: info.default_mode,
        });
    }
    web::Json(ProviderList { items })
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ModelsQuery {
    /// Probe the provider again instead of using what it reported before.
    pub refresh: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    pub items: Vec<ModelInfo>,
}

#[utoipa::path(tag = "providers", security(("bearer" = [])), params(("id" = String, Path), ModelsQuery),
    responses((status = 200, body = ModelList, example = json!({"items": [{"id": "mock-small", "label": "Mock small", "is_default": true, "context_window": 100000}, {"id": "mock-large", "label": "Mock large", "is_default": false, "context_window": 1000000}]})), (status = 404, body = Problem)))]
#[get("/providers/{id}/models")]
async fn list_models(
    state: web::Data<AppState>,
    _principal: Principal,
    id: web::Path<String>,
    q: web::Query<ModelsQuery>,
) -> ApiResult<web::Json<ModelList>> {
    let items = state
        .agents
        .registry()
        .models(&id, q.refresh.unwrap_or(false))
        .await
        .ok_or_else(|| ApiError::not_found("provider"))?
        .map_err(|e| ApiError::unavailable("provider_unavailable", e.to_string()))?
        .to_vec();
    Ok(web::Json(ModelList { items }))
}
