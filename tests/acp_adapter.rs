//! The ACP adapter driven against the real `agentry mock-agent` process: what a session
//! reports for each scripted prompt, interrupts, resume, mode/model changes and the
//! death of the process; plus a small `sh` agent with the wire habits of real agents.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentry::domain::{Behavior, ToolKind, ToolStatus, TurnOutcome};
use agentry::process::{CommandSpec, ManagedChild, ProcessError};
use agentry::providers::acp::{AcpProvider, AcpProviderConfig};
use agentry::providers::mock::mock_provider;
use agentry::providers::{
    Availability, ChangeKind, PermissionDecision, PermissionRequest, PlanStatus, ProcessLauncher,
    Provider, ProviderEvent, ProviderSession, SessionInfo, SessionSpec, ToolCallUpdate, TurnInput,
    Usage,
};
use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Spawns the process directly (no ledger).
struct TestLauncher;

#[async_trait]
impl ProcessLauncher for TestLauncher {
    async fn launch(&self, spec: CommandSpec) -> Result<ManagedChild, ProcessError> {
        agentry::process::spawn(&spec)
    }
}

fn provider() -> AcpProvider {
    mock_provider(env!("CARGO_BIN_EXE_agentry").into())
}

fn spec(dir: &tempfile::TempDir) -> SessionSpec {
    SessionSpec {
        cwd: dir.path().to_path_buf(),
        model: None,
        mode: None,
        system_prompt: None,
        mcp_servers: BTreeMap::new(),
        resume: None,
    }
}

/// The spec that reopens the scripted agents' session `s1`.
fn reopening(dir: &tempfile::TempDir) -> SessionSpec {
    SessionSpec {
        resume: Some(json!({ "session_id": "s1" })),
        ..spec(dir)
    }
}

/// How long any single expected event may take.
const EVENT_WAIT: Duration = Duration::from_secs(10);

struct Agent {
    session: Option<Box<dyn ProviderSession>>,
    info: SessionInfo,
    events: mpsc::Receiver<ProviderEvent>,
}

/// What one turn produced, up to and including its end.
#[derive(Default)]
struct Turn {
    deltas: Vec<(Option<String>, String)>,
    tools: Vec<ToolCallUpdate>,
    others: Vec<ProviderEvent>,
    outcome: Option<(TurnOutcome, Option<String>, Option<Usage>)>,
}

impl Turn {
    fn text(&self) -> String {
        self.deltas.iter().map(|(_, t)| t.as_str()).collect()
    }
}

impl Agent {
    async fn start(dir: &tempfile::TempDir) -> Self {
        Self::start_with(spec(dir)).await
    }

    async fn start_with(spec: SessionSpec) -> Self {
        Self::start_on(&provider(), spec, 1024).await
    }

    /// A session of `provider`'s agent, its events in a channel of `capacity`.
    async fn start_on(provider: &AcpProvider, spec: SessionSpec, capacity: usize) -> Self {
        let (tx, events) = mpsc::channel(capacity);
        let (session, info) = provider
            .start(spec, Arc::new(TestLauncher), tx)
            .await
            .expect("the agent starts");
        Self {
            session: Some(session),
            info,
            events,
        }
    }

    fn session(&mut self) -> &mut Box<dyn ProviderSession> {
        self.session.as_mut().expect("session still open")
    }

    async fn prompt(&mut self, text: &str) {
        self.session()
            .prompt(TurnInput {
                text: text.to_owned(),
            })
            .await
            .expect("prompt accepted");
    }

    async fn next(&mut self) -> ProviderEvent {
        match tokio::time::timeout(EVENT_WAIT, self.events.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => panic!("the event channel closed"),
            Err(_) => panic!("no event within {EVENT_WAIT:?}"),
        }
    }

    /// Events until the turn ends; a permission request is handed to `on_permission`.
    async fn turn_with(&mut self, mut on_permission: impl FnMut(PermissionRequest)) -> Turn {
        let mut turn = Turn::default();
        loop {
            match self.next().await {
                ProviderEvent::AssistantDelta { message_id, text } => {
                    turn.deltas.push((message_id, text))
                }
                ProviderEvent::ToolCall(call) => turn.tools.push(call),
                ProviderEvent::PermissionRequested(request) => on_permission(request),
                ProviderEvent::TurnEnded {
                    outcome,
                    error,
                    usage,
                } => {
                    turn.outcome = Some((outcome, error, usage));
                    return turn;
                }
                ProviderEvent::Exited { reason } => {
                    panic!("the agent exited during a turn: {reason}")
                }
                other => turn.others.push(other),
            }
        }
    }

