//! Workspaces: a git worktree of a project on a new branch (`agentry/<slug>`, made
//! unique) under `<data_dir>/worktrees/<project>/<slug>`, or the project's own directory.
//! Only paths the database records as ours are ever removed.

use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::audit::{self, Action, Entry};
use super::hooks::{self, Answering, Subject};
use super::{Data, ServiceContext, ServiceError, ServiceResult, setup};
use crate::auth::{Operation, Principal};
use crate::domain::{HookEvent, ProjectId, WorkspaceId};
use crate::events::NewTeamEvent;
use crate::git::{self, GitError};
use crate::store;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkspaceKind {
    Worktree,
    Directory,
}

#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "title": "fix login"}))]
pub struct CreateWorkspace {
    pub project_id: ProjectId,
    /// `worktree` (default) or `directory` (the project's own checkout).
    pub kind: Option<WorkspaceKind>,
    /// Branch, tag or commit to start from (default: the project's default branch). For
    /// a project cloned from `git_url`, the remote's branch of that name as fetched now.
    pub base_ref: Option<String>,
    /// Start from this pull request (GitHub: `refs/pull/<n>/head`) or merge request
    /// (GitLab: `refs/merge-requests/<n>/head`) of a `git_url` project with a `forge`,
    /// fetched with the project's credential. Not with `base_ref`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_request: Option<u32>,
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
    /// `active`, `setup_failed` (the repository's setup commands failed; agents may
    /// still be opened) or `archived`.
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub archived_at: Option<DateTime<Utc>>,
    /// `running`, `succeeded` or `failed` when the repository's `.agentry.toml` has
    /// setup commands; null otherwise.
    pub setup_status: Option<String>,
    /// What the setup commands printed (the last 64 KiB).
    pub setup_output: Option<String>,
    /// The pull/merge request the workspace was made from.
    #[serde(default)]
    pub pull_request: Option<i64>,
    /// The last push of the workspace's branch to the project's remote.
    #[serde(default)]
    pub pushed: Option<PushRecord>,
    /// The pull/merge request opened for the workspace's branch, as last seen.
    #[serde(default)]
    pub opened_pull_request: Option<OpenedPullRequest>,
}

/// A push of the workspace's branch.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PushRecord {
    /// The remote branch pushed to.
    pub branch: String,
    pub commit: String,
    pub forced: bool,
    pub at: DateTime<Utc>,
}

/// A pull request (GitHub) or merge request (GitLab) of the workspace's branch.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OpenedPullRequest {
    pub number: i64,
    pub url: String,
    /// `open`, `merged` or `closed`.
    pub state: String,
    /// The head's checks: `none`, `pending`, `passing` or `failing`.
    pub checks: String,
    /// When the state was last read from the forge.
    pub refreshed_at: Option<DateTime<Utc>>,
}

impl Workspace {
    /// Adds what the workspace exchanged with the remote.
    pub(crate) fn with_remote(
        mut self,
        r: Option<store::workspace_remotes::WorkspaceRemoteRow>,
    ) -> Self {
        let Some(r) = r else {
            return self;
        };
        self.pull_request = r.source_pull_request;
        self.pushed = match (r.pushed_branch, r.pushed_commit, r.pushed_at) {
            (Some(branch), Some(commit), Some(at)) => Some(PushRecord {
                branch,
                commit,
                forced: r.pushed_forced.unwrap_or(false),
                at,
            }),
            _ => None,
        };
        self.opened_pull_request = match (r.pr_number, r.pr_url, r.pr_state) {
            (Some(number), Some(url), Some(state)) => Some(OpenedPullRequest {
                number,
                url,
                state,
                checks: r.pr_checks.unwrap_or_else(|| "none".into()),
                refreshed_at: r.pr_refreshed_at,
            }),
            _ => None,
        };
        self
    }
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
            setup_status: r.setup_status,
            setup_output: r.setup_output,
            pull_request: None,
            pushed: None,
            opened_pull_request: None,
        }
    }
}

