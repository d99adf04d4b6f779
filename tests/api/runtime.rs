//! Runtime paths that the mock agent cannot reach, driven through `AgentManager` with an
//! in-process fake provider: an agent that ignores an interrupt, tools a turn leaves open,
//! and a provider that dies while a permission request waits for an answer. The agent's
//! rows come from a real server (created over the API, then closed there); what the fake
//! run leaves is read back over that server's API, as a client would see it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentry::domain::{
    AgentId, Behavior, PermissionKind, PermissionOption, ToolKind, ToolStatus, TurnOutcome,
    WorkspaceId,
};
use agentry::events::{Bus, EventWriter, WriterLimits};
use agentry::process::{CommandSpec, Ledger, ManagedChild};
use agentry::providers::{
    Availability, EventSink, PermissionDecision, PermissionRequest, ProcessLauncher, Provider,
    ProviderCapabilities, ProviderError, ProviderEvent, ProviderInfo, ProviderRegistry,
    ProviderSession, SessionInfo, SessionSpec, ToolCallUpdate, TurnInput,
};
use agentry::runtime::{AgentContext, AgentManager};
use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::helpers::{TestApp, eventually, git_repo, pid_alive, spawn_app};

/// A real process that waits ten minutes in `cwd`: what the fake provider runs.
fn sleeper(cwd: std::path::PathBuf) -> CommandSpec {
    CommandSpec::new("sleep", vec!["600".into()], cwd)
}

/// What the fake agent does with a prompt.
#[derive(Clone, Copy)]
enum Plan {
    /// Opens two tools, closes one, and ends the turn `completed`.
    LeaveToolOpen,
    /// Starts a tool and never ends the turn, whatever it is told.
    IgnoreInterrupt,
    /// Asks for a permission and waits (the test then kills the process).
    Ask,
    /// Learns a new session handle, asks for a permission, then withdraws the request
    /// (as Claude Code's `control_cancel_request` does) and ends the turn on an interrupt
    /// the way Claude Code does: `failed` (`error_during_execution`).
    AskThenWithdraw,
    /// Names the prompt's message itself (as OpenCode does), then replies and completes.
    NamesItsPrompt,
    /// Says it names prompts, but replies and completes without naming this one.
    NeverNamesItsPrompt,
}

/// What the test can observe of the fake from outside.
#[derive(Default)]
struct Seen {
    pid: Option<u32>,
    interrupts: usize,
    /// The answer the runtime gave to the permission request.
    decision: Option<oneshot::Receiver<PermissionDecision>>,
}

struct FakeProvider {
    plan: Plan,
    seen: Arc<Mutex<Seen>>,
}

struct FakeSession {
    plan: Plan,
    seen: Arc<Mutex<Seen>>,
    events: EventSink,
    kill: Option<oneshot::Sender<()>>,
    gone: Option<oneshot::Receiver<()>>,
}

fn tool(call_id: &str, status: ToolStatus) -> ProviderEvent {
    let mut update = ToolCallUpdate::new(
        call_id,
        "shell",
        ToolKind::Shell,
        status,
        json!({"command": call_id}),
    );
    update.title = format!("run {call_id}");
    ProviderEvent::ToolCall(update)
}

#[async_trait]
impl Provider for FakeProvider {
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "fake".into(),
            label: "Fake".into(),
            protocol: "test".into(),
            capabilities: ProviderCapabilities::default(),
            modes: Vec::new(),
            default_mode: None,
        }
    }

    async fn availability(&self) -> Availability {
        Availability::Available
    }

    async fn start(
        &self,
        spec: SessionSpec,
        launcher: Arc<dyn ProcessLauncher>,
        events: EventSink,
    ) -> Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError> {
        // A real process, recorded in the ledger like any provider's.
        let child = launcher.launch(sleeper(spec.cwd)).await?;
        let pid = child.pid();
        self.seen.lock().unwrap().pid = Some(pid);
        let (kill, killed) = oneshot::channel();
        let (gone_tx, gone) = oneshot::channel();
        tokio::spawn(supervise(child, killed, gone_tx, events.clone()));
        let session = FakeSession {
            plan: self.plan,
            seen: self.seen.clone(),
            events,
            kill: Some(kill),
            gone: Some(gone),
        };
        let info = SessionInfo {
            provider_session_id: Some("fake-session".into()),
            persistence: None,
            pid: Some(pid),
            resumed: false,
            current_mode: None,
            current_model: None,
        };
        Ok((Box::new(session), info))
    }
}