    async fn turn(&mut self) -> Turn {
        self.turn_with(|request| panic!("unexpected permission request: {}", request.title))
            .await
    }

    /// Nothing arrives within `wait`.
    async fn quiet_for(&mut self, wait: Duration) {
        if let Ok(Some(event)) = tokio::time::timeout(wait, self.events.recv()).await {
            panic!("unexpected event: {event:?}");
        }
    }

    async fn close(mut self) -> Vec<ProviderEvent> {
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        let mut rest = Vec::new();
        while let Ok(Some(event)) = tokio::time::timeout(EVENT_WAIT, self.events.recv()).await {
            rest.push(event);
        }
        rest
    }
}

fn completed(turn: &Turn) {
    match &turn.outcome {
        Some((TurnOutcome::Completed, None, _)) => {}
        other => panic!("expected a completed turn, got {other:?}"),
    }
}

#[tokio::test]
async fn provider_reports_itself_and_its_availability() {
    let info = provider().info();
    assert_eq!(info.id, "mock");
    assert_eq!(info.protocol, "acp");
    assert_eq!(info.default_mode.as_deref(), Some("default"));
    let unattended: Vec<(&str, bool)> = info
        .modes
        .iter()
        .map(|m| (m.id.as_str(), m.unattended))
        .collect();
    assert_eq!(unattended, [("default", false), ("unattended", true)]);
    assert!(matches!(
        provider().availability().await,
        Availability::Available
    ));

    let missing = AcpProvider::new(AcpProviderConfig {
        id: "ghost".into(),
        label: "Ghost".into(),
        command: vec!["agentry-no-such-agent-on-path".into(), "--acp".into()],
        env: BTreeMap::new(),
        pass_env: Vec::new(),
        modes: Vec::new(),
        default_mode: None,
        models: Vec::new(),
        model_flag: None,
        serve_reads: true,
        auth_method: None,
    });
    match missing.availability().await {
        Availability::Unavailable(reason) => {
            assert_eq!(
                reason,
                "`agentry-no-such-agent-on-path` was not found on PATH"
            )
        }
        Availability::Available => panic!("a missing program is not available"),
    }
}

#[tokio::test]
async fn start_reports_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    let id = agent
        .info
        .provider_session_id
        .clone()
        .expect("a session id");
    assert_eq!(agent.info.persistence, Some(json!({ "session_id": id })));
    assert!(agent.info.pid.is_some_and(|pid| pid > 0));
    assert!(!agent.info.resumed);
    assert_eq!(agent.info.current_mode.as_deref(), Some("default"));
    assert_eq!(agent.info.current_model.as_deref(), Some("mock-small"));
    agent.quiet_for(Duration::from_millis(200)).await;
    let rest = agent.close().await;
    assert!(
        matches!(rest.as_slice(), [ProviderEvent::Exited { reason }] if reason == "closed"),
        "{rest:?}"
    );
}

#[tokio::test]
async fn plain_prompt_streams_the_reply_in_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("hello there").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert!(turn.deltas.len() >= 3, "{:?}", turn.deltas);
    assert_eq!(turn.text(), "You said: hello there");
    let first_id = turn.deltas[0].0.clone();
    assert!(first_id.is_some());
    assert!(
        turn.deltas.iter().all(|(id, _)| *id == first_id),
        "one message id for the reply"
    );
    assert!(turn.tools.is_empty());

    // The next turn is a new message.
    agent.prompt("again").await;
    let second = agent.turn().await;
    completed(&second);
    assert_eq!(second.text(), "You said: again");
    assert_ne!(second.deltas[0].0, first_id);
    agent.close().await;
}

#[tokio::test]
async fn tool_prompt_reports_a_shell_call() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/tool ls -la").await;
    let turn = agent.turn().await;
    completed(&turn);
    let [running, done] = turn.tools.as_slice() else {
        panic!("two tool call events expected: {:?}", turn.tools);
    };
    assert_eq!(running.call_id, done.call_id);
    assert_eq!(running.status, ToolStatus::Running);
    assert_eq!(running.tool_kind, ToolKind::Shell);
    assert_eq!(running.title, "ls -la");
    assert_eq!(running.input, json!({ "command": "ls -la" }));
    assert_eq!(done.status, ToolStatus::Completed);
    // The update carried only status and output; the rest is remembered.
    assert_eq!(done.tool_kind, ToolKind::Shell);
    assert_eq!(done.title, "ls -la");
    assert_eq!(done.name, running.name);
    assert_eq!(done.input, json!({ "command": "ls -la" }));
    let output = done.output.as_ref().expect("output");
    assert_eq!(output["exit_code"], json!(0));
    assert!(output["stdout"].is_string());
    assert!(!turn.text().is_empty());
    agent.close().await;
}

