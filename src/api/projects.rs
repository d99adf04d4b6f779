//! Projects: git repositories a team's agents work on, cloned by the server from a remote
//! or registered from the server's disk.

use actix_web::{HttpRequest, HttpResponse, delete, get, post, web};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::{Page, PageQuery, idempotency, parse_id};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::ProjectId;
use crate::services::projects::{self, CreateProject, Project};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(create_project)
        .service(list_projects)
        .service(get_project)
        .service(delete_project);
}

/// Register a project: `git_url` (the server clones it) or `repo_path` (a repository on the
/// server, for server admins or under a `[projects] local_roots` entry bound to the team).
#[utoipa::path(tag = "projects", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry-safe creation")),
    request_body = CreateProject,
    responses((status = 201, body = Project), (status = 200, description = "Replayed", body = Project),
        (status = 403, description = "`forbidden`: repo_path is outside what the team may use", body = Problem),
        (status = 409, description = "`project_name_taken`, or `repo_in_use`: another team's project uses the repository", body = Problem),
        (status = 422, description = "`validation_failed`: e.g. a refused git_url, a failed clone, an unknown credential_secret", body = Problem)))]
#[post("/projects")]
async fn create_project(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    body: web::Json<CreateProject>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    let ctx = &state.services;
    idempotency::respond(&ctx.data, &ctx.access, &principal, &req, &body, || {
        projects::create(ctx, &principal, &body)
    })
    .await
}

/// Projects of your teams.
#[utoipa::path(tag = "projects", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Page<Project>, example = json!({"items": [{"id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "webapp", "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "repo_path": "/srv/git/webapp", "default_branch": "main", "created_at": "2026-11-30T12:00:00Z"}], "next_cursor": null}))))]
#[get("/projects")]
async fn list_projects(
    state: web::Data<AppState>,
    principal: Principal,
    page: web::Query<PageQuery>,
) -> ApiResult<web::Json<Page<Project>>> {
    let after: Option<ProjectId> = page.after()?;
    let items = projects::list(&state.services.data, &principal, after, page.limit() + 1).await?;
    Ok(web::Json(Page::from_rows(
        items,
        page.limit(),
        |p: &Project| p.id.to_string(),
    )))
}

#[utoipa::path(tag = "projects", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 200, body = Project), (status = 404, body = Problem)))]
#[get("/projects/{id}")]
async fn get_project(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<Project>> {
    let id: ProjectId = parse_id(&id, "project")?;
    Ok(web::Json(
        projects::get(&state.services.data, &principal, id).await?,
    ))
}

/// Remove a project (its workspaces must be archived first). A registered repository is
/// untouched; the server's own clone of a `git_url` project is removed.
#[utoipa::path(tag = "projects", security(("bearer" = [])), params(("id" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 404, body = Problem), (status = 409, body = Problem)))]
#[delete("/projects/{id}")]
async fn delete_project(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id: ProjectId = parse_id(&id, "project")?;
    projects::delete(&state.services.data, &state.services.repos, &principal, id).await?;
    Ok(HttpResponse::NoContent().finish())
}
