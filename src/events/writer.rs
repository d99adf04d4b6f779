//! The single writer of timelines. It assigns each agent's next `seq`, commits events in
//! batches (flush at `max_batch` events or after `linger`, whichever comes first; one
//! transaction and one fsync per batch), then publishes them.
//!
//! Nothing handed to the writer is dropped:
//! - event data is scrubbed on the producer's side (U+0000 becomes U+FFFD), so provider
//!   output is never refused for its bytes;
//! - a batch the database refuses for its *content* is stored again row by row, in one
//!   transaction and one round trip (`agentry_insert_events_each`): every other event is
//!   committed, and each refused one is stored as an `error` event (`event_rejected`) in
//!   its own seq slot;
//! - while the store is unreachable or stalled the batch is kept and retried, in order,
//!   with a backoff capped at one second, until it commits.
//!
//! Only an agent's owner writes its timeline. An operation may carry a `Fence`: the lease
//! epoch of the actor that wrote it. The statement that stores a batch locks the agent
//! rows of its fences (in id order, with those whose state it changes) and stores nothing
//! at all unless each epoch still matches `agents.lease_epoch`. A batch that met a fence
//! that no longer holds (another replica took the agent over) is taken apart before
//! anything of it is published or answered: the fenced operations are refused whole
//! (`WriteError::Fenced`, the fence marked deposed so that its actor stops, counted in
//! `fenced_batches`), and the others go back to the front of the queue to be numbered
//! again. A refused fence stalls nobody else. A seq slot found taken (a write without a
//! fence that raced another replica's) is never answered by renumbering a stored or
//! published event: the batch is sent back the same way and numbered from the table.
//!
//! A producer may attach *moments* to its events (`NewMoment`: a kind and some data,
//! e.g. "a turn ended"): each is stored in `agent_moments`, in the same transaction as the
//! event it goes with, so it exists exactly when its event does. The writer gives them no
//! meaning; it only wakes whoever waits on `moments_stored` after a batch with moments
//! commits. A batch without moments costs nothing more. A batch is one statement, committed
//! on its own, whatever it holds: agent events alone are one `INSERT`; with moments, team
//! events or state changes, one data-modifying `WITH`. A moment whose event the database
//! refuses is still stored (its event's stand-in takes the slot, and what the moment
//! says — a turn ended, an agent closed — did happen); a moment the database refuses
//! itself is logged and dropped, like a refused team event.
//!
//! An operation may also carry *state changes* (`StateChange`): a turn started or ended,
//! a new status, a permission request expired. They are what its events announce, and
//! they are written to the agent's row and to `permission_requests` in the same statement
//! as those events: the row never says what the timeline does not, nor the reverse, and a
//! turn's start or end costs no commit of its own. The writer folds a batch's changes into
//! one row update per agent, in order.
//!
//! Two batches may be committing at once, so that one slow commit (a thousand turns
//! ending together, each with a row to update) does not hold every other agent's events
//! behind it. A batch starts beside the one in flight only once its oldest operation has
//! waited `OVERLAP_AFTER` (a commit usually takes less, and a larger batch costs less per
//! event), and only with what cannot overtake anything: no event of an agent that has
//! events in flight or waiting ahead (each timeline is numbered, committed and published
//! in order), no team events, moments or state changes while another batch with any of
//! them is in flight or waiting ahead (team events commit in the order of their ids),
//! and no flush before everything queued ahead of it has landed.
//!
//! Since only one batch with team events, moments or state changes commits at a time,
//! such operations first wait `team_linger` (from the oldest of them) for company, unless
//! the batch is full: in a burst (a thousand prompts or turn ends within a second) each
//! commit would otherwise carry one or two of them, and pay for planning its statement
//! and for a WAL flush every time. Other agents' events do not wait for them.
//!
//! What is queued is bounded in events and in bytes. Producers wait for that budget
//! (backpressure: an agent's actor stops reading its provider), and the budget comes back
//! only when the events are committed or set aside.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::stream::{FuturesUnordered, StreamExt};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use uuid::Uuid;

use super::bus::{Bus, Published, TeamActivity};
use super::fault::{Fault, classify};
use super::scrub::{ENVELOPE_BYTES, scrub, scrub_text};
use crate::domain::{
    AgentEvent, AgentId, AgentStatus, EventKind, NewEvent, PermissionId, TurnId, TurnOutcome,
};
use crate::metrics::{self, Histogram};
use crate::store;
use crate::store::events::{AgentRowUpdate, StateRows, TeamEventRow};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// The store did not confirm the write in time. Whatever was queued stays queued and
    /// is committed, in order, once the store is back.
    #[error("the event store is unavailable; retry later")]
    Unavailable,
    #[error("the event writer has stopped")]
    Stopped,
    /// The operation's fence no longer holds: another replica took the agent over, and
    /// nothing of the operation was stored.
    #[error("another replica took this agent over; nothing was written")]
    Fenced,
}

/// The fencing token of the actor that runs `agent` here: the lease epoch it started with
/// (see the module docs). Every operation it hands over carries a clone; once the writer
/// finds the agent's epoch moved on, it refuses them and marks the fence deposed, which
/// wakes whoever waits on `deposed`.
#[derive(Debug, Clone)]
pub struct Fence {
    agent: AgentId,
    epoch: i64,
    deposed: Arc<Deposed>,
}

#[derive(Debug, Default)]
struct Deposed {
    flag: AtomicBool,
    notify: Notify,
}

impl Fence {
    pub fn new(agent: AgentId, epoch: i64) -> Self {
        Self {
            agent,
            epoch,
            deposed: Arc::default(),
        }
    }

    pub fn agent(&self) -> AgentId {
        self.agent
    }

    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Whether the writer refused a batch of this fence.
    pub fn is_deposed(&self) -> bool {
        self.deposed.flag.load(Ordering::SeqCst)
    }

    /// Wait until the writer refuses a batch of this fence (at once if it did).
    pub async fn deposed(&self) {
        loop {
            let notified = self.deposed.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_deposed() {
                return;
            }
            notified.await;
        }
    }

    fn depose(&self) {
        self.deposed.flag.store(true, Ordering::SeqCst);
        self.deposed.notify.notify_waiters();
    }
}

/// A team activity event to append alongside agent events.
#[derive(Debug, Clone)]
pub struct NewTeamEvent {
    pub team_id: Uuid,
    pub project_id: Option<Uuid>,
    pub workspace_id: Option<Uuid>,
    pub kind: &'static str,
    pub data: Value,
}

/// A moment of an agent's life, stored with the event that records it (see the module
/// docs). `event` is the index of that event among the operation's events (inside the
/// writer: among the batch's).
#[derive(Debug, Clone)]
pub struct NewMoment {
    pub event: usize,
    pub kind: &'static str,
    /// The hook event it is announced as: the moment is stored only while an enabled hook
    /// of the agent's team (or of the whole server) listens for it.
    pub hook: &'static str,
    pub data: Value,
}

/// A change to an agent's stored state that an operation's events announce (see the
/// module docs).
#[derive(Debug, Clone)]
pub enum StateChange {
    /// A turn started: it becomes the agent's last turn, with no outcome yet.
    TurnStarted { agent: AgentId, turn: TurnId },
    /// A turn ended: its outcome and error are kept while it is the agent's last turn.
    TurnEnded {
        agent: AgentId,
        turn: TurnId,
        outcome: TurnOutcome,
        error: Option<String>,
    },
    /// The agent's status, and why.
    Status {
        agent: AgentId,
        status: AgentStatus,
        reason: Option<String>,
    },
    /// A permission request expired (it stays as it is if it is no longer pending).
    PermissionExpired(PermissionId),
    /// The agent's mode (what its `mode_changed` event says).
    Mode { agent: AgentId, mode: String },
    /// The agent's model (what its `model_changed` event says).
    Model { agent: AgentId, model: String },
}

impl StateChange {
    /// Replace every U+0000 in its texts; returns their size in bytes.
    fn scrub(&mut self) -> usize {
        match self {
            StateChange::TurnEnded { error, .. } => error.as_mut().map_or(0, scrub_text),
            StateChange::Status { reason, .. } => reason.as_mut().map_or(0, scrub_text),
            StateChange::Mode { mode: text, .. } | StateChange::Model { model: text, .. } => {
                scrub_text(text)
            }
            StateChange::TurnStarted { .. } | StateChange::PermissionExpired(_) => 0,
        }
    }
}

