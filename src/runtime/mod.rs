//! The agent runtime: one actor per live agent owns its provider session and process,
//! runs the turn state machine and brokers permission requests. Everything else talks to
//! an agent through `AgentManager`, which sends the actor commands on its mailbox.

mod actor;
mod permissions;
mod reconcile;
mod replica_lock;
mod spend;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

pub use reconcile::{Abandoned, BootReport, abandon_agent, reconcile_at_boot};
pub use replica_lock::{ReplicaLock, ReplicaLockError};
pub use spend::{EndedTurn, Exhausted, Spend, TurnMeter, TurnSubject};

use crate::config::SandboxNetwork;
use crate::domain::{
    AgentId, AgentStatus, Behavior, HookEvent, PermissionId, SecretEnv, TurnId, TurnOutcome,
};
use crate::egress::{AllowList, Egress};
use crate::events::{EventWriter, NewMoment};
use crate::metrics::{Counter, Family};
use crate::process::{CommandSpec, Ledger, ManagedChild, ProcessError};
use crate::providers::{
    CatalogScope, ModelInfo, Probe, ProcessLauncher, Provider, ProviderRegistry,
};
use crate::sandbox::{AgentView, Sandbox};
use crate::store;
use crate::store::replicas::{Busy, Renewal};

/// How many agents' leases one renewal statement renews (see `Runtime::renew_leases`).
const RENEW_SLICE: usize = 64;
/// How many agents whose rows were busy at the first try (or that nobody held) one waiting
/// statement renews.
const BUSY_SLICE: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("a turn is running; wait for it to finish or interrupt it")]
    Busy,
    #[error("the agent could not be started: {0}")]
    StartFailed(String),
    #[error("unknown provider `{0}`")]
    UnknownProvider(String),
    #[error("permission request not found")]
    PermissionNotFound,
    #[error("this permission request was already answered")]
    PermissionAlreadyResolved,
    #[error("this permission request expired: {0}")]
    PermissionExpired(String),
    #[error("option `{0}` is not one of the request's options")]
    UnknownOption(String),
    #[error("option `{option}` is a `{actual}` option, not `{requested}`")]
    BehaviorMismatch {
        option: String,
        actual: &'static str,
        requested: &'static str,
    },
    #[error("the request offers no `{0}` option")]
    NoOptionForBehavior(&'static str),
    #[error("{0}")]
    Unsupported(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Another replica runs the agent (its id); the command belongs there.
    #[error("replica `{0}` runs this agent")]
    OwnedElsewhere(String),
    #[error("the agent stopped while handling the request")]
    ActorGone,
    /// A budget of the agent or its team ran out: no new turn starts.
    #[error("{0}")]
    BudgetExhausted(Box<Exhausted>),
    #[error(transparent)]
    Store(#[from] sqlx::Error),
    #[error("the event store failed: {0}")]
    Events(#[from] crate::events::WriteError),
}

/// What the runtime knows about a live agent, for reads that should not wait on it.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub status: AgentStatus,
    pub pid: Option<u32>,
    pub provider_session_id: Option<String>,
}

/// The answer a person gave to a permission request.
#[derive(Debug, Clone)]
pub struct PermissionAnswer {
    pub behavior: Behavior,
    pub option_id: Option<String>,
    pub message: Option<String>,
    pub updated_input: Option<Value>,
    pub resolved_by: Uuid,
}

/// Everything an actor needs to know about its agent, read from the database.
#[derive(Debug, Clone)]
pub struct AgentContext {
    pub id: AgentId,
    pub team_id: Uuid,
    pub project_id: Uuid,
    pub workspace_id: Uuid,
    pub cwd: PathBuf,
    pub provider: String,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub system_prompt: Option<String>,
    pub mcp_servers: Value,
    pub persistence: Option<Value>,
    /// The team secrets the provider takes, opened: set in the environment of every
    /// process started for this agent (values redacted when formatted).
    pub secret_env: SecretEnv,
    /// What the agent may reach through the egress proxy (its provider's, the server's
    /// and its team's entries), when its sandbox uses the proxy; read at each launch.
    pub egress_allow: Option<AllowList>,
    /// The agent's own API token when this launch gives it agentry's MCP server (it is
    /// in `mcp_servers`): never in the environment, redacted from its events.
    pub agentry_token: Option<crate::domain::SecretValue>,
}

pub(crate) enum Command {
    Prompt {
        text: String,
        client_message_id: Option<String>,
        reply: oneshot::Sender<Result<TurnId, RuntimeError>>,
    },
    Interrupt {
        reply: oneshot::Sender<()>,
    },
    /// Answered once the agent's session is open (or with why it did not open).
    Ready {
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    SetMode {
        mode: String,
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    SetModel {
        model: String,
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    Answer {
        id: PermissionId,
        answer: PermissionAnswer,
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    Close {
        reason: String,
        reply: oneshot::Sender<()>,
    },
    /// The egress proxy refused a connection of the agent's: a `network_denied` event.
    NetworkDenied {
        host: String,
        port: u16,
        reason: &'static str,
    },
}

/// A moment of an agent's life that lifecycle hooks hear about. It is attached to the
/// timeline event that records it and stored with it, in the same transaction (see
/// `events::NewMoment`); the hooks service turns stored moments into notifications on its
/// own time. Stored as its `kind` and its `data` (the variant's fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "data", rename_all = "snake_case")]
pub enum Moment {
    TurnStarted {
        turn_id: TurnId,
    },
    TurnEnded {
        turn_id: TurnId,
        outcome: TurnOutcome,
        error: Option<String>,
    },
    PermissionRequested {
        request_id: PermissionId,
    },
    PermissionResolved {
        request_id: PermissionId,
        resolution: Value,
    },
    Closed {},
}

impl Moment {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TurnStarted { .. } => "turn_started",
            Self::TurnEnded { .. } => "turn_ended",
            Self::PermissionRequested { .. } => "permission_requested",
            Self::PermissionResolved { .. } => "permission_resolved",
            Self::Closed {} => "closed",
        }
    }

    /// The hook event the moment is announced as.
    pub fn hook_event(&self) -> HookEvent {
        match self {
            Self::TurnStarted { .. } => HookEvent::AgentTurnBefore,
            Self::TurnEnded { .. } => HookEvent::AgentTurnAfter,
            Self::PermissionRequested { .. } => HookEvent::AgentPermissionBefore,
            Self::PermissionResolved { .. } => HookEvent::AgentPermissionAfter,
            Self::Closed {} => HookEvent::AgentCloseAfter,
        }
    }

    /// The moment, to be stored with the `event`-th event of its write.
    pub fn at(self, event: usize) -> NewMoment {
        let kind = self.kind();
        let hook = self.hook_event().as_str();
        let data = match serde_json::to_value(self) {
            Ok(Value::Object(mut m)) => m.remove("data").unwrap_or_default(),
            _ => Value::Null,
        };
        NewMoment {
            event,
            kind,
            hook,
            data,
        }
    }

    /// A stored moment read back (`None` for a kind this build does not know).
    pub fn stored(kind: &str, data: Value) -> Option<Self> {
        serde_json::from_value(serde_json::json!({"kind": kind, "data": data})).ok()
    }
}

#[derive(Clone)]
struct ActorHandle {
    generation: u64,
    /// The lease epoch the actor writes with (its fence), when the agent has a row.
    epoch: Option<i64>,
    /// The agent's team, to authorize a command for the live agent without reading its row.
    team_id: Uuid,
    tx: mpsc::Sender<Command>,
    snapshot: watch::Receiver<Snapshot>,
}

pub(crate) struct Shared {
    pub pool: PgPool,
    pub writer: EventWriter,
    pub registry: ProviderRegistry,
    pub ledger: Ledger,
    pub interrupt_grace: Duration,
    /// Idle time after which an agent's process is stopped (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// CPU priority of agent processes (`agents.nice`; 0: the server's own).
    pub agent_nice: i32,
    /// The sandbox every agent process runs in (`None`: none, as in unit tests).
    pub sandbox: Option<Arc<Sandbox>>,
    /// The egress proxy, whose endpoint an agent gets while its process runs when the
    /// sandbox's network mode is `proxy`.
    pub egress: Option<Egress>,
    actors: Mutex<HashMap<AgentId, ActorHandle>>,
    /// Turns ended, by provider and outcome.
    pub turns: Family<Counter>,
    /// Turns started, by provider.
    pub turns_started: Family<Counter>,
    /// Provider sessions started (a process started for an agent), by provider and
    /// whether the agent was new or resumed.
    pub sessions: Family<Counter>,
    /// This replica's id: the owner named in the leases of its agents.
    pub replica: String,
    /// Seconds a lease lasts unrenewed.
    pub lease_ttl_s: i64,
    /// Agents taken over from replicas that stopped answering.
    pub takeovers: Counter,
    generation: AtomicU64,
    shutting_down: AtomicBool,
    /// Turns running now (see `RunningTurn`).
    turns_running: AtomicUsize,
    /// The usage service: budgets before and during a turn, the ledger after it (none in
    /// unit tests: nothing is metered).
    spend: std::sync::OnceLock<Arc<dyn Spend>>,
    /// Rung when a turn ends (one wake-up is kept for the one who waits).
    turns_ended: tokio::sync::Notify,
    rt: Handle,
}

impl Shared {
    pub(crate) fn uses_egress(&self) -> bool {
        self.egress.is_some()
            && self.sandbox.as_ref().is_some_and(|s| {
                s.status().confines() && s.settings().network == SandboxNetwork::Proxy
            })
    }
}

/// Entry point to live agents.
#[derive(Clone)]
pub struct AgentManager {
    shared: Arc<Shared>,
}

impl AgentManager {
    pub fn new(
        pool: PgPool,
        writer: EventWriter,
        registry: ProviderRegistry,
        ledger: Ledger,
        rt: Handle,
    ) -> Self {
        let ledger_replica = ledger.replica.clone();
        Self {
            shared: Arc::new(Shared {
                pool,
                writer,
                registry,
                ledger,
                interrupt_grace: Duration::from_secs(5),
                idle_timeout: None,
                agent_nice: 0,
                sandbox: None,
                egress: None,
                actors: Mutex::new(HashMap::new()),
                turns: Family::counters(&["provider", "outcome"]),
                turns_started: Family::counters(&["provider"]),
                sessions: Family::counters(&["provider", "start"]),
                replica: ledger_replica.clone(),
                lease_ttl_s: 15,
                takeovers: Counter::default(),
                generation: AtomicU64::new(1),
                shutting_down: AtomicBool::new(false),
                turns_running: AtomicUsize::new(0),
                spend: std::sync::OnceLock::new(),
                turns_ended: tokio::sync::Notify::new(),
                rt,
            }),
        }
    }

    /// Resolves when a turn of an agent of this replica ends after this call (or ended
    /// since the last call: one wake-up is kept). For one waiter: the queue dispatcher.
    pub async fn turn_ended(&self) {
        self.shared.turns_ended.notified().await;
    }

    /// Whether the server is stopping (no new turn starts).
    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::SeqCst)
    }

    /// Meter turns with `spend` (once, when the server is wired together; later calls
    /// change nothing).
    pub fn set_spend(&self, spend: Arc<dyn Spend>) {
        let _ = self.shared.spend.set(spend);
    }

    /// How long an interrupted turn may take to end before its process is stopped
    /// (default 5 s). Set it before the manager is cloned or used.
    pub fn with_interrupt_grace(mut self, grace: Duration) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("the interrupt grace is set before the manager is shared")
            .interrupt_grace = grace;
        self
    }

    /// Stop an agent's provider process once it has been idle this long (no turn, no
    /// pending permission request); its next prompt resumes the session. Set it before
    /// the manager is cloned or used.
    pub fn with_idle_timeout(mut self, idle: Option<Duration>) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("the idle timeout is set before the manager is shared")
            .idle_timeout = idle;
        self
    }

    /// The CPU priority (`nice`) of agent processes. Set it before the manager is cloned
    /// or used.
    pub fn with_agent_nice(mut self, nice: i32) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("the agents' priority is set before the manager is shared")
            .agent_nice = nice;
        self
    }

    /// The sandbox agent processes run in. Set it before the manager is cloned or used.
    pub fn with_sandbox(mut self, sandbox: Arc<Sandbox>) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("the sandbox is set before the manager is shared")
            .sandbox = Some(sandbox);
        self
    }

    /// The sandbox agent processes run in, if any.
    pub fn sandbox(&self) -> Option<&Arc<Sandbox>> {
        self.shared.sandbox.as_ref()
    }

    /// The egress proxy agents reach the network through in the `proxy` network mode.
    /// Set it before the manager is cloned or used.
    pub fn with_egress(mut self, egress: Egress) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("the egress proxy is set before the manager is shared")
            .egress = Some(egress);
        self
    }

    /// Agents' processes run confined with the egress proxy as their only way out: their
    /// launches need an allow list (`AgentContext::egress_allow`).
    pub fn uses_egress(&self) -> bool {
        self.shared.uses_egress()
    }

    /// The egress proxy, when sandboxed processes reach the network through it
    /// (`uses_egress`): agents', and the setup and teardown commands of workspaces.
    pub fn egress(&self) -> Option<&Egress> {
        self.shared
            .egress
            .as_ref()
            .filter(|_| self.shared.uses_egress())
    }

    /// Connections the egress proxy allowed for agent `id` by host, since its process
    /// started (`None`: it has no endpoint here).
    pub fn egress_counts(&self, id: AgentId) -> Option<std::collections::BTreeMap<String, u64>> {
        self.shared.egress.as_ref()?.counts(id)
    }

    /// How long this replica's leases last unrenewed (default 15 s). Set it before the
    /// manager is cloned or used.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("the lease ttl is set before the manager is shared")
            .lease_ttl_s = ttl.as_secs().max(1) as i64;
        self
    }

    /// This replica's id.
    pub fn replica(&self) -> &str {
        &self.shared.replica
    }

    /// Seconds a lease lasts unrenewed.
    pub fn lease_ttl_s(&self) -> i64 {
        self.shared.lease_ttl_s
    }

    /// Agents taken over from replicas that stopped answering.
    pub fn takeovers(&self) -> &Counter {
        &self.shared.takeovers
    }

    pub fn registry(&self) -> &ProviderRegistry {
        &self.shared.registry
    }

    /// Turns ended on this server, by provider and outcome.
    pub fn turns(&self) -> &Family<Counter> {
        &self.shared.turns
    }

    /// Turns started on this server, by provider.
    pub fn turns_started(&self) -> &Family<Counter> {
        &self.shared.turns_started
    }

    /// Provider sessions started on this server, by provider and `new` / `resume`.
    pub fn sessions(&self) -> &Family<Counter> {
        &self.shared.sessions
    }

    /// Live agents whose provider process runs now.
    pub fn running_processes(&self) -> usize {
        let actors = self.shared.actors.lock().expect("actors lock");
        actors
            .values()
            .filter(|h| !h.tx.is_closed() && h.snapshot.borrow().pid.is_some())
            .count()
    }

    /// The process ledger every child of this server is recorded in.
    pub fn ledger(&self) -> &Ledger {
        &self.shared.ledger
    }

    /// The model catalog of provider `id` in `scope` (see `ProviderRegistry::models`). A
    /// probe that runs the CLI does so through the ledger: in the workspace for a workspace
    /// scope, else in an empty directory removed afterwards.
    pub async fn models(
        &self,
        id: &str,
        scope: &CatalogScope,
        refresh: bool,
    ) -> Option<Result<Arc<Vec<ModelInfo>>, String>> {
        // The empty directory of a global probe is made only when a probe runs (a cached
        // catalog needs none).
        let (cwd, throwaway) = match scope {
            CatalogScope::Workspace(path) => (path.clone(), None),
            CatalogScope::Global => {
                let cwd = std::env::temp_dir().join(format!("agentry-probe-{}", Uuid::now_v7()));
                (cwd.clone(), Some(cwd))
            }
        };
        let launcher = Arc::new(ProbeLauncher {
            ledger: self.shared.ledger.clone(),
            throwaway: throwaway.clone(),
        });
        let probe = Probe {
            launcher,
            cwd: cwd.clone(),
        };
        let models = self
            .shared
            .registry
            .models(id, scope, refresh, &probe)
            .await;
        if let Some(dir) = throwaway
            && dir.exists()
        {
            let _ = std::fs::remove_dir_all(&dir);
        }
        models
    }

    fn provider(&self, id: &str) -> Result<Arc<dyn Provider>, RuntimeError> {
        self.shared
            .registry
            .get(id)
            .ok_or_else(|| RuntimeError::UnknownProvider(id.to_owned()))
    }

    /// Make sure this replica holds agent `id`'s lease before it runs the agent: take it
    /// when nobody holds it, take the agent over when its holder stopped renewing, and
    /// say who runs it otherwise.
    /// Returns the lease epoch an actor started now writes with.
    async fn lease(&self, id: AgentId) -> Result<Option<i64>, RuntimeError> {
        if let Some(h) = self.live(id) {
            return Ok(h.epoch);
        }
        let s = &self.shared;
        for _ in 0..2 {
            match store::replicas::claim(&s.pool, id.uuid(), &s.replica, s.lease_ttl_s).await? {
                store::replicas::Claim::Taken { epoch } => return Ok(Some(epoch)),
                store::replicas::Claim::NotFound => return Ok(None),
                store::replicas::Claim::Held { owner, expired } if expired => {
                    self.take_over(id, &owner).await?;
                }
                store::replicas::Claim::Held { owner, .. } => {
                    return Err(RuntimeError::OwnedElsewhere(owner));
                }
            }
        }
        Err(RuntimeError::ActorGone)
    }

    /// Take agent `id` over from `owner`, whose lease ran out: its interrupted turn ends
    /// `failed` (`owner_lost`) and the agent is closed, resumable by its next prompt. False
    /// when another replica took it first.
    pub async fn take_over(&self, id: AgentId, owner: &str) -> Result<bool, RuntimeError> {
        let s = &self.shared;
        let Some(epoch) =
            store::replicas::take_over(&s.pool, id.uuid(), owner, &s.replica, s.lease_ttl_s)
                .await?
        else {
            return Ok(false);
        };
        // The lease is ours: that is the takeover, counted before its effects are written
        // so that nobody who sees them reads a count without it.
        s.takeovers.inc();
        tracing::warn!(agent_id = %id, owner, "taking over an agent whose replica stopped renewing its lease");
        if let Some(mut agent) = store::agents::open_agent(&s.pool, id.uuid()).await? {
            // Written as the takeover's ownership: if yet another replica took the agent
            // since (this one stalled), nothing is written and the agent is that one's.
            agent.lease_epoch = epoch;
            match abandon_agent(
                &s.pool,
                &s.writer,
                &agent,
                &format!("owner_lost: replica `{owner}`, which ran this agent, stopped answering"),
                "owner_lost",
            )
            .await
            {
                Err(RuntimeError::Events(crate::events::WriteError::Fenced)) => return Ok(false),
                other => {
                    other?;
                }
            }
        }
        store::replicas::release(&s.pool, id.uuid(), &s.replica).await?;
        Ok(true)
    }

    /// The agents whose actors run here now.
    pub fn live_ids(&self) -> Vec<AgentId> {
        let actors = self.shared.actors.lock().expect("actors lock");
        actors
            .iter()
            .filter(|(_, h)| !h.tx.is_closed())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Renew the leases of every agent running here (`renewal`: the replica's heartbeat has
    /// renewed them already, or each agent's own lease is renewed too); stop those whose lease
    /// another replica took (they must not write another event), or that were archived
    /// elsewhere.
    pub async fn renew_leases(&self, renewal: Renewal) -> Result<(), RuntimeError> {
        let ids = self.live_ids();
        if ids.is_empty() {
            return Ok(());
        }
        let s = &self.shared;
        let mut uuids: Vec<Uuid> = ids.iter().map(|a| a.uuid()).collect();
        uuids.sort_unstable();
        let mut held = std::collections::HashSet::with_capacity(uuids.len());
        let mut unowned = Vec::new();
        match renewal {
            Renewal::Replica => {
                // A read: no agent row is written or locked, unless nobody holds it.
                for (id, owned) in store::replicas::held(&s.pool, &s.replica, &uuids).await? {
                    if owned {
                        held.insert(id);
                    } else {
                        unowned.push(id);
                    }
                }
            }
            Renewal::EveryAgent => {
                // A statement of its own for each slice: the rows it renews stay locked until
                // it commits, and the event writer waits for them to write an agent's turn or
                // status. Rows the writer holds are skipped at first: waiting for one would
                // keep the slice's other rows locked meanwhile, and the writer's next batches
                // behind them. Only those are then renewed waiting, a few at a time.
                for slice in uuids.chunks(RENEW_SLICE) {
                    held.extend(
                        store::replicas::renew(
                            &s.pool,
                            &s.replica,
                            slice,
                            s.lease_ttl_s,
                            Busy::Skip,
                        )
                        .await?,
                    );
                }
                unowned = uuids.into_iter().filter(|u| !held.contains(u)).collect();
            }
        }
        for slice in unowned.chunks(BUSY_SLICE) {
            held.extend(
                store::replicas::renew(&s.pool, &s.replica, slice, s.lease_ttl_s, Busy::Wait)
                    .await?,
            );
        }
        for id in ids.into_iter().filter(|a| !held.contains(&a.uuid())) {
            tracing::warn!(agent_id = %id, "this agent was taken over or archived elsewhere; stopping it here");
            // In its own task: a slow close must not hold up the renewal of the others.
            let this = self.clone();
            s.rt.spawn(async move { this.close(id, "taken over or archived elsewhere").await });
        }
        Ok(())
    }

    /// The live actor of `ctx.id`, started (opening or resuming its session) when none runs.
    /// `epoch` is the lease epoch a new actor writes with (see `lease`).
    fn actor(&self, ctx: &AgentContext, epoch: Option<i64>) -> Result<ActorHandle, RuntimeError> {
        if self.shared.shutting_down.load(Ordering::SeqCst) {
            return Err(RuntimeError::ShuttingDown);
        }
        let provider = self.provider(&ctx.provider)?;
        let mut actors = self.shared.actors.lock().expect("actors lock");
        if let Some(h) = actors.get(&ctx.id)
            && !h.tx.is_closed()
        {
            return Ok(h.clone());
        }
        let generation = self.shared.generation.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(64);
        let (snap_tx, snap_rx) = watch::channel(Snapshot {
            status: AgentStatus::Starting,
            pid: None,
            provider_session_id: None,
        });
        let handle = ActorHandle {
            generation,
            epoch,
            team_id: ctx.team_id,
            tx,
            snapshot: snap_rx,
        };
        actors.insert(ctx.id, handle.clone());
        let actor = actor::Actor::new(
            self.shared.clone(),
            ctx.clone(),
            provider,
            snap_tx,
            generation,
            epoch,
        );
        self.shared.rt.spawn(actor.run(rx));
        Ok(handle)
    }

    /// Start a new agent's session (and its first prompt, if any).
    pub async fn start(
        &self,
        ctx: &AgentContext,
        prompt: Option<String>,
    ) -> Result<Option<TurnId>, RuntimeError> {
        let epoch = self.lease(ctx.id).await?;
        let handle = self.actor(ctx, epoch)?;
        match prompt {
            Some(text) => send(&handle, |reply| Command::Prompt {
                text,
                client_message_id: None,
                reply,
            })
            .await?
            .map(Some),
            None => Ok(None),
        }
    }

    pub async fn prompt(
        &self,
        ctx: &AgentContext,
        text: String,
        client_message_id: Option<String>,
    ) -> Result<TurnId, RuntimeError> {
        // A prompt that reaches an actor as it stops (idle timeout, exited process) is
        // handed to a fresh one, which reopens the session.
        for _ in 0..2 {
            let epoch = self.lease(ctx.id).await?;
            let handle = self.actor(ctx, epoch)?;
            match send(&handle, |reply| Command::Prompt {
                text: text.clone(),
                client_message_id: client_message_id.clone(),
                reply,
            })
            .await
            {
                Err(RuntimeError::ActorGone) | Ok(Err(RuntimeError::ActorGone)) => continue,
                other => return other?,
            }
        }
        Err(RuntimeError::ActorGone)
    }

    /// Open agent `ctx.id`'s session here, unless an actor already runs it: returns once the
    /// session is ready for a prompt, or with why it did not open. What a prompt to a
    /// closed agent waits for before its turn can start (its process, the CLI's start),
    /// done apart from it.
    pub async fn open(&self, ctx: &AgentContext) -> Result<(), RuntimeError> {
        for _ in 0..2 {
            let epoch = self.lease(ctx.id).await?;
            let handle = self.actor(ctx, epoch)?;
            match send(&handle, |reply| Command::Ready { reply }).await {
                Err(RuntimeError::ActorGone) | Ok(Err(RuntimeError::ActorGone)) => continue,
                other => return other?,
            }
        }
        Err(RuntimeError::ActorGone)
    }

    /// The team of agent `id` when its actor runs here.
    pub fn live_team(&self, id: AgentId) -> Option<Uuid> {
        self.live(id).map(|h| h.team_id)
    }

    /// Hand a prompt to agent `id`'s actor if it runs here; `None` when it does not (or
    /// stopped meanwhile): then the caller opens it with [`AgentManager::prompt`], which reads
    /// the agent's row, its team's secrets and its open hooks for the new session.
    pub async fn prompt_live(
        &self,
        id: AgentId,
        text: &str,
        client_message_id: Option<&str>,
    ) -> Result<Option<TurnId>, RuntimeError> {
        if self.shared.shutting_down.load(Ordering::SeqCst) {
            return Err(RuntimeError::ShuttingDown);
        }
        let Some(handle) = self.live(id) else {
            return Ok(None);
        };
        match send(&handle, |reply| Command::Prompt {
            text: text.to_owned(),
            client_message_id: client_message_id.map(str::to_owned),
            reply,
        })
        .await
        {
            Err(RuntimeError::ActorGone) | Ok(Err(RuntimeError::ActorGone)) => Ok(None),
            other => other?.map(Some),
        }
    }

    /// Interrupt the running turn, if any (a no-op when the agent is idle or closed).
    pub async fn interrupt(&self, id: AgentId) {
        if let Some(h) = self.live(id) {
            let _ = send(&h, |reply| Command::Interrupt { reply }).await;
        }
    }

    /// Change the mode of a live agent. `Ok(false)` when no actor runs (the caller records
    /// the change for the next session).
    pub async fn set_mode(&self, id: AgentId, mode: String) -> Result<bool, RuntimeError> {
        match self.live(id) {
            Some(h) => send(&h, |reply| Command::SetMode { mode, reply })
                .await?
                .map(|_| true),
            None => Ok(false),
        }
    }

    pub async fn set_model(&self, id: AgentId, model: String) -> Result<bool, RuntimeError> {
        match self.live(id) {
            Some(h) => send(&h, |reply| Command::SetModel { model, reply })
                .await?
                .map(|_| true),
            None => Ok(false),
        }
    }

    /// Answer a permission request. `None` when the agent has no live actor.
    pub async fn answer(
        &self,
        id: AgentId,
        request: PermissionId,
        answer: PermissionAnswer,
    ) -> Option<Result<(), RuntimeError>> {
        let h = self.live(id)?;
        Some(
            send(&h, |reply| Command::Answer {
                id: request,
                answer,
                reply,
            })
            .await
            .and_then(|r| r),
        )
    }

    /// Stop the agent's process; the agent stays resumable.
    pub async fn close(&self, id: AgentId, reason: &str) {
        if let Some(h) = self.live(id) {
            let reason = reason.to_owned();
            let mut ended = h.snapshot.clone();
            let _ = send(&h, |reply| Command::Close { reason, reply }).await;
            // The actor has stopped (its events committed, its lease given up) once it
            // dropped its end of the snapshot: its mailbox closes before that, so another
            // replica could still find the agent held if this returned then.
            while ended.changed().await.is_ok() {}
        }
    }

    /// Record in the agent's timeline that the egress proxy refused one of its
    /// connections (a `network_denied` event, in its current turn if one runs). Only the
    /// replica that runs the agent does: for an agent not live here nothing is written
    /// (`false`), and neither when its mailbox stays full for a second.
    pub async fn record_network_denial(
        &self,
        id: AgentId,
        host: String,
        port: u16,
        reason: &'static str,
    ) -> bool {
        let Some(handle) = self.live(id) else {
            return false;
        };
        let cmd = Command::NetworkDenied { host, port, reason };
        handle
            .tx
            .send_timeout(cmd, Duration::from_secs(1))
            .await
            .is_ok()
    }

    pub fn snapshot(&self, id: AgentId) -> Option<Snapshot> {
        self.live(id).map(|h| h.snapshot.borrow().clone())
    }

    pub fn watch(&self, id: AgentId) -> Option<watch::Receiver<Snapshot>> {
        self.live(id).map(|h| h.snapshot)
    }

    fn live(&self, id: AgentId) -> Option<ActorHandle> {
        let actors = self.shared.actors.lock().expect("actors lock");
        actors.get(&id).filter(|h| !h.tx.is_closed()).cloned()
    }

    /// Drain: take no new work, let running turns end for up to `drain`, then close every
    /// live agent (their processes end), flush the event writer and give up every lease,
    /// so any replica can run the agents again at once.
    pub async fn shutdown(&self, drain: Duration) {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        let running = &self.shared.turns_running;
        let turns_end = async {
            while running.load(Ordering::SeqCst) > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        if tokio::time::timeout(drain, turns_end).await.is_err() {
            tracing::warn!(
                ?drain,
                "turns still running after the drain time; stopping them"
            );
        }
        let ids: Vec<AgentId> = self
            .shared
            .actors
            .lock()
            .expect("actors lock")
            .keys()
            .copied()
            .collect();
        let closes = ids.into_iter().map(|id| {
            let this = self.clone();
            async move {
                if tokio::time::timeout(
                    Duration::from_secs(15),
                    this.close(id, "server shutting down"),
                )
                .await
                .is_err()
                {
                    tracing::warn!(agent_id = %id, "agent did not close in time during shutdown");
                }
            }
        });
        futures::future::join_all(closes).await;
        if let Err(e) = self.shared.writer.flush().await {
            tracing::warn!(error = %e, "could not flush events at shutdown");
        }
        if let Err(e) = store::replicas::release_all(&self.shared.pool, &self.shared.replica).await
        {
            tracing::warn!(error = %e, "could not give up this replica's leases at shutdown");
        }
    }
}

impl Shared {
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Called by an actor once it stopped: give its agent's lease up, unless a newer actor
    /// runs the agent here (any replica may then run it).
    pub(crate) async fn release_lease(&self, id: AgentId) {
        let live = || {
            let actors = self.actors.lock().expect("actors lock");
            actors
                .get(&id)
                .filter(|h| !h.tx.is_closed())
                .map(|h| h.epoch)
        };
        if live().is_some() {
            return;
        }
        if let Err(e) = store::replicas::release(&self.pool, id.uuid(), &self.replica).await {
            // It runs out by itself; another replica takes the agent over then.
            tracing::warn!(agent_id = %id, error = %e, "could not give up an agent's lease");
            return;
        }
        // A prompt may have reopened the agent here meanwhile, its lease taken just before
        // this release cleared it: take it back for that actor, in its epoch, so that no
        // other replica starts it too.
        if let Some(Some(epoch)) = live()
            && let Err(e) = store::replicas::reclaim(
                &self.pool,
                id.uuid(),
                &self.replica,
                epoch,
                self.lease_ttl_s,
            )
            .await
        {
            // The next renewal takes it back.
            tracing::warn!(agent_id = %id, error = %e, "could not take an agent's lease back");
        }
    }

    /// Called by an actor as it stops: drop its handle unless a newer actor replaced it.
    pub(crate) fn remove_actor(&self, id: AgentId, generation: u64) {
        let mut actors = self.actors.lock().expect("actors lock");
        if actors.get(&id).is_some_and(|h| h.generation == generation) {
            actors.remove(&id);
        }
    }
}

async fn send<T>(
    handle: &ActorHandle,
    make: impl FnOnce(oneshot::Sender<T>) -> Command,
) -> Result<T, RuntimeError> {
    let (tx, rx) = oneshot::channel();
    handle
        .tx
        .send(make(tx))
        .await
        .map_err(|_| RuntimeError::ActorGone)?;
    rx.await.map_err(|_| RuntimeError::ActorGone)
}

/// Starts catalog probes through the ledger (belonging to no agent), making their empty
/// working directory first when they have one of their own.
struct ProbeLauncher {
    ledger: Ledger,
    throwaway: Option<PathBuf>,
}

#[async_trait]
impl ProcessLauncher for ProbeLauncher {
    async fn launch(&self, spec: CommandSpec) -> Result<ManagedChild, ProcessError> {
        if let Some(dir) = &self.throwaway {
            std::fs::create_dir_all(dir).map_err(|source| ProcessError::Spawn {
                program: spec.program.clone(),
                source,
            })?;
        }
        self.ledger.launch(&spec, None).await
    }
}

/// Starts an agent's provider processes through the ledger, with the agent's team
/// secrets in their environment, at the agents' CPU priority.
pub(crate) struct AgentLauncher {
    pub ledger: Ledger,
    pub agent: AgentId,
    pub secret_env: SecretEnv,
    pub nice: i32,
    /// The sandbox the agent's processes run in, and what the agent sees there.
    pub sandbox: Option<(Arc<Sandbox>, AgentView)>,
    /// The provider's key is added by the egress proxy: what its processes get instead.
    pub brokered: Option<BrokeredEnv>,
}

/// What an agent's processes get in place of a brokered key.
#[derive(Debug, Clone)]
pub(crate) struct BrokeredEnv {
    /// Variables they get from nowhere: no team secret, no setting, not the server's.
    pub withhold: Vec<String>,
    /// Set for them: the brokered base URL and a placeholder key.
    pub env: std::collections::BTreeMap<String, String>,
    /// Appended to the CLI's arguments: configuration overrides naming the brokered URL.
    pub args: Vec<String>,
    /// Set in the JSON configuration a variable holds (the brokered URL, a placeholder).
    pub json_env: Vec<crate::providers::broker::JsonSet>,
}

impl BrokeredEnv {
    fn apply(&self, spec: &mut CommandSpec) {
        for name in &self.withhold {
            spec.secret_env.remove(name);
            spec.env.remove(name);
            spec.pass_env.retain(|p| p != name);
        }
        spec.env
            .extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        spec.args.extend(self.args.iter().cloned());
        for set in &self.json_env {
            let mut config = spec
                .env
                .get(&set.var)
                .and_then(|text| serde_json::from_str::<serde_json::Value>(text).ok())
                .filter(serde_json::Value::is_object)
                .unwrap_or_else(|| serde_json::json!({}));
            let mut at = &mut config;
            for key in &set.path {
                if !at[key.as_str()].is_object() {
                    at[key.as_str()] = serde_json::json!({});
                }
                at = &mut at[key.as_str()];
            }
            *at = set.value.clone();
            spec.env.insert(set.var.clone(), config.to_string());
        }
    }
}

#[async_trait]
impl ProcessLauncher for AgentLauncher {
    async fn launch(&self, mut spec: CommandSpec) -> Result<ManagedChild, ProcessError> {
        spec.secret_env
            .extend(self.secret_env.iter().map(|(k, v)| (k.clone(), v.clone())));
        if let Some(brokered) = &self.brokered {
            brokered.apply(&mut spec);
        }
        if let Some((sandbox, view)) = &self.sandbox {
            let served;
            let mut view = view;
            if let (Some(port), Some(plan)) = (spec.serves, view.network.as_ref())
                && let Some(with_inbound) = plan.serving(port)
            {
                served = crate::sandbox::AgentView {
                    network: Some(with_inbound),
                    ..view.clone()
                };
                view = &served;
            }
            spec = sandbox.wrap(spec, view).map_err(|e| ProcessError::Spawn {
                program: "bwrap".to_owned(),
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        let child = self.ledger.launch_limited(&spec, Some(self.agent)).await?;
        if self.nice > 0
            && let Err(e) = crate::process::lower_priority(child.pgid(), self.nice)
        {
            // It runs all the same, at the server's priority.
            tracing::warn!(agent_id = %self.agent, nice = self.nice, error = %e, "could not lower an agent process's CPU priority");
        }
        Ok(child)
    }

    fn confined(&self) -> bool {
        self.sandbox.is_some()
    }

    fn reach(&self, port: u16) -> Option<std::path::PathBuf> {
        let (_, view) = self.sandbox.as_ref()?;
        view.network.as_ref()?.inbound_socket(port)
    }
}

/// A turn counted as running while this lives: the drain at shutdown waits for none to be
/// left.
pub(crate) struct RunningTurn(Arc<Shared>);

impl RunningTurn {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        shared.turns_running.fetch_add(1, Ordering::SeqCst);
        Self(shared)
    }
}

impl Drop for RunningTurn {
    fn drop(&mut self) {
        self.0.turns_running.fetch_sub(1, Ordering::SeqCst);
    }
}
