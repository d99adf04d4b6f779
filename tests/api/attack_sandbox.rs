//! Escape attempts from inside a sandboxed agent: a scripted agent runs each prompt as a
//! shell command (as an injected prompt would make a real CLI do), and each attempt must
//! fail from inside while nothing happens outside; the legitimate actions still work.

use std::path::Path;

use agentry::config::{SandboxNetwork, Settings};
use serde_json::{Value, json};

use crate::helpers::{
    EXEC_PROVIDER as EXEC, TestApp, exec_agent_in as agent, git_repo, spawn_app_with,
    with_exec_agent as exec_agent,
};

/// Run `cmd` in the agent: its exit code and output.
async fn run(app: &TestApp, agent: &str, cmd: &str) -> (i64, String) {
    app.prompt(agent, cmd).await;
    app.wait(agent).await;
    let text = app
        .timeline(agent)
        .await
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "assistant_message")
        .and_then(|e| e["data"]["text"].as_str().map(str::to_owned))
        .expect("an answer");
    let code = text
        .strip_prefix("exit=")
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|c| c.parse().ok())
        .unwrap_or(-1);
    (code, text)
}

fn fails(r: &(i64, String), what: &str) {
    assert_ne!(r.0, 0, "{what} must fail inside the sandbox: {}", r.1);
}

#[tokio::test]
async fn the_data_dir_secrets_are_out_of_reach() {
    let app = spawn_app_with(exec_agent).await;
    let repo = git_repo();
    let (id, _) = agent(&app, repo.path(), "a").await;
    let data = app.data_dir.path();
    let token = data.join("admin-token");
    assert!(token.exists(), "the server wrote its admin token");
    let r = run(&app, &id, &format!("cat {}", token.display())).await;
    fails(&r, "reading the admin token");
    assert!(!r.1.contains(&app.token), "{}", r.1);
    let r = run(
        &app,
        &id,
        &format!("cat {}", data.join("secrets-key").display()),
    )
    .await;
    fails(&r, "reading the secrets key");
    // The data dir shows only the mount points of this agent's own paths.
    let r = run(
        &app,
        &id,
        &format!("ls {}", data.join("worktrees/*/").display()),
    )
    .await;
    assert_eq!(
        r.1.lines().filter(|l| !l.trim().is_empty()).count(),
        2,
        "{}",
        r.1
    );
}

#[tokio::test]
async fn another_projects_worktree_and_repository_are_invisible() {
    let app = spawn_app_with(exec_agent).await;
    let repo_a = git_repo();
    let repo_b = git_repo();
    std::fs::write(repo_b.path().join("secret.txt"), "team b's secret").unwrap();
    let (a, _) = agent(&app, repo_a.path(), "a").await;
    let (_b, wt_b) = agent(&app, repo_b.path(), "b").await;
    std::fs::write(wt_b.join("plan.txt"), "team b's plan").unwrap();
    let r = run(
        &app,
        &a,
        &format!("cat {}", wt_b.join("plan.txt").display()),
    )
    .await;
    fails(&r, "reading another worktree");
    assert!(!r.1.contains("team b's plan"));
    let r = run(
        &app,
        &a,
        &format!("cat {}", repo_b.path().join("secret.txt").display()),
    )
    .await;
    fails(&r, "reading another repository");
    assert!(!r.1.contains("team b's secret"));
}

#[tokio::test]
async fn the_server_process_is_out_of_sight_and_reach() {
    let app = spawn_app_with(exec_agent).await;
    let repo = git_repo();
    let (id, _) = agent(&app, repo.path(), "a").await;
    let server = std::process::id();
    let r = run(&app, &id, &format!("cat /proc/{server}/environ")).await;
    fails(&r, "reading the server's environment");
    let r = run(&app, &id, &format!("kill -0 {server}")).await;
    fails(&r, "signalling the server");
    // It sees its own processes only: bwrap's init, the agent, its shell and `ls`.
    let r = run(&app, &id, "ls /proc | grep -c '^[0-9]'").await;
    let n: usize =
        r.1.lines()
            .nth(1)
            .unwrap_or("99")
            .trim()
            .parse()
            .unwrap_or(99);
    assert!(n < 10, "{}", r.1);
}

