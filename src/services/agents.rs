//! Agents: creation (optionally with a new workspace and a first prompt), prompts,
//! interrupts, mode and model, permissions, close and archive, `wait`, and timeline pages.
//! Live work goes to the runtime; what is at rest is read from the database.

use std::path::PathBuf;
use std::time::Duration;

use actix_web::http::StatusCode;
use serde_json::{Value, json};

use crate::api::agents::{
    Agent, AgentRuntime, CreateAgent, LastTurn, PermissionAnswerBody, WaitResult,
};
use crate::api::error::{ApiError, ApiResult};
use crate::api::workspaces::CreateWorkspace;
use crate::auth::{Principal, Role};
use crate::domain::{
    AgentId, AgentStatus, EventKind, NewEvent, PermissionId, TurnId, UserId, WorkspaceId,
};
use crate::events::NewTeamEvent;
use crate::providers::Availability;
use crate::runtime::{AgentContext, PermissionAnswer, RuntimeError};
use crate::server::AppState;
use crate::store;
use crate::store::agents::AgentRow;

pub fn runtime_error(e: RuntimeError) -> ApiError {
    match e {
        RuntimeError::Busy => ApiError::conflict("agent_busy", e.to_string()),
        RuntimeError::StartFailed(m) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "provider_start_failed",
            format!("the agent could not be started: {m}"),
        ),
        RuntimeError::UnknownProvider(p) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_provider",
            format!("unknown provider `{p}`"),
        ),
        RuntimeError::PermissionNotFound => ApiError::not_found("permission request"),
        RuntimeError::PermissionAlreadyResolved => {
            ApiError::conflict("permission_already_resolved", e.to_string())
        }
        RuntimeError::PermissionExpired(_) => {
            ApiError::conflict("permission_expired", e.to_string())
        }
        RuntimeError::UnknownOption(_) => ApiError::validation("option_id", e.to_string()),
        RuntimeError::BehaviorMismatch { .. } => ApiError::validation("option_id", e.to_string()),
        RuntimeError::NoOptionForBehavior(_) => ApiError::validation("behavior", e.to_string()),
        RuntimeError::Unsupported(m) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unsupported", m)
        }
        RuntimeError::ShuttingDown => ApiError::unavailable("shutting_down", e.to_string()),
        RuntimeError::ActorGone => ApiError::conflict(
            "agent_closed",
            "the agent closed while handling the request; retry",
        ),
        RuntimeError::Store(e) => e.into(),
        RuntimeError::Events(e) => super::write_error(e),
    }
}

fn context(row: &AgentRow) -> AgentContext {
    AgentContext {
        id: row.id.into(),
        team_id: row.team_id,
        project_id: row.project_id,
        workspace_id: row.workspace_id,
        cwd: PathBuf::from(&row.workspace_path),
        provider: row.provider.clone(),
        model: row.model.clone(),
        mode: row.mode.clone(),
        system_prompt: row.system_prompt.clone(),
        mcp_servers: row.mcp_servers.clone(),
        persistence: row.persistence.clone(),
    }
}

pub fn to_agent(state: &AppState, row: AgentRow) -> Agent {
    let snap = state.agents.snapshot(row.id.into());
    let status = snap
        .as_ref()
        .map(|s| s.status)
        .or_else(|| AgentStatus::parse(&row.status))
        .unwrap_or(AgentStatus::Error);
    Agent {
        id: row.id.into(),
        workspace_id: row.workspace_id.into(),
        provider: row.provider,
        model: row.model,
        mode: row.mode,
        title: row.title,
        labels: row.labels,
        status,
        status_reason: row.status_reason,
        last_seq: row.last_seq,
        created_by: row.created_by.map(UserId::from),
        created_at: row.created_at,
        archived_at: row.archived_at,
        pending_permissions: row.pending_permissions,
        runtime: AgentRuntime {
            pid: snap.as_ref().and_then(|s| s.pid),
            provider_session_id: snap
                .and_then(|s| s.provider_session_id)
                .or(row.provider_session_id),
        },
    }
}

pub async fn load(state: &AppState, principal: &Principal, id: AgentId) -> ApiResult<AgentRow> {
    let teams = principal.visible_teams();
    store::agents::get(&state.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))
}

fn check_prompt(state: &AppState, field: &str, text: &str) -> ApiResult<()> {
    if text.trim().is_empty() {
        return Err(ApiError::validation(field, "must not be empty"));
    }
    if text.len() > state.settings.limits.max_prompt_bytes {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "prompt_too_large",
            format!(
                "the prompt is {} bytes; the limit is {}",
                text.len(),
                state.settings.limits.max_prompt_bytes
            ),
        ));
    }
    Ok(())
}

