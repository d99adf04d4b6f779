//! Agents: create, list, prompt, interrupt, mode/model, close, archive, wait, timeline
//! pages and permission requests.

use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, delete, get, post, put, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{AgentEvent, AgentId, AgentStatus, MessageId, PermissionId, WorkspaceId};
use crate::services::agents::{
    self, Agent, AgentFilter as Filter, CreateAgent, ModeBody, ModelBody, PermissionAnswerBody,
    PermissionList, PermissionStatus, PermissionView, PromptBody, TimelineFrom, TurnAccepted,
    WaitResult,
};
use crate::services::queue::{self, MessageState, QueueView, QueuedMessageList};
use crate::services::streams::Guard;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_agent)
        .service(list_agents)
        .service(get_agent)
        .service(send_message)
        .service(list_messages)
        .service(cancel_message)
        .service(show_queue)
        .service(interrupt_agent)
        .service(set_mode)
        .service(set_model)
        .service(close_agent)
        .service(archive_agent)
        .service(wait_agent)
        .service(timeline)
        .service(list_permissions)
        .service(answer_permission);
}

/// Open an agent in a workspace (or a new worktree), optionally with a first prompt.
/// 429 when the team or the workspace has spent its budget (`budget_exhausted`) or a
/// count limit is reached (`limit_reached`, and the child-agent limits).
#[utoipa::path(tag = "agents", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateAgent,
    responses((status = 201, body = Agent), (status = 200, description = "Replayed", body = Agent),
        (status = 404, body = Problem), (status = 409, body = Problem), (status = 422, body = Problem),
        (status = 429, body = Problem)))]
#[post("/agents")]
async fn create_agent(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateAgent>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        agents::create(ctx, &principal, &body)
    })
    .await
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AgentFilter {
    pub workspace_id: Option<String>,
    pub status: Option<String>,
    /// `key:value`; only agents with that label.
    pub label: Option<String>,
    pub include_archived: Option<bool>,
    /// Only the agents this agent created (its children).
    pub parent_agent_id: Option<String>,
}

#[utoipa::path(tag = "agents", security(("bearer" = [])), params(AgentFilter, PageQuery),
    responses((status = 200, body = Page<Agent>, example = json!({"items": [{"id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "workspace_id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "provider": "mock", "model": "mock-small", "mode": "default", "title": null, "labels": {"ci_run": "1234"}, "status": "idle", "status_reason": null, "last_seq": 12, "created_by": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "created_at": "2026-11-30T12:00:00Z", "archived_at": null, "pending_permissions": 0, "runtime": {"pid": 4242, "provider_session_id": "3b1f0c2e"}}], "next_cursor": null})), (status = 400, body = Problem)))]
#[get("/agents")]
async fn list_agents(
    state: web::Data<AppState>,
    principal: Principal,
    filter: web::Query<AgentFilter>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Agent>>> {
    let workspace: Option<WorkspaceId> = filter
        .workspace_id
        .as_deref()
        .map(|w| parse_id(w, "workspace"))
        .transpose()?;
    let status = match &filter.status {
        None => None,
        Some(s) => Some(AgentStatus::parse(s).ok_or_else(|| {
            ApiError::bad_request("invalid_query", format!("unknown status `{s}`"))
        })?),
    };
    let label = match &filter.label {
        None => None,
        Some(l) => {
            let (k, v) = l.split_once(':').ok_or_else(|| {
                ApiError::bad_request("invalid_query", "label must be `key:value`")
            })?;
            Some((k.to_owned(), v.to_owned()))
        }
    };
    let parent: Option<AgentId> = filter
        .parent_agent_id
        .as_deref()
        .map(|a| parse_id(a, "agent"))
        .transpose()?;
    let after: Option<AgentId> = page.after()?;
    let filter = Filter {
        workspace_id: workspace,
        status,
        label,
        include_archived: filter.include_archived.unwrap_or(false),
        parent_agent_id: parent,
    };
    let items = agents::list(
        &state.services,
        &principal,
        &filter,
        after,
        page.limit() + 1,
    )
    .await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |a: &Agent| a.id.to_string(),
    )))
}

