//! Hooks and their delivery outbox, as stored. A hook's signing secret is kept sealed
//! (key id, nonce, ciphertext); nothing here sees it in clear. Deliveries are claimed by
//! workers with `FOR UPDATE SKIP LOCKED`, so several replicas never send one twice at once.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

/// A hook as the API shows it (no secret).
#[derive(Debug, Clone, FromRow)]
pub struct HookRow {
    pub id: Uuid,
    pub team_id: Option<Uuid>,
    pub name: String,
    pub events: Vec<String>,
    pub url: String,
    pub project_id: Option<Uuid>,
    pub labels: Value,
    pub enabled: bool,
    pub settings_position: Option<i32>,
    pub created_at: DateTime<Utc>,
}

/// A hook with its sealed secret, to call it.
#[derive(Debug, Clone, FromRow)]
pub struct CallableHook {
    #[sqlx(flatten)]
    pub hook: HookRow,
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// A hook to store.
pub struct NewHook<'a> {
    pub id: Uuid,
    pub team_id: Option<Uuid>,
    pub name: &'a str,
    pub events: &'a [String],
    pub url: &'a str,
    pub key_id: &'a str,
    pub nonce: &'a [u8],
    pub ciphertext: &'a [u8],
    pub project_id: Option<Uuid>,
    pub labels: &'a Value,
    pub enabled: bool,
    pub settings_position: Option<i32>,
    pub created_by: Option<Uuid>,
}

const HOOK_COLUMNS: &str = "id, team_id, name, events, url, project_id, labels, enabled, \
                            settings_position, created_at";

pub async fn insert(db: impl PgExecutor<'_>, h: &NewHook<'_>) -> Result<HookRow, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO hooks (id, team_id, name, events, url, key_id, nonce, ciphertext,
                            project_id, labels, enabled, settings_position, created_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
         ON CONFLICT (id) DO UPDATE SET
            name = EXCLUDED.name, events = EXCLUDED.events, url = EXCLUDED.url,
            key_id = EXCLUDED.key_id, nonce = EXCLUDED.nonce, ciphertext = EXCLUDED.ciphertext,
            project_id = EXCLUDED.project_id, labels = EXCLUDED.labels,
            enabled = EXCLUDED.enabled, settings_position = EXCLUDED.settings_position
         RETURNING {HOOK_COLUMNS}"
    )))
    .bind(h.id)
    .bind(h.team_id)
    .bind(h.name)
    .bind(h.events)
    .bind(h.url)
    .bind(h.key_id)
    .bind(h.nonce)
    .bind(h.ciphertext)
    .bind(h.project_id)
    .bind(h.labels)
    .bind(h.enabled)
    .bind(h.settings_position)
    .bind(h.created_by)
    .fetch_one(db)
    .await
}

/// Replace the settings-file hooks by `keep` (ids): the others are deleted.
pub async fn delete_settings_hooks_except(
    db: impl PgExecutor<'_>,
    keep: &[Uuid],
) -> Result<u64, sqlx::Error> {
    let done =
        sqlx::query("DELETE FROM hooks WHERE settings_position IS NOT NULL AND NOT (id = ANY($1))")
            .bind(keep)
            .execute(db)
            .await?;
    Ok(done.rows_affected())
}

/// The hook, when it is server-wide or of one of `teams` (`None`: every team).
pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
    teams: Option<&[Uuid]>,
) -> Result<Option<HookRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {HOOK_COLUMNS} FROM hooks
         WHERE id = $1 AND (team_id IS NULL OR $2::uuid[] IS NULL OR team_id = ANY($2))"
    )))
    .bind(id)
    .bind(teams)
    .fetch_optional(db)
    .await
}

