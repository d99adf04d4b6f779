//! Workspaces: a git worktree of a project on a new branch (`agentry/<slug>`, made
//! unique) under `<data_dir>/worktrees/<project>/<slug>`, or the project's own directory.
//! Only paths the database records as ours are ever removed.

use std::path::{Path, PathBuf};

use actix_web::http::StatusCode;
use serde_json::json;

use crate::api::error::{ApiError, ApiResult};
use crate::api::workspaces::{CreateWorkspace, Workspace, WorkspaceKind};
use crate::auth::{Principal, Role};
use crate::domain::{ProjectId, WorkspaceId};
use crate::events::NewTeamEvent;
use crate::git::{self, GitError};
use crate::server::AppState;
use crate::store;

fn git_error(field: &str, e: GitError) -> ApiError {
    match e {
        GitError::UnknownRevision(r) => {
            ApiError::validation(field, format!("unknown revision `{r}`"))
        }
        GitError::InvalidBranch(b) => {
            ApiError::validation(field, format!("invalid branch name `{b}`"))
        }
        GitError::BranchExists(b) => {
            ApiError::conflict("branch_exists", format!("branch `{b}` already exists"))
        }
        GitError::NotARepository(_) | GitError::EmptyRepository(_) => ApiError::conflict(
            "repository_unavailable",
            format!("the project's repository cannot be used: {e}"),
        ),
        other => ApiError::internal(other),
    }
}

fn validate_ref(field: &str, r: &str) -> ApiResult<()> {
    if r.is_empty()
        || r.len() > 250
        || r.starts_with('-')
        || r.contains("..")
        || r.chars().any(|c| c.is_control() || c == ' ')
    {
        return Err(ApiError::validation(field, "not a valid git ref"));
    }
    Ok(())
}

pub async fn create(
    state: &AppState,
    principal: &Principal,
    body: &CreateWorkspace,
) -> ApiResult<(StatusCode, Workspace)> {
    let project = crate::services::projects::get(state, principal, body.project_id).await?;
    principal.require(project.team_id, Role::Member, "project")?;
    if let Some(t) = &body.title {
        crate::services::projects::validate_name("title", t)?;
    }
    let repo = PathBuf::from(&project.repo_path);
    let base_ref = body
        .base_ref
        .clone()
        .unwrap_or_else(|| project.default_branch.clone());
    validate_ref("base_ref", &base_ref)?;
    let base_commit = git::resolve_commit(&repo, &base_ref)
        .await
        .map_err(|e| git_error("base_ref", e))?;
    let id = WorkspaceId::new();
    let row = match body.kind.unwrap_or(WorkspaceKind::Worktree) {
        WorkspaceKind::Directory => {
            if body.branch.is_some() {
                return Err(ApiError::validation(
                    "branch",
                    "a directory workspace has no branch of its own",
                ));
            }
            store::workspaces::insert(
                &state.pool,
                store::workspaces::NewWorkspace {
                    id: id.uuid(),
                    project_id: project.id,
                    team_id: project.team_id,
                    kind: "directory",
                    title: body.title.as_deref(),
                    path: &project.repo_path,
                    branch: None,
                    base_ref: Some(&base_ref),
                    base_commit: Some(&base_commit),
                    created_by: principal.user_id,
                },
            )
            .await?
        }
        WorkspaceKind::Worktree => {
            let (branch, path) = add_worktree(state, &repo, project.id, body, &base_commit).await?;
            let inserted = store::workspaces::insert(
                &state.pool,
                store::workspaces::NewWorkspace {
                    id: id.uuid(),
                    project_id: project.id,
                    team_id: project.team_id,
                    kind: "worktree",
                    title: body.title.as_deref(),
                    path: &path.to_string_lossy(),
                    branch: Some(&branch),
                    base_ref: Some(&base_ref),
                    base_commit: Some(&base_commit),
                    created_by: principal.user_id,
                },
            )
            .await;
            match inserted {
                Ok(row) => row,
                Err(e) => {
                    // Not recorded, so not ours to keep: undo the worktree we just made.
                    let _ = git::worktree_remove(&repo, &path).await;
                    return Err(e.into());
                }
            }
        }
    };
    let ws = Workspace::from(row);
    super::announce(
        state,
        NewTeamEvent {
            team_id: project.team_id,
            project_id: Some(project.id),
            workspace_id: Some(id.uuid()),
            kind: "workspace_created",
            data: json!({"workspace_id": ws.id, "project_id": ws.project_id, "branch": ws.branch}),
        },
    )
    .await?;
    Ok((StatusCode::CREATED, ws))
}

