//! Where a repository's metadata is, found without trusting anything a work tree holds,
//! and the private git dir ("view") through which the server reads work trees.
//!
//! A work tree is agent-writable, and so is a `directory` workspace's `.git`. Git reads
//! its configuration from the git dir, and `.gitattributes` anywhere in the tree select
//! drivers (clean/smudge/process filters, textconv, external diff) that configuration
//! defines as commands. Commands that read a work tree (`add -A` for the diff, checking
//! out files into a new worktree) therefore never run against the repository's git
//! dir: they run against a view, a temporary git dir the server writes itself, with
//!
//! - a `config` holding only `core.repositoryformatversion` and
//!   `extensions.objectformat`, mirrored from the repository's config when they hold a
//!   value git accepts: no driver, hook, fsmonitor, alias or include is defined
//!   anywhere git looks, so attributes planted in the tree select drivers that do not
//!   exist;
//! - the repository's objects through `GIT_OBJECT_DIRECTORY` (objects are data);
//! - a copy of the work tree's index (an empty one when there is none), or the
//!   worktree's own index when the server fills it;
//! - `--work-tree` named explicitly.
//!
//! Calls on the repository's metadata (refs, `worktree add/prune`, `branch -D`,
//! `cat-file`) do read its config, but name `--git-dir` explicitly and run with
//! [`super::PINNED_CONFIG`] on the command line, and none of them reads attributes or
//! checks files out. A worktree's admin dir is found from the common dir
//! (`<common>/worktrees/*/gitdir` naming `<worktree>/.git`), never from the worktree's
//! `.git` file.

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use tokio::process::Command;

use super::{GitError, command, run};

/// Largest `gitdir`/`commondir` file read, in bytes.
const SMALL_FILE_LIMIT: u64 = 16 * 1024;

/// Opens `path` for reading without following a symlink in its last component and
/// without blocking on a FIFO; only regular files are accepted.
fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// The contents of a small regular file (a `gitdir` or `commondir` pointer) without
/// its trailing newline.
fn read_pointer(path: &Path) -> Option<PathBuf> {
    let mut bytes = Vec::new();
    open_regular(path)
        .ok()?
        .take(SMALL_FILE_LIMIT)
        .read_to_end(&mut bytes)
        .ok()?;
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
    (!bytes.is_empty()).then(|| PathBuf::from(OsStr::from_bytes(bytes)))
}

fn is_dir_no_follow(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Whether `dir` looks like a git dir itself (a bare repository).
fn is_bare_git_dir(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join("HEAD")).is_ok_and(|m| m.is_file())
        && is_dir_no_follow(&dir.join("objects"))
        && is_dir_no_follow(&dir.join("refs"))
}

/// The git dir of the repository at `repo` (its work tree's top level, or a bare
/// repository): `<repo>/.git` when that is a directory, else `repo` itself when it is
/// a bare repository. A `.git` file or symlink is not followed.
pub(super) fn repo_git_dir(repo: &Path) -> Result<PathBuf, GitError> {
    let dot_git = repo.join(".git");
    if is_dir_no_follow(&dot_git) {
        return Ok(dot_git);
    }
    if std::fs::symlink_metadata(&dot_git).is_err() && is_bare_git_dir(repo) {
        return Ok(repo.to_path_buf());
    }
    Err(GitError::NotARepository(repo.to_path_buf()))
}

/// The common dir of `git_dir`: the one its `commondir` file names, else itself.
pub(super) fn common_dir(git_dir: &Path) -> PathBuf {
    match read_pointer(&git_dir.join("commondir")) {
        Some(common) if common.is_absolute() => common,
        Some(common) => git_dir.join(common),
        None => git_dir.to_path_buf(),
    }
}

