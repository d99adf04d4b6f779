use super::*;

fn config(args: &[&str], env: &[(&str, &str)]) -> CliConfig {
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "codex", None);
    cfg.args = args.iter().map(|s| s.to_string()).collect();
    cfg.pass_env.clear();
    cfg.env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    cfg
}

#[test]
fn credentials_come_from_a_key_a_login_file_or_a_custom_provider() {
    let none = |_: &std::path::Path| false;
    let home = [("HOME", "/h"), ("CODEX_HOME", "/ch")];
    let err = credentials(&config(&[], &home), none).unwrap_err();
    assert!(
        err.contains("OPENAI_API_KEY") && err.contains("/ch/auth.json"),
        "{err}"
    );
    assert!(credentials(&config(&[], &[("OPENAI_API_KEY", "k")]), none).is_ok());
    assert!(credentials(&config(&[], &[("CODEX_API_KEY", "k")]), none).is_ok());
    let only_home = |p: &std::path::Path| p == std::path::Path::new("/h/.codex/auth.json");
    assert!(credentials(&config(&[], &[("HOME", "/h")]), only_home).is_ok());

    let custom = [
        "-c",
        "model_provider=fake",
        "-c",
        r#"model_providers.fake={name="Fake",base_url="http://x/v1",env_key="FAKE_KEY"}"#,
    ];
    let err = credentials(&config(&custom, &[("OPENAI_API_KEY", "k")]), none).unwrap_err();
    assert!(err.contains("`fake`") && err.contains("FAKE_KEY"), "{err}");
    assert!(credentials(&config(&custom, &[("FAKE_KEY", "k")]), none).is_ok());
    let keyless = [
        "-c",
        "model_provider=local",
        "--config=model_providers.local.base_url=\"http://x\"",
    ];
    assert!(credentials(&config(&keyless, &[]), none).is_ok());
    // A built-in provider name is not a custom one: the usual credentials apply.
    assert!(credentials(&config(&["-c", "model_provider=openai"], &[]), none).is_err());
}

#[test]
fn mcp_servers_become_config_overrides() {
    let servers: BTreeMap<String, Value> = serde_json::from_value(json!({
        "files": {"command": ["npx", "srv"], "args": ["--root", "a b"], "env": {"TOKEN": "t\"x"}},
        "web": {"type": "http", "url": "http://127.0.0.1:1/mcp", "headers": [{"name": "X-K", "value": "v"}]},
        "agentry": {"type": "http", "url": "http://127.0.0.1:2/mcp", "headers": {"Authorization": "Bearer agt_secret"}},
    }))
    .unwrap();
    let (args, env) = mcp_overrides(&servers, |_| false, &["OPENAI_API_KEY".into()]).unwrap();
    // Header and `env` values are in the environment, by name on the command line.
    assert!(
        !args
            .iter()
            .any(|a| a.contains("agt_secret") || a.contains("\"v\"") || a.contains("t\"x"))
    );
    assert_eq!(env["TOKEN"].expose(), "t\"x");
    assert_eq!(
        env["AGENTRY_MCP_HEADER_TOKEN_0"].expose(),
        "Bearer agt_secret"
    );
    assert_eq!(env["AGENTRY_MCP_HEADER_TOKEN_1"].expose(), "v");
    assert_eq!(
        args,
        [
            "-c",
            r#"mcp_servers.agentry.url="http://127.0.0.1:2/mcp""#,
            "-c",
            r#"mcp_servers.agentry.env_http_headers={ "Authorization" = "AGENTRY_MCP_HEADER_TOKEN_0" }"#,
            "-c",
            r#"mcp_servers.files.command="npx""#,
            "-c",
            r#"mcp_servers.files.args=["srv", "--root", "a b"]"#,
            "-c",
            r#"mcp_servers.files.env_vars=["TOKEN"]"#,
            "-c",
            r#"mcp_servers.web.url="http://127.0.0.1:1/mcp""#,
            "-c",
            r#"mcp_servers.web.env_http_headers={ "X-K" = "AGENTRY_MCP_HEADER_TOKEN_1" }"#,
            "-c",
            r#"shell_environment_policy.exclude=["OPENAI_API_KEY", "AGENTRY_MCP_HEADER_TOKEN_0", "AGENTRY_MCP_HEADER_TOKEN_1", "TOKEN"]"#,
        ]
    );
    let bad: BTreeMap<String, Value> =
        serde_json::from_value(json!({"a.b": {"command": "x"}})).unwrap();
    assert!(mcp_overrides(&bad, |_| false, &[]).is_err());
    // A variable the CLI is given, or one two servers give different values, cannot
    // travel in the CLI's environment.
    let taken = |var: &str| var == "PATH";
    let path: BTreeMap<String, Value> =
        serde_json::from_value(json!({"a": {"command": "x", "env": {"PATH": "/opt"}}})).unwrap();
    assert!(mcp_overrides(&path, taken, &[]).is_err());
    let clash: BTreeMap<String, Value> = serde_json::from_value(json!({
        "a": {"command": "x", "env": {"K": "1"}},
        "b": {"command": "y", "env": {"K": "2"}},
    }))
    .unwrap();
    assert!(mcp_overrides(&clash, taken, &[]).is_err());
    let shared: BTreeMap<String, Value> = serde_json::from_value(json!({
        "a": {"command": "x", "env": {"K": "1"}},
        "b": {"command": "y", "env": {"K": "1"}},
    }))
    .unwrap();
    assert_eq!(
        mcp_overrides(&shared, taken, &[]).unwrap().1["K"].expose(),
        "1"
    );
}

