//! What a workspace exchanged with its project's remote: the pull/merge request it
//! started from, its last push and the pull/merge request opened for it.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct WorkspaceRemoteRow {
    pub workspace_id: Uuid,
    pub source_pull_request: Option<i64>,
    pub source_ref: Option<String>,
    pub pushed_branch: Option<String>,
    pub pushed_commit: Option<String>,
    pub pushed_at: Option<DateTime<Utc>>,
    pub pushed_forced: Option<bool>,
    pub pr_number: Option<i64>,
    pub pr_url: Option<String>,
    pub pr_state: Option<String>,
    pub pr_checks: Option<String>,
    pub pr_refreshed_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "workspace_id, source_pull_request, source_ref, pushed_branch, \
     pushed_commit, pushed_at, pushed_forced, pr_number, pr_url, pr_state, pr_checks, \
     pr_refreshed_at";

/// Records that workspace `id` was made from pull/merge request `number` (ref `source_ref`).
pub async fn insert_source(
    db: impl PgExecutor<'_>,
    id: Uuid,
    number: i64,
    source_ref: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO workspace_remotes (workspace_id, source_pull_request, source_ref)
         VALUES ($1, $2, $3)",
    )
    .bind(id)
    .bind(number)
    .bind(source_ref)
    .execute(db)
    .await
    .map(|_| ())
}

pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<WorkspaceRemoteRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM workspace_remotes WHERE workspace_id = $1"
    )))
    .bind(id)
    .fetch_optional(db)
    .await
}

pub async fn get_many(
    db: impl PgExecutor<'_>,
    ids: &[Uuid],
) -> Result<Vec<WorkspaceRemoteRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM workspace_remotes WHERE workspace_id = ANY($1)"
    )))
    .bind(ids)
    .fetch_all(db)
    .await
}

pub async fn record_push(
    db: impl PgExecutor<'_>,
    id: Uuid,
    branch: &str,
    commit: &str,
    forced: bool,
) -> Result<WorkspaceRemoteRow, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO workspace_remotes (workspace_id, pushed_branch, pushed_commit, pushed_at,
             pushed_forced)
         VALUES ($1, $2, $3, now(), $4)
         ON CONFLICT (workspace_id) DO UPDATE SET pushed_branch = $2, pushed_commit = $3,
             pushed_at = now(), pushed_forced = $4
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(branch)
    .bind(commit)
    .bind(forced)
    .fetch_one(db)
    .await
}

pub async fn record_pull_request(
    db: impl PgExecutor<'_>,
    id: Uuid,
    number: i64,
    url: &str,
    state: &str,
    checks: &str,
) -> Result<WorkspaceRemoteRow, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO workspace_remotes (workspace_id, pr_number, pr_url, pr_state, pr_checks,
             pr_refreshed_at)
         VALUES ($1, $2, $3, $4, $5, now())
         ON CONFLICT (workspace_id) DO UPDATE SET pr_number = $2, pr_url = $3, pr_state = $4,
             pr_checks = $5, pr_refreshed_at = now()
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(number)
    .bind(url)
    .bind(state)
    .bind(checks)
    .fetch_one(db)
    .await
}
