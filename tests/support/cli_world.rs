//! The world of a real-CLI suite, written once: the app with one provider configured as a
//! user would, the fake model its CLI talks to, the CLI's home and a repository, and the
//! steps every suite takes in it. A suite says what is its own in a [`Provider`].

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use agentry::config::{ProviderSettings, Settings};
use serde_json::{Value, json};
use sqlx::PgPool;
use tempfile::TempDir;
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::clis;
use crate::helpers::*;

/// What a suite's provider brings to the world.
pub trait Provider {
    /// The provider id, which is also the name its pinned CLI is installed under.
    const ID: &'static str;
    /// How long one turn may take.
    const TURN: Duration;
    /// At most this many of its CLIs run at once across the tests of a binary (they are
    /// large); `None`: no limit.
    const SLOTS: Option<usize>;
    /// The model its agents are created with, when not the CLI's default.
    const MODEL: Option<&'static str> = None;
    /// The fake model server the CLI is pointed at.
    type Fake: ModelFake;

    /// The provider's table as a user would write it: `cli` talking to the fake at
    /// `fake_url`, living in `home`.
    fn settings(cli: &Path, fake_url: &str, home: &Path) -> ProviderSettings;

    /// The CLI's home, before the server starts.
    fn home() -> TempDir {
        tempfile::tempdir().unwrap()
    }
    /// Entries of the server's egress allow list (`egress.allow`) for a world whose fake
    /// is at `fake_url`: what an admin adds for a CLI that talks to a model server on the
    /// host's loopback itself, its credential not brokered. None by default.
    fn egress_allow(_fake_url: &str) -> Vec<String> {
        Vec::new()
    }
    /// `NAME=value` in the environment of every process started for the test (and of
    /// nothing else on the machine).
    fn marker(home: &Path) -> String {
        format!("HOME={}", home.display())
    }
}

/// A fake model server on 127.0.0.1; it stops when dropped.
pub trait ModelFake {
    fn launch() -> impl Future<Output = Self>;
    /// The URL a CLI is given for it.
    fn endpoint(&self) -> String;
}

/// `AGENTRY_TEST_SANDBOX_NETWORK` (`host`, `none` or `proxy`), when set, is the sandbox's
/// network mode of a suite's servers instead of the default (`proxy`: the CLIs behind the
/// egress proxy, with their keys brokered to the fake model servers).
pub fn network_from_env(s: &mut Settings) {
    use agentry::config::SandboxNetwork;
    let Ok(mode) = std::env::var("AGENTRY_TEST_SANDBOX_NETWORK") else {
        return;
    };
    s.sandbox.network = match mode.as_str() {
        "host" => SandboxNetwork::Host,
        "none" => SandboxNetwork::None,
        "proxy" => SandboxNetwork::Proxy,
        other => panic!("AGENTRY_TEST_SANDBOX_NETWORK={other}: expected host, none or proxy"),
    };
}

/// A provider table that runs `cli` with `env`.
pub fn cli_settings(cli: &Path, env: BTreeMap<String, String>) -> ProviderSettings {
    ProviderSettings {
        command: Some(vec![cli.display().to_string()]),
        env,
        ..Default::default()
    }
}

/// One test's world.
pub struct CliWorld<P: Provider> {
    pub app: TestApp,
    pub fake: P::Fake,
    pub cli: PathBuf,
    pub home: TempDir,
    pub repo: TempDir,
    _slot: Option<SemaphorePermit<'static>>,
}

impl<P: Provider> CliWorld<P> {
    /// A server with the provider on a fresh fake; fails when the CLI is not installed.
    pub async fn new() -> Self {
        Self::new_with(|_| {}).await
    }

    /// Like `new`, with the app's settings adjusted by `tweak`.
    pub async fn new_with(tweak: impl FnOnce(&mut Settings)) -> Self {
        let cli = clis::cli(P::ID);
        let slot = match P::SLOTS {
            Some(n) => {
                // One static for every `P`: a test binary drives one provider.
                static SLOTS: OnceLock<Semaphore> = OnceLock::new();
                let slots = SLOTS.get_or_init(|| Semaphore::new(n));
                Some(slots.acquire().await.unwrap())
            }
            None => None,
        };
        let fake = P::Fake::launch().await;
        let home = P::home();
        let table = P::settings(&cli, &fake.endpoint(), home.path());
        let allow = P::egress_allow(&fake.endpoint());
        let app = spawn_app_with(move |s| {
            s.providers.insert(P::ID.into(), table);
            s.egress.allow.extend(allow);
            network_from_env(s);
            tweak(s);
        })
        .await;
        Self {
            app,
            fake,
            cli,
            home,
            repo: git_repo(),
            _slot: slot,
        }
    }

