//! Git through the `git` CLI (argv, never a shell): repository checks, worktrees and
//! diffs. Anything that changes a working tree goes through here.
//!
//! Every git process starts from [`command`], which pins the environment (no inherited
//! `GIT_*` variable, no system or global config, a home holding no config, no terminal
//! prompts, pager or editor, C locale) and puts on the command line every
//! program-running key git would otherwise take from a repository's config
//! ([`PINNED_CONFIG`]). On top of it, every call names its git dir explicitly: calls on
//! a repository's metadata run with `--git-dir` (the repository's own `.git`
//! directory, never a `.git` file), and calls that read or fill a work tree run
//! through a view, a private git dir whose config the server writes (see `view.rs` for
//! why). So nothing a work tree, a checkout or a repository's config chose (hooks,
//! fsmonitor, filter and diff drivers, textconv, aliases, pagers, editors, credential
//! helpers, ssh commands) ever runs on the server. Nothing here needs a git newer than
//! 2.39. Commands that change a repository's metadata (`worktree add/prune`,
//! `branch -D`) are serialized per repository with [`lock_repo`].
//!
//! Other modules that start git (clones and fetches of remotes) start from
//! [`command`] too and add their own restrictions on top.

mod commit;
mod diff;
mod remote;
mod view;

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, LazyLock, Mutex};

use serde::Serialize;
use tokio::process::Command;
use utoipa::ToSchema;

pub use commit::{Author, commit_pending};
pub use diff::PATCH_LIMIT;
pub use remote::{
    FETCHED_REFS, PushOutcome, REMOTE_BRANCHES, Remote, clone_bare, fetch, fetch_ref, push,
    resolve_in_clone,
};

#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("`{0}` is not a readable git repository")]
    NotARepository(PathBuf),
    #[error("`{0}` is a git repository without any commit yet")]
    EmptyRepository(PathBuf),
    #[error("unknown revision `{0}`")]
    UnknownRevision(String),
    #[error("invalid branch name `{0}`")]
    InvalidBranch(String),
    #[error("branch `{0}` already exists")]
    BranchExists(String),
    #[error("git failed: {0}")]
    Failed(String),
    #[error("could not run git: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Debug, Clone)]
