//! The caller's identity and API tokens: who am I, create (shown once; a server admin may
//! issue one for another user), list, revoke. Creating and revoking are audited.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::audit::{self, Action, Entry};
use super::{Access, Data, ServiceError, ServiceResult, within_deadline};
use crate::auth::{AuthError, Operation, Principal, Role, Scope, tokens};
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
    "is_admin": true, "default_team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
    "teams": [{"id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "name": "default", "role": "owner"}]}))]
pub struct Me {
    pub id: UserId,
    pub email: String,
    pub name: String,
    pub is_admin: bool,
    /// Where new projects, hooks and other resources go when a request names no team:
    /// the team you chose (`PUT /v1/me/default-team`), else the one you joined first. A
    /// service token's is its team.
    pub default_team_id: Option<TeamId>,
    /// Your teams, the default first, then in the order you joined them.
    pub teams: Vec<TeamRef>,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c"}))]
pub struct DefaultTeam {
    /// A team you are a member of.
    pub team_id: TeamId,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "ci-bot", "expires_in_days": 90}))]
pub struct CreateToken {
    pub name: String,
    /// Days until the token expires (default: never). A personal token of a user of the
    /// identity provider lives at most `auth.oidc.max_token_days` (and that long by default).
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
    principal.authorize(Operation::ReadSelf)?;
    Ok(Me {
        id: principal.user_id.into(),
        email: principal.email.clone(),
        name: principal.name.clone(),
        is_admin: principal.is_admin,
        default_team_id: principal.default_team().map(Into::into),
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

/// Choose the team new resources go to when a request names none; it must be one of
/// your teams (a team you are not in is a missing resource). Being added to a team never
/// changes it.
#[tracing::instrument(name = "services::identity::set_default_team", skip_all)]
pub async fn set_default_team(
    data: &Data,
    access: &Access,
    principal: &Principal,
    body: &DefaultTeam,
) -> ServiceResult<Me> {
    principal.authorize(Operation::ManageSelf)?;
    if principal.service_team.is_some() {
        return Err(AuthError::Forbidden("a service token's team is its default team").into());
    }
    let team = body.team_id.uuid();
    if !principal.teams.iter().any(|m| m.team_id == team) {
        return Err(ServiceError::NotFound("team"));
    }
    let set = within_deadline(data, async {
        Ok(store::identity::set_default_team(&data.pool, principal.user_id, team).await?)
    })
    .await?;
    if !set {
        return Err(ServiceError::NotFound("team"));
    }
    // This replica forgets the principals it holds now, not at the notification.
    access.tokens.forget_all();
    let mut teams = principal.teams.clone();
    if let Some(i) = teams.iter().position(|m| m.team_id == team) {
        let chosen = teams.remove(i);
        teams.insert(0, chosen);
    }
    me(&Principal {
        teams,
        ..principal.clone()
    })
}

#[tracing::instrument(name = "services::identity::create_token", skip_all)]
pub async fn create_token(
    data: &Data,
    access: &Access,
    principal: &Principal,
    body: &CreateToken,
) -> ServiceResult<CreatedToken> {
    principal.authorize(Operation::ManageSelf)?;
    check_token_request(body)?;
    // A service token acts only in its team: what it creates is a token of that team.
    let team = body.team_id.map(|t| t.uuid()).or(principal.service_team);
    let (team, role) = match team {
        Some(team) => {
            principal.authorize_in(team, Operation::ManageTeam, "team")?;
            // An admin may name any team id: one that does not exist is a missing resource.
            if store::identity::team_name(&data.pool, team)
                .await?
                .is_none()
            {
                return Err(ServiceError::NotFound("team"));
            }
            let role = body.role.unwrap_or(Role::Member);
            if principal.role_in(team).is_some_and(|mine| role > mine) {
                return Err(AuthError::Forbidden(
                    "a service token cannot have a higher role than yours",
                )
                .into());
            }
            (Some(team), Some(role))
        }
        None if body.role.is_some() => {
            return Err(ServiceError::invalid(
                "role",
                "only a team service token has a role",
            ));
        }
        None => (None, None),
    };
    issue_token(data, access, principal, principal.user_id, team, role, body).await
}

/// A personal token for another user, issued by a server admin (in local mode, this is
/// how the people of a team get their first token).
#[tracing::instrument(name = "services::identity::create_user_token", skip_all, fields(user_id = %user))]
pub async fn create_user_token(
    data: &Data,
    access: &Access,
    principal: &Principal,
    user: UserId,
    body: &CreateToken,
) -> ServiceResult<CreatedToken> {
    principal.authorize(Operation::AdministerServer)?;
    check_token_request(body)?;
    if body.team_id.is_some() || body.role.is_some() {
        return Err(ServiceError::invalid(
            "team_id",
            "a user's token is personal; team service tokens are made with POST /v1/tokens",
        ));
    }
    if store::identity::get_user(&data.pool, user.uuid())
        .await?
        .is_none()
    {
        return Err(ServiceError::NotFound("user"));
    }
    issue_token(data, access, principal, user.uuid(), None, None, body).await
}

/// Whether the request is acceptable; its name is taken trimmed.
fn check_token_request(body: &CreateToken) -> ServiceResult<()> {
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
    Ok(())
}

/// The lifetime of a new token: a personal token of an identity provider's user lives at
/// most `auth.oidc.max_token_days` (that long when none is asked for), so it does not
/// outlast for long what the provider says of its user; other tokens as asked.
async fn lifetime_days(
    data: &Data,
    access: &Access,
    user: uuid::Uuid,
    team: Option<uuid::Uuid>,
    asked: Option<u32>,
) -> ServiceResult<Option<u32>> {
    let Some(idp) = &access.oidc else {
        return Ok(asked);
    };
    if team.is_some() || !store::identity::is_idp_user(&data.pool, user).await? {
        return Ok(asked);
    }
    let max = idp.settings().max_token_days;
    match asked {
        Some(d) if d > max => Err(ServiceError::invalid(
            "expires_in_days",
            format!("a personal token of a sign-in user lives at most {max} days"),
        )),
        Some(d) => Ok(Some(d)),
        None => Ok(Some(max)),
    }
}

/// Store a new token of `user` (its hash, never the secret) with its audit entry; `body`
/// passed `check_token_request`.
async fn issue_token(
    data: &Data,
    access: &Access,
    principal: &Principal,
    user: uuid::Uuid,
    team: Option<uuid::Uuid>,
    role: Option<Role>,
    body: &CreateToken,
) -> ServiceResult<CreatedToken> {
    let name = body.name.trim();
    let days = lifetime_days(data, access, user, team, body.expires_in_days).await?;
    let token = tokens::generate();
    let expires_at = days.map(|d| Utc::now() + Duration::days(i64::from(d)));
    let id = TokenId::new();
    let row = within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        let row = store::identity::insert_token(
            &mut *tx,
            id.uuid(),
            user,
            team,
            role.map(Role::as_str),
            name,
            &tokens::shown_prefix(&token),
            &tokens::hash(&token),
            &body.scopes,
            expires_at,
        )
        .await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::TokenCreate, team, "token", id).details(json!({
                "name": name,
                "user_id": UserId::from(user),
                "role": role,
                "scopes": body.scopes,
                "expires_at": expires_at,
            })),
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    })
    .await?;
    Ok(CreatedToken {
        id: row.id.into(),
        name: row.name,
        token,
        prefix: row.prefix,
        expires_at: row.expires_at,
    })
}

