//! The mapping driven by transcripts recorded from the real Pi 0.73.1 (`--mode rpc`, with
//! agentry's gate extension) against a fake Chat Completions model
//! (tests/fixtures/pi/*.jsonl), plus the pieces around it: dialog answers, the catalog,
//! the JSONL framing and the `extends = "pi"` profiles.

use std::collections::BTreeMap;

use tokio::sync::mpsc;

use super::*;
use crate::domain::{ToolKind, ToolStatus, TurnOutcome};
use crate::providers::test_support::{
    events, events_in_event_variant, replay_with, tool_calls, turn_end,
};
use crate::providers::{ChangeKind, Usage};

const TEXT: &str = include_str!("../../../tests/fixtures/pi/text.jsonl");
const WRITE_ALLOW: &str = include_str!("../../../tests/fixtures/pi/write_allow.jsonl");
const BASH_DENY: &str = include_str!("../../../tests/fixtures/pi/bash_deny.jsonl");
const ABORT: &str = include_str!("../../../tests/fixtures/pi/abort.jsonl");

events_in_event_variant!(Action);

fn replay(transcript: &str) -> Vec<Action> {
    let mut mapper = Mapper::new("/work/repo");
    replay_with(transcript, |m| mapper.map(m))
}

fn dialogs(actions: &[Action]) -> Vec<&Dialog> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dialog(d) => Some(d),
            _ => None,
        })
        .collect()
}

/// The assistant text of each message id, in order of first appearance.
fn messages(actions: &[Action]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for e in events(actions) {
        if let ProviderEvent::AssistantDelta { message_id, text } = e {
            let id = message_id.clone().unwrap_or_default();
            match out.iter_mut().find(|(m, _)| *m == id) {
                Some((_, t)) => t.push_str(text),
                None => out.push((id, text.clone())),
            }
        }
    }
    out
}

/// The one `TurnEnded` of a transcript, which must be its last event.
fn last_turn_end(actions: &[Action]) -> (TurnOutcome, Option<String>, Option<Usage>) {
    let all = events(actions);
    assert!(
        matches!(all.last(), Some(ProviderEvent::TurnEnded { .. })),
        "the turn's end is the last event: {all:?}"
    );
    turn_end(actions)
}

#[test]
fn a_text_turn_streams_text_and_reasoning_and_ends_with_agent_end() {
    let actions = replay(TEXT);
    assert_eq!(
        messages(&actions),
        [("m1".to_owned(), "Hello from fake.".to_owned())]
    );
    let reasoning: String = events(&actions)
        .iter()
        .filter_map(|e| match e {
            ProviderEvent::ReasoningDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, "Let me think.");
    // Pi's `input` excludes the cached part; agentry's includes it.
    let expected = Usage {
        input_tokens: 30,
        output_tokens: 7,
        cached_input_tokens: 10,
        context_window_used: Some(37),
        context_window_max: Some(128_000),
        ..Usage::default()
    };
    let usage: Vec<&Usage> = events(&actions)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::Usage(u) => Some(u),
            _ => None,
        })
        .collect();
    assert_eq!(usage, [&expected]);
    assert_eq!(
        last_turn_end(&actions),
        (TurnOutcome::Completed, None, Some(expected))
    );
    // The responses to our commands are handed back by id.
    let responses: Vec<(Option<&str>, &str, bool)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Response {
                id,
                command,
                result,
            } => Some((id.as_deref(), command.as_str(), result.is_ok())),
            _ => None,
        })
        .collect();
    assert_eq!(
        responses,
        [
            (Some("agentry_1"), "get_state", true),
            (Some("agentry_2"), "prompt", true)
        ]
    );
    // The user's message echoed by Pi is not reported (the runtime records the prompt).
    assert!(dialogs(&actions).is_empty());
}