/// What an operation commits with its agent events.
#[derive(Debug, Default)]
pub struct Attached {
    /// Team activity events.
    pub team: Vec<NewTeamEvent>,
    /// Moments, each attached to one of the operation's events.
    pub moments: Vec<NewMoment>,
    /// The state the events announce, in order.
    pub changes: Vec<StateChange>,
    /// The fence of the agent's owner: all of it is stored only while that holds. None
    /// for writes that are not an owner's (a takeover's, a service's on a closed agent).
    pub fence: Option<Fence>,
}

/// How the writer batches and how much it may hold.
#[derive(Debug, Clone)]
pub struct WriterLimits {
    /// Flush a batch at this many events…
    pub max_batch: usize,
    /// …or after this long, whichever comes first.
    pub linger: Duration,
    /// Team events, moments and state changes wait this long for company: one of them
    /// commits at a time (their ids commit in order), so in a burst (a thousand turns
    /// ending at once) each commit would otherwise carry one or two, and pay for a
    /// statement's planning and a WAL flush each time.
    pub team_linger: Duration,
    /// Events queued (accepted, not yet committed) before producers wait.
    pub max_queued_events: usize,
    /// Approximate bytes queued before producers wait.
    pub max_queued_bytes: usize,
    /// Longest time `append_committed` waits for budget and commit.
    pub commit_wait: Duration,
}

impl Default for WriterLimits {
    fn default() -> Self {
        Self {
            max_batch: 4096,
            linger: Duration::ZERO,
            team_linger: Duration::from_millis(10),
            max_queued_events: 50_000,
            max_queued_bytes: 64 << 20,
            commit_wait: Duration::from_secs(5),
        }
    }
}

/// A snapshot of the writer's counters (cheap: a few atomic loads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// Events accepted and not yet committed or set aside.
    pub queued_events: u64,
    /// Their approximate size in bytes.
    pub queued_bytes: u64,
    pub high_water_events: u64,
    pub high_water_bytes: u64,
    /// Events committed (stand-ins for refused events included).
    pub committed_events: u64,
    /// Agent events the database refused, stored as `event_rejected` errors instead.
    pub rejected_events: u64,
    /// Team events the database refused (logged; they have no slot to keep).
    pub rejected_team_events: u64,
    /// Batches refused for an agent whose fence no longer held (another replica took it
    /// over): counted once per agent and batch.
    pub fenced_batches: u64,
    /// Operations queued beyond the budget by `append_committed` after its wait expired.
    pub overdrafts: u64,
    /// Longest time any operation waited in the queue before its batch committed.
    pub max_queue_wait: Duration,
    /// Longest time spent setting refused events aside in one batch (from the first
    /// refusal to the last commit of that batch): the delay they caused the others.
    pub max_isolation: Duration,
    /// The writer currently believes the store is unreachable or stalled.
    pub store_down: bool,
}

type Done = oneshot::Sender<Result<Vec<AgentEvent>, WriteError>>;

/// Budget taken by one operation, and what it really holds.
#[derive(Debug, Clone, Copy, Default)]
struct Charge {
    event_permits: u32,
    byte_permits: u32,
    events: u64,
    bytes: u64,
}

enum WriteOp {
    Append {
        events: Vec<NewEvent>,
        team: Vec<NewTeamEvent>,
        moments: Vec<NewMoment>,
        changes: Vec<StateChange>,
        done: Option<Done>,
        charge: Charge,
        queued_at: Instant,
        fence: Option<Fence>,
    },
    /// The agent's actor stopped: drop its cached seq (memory stays flat).
    Forget(AgentId),
}

struct Shared {
    event_budget: Semaphore,
    byte_budget: Semaphore,
    max_events: u32,
    max_bytes: u32,
    commit_wait: Duration,
    queued_events: AtomicU64,
    queued_bytes: AtomicU64,
    high_water_events: AtomicU64,
    high_water_bytes: AtomicU64,
    committed_events: AtomicU64,
    rejected_events: AtomicU64,
    rejected_team_events: AtomicU64,
    fenced_batches: AtomicU64,
    overdrafts: AtomicU64,
    max_queue_wait_us: AtomicU64,
    max_isolation_us: AtomicU64,
    /// Events (agent and team) per committed batch.
    batch_events: Histogram,
    /// Time to commit one batch, retries and isolation included.
    commit_seconds: Histogram,
    store_down: AtomicBool,
    /// Rung after a batch with moments commits.
    moments_stored: Notify,
    /// The store's health as the request path knows it: told when a batch is refused
    /// because the database's disk is full, or finds it unreachable.
    health: std::sync::OnceLock<Arc<store::StoreHealth>>,
}

impl Shared {
    fn new(limits: &WriterLimits) -> Self {
        let max_events = clamp_u32(limits.max_queued_events.max(1));
        let max_bytes = clamp_u32(limits.max_queued_bytes.max(1));
        Self {
            event_budget: Semaphore::new(max_events as usize),
            byte_budget: Semaphore::new(max_bytes as usize),
            max_events,
            max_bytes,
            commit_wait: limits.commit_wait,
            queued_events: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            high_water_events: AtomicU64::new(0),
            high_water_bytes: AtomicU64::new(0),
            committed_events: AtomicU64::new(0),
            rejected_events: AtomicU64::new(0),
            rejected_team_events: AtomicU64::new(0),
            fenced_batches: AtomicU64::new(0),
            overdrafts: AtomicU64::new(0),
            max_queue_wait_us: AtomicU64::new(0),
            max_isolation_us: AtomicU64::new(0),
            batch_events: Histogram::new(metrics::SIZES),
            commit_seconds: Histogram::new(metrics::SECONDS),
            store_down: AtomicBool::new(false),
            moments_stored: Notify::new(),
            health: std::sync::OnceLock::new(),
        }
    }

    /// The budget an operation needs: what it holds, but never more than the whole
    /// budget, so one event larger than the budget still goes through (alone).
    fn charge(&self, events: usize, bytes: usize) -> Charge {
        Charge {
            event_permits: clamp_u32(events).min(self.max_events),
            byte_permits: clamp_u32(bytes).min(self.max_bytes),
            events: events as u64,
            bytes: bytes as u64,
        }
    }

    /// Wait until the budget has room for `charge`. Cancel-safe: a dropped wait gives
    /// back what it had taken.
    async fn reserve(&self, charge: &Charge) {
        let e = self
            .event_budget
            .acquire_many(charge.event_permits)
            .await
            .expect("the event budget is never closed");
        let b = self
            .byte_budget
            .acquire_many(charge.byte_permits)
            .await
            .expect("the byte budget is never closed");
        e.forget();
        b.forget();
    }

    fn try_reserve(&self, charge: &Charge) -> bool {
        let Ok(e) = self.event_budget.try_acquire_many(charge.event_permits) else {
            return false;
        };
        let Ok(b) = self.byte_budget.try_acquire_many(charge.byte_permits) else {
            return false;
        };
        e.forget();
        b.forget();
        true
    }

    fn admitted(&self, charge: &Charge) {
        let e = self
            .queued_events
            .fetch_add(charge.events, Ordering::Relaxed)
            + charge.events;
        let b = self.queued_bytes.fetch_add(charge.bytes, Ordering::Relaxed) + charge.bytes;
        self.high_water_events.fetch_max(e, Ordering::Relaxed);
        self.high_water_bytes.fetch_max(b, Ordering::Relaxed);
    }

    fn release(&self, total: &Charge) {
        self.queued_events
            .fetch_sub(total.events, Ordering::Relaxed);
        self.queued_bytes.fetch_sub(total.bytes, Ordering::Relaxed);
        self.event_budget.add_permits(total.event_permits as usize);
        self.byte_budget.add_permits(total.byte_permits as usize);
    }

    fn set_down(&self, down: bool) {
        self.store_down.store(down, Ordering::Relaxed);
    }

    fn is_down(&self) -> bool {
        self.store_down.load(Ordering::Relaxed)
    }
}

fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[derive(Clone)]
pub struct EventWriter {
    tx: mpsc::UnboundedSender<WriteOp>,
    shared: Arc<Shared>,
}

