//! The `gemini` provider driven end to end: agentry's REST/SSE API, the real Gemini CLI
//! (the pinned install, over ACP) and a fake Gemini API on 127.0.0.1 that scripts the
//! model. The provider is configured through settings exactly as a user would.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/scenarios.rs"]
#[allow(dead_code)]
mod scenarios;

#[path = "support/http.rs"]
mod http;

#[path = "support/clis.rs"]
mod clis;

#[path = "support/cli_world.rs"]
#[allow(dead_code)]
mod cli_world;

#[path = "support/fake_gemini.rs"]
#[allow(dead_code)]
mod fake_gemini;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, assistant_text, cli_settings};
use fake_gemini::{FakeGemini, REPLY_TOKENS, Reply, conversation_text, function_responses};
use helpers::*;
use serde_json::json;
use tempfile::TempDir;

const LONG: Duration = Duration::from_secs(60);
const MODEL: &str = "gemini-2.5-flash";

/// The Gemini CLI against the fake Gemini API.
struct Gemini;

type World = CliWorld<Gemini>;

impl Provider for Gemini {
    const ID: &'static str = "gemini";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = Some(3);
    const MODEL: Option<&'static str> = Some(MODEL);
    type Fake = FakeGemini;

    fn settings(cli: &Path, fake_url: &str, home: &Path) -> ProviderSettings {
        let env = BTreeMap::from([
            ("GOOGLE_GEMINI_BASE_URL".to_owned(), fake_url.to_owned()),
            ("GEMINI_API_KEY".to_owned(), "test-key".to_owned()),
            ("HOME".to_owned(), home.display().to_string()),
        ]);
        cli_settings(cli, env)
    }
    /// A quiet, isolated home: no usage statistics, no update checks.
    fn home() -> TempDir {
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join(".gemini");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("settings.json"),
            json!({"privacy": {"usageStatisticsEnabled": false},
                "general": {"enableAutoUpdate": false, "enableAutoUpdateNotification": false}})
            .to_string(),
        )
        .unwrap();
        home
    }
}

