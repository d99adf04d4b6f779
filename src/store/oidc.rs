//! Users of an OpenID Connect provider (by issuer and subject), the team memberships its
//! groups map to, browser sessions (stored as hashes) and sign-ins in progress.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use super::identity::UserRow;

/// The user for (`issuer`, `subject`), created on first sight; email, whether the
/// provider verified it, and name are refreshed when they changed. Never touches local
/// users (their issuer is null).
pub async fn upsert_user(
    db: impl PgExecutor<'_> + Copy,
    issuer: &str,
    subject: &str,
    email: &str,
    email_verified: bool,
    name: &str,
) -> Result<UserRow, sqlx::Error> {
    let found: Option<UserWithVerified> = sqlx::query_as(
        "SELECT id, email, name, is_admin, email_verified FROM users
         WHERE oidc_issuer = $1 AND oidc_subject = $2",
    )
    .bind(issuer)
    .bind(subject)
    .fetch_optional(db)
    .await?;
    if let Some(u) = found
        && u.email == email
        && u.name == name
        && u.email_verified == email_verified
    {
        return Ok(UserRow {
            id: u.id,
            email: u.email,
            name: u.name,
            is_admin: u.is_admin,
        });
    }
    sqlx::query_as(
        "INSERT INTO users (id, email, name, is_admin, oidc_issuer, oidc_subject, email_verified)
         VALUES ($1, $2, $3, false, $4, $5, $6)
         ON CONFLICT (oidc_issuer, oidc_subject)
         DO UPDATE SET email = EXCLUDED.email, name = EXCLUDED.name,
                       email_verified = EXCLUDED.email_verified
         RETURNING id, email, name, is_admin",
    )
    .bind(Uuid::now_v7())
    .bind(email)
    .bind(name)
    .bind(issuer)
    .bind(subject)
    .bind(email_verified)
    .fetch_one(db)
    .await
}

#[derive(FromRow)]
struct UserWithVerified {
    id: Uuid,
    email: String,
    name: String,
    is_admin: bool,
    email_verified: bool,
}

/// The id of the team bound to the group mapping `key`, created when there is none.
/// A team the server made for `name` before teams were bound by key (marked
/// `legacy:<name>`) is bound to `key` instead, once. Teams people made are never
/// bound: when one holds `name`, the mapped team is made beside it under the first free
/// name of `name-idp`, `name-idp-2`, …
pub async fn ensure_mapped_team(
    db: impl PgExecutor<'_> + Copy,
    key: &str,
    name: &str,
) -> Result<Uuid, sqlx::Error> {
    let bound: Option<Uuid> = sqlx::query_scalar("SELECT id FROM teams WHERE idp_key = $1")
        .bind(key)
        .fetch_optional(db)
        .await?;
    if let Some(id) = bound {
        return Ok(id);
    }
    let adopted: Option<Uuid> = sqlx::query_scalar(
        "UPDATE teams SET idp_key = $1 WHERE idp_key = 'legacy:' || $2 AND name = $2
         RETURNING id",
    )
    .bind(key)
    .bind(name)
    .fetch_optional(db)
    .await?;
    if let Some(id) = adopted {
        return Ok(id);
    }
    for attempt in 0..100u32 {
        let candidate = match attempt {
            0 => name.to_owned(),
            1 => format!("{name}-idp"),
            n => format!("{name}-idp-{n}"),
        };
        // Another request may make the same mapped team at once: the key is unique, so
        // exactly one insert wins and the others read its id.
        let made: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO teams (id, name, idp_key) VALUES ($1, $2, $3)
             ON CONFLICT DO NOTHING RETURNING id",
        )
        .bind(Uuid::now_v7())
        .bind(&candidate)
        .bind(key)
        .fetch_optional(db)
        .await?;
        if let Some(id) = made {
            return Ok(id);
        }
        let bound: Option<Uuid> = sqlx::query_scalar("SELECT id FROM teams WHERE idp_key = $1")
            .bind(key)
            .fetch_optional(db)
            .await?;
        if let Some(id) = bound {
            return Ok(id);
        }
    }
    Err(sqlx::Error::Protocol(format!(
        "no free name for the team of group mapping {key}"
    )))
}

/// The teams bound to group mappings, as (key, team id).
pub async fn mapped_teams(
    db: impl PgExecutor<'_>,
    keys: &[String],
) -> Result<Vec<(String, Uuid)>, sqlx::Error> {
    sqlx::query_as("SELECT idp_key, id FROM teams WHERE idp_key = ANY($1)")
        .bind(keys)
        .fetch_all(db)
        .await
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

/// Remember a sign-in in progress; expired ones are swept first.
#[allow(clippy::too_many_arguments)]
pub async fn insert_login(
    db: impl PgExecutor<'_>,
    state_hash: &[u8],
    browser_hash: &[u8],
    client_addr: &str,
    code_verifier: &str,
    nonce: &str,
    return_to: &str,
    expires_at: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH gone AS (DELETE FROM oidc_logins WHERE expires_at < now())
         INSERT INTO oidc_logins
             (state_hash, browser_hash, client_addr, code_verifier, nonce, return_to, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(state_hash)
    .bind(browser_hash)
    .bind(client_addr)
    .bind(code_verifier)
    .bind(nonce)
    .bind(return_to)
    .bind(expires_at)
    .execute(db)
    .await
    .map(|_| ())
}

/// Unexpired sign-ins in progress: in all, and those started from `client_addr` since
/// `since`.
pub async fn count_logins(
    db: impl PgExecutor<'_>,
    client_addr: &str,
    since: DateTime<Utc>,
) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*),
                count(*) FILTER (WHERE client_addr = $1 AND created_at > $2)
         FROM oidc_logins WHERE expires_at >= now()",
    )
    .bind(client_addr)
    .bind(since)
    .fetch_one(db)
    .await
}

#[derive(Debug, Clone, FromRow)]
pub struct LoginRow {
    pub browser_hash: Vec<u8>,
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
         RETURNING browser_hash, code_verifier, nonce, return_to, expires_at",
    )
    .bind(state_hash)
    .fetch_optional(db)
    .await
}