/// A page of the caller's own tokens (never their secrets); for a team service token,
/// only the tokens of its team made by the same person.
#[tracing::instrument(name = "services::identity::list_tokens", skip_all, fields(team_id = ?team))]
pub async fn list_tokens(
    data: &Data,
    principal: &Principal,
    team: Option<TeamId>,
    after: Option<TokenId>,
    limit: i64,
) -> ServiceResult<Vec<TokenInfo>> {
    principal.authorize(Operation::ReadSelf)?;
    let after = after.map(|t| t.uuid());
    let rows = match team {
        // The bots acting in a team are visible to its members (never their secrets);
        // its owners revoke them.
        Some(team) => {
            principal.authorize_in(team.uuid(), Operation::ReadTeam, "team")?;
            store::identity::list_team_tokens(&data.pool, team.uuid(), after, limit).await?
        }
        None => {
            store::identity::list_tokens(
                &data.pool,
                principal.user_id,
                principal.service_team,
                after,
                limit,
            )
            .await?
        }
    };
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

/// Revoke a token: your own, one of a team you own (a service token), or — a server
/// admin — anyone's. It fails from the next request on.
#[tracing::instrument(name = "services::identity::revoke_token", skip_all, fields(token_id = %id))]
pub async fn revoke_token(
    data: &Data,
    access: &Access,
    principal: &Principal,
    id: TokenId,
) -> ServiceResult<()> {
    principal.authorize(Operation::ManageSelf)?;
    let row = store::identity::get_token(&data.pool, id.uuid())
        .await?
        .filter(|r| r.revoked_at.is_none())
        .ok_or(ServiceError::NotFound("token"))?;
    // A person's own tokens are theirs to revoke; a service token acts for its team only.
    let own = principal.service_team.is_none() && row.user_id == principal.user_id;
    if !principal.is_server_admin() && !own {
        match row.team_id {
            Some(team) => principal.authorize_in(team, Operation::ManageTeam, "token")?,
            None => return Err(ServiceError::NotFound("token")),
        }
    }
    within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        if !store::identity::revoke_token(&mut *tx, row.id, None).await? {
            return Err(ServiceError::NotFound("token"));
        }
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::TokenRevoke, row.team_id, "token", id)
                .details(json!({"name": row.name, "user_id": UserId::from(row.user_id)})),
        )
        .await?;
        tx.commit().await?;
        // This replica forgets the principals it holds now, not at the notification.
        access.tokens.forget_all();
        Ok(())
    })
    .await
}