pub struct RepoInfo {
    /// Absolute, canonical top-level directory of the repository.
    pub toplevel: PathBuf,
    /// The branch HEAD points at (e.g. `main`).
    pub default_branch: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DiffFile {
    pub path: String,
    /// added, modified, deleted, renamed
    pub status: String,
    pub additions: u64,
    pub deletions: u64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Diff {
    pub base_commit: String,
    pub files: Vec<DiffFile>,
    pub patch: String,
}

/// Longest accepted branch name, in bytes.
pub const MAX_BRANCH_LEN: usize = 200;

/// Configuration pinned on the command line of every git process. Command-line
/// configuration outranks every file git reads (repository config, its `include.path` /
/// `includeIf` files, `config.worktree`), so these keys cannot be set by whoever
/// writes a repository's config: nothing they name as a program runs.
const PINNED_CONFIG: &[&str] = &[
    // Repositories are often owned by another user than the server.
    "safe.directory=*",
    // Hooks are code whoever controls the repository put there.
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.pager=cat",
    "core.editor=:",
    "sequence.editor=:",
    "core.askPass=",
    "core.sshCommand=ssh",
    // An empty value empties the list of helpers gathered so far (all of them: the
    // command line is read last).
    "credential.helper=",
    "core.alternateRefsCommand=true",
    // `ext::` URLs run a command of the URL's choosing.
    "protocol.ext.allow=never",
];

/// Where git would find user-level config, attributes and ignore files: nothing can
/// be created under `/dev/null`.
const NO_HOME: &str = "/dev/null";

/// The one place every git process of the server starts from: `git` with no inherited
/// `GIT_*` variable, no system or global config, a home that holds no config, no
/// terminal prompts, no pager or editor, and [`PINNED_CONFIG`]. Callers name the git dir
/// (and the work tree, when there is one) on top of this.
pub(crate) fn command() -> Command {
    let mut cmd = Command::new("git");
    for arg in PINNED_CONFIG {
        cmd.arg("-c").arg(arg);
    }
    cmd.arg("--no-pager");
    for (name, _) in std::env::vars_os() {
        if name.as_bytes().starts_with(b"GIT_") {
            cmd.env_remove(&name);
        }
    }
    cmd.env_remove("SSH_ASKPASS")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_ATTR_NOSYSTEM", "1")
        .env("HOME", NO_HOME)
        .env("XDG_CONFIG_HOME", NO_HOME)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_PAGER", "cat")
        .env("PAGER", "cat")
        .env("GIT_EDITOR", ":")
        .env("GIT_NO_REPLACE_OBJECTS", "1")
        .env("LC_ALL", "C")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// A git command on the repository metadata in `git_dir`, named explicitly; it has no
/// work tree and runs in `git_dir`.
fn at(git_dir: &Path) -> Command {
    let mut cmd = command();
    cmd.arg("--git-dir").arg(git_dir).current_dir(git_dir);
    cmd
}

/// Runs a command to completion, whatever its exit status.
async fn run(mut cmd: Command) -> Result<Output, GitError> {
    Ok(cmd.output().await?)
}

/// Runs a command and returns its stdout; a non-zero exit becomes [`GitError::Failed`]
/// with git's stderr.
async fn run_ok(cmd: Command, what: &str) -> Result<Vec<u8>, GitError> {
    let out = run(cmd).await?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(failure(what, &out))
    }
}

fn failure(what: &str, out: &Output) -> GitError {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stderr = stderr.trim();
    tracing::debug!(command = what, status = %out.status, stderr, "git command failed");
    if stderr.is_empty() {
        GitError::Failed(format!("git {what}: {}", out.status))
    } else {
        GitError::Failed(format!("git {what}: {stderr}"))
    }
}

/// Stdout as text with the single trailing newline git prints removed.
fn stdout_line(stdout: &[u8]) -> String {
    String::from_utf8_lossy(stdout.strip_suffix(b"\n").unwrap_or(stdout)).into_owned()
}

/// `path` made absolute against the current directory, without touching the disk.
fn absolute(path: &Path) -> Result<PathBuf, GitError> {
    Ok(std::path::absolute(path)?)
}

static LOCKS: LazyLock<Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Process-wide lock for commands that change `repo`'s metadata, keyed by the
/// canonical path (the path as given when it cannot be canonicalized).
pub async fn lock_repo(repo: &Path) -> tokio::sync::OwnedMutexGuard<()> {
    let key = match tokio::fs::canonicalize(repo).await {
        Ok(path) => path,
        Err(_) => absolute(repo).unwrap_or_else(|_| repo.to_path_buf()),
    };
    let lock = {
        let mut locks = LOCKS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Forget locks nobody holds or waits for, so the map stays small.
        locks.retain(|path, lock| *path == key || Arc::strong_count(lock) > 1);
        Arc::clone(locks.entry(key).or_default())
    };
    lock.lock_owned().await
}

/// The git dir of the repository at `repo` (see [`view::repo_git_dir`]).
fn git_dir(repo: &Path) -> Result<PathBuf, GitError> {
    view::repo_git_dir(repo)
}

/// Checks that `path` is (inside) the work tree of a git repository with at least one
/// commit and returns its canonical top level and the branch HEAD points at. The top
/// level is the nearest directory, from `path` up, holding a `.git` directory; a
/// `.git` file (a linked worktree or a submodule) is not a repository of its own.
pub async fn inspect_repo(path: &Path) -> Result<RepoInfo, GitError> {
    let not_a_repo = || GitError::NotARepository(path.to_path_buf());
    match tokio::fs::metadata(path).await {
        Ok(meta) if meta.is_dir() => {}
        _ => return Err(not_a_repo()),
    }
    let canonical = tokio::fs::canonicalize(path)
        .await
        .map_err(|_| not_a_repo())?;
    let Some(toplevel) = canonical
        .ancestors()
        .find(|dir| std::fs::symlink_metadata(dir.join(".git")).is_ok())
        .map(Path::to_path_buf)
    else {
        return Err(not_a_repo());
    };
    let git_dir = git_dir(&toplevel).map_err(|_| not_a_repo())?;
    let mut cmd = at(&git_dir);
    cmd.args(["rev-parse", "--git-dir"]);
    let out = run(cmd).await?;
    if !out.status.success() {
        tracing::debug!(
            path = %path.display(),
            stderr = %String::from_utf8_lossy(&out.stderr).trim(),
            "not a git repository"
        );
        return Err(not_a_repo());
    }

    let mut cmd = at(&git_dir);
    cmd.args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"]);
    if !run(cmd).await?.status.success() {
        return Err(GitError::EmptyRepository(toplevel));
    }

    let mut cmd = at(&git_dir);
    cmd.args(["symbolic-ref", "--quiet", "HEAD"]);
    let out = run(cmd).await?;
    if out.status.success() {
        let target = stdout_line(&out.stdout);
        if let Some(branch) = target.strip_prefix("refs/heads/") {
            return Ok(RepoInfo {
                toplevel,
                default_branch: branch.to_owned(),
            });
        }
    }

    // Detached HEAD (or HEAD pointing outside refs/heads): use a conventional name.
    for candidate in ["main", "master"] {
        if branch_exists(&toplevel, candidate).await? {
            return Ok(RepoInfo {
                toplevel,
                default_branch: candidate.to_owned(),
            });
        }
    }
    Err(GitError::Failed(format!(
        "`{}` has a detached HEAD and neither a `main` nor a `master` branch",
        toplevel.display()
    )))
}

/// Resolves `rev` to the full id of a commit in the repository at `repo`.
pub async fn resolve_commit(repo: &Path, rev: &str) -> Result<String, GitError> {
    resolve_commit_at(&git_dir(repo)?, rev).await
}

/// Resolves `rev` to the full id of a commit, with `git_dir` as the git dir (which
/// decides what `HEAD` is).
async fn resolve_commit_at(git_dir: &Path, rev: &str) -> Result<String, GitError> {
    let unknown = || GitError::UnknownRevision(rev.to_owned());
    if rev.is_empty() || rev.starts_with('-') || rev.chars().any(char::is_control) {
        return Err(unknown());
    }
    let mut cmd = at(git_dir);
    cmd.args(["rev-parse", "--verify", "--quiet", "--end-of-options"])
        .arg(format!("{rev}^{{commit}}"));
    let out = run(cmd).await?;
    if out.status.code() == Some(1) {
        return Err(unknown());
    }
    if !out.status.success() {
        return Err(failure("rev-parse", &out));
    }
    let sha = stdout_line(&out.stdout);
    if !is_object_id(&sha) {
        return Err(GitError::Failed(format!(
            "git rev-parse: unexpected output `{sha}` for `{rev}`"
        )));
    }
    Ok(sha)
}

fn is_object_id(id: &str) -> bool {
    matches!(id.len(), 40 | 64) && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The bytes of `path` as committed in `commit` (a full commit id), or `None` when that
/// commit has no such file. Larger files than `max` bytes are refused. The blob is read
/// as stored: no filter or conversion applies.
pub async fn read_committed_file(
    repo: &Path,
    commit: &str,
    path: &str,
    max: u64,
) -> Result<Option<Vec<u8>>, GitError> {
    if !is_object_id(commit) {
        return Err(GitError::UnknownRevision(commit.to_owned()));
    }
    let git_dir = git_dir(repo)?;
    let spec = format!("{commit}:{path}");
    let mut cmd = at(&git_dir);
    cmd.args(["cat-file", "-s", "--end-of-options"]).arg(&spec);
    let out = run(cmd).await?;
    if !out.status.success() {
        // `cat-file -s` fails (128) for a path the commit does not have.
        return Ok(None);
    }
    let size: u64 = stdout_line(&out.stdout).trim().parse().unwrap_or(u64::MAX);
    if size > max {
        return Err(GitError::Failed(format!(
            "{path} in {commit} is {size} bytes, more than the {max} allowed"
        )));
    }
    let mut cmd = at(&git_dir);
    cmd.args(["cat-file", "blob", "--end-of-options"])
        .arg(&spec);
    Ok(Some(run_ok(cmd, "cat-file").await?))
}

/// Our own rules on top of git's: no `..`, no leading `-` or `/`, no whitespace or
/// control characters, no reflog syntax, at most [`MAX_BRANCH_LEN`] bytes.
fn branch_name_is_acceptable(branch: &str) -> bool {
    !branch.is_empty()
        && branch.len() <= MAX_BRANCH_LEN
        && !branch.contains("..")
        && !branch.contains("@{")
        && branch != "@"
        && !branch.starts_with('-')
        && !branch.starts_with('/')
        && !branch.chars().any(|c| c.is_whitespace() || c.is_control())
}

/// Checks that `branch` is a name we are willing to create a branch under.
pub async fn check_branch_name(repo: &Path, branch: &str) -> Result<(), GitError> {
    let invalid = || GitError::InvalidBranch(branch.to_owned());
    if !branch_name_is_acceptable(branch) {
        return Err(invalid());
    }
    let mut cmd = at(&git_dir(repo)?);
    cmd.args(["check-ref-format", "--branch", branch]);
    let out = run(cmd).await?;
    // `--branch` prints the name it accepted; anything else means it was expanded.
    if !out.status.success() || stdout_line(&out.stdout) != branch {
        return Err(invalid());
    }
    Ok(())
}

/// Whether `refs/heads/<branch>` exists in `repo`.
pub async fn branch_exists(repo: &Path, branch: &str) -> Result<bool, GitError> {
    let mut cmd = at(&git_dir(repo)?);
    cmd.args(["show-ref", "--verify", "--quiet"])
        .arg(format!("refs/heads/{branch}"));
    let out = run(cmd).await?;
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => Err(failure("show-ref", &out)),
    }
}

/// Creates a worktree of `repo` at `path` (which must not exist; its parents are
/// created) on a new branch `branch` starting at `base_commit`.
///
/// Git only records the worktree (`worktree add --no-checkout`); its files and index
/// are then filled through a [`view::View`], so no checkout runs with the
/// repository's configuration.
pub async fn worktree_add(
    repo: &Path,
    path: &Path,
    branch: &str,
    base_commit: &str,
) -> Result<(), GitError> {
    check_branch_name(repo, branch).await?;
    let base = resolve_commit(repo, base_commit).await?;
    let path = absolute(path)?;
    let git_dir = git_dir(repo)?;

    let _guard = lock_repo(repo).await;

    if branch_exists(repo, branch).await? {
        return Err(GitError::BranchExists(branch.to_owned()));
    }
    if tokio::fs::symlink_metadata(&path).await.is_ok() {
        return Err(GitError::Failed(format!(
            "worktree path `{}` already exists",
            path.display()
        )));
    }
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent).await?;
    }

