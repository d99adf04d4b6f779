//! The test harness: a throwaway cluster per test process (or `DATABASE_URL`), a fresh
//! database per test, the app on port 0, a git repository fixture and an SSE reader.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use agentry::config::Settings;
use agentry::server::Application;
use futures::StreamExt;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tempfile::TempDir;
use tokio::sync::oneshot;

pub struct TestApp {
    pub base: String,
    pub token: String,
    pub client: reqwest::Client,
    pub pool: PgPool,
    pub data_dir: TempDir,
    pub db: PgConnectOptions,
    /// The app's event writer, for its counters.
    pub writer: agentry::events::EventWriter,
    /// The app's egress proxy, to open an agent's endpoint directly.
    pub egress: agentry::egress::Egress,
    /// The app's trigger scheduler clock (moved by hand under
    /// `triggers.manual_clock_start`).
    pub triggers: std::sync::Arc<agentry::services::triggers::Triggers>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

pub async fn fresh_database() -> PgConnectOptions {
    let name = format!("t_{}", uuid::Uuid::now_v7().simple());
    match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let admin: PgConnectOptions = url.parse().expect("DATABASE_URL");
            let pool = sqlx::PgPool::connect_with(admin.clone())
                .await
                .expect("connect DATABASE_URL");
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&pool)
                .await
                .unwrap();
            pool.close().await;
            admin.database(&name)
        }
        Err(_) => {
            let cluster = tokio::task::spawn_blocking(agentry::embedded_pg::test_cluster)
                .await
                .unwrap();
            cluster
                .ensure_database(&name)
                .await
                .expect("create test database");
            cluster.connect_options(&name)
        }
    }
}

