//! Attacks on what the server runs and holds for a plain member, through the API only:
//! a member naming a command as an MCP server (directly, or through a hook's answer),
//! MCP credentials left readable in the database, metric series minted by made-up
//! methods, unbounded streams, `wait`s, agents, workspaces and projects, an unbounded
//! mock `/load`, and catalog refreshes that each start a CLI. Each test plays the attack
//! and asserts the refusal and that nothing happened.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentry::config::{McpServerSetting, ProviderSettings, Settings};
use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::helpers::*;
use crate::people::*;

/// `[mcp.servers.files]`, usable by the teams named (absent: every team).
fn files_server(s: &mut Settings, teams: Option<&[&str]>) {
    s.mcp.servers.insert(
        "files".into(),
        McpServerSetting {
            command: "mcp-files".into(),
            args: vec!["--root".into(), ".".into()],
            env: BTreeMap::from([(
                "FILES_TOKEN".to_owned(),
                agentry::config::Secret::new("settings-env-value"),
            )]),
            teams: teams.map(|t| t.iter().map(|n| (*n).to_owned()).collect()),
        },
    );
}

/// A plain member with a team of their own named `team_name`, a project of it (the admin
/// adds the repository) and a workspace: `(member, team id, workspace id)`.
async fn member_with_workspace(
    app: &TestApp,
    name: &str,
    team_name: &str,
    repo: &Path,
) -> (Person, String, String) {
    let member = person(app, name).await;
    let team = team(&member, team_name).await;
    let admin = Caller::new(app, &app.token);
    let project = admin
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": format!("{name}-repo"), "repo_path": repo, "team_id": team})),
            201,
        )
        .await;
    let ws = member
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    (member, team, ws["id"].as_str().unwrap().to_owned())
}

async fn agents_of(app: &TestApp, team: &str) -> i64 {
    let team = uuid_of(team);
    sqlx::query_scalar("SELECT count(*) FROM agents WHERE team_id = $1")
        .bind(team)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// The uuid inside a prefixed id (`tea_<32 hex>`).
fn uuid_of(id: &str) -> uuid::Uuid {
    let hex = id.rsplit('_').next().unwrap();
    uuid::Uuid::parse_str(hex).unwrap()
}

/// A creation failed by a hook's answer that named an MCP command.
fn assert_hook_refused_command(status: u16, body: &Value) {
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("hook_failed")),
        "{body}"
    );
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("mcp_servers.planted.command"), "{body}");
}

#[tokio::test]
async fn a_member_naming_an_mcp_command_gets_422_naming_the_field_and_nothing_runs() {
    let app = spawn_app_with(|s| files_server(s, Some(&["web"]))).await;
    let repo = git_repo();
    let (mallory, team, ws) = member_with_workspace(&app, "mallory", "lab", repo.path()).await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("marker");
    let m = marker.display().to_string();
    for (servers, field) in [
        (
            json!({"x": {"command": "touch", "args": [m]}}),
            "mcp_servers.x.command",
        ),
        (
            json!({"x": {"type": "stdio", "command": ["sh", "-c", format!("touch {m}")]}}),
            "mcp_servers.x.command",
        ),
        (
            json!({"x": {"type": "local", "command": "touch", "env": {"A": "1"}}}),
            "mcp_servers.x.command",
        ),
        // A settings server that names the marker in its arguments is still refused.
        (
            json!({"x": {"server": "files", "args": [m]}}),
            "mcp_servers.x.args",
        ),
        // The settings define `files` for team `web` only: `lab` may not use it, and is
        // told no more than about a server that does not exist.
        (json!({"x": {"server": "files"}}), "mcp_servers.x.server"),
        (json!({"x": {"server": "other"}}), "mcp_servers.x.server"),
        // Remote servers by URL only, under the hooks' address rule.
        (
            json!({"x": {"type": "http", "url": "http://169.254.169.254/latest"}}),
            "mcp_servers.x.url",
        ),
        (
            json!({"x": {"type": "sse", "url": "http://[::ffff:127.0.0.1]:9/sse"}}),
            "mcp_servers.x.url",
        ),
    ] {
        let (status, body) = mallory
            .api
            .call(
                Method::POST,
                "/v1/agents",
                Some(json!({"workspace_id": ws, "provider": "mock", "mcp_servers": servers, "prompt": "hi"})),
            )
            .await;
        assert_eq!(status, 422, "{servers}: {body}");
        assert_eq!(body["code"], "validation_failed", "{body}");
        assert_eq!(body["errors"][0]["field"], field, "{servers}: {body}");
    }
    assert_eq!(agents_of(&app, &team).await, 0, "no agent was created");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!marker.exists(), "no command ran");
}

