//! Waiting prompts (`queued_messages`): follow-ups for a busy agent and prompts over the
//! running-turn limits, the running turns those limits count, and the order in which
//! teams were last served (round-robin).

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};
use uuid::Uuid;

/// The advisory lock that serializes admissions against the running-turn limits, on every
/// replica.
const ADMISSION_LOCK: i64 = 0x6167_656e_7471_7565; // "agentque"

#[derive(Debug, Clone, FromRow)]
pub struct MessageRow {
    pub id: Uuid,
    pub seq: i64,
    pub agent_id: Uuid,
    pub team_id: Uuid,
    pub text: String,
    pub client_message_id: Option<String>,
    pub interrupt: bool,
    pub created_by: Option<Uuid>,
    pub token_id: Option<Uuid>,
    pub reason: String,
    pub state: String,
    pub turn_id: Option<Uuid>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, seq, agent_id, team_id, text, client_message_id, interrupt, created_by, token_id, \
     reason, state, turn_id, error, created_at, ended_at";

pub struct NewMessage<'a> {
    pub id: Uuid,
    pub agent_id: Uuid,
    pub team_id: Uuid,
    pub text: &'a str,
    pub client_message_id: Option<&'a str>,
    pub interrupt: bool,
    pub created_by: Option<Uuid>,
    pub token_id: Option<Uuid>,
    pub reason: &'a str,
}

pub async fn insert(db: impl PgExecutor<'_>, m: &NewMessage<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO queued_messages (id, agent_id, team_id, text, client_message_id, interrupt,
                                      created_by, token_id, reason, state)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'queued')",
    )
    .bind(m.id)
    .bind(m.agent_id)
    .bind(m.team_id)
    .bind(m.text)
    .bind(m.client_message_id)
    .bind(m.interrupt)
    .bind(m.created_by)
    .bind(m.token_id)
    .bind(m.reason)
    .execute(db)
    .await?;
    Ok(())
}

/// The agent's messages in `state` (all when `None`), in the order they run: steering
/// messages first, then by arrival.
pub async fn list(
    db: impl PgExecutor<'_>,
    agent: Uuid,
    state: Option<&str>,
) -> Result<Vec<MessageRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM queued_messages
          WHERE agent_id = $1 AND ($2::text IS NULL OR state = $2)
          ORDER BY (state = 'queued') DESC, interrupt DESC, seq LIMIT 500"
    )))
    .bind(agent)
    .bind(state)
    .fetch_all(db)
    .await
}

pub async fn get(
    db: impl PgExecutor<'_>,
    agent: Uuid,
    id: Uuid,
) -> Result<Option<MessageRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM queued_messages WHERE agent_id = $1 AND id = $2"
    )))
    .bind(agent)
    .bind(id)
    .fetch_optional(db)
    .await
}

/// Cancel a waiting message; `false` when it is not waiting (any more).
pub async fn cancel(db: impl PgExecutor<'_>, agent: Uuid, id: Uuid) -> Result<bool, sqlx::Error> {
    let n = sqlx::query(
        "UPDATE queued_messages SET state = 'canceled', ended_at = now()
          WHERE agent_id = $1 AND id = $2 AND state = 'queued'",
    )
    .bind(agent)
    .bind(id)
    .execute(db)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Cancel every waiting message of an agent (it was archived). Returns their ids.
pub async fn cancel_all(db: impl PgExecutor<'_>, agent: Uuid) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE queued_messages SET state = 'canceled', ended_at = now(), error = 'the agent was archived'
          WHERE agent_id = $1 AND state = 'queued' RETURNING id",
    )
    .bind(agent)
    .fetch_all(db)
    .await
}

/// How many messages of the agent wait, and where the agent stands: 1-based position of
/// its next message in the queue.
pub async fn waiting_count(db: impl PgExecutor<'_>, agent: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM queued_messages WHERE agent_id = $1 AND state = 'queued'",
    )
    .bind(agent)
    .fetch_one(db)
    .await
}

/// A waiting message at the head of its agent's queue, with what decides when it runs.
#[derive(Debug, Clone, FromRow)]
pub struct HeadRow {
    pub id: Uuid,
    pub seq: i64,
    pub agent_id: Uuid,
    pub team_id: Uuid,
    pub reason: String,
    pub created_at: DateTime<Utc>,
    /// Its agent runs a turn now.
    pub agent_busy: bool,
    /// The replica that runs its agent, when one does (its lease lasts).
    pub owner: Option<String>,
    /// When the team was last given a running turn (a counter; null: never).
    pub last_served: Option<i64>,
    /// Messages of the agent that wait, this one included.
    pub agent_waiting: i64,
}