/// Own the child: report its exit as `Exited`, or end it when the session closes.
async fn supervise(
    mut child: ManagedChild,
    killed: oneshot::Receiver<()>,
    gone: oneshot::Sender<()>,
    events: EventSink,
) {
    let exited_by_itself = tokio::select! {
        _ = child.wait() => true,
        _ = killed => false,
    };
    child.terminate(Duration::from_secs(2)).await;
    if exited_by_itself {
        let _ = events
            .send(ProviderEvent::Exited {
                reason: "killed".into(),
            })
            .await;
    }
    let _ = gone.send(());
}

#[async_trait]
impl ProviderSession for FakeSession {
    fn records_user_messages(&self) -> bool {
        matches!(self.plan, Plan::NamesItsPrompt | Plan::NeverNamesItsPrompt)
    }

    async fn prompt(&mut self, _input: TurnInput) -> Result<(), ProviderError> {
        let reply_and_end = || {
            vec![
                ProviderEvent::AssistantMessage {
                    message_id: None,
                    text: "done".into(),
                },
                ProviderEvent::TurnEnded {
                    outcome: TurnOutcome::Completed,
                    error: None,
                    usage: None,
                },
            ]
        };
        let events = match self.plan {
            Plan::NamesItsPrompt => {
                let mut events = vec![ProviderEvent::UserMessageRecorded {
                    message_id: "msg_provider_1".into(),
                }];
                events.extend(reply_and_end());
                events
            }
            Plan::NeverNamesItsPrompt => reply_and_end(),
            Plan::LeaveToolOpen => vec![
                tool("left-open", ToolStatus::Running),
                tool("finished", ToolStatus::Running),
                tool("finished", ToolStatus::Completed),
                ProviderEvent::AssistantMessage {
                    message_id: None,
                    text: "done".into(),
                },
                ProviderEvent::TurnEnded {
                    outcome: TurnOutcome::Completed,
                    error: None,
                    usage: None,
                },
            ],
            Plan::IgnoreInterrupt => vec![
                ProviderEvent::AssistantDelta {
                    message_id: None,
                    text: "working".into(),
                },
                tool("slow", ToolStatus::Running),
            ],
            Plan::AskThenWithdraw => {
                let (reply, decision) = oneshot::channel();
                self.seen.lock().unwrap().decision = Some(decision);
                vec![
                    ProviderEvent::SessionUpdated {
                        provider_session_id: Some("fake-session-2".into()),
                        persistence: Some(json!({"session_id": "fake-session-2"})),
                    },
                    ask("tool-9", reply),
                    ProviderEvent::PermissionWithdrawn {
                        provider_request_id: "tool-9".into(),
                    },
                    ProviderEvent::AssistantDelta {
                        message_id: None,
                        text: "still working".into(),
                    },
                ]
            }
            Plan::Ask => {
                let (reply, decision) = oneshot::channel();
                self.seen.lock().unwrap().decision = Some(decision);
                vec![ProviderEvent::PermissionRequested(PermissionRequest {
                    provider_request_id: "7".into(),
                    kind: PermissionKind::Tool,
                    title: "run rm".into(),
                    call_id: None,
                    input: None,
                    options: vec![
                        PermissionOption {
                            id: "allow".into(),
                            label: "Allow".into(),
                            behavior: Behavior::Allow,
                        },
                        PermissionOption {
                            id: "deny".into(),
                            label: "Deny".into(),
                            behavior: Behavior::Deny,
                        },
                    ],
                    reply,
                })]
            }
        };
        for ev in events {
            self.events
                .send(ev)
                .await
                .map_err(|_| ProviderError::Gone)?;
        }
        Ok(())
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        self.seen.lock().unwrap().interrupts += 1;
        if let Plan::AskThenWithdraw = self.plan {
            let _ = self
                .events
                .send(ProviderEvent::TurnEnded {
                    outcome: TurnOutcome::Failed,
                    error: Some("error_during_execution".into()),
                    usage: None,
                })
                .await;
        }
        // Every other plan hears it, and ignores it.
        Ok(())
    }