#[test]
fn modes_are_policies() {
    assert_eq!(policy("read-only", false).unwrap().0, "untrusted");
    assert_eq!(policy("auto", false).unwrap().1, "workspace-write");
    assert_eq!(
        policy("full-access", false).unwrap().2,
        json!({"type": "dangerFullAccess"})
    );
    assert!(policy("yolo", false).is_none());
    assert!(MODES.iter().all(|m| policy(m.0, false).is_some()));
    // Inside agentry's sandbox `auto` leaves confinement to it; `read-only` keeps Codex's.
    assert_eq!(
        policy("auto", true).unwrap(),
        (
            "on-request",
            "danger-full-access",
            json!({"type": "dangerFullAccess"})
        )
    );
    assert_eq!(policy("read-only", true), policy("read-only", false));
}

#[test]
fn the_catalog_skips_hidden_models() {
    let page = json!({"data": [
        {"id": "a", "displayName": "A", "isDefault": true, "hidden": false},
        {"id": "h", "displayName": "H", "hidden": true},
        {"id": "b", "model": "b"},
    ], "nextCursor": null});
    let models = catalog(&page);
    let ids: Vec<(&str, &str, bool)> = models
        .iter()
        .map(|m| (m.id.as_str(), m.label.as_str(), m.is_default))
        .collect();
    assert_eq!(ids, [("a", "A", true), ("b", "b", false)]);
}

// ---- recorded transcripts (tests/fixtures/codex, captured from the CLI in tests/codex.rs)

