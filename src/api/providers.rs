//! Providers: which agent CLIs this server can run, whether they are usable now, their
//! modes and models.

use actix_web::{get, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::parse_id;
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{TeamId, WorkspaceId};
use crate::services::providers::{self, ModelList, ProviderList};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(list_providers).service(list_models);
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ProvidersQuery {
    /// Whose availability to answer for (default: the caller's team); a provider that
    /// takes team secrets is available only to a team that has set them.
    pub team_id: Option<String>,
}

/// The providers, each `available` or not for the caller's team, with the reason.
#[utoipa::path(tag = "providers", security(("bearer" = [])), params(ProvidersQuery), responses((status = 200, body = ProviderList, example = json!({"items": [{"id": "mock", "label": "Mock agent", "protocol": "acp", "available": true, "unavailable_reason": null, "capabilities": {"resume": true, "set_mode": true, "set_model": true, "permissions": true, "mcp_servers": true}, "modes": [{"id": "default", "label": "Default", "description": null, "unattended": false}, {"id": "unattended", "label": "Unattended", "description": null, "unattended": true}], "default_mode": "default", "team_secrets": [], "sandbox": "enforced", "credentials": "inside", "credential_reason": "the mock provider calls no model API"}, {"id": "claude", "label": "Claude Code", "protocol": "claude-stream-json", "available": true, "unavailable_reason": null, "capabilities": {"resume": true, "set_mode": true, "set_model": true, "permissions": true, "mcp_servers": true}, "modes": [{"id": "default", "label": "Ask", "description": "Asks before running commands and editing files", "unattended": false}], "default_mode": "default", "team_secrets": ["ANTHROPIC_API_KEY"], "sandbox": "enforced", "credentials": "brokered", "credential_reason": null}], "sandbox": {"mode": "enforce", "available": true, "reason": null, "network": "proxy"}})), (status = 404, body = Problem)))]
#[get("/providers")]
async fn list_providers(
    state: web::Data<AppState>,
    principal: Principal,
    q: web::Query<ProvidersQuery>,
) -> ApiResult<web::Json<ProviderList>> {
    let team = q
        .team_id
        .as_deref()
        .map(|t| parse_id::<TeamId>(t, "team"))
        .transpose()?;
    Ok(web::Json(
        providers::list(&state.services, &principal, team).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ModelsQuery {
    /// The catalog as the provider sees it in this workspace (a CLI may read the
    /// project's own settings); without it, the server-wide catalog.
    pub workspace_id: Option<String>,
    /// Probe again instead of answering what the provider reported before. With
    /// `workspace_id` only that workspace is probed again; without it, every workspace's
    /// catalog of this provider is forgotten (probed again when next asked for) and the
    /// server-wide one is probed again. Each team may refresh
    /// `limits.catalog_refreshes_per_minute` times a minute (default 6); past it the
    /// cached catalog is answered.
    pub refresh: Option<bool>,
}

#[utoipa::path(tag = "providers", security(("bearer" = [])), params(("id" = String, Path), ModelsQuery),
    responses((status = 200, body = ModelList, example = json!({"items": [{"id": "mock-small", "label": "Mock small", "is_default": true, "context_window": 100000}, {"id": "mock-large", "label": "Mock large", "is_default": false, "context_window": 1000000}]})), (status = 404, body = Problem),
        (status = 409, body = Problem, description = "The workspace named by workspace_id is archived")))]
#[get("/providers/{id}/models")]
async fn list_models(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    q: web::Query<ModelsQuery>,
) -> ApiResult<web::Json<ModelList>> {
    let workspace = q
        .workspace_id
        .as_deref()
        .map(|w| parse_id::<WorkspaceId>(w, "workspace"))
        .transpose()?;
    Ok(web::Json(
        providers::models(
            &state.services,
            &principal,
            &id,
            workspace,
            q.refresh.unwrap_or(false),
        )
        .await?,
    ))
}
