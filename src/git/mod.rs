//! Git through the `git` CLI (argv, never a shell): repository checks, worktrees and
//! diffs. Anything that changes a working tree goes through here.

use std::path::{Path, PathBuf};

use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("`{0}` is not a readable git repository")]
    NotARepository(PathBuf),
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

pub async fn inspect_repo(path: &Path) -> Result<RepoInfo, GitError> {
    let _ = path;
    todo!()
}

pub async fn resolve_commit(repo: &Path, rev: &str) -> Result<String, GitError> {
    let _ = (repo, rev);
    todo!()
}

pub async fn check_branch_name(repo: &Path, branch: &str) -> Result<(), GitError> {
    let _ = (repo, branch);
    todo!()
}

pub async fn branch_exists(repo: &Path, branch: &str) -> Result<bool, GitError> {
    let _ = (repo, branch);
    todo!()
}

pub async fn worktree_add(repo: &Path, path: &Path, branch: &str, base_commit: &str) -> Result<(), GitError> {
    let _ = (repo, path, branch, base_commit);
    todo!()
}

pub async fn worktree_remove(repo: &Path, path: &Path) -> Result<(), GitError> {
    let _ = (repo, path);
    todo!()
}

pub async fn diff(worktree: &Path, base_commit: &str) -> Result<Diff, GitError> {
    let _ = (worktree, base_commit);
    todo!()
}
