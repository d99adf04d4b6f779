//! Users, teams, memberships and API tokens.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct UserRow {
    pub id: Uuid,
    pub email: String,
    pub name: String,
    pub is_admin: bool,
}

#[derive(Debug, Clone, FromRow)]
pub struct MembershipRow {
    pub team_id: Uuid,
    pub team_name: String,
    pub role: String,
}

#[derive(Debug, Clone, FromRow)]
pub struct TokenRow {
    pub id: Uuid,
    pub user_id: Uuid,
    pub team_id: Option<Uuid>,
    pub role: Option<String>,
    pub name: String,
    pub prefix: String,
    pub scopes: Vec<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

pub async fn find_user_by_email(
    db: impl PgExecutor<'_>,
    email: &str,
) -> Result<Option<UserRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, email, name, is_admin FROM users WHERE email = $1 AND oidc_issuer IS NULL",
    )
    .bind(email)
    .fetch_optional(db)
    .await
}

pub async fn get_user(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<UserRow>, sqlx::Error> {
    sqlx::query_as("SELECT id, email, name, is_admin FROM users WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await
}

pub async fn insert_user(
    db: impl PgExecutor<'_>,
    id: Uuid,
    email: &str,
    name: &str,
    is_admin: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO users (id, email, name, is_admin) VALUES ($1, $2, $3, $4)")
        .bind(id)
        .bind(email)
        .bind(name)
        .bind(is_admin)
        .execute(db)
        .await
        .map(|_| ())
}

pub async fn find_team_by_name(
    db: impl PgExecutor<'_>,
    name: &str,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM teams WHERE name = $1")
        .bind(name)
        .fetch_optional(db)
        .await
}

pub async fn insert_team(db: impl PgExecutor<'_>, id: Uuid, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO teams (id, name) VALUES ($1, $2)")
        .bind(id)
        .bind(name)
        .execute(db)
        .await
        .map(|_| ())
}

pub async fn upsert_member(
    db: impl PgExecutor<'_>,
    team: Uuid,
    user: Uuid,
    role: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO team_members (team_id, user_id, role) VALUES ($1, $2, $3)
         ON CONFLICT (team_id, user_id) DO UPDATE SET role = EXCLUDED.role",
    )
    .bind(team)
    .bind(user)
    .bind(role)
    .execute(db)
    .await
    .map(|_| ())
}

/// The teams of `user`, their default team first, then in the order they joined (so the
/// first is the team new resources go to when a request names none).
pub async fn memberships(
    db: impl PgExecutor<'_>,
    user: Uuid,
) -> Result<Vec<MembershipRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT m.team_id, t.name AS team_name, m.role
         FROM team_members m JOIN teams t ON t.id = m.team_id JOIN users u ON u.id = m.user_id
         WHERE m.user_id = $1
         ORDER BY (m.team_id = u.default_team_id) IS TRUE DESC, m.created_at, m.team_id",
    )
    .bind(user)
    .fetch_all(db)
    .await
}

pub async fn team_name(db: impl PgExecutor<'_>, team: Uuid) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM teams WHERE id = $1")
        .bind(team)
        .fetch_optional(db)
        .await
}

#[allow(clippy::too_many_arguments)]
pub async fn insert_token(
    db: impl PgExecutor<'_>,
    id: Uuid,
    user_id: Uuid,
    team_id: Option<Uuid>,
    role: Option<&str>,
    name: &str,
    prefix: &str,
    hash: &[u8],
    scopes: &[String],
    expires_at: Option<DateTime<Utc>>,
) -> Result<TokenRow, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO api_tokens (id, user_id, team_id, role, name, prefix, token_hash, scopes, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         RETURNING id, user_id, team_id, role, name, prefix, scopes, created_at, expires_at, last_used_at, revoked_at",
    )
    .bind(id)
    .bind(user_id)
    .bind(team_id)
    .bind(role)
    .bind(name)
    .bind(prefix)
    .bind(hash)
    .bind(scopes)
    .bind(expires_at)
    .fetch_one(db)
    .await
}

/// What a bearer token stands for, read in one round trip: the token, its user (the
/// user columns are null when the user is gone), the user's memberships (their default
/// team first, then in the order they joined, like `memberships`) and, for a team's service token, that team's name.
#[derive(Debug, Clone, FromRow)]
pub struct BearerRow {
    #[sqlx(flatten)]
    pub token: TokenRow,
    pub email: Option<String>,
    pub user_name: Option<String>,
    pub is_admin: Option<bool>,
    pub service_team_name: Option<String>,
    pub member_team_ids: Vec<Uuid>,
    pub member_team_names: Vec<String>,
    pub member_roles: Vec<String>,
    /// For an agent's token: its agent, the agent's project and whether it is archived.
    pub agent_id: Option<Uuid>,
    pub agent_project_id: Option<Uuid>,
    pub agent_archived: Option<bool>,
}