pub async fn create(
    state: &AppState,
    principal: &Principal,
    body: &CreateAgent,
) -> ApiResult<(StatusCode, Agent)> {
    let provider = state.agents.registry().get(&body.provider).ok_or_else(|| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_provider",
            format!("unknown provider `{}`", body.provider),
        )
    })?;
    if let Availability::Unavailable(reason) = provider.availability().await {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "provider_unavailable",
            format!("provider `{}` is unavailable: {reason}", body.provider),
        ));
    }
    if let Some(p) = &body.prompt {
        check_prompt(state, "prompt", p)?;
    }
    if let Some(t) = &body.title {
        crate::services::projects::validate_name("title", t)?;
    }
    if !body.labels.is_object() {
        return Err(ApiError::validation(
            "labels",
            "must be an object of string values",
        ));
    }
    if body.labels.as_object().is_some_and(|m| {
        m.len() > 50
            || m.iter()
                .any(|(k, v)| k.is_empty() || k.len() > 100 || !v.is_string())
    }) {
        return Err(ApiError::validation(
            "labels",
            "at most 50 labels; keys 1 to 100 characters; values strings",
        ));
    }
    if !body.mcp_servers.is_object() {
        return Err(ApiError::validation(
            "mcp_servers",
            "must be an object keyed by server name",
        ));
    }
    if let Some(mode) = &body.mode {
        let info = provider.info();
        if !info.modes.is_empty() && !info.modes.iter().any(|m| &m.id == mode) {
            return Err(ApiError::validation(
                "mode",
                format!("`{mode}` is not a mode of `{}`", body.provider),
            ));
        }
    }
    let workspace = match (&body.workspace_id, &body.workspace) {
        (Some(_), Some(_)) => {
            return Err(ApiError::validation(
                "workspace",
                "give workspace_id or workspace, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::validation(
                "workspace_id",
                "required (or `workspace` to create one)",
            ));
        }
        (Some(id), None) => crate::services::workspaces::get(state, principal, *id).await?,
        (None, Some(spec)) => {
            let create = CreateWorkspace {
                project_id: spec.project_id,
                kind: None,
                base_ref: spec.base_ref.clone(),
                branch: spec.branch.clone(),
                title: body.title.clone(),
            };
            let (_, ws) = crate::services::workspaces::create(state, principal, &create).await?;
            crate::services::workspaces::get(state, principal, ws.id).await?
        }
    };
    principal.require(workspace.team_id, Role::Member, "workspace")?;
    if workspace.archived_at.is_some() {
        return Err(ApiError::conflict(
            "workspace_archived",
            "the workspace is archived",
        ));
    }
    let id = AgentId::new();
    store::agents::insert(
        &state.pool,
        store::agents::NewAgent {
            id: id.uuid(),
            workspace_id: workspace.id,
            team_id: workspace.team_id,
            provider: &body.provider,
            model: body.model.as_deref(),
            mode: body
                .mode
                .as_deref()
                .or(provider.info().default_mode.as_deref()),
            title: body.title.as_deref(),
            labels: &body.labels,
            system_prompt: body.system_prompt.as_deref(),
            mcp_servers: &body.mcp_servers,
            created_by: principal.user_id,
        },
    )
    .await?;
    super::announce(state, NewTeamEvent {
                team_id: workspace.team_id,
                project_id: Some(workspace.project_id),
                workspace_id: Some(workspace.id),
                kind: "agent_created",
                data: json!({"agent_id": id, "workspace_id": WorkspaceId::from(workspace.id), "provider": body.provider}),
            }).await?;
    let row = store::agents::get(&state.pool, id.uuid(), None)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))?;
    // Start the session (and the first prompt, queued behind it). A provider that fails to
    // start leaves the agent in `error` with the reason in its timeline; it is still created.
    match state
        .agents
        .start(&context(&row), body.prompt.clone())
        .await
    {
        Ok(_) | Err(RuntimeError::StartFailed(_) | RuntimeError::ActorGone) => {}
        Err(e) => return Err(runtime_error(e)),
    }
    let row = store::agents::get(&state.pool, id.uuid(), None)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))?;
    Ok((StatusCode::CREATED, to_agent(state, row)))
}

pub async fn prompt(
    state: &AppState,
    principal: &Principal,
    id: AgentId,
    text: String,
    client_message_id: Option<String>,
) -> ApiResult<TurnId> {
    check_prompt(state, "text", &text)?;
    if client_message_id
        .as_ref()
        .is_some_and(|c| c.is_empty() || c.len() > 200)
    {
        return Err(ApiError::validation(
            "client_message_id",
            "must be 1 to 200 characters",
        ));
    }
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    if row.archived_at.is_some() {
        return Err(ApiError::conflict(
            "agent_archived",
            "the agent is archived",
        ));
    }
    state
        .agents
        .prompt(&context(&row), text, client_message_id)
        .await
        .map_err(runtime_error)
}

pub async fn interrupt(state: &AppState, principal: &Principal, id: AgentId) -> ApiResult<()> {
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    state.agents.interrupt(id).await;
    Ok(())
}

