//! Users of local mode: server admins create people and issue their first token; team
//! owners look someone up by exact email to add them to a team.

use actix_web::{HttpRequest, HttpResponse, get, post, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::UserId;
use crate::services::identity::{self, CreateToken, CreatedToken};
use crate::services::users::{self, CreateUser, User};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_user)
        .service(list_users)
        .service(create_user_token);
}

/// Create a user (server admins). Emails are unique (409 `user_email_taken`).
#[utoipa::path(tag = "users", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateUser,
    responses((status = 201, body = User), (status = 200, description = "Replayed", body = User),
        (status = 409, body = Problem), (status = 422, body = Problem)))]
#[post("/users")]
async fn create_user(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateUser>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        users::create(&ctx.data, &principal, &body)
    })
    .await
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UserQuery {
    /// Exact email (case-insensitive). Required for team owners; admins may list all.
    pub email: Option<String>,
}

/// Users: admins list them all; team owners find one by exact `email` to add them.
#[utoipa::path(tag = "users", security(("bearer" = [])), params(UserQuery, PageQuery),
    responses((status = 200, body = Page<User>, example = json!({"items": [{"id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "email": "ana@example.com", "name": "Ana", "is_admin": false, "created_at": "2026-11-30T12:00:00Z"}], "next_cursor": null})),
        (status = 403, body = Problem)))]
#[get("/users")]
async fn list_users(
    state: web::Data<AppState>,
    principal: Principal,
    q: web::Query<UserQuery>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<User>>> {
    let after: Option<UserId> = page.after()?;
    let items = users::list(
        &state.services.data,
        &principal,
        q.email.as_deref(),
        after,
        page.limit() + 1,
    )
    .await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |u: &User| u.id.to_string(),
    )))
}

/// Issue a personal token for a user (server admins): how the people of a local team get
/// their first token. Same body and answer as `POST /v1/tokens`, without `team_id`.
#[utoipa::path(tag = "users", security(("bearer" = [])),
    params(("id" = String, Path), ("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateToken,
    responses((status = 201, body = CreatedToken), (status = 200, description = "Replayed", body = CreatedToken),
        (status = 404, body = Problem), (status = 422, body = Problem)))]
#[post("/users/{id}/tokens")]
async fn create_user_token(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    id: web::Path<String>,
    body: web::Json<CreateToken>,
) -> ApiResult<HttpResponse> {
    let id: UserId = parse_id(&id, "user")?;
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        identity::create_user_token(&ctx.data, &ctx.access, &principal, id, &body)
    })
    .await
}
