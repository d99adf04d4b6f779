//! Idempotency keys for create requests: the first request with a key claims it; a retry
//! with the same body gets the stored response, a different body a conflict.

use serde_json::Value;
use sqlx::{FromRow, PgExecutor};

#[derive(Debug, Clone, FromRow)]
pub struct KeyRow {
    pub request_hash: Vec<u8>,
    pub status: Option<i16>,
    pub response: Option<Value>,
}

/// Claim `key`; true when this request is the first to use it.
pub async fn claim(
    db: impl PgExecutor<'_>,
    principal: &str,
    key: &str,
    hash: &[u8],
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO idempotency_keys (principal, key, request_hash) VALUES ($1, $2, $3)
         ON CONFLICT (principal, key) DO NOTHING",
    )
    .bind(principal)
    .bind(key)
    .bind(hash)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

pub async fn get(
    db: impl PgExecutor<'_>,
    principal: &str,
    key: &str,
) -> Result<Option<KeyRow>, sqlx::Error> {
    sqlx::query_as("SELECT request_hash, status, response FROM idempotency_keys WHERE principal = $1 AND key = $2")
        .bind(principal)
        .bind(key)
        .fetch_optional(db)
        .await
}

pub async fn complete(
    db: impl PgExecutor<'_>,
    principal: &str,
    key: &str,
    status: i16,
    response: &Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE idempotency_keys SET status = $3, response = $4 WHERE principal = $1 AND key = $2",
    )
    .bind(principal)
    .bind(key)
    .bind(status)
    .bind(response)
    .execute(db)
    .await
    .map(|_| ())
}

pub async fn release(
    db: impl PgExecutor<'_>,
    principal: &str,
    key: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM idempotency_keys WHERE principal = $1 AND key = $2 AND response IS NULL",
    )
    .bind(principal)
    .bind(key)
    .execute(db)
    .await
    .map(|_| ())
}