#[tokio::test]
async fn a_settings_server_the_team_may_use_is_named_and_stored_by_name() {
    let app = spawn_app_with(|s| files_server(s, Some(&["web"]))).await;
    let repo = git_repo();
    let (ana, team, ws) = member_with_workspace(&app, "ana", "web", repo.path()).await;
    let agent = ana
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock",
                "mcp_servers": {"f": {"server": "files"}}})),
            201,
        )
        .await;
    assert_eq!(agents_of(&app, &team).await, 1);
    let stored: Value = sqlx::query_scalar("SELECT mcp_servers FROM agents WHERE id = $1")
        .bind(uuid_of(agent["id"].as_str().unwrap()))
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        stored,
        json!({"f": {"server": "files"}}),
        "stored by name only"
    );
    app.assert_database_lacks(&["settings-env-value"]).await;
}

/// One HTTP/1.1 request with a `Content-Length` body: its head and its body.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = buf[end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((head, body))
}

/// A hook receiver that answers `agent.*.before` calls with `answer(event, request)` and
/// records every payload it got.
struct HookReceiver {
    url: String,
    got: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HookReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HookReceiver {
    async fn start(answer: fn(&str, Value) -> Value) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let got = Arc::new(Mutex::new(Vec::new()));
        let seen = got.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen.clone();
                tokio::spawn(async move {
                    let Some((head, body)) = read_request(&mut stream).await else {
                        return;
                    };
                    let event = head
                        .lines()
                        .find_map(|l| {
                            let (name, value) = l.split_once(':')?;
                            name.eq_ignore_ascii_case("agentry-event")
                                .then(|| value.trim().to_owned())
                        })
                        .unwrap_or_default();
                    let mut body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    body["hook_event"] = json!(event);
                    seen.lock().unwrap().push(body.clone());
                    let request = body["payload"]["request"].clone();
                    let reply = json!({"request": answer(&event, request)}).to_string();
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        reply.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(reply.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self { url, got, task }
    }
}

#[tokio::test]
async fn a_hook_answering_with_an_mcp_command_fails_the_creation_and_sees_credentials_masked() {
    let app = spawn_app_with(|s| files_server(s, None)).await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("hook-marker");
    let rx = HookReceiver::start(|event, mut request| {
        if event == "agent.create.before" && request["config"]["title"] == "plant" {
            request["config"]["mcp_servers"]["planted"] = json!({"command": "touch"});
        }
        if event == "agent.open.before" {
            request["mcp_servers"]["planted"] =
                json!({"command": "sh", "args": ["-c", "touch /nonexistent/never"]});
        }
        request
    })
    .await;
    // A server-wide hook (only an admin may add one), on both agent events.
    app.post_ok(
        "/v1/hooks",
        json!({"name": "policy", "events": ["agent.create.before", "agent.open.before"],
            "url": rx.url, "secret": "whsec_attack_bounds_0123", "team_id": null}),
        201,
    )
    .await;
    let repo = git_repo();
    let (mallory, team, ws) = member_with_workspace(&app, "mallory", "lab", repo.path()).await;
    let (status, body) = mallory
        .api
        .call(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock",
                "mcp_servers": {"r": {"type": "http", "url": "https://mcp.example.com/x",
                    "headers": {"Authorization": "Bearer hook-should-never-see-this"}}}})),
        )
        .await;
    assert_hook_refused_command(status, &body);
    assert_eq!(agents_of(&app, &team).await, 0);
    assert!(!marker.exists());
    // The same from agent.create.before, which may change the saved configuration.
    let (status, body) = mallory
        .api
        .call(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock", "title": "plant"})),
        )
        .await;
    assert_hook_refused_command(status, &body);
    assert_eq!(agents_of(&app, &team).await, 0);
    let got = rx.got.lock().unwrap().clone();
    let create = got
        .iter()
        .find(|b| b["hook_event"] == "agent.create.before")
        .expect("the create hook was called");
    assert_eq!(
        create["payload"]["request"]["config"]["mcp_servers"]["r"]["headers"]["Authorization"],
        "[masked]",
        "{create}"
    );
    for b in &got {
        assert!(
            !b.to_string().contains("hook-should-never-see-this"),
            "a hook payload carries the credential: {b}"
        );
    }
}

