//! The `codex` provider against the real Codex CLI (the pinned install), pointed at a fake
//! OpenAI Responses server through its provider settings, exactly as a user would
//! configure it; everything is observed through agentry's REST and SSE API.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/http.rs"]
#[allow(dead_code)]
mod http;

#[path = "support/clis.rs"]
mod clis;

#[path = "support/scenarios.rs"]
#[allow(dead_code)]
mod scenarios;

#[path = "support/cli_world.rs"]
#[allow(dead_code)]
mod cli_world;

#[path = "support/fake_openai.rs"]
#[allow(dead_code)]
mod fake_openai;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, command_line, new_agent, process_tree};
use fake_openai::{FakeOpenAi, Item, Reply, input_text};
use helpers::*;
use serde_json::{Value, json};

const TURN: Duration = Duration::from_secs(25);

/// The `[providers.codex]` table a user would write for a fake model endpoint.
fn codex_settings(
    cli: &Path,
    base_url: &str,
    home: &Path,
    model: &str,
    key: bool,
) -> ProviderSettings {
    let mut env = BTreeMap::from([
        ("CODEX_HOME".to_owned(), home.display().to_string()),
        ("HOME".to_owned(), home.display().to_string()),
    ]);
    if key {
        env.insert("OPENAI_API_KEY".to_owned(), "x".to_owned());
    }
    ProviderSettings {
        command: Some(vec![cli.display().to_string()]),
        args: vec![
            "-c".into(),
            format!("model={model}"),
            "-c".into(),
            "model_provider=fake".into(),
            "-c".into(),
            format!(
                r#"model_providers.fake={{name="Fake",base_url="{base_url}",env_key="OPENAI_API_KEY",wire_api="responses"}}"#
            ),
        ],
        env,
        ..Default::default()
    }
}

/// Codex on a model of the fake's own, against the fake Responses server.
struct Codex;

type World = CliWorld<Codex>;

impl Provider for Codex {
    const ID: &'static str = "codex";
    const TURN: Duration = TURN;
    const SLOTS: Option<usize> = None;
    type Fake = FakeOpenAi;

    fn settings(cli: &Path, base_url: &str, home: &Path) -> ProviderSettings {
        codex_settings(cli, base_url, home, "fake-model", true)
    }
    fn marker(home: &Path) -> String {
        format!("CODEX_HOME={}", home.display())
    }
}

/// Codex on a model of its own catalog, to which it offers `apply_patch`.
struct CodexOnCatalogModel;

impl Provider for CodexOnCatalogModel {
    const ID: &'static str = "codex";
    const TURN: Duration = TURN;
    const SLOTS: Option<usize> = None;
    type Fake = FakeOpenAi;

    fn settings(cli: &Path, base_url: &str, home: &Path) -> ProviderSettings {
        codex_settings(cli, base_url, home, "gpt-5.5", true)
    }
}

impl scenarios::Rig for Codex {
    const PROTOCOL: &'static str = "codex-app-server";
    const MODES: &'static [(&'static str, bool)] =
        &[("read-only", false), ("auto", false), ("full-access", true)];
    const ASKING_MODE: &'static str = "read-only";
    const UNATTENDED_MODE: &'static str = "full-access";
    const REPLY_TOKENS: u64 = 20;

    fn reply_in_pieces(fake: &FakeOpenAi, text: &str) {
        fake.script([Reply::text(text)]);
    }
    /// The fake streams no answer slowly: one that never ends serves as well.
    fn reply_slowly(fake: &FakeOpenAi) {
        fake.script([Reply::stalled("Working on it")]);
    }
    fn reply_stalled(fake: &FakeOpenAi) {
        fake.script([Reply::stalled("Still talking")]);
    }
    fn reply_text(fake: &FakeOpenAi, text: &str) {
        fake.script([Reply::text(text)]);
    }
    /// A command that writes the file (asked about in read-only; an escalated one would
    /// be refused where nobody is asked).
    fn reply_write(fake: &FakeOpenAi, path: &Path, content: &str) {
        let cmd = format!(
            "printf '{}' > '{}'",
            content.replace('\n', "\\n"),
            path.display()
        );
        fake.script([Reply::exec("call_w", &cmd)]);
    }
    fn last_conversation(fake: &FakeOpenAi) -> String {
        input_text(fake.requests().last().expect("the model was called"))
    }
}

