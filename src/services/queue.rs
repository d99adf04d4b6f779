//! Prompts that wait, in Postgres: follow-ups sent while their agent runs a turn, and
//! prompts over the running-turn limits (`limits.max_running_turns`,
//! `limits.max_running_turns_per_team`). Each replica runs a dispatcher that starts the
//! waiting prompts of the agents it runs (and of agents no replica runs) when a turn
//! ends: an agent's messages in order (steering ones first), and across agents the team
//! served longest ago first (round-robin), first in first out within a team. Admissions
//! against the limits are serialized on every replica by one advisory lock, held only
//! while a turn starts: a closed agent's session is opened before it is taken.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::Notify;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Membership, Operation, Principal, Role};
use crate::domain::{AgentId, AgentStatus, EventKind, MessageId, NewEvent, TurnId};
use crate::events::NewTeamEvent;
use crate::runtime::RuntimeError;
use crate::store;
use crate::store::queue::{HeadRow, MessageRow};

/// How often the dispatcher looks at the queue without being told of a change (a turn
/// ending on another replica frees capacity here too).
const SWEEP: Duration = Duration::from_secs(1);

/// The dispatcher's wake-up, rung when a prompt is queued here, and the turn of this
/// replica's admissions: one at a time waits on the advisory lock, so that admissions
/// waiting for it never hold every pooled connection while the one holding it needs one.
#[derive(Default)]
pub struct Queue {
    queued: Notify,
    admission: tokio::sync::Mutex<()>,
}

/// Why a message waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WaitReason {
    /// Its agent ran a turn when it was sent.
    AgentBusy,
    /// The running-turn limits were reached when it was sent.
    Capacity,
}

impl WaitReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AgentBusy => "agent_busy",
            Self::Capacity => "capacity",
        }
    }
}

/// A prompt that waits (or waited) for its agent or for capacity.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "msg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
    "text": "now add tests", "client_message_id": null, "interrupt": false, "reason": "agent_busy",
    "state": "queued", "turn_id": null, "error": null, "position": 1,
    "created_at": "2026-11-30T12:00:00Z", "ended_at": null}))]
pub struct QueuedMessage {
    pub id: MessageId,
    pub agent_id: AgentId,
    pub text: String,
    pub client_message_id: Option<String>,
    /// A steering message: it interrupted the running turn and runs before the others.
    pub interrupt: bool,
    /// `agent_busy` or `capacity`: what it waited for when it was sent.
    pub reason: String,
    /// `queued`, `started` (see `turn_id`), `canceled` or `failed` (see `error`).
    pub state: String,
    pub turn_id: Option<TurnId>,
    pub error: Option<String>,
    /// Its place among the agent's waiting messages (1 runs next); null once it left.
    pub position: Option<i64>,
    pub created_at: DateTime<Utc>,
    /// When it started, was canceled or failed.
    pub ended_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct QueuedMessageList {
    pub items: Vec<QueuedMessage>,
}

fn view(r: MessageRow, position: Option<i64>) -> QueuedMessage {
    QueuedMessage {
        id: r.id.into(),
        agent_id: r.agent_id.into(),
        text: r.text,
        client_message_id: r.client_message_id,
        interrupt: r.interrupt,
        reason: r.reason,
        state: r.state,
        turn_id: r.turn_id.map(Into::into),
        error: r.error,
        position,
        created_at: r.created_at,
        ended_at: r.ended_at,
    }
}

/// Which messages `list` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageState {
    Queued,
    Started,
    Canceled,
    Failed,
}

impl MessageState {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "queued" => Some(Self::Queued),
            "started" => Some(Self::Started),
            "canceled" => Some(Self::Canceled),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Started => "started",
            Self::Canceled => "canceled",
            Self::Failed => "failed",
        }
    }
}

/// The limits are in force (one of them is set).
pub(crate) fn limited(ctx: &ServiceContext) -> bool {
    ctx.fleet.limits.max_running_turns > 0 || ctx.fleet.limits.max_running_turns_per_team > 0
}

