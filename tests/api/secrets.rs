//! Team secrets: owners set them, members list their names, no answer carries a value;
//! values are encrypted at rest (a moved or altered row does not open); a provider that
//! takes a team secret is unavailable to a team without it; an agent's process gets its
//! own team's value — when created, when resumed after a close and after a restart; key
//! rotation with `previous_keys` and `agentry secrets rotate`.
//!
//! The agent here is a real child: an ACP provider whose command writes its environment
//! to a file and then runs the mock agent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentry::auth::tokens;
use agentry::config::{ProviderSettings, Secret, Settings};
use agentry::store::identity;
use base64::Engine;
use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::helpers::*;

/// The provider whose processes write their environment to `<dir>/<pid>.env`.
const ENVDUMP: &str = "envdump";

fn envdump(s: &mut Settings, dir: &Path) {
    // The dump is written outside the agent's worktree, which a sandbox forbids: these
    // tests look at the environment, not at confinement.
    s.sandbox.mode = agentry::config::SandboxMode::Off;
    let script = format!(
        "env > \"$ENV_DUMP_DIR/$$.env\"; exec '{}' mock-agent",
        env!("CARGO_BIN_EXE_agentry")
    );
    s.providers.insert(
        ENVDUMP.into(),
        ProviderSettings {
            extends: Some("acp".into()),
            command: Some(vec!["sh".into(), "-c".into(), script]),
            env: [("ENV_DUMP_DIR".to_owned(), dir.display().to_string())].into(),
            team_secrets: vec!["TEAM_TOKEN".into()],
            ..Default::default()
        },
    );
}

fn key(n: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([n; 32])
}

pub(crate) fn with_keys(s: &mut Settings, current: u8, previous: &[u8]) {
    s.secrets.key = Some(Secret::new(key(current)));
    s.secrets.previous_keys = previous.iter().map(|n| Secret::new(key(*n))).collect();
}