fn fixture(name: &str) -> Vec<Value> {
    let path = format!("{}/tests/fixtures/codex/{name}", env!("CARGO_MANIFEST_DIR"));
    json_lines(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
}

/// Everything the mapping makes of a transcript, in order.
fn replay(name: &str) -> Vec<Mapped> {
    let mut mapper = Mapper::default();
    let mut out = Vec::new();
    for message in fixture(name) {
        let params = message.get("params").cloned().unwrap_or(Value::Null);
        match (message["method"].as_str(), message.get("id")) {
            (Some(method), Some(id)) => {
                let id = RequestId::Number(id.as_i64().unwrap());
                out.extend(mapper.request(id, method, &params));
            }
            (Some(method), None) => out.extend(mapper.notification(method, &params)),
            _ => {}
        }
    }
    out
}

test_support::events_in_event_variant!(Mapped);

fn text(mapped: &[Mapped], reasoning: bool) -> String {
    events(mapped)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::AssistantDelta { text, .. } if !reasoning => Some(text.as_str()),
            ProviderEvent::AssistantMessage { text, .. } if !reasoning => Some(text.as_str()),
            ProviderEvent::ReasoningDelta { text, .. } if reasoning => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// The turns' ends, with their outcome and usage.
fn turn_ends(mapped: &[Mapped]) -> Vec<(TurnOutcome, Option<Usage>)> {
    test_support::turn_ends(mapped)
        .into_iter()
        .map(|(outcome, _, usage)| (outcome, usage))
        .collect()
}

use crate::domain::{ToolKind, ToolStatus};
use crate::providers::test_support::{self, Direct, events, json_lines, tool_calls};
use crate::providers::{ChangeKind, Usage};

#[test]
fn a_text_turn_streams_text_and_reasoning_and_ends_with_the_turns_usage() {
    let mapped = replay("text_turn.jsonl");
    assert!(
        matches!(mapped.first(), Some(Mapped::TurnStarted { .. })),
        "{mapped:?}"
    );
    assert_eq!(text(&mapped, false), "Hello from the fake model.");
    assert_eq!(text(&mapped, true), "Thinking it over.");
    // The message streamed, so its completion adds nothing; the prompt's echo is dropped.
    assert!(
        !events(&mapped)
            .iter()
            .any(|e| matches!(e, ProviderEvent::AssistantMessage { .. }))
    );
    let ids: Vec<_> = events(&mapped)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::AssistantDelta { message_id, .. } => message_id.clone(),
            _ => None,
        })
        .collect();
    assert!(ids.iter().all(|id| id == "msg_1"), "{ids:?}");
    let ends = turn_ends(&mapped);
    assert_eq!(ends.len(), 1);
    let (outcome, usage) = &ends[0];
    assert_eq!(*outcome, TurnOutcome::Completed);
    let usage = usage.as_ref().expect("the turn's usage");
    assert_eq!((usage.input_tokens, usage.output_tokens), (100, 20));
    assert_eq!(usage.context_window_used, Some(120));
    assert!(usage.context_window_max.is_some());
}

#[test]
fn an_approved_command_asks_then_completes_and_the_usage_sums_the_turns_calls() {
    let mapped = replay("approve_command.jsonl");
    let calls = tool_calls(&mapped);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (calls[0].status, calls[0].tool_kind),
        (ToolStatus::Running, ToolKind::Shell)
    );
    assert!(
        calls[0].input["command"]
            .as_str()
            .unwrap()
            .contains("echo hello > out.txt")
    );
    assert_eq!(calls[1].status, ToolStatus::Completed);
    assert_eq!(calls[1].output, Some(json!({"output": "", "exit_code": 0})));
    let asks: Vec<_> = mapped
        .iter()
        .filter_map(|m| match m {
            Mapped::Ask { id, ask } => Some((id, ask)),
            _ => None,
        })
        .collect();
    assert_eq!(asks.len(), 1);
    let (id, ask) = asks[0];
    assert_eq!(*id, RequestId::Number(0));
    assert_eq!(ask.call_id.as_deref(), Some("call_1"));
    assert_eq!(
        ask.input.as_ref().unwrap()["reason"],
        "The file must be written."
    );
    let options: Vec<&str> = ask.options.iter().map(|o| o.id.as_str()).collect();
    // Codex did not offer `acceptForSession` here.
    assert_eq!(options, ["accept", "decline"]);
    assert!(
        mapped
            .iter()
            .any(|m| matches!(m, Mapped::Resolved { id } if *id == RequestId::Number(0)))
    );
    let (outcome, usage) = turn_ends(&mapped).pop().unwrap();
    assert_eq!(outcome, TurnOutcome::Completed);
    let usage = usage.unwrap();
    assert_eq!(
        (usage.input_tokens, usage.output_tokens),
        (200, 40),
        "two model calls"
    );
}

