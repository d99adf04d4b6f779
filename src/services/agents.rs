//! Agents: creation (optionally with a new workspace and a first prompt), lists, prompts,
//! interrupts, mode and model, permissions, close and archive, `wait`, and timeline pages.
//! Live work goes to the runtime; what is at rest is read from the database.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::audit::{self, Action, Entry};
use super::hooks::{self, Answering, Subject};
use super::workspaces::{CreateWorkspace, WorkspaceKind};
use super::{Data, ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::domain::{
    AgentEvent, AgentId, AgentStatus, Behavior, EventKind, HookEvent, NewEvent, PermissionId,
    ProjectId, SecretEnv, TurnId, UserId, WorkspaceId,
};
use crate::events::{Attached, Fence, NewTeamEvent, StateChange};
use crate::providers::Availability;
use crate::runtime::{AgentContext, PermissionAnswer, RuntimeError};
use crate::store;
use crate::store::agents::AgentRow;

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewWorkspaceSpec {
    pub project_id: ProjectId,
    pub base_ref: Option<String>,
    pub branch: Option<String>,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"workspace_id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "provider": "mock",
    "labels": {"ci_run": "1234"}, "prompt": "hello"}))]
pub struct CreateAgent {
    pub workspace_id: Option<WorkspaceId>,
    /// Create a new worktree workspace in the same call (instead of `workspace_id`).
    pub workspace: Option<NewWorkspaceSpec>,
    pub provider: String,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub title: Option<String>,
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    pub labels: Value,
    /// A first prompt, started as soon as the session is up.
    pub prompt: Option<String>,
    pub system_prompt: Option<String>,
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    pub mcp_servers: Value,
    /// Caps over the agent's life (cost, turns, wall time): a turn that crosses one is
    /// interrupted, and the agent takes no more prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<super::usage::AgentCaps>,
    /// Give the agent agentry's own MCP server (`agentry`, with a token of the agent's
    /// own) at each launch: true unless set to false here, or turned off for the team
    /// (`PUT /v1/teams/{id}/agentry-mcp`). Providers without MCP support never get it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agentry_mcp: Option<bool>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AgentRuntime {
    /// The provider process's pid while one runs.
    pub pid: Option<u32>,
    pub provider_session_id: Option<String>,
    /// The id of the replica running the agent, or null when none does.
    pub replica: Option<String>,
    /// Under `[sandbox] network = "proxy"`, while the agent's process runs: the
    /// connections the egress proxy allowed it since the process started, by host (at
    /// most 512 hosts counted). Null otherwise.
    pub egress_hosts: Option<std::collections::BTreeMap<String, u64>>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "workspace_id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
    "provider": "mock", "model": "mock-small", "mode": "default", "title": null, "labels": {"ci_run": "1234"},
    "status": "idle", "status_reason": null, "last_seq": 12, "created_by": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d",
    "created_at": "2026-11-30T12:00:00Z", "archived_at": null, "pending_permissions": 0,
    "runtime": {"pid": 4242, "provider_session_id": "3b1f…", "replica": "node-1-5f2c9a1e",
        "egress_hosts": null}}))]
pub struct Agent {
    pub id: AgentId,
    pub workspace_id: WorkspaceId,
    pub provider: String,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub title: Option<String>,
    #[schema(value_type = Object)]
    pub labels: Value,
    pub status: AgentStatus,
    pub status_reason: Option<String>,
    pub last_seq: i64,
    pub created_by: Option<UserId>,
    pub created_at: DateTime<Utc>,
    pub archived_at: Option<DateTime<Utc>>,
    pub pending_permissions: i64,
    pub runtime: AgentRuntime,
    /// The agent whose token created this one (through the API or agentry's MCP server);
    /// null for an agent a person or a bot created.
    pub parent_agent_id: Option<AgentId>,
    /// How far below a root agent it is: 0 for a root, its parent's depth plus one.
    pub depth: i32,
    /// The agents it created.
    pub children: ChildCounts,
    /// It is given agentry's MCP server at launch (unless its team turned that off or its
    /// provider has no MCP support).
    pub agentry_mcp: bool,
    /// Its messages that wait, when any does. While its next message waits for a
    /// running-turn slot, `status` is `queued` and `queue.position` its place in the fair
    /// order (1 starts next).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<super::queue::AgentQueue>,
}

/// How many agents an agent created.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ChildCounts {
    /// Those not archived.
    pub live: i64,
    /// All of them, archived or not.
    pub total: i64,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"text": "/ask deploy?", "client_message_id": "ci-42-1"}))]
pub struct PromptBody {
    pub text: String,
    pub client_message_id: Option<String>,
    /// While a turn runs (or the running-turn limits are reached), queue the message
    /// (default) or refuse it: `false` answers 409 `agent_busy` (429 `limit_reached`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<bool>,
    /// Steer: interrupt the running turn and send this message next, before the other
    /// queued ones.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interrupt: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "queued": false}))]
pub struct TurnAccepted {
    /// The turn the message started; absent when it was queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<TurnId>,
    /// The message waits (its agent runs a turn, or the running-turn limits are
    /// reached); it starts on its own (`GET /v1/agents/{id}/messages?state=queued`).
    #[serde(default)]
    pub queued: bool,
    /// The queued message's id (to cancel it: `DELETE /v1/agents/{id}/messages/{message_id}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<crate::domain::MessageId>,
    /// The queued message's place among its agent's waiting messages (1 runs next).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<i64>,
    /// Why it waits: `agent_busy` or `capacity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"mode": "unattended"}))]
pub struct ModeBody {
    pub mode: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"model": "mock-large"}))]
pub struct ModelBody {
    pub model: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct LastTurn {
    pub turn_id: TurnId,
    /// `completed`, `failed`, `canceled`; null while it runs.
    pub outcome: Option<String>,
    pub error: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"status": "idle", "timed_out": false,
    "last_turn": {"turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "outcome": "completed", "error": null},
    "pending_permissions": []}))]
pub struct WaitResult {
    pub status: AgentStatus,
    pub timed_out: bool,
    pub last_turn: Option<LastTurn>,
    pub pending_permissions: Vec<PermissionView>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PermissionView {
    pub request_id: PermissionId,
    pub kind: String,
    pub title: String,
    pub call_id: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
    #[schema(value_type = Vec<crate::domain::PermissionOption>)]
    pub options: Value,
    /// `pending`, `resolved` or `expired`.
    pub status: String,
    #[schema(value_type = Option<Object>)]
    pub resolution: Option<Value>,
    pub created_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolved_by: Option<UserId>,
}

impl From<store::permissions::PermissionRow> for PermissionView {
    fn from(r: store::permissions::PermissionRow) -> Self {
        Self {
            request_id: r.id.into(),
            kind: r.kind,
            title: r.title,
            call_id: r.call_id,
            input: r.input,
            options: r.options,
            status: r.status,
            resolution: r.resolution,
            created_at: r.created_at,
            resolved_at: r.resolved_at,
            resolved_by: r.resolved_by.map(Into::into),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PermissionList {
    pub items: Vec<PermissionView>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"behavior": "allow"}))]
pub struct PermissionAnswerBody {
    pub behavior: Behavior,
    /// A specific option; without it, the first option of `behavior`.
    pub option_id: Option<String>,
    pub message: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub updated_input: Option<Value>,
}

/// What the runtime needs to run the agent; `secret_env` is what its provider takes from
/// the team's secrets (see `team_env`).
fn context(row: &AgentRow, secret_env: SecretEnv) -> AgentContext {
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
        // Filled in by a launch (resolved and opened); a live agent does not need them.
        mcp_servers: json!({}),
        persistence: row.persistence.clone(),
        secret_env,
        // Filled in by a launch when the sandbox uses the egress proxy.
        egress_allow: None,
        // Filled in by a launch that gives the agent agentry's MCP server.
        agentry_token: None,
    }
}

