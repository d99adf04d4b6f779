//! Git through the `git` CLI (argv, never a shell): repository checks, worktrees and
//! diffs. Anything that changes a working tree goes through here.
//!
//! Every git process is built by [`git`], which pins the environment (no terminal
//! prompts, no system config, C locale, no inherited `GIT_DIR`-style overrides) and
//! trusts every directory (`safe.directory=*`) because repositories are often owned by
//! another user than the server. Commands that change a repository's metadata
//! (`worktree add/remove/prune`) are serialized per repository with [`lock_repo`].

mod diff;
mod remote;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, LazyLock, Mutex};

use serde::Serialize;
use tokio::process::Command;
use utoipa::ToSchema;

pub use diff::PATCH_LIMIT;
pub use remote::{REMOTE_BRANCHES, Remote, clone_bare, fetch, resolve_in_clone};

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

/// Environment variables that would redirect git to another repository, index or
/// config than the one we name explicitly.
const SCRUBBED_ENV: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_COMMON_DIR",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
    "GIT_CONFIG",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
];

/// A git command running in `dir` with a controlled environment. Every git process
/// of this module starts here.
fn git(dir: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-c")
        .arg("safe.directory=*")
        // Never start a filesystem-monitor daemon on behalf of the server.
        .arg("-c")
        .arg("core.fsmonitor=false")
        // Repository hooks are code that whoever controls the repository put there; the
        // server never runs them on its own behalf.
        .arg("-c")
        .arg("core.hooksPath=/dev/null")
        .arg("-C")
        .arg(dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
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

/// Stdout as a path with the single trailing newline removed (paths may hold any
/// byte, including trailing spaces).
fn stdout_path(stdout: &[u8]) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(
        stdout.strip_suffix(b"\n").unwrap_or(stdout),
    ))
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

/// Checks that `path` is the work tree of a git repository with at least one commit
/// and returns its canonical top level and the branch HEAD points at.
pub async fn inspect_repo(path: &Path) -> Result<RepoInfo, GitError> {
    let not_a_repo = || GitError::NotARepository(path.to_path_buf());
    match tokio::fs::metadata(path).await {
        Ok(meta) if meta.is_dir() => {}
        _ => return Err(not_a_repo()),
    }

    let mut cmd = git(path);
    cmd.args(["rev-parse", "--show-toplevel"]);
    let out = run(cmd).await?;
    if !out.status.success() || out.stdout.is_empty() {
        tracing::debug!(
            path = %path.display(),
            stderr = %String::from_utf8_lossy(&out.stderr).trim(),
            "not a git work tree"
        );
        return Err(not_a_repo());
    }
    let toplevel = tokio::fs::canonicalize(stdout_path(&out.stdout))
        .await
        .map_err(|_| not_a_repo())?;

    let mut cmd = git(&toplevel);
    cmd.args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"]);
    if !run(cmd).await?.status.success() {
        return Err(GitError::EmptyRepository(toplevel));
    }

    let mut cmd = git(&toplevel);
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

/// Resolves `rev` to the full id of a commit.
pub async fn resolve_commit(repo: &Path, rev: &str) -> Result<String, GitError> {
    let unknown = || GitError::UnknownRevision(rev.to_owned());
    if rev.is_empty() || rev.starts_with('-') || rev.chars().any(char::is_control) {
        return Err(unknown());
    }
    let mut cmd = git(repo);
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
    if !matches!(sha.len(), 40 | 64) || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(GitError::Failed(format!(
            "git rev-parse: unexpected output `{sha}` for `{rev}`"
        )));
    }
    Ok(sha)
}

/// The bytes of `path` as committed in `commit` (a full commit id), or `None` when that
/// commit has no such file. Larger files than `max` bytes are refused.
pub async fn read_committed_file(
    repo: &Path,
    commit: &str,
    path: &str,
    max: u64,
) -> Result<Option<Vec<u8>>, GitError> {
    if !matches!(commit.len(), 40 | 64) || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(GitError::UnknownRevision(commit.to_owned()));
    }
    let spec = format!("{commit}:{path}");
    let mut cmd = git(repo);
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
    let mut cmd = git(repo);
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
    let mut cmd = git(repo);
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
    let mut cmd = git(repo);
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
pub async fn worktree_add(
    repo: &Path,
    path: &Path,
    branch: &str,
    base_commit: &str,
) -> Result<(), GitError> {
    check_branch_name(repo, branch).await?;
    let base = resolve_commit(repo, base_commit).await?;
    let path = absolute(path)?;

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

    let mut cmd = git(repo);
    cmd.args(["worktree", "add", "--quiet", "-b", branch])
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
    Ok(())
}

/// Removes the worktree at `path` (discarding any changes in it) and prunes stale
/// worktree metadata. The branch is kept. A directory that is already gone is fine.
pub async fn worktree_remove(repo: &Path, path: &Path) -> Result<(), GitError> {
    let path = absolute(path)?;
    let _guard = lock_repo(repo).await;

    if tokio::fs::symlink_metadata(&path).await.is_ok() {
        let mut cmd = git(repo);
        cmd.args(["worktree", "remove", "--force"]).arg(&path);
        run_ok(cmd, "worktree remove").await?;
    }

    let mut cmd = git(repo);
    cmd.args(["worktree", "prune"]);
    run_ok(cmd, "worktree prune").await?;
    Ok(())
}

/// Deletes local branch `branch` (for undoing a worktree just made, whose branch nobody
/// has used yet).
pub async fn branch_delete(repo: &Path, branch: &str) -> Result<(), GitError> {
    check_branch_name(repo, branch).await?;
    let _guard = lock_repo(repo).await;
    let mut cmd = git(repo);
    cmd.args(["branch", "-D", "--"]).arg(branch);
    run_ok(cmd, "branch -D").await?;
    Ok(())
}

/// Changes of the working tree of `worktree` (tracked and untracked, not ignored
/// files) against `base_commit`. The patch is capped at [`PATCH_LIMIT`] bytes.
pub async fn diff(worktree: &Path, base_commit: &str) -> Result<Diff, GitError> {
    diff::diff(worktree, base_commit).await
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
