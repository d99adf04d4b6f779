//! The `copilot` provider driven end to end: agentry's REST/SSE API, the real GitHub
//! Copilot CLI (the pinned install) over ACP, offline, with its BYOK provider pointed at a
//! fake Chat Completions server on 127.0.0.1 that scripts the model. The provider is
//! configured through settings exactly as a user would configure it.

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
use std::path::Path;
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, cli_settings, last_message};
use fake_chat::{FakeChat, MODEL, Reply, conversation_text};
use helpers::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(40);

/// Copilot in BYOK mode against the fake Chat Completions server, offline.
struct Copilot;

type World = CliWorld<Copilot>;

impl Provider for Copilot {
    const ID: &'static str = "copilot";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = Some(3);
    type Fake = FakeChat;

    /// The `[providers.copilot]` table of a BYOK setup against the fake, offline.
    fn settings(cli: &Path, base_url: &str, home: &Path) -> ProviderSettings {
        let env = BTreeMap::from([
            ("COPILOT_OFFLINE".to_owned(), "true".to_owned()),
            ("COPILOT_PROVIDER_BASE_URL".to_owned(), base_url.to_owned()),
            ("COPILOT_PROVIDER_TYPE".to_owned(), "openai".to_owned()),
            ("COPILOT_PROVIDER_API_KEY".to_owned(), "test-key".to_owned()),
            ("COPILOT_MODEL".to_owned(), MODEL.to_owned()),
            (
                "COPILOT_HOME".to_owned(),
                home.join(".copilot").display().to_string(),
            ),
            ("HOME".to_owned(), home.display().to_string()),
        ]);
        cli_settings(cli, env)
    }
    fn marker(home: &Path) -> String {
        format!("COPILOT_HOME={}", home.join(".copilot").display())
    }
}

#[tokio::test]
async fn a_text_turn_streams_deltas_and_completes_with_usage() {
    let w = World::new().await;
    let copilot = w.app.provider("copilot").await;
    assert_eq!(copilot["available"], true, "{copilot}");
    assert_eq!(copilot["protocol"], "acp");
    assert_eq!(copilot["default_mode"], "agent");
    let modes: Vec<(&str, bool)> = copilot["modes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["unattended"] == true))
        .collect();
    assert_eq!(
        modes,
        [
            ("agent", false),
            ("plan", false),
            ("allow-all", true),
            ("autopilot", true)
        ]
    );
    let models = w.app.get_ok("/v1/providers/copilot/models").await;
    assert_eq!(models["items"][0]["id"], MODEL, "{models}");

    let (agent, _) = w.agent("agent").await;
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
    // Copilot reports the context window as it goes and the tokens with its answer.
    let usage = of_kind(&events, "usage");
    assert!(!usage.is_empty(), "{k:?}");
    assert_eq!(usage[0]["context_window_max"], 128000, "{}", usage[0]);
    let done = outcome(&events);
    assert_eq!(done["outcome"], "completed", "{done}");
    assert_eq!(done["usage"]["input_tokens"], 30, "{done}");
    assert_eq!(done["usage"]["output_tokens"], 7, "{done}");
    // The mode the agent reports is agentry's, not Copilot's URL.
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], "agent", "{a}");

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
async fn an_approved_create_lands_in_the_worktree_and_its_diff() {
    let w = World::new().await;
    let (agent, ws) = w.agent("agent").await;
    let path = path_of(&ws["path"]).join("hello.txt");
    w.fake.push(Reply::tool(
        "create",
        json!({"path": path, "file_text": "hello from copilot\n"}),
    ));
    w.fake.push(Reply::text("The file is written."));

    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "write hello.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    assert_eq!(request["kind"], "tool");
    let options: Vec<&str> = request["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect();
    // agentry's own option ids, chosen by kind; Copilot's stay inside the adapter.
    assert_eq!(options, ["allow", "allow_always", "deny"], "{request}");
    let pending = of_kind(&before, "tool_call");
    assert_eq!(pending[0]["tool_kind"], "edit", "{}", pending[0]);
    assert_eq!(pending[0]["diff"][0]["new_text"], "hello from copilot\n");
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
    // The call keeps the tool's own arguments; the request's view of it (with the diff)
    // is what the permission request carried.
    assert_eq!(done["input"]["file_text"], "hello from copilot\n", "{done}");
    assert!(request["input"]["diff"].is_string(), "{request}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "hello from copilot\n"
    );
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
    assert!(
        diff["patch"]
            .as_str()
            .unwrap()
            .contains("+hello from copilot")
    );
    // The model was told of the result.
    let last = conversation_text(&w.fake.last_completion().body);
    assert!(last.contains("Created file"), "{last}");
}

#[tokio::test]
async fn a_denied_create_fails_the_tool_and_the_turn_completes() {
    let w = World::new().await;
    let (agent, ws) = w.agent("agent").await;
    let path = path_of(&ws["path"]).join("denied.txt");
    w.fake.push(Reply::tool(
        "create",
        json!({"path": path, "file_text": "no\n"}),
    ));
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
            .contains("rejected"),
        "{failed}"
    );
    assert!(!path.exists());
    let resolved = of_kind(&after, "permission_resolved");
    assert_eq!(resolved[0]["behavior"], "deny", "{}", resolved[0]);

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
    let (agent, ws) = w.agent("allow-all").await;
    w.fake.push(Reply::text("Noted: mango."));
    let first = w.turn(&agent, "remember mango", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = w.pid(&agent).await;

    let w = w
        .restart(|_| assert!(!pid_alive(pid), "the server's stop ended the CLI"))
        .await;

    // Still unattended: a file is created without asking.
    let path = path_of(&ws["path"]).join("after.txt");
    w.fake.push(Reply::tool(
        "create",
        json!({"path": path, "file_text": "after\n"}),
    ));
    w.fake.push(Reply::text("You said mango."));
    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    w.app
        .prompt(&agent, "what fruit? and write after.txt")
        .await;
    let second = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&second)["outcome"],
        "completed",
        "{:?}",
        kinds(&second)
    );
    let started = of_kind(&second, "session_started");
    assert_eq!(started.last().unwrap()["resumed"], true);
    // The reopened session is put back in the agent's mode, not reported as another one.
    assert!(
        of_kind(&second, "mode_changed").is_empty(),
        "{:?}",
        kinds(&second)
    );
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], "allow-all", "{a}");
    let history = conversation_text(&w.fake.last_completion().body);
    assert!(history.contains("remember mango"), "{history}");
    assert!(history.contains("Noted: mango."), "{history}");
}

