//! A team's additions to its agents' egress allow lists (`team_network`).

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct TeamNetworkRow {
    pub allow: Vec<String>,
    pub updated_at: DateTime<Utc>,
    pub updated_by: Option<Uuid>,
}

/// The team's entries (`None`: it never set any).
pub async fn get(db: impl PgExecutor<'_>, team: Uuid) -> sqlx::Result<Option<TeamNetworkRow>> {
    sqlx::query_as("SELECT allow, updated_at, updated_by FROM team_network WHERE team_id = $1")
        .bind(team)
        .fetch_optional(db)
        .await
}

/// Replace the team's entries.
pub async fn set(
    db: impl PgExecutor<'_>,
    team: Uuid,
    allow: &[String],
    by: Uuid,
) -> sqlx::Result<TeamNetworkRow> {
    sqlx::query_as(
        "INSERT INTO team_network (team_id, allow, updated_at, updated_by) \
         VALUES ($1, $2, now(), $3) \
         ON CONFLICT (team_id) DO UPDATE \
         SET allow = EXCLUDED.allow, updated_at = now(), updated_by = EXCLUDED.updated_by \
         RETURNING allow, updated_at, updated_by",
    )
    .bind(team)
    .bind(allow)
    .bind(by)
    .fetch_one(db)
    .await
}
