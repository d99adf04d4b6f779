//! Workspaces: worktrees (or directories) agents work in, their diff, and archiving.

use actix_web::{HttpRequest, HttpResponse, get, post, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, parse_id};
use crate::auth::Principal;
use crate::domain::{ProjectId, WorkspaceId};
use crate::git::Diff;
use crate::server::AppState;
use crate::services::{idempotency, workspaces};
use crate::store;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_workspace)
        .service(list_workspaces)
        .service(get_workspace)
        .service(workspace_diff)
        .service(archive_workspace);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkspaceKind {
    Worktree,
    Directory,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "title": "fix login"}))]
pub struct CreateWorkspace {
    pub project_id: ProjectId,
    /// `worktree` (default) or `directory` (the project's own checkout).
    pub kind: Option<WorkspaceKind>,
    /// Branch, tag or commit to start from (default: the project's default branch).
    pub base_ref: Option<String>,
    /// New branch name (default: `agentry/<slug of title>`, made unique).
    pub branch: Option<String>,
    pub title: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
    "kind": "worktree", "title": "fix login", "path": "/var/lib/agentry/worktrees/prj_…/fix-login",
    "branch": "agentry/fix-login", "base_ref": "main", "base_commit": "9fceb02d0ae598e95dc970b74767f19372d61af8",
    "status": "active", "created_at": "2026-11-30T12:00:00Z", "archived_at": null}))]
pub struct Workspace {
    pub id: WorkspaceId,
    pub project_id: ProjectId,
    pub kind: WorkspaceKind,
    pub title: Option<String>,
    pub path: String,
    pub branch: Option<String>,
    pub base_ref: Option<String>,
    pub base_commit: Option<String>,
    /// `active` or `archived`.
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub archived_at: Option<DateTime<Utc>>,
}

impl From<store::workspaces::WorkspaceRow> for Workspace {
    fn from(r: store::workspaces::WorkspaceRow) -> Self {
        Self {
            id: r.id.into(),
            project_id: r.project_id.into(),
            kind: if r.kind == "directory" {
                WorkspaceKind::Directory
            } else {
                WorkspaceKind::Worktree
            },
            title: r.title,
            path: r.path,
            branch: r.branch,
            base_ref: r.base_ref,
            base_commit: r.base_commit,
            status: r.status,
            created_at: r.created_at,
            archived_at: r.archived_at,
        }
    }
}

/// Create a workspace: by default a new worktree on a new branch off the default branch.
#[utoipa::path(tag = "workspaces", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateWorkspace,
    responses((status = 201, body = Workspace), (status = 200, description = "Replayed", body = Workspace),
        (status = 404, body = Problem), (status = 409, body = Problem), (status = 422, body = Problem)))]
#[post("/workspaces")]
async fn create_workspace(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateWorkspace>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    idempotency::respond(&state, &principal, &req, &body, || {
        workspaces::create(&state, &principal, &body)
    })
    .await
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WorkspaceFilter {
    pub project_id: Option<String>,
    /// Include archived workspaces.
    pub include_archived: Option<bool>,
}

#[utoipa::path(tag = "workspaces", security(("bearer" = [])), params(WorkspaceFilter, PageQuery),
    responses((status = 200, body = Page<Workspace>, example = json!({"items": [{"id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "kind": "worktree", "title": "fix login", "path": "/var/lib/agentry/worktrees/prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c/fix-login", "branch": "agentry/fix-login", "base_ref": "main", "base_commit": "9fceb02d0ae598e95dc970b74767f19372d61af8", "status": "active", "created_at": "2026-11-30T12:00:00Z", "archived_at": null}], "next_cursor": null}))))]
#[get("/workspaces")]
async fn list_workspaces(
    state: web::Data<AppState>,
    principal: Principal,
    filter: web::Query<WorkspaceFilter>,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Workspace>>> {
    let project: Option<ProjectId> = filter
        .project_id
        .as_deref()
        .map(|p| parse_id(p, "project"))
        .transpose()?;
    let after: Option<WorkspaceId> = page.after()?;
    let teams = principal.visible_teams();
    let rows = store::workspaces::list(
        &state.pool,
        teams.as_deref(),
        project.map(|p| p.uuid()),
        filter.include_archived.unwrap_or(false),
        after.map(|w| w.uuid()),
        page.limit() + 1,
    )
    .await?;
    let items = rows.into_iter().map(Workspace::from).collect();
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |w: &Workspace| w.id.to_string(),
    )))
}

#[utoipa::path(tag = "workspaces", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Workspace), (status = 404, body = Problem)))]
#[get("/workspaces/{id}")]
async fn get_workspace(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Workspace>> {
    let id: WorkspaceId = parse_id(&id, "workspace")?;
    Ok(web::Json(
        workspaces::get(&state, &principal, id).await?.into(),
    ))
}

/// The working tree (including untracked files) against the workspace's base commit.
#[utoipa::path(tag = "workspaces", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Diff, example = json!({"base_commit": "9fceb02d0ae598e95dc970b74767f19372d61af8",
        "files": [{"path": "notes.txt", "status": "added", "additions": 1, "deletions": 0}],
        "patch": "diff --git a/notes.txt b/notes.txt\nnew file mode 100644\n--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1 @@\n+hello\n"})),
        (status = 404, body = Problem), (status = 409, body = Problem)))]
#[get("/workspaces/{id}/diff")]
async fn workspace_diff(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Diff>> {
    let id: WorkspaceId = parse_id(&id, "workspace")?;
    Ok(web::Json(workspaces::diff(&state, &principal, id).await?))
}

/// Close the workspace's agents, remove the worktree directory, keep the branch.
#[utoipa::path(tag = "workspaces", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Workspace), (status = 404, body = Problem)))]
#[post("/workspaces/{id}/archive")]
async fn archive_workspace(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Workspace>> {
    let id: WorkspaceId = parse_id(&id, "workspace")?;
    Ok(web::Json(
        workspaces::archive(&state, &principal, id).await?,
    ))
}