/// The head of every agent's queue, in the order they are served: teams round-robin (at
/// each round, the team served longest ago first), first in first out within a team.
pub async fn heads(db: impl PgExecutor<'_>) -> Result<Vec<HeadRow>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT x.* FROM (
           SELECT h.id, h.seq, h.agent_id, h.team_id, h.reason, h.created_at,
                  (a.last_turn_id IS NOT NULL AND a.last_turn_outcome IS NULL) AS agent_busy,
                  CASE WHEN ",
        lease_live!("a"),
        " THEN a.owner_replica END AS owner,
                  s.last_served,
                  (SELECT count(*) FROM queued_messages w
                    WHERE w.agent_id = h.agent_id AND w.state = 'queued') AS agent_waiting
             FROM (SELECT DISTINCT ON (agent_id) id, seq, agent_id, team_id, reason, created_at
                     FROM queued_messages WHERE state = 'queued'
                    ORDER BY agent_id, interrupt DESC, seq) h
             JOIN agents a ON a.id = h.agent_id
             LEFT JOIN capacity_served s ON s.team_id = h.team_id) x
          ORDER BY row_number() OVER (PARTITION BY x.team_id, x.agent_busy ORDER BY x.seq),
                   x.last_served NULLS FIRST, x.seq
          LIMIT 1000"
    ))
    .fetch_all(db)
    .await
}

/// Take the waiting head message `id` for starting it, holding its row until the
/// transaction ends; `None` when it is no longer waiting or another replica holds it.
pub async fn claim(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
) -> Result<Option<MessageRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM queued_messages WHERE id = $1 AND state = 'queued'
            FOR UPDATE SKIP LOCKED"
    )))
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
}

pub async fn mark_started(
    db: impl PgExecutor<'_>,
    id: Uuid,
    turn: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE queued_messages SET state = 'started', turn_id = $2, ended_at = now() WHERE id = $1",
    )
    .bind(id)
    .bind(turn)
    .execute(db)
    .await?;
    Ok(())
}

pub async fn mark_failed(
    db: impl PgExecutor<'_>,
    id: Uuid,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE queued_messages SET state = 'failed', error = $2, ended_at = now() WHERE id = $1",
    )
    .bind(id)
    .bind(error)
    .execute(db)
    .await?;
    Ok(())
}

/// What an admission reads, in one statement: whether anything waits for capacity (a new
/// prompt then waits behind it), and the turns running as `running_turns` counts them.
pub async fn admission_state(
    db: impl PgExecutor<'_>,
    team: Uuid,
) -> Result<(bool, (i64, i64)), sqlx::Error> {
    let (waiting, all, own): (bool, i64, i64) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM queued_messages WHERE state = 'queued' AND reason = 'capacity'),
                count(*), count(*) FILTER (WHERE team_id = $1) FROM agents
          WHERE last_turn_id IS NOT NULL AND last_turn_outcome IS NULL AND archived_at IS NULL",
    )
    .bind(team)
    .fetch_one(db)
    .await?;
    Ok((waiting, (all, own)))
}

/// Hold the admission lock until the transaction ends.
pub async fn lock_admissions(tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(ADMISSION_LOCK)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Turns running now: on the whole server, and for `team`.
pub async fn running_turns(db: impl PgExecutor<'_>, team: Uuid) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE team_id = $1) FROM agents
          WHERE last_turn_id IS NOT NULL AND last_turn_outcome IS NULL AND archived_at IS NULL",
    )
    .bind(team)
    .fetch_one(db)
    .await
}

/// Running turns per team (for `GET /v1/queue`).
pub async fn running_by_team(db: impl PgExecutor<'_>) -> Result<Vec<(Uuid, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT team_id, count(*) FROM agents
          WHERE last_turn_id IS NOT NULL AND last_turn_outcome IS NULL AND archived_at IS NULL
          GROUP BY team_id",
    )
    .fetch_all(db)
    .await
}

/// `team` was just given a running turn: it goes to the back of the round-robin.
pub async fn served(db: impl PgExecutor<'_>, team: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO capacity_served (team_id, last_served) VALUES ($1, nextval('capacity_turns'))
         ON CONFLICT (team_id) DO UPDATE SET last_served = EXCLUDED.last_served",
    )
    .bind(team)
    .execute(db)
    .await?;
    Ok(())
}