#[test]
fn a_gated_write_is_pending_then_asked_about_then_completed() {
    let actions = replay(WRITE_ALLOW);
    let calls = tool_calls(&actions);
    let statuses: Vec<ToolStatus> = calls.iter().map(|c| c.status).collect();
    assert_eq!(
        statuses,
        [
            ToolStatus::Pending,
            ToolStatus::Running,
            ToolStatus::Completed
        ]
    );
    let pending = calls[0];
    assert_eq!(pending.call_id, "call_1");
    assert_eq!(pending.tool_kind, ToolKind::Write);
    assert_eq!(pending.input["content"], "hi\n");
    assert_eq!(pending.title, "write hello.txt");
    assert_eq!(pending.diff.len(), 1);
    assert_eq!(pending.diff[0].change, ChangeKind::Add);
    assert_eq!(pending.diff[0].new_text.as_deref(), Some("hi\n"));
    assert_eq!(pending.locations[0].path, "hello.txt");
    let done = calls[2];
    assert_eq!(
        done.output,
        Some(json!("Successfully wrote 3 bytes to hello.txt"))
    );
    assert!(done.error.is_none());
    assert!(done.diff.is_empty(), "a finished call carries no diff");

    let asked = dialogs(&actions);
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].method, DialogMethod::Confirm);
    assert_eq!(asked[0].title, "Write hello.txt?");
    let gate = asked[0]
        .gate
        .as_ref()
        .expect("the gate's dialog names its call");
    assert_eq!(gate.call_id, "call_1");
    assert_eq!(gate.tool, "write");
    assert_eq!(gate.input["path"], "hello.txt");
    assert!(asked[0].message.is_none(), "the marker is not shown");

    // The text after the tool is a second message.
    let texts = messages(&actions);
    assert_eq!(texts.len(), 1, "{texts:?}");
    assert_eq!(texts[0], ("m2".to_owned(), "Hello from fake.".to_owned()));
    let (outcome, error, usage) = last_turn_end(&actions);
    assert_eq!((outcome, error), (TurnOutcome::Completed, None));
    let usage = usage.expect("usage of both model calls");
    assert_eq!((usage.input_tokens, usage.output_tokens), (60, 14));
}

#[test]
fn a_denied_bash_call_fails_with_the_gates_reason() {
    let actions = replay(BASH_DENY);
    let calls = tool_calls(&actions);
    assert_eq!(calls[0].tool_kind, ToolKind::Shell);
    assert_eq!(calls[0].title, "bash echo hi > bash.txt");
    let failed = calls.last().unwrap();
    assert_eq!(failed.status, ToolStatus::Failed);
    assert_eq!(
        failed.error.as_deref(),
        Some("The user denied this tool call.")
    );
    let asked = dialogs(&actions);
    assert_eq!(asked[0].gate.as_ref().unwrap().tool, "bash");
    assert_eq!(asked[0].title, "Run `echo hi > bash.txt`?");
    assert_eq!(last_turn_end(&actions).0, TurnOutcome::Completed);
}

#[test]
fn an_aborted_turn_is_canceled() {
    let actions = replay(ABORT);
    let (outcome, error, _) = last_turn_end(&actions);
    assert_eq!(outcome, TurnOutcome::Canceled);
    assert!(error.is_none());
    assert!(!messages(&actions).is_empty());
}

#[test]
fn a_finished_edit_points_at_its_first_changed_line() {
    let mut mapper = Mapper::new("/w");
    let edit = json!({"path": "src/lib.rs", "edits": [{"oldText": "a", "newText": "b"}]});
    let lines = [
        json!({"type": "tool_execution_start", "toolCallId": "e1", "toolName": "edit", "args": edit}),
        json!({"type": "tool_execution_end", "toolCallId": "e1", "toolName": "edit", "isError": false,
            "result": {"content": [{"type": "text", "text": "Successfully replaced 1 block(s) in src/lib.rs."}],
                "details": {"diff": "-1 a\n+1 b", "firstChangedLine": 12}}}),
    ];
    let actions: Vec<Action> = lines.iter().flat_map(|l| mapper.map(l)).collect();
    let calls = tool_calls(&actions);
    assert_eq!(calls[0].tool_kind, ToolKind::Edit);
    assert_eq!(calls[0].status, ToolStatus::Running);
    assert_eq!(calls[0].locations[0].line, None);
    assert_eq!(calls[1].status, ToolStatus::Completed);
    assert_eq!(calls[1].locations[0].path, "src/lib.rs");
    assert_eq!(calls[1].locations[0].line, Some(12));
}