#[tokio::test]
async fn mcp_credentials_are_sealed_at_rest_and_shown_nowhere() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (ana, _team, ws) = member_with_workspace(&app, "ana", "web", repo.path()).await;
    let secret = "mcp-header-credential-7f3a9c";
    let agent = ana
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock",
                "mcp_servers": {"r": {"type": "http", "url": "https://mcp.example.com/x",
                    "headers": {"Authorization": format!("Bearer {secret}")}}}})),
            201,
        )
        .await;
    let id = agent["id"].as_str().unwrap().to_owned();
    assert!(!agent.to_string().contains(secret), "{agent}");
    let read = ana
        .api
        .ok(Method::GET, &format!("/v1/agents/{id}"), None, 200)
        .await;
    assert!(!read.to_string().contains(secret), "{read}");
    // A reopen opens the sealed value for the launch (the agent still works).
    let admin = Caller::new(&app, &app.token);
    admin
        .ok(Method::POST, &format!("/v1/agents/{id}/close"), None, 200)
        .await;
    let turn = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/agents/{id}/messages"),
            Some(json!({"text": "hello again"})),
            202,
        )
        .await;
    assert!(turn["turn_id"].is_string());
    app.wait(&id).await;
    let audit = admin.ok(Method::GET, "/v1/audit", None, 200).await;
    assert!(!audit.to_string().contains(secret), "{audit}");
    app.assert_database_lacks(&[secret]).await;
}

#[tokio::test]
async fn made_up_methods_mint_no_metric_series() {
    let app = spawn_app().await;
    let client = reqwest::Client::new();
    for i in 0..3000 {
        let method = Method::from_bytes(format!("X{i}").as_bytes()).unwrap();
        let _ = client
            .request(method, app.url("/healthz"))
            .send()
            .await
            .unwrap();
    }
    let page = client
        .get(app.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("agentry_http_requests_total{"))
        .collect();
    assert!(series.len() < 10, "{} series: {series:?}", series.len());
    assert!(
        series.iter().any(|l| l.contains("method=\"other\"")),
        "{series:?}"
    );
    assert!(
        !page.contains("method=\"X1"),
        "made-up methods are not labels"
    );
    let durations = page
        .lines()
        .filter(|l| l.starts_with("agentry_http_request_duration_seconds_count{"))
        .count();
    assert!(durations < 10, "{durations}");
}

#[tokio::test]
async fn unmatched_paths_share_one_route_label() {
    let app = spawn_app().await;
    for i in 0..200 {
        let _ = app.get(&format!("/made/up/{i}")).await;
        let _ = app.get(&format!("/v1/agents/agt_{i}/nothing/{i}")).await;
    }
    let page = app.get("/metrics").await.text().await.unwrap();
    assert!(!page.contains("/made/up"), "raw paths are not labels");
    assert!(!page.contains("nothing"), "raw paths are not labels");
    assert!(page.contains("route=\"unmatched\""));
}

/// The problem is 429 `limit_reached` and its detail names the limit and its value.
fn assert_limit(status: u16, body: &Value, limit: &str, value: u64) {
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["code"], "limit_reached", "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains(limit) && detail.contains(&format!("({value})")),
        "{detail}"
    );
}