impl EventWriter {
    /// Start the writer task on the current runtime.
    pub fn spawn(pool: PgPool, bus: Arc<Bus>, limits: WriterLimits) -> Self {
        // Unbounded in operations: what bounds the queue is the budget, counted in
        // events and bytes, that every operation takes before it is sent.
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::new(&limits));
        let writer = Writer {
            committer: Committer {
                pool,
                shared: shared.clone(),
            },
            bus,
            max_batch: limits.max_batch.max(1),
            linger: limits.linger,
            team_linger: limits.team_linger,
            next_seq: HashMap::new(),
            flights: Vec::new(),
            next_flight: 0,
        };
        tokio::spawn(writer.run(rx));
        Self { tx, shared }
    }

    /// Tell `health` when the database refuses a batch because its disk is full (or a
    /// commit finds it unreachable), so the request path and `/readyz` know it too. Set
    /// once; later calls do nothing.
    pub fn report_to(&self, health: Arc<store::StoreHealth>) {
        let _ = self.shared.health.set(health);
    }

    /// Queue one event; it becomes visible once committed. Waits for budget.
    pub async fn append(&self, event: NewEvent) -> Result<(), WriteError> {
        self.append_many(vec![event]).await
    }

    /// Queue several events of one producer, in order, as one operation. Waits as long
    /// as it takes for budget: that wait is the backpressure on the producer.
    pub async fn append_many(&self, events: Vec<NewEvent>) -> Result<(), WriteError> {
        self.append_many_with(events, Vec::new()).await
    }

    /// `append_many`, with moments attached to some of the events.
    pub async fn append_many_with(
        &self,
        events: Vec<NewEvent>,
        moments: Vec<NewMoment>,
    ) -> Result<(), WriteError> {
        let attached = Attached {
            moments,
            ..Attached::default()
        };
        self.append_many_attached(events, attached).await
    }

    /// `append_many`, with moments and a fence (team events and state changes too).
    pub async fn append_many_attached(
        &self,
        mut events: Vec<NewEvent>,
        mut attached: Attached,
    ) -> Result<(), WriteError> {
        let Attached {
            team,
            moments,
            changes,
            ..
        } = &mut attached;
        let bytes = prepare(&mut events, team, moments, changes);
        let charge = self.shared.charge(events.len() + team.len(), bytes);
        self.shared.reserve(&charge).await;
        self.send(events, attached, None, charge)
    }

    /// Append events (and team activity) and wait until they are committed, at most
    /// `commit_wait` in all (budget included), and not at all when the writer already
    /// knows the store is down. On `Unavailable` the events stay queued and are
    /// committed in order once the store is back; nothing handed over is dropped. If the
    /// budget had no room in time they are queued beyond it (counted in `overdrafts`).
    pub async fn append_committed(
        &self,
        events: Vec<NewEvent>,
        team: Vec<NewTeamEvent>,
    ) -> Result<Vec<AgentEvent>, WriteError> {
        let attached = Attached {
            team,
            ..Attached::default()
        };
        self.append_committed_with(events, attached).await
    }

    /// `append_committed`, with moments attached to some of the events and the state
    /// changes they announce: all of it commits together.
    pub async fn append_committed_with(
        &self,
        mut events: Vec<NewEvent>,
        mut attached: Attached,
    ) -> Result<Vec<AgentEvent>, WriteError> {
        let deadline = Instant::now() + self.shared.commit_wait;
        let Attached {
            team,
            moments,
            changes,
            ..
        } = &mut attached;
        let bytes = prepare(&mut events, team, moments, changes);
        let mut charge = self.shared.charge(events.len() + team.len(), bytes);
        let known_down = self.shared.is_down();
        let reserved = if known_down {
            self.shared.try_reserve(&charge)
        } else {
            tokio::time::timeout_at(deadline, self.shared.reserve(&charge))
                .await
                .is_ok()
        };
        if !reserved {
            charge.event_permits = 0;
            charge.byte_permits = 0;
            self.shared.overdrafts.fetch_add(1, Ordering::Relaxed);
            self.send(events, attached, None, charge)?;
            return Err(WriteError::Unavailable);
        }
        if known_down {
            self.send(events, attached, None, charge)?;
            return Err(WriteError::Unavailable);
        }
        let (done, rx) = oneshot::channel();
        self.send(events, attached, Some(done), charge)?;
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(WriteError::Stopped),
            Err(_) => Err(WriteError::Unavailable),
        }
    }

    /// Wait until everything queued before this call is committed (at most
    /// `commit_wait`).
    pub async fn flush(&self) -> Result<(), WriteError> {
        self.append_committed(Vec::new(), Vec::new())
            .await
            .map(|_| ())
    }

    /// Wait until a batch with moments commits after this call (or already did since the
    /// last wait: one wake-up is kept).
    pub async fn moments_stored(&self) {
        self.shared.moments_stored.notified().await;
    }

    /// A write of `fence`'s actor made outside the writer (its session handle) found the
    /// agent in another epoch: count it with the refused batches and depose the fence, so
    /// that its actor stops as it would after a refused batch.
    pub fn fenced_off(&self, fence: &Fence) {
        self.shared.fenced_batches.fetch_add(1, Ordering::Relaxed);
        fence.depose();
    }

    pub async fn forget(&self, agent: AgentId) {
        let _ = self.tx.send(WriteOp::Forget(agent));
    }

    /// Events per committed batch.
    pub fn batch_histogram(&self) -> &Histogram {
        &self.shared.batch_events
    }

    /// Seconds to commit a batch.
    pub fn commit_histogram(&self) -> &Histogram {
        &self.shared.commit_seconds
    }

    /// The writer's counters.
    pub fn stats(&self) -> WriterStats {
        let s = &self.shared;
        WriterStats {
            queued_events: s.queued_events.load(Ordering::Relaxed),
            queued_bytes: s.queued_bytes.load(Ordering::Relaxed),
            high_water_events: s.high_water_events.load(Ordering::Relaxed),
            high_water_bytes: s.high_water_bytes.load(Ordering::Relaxed),
            committed_events: s.committed_events.load(Ordering::Relaxed),
            rejected_events: s.rejected_events.load(Ordering::Relaxed),
            rejected_team_events: s.rejected_team_events.load(Ordering::Relaxed),
            fenced_batches: s.fenced_batches.load(Ordering::Relaxed),
            overdrafts: s.overdrafts.load(Ordering::Relaxed),
            max_queue_wait: Duration::from_micros(s.max_queue_wait_us.load(Ordering::Relaxed)),
            max_isolation: Duration::from_micros(s.max_isolation_us.load(Ordering::Relaxed)),
            store_down: s.is_down(),
        }
    }

    fn send(
        &self,
        events: Vec<NewEvent>,
        attached: Attached,
        done: Option<Done>,
        charge: Charge,
    ) -> Result<(), WriteError> {
        let Attached {
            team,
            mut moments,
            changes,
            fence,
        } = attached;
        moments.retain(|m| {
            let fits = m.event < events.len();
            if !fits {
                tracing::error!(
                    kind = m.kind,
                    "a moment names no event of its operation; it is not stored"
                );
            }
            fits
        });
        self.shared.admitted(&charge);
        let op = WriteOp::Append {
            events,
            team,
            moments,
            changes,
            done,
            charge,
            queued_at: Instant::now(),
            fence,
        };
        self.tx.send(op).map_err(|e| {
            if let WriteOp::Append { charge, .. } = e.0 {
                self.shared.release(&charge);
            }
            WriteError::Stopped
        })
    }
}

/// Approximate bytes a state change costs besides its texts (ids, kind, status).
const CHANGE_BYTES: usize = 32;

/// Scrub every event's data and every text (on the producer's task) and measure the
/// operation.
fn prepare(
    events: &mut [NewEvent],
    team: &mut [NewTeamEvent],
    moments: &mut [NewMoment],
    changes: &mut [StateChange],
) -> usize {
    let a: usize = events
        .iter_mut()
        .map(|e| scrub(&mut e.data) + ENVELOPE_BYTES)
        .sum();
    let t: usize = team
        .iter_mut()
        .map(|e| scrub(&mut e.data) + ENVELOPE_BYTES)
        .sum();
    let m: usize = moments.iter_mut().map(|m| scrub(&mut m.data)).sum();
    let c: usize = changes.iter_mut().map(|c| c.scrub() + CHANGE_BYTES).sum();
    a + t + m + c
}