/// The limit a new turn of `team` would exceed, given the turns running.
fn over_limit(ctx: &ServiceContext, running: (i64, i64)) -> Option<(&'static str, i64)> {
    let (all, team) = running;
    let l = &ctx.fleet.limits;
    if l.max_running_turns > 0 && all >= l.max_running_turns {
        return Some(("limits.max_running_turns", l.max_running_turns));
    }
    if l.max_running_turns_per_team > 0 && team >= l.max_running_turns_per_team {
        return Some((
            "limits.max_running_turns_per_team",
            l.max_running_turns_per_team,
        ));
    }
    None
}

/// What `admit` did.
pub enum Admission<T> {
    Started(T),
    /// Over this limit (or behind prompts that wait for capacity): nothing was started.
    Full {
        limit: &'static str,
        value: i64,
    },
}

/// Start a turn of `team` with `start` when the running-turn limits allow it (and no
/// prompt waits for capacity before it); serialized with every other admission. `open`
/// is the slow part of a start (opening a closed agent's session): when the limits leave
/// room now, it runs first, holding neither the admission's lock nor a connection, and
/// `start` (the turn itself) under them.
#[tracing::instrument(name = "services::queue::admit", skip_all, fields(team_id = %team))]
pub async fn admit<T, O, F>(
    ctx: &ServiceContext,
    team: Uuid,
    open: O,
    start: F,
) -> ServiceResult<Admission<T>>
where
    O: std::future::Future<Output = ServiceResult<()>>,
    F: std::future::Future<Output = ServiceResult<T>>,
{
    if !limited(ctx) {
        return start.await.map(Admission::Started);
    }
    // A prompt that will wait is told so at once, without opening its agent.
    let (waiting, running) = store::queue::admission_state(&ctx.data.pool, team).await?;
    if let Some(full) = room(ctx, waiting, running) {
        return Ok(full);
    }
    open.await?;
    let _turn = ctx.governance.queue.admission.lock().await;
    let mut tx = ctx.data.pool.pool().begin().await?;
    store::queue::lock_admissions(&mut tx).await?;
    let (waiting, running) = store::queue::admission_state(&mut *tx, team).await?;
    if let Some(full) = room(ctx, waiting, running) {
        return Ok(full);
    }
    let started = start.await?;
    store::queue::served(&mut *tx, team).await?;
    tx.commit().await?;
    Ok(Admission::Started(started))
}

/// `None` when a new turn may start, given whether prompts wait for capacity and the
/// turns running (all, its team's); else what stops it.
fn room<T>(
    ctx: &ServiceContext,
    capacity_waiting: bool,
    running: (i64, i64),
) -> Option<Admission<T>> {
    if capacity_waiting {
        let limit =
            over_limit(ctx, (i64::MAX, i64::MAX)).unwrap_or(("limits.max_running_turns", 0));
        return Some(Admission::Full {
            limit: limit.0,
            value: limit.1,
        });
    }
    over_limit(ctx, running).map(|(limit, value)| Admission::Full { limit, value })
}

/// How many messages of agent `id` wait.
#[tracing::instrument(name = "services::queue::waiting", skip_all, fields(agent_id = %id))]
pub async fn waiting(ctx: &ServiceContext, id: AgentId) -> ServiceResult<i64> {
    Ok(store::queue::waiting_count(&ctx.data.pool, id.uuid()).await?)
}

