//! One agent's actor: owns its provider session (and so its process), turns provider
//! events into timeline events, and runs the turn state machine:
//! idle → running ⇄ waiting_permission → idle, with every accepted prompt producing one
//! `turn_started`, one `user_message` and exactly one `turn_completed`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::permissions::{self, Permissions};
use super::{
    AgentContext, AgentLauncher, BrokeredEnv, Command, EndedTurn, Exhausted, Moment, RunningTurn,
    RuntimeError, Shared, Snapshot, TurnMeter, TurnSubject,
};
use crate::domain::{
    AgentId, AgentStatus, EventKind, MessageId, NewEvent, Redactor, ToolStatus, TurnId, TurnOutcome,
};
use crate::events::{Attached, Fence, NewMoment, NewTeamEvent, StateChange};
use crate::providers::{
    Provider, ProviderError, ProviderEvent, ProviderSession, SessionSpec, ToolCallUpdate,
    TurnInput, Usage,
};
use crate::store;

/// The reason an agent closed for being idle.
const IDLE_REASON: &str =
    "idle: the agent's process was stopped after the idle timeout; the next prompt resumes it";

struct OpenMessage {
    provider_id: Option<String>,
    id: MessageId,
    text: String,
}

struct Turn {
    id: TurnId,
    /// The turn's `user_message`, held until the provider names it (see
    /// `ProviderSession::records_user_messages`).
    pending_user: Option<Value>,
    message: Option<OpenMessage>,
    reasoning: Option<OpenMessage>,
    open_tools: BTreeMap<String, ToolCallUpdate>,
    interrupt_deadline: Option<Instant>,
    /// The turn's trace span, from its start until its outcome is stored.
    span: tracing::Span,
    /// Counts the turn as running for a draining server, until the turn is dropped.
    _running: RunningTurn,
    /// Watches the turn's usage against the budgets (none when nothing meters turns).
    meter: Option<Box<dyn TurnMeter>>,
    /// The turn's latest reported usage (a `usage` event's figures are the turn's so far).
    seen: Usage,
    started_at: chrono::DateTime<chrono::Utc>,
    /// When a wall-time cap ends the turn, and that cap.
    wall_cap: Option<(Instant, Exhausted)>,
    /// Why a budget stopped the turn, once one did: the turn's error.
    budget_stop: Option<String>,
}

/// The status an agent whose session is gone stops in, why, and the moments hooks hear
/// of with it.
struct Settled {
    status: AgentStatus,
    reason: String,
    moments: Vec<Moment>,
}

pub(crate) struct Actor {
    pub(super) shared: Arc<Shared>,
    ctx: AgentContext,
    provider: Arc<dyn Provider>,
    snapshot: watch::Sender<Snapshot>,
    generation: u64,
    session: Option<Box<dyn ProviderSession>>,
    provider_events: Option<mpsc::Receiver<ProviderEvent>>,
    status: AgentStatus,
    turn: Option<Turn>,
    pub(super) permissions: Permissions,
    /// Events emitted but not yet handed to the writer.
    outbox: Vec<NewEvent>,
    /// Moments attached to events of `outbox` (indexed in it).
    outbox_moments: Vec<NewMoment>,
    /// The agent's row changes the queued events announce (a mode, a model): written with
    /// them, under this actor's fence.
    outbox_changes: Vec<StateChange>,
    stop: bool,
    /// When the agent last did anything (a command, a provider event).
    last_activity: Instant,
    /// Masks the agent's team secret values in what it writes.
    pub(super) redactor: Redactor,
    /// A status change the writer kept while the store was unavailable: it commits
    /// later, in order, and the snapshot (what `wait` and the API see) follows it then.
    unpublished: bool,
    /// The lease epoch this actor writes with; deposed once another replica took the
    /// agent over (then it stops without writing anything more).
    fence: Option<Fence>,
    /// The stable code of the open turn's failure, when it has one (`resource_limit`),
    /// given with its `turn_completed`.
    turn_error_code: Option<&'static str>,
    /// A budget the open turn exhausted, acted on once the current batch is written.
    budget_hit: Option<Exhausted>,
}

impl Actor {
    pub(crate) fn new(
        shared: Arc<Shared>,
        ctx: AgentContext,
        provider: Arc<dyn Provider>,
        snapshot: watch::Sender<Snapshot>,
        generation: u64,
        epoch: Option<i64>,
    ) -> Self {
        let redactor = match &ctx.agentry_token {
            Some(token) => {
                let mut values = ctx.secret_env.clone();
                values.insert(" agentry token".to_owned(), token.clone());
                Redactor::new(&values)
            }
            None => Redactor::new(&ctx.secret_env),
        };
        let fence = epoch.map(|e| Fence::new(ctx.id, e));
        Self {
            shared,
            ctx,
            provider,
            snapshot,
            generation,
            session: None,
            provider_events: None,
            status: AgentStatus::Closed,
            turn: None,
            permissions: Permissions::default(),
            outbox: Vec::new(),
            outbox_moments: Vec::new(),
            outbox_changes: Vec::new(),
            stop: false,
            last_activity: Instant::now(),
            redactor,
            unpublished: false,
            fence,
            turn_error_code: None,
            budget_hit: None,
        }
    }

    /// The open turn's id, if a turn is open.
    pub(super) fn turn_id(&self) -> Option<TurnId> {
        self.turn.as_ref().map(|t| t.id)
    }

    pub(super) fn in_turn(&self) -> bool {
        self.turn.is_some()
    }

    pub(super) fn id(&self) -> AgentId {
        self.ctx.id
    }