    let mut cmd = at(&git_dir);
    cmd.args(["worktree", "add", "--quiet", "--no-checkout", "-b", branch])
        .arg(&path)
        .arg(&base);
    let out = run(cmd).await?;
    if !out.status.success() {
        // Someone outside this process may have created the branch meanwhile.
        if String::from_utf8_lossy(&out.stderr).contains("already exists")
            && branch_exists(repo, branch).await.unwrap_or(false)
        {
            return Err(GitError::BranchExists(branch.to_owned()));
        }
        return Err(failure("worktree add", &out));
    }

    if let Err(e) = check_out(&git_dir, &path, &base).await {
        // Undo the half-made worktree: its directory, its record and its branch.
        let _ = tokio::fs::remove_dir_all(&path).await;
        let mut cmd = at(&git_dir);
        cmd.args(["worktree", "prune"]);
        let _ = run(cmd).await;
        let mut cmd = at(&git_dir);
        cmd.args(["branch", "-D", "--"]).arg(branch);
        let _ = run(cmd).await;
        return Err(e);
    }
    Ok(())
}

/// Fills the files and the index of the worktree just recorded at `path` from `commit`,
/// through a view.
async fn check_out(git_dir: &Path, path: &Path, commit: &str) -> Result<(), GitError> {
    let common = view::common_dir(git_dir);
    let admin = view::worktree_admin_dir(&common, path).ok_or_else(|| {
        GitError::Failed(format!("git recorded no worktree at `{}`", path.display()))
    })?;
    let view = view::View::create(&common, None).await?;
    let mut cmd = view.git(path, Some(&admin.join("index")));
    cmd.args(["read-tree", "-u", "--reset", "--end-of-options", commit]);
    run_ok(cmd, "read-tree").await?;
    Ok(())
}