#[test]
fn a_declined_command_fails_and_the_turn_completes() {
    let mapped = replay("decline_command.jsonl");
    let last = *tool_calls(&mapped).last().unwrap();
    assert_eq!(last.status, ToolStatus::Failed);
    assert_eq!(last.error.as_deref(), Some("declined by the user"));
    assert_eq!(turn_ends(&mapped)[0].0, TurnOutcome::Completed);
    assert_eq!(text(&mapped, false), "Understood, not running it.");
}

#[test]
fn an_interrupted_turn_is_canceled_and_the_next_one_completes() {
    let mapped = replay("interrupt.jsonl");
    let outcomes: Vec<TurnOutcome> = turn_ends(&mapped).into_iter().map(|(o, _)| o).collect();
    assert_eq!(outcomes, [TurnOutcome::Canceled, TurnOutcome::Completed]);
    let started = mapped
        .iter()
        .filter(|m| matches!(m, Mapped::TurnStarted { .. }))
        .count();
    assert_eq!(started, 2);
}

#[test]
fn a_patch_is_a_write_with_the_new_files_text() {
    let mapped = replay("apply_patch.jsonl");
    let last = *tool_calls(&mapped).last().unwrap();
    assert_eq!(
        (last.tool_kind, last.status),
        (ToolKind::Write, ToolStatus::Completed)
    );
    assert_eq!(last.diff.len(), 1);
    let diff = &last.diff[0];
    assert!(diff.path.ends_with("/hello.txt"));
    assert_eq!(diff.change, ChangeKind::Add);
    assert_eq!(diff.new_text.as_deref(), Some("hello from patch\n"));
    assert_eq!(last.locations[0].path, diff.path);
}

#[test]
fn a_resumed_thread_reports_only_the_new_turns_usage() {
    let mapped = replay("resume.jsonl");
    let usages = events(&mapped)
        .into_iter()
        .filter(|e| matches!(e, ProviderEvent::Usage(_)))
        .count();
    assert_eq!(
        usages, 1,
        "the old totals announced on resume are not a turn's usage"
    );
    let (outcome, usage) = turn_ends(&mapped).pop().unwrap();
    assert_eq!(outcome, TurnOutcome::Completed);
    assert_eq!(usage.unwrap().input_tokens, 100);
    assert_eq!(text(&mapped, false), "I remember.");
}

#[test]
fn binary_output_is_passed_on_for_the_store_to_scrub() {
    let mapped = replay("binary_output.jsonl");
    let done = tool_calls(&mapped)
        .into_iter()
        .find(|c| c.status == ToolStatus::Completed)
        .unwrap();
    assert_eq!(
        done.output.as_ref().unwrap()["output"],
        "a\u{0}b\u{FFFD}c\n"
    );
    assert_eq!(turn_ends(&mapped).len(), 2);
}

#[test]
fn the_recorded_catalog_has_one_default_model() {
    let answer = fixture("model_list.jsonl")
        .into_iter()
        .find(|m| m["id"] == 1)
        .unwrap();
    let models = catalog(&answer["result"]);
    assert!(models.len() > 1);
    assert_eq!(models.iter().filter(|m| m.is_default).count(), 1);
}

