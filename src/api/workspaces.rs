//! Workspaces: worktrees (or directories) agents work in, their diff, and archiving.

use actix_web::{HttpRequest, HttpResponse, get, post, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{ProjectId, WorkspaceId};
use crate::git::Diff;
use crate::services::ci::{self, OpenPullRequest, PushResult, PushWorkspace};
use crate::services::workspaces::{self, CreateWorkspace, Workspace};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_workspace)
        .service(list_workspaces)
        .service(get_workspace)
        .service(workspace_diff)
        .service(archive_workspace)
        .service(push_workspace)
        .service(workspace_pull_request);
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
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        workspaces::create(ctx, &principal, &body)
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
    Ok(web::Json(
        list_page(&state.services, &principal, &filter, &page).await?,
    ))
}

/// The page of workspaces `filter` and `page` ask for (also the MCP tool
/// `list_workspaces`).
pub(super) async fn list_page(
    ctx: &crate::services::ServiceContext,
    principal: &Principal,
    filter: &WorkspaceFilter,
    page: &PageQuery,
) -> ApiResult<Page<Workspace>> {
    let project: Option<ProjectId> = filter
        .project_id
        .as_deref()
        .map(|p| parse_id(p, "project"))
        .transpose()?;
    let after: Option<WorkspaceId> = page.after()?;
    let items = workspaces::list(
        &ctx.data,
        principal,
        project,
        filter.include_archived.unwrap_or(false),
        after,
        page.limit() + 1,
    )
    .await?;
    Ok(Page::from_rows(items, page.limit(), |w: &Workspace| {
        w.id.to_string()
    }))
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
        workspaces::get(&state.services, &principal, id).await?,
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
    Ok(web::Json(
        workspaces::diff(&state.services.data, &principal, id).await?,
    ))
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
        workspaces::archive(&state.services, &principal, id).await?,
    ))
}

/// Commit what is pending in the workspace (with a trailer naming the agent) and push
/// its branch to the project's remote, from the server, with the project's credential.
/// Never a force-push unless `force`; never to a protected branch.
#[utoipa::path(tag = "workspaces", security(("bearer" = [])), params(("id" = String, Path)),
    request_body = PushWorkspace,
    responses((status = 200, body = PushResult), (status = 404, body = Problem),
        (status = 409, body = Problem), (status = 422, body = Problem), (status = 502, body = Problem)))]
#[post("/workspaces/{id}/push")]
async fn push_workspace(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<PushWorkspace>,
) -> ApiResult<web::Json<PushResult>> {
    let id: WorkspaceId = parse_id(&id, "workspace")?;
    let body = body.into_inner();
    Ok(web::Json(
        ci::push(&state.services, &principal, id, &body).await?,
    ))
}

/// Open a pull request (GitHub) or merge request (GitLab) for the workspace's pushed
/// branch, or update the open one (201 when opened, 200 when updated).
#[utoipa::path(tag = "workspaces", security(("bearer" = [])), params(("id" = String, Path)),
    request_body = OpenPullRequest,
    responses((status = 201, body = Workspace), (status = 200, description = "Updated", body = Workspace),
        (status = 404, body = Problem), (status = 409, body = Problem), (status = 422, body = Problem),
        (status = 502, body = Problem)))]
#[post("/workspaces/{id}/pull-request")]
async fn workspace_pull_request(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<OpenPullRequest>,
) -> ApiResult<HttpResponse> {
    let id: WorkspaceId = parse_id(&id, "workspace")?;
    let body = body.into_inner();
    let (ws, created) = ci::pull_request(&state.services, &principal, id, &body).await?;
    Ok(if created {
        HttpResponse::Created().json(ws)
    } else {
        HttpResponse::Ok().json(ws)
    })
}
