//! Agents as callers and parents: each agent is given agentry's own MCP server with a
//! token of its own; that token acts in the agent's team and project with at most its
//! creator's role, makes children that record their parent, is bounded by the tree's
//! limits, and dies with its agent. The agents here are the scripted exec agent, which
//! hands the URL and token of its `agentry` MCP server to the commands it runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentry::config::Settings;
use reqwest::Method;
use serde_json::{Value, json};

use super::helpers::{EXEC_PROVIDER, TestApp, git_repo, spawn_app_with, with_exec_agent};
use super::people::{Caller, Person, person, team};

/// Run `cmd` in the agent (through the admin): its exit code and what it printed.
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

/// The token the agent was given, as its MCP client holds it: the agent writes it to
/// `file` in its worktree (printing nothing), and the test reads it there.
async fn token_of(app: &TestApp, agent: &str, worktree: &Path, file: &str) -> String {
    let r = run(
        app,
        agent,
        &format!("printf %s \"$EXEC_AGENT_MCP_TOKEN\" > {file}"),
    )
    .await;
    assert_eq!(r.0, 0, "{}", r.1);
    let token = std::fs::read_to_string(worktree.join(file)).unwrap();
    assert!(token.starts_with("agt_pat_"), "the agent was given a token");
    token
}

/// A team owned by ana with bob as a plain member, two projects of the team (the admin
/// adds the repositories) and a workspace of the first.
struct World {
    ana: Person,
    bob: Person,
    team: String,
    workspace: String,
    worktree: PathBuf,
    other_project: String,
    _repos: (tempfile::TempDir, tempfile::TempDir),
}

async fn world(app: &TestApp) -> World {
    let ana = person(app, "ana").await;
    let bob = person(app, "bob").await;
    let team = team(&ana, "ana-team").await;
    let (status, body) = ana
        .api
        .call(
            Method::PUT,
            &format!("/v1/teams/{team}/members/{}", bob.id),
            Some(json!({"role": "member"})),
        )
        .await;
    assert!(status == 200 || status == 201, "{status} {body}");
    let admin = Caller::new(app, &app.token);
    let (repo_a, repo_b) = (git_repo(), git_repo());
    let mut projects = Vec::new();
    for (name, repo) in [("a", &repo_a), ("b", &repo_b)] {
        let p = admin
            .ok(
                Method::POST,
                "/v1/projects",
                Some(json!({"name": name, "repo_path": repo.path(), "team_id": team})),
                201,
            )
            .await;
        projects.push(p["id"].as_str().unwrap().to_owned());
    }
    let ws = bob
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": projects[0]})),
            201,
        )
        .await;
    World {
        ana,
        bob,
        team,
        workspace: ws["id"].as_str().unwrap().to_owned(),
        worktree: PathBuf::from(ws["path"].as_str().unwrap()),
        other_project: projects[1].clone(),
        _repos: (repo_a, repo_b),
    }
}

/// `who` creates an agent of `provider` in the world's workspace, with `extra` fields;
/// it is ready when this returns.
async fn agent_by(app: &TestApp, who: &Caller, w: &World, provider: &str, extra: Value) -> Value {
    let mut body = json!({"workspace_id": w.workspace, "provider": provider});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let agent = who.ok(Method::POST, "/v1/agents", Some(body), 201).await;
    app.wait(agent["id"].as_str().unwrap()).await;
    agent
}

fn id(v: &Value) -> &str {
    v["id"].as_str().unwrap()
}

