//! Teams, their members and the users that can be added to them.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgConnection, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct TeamRow {
    pub id: Uuid,
    pub name: String,
    pub created_at: DateTime<Utc>,
    pub require_sandbox: bool,
}

#[derive(Debug, Clone, FromRow)]
pub struct MemberRow {
    pub user_id: Uuid,
    pub email: String,
    pub name: String,
    pub role: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, FromRow)]
pub struct UserRow {
    pub id: Uuid,
    pub email: String,
    pub name: String,
    pub is_admin: bool,
    pub created_at: DateTime<Utc>,
}

pub async fn get(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<TeamRow>, sqlx::Error> {
    sqlx::query_as("SELECT id, name, created_at, require_sandbox FROM teams WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await
}

/// Teams in id order after `after`; only those in `teams` unless it is `None`.
pub async fn list(
    db: impl PgExecutor<'_>,
    teams: Option<&[Uuid]>,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<TeamRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, name, created_at, require_sandbox FROM teams
         WHERE ($1::uuid[] IS NULL OR id = ANY($1)) AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3",
    )
    .bind(teams)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Whether the team's agents must run sandboxed (false for a team that does not exist).
pub async fn requires_sandbox(db: impl PgExecutor<'_>, id: Uuid) -> Result<bool, sqlx::Error> {
    let found: Option<bool> = sqlx::query_scalar("SELECT require_sandbox FROM teams WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(found.unwrap_or(false))
}

/// Whether the team's agents are given agentry's own MCP server (true for a team that
/// does not exist).
pub async fn agentry_mcp(db: impl PgExecutor<'_>, id: Uuid) -> Result<bool, sqlx::Error> {
    let found: Option<bool> = sqlx::query_scalar("SELECT agentry_mcp FROM teams WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(found.unwrap_or(true))
}

/// Set whether the team's agents are given agentry's own MCP server; `None`: no team.
pub async fn set_agentry_mcp(
    db: impl PgExecutor<'_>,
    id: Uuid,
    on: bool,
) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar("UPDATE teams SET agentry_mcp = $2 WHERE id = $1 RETURNING agentry_mcp")
        .bind(id)
        .bind(on)
        .fetch_optional(db)
        .await
}

/// Set whether the team's agents must run sandboxed; its row after (`None`: no team).
pub async fn set_require_sandbox(
    db: impl PgExecutor<'_>,
    id: Uuid,
    require: bool,
) -> Result<Option<TeamRow>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE teams SET require_sandbox = $2 WHERE id = $1 \
         RETURNING id, name, created_at, require_sandbox",
    )
    .bind(id)
    .bind(require)
    .fetch_optional(db)
    .await
}

/// A new team; false when the name is taken.
pub async fn insert(db: impl PgExecutor<'_>, id: Uuid, name: &str) -> Result<bool, sqlx::Error> {
    let done =
        sqlx::query("INSERT INTO teams (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
            .bind(id)
            .bind(name)
            .execute(db)
            .await?;
    Ok(done.rows_affected() == 1)
}

/// Members of a team in user id order, after `after`.
pub async fn members(
    db: impl PgExecutor<'_>,
    team: Uuid,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<MemberRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT m.user_id, u.email, u.name, m.role, m.created_at
         FROM team_members m JOIN users u ON u.id = m.user_id
         WHERE m.team_id = $1 AND ($2::uuid IS NULL OR m.user_id > $2)
         ORDER BY m.user_id LIMIT $3",
    )
    .bind(team)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn member(
    db: impl PgExecutor<'_>,
    team: Uuid,
    user: Uuid,
) -> Result<Option<MemberRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT m.user_id, u.email, u.name, m.role, m.created_at
         FROM team_members m JOIN users u ON u.id = m.user_id
         WHERE m.team_id = $1 AND m.user_id = $2",
    )
    .bind(team)
    .bind(user)
    .fetch_optional(db)
    .await
}

/// Take the team's row lock, so membership changes of one team happen one at a time
/// (the last-owner rule reads the owners, then changes them). False: no such team.
pub async fn lock(tx: &mut PgConnection, team: Uuid) -> Result<bool, sqlx::Error> {
    let found: Option<Uuid> = sqlx::query_scalar("SELECT id FROM teams WHERE id = $1 FOR UPDATE")
        .bind(team)
        .fetch_optional(tx)
        .await?;
    Ok(found.is_some())
}

pub async fn owner_count(db: impl PgExecutor<'_>, team: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM team_members WHERE team_id = $1 AND role = 'owner'")
        .bind(team)
        .fetch_one(db)
        .await
}

/// Add a member or change their role; true when they were added.
pub async fn set_member(
    db: impl PgExecutor<'_>,
    team: Uuid,
    user: Uuid,
    role: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO team_members (team_id, user_id, role) VALUES ($1, $2, $3)
         ON CONFLICT (team_id, user_id) DO UPDATE SET role = EXCLUDED.role
         RETURNING (xmax = 0)",
    )
    .bind(team)
    .bind(user)
    .bind(role)
    .fetch_one(db)
    .await
}

/// True when the member was removed. A member who leaves the team they chose as their
/// default forgets that choice (joining again later does not make it their default).
pub async fn remove_member(
    db: impl PgExecutor<'_>,
    team: Uuid,
    user: Uuid,
) -> Result<bool, sqlx::Error> {
    let removed: i64 = sqlx::query_scalar(
        "WITH gone AS (
             DELETE FROM team_members WHERE team_id = $1 AND user_id = $2 RETURNING user_id
         ), cleared AS (
             UPDATE users SET default_team_id = NULL
             WHERE id IN (SELECT user_id FROM gone) AND default_team_id = $1
         )
         SELECT count(*) FROM gone",
    )
    .bind(team)
    .bind(user)
    .fetch_one(db)
    .await?;
    Ok(removed == 1)
}

pub async fn get_user(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<UserRow>, sqlx::Error> {
    sqlx::query_as("SELECT id, email, name, is_admin, created_at FROM users WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await
}

/// A new local user; `None` when the email is taken.
pub async fn insert_user(
    db: impl PgExecutor<'_>,
    id: Uuid,
    email: &str,
    name: &str,
) -> Result<Option<UserRow>, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO users (id, email, name) VALUES ($1, $2, $3)
         ON CONFLICT (email) WHERE oidc_issuer IS NULL DO NOTHING
         RETURNING id, email, name, is_admin, created_at",
    )
    .bind(id)
    .bind(email)
    .bind(name)
    .fetch_optional(db)
    .await
}

/// Users in id order after `after`; with `email`, only those whose address is that one
/// and verified (an identity provider's unverified address never finds anyone).
pub async fn list_users(
    db: impl PgExecutor<'_>,
    email: Option<&str>,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<UserRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, email, name, is_admin, created_at FROM users
         WHERE ($1::text IS NULL OR (lower(email) = lower($1) AND email_verified))
           AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3",
    )
    .bind(email)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}