async fn ask(behavior: Behavior, option: &str) -> Turn {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/ask deploy?").await;
    let mut asked = 0;
    let option = option.to_owned();
    let turn = agent
        .turn_with(|request| {
            asked += 1;
            assert_eq!(request.title, "deploy?");
            let options: Vec<(&str, Behavior)> = request
                .options
                .iter()
                .map(|o| (o.id.as_str(), o.behavior))
                .collect();
            assert_eq!(
                options,
                [("allow", Behavior::Allow), ("deny", Behavior::Deny)]
            );
            assert!(request.call_id.is_some());
            let _ = request.reply.send(PermissionDecision::Selected {
                option_id: option.clone(),
                behavior,
                message: None,
                updated_input: None,
            });
        })
        .await;
    assert_eq!(asked, 1);
    completed(&turn);
    agent.close().await;
    turn
}

#[tokio::test]
async fn ask_allowed() {
    let turn = ask(Behavior::Allow, "allow").await;
    let [pending, done] = turn.tools.as_slice() else {
        panic!(
            "tool call before the request and after the answer: {:?}",
            turn.tools
        );
    };
    assert_eq!(pending.status, ToolStatus::Pending);
    assert_eq!(done.status, ToolStatus::Completed);
    assert_eq!(done.call_id, pending.call_id);
    let text = turn.text();
    assert!(text.contains("allow (option allow)"), "{text}");
}

#[tokio::test]
async fn ask_denied() {
    let turn = ask(Behavior::Deny, "deny").await;
    assert_eq!(
        turn.tools.last().map(|t| t.status),
        Some(ToolStatus::Failed)
    );
    let text = turn.text();
    assert!(text.contains("deny (option deny)"), "{text}");
}

#[tokio::test]
async fn permission_request_follows_its_tool_call() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/ask ship it").await;
    let ProviderEvent::ToolCall(call) = agent.next().await else {
        panic!("tool call first")
    };
    assert_eq!(call.status, ToolStatus::Pending);
    let ProviderEvent::PermissionRequested(request) = agent.next().await else {
        panic!("then the permission request")
    };
    assert_eq!(request.call_id.as_deref(), Some(call.call_id.as_str()));
    assert!(!request.provider_request_id.is_empty());

    // Interrupting answers the request on our behalf and cancels the turn.
    let asked_at = Instant::now();
    agent.session().interrupt().await.unwrap();
    let turn = agent.turn().await;
    assert!(
        matches!(turn.outcome, Some((TurnOutcome::Canceled, _, _))),
        "{:?}",
        turn.outcome
    );
    assert!(asked_at.elapsed() < Duration::from_secs(2));
    assert!(
        request.reply.is_closed(),
        "the adapter stopped waiting for an answer"
    );
    agent.close().await;
}

#[tokio::test]
async fn failing_prompt_fails_the_turn_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/fail boom").await;
    let turn = agent.turn().await;
    match turn.outcome {
        Some((TurnOutcome::Failed, Some(error), _)) => assert_eq!(error, "boom"),
        other => panic!("expected a failed turn, got {other:?}"),
    }
    // The session is still usable.
    agent.prompt("still there?").await;
    completed(&agent.turn().await);
    agent.close().await;
}

#[tokio::test]
async fn sleep_is_interrupted_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    // No wait for the sleep to begin: the cancel follows the prompt on the same pipe, and
    // the mock agent notes the turn's cancel epoch as it reads the prompt, so an interrupt
    // sent now reaches the running turn.
    agent.prompt("/sleep 10000").await;
    let interrupted_at = Instant::now();
    agent.session().interrupt().await.unwrap();
    let turn = agent.turn().await;
    assert!(
        matches!(turn.outcome, Some((TurnOutcome::Canceled, _, _))),
        "{:?}",
        turn.outcome
    );
    assert!(
        interrupted_at.elapsed() < Duration::from_secs(2),
        "took {:?}",
        interrupted_at.elapsed()
    );
    assert!(turn.deltas.is_empty());

    agent.prompt("after the interrupt").await;
    let next = agent.turn().await;
    completed(&next);
    assert_eq!(next.text(), "You said: after the interrupt");
    agent.close().await;
}

