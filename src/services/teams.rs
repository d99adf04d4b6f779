//! Teams and their members: any person creates a team and becomes its owner; owners add
//! members, change roles and remove members; a member may leave. A team always keeps an
//! owner: the last one can be neither removed nor demoted. Membership changes of one team
//! run one at a time (the team's row is locked), each with its audit entry in the same
//! transaction.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::audit::{self, Action, Entry};
use super::{Access, Data, ServiceError, ServiceResult, within_deadline};
use crate::auth::{AuthError, Operation, Principal, Role};
use crate::domain::{TeamId, UserId};
use crate::store;

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "platform"}))]
pub struct CreateTeam {
    pub name: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "platform", "role": "owner",
    "created_at": "2026-11-30T12:00:00Z", "require_sandbox": false}))]
pub struct Team {
    pub id: TeamId,
    pub name: String,
    /// Your role in the team; null for a server admin who is not a member.
    pub role: Option<Role>,
    pub created_at: DateTime<Utc>,
    /// The team's agents must run sandboxed: where the server's sandbox is off or
    /// unavailable, creating or prompting one is refused (409 `sandbox_required`).
    #[serde(default)]
    pub require_sandbox: bool,
}

/// Whether the team's agents must run sandboxed.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"require_sandbox": true}))]
pub struct TeamSandbox {
    pub require_sandbox: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"user_id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "email": "ana@example.com",
    "name": "Ana", "role": "member", "added_at": "2026-11-30T12:00:00Z"}))]
pub struct Member {
    pub user_id: UserId,
    pub email: String,
    pub name: String,
    pub role: Role,
    pub added_at: DateTime<Utc>,
}

/// A team with its members.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "platform", "role": "owner",
    "created_at": "2026-11-30T12:00:00Z", "require_sandbox": false,
    "members": [{"user_id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
    "email": "ana@example.com", "name": "Ana", "role": "owner", "added_at": "2026-11-30T12:00:00Z"}],
    "more_members": false}))]
pub struct TeamDetail {
    pub id: TeamId,
    pub name: String,
    pub role: Option<Role>,
    pub created_at: DateTime<Utc>,
    /// The team's agents must run sandboxed (see `Team`).
    pub require_sandbox: bool,
    /// The first `MEMBERS_SHOWN` members; page through `/members` for all of them.
    pub members: Vec<Member>,
    /// More members than shown here.
    pub more_members: bool,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"role": "member"}))]
pub struct MemberRole {
    pub role: Role,
}

/// Whether `set_member` added someone or changed their role.
pub enum MemberChange {
    Added(Member),
    Changed(Member),
}

/// How many members `get` shows.
pub const MEMBERS_SHOWN: i64 = 200;

fn member(r: store::teams::MemberRow) -> Member {
    Member {
        user_id: r.user_id.into(),
        email: r.email,
        name: r.name,
        role: Role::parse(&r.role).unwrap_or(Role::Viewer),
        added_at: r.created_at,
    }
}

fn team(principal: &Principal, r: store::teams::TeamRow) -> Team {
    Team {
        id: r.id.into(),
        name: r.name,
        role: principal
            .teams
            .iter()
            .find(|m| m.team_id == r.id)
            .map(|m| m.role),
        created_at: r.created_at,
        require_sandbox: r.require_sandbox,
    }
}

/// A new team with the caller as its owner. The names `[auth.oidc.groups]` gives its
/// teams are reserved (409 `team_name_reserved`).
#[tracing::instrument(name = "services::teams::create", skip_all)]
pub async fn create(
    data: &Data,
    access: &Access,
    principal: &Principal,
    body: &CreateTeam,
) -> ServiceResult<Team> {
    principal.authorize(Operation::ManageSelf)?;
    if principal.service_team.is_some() {
        return Err(AuthError::Forbidden("a service token cannot create teams").into());
    }
    let name = body.name.trim();
    super::projects::validate_name("name", name)?;
    // A team people make never becomes a mapped team; its name cannot pose as one.
    if let Some(idp) = &access.oidc
        && crate::auth::oidc::reserved_team_names(idp.settings())
            .any(|r| r.eq_ignore_ascii_case(name))
    {
        return Err(ServiceError::TeamNameReserved);
    }
    let id = TeamId::new().uuid();
    within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        if !store::teams::insert(&mut *tx, id, name).await? {
            return Err(ServiceError::TeamNameTaken);
        }
        store::teams::set_member(&mut *tx, id, principal.user_id, Role::Owner.as_str()).await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::TeamCreate, Some(id), "team", TeamId::from(id))
                .details(json!({"name": name})),
        )
        .await?;
        tx.commit().await?;
        // This replica forgets the principals it holds now, not at the notification.
        access.tokens.forget_all();
        Ok(())
    })
    .await?;
    let row = store::teams::get(&data.pool, id)
        .await?
        .ok_or(ServiceError::NotFound("team"))?;
    Ok(Team {
        role: Some(Role::Owner),
        ..team(principal, row)
    })
}