#[test]
fn a_failed_model_call_fails_the_turn_with_its_message() {
    let mut mapper = Mapper::new("/w");
    let lines = [
        json!({"type": "agent_start"}),
        json!({"type": "message_start", "message": {"role": "assistant", "content": []}}),
        json!({"type": "message_end", "message": {"role": "assistant", "content": [],
            "stopReason": "error", "errorMessage": "401 invalid api key"}}),
        json!({"type": "agent_end", "messages": []}),
    ];
    let actions: Vec<Action> = lines.iter().flat_map(|l| mapper.map(l)).collect();
    assert_eq!(
        last_turn_end(&actions),
        (
            TurnOutcome::Failed,
            Some("401 invalid api key".to_owned()),
            None
        )
    );
}

#[test]
fn text_a_message_did_not_stream_is_added_at_its_end() {
    let mut mapper = Mapper::new("/w");
    let lines = [
        json!({"type": "agent_start"}),
        json!({"type": "message_start", "message": {"role": "assistant", "content": []}}),
        json!({"type": "message_update", "assistantMessageEvent": {"type": "text_delta", "delta": "Hel"}}),
        json!({"type": "message_end", "message": {"role": "assistant", "stopReason": "stop",
            "content": [{"type": "text", "text": "Hello"}]}}),
        json!({"type": "message_start", "message": {"role": "assistant", "content": []}}),
        json!({"type": "message_end", "message": {"role": "assistant", "stopReason": "stop",
            "content": [{"type": "text", "text": "Whole"}]}}),
        json!({"type": "agent_end", "messages": []}),
    ];
    let actions: Vec<Action> = lines.iter().flat_map(|l| mapper.map(l)).collect();
    assert_eq!(
        messages(&actions),
        [
            ("m1".to_owned(), "Hello".to_owned()),
            ("m2".to_owned(), "Whole".to_owned())
        ]
    );
}

#[test]
fn other_extensions_dialogs_are_questions_and_fire_and_forget_ones_are_dropped() {
    let mut mapper = Mapper::new("/w");
    let select = json!({"type": "extension_ui_request", "id": "u1", "method": "select",
        "title": "Which branch?", "options": ["main", "dev"], "timeout": 10000});
    let notify = json!({"type": "extension_ui_request", "id": "u2", "method": "notify",
        "message": "hello"});
    let forged = json!({"type": "extension_ui_request", "id": "u3", "method": "select",
        "title": "t", "message": "{\"agentry_gate\":1,\"toolCallId\":\"x\"}", "options": []});
    let actions: Vec<Action> = [select, notify, forged]
        .iter()
        .flat_map(|l| mapper.map(l))
        .collect();
    let asked = dialogs(&actions);
    assert_eq!(asked.len(), 2, "notify asks nothing");
    assert!(asked[0].gate.is_none());
    assert_eq!(asked[0].timeout_ms, Some(10_000));
    // Only a confirm can be the gate's.
    assert!(asked[1].gate.is_none());

    let options: Vec<(String, String, Behavior)> = question_options(asked[0])
        .into_iter()
        .map(|o| (o.id, o.label, o.behavior))
        .collect();
    assert_eq!(
        options,
        [
            ("option_0".into(), "main".into(), Behavior::Allow),
            ("option_1".into(), "dev".into(), Behavior::Allow),
            ("deny".into(), "Dismiss".into(), Behavior::Deny),
        ]
    );
    let chose = |option: &str, behavior| PermissionDecision::Selected {
        option_id: option.to_owned(),
        behavior,
        message: None,
        updated_input: None,
    };
    assert_eq!(
        dialog_response(asked[0], chose("option_1", Behavior::Allow)),
        json!({"type": "extension_ui_response", "id": "u1", "value": "dev"})
    );
    assert_eq!(
        dialog_response(asked[0], chose("deny", Behavior::Deny)),
        json!({"type": "extension_ui_response", "id": "u1", "cancelled": true})
    );
}

