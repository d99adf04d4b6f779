use std::path::{Path, PathBuf};

use super::*;

/// Runs git synchronously for test setup, with an identity so commits work.
fn sh(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args([
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.com",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "core.hooksPath=/dev/null",
        ])
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        .output()
        .expect("run git");
    assert!(
        out.status.success(),
        "git {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim_end().to_owned()
}

/// A temp dir holding a repository at `repo/` on branch `trunk` with one commit.
struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    repo: PathBuf,
    base: String,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let repo = root.join("repo");
    std::fs::create_dir(&repo).unwrap();
    sh(&repo, &["init", "-q", "-b", "trunk"]);
    std::fs::write(repo.join("keep.txt"), "one\ntwo\nthree\n").unwrap();
    std::fs::write(repo.join("gone.txt"), "bye\n").unwrap();
    std::fs::write(repo.join(".gitignore"), "*.log\n").unwrap();
    sh(&repo, &["add", "-A"]);
    sh(&repo, &["commit", "-q", "-m", "initial"]);
    let base = sh(&repo, &["rev-parse", "HEAD"]);
    Fixture {
        _dir: dir,
        root,
        repo,
        base,
    }
}

#[tokio::test]
async fn inspect_reports_toplevel_and_branch() {
    let f = fixture();
    let info = inspect_repo(&f.repo).await.unwrap();
    assert_eq!(info.toplevel, f.repo);
    assert_eq!(info.default_branch, "trunk");

    // A subdirectory resolves to the top level.
    std::fs::create_dir(f.repo.join("sub")).unwrap();
    let info = inspect_repo(&f.repo.join("sub")).await.unwrap();
    assert_eq!(info.toplevel, f.repo);
}

#[tokio::test]
async fn inspect_detached_head_falls_back_to_main() {
    let f = fixture();
    sh(&f.repo, &["checkout", "-q", "--detach"]);
    let err = inspect_repo(&f.repo).await.unwrap_err();
    assert!(matches!(err, GitError::Failed(_)), "{err:?}");

    sh(&f.repo, &["branch", "main"]);
    let info = inspect_repo(&f.repo).await.unwrap();
    assert_eq!(info.default_branch, "main");
}

#[tokio::test]
async fn inspect_rejects_non_repositories() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let err = inspect_repo(&plain).await.unwrap_err();
    assert!(matches!(err, GitError::NotARepository(_)), "{err:?}");

    let missing = dir.path().join("missing");
    let err = inspect_repo(&missing).await.unwrap_err();
    assert!(matches!(err, GitError::NotARepository(_)), "{err:?}");

    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let err = inspect_repo(&file).await.unwrap_err();
    assert!(matches!(err, GitError::NotARepository(_)), "{err:?}");

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    sh(&empty, &["init", "-q", "-b", "trunk"]);
    let err = inspect_repo(&empty).await.unwrap_err();
    assert!(matches!(err, GitError::EmptyRepository(_)), "{err:?}");
}

#[tokio::test]
async fn resolve_commit_gives_full_ids() {
    let f = fixture();
    assert_eq!(resolve_commit(&f.repo, "HEAD").await.unwrap(), f.base);
    assert_eq!(resolve_commit(&f.repo, "trunk").await.unwrap(), f.base);
    assert_eq!(
        resolve_commit(&f.repo, &f.base[..10]).await.unwrap(),
        f.base
    );
    for bad in ["nope", "-x", "--all", "", "HEAD~5"] {
        let err = resolve_commit(&f.repo, bad).await.unwrap_err();
        assert!(
            matches!(err, GitError::UnknownRevision(_)),
            "{bad}: {err:?}"
        );
    }
}

#[tokio::test]
async fn branch_names_are_checked() {
    let f = fixture();
    for good in ["feature/x", "agent-1", "a.b"] {
        check_branch_name(&f.repo, good).await.unwrap();
    }
    let long = "a".repeat(MAX_BRANCH_LEN + 1);
    for bad in [
        "a..b",
        "-x",
        "has space",
        "/abs",
        "refs/../x",
        "",
        "@",
        "@{-1}",
        "HEAD",
        "x.lock",
        "tab\there",
        "a/",
        long.as_str(),
    ] {
        let err = check_branch_name(&f.repo, bad).await.unwrap_err();
        assert!(matches!(err, GitError::InvalidBranch(_)), "{bad}: {err:?}");
    }
}