/// Removes the worktree at `path` (discarding any changes in it) and prunes its
/// metadata. The branch is kept. A directory that is already gone is fine; one that is
/// not a worktree of `repo` (by the repository's own records) is refused. The directory
/// is removed without following any symlink in it, and without git looking at it.
pub async fn worktree_remove(repo: &Path, path: &Path) -> Result<(), GitError> {
    let path = absolute(path)?;
    let git_dir = git_dir(repo)?;
    let _guard = lock_repo(repo).await;

    if tokio::fs::symlink_metadata(&path).await.is_ok() {
        let common = view::common_dir(&git_dir);
        if view::worktree_admin_dir(&common, &path).is_none() {
            return Err(GitError::Failed(format!(
                "`{}` is not a worktree of `{}`",
                path.display(),
                repo.display()
            )));
        }
        tokio::fs::remove_dir_all(&path).await?;
    }

    let mut cmd = at(&git_dir);
    cmd.args(["worktree", "prune"]);
    run_ok(cmd, "worktree prune").await?;
    Ok(())
}

/// Deletes local branch `branch` (for undoing a worktree just made, whose branch nobody
/// has used yet).
pub async fn branch_delete(repo: &Path, branch: &str) -> Result<(), GitError> {
    check_branch_name(repo, branch).await?;
    let git_dir = git_dir(repo)?;
    let _guard = lock_repo(repo).await;
    let mut cmd = at(&git_dir);
    cmd.args(["branch", "-D", "--"]).arg(branch);
    run_ok(cmd, "branch -D").await?;
    Ok(())
}

