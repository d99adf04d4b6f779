//! Projects: a team registers a git repository, either one the server clones from a
//! remote (`git_url`, kept under `[projects] storage_dir`) or, for server admins and
//! under the `[projects] local_roots` bound to the team, a repository on the server's
//! disk (`repo_path`).

use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use serde_json::json;

use super::audit::{self, Action, Entry};
use super::{
    Access, Data, Repositories, ServiceContext, ServiceError, ServiceResult, within_deadline,
};
use crate::auth::{AuthError, Operation, Principal};
use crate::domain::{ProjectId, SecretValue, TeamId};
use crate::forge::ForgeKind;
use crate::git::{self, GitError};
use crate::store;

/// The one answer for a local path the caller may not use, whether or not it exists.
const PATH_FORBIDDEN: &str = "repo_path is outside the local roots your team may use \
     (`[projects] local_roots`); register a git_url instead, or ask a server admin";

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "webapp", "git_url": "https://git.example.com/web/webapp.git",
    "credential_secret": "WEBAPP_GIT"}))]
pub struct CreateProject {
    pub name: String,
    /// Defaults to your team when you belong to one.
    pub team_id: Option<TeamId>,
    /// Absolute path of a git repository on the server: server admins anywhere, others
    /// under a `[projects] local_roots` entry bound to the team. Give this or `git_url`.
    pub repo_path: Option<String>,
    /// An http(s) URL (without user info) the server clones from and fetches before each
    /// new workspace. Give this or `repo_path`.
    pub git_url: Option<String>,
    /// Name of a secret of the project's team holding the remote's credential:
    /// `user:password` is sent as HTTP Basic, any other value as a Bearer token.
    pub credential_secret: Option<String>,
    /// `github` or `gitlab`: the forge a `git_url` project lives on, for workspaces
    /// from pull/merge requests and for opening them. The credential is then also the
    /// forge's API token (the part after `:` of a `user:password` value).
    pub forge: Option<String>,
    /// The forge's REST API base (default `https://api.github.com` for GitHub,
    /// `<scheme>://<host>/api/v4` of `git_url` for GitLab).
    pub forge_api_url: Option<String>,
    /// The repository on the forge: `owner/name` on GitHub, the project's path on GitLab
    /// (default: the path of `git_url` without `.git`).
    pub forge_repo: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "webapp",
    "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "repo_path": "/srv/git/webapp",
    "git_url": null, "credential_secret": null,
    "default_branch": "main", "created_at": "2026-11-30T12:00:00Z"}))]