/// One operation inside a batch.
struct Pending {
    events: Vec<NewEvent>,
    team: Vec<NewTeamEvent>,
    moments: Vec<NewMoment>,
    changes: Vec<StateChange>,
    done: Option<Done>,
    charge: Charge,
    queued_at: Option<Instant>,
    forget: Option<AgentId>,
    fence: Option<Fence>,
}

impl Pending {
    fn from_op(op: WriteOp) -> Self {
        match op {
            WriteOp::Append {
                events,
                team,
                moments,
                changes,
                done,
                charge,
                queued_at,
                fence,
            } => Self {
                events,
                team,
                moments,
                changes,
                done,
                charge,
                queued_at: Some(queued_at),
                forget: None,
                fence,
            },
            // Applied once the batch is numbered.
            WriteOp::Forget(id) => Self {
                events: Vec::new(),
                team: Vec::new(),
                moments: Vec::new(),
                changes: Vec::new(),
                done: None,
                charge: Charge::default(),
                queued_at: None,
                forget: Some(id),
                fence: None,
            },
        }
    }

    fn len(&self) -> usize {
        self.events.len() + self.team.len()
    }
}

/// Retry pacing while the store is unavailable: 50 ms, doubling, at most 1 s.
struct Backoff(Duration);

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const MAX: Duration = Duration::from_secs(1);

    fn new() -> Self {
        Self(Self::FIRST)
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Self::MAX);
    }
}

/// What a batch asks of the batches committing beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Agent events only: may commit beside a batch of other agents.
    Plain,
    /// Team events, moments or state changes: one such batch commits at a time, so team
    /// events are committed in the order of their ids.
    Serial,
    /// A flush: committed only once everything queued before it is.
    Barrier,
}

impl Pending {
    fn class(&self) -> Class {
        if !self.team.is_empty() || !self.moments.is_empty() || !self.changes.is_empty() {
            Class::Serial
        } else if self.events.is_empty() && self.done.is_some() {
            Class::Barrier
        } else {
            Class::Plain
        }
    }

    /// Every agent whose timeline or row the operation touches.
    fn agents(&self) -> impl Iterator<Item = AgentId> + '_ {
        self.events
            .iter()
            .map(|e| e.agent_id)
            .chain(self.changes.iter().filter_map(StateChange::agent))
            .chain(self.forget)
    }
}

impl StateChange {
    fn agent(&self) -> Option<AgentId> {
        match self {
            StateChange::TurnStarted { agent, .. }
            | StateChange::TurnEnded { agent, .. }
            | StateChange::Status { agent, .. }
            | StateChange::Mode { agent, .. }
            | StateChange::Model { agent, .. } => Some(*agent),
            StateChange::PermissionExpired(_) => None,
        }
    }
}

/// At most this many batches commit at once…
const MAX_IN_FLIGHT: usize = 2;
/// …and one starts beside another only once its oldest operation has waited this long:
/// a commit usually takes less, and waiting for it makes larger batches, which cost less
/// per event. What it bounds is the wait behind a slow commit.
const OVERLAP_AFTER: Duration = Duration::from_millis(5);

/// Which of the waiting operations (in queue order) may start now beside the batches in
/// flight, at most `max_batch` events' worth: none of an agent in flight or held back
/// (each timeline commits in order), no team events while others are being committed or
/// are held back (their ids commit in order) or before they are `serial_due` (done
/// gathering for company), no flush before everything ahead of it.
fn startable(
    held: &VecDeque<Pending>,
    flights: &[Flight],
    max_batch: usize,
    serial_due: bool,
) -> Vec<bool> {
    let mut take = vec![false; held.len()];
    let mut blocked: HashSet<AgentId> = HashSet::new();
    let mut serial_blocked = !serial_due || flights.iter().any(|f| f.serial);
    let in_flight = |a: &AgentId| flights.iter().any(|f| f.agents.contains(a));
    let mut held_back = false;
    let mut events = 0;
    for (i, op) in held.iter().enumerate() {
        if events >= max_batch {
            break;
        }
        let class = op.class();
        if class == Class::Barrier && (!flights.is_empty() || held_back) {
            break;
        }
        let clash = (class == Class::Serial && serial_blocked)
            || op.agents().any(|a| in_flight(&a) || blocked.contains(&a));
        if clash {
            blocked.extend(op.agents());
            serial_blocked |= class == Class::Serial;
            held_back = true;
            continue;
        }
        take[i] = true;
        events += op.len();
    }
    take
}

/// A batch numbered and on its way to the store.
struct Numbered {
    flight: u64,
    batch: Vec<Pending>,
    spans: Vec<(usize, usize)>,
    /// How many team events, moments and state changes each operation brought, in order.
    parts: Vec<Parts>,
    events: Vec<AgentEvent>,
    team: Vec<NewTeamEvent>,
    moments: Vec<NewMoment>,
    changes: Vec<StateChange>,
    /// The fences of the batch's operations, each once.
    fences: Vec<store::events::FenceRow>,
}

/// What one operation added to a batch besides its events.
#[derive(Debug, Clone, Copy, Default)]
struct Parts {
    team: usize,
    moments: usize,
    changes: usize,
}

/// What became of a batch.
enum Outcome {
    /// Committed, with these team rows.
    Committed(Vec<TeamEventRow>),
    /// Nothing was stored: these fences did not hold.
    Deposed(Vec<store::events::FenceRow>),
    /// Nothing was stored: a seq slot was taken, so the cached seqs of its agents are
    /// behind the table.
    Stale,
}

/// A batch back from the store: committed (to be answered and published), or not stored
/// at all (to be taken apart and queued again, without what was fenced off).
struct Landed {
    flight: u64,
    batch: Vec<Pending>,
    spans: Vec<(usize, usize)>,
    parts: Vec<Parts>,
    events: Vec<AgentEvent>,
    team: Vec<NewTeamEvent>,
    moments: Vec<NewMoment>,
    changes: Vec<StateChange>,
    outcome: Outcome,
    commit_started: Instant,
}

/// A batch in flight, as the writer keeps track of it.
struct Flight {
    id: u64,
    agents: HashSet<AgentId>,
    serial: bool,
}

struct Writer {
    committer: Committer,
    bus: Arc<Bus>,
    max_batch: usize,
    linger: Duration,
    team_linger: Duration,
    next_seq: HashMap<AgentId, i64>,
    flights: Vec<Flight>,
    next_flight: u64,
}

/// Operations taken from the queue and not yet in a batch, in queue order.
struct Held {
    ops: VecDeque<Pending>,
    events: usize,
    /// When the first of them arrived.
    since: Instant,
}

impl Held {
    fn push(&mut self, op: WriteOp) {
        if self.ops.is_empty() {
            self.since = Instant::now();
        }
        let p = Pending::from_op(op);
        self.events += p.len();
        self.ops.push_back(p);
    }

    /// Put the operations of a batch that was not stored back at the front, in order:
    /// whatever else waits came after them.
    fn requeue(&mut self, ops: Vec<Pending>) {
        if ops.is_empty() {
            return;
        }
        if self.ops.is_empty() {
            self.since = Instant::now();
        }
        for p in ops.into_iter().rev() {
            self.events += p.len();
            self.ops.push_front(p);
        }
    }