#[tokio::test]
async fn the_repository_checkout_config_and_hooks_are_not_writable() {
    let app = spawn_app_with(exec_agent).await;
    let repo = git_repo();
    let (id, _) = agent(&app, repo.path(), "a").await;
    let checkout = repo.path().join("injected.txt");
    let r = run(&app, &id, &format!("echo x > {}", checkout.display())).await;
    fails(&r, "writing into the project's checkout");
    assert!(!checkout.exists());
    let beside = repo.path().parent().unwrap().join("beside-the-repo.txt");
    let r = run(&app, &id, &format!("echo x > {}", beside.display())).await;
    fails(&r, "writing beside the repository");
    assert!(!beside.exists());
    let git = repo.path().join(".git");
    let config = std::fs::read_to_string(git.join("config")).unwrap();
    let r = run(
        &app,
        &id,
        &format!("echo '[core]' >> {}", git.join("config").display()),
    )
    .await;
    fails(&r, "writing the repository's config");
    assert_eq!(std::fs::read_to_string(git.join("config")).unwrap(), config);
    let hook = git.join("hooks/post-checkout");
    let r = run(
        &app,
        &id,
        &format!("echo 'touch /tmp/pwned' > {}", hook.display()),
    )
    .await;
    fails(&r, "writing a hook");
    assert!(!hook.exists());
}

#[tokio::test]
async fn an_agent_commits_in_its_worktree_with_a_private_home_and_tmp() {
    let app = spawn_app_with(exec_agent).await;
    let repo = git_repo();
    let (id, wt) = agent(&app, repo.path(), "a").await;
    let r = run(
        &app,
        &id,
        "echo hi > new.txt && git add new.txt && git -c user.name=a -c user.email=a@b commit -qm sandboxed && git status --short",
    )
    .await;
    assert_eq!(r.0, 0, "{}", r.1);
    let log = std::process::Command::new("git")
        .args(["log", "-1", "--format=%s"])
        .current_dir(&wt)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&log.stdout).trim(), "sandboxed");
    let r = run(
        &app,
        &id,
        "echo mine > \"$HOME/f\" && echo t > \"$TMPDIR/f\" && cat \"$HOME/f\"",
    )
    .await;
    assert_eq!(r.0, 0, "{}", r.1);
    let (other, _) = agent(&app, repo.path(), "b").await;
    let r = run(
        &app,
        &other,
        &format!("cat {}/agent-homes/*/f", app.data_dir.path().display()),
    )
    .await;
    fails(&r, "reading another agent's home");
    assert!(!r.1.contains("mine"));
}

const CONNECT: &str = "python3 -c 'import socket,sys; socket.create_connection((\"127.0.0.1\", int(sys.argv[1])), 3)'";

#[tokio::test]
async fn network_none_reaches_no_loopback_server_of_the_host() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = spawn_app_with(|s| {
        exec_agent(s);
        s.sandbox.network = SandboxNetwork::None;
    })
    .await;
    let repo = git_repo();
    let (id, _) = agent(&app, repo.path(), "a").await;
    let r = run(&app, &id, &format!("{CONNECT} {port}")).await;
    fails(&r, "connecting to the host's loopback");
}

#[tokio::test]
async fn network_host_reaches_a_loopback_server() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = spawn_app_with(|s| {
        exec_agent(s);
        s.sandbox.network = SandboxNetwork::Host;
    })
    .await;
    let repo = git_repo();
    let (id, _) = agent(&app, repo.path(), "a").await;
    let r = run(&app, &id, &format!("{CONNECT} {port}")).await;
    assert_eq!(r.0, 0, "{}", r.1);
    let state = sandbox_state(&app).await;
    assert_eq!(
        state,
        json!({"mode": "enforce", "available": true, "reason": null, "network": "host"})
    );
    assert_eq!(item_sandbox(&app).await, "enforced");
}

