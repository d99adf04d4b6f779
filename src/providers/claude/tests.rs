//! The mapping driven by transcripts recorded from the real CLI against a fake model
//! (tests/fixtures/claude/*.jsonl), plus the pieces around it: permission answers, the
//! model catalog, the command line, and stdout that is not what it should be.

use std::collections::BTreeMap;

use tokio::sync::mpsc;

use super::*;
use crate::domain::{PermissionKind, ToolKind, ToolStatus, TurnOutcome};
use crate::process::STOP_GRACE;
use crate::providers::ChangeKind;
use crate::providers::test_support::{
    Direct, alive, deltas, events, events_in_event_variant, replay_with, tool_calls, turn_end,
};

const TEXT: &str = include_str!("../../../tests/fixtures/claude/text.jsonl");
const WRITE_ALLOW: &str = include_str!("../../../tests/fixtures/claude/write_allow.jsonl");
const BASH_DENY: &str = include_str!("../../../tests/fixtures/claude/bash_deny.jsonl");
const INTERRUPT: &str = include_str!("../../../tests/fixtures/claude/interrupt.jsonl");
const BASH_NUL: &str = include_str!("../../../tests/fixtures/claude/bash_nul.jsonl");
const EDIT: &str = include_str!("../../../tests/fixtures/claude/edit.jsonl");

/// The session id of a transcript (from its `system/init`).
fn session_of(transcript: &str) -> String {
    transcript
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|m| m["type"] == "system" && m["subtype"] == "init")
        .and_then(|m| m["session_id"].as_str().map(str::to_owned))
        .expect("the transcript has a system/init")
}

events_in_event_variant!(Action);

fn replay(transcript: &str) -> Vec<Action> {
    let mut mapper = Mapper::new(session_of(transcript));
    replay_with(transcript, |m| mapper.map(m))
}

#[test]
fn a_text_turn_streams_text_and_reasoning_and_ends_with_usage() {
    let actions = replay(TEXT);
    assert_eq!(deltas(&actions), "Hello from the fake model.");
    let reasoning: String = events(&actions)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::ReasoningDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, "The user wants a greeting.");
    // Streamed text is not repeated whole; the runtime closes the message.
    assert!(
        !events(&actions)
            .iter()
            .any(|e| matches!(e, ProviderEvent::AssistantMessage { .. }))
    );
    let ids: Vec<Option<&str>> = events(&actions)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::AssistantDelta { message_id, .. } => Some(message_id.as_deref()),
            _ => None,
        })
        .collect();
    assert!(
        ids.iter()
            .all(|id| id.is_some_and(|id| id.starts_with("msg_")))
    );

    let (outcome, error, usage) = turn_end(&actions);
    assert_eq!((outcome, error), (TurnOutcome::Completed, None));
    let usage = usage.expect("usage");
    assert_eq!(usage.input_tokens, 25);
    assert_eq!(usage.output_tokens, 15);
    assert!(usage.context_window_max.is_some_and(|w| w >= 200_000));
    assert_eq!(usage.context_window_used, Some(40));
    assert!(usage.cost_usd.is_some_and(|c| c > 0.0));
    assert!(
        events(&actions)
            .iter()
            .any(|e| matches!(e, ProviderEvent::Usage(u) if *u == usage)),
        "usage is also reported on its own"
    );
    // The initialize answer is routed back, and the mode is reported.
    assert!(actions.iter().any(|a| matches!(a,
        Action::ControlResponse { request_id, result: Ok(r) } if request_id == "agentry_1" && r["models"].is_array())));
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::ModeReported(m) if m == "default"))
    );
    // The id was ours: nothing to update.
    assert!(
        !events(&actions)
            .iter()
            .any(|e| matches!(e, ProviderEvent::SessionUpdated { .. }))
    );
}

