//! Any ACP agent from configuration: codex-acp (the pinned install) as
//! `[providers.codex-acp] extends = "acp"`, pointed at the fake OpenAI Responses server
//! exactly as a user would configure it, and driven through agentry's REST/SSE API.

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
use std::time::Duration;

use agentry::config::{ModeSetting, ProviderSettings};
use cli_world::{CliWorld, Provider, assistant_text};
use fake_openai::{FakeOpenAi, Reply, input_text};
use helpers::*;
use serde_json::json;

const LONG: Duration = Duration::from_secs(60);
/// A model Codex knows, so that it offers `apply_patch`.
const MODEL: &str = "gpt-5.5";

fn mode(id: &str, unattended: bool) -> ModeSetting {
    ModeSetting {
        id: id.to_owned(),
        label: None,
        description: None,
        unattended,
    }
}

/// codex-acp as a configured ACP agent against the fake OpenAI Responses server.
struct CodexAcp;

type World = CliWorld<CodexAcp>;

impl Provider for CodexAcp {
    const ID: &'static str = "codex-acp";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = None;
    type Fake = FakeOpenAi;

    /// The `[providers.codex-acp]` table a user would write.
    fn settings(cli: &Path, base_url: &str, home: &Path) -> ProviderSettings {
        ProviderSettings {
            extends: Some("acp".into()),
            label: Some("Codex over ACP".into()),
            command: Some(vec![
                cli.display().to_string(),
                "-c".into(),
                format!("model={MODEL}"),
                "-c".into(),
                "model_provider=fake".into(),
                "-c".into(),
                format!(
                    r#"model_providers.fake={{name="Fake",base_url="{base_url}",env_key="OPENAI_API_KEY",wire_api="responses"}}"#
                ),
            ]),
            env: BTreeMap::from([
                ("CODEX_HOME".to_owned(), home.display().to_string()),
                ("HOME".to_owned(), home.display().to_string()),
                ("OPENAI_API_KEY".to_owned(), "x".to_owned()),
            ]),
            modes: vec![
                mode("read-only", false),
                mode("auto", false),
                mode("full-access", true),
            ],
            default_mode: Some("full-access".into()),
            ..Default::default()
        }
    }
    /// codex-acp reaches the fake itself (its key is not brokered): under the proxy
    /// network mode the admin allows the fake's loopback port, which the agent's sandbox
    /// then forwards to the host's.
    fn egress_allow(fake_url: &str) -> Vec<String> {
        let url = url::Url::parse(fake_url).unwrap();
        vec![format!(
            "{}:{}",
            url.host_str().unwrap(),
            url.port_or_known_default().unwrap()
        )]
    }
    fn marker(home: &Path) -> String {
        format!("CODEX_HOME={}", home.display())
    }
}

impl scenarios::Rig for CodexAcp {
    const PROTOCOL: &'static str = "acp";
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
        fake.script([Reply::stalled("Thinking hard")]);
    }
    fn reply_stalled(fake: &FakeOpenAi) {
        fake.script([Reply::stalled("Still talking")]);
    }
    fn reply_text(fake: &FakeOpenAi, text: &str) {
        fake.script([Reply::text(text)]);
    }
    /// An `apply_patch` adding the file, named relative to the worktree (the agent's
    /// working directory).
    fn reply_write(fake: &FakeOpenAi, path: &Path, content: &str) {
        let name = path.file_name().unwrap().to_str().unwrap();
        let lines: String = content.lines().map(|l| format!("+{l}\n")).collect();
        let patch = format!("*** Begin Patch\n*** Add File: {name}\n{lines}*** End Patch\n");
        fake.script([Reply::patch("call_w", &patch)]);
    }
    fn last_conversation(fake: &FakeOpenAi) -> String {
        input_text(fake.requests().last().expect("the model was called"))
    }
}