pub fn settings(data_dir: &Path) -> Settings {
    let mut s = Settings {
        data_dir: data_dir.to_path_buf(),
        listen: "127.0.0.1:0".into(),
        ..Default::default()
    };
    s.providers.insert(
        "mock".into(),
        agentry::config::ProviderSettings {
            command: Some(vec![env!("CARGO_BIN_EXE_agentry").into()]),
            ..Default::default()
        },
    );
    s.database.max_connections = Some(10);
    // The server runs inside the test binary: its sandboxes' egress bridge is `agentry`.
    s.bridge_program = Some(env!("CARGO_BIN_EXE_agentry").into());
    // Stopping does not wait for running turns (tests that drain set it).
    s.cluster.drain_timeout_s = 0;
    // Tests run many servers side by side, each with its own turns: none waits for a
    // running-turn slot unless the test sets the limits (the host's default is for one
    // deployment on the whole machine).
    s.limits.max_running_turns = 0;
    s
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Like `spawn_app`, with settings adjusted by `tweak`.
pub async fn spawn_app_with(tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let db = fresh_database().await;
    let data_dir = tempfile::tempdir().unwrap();
    let mut s = settings(data_dir.path());
    tweak(&mut s);
    start(db, data_dir, None, s).await
}

/// Like `spawn_app_with`, serving on `listener` (for settings that name the server's own
/// address, such as a sign-in redirect URL).
#[allow(dead_code)] // used by the OIDC tests, not by tests/api
pub async fn spawn_app_on(listener: TcpListener, tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let db = fresh_database().await;
    let data_dir = tempfile::tempdir().unwrap();
    let mut s = settings(data_dir.path());
    tweak(&mut s);
    start_on(db, data_dir, None, s, listener).await
}

/// Start an app on an existing database and data dir (for restarts).
pub async fn spawn_on(db: PgConnectOptions, data_dir: TempDir, token: Option<String>) -> TestApp {
    spawn_on_with(db, data_dir, token, |_| {}).await
}

/// Like `spawn_on`, with settings adjusted by `tweak`.
pub async fn spawn_on_with(
    db: PgConnectOptions,
    data_dir: TempDir,
    token: Option<String>,
    tweak: impl FnOnce(&mut Settings),
) -> TestApp {
    let mut s = settings(data_dir.path());
    tweak(&mut s);
    start(db, data_dir, token, s).await
}

/// An app on the embedded default database of its own data dir, started and supervised
/// by the server itself (as `agentry serve` without `database.url` runs it).
#[allow(dead_code)] // used by the store recovery tests, not by tests/api
pub async fn spawn_embedded_app(tweak: impl FnOnce(&mut Settings)) -> TestApp {
    use std::os::unix::fs::PermissionsExt;
    let data_dir = tempfile::tempdir().unwrap();
    // The database server's account must reach it when the tests run as root.
    std::fs::set_permissions(data_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut s = settings(data_dir.path());
    s.database.url = None;
    tweak(&mut s);
    let (pool, embedded) = agentry::server::open_database(&s)
        .await
        .expect("the embedded database starts");
    let db = (*pool.connect_options()).clone();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    launch(pool, embedded, db, data_dir, None, s, listener).await
}

async fn start(
    db: PgConnectOptions,
    data_dir: TempDir,
    token: Option<String>,
    settings: Settings,
) -> TestApp {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    start_on(db, data_dir, token, settings, listener).await
}

async fn start_on(
    db: PgConnectOptions,
    data_dir: TempDir,
    token: Option<String>,
    settings: Settings,
    listener: TcpListener,
) -> TestApp {
    let pool = agentry::store::connect(db.clone(), 10).await.expect("pool");
    launch(pool, None, db, data_dir, token, settings, listener).await
}

async fn launch(
    pool: PgPool,
    embedded: Option<agentry::embedded_pg::EmbeddedPostgres>,
    db: PgConnectOptions,
    data_dir: TempDir,
    token: Option<String>,
    settings: Settings,
    listener: TcpListener,
) -> TestApp {
    let app = Application::build_with(settings, pool.clone(), embedded, listener)
        .await
        .expect("app builds");
    let token = token
        .or_else(|| app.bootstrap_token().map(str::to_owned))
        .expect("a token");
    let base = format!("http://127.0.0.1:{}", app.port());
    let writer = app.state().services.data.writer.clone();
    let egress = app.state().egress.clone();
    let triggers = app.state().services.triggers.clone();
    let (stop_tx, stop_rx) = oneshot::channel();
    let task = tokio::spawn(async move {
        app.run_until(async {
            let _ = stop_rx.await;
        })
        .await
        .expect("app stops cleanly");
    });
    TestApp {
        base,
        token,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            // Below the server's 5 s keep-alive: a connection the server is closing is
            // never reused (that fails the request with `IncompleteMessage`).
            .pool_idle_timeout(Duration::from_secs(2))
            .build()
            .unwrap(),
        pool,
        data_dir,
        db,
        writer,
        egress,
        triggers,
        stop: Some(stop_tx),
        task: Some(task),
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    pub async fn delete(&self, path: &str) -> reqwest::Response {
        self.client
            .delete(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap()
    }

    /// POST and expect `status`; returns the JSON body.
    pub async fn post_ok(&self, path: &str, body: Value, status: u16) -> Value {
        let res = self.post(path, body).await;
        expect_status(res, status).await
    }

    pub async fn get_ok(&self, path: &str) -> Value {
        expect_status(self.get(path).await, 200).await
    }

    /// `PUT` a JSON body; the answer must be 200.
    #[allow(dead_code)] // for the real-CLI suites; tests/api reads events its own way
    pub async fn put_ok(&self, path: &str, body: Value) -> Value {
        let res = self
            .client
            .put(self.url(path))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        expect_status(res, 200).await
    }

    /// Graceful stop (like SIGTERM): agents closed, processes ended.
    pub async fn stop(mut self) -> (PgConnectOptions, TempDir, String) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
        (self.db, self.data_dir, self.token)
    }

    /// The entry of provider `id` in `GET /v1/providers`; it must be listed.
    pub async fn provider(&self, id: &str) -> Value {
        let list = self.get_ok("/v1/providers").await;
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("{id} is listed: {list}"))
    }

    /// Creating an agent of `provider` in a new workspace of `repo` is refused (422
    /// `provider_unavailable`); returns the problem.
    #[allow(dead_code)] // for the real-CLI suites
    pub async fn creation_refused(&self, repo: &Path, provider: &str) -> Value {
        let project = self.project(repo).await;
        let ws = self
            .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
            .await;
        let refused = self
            .post_ok(
                "/v1/agents",
                json!({"workspace_id": ws["id"], "provider": provider}),
                422,
            )
            .await;
        assert_eq!(refused["code"], "provider_unavailable", "{refused}");
        refused
    }

    pub async fn project(&self, repo: &Path) -> Value {
        self.post_ok(
            "/v1/projects",
            json!({"name": "demo", "repo_path": repo}),
            201,
        )
        .await
    }

    /// A new worktree workspace of `project` and an agent of `provider` in it:
    /// `(agent id, workspace id)`.
    async fn agent_and_workspace(&self, project: &Value, provider: &str) -> (String, String) {
        let ws = self
            .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
            .await;
        let agent = self
            .post_ok(
                "/v1/agents",
                json!({"workspace_id": ws["id"], "provider": provider}),
                201,
            )
            .await;
        (
            agent["id"].as_str().unwrap().to_owned(),
            ws["id"].as_str().unwrap().to_owned(),
        )
    }

    /// An agent of `provider` in a new worktree workspace of `project`, once it is ready;
    /// returns its id.
    pub async fn agent_in_new_workspace(&self, project: &Value, provider: &str) -> String {
        let (id, _) = self.agent_and_workspace(project, provider).await;
        self.wait(&id).await;
        id
    }

    /// A project, a worktree workspace and a mock agent in it: `(agent id, workspace id)`.
    pub async fn mock_agent(&self, repo: &Path) -> (String, String) {
        let project = self.project(repo).await;
        self.agent_and_workspace(&project, "mock").await
    }

    pub async fn prompt(&self, agent: &str, text: &str) -> String {
        self.prompt_within(agent, text, Duration::from_secs(60))
            .await
    }

    /// A prompt that may reopen the agent's session first: the answer comes once the
    /// session is open, which for some CLIs takes longer than the client's usual 60 s
    /// (Gemini CLI waits out the minute its session was created in).
    pub async fn prompt_within(&self, agent: &str, text: &str, patience: Duration) -> String {
        let res = self
            .client
            .post(self.url(&format!("/v1/agents/{agent}/messages")))
            .bearer_auth(&self.token)
            .json(&json!({"text": text}))
            .timeout(patience)
            .send()
            .await
            .unwrap();
        expect_status(res, 202).await["turn_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub async fn wait(&self, agent: &str) -> Value {
        self.get_ok(&format!("/v1/agents/{agent}/wait?timeout_s=30"))
            .await
    }

    /// Every event of the agent's timeline, oldest first.
    pub async fn timeline(&self, agent: &str) -> Vec<Value> {
        let mut out = Vec::new();
        let mut path = format!("/v1/agents/{agent}/timeline?after_seq=0&limit=1000");
        loop {
            let page = self.get_ok(&path).await;
            out.extend(page["items"].as_array().unwrap().iter().cloned());
            match page["next_cursor"].as_str() {
                Some(c) => path = format!("/v1/agents/{agent}/timeline?cursor={c}&limit=1000"),
                None => return out,
            }
        }
    }

    #[allow(dead_code)] // for the suites that check secrets at rest
    /// Every row of every table of the public schema, one row a line as JSON text, each
    /// line prefixed with its table's name.
    pub async fn dump_database(&self) -> String {
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT quote_ident(table_name) FROM information_schema.tables
              WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap();
        assert!(!tables.is_empty(), "the database has tables");
        let mut dump = String::new();
        for table in tables {
            let rows: Vec<String> =
                // The table names come from the catalog, quoted by `quote_ident`.
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT row_to_json(t)::text FROM {table} t"
                )))
                    .fetch_all(&self.pool)
                    .await
                    .unwrap();
            for row in rows {
                dump.push_str(&table);
                dump.push(' ');
                dump.push_str(&row);
                dump.push('\n');
            }
        }
        dump
    }

    #[allow(dead_code)] // for the suites that check secrets at rest
    /// The whole database (`dump_database`) holds none of `secrets`: not as text, not in
    /// hex (how `bytea` columns appear), whatever the case.
    pub async fn assert_database_lacks(&self, secrets: &[&str]) {
        let dump = self.dump_database().await.to_lowercase();
        for secret in secrets {
            assert!(secret.len() >= 8, "too short to search for: {secret:?}");
            let forms = [secret.to_lowercase(), hex::encode(secret.as_bytes())];
            for form in forms {
                if let Some(at) = dump.find(&form) {
                    let line = dump[..at].rsplit('\n').next().unwrap_or_default();
                    panic!(
                        "the database holds a secret ({secret:.12}…) in the clear, in: {:.200}",
                        line
                    );
                }
            }
        }
    }

    /// Open the agent's SSE stream.
    pub async fn events(&self, agent: &str, last_event_id: Option<i64>) -> SseReader {
        let mut req = self
            .client
            .get(self.url(&format!("/v1/agents/{agent}/events")))
            .bearer_auth(&self.token);
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id.to_string());
        }
        let res = req.send().await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["content-type"], "text/event-stream");
        SseReader::from_response(res)
    }
}