fn git_error(field: &'static str, e: GitError) -> ServiceError {
    match e {
        GitError::UnknownRevision(r) => {
            ServiceError::invalid(field, format!("unknown revision `{r}`"))
        }
        GitError::InvalidBranch(b) => {
            ServiceError::invalid(field, format!("invalid branch name `{b}`"))
        }
        GitError::BranchExists(b) => ServiceError::BranchExists(b),
        GitError::NotARepository(_) | GitError::EmptyRepository(_) => {
            ServiceError::RepositoryUnavailable(e.to_string())
        }
        other => ServiceError::Git(other),
    }
}

fn validate_ref(field: &'static str, r: &str) -> ServiceResult<()> {
    if r.is_empty()
        || r.len() > 250
        || r.starts_with('-')
        || r.contains("..")
        || r.chars().any(|c| c.is_control() || c == ' ')
    {
        return Err(ServiceError::invalid(field, "not a valid git ref"));
    }
    Ok(())
}

#[tracing::instrument(name = "services::workspaces::create", skip_all)]
pub async fn create(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateWorkspace,
) -> ServiceResult<Workspace> {
    principal.authorize(Operation::DriveAgents)?;
    let project = super::projects::find(&ctx.data, principal, body.project_id).await?;
    principal.authorize_in(project.team_id, Operation::DriveAgents, "project")?;
    // An agent's token makes workspaces only in its agent's project.
    if principal.agent.is_some_and(|a| a.project_id != project.id) {
        return Err(ServiceError::OutsideAgentProject);
    }
    // `workspace.create.before` may replace the whole request; the replacement is
    // checked like the caller's own.
    let check = |_: &serde_json::Value, new: &serde_json::Value| {
        let parsed: CreateWorkspace = serde_json::from_value(new.clone())
            .map_err(|e| format!("the replacement request is not a workspace request: {e}"))?;
        serde_json::to_value(parsed).map_err(|e| e.to_string())
    };
    let request = hooks::call_waiting(
        ctx,
        principal,
        HookEvent::WorkspaceCreateBefore,
        Subject {
            team: project.team_id,
            project: Some(project.id),
            labels: None,
            among: None,
        },
        "request",
        serde_json::to_value(body).map_err(anyhow::Error::from)?,
        Answering::Replace(&check),
    )
    .await?;
    let replaced: CreateWorkspace = serde_json::from_value(request).map_err(anyhow::Error::from)?;
    let (body, project) = if replaced.project_id == body.project_id {
        (&replaced, project)
    } else {
        let p = super::projects::find(&ctx.data, principal, replaced.project_id).await?;
        principal.authorize_in(p.team_id, Operation::DriveAgents, "project")?;
        (&replaced, p)
    };
    if let Some(t) = &body.title {
        super::projects::validate_name("title", t)?;
    }
    super::bounds::check_count(
        store::bounds::live_workspaces(&ctx.data.pool, project.team_id).await?,
        ctx.fleet.limits.max_workspaces_per_team,
        "limits.max_workspaces_per_team",
    )?;
    let cloned = project.git_url.is_some();
    if cloned && body.kind == Some(WorkspaceKind::Directory) {
        return Err(ServiceError::invalid(
            "kind",
            "a directory workspace needs a local project; this one is cloned from git_url",
        ));
    }
    let repo = PathBuf::from(&project.repo_path);
    let source = match body.pull_request {
        None => None,
        Some(_) if body.base_ref.is_some() => {
            return Err(ServiceError::invalid(
                "pull_request",
                "give base_ref or pull_request, not both",
            ));
        }
        Some(0) => {
            return Err(ServiceError::invalid(
                "pull_request",
                "must be a pull/merge request number",
            ));
        }
        Some(n) => {
            let forge = project
                .forge
                .as_deref()
                .and_then(crate::forge::ForgeKind::parse)
                .filter(|_| cloned)
                .ok_or_else(|| {
                    ServiceError::invalid(
                        "pull_request",
                        "the project needs a git_url and a forge to start from a pull request",
                    )
                })?;
            Some((n, forge.pull_ref(u64::from(n))))
        }
    };
    let base_ref = match &source {
        Some((_, pull_ref)) => pull_ref.clone(),
        None => body
            .base_ref
            .clone()
            .unwrap_or_else(|| project.default_branch.clone()),
    };
    validate_ref("base_ref", &base_ref)?;
    // A cloned project starts from its remote's refs as they are now.
    super::projects::refresh(ctx, &project).await?;
    let base_commit = match &source {
        Some((n, pull_ref)) => {
            let access = super::projects::remote_access(ctx, &project)
                .await?
                .ok_or(ServiceError::NoRemote("the project has no remote"))?;
            let remote = access.remote(std::time::Duration::from_secs(
                ctx.repos.projects.fetch_timeout_s,
            ));
            match git::fetch_ref(&remote, &repo, pull_ref).await {
                Ok(commit) => Ok(commit),
                Err(GitError::UnknownRevision(_)) => {
                    return Err(ServiceError::invalid(
                        "pull_request",
                        format!("the remote has no pull/merge request {n} ({pull_ref})"),
                    ));
                }
                Err(e) => {
                    return Err(ServiceError::RemoteUnavailable(format!(
                        "the project's remote cannot be fetched: {}",
                        super::projects::git_message(e)
                    )));
                }
            }
        }
        None if cloned => git::resolve_in_clone(&repo, &base_ref).await,
        None => git::resolve_commit(&repo, &base_ref).await,
    }
    .map_err(|e| git_error("base_ref", e))?;
    let source_row = source.as_ref().map(|(n, r)| (i64::from(*n), r.as_str()));
    let id = WorkspaceId::new();
    let mut scripts = setup::RepoScripts::None;
    let row = match body.kind.unwrap_or(WorkspaceKind::Worktree) {
        WorkspaceKind::Directory => {
            if body.branch.is_some() {
                return Err(ServiceError::invalid(
                    "branch",
                    "a directory workspace has no branch of its own",
                ));
            }
            insert(
                ctx,
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
                    setup_replica: None,
                },
                true,
                source_row,
            )
            .await?
        }
        WorkspaceKind::Worktree => {
            // A workspace from a pull request is named after it unless told otherwise.
            let mut naming = body.clone();
            if let (None, Some(n)) = (&naming.title, body.pull_request) {
                naming.title = Some(format!("pr-{n}"));
            }
            let made = add_worktree(
                ctx,
                principal,
                &repo,
                &project,
                &naming,
                &base_ref,
                &base_commit,
            )
            .await?;
            let undo = || async {
                // Not recorded, so not ours to keep: undo the worktree (and its new
                // branch) we just made.
                let _ = git::worktree_remove(&repo, &made.path).await;
                let _ = git::branch_delete(&repo, &made.branch).await;
            };
            let after = hooks::call_waiting(
                ctx,
                principal,
                HookEvent::WorktreeCreateAfter,
                Subject {
                    team: project.team_id,
                    project: Some(project.id),
                    labels: None,
                                    among: None,
                },
                "worktree",
                json!({"path": made.path, "branch": made.branch, "source_checkout": project.repo_path}),
                Answering::Acknowledge,
            )
            .await;
            if let Err(e) = after {
                undo().await;
                return Err(e);
            }
            // The repository's setup commands (`.agentry.toml` of the commit the worktree
            // starts at) run once the workspace is registered, after
            // `worktree.create.after`.
            scripts = setup::read(&repo, &made.base_commit).await;
            let runs_setup = scripts.has_setup();
            // With a setup, the workspace is complete (and `workspace.create.after`
            // queued) when the setup's outcome is recorded.
            let inserted = insert(
                ctx,
                store::workspaces::NewWorkspace {
                    id: id.uuid(),
                    project_id: project.id,
                    team_id: project.team_id,
                    kind: "worktree",
                    title: body.title.as_deref(),
                    path: &made.path.to_string_lossy(),
                    branch: Some(&made.branch),
                    base_ref: Some(&made.base_ref),
                    base_commit: Some(&made.base_commit),
                    created_by: principal.user_id,
                    setup_replica: runs_setup.then_some(ctx.fleet.agents.ledger().replica.as_str()),
                },
                !runs_setup,
                source_row,
            )
            .await;
            match inserted {
                Ok(row) => row,
                Err(e) => {
                    undo().await;
                    return Err(e);
                }
            }
        }
    };
    let target = setup::Target {
        workspace_id: id,
        team_id: row.team_id,
        project_id: row.project_id,
        path: PathBuf::from(&row.path),
        branch: row.branch.clone(),
        base_commit: row.base_commit.clone(),
    };
    let remote_row = store::workspace_remotes::get(&ctx.data.pool, id.uuid()).await?;
    let mut ws = Workspace::from(row).with_remote(remote_row.clone());
    super::announce(
        &ctx.data,
        NewTeamEvent {
            team_id: project.team_id,
            project_id: Some(project.id),
            workspace_id: Some(id.uuid()),
            kind: "workspace_created",
            data: json!({"workspace_id": ws.id, "project_id": ws.project_id, "branch": ws.branch}),
        },
    )
    .await?;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::WorkspaceCreate, Some(project.team_id), "workspace", ws.id).details(
            json!({"project_id": ws.project_id, "kind": ws.kind, "branch": ws.branch, "base_commit": ws.base_commit}),
        ),
    )
    .await?;
    if scripts.has_setup() {
        // The setup runs to its end even if the client goes away meanwhile: it is its
        // own task, and the request waits for it.
        let task_ctx = ctx.clone();
        let run = ctx
            .lifecycle
            .runtime
            .spawn(async move { setup::run_setup(&task_ctx, &target, scripts).await });
        let finished = run.await.map_err(|e| {
            ServiceError::Unexpected(anyhow::anyhow!("the setup task failed: {e}"))
        })??;
        if let Some(row) = finished {
            ws = Workspace::from(row).with_remote(remote_row);
        }
    }
    Ok(ws)
}

