//! The audit log: who did what to which resource, in which team, for which request.
//! Append-only; read newest first.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

pub struct NewEntry<'a> {
    pub id: Uuid,
    pub actor_kind: &'a str,
    pub actor_id: Uuid,
    pub team_id: Option<Uuid>,
    pub action: &'a str,
    pub target_kind: &'a str,
    pub target_id: &'a str,
    pub details: &'a Value,
    pub request_id: Option<&'a str>,
}

#[derive(Debug, Clone, FromRow)]
pub struct EntryRow {
    pub id: Uuid,
    pub at: DateTime<Utc>,
    pub actor_kind: String,
    pub actor_id: Option<Uuid>,
    /// The actor's email, for a person.
    pub actor_email: Option<String>,
    pub team_id: Option<Uuid>,
    pub action: String,
    pub target_kind: String,
    pub target_id: String,
    pub details: Value,
    pub request_id: Option<String>,
}

/// Insert entries in one statement (on its own: one commit).
pub async fn insert(db: impl PgExecutor<'_>, entries: &[NewEntry<'_>]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO audit_log (id, actor_kind, actor_id, team_id, action, target_kind, target_id, details, request_id)
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::uuid[], $4::uuid[], $5::text[], $6::text[],
                              $7::text[], $8::jsonb[], $9::text[])",
    )
    .bind(entries.iter().map(|e| e.id).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.actor_kind).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.actor_id).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.team_id).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.action).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.target_kind).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.target_id).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| sqlx::types::Json(e.details)).collect::<Vec<_>>())
    .bind(entries.iter().map(|e| e.request_id).collect::<Vec<_>>())
    .execute(db)
    .await
    .map(|_| ())
}

/// Which entries `list` returns.
pub struct Filter<'a> {
    /// Only entries of these teams; `None`: every entry, also those of no team.
    pub teams: Option<&'a [Uuid]>,
    pub action: Option<&'a str>,
    pub actor_id: Option<Uuid>,
    /// Entries older than this one (the cursor).
    pub before: Option<Uuid>,
    pub limit: i64,
}

/// Entries newest first.
pub async fn list(db: impl PgExecutor<'_>, f: Filter<'_>) -> Result<Vec<EntryRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT a.id, a.at, a.actor_kind, a.actor_id, u.email AS actor_email, a.team_id, a.action,
                a.target_kind, a.target_id, a.details, a.request_id
         FROM audit_log a
         LEFT JOIN users u ON u.id = a.actor_id AND a.actor_kind <> 'service_token'
         WHERE ($1::uuid[] IS NULL OR a.team_id = ANY($1))
           AND ($2::text IS NULL OR a.action = $2)
           AND ($3::uuid IS NULL OR a.actor_id = $3)
           AND ($4::uuid IS NULL OR a.id < $4)
         ORDER BY a.id DESC LIMIT $5",
    )
    .bind(f.teams)
    .bind(f.action)
    .bind(f.actor_id)
    .bind(f.before)
    .bind(f.limit)
    .fetch_all(db)
    .await
}
