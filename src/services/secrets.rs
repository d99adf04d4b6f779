//! Team secrets: a team's own credentials for its agents' providers (`ANTHROPIC_API_KEY`,
//! …). Owners write and delete them; every member of the team may list their names and
//! update times; no one reads a value back. Values are sealed with AES-256-GCM before
//! they reach the store (`keyring`) and opened only to start an agent's provider process,
//! whose launcher puts them in the child's environment. A provider names the secrets it
//! takes (`[providers.<id>] team_secrets`); for a team that has not set one, or whose
//! stored value cannot be opened, the provider is unavailable with the reason.

mod keyring;

pub use keyring::{GENERATED_KEY_FILE, KeySource, Keyring, OpenError, Sealed, key_id};

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use utoipa::ToSchema;
use uuid::Uuid;

use super::audit::{self, Action, Entry};
use super::{Access, Data, ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::config::valid_env_name;
use crate::domain::{SecretEnv, SecretValue, TeamId, UserId};
use crate::store;

/// The largest value accepted, in bytes (an environment variable, not a file).
pub const MAX_VALUE_BYTES: usize = 32 * 1024;

/// The body of `PUT /v1/teams/{id}/secrets/{name}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"value": "sk-ant-api03-…"}))]
pub struct PutSecret {
    /// The value, at most 32 KiB. Write-only: no answer ever contains it.
    #[schema(value_type = String)]
    pub value: SecretValue,
}

/// A team secret as clients see it: its name and when it changed, never its value.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"name": "ANTHROPIC_API_KEY", "created_at": "2026-11-30T12:00:00Z",
    "updated_at": "2026-12-01T09:30:00Z", "updated_by": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"}))]
pub struct SecretInfo {
    pub name: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Who set the current value (null once that user is deleted).
    pub updated_by: Option<UserId>,
}

impl From<store::secrets::SecretMetaRow> for SecretInfo {
    fn from(r: store::secrets::SecretMetaRow) -> Self {
        Self {
            name: r.name,
            created_at: r.created_at,
            updated_at: r.updated_at,
            updated_by: r.updated_by.map(Into::into),
        }
    }
}

/// The team exists and the caller may do `op` in it (another team's id is a missing
/// team, for an admin too when no such team exists).
async fn team_for(
    data: &Data,
    principal: &Principal,
    team: TeamId,
    op: Operation,
) -> ServiceResult<Uuid> {
    principal.authorize_in(team.uuid(), op, "team")?;
    if store::identity::team_name(&data.pool, team.uuid())
        .await?
        .is_none()
    {
        return Err(ServiceError::NotFound("team"));
    }
    Ok(team.uuid())
}

fn check_name(name: &str) -> ServiceResult<()> {
    if valid_env_name(name) {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "name",
            "must be an environment variable name: A-Z, 0-9 and `_`, not starting with a \
             digit, at most 128 characters",
        ))
    }
}

/// Set a secret (owners). `true` in the answer when it did not exist before.
#[tracing::instrument(name = "services::secrets::put", skip_all, fields(team_id = %team))]
pub async fn put(
    data: &Data,
    access: &Access,
    principal: &Principal,
    team: TeamId,
    name: &str,
    body: &PutSecret,
) -> ServiceResult<(SecretInfo, bool)> {
    let team = team_for(data, principal, team, Operation::ManageTeam).await?;
    check_name(name)?;
    let value = body.value.expose();
    if value.is_empty() {
        return Err(ServiceError::invalid("value", "must not be empty"));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(ServiceError::invalid(
            "value",
            format!("must be at most {MAX_VALUE_BYTES} bytes"),
        ));
    }
    let sealed = access.secrets.seal(team, name, &body.value);
    let (row, created) = store::secrets::upsert(
        &data.pool,
        &store::secrets::NewSealed {
            team_id: team,
            name,
            key_id: &sealed.key_id,
            nonce: &sealed.nonce,
            ciphertext: &sealed.ciphertext,
            updated_by: principal.user_id,
        },
    )
    .await?;
    tracing::info!(team_id = %TeamId::from(team), name, created, key_id = %sealed.key_id, "team secret set");
    // The name only: the value never goes into the audit log.
    audit::record(
        data,
        principal,
        Entry::new(Action::SecretSet, Some(team), "secret", name)
            .details(json!({"created": created})),
    )
    .await?;
    Ok((row.into(), created))
}