/// Wait for the agent to stop running; returns the wait answer.
async fn settle(app: &TestApp, agent: &str) -> Value {
    let deadline = Instant::now() + TURN;
    loop {
        let w = app.wait(agent).await;
        if w["timed_out"] != json!(true) {
            return w;
        }
        assert!(Instant::now() < deadline, "the agent is still running: {w}");
    }
}

/// Prompt, wait for the agent to be idle again; returns its last turn.
async fn idle_turn(app: &TestApp, agent: &str, text: &str) -> Value {
    app.prompt(agent, text).await;
    let w = settle(app, agent).await;
    assert_eq!(w["status"], "idle", "{w}");
    w["last_turn"].clone()
}

fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

/// The last state of each tool call, by call id, in order of first appearance.
fn tools(events: &[Value]) -> Vec<Value> {
    let mut order: Vec<String> = Vec::new();
    let mut last: BTreeMap<String, Value> = BTreeMap::new();
    for e in of_kind(events, "tool_call") {
        let id = e["data"]["call_id"].as_str().unwrap().to_owned();
        if !order.contains(&id) {
            order.push(id.clone());
        }
        last.insert(id, e["data"].clone());
    }
    order
        .into_iter()
        .map(|id| last.remove(&id).unwrap())
        .collect()
}