    /// Take out the operations `take` marks, keeping the others in order.
    fn take(&mut self, take: Vec<bool>) -> Vec<Pending> {
        let mut batch = Vec::new();
        let mut kept = VecDeque::with_capacity(self.ops.len());
        for (p, t) in self.ops.drain(..).zip(take) {
            if t {
                self.events -= p.len();
                batch.push(p);
            } else {
                kept.push_back(p);
            }
        }
        self.ops = kept;
        batch
    }
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<WriteOp>) {
        let mut held = Held {
            ops: VecDeque::new(),
            events: 0,
            since: Instant::now(),
        };
        // Each commit runs as a task of its own, so it goes on while the writer numbers
        // the next batch.
        let mut landing = FuturesUnordered::new();
        let mut open = true;
        // When everything waiting had to wait for a batch to land: look again only after
        // a landing or `OVERLAP_AFTER`, not at every arrival (a scan is linear in what
        // waits, and under a steady load every write would trigger one).
        let mut rescan_at: Option<Instant> = None;
        loop {
            while open && held.events < self.max_batch {
                match rx.try_recv() {
                    Ok(op) => held.push(op),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            let now = Instant::now();
            // When the next batch may start, if not now.
            let mut wake: Option<Instant> = None;
            if !held.ops.is_empty()
                && self.flights.len() < MAX_IN_FLIGHT
                && rescan_at.is_none_or(|at| now >= at)
            {
                rescan_at = None;
                let full = held.events >= self.max_batch || !open;
                let alone = self.flights.is_empty();
                // Team events and state changes gather for company first.
                let gathered = held
                    .ops
                    .iter()
                    .find(|p| p.class() == Class::Serial)
                    .and_then(|p| p.queued_at)
                    .map(|t| t + self.team_linger);
                let serial_due = full || gathered.is_none_or(|at| now >= at);
                // When they are done gathering, if not yet.
                let gathering = gathered.filter(|_| !serial_due);
                // Alone, a batch starts once its first operation has lingered (or the
                // batch is full); beside one in flight, once the oldest operation that may
                // start has waited `OVERLAP_AFTER` (or the linger, if longer).
                let lingered = held.since + self.linger;
                let take = if alone && !full && now < lingered {
                    Vec::new()
                } else {
                    startable(&held.ops, &self.flights, self.max_batch, serial_due)
                };
                let ready = if alone {
                    Some(lingered)
                } else {
                    held.ops
                        .iter()
                        .zip(&take)
                        .filter(|(_, t)| **t)
                        .map(|(p, _)| p.queued_at.unwrap_or(now))
                        .min()
                        .map(|t| t + self.linger.max(OVERLAP_AFTER))
                };
                match ready {
                    Some(at) if !full && now < at => wake = Some(at),
                    _ if take.iter().any(|t| *t) => {
                        let numbered = self.number(held.take(take)).await;
                        landing.push(tokio::spawn(self.committer.clone().commit(numbered)));
                        continue;
                    }
                    // Everything waiting waits for a batch to land, or to gather.
                    _ => match gathering {
                        // Nothing in flight: an arriving event may start at once.
                        Some(g) if alone => wake = Some(g),
                        Some(g) => rescan_at = Some((now + OVERLAP_AFTER).min(g)),
                        None => rescan_at = Some(now + OVERLAP_AFTER),
                    },
                }
                if let (Some(w), Some(g)) = (wake, gathering) {
                    wake = Some(w.min(g));
                }
            }
            if !open && held.ops.is_empty() && landing.is_empty() {
                break;
            }
            // New operations are looked at only when one could start: not while the
            // writer waits to start a batch beside one in flight, or every slot is in
            // flight (each would wake it). A linger is cut short by a full batch.
            let receive = open
                && held.events < self.max_batch
                && (wake.is_none() || self.flights.is_empty())
                && self.flights.len() < MAX_IN_FLIGHT;
            tokio::select! {
                Some(landed) = landing.next(), if !landing.is_empty() => match landed {
                    Ok(landed) => {
                        held.requeue(self.land(landed));
                        rescan_at = None;
                    }
                    // A commit that panicked takes the writer with it, as it did when
                    // commits ran on the writer's own task.
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    // Cancelled: the runtime is shutting down.
                    Err(_) => return,
                },
                op = rx.recv(), if receive => match op {
                    Some(op) => held.push(op),
                    None => open = false,
                },
                _ = tokio::time::sleep_until(wake.or(rescan_at).unwrap_or(now)),
                    if wake.or(rescan_at).is_some() => {}
            }
        }
    }

    /// Number a batch's events (no copies on the hot path) and note it as in flight.
    async fn number(&mut self, mut batch: Vec<Pending>) -> Numbered {
        let agents: Vec<AgentId> = {
            let mut seen = HashSet::new();
            batch
                .iter()
                .flat_map(|p| p.events.iter().map(|e| e.agent_id))
                .filter(|id| !self.next_seq.contains_key(id) && seen.insert(*id))
                .collect()
        };
        if !agents.is_empty() {
            // None of them is in flight (`startable`), so the table has all their events.
            for (id, last) in self.committer.last_seqs(&agents).await {
                self.next_seq.insert(id, last + 1);
            }
        }

        let total: usize = batch.iter().map(|p| p.events.len()).sum();
        let mut events: Vec<AgentEvent> = Vec::with_capacity(total);
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(batch.len());
        let mut parts: Vec<Parts> = Vec::with_capacity(batch.len());
        let mut fences: Vec<store::events::FenceRow> = Vec::new();
        let mut team: Vec<NewTeamEvent> = Vec::new();
        let mut moments: Vec<NewMoment> = Vec::new();
        let mut changes: Vec<StateChange> = Vec::new();
        let mut touched: HashSet<AgentId> = HashSet::new();
        let mut serial = false;
        for p in batch.iter() {
            touched.extend(p.agents());
            serial |= p.class() == Class::Serial;
        }
        // The time as the table keeps it (microseconds), so live and replayed copies of
        // an event are the same.
        let now = Utc::now();
        let now = DateTime::from_timestamp_micros(now.timestamp_micros()).unwrap_or(now);
        for p in batch.iter_mut() {
            let start = events.len();
            parts.push(Parts {
                team: p.team.len(),
                moments: p.moments.len(),
                changes: p.changes.len(),
            });
            if let Some(f) = &p.fence {
                let row = (f.agent.uuid(), f.epoch);
                if !fences.contains(&row) {
                    fences.push(row);
                }
            }
            moments.extend(p.moments.drain(..).map(|mut m| {
                m.event += start;
                m
            }));
            for e in std::mem::take(&mut p.events) {
                // Every agent of the batch was read above. Were one missing, slot 1 would
                // collide and the batch be numbered again from the table.
                let seq = self.next_seq.get(&e.agent_id).copied().unwrap_or(1);
                self.next_seq.insert(e.agent_id, seq + 1);
                events.push(AgentEvent {
                    seq,
                    agent_id: e.agent_id,
                    turn_id: e.turn_id,
                    at: now,
                    kind: e.kind,
                    data: e.data,
                });
            }
            spans.push((start, events.len()));
            team.append(&mut p.team);
            changes.append(&mut p.changes);
        }
        // Forgetting only drops a cache entry: done after numbering the whole batch, so an
        // agent that stops and starts again within one batch keeps counting correctly.
        for id in batch.iter().filter_map(|p| p.forget) {
            self.next_seq.remove(&id);
        }
        let flight = self.next_flight;
        self.next_flight += 1;
        self.flights.push(Flight {
            id: flight,
            agents: touched,
            serial,
        });
        Numbered {
            flight,
            batch,
            spans,
            parts,
            events,
            team,
            moments,
            changes,
            fences,
        }
    }

    /// A batch is back from the store. Committed: now, and only now, answer its producers
    /// and publish it. Not stored: returns its operations to queue again (see `unwind`).
    fn land(&mut self, mut landed: Landed) -> Vec<Pending> {
        let mut rows = match std::mem::replace(&mut landed.outcome, Outcome::Stale) {
            Outcome::Committed(rows) => rows,
            Outcome::Deposed(deposed) => return self.unwind(landed, &deposed),
            Outcome::Stale => return self.unwind(landed, &[]),
        };
        let Landed {
            flight,
            batch,
            spans,
            events,
            moments,
            commit_started,
            ..
        } = landed;
        self.flights.retain(|f| f.id != flight);
        let shared = &self.committer.shared;
        if !moments.is_empty() {
            shared.moments_stored.notify_one();
        }
        let committed_at = Instant::now();
        if !events.is_empty() || !rows.is_empty() {
            shared
                .batch_events
                .observe((events.len() + rows.len()) as f64);
            shared
                .commit_seconds
                .observe(committed_at.duration_since(commit_started).as_secs_f64());
        }
        let mut released = Charge::default();
        let mut oldest: Option<Instant> = None;
        for (p, (start, end)) in batch.into_iter().zip(spans) {
            if let Some(done) = p.done {
                let _ = done.send(Ok(events[start..end].to_vec()));
            }
            released.event_permits += p.charge.event_permits;
            released.byte_permits += p.charge.byte_permits;
            released.events += p.charge.events;
            released.bytes += p.charge.bytes;
            if let Some(t) = p.queued_at {
                oldest = Some(oldest.map_or(t, |o| o.min(t)));
            }
        }
        shared
            .committed_events
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        if self.bus.announcing() {
            self.bus
                .announce(seq_ranges(&events), rows.iter().map(|r| r.id).collect());
        }
        self.bus
            .publish(events.into_iter().map(|e| Arc::new(Published::new(e))));
        rows.sort_by_key(|r| r.id);
        for row in rows {
            self.bus.publish_team(Arc::new(TeamActivity::from(row)));
        }
        shared.release(&released);
        if let Some(t) = oldest {
            let waited = committed_at.duration_since(t).as_micros() as u64;
            shared
                .max_queue_wait_us
                .fetch_max(waited, Ordering::Relaxed);
        }
        Vec::new()
    }

    /// A batch that was not stored, taken apart: the operations whose fence is among
    /// `deposed` are refused (their producers answered `Fenced`, their fences marked
    /// deposed, their budget given back); the others go back to the queue, to be numbered
    /// again. Nothing of the batch was published or answered, so no seq anyone has seen
    /// changes. The seqs cached for its agents go back to where the batch started them,
    /// except for agents that were fenced off, or all of them when the batch met a taken
    /// slot (`deposed` empty): those are read from the table again.
    fn unwind(&mut self, landed: Landed, deposed: &[store::events::FenceRow]) -> Vec<Pending> {
        let Landed {
            flight,
            batch,
            spans,
            parts,
            events,
            team,
            moments,
            changes,
            ..
        } = landed;
        self.flights.retain(|f| f.id != flight);
        let stale = deposed.is_empty();
        let fenced: HashSet<Uuid> = deposed.iter().map(|d| d.0).collect();
        let mut first: HashMap<AgentId, i64> = HashMap::new();
        for e in &events {
            let s = first.entry(e.agent_id).or_insert(e.seq);
            *s = (*s).min(e.seq);
        }
        for (agent, seq) in first {
            if stale || fenced.contains(&agent.uuid()) {
                self.next_seq.remove(&agent);
            } else {
                self.next_seq.insert(agent, seq);
            }
        }
        let shared = &self.committer.shared;
        shared
            .fenced_batches
            .fetch_add(deposed.len() as u64, Ordering::Relaxed);
        let mut events = events.into_iter();
        let mut team = team.into_iter();
        let mut moments = moments.into_iter();
        let mut changes = changes.into_iter();
        let mut released = Charge::default();
        let mut again = Vec::with_capacity(batch.len());
        for ((mut p, (start, end)), part) in batch.into_iter().zip(spans).zip(parts) {
            let op_events: Vec<NewEvent> = events
                .by_ref()
                .take(end - start)
                .map(|e| NewEvent {
                    agent_id: e.agent_id,
                    turn_id: e.turn_id,
                    kind: e.kind,
                    data: e.data,
                })
                .collect();
            let op_team: Vec<NewTeamEvent> = team.by_ref().take(part.team).collect();
            let op_moments: Vec<NewMoment> = moments
                .by_ref()
                .take(part.moments)
                .map(|mut m| {
                    m.event -= start;
                    m
                })
                .collect();
            let op_changes: Vec<StateChange> = changes.by_ref().take(part.changes).collect();
            let refused = p
                .fence
                .as_ref()
                .is_some_and(|f| deposed.contains(&(f.agent.uuid(), f.epoch)));
            if refused {
                if let Some(f) = &p.fence {
                    tracing::warn!(
                        agent_id = %f.agent, epoch = f.epoch, events = op_events.len(),
                        "another replica took this agent over: its batch is refused and the agent stops here"
                    );
                    f.depose();
                }
                if let Some(done) = p.done.take() {
                    let _ = done.send(Err(WriteError::Fenced));
                }
                released.event_permits += p.charge.event_permits;
                released.byte_permits += p.charge.byte_permits;
                released.events += p.charge.events;
                released.bytes += p.charge.bytes;
                continue;
            }
            p.events = op_events;
            p.team = op_team;
            p.moments = op_moments;
            p.changes = op_changes;
            again.push(p);
        }
        shared.release(&released);
        again
    }
}

/// What commits a batch: its own handle on the writer's connections, so that two batches
/// can be committing at once.
#[derive(Clone)]
struct Committer {
    pool: PgPool,
    shared: Arc<Shared>,
}

impl Committer {
    /// Commit a numbered batch, however long the store takes.
    async fn commit(self, n: Numbered) -> Landed {
        let Numbered {
            flight,
            batch,
            spans,
            parts,
            mut events,
            team,
            moments,
            changes,
            fences,
        } = n;
        let commit_started = Instant::now();
        let state = fold(&changes);
        let span = if events.is_empty() && team.is_empty() && state.is_empty() {
            tracing::Span::none()
        } else {
            tracing::info_span!("commit", events = events.len(), team_events = team.len())
        };
        let outcome = tracing::Instrument::instrument(
            self.commit_all(&mut events, &team, &moments, &state, &fences),
            span,
        )
        .await;
        drop(state);
        Landed {
            flight,
            batch,
            spans,
            parts,
            events,
            team,
            moments,
            changes,
            outcome,
            commit_started,
        }
    }

    /// Commit `events` and `team`, whatever it takes: retry while the store is
    /// unavailable; when the database refuses the batch for its content, commit it again
    /// row by row so that every other event is stored and each refused one is replaced by
    /// a stand-in in its slot. Stores nothing when a fence does not hold, or a seq slot
    /// is taken: the writer takes the batch apart then (`Writer::unwind`).
    async fn commit_all(
        &self,
        events: &mut [AgentEvent],
        team: &[NewTeamEvent],
        moments: &[NewMoment],
        state: &StateRows<'_>,
        fences: &[store::events::FenceRow],
    ) -> Outcome {
        if events.is_empty() && team.is_empty() && state.is_empty() {
            return Outcome::Committed(Vec::new());
        }
        let mut backoff = Backoff::new();
        let mut first_refusal: Option<Instant> = None;
        loop {
            let attempt = if first_refusal.is_some() {
                self.watched(
                    events.len(),
                    self.commit_isolating(events, team, moments, state, fences),
                )
                .await
            } else {
                self.watched(
                    events.len(),
                    try_commit(&self.pool, events, team, moments, state, fences),
                )
                .await
            };
            let err = match attempt {
                Ok(outcome) => {
                    if self.shared.is_down() {
                        tracing::info!("the event store is reachable again");
                        self.shared.set_down(false);
                    }
                    if let Some(t) = first_refusal {
                        self.shared
                            .max_isolation_us
                            .fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                    }
                    return outcome;
                }
                Err(err) => err,
            };
            match classify(&err) {
                Fault::Unavailable => {
                    if let Some(health) = self.shared.health.get() {
                        if store::health::is_disk_full(&err) {
                            health.disk_full(&err.to_string());
                        } else if store::health::is_unreachable(&err) {
                            health.suspect();
                        }
                    }
                    if !self.shared.is_down() {
                        tracing::warn!(error = %err, events = events.len(), "the event store is unavailable; keeping the batch and retrying");
                        self.shared.set_down(true);
                    }
                    backoff.wait().await;
                }
                Fault::SeqTaken => {
                    // A deposed owner never gets here: its fence fails first. What is left
                    // is a write without a fence (a takeover's, a service's) that found this
                    // writer's cached seq behind the table. Nothing was stored, published or
                    // answered: the batch is numbered again from the table.
                    tracing::warn!(error = %err, "an event's seq slot was already taken; numbering the batch again from the table");
                    return Outcome::Stale;
                }
                Fault::Content if first_refusal.is_none() => {
                    first_refusal = Some(Instant::now());
                }
                _ => {
                    // Refused even row by row with stand-ins: the cause is not an event.
                    // Keep everything and retry rather than lose a slot.
                    tracing::error!(error = %err, events = events.len(), "an event batch cannot be stored; retrying");
                    backoff.wait().await;
                }
            }
        }
    }

    /// Commit a refused batch row by row in one transaction: each refused agent event is
    /// replaced by an `error` event (`event_rejected`) in its slot, each refused team
    /// event is logged and counted; the state changes are written as they are (a refusal
    /// of those is logged).
    async fn commit_isolating(
        &self,
        events: &mut [AgentEvent],
        team: &[NewTeamEvent],
        moments: &[NewMoment],
        state: &StateRows<'_>,
        fences: &[store::events::FenceRow],
    ) -> Result<Outcome, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        // The fences first, their rows locked until the commit: nothing is set aside for a
        // batch that is not to be stored at all.
        let deposed = store::events::deposed(&mut tx, fences).await?;
        if !deposed.is_empty() {
            tx.rollback().await?;
            return Ok(Outcome::Deposed(deposed));
        }
        let refused = if events.is_empty() {
            Vec::new()
        } else {
            store::events::insert_each(&mut tx, events).await?
        };
        let mut stand_ins = Vec::with_capacity(refused.len());
        for (idx, code, why) in &refused {
            let Some(e) = usize::try_from(*idx).ok().and_then(|i| events.get_mut(i)) else {
                continue;
            };
            let message = format!(
                "a {} event was dropped: the database refused it ({why}, SQLSTATE {code})",
                e.kind.as_str()
            );
            tracing::error!(agent_id = %e.agent_id, seq = e.seq, %message, "event rejected; storing an error in its slot");
            e.kind = EventKind::Error;
            e.data = json!({"code": "event_rejected", "message": message});
            stand_ins.push(e.clone());
        }
        if !stand_ins.is_empty() {
            // Stand-ins go through the ordinary insert: if even they are refused, the
            // cause is not the events and the whole batch is retried.
            store::events::insert_batch(&mut *tx, &stand_ins).await?;
        }
        let mut rows = Vec::with_capacity(team.len());
        let mut team_refused = 0;
        for t in team {
            // A savepoint, so one refused team event does not undo the others.
            let mut sp = sqlx::Acquire::begin(&mut *tx).await?;
            match store::events::insert_team_event(
                &mut sp,
                t.team_id,
                t.project_id,
                t.workspace_id,
                t.kind,
                &t.data,
            )
            .await
            {
                Ok(row) => {
                    sp.commit().await?;
                    rows.push(row);
                }
                Err(err) if classify(&err) == Fault::Content => {
                    sp.rollback().await?;
                    tracing::error!(
                        error = %err, kind = t.kind, team_id = %t.team_id,
                        "the database refused a team event; it is not stored (team events have no seq slot to keep)"
                    );
                    team_refused += 1;
                }
                Err(err) => return Err(err),
            }
        }
        // Moments stay with their events, stand-ins included (what they say happened);
        // one the database refuses is logged and left out, each in its own savepoint.
        for m in moments {
            let mut sp = sqlx::Acquire::begin(&mut *tx).await?;
            match store::events::insert_moments(&mut *sp, &[moment_row(events, m)]).await {
                Ok(()) => sp.commit().await?,
                Err(err) if classify(&err) == Fault::Content => {
                    sp.rollback().await?;
                    tracing::error!(error = %err, kind = m.kind, "the database refused a moment; it is not stored");
                }
                Err(err) => return Err(err),
            }
        }
        if !state.is_empty() {
            let mut sp = sqlx::Acquire::begin(&mut *tx).await?;
            match store::events::insert_batch_with(&mut *sp, &[], &[], &[], state, &[]).await {
                Ok(_) => sp.commit().await?,
                Err(err) if classify(&err) == Fault::Content => {
                    sp.rollback().await?;
                    tracing::error!(error = %err, agents = state.agents.len(), "the database refused the state changes of a batch; they are not stored");
                }
                Err(err) => return Err(err),
            }
        }
        tx.commit().await?;
        self.shared
            .rejected_events
            .fetch_add(stand_ins.len() as u64, Ordering::Relaxed);
        self.shared
            .rejected_team_events
            .fetch_add(team_refused, Ordering::Relaxed);
        Ok(Outcome::Committed(rows))
    }

    /// Run one attempt; if it has not finished after `commit_wait`, the store counts as
    /// stalled (API writes stop waiting for it) while the attempt keeps going: abandoning
    /// a commit in flight would leave its outcome unknown.
    async fn watched<T>(
        &self,
        events: usize,
        attempt: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        tokio::pin!(attempt);
        tokio::select! {
            r = &mut attempt => r,
            _ = tokio::time::sleep(self.shared.commit_wait) => {
                tracing::warn!(events, "an event batch commit is stalled");
                self.shared.set_down(true);
                attempt.await
            }
        }
    }

    /// The last stored seq of each agent (0 for none), retried until the store answers.
    async fn last_seqs(&self, agents: &[AgentId]) -> Vec<(AgentId, i64)> {
        let ids: Vec<Uuid> = agents.iter().map(|a| a.uuid()).collect();
        let mut backoff = Backoff::new();
        loop {
            match store::events::last_seqs(&self.pool, &ids).await {
                Ok(found) => {
                    let found: HashMap<Uuid, i64> = found.into_iter().collect();
                    return agents
                        .iter()
                        .map(|a| (*a, found.get(&a.uuid()).copied().unwrap_or(0)))
                        .collect();
                }
                Err(err) => {
                    if !self.shared.is_down() {
                        tracing::warn!(error = %err, "cannot read the last seq of agents; retrying");
                        self.shared.set_down(true);
                    }
                    backoff.wait().await;
                }
            }
        }
    }
}

