//! The `pi` provider driven end to end: agentry's REST/SSE API, the real Pi CLI (the
//! pinned install) over `--mode rpc`, offline, with a custom model provider (its agent
//! dir's `models.json`) pointed at a fake Chat Completions server on 127.0.0.1 that
//! scripts the model. The provider is configured through settings exactly as a user
//! would configure it; approvals go through agentry's gate extension.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/http.rs"]
mod http;

#[path = "support/scenarios.rs"]
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
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, cli_settings, last_message, new_agent};
use fake_chat::{FakeChat, MODEL, Reply, conversation_text};
use helpers::*;
use serde_json::json;

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
    let w = World::new().await;
    let pi = w.app.provider("pi").await;
    assert_eq!(pi["available"], true, "{pi}");
    assert_eq!(pi["protocol"], "pi-rpc");
    assert_eq!(pi["default_mode"], "ask");
    let modes: Vec<(&str, bool)> = pi["modes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["unattended"] == true))
        .collect();
    assert_eq!(modes, [("ask", false), ("full-access", true)]);
    // The modes say they are agentry's, not Pi's.
    assert!(
        pi["modes"][0]["description"]
            .as_str()
            .unwrap()
            .contains("Pi itself never asks"),
        "{pi}"
    );
    let models = w.app.get_ok("/v1/providers/pi/models").await;
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

    let (agent, _) = w.agent("ask").await;
    w.fake.push(Reply::slow(
        "Hello from the fake model, in pieces.",
        4,
        Duration::from_millis(20),
    ));
    let events = w.turn(&agent, "say hello", None).await;
    let k = kinds(&events);
    let deltas: String = of_kind(&events, "assistant_delta")
        .iter()
        .map(|d| d["text"].as_str().unwrap())
        .collect();
    assert!(of_kind(&events, "assistant_delta").len() >= 2, "{k:?}");
    assert_eq!(deltas, "Hello from the fake model, in pieces.");
    assert_eq!(last_message(&events), deltas);
    assert_eq!(of_kind(&events, "user_message").len(), 1, "{k:?}");
    let usage = of_kind(&events, "usage");
    assert!(!usage.is_empty(), "{k:?}");
    assert_eq!(usage[0]["context_window_max"], 128000, "{}", usage[0]);
    let done = outcome(&events);
    assert_eq!(done["outcome"], "completed", "{done}");
    assert_eq!(done["usage"]["input_tokens"], 30, "{done}");
    assert_eq!(done["usage"]["output_tokens"], 7, "{done}");
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], "ask", "{a}");
    assert_eq!(a["model"], pi_model(), "{a}");

    let request = w.fake.last_completion();
    assert_eq!(request.body["stream"], true);
    assert_eq!(request.body["model"], MODEL);
    assert_eq!(request.header("authorization"), Some("Bearer test-key"));
    assert!(conversation_text(&request.body).contains("say hello"));
    // Offline: the only requests the CLI made were to the model endpoint.
    for r in w.fake.requests() {
        assert!(r.line.contains("/v1/"), "{}", r.line);
    }
}

#[tokio::test]
async fn an_approved_write_lands_in_the_worktree_and_its_diff() {
    let w = World::new().await;
    let (agent, ws) = w.agent("ask").await;
    let path = path_of(&ws["path"]).join("hello.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"path": path, "content": "hello from pi\n"}),
    ));
    w.fake.push(Reply::text("The file is written."));

    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "write hello.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    assert_eq!(request["kind"], "tool", "{request}");
    let options: Vec<&str> = request["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect();
    assert_eq!(options, ["allow", "deny"], "{request}");
    assert_eq!(request["input"]["content"], "hello from pi\n", "{request}");
    let calls = of_kind(&before, "tool_call");
    let pending = calls.first().expect("the call is announced first");
    assert_eq!(pending["status"], "pending", "{pending}");
    assert_eq!(pending["tool_kind"], "write", "{pending}");
    assert_eq!(pending["diff"][0]["change"], "add", "{pending}");
    assert_eq!(pending["diff"][0]["new_text"], "hello from pi\n");
    assert_eq!(request["call_id"], pending["call_id"], "{request}");
    assert!(!path.exists(), "nothing is written before the answer");

    w.answer(&agent, &request, "allow").await;
    let after = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&after)["outcome"],
        "completed",
        "{:?}",
        kinds(&after)
    );
    let calls = of_kind(&after, "tool_call");
    let done = calls.last().expect("the call's end");
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["input"]["content"], "hello from pi\n", "{done}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "hello from pi\n");
    assert_eq!(last_message(&after), "The file is written.");

    let diff = w
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
            .any(|f| f["path"] == "hello.txt"),
        "{diff}"
    );
    assert!(diff["patch"].as_str().unwrap().contains("+hello from pi"));
    // The model was told of the result.
    let last = conversation_text(&w.fake.last_completion().body);
    assert!(last.contains("Successfully wrote"), "{last}");
}