#[tokio::test]
async fn branch_exists_checks_local_branches() {
    let f = fixture();
    assert!(branch_exists(&f.repo, "trunk").await.unwrap());
    assert!(!branch_exists(&f.repo, "nope").await.unwrap());
}

#[tokio::test]
async fn worktree_add_creates_branch_at_base() {
    let f = fixture();
    // Move the repository past the base so the worktree must start from `base`.
    std::fs::write(f.repo.join("later.txt"), "later\n").unwrap();
    sh(&f.repo, &["add", "-A"]);
    sh(&f.repo, &["commit", "-q", "-m", "later"]);

    let path = f.root.join("worktrees/deep/one");
    worktree_add(&f.repo, &path, "agent/one", &f.base)
        .await
        .unwrap();
    assert_eq!(sh(&path, &["rev-parse", "HEAD"]), f.base);
    assert_eq!(sh(&path, &["symbolic-ref", "--short", "HEAD"]), "agent/one");
    assert!(path.join("keep.txt").exists());
    assert!(!path.join("later.txt").exists());
    // Files and index were filled together: nothing shows as changed.
    assert_eq!(sh(&path, &["status", "--porcelain"]), "");
    assert!(branch_exists(&f.repo, "agent/one").await.unwrap());

    let other = f.root.join("worktrees/two");
    let err = worktree_add(&f.repo, &other, "agent/one", &f.base)
        .await
        .unwrap_err();
    assert!(matches!(err, GitError::BranchExists(_)), "{err:?}");
    assert!(!other.exists());

    // The path must not exist yet.
    let err = worktree_add(&f.repo, &path, "agent/two", &f.base)
        .await
        .unwrap_err();
    assert!(matches!(err, GitError::Failed(_)), "{err:?}");
    assert!(!branch_exists(&f.repo, "agent/two").await.unwrap());

    let err = worktree_add(&f.repo, &other, "agent/two", "no-such-rev")
        .await
        .unwrap_err();
    assert!(matches!(err, GitError::UnknownRevision(_)), "{err:?}");

    for bad in ["a..b", "-x", "has space", "/abs", "refs/../x"] {
        let err = worktree_add(&f.repo, &other, bad, &f.base)
            .await
            .unwrap_err();
        assert!(matches!(err, GitError::InvalidBranch(_)), "{bad}: {err:?}");
    }
    assert!(!other.exists());
}

#[tokio::test]
async fn worktree_remove_keeps_branch() {
    let f = fixture();
    let path = f.root.join("wt");
    worktree_add(&f.repo, &path, "agent/rm", &f.base)
        .await
        .unwrap();
    std::fs::write(path.join("dirty.txt"), "uncommitted\n").unwrap();
    std::fs::write(path.join("keep.txt"), "changed\n").unwrap();
    let entry = format!("worktree {}", path.display());
    let listed = |repo: &std::path::Path| {
        sh(repo, &["worktree", "list", "--porcelain"])
            .lines()
            .any(|l| l == entry)
    };
    assert!(listed(&f.repo), "git lists the worktree by this path");

    worktree_remove(&f.repo, &path).await.unwrap();
    assert!(!path.exists());
    assert!(branch_exists(&f.repo, "agent/rm").await.unwrap());
    assert!(f.repo.join("keep.txt").exists());
    // By its path: the temporary directory's random name may itself contain "wt".
    assert!(!listed(&f.repo));

    // Already gone: still fine.
    worktree_remove(&f.repo, &path).await.unwrap();

    // A directory deleted behind git's back is pruned.
    let path2 = f.root.join("wt2");
    worktree_add(&f.repo, &path2, "agent/rm2", &f.base)
        .await
        .unwrap();
    std::fs::remove_dir_all(&path2).unwrap();
    worktree_remove(&f.repo, &path2).await.unwrap();
    assert!(!sh(&f.repo, &["worktree", "list"]).contains("wt2"));
    assert!(branch_exists(&f.repo, "agent/rm2").await.unwrap());

    // The branch can be checked out again in a new worktree.
    sh(
        &f.repo,
        &[
            "worktree",
            "add",
            "-q",
            path2.to_str().unwrap(),
            "agent/rm2",
        ],
    );
}