/// Hooks of `teams` (`None`: every team), with the server-wide ones when
/// `with_server`, by id after `after`.
pub async fn list(
    db: impl PgExecutor<'_>,
    teams: Option<&[Uuid]>,
    with_server: bool,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<HookRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {HOOK_COLUMNS} FROM hooks
         WHERE ((team_id IS NULL AND $2) OR (team_id IS NOT NULL AND ($1::uuid[] IS NULL OR team_id = ANY($1))))
           AND ($3::uuid IS NULL OR id > $3)
         ORDER BY id LIMIT $4"
    )))
    .bind(teams)
    .bind(with_server)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// What `update` changes (`None`: unchanged).
#[derive(Default)]
pub struct HookChange<'a> {
    pub name: Option<&'a str>,
    pub events: Option<&'a [String]>,
    pub url: Option<&'a str>,
    pub sealed: Option<(&'a str, &'a [u8], &'a [u8])>,
    pub project_id: Option<Option<Uuid>>,
    pub labels: Option<&'a Value>,
    pub enabled: Option<bool>,
}

pub async fn update(
    db: impl PgExecutor<'_>,
    id: Uuid,
    c: &HookChange<'_>,
) -> Result<Option<HookRow>, sqlx::Error> {
    let (key_id, nonce, ciphertext) = match c.sealed {
        Some((k, n, ct)) => (Some(k), Some(n), Some(ct)),
        None => (None, None, None),
    };
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE hooks SET
            name = COALESCE($2, name), events = COALESCE($3, events), url = COALESCE($4, url),
            key_id = COALESCE($5, key_id), nonce = COALESCE($6, nonce),
            ciphertext = COALESCE($7, ciphertext),
            project_id = CASE WHEN $8 THEN $9 ELSE project_id END,
            labels = COALESCE($10, labels), enabled = COALESCE($11, enabled)
         WHERE id = $1 RETURNING {HOOK_COLUMNS}"
    )))
    .bind(id)
    .bind(c.name)
    .bind(c.events)
    .bind(c.url)
    .bind(key_id)
    .bind(nonce)
    .bind(ciphertext)
    .bind(c.project_id.is_some())
    .bind(c.project_id.flatten())
    .bind(c.labels)
    .bind(c.enabled)
    .fetch_optional(db)
    .await
}

pub async fn delete(db: impl PgExecutor<'_>, id: Uuid) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM hooks WHERE id = $1")
        .bind(id)
        .execute(db)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The enabled hooks of `event` that concern `team`, in calling order: server-wide hooks
/// (those of the settings file in file order, then the others by creation), then the
/// team's by creation.
pub async fn for_event(
    db: impl PgExecutor<'_>,
    event: &str,
    team: Uuid,
) -> Result<Vec<CallableHook>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {HOOK_COLUMNS}, key_id, nonce, ciphertext FROM hooks
         WHERE enabled AND $1 = ANY(events) AND (team_id IS NULL OR team_id = $2)
         ORDER BY team_id IS NOT NULL, settings_position NULLS LAST, created_at, id"
    )))
    .bind(event)
    .bind(team)
    .fetch_all(db)
    .await
}

/// The enabled hooks that concern `team`, of every event, in `for_event`'s order.
pub async fn for_team(
    db: impl PgExecutor<'_>,
    team: Uuid,
) -> Result<Vec<CallableHook>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {HOOK_COLUMNS}, key_id, nonce, ciphertext FROM hooks
         WHERE enabled AND (team_id IS NULL OR team_id = $1)
         ORDER BY team_id IS NOT NULL, settings_position NULLS LAST, created_at, id"
    )))
    .bind(team)
    .fetch_all(db)
    .await
}