#[tokio::test]
async fn a_denied_write_fails_the_tool_and_the_turn_completes() {
    let w = World::new().await;
    let (agent, ws) = w.agent("ask").await;
    let path = path_of(&ws["path"]).join("denied.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"path": path, "content": "no\n"}),
    ));
    w.fake.push(Reply::text("Understood."));
    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "make denied.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    w.answer(&agent, &request, "deny").await;
    let after = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&after)["outcome"],
        "completed",
        "{:?}",
        kinds(&after)
    );
    let calls = of_kind(&after, "tool_call");
    let failed = calls.last().expect("the call's end");
    assert_eq!(failed["status"], "failed", "{failed}");
    assert!(
        failed["error"]
            .as_str()
            .unwrap_or_default()
            .contains("denied"),
        "{failed}"
    );
    assert!(!path.exists());
    let resolved = of_kind(&after, "permission_resolved");
    assert_eq!(resolved[0]["behavior"], "deny", "{}", resolved[0]);
    // The model heard why.
    let last = conversation_text(&w.fake.last_completion().body);
    assert!(last.contains("The user denied this tool call."), "{last}");

    // The agent goes on: the next turn works.
    w.fake.push(Reply::text("Fine."));
    let next = w.turn(&agent, "never mind", Some(last_seq(&after))).await;
    assert_eq!(outcome(&next)["outcome"], "completed");
    assert_eq!(last_message(&next), "Fine.");
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
    let w = World::new().await;
    let (agent, ws) = w.agent("full-access").await;
    w.fake.push(Reply::text("Noted: mango."));
    let first = w.turn(&agent, "remember mango", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = w.pid(&agent).await;

    let w = w
        .restart(|data_dir| {
            assert!(!pid_alive(pid), "the server's stop ended the CLI");
            // The session file is kept under the data dir.
            let sessions = data_dir.join("providers/pi/sessions");
            let files: Vec<_> = std::fs::read_dir(&sessions)
                .unwrap()
                .flatten()
                .filter(|f| f.path().extension().is_some_and(|e| e == "jsonl"))
                .collect();
            assert_eq!(files.len(), 1, "one session file in {}", sessions.display());
        })
        .await;

    // Still unattended: a file is written without asking.
    let path = path_of(&ws["path"]).join("after.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"path": path, "content": "after\n"}),
    ));
    w.fake.push(Reply::text("You said mango."));
    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    w.app
        .prompt(&agent, "what fruit? and write after.txt")
        .await;
    let second = stream.until("turn_completed", LONG).await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let started = of_kind(&second, "session_started");
    assert_eq!(started.last().unwrap()["resumed"], true);
    assert!(of_kind(&second, "mode_changed").is_empty(), "{k:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "after\n");
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], "full-access", "{a}");
    let history = conversation_text(&w.fake.last_completion().body);
    assert!(history.contains("remember mango"), "{history}");
    assert!(history.contains("Noted: mango."), "{history}");
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
    let (agent, ws) = w.agent("ask").await;
    w.fake.push(Reply::text("Ready."));
    let first = w.turn(&agent, "get ready", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = w.pid(&agent).await;

    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/mode"),
            json!({"mode": "full-access"}),
        )
        .await;
    assert_eq!(changed["mode"], "full-access", "{changed}");
    let path = path_of(&ws["path"]).join("switched.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"path": path, "content": "switched\n"}),
    ));
    w.fake.push(Reply::text("Wrote it."));
    w.app.prompt(&agent, "write switched.txt").await;
    let events = stream.until("turn_completed", LONG).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let modes = of_kind(&events, "mode_changed");
    assert_eq!(modes.len(), 1, "{k:?}");
    assert_eq!(modes[0]["mode"], "full-access");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "switched\n");
    assert_eq!(w.pid(&agent).await, pid, "the same process, not a restart");

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
    const ASKING_MODE: &'static str = "ask";

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