#[tokio::test]
async fn worktree_remove_refuses_non_worktrees() {
    let f = fixture();
    let plain = f.root.join("plain");
    std::fs::create_dir(&plain).unwrap();
    std::fs::write(plain.join("precious"), "x").unwrap();
    assert!(worktree_remove(&f.repo, &plain).await.is_err());
    assert!(plain.join("precious").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_worktree_adds_succeed() {
    let f = fixture();
    let paths: Vec<PathBuf> = ["wts/a", "wts/b", "other/a", "wts/d"]
        .iter()
        .map(|dir| f.root.join(dir))
        .collect();
    let (a, b, c, d) = tokio::join!(
        worktree_add(&f.repo, &paths[0], "par/a", &f.base),
        worktree_add(&f.repo, &paths[1], "par/b", &f.base),
        worktree_add(&f.repo, &paths[2], "par/c", &f.base),
        worktree_add(&f.repo, &paths[3], "par/d", &f.base),
    );
    a.unwrap();
    b.unwrap();
    c.unwrap();
    d.unwrap();
    for (dir, branch) in [
        ("wts/a", "par/a"),
        ("wts/b", "par/b"),
        ("other/a", "par/c"),
        ("wts/d", "par/d"),
    ] {
        let path = f.root.join(dir);
        assert_eq!(sh(&path, &["symbolic-ref", "--short", "HEAD"]), branch);
    }
}

#[tokio::test]
async fn diff_covers_tracked_and_untracked_changes() {
    let f = fixture();
    let wt = f.root.join("wt");
    worktree_add(&f.repo, &wt, "agent/diff", &f.base)
        .await
        .unwrap();

    std::fs::write(wt.join("keep.txt"), "one\n2\nthree\nfour\n").unwrap();
    std::fs::remove_file(wt.join("gone.txt")).unwrap();
    std::fs::create_dir(wt.join("new")).unwrap();
    std::fs::write(wt.join("new/file.txt"), "brand new content\nsecond\n").unwrap();
    std::fs::write(wt.join("debug.log"), "ignored\n").unwrap();
    std::fs::write(wt.join("blob.bin"), [0u8, 1, 2, 3, 0, 255, 0, 7]).unwrap();

    let diff = diff(&f.repo, &wt, "HEAD").await.unwrap();
    assert_eq!(diff.base_commit, f.base);
    let files: Vec<_> = diff
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.status.as_str(), f.additions, f.deletions))
        .collect();
    assert_eq!(
        files,
        [
            ("blob.bin", "added", 0, 0),
            ("gone.txt", "deleted", 0, 1),
            ("keep.txt", "modified", 2, 1),
            ("new/file.txt", "added", 2, 0),
        ]
    );
    assert!(diff.patch.contains("+brand new content"), "{}", diff.patch);
    assert!(diff.patch.contains("diff --git a/keep.txt b/keep.txt"));
    assert!(!diff.patch.contains("debug.log"));

    // The worktree's own index is untouched: the new file is still untracked.
    assert!(sh(&wt, &["status", "--porcelain"]).contains("?? new/"));
    // No temporary index is left behind.
    let git_dir = PathBuf::from(sh(&wt, &["rev-parse", "--absolute-git-dir"]));
    let leftovers: Vec<_> = std::fs::read_dir(git_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("agentry-diff-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn diff_detects_renames_and_committed_work() {
    let f = fixture();
    let wt = f.root.join("wt");
    worktree_add(&f.repo, &wt, "agent/ren", &f.base)
        .await
        .unwrap();
    std::fs::write(wt.join("committed.txt"), "c\n").unwrap();
    sh(&wt, &["add", "committed.txt"]);
    sh(&wt, &["commit", "-q", "-m", "work"]);
    sh(&wt, &["mv", "keep.txt", "moved.txt"]);

    let diff = diff(&f.repo, &wt, &f.base).await.unwrap();
    let files: Vec<_> = diff
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.status.as_str(), f.additions, f.deletions))
        .collect();
    assert_eq!(
        files,
        [
            ("committed.txt", "added", 1, 0),
            ("moved.txt", "renamed", 0, 0),
        ]
    );

    let clean = super::diff(&f.repo, &f.repo, &f.base).await.unwrap();
    assert!(clean.files.is_empty());
    assert!(clean.patch.is_empty());

    let err = super::diff(&f.repo, &wt, "-p").await.unwrap_err();
    assert!(matches!(err, GitError::UnknownRevision(_)), "{err:?}");
}

