//! The dashboard in a real browser: tests/browser/dashboard.py drives Debian's Chromium
//! through Playwright against a real server with the mock provider. Screenshots of each
//! page are kept in `target/dashboard-screenshots/` (or `$AGENTRY_SCREENSHOTS`).

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use std::path::PathBuf;

use helpers::*;
use serde_json::json;

/// The Python of the pinned Playwright install (`.ci/install-browser`); fails the test when
/// it or Chromium is missing.
fn playwright_python() -> PathBuf {
    let version = include_str!("../.ci/browser-pin")
        .lines()
        .find(|l| !l.starts_with('#') && !l.trim().is_empty())
        .expect("a version in .ci/browser-pin")
        .trim()
        .to_owned();
    let cache = std::env::var_os("AGENTRY_PLAYWRIGHT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/agentry"));
    let venv = cache.join(format!("playwright-{version}"));
    let chromium = std::path::Path::new("/usr/bin/chromium").exists();
    assert!(
        venv.join(".installed").exists() && chromium,
        "Playwright {version} (at {}) or Chromium is not installed; run the tests with \
         .ci/test, which installs them (or run .ci/install-browser)",
        venv.display()
    );
    venv.join("bin/python")
}

#[tokio::test]
async fn the_dashboard_works_in_a_real_browser() {
    let python = playwright_python();
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "dashboard"}),
            201,
        )
        .await;
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "title": "Dashboard demo",
                   "labels": {"team": "web"}, "prompt": "Say hello to the dashboard."}),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap().to_owned();
    app.wait(&agent).await;
    // An agent with a long timeline (100,000 streamed chunks, then many small turns so
    // that the tail is not one message).
    let long = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "title": "Long timeline",
                   "prompt": "/load 100000 0"}),
            201,
        )
        .await;
    let long = long["id"].as_str().unwrap().to_owned();
    // 100,000 events take a while on a busy machine: up to two minutes.
    let mut done = app.wait(&long).await;
    for _ in 0..3 {
        if done["timed_out"] != true {
            break;
        }
        done = app.wait(&long).await;
    }
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
    for i in 0..60 {
        app.prompt(&long, &format!("note {i}")).await;
        app.wait(&long).await;
    }

    let shots = screenshots();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/dashboard.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            &app.base,
            &app.token,
            &agent,
            ws["id"].as_str().unwrap(),
            &shots.display().to_string(),
            &long,
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("dashboard: ok"), "{stdout}");
    eprintln!("{stdout}");
    for page in [
        "home",
        "agent",
        "agent-permission",
        "workspace",
        "agent-phone",
        "device",
        "agent-dark",
        "workspace-dark",
    ] {
        assert!(shots.join(format!("{page}.png")).is_file(), "{page}.png");
    }
    eprintln!("screenshots in {}", shots.display());
}

/// Running a team from the browser (tests/browser/team.py): an agent started from the
/// form (and one refused by a hook, with the hook's words on the form), a workspace
/// archived from the list, a member added and removed, service tokens created and revoked,
/// a secret set, a hook's delivery redelivered and all of it in the audit log. The
/// service token the page showed once then lists agents; the revoked one is refused.
#[tokio::test]
async fn a_team_runs_from_the_browser() {
    let python = playwright_python();
    let app = spawn_app_with(|s| {
        s.hooks.allow_private_networks = true;
        s.limits.max_agents_per_team = 2000;
    })
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let old = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "old experiment"}),
            201,
        )
        .await;
    // A thousand agents more (closed, a day old), written straight into the store: the
    // list must stay fast with them.
    let bulk = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "bulk"}),
            201,
        )
        .await;
    let bulk = bulk["id"].as_str().unwrap().to_owned();
    sqlx::query(
        "INSERT INTO agents (id, workspace_id, team_id, provider, title, status, labels, created_at)
         SELECT gen_random_uuid(), w.id, w.team_id, 'mock', 'seeded ' || i, 'closed',
                '{\"bulk\": \"yes\"}', now() - interval '1 day' - i * interval '1 second'
         FROM workspaces w, generate_series(1, 1000) i WHERE w.id = $1::uuid",
    )
    .bind(bulk.strip_prefix("wsp_").unwrap())
    .execute(&app.pool)
    .await
    .unwrap();
    let person = "ana@example.com";
    app.post_ok("/v1/users", json!({"email": person, "name": "Ana"}), 201)
        .await;

    let shots = screenshots();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/team.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            &app.base,
            &app.token,
            &shots.display().to_string(),
            person,
            old["id"].as_str().unwrap(),
            "old experiment",
            &bulk,
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("dashboard team: ok"), "{stdout}");
    let printed = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {stdout}"))
            .trim()
            .to_owned()
    };

    // The secret the page showed once works, as a CI job would use it.
    let agents = app
        .client
        .get(app.url("/v1/agents?status=idle"))
        .bearer_auth(printed("service-token:"))
        .send()
        .await
        .unwrap();
    assert_eq!(agents.status(), 200);
    let agents: serde_json::Value = agents.json().await.unwrap();
    let titles: Vec<&str> = agents["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["title"].as_str())
        .collect();
    assert_eq!(titles, ["From the form"], "{agents}");
    let revoked = app
        .client
        .get(app.url("/v1/agents"))
        .bearer_auth(printed("revoked-token:"))
        .send()
        .await
        .unwrap();
    assert_eq!(revoked.status(), 401);
    // Nothing of the refused agent was made; the archived workspace is archived.
    let old = app
        .get_ok(&format!("/v1/workspaces/{}", old["id"].as_str().unwrap()))
        .await;
    assert!(old["archived_at"].is_string(), "{old}");
    let all = app.get_ok("/v1/workspaces?include_archived=true").await;
    assert_eq!(all["items"].as_array().unwrap().len(), 3, "{all}");
    for page in [
        "new-agent",
        "new-agent-refused",
        "agents-attention",
        "workspaces",
        "team",
        "team-token",
        "audit",
        "home-phone",
        "new-agent-phone",
        "workspaces-phone",
        "team-phone",
    ] {
        assert!(shots.join(format!("{page}.png")).is_file(), "{page}.png");
    }
    eprintln!("{stdout}screenshots in {}", shots.display());
}