    /// Stop the server and start it again on its database and data dir, calling `between`
    /// with the data dir while it is down.
    pub async fn restart(self, between: impl FnOnce(&Path)) -> Self {
        let (db, data_dir, token) = self.app.stop().await;
        between(data_dir.path());
        let table = P::settings(&self.cli, &self.fake.endpoint(), self.home.path());
        let allow = P::egress_allow(&self.fake.endpoint());
        let app = spawn_on_with(db, data_dir, Some(token), |s| {
            s.providers.insert(P::ID.into(), table);
            s.egress.allow.extend(allow);
            network_from_env(s);
        })
        .await;
        Self { app, ..self }
    }

    /// The server, and the rest of the world, which must outlive it.
    pub fn into_app(self) -> (TestApp, impl Sized) {
        let Self {
            app,
            fake,
            cli,
            home,
            repo,
            _slot,
        } = self;
        (app, (fake, cli, home, repo, _slot))
    }

    /// A worktree workspace and an agent in `mode`; returns (agent id, workspace).
    pub async fn agent(&self, mode: &str) -> (String, Value) {
        let mut fields = json!({"provider": P::ID, "mode": mode});
        if let Some(model) = P::MODEL {
            fields["model"] = model.into();
        }
        new_agent(&self.app, self.repo.path(), fields).await
    }

    /// Prompt and read the agent's stream until the turn completes; returns its events.
    pub async fn turn(&self, agent: &str, text: &str, after: Option<i64>) -> Vec<SseEvent> {
        let mut stream = self.app.events(agent, after).await;
        self.app.prompt(agent, text).await;
        stream.until("turn_completed", P::TURN).await
    }

    /// The pid of the agent's running CLI.
    pub async fn pid(&self, agent: &str) -> i32 {
        self.app.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["pid"]
            .as_i64()
            .expect("a running CLI") as i32
    }

    /// The provider session id the agent reports.
    pub async fn session_id(&self, agent: &str) -> String {
        let a = self.app.get_ok(&format!("/v1/agents/{agent}")).await;
        a["runtime"]["provider_session_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id: {a}"))
            .to_owned()
    }

    /// Answer the permission `request` (an event's data) with `behavior`.
    pub async fn answer(&self, agent: &str, request: &Value, behavior: &str) {
        self.answer_with(agent, request, json!({"behavior": behavior}))
            .await;
    }

    /// Like `answer`, with the whole `body` of the answer.
    pub async fn answer_with(&self, agent: &str, request: &Value, body: Value) {
        let id = request["request_id"].as_str().unwrap();
        self.app
            .post_ok(&format!("/v1/agents/{agent}/permissions/{id}"), body, 200)
            .await;
    }

    /// The [`Provider::marker`] of this test's home.
    pub fn marker(&self) -> String {
        P::marker(self.home.path())
    }

    /// The live processes started for this test.
    pub fn processes_of_this_test(&self) -> Vec<i32> {
        processes_with_env(&self.marker())
    }
}

/// A new project of `repo` (under a name of its own), a worktree workspace of it and an
/// agent in that created with `fields` (its provider, mode, …); returns (agent id,
/// workspace).
pub async fn new_agent(app: &TestApp, repo: &Path, mut fields: Value) -> (String, Value) {
    let name = format!("p{}", uuid::Uuid::now_v7().simple());
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
    fields["workspace_id"] = ws["id"].clone();
    let agent = app.post_ok("/v1/agents", fields, 201).await;
    (agent["id"].as_str().unwrap().to_owned(), ws)
}

/// The rows of the server's process ledger.
pub async fn ledger_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The assistant's last whole message in `events`.
pub fn last_message(events: &[SseEvent]) -> String {
    of_kind(events, "assistant_message")
        .last()
        .map(|m| m["text"].as_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// The assistant's whole messages in `events`.
pub fn assistant_text(events: &[SseEvent]) -> String {
    of_kind(events, "assistant_message")
        .iter()
        .map(|m| m["text"].as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `pid` and every process below it, read from `/proc`.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            // After the command's closing parenthesis: state, then the parent's pid.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

/// The command line of process `pid`, argument by argument (`None` once it is gone).
pub fn command_line(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    // Each argument ends with a NUL.
    let raw = raw.strip_suffix(&[0]).unwrap_or(&raw);
    Some(
        raw.split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}
