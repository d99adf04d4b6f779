//! The reads behind the two event streams: one agent's timeline, and the activity of the
//! caller's teams. Opening a stream authorizes it once; the stream then hands out live
//! subscriptions and durable pages, scoped to what the caller was allowed to see.

use std::sync::Arc;

use tokio::sync::broadcast;
use uuid::Uuid;

use super::bounds::Slot;
use super::{ServiceContext, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::domain::{AgentEvent, AgentId, ProjectId, WorkspaceId};
use crate::events::{Published, TeamActivity};
use crate::store;

/// One agent's events, for a caller allowed to read them.
pub struct AgentStream {
    ctx: ServiceContext,
    id: AgentId,
    /// Counts against `limits.max_streams_per_principal` while the stream is open.
    _slot: Slot,
}

pub async fn open_agent(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<AgentStream> {
    super::agents::authorize_read(ctx, principal, id).await?;
    let slot = ctx.bounds.stream(super::bounds::principal_key(principal))?;
    Ok(AgentStream {
        ctx: ctx.clone(),
        id,
        _slot: slot,
    })
}

impl AgentStream {
    pub fn id(&self) -> AgentId {
        self.id
    }

    /// Live events as they are committed. Subscribe before reading pages, so nothing
    /// committed in between is missed.
    /// Count a reader that fell behind the bus and catches up from the database.
    pub fn fell_behind(&self) {
        self.ctx.bus.resyncs.inc();
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Published>> {
        self.ctx.bus.subscribe(self.id)
    }

    /// Up to `limit` committed events after `seq`, oldest first.
    pub async fn after(&self, seq: i64, limit: i64) -> ServiceResult<Vec<AgentEvent>> {
        let rows = store::events::page_after(&self.ctx.pool, self.id.uuid(), seq, limit).await?;
        Ok(rows.into_iter().map(|r| r.into_event()).collect())
    }

    /// Resolves once the server starts shutting down.
    pub async fn stopping(&self) {
        self.ctx.stopping().await
    }
}

/// The activity of the caller's teams, optionally of one project or workspace.
pub struct TeamStream {
    ctx: ServiceContext,
    teams: Option<Vec<Uuid>>,
    project: Option<Uuid>,
    workspace: Option<Uuid>,
    /// Counts against `limits.max_streams_per_principal` while the stream is open.
    _slot: Slot,
}

pub async fn open_team(
    ctx: &ServiceContext,
    principal: &Principal,
    project: Option<ProjectId>,
    workspace: Option<WorkspaceId>,
) -> ServiceResult<TeamStream> {
    principal.authorize(Operation::ReadTeam)?;
    if let Some(p) = project {
        super::projects::find(ctx, principal, p).await?;
    }
    if let Some(w) = workspace {
        super::workspaces::find(ctx, principal, w).await?;
    }
    let slot = ctx.bounds.stream(super::bounds::principal_key(principal))?;
    Ok(TeamStream {
        _slot: slot,
        ctx: ctx.clone(),
        teams: principal.visible_teams(),
        project: project.map(|p| p.uuid()),
        workspace: workspace.map(|w| w.uuid()),
    })
}

impl TeamStream {
    /// Whether this stream's caller and filters admit `a`.
    pub fn admits(&self, a: &TeamActivity) -> bool {
        self.teams.as_ref().is_none_or(|t| t.contains(&a.team_id))
            && self.project.is_none_or(|p| a.project_id == Some(p))
            && self.workspace.is_none_or(|w| a.workspace_id == Some(w))
    }

    /// Live activity of every team; filter it with `admits`.
    /// Count a reader that fell behind the bus and catches up from the database.
    pub fn fell_behind(&self) {
        self.ctx.bus.resyncs.inc();
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<TeamActivity>> {
        self.ctx.bus.subscribe_team()
    }

    /// Up to `limit` committed activities of the caller's teams after `id`, oldest first;
    /// filter them with `admits`.
    pub async fn after(&self, id: i64, limit: i64) -> ServiceResult<Vec<TeamActivity>> {
        let rows =
            store::events::team_events_after(&self.ctx.pool, self.teams.as_deref(), id, limit)
                .await?;
        Ok(rows.into_iter().map(TeamActivity::from).collect())
    }

    /// Resolves once the server starts shutting down.
    pub async fn stopping(&self) {
        self.ctx.stopping().await
    }
}
