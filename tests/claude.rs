//! The `claude` provider driven end to end: agentry's REST/SSE API, the real Claude Code
//! CLI (the pinned install) and a fake Anthropic API on 127.0.0.1 that scripts the model.
//! The provider is configured through settings exactly as a user would configure it.

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

#[path = "support/fake_anthropic.rs"]
#[allow(dead_code)]
mod fake_anthropic;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use agentry::config::ProviderSettings;
use cli_world::{
    CliWorld, Provider, assistant_text, cli_settings, command_line, last_message, ledger_rows,
    process_tree,
};
use fake_anthropic::{FakeAnthropic, Reply, conversation_text};
use helpers::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(30);

/// Claude Code against the fake Anthropic API.
struct Claude;

type World = CliWorld<Claude>;

impl Provider for Claude {
    const ID: &'static str = "claude";
    const TURN: Duration = LONG;
    const SLOTS: Option<usize> = Some(3);
    type Fake = FakeAnthropic;

    fn settings(cli: &Path, fake_url: &str, home: &Path) -> ProviderSettings {
        let env = BTreeMap::from([
            ("ANTHROPIC_BASE_URL".to_owned(), fake_url.to_owned()),
            ("ANTHROPIC_API_KEY".to_owned(), "test-key".to_owned()),
            ("HOME".to_owned(), home.display().to_string()),
        ]);
        cli_settings(cli, env)
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
async fn a_denied_command_fails_and_the_model_is_told() {
    let w = World::new().await;
    let (agent, ws) = w.agent("default").await;
    w.fake.push(Reply::tool(
        "Bash",
        json!({"command": "echo no > denied.txt", "description": "write a file"}),
    ));
    w.fake.push(Reply::text("Understood, I will not."));

    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "make denied.txt").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    assert_eq!(of_kind(&before, "tool_call")[0]["tool_kind"], "shell");
    w.answer_with(
        &agent,
        &request,
        json!({"behavior": "deny", "message": "not on this machine"}),
    )
    .await;
    let after = stream.until("turn_completed", LONG).await;
    assert_eq!(outcome(&after)["outcome"], "completed");
    let failed = of_kind(&after, "tool_call");
    let failed = failed.last().unwrap();
    assert_eq!(failed["status"], "failed", "{failed}");
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("not on this machine")
    );
    assert!(!path_of(&ws["path"]).join("denied.txt").exists());
    // The next model call carried the refusal.
    let last = w.fake.requests().pop().unwrap();
    assert!(
        conversation_text(&last).contains("not on this machine"),
        "{}",
        conversation_text(&last)
    );
    assert_eq!(assistant_text(&after), "Understood, I will not.");
}

impl scenarios::Rig for Claude {
    const PROTOCOL: &'static str = "claude-stream-json";
    const MODES: &'static [(&'static str, bool)] = &[
        ("default", false),
        ("acceptEdits", false),
        ("plan", false),
        ("bypassPermissions", true),
    ];
    const ASKING_MODE: &'static str = "default";
    const UNATTENDED_MODE: &'static str = "bypassPermissions";
    const REPLY_TOKENS: u64 = 15;

    fn reply_in_pieces(fake: &FakeAnthropic, text: &str) {
        fake.push(Reply::slow(text, 4, Duration::from_millis(20)));
    }
    fn reply_slowly(fake: &FakeAnthropic) {
        fake.push(Reply::slow(
            "This answer takes a long while to arrive, word by word, far too long.",
            40,
            Duration::from_millis(250),
        ));
    }
    fn reply_stalled(fake: &FakeAnthropic) {
        // Longer than any test: 200 chunks, half a second apart.
        fake.push(Reply::slow(
            "Still talking",
            200,
            Duration::from_millis(500),
        ));
    }
    fn reply_text(fake: &FakeAnthropic, text: &str) {
        fake.push(Reply::text(text));
    }
    fn reply_write(fake: &FakeAnthropic, path: &Path, content: &str) {
        fake.push(Reply::tool(
            "Write",
            json!({"file_path": path, "content": content}),
        ));
    }
    fn last_conversation(fake: &FakeAnthropic) -> String {
        conversation_text(&fake.requests().pop().expect("the model was called"))
    }

    /// The catalog comes from the CLI's own initialize answer.
    fn check_models(models: &Value) {
        let ids: Vec<&str> = models["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        assert!(ids.contains(&"default"), "{models}");
    }
    /// One usage event, with the window's size.
    fn check_text_turn(_w: &World, _agent: &str, events: &[SseEvent]) -> impl Future<Output = ()> {
        let usage = of_kind(events, "usage");
        assert_eq!(usage.len(), 1, "{:?}", kinds(events));
        assert!(
            usage[0]["input_tokens"].as_u64().unwrap() >= 25,
            "{}",
            usage[0]
        );
        assert_eq!(usage[0]["output_tokens"], 15);
        assert!(usage[0]["context_window_max"].as_u64().is_some());
        async {}
    }
    /// `allow` first; the call is running while it waits.
    fn check_write_request(before: &[SseEvent], request: &Value) {
        assert_eq!(request["options"][0]["id"], "allow", "{request}");
        let running = of_kind(before, "tool_call");
        assert_eq!(running[0]["tool_kind"], "write");
        assert_eq!(running[0]["status"], "running");
    }
    fn check_written(_w: &World, after: &[SseEvent], _request: &Value) {
        let calls = of_kind(after, "tool_call");
        assert_eq!(calls.last().unwrap()["tool_kind"], "write");
        assert_eq!(assistant_text(after), "The file is written.");
    }
}

