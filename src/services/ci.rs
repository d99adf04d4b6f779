//! Delivering a workspace's work: committing what is pending and pushing its branch to
//! the project's remote, and opening (or updating) a pull request (GitHub) or merge
//! request (GitLab) for it, whose state is read again when the workspace is read.
//!
//! All of it runs in the server, never in an agent's sandbox: the remote's credential
//! (the project's team secret) reaches git only through the environment of the git
//! child (see `git::Remote`) and the forge only in a request header.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::audit::{self, Action, Entry};
use super::workspaces::{Workspace, find};
use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::domain::{AgentId, WorkspaceId};
use crate::forge::{self, Forge, ForgeError, ForgeKind, GitHub, GitLab, Review, ReviewSpec};
use crate::git::{self, Author, GitError, PushOutcome};
use crate::store;

/// Longest commit message, pull request title and body accepted, in bytes.
const MAX_MESSAGE: usize = 64 * 1024;
const MAX_TITLE: usize = 500;

#[derive(Debug, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"message": "Fix the login redirect", "author_name": "CI bot",
    "author_email": "ci@example.com"}))]
pub struct PushWorkspace {
    /// The remote branch to push to (default: the workspace's branch). Never one of
    /// `[projects] protected_branches`.
    pub branch: Option<String>,
    /// The commit message for what is pending (default: the agent's title, else the
    /// workspace's). A trailer `Agentry-Agent: <agent id>` is appended.
    pub message: Option<String>,
    /// Default `agentry`.
    pub author_name: Option<String>,
    /// Default `agentry@localhost`.
    pub author_email: Option<String>,
    /// The agent the trailer names (default: the workspace's most recent agent).
    pub agent_id: Option<AgentId>,
    /// Allow a push that is not a fast-forward of the remote branch (default false).
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PushResult {
    /// The commit the remote branch now points at.
    pub commit: String,
    /// Whether pending changes were committed first.
    pub committed: bool,
    /// The remote branch.
    pub branch: String,
    pub forced: bool,
    pub workspace: Workspace,
}

#[derive(Debug, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"title": "Fix the login redirect", "body": "Opened by agentry."}))]
pub struct OpenPullRequest {
    /// Default: the workspace's title, else its branch.
    pub title: Option<String>,
    #[serde(default)]
    pub body: Option<String>,
    /// The branch to merge into (default: the project's default branch).
    pub base: Option<String>,
}

fn check_text(field: &'static str, text: &str, max: usize) -> ServiceResult<()> {
    if text.len() > max {
        return Err(ServiceError::invalid(
            field,
            format!("must be at most {max} bytes"),
        ));
    }
    Ok(())
}

fn check_ident(field: &'static str, text: &str) -> ServiceResult<()> {
    if text.trim().is_empty()
        || text.len() > 200
        || text
            .chars()
            .any(|c| c.is_control() || matches!(c, '<' | '>'))
    {
        return Err(ServiceError::invalid(
            field,
            "must be 1 to 200 characters, without `<`, `>` or control characters",
        ));
    }
    Ok(())
}

/// The workspace (a live worktree the caller may drive) and its project.
async fn workspace_and_project(
    ctx: &ServiceContext,
    principal: &Principal,
    id: WorkspaceId,
) -> ServiceResult<(store::workspaces::WorkspaceRow, store::projects::ProjectRow)> {
    principal.authorize(Operation::DriveAgents)?;
    let ws = find(&ctx.data, principal, id).await?;
    principal.authorize_in(ws.team_id, Operation::DriveAgents, "workspace")?;
    if ws.archived_at.is_some() {
        return Err(ServiceError::WorkspaceArchived(
            "the workspace is archived; its files are gone",
        ));
    }
    let project = store::projects::get(&ctx.data.pool, ws.project_id, None)
        .await?
        .ok_or(ServiceError::NotFound("project"))?;
    Ok((ws, project))
}

#[tracing::instrument(name = "services::ci::push", skip_all, fields(agent_id = %id))]
pub async fn push(
    ctx: &ServiceContext,
    principal: &Principal,
    id: WorkspaceId,
    body: &PushWorkspace,
) -> ServiceResult<PushResult> {
    let (ws, project) = workspace_and_project(ctx, principal, id).await?;
    let Some(own_branch) = ws.branch.clone().filter(|_| ws.kind == "worktree") else {
        return Err(ServiceError::NoRemote(
            "a directory workspace has no branch of its own to push",
        ));
    };
    if project.git_url.is_none() {
        return Err(ServiceError::NoRemote(
            "the project has no remote to push to (register it with git_url)",
        ));
    }
    let repo = Path::new(&project.repo_path);
    let target = body.branch.clone().unwrap_or_else(|| own_branch.clone());
    git::check_branch_name(repo, &target)
        .await
        .map_err(|e| match e {
            GitError::InvalidBranch(b) => {
                ServiceError::invalid("branch", format!("invalid branch name `{b}`"))
            }
            other => ServiceError::Git(other),
        })?;
    if ctx.repos.projects.protected_branches.contains(&target) {
        return Err(ServiceError::BranchProtected(target));
    }
    if let Some(m) = &body.message {
        check_text("message", m, MAX_MESSAGE)?;
        if m.trim().is_empty() {
            return Err(ServiceError::invalid("message", "must not be empty"));
        }
    }
    let author = Author {
        name: body.author_name.clone().unwrap_or_else(|| "agentry".into()),
        email: body
            .author_email
            .clone()
            .unwrap_or_else(|| "agentry@localhost".into()),
    };
    check_ident("author_name", &author.name)?;
    check_ident("author_email", &author.email)?;

    // The agent the commit is credited to.
    let agent = match body.agent_id {
        Some(a) => {
            let row = store::agents::get(&ctx.data.pool, a.uuid(), None)
                .await?
                .filter(|r| r.workspace_id == ws.id)
                .ok_or(ServiceError::NotFound("agent"))?;
            Some(row)
        }
        None => {
            let latest = store::agents::ids_in_workspace(&ctx.data.pool, ws.id)
                .await?
                .into_iter()
                .max();
            match latest {
                Some(a) => store::agents::get(&ctx.data.pool, a, None).await?,
                None => None,
            }
        }
    };
    let subject = body
        .message
        .clone()
        .or_else(|| agent.as_ref().and_then(|a| a.title.clone()))
        .or_else(|| ws.title.clone())
        .unwrap_or_else(|| format!("Changes of workspace {id}"));
    let trailer = match &agent {
        Some(a) => format!("Agentry-Agent: {}", AgentId::from(a.id)),
        None => format!("Agentry-Workspace: {id}"),
    };
    let message = format!("{}\n\n{trailer}\n", subject.trim_end());

    let (commit, committed) =
        git::commit_pending(repo, Path::new(&ws.path), &own_branch, &author, &message)
            .await
            .map_err(ServiceError::Git)?;

    let access = super::projects::remote_access(ctx, &project)
        .await?
        .ok_or(ServiceError::NoRemote("the project has no remote"))?;
    let remote = access.remote(Duration::from_secs(ctx.repos.projects.fetch_timeout_s));
    match git::push(&remote, repo, &own_branch, &target, body.force).await {
        Ok(PushOutcome::Pushed) => {}
        Ok(PushOutcome::Rejected(why)) => {
            let hint = if why.contains("non-fast-forward") || why.contains("fetch first") {
                format!(
                    "{why}: the remote branch has commits the workspace lacks; push with \"force\": true to replace them"
                )
            } else {
                why
            };
            return Err(ServiceError::PushRejected(hint));
        }
        Err(e) => {
            return Err(ServiceError::RemoteUnavailable(format!(
                "the push did not reach the remote: {}",
                super::projects::git_message(e)
            )));
        }
    }
    let row =
        store::workspace_remotes::record_push(&ctx.data.pool, ws.id, &target, &commit, body.force)
            .await?;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::WorkspacePush, Some(ws.team_id), "workspace", id).details(json!({
            "branch": target, "commit": commit, "committed": committed, "forced": body.force,
            "agent_id": agent.as_ref().map(|a| AgentId::from(a.id)),
        })),
    )
    .await?;
    Ok(PushResult {
        commit,
        committed,
        branch: target,
        forced: body.force,
        workspace: Workspace::from(ws).with_remote(Some(row)),
    })
}

