//! Triggers and their runs, as stored. A webhook trigger's secret is kept sealed (key
//! id, nonce, ciphertext); nothing here sees it in clear. A run row is unique per
//! (trigger, delivery id) and per (trigger, slot): whoever inserts it owns it, anyone
//! else finds it. A pending run is acted on by the one worker that takes it.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct TriggerRow {
    pub id: Uuid,
    pub team_id: Uuid,
    pub project_id: Uuid,
    pub name: String,
    pub kind: String,
    pub enabled: bool,
    pub spec: Value,
    pub secret_key_id: Option<String>,
    pub secret_nonce: Option<Vec<u8>>,
    pub secret_ciphertext: Option<Vec<u8>>,
    pub last_slot: Option<DateTime<Utc>>,
    pub created_by: Uuid,
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, team_id, project_id, name, kind, enabled, spec, secret_key_id, \
     secret_nonce, secret_ciphertext, last_slot, created_by, created_at";

pub struct NewTrigger<'a> {
    pub id: Uuid,
    pub team_id: Uuid,
    pub project_id: Uuid,
    pub name: &'a str,
    pub kind: &'a str,
    pub enabled: bool,
    pub spec: &'a Value,
    /// (key id, nonce, ciphertext)
    pub sealed: Option<(&'a str, &'a [u8], &'a [u8])>,
    pub last_slot: Option<DateTime<Utc>>,
    pub created_by: Uuid,
}

pub async fn insert(
    db: impl PgExecutor<'_>,
    t: &NewTrigger<'_>,
) -> Result<TriggerRow, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO triggers (id, team_id, project_id, name, kind, enabled, spec,
                               secret_key_id, secret_nonce, secret_ciphertext, last_slot,
                               created_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         RETURNING {COLUMNS}"
    )))
    .bind(t.id)
    .bind(t.team_id)
    .bind(t.project_id)
    .bind(t.name)
    .bind(t.kind)
    .bind(t.enabled)
    .bind(t.spec)
    .bind(t.sealed.map(|s| s.0))
    .bind(t.sealed.map(|s| s.1))
    .bind(t.sealed.map(|s| s.2))
    .bind(t.last_slot)
    .bind(t.created_by)
    .fetch_one(db)
    .await
}

/// Trigger `id`, when it belongs to one of `teams` (`None`: any team).
pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
    teams: Option<&[Uuid]>,
) -> Result<Option<TriggerRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM triggers
         WHERE id = $1 AND ($2::uuid[] IS NULL OR team_id = ANY($2))"
    )))
    .bind(id)
    .bind(teams)
    .fetch_optional(db)
    .await
}

/// The triggers of `teams` (`None`: every team), by id, after `after`.
pub async fn list(
    db: impl PgExecutor<'_>,
    teams: Option<&[Uuid]>,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<TriggerRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM triggers
         WHERE ($1::uuid[] IS NULL OR team_id = ANY($1)) AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3"
    )))
    .bind(teams)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Every enabled cron trigger, for the scheduler.
pub async fn enabled_schedules(db: impl PgExecutor<'_>) -> Result<Vec<TriggerRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM triggers WHERE kind = 'cron' AND enabled ORDER BY id"
    )))
    .fetch_all(db)
    .await
}

pub struct TriggerChange<'a> {
    pub name: &'a str,
    pub enabled: bool,
    pub spec: &'a Value,
    /// Set when the schedule changed: slots up to here are not run.
    pub last_slot: Option<DateTime<Utc>>,
}

pub async fn update(
    db: impl PgExecutor<'_>,
    id: Uuid,
    c: &TriggerChange<'_>,
) -> Result<Option<TriggerRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE triggers SET name = $2, enabled = $3, spec = $4,
                last_slot = COALESCE($5, last_slot)
         WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(c.name)
    .bind(c.enabled)
    .bind(c.spec)
    .bind(c.last_slot)
    .fetch_optional(db)
    .await
}

pub async fn delete(db: impl PgExecutor<'_>, id: Uuid) -> Result<bool, sqlx::Error> {
    Ok(sqlx::query("DELETE FROM triggers WHERE id = $1")
        .bind(id)
        .execute(db)
        .await?
        .rows_affected()
        == 1)
}