pub async fn set_mode(
    state: &AppState,
    principal: &Principal,
    id: AgentId,
    mode: String,
) -> ApiResult<Agent> {
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    if let Some(p) = state.agents.registry().get(&row.provider) {
        let modes = p.info().modes;
        if !modes.is_empty() && !modes.iter().any(|m| m.id == mode) {
            return Err(ApiError::validation(
                "mode",
                format!("`{mode}` is not a mode of `{}`", row.provider),
            ));
        }
    }
    if !state
        .agents
        .set_mode(id, mode.clone())
        .await
        .map_err(runtime_error)?
    {
        store::agents::set_mode(&state.pool, row.id, &mode).await?;
        record(state, id, EventKind::ModeChanged, json!({"mode": mode})).await?;
    }
    reload(state, id).await
}

pub async fn set_model(
    state: &AppState,
    principal: &Principal,
    id: AgentId,
    model: String,
) -> ApiResult<Agent> {
    if model.trim().is_empty() || model.len() > 200 {
        return Err(ApiError::validation("model", "must be 1 to 200 characters"));
    }
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    if !state
        .agents
        .set_model(id, model.clone())
        .await
        .map_err(runtime_error)?
    {
        store::agents::set_model(&state.pool, row.id, &model).await?;
        record(state, id, EventKind::ModelChanged, json!({"model": model})).await?;
    }
    reload(state, id).await
}

async fn record(state: &AppState, id: AgentId, kind: EventKind, data: Value) -> ApiResult<()> {
    state
        .writer
        .append_committed(
            vec![NewEvent {
                agent_id: id,
                turn_id: None,
                kind,
                data,
            }],
            Vec::new(),
        )
        .await
        .map_err(super::write_error)?;
    Ok(())
}

async fn reload(state: &AppState, id: AgentId) -> ApiResult<Agent> {
    let row = store::agents::get(&state.pool, id.uuid(), None)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))?;
    Ok(to_agent(state, row))
}

pub async fn close(state: &AppState, principal: &Principal, id: AgentId) -> ApiResult<Agent> {
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    state.agents.close(id, "closed by request").await;
    reload(state, id).await
}

pub async fn archive(state: &AppState, principal: &Principal, id: AgentId) -> ApiResult<()> {
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    state.agents.close(id, "archived").await;
    if row.archived_at.is_none() {
        store::agents::mark_archived(&state.pool, row.id).await?;
        super::announce(
            state,
            NewTeamEvent {
                team_id: row.team_id,
                project_id: Some(row.project_id),
                workspace_id: Some(row.workspace_id),
                kind: "agent_archived",
                data: json!({"agent_id": id}),
            },
        )
        .await?;
    }
    Ok(())
}

pub async fn answer_permission(
    state: &AppState,
    principal: &Principal,
    id: AgentId,
    request: PermissionId,
    body: PermissionAnswerBody,
) -> ApiResult<()> {
    let row = load(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "agent")?;
    let answer = PermissionAnswer {
        behavior: body.behavior,
        option_id: body.option_id,
        message: body.message,
        updated_input: body.updated_input,
        resolved_by: principal.user_id,
    };
    match state.agents.answer(id, request, answer).await {
        Some(r) => r.map_err(runtime_error),
        None => {
            // No live agent: the request is resolved, expired, or never existed.
            match store::permissions::get(&state.pool, row.id, request.uuid()).await? {
                None => Err(ApiError::not_found("permission request")),
                Some(p) if p.status == "resolved" => {
                    Err(runtime_error(RuntimeError::PermissionAlreadyResolved))
                }
                Some(_) => Err(ApiError::conflict(
                    "permission_expired",
                    "the agent is closed; this request expired before it was answered",
                )),
            }
        }
    }
}

pub async fn wait(
    state: &AppState,
    principal: &Principal,
    id: AgentId,
    timeout: Duration,
) -> ApiResult<WaitResult> {
    load(state, principal, id).await?;
    let settled = |s: AgentStatus| !matches!(s, AgentStatus::Running | AgentStatus::Starting);
    let mut timed_out = false;
    if let Some(mut rx) = state.agents.watch(id) {
        let mut shutdown = state.shutdown.clone();
        let done = async {
            loop {
                if settled(rx.borrow_and_update().status) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            _ = done => {}
            _ = tokio::time::sleep(timeout) => timed_out = true,
            _ = crate::server::stopping(&mut shutdown) => {}
        }
    }
    let row = store::agents::get(&state.pool, id.uuid(), None)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))?;
    let agent = to_agent(state, row.clone());
    let pending = store::permissions::list(&state.pool, row.id, Some("pending")).await?;
    Ok(WaitResult {
        status: agent.status,
        timed_out: timed_out && !settled(agent.status),
        last_turn: row.last_turn_id.map(|t| LastTurn {
            turn_id: t.into(),
            outcome: row.last_turn_outcome.clone(),
            error: row.last_turn_error.clone(),
        }),
        pending_permissions: pending
            .into_iter()
            .map(crate::api::agents::PermissionView::from)
            .collect(),
    })
}
