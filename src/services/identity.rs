//! The caller's identity and API tokens: who am I, create (shown once), list, revoke.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Access, AuthError, Principal, Role, Scope, tokens};
use crate::domain::{TeamId, TokenId, UserId};
use crate::store;

#[derive(Debug, Serialize, ToSchema)]
pub struct TeamRef {
    pub id: TeamId,
    pub name: String,
    pub role: Role,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "email": "admin@localhost", "name": "Local admin",
    "is_admin": true, "teams": [{"id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "name": "default", "role": "owner"}]}))]
pub struct Me {
    pub id: UserId,
    pub email: String,
    pub name: String,
    pub is_admin: bool,
    pub teams: Vec<TeamRef>,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "ci-bot", "expires_in_days": 90}))]
pub struct CreateToken {
    pub name: String,
    /// Days until the token expires (default: never).
    pub expires_in_days: Option<u32>,
    /// Make a team service token acting in this team.
    pub team_id: Option<TeamId>,
    /// The role of a team service token (default `member`, never above your own).
    pub role: Option<Role>,
    #[serde(default)]
    pub scopes: Vec<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "tok_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "ci-bot",
    "token": "agt_pat_3f1c…", "prefix": "agt_pat_3f1c", "expires_at": null}))]
pub struct CreatedToken {
    pub id: TokenId,
    pub name: String,
    /// The secret. Shown only in this response: store it now.
    pub token: String,
    pub prefix: String,
    pub expires_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenInfo {
    pub id: TokenId,
    pub name: String,
    pub prefix: String,
    pub team_id: Option<TeamId>,
    pub role: Option<String>,
    pub scopes: Vec<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
}

pub fn me(principal: &Principal) -> ServiceResult<Me> {
    principal.allow(Access::Read)?;
    Ok(Me {
        id: principal.user_id.into(),
        email: principal.email.clone(),
        name: principal.name.clone(),
        is_admin: principal.is_admin,
        teams: principal
            .teams
            .iter()
            .map(|m| TeamRef {
                id: m.team_id.into(),
                name: m.team_name.clone(),
                role: m.role,
            })
            .collect(),
    })
}

pub async fn create_token(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateToken,
) -> ServiceResult<CreatedToken> {
    principal.allow(Access::Manage)?;
    let name = body.name.trim();
    if name.is_empty() || name.len() > 100 {
        return Err(ServiceError::invalid("name", "must be 1 to 100 characters"));
    }
    if let Some(d) = body.expires_in_days
        && !(1..=3650).contains(&d)
    {
        return Err(ServiceError::invalid(
            "expires_in_days",
            "must be between 1 and 3650",
        ));
    }
    if let Some(s) = body.scopes.iter().find(|s| Scope::parse(s).is_none()) {
        return Err(ServiceError::invalid(
            "scopes",
            format!("unknown scope `{s}`; scopes are read, agents and admin"),
        ));
    }
    let (team, role) = match body.team_id {
        Some(team) => {
            principal.require(team.uuid(), Role::Owner, "team")?;
            // An admin may name any team id: one that does not exist is a missing resource.
            if store::identity::team_name(&ctx.pool, team.uuid())
                .await?
                .is_none()
            {
                return Err(ServiceError::NotFound("team"));
            }
            let role = body.role.unwrap_or(Role::Member);
            if principal
                .role_in(team.uuid())
                .is_some_and(|mine| role > mine)
            {
                return Err(AuthError::Forbidden(
                    "a service token cannot have a higher role than yours",
                )
                .into());
            }
            (Some(team.uuid()), Some(role))
        }
        None if body.role.is_some() => {
            return Err(ServiceError::invalid(
                "role",
                "only a team service token has a role",
            ));
        }
        None => (principal.service_team, None),
    };
    let token = tokens::generate();
    let expires_at = body
        .expires_in_days
        .map(|d| Utc::now() + Duration::days(i64::from(d)));
    let row = store::identity::insert_token(
        &ctx.pool,
        uuid::Uuid::now_v7(),
        principal.user_id,
        team,
        role.map(Role::as_str),
        name,
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &body.scopes,
        expires_at,
    )
    .await?;
    Ok(CreatedToken {
        id: row.id.into(),
        name: row.name,
        token,
        prefix: row.prefix,
        expires_at: row.expires_at,
    })
}

/// A page of the caller's own tokens (never their secrets).
pub async fn list_tokens(
    ctx: &ServiceContext,
    principal: &Principal,
    after: Option<TokenId>,
    limit: i64,
) -> ServiceResult<Vec<TokenInfo>> {
    principal.allow(Access::Read)?;
    let rows =
        store::identity::list_tokens(&ctx.pool, principal.user_id, after.map(|t| t.uuid()), limit)
            .await?;
    Ok(rows
        .into_iter()
        .map(|r| TokenInfo {
            id: r.id.into(),
            name: r.name,
            prefix: r.prefix,
            team_id: r.team_id.map(Into::into),
            role: r.role,
            scopes: r.scopes,
            created_at: r.created_at,
            expires_at: r.expires_at,
            last_used_at: r.last_used_at,
        })
        .collect())
}

/// Revoke one of the caller's tokens (an admin: anyone's); it fails from now on.
pub async fn revoke_token(
    ctx: &ServiceContext,
    principal: &Principal,
    id: TokenId,
) -> ServiceResult<()> {
    principal.allow(Access::Manage)?;
    let owner = if principal.is_admin {
        None
    } else {
        Some(principal.user_id)
    };
    if !store::identity::revoke_token(&ctx.pool, id.uuid(), owner).await? {
        return Err(ServiceError::NotFound("token"));
    }
    Ok(())
}