#[test]
fn dialog_answers_follow_the_method() {
    let dialog = |method| Dialog {
        id: "d".to_owned(),
        method,
        title: "t".to_owned(),
        message: None,
        options: Vec::new(),
        timeout_ms: None,
        gate: None,
    };
    let allow = PermissionDecision::Selected {
        option_id: "allow".to_owned(),
        behavior: Behavior::Allow,
        message: Some("typed text".to_owned()),
        updated_input: None,
    };
    let deny = PermissionDecision::Selected {
        option_id: "deny".to_owned(),
        behavior: Behavior::Deny,
        message: None,
        updated_input: None,
    };
    let confirm = dialog(DialogMethod::Confirm);
    assert_eq!(
        dialog_response(&confirm, allow.clone()),
        json!({"type": "extension_ui_response", "id": "d", "confirmed": true})
    );
    assert_eq!(
        dialog_response(&confirm, deny.clone()),
        json!({"type": "extension_ui_response", "id": "d", "confirmed": false})
    );
    // An interrupt dismisses whatever is open.
    for method in [
        DialogMethod::Confirm,
        DialogMethod::Select,
        DialogMethod::Input,
        DialogMethod::Editor,
    ] {
        assert_eq!(
            dialog_response(&dialog(method), PermissionDecision::Cancelled),
            json!({"type": "extension_ui_response", "id": "d", "cancelled": true})
        );
    }
    assert_eq!(
        dialog_response(&dialog(DialogMethod::Input), allow),
        json!({"type": "extension_ui_response", "id": "d", "value": "typed text"})
    );
    assert_eq!(
        dialog_response(&dialog(DialogMethod::Editor), deny),
        json!({"type": "extension_ui_response", "id": "d", "cancelled": true})
    );
}

#[test]
fn the_catalog_names_models_by_provider_and_marks_the_current_one() {
    let state: Value = TEXT
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["command"] == "get_state")
        .unwrap();
    let current = model_id(&state["data"]["model"]);
    assert_eq!(current.as_deref(), Some("fake/fake-model"));
    let data = json!({"models": [state["data"]["model"].clone(),
        {"id": "other", "provider": "p", "name": "Other"}]});
    let models = models_of(&data, current.as_deref());
    let got: Vec<(&str, &str, bool, Option<u64>)> = models
        .iter()
        .map(|m| {
            (
                m.id.as_str(),
                m.label.as_str(),
                m.is_default,
                m.context_window,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("fake/fake-model", "fake-model", true, Some(128_000)),
            ("p/other", "Other", false, None)
        ]
    );
}

/// A session's shared state over in-memory pipes, for driving the reader directly.
fn shared_for_test(events: EventSink, dir: &Path) -> (Arc<Shared>, tokio::io::DuplexStream) {
    let (stdin, from_adapter) = tokio::io::duplex(1 << 16);
    let shared = Arc::new(Shared {
        io: Io::new(events, stdin, StderrTail::default()),
        commands: Pending::default(),
        dialogs: Mutex::new(HashMap::new()),
        mode_file: dir.join("s.mode"),
        running: AtomicBool::new(false),
        abort_on_start: AtomicBool::new(false),
    });
    (shared, from_adapter)
}