pub async fn expect_status(res: reqwest::Response, status: u16) -> Value {
    let got = res.status().as_u16();
    let ct = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = res.text().await.unwrap();
    assert_eq!(got, status, "unexpected status; body: {text}");
    if got >= 400 {
        assert_eq!(
            ct, "application/problem+json",
            "errors are problem+json: {text}"
        );
    }
    if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }
}

/// One SSE message.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub id: i64,
    pub event: String,
    pub data: Value,
}

/// The event kinds of `events`, in order.
#[allow(dead_code)] // for the real-CLI suites; tests/api reads events its own way
pub fn kinds(events: &[SseEvent]) -> Vec<&str> {
    events.iter().map(|e| e.event.as_str()).collect()
}

/// The `data` of each event of `kind`.
#[allow(dead_code)] // for the real-CLI suites; tests/api reads events its own way
pub fn of_kind<'a>(events: &'a [SseEvent], kind: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e.event == kind)
        .map(|e| &e.data["data"])
        .collect()
}

/// The seq of the last event, to resume after it.
#[allow(dead_code)] // for the real-CLI suites; tests/api reads events its own way
pub fn last_seq(events: &[SseEvent]) -> i64 {
    events.last().map(|e| e.id).unwrap_or(0)
}

/// The data of the last `turn_completed`.
#[allow(dead_code)] // for the real-CLI suites; tests/api reads events its own way
pub fn outcome(events: &[SseEvent]) -> Value {
    let ends = of_kind(events, "turn_completed");
    (*ends.last().expect("a turn_completed")).clone()
}

