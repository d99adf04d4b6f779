//! The replica lock: a session-level advisory lock on the replica's id that the running
//! server holds on a connection of its own, so that a second server started with the same
//! replica id on the same database can tell.

use sqlx::PgConnection;

/// The first key of the two-key advisory lock (`pg_advisory_lock(int, int)`); the second
/// is `hashtext(<replica id>)`. `pg_locks` shows them as `classid`, `objid`, `objsubid` 2.
const NAMESPACE: i32 = 7_243_002;

/// Take the lock for this session; false when another session holds it.
pub async fn try_acquire(conn: &mut PgConnection, replica: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(NAMESPACE)
        .bind(replica)
        .fetch_one(conn)
        .await
}

/// Give the lock up now. Closing the connection also releases it, but only once the
/// server's backend has ended, which a server started right after may not wait for.
pub async fn release(conn: &mut PgConnection, replica: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_advisory_unlock($1, hashtext($2))")
        .bind(NAMESPACE)
        .bind(replica)
        .fetch_one(conn)
        .await
}

/// Whether this session still holds the lock.
pub async fn held(conn: &mut PgConnection, replica: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks
          WHERE locktype = 'advisory' AND classid = $1::oid AND objid = hashtext($2)::oid
            AND objsubid = 2 AND granted AND pid = pg_backend_pid())",
    )
    .bind(NAMESPACE)
    .bind(replica)
    .fetch_one(conn)
    .await
}

/// What the database shows of the session holding the lock: its client address and since
/// when it is connected (either may be hidden from a role without `pg_read_all_stats`).
pub async fn holder(
    conn: &mut PgConnection,
    replica: &str,
) -> Result<Option<(Option<String>, Option<chrono::DateTime<chrono::Utc>>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT host(a.client_addr), a.backend_start
           FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'advisory' AND l.classid = $1::oid AND l.objid = hashtext($2)::oid
            AND l.objsubid = 2 AND l.granted
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          LIMIT 1",
    )
    .bind(NAMESPACE)
    .bind(replica)
    .fetch_optional(conn)
    .await
}