/// Queue a prompt for agent `id` of `team`, sent by `principal`; it is announced on the
/// agent's timeline. Returns its id and its place among the agent's waiting messages.
#[tracing::instrument(name = "services::queue::enqueue", skip_all, fields(agent_id = %id, team_id = %team, message_id))]
pub async fn enqueue(
    ctx: &ServiceContext,
    principal: &Principal,
    (id, team): (AgentId, Uuid),
    text: &str,
    client_message_id: Option<&str>,
    interrupt: bool,
    reason: WaitReason,
) -> ServiceResult<(MessageId, i64)> {
    let mid = MessageId::new();
    tracing::Span::current().record("message_id", tracing::field::display(mid));
    store::queue::insert(
        &ctx.data.pool,
        &store::queue::NewMessage {
            id: mid.uuid(),
            agent_id: id.uuid(),
            team_id: team,
            text,
            client_message_id,
            interrupt,
            created_by: (!principal.user_id.is_nil()).then_some(principal.user_id),
            token_id: (!principal.token_id.is_nil()).then_some(principal.token_id),
            reason: reason.as_str(),
        },
    )
    .await?;
    let mut data = json!({"message_id": mid, "text": text, "interrupt": interrupt,
        "reason": reason.as_str()});
    if let Some(c) = client_message_id {
        data["client_message_id"] = json!(c);
    }
    // An idle agent whose prompt waits for a running-turn slot shows as `queued` on its
    // team's stream too, with its place in the fair order.
    let mut team_events = Vec::new();
    if reason == WaitReason::Capacity
        && let Some(place) = agent_queue(ctx, id).await?
        && place.waiting_for == "capacity"
        && let Some(agent) = store::agents::get(&ctx.data.pool, id.uuid(), None).await?
    {
        data["position"] = json!(place.position);
        team_events.push(NewTeamEvent {
            team_id: team,
            project_id: None,
            workspace_id: Some(agent.workspace_id),
            kind: "agent_status",
            data: json!({"agent_id": id, "status": AgentStatus::Queued,
                "position": place.position}),
        });
    }
    ctx.data
        .writer
        .append_committed(
            vec![NewEvent {
                agent_id: id,
                turn_id: None,
                kind: EventKind::MessageQueued,
                data,
            }],
            team_events,
        )
        .await?;
    let position = position_of(ctx, id, mid).await?.unwrap_or(1);
    ctx.governance.queue.queued.notify_one();
    Ok((mid, position))
}

async fn position_of(
    ctx: &ServiceContext,
    id: AgentId,
    mid: MessageId,
) -> ServiceResult<Option<i64>> {
    let rows = store::queue::list(&ctx.data.pool, id.uuid(), Some("queued")).await?;
    Ok(rows
        .iter()
        .position(|r| r.id == mid.uuid())
        .map(|p| p as i64 + 1))
}

async fn record(
    ctx: &ServiceContext,
    id: AgentId,
    kind: EventKind,
    data: serde_json::Value,
) -> ServiceResult<()> {
    ctx.data
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
        .await?;
    Ok(())
}

/// `GET /v1/agents/{id}/messages?state=`: the agent's queued (and past queued) messages,
/// waiting ones first in the order they run.
#[tracing::instrument(name = "services::queue::list", skip_all, fields(agent_id = %id))]
pub async fn list(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    state: Option<MessageState>,
) -> ServiceResult<QueuedMessageList> {
    super::agents::authorize_read(&ctx.data, principal, id).await?;
    let rows =
        store::queue::list(&ctx.data.pool, id.uuid(), state.map(MessageState::as_str)).await?;
    let mut next = 0;
    let items = rows
        .into_iter()
        .map(|r| {
            let position = (r.state == "queued").then(|| {
                next += 1;
                next
            });
            view(r, position)
        })
        .collect();
    Ok(QueuedMessageList { items })
}

/// `DELETE /v1/agents/{id}/messages/{mid}`: cancel a waiting message.
#[tracing::instrument(name = "services::queue::cancel", skip_all, fields(agent_id = %id, message_id = %mid))]
pub async fn cancel(
    ctx: &ServiceContext,
    principal: &Principal,
    id: AgentId,
    mid: MessageId,
) -> ServiceResult<()> {
    super::agents::authorize_drive(ctx, principal, id).await?;
    if store::queue::cancel(&ctx.data.pool, id.uuid(), mid.uuid()).await? {
        record(
            ctx,
            id,
            EventKind::MessageDequeued,
            json!({"message_id": mid, "state": "canceled"}),
        )
        .await?;
        return Ok(());
    }
    match store::queue::get(&ctx.data.pool, id.uuid(), mid.uuid()).await? {
        None => Err(ServiceError::NotFound("message")),
        Some(m) => Err(ServiceError::MessageNotQueued(m.state)),
    }
}

/// Cancel every waiting message of agent `id` (it is being archived).
#[tracing::instrument(name = "services::queue::cancel_all", skip_all, fields(agent_id = %id))]
pub async fn cancel_all(ctx: &ServiceContext, id: AgentId) -> ServiceResult<()> {
    for mid in store::queue::cancel_all(&ctx.data.pool, id.uuid()).await? {
        record(
            ctx,
            id,
            EventKind::MessageDequeued,
            json!({"message_id": MessageId::from(mid), "state": "canceled",
                "error": "the agent was archived"}),
        )
        .await?;
    }
    Ok(())
}