#[test]
fn a_session_id_other_than_ours_is_reported() {
    let mut mapper = Mapper::new("ours");
    let init = TEXT
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|m| m["subtype"] == "init")
        .unwrap();
    let actions = mapper.map(&init);
    let theirs = session_of(TEXT);
    assert!(events(&actions).iter().any(|e| matches!(e,
        ProviderEvent::SessionUpdated { provider_session_id: Some(id), persistence: Some(p) }
            if *id == theirs && p["session_id"] == theirs.as_str())));
    assert_eq!(mapper.session_id(), theirs);

    // A new session announces its own id once, at its first init.
    let mut fresh = Mapper::new(theirs.clone()).announcing();
    let first = fresh.map(&init);
    assert!(matches!(events(&first).as_slice(),
        [ProviderEvent::SessionUpdated { provider_session_id: Some(id), persistence: Some(_) }] if *id == theirs));
    assert!(events(&fresh.map(&init)).is_empty());
    assert!(
        !events(&mapper.map(&init))
            .iter()
            .any(|e| matches!(e, ProviderEvent::SessionUpdated { .. }))
    );
}

#[test]
fn a_write_asks_then_completes_with_its_diff() {
    let actions = replay(WRITE_ALLOW);
    let permission = actions
        .iter()
        .find_map(|a| match a {
            Action::Permission(p) => Some(p),
            _ => None,
        })
        .expect("a can_use_tool request");
    assert_eq!(permission.tool_name, "Write");
    assert_eq!(permission.kind, PermissionKind::Tool);
    assert!(permission.title.starts_with("Write: "));
    assert!(permission.suggestions.is_some());
    assert_eq!(permission.input["content"], "hello\n");

    let calls = tool_calls(&actions);
    assert_eq!(calls.len(), 2);
    let (running, done) = (calls[0], calls[1]);
    assert_eq!(
        permission.call_id.as_deref(),
        Some(running.call_id.as_str())
    );
    assert_eq!(running.tool_kind, ToolKind::Write);
    assert_eq!(running.status, ToolStatus::Running);
    assert_eq!(
        running.locations[0].path,
        "/tmp/cl/ws_write_allow/hello.txt"
    );
    assert_eq!(running.diff[0].change, ChangeKind::Add);
    assert_eq!(running.diff[0].new_text.as_deref(), Some("hello\n"));
    assert_eq!(done.call_id, running.call_id);
    assert_eq!(done.status, ToolStatus::Completed);
    assert_eq!(done.tool_kind, ToolKind::Write);
    assert_eq!(done.output.as_ref().unwrap()["type"], "create");
    assert_eq!(done.diff[0].change, ChangeKind::Add);
    assert_eq!(turn_end(&actions).0, TurnOutcome::Completed);
    // Text of a message that also carried a tool call was streamed once.
    assert_eq!(deltas(&actions), "I will write it.Written.");
}

#[test]
fn a_denied_command_fails_its_call_and_the_turn_completes() {
    let actions = replay(BASH_DENY);
    let calls = tool_calls(&actions);
    assert_eq!(calls[0].tool_kind, ToolKind::Shell);
    assert_eq!(calls[0].title, "Bash: write a file");
    let failed = calls.last().unwrap();
    assert_eq!(failed.status, ToolStatus::Failed);
    assert!(
        failed
            .error
            .as_deref()
            .unwrap()
            .contains("not on this machine")
    );
    assert_eq!(turn_end(&actions).0, TurnOutcome::Completed);
}

#[test]
fn an_interrupted_turn_ends_failed_for_the_runtime_to_cancel() {
    let actions = replay(INTERRUPT);
    assert_eq!(deltas(&actions), "one two ");
    let (outcome, error, _) = turn_end(&actions);
    assert_eq!(outcome, TurnOutcome::Failed);
    assert!(error.unwrap().contains("failed while running"));
    // The CLI's "[Request interrupted by user]" is not the assistant speaking.
    assert!(
        !events(&actions)
            .iter()
            .any(|e| matches!(e, ProviderEvent::AssistantMessage { .. }))
    );
}

#[test]
fn shell_output_keeps_its_bytes_for_the_writer_to_clean() {
    let actions = replay(BASH_NUL);
    let done = *tool_calls(&actions).last().unwrap();
    assert_eq!(done.status, ToolStatus::Completed);
    assert_eq!(done.output.as_ref().unwrap()["stdout"], "left\u{0}right");
}

