//! Queries on the `managed_processes` ledger: one row per child process a replica started,
//! written before the child is used and deleted once it is gone.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use uuid::Uuid;

/// One recorded process, as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LedgerRow {
    pub id: Uuid,
    pub pid: i32,
    pub pgid: i32,
    pub start_ticks: i64,
    pub boot_id: String,
    /// Program followed by its arguments.
    pub command: Vec<String>,
    pub agent_id: Option<Uuid>,
    pub replica: String,
    pub started_at: DateTime<Utc>,
    /// The process's own temporary directory, removed once it is gone.
    pub tmpdir: Option<String>,
}

/// What `insert` writes; `started_at` is set by the database.
#[derive(Debug, Clone)]
pub struct NewLedgerRow<'a> {
    pub id: Uuid,
    pub pid: i32,
    pub pgid: i32,
    pub start_ticks: i64,
    pub boot_id: &'a str,
    pub command: &'a [String],
    pub agent_id: Option<Uuid>,
    pub replica: &'a str,
    pub tmpdir: Option<&'a str>,
}

pub async fn insert(exec: impl PgExecutor<'_>, row: &NewLedgerRow<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO managed_processes \
             (id, pid, pgid, start_ticks, boot_id, command, agent_id, replica, tmpdir) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(row.id)
    .bind(row.pid)
    .bind(row.pgid)
    .bind(row.start_ticks)
    .bind(row.boot_id)
    .bind(row.command)
    .bind(row.agent_id)
    .bind(row.replica)
    .bind(row.tmpdir)
    .execute(exec)
    .await?;
    Ok(())
}

/// Deletes one row; `false` when it was already gone.
pub async fn delete(exec: impl PgExecutor<'_>, id: Uuid) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM managed_processes WHERE id = $1")
        .bind(id)
        .execute(exec)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// Those of `ids` that have a row (of any replica).
pub async fn existing(exec: impl PgExecutor<'_>, ids: &[Uuid]) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM managed_processes WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(exec)
        .await
}

/// Every row of one replica, oldest first.
pub async fn list_for_replica(
    exec: impl PgExecutor<'_>,
    replica: &str,
) -> Result<Vec<LedgerRow>, sqlx::Error> {
    sqlx::query_as::<_, LedgerRow>(
        "SELECT id, pid, pgid, start_ticks, boot_id, command, agent_id, replica, started_at, tmpdir \
         FROM managed_processes \
         WHERE replica = $1 \
         ORDER BY started_at, id",
    )
    .bind(replica)
    .fetch_all(exec)
    .await
}

/// The rows of one agent's processes (across replicas), oldest first.
pub async fn list_for_agent(
    exec: impl PgExecutor<'_>,
    agent_id: Uuid,
) -> Result<Vec<LedgerRow>, sqlx::Error> {
    sqlx::query_as::<_, LedgerRow>(
        "SELECT id, pid, pgid, start_ticks, boot_id, command, agent_id, replica, started_at, tmpdir \
         FROM managed_processes \
         WHERE agent_id = $1 \
         ORDER BY started_at, id",
    )
    .bind(agent_id)
    .fetch_all(exec)
    .await
}