/// The sandbox's state as `GET /v1/providers` shows it, checked to be what `/readyz`
/// shows too.
async fn sandbox_state(app: &TestApp) -> Value {
    let providers = app.get_ok("/v1/providers").await;
    let ready: Value = app
        .client
        .get(app.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["sandbox"], providers["sandbox"], "{ready}");
    providers["sandbox"].clone()
}

/// What each provider of `GET /v1/providers` says of its sandbox: all the same here.
async fn item_sandbox(app: &TestApp) -> String {
    let providers = app.get_ok("/v1/providers").await;
    let items = providers["items"].as_array().unwrap();
    let first = items[0]["sandbox"].as_str().unwrap().to_owned();
    for item in items {
        assert_eq!(item["sandbox"], first.as_str(), "{item}");
    }
    first
}

/// The exec agent with an `ask` mode (default) and an unattended `yolo` mode, on a host
/// where the sandbox cannot run.
fn unsandboxable(s: &mut Settings) {
    exec_agent(s);
    let p = s.providers.get_mut(EXEC).unwrap();
    p.modes = vec![
        agentry::config::ModeSetting {
            id: "ask".into(),
            label: None,
            description: None,
            unattended: false,
        },
        agentry::config::ModeSetting {
            id: "yolo".into(),
            label: None,
            description: None,
            unattended: true,
        },
    ];
    p.default_mode = Some("ask".into());
    s.sandbox.bwrap = "/nonexistent".into();
}

async fn create_in_mode(app: &TestApp, repo: &Path, mode: &str, status: u16) -> Value {
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": format!("p-{mode}"), "repo_path": repo}),
            201,
        )
        .await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    app.post_ok(
        "/v1/agents",
        json!({"workspace_id": ws["id"], "provider": EXEC, "mode": mode}),
        status,
    )
    .await
}