/// Create the worktree on a unique branch and directory; returns both.
async fn add_worktree(
    state: &AppState,
    repo: &Path,
    project: uuid::Uuid,
    body: &CreateWorkspace,
    base_commit: &str,
) -> ApiResult<(String, PathBuf)> {
    let root = state
        .settings
        .data_dir
        .join("worktrees")
        .join(ProjectId::from(project).to_string());
    if let Some(branch) = &body.branch {
        git::check_branch_name(repo, branch)
            .await
            .map_err(|e| git_error("branch", e))?;
        let slug = git::slugify(branch.rsplit('/').next().unwrap_or(branch));
        for n in 1..=50 {
            let dir = if n == 1 {
                slug.clone()
            } else {
                format!("{slug}-{n}")
            };
            let path = root.join(&dir);
            if path.exists()
                || store::workspaces::path_or_branch_taken(
                    &state.pool,
                    project,
                    &path.to_string_lossy(),
                    None,
                )
                .await?
            {
                continue;
            }
            git::worktree_add(repo, &path, branch, base_commit)
                .await
                .map_err(|e| git_error("branch", e))?;
            return Ok((branch.clone(), path));
        }
        return Err(ApiError::conflict(
            "workspace_path_taken",
            "no free directory for this branch",
        ));
    }
    let slug = git::slugify(body.title.as_deref().unwrap_or("workspace"));
    for n in 1..=50 {
        let name = if n == 1 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        };
        let branch = format!("agentry/{name}");
        let path = root.join(&name);
        if path.exists()
            || store::workspaces::path_or_branch_taken(
                &state.pool,
                project,
                &path.to_string_lossy(),
                Some(&branch),
            )
            .await?
            || git::branch_exists(repo, &branch)
                .await
                .map_err(|e| git_error("branch", e))?
        {
            continue;
        }
        match git::worktree_add(repo, &path, &branch, base_commit).await {
            Ok(()) => return Ok((branch, path)),
            // Another request took this name a moment ago: try the next one.
            Err(GitError::BranchExists(_)) => continue,
            Err(GitError::Failed(m)) if m.contains("already exists") => continue,
            Err(e) => return Err(git_error("branch", e)),
        }
    }
    Err(ApiError::conflict(
        "workspace_path_taken",
        "could not find a free branch name; pass `branch`",
    ))
}

pub async fn get(
    state: &AppState,
    principal: &Principal,
    id: WorkspaceId,
) -> ApiResult<store::workspaces::WorkspaceRow> {
    let teams = principal.visible_teams();
    store::workspaces::get(&state.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or_else(|| ApiError::not_found("workspace"))
}

pub async fn diff(
    state: &AppState,
    principal: &Principal,
    id: WorkspaceId,
) -> ApiResult<git::Diff> {
    let ws = get(state, principal, id).await?;
    if ws.archived_at.is_some() {
        return Err(ApiError::conflict(
            "workspace_archived",
            "the workspace is archived; its files are gone",
        ));
    }
    let base = ws.base_commit.clone().unwrap_or_else(|| "HEAD".into());
    git::diff(Path::new(&ws.path), &base)
        .await
        .map_err(ApiError::internal)
}

pub async fn archive(
    state: &AppState,
    principal: &Principal,
    id: WorkspaceId,
) -> ApiResult<Workspace> {
    let ws = get(state, principal, id).await?;
    principal.require(ws.team_id, Role::Member, "workspace")?;
    if ws.archived_at.is_some() {
        return Ok(ws.into());
    }
    for agent in store::agents::ids_in_workspace(&state.pool, ws.id).await? {
        state
            .agents
            .close(agent.into(), "the workspace was archived")
            .await;
    }
    if ws.kind == "worktree" {
        let project = store::projects::get(&state.pool, ws.project_id, None)
            .await?
            .ok_or_else(|| ApiError::not_found("project"))?;
        git::worktree_remove(Path::new(&project.repo_path), Path::new(&ws.path))
            .await
            .map_err(ApiError::internal)?;
    }
    let row = store::workspaces::mark_archived(&state.pool, ws.id)
        .await?
        .ok_or_else(|| ApiError::not_found("workspace"))?;
    super::announce(
        state,
        NewTeamEvent {
            team_id: row.team_id,
            project_id: Some(row.project_id),
            workspace_id: Some(row.id),
            kind: "workspace_archived",
            data: json!({"workspace_id": WorkspaceId::from(row.id)}),
        },
    )
    .await?;
    Ok(row.into())
}
