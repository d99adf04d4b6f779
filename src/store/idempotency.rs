//! Idempotency keys for create requests: the first request with a key claims it; a retry
//! with the same body gets the stored response, a different body a conflict. A claim
//! without a response (the request died mid-way) expires after `CLAIM_TTL`, so a retry
//! can claim the key again; at boot every unfinished claim belongs to a stopped server.
//! A key is kept `KEY_TTL_S` after its claim: past that it is claimed anew as if it had
//! never been used, and `purge_expired` deletes it.

use serde_json::Value;
use sqlx::{FromRow, PgExecutor};

#[derive(Debug, Clone, FromRow)]
pub struct KeyRow {
    pub request_hash: Vec<u8>,
    pub status: Option<i16>,
    pub response: Option<Value>,
}

/// How long a claim without a response holds its key. Longer than any create request can
/// run (the slowest, an agent whose first prompt waits for its provider to start, gives up
/// after 120 s), so a request still at work is never taken over.
pub const CLAIM_TTL_S: i64 = 300;

/// How long a key is kept, completed or not: 24 hours.
pub const KEY_TTL_S: i64 = 24 * 3600;

/// Claim `key`; true when this request is the first to use it, or when the earlier claim
/// got no response within `CLAIM_TTL_S` (its request died; this one takes over), or when
/// the earlier use is older than `KEY_TTL_S` (expired: the key is new again).
pub async fn claim(
    db: impl PgExecutor<'_>,
    principal: &str,
    key: &str,
    hash: &[u8],
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO idempotency_keys (principal, key, request_hash) VALUES ($1, $2, $3)
         ON CONFLICT (principal, key) DO UPDATE
            SET request_hash = EXCLUDED.request_hash, created_at = now(),
                status = NULL, response = NULL
          WHERE (idempotency_keys.response IS NULL
                 AND idempotency_keys.created_at < now() - make_interval(secs => $4))
             OR idempotency_keys.created_at < now() - make_interval(secs => $5)",
    )
    .bind(principal)
    .bind(key)
    .bind(hash)
    .bind(CLAIM_TTL_S as f64)
    .bind(KEY_TTL_S as f64)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Drop every claim that has no response: at boot, before requests are served, they all
/// belong to requests that died with the previous server.
pub async fn release_unfinished(db: impl PgExecutor<'_>) -> Result<u64, sqlx::Error> {
    sqlx::query("DELETE FROM idempotency_keys WHERE response IS NULL")
        .execute(db)
        .await
        .map(|r| r.rows_affected())
}

/// Delete up to `limit` keys older than `KEY_TTL_S`; how many were deleted.
pub async fn purge_expired(db: impl PgExecutor<'_>, limit: i64) -> Result<u64, sqlx::Error> {
    sqlx::query(
        "DELETE FROM idempotency_keys WHERE ctid IN (
             SELECT ctid FROM idempotency_keys
              WHERE created_at < now() - make_interval(secs => $1)
              LIMIT $2 FOR UPDATE SKIP LOCKED)",
    )
    .bind(KEY_TTL_S as f64)
    .bind(limit)
    .execute(db)
    .await
    .map(|r| r.rows_affected())
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
