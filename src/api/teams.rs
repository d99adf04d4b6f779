//! Teams and their members: create a team (you become its owner), list your teams, read
//! one with its members, add or change a member (owners), remove a member (owners; anyone
//! may leave). The last owner can be neither removed nor demoted (409 `last_owner`).

use actix_web::{HttpRequest, HttpResponse, delete, get, post, put, web};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{TeamId, UserId};
use crate::services::teams::{
    self, CreateTeam, Member, MemberChange, MemberRole, Team, TeamAgentryMcp, TeamDetail,
    TeamSandbox,
};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_team)
        .service(list_teams)
        .service(get_team)
        .service(list_members)
        .service(set_member)
        .service(remove_member)
        .service(set_sandbox)
        .service(get_agentry_mcp)
        .service(set_agentry_mcp);
}

/// Whether the team's agents are given agentry's own MCP server (`agentry`, with a token
/// of each agent's own) at launch.
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")),
    responses((status = 200, body = TeamAgentryMcp), (status = 404, body = Problem)))]
#[get("/teams/{id}/agentry-mcp")]
async fn get_agentry_mcp(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<TeamAgentryMcp>> {
    let id: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        teams::agentry_mcp(&state.services.data, &principal, id).await?,
    ))
}

/// Give (or stop giving) the team's agents agentry's own MCP server, from their next
/// launch on (owners; audited as `team.agentry_mcp`).
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")), request_body = TeamAgentryMcp,
    responses((status = 200, body = TeamAgentryMcp), (status = 403, body = Problem),
        (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/teams/{id}/agentry-mcp")]
async fn set_agentry_mcp(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<TeamAgentryMcp>,
) -> ApiResult<web::Json<TeamAgentryMcp>> {
    let id: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        teams::set_agentry_mcp(&state.services.data, &principal, id, &body).await?,
    ))
}

/// Require (or stop requiring) that the team's agents run sandboxed (owners; audited as
/// `team.sandbox`). While it is required and the server's sandbox is off or unavailable,
/// creating or prompting an agent of the team answers 409 `sandbox_required`.
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")), request_body = TeamSandbox,
    responses((status = 200, body = Team), (status = 403, body = Problem),
        (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/teams/{id}/sandbox")]
async fn set_sandbox(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<TeamSandbox>,
) -> ApiResult<web::Json<Team>> {
    let id: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        teams::set_sandbox(&state.services.data, &principal, id, &body).await?,
    ))
}

/// Create a team; you become its owner. Names are unique (409 `team_name_taken`); the
/// names of the teams `[auth.oidc.groups]` maps to are reserved (409
/// `team_name_reserved`). Service tokens cannot create teams.
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateTeam,
    responses((status = 201, body = Team), (status = 200, description = "Replayed", body = Team),
        (status = 409, body = Problem), (status = 422, body = Problem)))]
#[post("/teams")]
async fn create_team(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateTeam>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        teams::create(&ctx.data, &ctx.access, &principal, &body)
    })
    .await
}

/// Your teams with your role in each (a server admin: every team).
#[utoipa::path(tag = "teams", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Page<Team>, example = json!({"items": [{"id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "platform", "role": "owner", "created_at": "2026-11-30T12:00:00Z"}], "next_cursor": null}))))]
#[get("/teams")]
async fn list_teams(
    state: web::Data<AppState>,
    principal: Principal,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Team>>> {
    let after: Option<TeamId> = page.after()?;
    let items = teams::list(&state.services.data, &principal, after, page.limit() + 1).await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |t: &Team| t.id.to_string(),
    )))
}

/// A team with its first 200 members (page through `/members` for more).
#[utoipa::path(tag = "teams", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = TeamDetail), (status = 404, body = Problem)))]
#[get("/teams/{id}")]
async fn get_team(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<TeamDetail>> {
    let id: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        teams::get(&state.services.data, &principal, id).await?,
    ))
}

/// The team's members and their roles.
#[utoipa::path(tag = "teams", security(("bearer" = [])), params(("id" = String, Path), PageQuery),
    responses((status = 200, body = Page<Member>, example = json!({"items": [{"user_id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "email": "ana@example.com", "name": "Ana", "role": "owner", "added_at": "2026-11-30T12:00:00Z"}], "next_cursor": null})),
        (status = 404, body = Problem)))]
#[get("/teams/{id}/members")]
async fn list_members(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Member>>> {
    let id: TeamId = parse_id(&id, "team")?;
    let after: Option<UserId> = page.after()?;
    let items = teams::members(
        &state.services.data,
        &principal,
        id,
        after,
        page.limit() + 1,
    )
    .await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |m: &Member| m.user_id.to_string(),
    )))
}

/// Add a user to the team with a role (201), or change a member's role (200). Owners
/// only. Demoting the last owner: 409 `last_owner`.
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path), ("user_id" = String, Path)), request_body = MemberRole,
    responses((status = 201, description = "Added", body = Member), (status = 200, description = "Role changed", body = Member),
        (status = 404, body = Problem), (status = 409, body = Problem)))]
#[put("/teams/{id}/members/{user_id}")]
async fn set_member(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
    body: web::Json<MemberRole>,
) -> ApiResult<HttpResponse> {
    let (id, user) = path.into_inner();
    let id: TeamId = parse_id(&id, "team")?;
    let user: UserId = parse_id(&user, "user")?;
    Ok(
        match teams::set_member(
            &state.services.data,
            &state.services.access,
            &principal,
            id,
            user,
            body.role,
        )
        .await?
        {
            MemberChange::Added(m) => HttpResponse::Created().json(m),
            MemberChange::Changed(m) => HttpResponse::Ok().json(m),
        },
    )
}

/// Remove a member (owners), or leave the team yourself. The last owner stays: 409
/// `last_owner`.
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path), ("user_id" = String, Path)),
    responses((status = 204, description = "Removed"), (status = 404, body = Problem), (status = 409, body = Problem)))]
#[delete("/teams/{id}/members/{user_id}")]
async fn remove_member(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
) -> ApiResult<HttpResponse> {
    let (id, user) = path.into_inner();
    let id: TeamId = parse_id(&id, "team")?;
    let user: UserId = parse_id(&user, "user")?;
    teams::remove_member(
        &state.services.data,
        &state.services.access,
        &principal,
        id,
        user,
    )
    .await?;
    Ok(HttpResponse::NoContent().finish())
}
