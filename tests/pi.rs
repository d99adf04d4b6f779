//! The `pi` provider driven end to end: agentry's REST/SSE API, the real Pi CLI (the
//! pinned install) over `--mode rpc`, offline, with a custom model provider (its agent
//! dir's `models.json`) pointed at a fake Chat Completions server on 127.0.0.1 that
//! scripts the model. The provider is configured through settings exactly as a user
//! would configure it; approvals go through agentry's gate extension.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/http.rs"]
#[allow(dead_code)]
mod http;

#[path = "support/scenarios.rs"]
#[allow(dead_code)]
mod scenarios;

#[path = "support/clis.rs"]
mod clis;

#[path = "support/cli_world.rs"]
#[allow(dead_code)]
mod cli_world;

#[path = "support/fake_chat.rs"]
#[allow(dead_code)]
mod fake_chat;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, cli_settings, last_message, new_agent};
use fake_chat::{FakeChat, MODEL, Reply, conversation_text};
use helpers::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(40);

/// A second model of the fake provider.
const OTHER_MODEL: &str = "fake-model-2";

/// The fake model as Pi names it: `<provider>/<id>`.
fn pi_model() -> String {
    format!("fake/{MODEL}")
}

/// Pi's agent dir with a `fake` provider at `base_url` as its default model.
fn agent_dir(home: &Path, base_url: &str) -> PathBuf {
    let dir = home.join("agent");
    std::fs::create_dir_all(&dir).unwrap();
    let models = json!({"providers": {"fake": {
        "baseUrl": base_url, "api": "openai-completions", "apiKey": "test-key",
        "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
        "models": [{"id": MODEL}, {"id": OTHER_MODEL, "name": "Other fake", "contextWindow": 64000}]}}});
    std::fs::write(dir.join("models.json"), models.to_string()).unwrap();
    let settings = json!({"defaultProvider": "fake", "defaultModel": MODEL});
    std::fs::write(dir.join("settings.json"), settings.to_string()).unwrap();
    dir
}

/// Pi with a custom model provider pointed at the fake Chat Completions server, offline.
struct Pi;

type World = CliWorld<Pi>;

impl Provider for Pi {
    const ID: &'static str = "pi";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = Some(3);
    type Fake = FakeChat;

    /// The `[providers.pi]` table: the pinned CLI, its agent dir, a home of its own.
    fn settings(cli: &Path, base_url: &str, home: &Path) -> ProviderSettings {
        let dir = agent_dir(home, base_url);
        let env = BTreeMap::from([
            ("PI_CODING_AGENT_DIR".to_owned(), dir.display().to_string()),
            ("HOME".to_owned(), home.display().to_string()),
        ]);
        cli_settings(cli, env)
    }
    fn marker(home: &Path) -> String {
        format!("PI_CODING_AGENT_DIR={}", home.join("agent").display())
    }
}

#[tokio::test]
async fn a_text_turn_streams_deltas_and_completes_with_usage() {
    scenarios::a_text_turn_streams_deltas_and_completes_with_usage(&World::new().await).await;
}

#[tokio::test]
async fn an_approved_write_lands_in_the_worktree_and_its_diff() {
    scenarios::an_approved_write_lands_in_the_worktree_and_its_diff(&World::new().await).await;
}

#[tokio::test]
async fn a_denied_write_fails_the_tool_and_the_turn_completes() {
    scenarios::a_denied_write_fails_its_call_and_the_agent_goes_on(&World::new().await).await;
}

#[tokio::test]
async fn an_interrupted_turn_is_canceled_and_the_next_prompt_works() {
    let w = World::new().await;
    scenarios::an_interrupted_turn_is_canceled_and_the_next_prompt_works(&w).await;
}

#[tokio::test]
async fn an_interrupt_while_a_permission_is_pending_cancels_the_turn() {
    let w = World::new().await;
    scenarios::an_interrupt_while_a_permission_is_pending_cancels_the_turn(&w).await;
}

#[tokio::test]
async fn a_closed_agent_resumes_its_conversation() {
    let w = World::new().await;
    scenarios::a_closed_agent_resumes_its_conversation(&w).await;
}