#[tokio::test]
async fn per_team_limits_refuse_one_more_agent_workspace_or_project_with_429() {
    let app = spawn_app_with(|s| {
        s.limits.max_agents_per_team = 1;
        s.limits.max_workspaces_per_team = 2;
        s.limits.max_projects_per_team = 1;
    })
    .await;
    let repo = git_repo();
    let (mallory, team, ws) = member_with_workspace(&app, "mallory", "lab", repo.path()).await;
    mallory
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock"})),
            201,
        )
        .await;
    let (status, body) = mallory
        .api
        .call(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock"})),
        )
        .await;
    assert_limit(status, &body, "limits.max_agents_per_team", 1);
    assert_eq!(agents_of(&app, &team).await, 1, "no second agent");

    let project =
        mallory.api.ok(Method::GET, "/v1/projects", None, 200).await["items"][0]["id"].clone();
    mallory
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project})),
            201,
        )
        .await;
    let (status, body) = mallory
        .api
        .call(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project})),
        )
        .await;
    assert_limit(status, &body, "limits.max_workspaces_per_team", 2);
    let workspaces: i64 = sqlx::query_scalar("SELECT count(*) FROM workspaces WHERE team_id = $1")
        .bind(uuid_of(&team))
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(workspaces, 2, "no third workspace");

    let admin = Caller::new(&app, &app.token);
    let other = git_repo();
    let (status, body) = admin
        .call(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "second", "repo_path": other.path(), "team_id": team})),
        )
        .await;
    assert_limit(status, &body, "limits.max_projects_per_team", 1);
}

