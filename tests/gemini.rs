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
#[allow(dead_code)]
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
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, assistant_text, cli_settings};
use fake_gemini::{FakeGemini, REPLY_TOKENS, Reply, conversation_text, function_responses};
use helpers::*;
use serde_json::{Value, json};
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
    scenarios::a_text_turn_streams_deltas_and_completes_with_usage(&World::new().await).await;
}

#[tokio::test]
async fn an_allowed_write_lands_in_the_worktree_and_its_diff() {
    scenarios::an_approved_write_lands_in_the_worktree_and_its_diff(&World::new().await).await;
}

#[tokio::test]
async fn a_denied_write_fails_its_call_and_the_turn_completes() {
    scenarios::a_denied_write_fails_its_call_and_the_agent_goes_on(&World::new().await).await;
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
    scenarios::the_unattended_mode_writes_without_asking(&World::new().await).await;
}

#[tokio::test]
async fn a_closed_agent_resumes_its_conversation() {
    // Reopened at once, within the minute the session was created in (see
    // `providers::gemini::resume_wait`): the history must survive that.
    scenarios::a_closed_agent_resumes_its_conversation(&World::new().await).await;
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
    scenarios::mode_and_model_change_in_a_live_session(&World::new().await).await;
}

impl scenarios::Rig for Gemini {
    /// Gemini's first turn in a new process can be slow.
    const PATIENCE: Duration = Duration::from_secs(150);
    const PROTOCOL: &'static str = "acp";
    const MODES: &'static [(&'static str, bool)] = &[
        ("default", false),
        ("autoEdit", false),
        ("plan", false),
        ("yolo", true),
    ];
    const ASKING_MODE: &'static str = "default";
    const UNATTENDED_MODE: &'static str = "yolo";
    const REPLY_TOKENS: u64 = REPLY_TOKENS;

    fn reply_in_pieces(fake: &FakeGemini, text: &str) {
        fake.push(Reply::slow(text, 4, Duration::from_millis(20)));
    }
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

    /// The key and the model reached the fake.
    fn check_text_turn(w: &World, _agent: &str, _events: &[SseEvent]) -> impl Future<Output = ()> {
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
        async {}
    }
    /// Answered with agentry's option id.
    fn allow() -> Value {
        json!({"behavior": "allow", "option_id": "allow"})
    }
    /// agentry's option ids and behaviors, not Gemini's (`proceed_once`, `cancel`, …); Gemini
    /// announces the call only inside the permission request: it is reported first.
    fn check_write_request(before: &[SseEvent], request: &Value) {
        let options: Vec<(&str, &str)> = request["options"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o["id"].as_str().unwrap(), o["behavior"].as_str().unwrap()))
            .collect();
        assert!(options.contains(&("allow", "allow")), "{options:?}");
        assert!(options.contains(&("deny", "deny")), "{options:?}");
        assert!(!request.to_string().contains("proceed_once"), "{request}");
        let calls = of_kind(before, "tool_call");
        assert_eq!(calls[0]["call_id"], request["call_id"], "{request}");
    }
    /// The call ends with its diff, and the model heard that the write succeeded.
    fn check_written(w: &World, after: &[SseEvent], request: &Value) {
        let calls = of_kind(after, "tool_call");
        let done = calls.last().unwrap();
        assert_eq!(done["call_id"], request["call_id"]);
        assert_eq!(done["tool_kind"], "write", "{done}");
        assert_eq!(done["diff"][0]["change"], "add", "{done}");
        assert_eq!(done["diff"][0]["new_text"], "hello from gemini\n", "{done}");
        let responses = function_responses(&w.fake.requests().pop().unwrap());
        assert_eq!(responses.len(), 1, "{responses:?}");
        assert_eq!(responses[0]["name"], "write_file");
    }
}

impl scenarios::LiveChanges for Gemini {
    const EDITS_MODE: &'static str = "autoEdit";
    const OTHER_MODEL: &'static str = "gemini-2.5-pro";

    /// Its last call asked for the model chosen.
    fn check_other_model_asked(fake: &FakeGemini, changed: &Value) {
        assert_eq!(changed["model"], "gemini-2.5-pro", "{changed}");
        let lines = fake.request_lines();
        let last = lines
            .iter()
            .rev()
            .find(|l| l.contains(":streamGenerateContent"))
            .unwrap();
        assert!(last.contains("/models/gemini-2.5-pro:"), "{lines:?}");
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
