//! Issue 37, item 1: projects come only from places the team may use. A plain member of
//! team B tries to register team A's repository, system directories, missing paths and
//! escapes out of a root through `..` and symlinks; and remotes that would reach local
//! files, run commands, carry credentials or reach private addresses. Each is refused
//! with the same answer whether or not the path exists, and nothing is written. Then the
//! supported path: a project cloned from an authenticated remote over smart HTTP.

use std::path::Path;

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

#[path = "../support/git_http.rs"]
mod git_http;

use git_http::GitHttp;

/// The problem without what differs between two requests (its request id).
fn comparable(mut problem: Value) -> Value {
    if let Some(o) = problem.as_object_mut() {
        o.remove("instance");
        o.remove("request_id");
    }
    problem
}

async fn project_rows(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM projects")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// A git repository with one commit at `dir` (which must not exist yet).
fn repo_at(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    git(dir, &["init", "-q", "-b", "main"]);
    std::fs::write(dir.join("README.md"), "# demo\n").unwrap();
    git(dir, &["add", "."]);
    git(dir, &["commit", "-q", "-m", "initial"]);
}

#[tokio::test]
async fn a_member_cannot_register_a_path_outside_the_roots_of_their_team() {
    let roots = tempfile::tempdir().unwrap();
    let root_a = roots.path().join("alpha");
    let root_b = roots.path().join("beta");
    let shared = roots.path().join("shared");
    for r in [&root_a, &root_b, &shared] {
        std::fs::create_dir_all(r).unwrap();
    }
    let (ra, rb, rs) = (root_a.clone(), root_b.clone(), shared.clone());
    let app = spawn_app_with(move |s| {
        s.projects.local_roots = vec![
            agentry::config::LocalRoot {
                path: ra,
                teams: vec!["alpha".into()],
            },
            agentry::config::LocalRoot {
                path: rb,
                teams: vec!["beta".into()],
            },
            agentry::config::LocalRoot {
                path: rs,
                teams: vec!["alpha".into(), "beta".into()],
            },
        ];
    })
    .await;
    let ana = person(&app, "ana").await;
    let bob = person(&app, "bob").await;
    let team_a = team(&ana, "alpha").await;
    let team_b = team(&bob, "beta").await;

    // Team A registers its repository under its own root, and one under the shared root.
    let repo_a = root_a.join("web");
    repo_at(&repo_a);
    let shared_repo = shared.join("common");
    repo_at(&shared_repo);
    ana.api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "web", "team_id": team_a, "repo_path": repo_a})),
            201,
        )
        .await;
    ana.api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "common", "team_id": team_a, "repo_path": shared_repo})),
            201,
        )
        .await;
    let before = project_rows(&app).await;

    // Symlinks planted under team B's own root, leading out of it.
    std::os::unix::fs::symlink(&repo_a, root_b.join("to-alpha")).unwrap();
    std::os::unix::fs::symlink("/etc", root_b.join("to-etc")).unwrap();
    std::os::unix::fs::symlink("/nowhere/at/all", root_b.join("dangling")).unwrap();
    // A repository of team B's own outside every root (a temp dir).
    let elsewhere = git_repo();

    let attempts: Vec<String> = vec![
        repo_a.display().to_string(),
        "/etc".into(),
        "/".into(),
        "/definitely/not/here".into(),
        root_a.join("missing").display().to_string(),
        format!("{}/../alpha/web", root_b.display()),
        format!("{}/../alpha/missing", root_b.display()),
        root_b.join("to-alpha").display().to_string(),
        root_b.join("to-etc").display().to_string(),
        root_b.join("dangling").display().to_string(),
        elsewhere.path().display().to_string(),
    ];
    let mut answers = Vec::new();
    for path in &attempts {
        let (status, body) = bob
            .api
            .call(
                Method::POST,
                "/v1/projects",
                Some(json!({"name": "grab", "team_id": team_b, "repo_path": path})),
            )
            .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (403, Some("forbidden")),
            "{path}: {body}"
        );
        let detail = body["detail"].as_str().unwrap_or_default().to_owned();
        assert!(
            !detail.contains(path.as_str()),
            "the answer names no path: {detail}"
        );
        answers.push(comparable(body));
    }
    assert!(
        answers.windows(2).all(|w| w[0] == w[1]),
        "the same answer for existing and missing paths: {answers:#?}"
    );

    // Under the shared root, team A's repository is in use (also through a symlink).
    std::os::unix::fs::symlink(&shared_repo, shared.join("alias")).unwrap();
    for path in [shared_repo.clone(), shared.join("alias")] {
        bob.api
            .refused(
                Method::POST,
                "/v1/projects",
                Some(json!({"name": "grab", "team_id": team_b, "repo_path": path})),
                409,
                "repo_in_use",
            )
            .await;
    }
    assert_eq!(
        project_rows(&app).await,
        before,
        "no project row was written"
    );
    let listed = bob.api.ok(Method::GET, "/v1/projects", None, 200).await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 0, "{listed}");

    // What team B may use works: a repository under its own root.
    let repo_b = root_b.join("api");
    repo_at(&repo_b);
    bob.api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "api", "team_id": team_b, "repo_path": repo_b})),
            201,
        )
        .await;
    // A server admin may register any repository, for any team, shared or not.
    let admin = Caller::new(&app, &app.token);
    admin
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "common", "team_id": team_b, "repo_path": shared_repo})),
            201,
        )
        .await;
    admin
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "other", "team_id": team_b, "repo_path": elsewhere.path()})),
            201,
        )
        .await;
}