#[test]
fn unknown_requests_are_refused_and_withdrawn_ones_reported() {
    let mut mapper = Mapper::default();
    let refused = mapper.request(
        RequestId::Number(3),
        "item/tool/requestUserInput",
        &json!({}),
    );
    assert!(matches!(&refused[..], [Mapped::Refuse { id, .. }] if *id == RequestId::Number(3)));
    let resolved = mapper.notification("serverRequest/resolved", &json!({"requestId": 3}));
    assert!(matches!(&resolved[..], [Mapped::Resolved { id }] if *id == RequestId::Number(3)));
    assert!(
        mapper
            .notification("thread/status/changed", &json!({}))
            .is_empty()
    );
    let failed = mapper.notification(
        "turn/completed",
        &json!({"turn": {"id": "t", "status": "failed", "error": {"message": "quota exceeded"}}}),
    );
    assert!(matches!(
        &failed[..],
        [Mapped::Event(ProviderEvent::TurnEnded { outcome: TurnOutcome::Failed, error: Some(e), .. })] if e == "quota exceeded"
    ));
    assert_eq!(decision_reply(None), json!({"decision": "cancel"}));
    assert_eq!(
        decision_reply(Some("acceptForSession")),
        json!({"decision": "acceptForSession"})
    );
}

#[test]
fn plans_and_updates_of_existing_files_map_to_the_shared_shapes() {
    let mut mapper = Mapper::default();
    let plan = mapper.notification(
        "turn/plan/updated",
        &json!({"plan": [{"step": "a", "status": "completed"}, {"step": "b", "status": "inProgress"}]}),
    );
    let [Mapped::Event(ProviderEvent::Plan { entries })] = &plan[..] else {
        panic!("{plan:?}")
    };
    assert_eq!(entries[1].status, crate::providers::PlanStatus::InProgress);
    let edit = mapper.notification(
        "item/completed",
        &json!({"item": {"type": "fileChange", "id": "c", "status": "completed", "changes": [
            {"path": "/w/a.txt", "kind": {"type": "update", "move_path": "/w/b.txt"}, "diff": "@@ -1 +1 @@\n-a\n+b\n"},
            {"path": "/w/gone.txt", "kind": {"type": "delete"}, "diff": "old\n"},
        ]}}),
    );
    let [Mapped::Event(ProviderEvent::ToolCall(call))] = &edit[..] else {
        panic!("{edit:?}")
    };
    assert_eq!(call.tool_kind, ToolKind::Edit);
    assert_eq!(call.diff[0].change, ChangeKind::Rename);
    assert_eq!(call.diff[0].move_path.as_deref(), Some("/w/b.txt"));
    assert!(call.diff[0].unified.as_deref().unwrap().starts_with("@@"));
    assert_eq!(call.diff[1].change, ChangeKind::Delete);
    assert_eq!(call.diff[1].old_text.as_deref(), Some("old\n"));
}

// ---- the session against a scripted stand-in for the CLI

fn scripted(script: &str, env: &[(&str, &str)], start_timeout: Duration) -> CodexProvider {
    let mut cfg = config(&[], env);
    cfg.command = vec!["sh".into(), "-c".into(), script.into()];
    CodexProvider { cfg, start_timeout }
}

fn spec(cwd: &std::path::Path, mode: &str) -> SessionSpec {
    SessionSpec {
        cwd: cwd.to_owned(),
        model: None,
        mode: Some(mode.into()),
        system_prompt: Some("Be brief.".into()),
        mcp_servers: BTreeMap::new(),
        resume: None,
    }
}

async fn next(rx: &mut mpsc::Receiver<ProviderEvent>) -> ProviderEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("an event in time")
        .expect("the sink is open")
}

const SCRIPTED_CLI: &str = r#"
say() { printf '%s\n' "$1"; }
hear() { read -r line; printf '%s\n' "$line" >> "$LOG"; }
hear; say '{"id":0,"result":{}}'
hear
hear; say '{"id":1,"result":{"thread":{"id":"th1","path":"/r.jsonl"},"model":"m1"}}'
hear; say '{"id":2,"result":{"turn":{"id":"tu1"}}}'
say 'this is not json'
say '{"method":"item/agentMessage/delta","params":{"threadId":"th1","turnId":"tu1","itemId":"m1","delta":"hi"}}'
say '{"method":"item/commandExecution/requestApproval","id":0,"params":{"threadId":"th1","turnId":"tu1","itemId":"c1","command":"ls"}}'
say '{"method":"serverRequest/resolved","params":{"threadId":"th1","requestId":0}}'
say '{"method":"turn/completed","params":{"threadId":"th1","turn":{"id":"tu1","status":"completed"}}}'
hear
echo 'the end' >&2
exit 3
"#;