#[tokio::test]
async fn allow_all_creates_files_without_asking() {
    let w = World::new().await;
    let (agent, ws) = w.agent("allow-all").await;
    let path = path_of(&ws["path"]).join("unattended.txt");
    w.fake.push(Reply::tool(
        "create",
        json!({"path": path, "file_text": "unattended\n"}),
    ));
    w.fake.push(Reply::text("Done without asking."));
    let events = w.turn(&agent, "write unattended.txt", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let calls = of_kind(&events, "tool_call");
    assert_eq!(calls.last().unwrap()["status"], "completed");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "unattended\n");
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], "allow-all", "{a}");
}

#[tokio::test]
async fn switching_to_allow_all_in_a_live_session_stops_the_asking() {
    let w = World::new().await;
    let (agent, ws) = w.agent("agent").await;
    w.fake.push(Reply::text("Ready."));
    let first = w.turn(&agent, "get ready", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");

    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/mode"),
            json!({"mode": "allow-all"}),
        )
        .await;
    assert_eq!(changed["mode"], "allow-all", "{changed}");
    let path = path_of(&ws["path"]).join("switched.txt");
    w.fake.push(Reply::tool(
        "create",
        json!({"path": path, "file_text": "switched\n"}),
    ));
    w.fake.push(Reply::text("Wrote it."));
    w.app.prompt(&agent, "write switched.txt").await;
    let events = stream.until("turn_completed", LONG).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let modes: Vec<&Value> = of_kind(&events, "mode_changed");
    assert_eq!(modes.len(), 1, "{k:?}");
    assert_eq!(modes[0]["mode"], "allow-all");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "switched\n");
}

#[tokio::test]
async fn without_credentials_copilot_is_unavailable_and_creation_is_refused() {
    let cli = clis::cli("copilot");
    let home = tempfile::tempdir().unwrap();
    let h = home.path().to_path_buf();
    let app = spawn_app_with(move |s| {
        // Empty values count as unset, whatever the server's own environment holds.
        let env = [
            "COPILOT_GITHUB_TOKEN",
            "GH_TOKEN",
            "GITHUB_TOKEN",
            "COPILOT_PROVIDER_BASE_URL",
        ]
        .into_iter()
        .map(|v| (v.to_owned(), String::new()))
        .chain([("HOME".to_owned(), h.display().to_string())])
        .collect();
        s.providers
            .insert("copilot".into(), cli_settings(&cli, env));
    })
    .await;
    let copilot = app.provider("copilot").await;
    assert_eq!(copilot["available"], false, "{copilot}");
    let reason = copilot["unavailable_reason"].as_str().unwrap();
    for looked_for in [
        "COPILOT_GITHUB_TOKEN",
        "GH_TOKEN",
        "GITHUB_TOKEN",
        "COPILOT_PROVIDER_BASE_URL",
    ] {
        assert!(reason.contains(looked_for), "{reason}");
    }

    let repo = git_repo();
    let refused = app.creation_refused(repo.path(), "copilot").await;
    assert!(refused.to_string().contains("GH_TOKEN"), "{refused}");

    // A GitHub token alone makes it available (it is not used: nothing is started).
    let cli = clis::cli("copilot");
    let app2 = spawn_app_with(move |s| {
        let env = BTreeMap::from([
            ("GH_TOKEN".to_owned(), "github_pat_placeholder".to_owned()),
            ("COPILOT_PROVIDER_BASE_URL".to_owned(), String::new()),
        ]);
        s.providers
            .insert("copilot".into(), cli_settings(&cli, env));
    })
    .await;
    let copilot = app2.provider("copilot").await;
    assert_eq!(copilot["available"], true, "{copilot}");

    // A command that is not installed is named.
    let app3 = spawn_app_with(|s| {
        s.providers.insert(
            "copilot".into(),
            ProviderSettings {
                command: Some(vec!["/nonexistent/copilot-cli".into()]),
                env: BTreeMap::from([("GH_TOKEN".to_owned(), "x".to_owned())]),
                ..Default::default()
            },
        );
    })
    .await;
    let copilot = app3.provider("copilot").await;
    assert_eq!(copilot["available"], false);
    assert!(
        copilot["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/copilot-cli"),
        "{copilot}"
    );
}

impl scenarios::Rig for Copilot {
    const ASKING_MODE: &'static str = "agent";

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
            "create",
            json!({"path": path, "file_text": content}),
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