pub struct Project {
    pub id: ProjectId,
    pub name: String,
    pub team_id: TeamId,
    /// The repository on the server: the registered checkout, or for a `git_url`
    /// project the server's own bare clone (`<storage_dir>/<project id>.git`).
    pub repo_path: String,
    /// The remote a cloned project comes from; null for a local repository.
    pub git_url: Option<String>,
    /// The team secret that authenticates to `git_url` (its name, never its value).
    pub credential_secret: Option<String>,
    /// `github` or `gitlab`, or null.
    #[serde(default)]
    pub forge: Option<String>,
    #[serde(default)]
    pub forge_api_url: Option<String>,
    #[serde(default)]
    pub forge_repo: Option<String>,
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
            git_url: r.git_url,
            credential_secret: r.credential_secret,
            forge: r.forge,
            forge_api_url: r.forge_api_url,
            forge_repo: r.forge_repo,
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

#[tracing::instrument(name = "services::projects::create", skip_all)]
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
    let Some(team_name) = store::identity::team_name(&ctx.data.pool, team).await? else {
        return Err(ServiceError::NotFound("team"));
    };
    super::bounds::check_count(
        store::bounds::live_projects(&ctx.data.pool, team).await?,
        ctx.fleet.limits.max_projects_per_team,
        "limits.max_projects_per_team",
    )?;
    let id = ProjectId::new();
    match (&body.repo_path, &body.git_url) {
        (Some(_), Some(_)) => Err(ServiceError::invalid(
            "git_url",
            "give either repo_path or git_url, not both",
        )),
        (None, None) => Err(ServiceError::invalid(
            "repo_path",
            "give repo_path (a repository on the server) or git_url (a remote to clone)",
        )),
        (Some(path), None) => {
            if body.credential_secret.is_some() {
                return Err(ServiceError::invalid(
                    "credential_secret",
                    "only a git_url project takes a credential",
                ));
            }
            for (field, given) in [
                ("forge", body.forge.is_some()),
                ("forge_api_url", body.forge_api_url.is_some()),
                ("forge_repo", body.forge_repo.is_some()),
            ] {
                if given {
                    return Err(ServiceError::invalid(
                        field,
                        "only a git_url project lives on a forge",
                    ));
                }
            }
            let repo = local_repo(ctx, principal, team, &team_name, path).await?;
            if store::projects::name_taken(&ctx.data.pool, team, body.name.trim()).await? {
                return Err(ServiceError::ProjectNameTaken);
            }
            let row = record(
                ctx,
                principal,
                store::projects::NewProject {
                    id: id.uuid(),
                    team_id: team,
                    name: body.name.trim(),
                    repo_path: &repo.toplevel.to_string_lossy(),
                    default_branch: &repo.default_branch,
                    created_by: principal.user_id,
                    git_url: None,
                    credential_secret: None,
                    forge: None,
                    forge_api_url: None,
                    forge_repo: None,
                },
            )
            .await?;
            Ok(row.into())
        }
        (None, Some(url)) => {
            let url = check_git_url(url)?;
            let forge = check_forge(body, &url, ctx.repos.projects.allow_private_remotes)?;
            if let Some(name) = &body.credential_secret
                && !crate::config::valid_env_name(name)
            {
                return Err(ServiceError::invalid(
                    "credential_secret",
                    "must be the name of a secret of the project's team",
                ));
            }
            let pinned = pin_host(&ctx.repos, &url)
                .await
                .map_err(|m| ServiceError::invalid("git_url", m))?;
            let credential = match &body.credential_secret {
                Some(name) => Some(
                    credential(&ctx.data, &ctx.access, team, name)
                        .await?
                        .map_err(|m| ServiceError::invalid("credential_secret", m))?,
                ),
                None => None,
            };
            if store::projects::name_taken(&ctx.data.pool, team, body.name.trim()).await? {
                return Err(ServiceError::ProjectNameTaken);
            }
            let dest = clone_path(&ctx.repos, id);
            let remote = git::Remote {
                url: url.as_str(),
                pinned,
                credential: credential.as_ref(),
                timeout: Duration::from_secs(ctx.repos.projects.clone_timeout_s),
            };
            let default_branch = git::clone_bare(&remote, &dest).await.map_err(|e| {
                ServiceError::invalid("git_url", format!("could not clone: {}", git_message(e)))
            })?;
            let recorded = record(
                ctx,
                principal,
                store::projects::NewProject {
                    id: id.uuid(),
                    team_id: team,
                    name: body.name.trim(),
                    repo_path: &dest.to_string_lossy(),
                    default_branch: &default_branch,
                    created_by: principal.user_id,
                    git_url: Some(url.as_str()),
                    credential_secret: body.credential_secret.as_deref(),
                    forge: forge.as_ref().map(|f| f.0.as_str()),
                    forge_api_url: forge.as_ref().map(|f| f.1.as_str()),
                    forge_repo: forge.as_ref().map(|f| f.2.as_str()),
                },
            )
            .await;
            match recorded {
                Ok(row) => Ok(row.into()),
                Err(e) => {
                    let _ = tokio::fs::remove_dir_all(&dest).await;
                    Err(e)
                }
            }
        }
    }
}

/// Inserts the project and its audit entry.
async fn record(
    ctx: &ServiceContext,
    principal: &Principal,
    new: store::projects::NewProject<'_>,
) -> ServiceResult<store::projects::ProjectRow> {
    within_deadline(&ctx.data, async {
        let mut tx = ctx.data.pool.pool().begin().await?;
        let row = store::projects::insert(&mut *tx, new).await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(
                Action::ProjectCreate,
                Some(new.team_id),
                "project",
                ProjectId::from(new.id),
            )
            .details(json!({
                "name": row.name, "repo_path": row.repo_path, "git_url": row.git_url,
                "credential_secret": row.credential_secret,
            })),
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    })
    .await
}