/// Insert a workspace; when it is complete as inserted (`complete`: no setup to run),
/// `workspace.create.after` is queued in the same transaction.
async fn insert(
    ctx: &ServiceContext,
    new: store::workspaces::NewWorkspace<'_>,
    complete: bool,
    source: Option<(i64, &str)>,
) -> ServiceResult<store::workspaces::WorkspaceRow> {
    let (row, queued) = super::within_deadline(&ctx.data, async {
        let mut tx = ctx.data.pool.pool().begin().await?;
        let row = store::workspaces::insert(&mut *tx, new).await?;
        if let Some((number, source_ref)) = source {
            store::workspace_remotes::insert_source(&mut *tx, row.id, number, source_ref).await?;
        }
        let queued = if complete {
            queue_created(&mut tx, &row).await?
        } else {
            0
        };
        tx.commit().await?;
        Ok((row, queued))
    })
    .await?;
    if queued > 0 {
        ctx.hooks.queued();
    }
    Ok(row)
}

/// Queue `workspace.create.after` for `row`, on `conn`: the transaction that completes
/// the workspace (its insert, or the record of its setup's outcome).
#[tracing::instrument(name = "services::workspaces::queue_created", skip_all)]
pub(crate) async fn queue_created(
    conn: &mut sqlx::PgConnection,
    row: &store::workspaces::WorkspaceRow,
) -> ServiceResult<usize> {
    hooks::queue(
        conn,
        HookEvent::WorkspaceCreateAfter,
        Subject {
            team: row.team_id,
            project: Some(row.project_id),
            labels: None,
            among: None,
        },
        json!({"workspace": Workspace::from(row.clone())}),
    )
    .await
}