#[tokio::test]
async fn write_creates_the_file_and_reports_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/write notes.txt hello").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("notes.txt")).unwrap(),
        "hello"
    );
    let first = turn.tools.first().expect("a tool call");
    assert_eq!(first.tool_kind, ToolKind::Write);
    assert_eq!(first.title, "Write notes.txt");
    assert_eq!(
        first.input,
        json!({ "path": "notes.txt", "content": "hello" })
    );
    let diff = first.diff.first().expect("a diff");
    assert_eq!(diff.new_text.as_deref(), Some("hello"));
    assert_eq!(diff.change, ChangeKind::Add);
    assert!(diff.path.ends_with("/notes.txt"));
    let last = turn.tools.last().unwrap();
    assert_eq!(last.status, ToolStatus::Completed);
    assert_eq!(last.tool_kind, ToolKind::Write);
    agent.close().await;
}

#[tokio::test]
async fn write_outside_the_workspace_is_refused() {
    let parent = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir_in(parent.path()).unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/write ../x y").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert!(!parent.path().join("x").exists());
    assert_eq!(
        turn.tools.last().map(|t| t.status),
        Some(ToolStatus::Failed)
    );
    assert!(
        turn.text().contains("Could not write ../x"),
        "{}",
        turn.text()
    );
    agent.close().await;
}

#[tokio::test]
async fn load_streams_every_chunk_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.prompt("/load 5000 0").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert!(
        turn.tools.is_empty() && turn.others.is_empty(),
        "only deltas: {:?}",
        turn.others
    );
    assert_eq!(turn.deltas.len(), 5000);
    for (i, (_, text)) in turn.deltas.iter().enumerate() {
        assert_eq!(text, &format!("{i} "));
    }
    agent.close().await;
}

#[tokio::test]
async fn resume_reopens_the_session_in_a_new_process() {
    let dir = tempfile::tempdir().unwrap();
    let first = Agent::start(&dir).await;
    let handle = first
        .info
        .persistence
        .clone()
        .expect("a persistence handle");
    let first_pid = first.info.pid;
    first.close().await;

    let mut resumed = Agent::start_with(SessionSpec {
        resume: Some(handle.clone()),
        ..spec(&dir)
    })
    .await;
    assert!(resumed.info.resumed);
    assert_ne!(resumed.info.pid, first_pid);
    assert_eq!(resumed.info.persistence, Some(handle.clone()));
    assert_eq!(
        resumed.info.provider_session_id.as_deref(),
        handle["session_id"].as_str()
    );
    resumed.quiet_for(Duration::from_millis(200)).await;
    resumed.prompt("hello again").await;
    completed(&resumed.turn().await);
    resumed.close().await;

    // A handle without an id starts afresh.
    let mut fresh = Agent::start_with(SessionSpec {
        resume: Some(json!({})),
        ..spec(&dir)
    })
    .await;
    assert!(!fresh.info.resumed);
    assert_ne!(
        fresh.info.provider_session_id.as_deref(),
        handle["session_id"].as_str()
    );
    fresh.quiet_for(Duration::from_millis(100)).await;
    fresh.close().await;
}

#[tokio::test]
async fn killed_process_ends_the_session_without_ending_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    let pid = agent.info.pid.unwrap();
    // The turn runs from the adapter's side once the prompt is sent; whether the agent
    // has read it yet changes nothing the adapter may report.
    agent.prompt("/sleep 10000").await;
    let killed_at = Instant::now();
    // SAFETY: the pid is our own child, still running.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let event = tokio::time::timeout(Duration::from_secs(2), agent.events.recv())
        .await
        .expect("Exited within 2 s")
        .expect("an event");
    match event {
        ProviderEvent::Exited { reason } => {
            assert!(reason.contains("killed by signal 9"), "{reason}");
        }
        other => panic!("expected Exited, got {other:?}"),
    }
    assert!(killed_at.elapsed() < Duration::from_secs(2));
    // Exited is the last event: the sink is released right after it.
    assert!(matches!(
        tokio::time::timeout(EVENT_WAIT, agent.events.recv()).await,
        Ok(None)
    ));
    assert!(matches!(
        agent
            .session()
            .prompt(TurnInput {
                text: "anyone?".into()
            })
            .await,
        Err(agentry::providers::ProviderError::Gone)
    ));
    agent.close().await;
}

#[tokio::test]
async fn set_mode_reports_the_new_mode_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.session().set_mode("unattended").await.unwrap();
    assert!(
        matches!(agent.next().await, ProviderEvent::ModeChanged { mode } if mode == "unattended")
    );
    agent.quiet_for(Duration::from_millis(200)).await;

    // Unattended: /ask is allowed without asking.
    agent.prompt("/ask deploy").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert!(
        turn.text().contains("allow (option allow)"),
        "{}",
        turn.text()
    );

    assert!(agent.session().set_mode("no-such-mode").await.is_err());
    agent.quiet_for(Duration::from_millis(100)).await;
    agent.close().await;
}

