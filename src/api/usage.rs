//! Usage and budgets: a team's usage from the ledger (totals and series), and its monthly
//! budget (read by any member, set by owners within the server's limits, by admins), and a
//! workspace's caps (set by the team's owners).

use actix_web::{get, put, web};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::parse_id;
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{TeamId, WorkspaceId};
use crate::services::usage::{
    self, AgentCaps, Budget, PutBudget, UsageQuery, UsageReport, WorkspaceBudget,
};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(get_usage)
        .service(get_budget)
        .service(put_budget)
        .service(get_workspace_budget)
        .service(put_workspace_budget);
}

/// A team's usage over `[from, to)` from the ledger (one row per ended turn): totals, and
/// with `group_by` one entry per day, person, provider, model or project. Members of the
/// team read it, admins any team's; another team's is 404.
#[utoipa::path(tag = "usage", security(("bearer" = [])), params(UsageQuery),
    responses((status = 200, body = UsageReport), (status = 404, body = Problem),
        (status = 422, body = Problem)))]
#[get("/usage")]
async fn get_usage(
    state: web::Data<AppState>,
    principal: Principal,
    q: web::Query<UsageQuery>,
) -> ApiResult<web::Json<UsageReport>> {
    Ok(web::Json(
        usage::report(&state.services.data, &principal, &q).await?,
    ))
}

/// The team's budget, what the current period used of it and when it resets.
#[utoipa::path(tag = "usage", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")),
    responses((status = 200, body = Budget), (status = 404, body = Problem)))]
#[get("/teams/{id}/budget")]
async fn get_budget(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Budget>> {
    let team: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        usage::get_budget(
            &state.services.data,
            &state.services.governance,
            &principal,
            team,
        )
        .await?,
    ))
}

/// Set the team's monthly budget (owners, within `[usage] max_team_cost_usd` and
/// `max_team_tokens`; admins any; audited as `budget.set`). Once it runs out, running
/// turns are interrupted and new prompts and agents answer 429 `budget_exhausted` until
/// the month ends.
#[utoipa::path(tag = "usage", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")),
    request_body = PutBudget,
    responses((status = 200, body = Budget), (status = 403, body = Problem),
        (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/teams/{id}/budget")]
async fn put_budget(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<PutBudget>,
) -> ApiResult<web::Json<Budget>> {
    let team: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        usage::put_budget(
            &state.services.data,
            &state.services.governance,
            &principal,
            team,
            &body,
        )
        .await?,
    ))
}

/// A workspace's caps (over all its agents' turns together) and what they used so far.
#[utoipa::path(tag = "usage", security(("bearer" = [])),
    params(("id" = String, Path, description = "The workspace")),
    responses((status = 200, body = WorkspaceBudget), (status = 404, body = Problem)))]
#[get("/workspaces/{id}/budget")]
async fn get_workspace_budget(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<WorkspaceBudget>> {
    let workspace: WorkspaceId = parse_id(&id, "workspace")?;
    Ok(web::Json(
        usage::get_workspace_budget(&state.services.data, &principal, workspace).await?,
    ))
}

/// Set a workspace's caps on cost, turns and wall time, over the life of all its agents
/// together (team owners; audited as `budget.set`); a field left out is no cap. A turn
/// that reaches one is interrupted (`budget_exhausted`, budget `workspace.cost_usd`,
/// `workspace.turns` or `workspace.wall_time_s`); new prompts and agents in the workspace
/// answer 429 `budget_exhausted`.
#[utoipa::path(tag = "usage", security(("bearer" = [])),
    params(("id" = String, Path, description = "The workspace")),
    request_body = AgentCaps,
    responses((status = 200, body = WorkspaceBudget), (status = 403, body = Problem),
        (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/workspaces/{id}/budget")]
async fn put_workspace_budget(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<AgentCaps>,
) -> ApiResult<web::Json<WorkspaceBudget>> {
    let workspace: WorkspaceId = parse_id(&id, "workspace")?;
    Ok(web::Json(
        usage::put_workspace_budget(
            &state.services.data,
            &state.services.governance,
            &principal,
            workspace,
            &body,
        )
        .await?,
    ))
}