/// A worktree made: where, on which branch, from which base.
struct MadeWorktree {
    branch: String,
    path: PathBuf,
    base_ref: String,
    base_commit: String,
}

/// Why one attempt to make a worktree did not.
enum AddFailed {
    /// Git refused (a name taken meanwhile: the caller may try the next one).
    Git(GitError),
    Other(ServiceError),
}

impl From<ServiceError> for AddFailed {
    fn from(e: ServiceError) -> Self {
        AddFailed::Other(e)
    }
}

/// `worktree.create.before` (which may choose the branch, base and destination), then
/// `git worktree add`.
#[allow(clippy::too_many_arguments)]
async fn add_one(
    ctx: &ServiceContext,
    principal: &Principal,
    repo: &Path,
    project: &store::projects::ProjectRow,
    branch: &str,
    path: &Path,
    base_ref: &str,
    base_commit: &str,
) -> Result<MadeWorktree, AddFailed> {
    let root = worktrees_root(ctx);
    let check = |previous: &serde_json::Value, new: &serde_json::Value| {
        hooks::only_changed(previous, new, &["base_ref", "branch", "path"])?;
        for key in ["base_ref", "branch", "path"] {
            if !new.get(key).is_some_and(serde_json::Value::is_string) {
                return Err(format!("`{key}` must be a string"));
            }
        }
        let path = Path::new(new["path"].as_str().unwrap_or_default());
        check_destination(&root, path)?;
        Ok(new.clone())
    };
    let chosen = hooks::call_waiting(
        ctx,
        principal,
        HookEvent::WorktreeCreateBefore,
        Subject {
            team: project.team_id,
            project: Some(project.id),
            labels: None,
            among: None,
        },
        "request",
        json!({"project_id": ProjectId::from(project.id), "base_ref": base_ref, "branch": branch,
               "path": path}),
        Answering::Replace(&check),
    )
    .await?;
    let branch = chosen["branch"].as_str().unwrap_or(branch).to_owned();
    let path = PathBuf::from(chosen["path"].as_str().unwrap_or_default());
    let new_ref = chosen["base_ref"].as_str().unwrap_or(base_ref).to_owned();
    let base_commit = if new_ref == base_ref {
        base_commit.to_owned()
    } else {
        validate_ref("base_ref", &new_ref)?;
        git::resolve_commit(repo, &new_ref)
            .await
            .map_err(|e| git_error("base_ref", e))?
    };
    git::worktree_add(repo, &path, &branch, &base_commit)
        .await
        .map_err(AddFailed::Git)?;
    Ok(MadeWorktree {
        branch,
        path,
        base_ref: new_ref,
        base_commit,
    })
}