/// The usage page (tests/browser/usage.py): a team's spend this month as a chart, by
/// person and by provider, and its budget with what is left; and an agent's queued
/// messages under its composer, canceled from there.
#[tokio::test]
async fn the_usage_page_and_queued_messages_show_in_a_real_browser() {
    let python = playwright_python();
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let me = app.get_ok("/v1/me").await;
    let team = me["default_team_id"].as_str().unwrap().to_owned();
    app.put_ok(
        &format!("/v1/teams/{team}/budget"),
        json!({"period": "month", "max_cost_usd": 0.1}),
    )
    .await;
    // Two turns of 0.018 USD each.
    let spender = app.agent_in_new_workspace(&project, "mock").await;
    for _ in 0..2 {
        app.prompt(&spender, "/spend 1000 1000 1 0").await;
        assert_eq!(
            app.wait(&spender).await["last_turn"]["outcome"],
            "completed"
        );
    }
    // An agent held on a permission request, with two follow-ups waiting.
    let held = app.agent_in_new_workspace(&project, "mock").await;
    app.prompt(&held, "/ask hold on?").await;
    assert_eq!(app.wait(&held).await["status"], "waiting_permission");
    let (first, second) = ("first follow-up", "second follow-up");
    for text in [first, second] {
        let q = app
            .post_ok(
                &format!("/v1/agents/{held}/messages"),
                json!({"text": text}),
                202,
            )
            .await;
        assert_eq!(q["queued"], true, "{q}");
    }

    let shots = screenshots();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/usage.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            &app.base,
            &app.token,
            &shots.display().to_string(),
            &held,
            first,
            second,
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("dashboard usage: ok"), "{stdout}");
    // What the page did went through the API: one message canceled, one sent.
    let listed = app.get_ok(&format!("/v1/agents/{held}/messages")).await;
    let states: Vec<(&str, &str)> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["text"].as_str().unwrap(), m["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        states,
        [
            (first, "queued"),
            ("third, from the page", "queued"),
            (second, "canceled")
        ]
    );
    for page in ["usage-page", "queued-prompts"] {
        assert!(shots.join(format!("{page}.png")).is_file(), "{page}.png");
    }
    eprintln!("{stdout}screenshots in {}", shots.display());
}

/// An agent's tree on its page (tests/browser/tree.py): its child with live status, a new
/// child appearing and an archived one going, and the child's link back to its parent.
/// The parent is the scripted exec agent, whose own token opens the children.
#[tokio::test]
async fn the_agent_page_shows_its_tree() {
    let python = playwright_python();
    let app = spawn_app_with(with_exec_agent).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let worktree = path_of(&ws["path"]);
    let parent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": EXEC_PROVIDER, "title": "Lead"}),
            201,
        )
        .await;
    let parent = parent["id"].as_str().unwrap().to_owned();
    app.wait(&parent).await;
    // The parent's token, as its MCP client holds it: the agent writes it to a file.
    app.prompt(
        &parent,
        "printf %s \"$EXEC_AGENT_MCP_TOKEN\" > parent-token",
    )
    .await;
    app.wait(&parent).await;
    let parent_token = std::fs::read_to_string(worktree.join("parent-token")).unwrap();
    assert!(
        parent_token.starts_with("agt_pat_"),
        "the agent was given a token"
    );
    let res = app
        .client
        .post(format!("{}/v1/agents", app.base))
        .bearer_auth(&parent_token)
        .json(&json!({"workspace_id": ws["id"], "provider": "mock", "title": "Child one"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let child: serde_json::Value = res.json().await.unwrap();
    assert_eq!(child["parent_agent_id"], parent.as_str());
    let child = child["id"].as_str().unwrap().to_owned();
    app.wait(&child).await;

    let shots = screenshots();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/tree.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            &app.base,
            &app.token,
            &parent,
            &child,
            &parent_token,
            ws["id"].as_str().unwrap(),
            &shots.display().to_string(),
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("dashboard tree: ok"), "{stdout}");
    assert!(shots.join("agent-tree.png").is_file());
}

fn screenshots() -> PathBuf {
    let shots = std::env::var_os("AGENTRY_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../dashboard-screenshots")
        });
    std::fs::create_dir_all(&shots).unwrap();
    shots
}

/// The page and its assets come with a policy that allows nothing but this server's own
/// files; deep links serve the same page.
#[tokio::test]
async fn the_dashboard_is_served_with_a_strict_policy() {
    let app = spawn_app().await;
    for path in [
        "/",
        "/agents/agt_x",
        "/workspaces",
        "/workspaces/wsp_x",
        "/new",
        "/teams",
        "/teams/tea_x",
        "/teams/tea_x/usage",
        "/usage",
        "/device",
        "/ui/app.js",
        "/ui/app.css",
    ] {
        let res = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(res.status(), 200, "{path}");
        let csp = res.headers()["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"),
            "{csp}"
        );
        assert_eq!(res.headers()["x-content-type-options"], "nosniff");
    }
    let page = app
        .client
        .get(app.url("/"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("/ui/app.js") && !page.contains("http"),
        "no outside resource"
    );
    let config: serde_json::Value = app
        .client
        .get(app.url("/ui/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(config, json!({"oidc": false}));
}