/// Where an agent stands in the queue, on the agent object.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AgentQueue {
    /// Its messages that wait.
    pub messages: i64,
    /// `agent_busy` (its next message waits for its running turn) or `capacity` (for a
    /// running-turn slot).
    pub waiting_for: String,
    /// Among agents waiting for capacity, its place in the fair order (1 starts next).
    pub position: Option<i64>,
}

/// Agent `id`'s place in the queue, when any of its messages waits.
#[tracing::instrument(name = "services::queue::agent_queue", skip_all, fields(agent_id = %id))]
pub async fn agent_queue(ctx: &ServiceContext, id: AgentId) -> ServiceResult<Option<AgentQueue>> {
    if store::queue::waiting_count(&ctx.data.pool, id.uuid()).await? == 0 {
        return Ok(None);
    }
    Ok(places(ctx).await?.remove(&id.uuid()))
}

/// The place in the queue of every agent whose messages wait (for agent lists: one
/// reading of the queue for the whole page).
#[tracing::instrument(name = "services::queue::places", skip_all)]
pub async fn places(
    ctx: &ServiceContext,
) -> ServiceResult<std::collections::HashMap<Uuid, AgentQueue>> {
    let heads = store::queue::heads(&ctx.data.pool).await?;
    let mut position = 0;
    let mut places = std::collections::HashMap::with_capacity(heads.len());
    for h in heads {
        if !h.agent_busy {
            position += 1;
        }
        places.insert(
            h.agent_id,
            AgentQueue {
                messages: h.agent_waiting,
                waiting_for: if h.agent_busy {
                    "agent_busy"
                } else {
                    "capacity"
                }
                .to_owned(),
                position: (!h.agent_busy).then_some(position),
            },
        );
    }
    Ok(places)
}

/// One agent whose messages wait, on `GET /v1/queue`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct QueueEntry {
    /// Among the entries waiting for capacity, the order they start in (1 next); null
    /// for an entry waiting for its agent.
    pub position: Option<i64>,
    pub agent_id: AgentId,
    pub team_id: crate::domain::TeamId,
    /// The message that runs next for this agent.
    pub message_id: MessageId,
    /// Messages of the agent that wait.
    pub messages: i64,
    /// `agent_busy`: its agent runs a turn; `capacity`: `limits.max_running_turns` is
    /// reached; `team_capacity`: `limits.max_running_turns_per_team` is reached for its
    /// team; `next`: it starts as soon as the dispatcher gets to it.
    pub waiting_for: String,
    pub queued_at: DateTime<Utc>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TeamRunning {
    pub team_id: crate::domain::TeamId,
    pub running: i64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"running": 2, "max_running_turns": 2, "max_running_turns_per_team": 0,
    "teams": [{"team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "running": 2}],
    "items": [{"position": 1, "agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
        "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "message_id": "msg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6e",
        "messages": 1, "waiting_for": "capacity", "queued_at": "2026-11-30T12:00:00Z"}]}))]
pub struct QueueView {
    /// Turns running now, on the whole deployment (of the teams the caller sees, for
    /// someone who is not a server admin).
    pub running: i64,
    /// The settings; 0: no limit.
    pub max_running_turns: i64,
    pub max_running_turns_per_team: i64,
    /// Running turns per team.
    pub teams: Vec<TeamRunning>,
    /// What waits, in the order it is served.
    pub items: Vec<QueueEntry>,
}

