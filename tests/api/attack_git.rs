//! Issue 37, item 2: nothing a worktree, a checkout or its repository's config chose
//! runs on the server, and agents cannot write git's metadata or through a symlink.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::json;

use reqwest::Method;

use crate::helpers::{git, git_repo, spawn_app};
use crate::people::{person, team};

/// A script recording `$1` in `<dir>/ran` and copying stdin to stdout.
fn evil_script(dir: &Path) -> (PathBuf, PathBuf) {
    let marker = dir.join("ran");
    let script = dir.join("evil.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\necho \"$1\" >> '{}'\ncat\n", marker.display()),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, marker)
}

/// What an unconfined agent could write into a git dir: drivers, fsmonitor, hooks in
/// the hooks dir and through `core.hooksPath`, and an include doing the same.
fn plant(git_dir: &Path, script: &Path) {
    let s = script.display();
    let hooks = git_dir.join("planted-hooks");
    for dir in [git_dir.join("hooks"), hooks.clone()] {
        std::fs::create_dir_all(&dir).unwrap();
        for hook in ["post-checkout", "reference-transaction", "pre-commit"] {
            let path = dir.join(hook);
            std::fs::write(&path, format!("#!/bin/sh\n{s} hook-{hook} </dev/null\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    let drivers = format!(
        "[filter \"x\"]\n\tclean = {s} clean\n\tsmudge = {s} smudge\n\tprocess = {s} process\n\
         [diff \"x\"]\n\ttextconv = {s} textconv\n\tcommand = {s} diffcmd\n\
         [diff]\n\texternal = {s} external\n\
         [core]\n\tfsmonitor = {s} fsmonitor\n\thooksPath = {}\n",
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

fn change_files(dir: &Path) {
    std::fs::write(dir.join("README.md"), "# demo\nchanged by the agent\n").unwrap();
    std::fs::remove_file(dir.join("doomed.txt")).unwrap();
    std::fs::write(dir.join("new.txt"), "untracked\n").unwrap();
}

#[tokio::test]
async fn planted_git_configuration_never_runs() {
    let app = spawn_app().await;
    let evil = tempfile::tempdir().unwrap();
    let (script, marker) = evil_script(evil.path());
    let repo = git_repo();
    std::fs::write(repo.path().join(".gitattributes"), "* filter=x diff=x\n").unwrap();
    std::fs::write(repo.path().join("doomed.txt"), "bye\n").unwrap();
    git(repo.path(), &["add", "."]);
    git(repo.path(), &["commit", "-q", "-m", "attributes"]);
    plant(&repo.path().join(".git"), &script);

    // The project is in the team of a plain owner, who makes and loads the workspaces;
    // the admin loads them too.
    let ana = person(&app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": "planted", "team_id": team_a, "repo_path": repo.path()}),
            201,
        )
        .await;
    let worktree = ana
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    let directory = ana
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"], "kind": "directory"})),
            201,
        )
        .await;
    let wt_path = PathBuf::from(worktree["path"].as_str().unwrap());
    assert!(
        wt_path.join("doomed.txt").exists(),
        "the worktree is checked out"
    );

    // The worktree's `.git` file now names a git dir of the agent's making.
    let planted = evil.path().join("planted.git");
    std::fs::create_dir_all(planted.join("refs")).unwrap();
    std::fs::create_dir_all(planted.join("objects")).unwrap();
    std::fs::write(planted.join("HEAD"), "ref: refs/heads/x\n").unwrap();
    plant(&planted, &script);
    std::fs::write(
        wt_path.join(".git"),
        format!("gitdir: {}\n", planted.display()),
    )
    .unwrap();
    change_files(&wt_path);
    change_files(repo.path());

    for (ws, by_admin) in [
        (&worktree, false),
        (&directory, false),
        (&worktree, true),
        (&directory, true),
    ] {
        let path = format!("/v1/workspaces/{}/diff", ws["id"].as_str().unwrap());
        let diff = if by_admin {
            app.get_ok(&path).await
        } else {
            ana.api.ok(Method::GET, &path, None, 200).await
        };
        let files: Vec<(String, String)> = diff["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["path"].as_str().unwrap().to_owned(),
                    f["status"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(
            files,
            [
                ("README.md".to_owned(), "modified".to_owned()),
                ("doomed.txt".to_owned(), "deleted".to_owned()),
                ("new.txt".to_owned(), "added".to_owned()),
            ],
            "{diff}"
        );
        assert!(
            diff["patch"]
                .as_str()
                .unwrap()
                .contains("+changed by the agent")
        );
    }
    // Another workspace, made after the planting, and archiving them all.
    let again = ana
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    for ws in [&worktree, &directory, &again] {
        let path = format!("/v1/workspaces/{}/archive", ws["id"].as_str().unwrap());
        ana.api.ok(Method::POST, &path, Some(json!({})), 200).await;
    }
    assert!(!wt_path.exists());
    assert!(
        !marker.exists(),
        "planted code ran: {}",
        std::fs::read_to_string(&marker).unwrap()
    );
}

#[tokio::test]
async fn mock_writes_refuse_git_paths_and_symlinks() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    for kind in ["worktree", "directory"] {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("file"), "precious").unwrap();
        let ws = app
            .post_ok(
                "/v1/workspaces",
                json!({"project_id": project["id"], "kind": kind}),
                201,
            )
            .await;
        let agent = app
            .post_ok(
                "/v1/agents",
                json!({"workspace_id": ws["id"], "provider": "mock"}),
                201,
            )
            .await;
        let agent = agent["id"].as_str().unwrap();
        app.wait(agent).await;
        let path = PathBuf::from(ws["path"].as_str().unwrap());
        let git_meta = |p: &Path| {
            let git = p.join(".git");
            if git.is_dir() {
                std::fs::read_to_string(git.join("config")).unwrap()
            } else {
                std::fs::read_to_string(git).unwrap()
            }
        };
        let before = git_meta(&path);
        std::os::unix::fs::symlink(outside.path(), path.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("file"), path.join("filelink")).unwrap();

        for target in [
            ".git/config",
            ".git",
            "sub/.git/x",
            ".GIT/config",
            ".git./config",
            "link/x",
            "link/new/x",
            "filelink",
        ] {
            let reply = write(&app, agent, &format!("{target} evil")).await;
            assert!(
                reply.contains(&format!("Could not write {target}:")),
                "{kind} {target}: {reply}"
            );
            assert!(reply.contains("\"failed\""), "{kind} {target}: {reply}");
        }
        assert_eq!(git_meta(&path), before, "{kind}");
        assert!(!path.join("sub").exists());
        assert!(!path.join(".GIT").exists());
        assert!(!path.join(".git.").exists());
        assert_eq!(
            std::fs::read_to_string(outside.path().join("file")).unwrap(),
            "precious"
        );
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 1);

        let reply = write(&app, agent, "notes/ok.txt fine").await;
        assert!(reply.contains("Wrote"), "{reply}");
        assert_eq!(
            std::fs::read_to_string(path.join("notes/ok.txt")).unwrap(),
            "fine"
        );
        std::fs::remove_file(path.join("link")).unwrap();
        std::fs::remove_file(path.join("filelink")).unwrap();
    }
}

/// `/write <args>` through the mock; returns the text of the turn's events.
async fn write(app: &crate::helpers::TestApp, agent: &str, args: &str) -> String {
    let before = app.timeline(agent).await.len();
    app.prompt(agent, &format!("/write {args}")).await;
    app.wait(agent).await;
    let events = app.timeline(agent).await;
    serde_json::to_string(&events[before..]).unwrap()
}
