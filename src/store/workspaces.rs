//! Workspaces: worktrees (or plain directories) of a project that agents work in.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct WorkspaceRow {
    pub id: Uuid,
    pub project_id: Uuid,
    pub team_id: Uuid,
    pub kind: String,
    pub title: Option<String>,
    pub path: String,
    pub branch: Option<String>,
    pub base_ref: Option<String>,
    pub base_commit: Option<String>,
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub archived_at: Option<DateTime<Utc>>,
    /// `running`, `succeeded` or `failed` when the repository has setup commands.
    pub setup_status: Option<String>,
    pub setup_output: Option<String>,
}

pub struct NewWorkspace<'a> {
    pub id: Uuid,
    pub project_id: Uuid,
    pub team_id: Uuid,
    pub kind: &'a str,
    pub title: Option<&'a str>,
    pub path: &'a str,
    pub branch: Option<&'a str>,
    pub base_ref: Option<&'a str>,
    pub base_commit: Option<&'a str>,
    pub created_by: Uuid,
    /// Set (to this replica) when setup commands are about to run in it.
    pub setup_replica: Option<&'a str>,
}

pub async fn insert(
    db: impl PgExecutor<'_>,
    w: NewWorkspace<'_>,
) -> Result<WorkspaceRow, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO workspaces (id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_by,
                                 setup_status, setup_replica)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'active', $10,
                 CASE WHEN $11::text IS NULL THEN NULL ELSE 'running' END, $11)
         RETURNING id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_at, archived_at, setup_status, setup_output",
    )
    .bind(w.id)
    .bind(w.project_id)
    .bind(w.team_id)
    .bind(w.kind)
    .bind(w.title)
    .bind(w.path)
    .bind(w.branch)
    .bind(w.base_ref)
    .bind(w.base_commit)
    .bind(w.created_by)
    .bind(w.setup_replica)
    .fetch_one(db)
    .await
}

pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
    teams: Option<&[Uuid]>,
) -> Result<Option<WorkspaceRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_at, archived_at, setup_status, setup_output
         FROM workspaces WHERE id = $1 AND ($2::uuid[] IS NULL OR team_id = ANY($2))",
    )
    .bind(id)
    .bind(teams)
    .fetch_optional(db)
    .await
}

pub async fn list(
    db: impl PgExecutor<'_>,
    teams: Option<&[Uuid]>,
    project_id: Option<Uuid>,
    include_archived: bool,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<WorkspaceRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_at, archived_at, setup_status, setup_output
         FROM workspaces
         WHERE ($1::uuid[] IS NULL OR team_id = ANY($1)) AND ($2::uuid IS NULL OR project_id = $2)
           AND ($3 OR archived_at IS NULL) AND ($4::uuid IS NULL OR id > $4)
         ORDER BY id LIMIT $5",
    )
    .bind(teams)
    .bind(project_id)
    .bind(include_archived)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Whether a workspace already uses `path`, or (when given) `branch` in this project;
/// used to pick a new, unique name.
pub async fn path_or_branch_taken(
    db: impl PgExecutor<'_>,
    project_id: Uuid,
    path: &str,
    branch: Option<&str>,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM workspaces WHERE path = $2 OR (project_id = $1 AND branch = $3))",
    )
    .bind(project_id)
    .bind(path)
    .bind(branch)
    .fetch_one(db)
    .await
}

pub async fn mark_archived(
    db: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<WorkspaceRow>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE workspaces SET status = 'archived', archived_at = COALESCE(archived_at, now()) WHERE id = $1
         RETURNING id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_at, archived_at, setup_status, setup_output",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

pub async fn active_count_for_project(
    db: impl PgExecutor<'_>,
    project_id: Uuid,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM workspaces WHERE project_id = $1 AND archived_at IS NULL",
    )
    .bind(project_id)
    .fetch_one(db)
    .await
}

/// Record how a workspace's setup ended: `failed` also marks the workspace `setup_failed`
/// (unless it was archived meanwhile).
pub async fn finish_setup(
    db: impl PgExecutor<'_>,
    id: Uuid,
    succeeded: bool,
    output: &str,
) -> Result<Option<WorkspaceRow>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE workspaces SET setup_status = CASE WHEN $2 THEN 'succeeded' ELSE 'failed' END,
                setup_output = $3, setup_replica = NULL,
                status = CASE WHEN status = 'active' AND NOT $2 THEN 'setup_failed' ELSE status END
         WHERE id = $1
         RETURNING id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_at, archived_at, setup_status, setup_output",
    )
    .bind(id)
    .bind(succeeded)
    .bind(output)
    .fetch_optional(db)
    .await
}

/// Setups this replica started and never finished (it stopped while they ran): they
/// fail, and the caller announces each.
pub async fn fail_interrupted_setups(
    db: impl PgExecutor<'_>,
    replica: &str,
    note: &str,
) -> Result<Vec<WorkspaceRow>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE workspaces SET setup_status = 'failed', setup_replica = NULL,
                setup_output = COALESCE(setup_output, '') || $2,
                status = CASE WHEN status = 'active' THEN 'setup_failed' ELSE status END
         WHERE setup_status = 'running' AND setup_replica = $1
         RETURNING id, project_id, team_id, kind, title, path, branch, base_ref, base_commit, status, created_at, archived_at, setup_status, setup_output",
    )
    .bind(replica)
    .bind(note)
    .fetch_all(db)
    .await
}
