//! Issue 42, items 1 and 2: workspaces from what CI names (a remote branch, a pull
//! request by number), the work pushed back from the server with the project's
//! credential (never a force-push unless asked, never to a protected branch), and a pull
//! request opened then updated on a fake GitHub, a merge request on a fake GitLab, their
//! state followed. The remote's credential reaches no timeline, environment or answer.

use base64::Engine;
use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

#[path = "../support/fake_forge.rs"]
mod fake_forge;
// attack_projects loads the same remote; two copies of it are harmless.
#[allow(clippy::duplicate_mod)]
#[path = "../support/git_http.rs"]
mod git_http;

use fake_forge::{FakeForge, Flavor};
use git_http::GitHttp;

const PASSWORD: &str = "ci-loop-remote-pass-5b1f";

/// A remote with repository `web`, a server that may reach it, a person owning a team
/// whose secret `WEB_GIT` holds the remote's credential.
async fn world() -> (GitHttp, TestApp, Person, String) {
    let remote = GitHttp::start("git", PASSWORD).await;
    remote.create_repo("web");
    let app = spawn_app_with(|s| s.projects.allow_private_remotes = true).await;
    let ana = person(&app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    ana.api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{team_a}/secrets/WEB_GIT"),
            Some(json!({ "value": format!("git:{PASSWORD}") })),
            201,
        )
        .await;
    (remote, app, ana, team_a)
}