/// The local repository `raw` names, when the caller may register it for `team`.
///
/// Server admins may name any repository. Everyone else may name only paths under a
/// `[projects] local_roots` entry bound to the team: decided first on the path as written
/// (with `..` applied), before anything on disk is looked at, then again on the resolved
/// path (so a symlink cannot lead out). Every refusal is the same 403, whether or not the
/// path exists; a path used by another team's project is 409 `repo_in_use`.
async fn local_repo(
    ctx: &ServiceContext,
    principal: &Principal,
    team: uuid::Uuid,
    team_name: &str,
    raw: &str,
) -> ServiceResult<git::RepoInfo> {
    let path = Path::new(raw);
    if !path.is_absolute() {
        return Err(ServiceError::invalid(
            "repo_path",
            "must be an absolute path on the server",
        ));
    }
    let admin = principal.visible_teams().is_none();
    if admin {
        if raw.split('/').any(|s| s == "..") {
            return Err(ServiceError::invalid("repo_path", "must not contain `..`"));
        }
        return git::inspect_repo(path)
            .await
            .map_err(|e| ServiceError::invalid("repo_path", e.to_string()));
    }
    let forbidden = || ServiceError::Auth(AuthError::Forbidden(PATH_FORBIDDEN));
    let team_id = TeamId::from(team).to_string();
    let written = lexical(path);
    let roots: Vec<&Path> = ctx
        .repos
        .projects
        .local_roots
        .iter()
        .filter(|r| r.teams.iter().any(|t| t == team_name || *t == team_id))
        .map(|r| r.path.as_path())
        .filter(|root| written.starts_with(root))
        .collect();
    if roots.is_empty() {
        return Err(forbidden());
    }
    let Ok(real) = tokio::fs::canonicalize(&written).await else {
        return Err(forbidden());
    };
    let mut real_root = None;
    for root in roots {
        if let Ok(r) = tokio::fs::canonicalize(root).await
            && real.starts_with(&r)
        {
            real_root = Some(r);
            break;
        }
    }
    let Some(real_root) = real_root else {
        return Err(forbidden());
    };
    let not_a_repo = || {
        ServiceError::invalid(
            "repo_path",
            GitError::NotARepository(path.to_path_buf()).to_string(),
        )
    };
    let repo = match git::inspect_repo(&real).await {
        Ok(repo) => repo,
        Err(GitError::NotARepository(_)) => return Err(not_a_repo()),
        Err(e) => return Err(ServiceError::invalid("repo_path", e.to_string())),
    };
    // A directory inside a repository whose top level is above the root is not a
    // repository the team may use.
    if !repo.toplevel.starts_with(&real_root) {
        return Err(not_a_repo());
    }
    if store::projects::path_used_elsewhere(&ctx.data.pool, team, &repo.toplevel.to_string_lossy())
        .await?
    {
        return Err(ServiceError::RepoInUse);
    }
    Ok(repo)
}

/// `path` with `.` dropped and `..` applied to what precedes it, without the disk.
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The forge, its API base URL and the repository on it, when the request names a forge.
fn check_forge(
    body: &CreateProject,
    git_url: &url::Url,
    allow_private: bool,
) -> ServiceResult<Option<(ForgeKind, String, String)>> {
    let Some(name) = &body.forge else {
        for (field, given) in [
            ("forge_api_url", body.forge_api_url.is_some()),
            ("forge_repo", body.forge_repo.is_some()),
        ] {
            if given {
                return Err(ServiceError::invalid(field, "name the `forge` too"));
            }
        }
        return Ok(None);
    };
    let kind = ForgeKind::parse(name)
        .ok_or_else(|| ServiceError::invalid("forge", "must be `github` or `gitlab`"))?;
    let api = match &body.forge_api_url {
        Some(raw) => {
            let url = url::Url::parse(raw)
                .ok()
                .filter(|u| {
                    matches!(u.scheme(), "http" | "https")
                        && u.host().is_some()
                        && u.username().is_empty()
                        && u.password().is_none()
                        && u.query().is_none()
                        && u.fragment().is_none()
                        && raw.len() <= 2048
                })
                .ok_or_else(|| {
                    ServiceError::invalid(
                        "forge_api_url",
                        "must be an http:// or https:// URL without user info, query or fragment",
                    )
                })?;
            if !allow_private && internal_literal(&url) {
                return Err(ServiceError::invalid(
                    "forge_api_url",
                    "is a loopback, private or link-local address; such hosts need \
                     `projects.allow_private_remotes`",
                ));
            }
            url.as_str().trim_end_matches('/').to_owned()
        }
        None => match kind {
            ForgeKind::GitHub => "https://api.github.com".to_owned(),
            ForgeKind::GitLab => {
                let mut base = format!(
                    "{}://{}",
                    git_url.scheme(),
                    git_url.host_str().unwrap_or("")
                );
                if let Some(port) = git_url.port() {
                    base.push_str(&format!(":{port}"));
                }
                format!("{base}/api/v4")
            }
        },
    };
    let repo = match &body.forge_repo {
        Some(r) => r.trim_matches('/').to_owned(),
        None => git_url
            .path()
            .trim_matches('/')
            .trim_end_matches(".git")
            .to_owned(),
    };
    let repo_ok = !repo.is_empty()
        && repo.len() <= 500
        && !repo
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
        && repo
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && (kind == ForgeKind::GitLab || repo.split('/').count() == 2);
    if !repo_ok {
        return Err(ServiceError::invalid(
            "forge_repo",
            "must be the repository's path on the forge (`owner/name` on GitHub)",
        ));
    }
    Ok(Some((kind, api, repo)))
}