/// HTTP clients for forges: any address, or public addresses only.
fn http(allow_private: bool) -> &'static reqwest::Client {
    static OPEN: OnceLock<reqwest::Client> = OnceLock::new();
    static GUARDED: OnceLock<reqwest::Client> = OnceLock::new();
    let build = |guarded: bool| {
        crate::telemetry::install_crypto_provider();
        let mut b = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(forge::CALL_TIMEOUT)
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("agentry/", env!("CARGO_PKG_VERSION")));
        if guarded {
            b = b
                .no_proxy()
                .dns_resolver(Arc::new(super::hooks::PublicOnly));
        }
        b.build().unwrap_or_default()
    };
    if allow_private {
        OPEN.get_or_init(|| build(false))
    } else {
        GUARDED.get_or_init(|| build(true))
    }
}

/// The forge of a project and the token for it.
struct ForgeAccess {
    kind: ForgeKind,
    api: String,
    repo: String,
    token: String,
    allow_private: bool,
}

async fn forge_access(
    ctx: &ServiceContext,
    project: &store::projects::ProjectRow,
) -> ServiceResult<ForgeAccess> {
    let (Some(kind), Some(api), Some(repo)) = (
        project.forge.as_deref().and_then(ForgeKind::parse),
        project.forge_api_url.clone(),
        project.forge_repo.clone(),
    ) else {
        return Err(ServiceError::NoRemote(
            "the project has no forge (register it with `forge`) to open pull requests on",
        ));
    };
    let allow_private = ctx.repos.projects.allow_private_remotes;
    // Names are checked as they are resolved (`PublicOnly`); address literals here.
    if !allow_private
        && url::Url::parse(&api).map_or(true, |u| super::projects::internal_literal(&u))
    {
        return Err(ServiceError::ForgeFailed(
            "the forge's API is at a loopback, private or link-local address; such hosts \
             need `projects.allow_private_remotes`"
                .into(),
        ));
    }
    let Some(name) = &project.credential_secret else {
        return Err(ServiceError::NoRemote(
            "the project has no credential_secret to call its forge with",
        ));
    };
    let value = super::projects::credential(&ctx.data, &ctx.access, project.team_id, name)
        .await?
        .map_err(ServiceError::ForgeFailed)?;
    let raw = value.expose();
    // A `user:password` credential: the password is the token.
    let token = raw.split_once(':').map_or(raw, |(_, t)| t).to_owned();
    Ok(ForgeAccess {
        kind,
        api,
        repo,
        token,
        allow_private,
    })
}