pub async fn bearer_by_hash(
    db: impl PgExecutor<'_>,
    hash: &[u8],
) -> Result<Option<BearerRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT t.id, t.user_id, t.team_id, t.role, t.name, t.prefix, t.scopes, t.created_at,
                t.expires_at, t.last_used_at, t.revoked_at, u.email, u.name AS user_name, u.is_admin,
                (SELECT name FROM teams WHERE id = t.team_id) AS service_team_name,
                ms.member_team_ids, ms.member_team_names, ms.member_roles,
                t.agent_id, aw.project_id AS agent_project_id,
                ag.archived_at IS NOT NULL AS agent_archived
         FROM api_tokens t
         LEFT JOIN users u ON u.id = t.user_id
         LEFT JOIN agents ag ON ag.id = t.agent_id
         LEFT JOIN workspaces aw ON aw.id = ag.workspace_id
         CROSS JOIN LATERAL (
             SELECT coalesce(array_agg(m.team_id ORDER BY m.later, m.created_at, m.team_id), '{}')
                        AS member_team_ids,
                    coalesce(array_agg(m.name ORDER BY m.later, m.created_at, m.team_id), '{}')
                        AS member_team_names,
                    coalesce(array_agg(m.role ORDER BY m.later, m.created_at, m.team_id), '{}')
                        AS member_roles
             FROM (
                 SELECT tm.team_id, tm.role, tm.created_at, te.name,
                        (tm.team_id = u.default_team_id) IS NOT TRUE AS later
                 FROM team_members tm JOIN teams te ON te.id = tm.team_id
                 WHERE tm.user_id = t.user_id
             ) m
         ) ms
         WHERE t.token_hash = $1",
    )
    .bind(hash)
    .fetch_optional(db)
    .await
}

/// Record use, at most once a minute per token (keeps writes off the hot path).
pub async fn touch_token(db: impl PgExecutor<'_>, id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE api_tokens SET last_used_at = now()
         WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')",
    )
    .bind(id)
    .execute(db)
    .await
    .map(|_| ())
}

/// Live tokens of `user_id`; only those of `team` when it is given.
pub async fn list_tokens(
    db: impl PgExecutor<'_>,
    user_id: Uuid,
    team: Option<Uuid>,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<TokenRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, team_id, role, name, prefix, scopes, created_at, expires_at, last_used_at, revoked_at
         FROM api_tokens WHERE user_id = $1 AND revoked_at IS NULL AND agent_id IS NULL
           AND ($2::uuid IS NULL OR id > $2)
           AND ($4::uuid IS NULL OR team_id = $4)
         ORDER BY id LIMIT $3",
    )
    .bind(user_id)
    .bind(after)
    .bind(limit)
    .bind(team)
    .fetch_all(db)
    .await
}

/// The live service tokens of `team`, whoever made them.
pub async fn list_team_tokens(
    db: impl PgExecutor<'_>,
    team: Uuid,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<TokenRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, team_id, role, name, prefix, scopes, created_at, expires_at, last_used_at, revoked_at
         FROM api_tokens WHERE team_id = $1 AND revoked_at IS NULL AND agent_id IS NULL
           AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3",
    )
    .bind(team)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn get_token(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<TokenRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, team_id, role, name, prefix, scopes, created_at, expires_at, last_used_at, revoked_at
         FROM api_tokens WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// Revoke a token of `user_id` (any token when `user_id` is None). True when one was revoked.
pub async fn revoke_token(
    db: impl PgExecutor<'_>,
    id: Uuid,
    user_id: Option<Uuid>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE api_tokens SET revoked_at = now()
         WHERE id = $1 AND revoked_at IS NULL AND ($2::uuid IS NULL OR user_id = $2)",
    )
    .bind(id)
    .bind(user_id)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Make `team` the default team of `user`, who must be a member of it; false when not.
pub async fn set_default_team(
    db: impl PgExecutor<'_>,
    user: Uuid,
    team: Uuid,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE users SET default_team_id = $2
         WHERE id = $1 AND EXISTS (SELECT 1 FROM team_members WHERE team_id = $2 AND user_id = $1)",
    )
    .bind(user)
    .bind(team)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Whether `user` signs in through an identity provider (not a local user).
pub async fn is_idp_user(db: impl PgExecutor<'_>, user: Uuid) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT oidc_issuer IS NOT NULL FROM users WHERE id = $1")
        .bind(user)
        .fetch_optional(db)
        .await
        .map(|v| v.unwrap_or(false))
}

/// A fresh token for `agent` (kind `agent`: it acts in `team` with `role` and the `agents`
/// scope); the agent's earlier tokens are revoked in the same statement's transaction, so
/// an agent holds one live token, that of its latest launch.
#[allow(clippy::too_many_arguments)]
pub async fn issue_agent_token(
    tx: &mut sqlx::PgConnection,
    id: Uuid,
    agent: Uuid,
    user_id: Uuid,
    team: Uuid,
    role: &str,
    name: &str,
    prefix: &str,
    hash: &[u8],
) -> Result<(), sqlx::Error> {
    revoke_agent_tokens(&mut *tx, &[agent]).await?;
    sqlx::query(
        "INSERT INTO api_tokens (id, user_id, team_id, role, name, prefix, token_hash, scopes, agent_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, '{agents}', $8)",
    )
    .bind(id)
    .bind(user_id)
    .bind(team)
    .bind(role)
    .bind(name)
    .bind(prefix)
    .bind(hash)
    .bind(agent)
    .execute(&mut *tx)
    .await
    .map(|_| ())
}

/// Revoke every live token of these agents; how many there were. Nothing is written (and
/// no change announced to the replicas' token caches) when none is live.
pub async fn revoke_agent_tokens(
    db: &mut sqlx::PgConnection,
    agents: &[Uuid],
) -> Result<u64, sqlx::Error> {
    let live: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE agent_id = ANY($1) AND revoked_at IS NULL)",
    )
    .bind(agents)
    .fetch_one(&mut *db)
    .await?;
    if !live {
        return Ok(0);
    }
    sqlx::query(
        "UPDATE api_tokens SET revoked_at = now() WHERE agent_id = ANY($1) AND revoked_at IS NULL",
    )
    .bind(agents)
    .execute(&mut *db)
    .await
    .map(|r| r.rows_affected())
}