#[tokio::test]
async fn lines_split_only_on_newline_and_a_gate_dialog_is_answered_on_stdin() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    let dir = tempfile::tempdir().unwrap();
    let (tx, mut rx) = mpsc::channel(64);
    let (shared, from_adapter) = shared_for_test(tx, dir.path());
    let (mut pi_stdout, adapter_stdout) = tokio::io::duplex(1 << 16);
    let reader = tokio::spawn(CLI.read(adapter_stdout, shared.clone(), Mapper::new(dir.path())));
    // U+2028 and U+2029 are legal inside JSON strings and are not line breaks.
    let text = "one\u{2028}two\u{2029}three";
    let lines = [
        json!({"type": "agent_start"}),
        json!({"type": "message_start", "message": {"role": "assistant", "content": []}}),
        json!({"type": "message_update", "assistantMessageEvent": {"type": "text_delta", "delta": text}}),
        json!({"type": "tool_execution_start", "toolCallId": "c1", "toolName": "write",
            "args": {"path": "a.txt", "content": "x"}}),
        json!({"type": "extension_ui_request", "id": "g1", "method": "confirm", "title": "Write a.txt?",
            "message": "{\"agentry_gate\":1,\"toolCallId\":\"c1\",\"toolName\":\"write\"}"}),
    ];
    for line in &lines {
        let mut bytes = serde_json::to_vec(line).unwrap();
        bytes.push(b'\n');
        pi_stdout.write_all(&bytes).await.unwrap();
    }
    let mut seen = Vec::new();
    let request = loop {
        match rx.recv().await.expect("events") {
            ProviderEvent::PermissionRequested(r) => break r,
            other => seen.push(other),
        }
    };
    assert!(
        seen.iter()
            .any(|e| matches!(e, ProviderEvent::AssistantDelta { text: t, .. } if t == text)),
        "{seen:?}"
    );
    assert_eq!(request.kind, PermissionKind::Tool);
    assert_eq!(request.call_id.as_deref(), Some("c1"));
    assert_eq!(request.input.as_ref().unwrap()["path"], "a.txt");
    let ids: Vec<&str> = request.options.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids, ["allow", "deny"]);
    request
        .reply
        .send(PermissionDecision::Selected {
            option_id: "allow".into(),
            behavior: Behavior::Allow,
            message: None,
            updated_input: None,
        })
        .unwrap();
    let mut answers = BufReader::new(from_adapter).lines();
    let answer: Value = serde_json::from_str(&answers.next_line().await.unwrap().unwrap()).unwrap();
    assert_eq!(
        answer,
        json!({"type": "extension_ui_response", "id": "g1", "confirmed": true})
    );
    drop(pi_stdout);
    assert_eq!(reader.await.unwrap(), None, "end of output is no error");
}

#[tokio::test]
async fn a_refused_prompt_ends_the_turn_as_failed() {
    use tokio::io::AsyncWriteExt;

    let dir = tempfile::tempdir().unwrap();
    let (tx, mut rx) = mpsc::channel(64);
    let (shared, _stdin) = shared_for_test(tx, dir.path());
    let (mut pi_stdout, adapter_stdout) = tokio::io::duplex(1 << 16);
    let reader = tokio::spawn(CLI.read(adapter_stdout, shared, Mapper::new(dir.path())));
    pi_stdout
        .write_all(b"{\"id\":\"agentry_9\",\"type\":\"response\",\"command\":\"prompt\",\"success\":false,\"error\":\"Agent is already processing\"}\nnot json\n")
        .await
        .unwrap();
    drop(pi_stdout);
    match rx.recv().await {
        Some(ProviderEvent::TurnEnded {
            outcome: TurnOutcome::Failed,
            error: Some(e),
            ..
        }) => assert!(e.contains("already processing"), "{e}"),
        other => panic!("{other:?}"),
    }
    match rx.recv().await {
        Some(ProviderEvent::Error { code, .. }) => {
            assert_eq!(code.as_deref(), Some("provider_output_invalid"))
        }
        other => panic!("{other:?}"),
    }
    reader.await.unwrap();
}

