//! The authenticated caller: who they are, their role in each team and their token's
//! scopes. What each operation needs of them is stated in `policy`.

use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;
use utoipa::ToSchema;
use uuid::Uuid;

use super::AuthError;
use super::cache::{Entry, TokenCache, TokenHash};
use super::tokens;
use crate::store::{self, DeadlinePool};

/// A role in a team, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Viewer,
    Member,
    Owner,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Member => "member",
            Role::Owner => "owner",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "viewer" => Some(Role::Viewer),
            "member" => Some(Role::Member),
            "owner" => Some(Role::Owner),
            _ => None,
        }
    }
}

/// What an API token may be limited to. A token without scopes has all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every read and both event streams.
    Read,
    /// `Read`, plus creating and driving workspaces and agents, and answering permissions.
    Agents,
    /// Everything the token's principal may do.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Agents, Scope::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Agents => "agents",
            Scope::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s)
    }

    fn grants(self, access: Access) -> bool {
        match self {
            Scope::Admin => true,
            Scope::Agents => matches!(access, Access::Read | Access::Drive),
            Scope::Read => access == Access::Read,
        }
    }
}

/// What an operation asks of the token's scopes (each `policy::Operation` has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reading anything, including the event streams.
    Read,
    /// Creating and driving workspaces and agents, answering permission requests.
    Drive,
    /// Everything else: projects, tokens.
    Manage,
}

impl Access {
    /// The narrowest scope that allows this access.
    fn needs(self) -> Scope {
        match self {
            Access::Read => Scope::Read,
            Access::Drive => Scope::Agents,
            Access::Manage => Scope::Admin,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Membership {
    pub team_id: Uuid,
    pub team_name: String,
    pub role: Role,
}

#[derive(Debug, Clone)]
pub struct Principal {
    pub user_id: Uuid,
    pub email: String,
    pub name: String,
    /// A server admin sees and may act on every team.
    pub is_admin: bool,
    pub token_id: Uuid,
    /// Set for a team service token: it acts only in that team, with that role.
    pub service_team: Option<Uuid>,
    pub teams: Vec<Membership>,
    /// The scopes the token was issued with, as stored; empty means every scope.
    pub scopes: Vec<String>,
    /// The id of the request being served (`X-Request-Id`), recorded in audit entries.
    pub request_id: Option<String>,
    /// Set for an agent's own token (kind `agent`): the agent that calls. Such a token
    /// acts in its agent's team (`service_team`) with at most its creator's role and the
    /// `agents` scope, and creates workspaces and agents only in its agent's project.
    pub agent: Option<AgentCaller>,
}

/// The agent behind an agent token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentCaller {
    pub agent_id: Uuid,
    pub project_id: Uuid,
}

/// Who acted, as the audit log records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActorKind {
    User,
    ServiceToken,
    Admin,
    /// An agent, through its own token; the person behind it is named in the entry.
    Agent,
}

impl ActorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ActorKind::User => "user",
            ActorKind::ServiceToken => "service_token",
            ActorKind::Admin => "admin",
            ActorKind::Agent => "agent",
        }
    }
}

impl Principal {
    /// The token's scopes allow `access`. Every service operation asks this first.
    pub fn allow(&self, access: Access) -> Result<(), AuthError> {
        if self.scopes.is_empty()
            || self
                .scopes
                .iter()
                .filter_map(|s| Scope::parse(s))
                .any(|s| s.grants(access))
        {
            return Ok(());
        }
        Err(AuthError::InsufficientScope {
            needed: access.needs().as_str(),
            granted: self.scopes.join(", "),
        })
    }

    /// Team ids whose resources the caller may see; `None` means every team.
    pub fn visible_teams(&self) -> Option<Vec<Uuid>> {
        if self.is_admin && self.service_team.is_none() {
            None
        } else {
            Some(self.teams.iter().map(|m| m.team_id).collect())
        }
    }

    pub fn role_in(&self, team: Uuid) -> Option<Role> {
        if self.is_admin && self.service_team.is_none() {
            return Some(Role::Owner);
        }
        self.teams
            .iter()
            .find(|m| m.team_id == team)
            .map(|m| m.role)
    }