#[tokio::test]
async fn open_streams_and_waits_are_bounded_per_principal() {
    let app = spawn_app_with(|s| {
        s.limits.max_streams_per_principal = 2;
        s.limits.max_waits_per_principal = 1;
        s.events.ping_interval_s = 1;
    })
    .await;
    let repo = git_repo();
    let (mallory, _team, ws) = member_with_workspace(&app, "mallory", "lab", repo.path()).await;
    let open = || {
        app.client
            .get(app.url("/v1/events"))
            .bearer_auth(&mallory.api.token)
            .send()
    };
    let first = open().await.unwrap();
    let second = open().await.unwrap();
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let third = open().await.unwrap();
    let status = third.status().as_u16();
    let body: Value = third.json().await.unwrap();
    assert_limit(status, &body, "limits.max_streams_per_principal", 2);
    // Another principal has a count of its own.
    let admin = Caller::new(&app, &app.token);
    let (status, _) = admin.call(Method::GET, "/v1/events", None).await;
    assert_eq!(status, 200);
    // A closed stream gives its slot back (within a keep-alive or two).
    drop(first);
    let mut reopened = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let res = open().await.unwrap();
        if res.status() == 200 {
            reopened += 1;
            drop(res);
            break;
        }
    }
    assert_eq!(reopened, 1, "the slot of a closed stream is freed");
    drop(second);

    // `wait`: one at a time for this principal while the agent works.
    let agent = mallory
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock"})),
            201,
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.wait(&agent).await;
    mallory
        .api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent}/messages"),
            Some(json!({"text": "/sleep 3000"})),
            202,
        )
        .await;
    let waiting = {
        let api = mallory.api.clone();
        let path = format!("/v1/agents/{agent}/wait?timeout_s=20");
        tokio::spawn(async move { api.call(Method::GET, &path, None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = mallory
        .api
        .call(
            Method::GET,
            &format!("/v1/agents/{agent}/wait?timeout_s=20"),
            None,
        )
        .await;
    assert_limit(status, &body, "limits.max_waits_per_principal", 1);
    let (status, done) = waiting.await.unwrap();
    assert_eq!(status, 200, "{done}");
    // Once it returned, the slot is free again.
    mallory
        .api
        .ok(
            Method::GET,
            &format!("/v1/agents/{agent}/wait?timeout_s=1"),
            None,
            200,
        )
        .await;
}

#[tokio::test]
async fn the_mock_load_is_capped_and_emits_nothing_over_its_bounds() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    for load in ["/load 100001 0", "/load 2 60001", "/load 60001 10"] {
        app.prompt(&agent, load).await;
        let done = app.wait(&agent).await;
        assert_eq!(done["last_turn"]["outcome"], "failed", "{load}: {done}");
        assert!(
            done["last_turn"]["error"]
                .as_str()
                .unwrap_or_default()
                .contains("/load"),
            "{load}: {done}"
        );
    }
    let deltas = app
        .timeline(&agent)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "assistant_delta")
        .count();
    assert_eq!(deltas, 0, "nothing was emitted");
    app.prompt(&agent, "/load 10 0").await;
    let done = app.wait(&agent).await;
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
}

#[tokio::test]
async fn catalog_refreshes_are_bounded_per_team() {
    // A provider CLI that records each start: every catalog probe is one line.
    let dir = tempfile::tempdir().unwrap();
    let starts = dir.path().join("starts");
    let cli = dir.path().join("opencode");
    std::fs::write(
        &cli,
        format!(
            "#!/bin/sh\necho started >> '{}'\nexit 3\n",
            starts.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cli, std::fs::Permissions::from_mode(0o755)).unwrap();
    let command = cli.display().to_string();
    let app = spawn_app_with(move |s| {
        s.limits.catalog_refreshes_per_minute = 2;
        s.providers.insert(
            "opencode".into(),
            ProviderSettings {
                command: Some(vec![command]),
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let (mallory, _team, _ws) = member_with_workspace(&app, "mallory", "lab", repo.path()).await;
    let count = || {
        std::fs::read_to_string(&starts)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    mallory
        .api
        .call(Method::GET, "/v1/providers/opencode/models", None)
        .await;
    assert_eq!(count(), 1, "the first read probes");
    for _ in 0..10 {
        let (status, body) = mallory
            .api
            .call(
                Method::GET,
                "/v1/providers/opencode/models?refresh=true",
                None,
            )
            .await;
        assert_ne!(
            status, 429,
            "past the bound the cached catalog answers: {body}"
        );
    }
    assert_eq!(
        count(),
        3,
        "two refreshes a minute, then the cached catalog"
    );
}

#[tokio::test]
async fn mcp_credentials_stored_in_the_clear_before_an_upgrade_are_sealed_on_start() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (ana, _team, ws) = member_with_workspace(&app, "ana", "web", repo.path()).await;
    let agent = ana
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock"})),
            201,
        )
        .await;
    // What an older server stored: the header value as given.
    let secret = "legacy-mcp-credential-51c0";
    sqlx::query("UPDATE agents SET mcp_servers = $2 WHERE id = $1")
        .bind(uuid_of(agent["id"].as_str().unwrap()))
        .bind(
            json!({"r": {"type": "http", "url": "https://mcp.example.com/x",
            "headers": {"Authorization": secret}}}),
        )
        .execute(&app.pool)
        .await
        .unwrap();
    let (db, data_dir, token) = app.stop().await;
    let app = spawn_on(db, data_dir, Some(token)).await;
    app.assert_database_lacks(&[secret]).await;
}

#[tokio::test]
async fn a_remote_mcp_server_whose_name_resolves_inside_is_refused() {
    // `localhost.` (with its root dot) is not the literal `localhost` the URL check
    // knows; the host's own name usually resolves to a loopback or private address too.
    let mut names = vec!["localhost.".to_owned()];
    if let Ok(h) = std::fs::read_to_string("/etc/hostname") {
        names.push(h.trim().to_owned());
    }
    let mut inside = Vec::new();
    for n in names {
        let addrs: Vec<std::net::IpAddr> = match tokio::net::lookup_host((n.as_str(), 80)).await {
            Ok(a) => a.map(|a| a.ip()).collect(),
            Err(_) => continue,
        };
        if addrs
            .iter()
            .any(|ip| agentry::services::hooks::is_internal(*ip))
        {
            inside.push(n);
        }
    }
    // Every host resolves `localhost.` through its hosts file; one that resolves none of
    // these cannot show the refusal, and a test that did nothing must not pass.
    let name = inside
        .first()
        .expect("`localhost.` or the host's name resolves to an internal address");
    let app = spawn_app().await;
    let repo = git_repo();
    let (mallory, team, ws) = member_with_workspace(&app, "mallory", "lab", repo.path()).await;
    let (status, body) = mallory
        .api
        .call(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock",
                "mcp_servers": {"r": {"type": "http", "url": format!("http://{name}:9/mcp")}}})),
        )
        .await;
    assert_eq!(status, 422, "{name}: {body}");
    assert_eq!(body["errors"][0]["field"], "mcp_servers.r.url", "{body}");
    assert_eq!(agents_of(&app, &team).await, 0);
}