#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Agent), (status = 404, body = Problem)))]
#[get("/agents/{id}")]
async fn get_agent(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Agent>> {
    let id: AgentId = parse_id(&id, "agent")?;
    Ok(web::Json(
        agents::get(&state.services, &principal, id).await?,
    ))
}

/// Send a prompt; a closed agent is reopened first. While a turn runs, or while the
/// running-turn limits are reached, the message is queued (202 with `queued: true` and a
/// `message_id`) and starts on its own; with `"queue": false` it is refused instead (409
/// `agent_busy`, 429 `limit_reached`). `"interrupt": true` interrupts the running turn and
/// sends this message next.
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path)), request_body = PromptBody,
    responses((status = 202, body = TurnAccepted, examples(
            ("started" = (value = json!({"turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "queued": false}))),
            ("queued" = (value = json!({"queued": true, "message_id": "msg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
                "position": 1, "reason": "agent_busy"}))))),
        (status = 404, body = Problem), (status = 409, body = Problem),
        (status = 413, body = Problem), (status = 429, body = Problem)))]
#[post("/agents/{id}/messages")]
async fn send_message(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<PromptBody>,
) -> ApiResult<HttpResponse> {
    let id: AgentId = parse_id(&id, "agent")?;
    let accepted: TurnAccepted =
        agents::prompt(&state.services, &principal, id, body.into_inner()).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MessageFilter {
    /// `queued`, `started`, `canceled` or `failed`; all when absent.
    pub state: Option<String>,
}

/// The agent's queued messages (and those that left the queue), waiting ones first in the
/// order they run.
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path), MessageFilter),
    responses((status = 200, body = QueuedMessageList), (status = 400, body = Problem), (status = 404, body = Problem)))]
#[get("/agents/{id}/messages")]
async fn list_messages(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    q: web::Query<MessageFilter>,
) -> ApiResult<web::Json<QueuedMessageList>> {
    let id: AgentId = parse_id(&id, "agent")?;
    let filter = match &q.state {
        None => None,
        Some(s) => Some(MessageState::parse(s).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_query",
                "state is queued, started, canceled or failed",
            )
        })?),
    };
    Ok(web::Json(
        queue::list(&state.services, &principal, id, filter).await?,
    ))
}

/// Cancel a queued message. One that already started (or was canceled): 409
/// `message_not_queued`.
#[utoipa::path(tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path), ("message_id" = String, Path)),
    responses((status = 204, description = "Canceled"), (status = 404, body = Problem), (status = 409, body = Problem)))]
#[delete("/agents/{id}/messages/{message_id}")]
async fn cancel_message(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
) -> ApiResult<HttpResponse> {
    let (id, mid) = path.into_inner();
    let id: AgentId = parse_id(&id, "agent")?;
    let mid: MessageId = parse_id(&mid, "message")?;
    queue::cancel(&state.services, &principal, id, mid).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// What waits for a running-turn slot or for its agent, in the order it is served, and
/// why; with the turns running per team (the caller's teams; a server admin sees all).
#[utoipa::path(tag = "agents", security(("bearer" = [])),
    responses((status = 200, body = QueueView)))]
#[get("/queue")]
async fn show_queue(
    state: web::Data<AppState>,
    principal: Principal,
) -> ApiResult<web::Json<QueueView>> {
    Ok(web::Json(queue::show(&state.services, &principal).await?))
}

/// Interrupt the running turn; it ends with outcome `canceled`.
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 202, description = "Interrupt sent"), (status = 404, body = Problem)))]
#[post("/agents/{id}/interrupt")]
async fn interrupt_agent(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id: AgentId = parse_id(&id, "agent")?;
    agents::interrupt(&state.services, &principal, id).await?;
    Ok(HttpResponse::Accepted().finish())
}