    /// The caller may act in `team` with at least `min`. A team the caller cannot see is
    /// reported as a missing resource, never as forbidden.
    pub fn require(&self, team: Uuid, min: Role, what: &'static str) -> Result<(), AuthError> {
        match self.role_in(team) {
            None => Err(AuthError::NotVisible(what)),
            Some(r) if r < min => Err(AuthError::RoleTooLow {
                needed: min.as_str(),
                actual: r.as_str(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// The team new resources go to when the request names none: a service token's team;
    /// for a person, the default team they chose, else the team they joined first (never
    /// one they were added to later, whatever its name). `teams` is read in that order —
    /// the default first, then by when they joined (`store::identity::memberships`,
    /// `bearer_by_hash`) — so it is the first membership.
    pub fn default_team(&self) -> Option<Uuid> {
        self.service_team
            .or_else(|| self.teams.first().map(|m| m.team_id))
    }

    /// How the audit log names this caller: a service token by its token id, a person
    /// (or the server admin) by their user id.
    pub fn actor(&self) -> (ActorKind, Uuid) {
        if let Some(agent) = self.agent {
            (ActorKind::Agent, agent.agent_id)
        } else if self.service_team.is_some() {
            (ActorKind::ServiceToken, self.token_id)
        } else if self.is_admin {
            (ActorKind::Admin, self.user_id)
        } else {
            (ActorKind::User, self.user_id)
        }
    }

    /// Identity used to scope idempotency keys.
    pub fn idempotency_scope(&self) -> String {
        format!(
            "{}:{}",
            self.user_id,
            self.service_team.map(|t| t.to_string()).unwrap_or_default()
        )
    }
}

/// Resolve a bearer token to a principal, every lookup within the pool's deadline, from
/// `cache` when it holds the token. Its last use is recorded in the background on
/// `runtime`, at most once a minute.
pub async fn authenticate(
    pool: &DeadlinePool,
    runtime: &Handle,
    cache: &Arc<TokenCache>,
    token: &str,
) -> Result<Principal, AuthError> {
    if !tokens::well_formed(token) {
        return Err(AuthError::TokenMalformed(
            "this is not an agentry API token",
        ));
    }
    let hash: TokenHash = tokens::hash(token);
    let entry = match cache.get(&hash) {
        Some(entry) => entry,
        None => {
            let generation = cache.generation();
            let entry = read(pool, &hash).await?;
            cache.keep(hash, entry.clone(), generation);
            entry
        }
    };
    if entry.expires_at.is_some_and(|t| t <= Utc::now()) {
        return Err(AuthError::TokenExpired);
    }
    // Its last use is recorded at most once a minute (`touch_token`): a token seen within
    // the minute costs no statement.
    let now = Utc::now();
    let recently = entry
        .used_at
        .is_some_and(|t| now - t < chrono::TimeDelta::minutes(1));
    if !recently {
        cache.used(&hash, now);
        let touch = pool.clone();
        let token_id = entry.principal.token_id;
        runtime.spawn(async move {
            if let Err(e) = store::identity::touch_token(&touch, token_id).await {
                tracing::debug!(error = %e, "could not record token use");
            }
        });
    }
    Ok(entry.principal)
}

/// The principal of the token whose hash is `hash`, as stored now.
async fn read(pool: &DeadlinePool, hash: &TokenHash) -> Result<Entry, AuthError> {
    let store::identity::BearerRow {
        token,
        email,
        user_name,
        is_admin,
        service_team_name,
        member_team_ids,
        member_team_names,
        member_roles,
        agent_id,
        agent_project_id,
        agent_archived,
    } = store::identity::bearer_by_hash(pool, hash)
        .await?
        .ok_or(AuthError::TokenUnknown)?;
    if token.revoked_at.is_some() {
        return Err(AuthError::TokenRevoked("this token was revoked"));
    }
    let (Some(email), Some(name), Some(is_admin)) = (email, user_name, is_admin) else {
        return Err(AuthError::TokenRevoked("the token's user no longer exists"));
    };
    // An agent's token acts with at most the role its creator has in the team now: one
    // who left the team (and is no server admin) leaves the agent's token powerless.
    let agent = match (agent_id, agent_project_id) {
        (Some(agent_id), Some(project_id)) => {
            if agent_archived.unwrap_or(true) {
                return Err(AuthError::TokenRevoked("the token's agent is archived"));
            }
            Some(AgentCaller {
                agent_id,
                project_id,
            })
        }
        (Some(_), None) => return Err(AuthError::TokenRevoked("the token's agent is gone")),
        _ => None,
    };
    let creator_role = |team: Uuid| {
        member_team_ids
            .iter()
            .zip(&member_roles)
            .find(|(t, _)| **t == team)
            .and_then(|(_, r)| Role::parse(r))
    };
    let token_role = match (
        agent,
        token.team_id,
        token.role.as_deref().and_then(Role::parse),
    ) {
        (Some(_), Some(team), Some(role)) => match creator_role(team) {
            Some(now) => Some(role.min(now)),
            None if is_admin => Some(role),
            None => {
                return Err(AuthError::TokenRevoked(
                    "the agent's creator is no longer in its team",
                ));
            }
        },
        (_, _, role) => role,
    };
    let teams = match (token.team_id, token_role) {
        (Some(team_id), Some(role)) => vec![Membership {
            team_id,
            team_name: service_team_name.unwrap_or_default(),
            role,
        }],
        _ => member_team_ids
            .into_iter()
            .zip(member_team_names)
            .zip(member_roles)
            .filter_map(|((team_id, team_name), role)| {
                Role::parse(&role).map(|role| Membership {
                    team_id,
                    team_name,
                    role,
                })
            })
            .collect(),
    };
    Ok(Entry {
        principal: Principal {
            user_id: token.user_id,
            email,
            name,
            is_admin,
            token_id: token.id,
            service_team: token.team_id,
            teams,
            scopes: token.scopes,
            request_id: None,
            agent,
        },
        expires_at: token.expires_at,
        used_at: token.last_used_at,
        stored: Instant::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_scopes(scopes: &[&str]) -> Principal {
        Principal {
            user_id: Uuid::nil(),
            email: String::new(),
            name: String::new(),
            is_admin: false,
            token_id: Uuid::nil(),
            service_team: None,
            teams: Vec::new(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            request_id: None,
            agent: None,
        }
    }

    #[test]
    fn scopes_nest_read_agents_admin() {
        let all = [Access::Read, Access::Drive, Access::Manage];
        let allowed = |p: &Principal| all.map(|a| p.allow(a).is_ok());
        assert_eq!(allowed(&with_scopes(&[])), [true, true, true]);
        assert_eq!(allowed(&with_scopes(&["read"])), [true, false, false]);
        assert_eq!(allowed(&with_scopes(&["agents"])), [true, true, false]);
        assert_eq!(allowed(&with_scopes(&["admin"])), [true, true, true]);
        assert_eq!(allowed(&with_scopes(&["bogus"])), [false, false, false]);
        let e = with_scopes(&["read"]).allow(Access::Drive).unwrap_err();
        assert_eq!(e.code(), "insufficient_scope");
    }
}