fn outcomes(events: &[Value]) -> Vec<String> {
    of_kind(events, "turn_completed")
        .iter()
        .map(|e| e["data"]["outcome"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_text_turn_streams_deltas_and_completes_with_usage() {
    let rig = World::new().await;
    rig.fake.script([Reply::new(vec![
        Item::Reasoning("Thinking it over.".into()),
        Item::Text("Hello from the fake model.".into()),
    ])]);
    let (agent, _) = rig.agent("auto").await;
    let codex = rig.app.provider("codex").await;
    assert_eq!(codex["available"], true, "{codex}");
    assert_eq!(codex["protocol"], "codex-app-server");
    assert_eq!(codex["default_mode"], "auto");

    let last = idle_turn(&rig.app, &agent, "say hello").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let events = rig.app.timeline(&agent).await;
    let deltas: String = of_kind(&events, "assistant_delta")
        .iter()
        .map(|e| e["data"]["text"].as_str().unwrap())
        .collect();
    let messages = of_kind(&events, "assistant_message");
    assert_eq!(messages.len(), 1, "one message: {messages:?}");
    assert_eq!(messages[0]["data"]["text"], "Hello from the fake model.");
    assert_eq!(deltas, "Hello from the fake model.");
    assert!(
        of_kind(&events, "assistant_delta").len() > 1,
        "the text streamed in pieces"
    );
    assert_eq!(
        of_kind(&events, "user_message").len(),
        1,
        "Codex's echo is dropped"
    );
    let reasoning = of_kind(&events, "reasoning_message");
    let reasoning_deltas = of_kind(&events, "reasoning_delta");
    assert!(
        !reasoning.is_empty() || !reasoning_deltas.is_empty(),
        "the reasoning summary is shown"
    );
    let usage = of_kind(&events, "usage");
    assert!(!usage.is_empty(), "a usage event");
    let u = &usage.last().unwrap()["data"];
    assert_eq!(u["input_tokens"], 100, "{u}");
    assert_eq!(u["output_tokens"], 20, "{u}");
    let done = of_kind(&events, "turn_completed");
    assert_eq!(done[0]["data"]["usage"]["input_tokens"], 100, "{}", done[0]);

    // The model heard the prompt once, with the key and the configured model.
    let requests = rig.fake.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0]["model"], "fake-model");
    assert!(input_text(&requests[0]).contains("say hello"));
    let catalog = rig.app.get_ok("/v1/providers/codex/models").await;
    assert!(
        !catalog["items"].as_array().unwrap().is_empty(),
        "Codex lists its catalog: {catalog}"
    );
    let probes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM managed_processes WHERE agent_id IS NULL")
            .fetch_one(&rig.app.pool)
            .await
            .unwrap();
    assert_eq!(probes, 0, "the catalog probe left no process behind");
}

#[tokio::test]
async fn an_allowed_command_in_read_only_mode_runs_and_its_file_is_in_the_diff() {
    let rig = World::new().await;
    // Asked to run outside the read-only sandbox, so that an approved command can write.
    rig.fake.script([
        Reply::exec_escalated("call_1", "echo hello > out.txt"),
        Reply::text("Wrote out.txt."),
    ]);
    let (agent, ws) = rig.agent("read-only").await;
    rig.app.prompt(&agent, "make out.txt").await;
    let w = settle(&rig.app, &agent).await;
    assert_eq!(w["status"], "waiting_permission", "{w}");
    let pending = rig
        .app
        .get_ok(&format!("/v1/agents/{agent}/permissions?status=pending"))
        .await;
    let request = &pending["items"][0];
    assert_eq!(request["call_id"], "call_1", "{request}");
    assert!(
        request["input"]["command"]
            .as_str()
            .unwrap()
            .contains("echo hello > out.txt"),
        "{request}"
    );
    let options: Vec<&str> = request["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect();
    assert!(
        options.contains(&"accept") && options.contains(&"decline"),
        "{options:?}"
    );
    rig.app
        .post_ok(
            &format!(
                "/v1/agents/{agent}/permissions/{}",
                request["request_id"].as_str().unwrap()
            ),
            json!({"behavior": "allow"}),
            200,
        )
        .await;
    let w = settle(&rig.app, &agent).await;
    assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");

    let dir = path_of(&ws["path"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("out.txt")).unwrap(),
        "hello\n"
    );
    let diff = rig
        .app
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
            .any(|f| f["path"] == "out.txt"),
        "{diff}"
    );
    let events = rig.app.timeline(&agent).await;
    let shell = &tools(&events)[0];
    assert_eq!(shell["tool_kind"], "shell", "{shell}");
    assert_eq!(shell["status"], "completed", "{shell}");
    assert_eq!(shell["output"]["exit_code"], 0, "{shell}");
    assert_eq!(of_kind(&events, "permission_requested").len(), 1);
}

#[tokio::test]
async fn a_declined_command_fails_the_tool_the_model_is_told_and_the_turn_completes() {
    let rig = World::new().await;
    rig.fake.script([
        Reply::exec("call_1", "echo hello > out.txt"),
        Reply::text("Understood, not running it."),
    ]);
    let (agent, ws) = rig.agent("read-only").await;
    rig.app.prompt(&agent, "make out.txt").await;
    let w = settle(&rig.app, &agent).await;
    assert_eq!(w["status"], "waiting_permission", "{w}");
    let id = w["pending_permissions"][0]["request_id"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("a pending request: {w}"));
    rig.app
        .post_ok(
            &format!("/v1/agents/{agent}/permissions/{id}"),
            json!({"behavior": "deny"}),
            200,
        )
        .await;
    let w = settle(&rig.app, &agent).await;
    assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
    let events = rig.app.timeline(&agent).await;
    let shell = &tools(&events)[0];
    assert_eq!(shell["status"], "failed", "{shell}");
    assert!(shell["error"].is_string(), "{shell}");
    let requests = rig.fake.requests();
    assert_eq!(requests.len(), 2, "the model was called again");
    let told = input_text(&requests[1]);
    assert!(
        told.contains("rejected"),
        "the model hears of the refusal: {told}"
    );
    assert!(!path_of(&ws["path"]).join("out.txt").exists());
}

#[tokio::test]
async fn an_interrupt_cancels_the_turn_and_the_next_prompt_works() {
    let rig = World::new().await;
    rig.fake.script([
        Reply::stalled("This answer never ends"),
        Reply::text("Back again."),
    ]);
    let (agent, _) = rig.agent("auto").await;
    let mut sse = rig.app.events(&agent, None).await;
    rig.app.prompt(&agent, "talk forever").await;
    sse.until("assistant_delta", TURN).await;
    let asked = Instant::now();
    rig.app
        .post_ok(&format!("/v1/agents/{agent}/interrupt"), json!({}), 202)
        .await;
    let end = sse.until("turn_completed", TURN).await;
    let took = asked.elapsed();
    assert_eq!(end.last().unwrap().data["data"]["outcome"], "canceled");
    assert!(took < Duration::from_secs(5), "canceled after {took:?}");

    let last = idle_turn(&rig.app, &agent, "are you there?").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let events = rig.app.timeline(&agent).await;
    assert_eq!(outcomes(&events), ["canceled", "completed"]);
    let messages = of_kind(&events, "assistant_message");
    assert_eq!(messages.last().unwrap()["data"]["text"], "Back again.");
}

#[tokio::test]
async fn a_closed_agent_resumes_its_thread_on_the_next_prompt() {
    scenarios::a_closed_agent_resumes_its_conversation(&World::new().await).await;
}

#[tokio::test]
async fn after_a_server_restart_the_next_prompt_resumes_the_thread() {
    scenarios::after_a_server_restart_the_agent_resumes_in_its_mode(World::new().await).await;
}

#[tokio::test]
async fn full_access_runs_commands_without_asking() {
    let rig = World::new().await;
    rig.fake.script([
        Reply::exec("call_1", "echo unattended > free.txt"),
        Reply::text("Done."),
    ]);
    let (agent, ws) = rig.agent("full-access").await;
    let last = idle_turn(&rig.app, &agent, "write free.txt").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let events = rig.app.timeline(&agent).await;
    assert!(of_kind(&events, "permission_requested").is_empty());
    assert_eq!(tools(&events)[0]["status"], "completed");
    let dir = path_of(&ws["path"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("free.txt")).unwrap(),
        "unattended\n"
    );
}

#[tokio::test]
async fn a_patch_becomes_a_write_with_its_diff_and_lands_in_the_worktree() {
    // `apply_patch` is offered to catalog models only.
    let rig = CliWorld::<CodexOnCatalogModel>::new().await;
    let patch = "*** Begin Patch\n*** Add File: hello.txt\n+hello from patch\n*** End Patch\n";
    rig.fake
        .script([Reply::patch("call_p", patch), Reply::text("Patched.")]);
    let (agent, ws) = rig.agent("auto").await;
    let last = idle_turn(&rig.app, &agent, "add hello.txt").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let dir = path_of(&ws["path"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("hello.txt")).unwrap(),
        "hello from patch\n"
    );
    let events = rig.app.timeline(&agent).await;
    let write = &tools(&events)[0];
    assert_eq!(write["tool_kind"], "write", "{write}");
    assert_eq!(write["status"], "completed", "{write}");
    let diff = &write["diff"][0];
    assert!(
        diff["path"].as_str().unwrap().ends_with("hello.txt"),
        "{write}"
    );
    assert_eq!(diff["change"], "add", "{write}");
    assert_eq!(diff["new_text"], "hello from patch\n", "{write}");
}

#[tokio::test]
async fn a_killed_cli_fails_the_turn_quickly_and_the_agent_is_usable_after() {
    scenarios::a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers(&World::new().await)
        .await;
}

#[tokio::test]
async fn without_credentials_codex_is_unavailable_and_creating_an_agent_is_refused() {
    let cli = clis::cli("codex");
    let home = tempfile::tempdir().unwrap();
    let table = codex_settings(
        &cli,
        "http://127.0.0.1:9/v1",
        home.path(),
        "fake-model",
        false,
    );
    let app = spawn_app_with(|s| {
        s.providers.insert("codex".into(), table);
    })
    .await;
    let codex = app.provider("codex").await;
    assert_eq!(codex["available"], false, "{codex}");
    let reason = codex["unavailable_reason"].as_str().unwrap();
    assert!(reason.contains("OPENAI_API_KEY"), "{reason}");

    let repo = git_repo();
    let refused = app.creation_refused(repo.path(), "codex").await;
    assert!(
        refused["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("OPENAI_API_KEY")
            || refused.to_string().contains("OPENAI_API_KEY"),
        "{refused}"
    );

    // A missing program is named.
    let app2 = spawn_app_with(|s| {
        let mut table = codex_settings(&cli, "http://127.0.0.1:9/v1", home.path(), "m", true);
        table.command = Some(vec!["no-such-codex-agentry".into()]);
        s.providers.insert("codex".into(), table);
    })
    .await;
    let codex = app2.provider("codex").await;
    assert!(
        codex["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("no-such-codex-agentry"),
        "{codex}"
    );
}

#[tokio::test]
async fn binary_shell_output_is_stored_with_replacement_characters() {
    let rig = World::new().await;
    rig.fake.script([
        Reply::exec("call_1", "printf 'a\\000b\\377c\\n'"),
        Reply::text("Printed."),
    ]);
    let (agent, _) = rig.agent("full-access").await;
    let last = idle_turn(&rig.app, &agent, "print binary").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let events = rig.app.timeline(&agent).await;
    let shell = &tools(&events)[0];
    assert_eq!(shell["status"], "completed", "{shell}");
    let output = shell["output"]["output"].as_str().unwrap();
    assert!(!output.contains('\0'), "{output:?}");
    assert!(output.contains('\u{FFFD}'), "{output:?}");
    assert!(
        output.starts_with('a') && output.contains('b') && output.contains('c'),
        "{output:?}"
    );
    // The agent goes on normally.
    let last = idle_turn(&rig.app, &agent, "again").await;
    assert_eq!(last["outcome"], "completed", "{last}");
}

#[tokio::test]
async fn an_idle_cli_is_stopped_and_the_next_prompt_resumes_the_conversation() {
    let rig = World::new_with(|s| s.agents.idle_timeout_s = 1).await;
    rig.fake
        .script([Reply::text("Noted: seven."), Reply::text("It was seven.")]);
    let (agent, _) = rig.agent("auto").await;
    idle_turn(&rig.app, &agent, "my number is seven").await;
    let pid = rig.pid(&agent).await;
    eventually(
        "the idle CLI to be stopped",
        Duration::from_secs(10),
        || !pid_alive(pid),
    )
    .await;
    let last = idle_turn(&rig.app, &agent, "which number?").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let history = input_text(rig.fake.requests().last().unwrap());
    assert!(
        history.contains("my number is seven") && history.contains("Noted: seven."),
        "{history}"
    );
}

#[tokio::test]
async fn mode_and_model_changes_apply_to_the_next_turn() {
    let rig = World::new().await;
    rig.fake.script([
        Reply::text("First."),
        Reply::exec("call_1", "echo later > later.txt"),
        Reply::text("Done."),
    ]);
    let (agent, ws) = rig.agent("read-only").await;
    idle_turn(&rig.app, &agent, "hello").await;
    let put = |path: String, body: Value| {
        let app = &rig.app;
        async move {
            let res = app
                .client
                .put(app.url(&path))
                .bearer_auth(&app.token)
                .json(&body)
                .send()
                .await
                .unwrap();
            expect_status(res, 200).await
        }
    };
    put(
        format!("/v1/agents/{agent}/mode"),
        json!({"mode": "full-access"}),
    )
    .await;
    put(
        format!("/v1/agents/{agent}/model"),
        json!({"model": "other-model"}),
    )
    .await;
    let agent_now = rig.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(agent_now["mode"], "full-access", "{agent_now}");
    assert_eq!(agent_now["model"], "other-model", "{agent_now}");

    let last = idle_turn(&rig.app, &agent, "write later.txt").await;
    assert_eq!(last["outcome"], "completed", "{last}");
    let events = rig.app.timeline(&agent).await;
    assert!(
        of_kind(&events, "permission_requested").is_empty(),
        "the unattended mode ran the command without asking"
    );
    assert!(path_of(&ws["path"]).join("later.txt").exists());
    let requests = rig.fake.requests();
    assert_eq!(requests[0]["model"], "fake-model");
    assert_eq!(
        requests[1]["model"], "other-model",
        "the next turn uses the new model"
    );
}

/// A stdio MCP server that answers `initialize` and lists no tools, in Node (`node -e`).
const PROBE_MCP_SERVER: &str = r#"
const rl = require("readline").createInterface({ input: process.stdin });
rl.on("line", (line) => {
  let m;
  try { m = JSON.parse(line); } catch { return; }
  if (m.id === undefined) return;
  const answer = { jsonrpc: "2.0", id: m.id };
  if (m.method === "initialize") {
    answer.result = { protocolVersion: m.params.protocolVersion,
      capabilities: { tools: {} }, serverInfo: { name: "probe", version: "1" } };
  } else if (m.method === "tools/list") {
    answer.result = { tools: [] };
  } else {
    answer.error = { code: -32601, message: "not served" };
  }
  process.stdout.write(JSON.stringify(answer) + "\n");
});
"#;

/// The `env` of a stdio MCP server from the server's settings (a credential) reaches the
/// server Codex starts, and no command line of the agent's processes (the sandbox, the
/// CLI, the MCP server) carries it, nor does a shell command's environment.
#[tokio::test]
async fn a_stdio_mcp_servers_env_reaches_it_and_no_command_line() {
    let secret = format!("probe-secret-{}", uuid::Uuid::now_v7().simple());
    let value = agentry::config::Secret::new(secret.clone());
    let rig = World::new_with(move |s| {
        s.mcp.servers.insert(
            "probe".into(),
            agentry::config::McpServerSetting {
                command: "node".into(),
                args: vec!["-e".into(), PROBE_MCP_SERVER.into()],
                env: BTreeMap::from([("PROBE_SECRET".to_owned(), value)]),
                teams: None,
            },
        );
    })
    .await;
    rig.fake.script([
        Reply::exec("call_1", "env > shell-env.txt"),
        Reply::text("Done."),
    ]);
    let (agent, ws) = new_agent(
        &rig.app,
        rig.repo.path(),
        json!({"provider": "codex", "mode": "full-access",
            "mcp_servers": {"probe": {"server": "probe"}}}),
    )
    .await;
    let last = idle_turn(&rig.app, &agent, "look around").await;
    assert_eq!(last["outcome"], "completed", "{last}");

    let pid = rig.pid(&agent).await as u32;
    let argvs: Vec<(u32, Vec<String>)> = process_tree(pid)
        .into_iter()
        .filter_map(|p| Some((p, command_line(p)?)))
        .collect();
    let (server, _) = argvs
        .iter()
        .find(|(_, argv)| argv[1..] == ["-e", PROBE_MCP_SERVER])
        .unwrap_or_else(|| {
            let programs: Vec<&str> = argvs.iter().map(|(_, argv)| argv[0].as_str()).collect();
            panic!("no MCP server among the agent's processes: {programs:?}")
        });
    let environ = std::fs::read(format!("/proc/{server}/environ")).unwrap();
    let wanted = format!("PROBE_SECRET={secret}");
    assert!(
        environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes()),
        "the MCP server has no PROBE_SECRET of its settings"
    );
    for (_, argv) in &argvs {
        assert!(
            !argv.iter().any(|a| a.contains(&secret)),
            "the MCP server's env value on the command line of {}",
            argv[0]
        );
    }
    let shell_env = std::fs::read_to_string(path_of(&ws["path"]).join("shell-env.txt")).unwrap();
    assert!(
        !shell_env.contains(&secret),
        "a shell command of the agent sees the MCP server's env value"
    );
    // Nor the agent's token for the `agentry` MCP server, whose header Codex reads from
    // its environment too.
    assert!(
        !shell_env.contains("AGENTRY_MCP_HEADER_TOKEN_"),
        "a shell command of the agent sees the agentry MCP server's token"
    );
    // Nor the variable of the model key (the key itself where it is not brokered).
    assert!(
        !shell_env.lines().any(|l| l.starts_with("OPENAI_API_KEY=")),
        "a shell command of the agent sees the model key's variable"
    );
}
