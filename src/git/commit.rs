//! Committing what is pending in a worktree, for the server (not the agent) to push.
//!
//! Like the diff, the work tree is staged with `git add --all` into the index of a view
//! (a private git dir whose config the server writes, so no filter, hook or signing
//! program the repository or the tree names can run); the tree is written and the
//! commit made through the same view, then the branch is moved with a compare-and-swap
//! `update-ref` on the repository and the worktree's own index is reset to the commit.

use std::path::Path;

use super::view::View;
use super::{GitError, at, failure, git_dir, is_object_id, run, run_ok, stdout_line, view};

/// Who a commit is by.
#[derive(Debug, Clone)]
pub struct Author {
    pub name: String,
    pub email: String,
}

/// Commits the changes of the worktree at `work_tree` (tracked and untracked, not
/// ignored) on its branch `branch` of `repo`, with `message` by `author`. Returns the
/// branch's commit afterwards and whether a new commit was made (nothing pending makes
/// none).
pub async fn commit_pending(
    repo: &Path,
    work_tree: &Path,
    branch: &str,
    author: &Author,
    message: &str,
) -> Result<(String, bool), GitError> {
    super::check_branch_name(repo, branch).await?;
    let git_dir = git_dir(repo)?;
    let common = view::common_dir(&git_dir);
    let admin = view::worktree_admin_dir(&common, work_tree).ok_or_else(|| {
        GitError::Failed(format!(
            "`{}` is not a worktree of `{}`",
            work_tree.display(),
            repo.display()
        ))
    })?;
    let _guard = super::lock_repo(repo).await;
    let branch_ref = format!("refs/heads/{branch}");
    let parent = super::resolve_commit_at(&git_dir, &branch_ref).await?;

    let view = View::create(&common, Some(&admin.join("index"))).await?;
    let mut add = view.git(work_tree, None);
    add.args([
        "-c",
        "core.safecrlf=false",
        "-c",
        "advice.addEmbeddedRepo=false",
        "add",
        "--all",
    ]);
    let out = run(add).await?;
    if !out.status.success() {
        // The copied index may be one git cannot use here: start from an empty one.
        view.forget_index();
        let mut add = view.git(work_tree, None);
        add.args(["-c", "core.safecrlf=false", "add", "--all"]);
        run_ok(add, "add").await?;
    }
    let mut write = view.git(work_tree, None);
    write.arg("write-tree");
    let tree = stdout_line(&run_ok(write, "write-tree").await?);
    let mut parent_tree = at(&git_dir);
    parent_tree
        .args(["rev-parse", "--verify", "--end-of-options"])
        .arg(format!("{parent}^{{tree}}"));
    if stdout_line(&run_ok(parent_tree, "rev-parse").await?) == tree {
        return Ok((parent, false));
    }

    let mut commit = view.git(work_tree, None);
    commit
        .args(["commit-tree", "--no-gpg-sign", "-p", &parent, "-F", "-"])
        .arg(&tree)
        .env("GIT_AUTHOR_NAME", &author.name)
        .env("GIT_AUTHOR_EMAIL", &author.email)
        .env("GIT_COMMITTER_NAME", &author.name)
        .env("GIT_COMMITTER_EMAIL", &author.email)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = commit.spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        stdin.write_all(message.as_bytes()).await?;
    }
    let out = child.wait_with_output().await?;
    if !out.status.success() {
        return Err(failure("commit-tree", &out));
    }
    let new = stdout_line(&out.stdout);
    if !is_object_id(&new) {
        return Err(GitError::Failed(format!(
            "git commit-tree: unexpected output `{new}`"
        )));
    }

    let mut update = at(&git_dir);
    update
        .args(["update-ref", "-m", "agentry: commit pending changes"])
        .arg(&branch_ref)
        .arg(&new)
        .arg(&parent);
    run_ok(update, "update-ref").await?;
    // The worktree's index now matches its new HEAD (the files already do).
    let mut reset = view.git(work_tree, Some(&admin.join("index")));
    reset
        .args(["read-tree", "--reset", "--end-of-options"])
        .arg(&new);
    run_ok(reset, "read-tree").await?;
    Ok((new, true))
}
