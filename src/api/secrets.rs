//! Team secrets: set (owners; write-only), list names and update times (any member of
//! the team), delete (owners). No answer ever carries a value.

use actix_web::{HttpResponse, delete, get, put, web};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::TeamId;
use crate::services::secrets::{self, PutSecret, SecretInfo};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(put_secret)
        .service(list_secrets)
        .service(delete_secret);
}

/// Set a team secret (team owners). 201 when it is new, 200 when it replaced a value.
/// The value is encrypted at rest and never returned.
#[utoipa::path(tag = "secrets", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team"),
        ("name" = String, Path, description = "An environment variable name (`^[A-Z_][A-Z0-9_]{0,127}$`)")),
    request_body = PutSecret,
    responses((status = 201, description = "Created", body = SecretInfo),
        (status = 200, description = "Replaced", body = SecretInfo),
        (status = 403, body = Problem), (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/teams/{id}/secrets/{name}")]
async fn put_secret(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
    body: web::Json<PutSecret>,
) -> ApiResult<HttpResponse> {
    let (team, name) = path.into_inner();
    let team: TeamId = parse_id(&team, "team")?;
    let (info, created) = secrets::put(
        &state.services.data,
        &state.services.access,
        &principal,
        team,
        &name,
        &body,
    )
    .await?;
    Ok(if created {
        HttpResponse::Created().json(info)
    } else {
        HttpResponse::Ok().json(info)
    })
}

/// The team's secrets: names and update times, never values (any member of the team).
#[utoipa::path(tag = "secrets", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team"), PageQuery),
    responses((status = 200, body = Page<SecretInfo>, example = json!({"items": [{"name": "ANTHROPIC_API_KEY",
        "created_at": "2026-11-30T12:00:00Z", "updated_at": "2026-12-01T09:30:00Z",
        "updated_by": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"}], "next_cursor": null})),
        (status = 404, body = Problem)))]
#[get("/teams/{id}/secrets")]
async fn list_secrets(
    state: web::Data<AppState>,
    principal: Principal,
    team: web::Path<String>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<SecretInfo>>> {
    let team: TeamId = parse_id(&team, "team")?;
    let items = secrets::list(
        &state.services.data,
        &principal,
        team,
        page.cursor.as_deref(),
        page.limit() + 1,
    )
    .await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |s: &SecretInfo| s.name.clone(),
    )))
}

/// Delete a team secret (team owners). Agents already running keep the value they were
/// started with; providers that take it become unavailable to the team.
#[utoipa::path(tag = "secrets", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team"), ("name" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 403, body = Problem),
        (status = 404, body = Problem)))]
#[delete("/teams/{id}/secrets/{name}")]
async fn delete_secret(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
) -> ApiResult<HttpResponse> {
    let (team, name) = path.into_inner();
    let team: TeamId = parse_id(&team, "team")?;
    secrets::delete(&state.services.data, &principal, team, &name).await?;
    Ok(HttpResponse::NoContent().finish())
}
