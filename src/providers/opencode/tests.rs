//! The event mapping fed with `GET /event` streams recorded from OpenCode 1.18.33 (against
//! a fake model on 127.0.0.1), and the pieces of the adapter that need no process.

use super::*;

use crate::domain::{Behavior, ToolKind, ToolStatus, TurnOutcome};
use crate::providers::ChangeKind;
use crate::providers::test_support::{
    self, Direct, assert_allow_always_deny, deltas, events, json_lines, tool_calls, turn_ends,
};

const TEXT_TURN: &str = include_str!("transcripts/text_turn.jsonl");
/// A write that asks, aborted while the request waits; the stream also carries another
/// session's events.
const WRITE_THEN_ABORT: &str = include_str!("transcripts/write_then_abort.jsonl");
/// A write allowed by the session's rules (no request), then one rejected by a person.
const ALLOWED_THEN_REJECTED: &str = include_str!("transcripts/allowed_then_rejected.jsonl");

/// The session the recorded prompts went to: the first user message's.
fn first_session(events: &[Value]) -> String {
    events
        .iter()
        .find(|e| e["type"] == "message.updated" && e["properties"]["info"]["role"] == "user")
        .and_then(|e| e["properties"]["sessionID"].as_str())
        .expect("a prompt")
        .to_owned()
}

/// Feed a recorded stream. A prompt was sent just before OpenCode recorded each user
/// message, so the turn begins there; `before` runs before each event, for interrupts.
fn replay(
    mapper: &mut Mapper,
    events: &[Value],
    mut before: impl FnMut(&mut Mapper, &Value),
) -> Vec<Mapped> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for event in events {
        let info = &event["properties"]["info"];
        if event["type"] == "message.updated"
            && info["role"] == "user"
            && event["properties"]["sessionID"].as_str() == Some(mapper.session_id())
            && seen.insert(info["id"].as_str().unwrap().to_owned())
            && !mapper.is_active()
        {
            mapper.begin_turn();
        }
        before(mapper, event);
        out.extend(mapper.event(event));
    }
    out
}

fn mapper_for(events: &[Value]) -> Mapper {
    Mapper::new(first_session(events))
}

test_support::events_in_event_variant!(Mapped);