/// Of the moments `(id, agent, event)`, the ids of those some enabled hook of the
/// agent's team (or a server-wide one) listens for: one query for a whole batch, where
/// the answer is usually none.
pub async fn listened_moments(
    db: impl PgExecutor<'_>,
    moments: &[(i64, Uuid, &str)],
) -> Result<Vec<i64>, sqlx::Error> {
    let ids: Vec<i64> = moments.iter().map(|m| m.0).collect();
    let agents: Vec<Uuid> = moments.iter().map(|m| m.1).collect();
    let events: Vec<&str> = moments.iter().map(|m| m.2).collect();
    sqlx::query_scalar(
        "SELECT m.id FROM unnest($1::bigint[], $2::uuid[], $3::text[]) AS m(id, agent_id, event)
          JOIN agents a ON a.id = m.agent_id
          WHERE EXISTS (SELECT 1 FROM hooks h WHERE h.enabled AND m.event = ANY(h.events)
                          AND (h.team_id IS NULL OR h.team_id = a.team_id))",
    )
    .bind(ids)
    .bind(agents)
    .bind(events)
    .fetch_all(db)
    .await
}

/// A delivery as listed.
#[derive(Debug, Clone, FromRow)]
pub struct DeliveryRow {
    pub id: Uuid,
    pub hook_id: Uuid,
    pub event: String,
    pub status: String,
    pub attempts: i32,
    pub response_status: Option<i32>,
    pub error: Option<String>,
    pub duration_ms: Option<i32>,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
}

const DELIVERY_COLUMNS: &str = "id, hook_id, event, status, attempts, response_status, error, \
                                duration_ms, created_at, delivered_at";

/// A notification to send.
pub struct NewDelivery<'a> {
    pub id: Uuid,
    pub hook_id: Uuid,
    pub hook_name: &'a str,
    pub event: &'a str,
    pub team_id: Option<Uuid>,
    pub body: &'a str,
    /// Retried until this long after now, in seconds.
    pub retry_for_s: f64,
}

pub async fn insert_delivery(
    db: impl PgExecutor<'_>,
    d: &NewDelivery<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO hook_deliveries (id, hook_id, hook_name, event, team_id, body, retry_until)
         VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))",
    )
    .bind(d.id)
    .bind(d.hook_id)
    .bind(d.hook_name)
    .bind(d.event)
    .bind(d.team_id)
    .bind(d.body)
    .bind(d.retry_for_s)
    .execute(db)
    .await?;
    Ok(())
}

/// The outcome of one synchronous call (a waiting hook), recorded for the list.
pub struct CallRecord<'a> {
    pub id: Uuid,
    pub hook_id: Uuid,
    pub hook_name: &'a str,
    pub event: &'a str,
    pub team_id: Option<Uuid>,
    pub body: &'a str,
    pub delivered: bool,
    pub response_status: Option<i32>,
    pub error: Option<&'a str>,
    pub duration_ms: i32,
}

pub async fn record_call(db: impl PgExecutor<'_>, c: &CallRecord<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO hook_deliveries (id, hook_id, hook_name, event, team_id, body, status,
                                      attempts, retry_until, response_status, error,
                                      duration_ms, delivered_at)
         VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $7 THEN 'delivered' ELSE 'failed' END,
                 1, now(), $8, $9, $10, CASE WHEN $7 THEN now() END)",
    )
    .bind(c.id)
    .bind(c.hook_id)
    .bind(c.hook_name)
    .bind(c.event)
    .bind(c.team_id)
    .bind(c.body)
    .bind(c.delivered)
    .bind(c.response_status)
    .bind(c.error)
    .bind(c.duration_ms)
    .execute(db)
    .await?;
    Ok(())
}