fn worktrees_root(ctx: &ServiceContext) -> PathBuf {
    ctx.repos.data_dir.join("worktrees")
}

/// A destination a hook chose: absolute, under `<data_dir>/worktrees`, no `..`, and
/// not existing yet.
fn check_destination(root: &Path, path: &Path) -> Result<(), String> {
    use std::path::Component;
    if !path.is_absolute() {
        return Err("`path` must be absolute".into());
    }
    if path
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err("`path` may not contain `.` or `..`".into());
    }
    let inside = path
        .strip_prefix(root)
        .ok()
        .filter(|rest| rest.components().count() >= 1);
    if inside.is_none() {
        return Err(format!("`path` must be inside {}", root.display()));
    }
    // A symlink on the way could lead outside: the nearest existing ancestor must
    // resolve inside the root too.
    let mut ancestor = path.parent();
    while let Some(a) = ancestor {
        if a.exists() {
            let real = a.canonicalize().map_err(|e| format!("`path`: {e}"))?;
            let real_root = root.canonicalize().map_err(|e| format!("`path`: {e}"))?;
            if !real.starts_with(&real_root) {
                return Err(format!("`path` must be inside {}", root.display()));
            }
            break;
        }
        ancestor = a.parent();
    }
    if std::fs::symlink_metadata(path).is_ok() {
        return Err("`path` already exists".into());
    }
    Ok(())
}

