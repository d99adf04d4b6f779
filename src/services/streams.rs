//! The reads behind the two event streams: one agent's timeline, and the activity of the
//! caller's teams. Opening a stream authorizes it once; the stream then hands out live
//! subscriptions and durable pages, scoped to what the caller was allowed to see.
//!
//! What was allowed at the opening does not last by itself: a token revoked, re-scoped or
//! expired, a session ended, a membership removed or a user deleted must end every stream
//! and `wait` its caller has open, on every replica. Each keeps a `Guard`, which checks
//! the caller again (`Recheck`, the credential of the request, re-read from the store)
//! whenever this replica hears of a change that may affect a principal (the token cache's
//! `changes`, driven by `NOTIFY agentry_auth`), and at least every
//! `events.revalidate_s` as a floor (a token's expiry, a notification lost with its
//! connection). The guard resolves when the caller no longer holds what the stream
//! needed: the credential is refused, or a team the stream covered is no longer visible
//! to it (the stream ends rather than narrows: the client reconnects with its rights).

use std::sync::Arc;
use std::time::Duration;

use futures::future::LocalBoxFuture;
use rand::Rng;
use tokio::sync::{broadcast, watch};
use uuid::Uuid;

use super::bounds::Slot;
use super::{ServiceContext, ServiceError, ServiceResult};
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

