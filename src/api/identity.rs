//! Who am I, and API tokens: create (shown once), list, revoke (effective at once).

use actix_web::{HttpRequest, HttpResponse, delete, get, post, put, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{TeamId, TokenId};
use crate::services::identity::{self, CreateToken, CreatedToken, DefaultTeam, Me, TokenInfo};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(me)
        .service(set_default_team)
        .service(create_token)
        .service(list_tokens)
        .service(revoke_token);
}

/// The caller: user, and the teams they belong to with their role.
#[utoipa::path(tag = "identity", security(("bearer" = [])), responses(
    (status = 200, body = Me), (status = 401, body = Problem)))]
#[get("/me")]
async fn me(principal: Principal) -> ApiResult<web::Json<Me>> {
    Ok(web::Json(identity::me(&principal)?))
}

/// Choose your default team: where new projects, hooks and other resources go when a
/// request names no team. It must be one of your teams; being added to a team never
/// changes it.
#[utoipa::path(tag = "identity", security(("bearer" = [])), request_body = DefaultTeam,
    responses((status = 200, body = Me), (status = 401, body = Problem),
        (status = 403, body = Problem, description = "A service token (its team is its default)"),
        (status = 404, body = Problem, description = "You are not a member of this team"),
        (status = 422, body = Problem)))]
#[put("/me/default-team")]
async fn set_default_team(
    state: web::Data<AppState>,
    principal: Principal,
    body: web::Json<DefaultTeam>,
) -> ApiResult<web::Json<Me>> {
    Ok(web::Json(
        identity::set_default_team(
            &state.services.data,
            &state.services.access,
            &principal,
            &body,
        )
        .await?,
    ))
}

/// Create an API token. The secret is in this response only.
#[utoipa::path(tag = "identity", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateToken,
    responses((status = 201, body = CreatedToken), (status = 200, description = "Replayed", body = CreatedToken),
        (status = 401, body = Problem), (status = 422, body = Problem)))]
#[post("/tokens")]
async fn create_token(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateToken>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        identity::create_token(&ctx.data, &ctx.access, &principal, &body)
    })
    .await
}

/// Which tokens to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct TokenFilter {
    /// A team's service tokens, whoever made them (members of the team) instead of yours.
    team_id: Option<String>,
}

/// Your tokens, or with `team_id` the team's service tokens (never their secrets).
#[utoipa::path(tag = "identity", security(("bearer" = [])), params(PageQuery, TokenFilter),
    responses((status = 200, body = Page<TokenInfo>, example = json!({"items": [{"id": "tok_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "ci-bot", "prefix": "agt_pat_3f1c", "team_id": null, "role": null, "scopes": [], "created_at": "2026-11-30T12:00:00Z", "expires_at": "2027-02-28T12:00:00Z", "last_used_at": null}], "next_cursor": null})), (status = 401, body = Problem)))]
#[get("/tokens")]
async fn list_tokens(
    state: web::Data<AppState>,
    principal: Principal,
    page: web::Query<PageQuery>,
    filter: web::Query<TokenFilter>,
) -> ApiResult<web::Json<Page<TokenInfo>>> {
    let after: Option<TokenId> = page.after()?;
    let team: Option<TeamId> = filter
        .team_id
        .as_deref()
        .map(|t| parse_id(t, "team"))
        .transpose()?;
    let items = identity::list_tokens(
        &state.services.data,
        &principal,
        team,
        after,
        page.limit() + 1,
    )
    .await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |t: &TokenInfo| t.id.to_string(),
    )))
}

/// Revoke a token; requests with it fail from now on.
#[utoipa::path(tag = "identity", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 204, description = "Revoked"), (status = 404, body = Problem)))]
#[delete("/tokens/{id}")]
async fn revoke_token(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id: TokenId = parse_id(&id, "token")?;
    identity::revoke_token(&state.services.data, &state.services.access, &principal, id).await?;
    Ok(HttpResponse::NoContent().finish())
}