impl ForgeAccess {
    fn endpoint(&self) -> forge::Endpoint<'_> {
        forge::Endpoint {
            http: http(self.allow_private),
            api: &self.api,
            repo: &self.repo,
            token: &self.token,
        }
    }
}

fn forge_error(e: ForgeError) -> ServiceError {
    ServiceError::ForgeFailed(e.to_string())
}

/// Finds the open pull request of `spec.head` (the stored one first) and updates it,
/// or creates one; then reads its state. Returns it, its checks and whether it is new.
async fn open_or_update<F: Forge>(
    f: &F,
    stored: Option<i64>,
    spec: &ReviewSpec<'_>,
) -> Result<(Review, forge::Checks, bool), ForgeError> {
    let existing = match stored {
        Some(n) => Some(n),
        None => f.find_open(spec.head).await?.map(|r| r.number),
    };
    let (number, created) = match existing {
        Some(n) => (f.update(n, spec).await?.number, false),
        None => (f.create(spec).await?.number, true),
    };
    let (review, checks) = f.status(number).await?;
    Ok((review, checks, created))
}

async fn status_of(
    access: &ForgeAccess,
    number: i64,
) -> Result<(Review, forge::Checks), ForgeError> {
    match access.kind {
        ForgeKind::GitHub => GitHub(access.endpoint()).status(number).await,
        ForgeKind::GitLab => GitLab(access.endpoint()).status(number).await,
    }
}

