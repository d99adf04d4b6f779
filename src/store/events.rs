//! The durable timelines: `agent_events` (append-only, dense `seq` per agent) and
//! `team_events` (the team activity stream). Writes come only from the `EventWriter`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};
use uuid::Uuid;

use crate::domain::{AgentEvent, EventKind};

#[derive(Debug, Clone, FromRow)]
pub struct EventRow {
    pub agent_id: Uuid,
    pub seq: i64,
    pub turn_id: Option<Uuid>,
    pub kind: String,
    pub data: Value,
    pub created_at: DateTime<Utc>,
}

impl EventRow {
    pub fn into_event(self) -> AgentEvent {
        AgentEvent {
            seq: self.seq,
            agent_id: self.agent_id.into(),
            turn_id: self.turn_id.map(Into::into),
            at: self.created_at,
            kind: EventKind::parse(&self.kind).unwrap_or(EventKind::Error),
            data: self.data,
        }
    }
}

/// A batch as column arrays, for `UNNEST`; `data` is encoded as each statement needs it.
struct Columns<'a, D> {
    agent_ids: Vec<Uuid>,
    seqs: Vec<i64>,
    turns: Vec<Option<Uuid>>,
    kinds: Vec<&'a str>,
    data: Vec<D>,
    ats: Vec<DateTime<Utc>>,
}

impl<'a, D> Columns<'a, D> {
    fn of(events: &'a [AgentEvent], data: impl Fn(&'a Value) -> D) -> Self {
        Self {
            agent_ids: events.iter().map(|e| e.agent_id.uuid()).collect(),
            seqs: events.iter().map(|e| e.seq).collect(),
            turns: events.iter().map(|e| e.turn_id.map(|t| t.uuid())).collect(),
            kinds: events.iter().map(|e| e.kind.as_str()).collect(),
            data: events.iter().map(|e| data(&e.data)).collect(),
            ats: events.iter().map(|e| e.at).collect(),
        }
    }
}

/// Bind a batch's columns (`Columns`), in table order, as the next six parameters.
macro_rules! bind_events {
    ($query:expr, $c:expr) => {
        $query
            .bind(&$c.agent_ids)
            .bind(&$c.seqs)
            .bind(&$c.turns)
            .bind(&$c.kinds)
            .bind(&$c.data)
            .bind(&$c.ats)
    };
}

/// Bind moments' columns (`MomentColumns`) as the next five parameters.
macro_rules! bind_moments {
    ($query:expr, $m:expr) => {
        $query
            .bind(&$m.agents)
            .bind(&$m.seqs)
            .bind(&$m.kinds)
            .bind(&$m.data)
            .bind(&$m.hooks)
    };
}

/// The statement that stores moments, bound as five arrays starting at parameter `$a`
/// (agents, seqs, kinds, payloads, hook events; see `bind_moments`). It keeps only the
/// moments that an enabled hook of the agent's team, or a server-wide one, listens for
/// when the statement runs: a server without such hooks stores none, and a hook hears
/// the moments committed after it was created. The hooks' other filters (project,
/// labels) are applied when the rows are turned into notifications.
macro_rules! insert_moments_sql {
    ($a:literal, $b:literal, $c:literal, $d:literal, $e:literal) => {
        concat!(
            "INSERT INTO agent_moments (agent_id, seq, kind, payload)
            SELECT m.agent_id, m.seq, m.kind, m.payload
            FROM UNNEST($", $a, "::uuid[], $", $b, "::int8[], $", $c, "::text[], $", $d,
            "::jsonb[], $", $e, "::text[]) AS m(agent_id, seq, kind, payload, hook)
            WHERE EXISTS (SELECT 1 FROM hooks h WHERE h.enabled AND m.hook = ANY (h.events)
                            AND (h.team_id IS NULL
                                 OR h.team_id = (SELECT a.team_id FROM agents a WHERE a.id = m.agent_id)))"
        )
    };
}

/// Insert a batch of events in one statement. On its own (outside a transaction) it is
/// one atomic, durable commit and one round trip. An agent's `last_seq` is not stored:
/// it is read as `max(seq)` of its timeline.
pub async fn insert_batch(
    db: impl PgExecutor<'_>,
    events: &[AgentEvent],
) -> Result<(), sqlx::Error> {
    let c = Columns::of(events, sqlx::types::Json);
    bind_events!(
        sqlx::query(
            "INSERT INTO agent_events (agent_id, seq, turn_id, kind, data, created_at)
             SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::text[], $5::jsonb[], $6::timestamptz[])",
        ),
        c
    )
    .execute(db)
    .await?;
    Ok(())
}

