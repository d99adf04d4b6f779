//! The audit log: who did what and when, newest first. Team owners read their teams'
//! entries, server admins everyone's.

use actix_web::{get, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::{Page, PageQuery, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{AuditId, TeamId, TokenId, UserId};
use crate::services::audit::{self, AuditEntry, AuditFilter};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(list_audit);
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Only this team's entries (required unless you are a server admin or own a team).
    pub team_id: Option<String>,
    /// Only this action, e.g. `agent.create`, `member.role`, `token.revoke`.
    pub action: Option<String>,
    /// Only what this person (`usr_…`), service token (`tok_…`) or agent (`agt_…`,
    /// through its own token) did.
    pub actor_id: Option<String>,
}

/// Who did what and when, newest first. Owners: their teams' entries; admins: all;
/// others: 403 `forbidden`.
#[utoipa::path(tag = "audit", security(("bearer" = [])), params(AuditQuery, PageQuery),
    responses((status = 200, body = Page<AuditEntry>, example = json!({"items": [{"id": "aud_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "at": "2026-11-30T12:00:00Z", "actor": {"kind": "user", "id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "email": "ana@example.com"}, "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "action": "agent.create", "target": {"kind": "agent", "id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6e"}, "details": {"provider": "mock"}, "request_id": "0193a1b2c3d47e8f9a0b1c2d3e4f5a70"}], "next_cursor": null})),
        (status = 403, body = Problem), (status = 404, body = Problem)))]
#[get("/audit")]
async fn list_audit(
    state: web::Data<AppState>,
    principal: Principal,
    q: web::Query<AuditQuery>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<AuditEntry>>> {
    let team_id: Option<TeamId> = q
        .team_id
        .as_deref()
        .map(|t| parse_id(t, "team"))
        .transpose()?;
    let actor_id = match q.actor_id.as_deref() {
        None => None,
        Some(a) => Some(
            a.parse::<UserId>()
                .map(|u| u.uuid())
                .or_else(|_| a.parse::<TokenId>().map(|t| t.uuid()))
                .or_else(|_| a.parse::<crate::domain::AgentId>().map(|t| t.uuid()))
                .map_err(|_| {
                    ApiError::bad_request(
                        "invalid_query",
                        "actor_id is a user id (usr_…), a token id (tok_…) or an agent id (agt_…)",
                    )
                })?,
        ),
    };
    let filter = AuditFilter {
        team_id,
        action: q.action.clone(),
        actor_id,
    };
    let before: Option<AuditId> = page.after()?;
    let items = audit::list(
        &state.services.data,
        &principal,
        &filter,
        before,
        page.limit() + 1,
    )
    .await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |e: &AuditEntry| e.id.to_string(),
    )))
}