/// Moves a cron trigger's considered slots forward to `slot` (never back).
pub async fn advance_slot(
    db: impl PgExecutor<'_>,
    id: Uuid,
    slot: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE triggers SET last_slot = $2
         WHERE id = $1 AND (last_slot IS NULL OR last_slot < $2)",
    )
    .bind(id)
    .bind(slot)
    .execute(db)
    .await
    .map(|_| ())
}

#[derive(Debug, Clone, FromRow)]
pub struct RunRow {
    pub id: Uuid,
    pub trigger_id: Uuid,
    pub delivery_id: Option<String>,
    pub slot: Option<DateTime<Utc>>,
    pub event: String,
    /// `pending`, `running`, `done` or `failed`.
    pub state: String,
    /// Known once the run ended.
    pub outcome: Option<String>,
    pub reason: Option<String>,
    pub agent_id: Option<Uuid>,
    pub workspace_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    /// What the run is to do, until it ends.
    pub work: Option<Value>,
    /// How many times a worker claimed it.
    pub attempt: i32,
}

const RUN_COLUMNS: &str = "id, trigger_id, delivery_id, slot, event, state, outcome, reason, \
     agent_id, workspace_id, created_at, work, attempt";

pub struct NewRun<'a> {
    pub id: Uuid,
    pub trigger_id: Uuid,
    pub delivery_id: Option<&'a str>,
    pub slot: Option<DateTime<Utc>>,
    pub event: &'a str,
    /// `pending` (a worker acts), `running` (the caller acts now, under a lease of
    /// `lease_s` seconds) or `done` (nothing to do).
    pub state: &'a str,
    pub work: Option<&'a Value>,
    pub lease_s: i64,
    pub outcome: Option<&'a str>,
    pub reason: Option<&'a str>,
}

/// Claims a delivery or a slot: the new run, or `None` when another run holds it.
pub async fn claim(db: impl PgExecutor<'_>, r: &NewRun<'_>) -> Result<Option<RunRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO trigger_runs (id, trigger_id, delivery_id, slot, event, outcome, reason,
                                   state, work, lease_until, attempt)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9,
                 CASE WHEN $8 = 'running' THEN now() + make_interval(secs => $10) END,
                 CASE WHEN $8 = 'running' THEN 1 ELSE 0 END)
         ON CONFLICT DO NOTHING
         RETURNING {RUN_COLUMNS}"
    )))
    .bind(r.id)
    .bind(r.trigger_id)
    .bind(r.delivery_id)
    .bind(r.slot)
    .bind(r.event)
    .bind(r.outcome)
    .bind(r.reason)
    .bind(r.state)
    .bind(r.work)
    .bind(r.lease_s as f64)
    .fetch_optional(db)
    .await
}

/// Takes the oldest run that waits for a worker: a pending one, or a running one whose
/// worker let its lease lapse (it died). The run becomes `running` under a lease of
/// `lease_s` seconds, with its attempt counted. Two workers never take the same run:
/// the row is locked, and one locked by another worker is skipped.
pub async fn take_unfinished(
    db: impl PgExecutor<'_>,
    lease_s: i64,
) -> Result<Option<RunRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE trigger_runs SET state = 'running',
                lease_until = now() + make_interval(secs => $1), attempt = attempt + 1
         WHERE id = (SELECT id FROM trigger_runs
                      WHERE state = 'pending' OR (state = 'running' AND lease_until < now())
                      ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
         RETURNING {RUN_COLUMNS}"
    )))
    .bind(lease_s as f64)
    .fetch_optional(db)
    .await
}