#[tokio::test]
async fn diff_patch_is_capped() {
    let f = fixture();
    let line = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde\n";
    let big = line.repeat(PATCH_LIMIT / line.len() + 1000);
    std::fs::write(f.repo.join("big.txt"), &big).unwrap();

    let diff = diff(&f.repo, &f.repo, "HEAD").await.unwrap();
    assert_eq!(diff.files.len(), 1);
    assert_eq!(
        diff.files[0].additions,
        (PATCH_LIMIT / line.len() + 1000) as u64
    );
    let note = "\n[patch truncated at 8 MiB]\n";
    assert!(diff.patch.ends_with(note));
    let body = &diff.patch[..diff.patch.len() - note.len()];
    assert!(body.len() <= PATCH_LIMIT);
    assert!(body.ends_with('\n'));
    assert!(body.ends_with(&format!("+{line}")));
}

#[test]
fn slugs() {
    assert_eq!(slugify("Fix the Login bug!"), "fix-the-login-bug");
    assert_eq!(slugify("  --Hello__World--  "), "hello-world");
    assert_eq!(slugify("Ünïcödé ✨"), "n-c-d");
    assert_eq!(slugify(""), "workspace");
    assert_eq!(slugify("!!!"), "workspace");
    let long = slugify(&"word ".repeat(20));
    assert!(long.len() <= 40, "{long}");
    assert!(!long.ends_with('-'));
    assert_eq!(slugify(&"a".repeat(50)), "a".repeat(40));
}

#[tokio::test]
async fn repo_locks_are_shared_per_path() {
    let f = fixture();
    let guard = lock_repo(&f.repo).await;
    // Same repository through another spelling of its path: must wait.
    let other_spelling = f.repo.join("../repo");
    let waited = tokio::time::timeout(
        std::time::Duration::from_millis(50),
        lock_repo(&other_spelling),
    )
    .await;
    assert!(waited.is_err());
    // Another repository is independent.
    let _other = lock_repo(&f.root).await;
    drop(guard);
    let _again = lock_repo(&other_spelling).await;
}

#[tokio::test]
async fn repositories_owned_by_another_user_are_usable() {
    // Only meaningful when the tests can hand a repository to another user.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let f = fixture();
    let status = std::process::Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&f.repo)
        .status()
        .unwrap();
    assert!(status.success());

    let info = inspect_repo(&f.repo).await.unwrap();
    assert_eq!(info.default_branch, "trunk");
    std::fs::write(f.repo.join("keep.txt"), "changed\n").unwrap();
    let diff = diff(&f.repo, &f.repo, &f.base).await.unwrap();
    assert_eq!(diff.files.len(), 1);
    let wt = f.root.join("wt");
    worktree_add(&f.repo, &wt, "agent/foreign", &f.base)
        .await
        .unwrap();
    worktree_remove(&f.repo, &wt).await.unwrap();
}

