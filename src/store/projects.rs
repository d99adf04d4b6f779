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
    /// The remote a cloned project comes from (`repo_path` is then the server's clone).
    pub git_url: Option<String>,
    /// The team secret that authenticates to `git_url`.
    pub credential_secret: Option<String>,
    /// `github` or `gitlab`: where pull requests of a cloned project are opened.
    pub forge: Option<String>,
    /// The forge's REST API base URL.
    pub forge_api_url: Option<String>,
    /// The repository on the forge (`owner/name`, or a GitLab project path).
    pub forge_repo: Option<String>,
}

/// A project to insert.
#[derive(Debug, Clone, Copy)]
pub struct NewProject<'a> {
    pub id: Uuid,
    pub team_id: Uuid,
    pub name: &'a str,
    pub repo_path: &'a str,
    pub default_branch: &'a str,
    pub created_by: Uuid,
    pub git_url: Option<&'a str>,
    pub credential_secret: Option<&'a str>,
    pub forge: Option<&'a str>,
    pub forge_api_url: Option<&'a str>,
    pub forge_repo: Option<&'a str>,
}

const COLUMNS: &str = "id, team_id, name, repo_path, default_branch, created_at, git_url, \
     credential_secret, forge, forge_api_url, forge_repo";

pub async fn insert(
    db: impl PgExecutor<'_>,
    new: NewProject<'_>,
) -> Result<ProjectRow, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO projects (id, team_id, name, repo_path, default_branch, created_by,
             git_url, credential_secret, forge, forge_api_url, forge_repo)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
         RETURNING {COLUMNS}"
    )))
    .bind(new.id)
    .bind(new.team_id)
    .bind(new.name)
    .bind(new.repo_path)
    .bind(new.default_branch)
    .bind(new.created_by)
    .bind(new.git_url)
    .bind(new.credential_secret)
    .bind(new.forge)
    .bind(new.forge_api_url)
    .bind(new.forge_repo)
    .fetch_one(db)
    .await
}

pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
    teams: Option<&[Uuid]>,
) -> Result<Option<ProjectRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM projects
         WHERE id = $1 AND deleted_at IS NULL AND ($2::uuid[] IS NULL OR team_id = ANY($2))"
    )))
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
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM projects
         WHERE deleted_at IS NULL AND ($1::uuid[] IS NULL OR team_id = ANY($1)) AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3"
    )))
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

/// Whether a live project of a team other than `team_id` uses `repo_path`.
pub async fn path_used_elsewhere(
    db: impl PgExecutor<'_>,
    team_id: Uuid,
    repo_path: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM projects
         WHERE repo_path = $1 AND team_id <> $2 AND deleted_at IS NULL)",
    )
    .bind(repo_path)
    .bind(team_id)
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
