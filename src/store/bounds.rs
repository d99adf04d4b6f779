//! Counts behind the per-team limits of `[limits]`, and the stored MCP servers whose
//! credentials are sealed on start.

use sqlx::PgExecutor;
use uuid::Uuid;

/// Agents of `team` that are not archived.
pub async fn live_agents(db: impl PgExecutor<'_>, team: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM agents WHERE team_id = $1 AND archived_at IS NULL")
        .bind(team)
        .fetch_one(db)
        .await
}

/// Workspaces of `team` that are not archived.
pub async fn live_workspaces(db: impl PgExecutor<'_>, team: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM workspaces WHERE team_id = $1 AND archived_at IS NULL")
        .bind(team)
        .fetch_one(db)
        .await
}

/// Projects of `team` that are not deleted.
pub async fn live_projects(db: impl PgExecutor<'_>, team: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM projects WHERE team_id = $1 AND deleted_at IS NULL")
        .bind(team)
        .fetch_one(db)
        .await
}

/// Agents whose stored MCP servers have `headers`: `(id, team, mcp_servers)`.
pub async fn agents_with_mcp_headers(
    db: impl PgExecutor<'_>,
) -> Result<Vec<(Uuid, Uuid, serde_json::Value)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, mcp_servers FROM agents \
         WHERE jsonb_path_exists(mcp_servers, '$.*.headers')",
    )
    .fetch_all(db)
    .await
}

pub async fn set_mcp_servers(
    db: impl PgExecutor<'_>,
    id: Uuid,
    servers: &serde_json::Value,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE agents SET mcp_servers = $2 WHERE id = $1")
        .bind(id)
        .bind(servers)
        .execute(db)
        .await
        .map(|_| ())
}