/// Whether `url` names its host by an internal address literal (a name is checked when
/// it is resolved).
pub(crate) fn internal_literal(url: &url::Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(ip)) => super::hooks::is_internal(ip.into()),
        Some(url::Host::Ipv6(ip)) => super::hooks::is_internal(ip.into()),
        _ => false,
    }
}

/// A remote the server may clone: http or https, a host, no user info.
fn check_git_url(raw: &str) -> ServiceResult<url::Url> {
    let invalid = |m: &str| ServiceError::invalid("git_url", m.to_owned());
    if raw.len() > 2048 || raw.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(
            "must be at most 2048 characters, without spaces or control characters",
        ));
    }
    let url = url::Url::parse(raw).map_err(|_| {
        invalid("must be an http:// or https:// URL (ssh, file, ext:: and local paths are refused)")
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(
            "must be an http:// or https:// URL (ssh, file, ext:: and local paths are refused)",
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            "must not carry user info: put the credential in a team secret and name it \
             in credential_secret",
        ));
    }
    if url.host().is_none() {
        return Err(invalid("must name a host"));
    }
    Ok(url)
}

pub(crate) type Pin = Option<(String, u16, Vec<SocketAddr>)>;

/// The addresses `url`'s host resolves to, refused when any is internal (unless
/// `projects.allow_private_remotes`); pinned for git so a later answer cannot differ.
#[tracing::instrument(name = "services::projects::pin_host", skip_all)]
pub(crate) async fn pin_host(repos: &Repositories, url: &url::Url) -> Result<Pin, String> {
    let allow = repos.projects.allow_private_remotes;
    let port = url.port_or_known_default().unwrap_or(443);
    let refused = || {
        "the remote's host is a loopback, private or link-local address; such remotes \
         need `projects.allow_private_remotes`"
            .to_owned()
    };
    match url.host() {
        Some(url::Host::Ipv4(ip)) if !allow && super::hooks::is_internal(ip.into()) => {
            Err(refused())
        }
        Some(url::Host::Ipv6(ip)) if !allow && super::hooks::is_internal(ip.into()) => {
            Err(refused())
        }
        Some(url::Host::Domain(name)) => {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name, port))
                .await
                .map_err(|_| format!("the remote's host `{name}` cannot be resolved"))?
                .collect();
            if addrs.is_empty() {
                return Err(format!("the remote's host `{name}` cannot be resolved"));
            }
            if !allow && addrs.iter().any(|a| super::hooks::is_internal(a.ip())) {
                return Err(refused());
            }
            Ok(Some((name.to_owned(), port, addrs)))
        }
        Some(_) => Ok(None),
        None => Err("must name a host".into()),
    }
}

/// The value of the team's secret `name`; `Err` with why it cannot be used.
#[tracing::instrument(name = "services::projects::credential", skip_all, fields(team_id = %team))]
pub(crate) async fn credential(
    data: &Data,
    access: &Access,
    team: uuid::Uuid,
    name: &str,
) -> ServiceResult<Result<SecretValue, String>> {
    let names = [name.to_owned()];
    let opened = super::secrets::open_many(data, access, team, &names).await?;
    Ok(match opened.into_iter().next() {
        Some((_, value)) => value,
        None => Err(format!("the team has no secret named {name}")),
    })
}

/// Where the clone of project `id` lives.
fn clone_path(repos: &Repositories, id: ProjectId) -> PathBuf {
    repos
        .projects
        .storage(&repos.data_dir)
        .join(format!("{id}.git"))
}

pub(crate) fn git_message(e: GitError) -> String {
    match e {
        GitError::Failed(m) => m,
        GitError::Io(e) => format!("could not run git: {e}"),
        other => other.to_string(),
    }
}