/// The egress allow list of the agent of `row` for this launch, when its sandbox uses the
/// egress proxy: its provider's entries, the server's, and its team's as they are now;
/// with `agentry_mcp` (the launch gives it agentry's MCP server) also this server's
/// `/mcp`, a loopback forward when it is on loopback.
async fn egress_allow(
    ctx: &ServiceContext,
    row: &AgentRow,
    agentry_mcp: bool,
) -> ServiceResult<Option<crate::egress::AllowList>> {
    if !ctx.fleet.agents.uses_egress() {
        return Ok(None);
    }
    let mut list = super::network::agent_allow_list(
        &ctx.data,
        &ctx.fleet.egress_policy,
        row.team_id,
        &row.provider,
    )
    .await?;
    if agentry_mcp && let Some(entry) = ctx.fleet.agentry_mcp_url.as_deref().and_then(mcp_entry) {
        list.forward_loopback([entry]);
    }
    Ok(Some(list))
}

/// The allow-list entry of the server's `/mcp` URL: its host and port.
fn mcp_entry(url: &str) -> Option<crate::egress::AllowEntry> {
    let url = url::Url::parse(url).ok()?;
    let port = url.port_or_known_default()?;
    crate::egress::AllowEntry::parse(&format!("{}:{port}", url.host_str()?)).ok()
}

/// The team secrets `provider` takes, opened for an agent of `team`; a secret that is not
/// set, or cannot be decrypted, makes the provider unavailable (422 at the edge).
async fn team_env(
    ctx: &ServiceContext,
    provider: &str,
    team: uuid::Uuid,
) -> ServiceResult<SecretEnv> {
    super::secrets::launch_env(ctx, provider, team)
        .await?
        .map_err(|reason| ServiceError::ProviderUnavailable {
            provider: provider.to_owned(),
            reason,
        })
}

/// The agent as clients see it: its row, with what the runtime knows of it live.
pub(crate) fn to_agent(ctx: &ServiceContext, row: AgentRow) -> Agent {
    let snap = ctx.fleet.agents.snapshot(row.id.into());
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
        parent_agent_id: row.parent_agent_id.map(AgentId::from),
        depth: row.depth,
        children: ChildCounts {
            live: row.live_children,
            total: row.children,
        },
        agentry_mcp: row.agentry_mcp,
        runtime: AgentRuntime {
            pid: snap.as_ref().and_then(|s| s.pid),
            replica: match &snap {
                Some(_) => Some(ctx.fleet.agents.replica().to_owned()),
                // A closed agent runs nowhere, whatever lease is still being given up.
                None if status == AgentStatus::Closed => None,
                None => row.owner_replica,
            },
            provider_session_id: snap
                .and_then(|s| s.provider_session_id)
                .or(row.provider_session_id),
            egress_hosts: ctx.fleet.agents.egress_counts(row.id.into()),
        },
        queue: None,
    }
}