#[tokio::test]
async fn remotes_that_reach_local_files_run_commands_or_carry_credentials_are_refused() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    let marker = tempfile::tempdir().unwrap();
    let pwned = marker.path().join("pwned");
    let local = git_repo();
    let urls = [
        format!("file://{}", local.path().display()),
        format!("ext::sh -c touch% {}", pwned.display()),
        format!("ext::sh -c 'touch {}'", pwned.display()),
        "ssh://git@example.com/web.git".into(),
        "git@example.com:web.git".into(),
        "git://example.com/web.git".into(),
        local.path().display().to_string(),
        "https://user:pass@example.com/web.git".into(),
        "https://token@example.com/web.git".into(),
        "http://127.0.0.1:9/web.git".into(),
        "http://[::1]:9/web.git".into(),
        "http://10.1.2.3/web.git".into(),
        "http://169.254.169.254/latest".into(),
        "http://localhost:9/web.git".into(),
    ];
    for url in &urls {
        let (status, body) = ana
            .api
            .call(
                Method::POST,
                "/v1/projects",
                Some(json!({"name": "r", "team_id": team_a, "git_url": url})),
            )
            .await;
        assert_eq!(status, 422, "{url}: {body}");
        assert_eq!(body["code"], "validation_failed", "{url}: {body}");
        assert_eq!(body["errors"][0]["field"], "git_url", "{url}: {body}");
        assert!(!body.to_string().contains("pass@"), "{body}");
    }
    // Exactly one source, named in the answer.
    let (status, body) = ana
        .api
        .call(
            Method::POST,
            "/v1/projects",
            Some(
                json!({"name": "r", "team_id": team_a, "git_url": "https://example.com/r.git",
                "repo_path": local.path()}),
            ),
        )
        .await;
    assert_eq!(
        (status, body["errors"][0]["field"].as_str()),
        (422, Some("git_url")),
        "{body}"
    );
    let (status, body) = ana
        .api
        .call(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "r", "team_id": team_a})),
        )
        .await;
    assert_eq!(
        (status, body["errors"][0]["field"].as_str()),
        (422, Some("repo_path")),
        "{body}"
    );

    assert!(!pwned.exists(), "no command ran");
    assert_eq!(project_rows(&app).await, 0, "no project row was written");
    let repos = app.data_dir.path().join("repos");
    let left = std::fs::read_dir(&repos).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "no clone was left behind");
}

/// Every row of every table of the database, as text.
async fn whole_database(app: &TestApp) -> String {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
         WHERE table_schema = 'public' AND table_type = 'BASE TABLE'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let mut out = String::new();
    for t in tables {
        let text: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT string_agg(x::text, E'\\n') FROM \"{t}\" x"
        )))
        .fetch_one(&app.pool)
        .await
        .unwrap();
        out.push_str(&text.unwrap_or_default());
        out.push('\n');
    }
    out
}