/// The permission requests, each with OpenCode's id for it.
fn asks(mapped: &[Mapped]) -> Vec<(&str, &Ask)> {
    mapped
        .iter()
        .filter_map(|m| match m {
            Mapped::Ask { request_id, ask } => Some((request_id.as_str(), ask)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_text_turn_streams_deltas_that_add_up_and_completes_with_usage() {
    let stream = json_lines(TEXT_TURN);
    let mut mapper = mapper_for(&stream);
    let mapped = replay(&mut mapper, &stream, |_, _| {});
    // The prompt's own text part is the user's, not the assistant's.
    assert_eq!(deltas(&mapped), "Hello from fake.");
    let ids: Vec<_> = events(&mapped)
        .iter()
        .filter_map(|e| match e {
            ProviderEvent::AssistantDelta { message_id, .. } => message_id.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(ids.len(), 3, "three deltas: {ids:?}");
    assert!(ids.iter().all(|i| i == &ids[0]), "one message: {ids:?}");
    // OpenCode's own id for the prompt names the turn's user_message, before any reply.
    let recorded: Vec<&str> = events(&mapped)
        .iter()
        .filter_map(|e| match e {
            ProviderEvent::UserMessageRecorded { message_id } => Some(message_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(recorded.len(), 1, "{mapped:?}");
    let user_id = stream
        .iter()
        .find(|e| e["type"] == "message.updated" && e["properties"]["info"]["role"] == "user")
        .and_then(|e| e["properties"]["info"]["id"].as_str())
        .expect("the transcript records the prompt");
    assert_eq!(recorded[0], user_id);
    assert!(matches!(
        events(&mapped).first(),
        Some(ProviderEvent::UserMessageRecorded { .. })
    ));
    let ends = turn_ends(&mapped);
    assert_eq!(ends.len(), 1, "{mapped:?}");
    let (outcome, error, usage) = &ends[0];
    assert_eq!(*outcome, TurnOutcome::Completed);
    assert_eq!(*error, None);
    let usage = usage.as_ref().expect("the step's tokens");
    assert_eq!((usage.input_tokens, usage.output_tokens), (30, 7));
    assert!(!mapper.is_active());
}

#[test]
fn an_asked_write_maps_to_a_tool_call_and_a_request_and_an_abort_cancels_the_turn() {
    let stream = json_lines(WRITE_THEN_ABORT);
    let mut mapper = mapper_for(&stream);
    let mapped = replay(&mut mapper, &stream, |m, e| {
        // The interrupt came after the request was shown.
        if e["type"] == "session.error" {
            m.interrupt();
        }
    });
    let calls = tool_calls(&mapped);
    let statuses: Vec<ToolStatus> = calls.iter().map(|c| c.status).collect();
    // The error update OpenCode sends after the turn's idle is not reported: the turn
    // is over, and the runtime closes the calls left open.
    assert_eq!(
        statuses,
        [ToolStatus::Pending, ToolStatus::Running],
        "{calls:?}"
    );
    let running = calls[1];
    assert_eq!(running.call_id, "call_1");
    assert_eq!(running.tool_kind, ToolKind::Write);
    assert_eq!(running.input["content"], "hi\n");
    assert_eq!(running.diff[0].change, ChangeKind::Add);
    assert_eq!(running.diff[0].new_text.as_deref(), Some("hi\n"));
    assert_eq!(running.locations[0].path, "/tmp/oc/ws/hello.txt");

    let asks = asks(&mapped);
    assert_eq!(asks.len(), 1, "{mapped:?}");
    let (request_id, ask) = asks[0];
    assert!(request_id.starts_with("per_"), "{request_id}");
    assert_eq!(ask.title, "Edit hello.txt");
    assert_eq!(ask.call_id.as_deref(), Some("call_1"));
    assert!(
        ask.input.as_ref().unwrap()["metadata"]["diff"]
            .as_str()
            .unwrap()
            .contains("+hi")
    );
    assert_allow_always_deny(&ask.options);
    let ends = turn_ends(&mapped);
    assert_eq!(ends.len(), 1, "one end, not one per idle: {mapped:?}");
    assert_eq!(ends[0].0, TurnOutcome::Canceled);
    // The other session on the same stream reported nothing here.
    assert!(deltas(&mapped).is_empty(), "{mapped:?}");
}

#[test]
fn a_write_allowed_by_the_rules_completes_and_a_rejected_one_fails_its_tool() {
    let stream = json_lines(ALLOWED_THEN_REJECTED);
    let mut mapper = mapper_for(&stream);
    let mapped = replay(&mut mapper, &stream, |_, _| {});
    let ends = turn_ends(&mapped);
    assert_eq!(ends.len(), 2, "two turns: {mapped:?}");
    assert!(
        ends.iter().all(|e| e.0 == TurnOutcome::Completed),
        "{ends:?}"
    );

    let calls = tool_calls(&mapped);
    let first: Vec<_> = calls.iter().take(3).map(|c| c.status).collect();
    assert_eq!(
        first,
        [
            ToolStatus::Pending,
            ToolStatus::Running,
            ToolStatus::Completed
        ]
    );
    assert!(calls[2].output.is_some(), "{:?}", calls[2]);
    let last = calls.last().unwrap();
    assert_eq!(last.status, ToolStatus::Failed);
    assert!(
        last.error.as_deref().unwrap().contains("rejected"),
        "{last:?}"
    );
    // One request, in the second turn; its reply was seen.
    assert_eq!(asks(&mapped).len(), 1);
    assert!(
        mapped
            .iter()
            .any(|m| matches!(m, Mapped::Replied { request_id } if request_id.starts_with("per_")))
    );
}

fn ev(kind: &str, props: Value) -> Value {
    json!({"type": kind, "properties": props})
}

fn user(session: &str, id: &str) -> Value {
    ev(
        "message.updated",
        json!({"sessionID": session, "info": {"id": id, "role": "user", "sessionID": session}}),
    )
}

#[test]
fn an_idle_before_opencode_records_the_prompt_is_stale() {
    let mut m = Mapper::new("ses_a");
    m.begin_turn();
    assert!(
        m.event(&ev("session.idle", json!({"sessionID": "ses_a"})))
            .is_empty()
    );
    assert!(m.is_active());
    m.event(&user("ses_a", "msg_1"));
    let out = m.event(&ev("session.idle", json!({"sessionID": "ses_a"})));
    assert_eq!(turn_ends(&out).len(), 1);
    assert!(!m.is_active());
}

#[test]
fn a_session_error_fails_the_turn_with_its_message() {
    let mut m = Mapper::new("ses_a");
    m.begin_turn();
    m.event(&user("ses_a", "msg_1"));
    let error = json!({"sessionID": "ses_a", "error": {"name": "APIError", "data": {"message": "model said no"}}});
    assert!(m.event(&ev("session.error", error.clone())).is_empty());
    let out = m.event(&ev("session.idle", json!({"sessionID": "ses_a"})));
    let ends = turn_ends(&out);
    assert_eq!(ends[0].0, TurnOutcome::Failed);
    assert_eq!(ends[0].1.as_deref(), Some("APIError: model said no"));

    // Before the prompt is recorded, an error ends the turn at once.
    m.begin_turn();
    let out = m.event(&ev("session.error", error));
    assert_eq!(super::tests::turn_ends(&out)[0].0, TurnOutcome::Failed);
    assert!(!m.is_active());
}

#[test]
fn text_sent_only_whole_still_arrives_as_deltas_without_repeats() {
    let mut m = Mapper::new("ses_a");
    m.begin_turn();
    m.event(&user("ses_a", "msg_1"));
    let part = |text: &str| {
        ev(
            "message.part.updated",
            json!({"sessionID": "ses_a", "part": {"id": "prt_1", "messageID": "msg_2", "sessionID": "ses_a", "type": "text", "text": text}}),
        )
    };
    let delta = ev(
        "message.part.delta",
        json!({"sessionID": "ses_a", "messageID": "msg_2", "partID": "prt_1", "field": "text", "delta": "Hel"}),
    );
    let mut out = m.event(&part(""));
    out.extend(m.event(&delta));
    out.extend(m.event(&part("Hello")));
    out.extend(m.event(&part("Hello")));
    assert_eq!(deltas(&out), "Hello");
    // Reasoning parts are reasoning.
    let reasoning = ev(
        "message.part.updated",
        json!({"sessionID": "ses_a", "part": {"id": "prt_2", "messageID": "msg_2", "sessionID": "ses_a", "type": "reasoning", "text": "hmm"}}),
    );
    let out = m.event(&reasoning);
    assert!(matches!(
        events(&out)[0],
        ProviderEvent::ReasoningDelta { text, .. } if text == "hmm"
    ));
}

#[test]
fn decisions_become_opencode_replies() {
    let selected = |id: &str, behavior| PermissionDecision::Selected {
        option_id: id.to_owned(),
        behavior,
        message: None,
        updated_input: None,
    };
    assert_eq!(reply_word(&selected("allow", Behavior::Allow)), "once");
    assert_eq!(
        reply_word(&selected("allow_always", Behavior::Allow)),
        "always"
    );
    assert_eq!(reply_word(&selected("deny", Behavior::Deny)), "reject");
    assert_eq!(reply_word(&PermissionDecision::Cancelled), "reject");
}

#[test]
fn the_configuration_keeps_the_users_and_sets_what_agentry_decides() {
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "opencode", None);
    cfg.env.insert(
        "OPENCODE_CONFIG_CONTENT".to_owned(),
        r#"{"provider":{"fake":{"npm":"x"}},"permission":{"webfetch":"deny","edit":"allow"}}"#
            .to_owned(),
    );
    let p = OpenCodeProvider::new(cfg.clone());
    let c = p.config(Some("fake/m")).unwrap();
    assert_eq!(c["model"], "fake/m");
    assert_eq!(c["provider"]["fake"]["npm"], "x");
    assert_eq!(c["permission"]["webfetch"], "deny");
    assert_eq!(c["permission"]["edit"], "ask");
    assert_eq!(c["permission"]["bash"], "ask");
    assert_eq!(c["agent"]["title"]["disable"], true);
    assert_eq!(c["agent"]["plan"]["permission"]["edit"], "deny");
    // OpenCode always asks; in full access agentry answers (see `policy`).
    assert_eq!(policy("full-access"), Some(("build", true)));
    let c = p.config(None).unwrap();
    assert_eq!(c["permission"]["edit"], "ask");
    assert!(c.get("model").is_none());

    cfg.env
        .insert("OPENCODE_CONFIG_CONTENT".to_owned(), "[1]".to_owned());
    assert!(OpenCodeProvider::new(cfg).config(None).is_err());
    // Quiet start by default.
    let b = builtin();
    assert!(b.env.contains(&("OPENCODE_DISABLE_MODELS_FETCH", "1")));
    assert!(b.env.contains(&("OPENCODE_DISABLE_AUTOUPDATE", "1")));
}

#[test]
fn models_are_provider_slash_model_and_mcp_servers_take_opencodes_shape() {
    assert_eq!(
        model_ref("fake/fake-model"),
        Some(json!({"providerID": "fake", "modelID": "fake-model"}))
    );
    assert_eq!(model_ref("fake-model"), None);
    let listed = json!({"providers": [{"id": "fake", "name": "Fake", "models": {
        "fake-model": {"id": "fake-model", "name": "Fake model", "limit": {"context": 100000}}}}],
        "default": {"fake": "fake-model"}});
    let models = catalog(&listed, Some("fake/fake-model"));
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].id, "fake/fake-model");
    assert!(models[0].is_default);
    assert_eq!(models[0].context_window, Some(100000));

    let servers = BTreeMap::from([
        (
            "files".to_owned(),
            json!({"command": "mcp-files", "args": ["--root", "/w"], "env": {"A": "1"}}),
        ),
        (
            "web".to_owned(),
            json!({"type": "http", "url": "http://127.0.0.1:9/mcp", "headers": [{"name": "X", "value": "y"}]}),
        ),
    ]);
    let configs = mcp_configs(&servers).unwrap();
    assert_eq!(
        configs[0],
        (
            "files".to_owned(),
            json!({"type": "local", "command": ["mcp-files", "--root", "/w"], "environment": {"A": "1"}})
        )
    );
    assert_eq!(
        configs[1].1,
        json!({"type": "remote", "url": "http://127.0.0.1:9/mcp", "headers": {"X": "y"}})
    );
    let bad = BTreeMap::from([("x".to_owned(), json!({"type": "carrier-pigeon"}))]);
    assert!(mcp_configs(&bad).is_err());
}

// ---- starting against stand-ins that never become a usable server

/// A provider whose "server" is `sh -c script` (the serve flags land in `$0`, `$1`…).
fn stand_in(script: &str, start_timeout: Duration) -> OpenCodeProvider {
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "opencode", None);
    cfg.command = vec!["sh".into(), "-c".into(), script.into()];
    OpenCodeProvider { cfg, start_timeout }
}

fn spec(cwd: &std::path::Path) -> SessionSpec {
    SessionSpec {
        cwd: cwd.to_owned(),
        model: None,
        mode: None,
        system_prompt: None,
        mcp_servers: BTreeMap::new(),
        resume: None,
    }
}

/// A failed start must not hang (its supervisor once waited for a dispatcher forever).
async fn bounded<T>(start: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), start)
        .await
        .expect("start answers within 20 s")
}

fn gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) != 0 }
}