#[test]
fn an_edit_carries_old_and_new_text_then_the_unified_patch() {
    let actions = replay(EDIT);
    let calls = tool_calls(&actions);
    let edit: Vec<_> = calls.iter().filter(|c| c.name == "Edit").collect();
    assert_eq!(edit.len(), 2);
    assert_eq!(edit[0].tool_kind, ToolKind::Edit);
    assert_eq!(edit[0].diff[0].change, ChangeKind::Modify);
    assert_eq!(edit[0].diff[0].old_text.as_deref(), Some("two"));
    assert_eq!(edit[0].diff[0].new_text.as_deref(), Some("three"));
    assert_eq!(
        edit[1].diff[0].unified.as_deref(),
        Some("@@ -1,2 +1,2 @@\n one\n-two\n+three\n")
    );
    assert_eq!(edit[1].status, ToolStatus::Completed);
    // Nothing asked in acceptEdits.
    assert!(!actions.iter().any(|a| matches!(a, Action::Permission(_))));
}

#[test]
fn tool_names_map_to_kinds() {
    for (name, kind) in [
        ("Bash", ToolKind::Shell),
        ("Read", ToolKind::Read),
        ("Write", ToolKind::Write),
        ("Edit", ToolKind::Edit),
        ("MultiEdit", ToolKind::Edit),
        ("Grep", ToolKind::Search),
        ("Glob", ToolKind::Search),
        ("WebFetch", ToolKind::Fetch),
        ("WebSearch", ToolKind::Fetch),
        ("mcp__files__read", ToolKind::Mcp),
        ("Task", ToolKind::Other),
    ] {
        assert_eq!(mapping::tool_kind(name), kind, "{name}");
    }
}

#[test]
fn sub_agent_calls_name_their_parent_and_their_text_stays_out() {
    let mut mapper = Mapper::new("s");
    let actions = mapper.map(&json!({"type": "assistant", "parent_tool_use_id": "toolu_task",
        "message": {"id": "msg_sub", "content": [
            {"type": "text", "text": "sub-agent musing"},
            {"type": "tool_use", "id": "toolu_inner", "name": "MultiEdit",
             "input": {"file_path": "/w/a", "edits": [
                {"old_string": "a", "new_string": "b"}, {"old_string": "c", "new_string": "d"}]}}]}}));
    let calls = tool_calls(&actions);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].parent_call_id.as_deref(), Some("toolu_task"));
    assert_eq!(calls[0].diff.len(), 2);
    assert_eq!(events(&actions).len(), 1);
}

#[test]
fn control_traffic_is_routed() {
    let mut mapper = Mapper::new("s");
    assert!(matches!(
        mapper.map(&json!({"type": "control_cancel_request", "request_id": "r9"})).as_slice(),
        [Action::Withdrawn { request_id }] if request_id == "r9"));
    assert!(matches!(
        mapper.map(&json!({"type": "control_request", "request_id": "h1",
            "request": {"subtype": "hook_callback"}})).as_slice(),
        [Action::Unsupported { request_id, subtype }] if request_id == "h1" && subtype == "hook_callback"));
    assert!(matches!(
        mapper.map(&json!({"type": "control_response", "response": {"subtype": "error",
            "request_id": "agentry_3", "error": "no such model"}})).as_slice(),
        [Action::ControlResponse { result: Err(e), .. }] if e == "no such model"));
    assert!(matches!(
        mapper.map(&json!({"type": "system", "subtype": "status", "status": null,
            "permissionMode": "acceptEdits"})).as_slice(),
        [Action::ModeReported(m)] if m == "acceptEdits"));
    assert!(mapper.map(&json!({"type": "rate_limit_event"})).is_empty());
    assert!(mapper.map(&json!({"no": "type"})).is_empty());
    assert!(mapper.map(&json!([1, 2])).is_empty());
}