/// The agent's row, when the caller may see it and its token allows `op`.
async fn load(
    data: &Data,
    principal: &Principal,
    id: AgentId,
    op: Operation,
) -> ServiceResult<AgentRow> {
    principal.authorize(op)?;
    let teams = principal.visible_teams();
    store::agents::get(&data.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or(ServiceError::NotFound("agent"))
}

/// Like `load`, for an operation that drives the agent: it also needs the member role.
async fn load_to_drive(data: &Data, principal: &Principal, id: AgentId) -> ServiceResult<AgentRow> {
    let row = load(data, principal, id, Operation::DriveAgents).await?;
    principal.authorize_in(row.team_id, Operation::DriveAgents, "agent")?;
    Ok(row)
}

/// The caller may read the agent (for its streams and pages).
#[tracing::instrument(name = "services::agents::authorize_read", skip_all, fields(agent_id = %id))]
pub async fn authorize_read(data: &Data, principal: &Principal, id: AgentId) -> ServiceResult<()> {
    load(data, principal, id, Operation::ReadTeam)
        .await
        .map(|_| ())
}

fn check_prompt(ctx: &ServiceContext, field: &'static str, text: &str) -> ServiceResult<()> {
    if text.trim().is_empty() {
        return Err(ServiceError::invalid(field, "must not be empty"));
    }
    if text.len() > ctx.fleet.limits.max_prompt_bytes {
        return Err(ServiceError::PromptTooLarge {
            size: text.len(),
            limit: ctx.fleet.limits.max_prompt_bytes,
        });
    }
    Ok(())
}

/// The checks of a create-agent request that need no team: the provider is known and
/// usable, and every field is acceptable. Returns the provider.
async fn check_create(
    ctx: &ServiceContext,
    body: &CreateAgent,
) -> ServiceResult<std::sync::Arc<dyn crate::providers::Provider>> {
    let provider = ctx
        .fleet
        .agents
        .registry()
        .get(&body.provider)
        .ok_or_else(|| ServiceError::UnknownProvider(body.provider.clone()))?;
    if let Availability::Unavailable(reason) = provider.availability().await {
        return Err(ServiceError::ProviderUnavailable {
            provider: body.provider.clone(),
            reason,
        });
    }
    if let Some(p) = &body.prompt {
        check_prompt(ctx, "prompt", p)?;
    }
    if let Some(t) = &body.title {
        super::projects::validate_name("title", t)?;
    }
    if !body.labels.is_object() {
        return Err(ServiceError::invalid(
            "labels",
            "must be an object of string values",
        ));
    }
    if body.labels.as_object().is_some_and(|m| {
        m.len() > 50
            || m.iter()
                .any(|(k, v)| k.is_empty() || k.len() > 100 || !v.is_string())
    }) {
        return Err(ServiceError::invalid(
            "labels",
            "at most 50 labels; keys 1 to 100 characters; values strings",
        ));
    }
    super::mcp::check(&ctx.fleet.bounds.mcp, &body.mcp_servers)?;
    if body.agentry_mcp != Some(false) && body.mcp_servers.get(AGENTRY_MCP).is_some() {
        return Err(ServiceError::invalid(
            "mcp_servers",
            "`agentry` is the name of agentry's own MCP server; choose another name, or create the agent with `\"agentry_mcp\": false`",
        ));
    }
    if let Some(mode) = &body.mode {
        let info = provider.info();
        if !info.modes.is_empty() && !info.modes.iter().any(|m| &m.id == mode) {
            return Err(ServiceError::invalid(
                "mode",
                format!("`{mode}` is not a mode of `{}`", body.provider),
            ));
        }
    }
    Ok(provider)
}

/// An unattended `mode` (or the provider's default) is refused when agents are not
/// sandboxed here (the host cannot, or `sandbox.mode = "off"`), unless the admin allows it
/// (`sandbox.allow_unconfined_unattended`): nothing runs unattended and unconfined silently.
fn check_confinement(
    ctx: &ServiceContext,
    provider: &dyn crate::providers::Provider,
    mode: Option<&str>,
) -> ServiceResult<()> {
    let Some(sandbox) = ctx.fleet.agents.sandbox() else {
        return Ok(());
    };
    let status = sandbox.status();
    if status.confines() || sandbox.settings().allow_unconfined_unattended {
        return Ok(());
    }
    let info = provider.info();
    let Some(mode) = mode.map(str::to_owned).or(info.default_mode.clone()) else {
        return Ok(());
    };
    if !info.modes.iter().any(|m| m.id == mode && m.unattended) {
        return Ok(());
    }
    Err(ServiceError::SandboxUnavailable {
        mode,
        reason: unconfined_reason(status),
    })
}

/// Why agents are not sandboxed here.
fn unconfined_reason(status: &crate::sandbox::SandboxStatus) -> String {
    match (&status.reason, status.mode) {
        (_, crate::config::SandboxMode::Off) => "sandbox.mode is off".to_owned(),
        (Some(r), _) => r.clone(),
        (None, _) => "unknown".to_owned(),
    }
}

/// An agent of a team that requires the sandbox is neither created nor prompted where
/// agents are not sandboxed (409 `sandbox_required`). Where they are, nothing is read.
async fn check_team_sandbox(ctx: &ServiceContext, team: uuid::Uuid) -> ServiceResult<()> {
    let reason = match ctx.fleet.agents.sandbox() {
        Some(s) if s.status().confines() => return Ok(()),
        Some(s) => unconfined_reason(s.status()),
        None => "no sandbox is configured".to_owned(),
    };
    if store::teams::requires_sandbox(&ctx.data.pool, team).await? {
        return Err(ServiceError::SandboxRequired { reason });
    }
    Ok(())
}

/// The name of agentry's own MCP server among an agent's MCP servers.
pub const AGENTRY_MCP: &str = "agentry";

/// When an agent's token creates an agent: the new agent goes in the caller's own
/// project, within the tree's bounds. Returns the parent and the new agent's depth
/// (`(None, 0)` for a caller that is not an agent).
async fn check_parent(
    ctx: &ServiceContext,
    principal: &Principal,
    team: uuid::Uuid,
    project: uuid::Uuid,
) -> ServiceResult<(Option<uuid::Uuid>, i32)> {
    let Some(caller) = principal.agent else {
        return Ok((None, 0));
    };
    if caller.project_id != project {
        return Err(ServiceError::OutsideAgentProject);
    }
    let parent = store::agents::get(&ctx.data.pool, caller.agent_id, Some(&[team]))
        .await?
        .ok_or(ServiceError::NotFound("agent"))?;
    if parent.archived_at.is_some() {
        return Err(ServiceError::AgentArchived);
    }
    let max_depth = ctx.fleet.limits.max_agent_depth;
    if parent.depth >= max_depth {
        return Err(ServiceError::AgentDepthExceeded { max: max_depth });
    }
    let max = ctx.fleet.limits.max_children_per_agent;
    if store::agents::live_children(&ctx.data.pool, parent.id).await? >= max {
        return Err(ServiceError::AgentChildrenExceeded { max });
    }
    let max = ctx.fleet.limits.max_child_agents_per_team;
    if store::agents::live_team_children(&ctx.data.pool, team).await? >= max {
        return Err(ServiceError::TeamChildrenExceeded { max });
    }
    Ok((Some(parent.id), parent.depth + 1))
}

/// Give the agent of `row` agentry's own MCP server for this launch, when it should have
/// it: a fresh token of kind `agent` (its earlier one revoked) in the server's
/// `Authorization` header, added to `mcp_servers` as `agentry`. The token is stored only
/// as its hash; it is returned so that the agent's events never show it.
async fn give_agentry_mcp(
    ctx: &ServiceContext,
    row: &AgentRow,
    mcp_servers: &mut Value,
) -> ServiceResult<Option<crate::domain::SecretValue>> {
    let (Some(url), Some(creator)) = (&ctx.fleet.agentry_mcp_url, row.created_by) else {
        return Ok(None);
    };
    if !row.agentry_mcp || !provider_takes_mcp(ctx, &row.provider) {
        return Ok(None);
    }
    if !store::teams::agentry_mcp(&ctx.data.pool, row.team_id).await? {
        return Ok(None);
    }
    let role = row
        .creator_role
        .as_deref()
        .and_then(crate::auth::Role::parse)
        .unwrap_or(crate::auth::Role::Member);
    let token = crate::auth::tokens::generate();
    let agent = AgentId::from(row.id);
    super::within_deadline(&ctx.data, async {
        let mut tx = ctx.data.pool.pool().begin().await?;
        store::identity::issue_agent_token(
            &mut tx,
            crate::domain::TokenId::new().uuid(),
            row.id,
            creator,
            row.team_id,
            role.as_str(),
            &format!("agent {agent}"),
            &crate::auth::tokens::shown_prefix(&token),
            &crate::auth::tokens::hash(&token),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    })
    .await?;
    if !mcp_servers.is_object() {
        *mcp_servers = json!({});
    }
    mcp_servers[AGENTRY_MCP] = json!({
        "type": "http",
        "url": url,
        "headers": {"Authorization": format!("Bearer {token}")},
    });
    Ok(Some(crate::domain::SecretValue::new(token)))
}

/// Whether agents of `provider` can be given MCP servers.
fn provider_takes_mcp(ctx: &ServiceContext, provider: &str) -> bool {
    ctx.fleet
        .agents
        .registry()
        .get(provider)
        .is_some_and(|p| p.info().capabilities.mcp_servers)
}

#[tracing::instrument(name = "services::agents::create", skip_all, fields(team_id, agent_id))]
pub async fn create(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateAgent,
) -> ServiceResult<Agent> {
    principal.authorize(Operation::DriveAgents)?;
    check_create(ctx, body).await?;
    // The workspace named, or the spec of one to create, with the team it belongs to. The
    // team's secrets are checked before anything is made: a provider the team cannot use
    // leaves no new workspace behind.
    enum Target<'a> {
        Existing(Box<store::workspaces::WorkspaceRow>),
        New(&'a NewWorkspaceSpec),
    }
    let (existing, team, project) = match (&body.workspace_id, &body.workspace) {
        (Some(_), Some(_)) => {
            return Err(ServiceError::invalid(
                "workspace",
                "give workspace_id or workspace, not both",
            ));
        }
        (None, None) => {
            return Err(ServiceError::invalid(
                "workspace_id",
                "required (or `workspace` to create one)",
            ));
        }
        (Some(id), None) => {
            let ws = super::workspaces::find(&ctx.data, principal, *id).await?;
            let (team, project) = (ws.team_id, ws.project_id);
            (Target::Existing(Box::new(ws)), team, project)
        }
        (None, Some(spec)) => {
            let project = super::projects::find(&ctx.data, principal, spec.project_id).await?;
            (Target::New(spec), project.team_id, project.id)
        }
    };
    principal.authorize_in(team, Operation::DriveAgents, "workspace")?;
    let (parent_agent_id, depth) = check_parent(ctx, principal, team, project).await?;
    check_team_sandbox(ctx, team).await?;
    // `agent.create.before` may change the saved configuration (not where the agent
    // works) and add launch environment; the result is checked like the caller's own.
    // The team's hooks, read once for the three events a create calls or queues.
    let team_hooks = hooks::TeamHooks::load(&ctx.data, team).await?;
    let replaced = create_hooks(ctx, principal, body, (team, project), &team_hooks).await?;
    let (body, create_env) = (&replaced.0, replaced.1);
    let provider = check_create(ctx, body).await?;
    check_confinement(ctx, provider.as_ref(), body.mode.as_deref())?;
    let team_name = team_name(&ctx.data, team).await?;
    super::mcp::check_team(&ctx.fleet.bounds.mcp, &team_name, &body.mcp_servers)?;
    super::mcp::check_addresses(&ctx.fleet.bounds.mcp, &body.mcp_servers).await?;
    super::bounds::check_count(
        store::bounds::live_agents(&ctx.data.pool, team).await?,
        ctx.fleet.limits.max_agents_per_team,
        "limits.max_agents_per_team",
    )?;
    if body.budget.is_some() {
        super::usage::ledger_on(&ctx.governance, "budget")?;
    }
    let caps = body
        .budget
        .as_ref()
        .map(super::usage::AgentCaps::checked)
        .transpose()?;
    super::usage::admit_team(&ctx.data, team).await?;
    // Remote MCP servers' header values are credentials: stored sealed, never in the clear.
    let stored_mcp = super::mcp::seal(&ctx.access.secrets, team, &body.mcp_servers);
    let id = AgentId::new();
    tracing::Span::current()
        .record("team_id", tracing::field::display(team))
        .record("agent_id", tracing::field::display(id));
    // `agent.open.before`: launch-only environment and MCP servers, for this start.
    let launch = open_hooks(
        ctx,
        principal,
        OpenSubject {
            agent: id,
            team,
            team_name: &team_name,
            team_hooks: Some(&team_hooks),
            project,
            labels: &body.labels,
            saved_mcp: &stored_mcp,
        },
        create_env,
    )
    .await?;
    let mut secret_env = team_env(ctx, &body.provider, team).await?;
    let workspace = match existing {
        Target::Existing(ws) => *ws,
        Target::New(spec) => {
            let create = CreateWorkspace {
                project_id: spec.project_id,
                kind: Some(WorkspaceKind::Worktree),
                base_ref: spec.base_ref.clone(),
                branch: spec.branch.clone(),
                title: body.title.clone(),
                pull_request: None,
            };
            let ws = super::workspaces::create(ctx, principal, &create).await?;
            super::workspaces::find(&ctx.data, principal, ws.id).await?
        }
    };
    principal.authorize_in(workspace.team_id, Operation::DriveAgents, "workspace")?;
    if workspace.archived_at.is_some() {
        return Err(ServiceError::WorkspaceArchived("the workspace is archived"));
    }
    super::usage::admit_workspace(&ctx.data, &ctx.governance, workspace.id).await?;
    // `agent.create.after` is queued in the transaction that creates the agent, which
    // returns the row as committed: nothing changes it before the start below.
    let (queued, row) = super::within_deadline(&ctx.data, async {
        let mut tx = ctx.data.pool.pool().begin().await?;
        store::agents::insert(
            &mut *tx,
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
                mcp_servers: &stored_mcp,
                created_by: principal.user_id,
                owner: (ctx.fleet.agents.replica(), ctx.fleet.agents.lease_ttl_s()),
                parent_agent_id,
                depth,
                agentry_mcp: body.agentry_mcp != Some(false),
                creator_role: principal
                    .role_in(workspace.team_id)
                    .map(crate::auth::Role::as_str),
            },
        )
        .await?;
        if let Some(caps) = &caps {
            store::usage::set_agent_caps(&mut *tx, id.uuid(), caps).await?;
        }
        // A team's service token acts for the team: usage is attributed to it. An agent's
        // own token is not one: its children's usage goes to whoever the agent acts for
        // (its creator, or the service token it was created with), naming the parent.
        if let Some(caller) = &principal.agent {
            store::usage::inherit_service_token(&mut *tx, id.uuid(), caller.agent_id).await?;
        } else if principal.service_team.is_some() {
            store::usage::set_agent_service_token(&mut *tx, id.uuid(), principal.token_id).await?;
        }
        let created = store::agents::get(&mut *tx, id.uuid(), None)
            .await?
            .ok_or(ServiceError::NotFound("agent"))?;
        let queued = hooks::queue(
            &mut tx,
            HookEvent::AgentCreateAfter,
            Subject {
                team: created.team_id,
                project: Some(created.project_id),
                labels: Some(&created.labels),
                among: Some(&team_hooks),
            },
            json!({"agent": to_agent(ctx, created.clone())}),
        )
        .await?;
        tx.commit().await?;
        Ok((queued, created))
    })
    .await?;
    if queued > 0 {
        ctx.hooks.queued();
    }
    super::announce(
        &ctx.data,
        NewTeamEvent {
            team_id: workspace.team_id,
            project_id: Some(workspace.project_id),
            workspace_id: Some(workspace.id),
            kind: "agent_created",
            data: json!({"agent_id": id, "workspace_id": WorkspaceId::from(workspace.id), "provider": body.provider,
                "parent_agent_id": parent_agent_id.map(AgentId::from)}),
        },
    )
    .await?;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::AgentCreate, Some(workspace.team_id), "agent", id).details(json!({
            "workspace_id": WorkspaceId::from(workspace.id),
            "provider": body.provider,
            "model": body.model,
            "mode": body.mode,
            "labels": body.labels,
            "with_prompt": body.prompt.is_some(),
            "parent_agent_id": parent_agent_id.map(AgentId::from),
        })),
    )
    .await?;
    secret_env.extend(launch.env);
    let mut agent_ctx = context(&row, secret_env);
    agent_ctx.mcp_servers = launch.mcp_servers;
    agent_ctx.agentry_token = give_agentry_mcp(ctx, &row, &mut agent_ctx.mcp_servers).await?;
    agent_ctx.egress_allow = egress_allow(ctx, &row, agent_ctx.agentry_token.is_some()).await?;
    // Start the session (and the first prompt, queued behind it). A provider that fails to
    // start leaves the agent in `error` with the reason in its timeline; a first turn the
    // store was too slow to confirm ends failed in the timeline. Either way the agent is
    // created, and answering otherwise would invite a duplicate. Under the running-turn
    // limits the first prompt is admitted as any other: it starts a turn once the session
    // is open, or waits in the queue.
    let limited = super::queue::limited(ctx);
    let first = body.prompt.clone().filter(|_| !limited);
    match ctx.fleet.agents.start(&agent_ctx, first).await {
        Ok(_) => {}
        Err(e) if created_anyway(&e) => {}
        Err(e) => return Err(e.into()),
    }
    if limited && let Some(text) = &body.prompt {
        first_prompt(ctx, principal, (id, workspace.team_id), &agent_ctx, text).await?;
        // Shown `queued` while the prompt waits.
        let mut agent = reload(ctx, id).await?;
        agent.queue = super::queue::agent_queue(ctx, id).await?;
        show_queued(&mut agent);
        return Ok(agent);
    }
    reload(ctx, id).await
}