#[tokio::test]
async fn a_session_speaks_the_protocol_and_survives_bad_lines_until_the_cli_exits() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("heard.jsonl");
    let provider = scripted(
        SCRIPTED_CLI,
        &[("LOG", log.to_str().unwrap())],
        Duration::from_secs(10),
    );
    let (tx, mut rx) = mpsc::channel(64);
    let launcher = Arc::new(Direct::default());
    let (mut session, info) = provider
        .start(spec(dir.path(), "read-only"), launcher.clone(), tx)
        .await
        .unwrap();
    assert_eq!(info.provider_session_id.as_deref(), Some("th1"));
    assert_eq!(
        info.persistence,
        Some(json!({"thread_id": "th1", "path": "/r.jsonl"}))
    );
    assert_eq!(info.current_model.as_deref(), Some("m1"));
    assert_eq!(info.current_mode.as_deref(), Some("read-only"));

    session.set_mode("full-access").await.unwrap();
    assert!(
        matches!(next(&mut rx).await, ProviderEvent::ModeChanged { mode } if mode == "full-access")
    );
    session
        .prompt(TurnInput {
            text: "hello".into(),
        })
        .await
        .unwrap();
    assert!(matches!(
        next(&mut rx).await,
        ProviderEvent::Error { message, .. } if message.contains("not JSON")
    ));
    assert!(
        matches!(next(&mut rx).await, ProviderEvent::AssistantDelta { text, .. } if text == "hi")
    );
    let ProviderEvent::PermissionRequested(request) = next(&mut rx).await else {
        panic!("a permission request")
    };
    assert_eq!(request.call_id.as_deref(), Some("c1"));
    assert!(matches!(
        next(&mut rx).await,
        ProviderEvent::PermissionWithdrawn { provider_request_id } if provider_request_id == "0"
    ));
    assert!(matches!(
        next(&mut rx).await,
        ProviderEvent::TurnEnded {
            outcome: TurnOutcome::Completed,
            ..
        }
    ));
    // The next prompt is read, then the CLI exits.
    session
        .prompt(TurnInput {
            text: "again".into(),
        })
        .await
        .unwrap();
    let ProviderEvent::Exited { reason } = next(&mut rx).await else {
        panic!("the exit is reported")
    };
    assert!(
        reason.contains("status 3") && reason.contains("the end"),
        "{reason}"
    );
    drop(request);

    let heard: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(heard[0]["method"], "initialize");
    assert!(
        heard.iter().all(|m| m.get("jsonrpc").is_none()),
        "no version field"
    );
    assert_eq!(heard[1], json!({"method": "initialized"}));
    let start = &heard[2]["params"];
    assert_eq!(heard[2]["method"], "thread/start");
    assert_eq!(
        (start["approvalPolicy"].as_str(), start["sandbox"].as_str()),
        (Some("untrusted"), Some("read-only"))
    );
    assert_eq!(start["developerInstructions"], "Be brief.");
    let first = &heard[3]["params"];
    assert_eq!(first["threadId"], "th1");
    assert_eq!(first["input"][0]["text"], "hello");
    assert_eq!(
        first["approvalPolicy"], "never",
        "the new mode applies to the next turn"
    );
    assert_eq!(first["sandboxPolicy"], json!({"type": "dangerFullAccess"}));
    assert!(
        heard[4]["params"].get("approvalPolicy").is_none(),
        "sent once"
    );
    session.close().await;
    let pid = launcher.pids()[0];
    assert!(
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_err(),
        "the process is gone (and reaped)"
    );
}