#[tokio::test]
async fn an_agent_token_acts_in_its_project_below_its_creator_and_dies_with_its_agent() {
    let app = spawn_app_with(with_exec_agent).await;
    let w = world(&app).await;
    let parent = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    let parent = id(&parent).to_owned();
    let token = token_of(&app, &parent, &w.worktree, "parent-token").await;
    let me = Caller::new(&app, &token);

    // It reads its team, and nothing of another team.
    me.ok(Method::GET, &format!("/v1/agents/{parent}"), None, 200)
        .await;
    let carl = person(&app, "carl").await;
    let carl_team = team(&carl, "carl-team").await;
    let repo_c = git_repo();
    let foreign_project = Caller::new(&app, &app.token)
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "c", "repo_path": repo_c.path(), "team_id": carl_team})),
            201,
        )
        .await;
    me.refused(
        Method::POST,
        "/v1/workspaces",
        Some(json!({"project_id": foreign_project["id"]})),
        404,
        "not_found",
    )
    .await;
    // Only its own project, and only the `agents` scope.
    me.refused(
        Method::POST,
        "/v1/workspaces",
        Some(json!({"project_id": w.other_project})),
        403,
        "outside_agent_project",
    )
    .await;
    me.refused(
        Method::POST,
        "/v1/tokens",
        Some(json!({"name": "escape"})),
        403,
        "insufficient_scope",
    )
    .await;

    // A child it creates records its parent; the tree shows on both.
    let child = me
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": w.workspace, "provider": "mock", "prompt": "hello"})),
            201,
        )
        .await;
    assert_eq!(child["parent_agent_id"], parent.as_str(), "{child}");
    assert_eq!(child["depth"], 1);
    let child = id(&child).to_owned();
    let seen = w
        .ana
        .api
        .ok(Method::GET, &format!("/v1/agents/{parent}"), None, 200)
        .await;
    assert_eq!(seen["children"], json!({"live": 1, "total": 1}), "{seen}");
    assert!(seen["parent_agent_id"].is_null());
    let listed = w
        .ana
        .api
        .ok(
            Method::GET,
            &format!("/v1/agents?parent_agent_id={parent}"),
            None,
            200,
        )
        .await;
    let ids: Vec<&str> = listed["items"].as_array().unwrap().iter().map(id).collect();
    assert_eq!(ids, [child.as_str()]);

    // The child's creation is audited with the parent agent as actor and bob behind it.
    let audit = w
        .ana
        .api
        .ok(
            Method::GET,
            &format!(
                "/v1/audit?team_id={}&action=agent.create&actor_id={parent}",
                w.team
            ),
            None,
            200,
        )
        .await;
    let entry = &audit["items"][0];
    assert_eq!(entry["actor"]["kind"], "agent", "{audit}");
    assert_eq!(entry["target"]["id"], child.as_str());
    assert_eq!(
        entry["details"]["on_behalf_of"],
        w.bob.id.as_str(),
        "{entry}"
    );

    // Never more than its creator: bob made a viewer, his agent's token drives nothing.
    w.ana
        .api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{}/members/{}", w.team, w.bob.id),
            Some(json!({"role": "viewer"})),
            200,
        )
        .await;
    me.refused(
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
        403,
        "forbidden",
    )
    .await;
    me.ok(Method::GET, &format!("/v1/agents/{parent}"), None, 200)
        .await;

    // The token is nowhere in the clear: not in the parent's timeline, not at rest.
    let timeline = serde_json::to_string(&app.timeline(&parent).await).unwrap();
    assert!(!timeline.contains(&token), "the timeline shows the token");
    app.assert_database_lacks(&[&token]).await;

    // Archiving the parent archives its child, and its token stops working at once.
    let res = app.delete(&format!("/v1/agents/{parent}")).await;
    assert_eq!(res.status(), 204);
    let child_now = app.get_ok(&format!("/v1/agents/{child}")).await;
    assert!(!child_now["archived_at"].is_null(), "{child_now}");
    me.refused(
        Method::GET,
        &format!("/v1/agents/{parent}"),
        None,
        401,
        "token_revoked",
    )
    .await;
}

fn tight_tree(s: &mut Settings) {
    with_exec_agent(s);
    s.limits.max_agent_depth = 1;
    s.limits.max_children_per_agent = 2;
    s.limits.max_child_agents_per_team = 3;
}

#[tokio::test]
async fn depth_and_children_limits_answer_their_codes_and_kept_children_outlive_their_parent() {
    let app = spawn_app_with(tight_tree).await;
    let w = world(&app).await;
    let parent = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    let parent = id(&parent).to_owned();
    let me = Caller::new(
        &app,
        &token_of(&app, &parent, &w.worktree, "parent-token").await,
    );

    // A child that is itself an exec agent: at depth 1 of 1, it may not create.
    let child = agent_by(&app, &me, &w, EXEC_PROVIDER, json!({})).await;
    assert_eq!(child["depth"], 1);
    let child = id(&child).to_owned();
    let child_token = token_of(&app, &child, &w.worktree, "child-token").await;
    let it = Caller::new(&app, &child_token);
    it.refused(
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
        409,
        "agent_depth_exceeded",
    )
    .await;

    // Two live children per agent.
    me.ok(
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
        201,
    )
    .await;
    me.refused(
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
        429,
        "agent_children_exceeded",
    )
    .await;

    // Three agents made by agents per team.
    let other = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    let other = id(&other).to_owned();
    let them = Caller::new(
        &app,
        &token_of(&app, &other, &w.worktree, "other-token").await,
    );
    let kept = them
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
            201,
        )
        .await;
    them.refused(
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
        429,
        "team_children_exceeded",
    )
    .await;

    // `?children=keep` leaves the children; the default archives the whole subtree.
    let res = app
        .delete(&format!("/v1/agents/{other}?children=keep"))
        .await;
    assert_eq!(res.status(), 204);
    let kept = app.get_ok(&format!("/v1/agents/{}", id(&kept))).await;
    assert!(kept["archived_at"].is_null(), "{kept}");
    assert_eq!(kept["parent_agent_id"], other.as_str());
    let res = app.delete(&format!("/v1/agents/{parent}")).await;
    assert_eq!(res.status(), 204);
    let child_now = app.get_ok(&format!("/v1/agents/{child}")).await;
    assert!(!child_now["archived_at"].is_null(), "{child_now}");
    it.refused(Method::GET, "/v1/agents", None, 401, "token_revoked")
        .await;
    let res = app
        .delete(&format!("/v1/agents/{parent}?children=some"))
        .await;
    assert_eq!(res.status(), 400);
}