#[tokio::test]
async fn a_configured_acp_agent_is_listed_and_runs_a_text_turn() {
    let rig = World::new().await;
    let listed = rig.app.provider("codex-acp").await;
    assert_eq!(listed["available"], true, "{listed}");
    assert_eq!(listed["protocol"], "acp");
    assert_eq!(listed["label"], "Codex over ACP");
    // No models in its settings: those codex-acp announces in `session/new`.
    let models = rig.app.get_ok("/v1/providers/codex-acp/models").await;
    let default: Vec<&str> = models["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["is_default"] == true)
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(default, [MODEL], "{models}");

    rig.fake.script([Reply::text("Hello over ACP.")]);
    let (agent, _) = rig.agent("full-access").await;
    let events = rig.turn(&agent, "say hello", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert_eq!(assistant_text(&events), "Hello over ACP.");
    assert!(input_text(rig.fake.requests().last().unwrap()).contains("say hello"));
}

#[tokio::test]
async fn a_file_write_is_approved_and_lands_in_the_worktree() {
    scenarios::an_approved_write_lands_in_the_worktree_and_its_diff(&World::new().await).await;
}

#[tokio::test]
async fn a_closed_agent_resumes_its_conversation() {
    scenarios::a_closed_agent_resumes_its_conversation(&World::new().await).await;
}

#[tokio::test]
async fn after_a_server_restart_the_agent_resumes_its_conversation() {
    scenarios::after_a_server_restart_the_agent_resumes_in_its_mode(World::new().await).await;
}

#[tokio::test]
async fn a_killed_agent_fails_the_turn_quickly_and_is_usable_after() {
    scenarios::a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers(&World::new().await)
        .await;
}

#[tokio::test]
async fn a_denied_write_changes_nothing_and_the_agent_goes_on() {
    let rig = World::new().await;
    let patch = "*** Begin Patch\n*** Add File: denied.txt\n+no\n*** End Patch\n";
    rig.fake.script([
        Reply::patch("call_d", patch),
        Reply::text("Fine, not writing."),
        Reply::text("Still here."),
    ]);
    let (agent, ws) = rig.agent("read-only").await;
    let mut stream = rig.app.events(&agent, None).await;
    rig.app.prompt(&agent, "add denied.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    rig.answer(&agent, &request, "deny").await;
    let after = stream.until("turn_completed", LONG).await;
    let k = kinds(&after);
    let resolved = of_kind(&after, "permission_resolved");
    assert_eq!(resolved[0]["behavior"], "deny", "{k:?}");
    // codex-acp's only way to refuse is `abort`, which ends the turn.
    let ended = outcome(&after)["outcome"].as_str().unwrap().to_owned();
    assert!(
        matches!(ended.as_str(), "completed" | "canceled"),
        "{ended} {k:?}"
    );
    for call in of_kind(&after, "tool_call") {
        assert_ne!(
            call["status"], "completed",
            "the denied call never completed: {call}"
        );
    }
    assert!(!path_of(&ws["path"]).join("denied.txt").exists());

    let next = rig
        .turn(&agent, "are you there?", Some(last_seq(&after)))
        .await;
    assert_eq!(outcome(&next)["outcome"], "completed", "{:?}", kinds(&next));
}

#[tokio::test]
async fn an_interrupted_turn_is_canceled_and_the_next_prompt_works() {
    scenarios::an_interrupted_turn_is_canceled_and_the_next_prompt_works(&World::new().await).await;
}

#[tokio::test]
async fn the_unattended_mode_writes_without_asking() {
    scenarios::the_unattended_mode_writes_without_asking(&World::new().await).await;
}

#[tokio::test]
async fn no_agent_process_is_left_after_archive_or_server_shutdown() {
    scenarios::no_cli_process_is_left_after_archive_or_server_shutdown(World::new().await).await;
}

/// An ACP agent from the settings that names no modes or models there: those it announces
/// in `session/new` are its provider's modes and models, its agent's mode and model, and
/// `session/set_mode` and `session/set_model` change them. The agent is the scripted
/// `exec_agent.py --announce`, which runs each prompt as a command with the session's
/// mode and model in its environment.
#[tokio::test]
async fn a_configured_agent_lists_and_sets_the_modes_and_models_it_announces() {
    let support = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support");
    let script = support.join("exec_agent.py");
    let app = spawn_app_with(move |s| {
        s.providers.insert(
            "announcer".into(),
            ProviderSettings {
                extends: Some("acp".into()),
                command: Some(vec![
                    "python3".into(),
                    script.display().to_string(),
                    "--announce".into(),
                ]),
                ..Default::default()
            },
        );
        s.sandbox.extra_read_only.push(support);
    })
    .await;

    // The catalog is asked of the agent.
    let models = app.get_ok("/v1/providers/announcer/models").await;
    let listed: Vec<(&str, &str, bool)> = models["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap(),
                m["label"].as_str().unwrap(),
                m["is_default"] == true,
            )
        })
        .collect();
    assert_eq!(
        listed,
        [("small", "Small", true), ("large", "Large", false)],
        "{models}"
    );
    let provider = app.provider("announcer").await;
    let modes: Vec<(&str, &str)> = provider["modes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["label"].as_str().unwrap()))
        .collect();
    assert_eq!(
        modes,
        [("ask", "Ask"), ("code", "Code"), ("plan", "Plan")],
        "{provider}"
    );
    assert_eq!(
        provider["modes"][0]["description"], "Asks before it changes anything",
        "{provider}"
    );

    let repo = git_repo();
    let (agent, _) =
        cli_world::new_agent(&app, repo.path(), json!({"provider": "announcer"})).await;
    let ask = "echo \"$EXEC_AGENT_MODE/$EXEC_AGENT_MODEL\"";
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, ask).await;
    let first = stream.until("turn_completed", LONG).await;
    assert_eq!(assistant_text(&first), "exit=0\nask/small\n");
    let a = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(
        (&a["mode"], &a["model"]),
        (&json!("ask"), &json!("small")),
        "{a}"
    );

    let changed = app
        .put_ok(&format!("/v1/agents/{agent}/mode"), json!({"mode": "plan"}))
        .await;
    assert_eq!(changed["mode"], "plan", "{changed}");
    let changed = app
        .put_ok(
            &format!("/v1/agents/{agent}/model"),
            json!({"model": "large"}),
        )
        .await;
    assert_eq!(changed["model"], "large", "{changed}");
    // A mode the agent did not announce is refused.
    let refused = app
        .client
        .put(app.url(&format!("/v1/agents/{agent}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "yolo"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 422);

    app.prompt(&agent, ask).await;
    let second = stream.until("turn_completed", LONG).await;
    let k = kinds(&second);
    assert_eq!(assistant_text(&second), "exit=0\nplan/large\n", "{k:?}");
    assert_eq!(of_kind(&second, "mode_changed")[0]["mode"], "plan", "{k:?}");
    assert_eq!(
        of_kind(&second, "model_changed")[0]["model"],
        "large",
        "{k:?}"
    );
}
