//! Triggers: create, list, read, change and delete them (team owners; members read),
//! their runs, and the one route that receives their webhook deliveries — outside `/v1`,
//! without a bearer token: a delivery is authenticated by its signature (GitHub) or
//! token (GitLab) made with the trigger's secret.

use actix_web::{HttpRequest, HttpResponse, delete, get, patch, post, web};
use futures::StreamExt;
use utoipa_actix_web::service_config::ServiceConfig;

use super::AppState;
use super::error::{ApiError, ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::auth::Principal;
use crate::domain::{TriggerId, TriggerRunId};
use crate::services::triggers::{
    self, CreateTrigger, Delivery, PatchTrigger, Receipt, Trigger, TriggerRun,
};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_trigger)
        .service(list_triggers)
        .service(get_trigger)
        .service(update_trigger)
        .service(delete_trigger)
        .service(list_trigger_runs);
}

/// The webhook receiver, outside `/v1`.
pub fn configure_public(cfg: &mut ServiceConfig) {
    cfg.service(receive_delivery);
}

/// Create a trigger (owners of the project's team). A `github` or `gitlab` trigger's
/// answer carries its `secret` — shown only here — and `webhook_path`.
#[utoipa::path(tag = "triggers", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateTrigger,
    responses((status = 201, body = Trigger), (status = 200, description = "Replayed", body = Trigger),
        (status = 403, body = Problem), (status = 404, body = Problem), (status = 422, body = Problem)))]
#[post("/triggers")]
async fn create_trigger(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateTrigger>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        triggers::create(ctx, &principal, &body)
    })
    .await
}

/// The triggers of your teams.
#[utoipa::path(tag = "triggers", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Page<Trigger>)))]
#[get("/triggers")]
async fn list_triggers(
    state: web::Data<AppState>,
    principal: Principal,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Trigger>>> {
    let after: Option<TriggerId> = page.after()?;
    let items = triggers::list(&state.services, &principal, after, page.limit() + 1).await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |t: &Trigger| t.id.to_string(),
    )))
}

#[utoipa::path(tag = "triggers", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Trigger), (status = 404, body = Problem)))]
#[get("/triggers/{id}")]
async fn get_trigger(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Trigger>> {
    let id: TriggerId = parse_id(&id, "trigger")?;
    Ok(web::Json(
        triggers::get(&state.services, &principal, id).await?,
    ))
}

/// Change a trigger: the fields given change. A new schedule (or one enabled again)
/// starts from now.
#[utoipa::path(tag = "triggers", security(("bearer" = [])), params(("id" = String, Path)),
    request_body = PatchTrigger,
    responses((status = 200, body = Trigger), (status = 403, body = Problem), (status = 404, body = Problem),
        (status = 422, body = Problem)))]
#[patch("/triggers/{id}")]
async fn update_trigger(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<PatchTrigger>,
) -> ApiResult<web::Json<Trigger>> {
    let id: TriggerId = parse_id(&id, "trigger")?;
    Ok(web::Json(
        triggers::update(&state.services, &principal, id, &body).await?,
    ))
}

/// Delete a trigger and its runs; deliveries to it answer 404 from now on.
#[utoipa::path(tag = "triggers", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 403, body = Problem),
        (status = 404, body = Problem)))]
#[delete("/triggers/{id}")]
async fn delete_trigger(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id: TriggerId = parse_id(&id, "trigger")?;
    triggers::delete(&state.services, &principal, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// The trigger's runs, newest first: each delivery or schedule slot and what it did.
#[utoipa::path(tag = "triggers", security(("bearer" = [])), params(("id" = String, Path), PageQuery),
    responses((status = 200, body = Page<TriggerRun>), (status = 404, body = Problem)))]
#[get("/triggers/{id}/runs")]
async fn list_trigger_runs(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<TriggerRun>>> {
    let id: TriggerId = parse_id(&id, "trigger")?;
    let before: Option<TriggerRunId> = page.after()?;
    let items = triggers::runs(&state.services, &principal, id, before, page.limit() + 1).await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |r: &TriggerRun| r.id.to_string(),
    )))
}

/// A forge's webhook event: any JSON object, as the forge documents it.
#[derive(utoipa::ToSchema)]
#[schema(value_type = Object)]
#[allow(dead_code)] // only its schema is used: the body is read as bytes
pub struct ForgeEvent(serde_json::Value);

fn header<'a>(req: &'a HttpRequest, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Receive a GitHub or GitLab webhook delivery for a trigger. Not under `/v1` and without
/// a bearer token: GitHub deliveries must carry `X-Hub-Signature-256` (HMAC-SHA256 of the
/// body with the trigger's secret), GitLab ones `X-Gitlab-Token` (the secret). A new
/// delivery is answered 202 as soon as its run is recorded, before anything is done: the
/// run is `pending` and a worker acts on it (follow it with `GET /v1/triggers/{id}/runs`),
/// or it is `done` as `ignored`, with the reason, when no rule applies. A delivery
/// received before (same `X-GitHub-Delivery`, `X-Gitlab-Event-UUID` or `Idempotency-Key`)
/// answers 200 with the first run and does nothing.
#[utoipa::path(tag = "triggers", params(("id" = String, Path),
        ("X-GitHub-Event" = Option<String>, Header, description = "GitHub's event name"),
        ("X-Hub-Signature-256" = Option<String>, Header, description = "`sha256=` and the hex HMAC-SHA256 of the body"),
        ("X-GitHub-Delivery" = Option<String>, Header, description = "GitHub's delivery id"),
        ("X-Gitlab-Event" = Option<String>, Header, description = "GitLab's event name"),
        ("X-Gitlab-Token" = Option<String>, Header, description = "The trigger's secret"),
        ("X-Gitlab-Event-UUID" = Option<String>, Header, description = "GitLab's delivery id")),
    request_body(content = ForgeEvent, description = "The forge's event, as JSON"),
    responses((status = 202, description = "Received now; acted on afterwards", body = Receipt),
        (status = 200, description = "Received before; nothing was done again", body = Receipt),
        (status = 401, description = "Not signed with the trigger's secret", body = Problem),
        (status = 404, body = Problem), (status = 413, body = Problem)))]
#[post("/hooks/triggers/{id}")]
async fn receive_delivery(
    state: web::Data<AppState>,
    req: HttpRequest,
    id: web::Path<String>,
    mut payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let id: TriggerId = parse_id(&id, "trigger")?;
    let max = state.services.triggers.settings.max_body_bytes;
    let too_large = || {
        ApiError::new(
            actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("a delivery is at most {max} bytes (triggers.max_body_bytes)"),
        )
    };
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|_| too_large())?;
        if body.len() + chunk.len() > max {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    let delivery = Delivery {
        event: header(&req, "x-github-event").or_else(|| header(&req, "x-gitlab-event")),
        signature: header(&req, "x-hub-signature-256"),
        gitlab_token: header(&req, "x-gitlab-token"),
        delivery_id: header(&req, "x-github-delivery")
            .or_else(|| header(&req, "x-gitlab-event-uuid"))
            .or_else(|| header(&req, "idempotency-key")),
        body: &body,
    };
    let (duplicate, run) = triggers::receive(&state.services, id, delivery).await?;
    let receipt = Receipt { duplicate, run };
    Ok(if duplicate {
        HttpResponse::Ok().json(receipt)
    } else {
        HttpResponse::Accepted().json(receipt)
    })
}