/// The names of the team's secrets and when they changed (every member of the team).
#[tracing::instrument(name = "services::secrets::list", skip_all, fields(team_id = %team))]
pub async fn list(
    data: &Data,
    principal: &Principal,
    team: TeamId,
    after: Option<&str>,
    limit: i64,
) -> ServiceResult<Vec<SecretInfo>> {
    let team = team_for(data, principal, team, Operation::ReadTeam).await?;
    let rows = store::secrets::list(&data.pool, team, after, limit).await?;
    Ok(rows.into_iter().map(SecretInfo::from).collect())
}

/// Delete a secret (owners). A name that is not set is a missing secret.
#[tracing::instrument(name = "services::secrets::delete", skip_all, fields(team_id = %team))]
pub async fn delete(
    data: &Data,
    principal: &Principal,
    team: TeamId,
    name: &str,
) -> ServiceResult<()> {
    let team = team_for(data, principal, team, Operation::ManageTeam).await?;
    if !valid_env_name(name) || !store::secrets::delete(&data.pool, team, name).await? {
        return Err(ServiceError::NotFound("secret"));
    }
    tracing::info!(team_id = %TeamId::from(team), name, "team secret deleted");
    audit::record(
        data,
        principal,
        Entry::new(Action::SecretDelete, Some(team), "secret", name),
    )
    .await?;
    Ok(())
}

/// The team's secrets among `names`, each opened or with the reason it cannot be used.
#[tracing::instrument(name = "services::secrets::open_many", skip_all, fields(team_id = %team))]
pub(crate) async fn open_many(
    data: &Data,
    access: &Access,
    team: Uuid,
    names: &[String],
) -> ServiceResult<BTreeMap<String, Result<SecretValue, String>>> {
    let mut out = BTreeMap::new();
    if names.is_empty() {
        return Ok(out);
    }
    for row in store::secrets::sealed(&data.pool, team, names).await? {
        let sealed = Sealed {
            key_id: row.key_id,
            nonce: row.nonce,
            ciphertext: row.ciphertext,
        };
        let opened = access.secrets.open(team, &row.name, &sealed).map_err(|e| {
            tracing::warn!(team_id = %TeamId::from(team), name = %row.name, key_id = %sealed.key_id,
                error = %e, "a team secret cannot be decrypted");
            format!("team secret {} cannot be decrypted: {e}", row.name)
        });
        out.insert(row.name, opened);
    }
    Ok(out)
}

/// The environment `names` make for an agent of `team`, in order; `Err` with the reason
/// of the first that is not set or cannot be opened.
pub(crate) fn env_of(
    names: &[String],
    opened: &BTreeMap<String, Result<SecretValue, String>>,
) -> Result<SecretEnv, String> {
    let mut env = SecretEnv::new();
    for name in names {
        match opened.get(name) {
            None => return Err(format!("team secret {name} not set")),
            Some(Err(why)) => return Err(why.clone()),
            Some(Ok(v)) => {
                env.insert(name.clone(), v.clone());
            }
        }
    }
    Ok(env)
}

/// The team secrets provider `provider` takes, opened for an agent of `team`; `Err` with
/// the reason the provider is unavailable to the team. No query when it takes none.
#[tracing::instrument(name = "services::secrets::launch_env", skip_all, fields(team_id = %team))]
pub(crate) async fn launch_env(
    ctx: &ServiceContext,
    provider: &str,
    team: Uuid,
) -> ServiceResult<Result<SecretEnv, String>> {
    let names = ctx.fleet.agents.registry().team_secrets(provider);
    if names.is_empty() {
        return Ok(Ok(SecretEnv::new()));
    }
    let opened = open_many(&ctx.data, &ctx.access, team, names).await?;
    Ok(env_of(names, &opened))
}

/// A new random key for `secrets.key`: 32 bytes from the system's random source, base64.
pub fn new_key() -> anyhow::Result<String> {
    use base64::Engine;
    use rand::TryRngCore;
    let mut key = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut key)
        .map_err(|e| anyhow::anyhow!("the system's random source failed: {e}"))?;
    Ok(base64::engine::general_purpose::STANDARD.encode(key))
}

/// What `rotate` did.
#[derive(Debug, Default)]
pub struct RotateReport {
    /// Values re-encrypted under the current key.
    pub rotated: usize,
    /// Values changed by someone else meanwhile (already under the current key).
    pub skipped: usize,
    /// Values that cannot be opened with any key the server has: `(team, name, why)`.
    pub failed: Vec<(TeamId, String, OpenError)>,
}