#[tokio::test]
async fn after_a_server_restart_the_agent_resumes_in_its_mode() {
    scenarios::after_a_server_restart_the_agent_resumes_in_its_mode(World::new().await).await;
}

#[tokio::test]
async fn full_access_writes_files_and_runs_commands_without_asking() {
    let w = World::new().await;
    let (agent, ws) = w.agent("full-access").await;
    let path = path_of(&ws["path"]).join("unattended.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"path": path, "content": "unattended\n"}),
    ));
    w.fake.push(Reply::tool(
        "bash",
        json!({"command": "echo ran > ran.txt"}),
    ));
    w.fake.push(Reply::text("Done without asking."));
    let events = w.turn(&agent, "write unattended.txt", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let calls = of_kind(&events, "tool_call");
    let ends: Vec<(&str, &str)> = calls
        .iter()
        .filter(|c| c["status"] != "pending" && c["status"] != "running")
        .map(|c| {
            (
                c["tool_kind"].as_str().unwrap(),
                c["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(ends, [("write", "completed"), ("shell", "completed")]);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "unattended\n");
    assert_eq!(
        std::fs::read_to_string(path_of(&ws["path"]).join("ran.txt")).unwrap(),
        "ran\n"
    );
}

#[tokio::test]
async fn switching_modes_in_a_live_session_turns_the_gate_off_and_on() {
    let w = World::new().await;
    let (agent, ws, events) =
        scenarios::a_live_switch_to_the_unattended_mode_stops_the_asking(&w).await;

    // And back: the gate asks again.
    w.app
        .put_ok(&format!("/v1/agents/{agent}/mode"), json!({"mode": "ask"}))
        .await;
    w.fake
        .push(Reply::tool("bash", json!({"command": "echo no > no.txt"})));
    w.fake.push(Reply::text("Asked."));
    let mut stream = w.app.events(&agent, Some(last_seq(&events))).await;
    w.app.prompt(&agent, "run a command").await;
    let asked = stream.until("permission_requested", LONG).await;
    let request = of_kind(&asked, "permission_requested")[0].clone();
    assert_eq!(request["input"]["command"], "echo no > no.txt", "{request}");
    w.answer(&agent, &request, "deny").await;
    let done = stream.until("turn_completed", LONG).await;
    assert_eq!(outcome(&done)["outcome"], "completed");
    assert!(!path_of(&ws["path"]).join("no.txt").exists());
}

#[tokio::test]
async fn a_missing_cli_is_unavailable_and_creation_is_refused() {
    let app = spawn_app_with(|s| {
        s.providers.insert(
            "pi".into(),
            ProviderSettings {
                command: Some(vec!["/nonexistent/pi-cli".into()]),
                ..Default::default()
            },
        );
    })
    .await;
    let pi = app.provider("pi").await;
    assert_eq!(pi["available"], false, "{pi}");
    assert!(
        pi["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/pi-cli"),
        "{pi}"
    );
    let repo = git_repo();
    let refused = app.creation_refused(repo.path(), "pi").await;
    assert!(
        refused.to_string().contains("/nonexistent/pi-cli"),
        "{refused}"
    );
}

#[tokio::test]
async fn a_pi_fork_configured_with_extends_runs_its_own_command() {
    // `omp` stands for any Pi fork that speaks the same RPC: here it is Pi itself under
    // another id, with its own command, label and agent dir.
    let w = World::new().await;
    let (url, h) = (w.fake.base_url(), w.home.path().join("fork"));
    let dir = agent_dir(&h, &url);
    let cli = w.cli.clone();
    let app = spawn_app_with(move |s| {
        s.providers.insert(
            "omp".into(),
            ProviderSettings {
                extends: Some("pi".into()),
                command: Some(vec![cli.display().to_string()]),
                label: Some("Oh My Pi".into()),
                env: BTreeMap::from([(
                    "PI_CODING_AGENT_DIR".to_owned(),
                    dir.display().to_string(),
                )]),
                ..Default::default()
            },
        );
    })
    .await;
    let omp = app.provider("omp").await;
    assert_eq!(omp["protocol"], "pi-rpc", "{omp}");
    assert_eq!(omp["label"], "Oh My Pi", "{omp}");
    assert_eq!(omp["available"], true, "{omp}");

    let (agent, _) = new_agent(&app, w.repo.path(), json!({"provider": "omp"})).await;
    w.fake.push(Reply::text("Forked hello."));
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "hello fork").await;
    let events = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert_eq!(last_message(&events), "Forked hello.");
}

#[tokio::test]
async fn the_model_is_chosen_at_creation_and_changed_in_a_live_session() {
    let w = World::new_with(|s| {
        // Stdio MCP servers are the server's own commands, defined in its settings.
        s.mcp.servers.insert(
            "files".into(),
            agentry::config::McpServerSetting {
                command: "mcp-files".into(),
                args: vec![],
                env: Default::default(),
                teams: None,
            },
        );
    })
    .await;
    let other = format!("fake/{OTHER_MODEL}");
    let (agent, _) = new_agent(
        &w.app,
        w.repo.path(),
        json!({"provider": "pi", "model": other,
            "system_prompt": "Always answer in haiku.",
            "mcp_servers": {"files": {"server": "files"}}}),
    )
    .await;
    let agent = agent.as_str();
    w.fake.push(Reply::text("From the other model."));
    let first = w.turn(agent, "which model?", None).await;
    assert_eq!(
        outcome(&first)["outcome"],
        "completed",
        "{:?}",
        kinds(&first)
    );
    let request = w.fake.last_completion();
    assert_eq!(request.body["model"], OTHER_MODEL);
    let system = fake_chat::messages_of(&request.body, "system").join("\n");
    assert!(system.contains("Always answer in haiku."), "{system}");
    assert_eq!(of_kind(&first, "usage")[0]["context_window_max"], 64000);
    // Pi has no MCP: the agent says so instead of silently dropping the servers.
    let errors = of_kind(&first, "error");
    assert!(
        errors.iter().any(|e| e["code"] == "mcp_unsupported"),
        "{:?}",
        kinds(&first)
    );

    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/model"),
            json!({"model": pi_model()}),
        )
        .await;
    assert_eq!(changed["model"], pi_model(), "{changed}");
    w.fake.push(Reply::text("From the first model."));
    let second = w.turn(agent, "and now?", Some(last_seq(&first))).await;
    assert_eq!(outcome(&second)["outcome"], "completed");
    assert_eq!(w.fake.last_completion().body["model"], MODEL);
    assert_eq!(of_kind(&second, "usage")[0]["context_window_max"], 128000);
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["model"], pi_model(), "{a}");
}

#[tokio::test]
async fn an_unreadable_session_file_starts_afresh_and_says_so() {
    let w = World::new().await;
    let (agent, _) = w.agent("ask").await;
    w.fake.push(Reply::text("Noted."));
    let first = w.turn(&agent, "remember kiwi", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    w.app
        .post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    let sessions = w.app.data_dir.path().join("providers/pi/sessions");
    let file = std::fs::read_dir(&sessions)
        .unwrap()
        .flatten()
        .map(|f| f.path())
        .find(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .expect("the agent's session file");
    std::fs::write(&file, "not a session\n").unwrap();

    w.fake.push(Reply::text("A fresh start."));
    let second = w.turn(&agent, "what fruit?", Some(last_seq(&first))).await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    assert_eq!(of_kind(&second, "session_started")[0]["resumed"], false);
    let errors = of_kind(&second, "error");
    assert!(errors.iter().any(|e| e["code"] == "resume_failed"), "{k:?}");
    let history = conversation_text(&w.fake.last_completion().body);
    assert!(!history.contains("remember kiwi"), "{history}");
}

impl scenarios::Rig for Pi {
    const PROTOCOL: &'static str = "pi-rpc";
    const MODES: &'static [(&'static str, bool)] = &[("ask", false), ("full-access", true)];
    const ASKING_MODE: &'static str = "ask";
    const UNATTENDED_MODE: &'static str = "full-access";
    const REPLY_TOKENS: u64 = 7;
    const DENIAL_SAYS: Option<&'static str> = Some("denied");

    fn reply_in_pieces(fake: &FakeChat, text: &str) {
        fake.push(Reply::slow(text, 4, Duration::from_millis(20)));
    }
    fn reply_slowly(fake: &FakeChat) {
        fake.push(Reply::slow(
            "A long answer that will be cut short midway.",
            40,
            Duration::from_millis(250),
        ));
    }
    fn reply_stalled(fake: &FakeChat) {
        fake.push(Reply::stalled("Still talking"));
    }
    fn reply_text(fake: &FakeChat, text: &str) {
        fake.push(Reply::text(text));
    }
    fn reply_write(fake: &FakeChat, path: &Path, content: &str) {
        fake.push(Reply::tool(
            "write",
            json!({"path": path, "content": content}),
        ));
    }
    fn last_conversation(fake: &FakeChat) -> String {
        conversation_text(&fake.last_completion().body)
    }

    fn check_models(models: &Value) {
        let listed: Vec<(&str, bool)> = models["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["id"].as_str().unwrap(), m["is_default"] == true))
            .collect();
        assert_eq!(
            listed,
            [
                (pi_model().as_str(), true),
                (format!("fake/{OTHER_MODEL}").as_str(), false)
            ],
            "{models}"
        );
    }
    /// The modes say they are agentry's, not Pi's; Pi reports the context window and the
    /// tokens; it asked the fake with its key, offline.
    fn check_text_turn(w: &World, agent: &str, events: &[SseEvent]) -> impl Future<Output = ()> {
        let usage = of_kind(events, "usage");
        assert!(!usage.is_empty(), "{:?}", kinds(events));
        assert_eq!(usage[0]["context_window_max"], 128000, "{}", usage[0]);
        assert_eq!(outcome(events)["usage"]["input_tokens"], 30);
        w.fake.assert_streamed_offline();
        async move {
            let pi = w.app.provider("pi").await;
            assert!(
                pi["modes"][0]["description"]
                    .as_str()
                    .unwrap()
                    .contains("Pi itself never asks"),
                "{pi}"
            );
            let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
            assert_eq!(a["model"], pi_model(), "{a}");
        }
    }
    /// The call is announced first, pending, with its diff.
    fn check_write_request(before: &[SseEvent], request: &Value) {
        let options = scenarios::option_ids(request);
        assert_eq!(options, ["allow", "deny"], "{request}");
        assert_eq!(request["input"]["content"], "hello from pi\n", "{request}");
        let calls = of_kind(before, "tool_call");
        let pending = calls.first().expect("the call is announced first");
        assert_eq!(pending["status"], "pending", "{pending}");
        assert_eq!(pending["tool_kind"], "write", "{pending}");
        assert_eq!(pending["diff"][0]["change"], "add", "{pending}");
        assert_eq!(pending["diff"][0]["new_text"], "hello from pi\n");
        assert_eq!(request["call_id"], pending["call_id"], "{request}");
    }
    /// The model was told of the result.
    fn check_written(w: &World, after: &[SseEvent], _request: &Value) {
        let calls = of_kind(after, "tool_call");
        let done = calls.last().unwrap();
        assert_eq!(done["input"]["content"], "hello from pi\n", "{done}");
        let last = conversation_text(&w.fake.last_completion().body);
        assert!(last.contains("Successfully wrote"), "{last}");
    }
    /// The model heard why.
    fn check_denied(w: &World) {
        let last = conversation_text(&w.fake.last_completion().body);
        assert!(last.contains("The user denied this tool call."), "{last}");
    }
    /// The session file is kept under the data dir.
    fn while_stopped(data_dir: &Path) {
        let sessions = data_dir.join("providers/pi/sessions");
        let files: Vec<_> = std::fs::read_dir(&sessions)
            .unwrap()
            .flatten()
            .filter(|f| f.path().extension().is_some_and(|e| e == "jsonl"))
            .collect();
        assert_eq!(files.len(), 1, "one session file in {}", sessions.display());
    }
}

#[tokio::test]
async fn a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers() {
    let w = World::new().await;
    scenarios::a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers(&w).await;
}

#[tokio::test]
async fn no_cli_process_is_left_after_archive_or_server_shutdown() {
    let w = World::new().await;
    scenarios::no_cli_process_is_left_after_archive_or_server_shutdown(w).await;
}