#[tokio::test]
async fn a_server_that_exits_before_it_is_ready_fails_the_start_with_its_output() {
    let dir = tempfile::tempdir().unwrap();
    let launcher = Arc::new(Direct::default());
    let provider = stand_in(
        "echo 'no config for you' >&2; exit 3",
        Duration::from_secs(20),
    );
    let (tx, mut rx) = tokio::sync::mpsc::channel(8);
    let started = std::time::Instant::now();
    let Err(e) = bounded(provider.start(spec(dir.path()), launcher.clone(), tx)).await else {
        panic!("a server that exits cannot start a session");
    };
    let e = e.to_string();
    assert!(e.contains("exited before it was ready"), "{e}");
    assert!(e.contains("no config for you"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10), "{e}");
    assert!(
        rx.recv().await.is_none(),
        "no events from a session that never started"
    );
    let pid = launcher.pids()[0];
    assert!(gone(pid));
}

#[tokio::test]
async fn a_server_that_never_gets_healthy_is_stopped_at_the_start_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let launcher = Arc::new(Direct::default());
    let provider = stand_in("sleep 30", Duration::from_millis(800));
    let (tx, _rx) = tokio::sync::mpsc::channel(8);
    let started = std::time::Instant::now();
    let Err(e) = bounded(provider.start(spec(dir.path()), launcher.clone(), tx)).await else {
        panic!("nothing answers the health route");
    };
    assert!(e.to_string().contains("did not start within"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10), "{e}");
    let pid = launcher.pids()[0];
    assert!(gone(pid), "the process group is stopped");
}