async fn project(ana: &Person, team: &str, remote: &GitHttp, extra: Value) -> Value {
    let mut body = json!({"name": format!("web-{}", uuid::Uuid::now_v7().simple()),
        "team_id": team, "git_url": remote.url("web"), "credential_secret": "WEB_GIT"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    ana.api
        .ok(Method::POST, "/v1/projects", Some(body), 201)
        .await
}

async fn workspace(ana: &Person, body: Value) -> Value {
    ana.api
        .ok(Method::POST, "/v1/workspaces", Some(body), 201)
        .await
}

fn id(v: &Value) -> &str {
    v["id"].as_str().unwrap()
}

/// The text must not hold the credential or the header it makes.
fn assert_no_credential(what: &str, text: &str) {
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("git:{PASSWORD}"));
    assert!(!text.contains(PASSWORD), "the credential is in the {what}");
    assert!(
        !text.contains(&encoded),
        "the encoded credential is in the {what}"
    );
}

#[tokio::test]
async fn workspaces_start_from_a_remote_branch_or_a_pull_request_and_are_pushed_back() {
    let (remote, app, ana, team_a) = world().await;
    let feature = remote.commit_on("web", "feature", "feature.txt", "feature\n", "feature work");
    let contributed = remote.commit_on("web", "contrib", "contrib.txt", "from a fork\n", "pr work");
    remote.set_ref("web", "refs/pull/12/head", &contributed);
    let forge = FakeForge::start(Flavor::GitHub, PASSWORD).await;
    let project = project(
        &ana,
        &team_a,
        &remote,
        json!({"forge": "github", "forge_api_url": forge.api_url(), "forge_repo": "acme/web"}),
    )
    .await;
    assert_eq!(project["forge"], "github", "{project}");
    assert_eq!(project["forge_repo"], "acme/web");

    // A remote branch.
    let from_branch = workspace(
        &ana,
        json!({"project_id": project["id"], "base_ref": "feature", "title": "fix it"}),
    )
    .await;
    assert_eq!(from_branch["base_commit"], feature, "{from_branch}");
    assert!(path_of(&from_branch["path"]).join("feature.txt").exists());

    // A pull request by number: its head ref, fetched with the project's credential.
    let from_pr = workspace(
        &ana,
        json!({"project_id": project["id"], "pull_request": 12}),
    )
    .await;
    assert_eq!(from_pr["base_commit"], contributed, "{from_pr}");
    assert_eq!(from_pr["base_ref"], "refs/pull/12/head");
    assert_eq!(from_pr["pull_request"], 12);
    assert_eq!(from_pr["branch"], "agentry/pr-12");
    assert!(path_of(&from_pr["path"]).join("contrib.txt").exists());
    let read = app
        .get_ok(&format!("/v1/workspaces/{}", id(&from_pr)))
        .await;
    assert_eq!(read["pull_request"], 12, "{read}");
    // One that does not exist, or with base_ref too, is refused with the field named.
    for body in [
        json!({"project_id": project["id"], "pull_request": 99}),
        json!({"project_id": project["id"], "pull_request": 12, "base_ref": "main"}),
    ] {
        let (status, problem) = ana
            .api
            .call(Method::POST, "/v1/workspaces", Some(body))
            .await;
        assert_eq!(
            (status, problem["errors"][0]["field"].as_str()),
            (422, Some("pull_request")),
            "{problem}"
        );
    }
    // A project without a forge cannot name a pull request.
    let plain = self::project(&ana, &team_a, &remote, json!({})).await;
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": plain["id"], "pull_request": 12})),
        )
        .await;
    assert_eq!(status, 422, "{problem}");

    // An agent works in the branch's workspace; the push commits its work with a trailer
    // naming it and pushes the workspace's branch.
    let agent = ana
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": from_branch["id"], "provider": "mock", "title": "Fix the thing"})),
            201,
        )
        .await;
    let agent = id(&agent).to_owned();
    app.wait(&agent).await;
    app.prompt(&agent, "/write notes.txt written by the agent")
        .await;
    app.wait(&agent).await;
    let branch = from_branch["branch"].as_str().unwrap().to_owned();
    let ws_id = id(&from_branch).to_owned();
    let pushed = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/push"),
            Some(json!({})),
            200,
        )
        .await;
    assert_eq!(pushed["committed"], true, "{pushed}");
    assert_eq!(pushed["branch"], branch.as_str());
    assert_eq!(pushed["forced"], false);
    let commit = pushed["commit"].as_str().unwrap().to_owned();
    assert_eq!(
        remote.rev("web", &format!("refs/heads/{branch}")),
        Some(commit.clone())
    );
    let log = remote.show("web", &commit, "%an <%ae>%n%P%n%B");
    assert!(log.starts_with("agentry <agentry@localhost>\n"), "{log}");
    assert!(log.contains(&feature), "the parent is the base: {log}");
    assert!(
        log.contains("Fix the thing"),
        "the agent's title is the default message: {log}"
    );
    assert!(log.contains(&format!("Agentry-Agent: {agent}")), "{log}");
    assert_eq!(pushed["workspace"]["pushed"]["commit"], commit.as_str());
    // The worktree is clean after the commit: its diff against the new HEAD is empty,
    // and pushing again commits nothing and changes nothing.
    let again = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/push"),
            Some(json!({"message": "nothing new", "author_name": "CI", "author_email": "ci@example.com"})),
            200,
        )
        .await;
    assert_eq!(
        (again["committed"].clone(), again["commit"].clone()),
        (json!(false), json!(commit))
    );

    // A protected branch is refused, whatever is pending; the remote's main is unchanged.
    let main_before = remote.rev("web", "refs/heads/main");
    for body in [
        json!({"branch": "main"}),
        json!({"branch": "master", "force": true}),
    ] {
        let (status, problem) = ana
            .api
            .call(
                Method::POST,
                &format!("/v1/workspaces/{ws_id}/push"),
                Some(body),
            )
            .await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (409, Some("branch_protected")),
            "{problem}"
        );
    }
    assert_eq!(remote.rev("web", "refs/heads/main"), main_before);

    // The remote's branch moves on meanwhile: a push that is not a fast-forward is
    // refused and the remote keeps its commit; with force it is replaced.
    let theirs = remote.commit_on("web", &branch, "theirs.txt", "theirs\n", "someone else");
    std::fs::write(path_of(&from_branch["path"]).join("mine.txt"), "mine\n").unwrap();
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/push"),
            Some(json!({"message": "mine"})),
        )
        .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("push_rejected")),
        "{problem}"
    );
    assert_eq!(
        remote.rev("web", &format!("refs/heads/{branch}")),
        Some(theirs.clone())
    );
    let forced = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/push"),
            Some(json!({"force": true})),
            200,
        )
        .await;
    assert_eq!(forced["forced"], true, "{forced}");
    let forced_commit = forced["commit"].as_str().unwrap();
    assert_eq!(
        remote
            .rev("web", &format!("refs/heads/{branch}"))
            .as_deref(),
        Some(forced_commit)
    );
    assert!(
        remote
            .show("web", forced_commit, "%B")
            .starts_with("mine\n")
    );

    let read = app.get_ok(&format!("/v1/workspaces/{ws_id}")).await;
    assert_eq!(read["pushed"]["forced"], true, "{read}");

    // The push is audited; the credential is in no answer, timeline, audit entry or the
    // agent's environment.
    let audit = ana
        .api
        .ok(
            Method::GET,
            "/v1/audit?action=workspace.push&limit=100",
            None,
            200,
        )
        .await;
    let pushes = audit["items"].as_array().unwrap();
    assert_eq!(pushes.len(), 3, "{audit}");
    assert!(
        pushes.iter().all(|e| e["target"]["id"] == ws_id.as_str()),
        "{audit}"
    );
    app.prompt(&agent, "/env GIT_CONFIG_VALUE_0").await;
    app.wait(&agent).await;
    let timeline = app.timeline(&agent).await;
    let shown = format!("{pushed}{again}{forced}{read}{audit}{}", json!(timeline));
    assert!(
        shown.contains("GIT_CONFIG_VALUE_0 unset"),
        "the agent's environment has no git config"
    );
    assert_no_credential("answers, the timeline or the audit log", &shown);
    app.assert_database_lacks(&[PASSWORD]).await;
}