/// Create the worktree on a unique branch and directory.
async fn add_worktree(
    ctx: &ServiceContext,
    principal: &Principal,
    repo: &Path,
    project: &store::projects::ProjectRow,
    body: &CreateWorkspace,
    base_ref: &str,
    base_commit: &str,
) -> ServiceResult<MadeWorktree> {
    let root = worktrees_root(ctx).join(ProjectId::from(project.id).to_string());
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
                    &ctx.data.pool,
                    project.id,
                    &path.to_string_lossy(),
                    None,
                )
                .await?
            {
                continue;
            }
            return match add_one(
                ctx,
                principal,
                repo,
                project,
                branch,
                &path,
                base_ref,
                base_commit,
            )
            .await
            {
                Ok(made) => Ok(made),
                Err(AddFailed::Git(e)) => Err(git_error("branch", e)),
                Err(AddFailed::Other(e)) => Err(e),
            };
        }
        return Err(ServiceError::WorkspacePathTaken(
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
                &ctx.data.pool,
                project.id,
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
        match add_one(
            ctx,
            principal,
            repo,
            project,
            &branch,
            &path,
            base_ref,
            base_commit,
        )
        .await
        {
            Ok(made) => return Ok(made),
            // Another request took this name a moment ago: try the next one.
            Err(AddFailed::Git(GitError::BranchExists(_))) => continue,
            Err(AddFailed::Git(GitError::Failed(m))) if m.contains("already exists") => continue,
            Err(AddFailed::Git(e)) => return Err(git_error("branch", e)),
            Err(AddFailed::Other(e)) => return Err(e),
        }
    }
    Err(ServiceError::WorkspacePathTaken(
        "could not find a free branch name; pass `branch`",
    ))
}

/// A page of the workspaces of the caller's teams (optionally of one project).
#[tracing::instrument(name = "services::workspaces::list", skip_all, fields(project_id = ?project))]
pub async fn list(
    data: &Data,
    principal: &Principal,
    project: Option<ProjectId>,
    include_archived: bool,
    after: Option<WorkspaceId>,
    limit: i64,
) -> ServiceResult<Vec<Workspace>> {
    principal.authorize(Operation::ReadTeam)?;
    // A project filter names a project: one the caller cannot see is missing.
    if let Some(p) = project {
        super::projects::find(data, principal, p).await?;
    }
    let teams = principal.visible_teams();
    let rows = store::workspaces::list(
        &data.pool,
        teams.as_deref(),
        project.map(|p| p.uuid()),
        include_archived,
        after.map(|w| w.uuid()),
        limit,
    )
    .await?;
    let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.id).collect();
    let mut remotes: std::collections::HashMap<uuid::Uuid, _> =
        store::workspace_remotes::get_many(&data.pool, &ids)
            .await?
            .into_iter()
            .map(|r| (r.workspace_id, r))
            .collect();
    Ok(rows
        .into_iter()
        .map(|r| {
            let remote = remotes.remove(&r.id);
            Workspace::from(r).with_remote(remote)
        })
        .collect())
}

/// The workspace, with the state of the pull request opened for it read again from the
/// forge while it is open (see `ci::refresh_pull_request`).
#[tracing::instrument(name = "services::workspaces::get", skip_all, fields(workspace_id = %id))]
pub async fn get(
    ctx: &ServiceContext,
    principal: &Principal,
    id: WorkspaceId,
) -> ServiceResult<Workspace> {
    let row = find(&ctx.data, principal, id).await?;
    let remote = super::ci::refresh_pull_request(ctx, &row).await?;
    Ok(Workspace::from(row).with_remote(remote))
}

