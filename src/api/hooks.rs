//! Lifecycle hooks: create, list, read, change and delete webhooks (team owners for their
//! team's, server admins for server-wide ones), their recent deliveries, and redelivery.

use actix_web::{HttpRequest, HttpResponse, delete, get, patch, post, web};
use serde::Serialize;
use sha2::{Digest, Sha256};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{DeliveryId, HookId};
use crate::services::hooks::{self, CreateHook, Delivery, Hook, PatchHook};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_hook)
        .service(list_hooks)
        .service(get_hook)
        .service(update_hook)
        .service(delete_hook)
        .service(list_deliveries)
        .service(redeliver);
}

/// What identifies a create request for `Idempotency-Key`: the body, with the secret
/// only as its digest.
#[derive(Serialize)]
struct CreateFingerprint<'a> {
    name: &'a str,
    events: &'a [String],
    url: &'a str,
    secret_sha256: String,
    team_id: Option<Option<String>>,
    project_id: Option<String>,
    labels: &'a Option<serde_json::Value>,
    enabled: Option<bool>,
}

/// Register a webhook for lifecycle points (team owners; `team_id: null` for a
/// server-wide hook, server admins). The `secret` signs every delivery and is never
/// returned.
#[utoipa::path(tag = "hooks", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateHook,
    responses((status = 201, body = Hook), (status = 200, description = "Replayed", body = Hook),
        (status = 403, body = Problem), (status = 404, body = Problem), (status = 422, body = Problem)))]
#[post("/hooks")]
async fn create_hook(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateHook>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    let fingerprint = CreateFingerprint {
        name: &body.name,
        events: &body.events,
        url: &body.url,
        secret_sha256: hex::encode(Sha256::digest(body.secret.expose().as_bytes())),
        team_id: body.team_id.map(|t| t.map(|t| t.to_string())),
        project_id: body.project_id.map(|p| p.to_string()),
        labels: &body.labels,
        enabled: body.enabled,
    };
    idempotency::respond(
        &ctx.data,
        &ctx.access,
        &principal,
        &req,
        &fingerprint,
        || hooks::create(ctx, &principal, &body),
    )
    .await
}

/// The hooks you manage: your teams' (as an owner), and every hook for a server admin.
#[utoipa::path(tag = "hooks", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Page<Hook>, example = json!({"items": [{"id": "hook_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
        "name": "ticket-bot", "events": ["agent.turn.after"], "url": "https://hooks.example.com/agentry",
        "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "project_id": null, "labels": {}, "enabled": true,
        "source": "api", "created_at": "2026-12-01T12:00:00Z"}], "next_cursor": null}))))]
#[get("/hooks")]
async fn list_hooks(
    state: web::Data<AppState>,
    principal: Principal,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Hook>>> {
    let after: Option<HookId> = page.after()?;
    let items = hooks::list(&state.services, &principal, after, page.limit() + 1).await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |h: &Hook| h.id.to_string(),
    )))
}

#[utoipa::path(tag = "hooks", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Hook), (status = 403, body = Problem), (status = 404, body = Problem)))]
#[get("/hooks/{id}")]
async fn get_hook(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Hook>> {
    let id: HookId = parse_id(&id, "hook")?;
    Ok(web::Json(
        hooks::get(&state.services, &principal, id).await?,
    ))
}

/// Change a hook: the fields given change (`secret` is replaced, never shown). Hooks of
/// the settings file are read-only: 409 `hook_read_only`.
#[utoipa::path(tag = "hooks", security(("bearer" = [])), params(("id" = String, Path)),
    request_body = PatchHook,
    responses((status = 200, body = Hook), (status = 403, body = Problem), (status = 404, body = Problem),
        (status = 409, body = Problem), (status = 422, body = Problem)))]
#[patch("/hooks/{id}")]
async fn update_hook(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<PatchHook>,
) -> ApiResult<web::Json<Hook>> {
    let id: HookId = parse_id(&id, "hook")?;
    Ok(web::Json(
        hooks::update(&state.services, &principal, id, &body).await?,
    ))
}

#[utoipa::path(tag = "hooks", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 403, body = Problem),
        (status = 404, body = Problem), (status = 409, body = Problem)))]
#[delete("/hooks/{id}")]
async fn delete_hook(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id: HookId = parse_id(&id, "hook")?;
    hooks::delete(&state.services, &principal, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// The hook's recent deliveries, newest first: notifications with their retries, and
/// the calls of waiting hooks.
#[utoipa::path(tag = "hooks", security(("bearer" = [])), params(("id" = String, Path), PageQuery),
    responses((status = 200, body = Page<Delivery>, example = json!({"items": [{"id": "dlv_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
        "hook": "agent.turn.after", "status": "delivered", "attempts": 1, "response_status": 204, "error": null,
        "duration_ms": 38, "created_at": "2026-12-01T12:00:00Z", "delivered_at": "2026-12-01T12:00:00Z"}],
        "next_cursor": null})),
        (status = 403, body = Problem), (status = 404, body = Problem)))]
#[get("/hooks/{id}/deliveries")]
async fn list_deliveries(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Delivery>>> {
    let id: HookId = parse_id(&id, "hook")?;
    let before: Option<DeliveryId> = page.after()?;
    let items =
        hooks::deliveries(&state.services, &principal, id, before, page.limit() + 1).await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |d: &Delivery| d.id.to_string(),
    )))
}

/// Send a notification again (same id and body), retried like a new one. The recorded
/// calls of waiting hooks are not sent again (404).
#[utoipa::path(tag = "hooks", security(("bearer" = [])),
    params(("id" = String, Path), ("delivery_id" = String, Path)),
    responses((status = 202, description = "Queued"), (status = 403, body = Problem),
        (status = 404, body = Problem)))]
#[post("/hooks/{id}/deliveries/{delivery_id}/redeliver")]
async fn redeliver(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
) -> ApiResult<HttpResponse> {
    let (id, delivery) = path.into_inner();
    let id: HookId = parse_id(&id, "hook")?;
    let delivery: DeliveryId = parse_id(&delivery, "delivery")?;
    hooks::redeliver(&state.services, &principal, id, delivery).await?;
    Ok(HttpResponse::Accepted().finish())
}