/// Re-encrypt every value that is not under the current key (`agentry secrets rotate`).
/// Safe beside a running server: a value written meanwhile is left as written.
#[tracing::instrument(name = "services::secrets::rotate", skip_all)]
pub async fn rotate(pool: &PgPool, keys: &Keyring) -> Result<RotateReport, sqlx::Error> {
    let mut report = RotateReport::default();
    let mut after: Option<(Uuid, String)> = None;
    loop {
        let rows = store::secrets::sealed_not_under(
            pool,
            keys.current_id(),
            after.as_ref().map(|(t, n)| (*t, n.as_str())),
            200,
        )
        .await?;
        let Some(last) = rows.last() else { break };
        after = Some((last.team_id, last.name.clone()));
        for row in rows {
            let sealed = Sealed {
                key_id: row.key_id.clone(),
                nonce: row.nonce.clone(),
                ciphertext: row.ciphertext.clone(),
            };
            let value = match keys.open(row.team_id, &row.name, &sealed) {
                Ok(v) => v,
                Err(e) => {
                    report
                        .failed
                        .push((row.team_id.into(), row.name.clone(), e));
                    continue;
                }
            };
            let new = keys.seal(row.team_id, &row.name, &value);
            if store::secrets::reseal(pool, &row, &new.key_id, &new.nonce, &new.ciphertext).await? {
                report.rotated += 1;
            } else {
                report.skipped += 1;
            }
        }
    }
    Ok(report)
}

/// Re-encrypt the secrets of `table` (hooks', webhook triggers') that are not under the
/// current key, each sealed for its owner's team (the nil id for a server-wide owner) and
/// the name `seal_name` gives its row id. Returns how many were re-encrypted, and the ids
/// whose secret cannot be opened with any key the server has. One changed meanwhile is
/// left as written.
#[tracing::instrument(name = "services::secrets::rotate_sealed", skip_all, fields(table = ?table))]
pub async fn rotate_sealed<Id: From<Uuid>>(
    pool: &PgPool,
    keys: &Keyring,
    table: store::sealed::SealedIn,
    seal_name: impl Fn(Uuid) -> String,
) -> Result<(usize, Vec<(Id, OpenError)>), sqlx::Error> {
    let mut rotated = 0;
    let mut failed = Vec::new();
    for row in store::sealed::sealed_not_under(pool, table, keys.current_id()).await? {
        let team = row.team_id.unwrap_or(Uuid::nil());
        let name = seal_name(row.id);
        let sealed = Sealed {
            key_id: row.key_id.clone(),
            nonce: row.nonce.clone(),
            ciphertext: row.ciphertext.clone(),
        };
        match keys.open(team, &name, &sealed) {
            Ok(secret) => {
                let new = keys.seal(team, &name, &secret);
                if store::sealed::reseal(
                    pool,
                    table,
                    &row,
                    &new.key_id,
                    &new.nonce,
                    &new.ciphertext,
                )
                .await?
                {
                    rotated += 1;
                }
            }
            Err(e) => failed.push((row.id.into(), e)),
        }
    }
    Ok((rotated, failed))
}

/// At start: say where the key comes from (a generated key once, loudly) and how many
/// stored values wait for `agentry secrets rotate`.
#[tracing::instrument(name = "services::secrets::announce_key", skip_all)]
pub async fn announce_key(pool: &PgPool, keys: &Keyring, source: &KeySource, shared_db: bool) {
    match source {
        KeySource::Generated(path) => {
            tracing::warn!(
                key_id = keys.current_id(),
                file = %path.display(),
                "generated the key that encrypts team secrets (no `secrets.key` is set); back \
                 up this file: without it stored team secrets cannot be decrypted"
            );
            if shared_db {
                tracing::warn!(
                    "the database is external: every replica that uses it needs the same \
                     key; set `secrets.key` (or AGENTRY_SECRETS__KEY) to this file's content"
                );
            }
        }
        KeySource::File(path) => {
            tracing::info!(key_id = keys.current_id(), file = %path.display(), "team secrets key loaded");
        }
        KeySource::Settings => {
            tracing::info!(
                key_id = keys.current_id(),
                "team secrets key from the settings"
            );
        }
    }
    match store::secrets::count_not_under(pool, keys.current_id()).await {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            values = n,
            key_id = keys.current_id(),
            "team secrets are stored under another key than the current one; run `agentry \
             secrets rotate` (values under a key not in `secrets.previous_keys` cannot be used)"
        ),
        Err(e) => tracing::warn!(error = %e, "could not count team secrets to rotate"),
    }
}