#[tokio::test]
async fn start_in_a_mode() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start_with(SessionSpec {
        mode: Some("unattended".into()),
        ..spec(&dir)
    })
    .await;
    assert_eq!(agent.info.current_mode.as_deref(), Some("unattended"));
    // The starting mode is in the session info, not repeated as an event.
    agent.quiet_for(Duration::from_millis(200)).await;
    agent.prompt("/ask deploy").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert!(
        turn.text().contains("allow (option allow)"),
        "{}",
        turn.text()
    );
    agent.close().await;
}

#[tokio::test]
async fn set_model_reports_the_new_model_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    agent.session().set_model("mock-large").await.unwrap();
    assert!(
        matches!(agent.next().await, ProviderEvent::ModelChanged { model } if model == "mock-large")
    );
    agent.quiet_for(Duration::from_millis(200)).await;
    assert!(agent.session().set_model("gpt-unknown").await.is_err());
    agent.quiet_for(Duration::from_millis(100)).await;
    agent.close().await;
}

#[tokio::test]
async fn close_ends_with_exited_closed() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&dir).await;
    let pid = agent.info.pid.unwrap() as i32;
    // Closed with the turn sent and unanswered, whether or not the agent has read it.
    agent.prompt("/sleep 10000").await;
    let rest = agent.close().await;
    let Some(ProviderEvent::Exited { reason }) = rest.last() else {
        panic!("Exited last: {rest:?}")
    };
    assert_eq!(reason, "closed");
    assert!(
        !rest
            .iter()
            .any(|e| matches!(e, ProviderEvent::TurnEnded { .. })),
        "no turn end after close: {rest:?}"
    );
    // The process is gone.
    // SAFETY: signal 0 only checks for existence.
    assert_eq!(unsafe { libc::kill(pid, 0) }, -1);
}

#[tokio::test]
async fn unknown_fields_and_ids_are_tolerated() {
    // The resume handle may carry anything; only `session_id` matters.
    let dir = tempfile::tempdir().unwrap();
    let handle: Value = json!({ "session_id": "not-a-real-session", "extra": [1, 2] });
    let mut agent = Agent::start_with(SessionSpec {
        resume: Some(handle),
        ..spec(&dir)
    })
    .await;
    assert!(agent.info.resumed);
    agent.prompt("ok").await;
    completed(&agent.turn().await);
    agent.close().await;
}