#[tokio::test]
async fn a_pull_request_is_opened_then_updated_and_followed_on_github_and_gitlab() {
    let (remote, app, ana, team_a) = world().await;
    let github = FakeForge::start(Flavor::GitHub, PASSWORD).await;
    let gitlab = FakeForge::start(Flavor::GitLab, PASSWORD).await;
    let on_github = project(
        &ana,
        &team_a,
        &remote,
        json!({"forge": "github", "forge_api_url": github.api_url(), "forge_repo": "acme/web"}),
    )
    .await;
    let on_gitlab = project(
        &ana,
        &team_a,
        &remote,
        json!({"forge": "gitlab", "forge_api_url": gitlab.api_url(), "forge_repo": "group/web"}),
    )
    .await;
    // A forge the server does not implement is refused.
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            "/v1/projects",
            Some(
                json!({"name": "bb", "team_id": team_a, "git_url": remote.url("web"),
                "forge": "bitbucket"}),
            ),
        )
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("forge")),
        "{problem}"
    );

    // GitHub: nothing pushed yet is refused; then opened, then updated.
    let ws = workspace(
        &ana,
        json!({"project_id": on_github["id"], "title": "login fix"}),
    )
    .await;
    let ws_id = id(&ws).to_owned();
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/pull-request"),
            Some(json!({})),
        )
        .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("not_pushed")),
        "{problem}"
    );
    std::fs::write(path_of(&ws["path"]).join("fix.txt"), "fixed\n").unwrap();
    ana.api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/push"),
            Some(json!({})),
            200,
        )
        .await;
    let branch = ws["branch"].as_str().unwrap();
    let opened = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/pull-request"),
            Some(json!({"title": "Fix login", "body": "First take."})),
            201,
        )
        .await;
    let pr = &opened["opened_pull_request"];
    assert_eq!(pr["number"], 7, "{opened}");
    assert_eq!(pr["url"], "https://github.example/acme/web/pull/7");
    assert_eq!(
        (pr["state"].as_str(), pr["checks"].as_str()),
        (Some("open"), Some("none"))
    );
    let calls = github.calls();
    let create = calls.iter().find(|c| c.method == "POST").unwrap();
    assert_eq!(create.path, "/repos/acme/web/pulls");
    assert_eq!(
        create.credential.as_deref(),
        Some(format!("Bearer {PASSWORD}").as_str())
    );
    assert_eq!(
        (
            create.body["head"].as_str(),
            create.body["base"].as_str(),
            create.body["title"].as_str()
        ),
        (Some(branch), Some("main"), Some("Fix login"))
    );
    let updated = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/pull-request"),
            Some(json!({"title": "Fix login, take two", "body": "Second take."})),
            200,
        )
        .await;
    assert_eq!(updated["opened_pull_request"]["number"], 7, "{updated}");
    assert_eq!(github.request_count(), 1, "updated, not opened again");
    assert_eq!(github.request(7).unwrap()["title"], "Fix login, take two");
    assert!(
        github
            .calls()
            .iter()
            .any(|c| c.method == "PATCH" && c.path == "/repos/acme/web/pulls/7")
    );

    // Reading the workspace follows the pull request: checks, then the merge.
    github.set_check_runs(json!([{"status": "completed", "conclusion": "failure"}]));
    let read = app.get_ok(&format!("/v1/workspaces/{ws_id}")).await;
    assert_eq!(read["opened_pull_request"]["checks"], "failing", "{read}");
    github.set_check_runs(json!([{"status": "completed", "conclusion": "success"}]));
    github.merge(7);
    let read = app.get_ok(&format!("/v1/workspaces/{ws_id}")).await;
    assert_eq!(read["opened_pull_request"]["state"], "merged", "{read}");
    assert_eq!(read["opened_pull_request"]["checks"], "passing", "{read}");

    // GitLab: a merge request with the project's token, its pipeline followed.
    let ws = workspace(
        &ana,
        json!({"project_id": on_gitlab["id"], "title": "docs"}),
    )
    .await;
    let ws_id = id(&ws).to_owned();
    std::fs::write(path_of(&ws["path"]).join("docs.md"), "# docs\n").unwrap();
    ana.api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/push"),
            Some(json!({})),
            200,
        )
        .await;
    let opened = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/pull-request"),
            Some(json!({"body": "Docs."})),
            201,
        )
        .await;
    let mr = &opened["opened_pull_request"];
    assert_eq!(
        mr["url"], "https://gitlab.example/group/web/-/merge_requests/7",
        "{opened}"
    );
    let create = gitlab
        .calls()
        .into_iter()
        .find(|c| c.method == "POST")
        .unwrap();
    assert_eq!(create.path, "/api/v4/projects/group%2Fweb/merge_requests");
    assert_eq!(create.credential.as_deref(), Some(PASSWORD));
    assert_eq!(
        create.body["title"], "docs",
        "the workspace's title by default"
    );
    assert_eq!(create.body["source_branch"], ws["branch"]);
    gitlab.set_pipeline("failed");
    let read = app.get_ok(&format!("/v1/workspaces/{ws_id}")).await;
    assert_eq!(read["opened_pull_request"]["checks"], "failing", "{read}");
    gitlab.set_pipeline("running");
    let read = app.get_ok(&format!("/v1/workspaces/{ws_id}")).await;
    assert_eq!(read["opened_pull_request"]["checks"], "pending", "{read}");

    // A forge that refuses the token: 502 with a stable code, no credential shown.
    let wrong = FakeForge::start(Flavor::GitHub, "another-token").await;
    let elsewhere = project(
        &ana,
        &team_a,
        &remote,
        json!({"forge": "github", "forge_api_url": wrong.api_url(), "forge_repo": "acme/web"}),
    )
    .await;
    let ws = workspace(
        &ana,
        json!({"project_id": elsewhere["id"], "title": "refused"}),
    )
    .await;
    std::fs::write(path_of(&ws["path"]).join("x.txt"), "x\n").unwrap();
    ana.api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{}/push", id(&ws)),
            Some(json!({})),
            200,
        )
        .await;
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            &format!("/v1/workspaces/{}/pull-request", id(&ws)),
            Some(json!({})),
        )
        .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (502, Some("forge_failed")),
        "{problem}"
    );
    assert_no_credential("forge failure", &problem.to_string());
}