/// What a new agent's start may end in and still answer the agent created (see `create`).
fn created_anyway(e: &RuntimeError) -> bool {
    matches!(
        e,
        RuntimeError::StartFailed(_)
            | RuntimeError::ActorGone
            | RuntimeError::Events(crate::events::WriteError::Unavailable)
    )
}

/// A new agent's first prompt under the running-turn limits: a turn once its session is
/// open, or a message waiting for capacity.
async fn first_prompt(
    ctx: &ServiceContext,
    principal: &Principal,
    (id, team): (AgentId, uuid::Uuid),
    agent_ctx: &AgentContext,
    text: &str,
) -> ServiceResult<()> {
    use super::queue::{self, Admission, WaitReason};
    let body = PromptBody {
        text: text.to_owned(),
        client_message_id: None,
        queue: Some(true),
        interrupt: false,
    };
    // The answer shows the agent as it is once its session is open (as without the
    // limits), whether its prompt then runs or waits.
    match ctx.fleet.agents.open(agent_ctx).await {
        Ok(()) => {}
        Err(e) if created_anyway(&e) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let open = async { Ok(()) };
    match queue::admit(ctx, team, open, start_now(ctx, principal, id, &body)).await {
        Ok(Admission::Started(_)) => Ok(()),
        Err(ServiceError::Runtime(e)) if created_anyway(&e) => Ok(()),
        Ok(Admission::Full { .. }) => {
            let reason = WaitReason::Capacity;
            queue::enqueue(ctx, principal, (id, team), text, None, false, reason).await?;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The configuration as `agent.create.before` hooks see it: the creation body without
/// `prompt`. Every hook of a chain gets this shape, the first from the caller's body, each
/// next one from the previous answer.
fn hook_config(body: &CreateAgent) -> ServiceResult<Value> {
    let mut config = serde_json::to_value(body).map_err(anyhow::Error::from)?;
    if let Some(m) = config.as_object_mut() {
        m.remove("prompt");
    }
    Ok(config)
}

/// `agent.create.before`: the request (its configuration without `prompt`, and launch
/// `env`) through the team's waiting hooks. Returns the configuration to save (with the
/// caller's prompt) and the launch environment.
async fn create_hooks(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateAgent,
    (team, project): (uuid::Uuid, uuid::Uuid),
    team_hooks: &hooks::TeamHooks,
) -> ServiceResult<(CreateAgent, Value)> {
    let mut config = hook_config(body)?;
    if let Some(m) = config.as_object_mut() {
        // Hooks see MCP credentials masked; a masked value they return keeps the caller's.
        m.insert("mcp_servers".into(), super::mcp::mask(&body.mcp_servers));
    }
    let check = |previous: &Value, new: &Value| {
        hooks::only_changed(previous, new, &["config", "env"])?;
        hooks::checked_env(new)?;
        let Some(cfg) = new.get("config").and_then(Value::as_object) else {
            return Err("`config` must be an object".into());
        };
        for fixed in ["workspace_id", "workspace"] {
            if cfg.get(fixed).unwrap_or(&Value::Null)
                != previous["config"].get(fixed).unwrap_or(&Value::Null)
            {
                return Err(format!("`config.{fixed}` may not be changed"));
            }
        }
        // `"prompt": null` (a hook that round-trips the configuration through a typed
        // value) sets nothing; a prompt is the caller's alone.
        if cfg.get("prompt").is_some_and(|p| !p.is_null()) {
            return Err("`config.prompt` is not part of the configuration".into());
        }
        let parsed: CreateAgent = serde_json::from_value(Value::Object(cfg.clone()))
            .map_err(|e| format!("`config` is not an agent configuration: {e}"))?;
        // A hook names no command either.
        super::mcp::check(&ctx.fleet.bounds.mcp, &parsed.mcp_servers).map_err(|e| e.to_string())?;
        // The next hook sees the configuration in the same shape as the first did.
        let config = hook_config(&parsed).map_err(|e| e.to_string())?;
        Ok(json!({"config": config, "env": new.get("env").cloned().unwrap_or_else(|| json!({}))}))
    };
    let request = hooks::call_waiting(
        ctx,
        principal,
        HookEvent::AgentCreateBefore,
        Subject {
            team,
            project: Some(project),
            labels: Some(&body.labels),
            among: Some(team_hooks),
        },
        "request",
        json!({"config": config, "env": {}}),
        Answering::Replace(&check),
    )
    .await?;
    let mut parsed: CreateAgent =
        serde_json::from_value(request["config"].clone()).map_err(anyhow::Error::from)?;
    parsed.prompt = body.prompt.clone();
    parsed.mcp_servers = super::mcp::unmask(&parsed.mcp_servers, &body.mcp_servers);
    let env = request.get("env").cloned().unwrap_or_else(|| json!({}));
    Ok((parsed, env))
}

/// The agent an `agent.open.before` call is about.
struct OpenSubject<'a> {
    agent: AgentId,
    team: uuid::Uuid,
    team_name: &'a str,
    /// The team's hooks, when the caller read them already.
    team_hooks: Option<&'a hooks::TeamHooks>,
    project: uuid::Uuid,
    labels: &'a Value,
    /// The agent's MCP servers as stored (credentials sealed).
    saved_mcp: &'a Value,
}

/// What hooks add to one launch; never stored.
struct Launch {
    env: SecretEnv,
    /// The saved MCP servers with those of hooks, resolved for the provider: named
    /// servers as the settings define them, credentials opened.
    mcp_servers: Value,
}

/// `agent.open.before`: launch-only `env` (starting from `env`) and `mcp_servers` from
/// the waiting hooks, for one start of the provider process.
async fn open_hooks(
    ctx: &ServiceContext,
    principal: &Principal,
    subject: OpenSubject<'_>,
    env: Value,
) -> ServiceResult<Launch> {
    let saved = super::mcp::open(&ctx.access.secrets, subject.team, subject.saved_mcp)?;
    let saved = &saved;
    let team_name = subject.team_name;
    let settings = &ctx.fleet.bounds.mcp;
    let check = |previous: &Value, new: &Value| {
        hooks::only_changed(previous, new, &["env", "mcp_servers"])?;
        hooks::checked_env(new)?;
        let mcp = new.get("mcp_servers").cloned().unwrap_or_else(|| json!({}));
        // What a hook adds follows the caller's rules: no commands, only the servers of
        // the settings this team may use, remote ones by allowed URL.
        super::mcp::check(settings, &mcp).map_err(|e| e.to_string())?;
        super::mcp::check_team(settings, team_name, &mcp).map_err(|e| e.to_string())?;
        if let Some(m) = mcp.as_object()
            && let Some(name) = m.keys().find(|k| saved.get(k.as_str()).is_some())
        {
            return Err(format!(
                "MCP server `{name}` collides with the agent's saved MCP server `{name}`"
            ));
        }
        let mut out = new.clone();
        out["mcp_servers"] = mcp;
        Ok(out)
    };
    let request = hooks::call_waiting(
        ctx,
        principal,
        HookEvent::AgentOpenBefore,
        Subject {
            team: subject.team,
            project: Some(subject.project),
            labels: Some(subject.labels),
            among: subject.team_hooks,
        },
        "request",
        json!({"agent_id": subject.agent, "env": env, "mcp_servers": {}}),
        Answering::Replace(&check),
    )
    .await?;
    let mut mcp_servers = saved.as_object().cloned().unwrap_or_default();
    if let Some(m) = request.get("mcp_servers").and_then(Value::as_object) {
        mcp_servers.extend(m.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    // Names resolve now as the provider will resolve them: none may point inside.
    super::mcp::check_addresses(settings, &Value::Object(mcp_servers.clone())).await?;
    Ok(Launch {
        env: hooks::env_of(&request),
        mcp_servers: super::mcp::resolve(settings, team_name, &Value::Object(mcp_servers))?,
    })
}

/// Which agents `list` returns.
#[derive(Debug, Default)]
pub struct AgentFilter {
    pub workspace_id: Option<WorkspaceId>,
    pub status: Option<AgentStatus>,
    /// Only agents with this label `(key, value)`.
    pub label: Option<(String, String)>,
    pub include_archived: bool,
    /// Only the children of this agent.
    pub parent_agent_id: Option<AgentId>,
}

/// A page of the agents of the caller's teams, after `after`.
#[tracing::instrument(name = "services::agents::list", skip_all)]
pub async fn list(
    ctx: &ServiceContext,
    principal: &Principal,
    filter: &AgentFilter,
    after: Option<AgentId>,
    limit: i64,
) -> ServiceResult<Vec<Agent>> {
    principal.authorize(Operation::ReadTeam)?;
    // A workspace filter names a workspace: one the caller cannot see is missing.
    if let Some(w) = filter.workspace_id {
        super::workspaces::find(&ctx.data, principal, w).await?;
    }
    let teams = principal.visible_teams();
    let labels = filter.label.as_ref().map(|(k, v)| json!({ k: v }));
    // `queued` is no stored status: it is an idle agent whose next message waits for a
    // running-turn slot, so the filter selects those agents (and another status, the others).
    let places = super::queue::places(ctx).await?;
    let waiting: Vec<uuid::Uuid> = places
        .iter()
        .filter(|(_, q)| q.waiting_for == "capacity")
        .map(|(id, _)| *id)
        .collect();
    let (status, only, except) = match filter.status {
        Some(AgentStatus::Queued) => (None, Some(waiting.as_slice()), None),
        Some(s) if !s.is_busy() => (Some(s.as_str()), None, Some(waiting.as_slice())),
        Some(s) => (Some(s.as_str()), None, None),
        None => (None, None, None),
    };
    let rows = store::agents::list(
        &ctx.data.pool,
        store::agents::AgentFilter {
            teams: teams.as_deref(),
            workspace_id: filter.workspace_id.map(|w| w.uuid()),
            status,
            labels: labels.as_ref(),
            include_archived: filter.include_archived,
            parent_agent_id: filter.parent_agent_id.map(|a| a.uuid()),
            only,
            except,
            after: after.map(|a| a.uuid()),
            limit,
        },
    )
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let mut agent = to_agent(ctx, r);
            agent.queue = places.get(&agent.id.uuid()).cloned();
            show_queued(&mut agent);
            agent
        })
        .collect())
}

/// An idle agent whose next message waits for a running-turn slot shows as `queued`.
fn show_queued(agent: &mut Agent) {
    if agent
        .queue
        .as_ref()
        .is_some_and(|q| q.waiting_for == "capacity")
        && !agent.status.is_busy()
    {
        agent.status = AgentStatus::Queued;
    }
}

#[tracing::instrument(name = "services::agents::get", skip_all, fields(agent_id = %id))]
pub async fn get(ctx: &ServiceContext, principal: &Principal, id: AgentId) -> ServiceResult<Agent> {
    let row = load(&ctx.data, principal, id, Operation::ReadTeam).await?;
    let mut agent = to_agent(ctx, row);
    agent.queue = super::queue::agent_queue(ctx, id).await?;
    show_queued(&mut agent);
    Ok(agent)
}

/// The caller may drive the agent (a member of its team): the agent's team.
#[tracing::instrument(name = "services::agents::authorize_drive", skip_all, fields(agent_id = %id))]
pub(crate) async fn authorize_drive(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<uuid::Uuid> {
    principal.authorize(Operation::DriveAgents)?;
    if let Some(team) = ctx.fleet.agents.live_team(id) {
        if principal
            .visible_teams()
            .is_some_and(|teams| !teams.contains(&team))
        {
            return Err(ServiceError::NotFound("agent"));
        }
        principal.authorize_in(team, Operation::DriveAgents, "agent")?;
        return Ok(team);
    }
    Ok(load_to_drive(&ctx.data, principal, id).await?.team_id)
}

/// Send a prompt: start a turn now, or queue the message while the agent runs a turn (or
/// the running-turn limits are reached), unless `queue` is false.
#[tracing::instrument(name = "services::agents::prompt", skip_all, fields(agent_id = %id))]
pub async fn prompt(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    body: PromptBody,
) -> ServiceResult<TurnAccepted> {
    use super::queue::{self, Admission, WaitReason};
    principal.authorize(Operation::DriveAgents)?;
    check_prompt(ctx, "text", &body.text)?;
    let may_queue = body.queue.unwrap_or(true);
    if body.interrupt && !may_queue {
        return Err(ServiceError::invalid(
            "interrupt",
            "a steering message is queued behind the interrupted turn; it cannot be sent with `queue: false`",
        ));
    }
    check_client_message_id(&body)?;
    let team = authorize_drive(ctx, principal, id).await?;
    let cmid = body.client_message_id.as_deref();
    let b = &body;
    let queued = |reason: WaitReason| async move {
        let (mid, position) = queue::enqueue(
            ctx,
            principal,
            (id, team),
            &b.text,
            cmid,
            b.interrupt,
            reason,
        )
        .await?;
        if b.interrupt {
            ctx.fleet.agents.interrupt(id).await;
        }
        audit::record(
            &ctx.data,
            principal,
            Entry::new(Action::AgentPrompt, Some(team), "agent", id).details(
                json!({"message_id": mid, "queued": true, "reason": reason.as_str(),
                    "client_message_id": cmid}),
            ),
        )
        .await?;
        Ok::<_, ServiceError>(TurnAccepted {
            turn_id: None,
            queued: true,
            message_id: Some(mid),
            position: Some(position),
            reason: Some(reason.as_str().to_owned()),
        })
    };
    // Messages already wait: this one goes behind them (a steering one goes first, once
    // the running turn is interrupted).
    if may_queue && !body.interrupt && queue::waiting(ctx, id).await? > 0 {
        return queued(WaitReason::AgentBusy).await;
    }
    let open = open_now(ctx, principal, id);
    match queue::admit(ctx, team, open, start_now(ctx, principal, id, &body)).await {
        Ok(Admission::Started((team, turn_id))) => {
            audit_prompt(&ctx.data, principal, team, id, turn_id, cmid).await?;
            Ok(TurnAccepted {
                turn_id: Some(turn_id),
                queued: false,
                message_id: None,
                position: None,
                reason: None,
            })
        }
        Ok(Admission::Full { .. }) if may_queue => queued(WaitReason::Capacity).await,
        Ok(Admission::Full { limit, value }) => Err(ServiceError::LimitReached {
            limit,
            value: value.max(0) as u64,
        }),
        Err(ServiceError::Runtime(RuntimeError::Busy)) if may_queue => {
            queued(WaitReason::AgentBusy).await
        }
        Err(e) => Err(e),
    }
}

fn check_client_message_id(body: &PromptBody) -> ServiceResult<()> {
    if body
        .client_message_id
        .as_ref()
        .is_some_and(|c| c.is_empty() || c.len() > 200)
    {
        return Err(ServiceError::invalid(
            "client_message_id",
            "must be 1 to 200 characters",
        ));
    }
    Ok(())
}

/// Start a turn with `body` now (reopening a closed agent): the agent's team and the turn.
#[tracing::instrument(name = "services::agents::start_now", skip_all, fields(agent_id = %id))]
pub(crate) async fn start_now(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    body: &PromptBody,
) -> ServiceResult<(uuid::Uuid, TurnId)> {
    principal.authorize(Operation::DriveAgents)?;
    check_prompt(ctx, "text", &body.text)?;
    check_client_message_id(body)?;
    // An agent running here takes the prompt without its row being read: its team is
    // known, and an archive closes the agent before it marks it.
    if let Some(team) = ctx.fleet.agents.live_team(id) {
        if principal
            .visible_teams()
            .is_some_and(|teams| !teams.contains(&team))
        {
            return Err(ServiceError::NotFound("agent"));
        }
        principal.authorize_in(team, Operation::DriveAgents, "agent")?;
        check_team_sandbox(ctx, team).await?;
        let cmid = body.client_message_id.as_deref();
        if let Some(turn_id) = ctx.fleet.agents.prompt_live(id, &body.text, cmid).await? {
            return Ok((team, turn_id));
        }
    }
    let (team, agent_ctx) = launch_context(ctx, principal, id).await?;
    let turn_id = ctx
        .fleet
        .agents
        .prompt(
            &agent_ctx,
            body.text.clone(),
            body.client_message_id.clone(),
        )
        .await?;
    Ok((team, turn_id))
}

/// Open agent `id`'s session here when no actor runs it here: the slow part of a prompt
/// to a closed agent (its `agent.open.before` hooks, its process, the CLI's start), done
/// before the turn's admission so that the admission holds its lock and its connection
/// only while the turn itself starts (`start_now` then finds the agent live). A no-op for
/// an agent live here; `start_now` checks the rest.
#[tracing::instrument(name = "services::agents::open_now", skip_all, fields(agent_id = %id))]
pub(crate) async fn open_now(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<()> {
    principal.authorize(Operation::DriveAgents)?;
    if ctx.fleet.agents.live_team(id).is_some() {
        return Ok(());
    }
    let (_, agent_ctx) = launch_context(ctx, principal, id).await?;
    ctx.fleet.agents.open(&agent_ctx).await?;
    Ok(())
}

/// What (re)opening agent `id` takes, once the caller may drive it and it may run: its
/// team's secrets as they are now, what `agent.open.before` hooks add for this launch,
/// its MCP servers and its egress allow list. The agent's team and that context.
async fn launch_context(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<(uuid::Uuid, AgentContext)> {
    let row = load_to_drive(&ctx.data, principal, id).await?;
    check_team_sandbox(ctx, row.team_id).await?;
    if row.archived_at.is_some() {
        return Err(ServiceError::AgentArchived);
    }
    if row.workspace_archived {
        return Err(ServiceError::WorkspaceArchived(
            "the agent's workspace is archived; its files are gone",
        ));
    }
    // A closed agent is reopened by this prompt, with the team's secrets as they are now
    // and what `agent.open.before` hooks add for this launch.
    let mut secret_env = team_env(ctx, &row.provider, row.team_id).await?;
    let mut agent_ctx = if ctx.fleet.agents.snapshot(id).is_none() {
        let team_name = team_name(&ctx.data, row.team_id).await?;
        let launch = open_hooks(
            ctx,
            principal,
            OpenSubject {
                agent: id,
                team: row.team_id,
                team_name: &team_name,
                team_hooks: None,
                project: row.project_id,
                labels: &row.labels,
                saved_mcp: &row.mcp_servers,
            },
            json!({}),
        )
        .await?;
        secret_env.extend(launch.env);
        let mut c = context(&row, secret_env);
        c.mcp_servers = launch.mcp_servers;
        c.agentry_token = give_agentry_mcp(ctx, &row, &mut c.mcp_servers).await?;
        c
    } else {
        context(&row, secret_env)
    };
    // Also for an agent live at the check: its actor may be stopping, and the fresh one
    // that takes the prompt then opens its endpoint with this list.
    agent_ctx.egress_allow = egress_allow(ctx, &row, agent_ctx.agentry_token.is_some()).await?;
    Ok((row.team_id, agent_ctx))
}

/// A prompt started a turn: audit it.
#[tracing::instrument(name = "services::agents::audit_prompt", skip_all, fields(team_id = %team, agent_id = %id, turn_id = %turn_id))]
pub(crate) async fn audit_prompt(
    data: &Data,
    principal: &Principal,
    team: uuid::Uuid,
    id: AgentId,
    turn_id: TurnId,
    client_message_id: Option<&str>,
) -> ServiceResult<()> {
    audit::record(
        data,
        principal,
        Entry::new(Action::AgentPrompt, Some(team), "agent", id)
            .details(json!({"turn_id": turn_id, "client_message_id": client_message_id})),
    )
    .await
}

#[tracing::instrument(name = "services::agents::interrupt", skip_all, fields(agent_id = %id))]
pub async fn interrupt(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<()> {
    let row = load_to_drive(&ctx.data, principal, id).await?;
    ctx.fleet.agents.interrupt(id).await;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::AgentInterrupt, Some(row.team_id), "agent", id),
    )
    .await
}

#[tracing::instrument(name = "services::agents::set_mode", skip_all, fields(agent_id = %id))]
pub async fn set_mode(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    mode: String,
) -> ServiceResult<Agent> {
    let row = load_to_drive(&ctx.data, principal, id).await?;
    if let Some(p) = ctx.fleet.agents.registry().get(&row.provider) {
        let modes = p.info().modes;
        if !modes.is_empty() && !modes.iter().any(|m| m.id == mode) {
            return Err(ServiceError::invalid(
                "mode",
                format!("`{mode}` is not a mode of `{}`", row.provider),
            ));
        }
    }
    if let Some(p) = ctx.fleet.agents.registry().get(&row.provider) {
        check_confinement(ctx, p.as_ref(), Some(&mode))?;
    }
    if !ctx.fleet.agents.set_mode(id, mode.clone()).await? {
        let data = json!({"mode": &mode});
        let change = StateChange::Mode { agent: id, mode };
        record(ctx, id, EventKind::ModeChanged, data, change).await?;
    }
    reload(ctx, id).await
}

#[tracing::instrument(name = "services::agents::set_model", skip_all, fields(agent_id = %id))]
pub async fn set_model(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    model: String,
) -> ServiceResult<Agent> {
    principal.authorize(Operation::DriveAgents)?;
    if model.trim().is_empty() || model.len() > 200 {
        return Err(ServiceError::invalid(
            "model",
            "must be 1 to 200 characters",
        ));
    }
    load_to_drive(&ctx.data, principal, id).await?;
    if !ctx.fleet.agents.set_model(id, model.clone()).await? {
        let data = json!({"model": &model});
        let change = StateChange::Model { agent: id, model };
        record(ctx, id, EventKind::ModelChanged, data, change).await?;
    }
    reload(ctx, id).await
}

/// Write a change of an agent that no actor runs here: its event and the row it changes,
/// in one statement. Only the agent's owner writes its timeline, so this writes under a
/// fence of its own: the lease epoch read while nobody else holds the agent. Should another
/// replica claim it before the statement runs, the epoch has moved on and nothing is
/// written (`agent_moved`, counted as a fenced batch); one that holds it now is named.
async fn record(
    ctx: &ServiceContext,
    id: AgentId,
    kind: EventKind,
    data: Value,
    change: StateChange,
) -> ServiceResult<()> {
    let me = ctx.fleet.agents.replica();
    let epoch = match store::replicas::lease_of(&ctx.data.pool, id.uuid()).await? {
        None => return Err(ServiceError::NotFound("agent")),
        Some((Some(owner), _)) if owner != me => {
            return Err(RuntimeError::OwnedElsewhere(owner).into());
        }
        Some((_, epoch)) => epoch,
    };
    let attached = Attached {
        changes: vec![change],
        fence: Some(Fence::new(id, epoch)),
        ..Attached::default()
    };
    let event = NewEvent {
        agent_id: id,
        turn_id: None,
        kind,
        data,
    };
    ctx.data
        .writer
        .append_committed_with(vec![event], attached)
        .await?;
    Ok(())
}

async fn reload_row(data: &Data, id: AgentId) -> ServiceResult<AgentRow> {
    store::agents::get(&data.pool, id.uuid(), None)
        .await?
        .ok_or(ServiceError::NotFound("agent"))
}

async fn reload(ctx: &ServiceContext, id: AgentId) -> ServiceResult<Agent> {
    let row = reload_row(&ctx.data, id).await?;
    Ok(to_agent(ctx, row))
}

#[tracing::instrument(name = "services::agents::close", skip_all, fields(agent_id = %id))]
pub async fn close(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<Agent> {
    load_to_drive(&ctx.data, principal, id).await?;
    ctx.fleet.agents.close(id, "closed by request").await;
    reload(ctx, id).await
}

/// Archive the agent and, unless `keep_children`, every descendant that is not archived
/// yet (deepest first). Each archived agent's token stops working at once.
#[tracing::instrument(name = "services::agents::archive", skip_all, fields(agent_id = %id))]
pub async fn archive(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    keep_children: bool,
) -> ServiceResult<()> {
    let row = load_to_drive(&ctx.data, principal, id).await?;
    if !keep_children {
        for child in store::agents::live_descendants(&ctx.data.pool, row.id).await? {
            let child = reload_row(&ctx.data, child.into()).await?;
            archive_one(ctx, principal, child).await?;
        }
    }
    archive_one(ctx, principal, row).await
}

async fn archive_one(
    ctx: &ServiceContext,
    principal: &Principal,
    row: AgentRow,
) -> ServiceResult<()> {
    let id = AgentId::from(row.id);
    ctx.fleet.agents.close(id, "archived").await;
    super::queue::cancel_all(ctx, id).await?;
    if row.archived_at.is_none() {
        // `agent.archive.after` is queued in the archive's own transaction.
        let (queued, revoked) = super::within_deadline(&ctx.data, async {
            let mut tx = ctx.data.pool.pool().begin().await?;
            store::agents::mark_archived(&mut *tx, row.id).await?;
            let revoked = store::identity::revoke_agent_tokens(&mut tx, &[row.id]).await?;
            let archived = store::agents::get(&mut *tx, row.id, None)
                .await?
                .ok_or(ServiceError::NotFound("agent"))?;
            let archived_at = archived.archived_at;
            let queued = hooks::queue(
                &mut tx,
                HookEvent::AgentArchiveAfter,
                Subject {
                    team: archived.team_id,
                    project: Some(archived.project_id),
                    labels: Some(&archived.labels.clone()),
                    among: None,
                },
                json!({"agent": to_agent(ctx, archived), "archived_at": archived_at}),
            )
            .await?;
            tx.commit().await?;
            Ok((queued, revoked))
        })
        .await?;
        if revoked > 0 {
            // This replica forgets the principals it holds now, not at the notification.
            ctx.access.tokens.forget_all();
        }
        if queued > 0 {
            ctx.hooks.queued();
        }
        super::announce(
            &ctx.data,
            NewTeamEvent {
                team_id: row.team_id,
                project_id: Some(row.project_id),
                workspace_id: Some(row.workspace_id),
                kind: "agent_archived",
                data: json!({"agent_id": id}),
            },
        )
        .await?;
        audit::record(
            &ctx.data,
            principal,
            Entry::new(Action::AgentArchive, Some(row.team_id), "agent", id).details(json!({
                "workspace_id": WorkspaceId::from(row.workspace_id),
                "parent_agent_id": row.parent_agent_id.map(AgentId::from),
            })),
        )
        .await?;
    }
    Ok(())
}

/// Which permission requests `list_permissions` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermissionStatus {
    Pending,
    Resolved,
    Expired,
}

impl PermissionStatus {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Self::Pending),
            "resolved" => Some(Self::Resolved),
            "expired" => Some(Self::Expired),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Resolved => "resolved",
            Self::Expired => "expired",
        }
    }
}

#[tracing::instrument(name = "services::agents::list_permissions", skip_all, fields(agent_id = %id))]
pub async fn list_permissions(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    status: Option<PermissionStatus>,
) -> ServiceResult<PermissionList> {
    let row = load(&ctx.data, principal, id, Operation::ReadTeam).await?;
    let rows =
        store::permissions::list(&ctx.data.pool, row.id, status.map(PermissionStatus::as_str))
            .await?;
    Ok(PermissionList {
        items: rows.into_iter().map(PermissionView::from).collect(),
    })
}

#[tracing::instrument(name = "services::agents::answer_permission", skip_all, fields(agent_id = %id, request_id = %request))]
pub async fn answer_permission(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    request: PermissionId,
    body: PermissionAnswerBody,
) -> ServiceResult<PermissionView> {
    let row = load_to_drive(&ctx.data, principal, id).await?;
    let details = json!({"agent_id": id, "behavior": body.behavior, "option_id": body.option_id});
    let answer = PermissionAnswer {
        behavior: body.behavior,
        option_id: body.option_id,
        message: body.message,
        updated_input: body.updated_input,
        resolved_by: principal.user_id,
    };
    match ctx.fleet.agents.answer(id, request, answer).await {
        Some(r) => r?,
        None => {
            // No live agent: the request is resolved, expired, or never existed.
            return match store::permissions::get(&ctx.data.pool, row.id, request.uuid()).await? {
                None => Err(ServiceError::NotFound("permission request")),
                Some(p) if p.status == "resolved" => {
                    Err(RuntimeError::PermissionAlreadyResolved.into())
                }
                Some(_) => Err(ServiceError::PermissionExpired),
            };
        }
    }
    audit::record(
        &ctx.data,
        principal,
        Entry::new(
            Action::PermissionAnswer,
            Some(row.team_id),
            "permission",
            request,
        )
        .details(details),
    )
    .await?;
    store::permissions::get(&ctx.data.pool, row.id, request.uuid())
        .await?
        .map(PermissionView::from)
        .ok_or(ServiceError::NotFound("permission request"))
}

/// How often a `wait` for an agent no actor of this replica runs reads its row again.
const WAIT_POLL: Duration = Duration::from_millis(250);

/// Wait until the agent is neither `running` nor `starting`, for at most `timeout`
/// (capped by `limits.max_wait_s`), or until the server stops.
#[tracing::instrument(name = "services::agents::wait", skip_all, fields(agent_id = %id))]
pub async fn wait(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    timeout: Duration,
) -> ServiceResult<WaitResult> {
    load(&ctx.data, principal, id, Operation::ReadTeam).await?;
    let _slot = ctx
        .fleet
        .bounds
        .wait(super::bounds::principal_key(principal))?;
    let timeout = timeout.min(Duration::from_secs(ctx.fleet.limits.max_wait_s));
    let settled = |s: AgentStatus| !matches!(s, AgentStatus::Running | AgentStatus::Starting);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut timed_out = false;
    loop {
        if let Some(mut rx) = ctx.fleet.agents.watch(id) {
            // An actor runs the agent here: its snapshot says when it settles. The watch
            // also ends when the actor stops (closed, or its lease taken over): the row
            // then says whether the agent settled or runs on elsewhere.
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
                _ = tokio::time::sleep_until(deadline) => timed_out = true,
                _ = ctx.lifecycle.stopping() => break,
            }
        }
        if timed_out {
            break;
        }
        // No actor here (another replica runs the agent, or it is between owners): the
        // stored row is the truth, read again until it settles.
        if settled(to_agent(ctx, reload_row(&ctx.data, id).await?).status) {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            timed_out = true;
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(WAIT_POLL) => {}
            _ = tokio::time::sleep_until(deadline) => {}
            _ = ctx.lifecycle.stopping() => break,
        }
    }
    let row = reload_row(&ctx.data, id).await?;
    let agent = to_agent(ctx, row.clone());
    let pending = store::permissions::list(&ctx.data.pool, row.id, Some("pending")).await?;
    Ok(WaitResult {
        status: agent.status,
        timed_out: timed_out && !settled(agent.status),
        last_turn: row.last_turn_id.map(|t| LastTurn {
            turn_id: t.into(),
            outcome: row.last_turn_outcome.clone(),
            error: row.last_turn_error.clone(),
        }),
        pending_permissions: pending.into_iter().map(PermissionView::from).collect(),
    })
}