/// `GET /v1/queue`: what waits and why, for the caller's teams (a server admin: all).
#[tracing::instrument(name = "services::queue::show", skip_all)]
pub async fn show(ctx: &ServiceContext, principal: &Principal) -> ServiceResult<QueueView> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams();
    let sees = |t: Uuid| teams.as_ref().is_none_or(|ts| ts.contains(&t));
    let heads = store::queue::heads(&ctx.data.pool).await?;
    let by_team = store::queue::running_by_team(&ctx.data.pool).await?;
    let total: i64 = by_team.iter().map(|(_, n)| n).sum();
    let mut running_of: std::collections::HashMap<Uuid, i64> = by_team.iter().copied().collect();
    let mut all = total;
    let mut position = 0;
    let mut items = Vec::new();
    for h in heads {
        let waiting_for = if h.agent_busy {
            "agent_busy"
        } else {
            let team = running_of.get(&h.team_id).copied().unwrap_or(0);
            match over_limit(ctx, (all, team)) {
                Some(("limits.max_running_turns", _)) => "capacity",
                Some(_) => "team_capacity",
                None => {
                    // It would take a slot: those after it see the slot taken.
                    all += 1;
                    *running_of.entry(h.team_id).or_insert(0) += 1;
                    "next"
                }
            }
        };
        let pos = (!h.agent_busy).then(|| {
            position += 1;
            position
        });
        if sees(h.team_id) {
            items.push(QueueEntry {
                position: pos,
                agent_id: h.agent_id.into(),
                team_id: h.team_id.into(),
                message_id: h.id.into(),
                messages: h.agent_waiting,
                waiting_for: waiting_for.to_owned(),
                queued_at: h.created_at,
            });
        }
    }
    let teams_running: Vec<TeamRunning> = by_team
        .into_iter()
        .filter(|(t, _)| sees(*t))
        .map(|(t, n)| TeamRunning {
            team_id: t.into(),
            running: n,
        })
        .collect();
    Ok(QueueView {
        running: if teams.is_none() {
            total
        } else {
            teams_running.iter().map(|t| t.running).sum()
        },
        max_running_turns: ctx.fleet.limits.max_running_turns,
        max_running_turns_per_team: ctx.fleet.limits.max_running_turns_per_team,
        teams: teams_running,
        items,
    })
}

/// The sender of a queued message, as whom it is started: authorized when it was sent,
/// acting in the message's team with the member role.
fn sender(m: &MessageRow) -> Principal {
    Principal {
        user_id: m.created_by.unwrap_or_default(),
        email: String::new(),
        name: String::new(),
        is_admin: false,
        token_id: m.token_id.unwrap_or_default(),
        service_team: None,
        teams: vec![Membership {
            team_id: m.team_id,
            team_name: String::new(),
            role: Role::Member,
        }],
        scopes: Vec::new(),
        request_id: None,
        // A message an agent's token queued is started as the person behind that agent.
        agent: None,
    }
}

/// Start waiting messages until none can start now: those whose agent is idle and runs
/// here or nowhere, in the fair order, while the limits allow.
#[tracing::instrument(name = "services::queue::dispatch", level = "debug", skip_all)]
pub async fn dispatch(ctx: &ServiceContext) -> ServiceResult<usize> {
    let mut started = 0;
    let me = ctx.fleet.agents.replica();
    let heads = store::queue::heads(&ctx.data.pool).await?;
    let mut full_teams: Vec<Uuid> = Vec::new();
    for h in heads {
        if ctx.fleet.agents.is_shutting_down() || *ctx.lifecycle.shutdown.borrow() {
            break;
        }
        if h.agent_busy || h.owner.as_deref().is_some_and(|o| o != me) {
            continue;
        }
        if full_teams.contains(&h.team_id) {
            continue;
        }
        match start_head(ctx, &h).await {
            Ok(Step::Started) => started += 1,
            Ok(Step::Skipped) => {}
            Ok(Step::Full("limits.max_running_turns")) => break,
            Ok(Step::Full(_)) => full_teams.push(h.team_id),
            Err(e) => {
                tracing::warn!(agent_id = %AgentId::from(h.agent_id), error = %e, "could not start a queued message");
            }
        }
    }
    Ok(started)
}