/// A scripted agent in `sh` that speaks the wire protocol the way some real agents do:
/// it replays history on `session/load`, sends update kinds the adapter does not know,
/// non-text content, numeric and string ids, a tool call that first appears inside a
/// permission request (as Gemini does), uses the client's file methods, and reports usage
/// with its answer.
const SCRIPTED_AGENT: &str = r#"
emit() { printf '%s\n' "$1"; }
upd() { emit "{\"jsonrpc\":\"2.0\",\"method\":\"session/update\",\"params\":{\"sessionId\":\"s1\",\"update\":$1}}"; }
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n -e 's/.*"id":\([0-9][0-9]*\).*/\1/p' -e 's/.*"id":\("[^"]*"\).*/\1/p')
  case "$line" in
  *'"method":"initialize"'*)
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"protocolVersion\":1,\"agentCapabilities\":{\"loadSession\":true}}}" ;;
  *'"method":"session/new"'*)
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"sessionId\":\"s1\"}}" ;;
  *'"method":"session/load"'*)
    upd '{"sessionUpdate":"user_message_chunk","content":{"type":"text","text":"old question"}}'
    upd '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"old answer"}}'
    upd '{"sessionUpdate":"tool_call","toolCallId":"old","title":"old tool","kind":"read","status":"completed"}'
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{}}" ;;
  *'"method":"session/prompt"'*)
    upd '{"sessionUpdate":"something_new","x":1}'
    upd '{"sessionUpdate":"agent_thought_chunk","content":{"type":"text","text":"thinking"},"messageId":"t1"}'
    upd '{"sessionUpdate":"agent_message_chunk","content":{"type":"image","data":"AA==","mimeType":"image/png"}}'
    upd '{"sessionUpdate":"tool_call_update","toolCallId":42,"status":"in_progress"}'
    upd '{"sessionUpdate":"plan","entries":[{"content":"step one","priority":"high","status":"in_progress"}]}'
    upd '{"sessionUpdate":"usage_update","used":1200,"size":200000,"cost":{"amount":0.5,"currency":"USD"}}'
    emit '{"jsonrpc":"2.0","id":"perm-1","method":"session/request_permission","params":{"sessionId":"s1","toolCall":{"toolCallId":"g1","title":"write_file","kind":"edit","status":"pending","rawInput":{"file_path":"a.txt"}},"options":[{"optionId":"proceed_once","name":"Allow","kind":"allow_once"},{"optionId":"cancel","name":"Reject","kind":"reject_once"}]}}'
    IFS= read -r answer
    case "$answer" in *proceed_once*) choice=allowed ;; *) choice=refused ;; esac
    emit "{\"jsonrpc\":\"2.0\",\"id\":\"w1\",\"method\":\"fs/write_text_file\",\"params\":{\"sessionId\":\"s1\",\"path\":\"$PWD/a.txt\",\"content\":\"one\\ntwo\\nthree\\n\"}}"
    IFS= read -r written
    emit "{\"jsonrpc\":\"2.0\",\"id\":\"r1\",\"method\":\"fs/read_text_file\",\"params\":{\"sessionId\":\"s1\",\"path\":\"$PWD/a.txt\",\"line\":2,\"limit\":1}}"
    IFS= read -r read_back
    case "$read_back" in *'"content":"two\n"'*) reading=read-ok ;; *) reading=read-bad ;; esac
    emit "{\"jsonrpc\":\"2.0\",\"id\":\"w2\",\"method\":\"fs/write_text_file\",\"params\":{\"sessionId\":\"s1\",\"path\":\"$PWD/../escape.txt\",\"content\":\"x\"}}"
    IFS= read -r escaped
    case "$escaped" in *'"error"'*) escaping=escape-refused ;; *) escaping=escape-allowed ;; esac
    upd '{"sessionUpdate":"tool_call_update","toolCallId":"g1","status":"completed","content":[{"type":"diff","path":"a.txt","oldText":null,"newText":"one"}]}'
    upd "{\"sessionUpdate\":\"agent_message_chunk\",\"content\":{\"type\":\"text\",\"text\":\"$choice $reading $escaping\"}}"
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"stopReason\":\"end_turn\",\"usage\":{\"totalTokens\":30,\"inputTokens\":20,\"outputTokens\":10,\"cachedReadTokens\":5}}}" ;;
  esac
done
"#;