#[tokio::test]
async fn the_agentry_server_is_reachable_from_the_sandbox_and_opted_out_per_agent_and_team() {
    let app = spawn_app_with(with_exec_agent).await;
    let w = world(&app).await;
    let agent = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    assert_eq!(agent["agentry_mcp"], true);
    let agent = id(&agent).to_owned();
    // From inside the agent's sandbox, its MCP client's request reaches /mcp.
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "probe", "version": "1"}}});
    let r = run(
        &app,
        &agent,
        &format!(
            "curl -sS -H \"Authorization: Bearer $EXEC_AGENT_MCP_TOKEN\" \
             -H 'content-type: application/json' \
             -H 'accept: application/json, text/event-stream' \
             --data '{initialize}' \"$EXEC_AGENT_MCP_URL\""
        ),
    )
    .await;
    assert_eq!(r.0, 0, "{}", r.1);
    assert!(r.1.contains("\"serverInfo\""), "{}", r.1);

    // An agent created without it gets no token.
    let without = agent_by(
        &app,
        &w.bob.api,
        &w,
        EXEC_PROVIDER,
        json!({"agentry_mcp": false}),
    )
    .await;
    assert_eq!(without["agentry_mcp"], false);
    let r = run(&app, id(&without), "test -z \"$EXEC_AGENT_MCP_TOKEN\"").await;
    assert_eq!(r.0, 0, "{}", r.1);
    // The name is agentry's own.
    w.bob
        .api
        .refused(
            Method::POST,
            "/v1/agents",
            Some(
                json!({"workspace_id": w.workspace, "provider": EXEC_PROVIDER,
                "mcp_servers": {"agentry": {"type": "http", "url": "http://127.0.0.1:9/mcp"}}}),
            ),
            422,
            "validation_failed",
        )
        .await;

    // The team's owner turns it off for the team: only an owner may.
    let path = format!("/v1/teams/{}/agentry-mcp", w.team);
    w.bob
        .api
        .refused(
            Method::PUT,
            &path,
            Some(json!({"agentry_mcp": false})),
            403,
            "forbidden",
        )
        .await;
    let off = w
        .ana
        .api
        .ok(Method::PUT, &path, Some(json!({"agentry_mcp": false})), 200)
        .await;
    assert_eq!(off, json!({"agentry_mcp": false}));
    let later = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    let r = run(&app, id(&later), "test -z \"$EXEC_AGENT_MCP_TOKEN\"").await;
    assert_eq!(r.0, 0, "{}", r.1);

    // A provider without MCP support says so.
    let mock = app.provider("mock").await;
    assert_eq!(mock["capabilities"]["mcp_servers"], false, "{mock}");
}

/// The Python of the virtual environment `.ci/install-test-peers` makes for the client.
fn mcp_python() -> PathBuf {
    let cache = std::env::var_os("AGENTRY_TEST_PEERS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/agentry/test-peers")
        });
    let venv = cache.join("mcp-python@2.3.0");
    assert!(
        venv.join(".installed").exists(),
        "the MCP client test peer is missing from {}: run .ci/install-test-peers",
        venv.display()
    );
    venv.join("bin/python")
}