/// Where a timeline page starts and in which direction it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimelineFrom {
    /// Oldest first, after this seq.
    After(i64),
    /// Newest first, before this seq.
    Before(i64),
}

/// A timeline page and whether more events follow in its direction.
pub struct TimelinePage {
    pub items: Vec<AgentEvent>,
    pub more: bool,
}

/// Pages also stop at about this many bytes of event data.
const TIMELINE_PAGE_BYTES: usize = 4 * 1024 * 1024;

/// A page of the agent's durable timeline: at most `limit` events.
#[tracing::instrument(name = "services::agents::timeline", skip_all, fields(agent_id = %id))]
pub async fn timeline(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    from: TimelineFrom,
    limit: i64,
) -> ServiceResult<TimelinePage> {
    load(&ctx.data, principal, id, Operation::ReadTeam).await?;
    let rows = match from {
        TimelineFrom::After(n) => {
            store::events::page_after(&ctx.data.pool, id.uuid(), n, limit + 1).await?
        }
        TimelineFrom::Before(n) => {
            store::events::page_before(&ctx.data.pool, id.uuid(), n, limit + 1).await?
        }
    };
    let mut more = rows.len() as i64 > limit;
    let mut items = Vec::with_capacity(rows.len().min(limit as usize));
    let mut bytes = 0usize;
    for row in rows.into_iter().take(limit as usize) {
        bytes += row.data.to_string().len() + 160;
        if bytes > TIMELINE_PAGE_BYTES && !items.is_empty() {
            more = true;
            break;
        }
        items.push(row.into_event());
    }
    Ok(TimelinePage { items, more })
}

/// The name of `team`, which `[mcp.servers.<name>] teams` lists.
async fn team_name(data: &Data, team: uuid::Uuid) -> ServiceResult<String> {
    Ok(store::identity::team_name(&data.pool, team)
        .await?
        .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::mcp_entry;

    #[test]
    fn the_servers_mcp_url_is_one_exact_entry_and_a_forward_on_loopback() {
        let e = mcp_entry("http://127.0.0.1:8787/mcp").unwrap();
        assert_eq!(e.to_string(), "127.0.0.1:8787");
        assert_eq!(e.loopback_target().as_deref(), Some("127.0.0.1:8787"));
        let e = mcp_entry("http://[::1]:8787/mcp").unwrap();
        assert_eq!(e.loopback_target().as_deref(), Some("[::1]:8787"));
        let e = mcp_entry("https://agentry.example.com/mcp").unwrap();
        assert_eq!(e.to_string(), "agentry.example.com:443");
        assert_eq!(e.loopback_target(), None);
        assert!(mcp_entry("not a url").is_none());
    }
}