pub struct SseReader {
    stream: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    parser: agentry::event_stream::Parser,
    ready: std::collections::VecDeque<agentry::event_stream::Event>,
}

impl SseReader {
    pub fn from_response(res: reqwest::Response) -> Self {
        SseReader {
            stream: Box::pin(res.bytes_stream()),
            parser: agentry::event_stream::Parser::new(),
            ready: std::collections::VecDeque::new(),
        }
    }

    /// The next event with a numeric id (comments and `retry:` skipped), or None when the
    /// stream ends or nothing arrives within `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<SseEvent> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            while let Some(e) = self.ready.pop_front() {
                let Ok(id) = e.id.parse() else { continue };
                let data = serde_json::from_str(&e.data)
                    .unwrap_or_else(|err| panic!("event {id} is not JSON ({err}): {}", e.data));
                return Some(SseEvent {
                    id,
                    event: e.event,
                    data,
                });
            }
            match tokio::time::timeout_at(deadline, self.stream.next()).await {
                Ok(Some(Ok(chunk))) => self.ready.extend(self.parser.push(&chunk)),
                _ => return None,
            }
        }
    }

    /// Read events until one of `kind` arrives (inclusive); returns all read.
    pub async fn until(&mut self, kind: &str, timeout: Duration) -> Vec<SseEvent> {
        let mut out = Vec::new();
        while let Some(e) = self.next(timeout).await {
            let done = e.event == kind;
            out.push(e);
            if done {
                return out;
            }
        }
        panic!(
            "no `{kind}` event within {timeout:?}; got {:?}",
            out.iter().map(|e| &e.event).collect::<Vec<_>>()
        );
    }
}

/// A git repository with one commit on `main`.
pub fn git_repo() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    git(dir.path(), &["init", "-q", "-b", "main"]);
    std::fs::write(dir.path().join("README.md"), "# demo\n").unwrap();
    git(dir.path(), &["add", "."]);
    git(dir.path(), &["commit", "-q", "-m", "initial"]);
    dir
}

pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "safe.directory=*",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Pids whose environment holds `entry` (`NAME=value`).
#[allow(dead_code)]
pub fn processes_with_env(entry: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for dir in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = dir.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(environ) = std::fs::read(dir.path().join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|e| e == entry.as_bytes()) && pid_alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// The `TMPDIR` a running process was started with.
pub fn tmpdir_of(pid: i32) -> PathBuf {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("a live process");
    environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(b"TMPDIR="))
        .map(|v| PathBuf::from(String::from_utf8(v.to_vec()).unwrap()))
        .expect("TMPDIR is set")
}

pub fn pid_alive(pid: i32) -> bool {
    // A zombie is gone for our purposes.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

pub async fn eventually<F: FnMut() -> bool>(what: &str, timeout: Duration, mut f: F) {
    let deadline = std::time::Instant::now() + timeout;
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn path_of(v: &Value) -> PathBuf {
    PathBuf::from(v.as_str().unwrap())
}

/// The random source of a randomized test: seeded from `AGENTRY_TEST_SEED` when set, else
/// from a fresh random seed. The seed is printed (shown with the output of a failed test)
/// so that a failure can be re-run exactly: `AGENTRY_TEST_SEED=<seed> cargo test <name>`.
pub fn seeded_rng(test: &str) -> rand::rngs::StdRng {
    use rand::{Rng, SeedableRng};
    let seed = match std::env::var("AGENTRY_TEST_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .expect("AGENTRY_TEST_SEED is an unsigned integer"),
        Err(_) => rand::rng().random(),
    };
    eprintln!("{test}: random seed {seed} (re-run with AGENTRY_TEST_SEED={seed})");
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// `DATABASE_URL` for a separate process to reach the test database.
pub fn database_url(db: &sqlx::postgres::PgConnectOptions) -> String {
    let name = db.get_database().expect("a database name");
    if let Ok(url) = std::env::var("DATABASE_URL") {
        let (base, _) = url.rsplit_once('/').expect("DATABASE_URL has a path");
        return format!("{base}/{name}");
    }
    let socket = db
        .get_socket()
        .expect("the test cluster is on a unix socket");
    format!(
        "postgres://{}@localhost:{}/{name}?host={}",
        db.get_username(),
        db.get_port(),
        socket.display()
    )
}

/// Wait (at most 20 s) until a statement of this test's database whose text starts with
/// `query_prefix` waits on a lock; `what` says what never happened otherwise.
pub async fn until_a_statement_waits_on_a_lock(pool: &PgPool, query_prefix: &str, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND starts_with(query, $1)",
        )
        .bind(query_prefix)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The provider id of the scripted agent `tests/support/exec_agent.py` (each prompt runs
/// as a shell command in the agent's worktree, as an injected prompt would have it).
pub const EXEC_PROVIDER: &str = "exec";

/// A project of `repo` named `name`, a worktree workspace and an exec agent in it:
/// `(agent id, worktree path)`.
pub async fn exec_agent_in(app: &TestApp, repo: &Path, name: &str) -> (String, PathBuf) {
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": name, "repo_path": repo}),
            201,
        )
        .await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": EXEC_PROVIDER}),
            201,
        )
        .await;
    let id = agent["id"].as_str().unwrap().to_owned();
    app.wait(&id).await;
    let ws = app
        .get_ok(&format!("/v1/workspaces/{}", ws["id"].as_str().unwrap()))
        .await;
    (id, PathBuf::from(ws["path"].as_str().unwrap()))
}

/// Settings with the scripted exec agent as a custom ACP provider; its script's
/// directory is shown read-only inside agent sandboxes.
pub fn with_exec_agent(s: &mut Settings) {
    let support = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support");
    s.providers.insert(
        EXEC_PROVIDER.into(),
        agentry::config::ProviderSettings {
            extends: Some("acp".into()),
            command: Some(vec![
                "python3".into(),
                support.join("exec_agent.py").display().to_string(),
            ]),
            ..Default::default()
        },
    );
    s.sandbox.extra_read_only.push(support);
}