#[tokio::test]
async fn an_mcp_client_with_an_agent_token_creates_a_child_within_the_tree() {
    let app = spawn_app_with(|s| {
        with_exec_agent(s);
        s.limits.max_children_per_agent = 1;
    })
    .await;
    let w = world(&app).await;
    let parent = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    let parent = id(&parent).to_owned();
    let token = token_of(&app, &parent, &w.worktree, "parent-token").await;
    let carl = person(&app, "carl").await;
    let carl_team = team(&carl, "carl-team").await;
    let repo_c = git_repo();
    let project = Caller::new(&app, &app.token)
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "c", "repo_path": repo_c.path(), "team_id": carl_team})),
            201,
        )
        .await;
    let foreign = carl
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;

    let run = tokio::process::Command::new(mcp_python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/mcp_child.py"
        ))
        .env_clear()
        .env("MCP_CLIENT_URL", app.url("/mcp"))
        .env("MCP_CLIENT_TOKEN", &token)
        .env("WORKSPACE_ID", &w.workspace)
        .env("FOREIGN_WORKSPACE_ID", id(&foreign))
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the MCP client finishes within 2 minutes")
        .unwrap();
    assert!(
        output.status.success(),
        "the MCP client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let out: Value = serde_json::from_slice(&output.stdout).unwrap();

    let created = &out["create_child"];
    assert_eq!(created["is_error"], false, "{created}");
    assert_eq!(created["structured"]["parent_agent_id"], parent.as_str());
    let waited = &out["wait_child"]["structured"];
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let foreign_try = &out["create_foreign"];
    assert_eq!(foreign_try["is_error"], true, "{foreign_try}");
    assert_eq!(foreign_try["structured"]["code"], "not_found");
    let second = &out["create_second"];
    assert_eq!(second["is_error"], true, "{second}");
    assert_eq!(second["structured"]["code"], "agent_children_exceeded");

    let child = created["structured"]["id"].as_str().unwrap();
    let seen = app.get_ok(&format!("/v1/agents/{child}")).await;
    assert_eq!(seen["parent_agent_id"], parent.as_str());
    // Its prompt is audited with the parent as actor.
    let audit = app
        .get_ok(&format!(
            "/v1/audit?team_id={}&action=agent.prompt&actor_id={parent}",
            w.team
        ))
        .await;
    let prompts: Vec<&Value> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["target"]["id"] == child)
        .collect();
    assert_eq!(prompts.len(), 1, "{audit}");
    assert_eq!(prompts[0]["details"]["on_behalf_of"], w.bob.id.as_str());
}

/// `group_by`'s keys and input tokens, by key.
fn groups_of(report: &Value) -> Vec<(String, i64)> {
    let mut groups: Vec<(String, i64)> = report["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let key = g["key"].as_str().unwrap().to_owned();
            (key, g["input_tokens"].as_i64().unwrap())
        })
        .collect();
    groups.sort();
    groups
}

#[tokio::test]
async fn a_childs_spend_is_its_creators_and_names_the_agent_that_made_it() {
    let app = spawn_app_with(with_exec_agent).await;
    let w = world(&app).await;
    let parent = agent_by(&app, &w.bob.api, &w, EXEC_PROVIDER, json!({})).await;
    let parent = id(&parent).to_owned();
    let token = token_of(&app, &parent, &w.worktree, "parent-token").await;
    let child = Caller::new(&app, &token)
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": w.workspace, "provider": "mock"})),
            201,
        )
        .await;
    let child = id(&child).to_owned();
    app.wait(&child).await;
    app.prompt(&child, "/usage 7 1").await;
    app.wait(&child).await;
    let own = agent_by(&app, &w.bob.api, &w, "mock", json!({})).await;
    app.prompt(id(&own), "/usage 20 2").await;
    app.wait(id(&own)).await;

    let usage = |group: &str| {
        let path = format!("/v1/usage?team_id={}&group_by={group}", w.team);
        let ana = &w.ana.api;
        async move { ana.ok(Method::GET, &path, None, 200).await }
    };
    // Bob answers for what his agent's child spent.
    let by_person = usage("person").await;
    assert_eq!(
        groups_of(&by_person),
        vec![(w.bob.id.clone(), 27)],
        "{by_person}"
    );
    // The parent is named: the child's turn under its parent, the rest under "".
    let by_parent = usage("parent_agent").await;
    assert_eq!(
        groups_of(&by_parent),
        vec![(String::new(), 20), (parent.clone(), 7)],
        "{by_parent}"
    );
    let (status, body) = w
        .ana
        .api
        .call(
            Method::GET,
            &format!("/v1/usage?team_id={}&group_by=agent_tree", w.team),
            None,
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("parent_agent")
            || body.to_string().contains("parent_agent"),
        "{body}"
    );
}