fn scripted(script: &str) -> AcpProvider {
    AcpProvider::new(AcpProviderConfig {
        id: "scripted".into(),
        label: "Scripted".into(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: BTreeMap::new(),
        pass_env: Vec::new(),
        modes: Vec::new(),
        default_mode: None,
        models: Vec::new(),
        model_flag: None,
        serve_reads: true,
        auth_method: None,
    })
}

#[tokio::test]
async fn real_agent_wire_habits_are_mapped() {
    let parent = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir_in(parent.path()).unwrap();
    let mut agent = Agent::start_on(&scripted(SCRIPTED_AGENT), reopening(&dir), 1024).await;
    assert!(agent.info.resumed);
    assert_eq!(agent.info.provider_session_id.as_deref(), Some("s1"));
    // The history replayed by session/load is not reported again.
    agent.quiet_for(Duration::from_millis(300)).await;

    agent.prompt("go").await;
    let mut seen = Vec::new();
    let usage = loop {
        match agent.next().await {
            ProviderEvent::ReasoningDelta { id, text } => {
                assert_eq!((id.as_deref(), text.as_str()), (Some("t1"), "thinking"));
                seen.push("reasoning".to_owned());
            }
            ProviderEvent::ToolCall(call) => {
                match call.call_id.as_str() {
                    "42" => {
                        // Never announced: still a complete event.
                        assert_eq!(call.status, ToolStatus::Running);
                        assert_eq!(call.tool_kind, ToolKind::Other);
                        assert_eq!(call.input, json!({}));
                    }
                    "g1" if call.status == ToolStatus::Pending => {
                        assert_eq!(call.title, "write_file");
                        assert_eq!(call.tool_kind, ToolKind::Edit);
                    }
                    "g1" => {
                        assert_eq!(call.status, ToolStatus::Completed);
                        assert_eq!(call.title, "write_file");
                        assert_eq!(call.tool_kind, ToolKind::Write);
                        assert_eq!(call.input, json!({ "file_path": "a.txt" }));
                        assert!(!call.diff.is_empty());
                    }
                    other => panic!("unexpected tool call {other}"),
                }
                seen.push(format!("tool {} {:?}", call.call_id, call.status));
            }
            ProviderEvent::Plan { entries } => {
                assert_eq!(entries.len(), 1);
                assert_eq!(
                    (entries[0].text.as_str(), entries[0].status),
                    ("step one", PlanStatus::InProgress)
                );
                seen.push("plan".to_owned());
            }
            ProviderEvent::Usage(usage) => {
                assert_eq!(usage.context_window_used, Some(1200));
                assert_eq!(usage.context_window_max, Some(200_000));
                assert_eq!(usage.cost_usd, Some(0.5));
                seen.push("usage".to_owned());
            }
            ProviderEvent::PermissionRequested(request) => {
                assert_eq!(request.provider_request_id, "perm-1");
                assert_eq!(request.title, "write_file");
                assert_eq!(request.call_id.as_deref(), Some("g1"));
                assert_eq!(request.input, Some(json!({ "file_path": "a.txt" })));
                let options: Vec<(&str, Behavior)> = request
                    .options
                    .iter()
                    .map(|o| (o.id.as_str(), o.behavior))
                    .collect();
                assert_eq!(
                    options,
                    [("allow", Behavior::Allow), ("deny", Behavior::Deny)]
                );
                request
                    .reply
                    .send(PermissionDecision::Selected {
                        // agentry's id; the agent hears its own (`proceed_once`).
                        option_id: "allow".into(),
                        behavior: Behavior::Allow,
                        message: None,
                        updated_input: None,
                    })
                    .unwrap();
                seen.push("permission".to_owned());
            }
            ProviderEvent::AssistantDelta { text, .. } => seen.push(format!("text {text}")),
            ProviderEvent::TurnEnded {
                outcome,
                error,
                usage,
            } => {
                assert_eq!((outcome, error), (TurnOutcome::Completed, None));
                break usage;
            }
            other => panic!("unexpected event {other:?}"),
        }
    };
    assert_eq!(
        seen,
        [
            "reasoning",
            "tool 42 Running",
            "plan",
            "usage",
            "tool g1 Pending",
            "permission",
            "tool g1 Completed",
            "text allowed read-ok escape-refused",
        ]
    );
    let usage = usage.expect("the answer's usage");
    assert_eq!(
        (
            usage.input_tokens,
            usage.output_tokens,
            usage.cached_input_tokens
        ),
        (20, 10, 5)
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("a.txt")).unwrap(),
        "one\ntwo\nthree\n"
    );
    assert!(!parent.path().join("escape.txt").exists());
    let rest = agent.close().await;
    assert!(
        matches!(rest.as_slice(), [ProviderEvent::Exited { reason }] if reason == "closed"),
        "{rest:?}"
    );
}

#[tokio::test]
async fn an_agent_that_dies_while_starting_is_explained() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, mut events) = mpsc::channel(16);
    let result = scripted("echo 'no credentials found' >&2; exit 3")
        .start(spec(&dir), Arc::new(TestLauncher), tx)
        .await;
    let Err(error) = result else {
        panic!("the start must fail")
    };
    let message = error.to_string();
    assert!(message.contains("exited with status 3"), "{message}");
    assert!(message.contains("no credentials found"), "{message}");
    // A session that never started sends nothing.
    assert!(events.recv().await.is_none());
}

/// An agent that answers a prompt with `FLOOD` text chunks as fast as `sh` can write
/// them, recording in `progress` (in its working directory) how many it has written.
const FLOOD: usize = 20_000;
const FLOODING_AGENT: &str = r#"
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n -e 's/.*"id":\([0-9][0-9]*\).*/\1/p' -e 's/.*"id":\("[^"]*"\).*/\1/p')
  case "$line" in
  *'"method":"initialize"'*)
    printf '{"jsonrpc":"2.0","id":%s,"result":{"protocolVersion":1,"agentCapabilities":{}}}\n' "$id" ;;
  *'"method":"session/new"'*)
    printf '{"jsonrpc":"2.0","id":%s,"result":{"sessionId":"s1"}}\n' "$id" ;;
  *'"method":"session/prompt"'*)
    i=0
    while [ "$i" -lt "$FLOOD" ]; do
      printf '{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"%d "}}}}\n' "$i"
      i=$((i + 1))
      if [ $((i % 100)) -eq 0 ]; then echo "$i" > progress.new; mv progress.new progress; fi
    done
    printf '{"jsonrpc":"2.0","id":%s,"result":{"stopReason":"end_turn"}}\n' "$id" ;;
  esac
done
"#;