#[tokio::test]
async fn repository_hooks_never_run() {
    use std::os::unix::fs::PermissionsExt;
    let f = fixture();
    let marker = f.root.join("hook-ran");
    let hook = f.repo.join(".git/hooks/post-checkout");
    std::fs::write(&hook, format!("#!/bin/sh\ntouch {}\n", marker.display())).unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The hook works when git runs it normally…
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(&f.repo)
        .args(["checkout", "-q", "-b", "probe"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(marker.exists(), "the hook is live");
    std::fs::remove_file(&marker).unwrap();
    // …but not when agentry creates or removes a worktree.
    let path = f.root.join("worktrees/hooked");
    worktree_add(&f.repo, &path, "agent/hooked", &f.base)
        .await
        .unwrap();
    worktree_remove(&f.repo, &path).await.unwrap();
    assert!(!marker.exists(), "a repository hook ran");
}

/// An executable script at `root/evil.sh` that records `$1` in `root/ran` and copies
/// stdin to stdout (so it also works as a filter); returns the path of `ran`.
fn evil_script(root: &Path) -> (PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let marker = root.join("ran");
    let script = root.join("evil.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\necho \"$1\" >> '{}'\ncat\n", marker.display()),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, marker)
}

/// Plants in `git_dir` every program-running configuration an agent could write: a
/// filter and diff driver, external diff, fsmonitor, hooks (in the hooks dir and
/// through `core.hooksPath`), and an `include.path` to a config doing the same.
fn plant(git_dir: &Path, script: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let s = script.display();
    let hooks = git_dir.join("planted-hooks");
    for dir in [git_dir.join("hooks"), hooks.clone()] {
        std::fs::create_dir_all(&dir).unwrap();
        for hook in [
            "post-checkout",
            "reference-transaction",
            "pre-commit",
            "post-index-change",
        ] {
            let path = dir.join(hook);
            std::fs::write(&path, format!("#!/bin/sh\n{s} hook-{hook} </dev/null\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    let drivers = format!(
        "[filter \"x\"]\n\tclean = {s} clean\n\tsmudge = {s} smudge\n\trequired = true\n\
         [diff \"x\"]\n\ttextconv = {s} textconv\n\tcommand = {s} diffcmd\n\
         [diff]\n\texternal = {s} external\n\
         [core]\n\tfsmonitor = {s} fsmonitor\n\thooksPath = {}\n\
         [alias]\n\tdiff = !{s} alias\n",
        hooks.display()
    );
    std::fs::write(git_dir.join("included.config"), &drivers).unwrap();
    let mut config = std::fs::read_to_string(git_dir.join("config")).unwrap_or_default();
    config.push_str(&drivers);
    config.push_str(&format!(
        "[include]\n\tpath = {}\n",
        git_dir.join("included.config").display()
    ));
    std::fs::write(git_dir.join("config"), config).unwrap();
}

#[tokio::test]
async fn nothing_a_repository_or_tree_plants_runs() {
    let f = fixture();
    let (script, marker) = evil_script(&f.root);
    // The base commit selects the driver for every file.
    std::fs::write(f.repo.join(".gitattributes"), "* filter=x diff=x\n").unwrap();
    sh(&f.repo, &["add", "-A"]);
    sh(&f.repo, &["commit", "-q", "-m", "attributes"]);
    let base = sh(&f.repo, &["rev-parse", "HEAD"]);
    plant(&f.repo.join(".git"), &script);

    let wt = f.root.join("wt");
    worktree_add(&f.repo, &wt, "agent/planted", &base)
        .await
        .unwrap();
    assert!(wt.join("keep.txt").exists());
    assert_eq!(
        std::fs::read_to_string(wt.join("gone.txt")).unwrap(),
        "bye\n"
    );

    // The worktree's `.git` file now points at a git dir of the agent's making.
    let planted = f.root.join("planted.git");
    std::fs::create_dir_all(planted.join("refs")).unwrap();
    std::fs::write(planted.join("HEAD"), "ref: refs/heads/x\n").unwrap();
    plant(&planted, &script);
    std::fs::write(wt.join(".git"), format!("gitdir: {}\n", planted.display())).unwrap();

    for dir in [&wt, &f.repo] {
        std::fs::write(dir.join("keep.txt"), "one\nchanged\n").unwrap();
        std::fs::remove_file(dir.join("gone.txt")).unwrap();
        std::fs::write(dir.join("new.txt"), "new\n").unwrap();
        std::fs::write(dir.join("sub.gitattributes"), "* filter=x\n").unwrap();
    }
    for (tree, expected_base) in [(&wt, &base), (&f.repo, &base)] {
        let diff = diff(&f.repo, tree, &base).await.unwrap();
        assert_eq!(&diff.base_commit, expected_base);
        let files: Vec<_> = diff
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.status.as_str()))
            .collect();
        assert_eq!(
            files,
            [
                ("gone.txt", "deleted"),
                ("keep.txt", "modified"),
                ("new.txt", "added"),
                ("sub.gitattributes", "added"),
            ]
        );
        assert!(diff.patch.contains("+changed"), "{}", diff.patch);
    }
    inspect_repo(&f.repo).await.unwrap();
    read_committed_file(&f.repo, &base, ".gitattributes", 1024)
        .await
        .unwrap()
        .unwrap();
    worktree_remove(&f.repo, &wt).await.unwrap();
    assert!(!wt.exists());
    assert!(
        planted.join("config").exists(),
        "only the worktree is removed"
    );
    branch_delete(&f.repo, "agent/planted").await.unwrap();
    assert!(
        !marker.exists(),
        "{}",
        std::fs::read_to_string(&marker).unwrap()
    );

    // The planted configuration is live when git runs in the repository the usual way.
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(&f.repo)
        .args(["add", "-A"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(marker.exists(), "the planted filter is live");
}

#[tokio::test]
async fn the_builder_pins_config_and_environment() {
    let f = fixture();
    let mut cmd = at(&f.repo.join(".git"));
    cmd.args(["config", "--show-origin", "--get-all", "core.hooksPath"])
        .env("GIT_DIR", "/nowhere");
    // Variables of the server's own environment are not passed on either.
    let out = run(cmd).await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "command line:\t/dev/null"
    );
    let mut cmd = command();
    cmd.args(["var", "GIT_EDITOR"]);
    let out = run(cmd).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), ":");
    let std_cmd = command();
    let envs: std::collections::HashMap<_, _> = std_cmd.as_std().get_envs().collect();
    assert_eq!(
        envs[std::ffi::OsStr::new("GIT_CONFIG_GLOBAL")],
        Some(std::ffi::OsStr::new("/dev/null"))
    );
    assert_eq!(
        envs[std::ffi::OsStr::new("HOME")],
        Some(std::ffi::OsStr::new("/dev/null"))
    );
}

#[tokio::test]
async fn a_view_reads_no_repository_config() {
    let f = fixture();
    let (script, marker) = evil_script(&f.root);
    plant(&f.repo.join(".git"), &script);
    let view = view::View::create(&f.repo.join(".git"), Some(&f.repo.join(".git/index")))
        .await
        .unwrap();
    let mut cmd = view.git(&f.repo, None);
    cmd.args(["config", "--list", "--show-origin"]);
    let listed = String::from_utf8(run_ok(cmd, "config").await.unwrap()).unwrap();
    assert!(!listed.contains("filter.x"), "{listed}");
    assert!(!listed.contains("include"), "{listed}");
    assert!(
        listed.contains("core.repositoryformatversion=0"),
        "{listed}"
    );
    // The index was copied: the committed files are tracked, nothing is changed.
    let mut cmd = view.git(&f.repo, None);
    cmd.args(["diff", "--name-only", "--no-ext-diff"]);
    assert!(run_ok(cmd, "diff").await.unwrap().is_empty());
    let mut cmd = view.git(&f.repo, None);
    cmd.args(["ls-files"]);
    let listed = String::from_utf8(run_ok(cmd, "ls-files").await.unwrap()).unwrap();
    assert!(listed.contains("keep.txt"), "{listed}");
    assert!(!marker.exists());

    // A view of a SHA-256 repository says so, and only that.
    let sha256 = f.root.join("sha256");
    std::fs::create_dir(&sha256).unwrap();
    sh(&sha256, &["init", "-q", "--object-format=sha256"]);
    let view = view::View::create(&sha256.join(".git"), None)
        .await
        .unwrap();
    let mut cmd = view.git(&sha256, None);
    cmd.args(["rev-parse", "--show-object-format"]);
    assert_eq!(
        String::from_utf8(run_ok(cmd, "rev-parse").await.unwrap())
            .unwrap()
            .trim(),
        "sha256"
    );
}

#[tokio::test]
async fn a_dot_git_file_is_no_repository() {
    let f = fixture();
    let other = f.root.join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(
        other.join(".git"),
        format!("gitdir: {}\n", f.repo.join(".git").display()),
    )
    .unwrap();
    let err = inspect_repo(&other).await.unwrap_err();
    assert!(matches!(err, GitError::NotARepository(_)), "{err:?}");
    let err = resolve_commit(&other, "HEAD").await.unwrap_err();
    assert!(matches!(err, GitError::NotARepository(_)), "{err:?}");
}