enum Step {
    Started,
    /// Another replica holds it, it left the queue, or its agent is busy after all.
    Skipped,
    Full(&'static str),
}

#[tracing::instrument(name = "services::queue::start_head", skip_all, fields(agent_id = %AgentId::from(h.agent_id), message_id = %MessageId::from(h.id)))]
async fn start_head(ctx: &ServiceContext, h: &HeadRow) -> ServiceResult<Step> {
    let id = AgentId::from(h.agent_id);
    if limited(ctx) {
        let running = store::queue::running_turns(&ctx.data.pool, h.team_id).await?;
        if let Some((limit, _)) = over_limit(ctx, running) {
            return Ok(Step::Full(limit));
        }
    }
    // Its agent's session is opened (when closed) before the admission's lock and the
    // message's row are taken: only the turn's start is made under them.
    let Some(m) = store::queue::get(&ctx.data.pool, h.agent_id, h.id).await? else {
        return Ok(Step::Skipped);
    };
    if m.state != "queued" {
        return Ok(Step::Skipped);
    }
    if let Err(e) = super::agents::open_now(ctx, &sender(&m), id).await {
        return match e {
            ServiceError::Runtime(
                RuntimeError::Busy | RuntimeError::ShuttingDown | RuntimeError::OwnedElsewhere(_),
            ) => Ok(Step::Skipped),
            e @ (ServiceError::StoreUnavailable | ServiceError::Store(_)) => Err(e),
            e => {
                let mut tx = ctx.data.pool.pool().begin().await?;
                if let Some(m) = store::queue::claim(&mut tx, h.id).await? {
                    fail(ctx, tx, &m, &e.to_string()).await?;
                }
                Ok(Step::Skipped)
            }
        };
    }
    let _turn = match limited(ctx) {
        true => Some(ctx.governance.queue.admission.lock().await),
        false => None,
    };
    let mut tx = ctx.data.pool.pool().begin().await?;
    if limited(ctx) {
        store::queue::lock_admissions(&mut tx).await?;
        let running = store::queue::running_turns(&mut *tx, h.team_id).await?;
        if let Some((limit, _)) = over_limit(ctx, running) {
            return Ok(Step::Full(limit));
        }
    }
    let Some(m) = store::queue::claim(&mut tx, h.id).await? else {
        return Ok(Step::Skipped);
    };
    let principal = sender(&m);
    let body = super::agents::PromptBody {
        text: m.text.clone(),
        client_message_id: m.client_message_id.clone(),
        queue: Some(false),
        interrupt: false,
    };
    match super::agents::start_now(ctx, &principal, id, &body).await {
        Ok((team, turn)) => {
            store::queue::mark_started(&mut *tx, m.id, turn.uuid()).await?;
            if limited(ctx) {
                store::queue::served(&mut *tx, team).await?;
            }
            tx.commit().await?;
            record(
                ctx,
                id,
                EventKind::MessageDequeued,
                json!({"message_id": MessageId::from(m.id), "state": "started", "turn_id": turn}),
            )
            .await?;
            super::agents::audit_prompt(
                &ctx.data,
                &principal,
                team,
                id,
                turn,
                body.client_message_id.as_deref(),
            )
            .await?;
            Ok(Step::Started)
        }
        // Not now: it stays queued for the next turn's end.
        Err(ServiceError::Runtime(RuntimeError::Busy | RuntimeError::ShuttingDown)) => {
            Ok(Step::Skipped)
        }
        Err(e @ (ServiceError::StoreUnavailable | ServiceError::Store(_))) => Err(e),
        Err(e) => {
            fail(ctx, tx, &m, &e.to_string()).await?;
            Ok(Step::Skipped)
        }
    }
}

/// Message `m` (claimed in `tx`) cannot start: it leaves the queue as failed, with why.
async fn fail(
    ctx: &ServiceContext,
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    m: &MessageRow,
    error: &str,
) -> ServiceResult<()> {
    store::queue::mark_failed(&mut *tx, m.id, error).await?;
    tx.commit().await?;
    record(
        ctx,
        AgentId::from(m.agent_id),
        EventKind::MessageDequeued,
        json!({"message_id": MessageId::from(m.id), "state": "failed", "error": error}),
    )
    .await
}

/// The dispatcher of this replica: starts waiting messages after every turn's end, when
/// a message is queued here, and every `SWEEP`, until the server stops.
pub async fn run(ctx: ServiceContext) {
    loop {
        if let Err(e) = dispatch(&ctx).await {
            tracing::warn!(error = %e, "could not look at the queue; retrying");
        }
        tokio::select! {
            _ = ctx.fleet.agents.turn_ended() => {}
            _ = ctx.governance.queue.queued.notified() => {}
            _ = tokio::time::sleep(SWEEP) => {}
            _ = ctx.lifecycle.stopping() => return,
        }
    }
}
