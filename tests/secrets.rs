//! Team secrets end to end, looking for leaks: the real Claude Code CLI (the pinned
//! install) configured with `team_secrets = ["ANTHROPIC_API_KEY"]` sends each team's own
//! key to a fake Anthropic API, and never another team's; then the server's whole log
//! (captured at trace level for agentry) and a `pg_dump` of its database are searched for
//! every value: absent.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/clis.rs"]
mod clis;

#[path = "support/cli_world.rs"]
#[allow(dead_code)]
mod cli_world;

#[path = "support/git_http.rs"]
mod git_http;

#[path = "support/fake_forge.rs"]
mod fake_forge;

#[path = "support/fake_anthropic.rs"]
#[allow(dead_code)]
mod fake_anthropic;

#[path = "support/fake_openai.rs"]
#[allow(dead_code)]
mod fake_openai;

#[path = "support/fake_chat.rs"]
#[allow(dead_code)]
mod fake_chat;

#[path = "support/http.rs"]
#[allow(dead_code)]
mod http;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use agentry::auth::tokens;
use agentry::config::{ProviderSettings, Settings};
use agentry::store::identity;
use fake_anthropic::{FakeAnthropic, Reply};
use fake_chat::FakeChat;
use fake_openai::FakeOpenAi;
use helpers::*;
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;
use uuid::Uuid;

// ---- the server's log, captured ----------------------------------------------------------

fn log_buffer() -> &'static Mutex<Vec<u8>> {
    static LOG: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LOG.get_or_init(|| Mutex::new(Vec::new()))
}

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        log_buffer().lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything agentry logs in this test binary (every level), from here on.
fn capture_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info,agentry=trace"))
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .init();
    });
}

fn captured_log() -> String {
    String::from_utf8_lossy(&log_buffer().lock().unwrap()).into_owned()
}

// ---- the database, dumped ---------------------------------------------------------------

fn pg_dump_binary() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pg_dump"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| PathBuf::from("pg_dump"))
}