async fn agent_rows(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM agents")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn unattended_modes_are_refused_when_the_host_cannot_sandbox() {
    let app = spawn_app_with(unsandboxable).await;
    let repo = git_repo();
    let refused = create_in_mode(&app, repo.path(), "yolo", 409).await;
    assert_eq!(refused["code"], "sandbox_unavailable", "{refused}");
    assert_eq!(agent_rows(&app).await, 0, "no agent was made");
    // The state is shown, with why.
    let state = sandbox_state(&app).await;
    assert_eq!(state["available"], false, "{state}");
    assert!(
        state["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{state}"
    );
    assert_eq!(item_sandbox(&app).await, "unavailable");
    // An asking mode still runs (unconfined, as the start log says).
    let other = git_repo();
    let ok = create_in_mode(&app, other.path(), "ask", 201).await;
    let id = ok["id"].as_str().unwrap();
    let refused = app
        .client
        .put(app.url(&format!("/v1/agents/{id}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "yolo"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
}

#[tokio::test]
async fn unattended_modes_run_unconfined_only_when_the_admin_allows_it() {
    let app = spawn_app_with(|s| {
        unsandboxable(s);
        s.sandbox.allow_unconfined_unattended = true;
    })
    .await;
    let repo = git_repo();
    create_in_mode(&app, repo.path(), "yolo", 201).await;
}

#[tokio::test]
async fn sandbox_mode_off_refuses_unattended_modes_too() {
    let app = spawn_app_with(|s| {
        unsandboxable(s);
        s.sandbox.bwrap = "bwrap".into();
        s.sandbox.mode = agentry::config::SandboxMode::Off;
    })
    .await;
    let repo = git_repo();
    let refused = create_in_mode(&app, repo.path(), "yolo", 409).await;
    assert_eq!(refused["code"], "sandbox_unavailable", "{refused}");
    assert_eq!(agent_rows(&app).await, 0);
    assert_eq!(item_sandbox(&app).await, "off");
}

/// Set the team's sandbox requirement with `token`: the status and the body.
async fn require_sandbox(app: &TestApp, token: &str, team: &str, require: bool) -> (u16, Value) {
    let res = app
        .client
        .put(app.url(&format!("/v1/teams/{team}/sandbox")))
        .bearer_auth(token)
        .json(&json!({"require_sandbox": require}))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

/// Prompt `agent`: the status and the body.
async fn prompt_status(app: &TestApp, agent: &str, text: &str) -> (u16, Value) {
    let res = app
        .client
        .post(app.url(&format!("/v1/agents/{agent}/messages")))
        .bearer_auth(&app.token)
        .json(&json!({"text": text}))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_team_that_requires_the_sandbox_gets_no_unconfined_agent() {
    let app = spawn_app_with(unsandboxable).await;
    let team = app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let team_uuid: uuid::Uuid = team.strip_prefix("team_").unwrap().parse().unwrap();
    // An agent made before the team required the sandbox (an asking mode runs
    // unconfined here), live.
    let repo = git_repo();
    let before = create_in_mode(&app, repo.path(), "ask", 201).await;
    let agent = before["id"].as_str().unwrap().to_owned();
    app.wait(&agent).await;
    assert_eq!(
        app.get_ok(&format!("/v1/teams/{team}")).await["require_sandbox"],
        false
    );

    // Owners only: a member is refused and nothing changes.
    let member = crate::attack_egress::user_in(&app, team_uuid, "member").await;
    let (status, body) = require_sandbox(&app, &member, &team, true).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = prompt_status(&app, &agent, "true").await;
    assert_eq!(status, 202, "{body}");
    app.wait(&agent).await;

    let (status, body) = require_sandbox(&app, &app.token, &team, true).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["require_sandbox"], true, "{body}");
    assert_eq!(
        app.get_ok(&format!("/v1/teams/{team}")).await["require_sandbox"],
        true
    );
    let listed = app.get_ok("/v1/teams").await;
    assert_eq!(listed["items"][0]["require_sandbox"], true, "{listed}");

    // This server cannot sandbox: no new agent of the team, in any mode.
    for mode in ["ask", "yolo"] {
        let refused = app
            .post_ok(
                "/v1/agents",
                json!({"workspace_id": before["workspace_id"], "provider": EXEC, "mode": mode}),
                409,
            )
            .await;
        assert_eq!(refused["code"], "sandbox_required", "{refused}");
    }
    assert_eq!(agent_rows(&app).await, 1, "no agent was made");
    // The live agent takes no prompt, nor once its process is closed.
    let (status, body) = prompt_status(&app, &agent, "true").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("sandbox_required")),
        "{body}"
    );
    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    let (status, body) = prompt_status(&app, &agent, "true").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("sandbox_required")),
        "{body}"
    );

    // Audited.
    let audit = app
        .get_ok(&format!("/v1/audit?team_id={team}&action=team.sandbox"))
        .await;
    let items = audit["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{audit}");
    assert_eq!(items[0]["details"], json!({"require_sandbox": true}));

    // Lifted: the agent runs again.
    let (status, body) = require_sandbox(&app, &app.token, &team, false).await;
    assert_eq!(
        (status, &body["require_sandbox"]),
        (200, &json!(false)),
        "{body}"
    );
    let (status, body) = prompt_status(&app, &agent, "true").await;
    assert_eq!(status, 202, "{body}");
    app.wait(&agent).await;
}

#[tokio::test]
async fn a_team_that_requires_the_sandbox_runs_agents_where_they_are_sandboxed() {
    let app = spawn_app_with(exec_agent).await;
    let team = app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, body) = require_sandbox(&app, &app.token, &team, true).await;
    assert_eq!(status, 200, "{body}");
    let repo = git_repo();
    let (id, _) = agent(&app, repo.path(), "a").await;
    let r = run(&app, &id, "true").await;
    assert_eq!(r.0, 0, "{}", r.1);
}
