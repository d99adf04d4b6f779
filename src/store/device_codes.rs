//! Device authorization codes (RFC 8628): looked up by the hash of the device code (the
//! client's) or of the user code (the approver's), never by the codes themselves.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use uuid::Uuid;

#[derive(Debug, sqlx::FromRow)]
pub struct DeviceCodeRow {
    pub id: Uuid,
    pub client_name: String,
    pub interval_s: i32,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub last_polled_at: Option<DateTime<Utc>>,
    pub status: String,
    pub answered_by: Option<Uuid>,
    pub answered_kind: Option<String>,
    pub token_scopes: Option<Vec<String>>,
}

const COLUMNS: &str = "id, client_name, interval_s, created_at, expires_at, last_polled_at, \
                       status, answered_by, answered_kind, token_scopes";

#[allow(clippy::too_many_arguments)]
pub async fn insert(
    db: impl PgExecutor<'_>,
    id: Uuid,
    device_code_hash: &[u8],
    user_code_hash: &[u8],
    client_name: &str,
    client_ip: &str,
    interval_s: i32,
    expires_at: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO device_codes
             (id, device_code_hash, user_code_hash, client_name, client_ip, interval_s, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(id)
    .bind(device_code_hash)
    .bind(user_code_hash)
    .bind(client_name)
    .bind(client_ip)
    .bind(interval_s)
    .bind(expires_at)
    .execute(db)
    .await?;
    Ok(())
}

/// Codes requested from `client_ip` since `since`.
pub async fn count_recent(
    db: impl PgExecutor<'_>,
    client_ip: &str,
    since: DateTime<Utc>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM device_codes WHERE client_ip = $1 AND created_at > $2")
        .bind(client_ip)
        .bind(since)
        .fetch_one(db)
        .await
}

/// Forget codes that expired before `before` (their sealed tokens with them).
pub async fn delete_expired(
    db: impl PgExecutor<'_>,
    before: DateTime<Utc>,
) -> Result<u64, sqlx::Error> {
    Ok(
        sqlx::query("DELETE FROM device_codes WHERE expires_at < $1")
            .bind(before)
            .execute(db)
            .await?
            .rows_affected(),
    )
}

/// The code with this device-code hash, locked for the rest of the transaction.
pub async fn by_device_code_for_update(
    db: impl PgExecutor<'_>,
    hash: &[u8],
) -> Result<Option<DeviceCodeRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM device_codes WHERE device_code_hash = $1 FOR UPDATE"
    )))
    .bind(hash)
    .fetch_optional(db)
    .await
}

/// The code with this user-code hash (locked when `lock`).
pub async fn by_user_code(
    db: impl PgExecutor<'_>,
    hash: &[u8],
    lock: bool,
) -> Result<Option<DeviceCodeRow>, sqlx::Error> {
    let lock = if lock { " FOR UPDATE" } else { "" };
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM device_codes WHERE user_code_hash = $1{lock}"
    )))
    .bind(hash)
    .fetch_optional(db)
    .await
}

pub async fn touch_polled(
    db: impl PgExecutor<'_>,
    id: Uuid,
    at: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE device_codes SET last_polled_at = $2 WHERE id = $1")
        .bind(id)
        .bind(at)
        .execute(db)
        .await?;
    Ok(())
}

/// Record the approver's answer: who, acting how, and the scopes the token may have.
pub async fn answer(
    db: impl PgExecutor<'_>,
    id: Uuid,
    status: &str,
    by: Uuid,
    kind: &str,
    token_scopes: &[String],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE device_codes
         SET status = $2, answered_by = $3, answered_kind = $4, answered_at = now(),
             token_scopes = $5
         WHERE id = $1",
    )
    .bind(id)
    .bind(status)
    .bind(by)
    .bind(kind)
    .bind(token_scopes)
    .execute(db)
    .await?;
    Ok(())
}

/// The token was collected: the code is spent.
pub async fn mark_used(
    db: impl PgExecutor<'_>,
    id: Uuid,
    token_id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE device_codes SET status = 'used', token_id = $2 WHERE id = $1")
        .bind(id)
        .bind(token_id)
        .execute(db)
        .await?;
    Ok(())
}
