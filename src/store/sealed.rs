//! Secrets kept sealed (key id, nonce, ciphertext) in a row of their own owner: a hook's
//! signing secret, a webhook trigger's secret. Key rotation finds the ones sealed under an
//! older key and seals them anew, the same way for every table that keeps one; only the
//! table and its column names differ, and those are fixed here, never taken from input.

use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

/// A table whose rows keep a sealed secret, with its two statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealedIn {
    /// `hooks`: `key_id`, `nonce`, `ciphertext` (always set); `team_id` null for a
    /// server-wide hook.
    Hooks,
    /// `triggers`: `secret_key_id`, `secret_nonce`, `secret_ciphertext` (set for webhook
    /// triggers only).
    Triggers,
}

impl SealedIn {
    fn select_not_under(self) -> &'static str {
        match self {
            SealedIn::Hooks => {
                "SELECT id, team_id, key_id, nonce, ciphertext FROM hooks
                 WHERE key_id <> $1 ORDER BY id"
            }
            SealedIn::Triggers => {
                "SELECT id, team_id, secret_key_id AS key_id, secret_nonce AS nonce,
                        secret_ciphertext AS ciphertext
                 FROM triggers
                 WHERE secret_key_id <> $1 AND secret_nonce IS NOT NULL
                   AND secret_ciphertext IS NOT NULL
                 ORDER BY id"
            }
        }
    }

    fn reseal(self) -> &'static str {
        match self {
            SealedIn::Hooks => {
                "UPDATE hooks SET key_id = $2, nonce = $3, ciphertext = $4
                 WHERE id = $1 AND key_id = $5 AND nonce = $6"
            }
            SealedIn::Triggers => {
                "UPDATE triggers
                 SET secret_key_id = $2, secret_nonce = $3, secret_ciphertext = $4
                 WHERE id = $1 AND secret_key_id = $5 AND secret_nonce = $6"
            }
        }
    }
}

/// One row's sealed secret, for key rotation. `team_id` is `None` for a server-wide owner.
#[derive(Debug, Clone, FromRow)]
pub struct SealedSecret {
    pub id: Uuid,
    pub team_id: Option<Uuid>,
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// The secrets in `table` sealed under another key than `key_id`, by id.
pub async fn sealed_not_under(
    db: impl PgExecutor<'_>,
    table: SealedIn,
    key_id: &str,
) -> Result<Vec<SealedSecret>, sqlx::Error> {
    sqlx::query_as(table.select_not_under())
        .bind(key_id)
        .fetch_all(db)
        .await
}

/// Replaces a sealed secret by the same secret sealed anew, unless it changed meanwhile
/// (a concurrent write wins). `true` when replaced.
pub async fn reseal(
    db: impl PgExecutor<'_>,
    table: SealedIn,
    old: &SealedSecret,
    key_id: &str,
    nonce: &[u8],
    ciphertext: &[u8],
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(table.reseal())
        .bind(old.id)
        .bind(key_id)
        .bind(nonce)
        .bind(ciphertext)
        .bind(&old.key_id)
        .bind(&old.nonce)
        .execute(db)
        .await?;
    Ok(done.rows_affected() > 0)
}