/// The whole database as `pg_dump` writes it (schema and data, plain SQL).
fn pg_dump(db: &PgConnectOptions) -> String {
    let name = db.get_database().expect("a database name");
    let target = match std::env::var("DATABASE_URL") {
        Ok(url) => format!("{}/{name}", url.rsplit_once('/').unwrap().0),
        Err(_) => format!(
            "host={} port={} user={} dbname={name}",
            db.get_socket()
                .expect("the test cluster is on a unix socket")
                .display(),
            db.get_port(),
            db.get_username()
        ),
    };
    let out = std::process::Command::new(pg_dump_binary())
        .arg("--dbname")
        .arg(&target)
        .output()
        .expect("pg_dump runs (PostgreSQL client binaries are installed)");
    assert!(
        out.status.success(),
        "pg_dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `value` appears nowhere in `text`, neither as written nor in the hex form a dump
/// gives `bytea` columns.
fn assert_absent(what: &str, text: &str, value: &str) {
    assert!(!text.contains(value), "{value} is in the {what}");
    let hex = hex_of(value);
    assert!(!text.contains(&hex), "{value} (as hex) is in the {what}");
}

fn hex_of(value: &str) -> String {
    value.bytes().map(|b| format!("{b:02x}")).collect()
}

// ---- teams and calls -------------------------------------------------------------------

async fn call(
    app: &TestApp,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = app.client.request(method, app.url(path)).bearer_auth(token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let text = res.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// A second team with an owner; returns (wire team id, owner token).
async fn other_team(app: &TestApp, name: &str) -> (String, String) {
    let (team, user) = (Uuid::now_v7(), Uuid::now_v7());
    identity::insert_team(&app.pool, team, name).await.unwrap();
    identity::insert_user(&app.pool, user, &format!("{user}@example.com"), "B", false)
        .await
        .unwrap();
    identity::upsert_member(&app.pool, team, user, "owner")
        .await
        .unwrap();
    let token = tokens::generate();
    identity::insert_token(
        &app.pool,
        Uuid::now_v7(),
        user,
        None,
        None,
        "t",
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &[],
        None,
    )
    .await
    .unwrap();
    (format!("team_{}", team.simple()), token)
}

async fn default_team(app: &TestApp) -> String {
    app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn set_secret(app: &TestApp, token: &str, team: &str, name: &str, value: &str) {
    let (s, body) = call(
        app,
        token,
        Method::PUT,
        &format!("/v1/teams/{team}/secrets/{name}"),
        Some(json!({ "value": value })),
    )
    .await;
    assert!(s == 201 || s == 200, "{body}");
}

/// A workspace of `team` (a new project on `repo`).
async fn workspace(app: &TestApp, token: &str, team: &str, repo: &Path) -> String {
    // Registering a local repository is a server admin's part.
    let (s, project) = call(
        app,
        &app.token,
        Method::POST,
        "/v1/projects",
        Some(json!({"name": format!("p-{}", Uuid::now_v7().simple()), "repo_path": repo, "team_id": team})),
    )
    .await;
    assert_eq!(s, 201, "{project}");
    let (s, ws) = call(
        app,
        token,
        Method::POST,
        "/v1/workspaces",
        Some(json!({"project_id": project["id"]})),
    )
    .await;
    assert_eq!(s, 201, "{ws}");
    ws["id"].as_str().unwrap().to_owned()
}

async fn provider(app: &TestApp, token: &str, id: &str) -> Value {
    let (s, list) = call(app, token, Method::GET, "/v1/providers", None).await;
    assert_eq!(s, 200, "{list}");
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("{id} is listed: {list}"))
}

/// Prompt and wait for the turn to end; returns the `wait` answer.
async fn turn(app: &TestApp, token: &str, agent: &str, text: &str) -> Value {
    let (s, body) = call(
        app,
        token,
        Method::POST,
        &format!("/v1/agents/{agent}/messages"),
        Some(json!({ "text": text })),
    )
    .await;
    assert_eq!(s, 202, "{body}");
    let (s, waited) = call(
        app,
        token,
        Method::GET,
        &format!("/v1/agents/{agent}/wait?timeout_s=60"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{waited}");
    waited
}

/// Everything the API shows about an agent: the agent and its whole timeline.
async fn agent_texts(app: &TestApp, token: &str, agent: &str) -> String {
    let (_, a) = call(
        app,
        token,
        Method::GET,
        &format!("/v1/agents/{agent}"),
        None,
    )
    .await;
    let (_, t) = call(
        app,
        token,
        Method::GET,
        &format!("/v1/agents/{agent}/timeline?after_seq=0&limit=1000"),
        None,
    )
    .await;
    format!("{a}\n{t}")
}

#[tokio::test]
async fn claude_sends_each_teams_own_key_and_no_value_reaches_a_log_or_the_database() {
    capture_logs();
    let cli = clis::cli("claude");
    let fake = FakeAnthropic::start().await;
    let home = tempfile::tempdir().unwrap();
    let (url, h) = (fake.url.clone(), home.path().to_path_buf());
    let app = spawn_app_with(move |s: &mut Settings| {
        let env = BTreeMap::from([
            ("ANTHROPIC_BASE_URL".to_owned(), url),
            ("HOME".to_owned(), h.display().to_string()),
            (
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".to_owned(),
                "1".to_owned(),
            ),
        ]);
        s.providers.insert(
            "claude".into(),
            ProviderSettings {
                command: Some(vec![cli.display().to_string()]),
                env,
                team_secrets: vec!["ANTHROPIC_API_KEY".into()],
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let team_a = default_team(&app).await;
    let (team_b, owner_b) = other_team(&app, "b").await;
    let key_a = format!("sk-ant-team-a-{}", Uuid::now_v7().simple());
    let key_b = format!("sk-ant-team-b-{}", Uuid::now_v7().simple());

    // Without its key, the provider is unavailable to the team, and says why.
    let claude = provider(&app, &app.token, "claude").await;
    assert_eq!(claude["available"], false, "{claude}");
    assert_eq!(
        claude["unavailable_reason"],
        "team secret ANTHROPIC_API_KEY not set"
    );
    set_secret(&app, &app.token, &team_a, "ANTHROPIC_API_KEY", &key_a).await;
    assert_eq!(
        provider(&app, &app.token, "claude").await["available"],
        true
    );

    // Team A's agent: every model request carries A's key.
    let ws_a = workspace(&app, &app.token, &team_a, repo.path()).await;
    let (s, agent_a) = call(
        &app,
        &app.token,
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": ws_a, "provider": "claude", "mode": "default"})),
    )
    .await;
    assert_eq!(s, 201, "{agent_a}");
    let agent_a = agent_a["id"].as_str().unwrap().to_owned();
    fake.push(Reply::text("Hello from team A's model."));
    let waited = turn(&app, &app.token, &agent_a, "say hello").await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let keys = fake.api_keys();
    assert!(!keys.is_empty(), "the CLI called the model");
    assert!(keys.iter().all(|k| *k == key_a), "{keys:?}");

    // Team B, same provider, no secret: refused with the reason.
    let ws_b = workspace(&app, &owner_b, &team_b, repo.path()).await;
    let create_b = json!({"workspace_id": ws_b, "provider": "claude", "mode": "default"});
    let (s, refused) = call(
        &app,
        &owner_b,
        Method::POST,
        "/v1/agents",
        Some(create_b.clone()),
    )
    .await;
    assert_eq!(s, 422, "{refused}");
    assert_eq!(refused["code"], "provider_unavailable");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap()
            .contains("team secret ANTHROPIC_API_KEY not set"),
        "{refused}"
    );

    // With its own key: the fake sees B's key for B's agent, never A's.
    set_secret(&app, &owner_b, &team_b, "ANTHROPIC_API_KEY", &key_b).await;
    app.post_ok(&format!("/v1/agents/{agent_a}/close"), json!({}), 200)
        .await;
    let before = fake.api_keys().len();
    let (s, agent_b) = call(&app, &owner_b, Method::POST, "/v1/agents", Some(create_b)).await;
    assert_eq!(s, 201, "{agent_b}");
    let agent_b = agent_b["id"].as_str().unwrap().to_owned();
    fake.push(Reply::text("Hello from team B's model."));
    let waited = turn(&app, &owner_b, &agent_b, "say hello").await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let keys = fake.api_keys();
    assert!(keys.len() > before, "B's agent called the model");
    assert!(keys[before..].iter().all(|k| *k == key_b), "{keys:?}");

    // A's closed agent, prompted again, resumes with A's key.
    let before = keys.len();
    fake.push(Reply::text("Team A again."));
    let waited = turn(&app, &app.token, &agent_a, "and again").await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let keys = fake.api_keys();
    assert!(keys.len() > before, "the resumed agent called the model");
    assert!(keys[before..].iter().all(|k| *k == key_a), "{keys:?}");

    // No API answer, log line or database row holds a key.
    let shown = format!(
        "{}\n{}\n{}",
        agent_texts(&app, &app.token, &agent_a).await,
        agent_texts(&app, &owner_b, &agent_b).await,
        call(&app, &app.token, Method::GET, "/v1/providers", None)
            .await
            .1
    );
    let db = app.db.clone();
    app.stop().await;
    let dump = pg_dump(&db);
    assert!(
        dump.contains("team_secrets"),
        "the dump has the secrets table"
    );
    let log = captured_log();
    assert!(
        log.contains("team secret set") && log.contains("ANTHROPIC_API_KEY"),
        "the log was captured"
    );
    for key in [&key_a, &key_b] {
        assert_absent("API answers", &shown, key);
        assert_absent("server log", &log, key);
        assert_absent("database dump", &dump, key);
    }
}

// ---- brokered keys ------------------------------------------------------------------------

/// The pids of `root` and of every process under it.
fn process_tree(root: i32) -> Vec<i32> {
    let mut parents: Vec<(i32, i32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: the name may hold spaces and parentheses.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let ppid = after.split(' ').nth(1).unwrap().parse::<i32>().unwrap();
        parents.push((pid, ppid));
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    tree
}

/// `NAME=value` entries of a process's environment.
fn environ(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| {
            b.split(|c| *c == 0)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every regular file under `dir` (symbolic links not followed) whose bytes hold `needle`.
fn files_holding(dir: &Path, needle: &str, out: &mut Vec<PathBuf>, seen: &mut usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let path = entry.path();
        if kind.is_dir() {
            files_holding(&path, needle, out, seen);
        } else if kind.is_file() {
            *seen += 1;
            if let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(needle.len()).any(|w| w == needle.as_bytes())
            {
                out.push(path);
            }
        }
    }
}

/// Under `network = "proxy"` the team's key never enters the sandbox: the real Claude
/// Code is given the agent's brokered base URL and a placeholder key, and the egress
/// proxy adds the key on the way to the model API. The fake model server receives the
/// key; the CLI's environment (and that of every process of its sandbox) does not hold
/// it, nor does any file the server wrote or the sandbox can write.
#[tokio::test]
async fn under_the_proxy_network_the_team_key_is_added_outside_the_sandbox() {
    let cli = clis::cli("claude");
    let fake = FakeAnthropic::start().await;
    let url = fake.url.clone();
    let app = spawn_app_with(move |s: &mut Settings| {
        s.sandbox.network = agentry::config::SandboxNetwork::Proxy;
        let env = BTreeMap::from([("ANTHROPIC_BASE_URL".to_owned(), url)]);
        s.providers.insert(
            "claude".into(),
            ProviderSettings {
                command: Some(vec![cli.display().to_string()]),
                env,
                team_secrets: vec!["ANTHROPIC_API_KEY".into()],
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let team = default_team(&app).await;
    let key = format!("sk-ant-brokered-{}", Uuid::now_v7().simple());
    set_secret(&app, &app.token, &team, "ANTHROPIC_API_KEY", &key).await;

    let claude = provider(&app, &app.token, "claude").await;
    assert_eq!(claude["available"], true, "{claude}");
    assert_eq!(claude["credentials"], "brokered", "{claude}");
    assert_eq!(claude["credential_reason"], Value::Null, "{claude}");
    let mock = provider(&app, &app.token, "mock").await;
    assert_eq!(mock["credentials"], "inside", "{mock}");
    assert!(mock["credential_reason"].is_string(), "{mock}");

    let ws = workspace(&app, &app.token, &team, repo.path()).await;
    let (s, agent) = call(
        &app,
        &app.token,
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": ws, "provider": "claude", "mode": "default"})),
    )
    .await;
    assert_eq!(s, 201, "{agent}");
    let agent = agent["id"].as_str().unwrap().to_owned();
    fake.push(Reply::text("Hello through the broker."));
    let waited = turn(&app, &app.token, &agent, "say hello").await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let keys = fake.api_keys();
    assert!(!keys.is_empty(), "the CLI called the model");
    assert!(keys.iter().all(|k| *k == key), "{keys:?}");

    key_stays_outside(
        &app,
        &agent,
        &key,
        "claude",
        "ANTHROPIC_BASE_URL=http://127.0.0.1:3128/anthropic",
        "ANTHROPIC_API_KEY=agentry-brokered-key",
        &[repo.path()],
    )
    .await;
    assert!(
        app.data_dir.path().join("agent-homes").is_dir(),
        "the agent's home was searched"
    );
}

/// The running CLI of `agent` (the deepest process of its sandbox whose command line
/// holds `cli` and whose environment holds `marker`) has `placeholder` in its
/// environment; no process of the sandbox has `key` in its environment, and no file of
/// the data dir (the agent's home, worktree, endpoint) nor of `dirs` holds it.
async fn key_stays_outside(
    app: &TestApp,
    agent: &str,
    key: &str,
    cli: &str,
    marker: &str,
    placeholder: &str,
    dirs: &[&Path],
) {
    let (_, a) = call(
        app,
        &app.token,
        Method::GET,
        &format!("/v1/agents/{agent}"),
        None,
    )
    .await;
    let pid = a["runtime"]["pid"].as_i64().expect("a running CLI") as i32;
    let tree = process_tree(pid);
    // The deepest such process: the bridge that starts the CLI has its argv and
    // environment too.
    let cli_pid = *tree
        .iter()
        .rev()
        .find(|p| {
            environ(**p).iter().any(|v| v == marker)
                && std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(cli))
        })
        .unwrap_or_else(|| panic!("the CLI is in the sandbox's tree {tree:?}"));
    let cli_env = environ(cli_pid);
    assert!(cli_env.iter().any(|v| v == placeholder), "{cli_env:?}");
    for p in &tree {
        let env = environ(*p);
        assert!(
            !env.iter().any(|v| v.contains(key)),
            "the key is in the environment of {p}"
        );
    }
    let mut found = Vec::new();
    let mut seen = 0;
    files_holding(app.data_dir.path(), key, &mut found, &mut seen);
    for dir in dirs {
        files_holding(dir, key, &mut found, &mut seen);
    }
    assert!(seen > 10, "the files were read ({seen})");
    assert!(found.is_empty(), "the key is in {found:?}");
}

/// With the team's secret `secret` set to a fresh key: provider `name` is available with
/// brokered credentials, and an agent of it in `mode` completes a turn whose answer its fake
/// model server gives (`answer` scripts it) and the timeline shows. Returns the agent's id
/// and the key.
async fn brokered_turn(
    app: &TestApp,
    repo: &Path,
    (name, mode): (&str, &str),
    secret: &str,
    answer: impl FnOnce(),
) -> (String, String) {
    let team = default_team(app).await;
    let key = format!("sk-{name}-brokered-{}", Uuid::now_v7().simple());
    set_secret(app, &app.token, &team, secret, &key).await;

    let view = provider(app, &app.token, name).await;
    assert_eq!(view["available"], true, "{view}");
    assert_eq!(view["credentials"], "brokered", "{view}");

    let ws = workspace(app, &app.token, &team, repo).await;
    let (s, agent) = call(
        app,
        &app.token,
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": ws, "provider": name, "mode": mode})),
    )
    .await;
    assert_eq!(s, 201, "{agent}");
    let agent = agent["id"].as_str().unwrap().to_owned();
    answer();
    let waited = turn(app, &app.token, &agent, "say hello").await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    assert!(
        agent_texts(app, &app.token, &agent)
            .await
            .contains("Hello through the broker."),
        "the model's answer reached the timeline"
    );
    (agent, key)
}

/// Every request the fake model server received carried `key`.
fn every_completion_carries(fake: &FakeChat, key: &str) {
    let completions = fake.completions();
    assert!(!completions.is_empty(), "the CLI called the model");
    let bearer = format!("Bearer {key}");
    for r in &completions {
        assert_eq!(
            r.header("authorization"),
            Some(bearer.as_str()),
            "{}",
            r.line
        );
    }
}

/// The same for the real Codex: its model provider (defined in the provider's `args`
/// with `env_key`) is given the brokered URL by a configuration override, and its key
/// variable the placeholder; the fake OpenAI server receives the team's key.
#[tokio::test]
async fn under_the_proxy_network_codex_gets_its_key_added_outside_the_sandbox() {
    let cli = clis::cli("codex");
    let fake = FakeOpenAi::start().await;
    let home = tempfile::tempdir().unwrap();
    let (url, h) = (fake.base_url(), home.path().to_path_buf());
    let app = spawn_app_with(move |s: &mut Settings| {
        s.sandbox.network = agentry::config::SandboxNetwork::Proxy;
        let env = BTreeMap::from([
            ("CODEX_HOME".to_owned(), h.display().to_string()),
            ("HOME".to_owned(), h.display().to_string()),
        ]);
        s.providers.insert(
            "codex".into(),
            ProviderSettings {
                command: Some(vec![cli.display().to_string()]),
                args: vec![
                    "-c".into(),
                    "model=fake-model".into(),
                    "-c".into(),
                    "model_provider=fake".into(),
                    "-c".into(),
                    format!(
                        r#"model_providers.fake={{name="Fake",base_url="{url}",env_key="FAKE_OPENAI_KEY",wire_api="responses"}}"#
                    ),
                ],
                env,
                team_secrets: vec!["FAKE_OPENAI_KEY".into()],
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let (agent, key) = brokered_turn(
        &app,
        repo.path(),
        ("codex", "auto"),
        "FAKE_OPENAI_KEY",
        || fake.script([fake_openai::Reply::text("Hello through the broker.")]),
    )
    .await;
    let codex = provider(&app, &app.token, "codex").await;
    assert_eq!(codex["credential_reason"], Value::Null, "{codex}");
    let sent = fake.authorizations();
    assert!(!sent.is_empty(), "the CLI called the model");
    let bearer = format!("Bearer {key}");
    assert!(sent.iter().all(|a| *a == bearer), "{sent:?}");

    key_stays_outside(
        &app,
        &agent,
        &key,
        "codex",
        "FAKE_OPENAI_KEY=agentry-brokered-key",
        "FAKE_OPENAI_KEY=agentry-brokered-key",
        &[repo.path(), home.path()],
    )
    .await;
    // The override reached the CLI's command line.
    let (_, a) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/agents/{agent}"),
        None,
    )
    .await;
    let tree = process_tree(a["runtime"]["pid"].as_i64().unwrap() as i32);
    assert!(
        tree.iter().any(
            |p| std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                String::from_utf8_lossy(&c)
                    .contains(r#"model_providers.fake.base_url="http://127.0.0.1:3128/openai""#)
            })
        ),
        "the brokered base URL is passed as an override"
    );
}

/// The same for the real Pi: its agent directory's `models.json` names the key by a
/// variable the team sets; the sandbox is shown a `models.json` with the brokered URL
/// and the placeholder in its place, and the fake model server receives the team's key.
#[tokio::test]
async fn under_the_proxy_network_pi_gets_its_key_added_outside_the_sandbox() {
    let cli = clis::cli("pi");
    let fake = FakeChat::start().await;
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("agent");
    std::fs::create_dir_all(&dir).unwrap();
    let models = json!({"providers": {"fake": {
        "baseUrl": fake.base_url(), "api": "openai-completions", "apiKey": "FAKE_PI_KEY",
        "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
        "models": [{"id": fake_chat::MODEL}]}}});
    std::fs::write(dir.join("models.json"), models.to_string()).unwrap();
    let settings = json!({"defaultProvider": "fake", "defaultModel": fake_chat::MODEL});
    std::fs::write(dir.join("settings.json"), settings.to_string()).unwrap();
    let (d, h) = (dir.clone(), home.path().to_path_buf());
    let app = spawn_app_with(move |s: &mut Settings| {
        s.sandbox.network = agentry::config::SandboxNetwork::Proxy;
        let env = BTreeMap::from([
            ("PI_CODING_AGENT_DIR".to_owned(), d.display().to_string()),
            ("HOME".to_owned(), h.display().to_string()),
        ]);
        s.providers.insert(
            "pi".into(),
            ProviderSettings {
                command: Some(vec![cli.display().to_string()]),
                env,
                team_secrets: vec!["FAKE_PI_KEY".into()],
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let (agent, key) = brokered_turn(&app, repo.path(), ("pi", "ask"), "FAKE_PI_KEY", || {
        fake.push(fake_chat::Reply::text("Hello through the broker."))
    })
    .await;
    every_completion_carries(&fake, &key);
    // The configured file is untouched: the sandbox saw the rewritten one instead.
    assert_eq!(
        std::fs::read_to_string(dir.join("models.json")).unwrap(),
        models.to_string()
    );

    key_stays_outside(
        &app,
        &agent,
        &key,
        "pi",
        &format!("PI_CODING_AGENT_DIR={}", dir.display()),
        &format!("PI_CODING_AGENT_DIR={}", dir.display()),
        &[repo.path(), home.path()],
    )
    .await;
}

/// The same for the real OpenCode: its configured model provider names the key as
/// `{env:NAME}` of a team secret; the configuration it is given holds the brokered URL
/// and the placeholder instead, and the server still drives OpenCode's HTTP server, which
/// runs in the sandbox's own network namespace, through the bridge.
#[tokio::test]
async fn under_the_proxy_network_opencode_gets_its_key_added_outside_the_sandbox() {
    let cli = clis::cli("opencode");
    let fake = FakeChat::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = json!({
        "model": format!("fake/{}", fake_chat::MODEL),
        "small_model": format!("fake/{}", fake_chat::MODEL),
        "provider": {"fake": {
            "npm": "@ai-sdk/openai-compatible",
            "options": {"baseURL": fake.base_url(), "apiKey": "{env:FAKE_OPENCODE_KEY}"},
            "models": {fake_chat::MODEL: {"name": "Fake", "tool_call": true,
                "limit": {"context": 100000, "output": 4096}}},
        }},
    });
    let h = home.path().to_path_buf();
    let app = spawn_app_with(move |s: &mut Settings| {
        s.sandbox.network = agentry::config::SandboxNetwork::Proxy;
        let dir = |d: &str| h.join(d).display().to_string();
        let env = BTreeMap::from([
            ("OPENCODE_CONFIG_CONTENT".to_owned(), config.to_string()),
            ("HOME".to_owned(), h.display().to_string()),
            ("XDG_CONFIG_HOME".to_owned(), dir(".config")),
            ("XDG_DATA_HOME".to_owned(), dir(".local/share")),
            ("XDG_STATE_HOME".to_owned(), dir(".local/state")),
            ("XDG_CACHE_HOME".to_owned(), dir(".cache")),
            (
                "npm_config_registry".to_owned(),
                "http://127.0.0.1:9/".to_owned(),
            ),
        ]);
        s.providers.insert(
            "opencode".into(),
            ProviderSettings {
                command: Some(vec![cli.display().to_string()]),
                env,
                team_secrets: vec!["FAKE_OPENCODE_KEY".into()],
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let (agent, key) = brokered_turn(
        &app,
        repo.path(),
        ("opencode", "build"),
        "FAKE_OPENCODE_KEY",
        || fake.push(fake_chat::Reply::text("Hello through the broker.")),
    )
    .await;
    every_completion_carries(&fake, &key);

    key_stays_outside(
        &app,
        &agent,
        &key,
        "opencode",
        "OPENCODE_DISABLE_PROJECT_CONFIG=1",
        "OPENCODE_DISABLE_PROJECT_CONFIG=1",
        &[repo.path(), home.path()],
    )
    .await;
    // The configuration the CLI runs with names the brokered URL and the placeholder.
    let (_, a) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/agents/{agent}"),
        None,
    )
    .await;
    let tree = process_tree(a["runtime"]["pid"].as_i64().unwrap() as i32);
    let configs: Vec<String> = tree
        .iter()
        .flat_map(|p| environ(*p))
        .filter(|v| v.starts_with("OPENCODE_CONFIG_CONTENT="))
        .collect();
    assert!(!configs.is_empty(), "the CLI has its configuration");
    for c in &configs {
        assert!(
            c.contains("http://127.0.0.1:3128/opencode/fake") && c.contains("agentry-brokered-key"),
            "{c}"
        );
    }
}

#[tokio::test]
async fn no_value_reaches_the_log_or_the_database_dump_whatever_happens_to_it() {
    capture_logs();
    let dumps = tempfile::tempdir().unwrap();
    let dir = dumps.path().to_owned();
    let app = spawn_app_with(move |s: &mut Settings| {
        let script = format!(
            "env > \"$ENV_DUMP_DIR/$$.env\"; echo \"starting with token $TEAM_TOKEN\" >&2; exec '{}' mock-agent",
            env!("CARGO_BIN_EXE_agentry")
        );
        s.providers.insert(
            "envdump".into(),
            ProviderSettings {
                extends: Some("acp".into()),
                command: Some(vec!["sh".into(), "-c".into(), script]),
                env: [("ENV_DUMP_DIR".to_owned(), dir.display().to_string())].into(),
                team_secrets: vec!["TEAM_TOKEN".into()],
                ..Default::default()
            },
        );
        // The dump is written outside the agent's worktree and named by the host's pid,
        // which a sandbox forbids and hides: this test is about the values, not the walls.
        s.sandbox.mode = agentry::config::SandboxMode::Off;
    })
    .await;
    let repo = git_repo();
    let team_a = default_team(&app).await;
    let (team_b, owner_b) = other_team(&app, "b").await;
    let v1 = format!("v1-{}", Uuid::now_v7().simple());
    let v2 = format!("v2-{}", Uuid::now_v7().simple());
    let v3 = format!("v3-{}", Uuid::now_v7().simple());

    set_secret(&app, &app.token, &team_a, "TEAM_TOKEN", &v1).await;
    set_secret(&app, &owner_b, &team_b, "TEAM_TOKEN", &v2).await;
    set_secret(&app, &owner_b, &team_b, "DELETED_LATER", &v3).await;
    let ws = workspace(&app, &app.token, &team_a, repo.path()).await;
    let (s, agent) = call(
        &app,
        &app.token,
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": ws, "provider": "envdump", "prompt": format!("/tool echo {v1}")})),
    )
    .await;
    assert_eq!(s, 201, "{agent}");
    let agent = agent["id"].as_str().unwrap().to_owned();
    let (_, waited) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/agents/{agent}/wait?timeout_s=30"),
        None,
    )
    .await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let pid = app.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["pid"].clone();
    let env = std::fs::read_to_string(dumps.path().join(format!("{pid}.env"))).unwrap();
    assert!(
        env.lines().any(|l| l == format!("TEAM_TOKEN={v1}")),
        "the agent got the value"
    );
    let waited = turn(&app, &app.token, &agent, &format!("/fail rejected {v1}")).await;
    assert_eq!(waited["last_turn"]["outcome"], "failed", "{waited}");

    // An altered row: the provider reports it unavailable (and the server logs a warning
    // naming the secret, not its value).
    sqlx::query(
        "UPDATE team_secrets SET ciphertext = set_byte(ciphertext, 0, get_byte(ciphertext, 0) # 1)
         WHERE name = 'TEAM_TOKEN' AND team_id <> $1",
    )
    .bind(Uuid::parse_str(team_a.strip_prefix("team_").unwrap()).unwrap())
    .execute(&app.pool)
    .await
    .unwrap();
    let envdump = provider(&app, &owner_b, "envdump").await;
    assert_eq!(envdump["available"], false, "{envdump}");
    let (s, _) = call(
        &app,
        &owner_b,
        Method::DELETE,
        &format!("/v1/teams/{team_b}/secrets/DELETED_LATER"),
        None,
    )
    .await;
    assert_eq!(s, 204);

    let shown = format!(
        "{}\n{}\n{}",
        agent_texts(&app, &app.token, &agent).await,
        envdump,
        waited
    );
    let db = app.db.clone();
    app.stop().await;
    let dump = pg_dump(&db);
    assert!(dump.contains("team_secrets"), "the dump has the table");
    let log = captured_log();
    assert!(
        log.contains("cannot be decrypted") && log.contains("team secret deleted"),
        "the log was captured"
    );
    assert!(
        log.contains("starting with token [redacted]"),
        "the provider's stderr is logged, masked"
    );
    for value in [&v1, &v2, &v3] {
        assert_absent("API answers", &shown, value);
        assert_absent("server log", &log, value);
        assert_absent("database dump", &dump, value);
    }
}

#[tokio::test]
async fn a_remote_credential_reaches_neither_the_log_nor_the_database() {
    capture_logs();
    let password = format!("remote-{}", Uuid::now_v7().simple());
    let wrong = format!("wrong-{}", Uuid::now_v7().simple());
    let remote = git_http::GitHttp::start("git", &password).await;
    remote.create_repo("web");
    let app = spawn_app_with(|s: &mut Settings| s.projects.allow_private_remotes = true).await;
    let team = default_team(&app).await;
    set_secret(
        &app,
        &app.token,
        &team,
        "WEB_GIT",
        &format!("git:{password}"),
    )
    .await;
    set_secret(
        &app,
        &app.token,
        &team,
        "WRONG_GIT",
        &format!("git:{wrong}"),
    )
    .await;
    let mut shown = String::new();
    for (name, secret, status) in [("bad", "WRONG_GIT", 422), ("web", "WEB_GIT", 201)] {
        let (s, body) = call(
            &app,
            &app.token,
            Method::POST,
            "/v1/projects",
            Some(json!({"name": name, "git_url": remote.url("web"), "credential_secret": secret})),
        )
        .await;
        assert_eq!(s, status, "{body}");
        shown.push_str(&body.to_string());
        if s == 201 {
            remote.commit("web", "next.txt", "next\n", "next");
            let (s, ws) = call(
                &app,
                &app.token,
                Method::POST,
                "/v1/workspaces",
                Some(json!({"project_id": body["id"]})),
            )
            .await;
            assert_eq!(s, 201, "{ws}");
            shown.push_str(&ws.to_string());
        }
    }
    let db = app.db.clone();
    app.stop().await;
    let dump = pg_dump(&db);
    let log = captured_log();
    assert!(log.contains("ls-remote"), "the failed clone was logged");
    use base64::Engine;
    for value in [&password, &wrong] {
        let encoded = base64::engine::general_purpose::STANDARD.encode(format!("git:{value}"));
        for (what, text) in [
            ("API answers", &shown),
            ("server log", &log),
            ("database dump", &dump),
        ] {
            assert_absent(what, text, value);
            assert!(!text.contains(&encoded), "the header is in the {what}");
        }
    }
}

#[tokio::test]
async fn pushes_and_pull_requests_keep_the_remote_credential_out_of_the_log() {
    capture_logs();
    let password = format!("push-{}", Uuid::now_v7().simple());
    let wrong = format!("wrong-{}", Uuid::now_v7().simple());
    let remote = git_http::GitHttp::start("git", &password).await;
    remote.create_repo("web");
    let forge = fake_forge::FakeForge::start(fake_forge::Flavor::GitHub, &password).await;
    let app = spawn_app_with(|s: &mut Settings| s.projects.allow_private_remotes = true).await;
    let team = default_team(&app).await;
    set_secret(
        &app,
        &app.token,
        &team,
        "WEB_GIT",
        &format!("git:{password}"),
    )
    .await;
    let mut shown = String::new();
    let mut ok = |status: u16, expected: u16, body: Value| {
        assert_eq!(status, expected, "{body}");
        shown.push_str(&body.to_string());
        body
    };
    let (s, project) = call(
        &app,
        &app.token,
        Method::POST,
        "/v1/projects",
        Some(
            json!({"name": "web", "git_url": remote.url("web"), "credential_secret": "WEB_GIT",
            "forge": "github", "forge_api_url": forge.api_url(), "forge_repo": "acme/web"}),
        ),
    )
    .await;
    let project = ok(s, 201, project);
    let (s, ws) = call(
        &app,
        &app.token,
        Method::POST,
        "/v1/workspaces",
        Some(json!({"project_id": project["id"], "title": "leak check"})),
    )
    .await;
    let ws = ok(s, 201, ws);
    let ws_id = ws["id"].as_str().unwrap().to_owned();
    let branch = ws["branch"].as_str().unwrap().to_owned();
    std::fs::write(path_of(&ws["path"]).join("a.txt"), "a\n").unwrap();
    let push = |body: Value| {
        let (app, ws_id) = (&app, ws_id.clone());
        async move {
            call(
                app,
                &app.token,
                Method::POST,
                &format!("/v1/workspaces/{ws_id}/push"),
                Some(body),
            )
            .await
        }
    };
    let (s, b) = push(json!({})).await;
    ok(s, 200, b);
    // Refused (diverged), forced, and failed (the secret no longer opens the remote).
    remote.commit_on("web", &branch, "theirs.txt", "theirs\n", "theirs");
    std::fs::write(path_of(&ws["path"]).join("b.txt"), "b\n").unwrap();
    let (s, b) = push(json!({})).await;
    ok(s, 409, b);
    let (s, b) = push(json!({"force": true})).await;
    ok(s, 200, b);
    let (s, b) = call(
        &app,
        &app.token,
        Method::POST,
        &format!("/v1/workspaces/{ws_id}/pull-request"),
        Some(json!({"title": "leak check"})),
    )
    .await;
    ok(s, 201, b);
    set_secret(&app, &app.token, &team, "WEB_GIT", &format!("git:{wrong}")).await;
    std::fs::write(path_of(&ws["path"]).join("c.txt"), "c\n").unwrap();
    let (s, b) = push(json!({})).await;
    ok(s, 502, b);
    let (s, b) = call(
        &app,
        &app.token,
        Method::GET,
        &format!("/v1/workspaces/{ws_id}"),
        None,
    )
    .await;
    ok(s, 200, b);
    let db = app.db.clone();
    app.stop().await;
    let dump = pg_dump(&db);
    let log = captured_log();
    assert!(
        log.contains("git push failed"),
        "the failed push was logged"
    );
    assert!(
        log.contains("pull request's state cannot be refreshed"),
        "the refused refresh was logged"
    );
    use base64::Engine;
    for value in [&password, &wrong] {
        let encoded = base64::engine::general_purpose::STANDARD.encode(format!("git:{value}"));
        for (what, text) in [
            ("API answers", &shown),
            ("server log", &log),
            ("database dump", &dump),
        ] {
            assert_absent(what, text, value);
            assert!(!text.contains(&encoded), "the header is in the {what}");
        }
    }
}