/// Extends the lease of attempt `attempt` of run `id`; false when it is no longer held.
pub async fn renew(
    db: impl PgExecutor<'_>,
    id: Uuid,
    attempt: i32,
    lease_s: i64,
) -> Result<bool, sqlx::Error> {
    Ok(sqlx::query(
        "UPDATE trigger_runs SET lease_until = now() + make_interval(secs => $3)
         WHERE id = $1 AND attempt = $2 AND state = 'running'",
    )
    .bind(id)
    .bind(attempt)
    .bind(lease_s as f64)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// Gives run `id` back (attempt `attempt` was cut short): it is pending again.
pub async fn release(db: impl PgExecutor<'_>, id: Uuid, attempt: i32) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE trigger_runs SET state = 'pending', lease_until = NULL
         WHERE id = $1 AND attempt = $2 AND state = 'running'",
    )
    .bind(id)
    .bind(attempt)
    .execute(db)
    .await
    .map(|_| ())
}

/// The run that holds delivery `delivery_id` of trigger `trigger`.
pub async fn by_delivery(
    db: impl PgExecutor<'_>,
    trigger: Uuid,
    delivery_id: &str,
) -> Result<Option<RunRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {RUN_COLUMNS} FROM trigger_runs WHERE trigger_id = $1 AND delivery_id = $2"
    )))
    .bind(trigger)
    .bind(delivery_id)
    .fetch_optional(db)
    .await
}

/// Records what attempt `attempt` of a run did: it is `failed` when its outcome is,
/// `done` otherwise. `None` when the attempt no longer holds the run.
pub async fn finish(
    db: impl PgExecutor<'_>,
    id: Uuid,
    attempt: i32,
    outcome: &str,
    reason: Option<&str>,
    agent_id: Option<Uuid>,
    workspace_id: Option<Uuid>,
) -> Result<Option<RunRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE trigger_runs SET outcome = $3, reason = $4, agent_id = $5, workspace_id = $6,
                state = CASE WHEN $3 = 'failed' THEN 'failed' ELSE 'done' END,
                work = NULL, lease_until = NULL
         WHERE id = $1 AND attempt = $2 AND state = 'running' RETURNING {RUN_COLUMNS}"
    )))
    .bind(id)
    .bind(attempt)
    .bind(outcome)
    .bind(reason)
    .bind(agent_id)
    .bind(workspace_id)
    .fetch_optional(db)
    .await
}

/// The runs of trigger `trigger`, newest first, before `before`.
pub async fn runs(
    db: impl PgExecutor<'_>,
    trigger: Uuid,
    before: Option<Uuid>,
    limit: i64,
) -> Result<Vec<RunRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {RUN_COLUMNS} FROM trigger_runs
         WHERE trigger_id = $1 AND ($2::uuid IS NULL OR id < $2)
         ORDER BY id DESC LIMIT $3"
    )))
    .bind(trigger)
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// The live workspace of project `project` whose opened pull/merge request is `number`,
/// and its most recent agent that is not archived.
pub async fn agent_of_pull_request(
    db: impl PgExecutor<'_>,
    project: Uuid,
    number: i64,
) -> Result<Option<(Uuid, Option<Uuid>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT w.id,
                (SELECT a.id FROM agents a
                  WHERE a.workspace_id = w.id AND a.archived_at IS NULL
                  ORDER BY a.id DESC LIMIT 1)
         FROM workspaces w JOIN workspace_remotes r ON r.workspace_id = w.id
         WHERE w.project_id = $1 AND r.pr_number = $2 AND w.archived_at IS NULL
         ORDER BY w.id DESC LIMIT 1",
    )
    .bind(project)
    .bind(number)
    .fetch_optional(db)
    .await
}

/// Like `agent_of_pull_request`, for the workspace whose pushed branch is `branch` and
/// whose pull/merge request is recorded.
pub async fn agent_of_pushed_branch(
    db: impl PgExecutor<'_>,
    project: Uuid,
    branch: &str,
) -> Result<Option<(Uuid, Option<Uuid>, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT w.id,
                (SELECT a.id FROM agents a
                  WHERE a.workspace_id = w.id AND a.archived_at IS NULL
                  ORDER BY a.id DESC LIMIT 1),
                r.pr_number
         FROM workspaces w JOIN workspace_remotes r ON r.workspace_id = w.id
         WHERE w.project_id = $1 AND r.pushed_branch = $2 AND r.pr_number IS NOT NULL
           AND w.archived_at IS NULL
         ORDER BY w.id DESC LIMIT 1",
    )
    .bind(project)
    .bind(branch)
    .fetch_optional(db)
    .await
}