impl scenarios::LiveChanges for Claude {
    const EDITS_MODE: &'static str = "acceptEdits";
    const OTHER_MODEL: &'static str = "sonnet";

    fn check_other_model_asked(fake: &FakeAnthropic, _changed: &Value) {
        let last = fake.requests().pop().unwrap();
        assert!(
            last["model"].as_str().unwrap().contains("sonnet"),
            "{}",
            last["model"]
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
async fn after_a_server_restart_the_agent_resumes() {
    scenarios::after_a_server_restart_the_agent_resumes_in_its_mode(World::new().await).await;
}

#[tokio::test]
async fn bypass_permissions_runs_tools_without_asking() {
    let w = World::new().await;
    let (agent, ws) = w.agent("bypassPermissions").await;
    w.fake.push(Reply::tool(
        "Bash",
        json!({"command": "echo unattended > bypass.txt", "description": "write"}),
    ));
    w.fake.push(Reply::text("Done without asking."));
    let events = w.turn(&agent, "write bypass.txt", None).await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert!(of_kind(&events, "permission_requested").is_empty());
    let calls = of_kind(&events, "tool_call");
    assert_eq!(calls.last().unwrap()["status"], "completed");
    assert_eq!(
        std::fs::read_to_string(path_of(&ws["path"]).join("bypass.txt")).unwrap(),
        "unattended\n"
    );
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

#[tokio::test]
async fn without_credentials_claude_is_unavailable_and_creation_is_refused() {
    let cli = clis::cli("claude");
    let home = tempfile::tempdir().unwrap();
    let h = home.path().to_path_buf();
    let app = spawn_app_with(move |s| {
        let env = BTreeMap::from([
            // Empty values count as unset, whatever the server's own environment holds.
            ("ANTHROPIC_API_KEY".to_owned(), String::new()),
            ("ANTHROPIC_AUTH_TOKEN".to_owned(), String::new()),
            ("HOME".to_owned(), h.display().to_string()),
        ]);
        s.providers.insert("claude".into(), cli_settings(&cli, env));
    })
    .await;
    let claude = app.provider("claude").await;
    assert_eq!(claude["available"], false);
    let reason = claude["unavailable_reason"].as_str().unwrap();
    assert!(reason.contains("ANTHROPIC_API_KEY"), "{reason}");
    assert!(reason.contains(".credentials.json"), "{reason}");

    let repo = git_repo();
    let refused = app.creation_refused(repo.path(), "claude").await;
    assert!(
        refused.to_string().contains("ANTHROPIC_API_KEY"),
        "{refused}"
    );

    // A command that is not installed is named.
    let app2 = spawn_app_with(|s| {
        s.providers.insert(
            "claude".into(),
            ProviderSettings {
                command: Some(vec!["/nonexistent/claude-cli".into()]),
                ..Default::default()
            },
        );
    })
    .await;
    let claude = app2.provider("claude").await;
    assert_eq!(claude["available"], false);
    assert!(
        claude["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/claude-cli")
    );
}

#[tokio::test]
async fn shell_output_with_a_nul_is_stored_with_a_replacement_character() {
    let w = World::new().await;
    let (agent, _) = w.agent("bypassPermissions").await;
    w.fake.push(Reply::tool(
        "Bash",
        json!({"command": "printf 'left\\000right\\n'", "description": "binary output"}),
    ));
    w.fake.push(Reply::text("Printed it."));
    let events = w.turn(&agent, "print a NUL", None).await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    let calls = of_kind(&events, "tool_call");
    let done = calls.last().unwrap();
    assert_eq!(done["status"], "completed", "{done}");
    let output = done["output"].to_string();
    assert!(!output.contains("\\u0000"), "{output}");
    assert!(output.contains("left\u{FFFD}right"), "{output}");
    assert!(assistant_text(&events).ends_with("Printed it."));
    // The timeline as stored reads the same.
    let timeline = w.app.timeline(&agent).await;
    assert!(timeline.iter().any(|e| {
        e["kind"] == "tool_call"
            && e["data"]["output"]
                .to_string()
                .contains("left\u{FFFD}right")
    }));
}

#[tokio::test]
async fn mode_and_model_change_in_a_live_session() {
    scenarios::mode_and_model_change_in_a_live_session(&World::new().await).await;
}

#[tokio::test]
async fn an_agent_closed_before_its_first_prompt_still_works() {
    let w = World::new().await;
    let (agent, _) = w.agent("default").await;
    w.app
        .post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    w.fake.push(Reply::text("First words."));
    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "hello after close").await;
    let events = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert_eq!(assistant_text(&events), "First words.");
    // Nothing was lost, so nothing is reported as lost.
    assert!(
        of_kind(&events, "error").is_empty(),
        "{:?}",
        of_kind(&events, "error")
    );
    let started = of_kind(&events, "session_started");
    assert_eq!(started.len(), 2);
    assert_eq!(started[1]["resumed"], false);
}

#[tokio::test]
async fn an_idle_cli_is_stopped_and_the_next_prompt_resumes_the_conversation() {
    let w = World::new_with(|s| s.agents.idle_timeout_s = 2).await;
    let (agent, _) = w.agent("default").await;
    w.fake.push(Reply::text("Kiwi it is."));
    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "remember kiwi").await;
    let first = stream.until("turn_completed", LONG).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = w.pid(&agent).await;
    eventually("the idle CLI is stopped", Duration::from_secs(15), || {
        !pid_alive(pid)
    })
    .await;
    let gone = Instant::now();
    let closed = loop {
        let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
        if a["status"] == "closed" || gone.elapsed() > Duration::from_secs(10) {
            break a;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(closed["status"], "closed", "{closed}");
    assert!(
        closed["status_reason"]
            .as_str()
            .is_some_and(|r| r.contains("idle")),
        "{closed}"
    );
    assert!(closed["runtime"]["pid"].is_null());
    assert_eq!(
        ledger_rows(&w.app.pool).await,
        0,
        "no process is left in the ledger"
    );

    w.fake.push(Reply::text("You asked me to remember kiwi."));
    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    w.app.prompt(&agent, "which fruit?").await;
    let second = stream.until("turn_completed", LONG).await;
    assert_eq!(
        outcome(&second)["outcome"],
        "completed",
        "{:?}",
        kinds(&second)
    );
    let started = of_kind(&second, "session_started");
    assert_eq!(started.last().unwrap()["resumed"], true);
    let history = conversation_text(&w.fake.requests().pop().unwrap());
    assert!(history.contains("remember kiwi"), "{history}");
    assert!(history.contains("Kiwi it is."), "{history}");
}

#[tokio::test]
async fn always_allowing_applies_the_cli_suggestion() {
    let w = World::new().await;
    let (agent, ws) = w.agent("default").await;
    let dir = path_of(&ws["path"]);
    w.fake.push(Reply::tool(
        "Write",
        json!({"file_path": dir.join("one.txt"), "content": "1\n"}),
    ));
    w.fake.push(Reply::tool(
        "Write",
        json!({"file_path": dir.join("two.txt"), "content": "2\n"}),
    ));
    w.fake.push(Reply::text("Both written."));
    let mut stream = w.app.events(&agent, None).await;
    w.app.prompt(&agent, "write two files").await;
    let before = stream.until("permission_requested", LONG).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    w.answer_with(
        &agent,
        &request,
        json!({"behavior": "allow", "option_id": "allow_always"}),
    )
    .await;
    let after = stream.until("turn_completed", LONG).await;
    let k = kinds(&after);
    assert_eq!(outcome(&after)["outcome"], "completed", "{k:?}");
    // The suggestion for a write is "accept edits for this session": the second write
    // needs no approval, and the mode change is reported.
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    assert_eq!(of_kind(&after, "mode_changed")[0]["mode"], "acceptEdits");
    assert_eq!(std::fs::read_to_string(dir.join("two.txt")).unwrap(), "2\n");
    let agent_now = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(agent_now["mode"], "acceptEdits");
}

/// The text of a tool result as the CLI hands it back: the API's JSON for a success.
fn result_json(result: &fake_anthropic::ToolResult) -> serde_json::Value {
    serde_json::from_str(result.text.trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", result.text))
}

/// The problem code a failed tool result starts with (`<code>: <detail>`).
fn result_code(result: &fake_anthropic::ToolResult) -> String {
    assert!(result.is_error, "a tool error: {}", result.text);
    result
        .text
        .trim()
        .split(':')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// The `agentry` MCP server from inside Claude Code (sandboxed as the server runs every
/// agent): the model calls `create_agent`, which opens a child mock agent; it waits for
/// it and reports its answer. Another team's workspace is `not_found` to the parent and
/// to a Claude child; the depth and children limits are tool errors with their codes; the
/// parent's timeline links its children; archiving the parent archives them, and its
/// token stops working.
#[tokio::test]
async fn an_agent_opens_and_waits_for_a_child_through_the_agentry_mcp_server() {
    use fake_anthropic::{first_message_text, offers_tool, tool_results};

    const CREATE: &str = "mcp__agentry__create_agent";
    const WAIT: &str = "mcp__agentry__wait_for_agent";
    const DIFF: &str = "mcp__agentry__get_diff";
    let w = World::new_with(|s| {
        s.limits.max_agent_depth = 1;
        s.limits.max_children_per_agent = 2;
        // The CLI would otherwise hide MCP tools behind its ToolSearch tool, for the
        // model to load first; this fake model calls them directly.
        let claude = s.providers.get_mut("claude").unwrap();
        claude
            .env
            .insert("ENABLE_TOOL_SEARCH".into(), "false".into());
    })
    .await;
    let (parent, ws) = w.agent("bypassPermissions").await;
    let ws_id = ws["id"].as_str().unwrap().to_owned();
    // Another team (the admin's second), with a workspace of its own.
    let other = w
        .app
        .post_ok("/v1/teams", json!({"name": "elsewhere"}), 201)
        .await;
    let other_repo = git_repo();
    let project = w
        .app
        .post_ok(
            "/v1/projects",
            json!({"name": "elsewhere", "repo_path": other_repo.path(), "team_id": other["id"]}),
            201,
        )
        .await;
    let foreign = w
        .app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let foreign = foreign["id"].as_str().unwrap().to_owned();

    // The model: each step decided by what the tools answered so far. The parent opens a
    // mock child, waits for it, tries another team's workspace, opens a Claude child,
    // waits for it, tries a third child and reports. The Claude child (its prompt says
    // GRANDCHILD) reads another team's diff, then tries to open a child of its own.
    let (ws2, foreign2) = (ws_id.clone(), foreign.clone());
    w.fake.respond_with(move |req| {
        if !offers_tool(req, CREATE) {
            let offered: Vec<&str> = req["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["name"].as_str())
                .collect();
            return Reply::text(&format!("No agentry tools were offered, only {offered:?}."));
        }
        let results = tool_results(req);
        // What wait_for_agent said the child's last message was: the CLI hands the model
        // the tool's structured result when there is one, else its text.
        let last_message = |i: usize| {
            let text = &results[i].text;
            match serde_json::from_str::<Value>(text.trim()) {
                Ok(v) => v["last_assistant_message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                Err(_) => text
                    .split_once("last assistant message:")
                    .map(|(_, m)| m.trim().to_owned())
                    .unwrap_or_default(),
            }
        };
        if first_message_text(req).contains("GRANDCHILD") {
            return match results.len() {
                0 => Reply::tool(DIFF, json!({"workspace_id": foreign2})),
                1 => Reply::tool(CREATE, json!({"provider": "mock", "workspace_id": ws2})),
                _ => Reply::text(&format!(
                    "Refused: {} then {}",
                    result_code(&results[0]),
                    result_code(&results[1])
                )),
            };
        }
        match results.len() {
            0 => Reply::tool(
                CREATE,
                json!({"provider": "mock", "workspace_id": ws2, "title": "mock child",
                       "prompt": "hello from the parent"}),
            ),
            1 => Reply::tool(
                WAIT,
                json!({"agent_id": result_json(&results[0])["id"], "timeout_s": 30}),
            ),
            2 => Reply::tool(
                CREATE,
                json!({"provider": "mock", "workspace_id": foreign2}),
            ),
            3 => Reply::tool(
                CREATE,
                json!({"provider": "claude", "workspace_id": ws2, "mode": "bypassPermissions",
                       "title": "claude child", "prompt": "GRANDCHILD: open one more"}),
            ),
            4 => Reply::tool(
                WAIT,
                json!({"agent_id": result_json(&results[3])["id"], "timeout_s": 90}),
            ),
            5 => Reply::tool(CREATE, json!({"provider": "mock", "workspace_id": ws2})),
            _ => Reply::text(&format!(
                "The child answered: {}. The other said: {}. The third: {}.",
                last_message(1),
                last_message(4),
                result_code(&results[5])
            )),
        }
    });

    let mut stream = w.app.events(&parent, None).await;
    w.app.prompt(&parent, "open a child and report").await;
    // The parent's token, from its CLI's MCP configuration, while the CLI runs: a file
    // of its process's own, named on the command line; no command line of the agent's
    // processes (the sandbox, the bridge, the CLI) carries the token.
    let pid = w.pid(&parent).await;
    let argvs: Vec<Vec<String>> = process_tree(pid as u32)
        .into_iter()
        .filter_map(command_line)
        .collect();
    assert!(argvs.len() >= 2, "{argvs:?}");
    let config = argvs
        .iter()
        .find_map(|argv| {
            let at = argv.iter().position(|a| a == "--mcp-config")?;
            argv.get(at + 1).cloned()
        })
        .expect("the CLI is given an MCP configuration");
    let config_path = std::path::Path::new(&config);
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(config_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{config}");
    let config: Value = serde_json::from_slice(&std::fs::read(config_path).unwrap()).unwrap();
    let token = config["mcpServers"]["agentry"]["headers"]["Authorization"]
        .as_str()
        .and_then(|h| h.strip_prefix("Bearer "))
        .expect("the agentry MCP server with the agent's token")
        .to_owned();
    assert!(token.starts_with("agt_pat_"), "{token}");
    for argv in &argvs {
        assert!(
            !argv
                .iter()
                .any(|a| a.contains(&token) || a.contains("agt_pat_")),
            "a token on a command line: {argv:?}"
        );
    }
    let events = stream
        .until("turn_completed", Duration::from_secs(240))
        .await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert_eq!(
        last_message(&events),
        "The child answered: You said: hello from the parent. \
         The other said: Refused: not_found then agent_depth_exceeded. \
         The third: agent_children_exceeded.",
        "{}",
        conversation_text(&w.fake.requests().pop().unwrap())
    );

    // The children carry their parent; the parent's calls link them.
    let children = w
        .app
        .get_ok(&format!("/v1/agents?parent_agent_id={parent}"))
        .await;
    let children: Vec<Value> = children["items"].as_array().unwrap().clone();
    assert_eq!(children.len(), 2, "{children:?}");
    for c in &children {
        assert_eq!(c["parent_agent_id"], parent.as_str(), "{c}");
        assert_eq!(c["depth"], 1, "{c}");
    }
    let timeline = w.app.timeline(&parent).await;
    let calls: Vec<&Value> = timeline
        .iter()
        .filter(|e| e["kind"] == "tool_call" && e["data"]["name"] == CREATE)
        .map(|e| &e["data"])
        .filter(|d| d["status"] == "completed" || d["status"] == "failed")
        .collect();
    let linked: Vec<&str> = calls
        .iter()
        .filter_map(|d| d["child_agent"].as_str())
        .collect();
    let mut ids: Vec<&str> = children.iter().map(|c| c["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    let mut sorted = linked.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, ids, "{calls:?}");
    let failed: Vec<&str> = calls
        .iter()
        .filter(|d| d["status"] == "failed")
        .map(|d| d["error"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(failed.len(), 2, "{calls:?}");
    assert!(failed[0].starts_with("not_found"), "{failed:?}");
    assert!(
        failed[1].starts_with("agent_children_exceeded"),
        "{failed:?}"
    );
    assert!(
        calls
            .iter()
            .filter(|d| d["status"] == "failed")
            .all(|d| d["child_agent"].is_null())
    );
    // The token never shows in the timeline.
    assert!(
        !serde_json::to_string(&timeline).unwrap().contains(&token),
        "the token is in the timeline"
    );

    // Archiving the parent archives its children; its token dies with it.
    let agents = w
        .app
        .client
        .get(w.app.url("/v1/agents"))
        .bearer_auth(&token);
    assert_eq!(agents.send().await.unwrap().status(), 200);
    let res = w.app.delete(&format!("/v1/agents/{parent}")).await;
    assert_eq!(res.status(), 204);
    for c in &children {
        let c = w
            .app
            .get_ok(&format!("/v1/agents/{}", c["id"].as_str().unwrap()))
            .await;
        assert!(!c["archived_at"].is_null(), "{c}");
    }
    let refused = w
        .app
        .client
        .get(w.app.url("/v1/agents"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "token_revoked", "{problem}");
}