/// Each agent of a committed batch with its first and last seq in it.
fn seq_ranges(events: &[AgentEvent]) -> Vec<(Uuid, i64, i64)> {
    let mut ranges: HashMap<AgentId, (i64, i64)> = HashMap::new();
    for e in events {
        let r = ranges.entry(e.agent_id).or_insert((e.seq, e.seq));
        r.0 = r.0.min(e.seq);
        r.1 = r.1.max(e.seq);
    }
    ranges
        .into_iter()
        .map(|(id, (from, to))| (id.uuid(), from, to))
        .collect()
}

fn moment_row<'a>(events: &[AgentEvent], m: &'a NewMoment) -> store::events::MomentRow<'a> {
    let e = &events[m.event];
    store::events::MomentRow {
        agent_id: e.agent_id.uuid(),
        seq: e.seq,
        kind: m.kind,
        hook: m.hook,
        data: &m.data,
    }
}

/// The net effect of a batch's state changes, in their order: one update per agent (in id
/// order) and the permission requests that expire.
fn fold(changes: &[StateChange]) -> StateRows<'_> {
    fn row<'m, 'a>(
        agents: &'m mut BTreeMap<Uuid, AgentRowUpdate<'a>>,
        agent: &AgentId,
    ) -> &'m mut AgentRowUpdate<'a> {
        let id = agent.uuid();
        agents.entry(id).or_insert_with(|| AgentRowUpdate {
            agent_id: id,
            ..AgentRowUpdate::default()
        })
    }
    let mut agents: BTreeMap<Uuid, AgentRowUpdate<'_>> = BTreeMap::new();
    let mut expired_permissions = Vec::new();
    for c in changes {
        match c {
            StateChange::TurnStarted { agent, turn } => {
                let r = row(&mut agents, agent);
                r.started_turn = Some(turn.uuid());
                r.ended_turn = None;
            }
            StateChange::TurnEnded {
                agent,
                turn,
                outcome,
                error,
            } => {
                row(&mut agents, agent).ended_turn =
                    Some((turn.uuid(), outcome.as_str(), error.as_deref()));
            }
            StateChange::Status {
                agent,
                status,
                reason,
            } => row(&mut agents, agent).status = Some((status.as_str(), reason.as_deref())),
            StateChange::Mode { agent, mode } => row(&mut agents, agent).mode = Some(mode),
            StateChange::Model { agent, model } => row(&mut agents, agent).model = Some(model),
            StateChange::PermissionExpired(id) => expired_permissions.push(id.uuid()),
        }
    }
    StateRows {
        agents: agents.into_values().collect(),
        expired_permissions,
    }
}