#[test]
fn each_keyed_model_provider_is_brokered_under_its_own_path() {
    let decide = |config: Value, vars: &[(&str, &str)]| {
        let text = config.to_string();
        let var = |name: &str| {
            if name == "OPENCODE_CONFIG_CONTENT" {
                return Some(text.clone());
            }
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        };
        broker(&BrokerInput {
            provider: "opencode",
            args: &[],
            var: &var,
        })
    };
    let config = json!({"provider": {
        "fake": {"npm": "@ai-sdk/openai-compatible",
                 "options": {"baseURL": "http://127.0.0.1:9/v1", "apiKey": "{env:FAKE_KEY}"}},
        "local": {"options": {"baseURL": "http://127.0.0.1:8/v1"}},
    }});
    let b = decide(
        config.clone(),
        &[("FAKE_KEY", "sk-1"), ("ANTHROPIC_API_KEY", "sk-a")],
    )
    .unwrap();
    let prefixes: Vec<&str> = b.brokered.iter().map(|x| x.path_prefix.as_str()).collect();
    assert_eq!(prefixes, ["opencode/fake", "opencode/anthropic"]);
    assert_eq!(
        b.brokered[0].upstream_base.as_str(),
        "http://127.0.0.1:9/v1"
    );
    assert_eq!(b.brokered[0].headers[0].1.expose(), "Bearer sk-1");
    assert_eq!(
        b.brokered[1].upstream_base.as_str(),
        "https://api.anthropic.com/v1"
    );
    assert_eq!(b.brokered[1].headers[0].0, "x-api-key");
    assert_eq!(b.withhold, ["ANTHROPIC_API_KEY", "FAKE_KEY"]);
    assert!(b.json_env.contains(&JsonSet {
        var: "OPENCODE_CONFIG_CONTENT".into(),
        path: vec![
            "provider".into(),
            "fake".into(),
            "options".into(),
            "baseURL".into()
        ],
        value: json!("http://127.0.0.1:3128/opencode/fake"),
    }));
    assert!(b.json_env.contains(&JsonSet {
        var: "OPENCODE_CONFIG_CONTENT".into(),
        path: vec![
            "provider".into(),
            "anthropic".into(),
            "options".into(),
            "apiKey".into()
        ],
        value: json!(PLACEHOLDER_KEY),
    }));
    // The keyless local server is left as it is.
    assert!(!b.json_env.iter().any(|s| s.path[1] == "local"));

    let literal =
        json!({"provider": {"fake": {"options": {"baseURL": "http://x/v1", "apiKey": "sk-lit"}}}});
    let b = decide(literal, &[]).unwrap();
    assert_eq!(b.brokered[0].headers[0].1.expose(), "Bearer sk-lit");

    let no_url = json!({"provider": {"other": {"options": {"apiKey": "k"}}}});
    assert!(decide(no_url, &[]).unwrap_err().contains("baseURL"));
    assert!(decide(json!({}), &[]).unwrap_err().contains("login"));
    assert!(decide(json!({}), &[("OPENCODE_API_KEY", "k")]).is_err());
}