    async fn close(mut self: Box<Self>) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        if let Some(gone) = self.gone.take() {
            let _ = gone.await;
        }
    }
}

fn ask(provider_request_id: &str, reply: oneshot::Sender<PermissionDecision>) -> ProviderEvent {
    ProviderEvent::PermissionRequested(PermissionRequest {
        provider_request_id: provider_request_id.into(),
        kind: PermissionKind::Tool,
        title: "run rm".into(),
        call_id: None,
        input: None,
        options: vec![
            PermissionOption {
                id: "allow".into(),
                label: "Allow".into(),
                behavior: Behavior::Allow,
            },
            PermissionOption {
                id: "deny".into(),
                label: "Deny".into(),
                behavior: Behavior::Deny,
            },
        ],
        reply,
    })
}

/// A server's agent, closed there, then driven by a runtime with the fake provider.
struct Harness {
    app: TestApp,
    _repo: tempfile::TempDir,
    agent: String,
    ctx: AgentContext,
    manager: AgentManager,
    seen: Arc<Mutex<Seen>>,
}

async fn harness(plan: Plan, interrupt_grace: Duration) -> Harness {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, ws) = app.mock_agent(repo.path()).await;
    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    let workspace = app.get_ok(&format!("/v1/workspaces/{ws}")).await;
    let id: AgentId = agent.parse().unwrap();
    let (project_id, team_id): (uuid::Uuid, uuid::Uuid) = sqlx::query_as(
        "SELECT p.id, p.team_id FROM agents a JOIN workspaces w ON w.id = a.workspace_id
          JOIN projects p ON p.id = w.project_id WHERE a.id = $1",
    )
    .bind(id.uuid())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let workspace_id: WorkspaceId = ws.parse().unwrap();
    let ctx = AgentContext {
        id,
        team_id,
        project_id,
        workspace_id: workspace_id.uuid(),
        cwd: workspace["path"].as_str().unwrap().into(),
        provider: "fake".into(),
        model: None,
        mode: None,
        system_prompt: None,
        mcp_servers: json!({}),
        persistence: None,
        secret_env: Default::default(),
        egress_allow: None,
        agentry_token: None,
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut registry = ProviderRegistry::new();
    registry.register(Arc::new(FakeProvider {
        plan,
        seen: seen.clone(),
    }));
    let pool = app.pool.clone();
    let writer = EventWriter::spawn(
        pool.clone(),
        Arc::new(Bus::new(64)),
        WriterLimits {
            max_batch: 512,
            ..WriterLimits::default()
        },
    );
    let manager = AgentManager::new(
        pool.clone(),
        writer,
        registry,
        Ledger::new(pool, "fake-runtime"),
        tokio::runtime::Handle::current(),
    )
    .with_interrupt_grace(interrupt_grace);
    Harness {
        app,
        _repo: repo,
        agent,
        ctx,
        manager,
        seen,
    }
}