#[tokio::test]
async fn agentry_run_starts_from_a_pull_request_then_pushes_and_opens_one() {
    let (remote, app, ana, team_a) = world().await;
    let contributed = remote.commit_on("web", "contrib", "contrib.txt", "x\n", "pr work");
    remote.set_ref("web", "refs/pull/5/head", &contributed);
    let forge = FakeForge::start(Flavor::GitHub, PASSWORD).await;
    let project = project(
        &ana,
        &team_a,
        &remote,
        json!({"forge": "github", "forge_api_url": forge.api_url(), "forge_repo": "acme/web"}),
    )
    .await;
    let home = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"));
        cmd.args(["run", "--project", id(&project), "--provider", "mock"])
            .args(extra)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", home.path())
            .env("AGENTRY_URL", &app.base)
            .env("AGENTRY_TOKEN", &ana.api.token)
            .kill_on_drop(true);
        async move {
            tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output())
                .await
                .expect("the command ends")
                .unwrap()
        }
    };
    let out = run(&["--pr", "5", "--open-pr", "/write fix.txt fixed"]).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stderr.contains("pushed agentry/pr-5 at "), "{stderr}");
    assert_eq!(
        stdout.lines().last(),
        Some("https://github.example/acme/web/pull/7"),
        "{stdout}"
    );
    let pushed = remote
        .rev("web", "refs/heads/agentry/pr-5")
        .expect("the branch is pushed");
    let log = remote.show("web", &pushed, "%P%n%B");
    assert!(
        log.starts_with(&contributed),
        "the pull request's head is the parent: {log}"
    );
    assert!(log.contains("Agentry-Agent: agt_"), "{log}");
    let create = forge
        .calls()
        .into_iter()
        .find(|c| c.method == "POST")
        .unwrap();
    assert_eq!(create.body["head"], "agentry/pr-5");
    assert_eq!(create.body["title"], "/write fix.txt fixed");

    // A turn that fails pushes nothing.
    let out = run(&["--branch", "contrib", "--push", "/fail on purpose"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("pushed"));
    // --push and --detach do not go together.
    let out = run(&["--push", "--detach", "hello"]).await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_forge_api_at_an_internal_address_is_refused_unless_allowed() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    for (api, field) in [
        ("http://169.254.169.254/api/v4", "forge_api_url"),
        ("http://[::1]:8080", "forge_api_url"),
        ("ftp://forge.example.com", "forge_api_url"),
    ] {
        let (status, problem) = ana
            .api
            .call(
                Method::POST,
                "/v1/projects",
                Some(json!({"name": "web", "team_id": team_a,
                    "git_url": "https://git.example.com/group/web.git",
                    "forge": "gitlab", "forge_api_url": api})),
            )
            .await;
        assert_eq!(
            (status, problem["errors"][0]["field"].as_str()),
            (422, Some(field)),
            "{api}: {problem}"
        );
    }
    // A forge field without `forge`, or on a local project, is refused too.
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "web", "team_id": team_a,
                "git_url": "https://git.example.com/group/web.git", "forge_repo": "group/web"})),
        )
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("forge_repo")),
        "{problem}"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM projects")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
}