/// An agent's fence in a batch: the lease epoch its owner's writes carry.
pub type FenceRow = (Uuid, i64);

/// `insert_batch`, stored only if every fence holds: each agent's row is locked (in id
/// order) and its `lease_epoch` compared in the same statement. When one does not hold,
/// nothing is stored and the fences that failed come back.
pub async fn insert_batch_fenced(
    db: impl PgExecutor<'_>,
    events: &[AgentEvent],
    fences: &[FenceRow],
) -> Result<Vec<FenceRow>, sqlx::Error> {
    let c = Columns::of(events, sqlx::types::Json);
    bind_events!(
        sqlx::query_as(
            "WITH locked AS MATERIALIZED (
                SELECT id, lease_epoch FROM agents WHERE id = ANY($7::uuid[]) ORDER BY id FOR NO KEY UPDATE
             ), deposed AS MATERIALIZED (
                SELECT f.id, f.epoch FROM UNNEST($7::uuid[], $8::int8[]) AS f(id, epoch)
                  JOIN locked l ON l.id = f.id WHERE l.lease_epoch <> f.epoch
             ), stored AS (
                INSERT INTO agent_events (agent_id, seq, turn_id, kind, data, created_at)
                SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::text[], $5::jsonb[], $6::timestamptz[])
                 WHERE NOT EXISTS (SELECT 1 FROM deposed)
             )
             SELECT id, epoch FROM deposed",
        ),
        c
    )
    .bind(fences.iter().map(|f| f.0).collect::<Vec<_>>())
    .bind(fences.iter().map(|f| f.1).collect::<Vec<_>>())
    .fetch_all(db)
    .await
}

/// The fences among `fences` that no longer hold, their agents' rows locked (in id order)
/// until the transaction ends.
pub async fn deposed(
    tx: &mut Transaction<'_, Postgres>,
    fences: &[FenceRow],
) -> Result<Vec<FenceRow>, sqlx::Error> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = fences.iter().map(|f| f.0).collect();
    sqlx::query_as(
        "WITH locked AS MATERIALIZED (
            SELECT id, lease_epoch FROM agents WHERE id = ANY($1::uuid[]) ORDER BY id FOR NO KEY UPDATE
         )
         SELECT f.id, f.epoch FROM UNNEST($1::uuid[], $2::int8[]) AS f(id, epoch)
           JOIN locked l ON l.id = f.id WHERE l.lease_epoch <> f.epoch",
    )
    .bind(&ids)
    .bind(fences.iter().map(|f| f.1).collect::<Vec<_>>())
    .fetch_all(&mut **tx)
    .await
}

/// Insert events one by one (each in its own subtransaction): the ones the database
/// refuses for their content are left out and reported as `(index, SQLSTATE, message)`.
/// Slow; only for a batch that `insert_batch` could not store. `data` goes as text, so
/// that even a value jsonb refuses is refused row by row.
pub async fn insert_each(
    tx: &mut Transaction<'_, Postgres>,
    events: &[AgentEvent],
) -> Result<Vec<(i32, String, String)>, sqlx::Error> {
    let c = Columns::of(events, Value::to_string);
    bind_events!(
        sqlx::query_as(
            "SELECT idx, code, message FROM agentry_insert_events_each($1, $2, $3, $4, $5, $6)",
        ),
        c
    )
    .fetch_all(&mut **tx)
    .await
}

pub async fn last_seq(db: impl PgExecutor<'_>, agent_id: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT COALESCE(max(seq), 0) FROM agent_events WHERE agent_id = $1")
        .bind(agent_id)
        .fetch_one(db)
        .await
}

/// The last seq of each given agent that has events (agents without any are absent).
pub async fn last_seqs(
    db: impl PgExecutor<'_>,
    agent_ids: &[Uuid],
) -> Result<Vec<(Uuid, i64)>, sqlx::Error> {
    // One index probe per agent (backwards on the primary key), whatever its length.
    sqlx::query_as(
        "SELECT a.id, m.seq FROM UNNEST($1::uuid[]) AS a(id)
         CROSS JOIN LATERAL (SELECT max(seq) AS seq FROM agent_events e WHERE e.agent_id = a.id) m
         WHERE m.seq IS NOT NULL",
    )
    .bind(agent_ids)
    .fetch_all(db)
    .await
}

