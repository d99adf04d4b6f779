//! The `opencode` provider driven end to end: agentry's REST/SSE API, the real OpenCode
//! (the pinned install) as `opencode serve`, offline, with a custom provider pointed at a
//! fake Chat Completions server on 127.0.0.1 that scripts the model. The provider is
//! configured through settings exactly as a user would configure it.

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

#[path = "support/fake_chat.rs"]
#[allow(dead_code)]
mod fake_chat;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, cli_settings, last_message, new_agent};
use fake_chat::{FakeChat, MODEL, Reply, conversation_text};
use helpers::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(60);

/// `opencode serve` with a custom provider pointed at the fake Chat Completions server,
/// offline.
struct OpenCode;

type World = CliWorld<OpenCode>;

impl Provider for OpenCode {
    const ID: &'static str = "opencode";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = Some(2);
    type Fake = FakeChat;

    /// The `[providers.opencode]` table of a setup against the fake: a custom provider
    /// in `OPENCODE_CONFIG_CONTENT`, and a home of its own. The npm registry is
    /// unreachable, as on an offline machine: OpenCode's plugin install at start fails
    /// and must not matter.
    fn settings(cli: &Path, base_url: &str, home: &Path) -> ProviderSettings {
        let config = json!({
            "model": format!("fake/{MODEL}"),
            "small_model": format!("fake/{MODEL}"),
            "provider": {"fake": {
                "npm": "@ai-sdk/openai-compatible",
                "options": {"baseURL": base_url, "apiKey": "test-key"},
                "models": {
                    MODEL: {"name": "Fake", "tool_call": true,
                        "limit": {"context": 100000, "output": 4096}},
                    "fake-model-2": {"name": "Fake 2", "tool_call": true,
                        "limit": {"context": 100000, "output": 4096}},
                },
            }},
        });
        let dir = |d: &str| home.join(d).display().to_string();
        let env = BTreeMap::from([
            ("OPENCODE_CONFIG_CONTENT".to_owned(), config.to_string()),
            ("HOME".to_owned(), home.display().to_string()),
            ("XDG_CONFIG_HOME".to_owned(), dir(".config")),
            ("XDG_DATA_HOME".to_owned(), dir(".local/share")),
            ("XDG_STATE_HOME".to_owned(), dir(".local/state")),
            ("XDG_CACHE_HOME".to_owned(), dir(".cache")),
            (
                "npm_config_registry".to_owned(),
                "http://127.0.0.1:9/".to_owned(),
            ),
        ]);
        cli_settings(cli, env)
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
async fn a_denied_write_fails_the_tool_and_the_next_turn_works() {
    scenarios::a_denied_write_fails_its_call_and_the_agent_goes_on(&World::new().await).await;
}

impl scenarios::Rig for OpenCode {
    const PROTOCOL: &'static str = "opencode-http";
    const MODES: &'static [(&'static str, bool)] =
        &[("build", false), ("plan", false), ("full-access", true)];
    const ASKING_MODE: &'static str = "build";
    const UNATTENDED_MODE: &'static str = "full-access";
    const REPLY_TOKENS: u64 = 7;
    const DENIAL_SAYS: Option<&'static str> = Some("rejected");

    fn reply_in_pieces(fake: &FakeChat, text: &str) {
        fake.push(Reply::slow(text, 4, Duration::from_millis(20)));
    }
    fn reply_slowly(fake: &FakeChat) {
        fake.push(Reply::slow(
            "This answer takes a long while to arrive, word by word, far too long.",
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
            json!({"filePath": path, "content": content}),
        ));
    }
    fn last_conversation(fake: &FakeChat) -> String {
        conversation_text(&fake.last_completion().body)
    }

