//! Who am I, and API tokens: create (shown once), list, revoke (effective at once).

use actix_web::{HttpRequest, HttpResponse, delete, get, post, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::{Page, PageQuery, parse_id};
use crate::auth::{Principal, Role};
use crate::domain::{TeamId, TokenId, UserId};
use crate::server::AppState;
use crate::services::{idempotency, tokens};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(me)
        .service(create_token)
        .service(list_tokens)
        .service(revoke_token);
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TeamRef {
    pub id: TeamId,
    pub name: String,
    pub role: Role,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "email": "admin@localhost", "name": "Local admin",
    "is_admin": true, "teams": [{"id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "name": "default", "role": "owner"}]}))]
pub struct Me {
    pub id: UserId,
    pub email: String,
    pub name: String,
    pub is_admin: bool,
    pub teams: Vec<TeamRef>,
}

/// The caller: user, and the teams they belong to with their role.
#[utoipa::path(tag = "identity", security(("bearer" = [])), responses(
    (status = 200, body = Me), (status = 401, body = Problem)))]
#[get("/me")]
async fn me(principal: Principal) -> web::Json<Me> {
    web::Json(Me {
        id: principal.user_id.into(),
        email: principal.email.clone(),
        name: principal.name.clone(),
        is_admin: principal.is_admin,
        teams: principal
            .teams
            .iter()
            .map(|m| TeamRef {
                id: m.team_id.into(),
                name: m.team_name.clone(),
                role: m.role,
            })
            .collect(),
    })
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "ci-bot", "expires_in_days": 90}))]
pub struct CreateToken {
    pub name: String,
    /// Days until the token expires (default: never).
    pub expires_in_days: Option<u32>,
    /// Make a team service token acting in this team.
    pub team_id: Option<TeamId>,
    /// The role of a team service token (default `member`, never above your own).
    pub role: Option<Role>,
    #[serde(default)]
    pub scopes: Vec<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "tok_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "ci-bot",
    "token": "agt_pat_3f1c…", "prefix": "agt_pat_3f1c", "expires_at": null}))]
pub struct CreatedToken {
    pub id: TokenId,
    pub name: String,
    /// The secret. Shown only in this response: store it now.
    pub token: String,
    pub prefix: String,
    pub expires_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenInfo {
    pub id: TokenId,
    pub name: String,
    pub prefix: String,
    pub team_id: Option<TeamId>,
    pub role: Option<String>,
    pub scopes: Vec<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
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
    idempotency::respond(&state, &principal, &req, &body, || {
        tokens::create(&state, &principal, &body)
    })
    .await
}

/// Your tokens (never their secrets).
#[utoipa::path(tag = "identity", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Page<TokenInfo>, example = json!({"items": [{"id": "tok_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "ci-bot", "prefix": "agt_pat_3f1c", "team_id": null, "role": null, "scopes": [], "created_at": "2026-11-30T12:00:00Z", "expires_at": "2027-02-28T12:00:00Z", "last_used_at": null}], "next_cursor": null})), (status = 401, body = Problem)))]
#[get("/tokens")]
async fn list_tokens(
    state: web::Data<AppState>,
    principal: Principal,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<TokenInfo>>> {
    let after: Option<TokenId> = page.after()?;
    let rows = crate::store::identity::list_tokens(
        &state.pool,
        principal.user_id,
        after.map(|t| t.uuid()),
        page.limit() + 1,
    )
    .await?;
    let items = rows
        .into_iter()
        .map(|r| TokenInfo {
            id: r.id.into(),
            name: r.name,
            prefix: r.prefix,
            team_id: r.team_id.map(Into::into),
            role: r.role,
            scopes: r.scopes,
            created_at: r.created_at,
            expires_at: r.expires_at,
            last_used_at: r.last_used_at,
        })
        .collect();
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
    let owner = if principal.is_admin {
        None
    } else {
        Some(principal.user_id)
    };
    if !crate::store::identity::revoke_token(&state.pool, id.uuid(), owner).await? {
        return Err(ApiError::not_found("token"));
    }
    Ok(HttpResponse::NoContent().finish())
}