#[tokio::test]
async fn a_cli_that_hangs_at_start_fails_in_bounded_time_and_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let provider = scripted("exec sleep 60", &[], Duration::from_millis(500));
    let (tx, _rx) = mpsc::channel(8);
    let launcher = Arc::new(Direct::default());
    let started = std::time::Instant::now();
    let err = match provider
        .start(spec(dir.path(), "auto"), launcher.clone(), tx)
        .await
    {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a hung CLI cannot start"),
    };
    assert!(err.contains("did not start within"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let pid = launcher.pids()[0];
    assert!(
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_err(),
        "the process is gone (and reaped)"
    );
}

#[tokio::test]
async fn an_unknown_mode_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let provider = scripted("exit 0", &[], Duration::from_secs(1));
    let (tx, _rx) = mpsc::channel(8);
    let launcher = Arc::new(Direct::default());
    let err = provider
        .start(spec(dir.path(), "yolo"), launcher.clone(), tx)
        .await
        .err()
        .expect("refused");
    assert!(
        err.to_string().contains("unknown Codex mode `yolo`"),
        "{err}"
    );
    assert!(launcher.pids().is_empty());
}

#[test]
fn the_key_of_the_chosen_model_provider_is_brokered_through_an_override() {
    let decide = |args: &[&str], vars: &[(&str, &str)]| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let var = |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        };
        broker(&BrokerInput {
            provider: "codex",
            args: &args,
            var: &var,
        })
    };
    let custom = [
        "-c",
        "model_provider=fake",
        "-c",
        r#"model_providers.fake={name="Fake",base_url="http://127.0.0.1:9/v1",env_key="FAKE_KEY"}"#,
    ];
    let b = decide(&custom, &[("FAKE_KEY", "sk-1")]).unwrap();
    assert_eq!(
        b.brokered[0].upstream_base.as_str(),
        "http://127.0.0.1:9/v1"
    );
    assert_eq!(b.brokered[0].headers[0].1.expose(), "Bearer sk-1");
    assert_eq!(
        b.args,
        [
            "-c",
            r#"model_providers.fake.base_url="http://127.0.0.1:3128/openai""#
        ]
    );
    assert_eq!(b.env["FAKE_KEY"], PLACEHOLDER_KEY);
    assert_eq!(b.withhold, ["FAKE_KEY"]);
    // The brokered override comes after the configured ones, so it is the one that holds.
    let mut all: Vec<String> = custom.iter().map(|s| s.to_string()).collect();
    all.extend(b.args.clone());
    assert_eq!(
        provider_field(&config_overrides(&all), "fake", "base_url").as_deref(),
        Some("http://127.0.0.1:3128/openai")
    );
    assert!(
        decide(&custom, &[])
            .unwrap_err()
            .contains("FAKE_KEY is not set")
    );
    let keyless = [
        "-c",
        "model_provider=local",
        "-c",
        r#"model_providers.local.base_url="http://x""#,
    ];
    assert!(decide(&keyless, &[]).unwrap_err().contains("env_key"));
    let elsewhere = ["-c", "model_provider=oss"];
    assert!(decide(&elsewhere, &[]).unwrap_err().contains("base_url"));

    // Codex's own OpenAI provider with a key variable.
    let b = decide(&[], &[("OPENAI_API_KEY", "sk-2")]).unwrap();
    assert_eq!(
        b.brokered[0].upstream_base.as_str(),
        "https://api.openai.com/v1"
    );
    assert_eq!(
        b.args,
        ["-c", r#"openai_base_url="http://127.0.0.1:3128/openai""#]
    );
    assert_eq!(b.withhold, ["OPENAI_API_KEY", "CODEX_API_KEY"]);
    let b = decide(
        &["-c", r#"openai_base_url="https://gw.example/v1""#],
        &[("CODEX_API_KEY", "sk-3")],
    )
    .unwrap();
    assert_eq!(
        b.brokered[0].upstream_base.as_str(),
        "https://gw.example/v1"
    );
    assert_eq!(b.env["CODEX_API_KEY"], PLACEHOLDER_KEY);
    assert!(decide(&[], &[]).unwrap_err().contains("login"));
}