#[test]
fn permission_answers_follow_the_decision() {
    let stored = json!({"input": {"command": "ls"}, "suggestions": [{"type": "addRules"}]});
    let allow = |option: &str, updated: Option<Value>| {
        permission_response(
            PermissionDecision::Selected {
                option_id: option.into(),
                behavior: Behavior::Allow,
                message: None,
                updated_input: updated,
            },
            stored.clone(),
        )
    };
    assert_eq!(
        allow("allow", None),
        json!({"behavior": "allow", "updatedInput": {"command": "ls"}})
    );
    assert_eq!(
        allow("allow", Some(json!({"command": "ls -a"})))["updatedInput"],
        json!({"command": "ls -a"})
    );
    assert_eq!(
        allow("allow_always", None)["updatedPermissions"],
        json!([{"type": "addRules"}])
    );
    let deny = permission_response(
        PermissionDecision::Selected {
            option_id: "deny".into(),
            behavior: Behavior::Deny,
            message: Some("no".into()),
            updated_input: None,
        },
        stored.clone(),
    );
    assert_eq!(deny, json!({"behavior": "deny", "message": "no"}));
    let cancelled = permission_response(PermissionDecision::Cancelled, stored);
    assert_eq!(cancelled["behavior"], "deny");
    assert_eq!(cancelled["interrupt"], true);
}

#[test]
fn the_catalog_comes_from_the_initialize_answer() {
    let first: Value = serde_json::from_str(TEXT.lines().next().unwrap()).unwrap();
    let models = models_of(&first["response"]["response"]);
    assert!(models.len() >= 3);
    let default = models.iter().find(|m| m.id == "default").unwrap();
    assert!(default.is_default);
    assert!(default.label.starts_with("Default"));
    assert!(models.iter().filter(|m| m.is_default).count() == 1);
}

#[test]
fn no_header_of_an_mcp_server_is_on_the_command_line() {
    let spec = SessionSpec {
        cwd: "/w".into(),
        model: None,
        mode: None,
        system_prompt: None,
        mcp_servers: BTreeMap::from([(
            "agentry".to_owned(),
            json!({"type": "http", "url": "http://127.0.0.1:9/mcp",
                   "headers": {"Authorization": "Bearer agt_secret-token"}}),
        )]),
        resume: None,
    };
    let flags = session_flags(&spec, "abc", false);
    assert!(
        !flags.iter().any(|f| f.contains("secret-token")),
        "{flags:?}"
    );
    let files = session_files(&spec);
    assert!(files[0].1.expose().contains("Bearer agt_secret-token"));
}

#[test]
fn the_command_line_opens_or_resumes_a_session() {
    let spec = SessionSpec {
        cwd: "/w".into(),
        model: Some("sonnet".into()),
        mode: Some("plan".into()),
        system_prompt: Some("be brief".into()),
        mcp_servers: BTreeMap::from([
            (
                "files".to_owned(),
                json!({"command": ["mcp-files", "--root"], "args": ["."], "env": {"T": "1"}}),
            ),
            (
                "web".to_owned(),
                json!({"type": "http", "url": "https://m.example"}),
            ),
            ("broken".to_owned(), json!({"args": []})),
        ]),
        resume: None,
    };
    let fresh = session_flags(&spec, "abc", false);
    assert!(fresh.contains(&"--session-id=abc".to_owned()));
    assert!(!fresh.iter().any(|f| f.starts_with("--resume")));
    for pair in [
        ["--model", "sonnet"],
        ["--permission-mode", "plan"],
        ["--append-system-prompt", "be brief"],
        ["--permission-prompt-tool", "stdio"],
    ] {
        assert!(fresh.windows(2).any(|w| w == pair), "{pair:?} in {fresh:?}");
    }
    // The configuration is a private file of the process, named on the command line.
    let at = fresh.iter().position(|f| f == "--mcp-config").unwrap();
    assert_eq!(
        fresh[at + 1],
        crate::process::private_file_arg(MCP_CONFIG_FILE)
    );
    let files = session_files(&spec);
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].0, MCP_CONFIG_FILE);
    let config: Value = serde_json::from_str(files[0].1.expose()).unwrap();
    assert_eq!(
        config,
        json!({"mcpServers": {
            "files": {"type": "stdio", "command": "mcp-files", "args": ["--root", "."], "env": {"T": "1"}},
            "web": {"type": "http", "url": "https://m.example"}}})
    );
    assert!(fresh.contains(&"--strict-mcp-config".to_owned()));

    let bare = SessionSpec {
        mcp_servers: BTreeMap::new(),
        model: None,
        mode: None,
        system_prompt: None,
        ..spec
    };
    assert!(session_files(&bare).is_empty());
    let resumed = session_flags(&bare, "abc", true);
    assert!(resumed.contains(&"--resume=abc".to_owned()));
    assert!(
        !resumed
            .iter()
            .any(|f| f.starts_with("--session-id") || f == "--mcp-config")
    );
}

