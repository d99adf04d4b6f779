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

/// Records what a forge's delivery says of pull/merge request `number` of project
/// `project`: its state and/or its checks, on every live workspace that opened it.
/// Returns how many workspaces it changed.
pub async fn follow_pull_request(
    db: impl PgExecutor<'_>,
    project: Uuid,
    number: i64,
    state: Option<&str>,
    checks: Option<&str>,
) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(
        "UPDATE workspace_remotes r
            SET pr_state = COALESCE($3, r.pr_state), pr_checks = COALESCE($4, r.pr_checks),
                pr_refreshed_at = now()
           FROM workspaces w
          WHERE w.id = r.workspace_id AND w.project_id = $1 AND w.archived_at IS NULL
            AND r.pr_number = $2",
    )
    .bind(project)
    .bind(number)
    .bind(state)
    .bind(checks)
    .execute(db)
    .await?
    .rows_affected())
}

/// Takes up to `limit` live workspaces whose pull/merge request is open and was not read
/// from the forge for `every_s` seconds, oldest read first, and marks them read now so
/// that another replica's poll skips them. Returns their ids.
pub async fn due_open_pull_requests(
    db: impl PgExecutor<'_>,
    every_s: i64,
    limit: i64,
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE workspace_remotes SET pr_refreshed_at = now()
          WHERE workspace_id IN (
                SELECT r.workspace_id FROM workspace_remotes r
                  JOIN workspaces w ON w.id = r.workspace_id
                 WHERE r.pr_state = 'open' AND w.archived_at IS NULL
                   AND (r.pr_refreshed_at IS NULL
                        OR r.pr_refreshed_at < now() - make_interval(secs => $1))
                 ORDER BY r.pr_refreshed_at NULLS FIRST
                 LIMIT $2
                 FOR UPDATE OF r SKIP LOCKED)
          RETURNING workspace_id",
    )
    .bind(every_s as f64)
    .bind(limit)
    .fetch_all(db)
    .await
}