    /// The catalog comes from a server started for the probe (gone after it).
    fn check_models(models: &Value) {
        let fake = models["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == format!("fake/{MODEL}"))
            .unwrap_or_else(|| panic!("the configured model is listed: {models}"));
        assert_eq!(fake["is_default"], true, "{models}");
        assert_eq!(fake["context_window"], 100000, "{models}");
    }
    /// One model call for the turn (no title generation), with the prompt, to the fake,
    /// offering the tools that write and none that waits on a route agentry does not
    /// serve.
    fn check_text_turn(w: &World, agent: &str, events: &[SseEvent]) -> impl Future<Output = ()> {
        assert_eq!(outcome(events)["usage"]["input_tokens"], 30);
        let calls = w.fake.completions();
        assert_eq!(
            calls.len(),
            1,
            "{:?}",
            calls.iter().map(|c| &c.line).collect::<Vec<_>>()
        );
        w.fake.assert_streamed_offline();
        let tools: Vec<&str> = calls[0].body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert!(
            tools.contains(&"write") && tools.contains(&"bash"),
            "{tools:?}"
        );
        assert!(!tools.contains(&"question"), "{tools:?}");
        async move {
            let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
            assert!(
                a["runtime"]["provider_session_id"]
                    .as_str()
                    .unwrap()
                    .starts_with("ses"),
                "{a}"
            );
        }
    }
    fn check_write_request(before: &[SseEvent], request: &Value) {
        assert_eq!(request["title"], "Edit hello.txt", "{request}");
        let options = scenarios::option_ids(request);
        assert_eq!(options, ["allow", "allow_always", "deny"], "{request}");
        let pending = of_kind(before, "tool_call");
        let last = pending.last().unwrap();
        assert_eq!(last["tool_kind"], "write", "{last}");
        assert_eq!(
            last["diff"][0]["new_text"], "hello from opencode\n",
            "{last}"
        );
    }
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
async fn a_failed_mcp_server_and_a_lost_session_are_reported_and_the_agent_works() {
    let w = World::new_with(|s| {
        // Stdio MCP servers are the server's own commands, defined in its settings.
        s.mcp.servers.insert(
            "files".into(),
            agentry::config::McpServerSetting {
                command: "/nonexistent/mcp-files".into(),
                args: vec!["--root".into(), ".".into()],
                env: Default::default(),
                teams: None,
            },
        );
    })
    .await;
    let (agent, _) = new_agent(
        &w.app,
        w.repo.path(),
        json!({"provider": "opencode",
            "mcp_servers": {"files": {"server": "files"}}}),
    )
    .await;
    w.fake.push(Reply::text("Working without it."));
    let first = w.turn(&agent, "hello", None).await;
    assert_eq!(
        outcome(&first)["outcome"],
        "completed",
        "{:?}",
        kinds(&first)
    );
    let errors = of_kind(&first, "error");
    assert!(
        errors.iter().any(|e| e["code"] == "mcp_server_failed"
            && e["message"].as_str().unwrap().contains("`files`")),
        "{errors:?}"
    );
    let id = w.app.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["provider_session_id"]
        .clone();

    // OpenCode's store is wiped while the agent is closed: the next prompt starts a new
    // session and says so.
    w.app
        .post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    eventually(
        "no process of this test's OpenCode home",
        Duration::from_secs(10),
        || w.processes_of_this_test().is_empty(),
    )
    .await;
    std::fs::remove_dir_all(w.home.path().join(".local/share/opencode")).unwrap();
    w.fake.push(Reply::text("Fresh start."));
    let second = w.turn(&agent, "again", Some(last_seq(&first))).await;
    assert_eq!(
        outcome(&second)["outcome"],
        "completed",
        "{:?}",
        kinds(&second)
    );
    let started = of_kind(&second, "session_started");
    assert_eq!(started[0]["resumed"], false, "{}", started[0]);
    assert_ne!(started[0]["provider_session_id"], id);
    assert!(
        of_kind(&second, "error")
            .iter()
            .any(|e| e["code"] == "resume_failed"),
        "{:?}",
        kinds(&second)
    );
    assert_eq!(last_message(&second), "Fresh start.");
}

#[tokio::test]
async fn plan_mode_edits_nothing_and_a_model_change_applies_to_the_next_prompt() {
    let w = World::new().await;
    let (agent, ws) = w.agent("plan").await;
    let path = path_of(&ws["path"]).join("planned.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"filePath": path, "content": "no\n"}),
    ));
    w.fake.push(Reply::text("I only plan."));
    let events = w.turn(&agent, "write planned.txt", None).await;
    let k = kinds(&events);
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    assert!(!path.exists());
    // The plan agent is not offered the tools that edit.
    let first = &w.fake.completions()[0];
    let tools: Vec<&str> = first.body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert!(tools.contains(&"read"), "{tools:?}");
    assert!(
        !tools.contains(&"write") && !tools.contains(&"edit"),
        "{tools:?}"
    );
    assert_eq!(first.body["model"], MODEL);

    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/model"),
            json!({"model": "fake/fake-model-2"}),
        )
        .await;
    assert_eq!(changed["model"], "fake/fake-model-2", "{changed}");
    w.fake.push(Reply::text("Now the other model."));
    let next = w.turn(&agent, "and now?", Some(last_seq(&events))).await;
    assert_eq!(outcome(&next)["outcome"], "completed", "{:?}", kinds(&next));
    assert_eq!(w.fake.last_completion().body["model"], "fake-model-2");
}

#[tokio::test]
async fn full_access_writes_without_asking_and_a_live_switch_to_build_asks_again() {
    let w = World::new().await;
    let (agent, ws, events) = scenarios::the_unattended_mode_writes_without_asking(&w).await;

    // Switched in the live session, the next write asks.
    let mut stream = w.app.events(&agent, Some(last_seq(&events))).await;
    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/mode"),
            json!({"mode": "build"}),
        )
        .await;
    assert_eq!(changed["mode"], "build", "{changed}");
    let asked = path_of(&ws["path"]).join("asked.txt");
    w.fake.push(Reply::tool(
        "write",
        json!({"filePath": asked, "content": "asked\n"}),
    ));
    w.fake.push(Reply::text("Wrote it after asking."));
    w.app.prompt(&agent, "write asked.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    w.answer(&agent, &request, "allow").await;
    let after = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&after)["outcome"],
        "completed",
        "{:?}",
        kinds(&after)
    );
    assert_eq!(std::fs::read_to_string(&asked).unwrap(), "asked\n");
}

#[tokio::test]
async fn a_killed_server_fails_the_turn_quickly_and_the_agent_recovers() {
    let w = World::new().await;
    scenarios::a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers(&w).await;
}

#[tokio::test]
async fn no_server_process_is_left_after_archive_or_server_shutdown() {
    scenarios::no_cli_process_is_left_after_archive_or_server_shutdown(World::new().await).await;
}

#[tokio::test]
async fn not_installed_is_unavailable_and_creation_is_refused() {
    let app = spawn_app_with(|s| {
        s.providers.insert(
            "opencode".into(),
            ProviderSettings {
                command: Some(vec!["/nonexistent/opencode".into()]),
                ..Default::default()
            },
        );
    })
    .await;
    let opencode = app.provider("opencode").await;
    assert_eq!(opencode["available"], false, "{opencode}");
    assert!(
        opencode["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/opencode"),
        "{opencode}"
    );
    let repo = git_repo();
    app.creation_refused(repo.path(), "opencode").await;
}