/// How many chunks the flooding agent has written so far.
fn flood_progress(dir: &std::path::Path) -> usize {
    std::fs::read_to_string(dir.join("progress"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn an_agent_outrunning_its_consumer_blocks_on_its_pipe_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut provider_config = scripted(FLOODING_AGENT).config().clone();
    provider_config
        .env
        .insert("FLOOD".to_owned(), FLOOD.to_string());
    let mut agent = Agent::start_on(&AcpProvider::new(provider_config), spec(&dir), 64).await;
    agent.prompt("go").await;

    // Nobody takes events: the agent's writes must stop once the channel, the adapter's
    // updates in flight and the pipe are full, far short of the whole flood.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = 0;
    let mut steady_since = Instant::now();
    // That the agent has stopped is an absence: its progress file unchanged for 1.5 s,
    // sampled every 100 ms, is the check itself.
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = flood_progress(dir.path());
        if now != last || now == 0 {
            last = now;
            steady_since = Instant::now();
        } else if steady_since.elapsed() >= Duration::from_millis(1500) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent never stopped writing ({last} chunks)"
        );
    }
    // 64 in the channel, 1024 in flight, about 550 in a 64 KiB pipe, one read chunk.
    assert!(
        last < 4_000,
        "the agent wrote {last} of {FLOOD} chunks with nobody reading them"
    );

    // Once events are taken everything arrives, in order, then the prompt's answer.
    let turn = agent.turn().await;
    completed(&turn);
    assert_eq!(turn.deltas.len(), FLOOD);
    for (i, (_, text)) in turn.deltas.iter().enumerate() {
        assert_eq!(text, &format!("{i} "), "chunk {i}");
    }
    assert_eq!(flood_progress(dir.path()), FLOOD);
    agent.close().await;
}

/// An agent that behaves like Gemini CLI reopening a session: `session/load` needs an
/// `authenticate` first (answering -32000 until then), and the history it replays arrives
/// partly after its answer.
const LATE_REPLAY_AGENT: &str = r#"
emit() { printf '%s\n' "$1"; }
upd() { emit "{\"jsonrpc\":\"2.0\",\"method\":\"session/update\",\"params\":{\"sessionId\":\"s1\",\"update\":$1}}"; }
authed=no
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n -e 's/.*"id":\([0-9][0-9]*\).*/\1/p' -e 's/.*"id":\("[^"]*"\).*/\1/p')
  case "$line" in
  *'"method":"initialize"'*)
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"protocolVersion\":1,\"agentCapabilities\":{\"loadSession\":true}}}" ;;
  *'"method":"authenticate"'*)
    case "$line" in *'"methodId":"gemini-api-key"'*) authed=yes ;; esac
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{}}" ;;
  *'"method":"session/new"'*)
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"sessionId\":\"s2\"}}" ;;
  *'"method":"session/load"'*)
    if [ "$authed" != yes ]; then
      emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"error\":{\"code\":-32000,\"message\":\"Authentication required.\"}}"
      continue
    fi
    upd '{"sessionUpdate":"user_message_chunk","content":{"type":"text","text":"old question"}}'
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{}}"
    sleep 0.05
    upd '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"old answer"}}'
    sleep 0.05
    upd '{"sessionUpdate":"tool_call","toolCallId":"old","title":"old tool","kind":"read","status":"completed"}' ;;
  *'"method":"session/prompt"'*)
    upd '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"new answer"}}'
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"stopReason\":\"end_turn\"}}" ;;
  esac
done
"#;

#[tokio::test]
async fn a_reopen_that_needs_authentication_and_replays_late_keeps_only_new_events() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = scripted(LATE_REPLAY_AGENT).config().clone();
    config.auth_method = Some("gemini-api-key".to_owned());
    let mut agent = Agent::start_on(&AcpProvider::new(config), reopening(&dir), 1024).await;
    assert!(agent.info.resumed, "reopened after authenticating");
    agent.prompt("go").await;
    let turn = agent.turn().await;
    completed(&turn);
    assert_eq!(turn.text(), "new answer");
    assert!(turn.tools.is_empty(), "{:?}", turn.tools);
    agent.close().await;

    // Without a method to authenticate with, the session cannot be reopened: a new one
    // starts, and the timeline says why.
    let (tx, mut events) = mpsc::channel(1024);
    let (session, info) = scripted(LATE_REPLAY_AGENT)
        .start(reopening(&dir), Arc::new(TestLauncher), tx)
        .await
        .expect("the agent starts");
    assert!(!info.resumed);
    match events.recv().await {
        Some(ProviderEvent::Error { code, .. }) => {
            assert_eq!(code.as_deref(), Some("resume_failed"))
        }
        other => panic!("expected resume_failed, got {other:?}"),
    }
    session.close().await;
}
