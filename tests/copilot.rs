//! The `copilot` provider driven end to end: agentry's REST/SSE API, the real GitHub
//! Copilot CLI (the pinned install) over ACP, offline, with its BYOK provider pointed at a
//! fake Chat Completions server on 127.0.0.1 that scripts the model. The provider is
//! configured through settings exactly as a user would configure it.

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
use std::path::Path;
use std::time::Duration;

use agentry::config::ProviderSettings;
use cli_world::{CliWorld, Provider, cli_settings};
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
    scenarios::a_text_turn_streams_deltas_and_completes_with_usage(&World::new().await).await;
}

#[tokio::test]
async fn an_approved_create_lands_in_the_worktree_and_its_diff() {
    scenarios::an_approved_write_lands_in_the_worktree_and_its_diff(&World::new().await).await;
}

#[tokio::test]
async fn a_denied_create_fails_the_tool_and_the_turn_completes() {
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
async fn allow_all_creates_files_without_asking() {
    scenarios::the_unattended_mode_writes_without_asking(&World::new().await).await;
}

#[tokio::test]
async fn switching_to_allow_all_in_a_live_session_stops_the_asking() {
    scenarios::a_live_switch_to_the_unattended_mode_stops_the_asking(&World::new().await).await;
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
    const PROTOCOL: &'static str = "acp";
    const MODES: &'static [(&'static str, bool)] = &[
        ("agent", false),
        ("plan", false),
        ("allow-all", true),
        ("autopilot", true),
    ];
    const ASKING_MODE: &'static str = "agent";
    const UNATTENDED_MODE: &'static str = "allow-all";
    const REPLY_TOKENS: u64 = 7;
    const DENIAL_SAYS: Option<&'static str> = Some("rejected");

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
            "create",
            json!({"path": path, "file_text": content}),
        ));
    }
    fn last_conversation(fake: &FakeChat) -> String {
        conversation_text(&fake.last_completion().body)
    }

    fn check_models(models: &Value) {
        assert_eq!(models["items"][0]["id"], MODEL, "{models}");
    }
    /// Copilot reports the context window as it goes and the tokens with its answer; it
    /// asked the fake with its key, offline: the only requests it made were to the model
    /// endpoint.
    fn check_text_turn(w: &World, _agent: &str, events: &[SseEvent]) -> impl Future<Output = ()> {
        let usage = of_kind(events, "usage");
        assert!(!usage.is_empty(), "{:?}", kinds(events));
        assert_eq!(usage[0]["context_window_max"], 128000, "{}", usage[0]);
        assert_eq!(outcome(events)["usage"]["input_tokens"], 30);
        w.fake.assert_streamed_offline();
        async {}
    }
    /// agentry's own option ids, chosen by kind; Copilot's stay inside the adapter.
    fn check_write_request(before: &[SseEvent], request: &Value) {
        let options = scenarios::option_ids(request);
        assert_eq!(options, ["allow", "allow_always", "deny"], "{request}");
        let pending = of_kind(before, "tool_call");
        assert_eq!(pending[0]["tool_kind"], "edit", "{}", pending[0]);
        assert_eq!(pending[0]["diff"][0]["new_text"], "hello from copilot\n");
    }
    /// The call keeps the tool's own arguments; the request's view of it (with the diff)
    /// is what the permission request carried. The model was told of the result.
    fn check_written(w: &World, after: &[SseEvent], request: &Value) {
        let calls = of_kind(after, "tool_call");
        let done = calls.last().unwrap();
        assert_eq!(done["input"]["file_text"], "hello from copilot\n", "{done}");
        assert!(request["input"]["diff"].is_string(), "{request}");
        let last = conversation_text(&w.fake.last_completion().body);
        assert!(last.contains("Created file"), "{last}");
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