/// Opens a pull request for the workspace's pushed branch, or updates the open one.
/// Returns the workspace and whether the pull request is new.
#[tracing::instrument(name = "services::ci::pull_request", skip_all, fields(agent_id = %id))]
pub async fn pull_request(
    ctx: &ServiceContext,
    principal: &Principal,
    id: WorkspaceId,
    body: &OpenPullRequest,
) -> ServiceResult<(Workspace, bool)> {
    let (ws, project) = workspace_and_project(ctx, principal, id).await?;
    let access = forge_access(ctx, &project).await?;
    let stored = store::workspace_remotes::get(&ctx.data.pool, ws.id).await?;
    let Some(head) = stored.as_ref().and_then(|r| r.pushed_branch.clone()) else {
        return Err(ServiceError::NotPushed);
    };
    let title = body
        .title
        .clone()
        .or_else(|| ws.title.clone())
        .unwrap_or_else(|| head.clone());
    check_text("title", &title, MAX_TITLE)?;
    if title.trim().is_empty() {
        return Err(ServiceError::invalid("title", "must not be empty"));
    }
    let text = body.body.clone().unwrap_or_default();
    check_text("body", &text, MAX_MESSAGE)?;
    let base = body
        .base
        .clone()
        .unwrap_or_else(|| project.default_branch.clone());
    git::check_branch_name(Path::new(&project.repo_path), &base)
        .await
        .map_err(|_| ServiceError::invalid("base", "not a valid branch name"))?;
    if base == head {
        return Err(ServiceError::invalid(
            "base",
            "is the branch the workspace was pushed to",
        ));
    }
    // A pull request that is still open (as last seen) is updated, not opened again.
    let known_open = stored
        .as_ref()
        .filter(|r| r.pr_state.as_deref() == Some("open"))
        .and_then(|r| r.pr_number);
    let spec = ReviewSpec {
        head: &head,
        base: &base,
        title: &title,
        body: &text,
    };
    let (review, checks, created) = match access.kind {
        ForgeKind::GitHub => open_or_update(&GitHub(access.endpoint()), known_open, &spec).await,
        ForgeKind::GitLab => open_or_update(&GitLab(access.endpoint()), known_open, &spec).await,
    }
    .map_err(forge_error)?;
    let row = store::workspace_remotes::record_pull_request(
        &ctx.data.pool,
        ws.id,
        review.number,
        &review.url,
        review.state.as_str(),
        checks.as_str(),
    )
    .await?;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(
            Action::WorkspacePullRequest,
            Some(ws.team_id),
            "workspace",
            id,
        )
        .details(
            json!({"number": review.number, "url": review.url, "created": created,
                "forge": access.kind.as_str(), "head": head, "base": base}),
        ),
    )
    .await?;
    Ok((Workspace::from(ws).with_remote(Some(row)), created))
}

/// The end (at most 64 KiB) of the log of job `job` of a GitLab project, read with the
/// project's credential.
pub(crate) async fn job_log(
    ctx: &ServiceContext,
    project: &store::projects::ProjectRow,
    job: i64,
) -> ServiceResult<String> {
    let access = forge_access(ctx, project).await?;
    if access.kind != ForgeKind::GitLab {
        return Err(ServiceError::NoRemote("job logs are read from GitLab only"));
    }
    GitLab(access.endpoint())
        .job_trace(job, 64 * 1024)
        .await
        .map_err(forge_error)
}