/// Events after `after_seq`, oldest first.
pub async fn page_after(
    db: impl PgExecutor<'_>,
    agent_id: Uuid,
    after_seq: i64,
    limit: i64,
) -> Result<Vec<EventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT agent_id, seq, turn_id, kind, data, created_at FROM agent_events
         WHERE agent_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
    )
    .bind(agent_id)
    .bind(after_seq)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Events before `before_seq`, newest first.
pub async fn page_before(
    db: impl PgExecutor<'_>,
    agent_id: Uuid,
    before_seq: i64,
    limit: i64,
) -> Result<Vec<EventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT agent_id, seq, turn_id, kind, data, created_at FROM agent_events
         WHERE agent_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3",
    )
    .bind(agent_id)
    .bind(before_seq)
    .bind(limit)
    .fetch_all(db)
    .await
}

#[derive(Debug, Clone, FromRow, serde::Deserialize)]
pub struct TeamEventRow {
    pub id: i64,
    pub team_id: Uuid,
    pub project_id: Option<Uuid>,
    pub workspace_id: Option<Uuid>,
    pub kind: String,
    pub data: Value,
    pub at: DateTime<Utc>,
}

pub async fn insert_team_event(
    tx: &mut Transaction<'_, Postgres>,
    team_id: Uuid,
    project_id: Option<Uuid>,
    workspace_id: Option<Uuid>,
    kind: &str,
    data: &Value,
) -> Result<TeamEventRow, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO team_events (team_id, project_id, workspace_id, kind, data) VALUES ($1, $2, $3, $4, $5)
         RETURNING id, team_id, project_id, workspace_id, kind, data, at",
    )
    .bind(team_id)
    .bind(project_id)
    .bind(workspace_id)
    .bind(kind)
    .bind(data)
    .fetch_one(&mut **tx)
    .await
}

pub async fn team_events_after(
    db: impl PgExecutor<'_>,
    teams: Option<&[Uuid]>,
    after_id: i64,
    limit: i64,
) -> Result<Vec<TeamEventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, project_id, workspace_id, kind, data, at FROM team_events
         WHERE ($1::uuid[] IS NULL OR team_id = ANY($1)) AND id > $2 ORDER BY id LIMIT $3",
    )
    .bind(teams)
    .bind(after_id)
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn last_team_event_id(db: impl PgExecutor<'_>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT COALESCE(max(id), 0) FROM team_events")
        .fetch_one(db)
        .await
}

/// The team events with these ids, oldest first.
pub async fn team_events_by_ids(
    db: impl PgExecutor<'_>,
    ids: &[i64],
) -> Result<Vec<TeamEventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, project_id, workspace_id, kind, data, at FROM team_events
         WHERE id = ANY($1) ORDER BY id",
    )
    .bind(ids)
    .fetch_all(db)
    .await
}

/// One moment to store: the agent and seq of the event it goes with, its kind, the hook
/// event it is announced as, its data.
#[derive(Debug, Clone, Copy)]
pub struct MomentRow<'a> {
    pub agent_id: Uuid,
    pub seq: i64,
    pub kind: &'a str,
    pub hook: &'a str,
    pub data: &'a Value,
}

/// A team event to store (its id and time are the table's).
#[derive(Debug, Clone, Copy)]
pub struct NewTeamRow<'a> {
    pub team_id: Uuid,
    pub project_id: Option<Uuid>,
    pub workspace_id: Option<Uuid>,
    pub kind: &'a str,
    pub data: &'a Value,
}

/// The agent rows and permission requests a batch changes (`insert_batch_with`): at most
/// one entry per agent, each the net effect of what the batch says of that agent.
#[derive(Debug, Default)]
pub struct StateRows<'a> {
    pub agents: Vec<AgentRowUpdate<'a>>,
    /// Permission requests that expire, if they are still pending.
    pub expired_permissions: Vec<Uuid>,
}

impl StateRows<'_> {
    pub fn is_empty(&self) -> bool {
        self.agents.is_empty() && self.expired_permissions.is_empty()
    }
}