/// The workspace's row, when the caller may see it.
#[tracing::instrument(name = "services::workspaces::find", skip_all, fields(workspace_id = %id))]
pub(crate) async fn find(
    data: &Data,
    principal: &Principal,
    id: WorkspaceId,
) -> ServiceResult<store::workspaces::WorkspaceRow> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams();
    store::workspaces::get(&data.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or(ServiceError::NotFound("workspace"))
}

#[tracing::instrument(name = "services::workspaces::diff", skip_all, fields(workspace_id = %id))]
pub async fn diff(data: &Data, principal: &Principal, id: WorkspaceId) -> ServiceResult<git::Diff> {
    let ws = find(data, principal, id).await?;
    if ws.archived_at.is_some() {
        return Err(ServiceError::WorkspaceArchived(
            "the workspace is archived; its files are gone",
        ));
    }
    let project = store::projects::get(&data.pool, ws.project_id, None)
        .await?
        .ok_or(ServiceError::NotFound("project"))?;
    let base = ws.base_commit.clone().unwrap_or_else(|| "HEAD".into());
    Ok(git::diff(Path::new(&project.repo_path), Path::new(&ws.path), &base).await?)
}

#[tracing::instrument(name = "services::workspaces::archive", skip_all, fields(workspace_id = %id))]
pub async fn archive(
    ctx: &ServiceContext,
    principal: &Principal,
    id: WorkspaceId,
) -> ServiceResult<Workspace> {
    principal.authorize(Operation::DriveAgents)?;
    let ws = find(&ctx.data, principal, id).await?;
    principal.authorize_in(ws.team_id, Operation::DriveAgents, "workspace")?;
    if ws.archived_at.is_some() {
        return Ok(ws.into());
    }
    for agent in store::agents::ids_in_workspace(&ctx.data.pool, ws.id).await? {
        ctx.fleet
            .agents
            .close(agent.into(), "the workspace was archived")
            .await;
    }
    if ws.kind == "worktree" {
        let project = store::projects::get(&ctx.data.pool, ws.project_id, None)
            .await?
            .ok_or(ServiceError::NotFound("project"))?;
        let target = setup::Target {
            workspace_id: id,
            team_id: ws.team_id,
            project_id: ws.project_id,
            path: PathBuf::from(&ws.path),
            branch: ws.branch.clone(),
            base_commit: ws.base_commit.clone(),
        };
        if Path::new(&ws.path).is_dir() {
            setup::run_teardown(ctx, &target, Path::new(&project.repo_path)).await;
        }
        git::worktree_remove(Path::new(&project.repo_path), Path::new(&ws.path)).await?;
    }
    // `workspace.archive.after` is queued in the archive's own transaction.
    let (row, queued) = super::within_deadline(&ctx.data, async {
        let mut tx = ctx.data.pool.pool().begin().await?;
        let row = store::workspaces::mark_archived(&mut *tx, ws.id)
            .await?
            .ok_or(ServiceError::NotFound("workspace"))?;
        let queued = hooks::queue(
            &mut tx,
            HookEvent::WorkspaceArchiveAfter,
            Subject {
                team: row.team_id,
                project: Some(row.project_id),
                labels: None,
                among: None,
            },
            json!({"workspace": Workspace::from(row.clone())}),
        )
        .await?;
        tx.commit().await?;
        Ok((row, queued))
    })
    .await?;
    if queued > 0 {
        ctx.hooks.queued();
    }
    super::announce(
        &ctx.data,
        NewTeamEvent {
            team_id: row.team_id,
            project_id: Some(row.project_id),
            workspace_id: Some(row.id),
            kind: "workspace_archived",
            data: json!({"workspace_id": WorkspaceId::from(row.id)}),
        },
    )
    .await?;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::WorkspaceArchive, Some(row.team_id), "workspace", id)
            .details(json!({"project_id": ProjectId::from(row.project_id)})),
    )
    .await?;
    Ok(Workspace::from(row))
}
