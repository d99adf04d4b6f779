//! Projects: a team registers a git repository on the server's disk.

use std::path::Path;

use actix_web::http::StatusCode;

use crate::api::error::{ApiError, ApiResult};
use crate::api::projects::{CreateProject, Project};
use crate::auth::{Principal, Role};
use crate::domain::ProjectId;
use crate::git::{self, GitError};
use crate::server::AppState;
use crate::store;

pub fn validate_name(field: &str, name: &str) -> ApiResult<()> {
    if name.trim().is_empty() || name.len() > 100 || name.chars().any(char::is_control) {
        return Err(ApiError::validation(
            field,
            "must be 1 to 100 characters, without control characters",
        ));
    }
    Ok(())
}

pub async fn create(
    state: &AppState,
    principal: &Principal,
    body: &CreateProject,
) -> ApiResult<(StatusCode, Project)> {
    validate_name("name", &body.name)?;
    let team = match body.team_id {
        Some(t) => t.uuid(),
        None => principal
            .default_team()
            .ok_or_else(|| ApiError::validation("team_id", "you belong to no team; name one"))?,
    };
    principal.require(team, Role::Member, "team")?;
    let path = Path::new(&body.repo_path);
    if !path.is_absolute() {
        return Err(ApiError::validation(
            "repo_path",
            "must be an absolute path on the server",
        ));
    }
    if body.repo_path.split('/').any(|s| s == "..") {
        return Err(ApiError::validation("repo_path", "must not contain `..`"));
    }
    let repo = git::inspect_repo(path).await.map_err(|e| match e {
        GitError::NotARepository(_) | GitError::EmptyRepository(_) | GitError::Io(_) => {
            ApiError::validation("repo_path", e.to_string())
        }
        other => ApiError::validation("repo_path", other.to_string()),
    })?;
    if store::projects::name_taken(&state.pool, team, body.name.trim()).await? {
        return Err(ApiError::conflict(
            "project_name_taken",
            "the team already has a project with this name",
        ));
    }
    let row = store::projects::insert(
        &state.pool,
        ProjectId::new().uuid(),
        team,
        body.name.trim(),
        &repo.toplevel.to_string_lossy(),
        &repo.default_branch,
        principal.user_id,
    )
    .await?;
    Ok((StatusCode::CREATED, row.into()))
}

pub async fn get(
    state: &AppState,
    principal: &Principal,
    id: ProjectId,
) -> ApiResult<store::projects::ProjectRow> {
    let teams = principal.visible_teams();
    store::projects::get(&state.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or_else(|| ApiError::not_found("project"))
}

pub async fn delete(state: &AppState, principal: &Principal, id: ProjectId) -> ApiResult<()> {
    let row = get(state, principal, id).await?;
    principal.require(row.team_id, Role::Member, "project")?;
    if store::workspaces::active_count_for_project(&state.pool, row.id).await? > 0 {
        return Err(ApiError::conflict(
            "project_has_workspaces",
            "archive the project's workspaces before deleting it",
        ));
    }
    store::projects::mark_deleted(&state.pool, row.id).await?;
    Ok(())
}
