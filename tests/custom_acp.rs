//! Any ACP agent from configuration: codex-acp (the pinned install) as
//! `[providers.codex-acp] extends = "acp"`, pointed at the fake OpenAI Responses server
//! exactly as a user would configure it, and driven through agentry's REST/SSE API.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/http.rs"]
mod http;

#[path = "support/clis.rs"]
mod clis;

#[path = "support/cli_world.rs"]
#[allow(dead_code)]
mod cli_world;

#[path = "support/fake_openai.rs"]
#[allow(dead_code)]
mod fake_openai;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use agentry::config::{ModeSetting, ProviderSettings};
use cli_world::{CliWorld, Provider, assistant_text, ledger_rows};
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
    let rig = World::new().await;
    let patch = "*** Begin Patch\n*** Add File: hello.txt\n+hello over acp\n*** End Patch\n";
    rig.fake
        .script([Reply::patch("call_p", patch), Reply::text("Patched.")]);
    let (agent, ws) = rig.agent("read-only").await;
    let mut stream = rig.app.events(&agent, None).await;
    rig.app.prompt(&agent, "add hello.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    let options: Vec<&str> = request["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect();
    // agentry's ids, chosen by kind (codex-acp's own are `approved`, `abort`, …).
    assert!(options.contains(&"allow"), "{request}");
    assert!(options.contains(&"deny"), "{request}");
    rig.answer(&agent, &request, "allow").await;
    let after = stream.until("turn_completed", LONG).await;
    let k = kinds(&after);
    assert_eq!(outcome(&after)["outcome"], "completed", "{k:?}");
    let dir = path_of(&ws["path"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("hello.txt")).unwrap(),
        "hello over acp\n"
    );
    let diff = rig
        .app
        .get_ok(&format!(
            "/v1/workspaces/{}/diff",
            ws["id"].as_str().unwrap()
        ))
        .await;
    assert!(
        diff["patch"].as_str().unwrap().contains("+hello over acp"),
        "{diff}"
    );
}

#[tokio::test]
async fn a_closed_agent_resumes_its_conversation() {
    let rig = World::new().await;
    rig.fake
        .script([Reply::text("Noted: blue."), Reply::text("It was blue.")]);
    let (agent, _) = rig.agent("full-access").await;
    let first = rig.turn(&agent, "my colour is blue", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = rig.pid(&agent).await;
    rig.app
        .post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    eventually("the agent to end", Duration::from_secs(5), || {
        !pid_alive(pid)
    })
    .await;

    the_next_turn_resumes_with_its_history(&rig, &agent, &first).await;
}

#[tokio::test]
async fn after_a_server_restart_the_agent_resumes_its_conversation() {
    let rig = World::new().await;
    rig.fake
        .script([Reply::text("Noted: blue."), Reply::text("It was blue.")]);
    let (agent, _) = rig.agent("full-access").await;
    let first = rig.turn(&agent, "my colour is blue", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = rig.pid(&agent).await;
    let rig = rig
        .restart(|_| assert!(!pid_alive(pid), "the server's stop ended the agent"))
        .await;

    the_next_turn_resumes_with_its_history(&rig, &agent, &first).await;
}

#[tokio::test]
async fn a_killed_agent_fails_the_turn_quickly_and_is_usable_after() {
    let rig = World::new().await;
    rig.fake
        .script([Reply::stalled("Working on it"), Reply::text("Recovered.")]);
    let (agent, _) = rig.agent("full-access").await;
    let mut stream = rig.app.events(&agent, None).await;
    rig.app.prompt(&agent, "long task").await;
    stream.until("assistant_delta", LONG).await;
    let pid = rig.pid(&agent).await;
    let killed = Instant::now();
    // SAFETY: kill(2) on the agent process this test's server started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let ended = stream.until("turn_completed", Duration::from_secs(5)).await;
    let took = killed.elapsed();
    eprintln!("the turn failed {took:?} after SIGKILL");
    assert_eq!(outcome(&ended)["outcome"], "failed", "{:?}", kinds(&ended));
    assert!(took < Duration::from_secs(2), "took {took:?}");

    let events = rig
        .turn(&agent, "still there?", Some(last_seq(&ended)))
        .await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert_eq!(assistant_text(&events), "Recovered.");
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
    let rig = World::new().await;
    rig.fake
        .script([Reply::stalled("Thinking hard"), Reply::text("Back.")]);
    let (agent, _) = rig.agent("full-access").await;
    let mut stream = rig.app.events(&agent, None).await;
    rig.app.prompt(&agent, "take your time").await;
    stream.until("assistant_delta", LONG).await;
    rig.app
        .post_ok(&format!("/v1/agents/{agent}/interrupt"), json!({}), 202)
        .await;
    let ended = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&ended)["outcome"],
        "canceled",
        "{:?}",
        kinds(&ended)
    );
    let next = rig.turn(&agent, "again", Some(last_seq(&ended))).await;
    assert_eq!(outcome(&next)["outcome"], "completed", "{:?}", kinds(&next));
    assert_eq!(assistant_text(&next), "Back.");
}

