//! Permission requests raised by agents: pending until answered, expired when their
//! turn ends or their agent closes first.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct PermissionRow {
    pub id: Uuid,
    pub agent_id: Uuid,
    pub turn_id: Option<Uuid>,
    pub kind: String,
    pub title: String,
    pub call_id: Option<String>,
    pub input: Option<Value>,
    pub options: Value,
    pub status: String,
    pub resolution: Option<Value>,
    pub resolved_by: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
}

pub struct NewPermission<'a> {
    pub id: Uuid,
    pub agent_id: Uuid,
    pub turn_id: Option<Uuid>,
    pub provider_request_id: &'a str,
    pub kind: &'a str,
    pub title: &'a str,
    pub call_id: Option<&'a str>,
    pub input: Option<&'a Value>,
    pub options: &'a Value,
}

pub async fn insert(db: impl PgExecutor<'_>, p: NewPermission<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO permission_requests (id, agent_id, turn_id, provider_request_id, kind, title, call_id, input, options, status)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'pending')",
    )
    .bind(p.id)
    .bind(p.agent_id)
    .bind(p.turn_id)
    .bind(p.provider_request_id)
    .bind(p.kind)
    .bind(p.title)
    .bind(p.call_id)
    .bind(p.input)
    .bind(p.options)
    .execute(db)
    .await
    .map(|_| ())
}

pub async fn get(
    db: impl PgExecutor<'_>,
    agent_id: Uuid,
    id: Uuid,
) -> Result<Option<PermissionRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, agent_id, turn_id, kind, title, call_id, input, options, status, resolution, resolved_by,
                created_at, resolved_at
         FROM permission_requests WHERE agent_id = $1 AND id = $2",
    )
    .bind(agent_id)
    .bind(id)
    .fetch_optional(db)
    .await
}

pub async fn list(
    db: impl PgExecutor<'_>,
    agent_id: Uuid,
    status: Option<&str>,
) -> Result<Vec<PermissionRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, agent_id, turn_id, kind, title, call_id, input, options, status, resolution, resolved_by,
                created_at, resolved_at
         FROM permission_requests WHERE agent_id = $1 AND ($2::text IS NULL OR status = $2)
         ORDER BY created_at, id LIMIT 1000",
    )
    .bind(agent_id)
    .bind(status)
    .fetch_all(db)
    .await
}

/// Resolve a pending request; false when it was no longer pending.
pub async fn resolve(
    db: impl PgExecutor<'_>,
    id: Uuid,
    resolution: &Value,
    by: Uuid,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE permission_requests SET status = 'resolved', resolution = $2, resolved_by = $3, resolved_at = now()
         WHERE id = $1 AND status = 'pending'",
    )
    .bind(id)
    .bind(resolution)
    .bind(by)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The ids of an agent's pending requests.
pub async fn pending_ids(
    db: impl PgExecutor<'_>,
    agent_id: Uuid,
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM permission_requests WHERE agent_id = $1 AND status = 'pending'",
    )
    .bind(agent_id)
    .fetch_all(db)
    .await
}

/// Expire one pending request of an agent by the provider's id for it (the CLI withdrew
/// it); returns its id when one was pending.
pub async fn expire_by_provider_id(
    db: impl PgExecutor<'_>,
    agent_id: Uuid,
    provider_request_id: &str,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE permission_requests SET status = 'expired', resolved_at = now()
         WHERE agent_id = $1 AND provider_request_id = $2 AND status = 'pending' RETURNING id",
    )
    .bind(agent_id)
    .bind(provider_request_id)
    .fetch_optional(db)
    .await
}