#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path)), request_body = ModeBody,
    responses((status = 200, body = Agent), (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/agents/{id}/mode")]
async fn set_mode(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<ModeBody>,
) -> ApiResult<web::Json<Agent>> {
    let id: AgentId = parse_id(&id, "agent")?;
    Ok(web::Json(
        agents::set_mode(&state.services, &principal, id, body.into_inner().mode).await?,
    ))
}

#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path)), request_body = ModelBody,
    responses((status = 200, body = Agent), (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/agents/{id}/model")]
async fn set_model(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<ModelBody>,
) -> ApiResult<web::Json<Agent>> {
    let id: AgentId = parse_id(&id, "agent")?;
    Ok(web::Json(
        agents::set_model(&state.services, &principal, id, body.into_inner().model).await?,
    ))
}

/// Stop the agent's process; the agent stays resumable (the next prompt reopens it).
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Agent), (status = 404, body = Problem)))]
#[post("/agents/{id}/close")]
async fn close_agent(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Agent>> {
    let id: AgentId = parse_id(&id, "agent")?;
    Ok(web::Json(
        agents::close(&state.services, &principal, id).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ArchiveQuery {
    /// `archive` (the default): the agents it created, and theirs, are archived with it;
    /// `keep`: they are left as they are.
    pub children: Option<String>,
}

/// Archive: close the agent and hide it from default lists; the timeline is kept. Its
/// children (the agents it created, down the tree) are archived with it unless
/// `?children=keep`. An archived agent's own token stops working.
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path), ArchiveQuery),
    responses((status = 204, description = "Archived"), (status = 400, body = Problem), (status = 404, body = Problem)))]
#[delete("/agents/{id}")]
async fn archive_agent(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    query: web::Query<ArchiveQuery>,
) -> ApiResult<HttpResponse> {
    let id: AgentId = parse_id(&id, "agent")?;
    let keep = match query.children.as_deref() {
        None | Some("archive") => false,
        Some("keep") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("children must be `archive` or `keep`, not `{other}`"),
            ));
        }
    };
    agents::archive(&state.services, &principal, id, keep).await?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WaitQuery {
    /// Seconds to wait at most (default 600, or 60 for the MCP tool `wait_for_agent`;
    /// capped by the server's `limits.max_wait_s`).
    pub timeout_s: Option<u64>,
}

/// Long-poll until the agent is neither `running` nor `starting` (or the timeout passes).
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path), WaitQuery),
    responses((status = 200, body = WaitResult), (status = 404, body = Problem)))]