#[tokio::test]
async fn the_unattended_mode_writes_without_asking() {
    let rig = World::new().await;
    let patch = "*** Begin Patch\n*** Add File: quiet.txt\n+unattended\n*** End Patch\n";
    rig.fake
        .script([Reply::patch("call_q", patch), Reply::text("Done.")]);
    let (agent, ws) = rig.agent("full-access").await;
    let events = rig.turn(&agent, "add quiet.txt", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    assert_eq!(
        std::fs::read_to_string(path_of(&ws["path"]).join("quiet.txt")).unwrap(),
        "unattended\n"
    );
}

#[tokio::test]
async fn no_agent_process_is_left_after_archive_or_server_shutdown() {
    let rig = World::new().await;
    rig.fake
        .script([Reply::text("One."), Reply::stalled("Still talking")]);
    let (archived, ws) = rig.agent("full-access").await;
    let events = rig.turn(&archived, "one", None).await;
    assert_eq!(outcome(&events)["outcome"], "completed");
    let pid = rig.pid(&archived).await;
    assert!(
        rig.processes_of_this_test().contains(&pid),
        "{:?}",
        rig.processes_of_this_test()
    );
    let res = rig.app.delete(&format!("/v1/agents/{archived}")).await;
    assert_eq!(res.status(), 204);
    eventually(
        "the archived agent's processes to end",
        Duration::from_secs(10),
        || rig.processes_of_this_test().is_empty(),
    )
    .await;
    assert_eq!(
        ledger_rows(&rig.app.pool).await,
        0,
        "the ledger is empty after archive"
    );

    // Server shutdown with a turn in flight.
    let agent = rig
        .app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "codex-acp", "mode": "full-access"}),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap();
    let mut stream = rig.app.events(agent, None).await;
    rig.app.prompt(agent, "talk").await;
    stream.until("assistant_delta", LONG).await;
    assert!(!rig.processes_of_this_test().is_empty());
    let marker = rig.marker();
    let (app, _rest) = rig.into_app();
    let (db, _data_dir, _token) = app.stop().await;
    assert!(
        processes_with_env(&marker).is_empty(),
        "the server's stop ended every process"
    );
    let pool = sqlx::PgPool::connect_with(db).await.unwrap();
    assert_eq!(
        ledger_rows(&pool).await,
        0,
        "the ledger is empty after shutdown"
    );
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

/// The turn after a close or a restart reopens the session (`resumed`) and the model hears
/// the earlier turn.
async fn the_next_turn_resumes_with_its_history(rig: &World, agent: &str, first: &[SseEvent]) {
    let second = rig
        .turn(agent, "which colour?", Some(last_seq(first)))
        .await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    let started = of_kind(&second, "session_started");
    assert_eq!(started.last().unwrap()["resumed"], true, "{k:?}");
    assert_eq!(assistant_text(&second), "It was blue.");
    let history = input_text(rig.fake.requests().last().unwrap());
    assert!(
        history.contains("my colour is blue") && history.contains("Noted: blue."),
        "{history}"
    );
}