#[tokio::test]
async fn a_project_cloned_from_an_authenticated_remote_follows_it() {
    const PASSWORD: &str = "s3cret-remote-pass";
    let remote = GitHttp::start("git", PASSWORD).await;
    let first = remote.create_repo("web");
    let app = spawn_app_with(|s| s.projects.allow_private_remotes = true).await;
    let ana = person(&app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    let put = |name: &str, value: &str| {
        let (api, team_a) = (ana.api.clone(), team_a.clone());
        let (name, value) = (name.to_owned(), value.to_owned());
        async move {
            api.ok(
                Method::PUT,
                &format!("/v1/teams/{team_a}/secrets/{name}"),
                Some(json!({ "value": value })),
                201,
            )
            .await;
        }
    };
    put("WEB_GIT", &format!("git:{PASSWORD}")).await;
    put("WRONG_GIT", "git:not-the-password").await;

    // A wrong, missing or unknown credential fails cleanly: no row, no clone, no secret.
    for (secret, field) in [
        (Some("WRONG_GIT"), "git_url"),
        (None, "git_url"),
        (Some("NO_SUCH_SECRET"), "credential_secret"),
    ] {
        let mut body = json!({"name": "web", "team_id": team_a, "git_url": remote.url("web")});
        if let Some(s) = secret {
            body["credential_secret"] = json!(s);
        }
        let (status, problem) = ana.api.call(Method::POST, "/v1/projects", Some(body)).await;
        assert_eq!(
            (status, problem["errors"][0]["field"].as_str()),
            (422, Some(field)),
            "{secret:?}: {problem}"
        );
        assert!(
            !problem.to_string().contains("not-the-password"),
            "{problem}"
        );
        assert!(!problem.to_string().contains(PASSWORD), "{problem}");
    }
    assert_eq!(project_rows(&app).await, 0);
    let repos = app.data_dir.path().join("repos");
    assert_eq!(
        std::fs::read_dir(&repos).map(|d| d.count()).unwrap_or(0),
        0,
        "a failed clone leaves no directory"
    );

    // The right credential: the server clones into storage it owns.
    let project = ana
        .api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(
                json!({"name": "web", "team_id": team_a, "git_url": remote.url("web"),
                "credential_secret": "WEB_GIT"}),
            ),
            201,
        )
        .await;
    assert_eq!(project["git_url"], remote.url("web"));
    assert_eq!(project["credential_secret"], "WEB_GIT");
    assert_eq!(project["default_branch"], "main");
    let clone = path_of(&project["repo_path"]);
    assert!(clone.starts_with(&repos), "{project}");
    assert!(
        clone.join("HEAD").exists(),
        "a bare clone at {}",
        clone.display()
    );

    // A directory workspace needs a checkout the project does not have.
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"], "kind": "directory"})),
        )
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("kind")),
        "{problem}"
    );

    // A commit pushed after creation is the base of the next workspace.
    let ws = ana
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    assert_eq!(ws["base_commit"], first, "{ws}");
    let second = remote.commit("web", "src/lib.rs", "pub fn two() {}\n", "second");
    let ws = ana
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"], "title": "next"})),
            201,
        )
        .await;
    assert_eq!(ws["base_commit"], second, "{ws}");
    let ws_path = path_of(&ws["path"]);
    assert!(ws_path.join("src/lib.rs").exists());
    // The test remote takes pushes too (over smart HTTP, with the same credential).
    {
        use base64::Engine;
        let header = format!(
            "http.extraHeader=Authorization: Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("git:{PASSWORD}"))
        );
        // Blocking git on a thread of its own: the remote is served on this runtime.
        let (dir, url) = (ws_path.clone(), remote.url("web"));
        tokio::task::spawn_blocking(move || {
            git(
                &dir,
                &["-c", &header, "push", "-q", &url, "HEAD:refs/heads/pushed"],
            )
        })
        .await
        .unwrap();
        let pushed = git(&remote.path("web"), &["rev-parse", "refs/heads/pushed"]);
        assert_eq!(pushed.trim(), second);
    }

    // An agent works in the worktree; the diff shows its write.
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock"}),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap();
    app.wait(agent).await;
    app.prompt(agent, "/write notes.txt from the remote").await;
    app.wait(agent).await;
    let diff = app
        .get_ok(&format!(
            "/v1/workspaces/{}/diff",
            ws["id"].as_str().unwrap()
        ))
        .await;
    assert!(
        diff["files"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["path"] == "notes.txt"),
        "{diff}"
    );
    assert!(diff["patch"].as_str().unwrap().contains("+from the remote"));

    // The remote gone, a new workspace is refused with a clear code.
    drop(remote);
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
        )
        .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (502, Some("remote_unavailable")),
        "{problem}"
    );

    // The credential is nowhere: not in the database, the clone's files, the answers.
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("git:{PASSWORD}"));
    let dump = whole_database(&app).await;
    for needle in [PASSWORD, encoded.as_str(), "not-the-password"] {
        assert!(!dump.contains(needle), "the database holds {needle}");
        assert!(!problem.to_string().contains(needle));
        assert!(!project.to_string().contains(needle));
    }
    let mut stack = vec![clone.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            if entry.file_type().unwrap().is_dir() {
                stack.push(path);
            } else if let Ok(text) = std::fs::read(&path) {
                let text = String::from_utf8_lossy(&text);
                assert!(
                    !text.contains(PASSWORD),
                    "{} holds the password",
                    path.display()
                );
                assert!(
                    !text.contains(&encoded),
                    "{} holds the header",
                    path.display()
                );
            }
        }
    }
    // Workspaces archived, deleting the project removes the server's clone with it.
    let listed = app
        .get_ok(&format!(
            "/v1/workspaces?project_id={}",
            project["id"].as_str().unwrap()
        ))
        .await;
    for ws in listed["items"].as_array().unwrap() {
        let res = app
            .post(
                &format!("/v1/workspaces/{}/archive", ws["id"].as_str().unwrap()),
                json!({}),
            )
            .await;
        assert!(res.status().is_success(), "{}", res.text().await.unwrap());
    }
    let res = app
        .delete(&format!("/v1/projects/{}", project["id"].as_str().unwrap()))
        .await;
    assert_eq!(res.status().as_u16(), 204);
    assert!(!clone.exists(), "the clone went with its project");
}