/// A page of the caller's teams (a server admin: every team), with the caller's role.
#[tracing::instrument(name = "services::teams::list", skip_all)]
pub async fn list(
    data: &Data,
    principal: &Principal,
    after: Option<TeamId>,
    limit: i64,
) -> ServiceResult<Vec<Team>> {
    principal.authorize(Operation::ReadSelf)?;
    let teams = principal.visible_teams();
    let rows =
        store::teams::list(&data.pool, teams.as_deref(), after.map(|t| t.uuid()), limit).await?;
    Ok(rows.into_iter().map(|r| team(principal, r)).collect())
}

/// The team's row, when the caller may do `op` in it.
async fn find(
    data: &Data,
    principal: &Principal,
    id: TeamId,
    op: Operation,
) -> ServiceResult<store::teams::TeamRow> {
    // Visibility first: a team the caller cannot see is missing, whatever `op` needs.
    principal.authorize_in(id.uuid(), Operation::ReadTeam, "team")?;
    let row = store::teams::get(&data.pool, id.uuid())
        .await?
        .ok_or(ServiceError::NotFound("team"))?;
    principal.authorize_in(row.id, op, "team")?;
    Ok(row)
}

#[tracing::instrument(name = "services::teams::get", skip_all, fields(team_id = %id))]
pub async fn get(data: &Data, principal: &Principal, id: TeamId) -> ServiceResult<TeamDetail> {
    let row = find(data, principal, id, Operation::ReadTeam).await?;
    let mut members = store::teams::members(&data.pool, row.id, None, MEMBERS_SHOWN + 1).await?;
    let more_members = members.len() as i64 > MEMBERS_SHOWN;
    members.truncate(MEMBERS_SHOWN as usize);
    let t = team(principal, row);
    Ok(TeamDetail {
        id: t.id,
        name: t.name,
        role: t.role,
        created_at: t.created_at,
        require_sandbox: t.require_sandbox,
        members: members.into_iter().map(member).collect(),
        more_members,
    })
}

/// Require (or stop requiring) that the team's agents run sandboxed: owners only,
/// audited as `team.sandbox` in the same transaction. The answer is the team.
#[tracing::instrument(name = "services::teams::set_sandbox", skip_all, fields(team_id = %id))]
pub async fn set_sandbox(
    data: &Data,
    principal: &Principal,
    id: TeamId,
    body: &TeamSandbox,
) -> ServiceResult<Team> {
    find(data, principal, id, Operation::ManageTeam).await?;
    let row = within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        let row = store::teams::set_require_sandbox(&mut *tx, id.uuid(), body.require_sandbox)
            .await?
            .ok_or(ServiceError::NotFound("team"))?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::TeamSandbox, Some(row.id), "team", id)
                .details(json!({"require_sandbox": body.require_sandbox})),
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    })
    .await?;
    tracing::info!(team_id = %id, require_sandbox = row.require_sandbox, "team sandbox requirement set");
    Ok(team(principal, row))
}

/// Whether the team's agents are given agentry's own MCP server.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"agentry_mcp": false}))]
pub struct TeamAgentryMcp {
    /// True (the default): every agent of the team gets the `agentry` MCP server (with a
    /// token of its own) unless created with `"agentry_mcp": false`. False: none does,
    /// from its next launch on.
    pub agentry_mcp: bool,
}

/// Give (or stop giving) the team's agents agentry's own MCP server: owners only,
/// audited as `team.agentry_mcp`.
#[tracing::instrument(name = "services::teams::set_agentry_mcp", skip_all, fields(team_id = %id))]
pub async fn set_agentry_mcp(
    data: &Data,
    principal: &Principal,
    id: TeamId,
    body: &TeamAgentryMcp,
) -> ServiceResult<TeamAgentryMcp> {
    find(data, principal, id, Operation::ManageTeam).await?;
    let on = within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        let on = store::teams::set_agentry_mcp(&mut *tx, id.uuid(), body.agentry_mcp)
            .await?
            .ok_or(ServiceError::NotFound("team"))?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::TeamAgentryMcp, Some(id.uuid()), "team", id)
                .details(json!({"agentry_mcp": on})),
        )
        .await?;
        tx.commit().await?;
        Ok(on)
    })
    .await?;
    Ok(TeamAgentryMcp { agentry_mcp: on })
}

