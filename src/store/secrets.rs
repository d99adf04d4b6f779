//! Team secrets as stored: sealed values (key id, nonce, ciphertext) by team and name.
//! Nothing here sees a plaintext; the cipher lives in `services::secrets`.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

/// What may be shown about a secret: never its value.
#[derive(Debug, Clone, FromRow)]
pub struct SecretMetaRow {
    pub name: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub updated_by: Option<Uuid>,
}

/// A stored value, sealed.
#[derive(Debug, Clone, FromRow)]
pub struct SealedRow {
    pub team_id: Uuid,
    pub name: String,
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// A sealed value to store.
pub struct NewSealed<'a> {
    pub team_id: Uuid,
    pub name: &'a str,
    pub key_id: &'a str,
    pub nonce: &'a [u8],
    pub ciphertext: &'a [u8],
    pub updated_by: Uuid,
}

/// Insert or replace; `true` in the answer when the secret did not exist before.
pub async fn upsert(
    db: impl PgExecutor<'_>,
    s: &NewSealed<'_>,
) -> Result<(SecretMetaRow, bool), sqlx::Error> {
    #[derive(FromRow)]
    struct Row {
        #[sqlx(flatten)]
        meta: SecretMetaRow,
        created: bool,
    }
    let row: Row = sqlx::query_as(
        "INSERT INTO team_secrets (team_id, name, key_id, nonce, ciphertext, updated_by)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (team_id, name) DO UPDATE
            SET key_id = EXCLUDED.key_id, nonce = EXCLUDED.nonce,
                ciphertext = EXCLUDED.ciphertext, updated_by = EXCLUDED.updated_by,
                updated_at = now()
         RETURNING name, created_at, updated_at, updated_by, (xmax = 0) AS created",
    )
    .bind(s.team_id)
    .bind(s.name)
    .bind(s.key_id)
    .bind(s.nonce)
    .bind(s.ciphertext)
    .bind(s.updated_by)
    .fetch_one(db)
    .await?;
    Ok((row.meta, row.created))
}

/// The team's secrets by name, after `after`, at most `limit`.
pub async fn list(
    db: impl PgExecutor<'_>,
    team: Uuid,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<SecretMetaRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT name, created_at, updated_at, updated_by FROM team_secrets
         WHERE team_id = $1 AND ($2::text IS NULL OR name > $2)
         ORDER BY name LIMIT $3",
    )
    .bind(team)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// `true` when a secret was deleted.
pub async fn delete(db: impl PgExecutor<'_>, team: Uuid, name: &str) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM team_secrets WHERE team_id = $1 AND name = $2")
        .bind(team)
        .bind(name)
        .execute(db)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The sealed values of the team's secrets among `names` (absent ones are left out).
pub async fn sealed(
    db: impl PgExecutor<'_>,
    team: Uuid,
    names: &[String],
) -> Result<Vec<SealedRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT team_id, name, key_id, nonce, ciphertext FROM team_secrets
         WHERE team_id = $1 AND name = ANY($2)",
    )
    .bind(team)
    .bind(names)
    .fetch_all(db)
    .await
}

/// Sealed values not under key `key_id`, in a stable order, after `after` (team, name).
pub async fn sealed_not_under(
    db: impl PgExecutor<'_>,
    key_id: &str,
    after: Option<(Uuid, &str)>,
    limit: i64,
) -> Result<Vec<SealedRow>, sqlx::Error> {
    let (after_team, after_name) = match after {
        Some((t, n)) => (Some(t), Some(n)),
        None => (None, None),
    };
    sqlx::query_as(
        "SELECT team_id, name, key_id, nonce, ciphertext FROM team_secrets
         WHERE key_id <> $1
           AND ($2::uuid IS NULL OR (team_id, name) > ($2, $3::text))
         ORDER BY team_id, name LIMIT $4",
    )
    .bind(key_id)
    .bind(after_team)
    .bind(after_name)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// How many values are sealed under another key than `key_id`.
pub async fn count_not_under(db: impl PgExecutor<'_>, key_id: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM team_secrets WHERE key_id <> $1")
        .bind(key_id)
        .fetch_one(db)
        .await
}

/// Replace a sealed value by the same value sealed anew, unless it changed meanwhile
/// (a concurrent write wins). `true` when replaced.
pub async fn reseal(
    db: impl PgExecutor<'_>,
    old: &SealedRow,
    key_id: &str,
    nonce: &[u8],
    ciphertext: &[u8],
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE team_secrets SET key_id = $3, nonce = $4, ciphertext = $5
         WHERE team_id = $1 AND name = $2 AND key_id = $6 AND nonce = $7",
    )
    .bind(old.team_id)
    .bind(&old.name)
    .bind(key_id)
    .bind(nonce)
    .bind(ciphertext)
    .bind(&old.key_id)
    .bind(&old.nonce)
    .execute(db)
    .await?;
    Ok(done.rows_affected() > 0)
}
