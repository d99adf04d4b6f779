//! Worktrees: branch and base, directories, concurrency and path validation.

use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn worktrees_start_from_the_right_base_on_their_own_branch() {
    let app = spawn_app().await;
    let repo = git_repo();
    let first = git(repo.path(), &["rev-parse", "HEAD"]).trim().to_owned();
    std::fs::write(repo.path().join("later.txt"), "x").unwrap();
    git(repo.path(), &["add", "."]);
    git(repo.path(), &["commit", "-q", "-m", "later"]);
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "base_ref": first, "branch": "feature/x"}),
            201,
        )
        .await;
    assert_eq!(ws["base_commit"], first.as_str());
    let path = path_of(&ws["path"]);
    assert_eq!(git(&path, &["rev-parse", "HEAD"]).trim(), first);
    assert_eq!(
        git(&path, &["branch", "--show-current"]).trim(),
        "feature/x"
    );
    assert!(!path.join("later.txt").exists());
    let dup = app
        .post(
            "/v1/workspaces",
            json!({"project_id": project["id"], "branch": "feature/x"}),
        )
        .await;
    assert_eq!(expect_status(dup, 409).await["code"], "branch_exists");

    // Two at once on one repository both succeed, on distinct branches.
    let (a, b) = tokio::join!(
        app.post(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "same"})
        ),
        app.post(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "same"})
        ),
    );
    let (a, b) = (expect_status(a, 201).await, expect_status(b, 201).await);
    assert_ne!(a["branch"], b["branch"]);
    assert_ne!(a["path"], b["path"]);

    let dir = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "kind": "directory"}),
            201,
        )
        .await;
    assert_eq!(dir["kind"], "directory");
    assert_eq!(
        path_of(&dir["path"]),
        std::fs::canonicalize(repo.path()).unwrap()
    );
}

#[tokio::test]
async fn names_and_refs_are_validated() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    for branch in ["../escape", "a..b", "-rf", "/abs", "has space", "x.lock"] {
        let r = app
            .post(
                "/v1/workspaces",
                json!({"project_id": project["id"], "branch": branch}),
            )
            .await;
        assert_eq!(
            expect_status(r, 422).await["code"],
            "validation_failed",
            "{branch}"
        );
    }
    for base in ["--upload-pack=x", "nope", "../../etc"] {
        let r = app
            .post(
                "/v1/workspaces",
                json!({"project_id": project["id"], "base_ref": base}),
            )
            .await;
        assert_eq!(
            expect_status(r, 422).await["code"],
            "validation_failed",
            "{base}"
        );
    }
    let r = app
        .post(
            "/v1/projects",
            json!({"name": "p", "repo_path": format!("{}/../{}", repo.path().display(), "x")}),
        )
        .await;
    assert_eq!(expect_status(r, 422).await["code"], "validation_failed");
    let r = app
        .post(
            "/v1/projects",
            json!({"name": "p", "repo_path": "relative/path"}),
        )
        .await;
    assert_eq!(expect_status(r, 422).await["code"], "validation_failed");
    let r = app.post("/v1/agents", json!({"workspace": {"project_id": project["id"], "branch": "../../x"}, "provider": "mock"})).await;
    assert_eq!(expect_status(r, 422).await["code"], "validation_failed");
}

#[tokio::test]
async fn an_agent_of_an_archived_workspace_cannot_be_prompted_again() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, ws) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    app.post_ok(&format!("/v1/workspaces/{ws}/archive"), json!({}), 200)
        .await;
    let res = app
        .post(
            &format!("/v1/agents/{agent}/messages"),
            json!({"text": "hello again"}),
        )
        .await;
    let body = expect_status(res, 409).await;
    assert_eq!(body["code"], "workspace_archived", "{body}");
    // The agent is still readable, and closed.
    let view = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(view["status"], "closed", "{view}");
}
