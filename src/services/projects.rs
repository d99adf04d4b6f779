//! Projects: a team registers a git repository on the server's disk.

use std::path::Path;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use serde_json::json;

use super::audit::{self, Action, Entry};
use super::{ServiceContext, ServiceError, ServiceResult, within_deadline};
use crate::auth::{Operation, Principal};
use crate::domain::{ProjectId, TeamId};
use crate::git::{self, GitError};
use crate::store;

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "webapp", "repo_path": "/srv/git/webapp"}))]
pub struct CreateProject {
    pub name: String,
    /// Defaults to your team when you belong to one.
    pub team_id: Option<TeamId>,
    /// Absolute path of a git repository the server can read.
    pub repo_path: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "webapp",
    "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "repo_path": "/srv/git/webapp",
    "default_branch": "main", "created_at": "2026-11-30T12:00:00Z"}))]
pub struct Project {
    pub id: ProjectId,
    pub name: String,
    pub team_id: TeamId,
    pub repo_path: String,
    pub default_branch: String,
    pub created_at: DateTime<Utc>,
}

impl From<store::projects::ProjectRow> for Project {
    fn from(r: store::projects::ProjectRow) -> Self {
        Self {
            id: r.id.into(),
            name: r.name,
            team_id: r.team_id.into(),
            repo_path: r.repo_path,
            default_branch: r.default_branch,
            created_at: r.created_at,
        }
    }
}

pub fn validate_name(field: &'static str, name: &str) -> ServiceResult<()> {
    if name.trim().is_empty() || name.len() > 100 || name.chars().any(char::is_control) {
        return Err(ServiceError::invalid(
            field,
            "must be 1 to 100 characters, without control characters",
        ));
    }
    Ok(())
}

pub async fn create(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateProject,
) -> ServiceResult<Project> {
    principal.authorize(Operation::ManageTeam)?;
    validate_name("name", &body.name)?;
    let team = match body.team_id {
        Some(t) => t.uuid(),
        None => principal
            .default_team()
            .ok_or_else(|| ServiceError::invalid("team_id", "you belong to no team; name one"))?,
    };
    principal.authorize_in(team, Operation::ManageTeam, "team")?;
    // An admin may name any team id: one that does not exist is a missing resource.
    if store::identity::team_name(&ctx.pool, team).await?.is_none() {
        return Err(ServiceError::NotFound("team"));
    }
    super::bounds::check_count(
        store::bounds::live_projects(&ctx.pool, team).await?,
        ctx.limits.max_projects_per_team,
        "limits.max_projects_per_team",
    )?;
    let path = Path::new(&body.repo_path);
    if !path.is_absolute() {
        return Err(ServiceError::invalid(
            "repo_path",
            "must be an absolute path on the server",
        ));
    }
    if body.repo_path.split('/').any(|s| s == "..") {
        return Err(ServiceError::invalid("repo_path", "must not contain `..`"));
    }
    let repo = git::inspect_repo(path).await.map_err(|e| match e {
        GitError::NotARepository(_) | GitError::EmptyRepository(_) | GitError::Io(_) => {
            ServiceError::invalid("repo_path", e.to_string())
        }
        other => ServiceError::invalid("repo_path", other.to_string()),
    })?;
    if store::projects::name_taken(&ctx.pool, team, body.name.trim()).await? {
        return Err(ServiceError::ProjectNameTaken);
    }
    let id = ProjectId::new();
    let row = within_deadline(ctx, async {
        let mut tx = ctx.pool.pool().begin().await?;
        let row = store::projects::insert(
            &mut *tx,
            id.uuid(),
            team,
            body.name.trim(),
            &repo.toplevel.to_string_lossy(),
            &repo.default_branch,
            principal.user_id,
        )
        .await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::ProjectCreate, Some(team), "project", id)
                .details(json!({"name": row.name, "repo_path": row.repo_path})),
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    })
    .await?;
    Ok(row.into())
}

/// A page of the projects of the caller's teams, after `after`.
pub async fn list(
    ctx: &ServiceContext,
    principal: &Principal,
    after: Option<ProjectId>,
    limit: i64,
) -> ServiceResult<Vec<Project>> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams();
    let rows =
        store::projects::list(&ctx.pool, teams.as_deref(), after.map(|p| p.uuid()), limit).await?;
    Ok(rows.into_iter().map(Project::from).collect())
}

pub async fn get(
    ctx: &ServiceContext,
    principal: &Principal,
    id: ProjectId,
) -> ServiceResult<Project> {
    Ok(find(ctx, principal, id).await?.into())
}

/// The project's row, when the caller may see it.
pub(crate) async fn find(
    ctx: &ServiceContext,
    principal: &Principal,
    id: ProjectId,
) -> ServiceResult<store::projects::ProjectRow> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams();
    store::projects::get(&ctx.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or(ServiceError::NotFound("project"))
}

pub async fn delete(
    ctx: &ServiceContext,
    principal: &Principal,
    id: ProjectId,
) -> ServiceResult<()> {
    principal.authorize(Operation::ManageTeam)?;
    let row = find(ctx, principal, id).await?;
    principal.authorize_in(row.team_id, Operation::ManageTeam, "project")?;
    if store::workspaces::active_count_for_project(&ctx.pool, row.id).await? > 0 {
        return Err(ServiceError::ProjectHasWorkspaces);
    }
    within_deadline(ctx, async {
        let mut tx = ctx.pool.pool().begin().await?;
        store::projects::mark_deleted(&mut *tx, row.id).await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::ProjectDelete, Some(row.team_id), "project", id)
                .details(json!({"name": row.name})),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    })
    .await
}