/// A session's shared state over in-memory pipes, with its event receiver.
fn shared() -> (Arc<Shared>, mpsc::Receiver<ProviderEvent>) {
    let (tx, rx) = mpsc::channel(64);
    let (stdin, _reader) = tokio::io::duplex(1 << 16);
    let shared = Arc::new(Shared {
        io: Io::new(tx, stdin, StderrTail::default()),
        session_id: Mutex::new("s".into()),
        controls: Pending::default(),
        permissions: Mutex::new(HashMap::new()),
        mode: Mutex::new(Some("default".into())),
    });
    (shared, rx)
}

#[tokio::test]
async fn bad_output_is_reported_and_reading_goes_on() {
    let (shared, mut rx) = shared();
    let mut input = Vec::new();
    input.extend_from_slice(b"not json at all\n");
    input.extend_from_slice(b"\0\xff\xfe{\n");
    input.extend_from_slice(&vec![b'x'; crate::providers::stdio::MAX_LINE + 10]);
    input.push(b'\n');
    input.extend_from_slice(b"\n");
    input.extend_from_slice(br#"{"type":"system","subtype":"status","permissionMode":"plan"}"#);
    input.push(b'\n');
    let broken = CLI.read(&input[..], shared, Mapper::new("s")).await;
    assert!(broken.is_none());
    let mut got = Vec::new();
    while let Ok(event) = rx.try_recv() {
        got.push(event);
    }
    let codes: Vec<_> = got
        .iter()
        .filter_map(|e| match e {
            ProviderEvent::Error { code, .. } => code.as_deref(),
            _ => None,
        })
        .collect();
    assert_eq!(codes, ["provider_output_invalid"; 3]);
    assert!(matches!(got.last(), Some(ProviderEvent::ModeChanged { mode }) if mode == "plan"));
}

#[tokio::test]
async fn a_mode_already_known_is_not_reported_again() {
    let (shared, mut rx) = shared();
    let mut mapper = Mapper::new("s");
    let status = json!({"type": "system", "subtype": "status", "permissionMode": "default"});
    shared.handle(&mut mapper, &status).await;
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn a_withdrawn_request_expires_and_its_late_answer_goes_nowhere() {
    let (shared, mut rx) = shared();
    let mut mapper = Mapper::new("s");
    let request = WRITE_ALLOW
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|m| m["type"] == "control_request")
        .unwrap();
    shared.handle(&mut mapper, &request).await;
    let ProviderEvent::PermissionRequested(raised) = rx.recv().await.unwrap() else {
        panic!("a permission request");
    };
    assert_eq!(raised.options.len(), 3, "allow, always, deny");
    let id = raised.provider_request_id.clone();
    shared
        .handle(
            &mut mapper,
            &json!({"type": "control_cancel_request", "request_id": id}),
        )
        .await;
    assert!(matches!(rx.recv().await.unwrap(),
        ProviderEvent::PermissionWithdrawn { provider_request_id } if provider_request_id == id));
    assert!(lock(&shared.permissions).is_empty());
}

/// Spawns directly (no ledger) and remembers the pids it started.
/// A provider whose "CLI" is the shell script `script` (the protocol flags become its
/// positional arguments).
fn scripted(script: &str, start_timeout: Duration) -> ClaudeProvider {
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "claude", None);
    cfg.command = vec!["sh".into(), "-c".into(), script.into(), "claude".into()];
    ClaudeProvider { cfg, start_timeout }
}

