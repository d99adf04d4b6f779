//! Users of an OpenID Connect provider (by issuer and subject), the team memberships its
//! groups map to, browser sessions (stored as hashes) and sign-ins in progress.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use super::identity::UserRow;

/// The user for (`issuer`, `subject`), created on first sight; email and name are
/// refreshed when they changed. Never touches local users (their issuer is null).
pub async fn upsert_user(
    db: impl PgExecutor<'_> + Copy,
    issuer: &str,
    subject: &str,
    email: &str,
    name: &str,
) -> Result<UserRow, sqlx::Error> {
    let found: Option<UserRow> = sqlx::query_as(
        "SELECT id, email, name, is_admin FROM users WHERE oidc_issuer = $1 AND oidc_subject = $2",
    )
    .bind(issuer)
    .bind(subject)
    .fetch_optional(db)
    .await?;
    if let Some(u) = &found
        && u.email == email
        && u.name == name
    {
        return Ok(found.expect("checked"));
    }
    sqlx::query_as(
        "INSERT INTO users (id, email, name, is_admin, oidc_issuer, oidc_subject)
         VALUES ($1, $2, $3, false, $4, $5)
         ON CONFLICT (oidc_issuer, oidc_subject)
         DO UPDATE SET email = EXCLUDED.email, name = EXCLUDED.name
         RETURNING id, email, name, is_admin",
    )
    .bind(Uuid::now_v7())
    .bind(email)
    .bind(name)
    .bind(issuer)
    .bind(subject)
    .fetch_one(db)
    .await
}

/// The id of the team named `name`, created when it does not exist.
pub async fn ensure_team(db: impl PgExecutor<'_> + Copy, name: &str) -> Result<Uuid, sqlx::Error> {
    let made: Option<Uuid> = sqlx::query_scalar(
        "INSERT INTO teams (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING RETURNING id",
    )
    .bind(Uuid::now_v7())
    .bind(name)
    .fetch_optional(db)
    .await?;
    match made {
        Some(id) => Ok(id),
        // It exists (perhaps made a moment ago by a concurrent request): a new statement
        // sees it.
        None => {
            sqlx::query_scalar("SELECT id FROM teams WHERE name = $1")
                .bind(name)
                .fetch_one(db)
                .await
        }
    }
}

#[derive(Debug, Clone, FromRow)]
pub struct SessionRow {
    pub id: Uuid,
    pub user_id: Uuid,
    pub groups: Vec<String>,
    pub idle_expires_at: DateTime<Utc>,
    pub absolute_expires_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// When the provider last vouched for the session's user (its sign-in).
    pub created_at: DateTime<Utc>,
}

pub async fn insert_session(
    db: impl PgExecutor<'_>,
    user: Uuid,
    hash: &[u8],
    groups: &[String],
    idle_expires_at: DateTime<Utc>,
    absolute_expires_at: DateTime<Utc>,
) -> Result<Uuid, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO user_sessions (id, user_id, session_hash, groups, idle_expires_at, absolute_expires_at)
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
    )
    .bind(Uuid::now_v7())
    .bind(user)
    .bind(hash)
    .bind(groups)
    .bind(idle_expires_at)
    .bind(absolute_expires_at)
    .fetch_one(db)
    .await
}

pub async fn session_by_hash(
    db: impl PgExecutor<'_>,
    hash: &[u8],
) -> Result<Option<SessionRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, groups, idle_expires_at, absolute_expires_at, revoked_at,
                created_at
         FROM user_sessions WHERE session_hash = $1",
    )
    .bind(hash)
    .fetch_optional(db)
    .await
}

/// Push the idle expiry forward (never past the absolute one), at most once a minute.
pub async fn touch_session(
    db: impl PgExecutor<'_>,
    id: Uuid,
    idle_s: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE user_sessions
         SET last_seen_at = now(),
             idle_expires_at = least(now() + make_interval(secs => $2), absolute_expires_at)
         WHERE id = $1 AND revoked_at IS NULL AND last_seen_at < now() - interval '1 minute'",
    )
    .bind(id)
    .bind(idle_s as f64)
    .execute(db)
    .await
    .map(|_| ())
}

/// Revoke the session with this hash; true when one was live.
pub async fn revoke_session(db: impl PgExecutor<'_>, hash: &[u8]) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE user_sessions SET revoked_at = now() WHERE session_hash = $1 AND revoked_at IS NULL",
    )
    .bind(hash)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

pub async fn insert_login(
    db: impl PgExecutor<'_>,
    state_hash: &[u8],
    code_verifier: &str,
    nonce: &str,
    return_to: &str,
    expires_at: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH gone AS (DELETE FROM oidc_logins WHERE expires_at < now())
         INSERT INTO oidc_logins (state_hash, code_verifier, nonce, return_to, expires_at)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(state_hash)
    .bind(code_verifier)
    .bind(nonce)
    .bind(return_to)
    .bind(expires_at)
    .execute(db)
    .await
    .map(|_| ())
}

#[derive(Debug, Clone, FromRow)]
pub struct LoginRow {
    pub code_verifier: String,
    pub nonce: String,
    pub return_to: String,
    pub expires_at: DateTime<Utc>,
}

/// Take (read and delete) the sign-in started with this state: a state is used once.
/// (Expired sign-ins are swept whenever a new one starts.)
pub async fn take_login(
    db: impl PgExecutor<'_>,
    state_hash: &[u8],
) -> Result<Option<LoginRow>, sqlx::Error> {
    sqlx::query_as(
        "DELETE FROM oidc_logins WHERE state_hash = $1
         RETURNING code_verifier, nonce, return_to, expires_at",
    )
    .bind(state_hash)
    .fetch_optional(db)
    .await
}