/// A claimed delivery with what is needed to send it.
#[derive(Debug, Clone, FromRow)]
pub struct DueDelivery {
    pub id: Uuid,
    pub hook_id: Uuid,
    pub event: String,
    pub team_id: Option<Uuid>,
    pub body: String,
    pub attempts: i32,
    pub retry_until: DateTime<Utc>,
    /// The hook's own team (null: server-wide).
    pub hook_team_id: Option<Uuid>,
    pub url: String,
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// Claim up to `limit` due deliveries: each is pushed `lease_s` into the future (so no
/// other worker takes it while it is in flight) and its attempt counted.
pub async fn claim_due(
    db: impl PgExecutor<'_>,
    limit: i64,
    lease_s: f64,
) -> Result<Vec<DueDelivery>, sqlx::Error> {
    sqlx::query_as(
        "WITH due AS (
            SELECT id FROM hook_deliveries
            WHERE status = 'pending' AND next_attempt_at <= now()
            ORDER BY next_attempt_at LIMIT $1
            FOR UPDATE SKIP LOCKED
         ), claimed AS (
            UPDATE hook_deliveries d
               SET next_attempt_at = now() + make_interval(secs => $2), attempts = d.attempts + 1
              FROM due WHERE d.id = due.id
            RETURNING d.id, d.hook_id, d.event, d.team_id, d.body, d.attempts, d.retry_until
         )
         SELECT c.id, c.hook_id, c.event, c.team_id, c.body, c.attempts, c.retry_until,
                h.team_id AS hook_team_id, h.url, h.key_id, h.nonce, h.ciphertext
         FROM claimed c JOIN hooks h ON h.id = c.hook_id",
    )
    .bind(limit)
    .bind(lease_s)
    .fetch_all(db)
    .await
}

/// Record one attempt: delivered, retried at `retry_in_s`, or failed for good.
pub async fn finish_attempt(
    db: impl PgExecutor<'_>,
    id: Uuid,
    status: &str,
    retry_in_s: f64,
    response_status: Option<i32>,
    error: Option<&str>,
    duration_ms: i32,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE hook_deliveries SET status = $2,
            next_attempt_at = now() + make_interval(secs => $3),
            response_status = $4, error = $5, duration_ms = $6,
            delivered_at = CASE WHEN $2 = 'delivered' THEN now() ELSE delivered_at END
         WHERE id = $1",
    )
    .bind(id)
    .bind(status)
    .bind(retry_in_s)
    .bind(response_status)
    .bind(error)
    .bind(duration_ms)
    .execute(db)
    .await?;
    Ok(())
}

/// The hook's deliveries, newest first, before `before`.
pub async fn deliveries(
    db: impl PgExecutor<'_>,
    hook: Uuid,
    before: Option<Uuid>,
    limit: i64,
) -> Result<Vec<DeliveryRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {DELIVERY_COLUMNS} FROM hook_deliveries
         WHERE hook_id = $1 AND ($2::uuid IS NULL OR id < $2)
         ORDER BY id DESC LIMIT $3"
    )))
    .bind(hook)
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Send a notification again from now (same id, same body), retried for `retry_for_s`.
/// The recorded calls of waiting hooks (`waiting` events) are not sent again.
pub async fn redeliver(
    db: impl PgExecutor<'_>,
    hook: Uuid,
    id: Uuid,
    retry_for_s: f64,
    waiting: &[&str],
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE hook_deliveries SET status = 'pending', next_attempt_at = now(),
            retry_until = now() + make_interval(secs => $3), delivered_at = NULL
         WHERE hook_id = $1 AND id = $2 AND NOT (event = ANY($4))",
    )
    .bind(hook)
    .bind(id)
    .bind(retry_for_s)
    .bind(waiting)
    .execute(db)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// A stored moment of an agent, waiting to become outbox rows.
#[derive(Debug, Clone, FromRow)]
pub struct MomentRow {
    pub id: i64,
    pub agent_id: Uuid,
    pub kind: String,
    pub payload: Value,
}

/// Whether any moment is stored (claimed by another replica or not): one cheap look
/// before a transaction is opened to claim them.
pub async fn any_moment(db: impl PgExecutor<'_>) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM agent_moments)")
        .fetch_one(db)
        .await
}

/// The oldest moments no other worker holds, locked until `tx` ends.
pub async fn claim_moments(
    tx: &mut sqlx::PgConnection,
    limit: i64,
) -> Result<Vec<MomentRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, agent_id, kind, payload FROM agent_moments
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(tx)
    .await
}

pub async fn delete_moments(tx: &mut sqlx::PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM agent_moments WHERE id = ANY($1)")
        .bind(ids)
        .execute(tx)
        .await
        .map(|_| ())
}