async fn try_commit(
    pool: &PgPool,
    events: &[AgentEvent],
    team: &[NewTeamEvent],
    moments: &[NewMoment],
    state: &StateRows<'_>,
    fences: &[store::events::FenceRow],
) -> Result<Outcome, sqlx::Error> {
    // One statement, committed on its own: atomic and durable in one round trip, the
    // fences checked in it.
    if team.is_empty() && moments.is_empty() && state.is_empty() {
        if fences.is_empty() {
            store::events::insert_batch(pool, events).await?;
            return Ok(Outcome::Committed(Vec::new()));
        }
        let deposed = store::events::insert_batch_fenced(pool, events, fences).await?;
        return Ok(if deposed.is_empty() {
            Outcome::Committed(Vec::new())
        } else {
            Outcome::Deposed(deposed)
        });
    }
    let stored: Vec<_> = moments.iter().map(|m| moment_row(events, m)).collect();
    let team: Vec<_> = team
        .iter()
        .map(|t| store::events::NewTeamRow {
            team_id: t.team_id,
            project_id: t.project_id,
            workspace_id: t.workspace_id,
            kind: t.kind,
            data: &t.data,
        })
        .collect();
    Ok(
        match store::events::insert_batch_with(pool, events, &stored, &team, state, fences).await? {
            store::events::Stored::Team(rows) => Outcome::Committed(rows),
            store::events::Stored::Deposed(deposed) => Outcome::Deposed(deposed),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(events: usize, bytes: usize) -> Shared {
        Shared::new(&WriterLimits {
            max_queued_events: events,
            max_queued_bytes: bytes,
            ..WriterLimits::default()
        })
    }

    #[test]
    fn state_changes_fold_into_one_update_per_agent_in_order() {
        let (a, b) = (AgentId::new(), AgentId::new());
        let (t1, t2) = (TurnId::new(), TurnId::new());
        let ended = |agent, turn, outcome| StateChange::TurnEnded {
            agent,
            turn,
            outcome,
            error: None,
        };
        let status = |agent, status| StateChange::Status {
            agent,
            status,
            reason: None,
        };
        let changes = vec![
            StateChange::TurnStarted { agent: a, turn: t1 },
            status(a, AgentStatus::Running),
            ended(a, t1, TurnOutcome::Completed),
            status(a, AgentStatus::Idle),
            StateChange::PermissionExpired(PermissionId::new()),
            ended(b, t1, TurnOutcome::Failed),
            StateChange::TurnStarted { agent: b, turn: t2 },
        ];
        let folded = fold(&changes);
        assert_eq!(folded.expired_permissions.len(), 1);
        let mut ids = [a.uuid(), b.uuid()];
        ids.sort();
        assert_eq!(
            folded.agents.iter().map(|r| r.agent_id).collect::<Vec<_>>(),
            ids,
            "one update per agent, in id order"
        );
        let of = |id: AgentId| {
            folded
                .agents
                .iter()
                .find(|r| r.agent_id == id.uuid())
                .unwrap()
        };
        assert_eq!(of(a).started_turn, Some(t1.uuid()));
        assert_eq!(of(a).ended_turn, Some((t1.uuid(), "completed", None)));
        assert_eq!(of(a).status, Some(("idle", None)), "the last status wins");
        // A turn that starts after another one's end: the end no longer applies.
        assert_eq!(of(b).started_turn, Some(t2.uuid()));
        assert_eq!(of(b).ended_turn, None);
        assert_eq!(of(b).status, None);
    }

    fn op(agents: &[AgentId], class: Class) -> Pending {
        let events = agents
            .iter()
            .map(|a| NewEvent {
                agent_id: *a,
                turn_id: None,
                kind: EventKind::AssistantDelta,
                data: json!({"text": "x"}),
            })
            .collect();
        let team = match class {
            Class::Serial => vec![NewTeamEvent {
                team_id: Uuid::nil(),
                project_id: None,
                workspace_id: None,
                kind: "agent.status",
                data: json!({}),
            }],
            _ => Vec::new(),
        };
        Pending {
            events,
            team,
            moments: Vec::new(),
            changes: Vec::new(),
            done: (class == Class::Barrier).then(|| oneshot::channel().0),
            charge: Charge::default(),
            queued_at: None,
            forget: None,
            fence: None,
        }
    }

    fn flying(agents: &[AgentId], serial: bool) -> [Flight; 1] {
        [Flight {
            id: 0,
            agents: agents.iter().copied().collect(),
            serial,
        }]
    }

    #[test]
    fn with_nothing_in_flight_everything_starts_up_to_a_batch() {
        let (a, b) = (AgentId::new(), AgentId::new());
        let held: VecDeque<Pending> = [
            op(&[a], Class::Plain),
            op(&[b], Class::Serial),
            op(&[], Class::Barrier),
            op(&[a, b], Class::Serial),
            op(&[a], Class::Plain),
        ]
        .into();
        assert_eq!(
            startable(&held, &[], 100, true),
            [true, true, true, true, true]
        );
        assert_eq!(
            startable(&held, &[], 2, true),
            [true, true, false, false, false],
            "a batch closes once it holds max_batch events"
        );
        assert_eq!(op(&[a], Class::Serial).class(), Class::Serial);
        assert_eq!(op(&[], Class::Barrier).class(), Class::Barrier);
    }

    #[test]
    fn nothing_overtakes_its_agent_or_a_team_event_in_flight_or_waiting() {
        let (a, b, c, d) = (
            AgentId::new(),
            AgentId::new(),
            AgentId::new(),
            AgentId::new(),
        );
        let held: VecDeque<Pending> = [
            op(&[a], Class::Plain),  // a is in flight
            op(&[b], Class::Plain),  // free
            op(&[c], Class::Serial), // team events are in flight
            op(&[c], Class::Plain),  // c waits ahead
            op(&[d], Class::Plain),  // free
            op(&[a, d], Class::Plain),
            op(&[d], Class::Plain), // d waits ahead now
        ]
        .into();
        assert_eq!(
            startable(&held, &flying(&[a], true), 100, true),
            [false, true, false, false, true, false, false]
        );
        // Without team events in flight, the first serial operation may start, and a
        // second one may not pass a serial operation held back.
        let held: VecDeque<Pending> = [
            op(&[a], Class::Serial),
            op(&[b], Class::Serial),
            op(&[c], Class::Serial),
        ]
        .into();
        assert_eq!(
            startable(&held, &flying(&[d], false), 100, true),
            [true, true, true]
        );
        assert_eq!(
            startable(&held, &flying(&[a], false), 100, true),
            [false, false, false],
            "team events keep their order"
        );
    }

    #[test]
    fn team_events_still_gathering_hold_back_only_their_agents() {
        let (a, b, c) = (AgentId::new(), AgentId::new(), AgentId::new());
        let held: VecDeque<Pending> = [
            op(&[a], Class::Serial), // gathering
            op(&[b], Class::Plain),  // free
            op(&[a], Class::Plain),  // a waits ahead
            op(&[c], Class::Serial), // team events keep their order
            op(&[], Class::Barrier),
        ]
        .into();
        assert_eq!(
            startable(&held, &[], 100, false),
            [false, true, false, false, false]
        );
        assert_eq!(
            startable(&held, &[], 100, true),
            [true, true, true, true, true],
            "once gathered, they go"
        );
    }

    #[test]
    fn a_flush_waits_for_everything_ahead_of_it() {
        let (a, b) = (AgentId::new(), AgentId::new());
        let held: VecDeque<Pending> = [
            op(&[b], Class::Plain),
            op(&[], Class::Barrier),
            op(&[b], Class::Plain),
        ]
        .into();
        assert_eq!(
            startable(&held, &flying(&[a], false), 100, true),
            [true, false, false],
            "not while a batch is in flight, nor anything after it"
        );
    }

    #[tokio::test]
    async fn an_event_larger_than_the_budget_takes_the_whole_budget() {
        let s = shared(10, 1000);
        let big = s.charge(1, 5000);
        assert_eq!(big.byte_permits, 1000);
        s.reserve(&big).await;
        // Nothing else fits until it is released.
        assert!(!s.try_reserve(&s.charge(1, 1)));
        s.release(&big);
        assert!(s.try_reserve(&s.charge(1, 1)));
    }

    #[tokio::test]
    async fn producers_wait_for_budget_until_it_is_released() {
        let s = Arc::new(shared(4, 1 << 20));
        let first = s.charge(4, 100);
        s.reserve(&first).await;
        s.admitted(&first);
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move {
                let c = s.charge(1, 10);
                s.reserve(&c).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "the budget is spent; the producer waits"
        );
        s.release(&first);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("released budget wakes the producer")
            .unwrap();
        assert_eq!(s.high_water_events.load(Ordering::Relaxed), 4);
        assert_eq!(s.queued_events.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_cancelled_wait_gives_back_what_it_took() {
        let s = shared(10, 100);
        let held = s.charge(1, 100);
        s.reserve(&held).await;
        // Gets its event permits, then waits for bytes; cancelled by the timeout.
        let c = s.charge(5, 50);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), s.reserve(&c))
                .await
                .is_err()
        );
        assert_eq!(s.event_budget.available_permits(), 9);
    }
}