#[get("/agents/{id}/wait")]
async fn wait_agent(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    id: web::Path<String>,
    q: web::Query<WaitQuery>,
) -> ApiResult<web::Json<WaitResult>> {
    let id: AgentId = parse_id(&id, "agent")?;
    let timeout = Duration::from_secs(q.timeout_s.unwrap_or(600));
    // The wait ends as soon as its caller may no longer read the agent.
    let guard = Guard::for_agent(&state.services, id, super::sse::recheck(&req));
    tokio::select! {
        done = agents::wait(&state.services, &principal, id, timeout) => Ok(web::Json(done?)),
        ending = guard.ended() => Err(super::sse::ending_error(ending)),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TimelineQuery {
    /// Oldest first, starting after this seq.
    pub after_seq: Option<i64>,
    /// Newest first, starting before this seq (for a tail).
    pub before_seq: Option<i64>,
    /// Events per page (default 100, at most 1000; pages also stop at 4 MiB).
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page: continues in the same direction.
    pub cursor: Option<String>,
}

/// A page of the agent's durable timeline.
#[utoipa::path(tag = "agents", security(("bearer" = [])), params(("id" = String, Path), TimelineQuery),
    responses((status = 200, body = Page<AgentEvent>, example = json!({"items": [{"seq": 4, "agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "at": "2026-11-30T12:00:00Z", "kind": "turn_started", "data": {"turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c"}}, {"seq": 5, "agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "at": "2026-11-30T12:00:00Z", "kind": "user_message", "data": {"message_id": "msg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "text": "hello"}}], "next_cursor": "a5"})), (status = 400, body = Problem), (status = 404, body = Problem)))]
#[get("/agents/{id}/timeline")]
async fn timeline(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    q: web::Query<TimelineQuery>,
) -> ApiResult<web::Json<Page<AgentEvent>>> {
    let id: AgentId = parse_id(&id, "agent")?;
    Ok(web::Json(
        timeline_page(&state.services, &principal, id, &q).await?,
    ))
}

/// The page `q` asks for (also the MCP tool `get_timeline`).
pub(super) async fn timeline_page(
    ctx: &crate::services::ServiceContext,
    principal: &Principal,
    id: AgentId,
    q: &TimelineQuery,
) -> ApiResult<Page<AgentEvent>> {
    let limit = i64::from(q.limit.unwrap_or(100).clamp(1, 1000));
    let bad_cursor = || {
        ApiError::bad_request(
            "invalid_cursor",
            "the cursor is not one this timeline returned",
        )
    };
    let (forward, from) = match (&q.cursor, q.after_seq, q.before_seq) {
        (Some(c), None, None) => {
            let (forward, n) = match (c.strip_prefix('a'), c.strip_prefix('b')) {
                (Some(n), _) => (true, n),
                (_, Some(n)) => (false, n),
                _ => return Err(bad_cursor()),
            };
            (forward, n.parse().map_err(|_| bad_cursor())?)
        }
        (None, after, None) => (true, after.unwrap_or(0)),
        (None, None, Some(before)) => (false, before),
        _ => {
            return Err(ApiError::bad_request(
                "invalid_query",
                "use one of after_seq, before_seq or cursor",
            ));
        }
    };
    let from = if forward {
        TimelineFrom::After(from)
    } else {
        TimelineFrom::Before(from)
    };
    let page = agents::timeline(ctx, principal, id, from, limit).await?;
    let items = page.items;
    let next_cursor = if page.more {
        items
            .last()
            .map(|e: &AgentEvent| format!("{}{}", if forward { "a" } else { "b" }, e.seq))
    } else {
        None
    };
    Ok(Page { items, next_cursor })
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PermissionFilter {
    /// `pending`, `resolved` or `expired`.
    pub status: Option<String>,
}

#[utoipa::path(tag = "permissions", security(("bearer" = [])), params(("id" = String, Path), PermissionFilter),
    responses((status = 200, body = PermissionList, example = json!({"items": [{"request_id": "perm_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "kind": "tool", "title": "deploy?", "call_id": "call_1", "input": {"title": "deploy?"}, "options": [{"id": "allow", "label": "Allow", "behavior": "allow"}, {"id": "deny", "label": "Deny", "behavior": "deny"}], "status": "pending", "resolution": null, "created_at": "2026-11-30T12:00:00Z", "resolved_at": null, "resolved_by": null}]})), (status = 404, body = Problem)))]
#[get("/agents/{id}/permissions")]
async fn list_permissions(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    q: web::Query<PermissionFilter>,
) -> ApiResult<web::Json<PermissionList>> {
    let id: AgentId = parse_id(&id, "agent")?;
    let status = match &q.status {
        None => None,
        Some(s) => Some(PermissionStatus::parse(s).ok_or_else(|| {
            ApiError::bad_request("invalid_query", "status is pending, resolved or expired")
        })?),
    };
    Ok(web::Json(
        agents::list_permissions(&state.services, &principal, id, status).await?,
    ))
}

/// Answer a permission request. Twice: 409 `permission_already_resolved`; after its turn
/// ended or its agent closed: 409 `permission_expired`.
#[utoipa::path(tag = "permissions", security(("bearer" = [])),
    params(("id" = String, Path), ("request_id" = String, Path)), request_body = PermissionAnswerBody,
    responses((status = 200, body = PermissionView), (status = 404, body = Problem), (status = 409, body = Problem),
        (status = 422, body = Problem)))]
#[post("/agents/{id}/permissions/{request_id}")]
async fn answer_permission(
    state: web::Data<AppState>,
    principal: Principal,
    path: web::Path<(String, String)>,
    body: web::Json<PermissionAnswerBody>,
) -> ApiResult<web::Json<PermissionView>> {
    let (id, request) = path.into_inner();
    let id: AgentId = parse_id(&id, "agent")?;
    let request: PermissionId = parse_id(&request, "permission request")?;
    Ok(web::Json(
        agents::answer_permission(&state.services, &principal, id, request, body.into_inner())
            .await?,
    ))
}