/// The admin dir (`<common>/worktrees/<name>`) of the linked worktree at `worktree`:
/// the one whose `gitdir` file names `<worktree>/.git`.
pub(super) fn worktree_admin_dir(common: &Path, worktree: &Path) -> Option<PathBuf> {
    let mut wanted = vec![worktree.join(".git")];
    if let Ok(canonical) = std::fs::canonicalize(worktree) {
        wanted.push(canonical.join(".git"));
    }
    let entries = std::fs::read_dir(common.join("worktrees")).ok()?;
    entries.filter_map(Result::ok).find_map(|entry| {
        let admin = entry.path();
        let named = read_pointer(&admin.join("gitdir"))?;
        (is_dir_no_follow(&admin) && wanted.contains(&named)).then_some(admin)
    })
}

/// A temporary git dir of the server's own making, removed on drop. See the module
/// documentation.
pub(super) struct View {
    dir: tempfile::TempDir,
    objects: PathBuf,
}

impl View {
    /// A view of the repository whose common dir is `common`, with a copy of the index
    /// at `index` when there is one git can use (else no index file: an empty index).
    pub(super) async fn create(common: &Path, index: Option<&Path>) -> Result<Self, GitError> {
        let dir = tempfile::Builder::new()
            .prefix("agentry-git-view-")
            .tempdir()?;
        let root = dir.path().to_path_buf();
        std::fs::create_dir(root.join("refs"))?;
        std::fs::write(root.join("HEAD"), "ref: refs/heads/view\n")?;
        std::fs::write(root.join("config"), view_config(0, "sha1"))?;
        let view = Self {
            dir,
            objects: common.join("objects"),
        };

        // The repository's format, read as a plain file: `--file` follows no include.
        let mut cmd = view.git(&root, None);
        cmd.args(["config", "--file"])
            .arg(common.join("config"))
            .args([
                "--get-regexp",
                r"^(core\.repositoryformatversion|extensions\.objectformat)$",
            ]);
        let out = run(cmd).await?;
        let (mut version, mut format) = (0u32, "sha1");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            match line.split_once(' ') {
                Some(("core.repositoryformatversion", "1")) => version = 1,
                Some(("extensions.objectformat", value))
                    if value.eq_ignore_ascii_case("sha256") =>
                {
                    format = "sha256";
                }
                _ => {}
            }
        }
        if format != "sha1" || version != 0 {
            std::fs::write(view.dir.path().join("config"), view_config(version, format))?;
        }

        if let Some(index) = index {
            view.copy_index(index);
        }
        Ok(view)
    }

    /// The view's own index file.
    pub(super) fn index(&self) -> PathBuf {
        self.dir.path().join("index")
    }

    /// Replaces the view's index with a copy of `source`, or leaves none (an empty
    /// index) when `source` is not a regular file that can be read.
    fn copy_index(&self, source: &Path) {
        let target = self.index();
        let copied = open_regular(source).and_then(|mut from| {
            let mut to = std::fs::File::create(&target)?;
            std::io::copy(&mut from, &mut to)
        });
        if copied.is_err() {
            self.forget_index();
        }
    }

    /// Removes the view's index (git then reads an empty one).
    pub(super) fn forget_index(&self) {
        let _ = std::fs::remove_file(self.index());
        let _ = std::fs::remove_file(self.dir.path().join("index.lock"));
    }

    /// A git command on `work_tree` through this view, with `index` as the index file
    /// (the view's own copy when `None`). It runs in `work_tree`.
    pub(super) fn git(&self, work_tree: &Path, index: Option<&Path>) -> Command {
        let mut cmd = command();
        cmd.arg("--git-dir")
            .arg(self.dir.path())
            .arg("--work-tree")
            .arg(work_tree)
            .current_dir(work_tree)
            .env("GIT_OBJECT_DIRECTORY", &self.objects)
            .env(
                "GIT_INDEX_FILE",
                index.map_or_else(|| self.index(), Path::to_path_buf),
            );
        cmd
    }
}

fn view_config(version: u32, format: &str) -> String {
    let version = if format == "sha1" { version } else { 1 };
    let mut config = format!("[core]\n\trepositoryformatversion = {version}\n");
    if format != "sha1" {
        config.push_str(&format!("[extensions]\n\tobjectformat = {format}\n"));
    }
    config
}
