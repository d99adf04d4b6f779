//! Projects: git repositories registered on the server, owned by a team.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct ProjectRow {
    pub id: Uuid,
    pub team_id: Uuid,
    pub name: String,
    pub repo_path: String,
    pub default_branch: String,
    pub created_at: DateTime<Utc>,
}

pub async fn insert(
    db: impl PgExecutor<'_>,
    id: Uuid,
    team_id: Uuid,
    name: &str,
    repo_path: &str,
    default_branch: &str,
    created_by: Uuid,
) -> Result<ProjectRow, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO projects (id, team_id, name, repo_path, default_branch, created_by)
         VALUES ($1, $2, $3, $4, $5, $6)
         RETURNING id, team_id, name, repo_path, default_branch, created_at",
    )
    .bind(id)
    .bind(team_id)
    .bind(name)
    .bind(repo_path)
    .bind(default_branch)
    .bind(created_by)
    .fetch_one(db)
    .await
}

pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
    teams: Option<&[Uuid]>,
) -> Result<Option<ProjectRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, name, repo_path, default_branch, created_at FROM projects
         WHERE id = $1 AND deleted_at IS NULL AND ($2::uuid[] IS NULL OR team_id = ANY($2))",
    )
    .bind(id)
    .bind(teams)
    .fetch_optional(db)
    .await
}

pub async fn list(
    db: impl PgExecutor<'_>,
    teams: Option<&[Uuid]>,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<ProjectRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, name, repo_path, default_branch, created_at FROM projects
         WHERE deleted_at IS NULL AND ($1::uuid[] IS NULL OR team_id = ANY($1)) AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3",
    )
    .bind(teams)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn name_taken(
    db: impl PgExecutor<'_>,
    team_id: Uuid,
    name: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM projects WHERE team_id = $1 AND name = $2 AND deleted_at IS NULL)")
        .bind(team_id)
        .bind(name)
        .fetch_one(db)
        .await
}

pub async fn mark_deleted(db: impl PgExecutor<'_>, id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE projects SET deleted_at = now() WHERE id = $1")
        .bind(id)
        .execute(db)
        .await
        .map(|_| ())
}