    pub(crate) async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        if let Err(e) = self.open_session().await {
            tracing::warn!(agent_id = %self.id(), error = %e, "agent session did not start");
            self.close_egress();
            // Answer what is already queued, then stop: the agent stays in `error`.
            commands.close();
            while let Some(cmd) = commands.recv().await {
                self.reject(cmd, &e.to_string());
            }
            self.finish().await;
            return;
        }
        // Idle time counts from when the session is ready, not from when it began starting.
        self.last_activity = Instant::now();
        loop {
            let deadline = self.turn.as_ref().and_then(|t| t.interrupt_deadline);
            let idle_deadline = self.idle_deadline();
            let wall_cap = self
                .turn
                .as_ref()
                .filter(|t| t.budget_stop.is_none())
                .and_then(|t| t.wall_cap.as_ref().map(|(at, _)| *at));
            let writer = self.shared.writer.clone();
            tokio::select! {
                cmd = commands.recv() => {
                    // A refused connection is no work: it keeps no idle agent running.
                    if !matches!(cmd, Some(Command::NetworkDenied { .. })) {
                        self.last_activity = Instant::now();
                    }
                    match cmd {
                        Some(cmd) => self.handle_command(cmd).await,
                        None => self.close("the server dropped the agent").await,
                    }
                }
                ev = next_event(&mut self.provider_events) => {
                    self.last_activity = Instant::now();
                    self.handle_provider_event(ev).await
                }
                _ = sleep_until(deadline) => self.interrupt_timed_out().await,
                _ = sleep_until(idle_deadline) => self.close(IDLE_REASON).await,
                _ = sleep_until(wall_cap) => {
                    self.budget_hit = self.turn.as_ref().and_then(|t| t.wall_cap.as_ref()).map(|(_, x)| x.clone());
                }
                landed = landed(&writer), if self.unpublished => self.publish_landed(landed),
                _ = deposed(self.fence.as_ref()) => self.deposed().await,
            }
            // Take what else the provider has already sent, then write it as one batch.
            let mut taken = 0;
            while taken < 512 && !self.stop {
                match self.provider_events.as_mut().map(|rx| rx.try_recv()) {
                    Some(Ok(ev)) => self.handle_provider_event(Some(ev)).await,
                    _ => break,
                }
                taken += 1;
            }
            self.flush().await;
            // A budget ran out in this batch: the turn is interrupted now, not at its end.
            if let Some(hit) = self.budget_hit.take() {
                self.stop_for_budget(hit).await;
                self.flush().await;
            }
            if self.stop {
                break;
            }
        }
        self.close_egress();
        // Answer commands that raced with the stop; a new actor serves later ones (a
        // prompt is retried there: `ActorGone`).
        commands.close();
        while let Some(cmd) = commands.recv().await {
            match cmd {
                Command::Prompt { reply, .. } => {
                    let _ = reply.send(Err(RuntimeError::ActorGone));
                }
                Command::Ready { reply } => {
                    let _ = reply.send(Err(RuntimeError::ActorGone));
                }
                cmd => self.reject(cmd, "the agent was closed"),
            }
        }
        self.finish().await;
    }

    /// When an idle agent's process is stopped: only with no turn, no pending request.
    fn idle_deadline(&self) -> Option<Instant> {
        let idle = self.shared.idle_timeout?;
        (self.turn.is_none() && self.permissions.is_empty() && self.session.is_some())
            .then(|| self.last_activity + idle)
    }

    fn reject(&self, cmd: Command, why: &str) {
        match cmd {
            Command::Prompt { reply, .. } => {
                let _ = reply.send(Err(RuntimeError::StartFailed(why.to_owned())));
            }
            Command::Ready { reply } => {
                let _ = reply.send(Err(RuntimeError::StartFailed(why.to_owned())));
            }
            Command::Interrupt { reply } | Command::Close { reply, .. } => {
                let _ = reply.send(());
            }
            Command::SetMode { reply, .. } | Command::SetModel { reply, .. } => {
                let _ = reply.send(Err(RuntimeError::ActorGone));
            }
            Command::Answer { reply, .. } => {
                let _ = reply.send(Err(RuntimeError::PermissionExpired(
                    "the agent was closed".into(),
                )));
            }
            Command::NetworkDenied { .. } => {}
        }
    }

    async fn finish(&mut self) {
        // What this actor wrote is committed before its lease is given up: a later claim
        // starts a new epoch, which would fence off anything still on its way.
        if !self.is_deposed() {
            let _ = self.commit(Vec::new(), Vec::new()).await;
        }
        self.shared.writer.forget(self.id()).await;
        self.shared.remove_actor(self.id(), self.generation);
        self.shared.release_lease(self.id()).await;
    }

    // ---- session lifecycle -------------------------------------------------------------

    async fn open_session(&mut self) -> Result<(), RuntimeError> {
        kept(self.set_status(AgentStatus::Starting, None).await)?;
        let mcp_servers = match &self.ctx.mcp_servers {
            Value::Object(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            _ => BTreeMap::new(),
        };
        let spec = SessionSpec {
            cwd: self.ctx.cwd.clone(),
            model: self.ctx.model.clone(),
            mode: self.ctx.mode.clone(),
            system_prompt: self.ctx.system_prompt.clone(),
            mcp_servers,
            resume: self.ctx.persistence.clone(),
        };
        let (network, brokered) = match self.open_egress() {
            Ok(Some((n, b))) => (Some(n), b),
            Ok(None) => (None, None),
            Err(e) => {
                let message = format!("could not open the agent's egress endpoint: {e}");
                self.emit(
                    EventKind::Error,
                    json!({"message": message, "code": "provider_start_failed"}),
                )
                .await;
                self.set_status(AgentStatus::Error, Some(&message)).await?;
                return Err(RuntimeError::StartFailed(message));
            }
        };
        let launcher = Arc::new(AgentLauncher {
            ledger: self.shared.ledger.clone(),
            agent: self.id(),
            secret_env: self.ctx.secret_env.clone(),
            nice: self.shared.agent_nice,
            brokered,
            sandbox: self.shared.sandbox.clone().map(|s| {
                let view = crate::sandbox::AgentView {
                    agent: Some(self.id().uuid()),
                    worktree: self.ctx.cwd.clone(),
                    provider: Some(self.ctx.provider.clone()),
                    network,
                };
                (s, view)
            }),
        });
        let (tx, rx) = mpsc::channel(1024);
        match self.provider.start(spec, launcher, tx).await {
            Ok((session, info)) => {
                let how = if self.ctx.persistence.is_some() {
                    "resume"
                } else {
                    "new"
                };
                self.shared.sessions.with(&[&self.ctx.provider, how]).inc();
                self.session = Some(session);
                self.provider_events = Some(rx);
                if info.persistence.is_some() {
                    self.ctx.persistence = info.persistence.clone();
                }
                let (pool, id) = (&self.shared.pool, self.id().uuid());
                let epoch = self.fence.as_ref().map(Fence::epoch);
                let stored = self
                    .until_stored(|| {
                        store::agents::set_session(
                            pool,
                            id,
                            info.provider_session_id.as_deref(),
                            info.persistence.as_ref(),
                            epoch,
                        )
                    })
                    .await?;
                if !stored && self.fence.is_some() {
                    self.fenced_off();
                    return Err(crate::events::WriteError::Fenced.into());
                }
                if let Some(mode) = &info.current_mode
                    && self.ctx.mode.as_ref() != Some(mode)
                {
                    self.ctx.mode = Some(mode.clone());
                    self.outbox_changes.push(StateChange::Mode {
                        agent: self.id(),
                        mode: mode.clone(),
                    });
                }
                if let Some(model) = &info.current_model
                    && self.ctx.model.as_ref() != Some(model)
                {
                    self.ctx.model = Some(model.clone());
                    self.outbox_changes.push(StateChange::Model {
                        agent: self.id(),
                        model: model.clone(),
                    });
                }
                self.snapshot.send_modify(|s| {
                    s.pid = info.pid;
                    s.provider_session_id = info.provider_session_id.clone();
                });
                self.emit(
                    EventKind::SessionStarted,
                    json!({"provider_session_id": info.provider_session_id, "resumed": info.resumed, "pid": info.pid}),
                )
                .await;
                kept(self.set_status(AgentStatus::Idle, None).await)?;
                Ok(())
            }
            Err(e) => {
                let message = e.to_string();
                self.emit(
                    EventKind::Error,
                    json!({"message": message, "code": "provider_start_failed"}),
                )
                .await;
                self.set_status(AgentStatus::Error, Some(&message)).await?;
                Err(RuntimeError::StartFailed(message))
            }
        }
    }

    /// A write of the agent's own row while its session opens, tried again while the
    /// database is unavailable (a pool wait under load, a restart): a session that started
    /// is not given up for a write that can succeed a moment later. Ends early only when
    /// the server stops.
    async fn until_stored<F, Fut, T>(&self, mut write: F) -> Result<T, RuntimeError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let mut pause = std::time::Duration::from_millis(100);
        loop {
            match write().await {
                Ok(v) => return Ok(v),
                Err(e)
                    if crate::events::classify(&e) == crate::events::Fault::Unavailable
                        && !self.shared.is_shutting_down() =>
                {
                    tracing::warn!(agent_id = %self.id(), error = %e, "the database did not take the agent's session; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// In the `proxy` network mode, the agent's egress endpoint, opened (again) with its
    /// allow list and, when its provider's key can be added there, that key; what its
    /// sandbox needs to use it, and what its processes get in place of the key. `None`
    /// in the other modes.
    fn open_egress(
        &self,
    ) -> std::io::Result<Option<(crate::sandbox::NetworkPlan, Option<BrokeredEnv>)>> {
        if !self.shared.uses_egress() {
            return Ok(None);
        }
        let Some(egress) = &self.shared.egress else {
            return Ok(None);
        };
        // An agent started without a list (none was read for it) reaches nothing.
        let allow = self.ctx.egress_allow.clone().unwrap_or_default();
        let brokering = self
            .shared
            .registry
            .brokering(&self.ctx.provider, &self.ctx.secret_env);
        let mut files = Vec::new();
        let (brokered, env) = match brokering {
            Ok(b) => {
                files = b.files;
                (
                    b.brokered,
                    Some(BrokeredEnv {
                        withhold: b.withhold,
                        env: b.env,
                        args: b.args,
                        json_env: b.json_env,
                    }),
                )
            }
            Err(why) => {
                tracing::debug!(agent_id = %self.id(), provider = %self.ctx.provider, why, "the provider's credential is not brokered");
                (Vec::new(), None)
            }
        };
        let net = egress.open(self.id(), allow, brokered)?;
        let mut plan = crate::sandbox::NetworkPlan::from(net);
        // Rewritten configuration files live in the endpoint's directory (removed with
        // it) and are shown in place of the originals.
        for (i, (inside, contents)) in files.into_iter().enumerate() {
            let host = egress.endpoint_dir(self.id()).join(format!("brokered-{i}"));
            write_private(&host, &contents)?;
            plan.files.push((host, inside));
        }
        Ok(Some((plan, env)))
    }

    /// Close the agent's egress endpoint (its connections end, its directory goes):
    /// before the mailbox closes, so that a later actor of the agent never has its new
    /// endpoint closed by this one.
    fn close_egress(&self) {
        if let Some(egress) = &self.shared.egress {
            egress.close(self.id());
        }
    }

    /// Stop the session and the actor. The agent stays resumable.
    async fn close(&mut self, reason: &str) {
        self.stop_session().await;
        self.settle(
            Settled {
                status: AgentStatus::Closed,
                reason: reason.to_owned(),
                moments: vec![Moment::Closed {}],
            },
            TurnOutcome::Canceled,
            format!("the agent was closed: {reason}"),
        )
        .await;
    }

    /// The session is gone: the agent stops in `settled`'s status. An open turn ends
    /// with `outcome` and `error` in the same commit, so nobody sees the turn over and
    /// the agent still busy.
    async fn settle(&mut self, settled: Settled, outcome: TurnOutcome, error: String) {
        if self.turn.is_some() {
            self.finish_turn_then(outcome, Some(error), None, Some(settled))
                .await;
        } else {
            let _ = self
                .set_status_with(settled.status, Some(&settled.reason), settled.moments)
                .await;
        }
        self.stop = true;
    }

    /// End the provider session and process; handle what it reported before it ended.
    async fn stop_session(&mut self) {
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        if let Some(mut rx) = self.provider_events.take() {
            while let Ok(ev) = rx.try_recv() {
                if !matches!(
                    ev,
                    ProviderEvent::Exited { .. } | ProviderEvent::TurnEnded { .. }
                ) {
                    self.handle_provider_event(Some(ev)).await;
                }
            }
        }
        self.snapshot.send_modify(|s| s.pid = None);
    }

    // ---- commands ----------------------------------------------------------------------

    async fn handle_command(&mut self, cmd: Command) {
        match cmd {
            Command::Prompt {
                text,
                client_message_id,
                reply,
            } => {
                let r = self.start_turn(text, client_message_id).await;
                let _ = reply.send(r);
            }
            Command::Interrupt { reply } => {
                self.interrupt().await;
                let _ = reply.send(());
            }
            Command::Ready { reply } => {
                let _ = reply.send(Ok(()));
            }
            Command::SetMode { mode, reply } => {
                let mut held = Vec::new();
                let r = match self.session.as_mut() {
                    Some(s) => {
                        while_reading(s.set_mode(&mode), &mut self.provider_events, &mut held)
                            .await
                            .map_err(unsupported)
                    }
                    None => Err(RuntimeError::ActorGone),
                };
                for ev in held {
                    self.handle_provider_event(Some(ev)).await;
                }
                if r.is_ok() {
                    self.settle_change(Some(mode), None).await;
                }
                let _ = reply.send(r);
            }
            Command::SetModel { model, reply } => {
                let mut held = Vec::new();
                let r = match self.session.as_mut() {
                    Some(s) => {
                        while_reading(s.set_model(&model), &mut self.provider_events, &mut held)
                            .await
                            .map_err(unsupported)
                    }
                    None => Err(RuntimeError::ActorGone),
                };
                for ev in held {
                    self.handle_provider_event(Some(ev)).await;
                }
                if r.is_ok() {
                    self.settle_change(None, Some(model)).await;
                }
                let _ = reply.send(r);
            }
            Command::Answer { id, answer, reply } => {
                let r = self.answer(id, answer).await;
                let _ = reply.send(r);
            }
            Command::Close { reason, reply } => {
                self.close(&reason).await;
                let _ = reply.send(());
            }
            Command::NetworkDenied { host, port, reason } => {
                self.emit(
                    EventKind::NetworkDenied,
                    json!({"host": host, "port": port, "reason": reason}),
                )
                .await;
            }
        }
    }

    /// After the provider accepted a mode or model change: record what it reported so far,
    /// and the change itself if it reported nothing, before the caller reads the agent.
    async fn settle_change(&mut self, mode: Option<String>, model: Option<String>) {
        while let Some(rx) = self.provider_events.as_mut() {
            match rx.try_recv() {
                Ok(ev) => self.handle_provider_event(Some(ev)).await,
                Err(_) => break,
            }
        }
        if let Some(mode) = mode
            && self.ctx.mode.as_ref() != Some(&mode)
        {
            self.handle_provider_event(Some(ProviderEvent::ModeChanged { mode }))
                .await;
        }
        if let Some(model) = model
            && self.ctx.model.as_ref() != Some(&model)
        {
            self.handle_provider_event(Some(ProviderEvent::ModelChanged { model }))
                .await;
        }
        // The caller's answer follows: whoever reads the timeline after it sees the change.
        if let Err(e) = self.commit(Vec::new(), Vec::new()).await {
            tracing::warn!(agent_id = %self.id(), error = %e, "could not commit a mode or model change");
        }
    }

    async fn start_turn(
        &mut self,
        text: String,
        client_message_id: Option<String>,
    ) -> Result<TurnId, RuntimeError> {
        if self.turn.is_some() {
            return Err(RuntimeError::Busy);
        }
        if self.session.is_none() {
            return Err(RuntimeError::StartFailed(
                "the agent has no running session".into(),
            ));
        }
        // Counted before the stop flag is read: a draining server either sees this turn
        // or this turn sees the server stopping (and is refused, to run elsewhere).
        let running = RunningTurn::new(self.shared.clone());
        if self.shared.is_shutting_down() {
            return Err(RuntimeError::ShuttingDown);
        }
        let meter = match self.shared.spend.get() {
            Some(spend) => Some(
                spend
                    .open_turn(&self.turn_subject())
                    .await
                    .map_err(|x| RuntimeError::BudgetExhausted(Box::new(x)))?,
            ),
            None => None,
        };
        let wall_cap = meter
            .as_ref()
            .and_then(|m| m.wall_time())
            .map(|(left, cap)| (Instant::now() + left, cap));
        let turn_id = TurnId::new();
        self.status = AgentStatus::Running;
        self.turn = Some(Turn {
            id: turn_id,
            pending_user: None,
            message: None,
            reasoning: None,
            open_tools: BTreeMap::new(),
            interrupt_deadline: None,
            span: tracing::info_span!(parent: None, "turn", agent_id = %self.id(),
                turn_id = %turn_id, provider = %self.ctx.provider,
                outcome = tracing::field::Empty, otel.status_code = tracing::field::Empty),
            _running: running,
            meter,
            seen: Usage::default(),
            started_at: chrono::Utc::now(),
            wall_cap,
            budget_stop: None,
        });
        let mut user = json!({"message_id": MessageId::new(), "text": text});
        if let Some(c) = &client_message_id {
            user["client_message_id"] = json!(c);
        }
        let mut opening = vec![self.event(EventKind::TurnStarted, json!({"turn_id": turn_id}))];
        if self
            .session
            .as_ref()
            .is_some_and(|s| s.records_user_messages())
        {
            if let Some(turn) = self.turn.as_mut() {
                turn.pending_user = Some(user);
            }
        } else {
            opening.push(self.event(EventKind::UserMessage, user));
        }
        self.shared.turns_started.with(&[&self.ctx.provider]).inc();
        // The turn's opening, the status it puts the agent in and the agent's row: one
        // commit.
        let (status, team, change) = self.status_events(AgentStatus::Running, None);
        opening.push(status);
        let started = self
            .commit_with(
                opening,
                Attached {
                    fence: None,
                    team: vec![team],
                    moments: vec![Moment::TurnStarted { turn_id }.at(0)],
                    changes: vec![
                        StateChange::TurnStarted {
                            agent: self.id(),
                            turn: turn_id,
                        },
                        change,
                    ],
                },
            )
            .await;
        if started.is_ok() {
            self.snapshot
                .send_modify(|s| s.status = AgentStatus::Running);
        }
        if let Err(e) = started.map_err(RuntimeError::from) {
            // The store did not confirm the turn's start (it may still commit it, in
            // order): the prompt is not sent, and the turn ends failed so the timeline
            // stays whole and the agent is not left busy.
            self.finish_turn(
                TurnOutcome::Failed,
                Some(format!(
                    "the turn could not be started ({e}); the prompt was not sent"
                )),
                None,
            )
            .await;
            return Err(e);
        }
        // An adapter may await the CLI's answer to the prompt (Codex's `turn/start`),
        // which can sit behind events already sent: keep reading them meanwhile.
        let mut held = Vec::new();
        let sent = match self.session.as_mut() {
            Some(s) => {
                while_reading(
                    s.prompt(TurnInput { text }),
                    &mut self.provider_events,
                    &mut held,
                )
                .await
            }
            None => Err(ProviderError::Gone),
        };
        for ev in held {
            self.handle_provider_event(Some(ev)).await;
        }
        if let Err(e) = sent {
            self.finish_turn(
                TurnOutcome::Failed,
                Some(format!("the prompt could not be delivered: {e}")),
                None,
            )
            .await;
        }
        Ok(turn_id)
    }

    async fn interrupt(&mut self) {
        let Some(turn) = self.turn.as_mut() else {
            return;
        };
        if turn.interrupt_deadline.is_none() {
            turn.interrupt_deadline = Some(Instant::now() + self.shared.interrupt_grace);
        }
        let mut held = Vec::new();
        if let Some(s) = self.session.as_mut()
            && let Err(e) = while_reading(s.interrupt(), &mut self.provider_events, &mut held).await
        {
            tracing::warn!(agent_id = %self.ctx.id, error = %e, "interrupt failed");
        }
        for ev in held {
            self.handle_provider_event(Some(ev)).await;
        }
    }

    fn turn_subject(&self) -> TurnSubject {
        TurnSubject {
            agent: self.id(),
            team: self.ctx.team_id,
            provider: self.ctx.provider.clone(),
            model: self.ctx.model.clone(),
        }
    }

    /// A budget ran out while the turn ran: say so on the timeline and interrupt the turn,
    /// which ends `canceled` with error code `budget_exhausted`.
    async fn stop_for_budget(&mut self, hit: Exhausted) {
        let Some(turn) = self.turn.as_mut() else {
            return;
        };
        if turn.budget_stop.is_some() {
            return;
        }
        let why = hit.to_string();
        turn.budget_stop = Some(why.clone());
        tracing::info!(agent_id = %self.ctx.id, budget = %hit.budget, "a budget ran out; interrupting the turn");
        self.emit(
            EventKind::Error,
            json!({"message": why, "code": "budget_exhausted", "budget": hit}),
        )
        .await;
        self.turn_error_code = Some("budget_exhausted");
        self.interrupt().await;
    }

    /// The provider did not end the turn after an interrupt: stop it the hard way.
    async fn interrupt_timed_out(&mut self) {
        tracing::warn!(agent_id = %self.id(), "the agent ignored the interrupt; stopping its process");
        self.stop_session().await;
        self.settle(
            Settled {
                status: AgentStatus::Closed,
                reason: "stopped after an interrupt timed out".into(),
                moments: Vec::new(),
            },
            TurnOutcome::Canceled,
            "the agent did not stop in time; its process was stopped".into(),
        )
        .await;
    }

    // ---- provider events ---------------------------------------------------------------

    async fn handle_provider_event(&mut self, ev: Option<ProviderEvent>) {
        let ev = ev.unwrap_or(ProviderEvent::Exited {
            reason: "the connection to the agent closed".into(),
        });
        // A held user_message goes out before anything else of its turn: under the
        // provider's id when this is the provider naming it, else under agentry's.
        let named = match &ev {
            ProviderEvent::UserMessageRecorded { message_id } => Some(message_id.clone()),
            _ => None,
        };
        self.release_user_message(named).await;
        match ev {
            ProviderEvent::UserMessageRecorded { .. } => {}
            ProviderEvent::AssistantDelta { message_id, text } => {
                self.delta(false, message_id, text).await
            }
            ProviderEvent::ReasoningDelta { id, text } => self.delta(true, id, text).await,
            ProviderEvent::AssistantMessage { message_id, text } => {
                // Whole messages become one delta plus the message, keeping the invariant
                // that deltas concatenate to the message.
                self.close_message(false).await;
                self.delta(false, message_id, text).await;
                self.close_message(false).await;
            }
            ProviderEvent::ToolCall(update) => {
                self.close_message(false).await;
                self.close_message(true).await;
                if let Some(turn) = self.turn.as_mut() {
                    if update.status.is_final() {
                        turn.open_tools.remove(&update.call_id);
                    } else {
                        turn.open_tools
                            .insert(update.call_id.clone(), update.clone());
                    }
                }
                let mut data = tool_json(&update);
                if let Some(child) = self.child_made_by(&update).await {
                    data["child_agent"] = json!(child.to_string());
                }
                self.emit(EventKind::ToolCall, data).await;
            }
            ProviderEvent::PermissionRequested(req) => self.permission_requested(req).await,
            ProviderEvent::Plan { entries } => {
                self.emit(EventKind::Plan, json!({"entries": entries}))
                    .await
            }
            ProviderEvent::Usage(u) => {
                if let Some(turn) = self.turn.as_mut() {
                    turn.seen = merged(&turn.seen, &u);
                    if turn.budget_stop.is_none()
                        && self.budget_hit.is_none()
                        && let Some(meter) = turn.meter.as_mut()
                    {
                        self.budget_hit = meter.observe(&turn.seen);
                    }
                }
                self.emit(EventKind::Usage, json!(u)).await
            }
            ProviderEvent::ModeChanged { mode } => {
                self.ctx.mode = Some(mode.clone());
                self.emit(EventKind::ModeChanged, json!({"mode": mode}))
                    .await;
                self.outbox_changes.push(StateChange::Mode {
                    agent: self.id(),
                    mode,
                });
            }
            ProviderEvent::ModelChanged { model } => {
                self.ctx.model = Some(model.clone());
                self.emit(EventKind::ModelChanged, json!({"model": model}))
                    .await;
                self.outbox_changes.push(StateChange::Model {
                    agent: self.id(),
                    model,
                });
            }
            ProviderEvent::SessionUpdated {
                provider_session_id,
                persistence,
            } => self.session_updated(provider_session_id, persistence).await,
            ProviderEvent::PermissionWithdrawn {
                provider_request_id,
            } => self.permission_withdrawn(&provider_request_id).await,
            ProviderEvent::Error { message, code } => {
                self.emit(EventKind::Error, json!({"message": message, "code": code}))
                    .await
            }
            ProviderEvent::TurnEnded {
                outcome,
                error,
                usage,
            } => {
                if self.turn.is_some() {
                    let outcome = match self.turn.as_ref().and_then(|t| t.interrupt_deadline) {
                        // A turn that ends after an interrupt is canceled, whatever the
                        // agent calls it (Claude Code ends it `error_during_execution`).
                        Some(_) => TurnOutcome::Canceled,
                        None => outcome,
                    };
                    // A tree over its limit is ended; the turn it ran in fails with it,
                    // even when the agent answered before the limit's watch noticed.
                    if let Some(hit) = self.shared.ledger.stop_if_over_limit(self.id()) {
                        let why = format!("the agent's processes were stopped: {hit}");
                        self.emit(
                            EventKind::Error,
                            json!({"message": why, "code": "resource_limit"}),
                        )
                        .await;
                        self.turn_error_code = Some("resource_limit");
                        self.finish_turn(TurnOutcome::Failed, Some(why), usage)
                            .await;
                        return;
                    }
                    // A turn a budget stopped says which budget, whatever the agent says.
                    let error = self
                        .turn
                        .as_ref()
                        .and_then(|t| t.budget_stop.clone())
                        .or(error);
                    self.finish_turn(outcome, error, usage).await;
                }
            }
            ProviderEvent::Exited { reason } => {
                self.provider_events = None;
                if let Some(session) = self.session.take() {
                    session.close().await;
                }
                self.snapshot.send_modify(|s| s.pid = None);
                let why = match self.shared.ledger.take_limit_hit(self.id()) {
                    Some(hit) if self.turn.is_some() => {
                        let why = format!("the agent's processes were stopped: {hit}");
                        self.emit(
                            EventKind::Error,
                            json!({"message": why, "code": "resource_limit"}),
                        )
                        .await;
                        self.turn_error_code = Some("resource_limit");
                        why
                    }
                    Some(hit) => format!("the agent's processes were stopped: {hit}"),
                    None => format!("the agent process exited: {reason}"),
                };
                self.settle(
                    Settled {
                        status: AgentStatus::Error,
                        reason: why.clone(),
                        moments: Vec::new(),
                    },
                    TurnOutcome::Failed,
                    why,
                )
                .await;
            }
        }
    }

    async fn delta(&mut self, reasoning: bool, provider_id: Option<String>, text: String) {
        let needs_new = {
            let slot = self.message_slot(reasoning);
            match slot {
                Some(m) => {
                    provider_id.is_some() && m.provider_id.is_some() && m.provider_id != provider_id
                }
                None => true,
            }
        };
        if needs_new {
            self.close_message(reasoning).await;
            let m = OpenMessage {
                provider_id: provider_id.clone(),
                id: MessageId::new(),
                text: String::new(),
            };
            self.set_message_slot(reasoning, Some(m));
        }
        // Outside a turn there is no message to add to.
        let Some(m) = self.message_slot_mut(reasoning) else {
            return;
        };
        m.text.push_str(&text);
        let id = m.id;
        if reasoning {
            self.emit(EventKind::ReasoningDelta, chunk("id", id, text))
                .await;
        } else {
            self.emit(EventKind::AssistantDelta, chunk("message_id", id, text))
                .await;
        }
    }

    fn message_slot(&self, reasoning: bool) -> Option<&OpenMessage> {
        let turn = self.turn.as_ref()?;
        if reasoning {
            turn.reasoning.as_ref()
        } else {
            turn.message.as_ref()
        }
    }

    fn message_slot_mut(&mut self, reasoning: bool) -> Option<&mut OpenMessage> {
        let turn = self.turn.as_mut()?;
        if reasoning {
            turn.reasoning.as_mut()
        } else {
            turn.message.as_mut()
        }
    }

    fn set_message_slot(&mut self, reasoning: bool, m: Option<OpenMessage>) {
        if let Some(turn) = self.turn.as_mut() {
            if reasoning {
                turn.reasoning = m;
            } else {
                turn.message = m;
            }
        }
    }

    /// Close the open assistant message (or reasoning block) with its whole text.
    pub(super) async fn close_message(&mut self, reasoning: bool) {
        let Some(turn) = self.turn.as_mut() else {
            return;
        };
        let taken = if reasoning {
            turn.reasoning.take()
        } else {
            turn.message.take()
        };
        if let Some(m) = taken {
            if reasoning {
                self.emit(EventKind::Reasoning, json!({"id": m.id, "text": m.text}))
                    .await;
            } else {
                self.emit(
                    EventKind::AssistantMessage,
                    json!({"message_id": m.id, "text": m.text}),
                )
                .await;
            }
        }
    }

    /// Store a session id or persistence handle the provider learned after the start.
    async fn session_updated(
        &mut self,
        provider_session_id: Option<String>,
        persistence: Option<Value>,
    ) {
        if provider_session_id.is_none() && persistence.is_none() {
            return;
        }
        match store::agents::set_session(
            &self.shared.pool,
            self.id().uuid(),
            provider_session_id.as_deref(),
            persistence.as_ref(),
            self.fence.as_ref().map(Fence::epoch),
        )
        .await
        {
            Ok(false) if self.fence.is_some() => {
                self.fenced_off();
                return;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(agent_id = %self.id(), error = %e, "could not store the session handle");
            }
        }
        if persistence.is_some() {
            self.ctx.persistence = persistence;
        }
        if let Some(sid) = provider_session_id {
            self.snapshot
                .send_modify(|s| s.provider_session_id = Some(sid));
        }
    }

    /// Write the turn's held `user_message`, if any, under `provider_id` when given.
    async fn release_user_message(&mut self, provider_id: Option<String>) {
        let Some(turn) = self.turn.as_mut() else {
            return;
        };
        let Some(mut user) = turn.pending_user.take() else {
            return;
        };
        let turn_id = turn.id;
        if let Some(id) = provider_id {
            user["message_id"] = json!(id);
        }
        self.emit_in(Some(turn_id), EventKind::UserMessage, user)
            .await;
    }

    async fn finish_turn(
        &mut self,
        outcome: TurnOutcome,
        error: Option<String>,
        usage: Option<Usage>,
    ) {
        self.finish_turn_then(outcome, error, usage, None).await;
    }

    /// End the open turn. The agent goes back to idle while its session lives on, or
    /// into `settled` when the session is gone; either status is committed with
    /// `turn_completed` and written to the agent's row in the same statement as the
    /// turn's outcome.
    async fn finish_turn_then(
        &mut self,
        outcome: TurnOutcome,
        error: Option<String>,
        usage: Option<Usage>,
        settled: Option<Settled>,
    ) {
        // Exactly one user_message per turn, even when the provider never named it.
        self.release_user_message(None).await;
        self.close_message(true).await;
        self.close_message(false).await;
        let Some(turn) = self.turn.take() else { return };
        turn.span.record("outcome", outcome.as_str());
        // The ledger's row, before the turn's end is visible: whoever sees the agent idle
        // finds the turn in the ledger.
        if let Some(spend) = self.shared.spend.get() {
            spend
                .record(EndedTurn {
                    subject: self.turn_subject(),
                    turn: turn.id,
                    usage: merged(&turn.seen, usage.as_ref().unwrap_or(&Usage::default())),
                    started_at: turn.started_at,
                    ended_at: chrono::Utc::now(),
                })
                .await;
        }
        if outcome == TurnOutcome::Failed {
            turn.span.record("otel.status_code", "ERROR");
        }
        // A tool call the agent never closed is `failed` (CONTRACT.md), whatever the
        // turn's outcome; the error says why.
        for (_, mut tool) in turn.open_tools {
            tool.status = ToolStatus::Failed;
            tool.error = Some(
                match outcome {
                    TurnOutcome::Canceled => "the turn was canceled before the tool call finished",
                    _ => "the turn ended before the tool call finished",
                }
                .into(),
            );
            self.emit_in(Some(turn.id), EventKind::ToolCall, tool_json(&tool))
                .await;
        }
        // Requests nobody answered expire with the turn (in the commit of its end); the
        // provider hears "cancelled". Every request stored as pending is in `permissions`
        // until it is answered or withdrawn.
        let expired = self.permissions.expire_all();
        let mut data = json!({"turn_id": turn.id, "outcome": outcome});
        if let Some(e) = &error {
            data["error"] = json!(e);
        }
        if let Some(code) = self.turn_error_code.take() {
            data["error_code"] = json!(code);
        }
        if let Some(u) = &usage {
            data["usage"] = json!(u);
        }
        let ev = NewEvent {
            agent_id: self.id(),
            turn_id: Some(turn.id),
            kind: EventKind::TurnCompleted,
            data,
        };
        // The hooks hear of the expired requests, then of the turn's end, with this event.
        let mut moments: Vec<NewMoment> = expired
            .iter()
            .map(|&request_id| {
                Moment::PermissionResolved {
                    request_id,
                    resolution: permissions::expired_resolution(),
                }
                .at(0)
            })
            .collect();
        moments.push(
            Moment::TurnEnded {
                turn_id: turn.id,
                outcome,
                error: error.clone(),
            }
            .at(0),
        );
        // A session that lives on goes back to idle with the turn's end, in its commit.
        let next = match settled {
            Some(s) => {
                // The settled status's moments go with its event, the second of the write.
                moments.extend(s.moments.into_iter().map(|m| m.at(1)));
                Some((s.status, Some(self.redactor.text(&s.reason).into_owned())))
            }
            None if self.session.is_some() && self.status != AgentStatus::Idle => {
                Some((AgentStatus::Idle, None))
            }
            None => None,
        };
        let mut events = vec![ev];
        let mut team = Vec::new();
        let mut changes: Vec<StateChange> = expired
            .iter()
            .map(|id| StateChange::PermissionExpired(*id))
            .collect();
        changes.push(StateChange::TurnEnded {
            agent: self.id(),
            turn: turn.id,
            outcome,
            error,
        });
        if let Some((status, reason)) = &next {
            let (event, status_team, change) = self.status_events(*status, reason.as_deref());
            events.push(event);
            team.push(status_team);
            changes.push(change);
        }
        let committed = self
            .commit_with(
                events,
                Attached {
                    fence: None,
                    team,
                    moments,
                    changes,
                },
            )
            .await;
        if let Err(e) = &committed {
            tracing::error!(error = %e, "could not record the end of a turn");
        }
        self.shared
            .turns
            .with(&[&self.ctx.provider, outcome.as_str()])
            .inc();
        if let Some((status, _)) = next {
            self.status = status;
            self.publish_status(&committed);
        }
        // Whoever starts waiting prompts hears that this agent may take one.
        self.shared.turns_ended.notify_one();
    }

    /// After a commit that changed the status: publish it when it is committed; when the
    /// writer kept it for later (the store is unavailable), once it has landed. A turn's
    /// end committed after a stall then still ends the turn for those who wait on it.
    fn publish_status<T>(&mut self, committed: &Result<T, crate::events::WriteError>) {
        match committed {
            Ok(_) => {
                let status = self.status;
                self.snapshot.send_modify(|s| s.status = status);
                self.unpublished = false;
            }
            Err(crate::events::WriteError::Unavailable) => self.unpublished = true,
            // Stopped: it never lands. Fenced: the agent is another replica's now.
            Err(crate::events::WriteError::Stopped | crate::events::WriteError::Fenced) => {}
        }
    }

    /// What the writer kept has landed (or the writer stopped, and it never will).
    fn publish_landed(&mut self, landed: bool) {
        self.unpublished = false;
        if landed {
            let status = self.status;
            self.snapshot.send_modify(|s| s.status = status);
            tracing::info!(agent_id = %self.id(), status = status.as_str(), "a status kept through a store outage is committed");
        }
    }

    // ---- writing -----------------------------------------------------------------------

    pub(super) fn event(&self, kind: EventKind, data: Value) -> NewEvent {
        NewEvent {
            agent_id: self.id(),
            turn_id: self.turn.as_ref().map(|t| t.id),
            kind,
            data,
        }
    }

    /// Queue an event; it goes to the writer with the next `flush` (in order with
    /// everything else this actor writes).
    /// The child agent a completed call of agentry's `create_agent` tool made: an agent
    /// named in the call's output whose parent is this agent. Names vary by CLI
    /// (`mcp__agentry__create_agent`, `agentry_create_agent`, …); the store has the last
    /// word, so an output that merely mentions some agent links nothing.
    async fn child_made_by(&self, call: &ToolCallUpdate) -> Option<AgentId> {
        if call.status != ToolStatus::Completed || !call.name.contains("create_agent") {
            return None;
        }
        let mut candidates = Vec::new();
        agent_ids_in(call.output.as_ref()?, &mut candidates);
        if candidates.is_empty() {
            return None;
        }
        match store::agents::child_among(&self.shared.pool, self.ctx.id.uuid(), &candidates).await {
            Ok(found) => found.map(AgentId::from),
            Err(e) => {
                tracing::warn!(agent_id = %self.ctx.id, error = %e, "could not link a child agent");
                None
            }
        }
    }

    pub(super) async fn emit(&mut self, kind: EventKind, data: Value) {
        let ev = self.event(kind, data);
        self.outbox.push(ev);
    }

    /// Attach `moment` to the last event emitted (it is stored with it).
    pub(super) fn attach(&mut self, moment: Moment) {
        if let Some(last) = self.outbox.len().checked_sub(1) {
            self.outbox_moments.push(moment.at(last));
        }
    }

    async fn emit_in(&mut self, turn: Option<TurnId>, kind: EventKind, data: Value) {
        self.outbox.push(NewEvent {
            agent_id: self.id(),
            turn_id: turn,
            kind,
            data,
        });
    }

    /// A write of this actor outside the writer found the agent in another epoch: count
    /// it and depose the fence (the actor then stops, as after a refused batch).
    fn fenced_off(&self) {
        if let Some(fence) = &self.fence {
            self.shared.writer.fenced_off(fence);
        }
    }

    fn is_deposed(&self) -> bool {
        self.fence.as_ref().is_some_and(Fence::is_deposed)
    }

    /// Another replica took the agent over (the writer refused a batch of this actor):
    /// stop the provider process at once and write nothing more. The timeline and the
    /// agent's row are the new owner's.
    async fn deposed(&mut self) {
        tracing::warn!(agent_id = %self.id(), "another replica took this agent over; stopping it here without writing");
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        self.provider_events = None;
        self.outbox.clear();
        self.outbox_moments.clear();
        self.outbox_changes.clear();
        self.permissions.abandon();
        self.turn = None;
        self.status = AgentStatus::Closed;
        self.snapshot.send_modify(|s| {
            s.status = AgentStatus::Closed;
            s.pid = None;
        });
        self.stop = true;
    }

    /// Hand the queued events to the writer as one batch.
    async fn flush(&mut self) {
        if self.is_deposed() {
            self.outbox.clear();
            self.outbox_moments.clear();
            self.outbox_changes.clear();
            return;
        }
        if self.outbox.is_empty() {
            return;
        }
        let mut events = std::mem::take(&mut self.outbox);
        let mut attached = Attached {
            moments: std::mem::take(&mut self.outbox_moments),
            changes: std::mem::take(&mut self.outbox_changes),
            fence: self.fence.clone(),
            ..Attached::default()
        };
        self.redact(&mut events, &mut attached);
        if let Err(e) = self
            .shared
            .writer
            .append_many_attached(events, attached)
            .await
        {
            tracing::error!(agent_id = %self.id(), error = %e, "could not queue events");
        }
    }

    /// Write `events` (after anything queued) and wait until they are committed.
    async fn commit(
        &mut self,
        events: Vec<NewEvent>,
        team: Vec<NewTeamEvent>,
    ) -> Result<Vec<crate::domain::AgentEvent>, crate::events::WriteError> {
        let attached = Attached {
            team,
            ..Attached::default()
        };
        self.commit_with(events, attached).await
    }

    /// `commit`, with moments attached to `events` (indexed in them) and the state
    /// changes they announce: all of it commits together.
    pub(super) async fn commit_with(
        &mut self,
        events: Vec<NewEvent>,
        mut attached: Attached,
    ) -> Result<Vec<crate::domain::AgentEvent>, crate::events::WriteError> {
        let mut all = std::mem::take(&mut self.outbox);
        let mut all_moments = std::mem::take(&mut self.outbox_moments);
        let mut changes = std::mem::take(&mut self.outbox_changes);
        changes.append(&mut attached.changes);
        attached.changes = changes;
        let offset = all.len();
        all_moments.extend(attached.moments.drain(..).map(|mut m| {
            m.event += offset;
            m
        }));
        attached.moments = all_moments;
        attached.fence = self.fence.clone();
        if self.is_deposed() {
            return Err(crate::events::WriteError::Fenced);
        }
        all.extend(events);
        self.redact(&mut all, &mut attached);
        self.shared
            .writer
            .append_committed_with(all, attached)
            .await
    }

    /// Mask the agent's secret values in what it is about to write.
    fn redact(&self, events: &mut [NewEvent], attached: &mut Attached) {
        if self.redactor.is_empty() {
            return;
        }
        for ev in events {
            self.redactor.json(&mut ev.data);
        }
        for ev in &mut attached.team {
            self.redactor.json(&mut ev.data);
        }
        for m in &mut attached.moments {
            self.redactor.json(&mut m.data);
        }
        for c in &mut attached.changes {
            let text = match c {
                StateChange::TurnEnded { error, .. } => error,
                StateChange::Status { reason, .. } => reason,
                StateChange::TurnStarted { .. }
                | StateChange::PermissionExpired(_)
                | StateChange::Mode { .. }
                | StateChange::Model { .. } => continue,
            };
            if let Some(t) = text
                && let std::borrow::Cow::Owned(masked) = self.redactor.text(t)
            {
                *t = masked;
            }
        }
    }

    pub(super) fn team_event(&self, kind: &'static str, data: Value) -> NewTeamEvent {
        NewTeamEvent {
            team_id: self.ctx.team_id,
            project_id: Some(self.ctx.project_id),
            workspace_id: Some(self.ctx.workspace_id),
            kind,
            data,
        }
    }

    pub(super) async fn set_status(
        &mut self,
        status: AgentStatus,
        reason: Option<&str>,
    ) -> Result<(), RuntimeError> {
        self.set_status_with(status, reason, Vec::new()).await
    }

    /// The `status` event of the agent's timeline, the `agent_status` event of its team's
    /// stream and the change to its row, for a new status (whose reason is already
    /// redacted): written together.
    fn status_events(
        &self,
        status: AgentStatus,
        reason: Option<&str>,
    ) -> (NewEvent, NewTeamEvent, StateChange) {
        let mut data = json!({"status": status});
        if let Some(r) = reason {
            data["reason"] = json!(r);
        }
        let team = self.team_event(
            "agent_status",
            json!({"agent_id": self.id(), "status": status}),
        );
        let change = StateChange::Status {
            agent: self.id(),
            status,
            reason: reason.map(str::to_owned),
        };
        (self.event(EventKind::Status, data), team, change)
    }

    /// `set_status`, with moments stored with the status event.
    async fn set_status_with(
        &mut self,
        status: AgentStatus,
        reason: Option<&str>,
        moments: Vec<Moment>,
    ) -> Result<(), RuntimeError> {
        if self.status == status && reason.is_none() && moments.is_empty() {
            return Ok(());
        }
        self.status = status;
        let reason = reason.map(|r| self.redactor.text(r).into_owned());
        let (event, team, change) = self.status_events(status, reason.as_deref());
        let attached = Attached {
            fence: None,
            team: vec![team],
            moments: moments.into_iter().map(|m| m.at(0)).collect(),
            changes: vec![change],
        };
        let committed = self.commit_with(vec![event], attached).await;
        self.publish_status(&committed);
        committed?;
        Ok(())
    }
}

/// A status the store did not confirm in time is still queued, and commits in order (the
/// actor publishes it once it has: `unpublished`): not a reason to give up what it reports.
fn kept(r: Result<(), RuntimeError>) -> Result<(), RuntimeError> {
    match r {
        Err(RuntimeError::Events(crate::events::WriteError::Unavailable)) => Ok(()),
        r => r,
    }
}

/// Once everything handed to the writer so far is committed: true, or false when the
/// writer has stopped (or this actor's writes were fenced off). While the store is known to be down, asks again every 250 ms.
async fn landed(writer: &crate::events::EventWriter) -> bool {
    loop {
        match writer.flush().await {
            Ok(()) => return true,
            Err(crate::events::WriteError::Stopped | crate::events::WriteError::Fenced) => {
                return false;
            }
            Err(crate::events::WriteError::Unavailable) => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        }
    }
}

/// `{<id_key>: id, "text": text}`, moving the text (the streaming hot path).
fn chunk(id_key: &str, id: MessageId, text: String) -> Value {
    let mut m = serde_json::Map::with_capacity(2);
    m.insert(id_key.to_owned(), Value::String(id.to_string()));
    m.insert("text".to_owned(), Value::String(text));
    Value::Object(m)
}

async fn next_event(rx: &mut Option<mpsc::Receiver<ProviderEvent>>) -> Option<ProviderEvent> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The turn's usage so far from two reports of it: each figure the larger (both count the
/// turn so far), a cost or window where either has one (the later's first).
fn merged(before: &Usage, now: &Usage) -> Usage {
    Usage {
        input_tokens: before.input_tokens.max(now.input_tokens),
        output_tokens: before.output_tokens.max(now.output_tokens),
        cached_input_tokens: before.cached_input_tokens.max(now.cached_input_tokens),
        cache_write_tokens: before.cache_write_tokens.max(now.cache_write_tokens),
        reasoning_tokens: before.reasoning_tokens.max(now.reasoning_tokens),
        context_window_max: now.context_window_max.or(before.context_window_max),
        context_window_used: now.context_window_used.or(before.context_window_used),
        cost_usd: match (before.cost_usd, now.cost_usd) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => b.or(a),
        },
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn unsupported(e: ProviderError) -> RuntimeError {
    match e {
        ProviderError::Unsupported(what) => {
            RuntimeError::Unsupported(format!("this provider does not support {what}"))
        }
        other => RuntimeError::Unsupported(other.to_string()),
    }
}

/// Every agent id (`agt_` and 32 hex digits) written anywhere in `value`, in order, at
/// most 16 of them.
fn agent_ids_in(value: &Value, out: &mut Vec<uuid::Uuid>) {
    const MAX: usize = 16;
    match value {
        Value::String(s) => {
            let mut rest = s.as_str();
            while out.len() < MAX
                && let Some(at) = rest.find(AgentId::PREFIX)
            {
                let after = &rest[at + AgentId::PREFIX.len()..];
                let hex: String = after.chars().take(32).collect();
                if hex.len() == 32
                    && let Ok(id) = format!("{}{hex}", AgentId::PREFIX).parse::<AgentId>()
                    && !out.contains(&id.uuid())
                {
                    out.push(id.uuid());
                }
                rest = after;
            }
        }
        Value::Array(items) => items.iter().for_each(|v| agent_ids_in(v, out)),
        Value::Object(map) => map.values().for_each(|v| agent_ids_in(v, out)),
        _ => {}
    }
}

pub(crate) fn tool_json(t: &ToolCallUpdate) -> Value {
    let mut v = json!({
        "call_id": t.call_id, "name": t.name, "title": t.title, "tool_kind": t.tool_kind,
        "status": t.status, "input": t.input,
    });
    if let Some(o) = &t.output {
        v["output"] = o.clone();
    }
    if let Some(e) = &t.error {
        v["error"] = json!(e);
    }
    if !t.diff.is_empty() {
        v["diff"] = json!(t.diff);
    }
    if !t.locations.is_empty() {
        v["locations"] = json!(t.locations);
    }
    if let Some(p) = &t.parent_call_id {
        v["parent_call_id"] = json!(p);
    }
    v
}

/// Drive a call to the provider to its end while still reading the provider's events
/// (kept in `held`, in order, for the caller to handle next). The call's answer can sit
/// behind those events on the provider's stream; with nobody reading them, the provider
/// would wait for room to send and the call would never end.
async fn while_reading<T>(
    call: impl std::future::Future<Output = T>,
    events: &mut Option<mpsc::Receiver<ProviderEvent>>,
    held: &mut Vec<ProviderEvent>,
) -> T {
    tokio::pin!(call);
    loop {
        let Some(rx) = events.as_mut() else {
            return call.await;
        };
        tokio::select! {
            biased;
            out = &mut call => return out,
            ev = rx.recv() => match ev {
                Some(ev) => held.push(ev),
                // The provider is gone: the call ends on its own; the actor's loop sees
                // the closed channel next.
                None => return call.await,
            },
        }
    }
}

/// Resolves once `fence` is deposed; never without one.
async fn deposed(fence: Option<&Fence>) {
    match fence {
        Some(f) => f.deposed().await,
        None => std::future::pending().await,
    }
}

/// Write `contents` to a new file at `path` readable by its owner only.
fn write_private(path: &std::path::Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(contents.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_ids_are_found_in_a_tool_output_wherever_they_are_written() {
        let a = AgentId::new();
        let b = AgentId::new();
        let output = json!([
            {"type": "text", "text": format!("{{\"id\":\"{a}\",\"parent_agent_id\":\"{b}\"}}")},
            {"nested": [format!("again {a}, a token agt_pat_0123 and agt_short")]},
        ]);
        let mut found = Vec::new();
        agent_ids_in(&output, &mut found);
        assert_eq!(found, [a.uuid(), b.uuid()]);
    }
}