/// What a batch writes to one agent's row.
#[derive(Debug, Clone, Default)]
pub struct AgentRowUpdate<'a> {
    pub agent_id: Uuid,
    /// This turn becomes the agent's last one, with no outcome yet.
    pub started_turn: Option<Uuid>,
    /// This turn ended: its outcome and error are kept if it is (then) the last one.
    pub ended_turn: Option<(Uuid, &'a str, Option<&'a str>)>,
    /// The agent's status and why.
    pub status: Option<(&'a str, Option<&'a str>)>,
    /// The agent's mode.
    pub mode: Option<&'a str>,
    /// The agent's model.
    pub model: Option<&'a str>,
}

/// Events, moments, team events and the state they announce, in one statement (see
/// `insert_batch_with`). The agent rows are locked in id order, as every statement that
/// locks several agent rows does (`replicas::renew`), so two of them never deadlock: those
/// whose state changes and those whose fence is checked, together. When a fence does not
/// hold, nothing at all is written.
const INSERT_BATCH_WITH: &str = concat!(
    "WITH locked AS MATERIALIZED (
            SELECT id, lease_epoch FROM agents WHERE id = ANY($17::uuid[]) OR id = ANY($25::uuid[])
             ORDER BY id FOR NO KEY UPDATE
         ), deposed AS MATERIALIZED (
            SELECT f.id, f.epoch FROM UNNEST($25::uuid[], $26::int8[]) AS f(id, epoch)
              JOIN locked l ON l.id = f.id WHERE l.lease_epoch <> f.epoch
         ), stored AS (
            INSERT INTO agent_events (agent_id, seq, turn_id, kind, data, created_at)
            SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::text[], $5::jsonb[], $6::timestamptz[])
             WHERE NOT EXISTS (SELECT 1 FROM deposed)
         ), moments AS (
            ",
    insert_moments_sql!(7, 8, 9, 10, 11),
    "
              AND NOT EXISTS (SELECT 1 FROM deposed)
         ), agent_rows AS (
            UPDATE agents a SET
              last_turn_id = COALESCE(u.started, a.last_turn_id),
              last_turn_outcome = CASE WHEN u.ended = COALESCE(u.started, a.last_turn_id) THEN u.outcome
                                       WHEN u.started IS NOT NULL THEN NULL
                                       ELSE a.last_turn_outcome END,
              last_turn_error = CASE WHEN u.ended = COALESCE(u.started, a.last_turn_id) THEN u.error
                                     WHEN u.started IS NOT NULL THEN NULL
                                     ELSE a.last_turn_error END,
              status = COALESCE(u.status, a.status),
              status_reason = CASE WHEN u.status IS NULL THEN a.status_reason ELSE u.reason END,
              mode = COALESCE(u.mode, a.mode),
              model = COALESCE(u.model, a.model)
            FROM UNNEST($17::uuid[], $18::uuid[], $19::uuid[], $20::text[], $21::text[], $22::text[], $23::text[],
                        $27::text[], $28::text[])
                 AS u(id, started, ended, outcome, error, status, reason, mode, model)
            WHERE a.id = u.id AND a.id IN (SELECT id FROM locked)
              AND NOT EXISTS (SELECT 1 FROM deposed)
         ), expired AS (
            UPDATE permission_requests SET status = 'expired', resolved_at = now()
            WHERE id = ANY($24::uuid[]) AND status = 'pending'
              AND NOT EXISTS (SELECT 1 FROM deposed)
         ), team_rows AS (
            INSERT INTO team_events (team_id, project_id, workspace_id, kind, data)
            SELECT t, p, w, k, d
            FROM UNNEST($12::uuid[], $13::uuid[], $14::uuid[], $15::text[], $16::jsonb[])
                 WITH ORDINALITY AS x(t, p, w, k, d, n)
            WHERE NOT EXISTS (SELECT 1 FROM deposed)
            ORDER BY n
            RETURNING id, team_id, project_id, workspace_id, kind, data, at
         )
         SELECT (SELECT COALESCE(json_agg(r ORDER BY r.id), '[]'::json) FROM team_rows r) AS team,
                (SELECT COALESCE(array_agg(id), '{}') FROM deposed) AS deposed_ids,
                (SELECT COALESCE(array_agg(epoch), '{}') FROM deposed) AS deposed_epochs"
);