impl Harness {
    /// The agent's timeline as a client reads it, once it holds a `turn_completed`.
    async fn finished_timeline(&self, within: Duration) -> Vec<Value> {
        let deadline = Instant::now() + within;
        loop {
            let events = self.app.timeline(&self.agent).await;
            if events.iter().any(|e| e["kind"] == "turn_completed") {
                return events;
            }
            assert!(
                Instant::now() < deadline,
                "no turn_completed within {within:?}: {:?}",
                kinds(&events)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn agent_view(&self) -> Value {
        self.app.get_ok(&format!("/v1/agents/{}", self.agent)).await
    }
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

/// The statuses one tool call went through, in order, and where its last one is.
fn tool_statuses(events: &[Value], call_id: &str) -> Vec<(usize, String)> {
    events
        .iter()
        .enumerate()
        .filter(|(_, e)| e["kind"] == "tool_call" && e["data"]["call_id"] == call_id)
        .map(|(i, e)| (i, e["data"]["status"].as_str().unwrap().to_owned()))
        .collect()
}

fn turn_end(events: &[Value]) -> (usize, &Value) {
    let i = events
        .iter()
        .position(|e| e["kind"] == "turn_completed")
        .unwrap();
    (i, &events[i]["data"])
}

/// A provider that names prompts itself (OpenCode) gives the turn's user_message its id;
/// one that does not name this prompt still gets exactly one user_message, before the
/// reply, under agentry's id.
#[tokio::test]
async fn a_provider_may_name_the_prompts_message() {
    for (plan, named) in [
        (Plan::NamesItsPrompt, true),
        (Plan::NeverNamesItsPrompt, false),
    ] {
        let h = harness(plan, Duration::from_secs(5)).await;
        h.manager
            .prompt(&h.ctx, "go".into(), Some("mine-1".into()))
            .await
            .unwrap();
        let events = h.finished_timeline(Duration::from_secs(10)).await;
        let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
        let users: Vec<&Value> = events
            .iter()
            .filter(|e| e["kind"] == "user_message")
            .collect();
        assert_eq!(users.len(), 1, "{kinds:?}");
        let at = |k: &str| kinds.iter().position(|x| *x == k).unwrap();
        assert!(at("turn_started") < at("user_message"), "{kinds:?}");
        assert!(at("user_message") < at("assistant_message"), "{kinds:?}");
        let data = &users[0]["data"];
        assert_eq!(data["text"], "go");
        assert_eq!(data["client_message_id"], "mine-1");
        assert_eq!(data["message_id"] == "msg_provider_1", named, "{data}");
        h.manager.shutdown(Duration::ZERO).await;
    }
}

#[tokio::test]
async fn a_tool_left_open_at_the_end_of_a_turn_is_marked_failed() {
    let h = harness(Plan::LeaveToolOpen, Duration::from_secs(5)).await;
    let turn = h.manager.prompt(&h.ctx, "go".into(), None).await.unwrap();
    let events = h.finished_timeline(Duration::from_secs(10)).await;
    let (end, data) = turn_end(&events);
    assert_eq!(data["outcome"], "completed");
    assert_eq!(data["turn_id"], json!(turn));

    let open = tool_statuses(&events, "left-open");
    let statuses: Vec<&str> = open.iter().map(|(_, s)| s.as_str()).collect();
    assert_eq!(statuses, ["running", "failed"], "{:?}", kinds(&events));
    let (closed_at, _) = open[1];
    assert!(closed_at < end, "closed before the turn ends");
    assert!(events[closed_at]["data"]["error"].is_string());
    assert_eq!(events[closed_at]["turn_id"], json!(turn));
    let done: Vec<String> = tool_statuses(&events, "finished")
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    assert_eq!(
        done,
        ["running", "completed"],
        "a closed tool is left alone"
    );

    // The agent's status is written right after the turn's end.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = h.agent_view().await["status"].clone();
        if status == "idle" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} after the turn ended"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    h.manager.shutdown(Duration::ZERO).await;
}

#[tokio::test]
async fn an_ignored_interrupt_still_ends_the_turn_canceled_and_stops_the_process() {
    let grace = Duration::from_millis(800);
    let h = harness(Plan::IgnoreInterrupt, grace).await;
    h.manager.prompt(&h.ctx, "go".into(), None).await.unwrap();
    let pid = h
        .seen
        .lock()
        .unwrap()
        .pid
        .expect("the fake started a process") as i32;
    // The turn runs (its tool is open) until interrupted.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tool_statuses(&h.app.timeline(&h.agent).await, "slow").is_empty() {
        assert!(Instant::now() < deadline, "the turn never started its tool");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(h.agent_view().await["status"], "running");

    let asked = Instant::now();
    h.manager.interrupt(h.ctx.id).await;
    let events = h.finished_timeline(grace + Duration::from_secs(5)).await;
    let took = asked.elapsed();
    assert!(
        took >= grace && took < grace + Duration::from_secs(4),
        "the turn ended {took:?} after the interrupt (grace {grace:?})"
    );
    assert_eq!(
        h.seen.lock().unwrap().interrupts,
        1,
        "the agent was asked first"
    );
    let (end, data) = turn_end(&events);
    assert_eq!(data["outcome"], "canceled");
    let slow = tool_statuses(&events, "slow");
    assert_eq!(slow.last().unwrap().1, "failed", "{slow:?}");
    assert!(slow.last().unwrap().0 < end);
    // The agent's closing comes in the turn end's own write: no reader sees the turn
    // over while the agent still runs.
    assert_eq!(
        events
            .get(end + 1)
            .map(|e| (&e["kind"], &e["data"]["status"])),
        Some((&json!("status"), &json!("closed"))),
        "{:?}",
        kinds(&events)
    );

    // The turn ends first; stopping the process follows it (on a busy machine, a moment later).
    eventually(
        "the process that ignored the interrupt to be stopped",
        Duration::from_secs(5),
        || !pid_alive(pid),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = h.agent_view().await["status"].clone();
        assert_ne!(status, "running");
        if status == "closed" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent shows closed: {status}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    loop {
        let ledger: i64 =
            sqlx::query_scalar("SELECT count(*) FROM managed_processes WHERE pid = $1")
                .bind(pid)
                .fetch_one(&h.app.pool)
                .await
                .unwrap();
        if ledger == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "its ledger row is gone");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let w = h.app.wait(&h.agent).await;
    assert_eq!(w["last_turn"]["outcome"], "canceled");
    h.manager.shutdown(Duration::ZERO).await;
}

#[tokio::test]
async fn a_provider_exiting_while_a_permission_is_pending_expires_it_and_fails_the_turn() {
    let h = harness(Plan::Ask, Duration::from_secs(5)).await;
    h.manager.prompt(&h.ctx, "go".into(), None).await.unwrap();
    let pid = h.seen.lock().unwrap().pid.unwrap() as i32;
    let path = format!("/v1/agents/{}/permissions?status=pending", h.agent);
    let deadline = Instant::now() + Duration::from_secs(10);
    let request_id = loop {
        let pending = h.app.get_ok(&path).await;
        if let Some(p) = pending["items"].as_array().and_then(|a| a.first()) {
            break p["request_id"].as_str().unwrap().to_owned();
        }
        assert!(Instant::now() < deadline, "the permission was never raised");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    // The request is stored a moment before the status says so.
    while h.agent_view().await["status"] != "waiting_permission" {
        assert!(
            Instant::now() < deadline,
            "the agent never waited for the answer"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // The agent process dies while the request waits.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let events = h.finished_timeline(Duration::from_secs(10)).await;
    let (_, data) = turn_end(&events);
    assert_eq!(data["outcome"], "failed");
    assert!(data["error"].as_str().unwrap().contains("exited"), "{data}");

    let all = h
        .app
        .get_ok(&format!("/v1/agents/{}/permissions", h.agent))
        .await;
    let p = &all["items"][0];
    assert_eq!(p["request_id"], request_id.as_str());
    assert_eq!(p["status"], "expired");
    let agent = h.agent_view().await;
    assert!(
        !matches!(
            agent["status"].as_str(),
            Some("running" | "waiting_permission")
        ),
        "the agent is not left busy: {}",
        agent["status"]
    );
    assert_eq!(agent["pending_permissions"], 0);
    let decision = h.seen.lock().unwrap().decision.take().unwrap();
    assert!(
        matches!(decision.await, Ok(PermissionDecision::Cancelled)),
        "the adapter hears that nobody will answer"
    );
    // Answering it now is refused as expired.
    let res = h
        .app
        .post(
            &format!("/v1/agents/{}/permissions/{request_id}", h.agent),
            json!({"behavior": "allow"}),
        )
        .await;
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap();
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], "permission_expired");
    h.manager.shutdown(Duration::ZERO).await;
}

#[tokio::test]
async fn a_withdrawn_request_expires_a_late_handle_is_kept_and_an_interrupted_turn_is_canceled() {
    let h = harness(Plan::AskThenWithdraw, Duration::from_secs(5)).await;
    h.manager.prompt(&h.ctx, "go".into(), None).await.unwrap();
    // Wait for the delta sent after the withdrawal: everything before it is handled.
    let deadline = Instant::now() + Duration::from_secs(10);
    let events = loop {
        let events = h.app.timeline(&h.agent).await;
        if events.iter().any(|e| e["kind"] == "assistant_delta") {
            break events;
        }
        assert!(Instant::now() < deadline, "{:?}", kinds(&events));
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let requested = events
        .iter()
        .find(|e| e["kind"] == "permission_requested")
        .expect("the request is on the timeline");
    let request_id = requested["data"]["request_id"].as_str().unwrap();
    let resolved = events
        .iter()
        .find(|e| e["kind"] == "permission_resolved")
        .expect("its withdrawal too");
    assert_eq!(resolved["data"]["request_id"], request_id);
    assert_eq!(resolved["data"]["expired"], true);
    assert!(resolved["data"]["resolved_by"].is_null());
    let all = h
        .app
        .get_ok(&format!("/v1/agents/{}/permissions", h.agent))
        .await;
    assert_eq!(all["items"][0]["status"], "expired");
    let agent = h.agent_view().await;
    assert_eq!(agent["status"], "running", "no longer waiting for a person");
    assert_eq!(agent["pending_permissions"], 0);
    let decision = h.seen.lock().unwrap().decision.take().unwrap();
    assert!(decision.await.is_err(), "the answer channel is gone");
    let res = h
        .app
        .post(
            &format!("/v1/agents/{}/permissions/{request_id}", h.agent),
            json!({"behavior": "allow"}),
        )
        .await;
    assert_eq!(res.status().as_u16(), 409);

    // The session handle learned mid-session is stored.
    let (sid, persistence): (Option<String>, Option<Value>) =
        sqlx::query_as("SELECT provider_session_id, persistence FROM agents WHERE id = $1")
            .bind(h.ctx.id.uuid())
            .fetch_one(&h.app.pool)
            .await
            .unwrap();
    assert_eq!(sid.as_deref(), Some("fake-session-2"));
    assert_eq!(persistence, Some(json!({"session_id": "fake-session-2"})));

    // The agent ends the interrupted turn `failed`; it reads as canceled.
    h.manager.interrupt(h.ctx.id).await;
    let events = h.finished_timeline(Duration::from_secs(10)).await;
    let (_, data) = turn_end(&events);
    assert_eq!(data["outcome"], "canceled", "{data}");
    h.manager.shutdown(Duration::ZERO).await;
}

/// An agent abandoned by its server (a replica gone, a crash): its pending requests
/// expire, its turn fails and it is closed in the commit of the events and moments that
/// announce it. Were that commit to fail, everything stays as it was (the request
/// pending, the turn open), so the next attempt announces it all again instead of
/// leaving a change with no notification.
#[tokio::test]
async fn abandoned_requests_expire_only_once_their_end_is_committed() {
    use agentry::store;
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    let agent_id: uuid::Uuid = id.trim_start_matches("agt_").parse().unwrap();
    // As a server that died mid-turn leaves it: an open turn with a pending request.
    let turn = uuid::Uuid::now_v7();
    sqlx::query("UPDATE agents SET last_turn_id = $2, last_turn_outcome = NULL WHERE id = $1")
        .bind(agent_id)
        .bind(turn)
        .execute(&app.pool)
        .await
        .unwrap();
    let request = uuid::Uuid::now_v7();
    store::permissions::insert(
        &app.pool,
        store::permissions::NewPermission {
            id: request,
            agent_id,
            turn_id: Some(turn),
            provider_request_id: "p1",
            kind: "execute",
            title: "Run a command",
            call_id: None,
            input: None,
            options: &json!([]),
        },
    )
    .await
    .unwrap();
    let status = |pool: sqlx::PgPool| async move {
        store::permissions::get(&pool, agent_id, request)
            .await
            .unwrap()
            .unwrap()
            .status
    };
    let open = store::agents::open_agent(&app.pool, agent_id)
        .await
        .unwrap()
        .unwrap();

    // A writer whose database cannot be reached: nothing is committed.
    let unreachable = sqlx::postgres::PgPoolOptions::new().connect_lazy_with(
        (*app.pool.connect_options())
            .clone()
            .host("127.0.0.1")
            .port(1),
    );
    let limits = WriterLimits {
        commit_wait: Duration::from_millis(300),
        ..WriterLimits::default()
    };
    let cut_off = EventWriter::spawn(unreachable, Arc::new(Bus::new(64)), limits.clone());
    let failed = agentry::runtime::abandon_agent(&app.pool, &cut_off, &open, "lost", "lost").await;
    assert!(failed.is_err(), "nothing could be committed");
    assert_eq!(status(app.pool.clone()).await, "pending");
    let row = store::agents::open_agent(&app.pool, agent_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.last_turn_id, row.last_turn_outcome.as_deref()),
        (Some(turn), None),
        "the turn is still open"
    );

    // Again, with the database reachable: announced, then expired.
    let writer = EventWriter::spawn(app.pool.clone(), Arc::new(Bus::new(64)), limits);
    let done = agentry::runtime::abandon_agent(&app.pool, &writer, &open, "lost", "lost")
        .await
        .unwrap();
    assert!(done.turn_failed);
    assert_eq!(status(app.pool.clone()).await, "expired");
    let events = app.timeline(&id).await;
    let (_, end) = turn_end(&events);
    assert_eq!(end["outcome"], "failed");
    let row = store::agents::open_agent(&app.pool, agent_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.last_turn_outcome.as_deref(), Some("failed"));
}

/// A start while every pooled connection is taken: the process's ledger row waits for a
/// connection (within its patience) instead of the start failing at the first acquire
/// timeout, and it is stored once.
#[tokio::test]
async fn a_process_started_while_the_pool_is_exhausted_is_recorded_once_a_connection_frees() {
    let app = spawn_app().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(1))
        .connect_with((*app.pool.connect_options()).clone())
        .await
        .unwrap();
    let ledger = Ledger::new(pool.clone(), "exhausted");
    let held = pool.acquire().await.unwrap();
    let release = tokio::spawn(async move {
        // Three acquire timeouts long.
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(held);
    });
    let cwd = tempfile::tempdir().unwrap();
    let mut child = ledger
        .launch(&sleeper(cwd.path().to_owned()), None)
        .await
        .expect("the start waits for a connection");
    release.await.unwrap();
    let rows = ledger.list().await.unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].pid, child.identity.pid as i32);
    child.terminate(Duration::ZERO).await;
    assert!(
        ledger.list().await.unwrap().is_empty(),
        "reaped and forgotten"
    );
}