#[tracing::instrument(name = "services::streams::open_agent", skip_all, fields(agent_id = %id))]
pub async fn open_agent(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
) -> ServiceResult<AgentStream> {
    super::agents::authorize_read(&ctx.data, principal, id).await?;
    let slot = ctx
        .fleet
        .bounds
        .stream(super::bounds::principal_key(principal))?;
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
        self.ctx.data.bus.resyncs.inc();
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Published>> {
        self.ctx.data.bus.subscribe(self.id)
    }

    /// Up to `limit` committed events after `seq`, oldest first.
    pub async fn after(&self, seq: i64, limit: i64) -> ServiceResult<Vec<AgentEvent>> {
        let rows =
            store::events::page_after(&self.ctx.data.pool, self.id.uuid(), seq, limit).await?;
        Ok(rows.into_iter().map(|r| r.into_event()).collect())
    }

    /// Resolves once the server starts shutting down.
    pub async fn stopping(&self) {
        self.ctx.lifecycle.stopping().await
    }

    /// The guard of this stream: it resolves when its caller may no longer read the agent.
    pub fn guard(&self, recheck: Recheck) -> Guard {
        Guard::new(&self.ctx, Covered::Agent(self.id), recheck)
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

#[tracing::instrument(name = "services::streams::open_team", skip_all, fields(project_id = ?project, workspace_id = ?workspace))]
pub async fn open_team(
    ctx: &ServiceContext,
    principal: &Principal,
    project: Option<ProjectId>,
    workspace: Option<WorkspaceId>,
) -> ServiceResult<TeamStream> {
    principal.authorize(Operation::ReadTeam)?;
    if let Some(p) = project {
        super::projects::find(&ctx.data, principal, p).await?;
    }
    if let Some(w) = workspace {
        super::workspaces::find(&ctx.data, principal, w).await?;
    }
    let slot = ctx
        .fleet
        .bounds
        .stream(super::bounds::principal_key(principal))?;
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
        self.ctx.data.bus.resyncs.inc();
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<TeamActivity>> {
        self.ctx.data.bus.subscribe_team()
    }

    /// Up to `limit` committed activities of the caller's teams after `id`, oldest first;
    /// filter them with `admits`.
    pub async fn after(&self, id: i64, limit: i64) -> ServiceResult<Vec<TeamActivity>> {
        let rows =
            store::events::team_events_after(&self.ctx.data.pool, self.teams.as_deref(), id, limit)
                .await?;
        Ok(rows.into_iter().map(TeamActivity::from).collect())
    }

    /// Resolves once the server starts shutting down.
    pub async fn stopping(&self) {
        self.ctx.lifecycle.stopping().await
    }

    /// The guard of this stream: it resolves when its caller may no longer see one of the
    /// teams the stream covers.
    pub fn guard(&self, recheck: Recheck) -> Guard {
        Guard::new(&self.ctx, Covered::Teams(self.teams.clone()), recheck)
    }
}

/// What checking a caller's credential again found.
pub enum Verdict {
    /// The credential still stands for this principal (as it is now).
    Holds(Principal),
    /// The credential is refused now (revoked, expired, its user deleted): why, as the
    /// stable code and detail a new request with it would get.
    Refused { code: &'static str, detail: String },
    /// It could not be checked now (the store did not answer); checked again later.
    Unknown,
}

/// Checks the credential a stream or wait was opened with again. With `true`, nothing
/// this replica holds about it is trusted: it is read from the store (the floor check,
/// for a change whose notification was lost).
pub type Recheck = Box<dyn Fn(bool) -> LocalBoxFuture<'static, Verdict>>;

/// Why a guarded stream or wait ends.
#[derive(Debug)]
pub enum Ending {
    /// The credential is refused now (`code` as `AuthError::code`).
    Refused { code: &'static str, detail: String },
    /// The credential stands, but no longer for what was opened (a membership removed,
    /// the token's scopes narrowed): the error opening it now would give.
    OutOfScope(ServiceError),
}

impl Ending {
    pub fn code(&self) -> &'static str {
        match self {
            Ending::Refused { code, .. } => code,
            Ending::OutOfScope(e) => e.code(),
        }
    }

    pub fn detail(&self) -> String {
        match self {
            Ending::Refused { detail, .. } => detail.clone(),
            Ending::OutOfScope(e) => e.to_string(),
        }
    }
}

/// What a guarded stream or wait covers.
enum Covered {
    /// These teams (`None`: every team, a server admin's view).
    Teams(Option<Vec<Uuid>>),
    /// One agent.
    Agent(AgentId),
}

/// Ends a stream or wait when its caller loses the right to it (see the module doc).
pub struct Guard {
    ctx: ServiceContext,
    covered: Covered,
    recheck: Recheck,
    changes: watch::Receiver<u64>,
    floor: Duration,
}

/// The most a change waits before being checked, spread so that every stream of a
/// replica does not read the store in the same instant.
const SPREAD_MS: u64 = 250;

impl Guard {
    fn new(ctx: &ServiceContext, covered: Covered, recheck: Recheck) -> Self {
        let mut changes = ctx.access.tokens.changes();
        changes.mark_unchanged();
        Self {
            ctx: ctx.clone(),
            covered,
            recheck,
            changes,
            floor: ctx.access.revalidate,
        }
    }

    /// A guard for a `wait` on agent `id`.
    pub fn for_agent(ctx: &ServiceContext, id: AgentId, recheck: Recheck) -> Self {
        Self::new(ctx, Covered::Agent(id), recheck)
    }

    /// Resolves when the caller no longer holds what was opened; never otherwise. Made
    /// once per stream and polled from its loop (not cancel-safe across re-creation).
    pub async fn ended(mut self) -> Ending {
        let mut floor =
            tokio::time::interval_at(tokio::time::Instant::now() + self.floor, self.floor);
        floor.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut listening = true;
        loop {
            let fresh;
            tokio::select! {
                _ = floor.tick() => fresh = true,
                changed = self.changes.changed(), if listening => {
                    if changed.is_err() {
                        // The cache is gone (the server stops): the floor still checks.
                        listening = false;
                        continue;
                    }
                    let spread = rand::rng().random_range(0..=SPREAD_MS);
                    tokio::time::sleep(Duration::from_millis(spread)).await;
                    self.changes.mark_unchanged();
                    fresh = false;
                }
            }
            if let Some(ending) = self.check(fresh).await {
                return ending;
            }
        }
    }

    /// `Some` when the caller no longer holds what was opened.
    async fn check(&self, fresh: bool) -> Option<Ending> {
        let principal = match (self.recheck)(fresh).await {
            Verdict::Holds(p) => p,
            Verdict::Refused { code, detail } => return Some(Ending::Refused { code, detail }),
            Verdict::Unknown => return None,
        };
        let result = match &self.covered {
            Covered::Teams(teams) => principal
                .authorize(Operation::ReadTeam)
                .map_err(ServiceError::from)
                .and_then(|()| match (teams, principal.visible_teams()) {
                    (_, None) => Ok(()),
                    (None, Some(_)) => Err(ServiceError::Auth(crate::auth::AuthError::NotVisible(
                        "every team's activity",
                    ))),
                    (Some(had), Some(has)) => match had.iter().all(|t| has.contains(t)) {
                        true => Ok(()),
                        false => Err(ServiceError::Auth(crate::auth::AuthError::NotVisible(
                            "team",
                        ))),
                    },
                }),
            Covered::Agent(id) => {
                super::agents::authorize_read(&self.ctx.data, &principal, *id).await
            }
        };
        match result {
            Ok(()) => None,
            Err(
                ServiceError::Store(_)
                | ServiceError::StoreUnavailable
                | ServiceError::StoreDown(_),
            ) => None,
            Err(e) => Some(Ending::OutOfScope(e)),
        }
    }
}