/// Whether the team's agents are given agentry's own MCP server (any member).
#[tracing::instrument(name = "services::teams::agentry_mcp", skip_all, fields(team_id = %id))]
pub async fn agentry_mcp(
    data: &Data,
    principal: &Principal,
    id: TeamId,
) -> ServiceResult<TeamAgentryMcp> {
    find(data, principal, id, Operation::ReadTeam).await?;
    Ok(TeamAgentryMcp {
        agentry_mcp: store::teams::agentry_mcp(&data.pool, id.uuid()).await?,
    })
}

/// A page of the team's members, by user id.
#[tracing::instrument(name = "services::teams::members", skip_all, fields(team_id = %id))]
pub async fn members(
    data: &Data,
    principal: &Principal,
    id: TeamId,
    after: Option<UserId>,
    limit: i64,
) -> ServiceResult<Vec<Member>> {
    let row = find(data, principal, id, Operation::ReadTeam).await?;
    let rows = store::teams::members(&data.pool, row.id, after.map(|u| u.uuid()), limit).await?;
    Ok(rows.into_iter().map(member).collect())
}

/// Add `user` to the team with `role`, or change their role (owners only). Demoting the
/// last owner is refused.
#[tracing::instrument(name = "services::teams::set_member", skip_all, fields(team_id = %id, user_id = %user))]
pub async fn set_member(
    data: &Data,
    access: &Access,
    principal: &Principal,
    id: TeamId,
    user: UserId,
    role: Role,
) -> ServiceResult<MemberChange> {
    let row = find(data, principal, id, Operation::ManageTeam).await?;
    if store::teams::get_user(&data.pool, user.uuid())
        .await?
        .is_none()
    {
        return Err(ServiceError::NotFound("user"));
    }
    let team_id = row.id;
    let added = within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        if !store::teams::lock(&mut tx, team_id).await? {
            return Err(ServiceError::NotFound("team"));
        }
        let before = store::teams::member(&mut *tx, team_id, user.uuid()).await?;
        let was = before.as_ref().and_then(|m| Role::parse(&m.role));
        if was == Some(Role::Owner)
            && role != Role::Owner
            && store::teams::owner_count(&mut *tx, team_id).await? <= 1
        {
            return Err(ServiceError::LastOwner);
        }
        let added = store::teams::set_member(&mut *tx, team_id, user.uuid(), role.as_str()).await?;
        let entry = if added {
            Entry::new(Action::MemberAdd, Some(team_id), "member", user)
                .details(json!({"role": role}))
        } else {
            Entry::new(Action::MemberRole, Some(team_id), "member", user)
                .details(json!({"role": role, "previous_role": was}))
        };
        audit::record_in(&mut *tx, principal, &entry).await?;
        tx.commit().await?;
        // This replica forgets the principals it holds now, not at the notification.
        access.tokens.forget_all();
        Ok(added)
    })
    .await?;
    let m = store::teams::member(&data.pool, team_id, user.uuid())
        .await?
        .map(member)
        .ok_or(ServiceError::NotFound("member"))?;
    Ok(if added {
        MemberChange::Added(m)
    } else {
        MemberChange::Changed(m)
    })
}

/// Remove `user` from the team: owners remove anyone, anyone may leave. The last owner
/// stays.
#[tracing::instrument(name = "services::teams::remove_member", skip_all, fields(team_id = %id, user_id = %user))]
pub async fn remove_member(
    data: &Data,
    access: &Access,
    principal: &Principal,
    id: TeamId,
    user: UserId,
) -> ServiceResult<()> {
    let leaving = principal.service_team.is_none() && user.uuid() == principal.user_id;
    let op = if leaving {
        Operation::ReadTeam
    } else {
        Operation::ManageTeam
    };
    // Leaving changes something too: the token's scopes must allow what the route needs.
    principal.allow(Operation::ManageTeam.access())?;
    let row = find(data, principal, id, op).await?;
    let team_id = row.id;
    within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        if !store::teams::lock(&mut tx, team_id).await? {
            return Err(ServiceError::NotFound("team"));
        }
        let Some(before) = store::teams::member(&mut *tx, team_id, user.uuid()).await? else {
            return Err(ServiceError::NotFound("member"));
        };
        if before.role == Role::Owner.as_str()
            && store::teams::owner_count(&mut *tx, team_id).await? <= 1
        {
            return Err(ServiceError::LastOwner);
        }
        store::teams::remove_member(&mut *tx, team_id, user.uuid()).await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::MemberRemove, Some(team_id), "member", user)
                .details(json!({"role": before.role, "left": leaving})),
        )
        .await?;
        tx.commit().await?;
        // This replica forgets the principals it holds now, not at the notification.
        access.tokens.forget_all();
        Ok(())
    })
    .await
}