/// Changes of the files at `work_tree` against `base_commit`, where `work_tree` is
/// `repo` itself or one of its linked worktrees: tracked and untracked, not ignored
/// files. The patch is capped at [`PATCH_LIMIT`] bytes.
pub async fn diff(repo: &Path, work_tree: &Path, base_commit: &str) -> Result<Diff, GitError> {
    let git_dir = git_dir(repo)?;
    let common = view::common_dir(&git_dir);
    let own_dir = if same_dir(repo, work_tree) {
        git_dir
    } else {
        view::worktree_admin_dir(&common, work_tree).ok_or_else(|| {
            GitError::Failed(format!(
                "`{}` is not a worktree of `{}`",
                work_tree.display(),
                repo.display()
            ))
        })?
    };
    let base = resolve_commit_at(&own_dir, base_commit).await?;
    diff::diff(&common, &own_dir.join("index"), work_tree, base).await
}

fn same_dir(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(a), Ok(b)) if a == b
        )
}

/// A short branch/directory friendly name for `title`: lowercase ASCII letters,
/// digits and single dashes, at most 40 characters, `workspace` when nothing is left.
pub fn slugify(title: &str) -> String {
    const MAX: usize = 40;
    let mut slug = String::with_capacity(MAX);
    for c in title.chars() {
        if slug.len() >= MAX {
            break;
        }
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let slug = slug.trim_end_matches('-');
    if slug.is_empty() {
        "workspace".to_owned()
    } else {
        slug.to_owned()
    }
}

#[cfg(test)]
mod tests;