/// A request with `token`: status and body text.
async fn call(
    app: &TestApp,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    let mut req = app.client.request(method, app.url(path)).bearer_auth(token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let res = req.send().await.unwrap();
    (res.status().as_u16(), res.text().await.unwrap())
}

fn code(body: &str) -> String {
    serde_json::from_str::<Value>(body).unwrap_or_default()["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn put_secret(
    app: &TestApp,
    token: &str,
    team: &str,
    name: &str,
    value: &str,
) -> (u16, String) {
    call(
        app,
        token,
        Method::PUT,
        &format!("/v1/teams/{team}/secrets/{name}"),
        Some(json!({ "value": value })),
    )
    .await
}

/// The id of the bootstrap admin's team (`default`).
async fn default_team(app: &TestApp) -> String {
    app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A new user with `role` in `team` and a token (with `scopes`) for them.
async fn user_in(app: &TestApp, team: Uuid, role: &str, scopes: &[&str]) -> String {
    let user = Uuid::now_v7();
    identity::insert_user(&app.pool, user, &format!("{user}@example.com"), "U", false)
        .await
        .unwrap();
    identity::upsert_member(&app.pool, team, user, role)
        .await
        .unwrap();
    let token = tokens::generate();
    let scopes: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
    identity::insert_token(
        &app.pool,
        Uuid::now_v7(),
        user,
        None,
        None,
        "t",
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &scopes,
        None,
    )
    .await
    .unwrap();
    token
}

/// A second team with an owner; returns (wire team id, owner token).
async fn other_team(app: &TestApp, name: &str) -> (String, String) {
    let team = Uuid::now_v7();
    identity::insert_team(&app.pool, team, name).await.unwrap();
    let token = user_in(app, team, "owner", &[]).await;
    (format!("team_{}", team.simple()), token)
}

fn uuid_of(team: &str) -> Uuid {
    team.strip_prefix("team_").unwrap().parse().unwrap()
}

/// A project and workspace of the caller's team (`token`); returns the workspace id.
async fn workspace(app: &TestApp, token: &str, team: &str, repo: &Path) -> String {
    // Registering a local repository is a server admin's part.
    let (s, body) = call(
        app,
        &app.token,
        Method::POST,
        "/v1/projects",
        Some(json!({"name": format!("p-{}", Uuid::now_v7().simple()), "repo_path": repo, "team_id": team})),
    )
    .await;
    assert_eq!(s, 201, "{body}");
    let project: Value = serde_json::from_str(&body).unwrap();
    let (s, body) = call(
        app,
        token,
        Method::POST,
        "/v1/workspaces",
        Some(json!({"project_id": project["id"]})),
    )
    .await;
    assert_eq!(s, 201, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Create an agent on `provider`; status and body.
async fn create_agent(app: &TestApp, token: &str, ws: &str, provider: &str) -> (u16, Value) {
    let (s, body) = call(
        app,
        token,
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": ws, "provider": provider})),
    )
    .await;
    (
        s,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// `provider` as `GET /v1/providers` shows it to `token`'s team.
async fn provider_view(app: &TestApp, token: &str, provider: &str) -> Value {
    let (s, body) = call(app, token, Method::GET, "/v1/providers", None).await;
    assert_eq!(s, 200, "{body}");
    let list: Value = serde_json::from_str(&body).unwrap();
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == provider)
        .unwrap_or_else(|| panic!("{provider} is listed: {list}"))
        .clone()
}

/// The environment the agent's current process started with.
async fn agent_env(app: &TestApp, token: &str, agent: &str, dir: &Path) -> String {
    let mut pid = Value::Null;
    for _ in 0..500 {
        let (_, body) = call(
            app,
            token,
            Method::GET,
            &format!("/v1/agents/{agent}"),
            None,
        )
        .await;
        pid = serde_json::from_str::<Value>(&body).unwrap()["runtime"]["pid"].clone();
        if pid.is_u64() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let file: PathBuf = dir.join(format!("{}.env", pid.as_u64().expect("the agent runs")));
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

fn var<'a>(env: &'a str, name: &str) -> Option<&'a str> {
    env.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
}

async fn wait_idle(app: &TestApp, token: &str, agent: &str) -> Value {
    let (s, body) = call(
        app,
        token,
        Method::GET,
        &format!("/v1/agents/{agent}/wait?timeout_s=30"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[tokio::test]
async fn owners_set_secrets_that_no_answer_ever_shows() {
    let app = spawn_app().await;
    let team = default_team(&app).await;
    let value = "sk-test-never-shown-7f3a";
    let path = format!("/v1/teams/{team}/secrets/ANTHROPIC_API_KEY");

    let (s, body) = put_secret(&app, &app.token, &team, "ANTHROPIC_API_KEY", value).await;
    assert_eq!(s, 201, "{body}");
    let created: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(created["name"], "ANTHROPIC_API_KEY");
    assert!(created["updated_by"].as_str().unwrap().starts_with("usr_"));
    assert!(
        created.get("value").is_none() && !body.contains(value),
        "{body}"
    );
    let (s, body) = put_secret(&app, &app.token, &team, "ANTHROPIC_API_KEY", "replaced-9c1").await;
    assert_eq!(s, 200, "replacing answers 200: {body}");
    let replaced: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(replaced["created_at"], created["created_at"]);
    assert_ne!(replaced["updated_at"], created["updated_at"]);
    put_secret(&app, &app.token, &team, "A_SECOND", "v2").await;

    let (s, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/teams/{team}/secrets"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let list: Value = serde_json::from_str(&body).unwrap();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ANTHROPIC_API_KEY", "A_SECOND"]);
    assert!(
        !body.contains(value) && !body.contains("replaced-9c1") && !body.contains("\"value\""),
        "{body}"
    );
    // Each change is in the audit log, by name; no value is.
    let (s, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/audit?team_id={team}&action=secret.set"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let audit: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(audit["items"].as_array().unwrap().len(), 3, "{body}");
    assert_eq!(audit["items"][2]["target"]["id"], "ANTHROPIC_API_KEY");
    assert_eq!(audit["items"][2]["details"]["created"], true);
    assert!(
        !body.contains(value) && !body.contains("replaced-9c1"),
        "{body}"
    );
    // Pages, by name.
    let (_, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/teams/{team}/secrets?limit=1"),
        None,
    )
    .await;
    let page: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    let cursor = page["next_cursor"].as_str().unwrap();
    let (_, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/teams/{team}/secrets?limit=1&cursor={cursor}"),
        None,
    )
    .await;
    let page: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(page["items"][0]["name"], "A_SECOND");
    assert!(page["next_cursor"].is_null());

    // Bad input: problem+json naming the field, never echoing the value.
    for (name, body, field) in [
        ("lower_case", json!({"value": "x"}), "name"),
        ("1ABC", json!({"value": "x"}), "name"),
        ("OK_NAME", json!({"value": ""}), "value"),
        (
            "OK_NAME",
            json!({"value": "y".repeat(32 * 1024 + 1)}),
            "value",
        ),
    ] {
        let (s, text) = call(
            &app,
            &app.token,
            Method::PUT,
            &format!("/v1/teams/{team}/secrets/{name}"),
            Some(body),
        )
        .await;
        assert_eq!(
            (s, code(&text)),
            (422, "validation_failed".into()),
            "{name}: {text}"
        );
        let problem: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(problem["errors"][0]["field"], field, "{text}");
        assert!(!text.contains("yyyy"), "{text}");
    }
    let (s, text) = call(
        &app,
        &app.token,
        Method::PUT,
        &path,
        Some(json!({"value": "v", "note": 1})),
    )
    .await;
    assert_eq!(
        (s, code(&text)),
        (422, "validation_failed".into()),
        "{text}"
    );
    // A team that does not exist (even for an admin) or a malformed id: 404.
    let nobody = format!("team_{}", Uuid::now_v7().simple());
    for team in [
        nobody.as_str(),
        "team_nope",
        "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
    ] {
        let (s, text) = put_secret(&app, &app.token, team, "K", "v").await;
        assert_eq!(
            (s, code(&text)),
            (404, "not_found".into()),
            "{team}: {text}"
        );
        let (s, _) = call(
            &app,
            &app.token,
            Method::GET,
            &format!("/v1/teams/{team}/secrets"),
            None,
        )
        .await;
        assert_eq!(s, 404, "{team}");
    }

    // Roles: members and viewers list names; only owners write. Token scopes apply.
    let team_uuid = uuid_of(&team);
    let member = user_in(&app, team_uuid, "member", &[]).await;
    let viewer = user_in(&app, team_uuid, "viewer", &[]).await;
    let owner_read_only = user_in(&app, team_uuid, "owner", &["read"]).await;
    let owner_agents = user_in(&app, team_uuid, "owner", &["agents"]).await;
    for (who, token, code_) in [
        ("member", &member, "forbidden"),
        ("viewer", &viewer, "forbidden"),
        ("a read token", &owner_read_only, "insufficient_scope"),
        ("an agents token", &owner_agents, "insufficient_scope"),
    ] {
        let (s, text) = put_secret(&app, token, &team, "ANTHROPIC_API_KEY", "stolen").await;
        assert_eq!(s, 403, "{who}: {text}");
        assert_eq!(code(&text), code_, "{who}: {text}");
        let (s, text) = call(&app, token, Method::DELETE, &path, None).await;
        assert_eq!(s, 403, "{who}: {text}");
        let (s, text) = call(
            &app,
            token,
            Method::GET,
            &format!("/v1/teams/{team}/secrets"),
            None,
        )
        .await;
        assert_eq!(s, 200, "{who} lists names: {text}");
        assert!(!text.contains(value) && !text.contains("replaced-9c1"));
    }
    // Another team's owner: team A's secrets do not exist for them.
    let (other, other_owner) = other_team(&app, "other").await;
    for (method, p, body) in [
        (Method::PUT, path.clone(), Some(json!({"value": "x"}))),
        (Method::GET, format!("/v1/teams/{team}/secrets"), None),
        (Method::DELETE, path.clone(), None),
    ] {
        let (s, text) = call(&app, &other_owner, method.clone(), &p, body).await;
        assert_eq!(
            (s, code(&text)),
            (404, "not_found".into()),
            "{method} {p}: {text}"
        );
    }
    // Their own team is theirs to manage; the admin's list does not mix them.
    let (s, _) = put_secret(&app, &other_owner, &other, "ANTHROPIC_API_KEY", "theirs").await;
    assert_eq!(s, 201);
    let (_, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/teams/{team}/secrets"),
        None,
    )
    .await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // Delete: 204, then the name is gone (404).
    let (s, _) = call(&app, &app.token, Method::DELETE, &path, None).await;
    assert_eq!(s, 204);
    let (s, text) = call(&app, &app.token, Method::DELETE, &path, None).await;
    assert_eq!((s, code(&text)), (404, "not_found".into()), "{text}");
    let (_, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/audit?team_id={team}&action=secret.delete"),
        None,
    )
    .await;
    let audit: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(audit["items"].as_array().unwrap().len(), 1, "{body}");
    let (s, text) = call(
        &app,
        &app.token,
        Method::DELETE,
        &format!("/v1/teams/{team}/secrets/bad-name"),
        None,
    )
    .await;
    assert_eq!(s, 404, "{text}");
    let (_, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/teams/{team}/secrets"),
        None,
    )
    .await;
    assert!(!body.contains("ANTHROPIC_API_KEY"), "{body}");
    app.stop().await;
}

#[tokio::test]
async fn the_database_holds_no_plaintext_and_a_moved_or_altered_row_does_not_open() {
    let dumps = tempfile::tempdir().unwrap();
    let d = dumps.path().to_owned();
    let app = spawn_app_with(|s| {
        envdump(s, &d);
        with_keys(s, 1, &[]);
    })
    .await;
    let repo = git_repo();
    let team_a = default_team(&app).await;
    let (team_b, owner_b) = other_team(&app, "b").await;
    let value = "alpha-secret-value-5d2e";

    // Without the secret: unavailable, with the reason; creating an agent is refused.
    let view = provider_view(&app, &app.token, ENVDUMP).await;
    assert_eq!(view["available"], false, "{view}");
    assert_eq!(view["unavailable_reason"], "team secret TEAM_TOKEN not set");
    assert_eq!(view["team_secrets"], json!(["TEAM_TOKEN"]));
    let ws_a = workspace(&app, &app.token, &team_a, repo.path()).await;
    let (s, body) = create_agent(&app, &app.token, &ws_a, ENVDUMP).await;
    assert_eq!(
        (s, body["code"].as_str()),
        (422, Some("provider_unavailable")),
        "{body}"
    );
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("team secret TEAM_TOKEN not set"),
        "{body}"
    );
    let (s, text) = call(
        &app,
        &app.token,
        Method::GET,
        "/v1/providers/envdump/models",
        None,
    )
    .await;
    assert_eq!(
        (s, code(&text)),
        (422, "provider_unavailable".into()),
        "{text}"
    );
    // The mock, which takes no secret, stays available.
    assert_eq!(
        provider_view(&app, &app.token, "mock").await["available"],
        true
    );

    let (s, _) = put_secret(&app, &app.token, &team_a, "TEAM_TOKEN", value).await;
    assert_eq!(s, 201);
    assert_eq!(
        provider_view(&app, &app.token, ENVDUMP).await["available"],
        true
    );
    // Asking for another team: the admin sees B's view; B itself still lacks the secret.
    let (_, body) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/providers?team_id={team_b}"),
        None,
    )
    .await;
    assert!(body.contains("team secret TEAM_TOKEN not set"), "{body}");
    let view = provider_view(&app, &owner_b, ENVDUMP).await;
    assert_eq!(view["unavailable_reason"], "team secret TEAM_TOKEN not set");
    let (s, _) = call(
        &app,
        &owner_b,
        Method::GET,
        &format!("/v1/providers?team_id={team_a}"),
        None,
    )
    .await;
    assert_eq!(s, 404, "another team's view is not B's to ask for");

    // At rest: a key id, a 12-byte nonce, a ciphertext that holds no plaintext.
    let (key_id, nonce, ciphertext): (String, Vec<u8>, Vec<u8>) = sqlx::query_as(
        "SELECT key_id, nonce, ciphertext FROM team_secrets WHERE name = 'TEAM_TOKEN'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(key_id, agentry::services::secrets::key_id(&[1; 32]));
    assert_eq!(nonce.len(), 12);
    assert!(
        !ciphertext
            .windows(value.len())
            .any(|w| w == value.as_bytes())
    );
    let as_text: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM team_secrets WHERE encode(ciphertext, 'escape') LIKE '%' || $1 || '%'",
    )
    .bind(value)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(as_text, 0);

    // The row moved to team B does not open there: unavailable with the reason, 422.
    sqlx::query("UPDATE team_secrets SET team_id = $1 WHERE team_id = $2")
        .bind(uuid_of(&team_b))
        .bind(uuid_of(&team_a))
        .execute(&app.pool)
        .await
        .unwrap();
    let view = provider_view(&app, &owner_b, ENVDUMP).await;
    assert_eq!(view["available"], false, "{view}");
    let reason = view["unavailable_reason"].as_str().unwrap();
    assert!(
        reason.starts_with("team secret TEAM_TOKEN cannot be decrypted"),
        "{reason}"
    );
    let ws_b = workspace(&app, &owner_b, &team_b, repo.path()).await;
    let (s, body) = create_agent(&app, &owner_b, &ws_b, ENVDUMP).await;
    assert_eq!(
        (s, body["code"].as_str()),
        (422, Some("provider_unavailable")),
        "{body}"
    );
    assert!(!body.to_string().contains(value));

    // Back home but with one bit flipped: unavailable too, never the plaintext.
    sqlx::query(
        "UPDATE team_secrets SET team_id = $2,
            ciphertext = set_byte(ciphertext, 0, get_byte(ciphertext, 0) # 1)
         WHERE team_id = $1",
    )
    .bind(uuid_of(&team_b))
    .bind(uuid_of(&team_a))
    .execute(&app.pool)
    .await
    .unwrap();
    let view = provider_view(&app, &app.token, ENVDUMP).await;
    assert_eq!(view["available"], false, "{view}");
    assert!(
        view["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("cannot be decrypted")
    );
    let (s, body) = create_agent(&app, &app.token, &ws_a, ENVDUMP).await;
    assert_eq!(s, 422, "{body}");
    assert!(!body.to_string().contains(value));
    // Setting it again repairs it.
    put_secret(&app, &app.token, &team_a, "TEAM_TOKEN", value).await;
    let (s, body) = create_agent(&app, &app.token, &ws_a, ENVDUMP).await;
    assert_eq!(s, 201, "{body}");
    let agent = body["id"].as_str().unwrap().to_owned();
    assert_eq!(
        var(&agent_env(&app, &app.token, &agent, &d).await, "TEAM_TOKEN"),
        Some(value)
    );
    app.stop().await;
}

#[tokio::test]
async fn agents_get_their_own_teams_secret_when_created_resumed_and_after_a_restart() {
    let dumps = tempfile::tempdir().unwrap();
    let d = dumps.path().to_owned();
    let tweak = {
        let d = d.clone();
        move |s: &mut Settings| {
            envdump(s, &d);
            with_keys(s, 3, &[]);
        }
    };
    let app = spawn_app_with(tweak.clone()).await;
    let repo = git_repo();
    let team_a = default_team(&app).await;
    let (team_b, owner_b) = other_team(&app, "b").await;
    let (alpha, beta) = ("alpha-value-0b7c", "beta-value-e41d");
    put_secret(&app, &app.token, &team_a, "TEAM_TOKEN", alpha).await;
    put_secret(&app, &owner_b, &team_b, "TEAM_TOKEN", beta).await;

    let ws_a = workspace(&app, &app.token, &team_a, repo.path()).await;
    let ws_b = workspace(&app, &owner_b, &team_b, repo.path()).await;
    let (s, a) = create_agent(&app, &app.token, &ws_a, ENVDUMP).await;
    assert_eq!(s, 201, "{a}");
    let (s, b) = create_agent(&app, &owner_b, &ws_b, ENVDUMP).await;
    assert_eq!(s, 201, "{b}");
    let (a, b) = (
        a["id"].as_str().unwrap().to_owned(),
        b["id"].as_str().unwrap().to_owned(),
    );
    let env_a = agent_env(&app, &app.token, &a, &d).await;
    let env_b = agent_env(&app, &owner_b, &b, &d).await;
    assert_eq!(var(&env_a, "TEAM_TOKEN"), Some(alpha));
    assert_eq!(var(&env_b, "TEAM_TOKEN"), Some(beta));
    assert!(
        !env_b.contains(alpha) && !env_a.contains(beta),
        "a team's value stays in its agents"
    );
    assert_eq!(var(&env_a, "ENV_DUMP_DIR"), Some(d.to_str().unwrap()));

    // Closed, then prompted: a new process, with the value as it is now.
    wait_idle(&app, &app.token, &a).await;
    put_secret(
        &app,
        &app.token,
        &team_a,
        "TEAM_TOKEN",
        "alpha-rotated-41aa",
    )
    .await;
    app.post_ok(&format!("/v1/agents/{a}/close"), json!({}), 200)
        .await;
    app.prompt(&a, "hello again").await;
    let waited = wait_idle(&app, &app.token, &a).await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    assert_eq!(
        var(&agent_env(&app, &app.token, &a, &d).await, "TEAM_TOKEN"),
        Some("alpha-rotated-41aa")
    );

    // After a restart the next prompt resumes the agent with the secret.
    let (db, data_dir, token) = app.stop().await;
    let app = spawn_on_with(db, data_dir, Some(token), tweak).await;
    app.prompt(&a, "after the restart").await;
    let waited = wait_idle(&app, &app.token, &a).await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    assert_eq!(
        var(&agent_env(&app, &app.token, &a, &d).await, "TEAM_TOKEN"),
        Some("alpha-rotated-41aa")
    );

    // What the provider reports back (a tool that prints the value, a failure that
    // quotes it) is masked before it is stored.
    app.prompt(&a, "/tool echo alpha-rotated-41aa").await;
    wait_idle(&app, &app.token, &a).await;
    let timeline = serde_json::to_string(&app.timeline(&a).await).unwrap();
    assert!(timeline.contains("echo [redacted]"), "{timeline}");
    app.prompt(&a, "/fail bad key alpha-rotated-41aa").await;
    let waited = wait_idle(&app, &app.token, &a).await;
    assert_eq!(waited["last_turn"]["outcome"], "failed", "{waited}");
    assert!(
        waited["last_turn"]["error"]
            .as_str()
            .unwrap()
            .contains("bad key [redacted]"),
        "{waited}"
    );

    // Nothing the API answers carries a value: timelines, agents, providers.
    for (agent, token) in [(&a, &app.token), (&b, &owner_b)] {
        let mut texts = Vec::new();
        for path in [
            format!("/v1/agents/{agent}"),
            format!("/v1/agents/{agent}/timeline?after_seq=0&limit=1000"),
            "/v1/providers".to_owned(),
            "/v1/agents".to_owned(),
        ] {
            texts.push(call(&app, token, Method::GET, &path, None).await.1);
        }
        for text in texts {
            for v in [alpha, beta, "alpha-rotated-41aa"] {
                assert!(!text.contains(v), "{v} in {text}");
            }
        }
    }

    // Deleted: a closed agent of the team cannot be reopened; the reason says why.
    let (s, _) = call(
        &app,
        &app.token,
        Method::DELETE,
        &format!("/v1/teams/{team_a}/secrets/TEAM_TOKEN"),
        None,
    )
    .await;
    assert_eq!(s, 204);
    app.post_ok(&format!("/v1/agents/{a}/close"), json!({}), 200)
        .await;
    let (s, text) = call(
        &app,
        &app.token,
        Method::POST,
        &format!("/v1/agents/{a}/messages"),
        Some(json!({"text": "hi"})),
    )
    .await;
    assert_eq!(
        (s, code(&text)),
        (422, "provider_unavailable".into()),
        "{text}"
    );
    assert!(text.contains("team secret TEAM_TOKEN not set"), "{text}");
    app.stop().await;
}

/// `agentry secrets rotate` with `current` and `previous` keys; its exit status and output.
pub(crate) fn rotate(
    app_db: &sqlx::postgres::PgConnectOptions,
    data_dir: &Path,
    current: u8,
    previous: &[u8],
) -> (bool, String) {
    let previous: Vec<String> = previous
        .iter()
        .map(|n| format!("\"{}\"", key(*n)))
        .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .args(["secrets", "rotate", "--data-dir"])
        .arg(data_dir)
        .env("DATABASE_URL", database_url(app_db))
        .env("AGENTRY_SECRETS__KEY", key(current))
        .env(
            "AGENTRY_SECRETS__PREVIOUS_KEYS",
            format!("[{}]", previous.join(",")),
        )
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test]
async fn a_previous_key_still_opens_and_rotate_moves_every_value_to_the_current_key() {
    let dumps = tempfile::tempdir().unwrap();
    let d = dumps.path().to_owned();
    let keys = |current: u8, previous: Vec<u8>| {
        let d = d.clone();
        move |s: &mut Settings| {
            envdump(s, &d);
            with_keys(s, current, &previous);
        }
    };
    let app = spawn_app_with(keys(1, vec![])).await;
    let repo = git_repo();
    let team = default_team(&app).await;
    let (team_b, owner_b) = other_team(&app, "b").await;
    put_secret(&app, &app.token, &team, "TEAM_TOKEN", "under-key-one-77").await;
    put_secret(&app, &owner_b, &team_b, "TEAM_TOKEN", "b-under-key-one-88").await;
    let ws = workspace(&app, &app.token, &team, repo.path()).await;
    let (db, data_dir, token) = app.stop().await;
    let old_id = agentry::services::secrets::key_id(&[1; 32]);
    let new_id = agentry::services::secrets::key_id(&[2; 32]);

    // A new key without the old one: the stored value is unusable, and the reason names
    // the key it needs (and nothing of the value).
    let app = spawn_on_with(db, data_dir, Some(token), keys(2, vec![])).await;
    let view = provider_view(&app, &app.token, ENVDUMP).await;
    assert_eq!(view["available"], false, "{view}");
    let reason = view["unavailable_reason"].as_str().unwrap();
    assert!(
        reason.contains(&old_id) && reason.contains("previous_keys"),
        "{reason}"
    );
    let (db, data_dir, token) = app.stop().await;

    // With the old key among the previous ones, it opens; new values use the new key.
    let app = spawn_on_with(db, data_dir, Some(token), keys(2, vec![1])).await;
    let (s, agent) = create_agent(&app, &app.token, &ws, ENVDUMP).await;
    assert_eq!(s, 201, "{agent}");
    let agent = agent["id"].as_str().unwrap().to_owned();
    assert_eq!(
        var(&agent_env(&app, &app.token, &agent, &d).await, "TEAM_TOKEN"),
        Some("under-key-one-77")
    );
    put_secret(&app, &app.token, &team, "SECOND", "under-key-two").await;
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT key_id FROM team_secrets ORDER BY name, team_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(ids, [new_id.clone(), old_id.clone(), old_id.clone()]);
    let (db, data_dir, token) = app.stop().await;

    // Rotate beside no running server: every value moves to the new key.
    let (ok, out) = rotate(&db, data_dir.path(), 2, &[1]);
    assert!(ok, "{out}");
    assert!(out.contains("2 re-encrypted"), "{out}");
    assert!(!out.contains("under-key-one"), "{out}");
    let (ok, out) = rotate(&db, data_dir.path(), 2, &[1]);
    assert!(
        ok && out.contains("0 re-encrypted"),
        "a second run has nothing to do: {out}"
    );

    // Now the old key can go.
    let app = spawn_on_with(db, data_dir, Some(token), keys(2, vec![])).await;
    let ids: Vec<String> = sqlx::query_scalar("SELECT DISTINCT key_id FROM team_secrets")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(ids, [new_id]);
    assert_eq!(
        provider_view(&app, &owner_b, ENVDUMP).await["available"],
        true
    );
    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    app.prompt(&agent, "again").await;
    wait_idle(&app, &app.token, &agent).await;
    assert_eq!(
        var(&agent_env(&app, &app.token, &agent, &d).await, "TEAM_TOKEN"),
        Some("under-key-one-77")
    );
    let (db, data_dir, _) = app.stop().await;

    // Rotating to a key while the current one is forgotten fails loudly, naming what it
    // could not re-encrypt, and changes nothing.
    let (ok, out) = rotate(&db, data_dir.path(), 3, &[]);
    assert!(!ok, "{out}");
    assert!(out.contains("cannot re-encrypt TEAM_TOKEN"), "{out}");
    assert!(!out.contains("under-key-one"), "{out}");
}

#[tokio::test]
async fn an_agent_stopped_for_being_idle_reopens_with_its_teams_secret() {
    let dumps = tempfile::tempdir().unwrap();
    let d = dumps.path().to_owned();
    let dir = d.clone();
    let app = spawn_app_with(move |s| {
        envdump(s, &dir);
        s.agents.idle_timeout_s = 1;
    })
    .await;
    let repo = git_repo();
    let team = default_team(&app).await;
    put_secret(&app, &app.token, &team, "TEAM_TOKEN", "idle-value-3f9").await;
    let ws = workspace(&app, &app.token, &team, repo.path()).await;
    let (s, agent) = create_agent(&app, &app.token, &ws, ENVDUMP).await;
    assert_eq!(s, 201, "{agent}");
    let agent = agent["id"].as_str().unwrap().to_owned();
    // The environment of every process started so far (the agent may be closed again by
    // the time it is read: the processes' own dumps are what counts).
    let envs = || -> Vec<String> {
        std::fs::read_dir(&d)
            .unwrap()
            .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
            .collect()
    };
    let mut status = Value::Null;
    for _ in 0..500 {
        status = app.get_ok(&format!("/v1/agents/{agent}")).await["status"].clone();
        if status == "closed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, "closed", "the idle agent's process was stopped");
    assert_eq!(envs().len(), 1);
    app.prompt(&agent, "wake up").await;
    let waited = wait_idle(&app, &app.token, &agent).await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let envs = envs();
    assert_eq!(envs.len(), 2, "the prompt started a second process");
    for env in &envs {
        assert_eq!(var(env, "TEAM_TOKEN"), Some("idle-value-3f9"), "{env}");
    }
    app.stop().await;
}