#[tokio::test]
async fn a_text_turn_streams_deltas_and_completes_with_usage() {
    let w = World::new().await;
    let gemini = w.app.provider("gemini").await;
    assert_eq!(gemini["available"], true, "{gemini}");
    assert_eq!(gemini["protocol"], "acp");
    assert_eq!(gemini["default_mode"], "default");
    let unattended: Vec<&str> = gemini["modes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["unattended"] == true)
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(unattended, ["yolo"]);

    let (agent, _) = w.agent("default").await;
    w.fake.push(Reply::slow(
        "Hello from the fake Gemini, in pieces.",
        4,
        Duration::from_millis(20),
    ));
    let events = w.turn(&agent, "say hello", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert_eq!(
        k.iter().filter(|k| **k == "user_message").count(),
        1,
        "{k:?}"
    );
    let deltas: String = of_kind(&events, "assistant_delta")
        .iter()
        .map(|d| d["text"].as_str().unwrap())
        .collect();
    assert!(of_kind(&events, "assistant_delta").len() >= 2, "{k:?}");
    assert_eq!(deltas, "Hello from the fake Gemini, in pieces.");
    assert_eq!(assistant_text(&events), deltas);
    let done = outcome(&events);
    assert_eq!(done["usage"]["output_tokens"], REPLY_TOKENS, "{done}");
    assert!(
        done["usage"]["input_tokens"].as_u64().unwrap() > 0,
        "{done}"
    );

    let request = w.fake.requests().pop().expect("the model was called");
    assert!(conversation_text(&request).contains("say hello"));
    assert!(
        w.fake.api_keys().iter().all(|k| k == "test-key"),
        "{:?}",
        w.fake.api_keys()
    );
    assert!(
        w.fake
            .request_lines()
            .iter()
            .any(|l| l.contains(&format!("/v1beta/models/{MODEL}:streamGenerateContent"))),
        "{:?}",
        w.fake.request_lines()
    );
}

#[tokio::test]
async fn an_allowed_write_lands_in_the_worktree_and_its_diff() {
    let w = World::new().await;
    let (agent, ws) = w.agent("default").await;
    let path = path_of(&ws["path"]).join("hello.txt");
    w.fake.push(Reply::tool(
        "write_file",
        json!({"file_path": path, "content": "hello from gemini\n"}),
    ));
    w.fake.push(Reply::text("The file is written."));

    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "write hello.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    assert_eq!(request["kind"], "tool");
    // agentry's option ids, not Gemini's (`proceed_once`, `cancel`, …).
    let options: Vec<(&str, &str)> = request["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o["id"].as_str().unwrap(), o["behavior"].as_str().unwrap()))
        .collect();
    assert!(options.contains(&("allow", "allow")), "{options:?}");
    assert!(options.contains(&("deny", "deny")), "{options:?}");
    assert!(!request.to_string().contains("proceed_once"), "{request}");
    // Gemini announces the call only inside the permission request: it is reported first.
    let calls = of_kind(&before, "tool_call");
    assert!(!calls.is_empty(), "{:?}", kinds(&before));
    assert_eq!(calls[0]["call_id"], request["call_id"], "{request}");
    assert!(!path.exists(), "nothing is written before the answer");

    w.answer_with(
        &agent,
        &request,
        json!({"behavior": "allow", "option_id": "allow"}),
    )
    .await;
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
    assert_eq!(done["call_id"], request["call_id"]);
    assert_eq!(done["tool_kind"], "write", "{done}");
    assert_eq!(done["diff"][0]["change"], "add", "{done}");
    assert_eq!(done["diff"][0]["new_text"], "hello from gemini\n", "{done}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "hello from gemini\n"
    );
    assert!(assistant_text(&after).ends_with("The file is written."));
    // The model heard that the write succeeded.
    let responses = function_responses(&w.fake.requests().pop().unwrap());
    assert_eq!(responses.len(), 1, "{responses:?}");
    assert_eq!(responses[0]["name"], "write_file");

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
            .contains("+hello from gemini")
    );
}

#[tokio::test]
async fn a_denied_write_fails_its_call_and_the_turn_completes() {
    let w = World::new().await;
    let (agent, ws) = w.agent("default").await;
    let path = path_of(&ws["path"]).join("denied.txt");
    w.fake.push(Reply::tool(
        "write_file",
        json!({"file_path": path, "content": "no\n"}),
    ));
    w.fake.push(Reply::text("Understood, I will not."));

    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "make denied.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    w.answer(&agent, &request, "deny").await;
    let after = stream.until("turn_completed", LONG).await;
    let k = kinds(&after);
    assert_eq!(outcome(&after)["outcome"], "completed", "{k:?}");
    let calls = of_kind(&after, "tool_call");
    let last = calls.last().unwrap_or_else(|| panic!("{k:?}"));
    assert_eq!(last["call_id"], request["call_id"]);
    assert_eq!(last["status"], "failed", "{last}");
    assert!(!path.exists());
}

#[tokio::test]
async fn an_interrupted_turn_is_canceled_and_the_next_prompt_works() {
    let w = World::new().await;
    scenarios::an_interrupted_turn_is_canceled_and_the_next_prompt_works(&w).await;
}

#[tokio::test]
async fn an_interrupt_while_a_permission_waits_expires_it() {
    let w = World::new().await;
    scenarios::an_interrupt_while_a_permission_is_pending_cancels_the_turn(&w).await;
}

#[tokio::test]
async fn yolo_runs_tools_without_asking() {
    let w = World::new().await;
    let (agent, ws) = w.agent("yolo").await;
    let path = path_of(&ws["path"]).join("yolo.txt");
    w.fake.push(Reply::tool(
        "write_file",
        json!({"file_path": path, "content": "unattended\n"}),
    ));
    w.fake.push(Reply::text("Done without asking."));
    let events = w.turn(&agent, "write yolo.txt", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let calls = of_kind(&events, "tool_call");
    assert_eq!(calls.last().unwrap()["status"], "completed", "{calls:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "unattended\n");
}

#[tokio::test]
async fn a_closed_agent_resumes_its_conversation() {
    let w = World::new().await;
    let (agent, _) = w.agent("default").await;
    w.fake.push(Reply::text("I will remember pineapple."));
    let first = w.turn(&agent, "the secret word is pineapple", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let id = w.session_id(&agent).await;
    let pid = w.pid(&agent).await;

    w.app
        .post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    eventually("the CLI to end", Duration::from_secs(5), || !pid_alive(pid)).await;
    // Reopened at once, within the minute the session was created in (see
    // `providers::gemini::resume_wait`): the history must survive that.
    w.fake.push(Reply::text("It was pineapple."));
    // The prompt is answered once its turn starts: after that wait (up to a minute) and
    // the CLI's start, longer than the harness client's 60 s (which bounds a stream too:
    // the stream is opened afterwards, from the first turn's last event).
    w.app
        .prompt_within(&agent, "what was the word?", Duration::from_secs(180))
        .await;
    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    let second = stream
        .until("turn_completed", Duration::from_secs(150))
        .await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    assert!(
        of_kind(&second, "error").is_empty(),
        "{:?}",
        of_kind(&second, "error")
    );
    let started = of_kind(&second, "session_started");
    assert_eq!(started.len(), 1);
    assert_eq!(started[0]["resumed"], true);
    assert_eq!(started[0]["provider_session_id"], id.as_str());
    // The history Gemini replays on load is not reported again.
    assert_eq!(of_kind(&second, "user_message").len(), 1, "{k:?}");
    assert_eq!(assistant_text(&second), "It was pineapple.");
    let last = w.fake.requests().pop().unwrap();
    let history = conversation_text(&last);
    assert!(
        history.contains("the secret word is pineapple"),
        "{history}"
    );
    assert!(history.contains("I will remember pineapple."), "{history}");
    assert!(history.contains("what was the word?"));
}

/// Gemini configured with no HOME of its own: each agent's CLI lives in the private home
/// the sandbox gives it (`<data_dir>/agent-homes/<agent>`), as in a default install.
struct GeminiOwnHome;

impl Provider for GeminiOwnHome {
    const ID: &'static str = "gemini";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = Some(3);
    const MODEL: Option<&'static str> = Some(MODEL);
    type Fake = FakeGemini;

    fn settings(cli: &Path, fake_url: &str, _home: &Path) -> ProviderSettings {
        let env = BTreeMap::from([
            ("GOOGLE_GEMINI_BASE_URL".to_owned(), fake_url.to_owned()),
            ("GEMINI_API_KEY".to_owned(), "test-key".to_owned()),
        ]);
        cli_settings(cli, env)
    }
}

/// A server restart ends the CLI; the agent's next prompt reopens the same Gemini session
/// and the model hears the whole conversation.
#[tokio::test]
async fn after_a_server_restart_the_agent_resumes_with_its_history() {
    let w = World::new().await;
    after_a_restart_the_history_is_heard(w).await;
}

/// The same, with the CLI in the agent's private home.
#[tokio::test]
async fn after_a_server_restart_an_agent_in_its_own_home_resumes_with_its_history() {
    let w = CliWorld::<GeminiOwnHome>::new().await;
    after_a_restart_the_history_is_heard(w).await;
}

async fn after_a_restart_the_history_is_heard<P: Provider<Fake = FakeGemini>>(w: CliWorld<P>) {
    let (agent, _) = w.agent("default").await;
    w.fake.push(Reply::text("Noted: mango."));
    let first = w.turn(&agent, "remember mango", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let id = w.session_id(&agent).await;
    let mut w = w;
    let mut after = last_seq(&first);
    // Twice: a session reopened once must reopen again with everything.
    let rounds = [
        ("and remember kiwi", "Noted: kiwi."),
        ("which fruits?", "Mango and kiwi."),
    ];
    for (prompt, answer) in rounds {
        let pid = w.pid(&agent).await;
        w = w
            .restart(|_| assert!(!pid_alive(pid), "the server's stop ended the CLI"))
            .await;
        w.fake.push(Reply::text(answer));
        // As in `a_closed_agent_resumes_its_conversation`: the reopening may wait for the
        // minute of creation to pass, so the stream is opened after the prompt is
        // answered.
        w.app
            .prompt_within(&agent, prompt, Duration::from_secs(180))
            .await;
        let mut stream = w.app.events(&agent, Some(after)).await;
        let turn = stream
            .until("turn_completed", Duration::from_secs(150))
            .await;
        let k = kinds(&turn);
        assert_eq!(outcome(&turn)["outcome"], "completed", "{k:?}");
        assert!(
            of_kind(&turn, "error").is_empty(),
            "{:?}",
            of_kind(&turn, "error")
        );
        let started = of_kind(&turn, "session_started");
        assert_eq!(started.len(), 1, "{k:?}");
        assert_eq!(started[0]["resumed"], true);
        assert_eq!(started[0]["provider_session_id"], id.as_str());
        // The history Gemini replays on load is not reported again.
        assert_eq!(of_kind(&turn, "user_message").len(), 1, "{k:?}");
        assert_eq!(assistant_text(&turn), answer);
        after = last_seq(&turn);
    }
    let history = conversation_text(&w.fake.requests().pop().unwrap());
    for said in [
        "remember mango",
        "Noted: mango.",
        "and remember kiwi",
        "Noted: kiwi.",
        "which fruits?",
    ] {
        assert!(history.contains(said), "{said}: {history}");
    }
}

#[tokio::test]
async fn without_credentials_gemini_is_unavailable_and_creation_is_refused() {
    let cli = clis::cli("gemini");
    let app = spawn_app_with(move |s| {
        // Empty values count as unset, whatever the server's own environment holds.
        let env = [
            "GEMINI_API_KEY",
            "GOOGLE_API_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_GENAI_USE_VERTEXAI",
        ]
        .iter()
        .map(|k| ((*k).to_owned(), String::new()))
        .collect();
        s.providers.insert("gemini".into(), cli_settings(&cli, env));
    })
    .await;
    let gemini = app.provider("gemini").await;
    assert_eq!(gemini["available"], false, "{gemini}");
    let reason = gemini["unavailable_reason"].as_str().unwrap();
    assert!(reason.contains("GEMINI_API_KEY"), "{reason}");

    let repo = git_repo();
    let refused = app.creation_refused(repo.path(), "gemini").await;
    assert!(refused.to_string().contains("GEMINI_API_KEY"), "{refused}");
}

#[tokio::test]
async fn mode_and_model_change_in_a_live_session() {
    let w = World::new().await;
    let (agent, ws) = w.agent("default").await;
    w.fake.push(Reply::text("Ready."));
    let first = w.turn(&agent, "get ready", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");

    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/mode"),
            json!({"mode": "autoEdit"}),
        )
        .await;
    assert_eq!(changed["mode"], "autoEdit", "{changed}");
    let changed = w
        .app
        .put_ok(
            &format!("/v1/agents/{agent}/model"),
            json!({"model": "gemini-2.5-pro"}),
        )
        .await;
    assert_eq!(changed["model"], "gemini-2.5-pro", "{changed}");

    // In autoEdit a write needs no approval.
    let path = path_of(&ws["path"]).join("edited.txt");
    w.fake.push(Reply::tool(
        "write_file",
        json!({"file_path": path, "content": "accepted\n"}),
    ));
    w.fake.push(Reply::text("Wrote it."));
    w.app.prompt(&agent, "write edited.txt").await;
    let events = stream.until("turn_completed", LONG).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert_eq!(
        of_kind(&events, "mode_changed")[0]["mode"],
        "autoEdit",
        "{k:?}"
    );
    assert_eq!(
        of_kind(&events, "model_changed")[0]["model"],
        "gemini-2.5-pro",
        "{k:?}"
    );
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "accepted\n");
    // The model change reached the CLI: its last call asked for the model chosen.
    let lines = w.fake.request_lines();
    let last = lines
        .iter()
        .rev()
        .find(|l| l.contains(":streamGenerateContent"))
        .unwrap();
    assert!(last.contains("/models/gemini-2.5-pro:"), "{lines:?}");
}

impl scenarios::Rig for Gemini {
    /// Gemini's first turn in a new process can be slow.
    const PATIENCE: Duration = Duration::from_secs(150);
    const ASKING_MODE: &'static str = "default";

    fn reply_slowly(fake: &FakeGemini) {
        fake.push(Reply::slow(
            "A long answer that will be cut short midway.",
            40,
            Duration::from_millis(250),
        ));
    }
    fn reply_stalled(fake: &FakeGemini) {
        // Longer than any test: 200 chunks, half a second apart.
        fake.push(Reply::slow(
            "Still talking",
            200,
            Duration::from_millis(500),
        ));
    }
    fn reply_text(fake: &FakeGemini, text: &str) {
        fake.push(Reply::text(text));
    }
    fn reply_write(fake: &FakeGemini, path: &Path, content: &str) {
        fake.push(Reply::tool(
            "write_file",
            json!({"file_path": path, "content": content}),
        ));
    }
    fn last_conversation(fake: &FakeGemini) -> String {
        conversation_text(&fake.requests().pop().expect("the model was called"))
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