/// The failed jobs of a GitHub workflow run, each with the end (at most 1 MiB) of its
/// log, read with the project's credential (at most `limit` jobs).
pub(crate) async fn workflow_run_logs(
    ctx: &ServiceContext,
    project: &store::projects::ProjectRow,
    run: i64,
    limit: usize,
) -> ServiceResult<Vec<(String, Result<String, String>)>> {
    let access = forge_access(ctx, project).await?;
    if access.kind != ForgeKind::GitHub {
        return Err(ServiceError::NoRemote(
            "workflow runs are read from GitHub only",
        ));
    }
    let github = forge::GitHub(access.endpoint());
    let jobs = github.failed_jobs(run).await.map_err(forge_error)?;
    let mut logs = Vec::new();
    for (id, name) in jobs.into_iter().take(limit) {
        let log = github
            .job_log(id, 1024 * 1024)
            .await
            .map_err(|e| e.to_string());
        logs.push((name, log));
    }
    Ok(logs)
}

/// What the workspace exchanged with the remote, with the state of its pull request read
/// again from the forge while it is open. A forge that fails leaves the last state
/// known (its `refreshed_at` says when).
#[tracing::instrument(name = "services::ci::refresh_pull_request", skip_all)]
pub(crate) async fn refresh_pull_request(
    ctx: &ServiceContext,
    ws: &store::workspaces::WorkspaceRow,
) -> ServiceResult<Option<store::workspace_remotes::WorkspaceRemoteRow>> {
    let stored = store::workspace_remotes::get(&ctx.data.pool, ws.id).await?;
    let Some(number) = stored
        .as_ref()
        .filter(|r| r.pr_state.as_deref() == Some("open"))
        .and_then(|r| r.pr_number)
    else {
        return Ok(stored);
    };
    let Some(project) = store::projects::get(&ctx.data.pool, ws.project_id, None).await? else {
        return Ok(stored);
    };
    let access = match forge_access(ctx, &project).await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(workspace_id = %WorkspaceId::from(ws.id), error = %e,
                "the pull request's state cannot be refreshed");
            return Ok(stored);
        }
    };
    match status_of(&access, number).await {
        Ok((review, checks)) => Ok(Some(
            store::workspace_remotes::record_pull_request(
                &ctx.data.pool,
                ws.id,
                review.number,
                &review.url,
                review.state.as_str(),
                checks.as_str(),
            )
            .await?,
        )),
        Err(e) => {
            tracing::warn!(workspace_id = %WorkspaceId::from(ws.id), error = %e,
                "the pull request's state cannot be refreshed");
            Ok(stored)
        }
    }
}

/// This replica's poll of open pull/merge requests: every `triggers.pr_poll_s` it takes
/// up to `triggers.pr_poll_batch` of those not read for as long (the database marks them
/// taken, so replicas share the work) and reads their state and checks from the forge.
/// Deliveries keep them current between polls.
pub async fn run_pr_poll(ctx: ServiceContext) {
    let every = ctx.triggers.settings.pr_poll_s;
    if every == 0 {
        return;
    }
    let batch = i64::from(ctx.triggers.settings.pr_poll_batch);
    loop {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(every)) => {}
            () = ctx.lifecycle.stopping() => return,
        }
        let due = match store::workspace_remotes::due_open_pull_requests(
            &ctx.data.pool,
            every as i64,
            batch,
        )
        .await
        {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "the open pull requests could not be looked up");
                continue;
            }
        };
        for id in due {
            if *ctx.lifecycle.shutdown.borrow() {
                return;
            }
            match store::workspaces::get(&ctx.data.pool, id, None).await {
                Ok(Some(ws)) => {
                    if let Err(e) = refresh_pull_request(&ctx, &ws).await {
                        tracing::warn!(workspace_id = %WorkspaceId::from(id), error = %e,
                            "the pull request's state could not be recorded");
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(workspace_id = %WorkspaceId::from(id), error = %e,
                        "the workspace of an open pull request could not be read");
                }
            }
        }
    }
}