/// What `insert_batch_with` did: the team events stored (in id order), or, when a fence
/// did not hold, nothing at all and the fences that failed.
#[derive(Debug)]
pub enum Stored {
    Team(Vec<TeamEventRow>),
    Deposed(Vec<FenceRow>),
}

/// Insert a batch of events, their moments and team events, and write the state they
/// announce, in one statement (a data-modifying `WITH`): on its own, one atomic commit and
/// one round trip, like `insert_batch`, however much it holds. Team events take their ids
/// in the order given; the stored rows come back in that order. With `fences`, all of it is
/// stored only if each holds (see `insert_batch_fenced`).
pub async fn insert_batch_with(
    db: impl PgExecutor<'_>,
    events: &[AgentEvent],
    moments: &[MomentRow<'_>],
    team: &[NewTeamRow<'_>],
    state: &StateRows<'_>,
    fences: &[FenceRow],
) -> Result<Stored, sqlx::Error> {
    let c = Columns::of(events, sqlx::types::Json);
    let m = MomentColumns::of(moments);
    let a = &state.agents;
    let (rows, ids, epochs): (sqlx::types::Json<Vec<TeamEventRow>>, Vec<Uuid>, Vec<i64>) =
        bind_moments!(bind_events!(sqlx::query_as(INSERT_BATCH_WITH), c), m)
            .bind(team.iter().map(|t| t.team_id).collect::<Vec<_>>())
            .bind(team.iter().map(|t| t.project_id).collect::<Vec<_>>())
            .bind(team.iter().map(|t| t.workspace_id).collect::<Vec<_>>())
            .bind(team.iter().map(|t| t.kind).collect::<Vec<_>>())
            .bind(
                team.iter()
                    .map(|t| sqlx::types::Json(t.data))
                    .collect::<Vec<_>>(),
            )
            .bind(a.iter().map(|r| r.agent_id).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.started_turn).collect::<Vec<_>>())
            .bind(
                a.iter()
                    .map(|r| r.ended_turn.map(|e| e.0))
                    .collect::<Vec<_>>(),
            )
            .bind(
                a.iter()
                    .map(|r| r.ended_turn.map(|e| e.1))
                    .collect::<Vec<_>>(),
            )
            .bind(
                a.iter()
                    .map(|r| r.ended_turn.and_then(|e| e.2))
                    .collect::<Vec<_>>(),
            )
            .bind(a.iter().map(|r| r.status.map(|s| s.0)).collect::<Vec<_>>())
            .bind(
                a.iter()
                    .map(|r| r.status.and_then(|s| s.1))
                    .collect::<Vec<_>>(),
            )
            .bind(&state.expired_permissions)
            .bind(fences.iter().map(|f| f.0).collect::<Vec<_>>())
            .bind(fences.iter().map(|f| f.1).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.mode).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.model).collect::<Vec<_>>())
            .fetch_one(db)
            .await?;
    if !ids.is_empty() {
        return Ok(Stored::Deposed(ids.into_iter().zip(epochs).collect()));
    }
    let mut rows = rows.0;
    rows.sort_by_key(|r| r.id);
    Ok(Stored::Team(rows))
}

struct MomentColumns<'a> {
    agents: Vec<Uuid>,
    seqs: Vec<i64>,
    kinds: Vec<&'a str>,
    data: Vec<sqlx::types::Json<&'a Value>>,
    hooks: Vec<&'a str>,
}

impl<'a> MomentColumns<'a> {
    fn of(moments: &[MomentRow<'a>]) -> Self {
        Self {
            agents: moments.iter().map(|m| m.agent_id).collect(),
            seqs: moments.iter().map(|m| m.seq).collect(),
            kinds: moments.iter().map(|m| m.kind).collect(),
            data: moments.iter().map(|m| sqlx::types::Json(m.data)).collect(),
            hooks: moments.iter().map(|m| m.hook).collect(),
        }
    }
}

/// Store moments in one statement (inside the transaction of their events).
pub async fn insert_moments(
    db: impl PgExecutor<'_>,
    moments: &[MomentRow<'_>],
) -> Result<(), sqlx::Error> {
    let m = MomentColumns::of(moments);
    bind_moments!(sqlx::query(insert_moments_sql!(1, 2, 3, 4, 5)), m)
        .execute(db)
        .await?;
    Ok(())
}