/// How the server reaches a cloned project's remote: its URL, the addresses pinned for
/// its host and the credential (the value of the project's team secret).
pub(crate) struct RemoteAccess {
    pub url: url::Url,
    pub pinned: Pin,
    pub credential: Option<SecretValue>,
}

impl RemoteAccess {
    pub fn remote(&self, timeout: Duration) -> git::Remote<'_> {
        git::Remote {
            url: self.url.as_str(),
            pinned: self.pinned.clone(),
            credential: self.credential.as_ref(),
            timeout,
        }
    }
}

/// The way to a cloned project's remote (`None` for a local project). Fails with
/// `remote_unavailable`.
#[tracing::instrument(name = "services::projects::remote_access", skip_all)]
pub(crate) async fn remote_access(
    ctx: &ServiceContext,
    project: &store::projects::ProjectRow,
) -> ServiceResult<Option<RemoteAccess>> {
    let Some(raw) = &project.git_url else {
        return Ok(None);
    };
    let unavailable = |m: String| {
        ServiceError::RemoteUnavailable(format!("the project's remote cannot be reached: {m}"))
    };
    let url = url::Url::parse(raw).map_err(|e| unavailable(e.to_string()))?;
    let pinned = pin_host(&ctx.repos, &url).await.map_err(unavailable)?;
    let credential = match &project.credential_secret {
        Some(name) => Some(
            credential(&ctx.data, &ctx.access, project.team_id, name)
                .await?
                .map_err(unavailable)?,
        ),
        None => None,
    };
    Ok(Some(RemoteAccess {
        url,
        pinned,
        credential,
    }))
}

/// Brings a cloned project's clone up to date with its remote (a local project has
/// nothing to fetch). Fails with `remote_unavailable`.
#[tracing::instrument(name = "services::projects::refresh", skip_all)]
pub(crate) async fn refresh(
    ctx: &ServiceContext,
    project: &store::projects::ProjectRow,
) -> ServiceResult<()> {
    let Some(access) = remote_access(ctx, project).await? else {
        return Ok(());
    };
    let remote = access.remote(Duration::from_secs(ctx.repos.projects.fetch_timeout_s));
    git::fetch(&remote, Path::new(&project.repo_path))
        .await
        .map_err(|e| {
            ServiceError::RemoteUnavailable(format!(
                "the project's remote cannot be fetched: {}",
                git_message(e)
            ))
        })
}

/// A page of the projects of the caller's teams, after `after`.
#[tracing::instrument(name = "services::projects::list", skip_all)]
pub async fn list(
    data: &Data,
    principal: &Principal,
    after: Option<ProjectId>,
    limit: i64,
) -> ServiceResult<Vec<Project>> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams();
    let rows =
        store::projects::list(&data.pool, teams.as_deref(), after.map(|p| p.uuid()), limit).await?;
    Ok(rows.into_iter().map(Project::from).collect())
}

#[tracing::instrument(name = "services::projects::get", skip_all, fields(project_id = %id))]
pub async fn get(data: &Data, principal: &Principal, id: ProjectId) -> ServiceResult<Project> {
    Ok(find(data, principal, id).await?.into())
}

/// The project's row, when the caller may see it.
#[tracing::instrument(name = "services::projects::find", skip_all, fields(project_id = %id))]
pub(crate) async fn find(
    data: &Data,
    principal: &Principal,
    id: ProjectId,
) -> ServiceResult<store::projects::ProjectRow> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams();
    store::projects::get(&data.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or(ServiceError::NotFound("project"))
}

#[tracing::instrument(name = "services::projects::delete", skip_all, fields(project_id = %id))]
pub async fn delete(
    data: &Data,
    repos: &Repositories,
    principal: &Principal,
    id: ProjectId,
) -> ServiceResult<()> {
    principal.authorize(Operation::ManageTeam)?;
    let row = find(data, principal, id).await?;
    principal.authorize_in(row.team_id, Operation::ManageTeam, "project")?;
    if store::workspaces::active_count_for_project(&data.pool, row.id).await? > 0 {
        return Err(ServiceError::ProjectHasWorkspaces);
    }
    within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
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
    .await?;
    // The clone of a `git_url` project is the server's own: it goes with the project.
    if row.git_url.is_some() {
        let clone = clone_path(repos, id);
        if Path::new(&row.repo_path) == clone {
            let _ = tokio::fs::remove_dir_all(&clone).await;
        }
    }
    Ok(())
}