fn bare_spec(dir: &tempfile::TempDir, resume: Option<Value>) -> SessionSpec {
    SessionSpec {
        cwd: dir.path().to_path_buf(),
        model: None,
        mode: None,
        system_prompt: None,
        mcp_servers: BTreeMap::new(),
        resume,
    }
}

#[tokio::test]
async fn a_cli_that_exits_at_start_fails_with_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let provider = scripted(
        "echo 'cannot start: bad settings' >&2; exit 3",
        START_TIMEOUT,
    );
    let launcher = Arc::new(Direct::default());
    let (tx, _rx) = mpsc::channel(16);
    let Err(e) = provider
        .start(bare_spec(&dir, None), launcher.clone(), tx)
        .await
    else {
        panic!("the start must fail");
    };
    let message = e.to_string();
    assert!(message.contains("status 3"), "{message}");
    assert!(message.contains("cannot start: bad settings"), "{message}");
    assert!(launcher.pids().iter().all(|p| !alive(*p)));
}

#[tokio::test]
async fn a_cli_that_hangs_at_start_is_stopped_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let provider = scripted(
        "echo 'waiting forever' >&2; exec sleep 60",
        Duration::from_secs(1),
    );
    let launcher = Arc::new(Direct::default());
    let (tx, _rx) = mpsc::channel(16);
    let began = std::time::Instant::now();
    let Err(e) = provider
        .start(bare_spec(&dir, None), launcher.clone(), tx)
        .await
    else {
        panic!("the start must fail");
    };
    let took = began.elapsed();
    let message = e.to_string();
    assert!(message.contains("within 1 s"), "{message}");
    assert!(message.contains("waiting forever"), "{message}");
    assert!(
        took < Duration::from_secs(1) + CLI.after_eof + STOP_GRACE + Duration::from_secs(2),
        "{took:?}"
    );
    let pids = launcher.pids();
    assert_eq!(pids.len(), 1);
    assert!(!alive(pids[0]), "no process is left");
}

#[tokio::test]
async fn a_conversation_that_cannot_be_reopened_starts_afresh_under_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    // Refuses `--resume`; otherwise answers `initialize` and waits for end of input.
    let script = r#"case "$*" in *--resume=*) echo "No conversation found with session ID" >&2; exit 1;; esac
read line
echo '{"type":"control_response","response":{"subtype":"success","request_id":"agentry_1","response":{"current_permission_mode":"default"}}}'
cat > /dev/null"#;
    let provider = scripted(script, START_TIMEOUT);
    let launcher = Arc::new(Direct::default());
    let (tx, mut rx) = mpsc::channel(16);
    let handle = json!({"session_id": "0193a1b2-c3d4-7e8f-9a0b-1c2d3e4f5a6b"});
    let (session, info) = provider
        .start(bare_spec(&dir, Some(handle)), launcher.clone(), tx)
        .await
        .expect("a fresh session starts");
    assert!(!info.resumed);
    assert_eq!(
        info.provider_session_id.as_deref(),
        Some("0193a1b2-c3d4-7e8f-9a0b-1c2d3e4f5a6b")
    );
    assert_eq!(info.current_mode.as_deref(), Some("default"));
    match rx.recv().await.unwrap() {
        ProviderEvent::Error { message, code } => {
            assert_eq!(code.as_deref(), Some("resume_failed"));
            assert!(message.contains("No conversation found"), "{message}");
        }
        other => panic!("expected the resume failure, got {other:?}"),
    }
    session.close().await;
    assert!(
        matches!(rx.recv().await, Some(ProviderEvent::Exited { reason }) if reason == "closed")
    );
    let pids = launcher.pids();
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|p| !alive(*p)));
}