#[test]
fn a_pi_fork_runs_as_a_profile_of_pi_with_its_own_command_and_state() {
    let toml = r#"
        [omp]
        extends = "pi"
        command = ["omp"]
        label = "Oh My Pi"
    "#;
    let providers: BTreeMap<String, crate::config::ProviderSettings> =
        toml::from_str(toml).expect("toml");
    let data = Path::new("/srv/agentry");
    let registry =
        crate::providers::ProviderRegistry::from_settings_in(&providers, Some(data)).unwrap();
    let omp = registry.get("omp").expect("omp is offered").info();
    assert_eq!(omp.protocol, "pi-rpc");
    assert_eq!(omp.label, "Oh My Pi");
    let modes: Vec<&str> = omp.modes.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(modes, [ASK, FULL_ACCESS]);
    assert!(registry.get("pi").is_some(), "pi itself stays");

    let b = builtin();
    let mut cfg = crate::providers::registry::builtin_config(&b, "omp", Some(&providers["omp"]));
    cfg.state_dir = Some(data.join("providers/omp"));
    assert_eq!(cfg.command, ["omp"]);
    let provider = PiProvider::new(cfg);
    assert_eq!(provider.state_dir(), data.join("providers/omp"));
}

#[tokio::test]
async fn a_missing_binary_is_unavailable_and_named() {
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "pi", None);
    cfg.command = vec!["/nonexistent/pi".to_owned()];
    match PiProvider::new(cfg).availability().await {
        Availability::Unavailable(why) => assert!(why.contains("/nonexistent/pi"), "{why}"),
        Availability::Available => panic!("a missing binary is not available"),
    }
}

#[test]
fn the_gate_extension_is_written_once_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "pi", None);
    cfg.state_dir = Some(dir.path().join("providers/pi"));
    let provider = PiProvider::new(cfg);
    let path = provider.install_gate().unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), GATE_SOURCE);
    assert!(GATE_SOURCE.contains(GATE_FILE_VAR));
    // A stale copy is replaced.
    std::fs::write(&path, "old").unwrap();
    provider.install_gate().unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), GATE_SOURCE);
}

#[tokio::test]
async fn an_interrupt_before_pi_starts_the_prompt_aborts_it_once_it_starts() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    let dir = tempfile::tempdir().unwrap();
    let (tx, _rx) = mpsc::channel(64);
    let (shared, from_adapter) = shared_for_test(tx, dir.path());
    let (mut pi_stdout, adapter_stdout) = tokio::io::duplex(1 << 16);
    let reader = tokio::spawn(CLI.read(adapter_stdout, shared.clone(), Mapper::new(dir.path())));
    let mut session = PiSession {
        shared: shared.clone(),
        stopper: Stopper::new().0,
    };
    let mut sent = BufReader::new(from_adapter).lines();
    let mut next_sent = async || -> Value {
        serde_json::from_str(&sent.next_line().await.unwrap().unwrap()).unwrap()
    };
    session
        .prompt(TurnInput {
            text: "hi".to_owned(),
        })
        .await
        .unwrap();
    assert_eq!(next_sent().await["type"], "prompt");
    // Pi has accepted the prompt but not started on it: this abort is lost on Pi…
    session.interrupt().await.unwrap();
    assert_eq!(next_sent().await["type"], "abort");
    // …so it is sent again when Pi starts.
    pi_stdout
        .write_all(b"{\"type\":\"agent_start\"}\n")
        .await
        .unwrap();
    assert_eq!(next_sent().await["type"], "abort");
    // A running prompt is aborted once, and the next prompt starts clean.
    pi_stdout
        .write_all(b"{\"type\":\"agent_end\",\"messages\":[]}\n")
        .await
        .unwrap();
    session
        .prompt(TurnInput {
            text: "again".to_owned(),
        })
        .await
        .unwrap();
    assert_eq!(next_sent().await["type"], "prompt");
    pi_stdout
        .write_all(b"{\"type\":\"agent_start\"}\n")
        .await
        .unwrap();
    eventually_running(&shared).await;
    session.interrupt().await.unwrap();
    assert_eq!(next_sent().await["type"], "abort");
    assert!(!shared.abort_on_start.load(Ordering::Acquire));
    drop(pi_stdout);
    reader.await.unwrap();
}

async fn eventually_running(shared: &Shared) {
    for _ in 0..200 {
        if shared.running.load(Ordering::Acquire) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("Pi's agent_start was not seen");
}
