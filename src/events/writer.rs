//! The single writer of timelines. It assigns each agent's next `seq`, commits events in
//! batches (flush at `batch_max_events` or after `batch_linger_ms`, whichever comes first;
//! one transaction and one fsync per batch), then publishes them. Producers are never
//! blocked by readers; they only wait for channel capacity, which is the backpressure
//! when the database cannot keep up.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::bus::{Bus, Published, TeamActivity};
use crate::domain::{AgentEvent, AgentId, NewEvent};
use crate::store;

#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    #[error("the event store is unavailable: {0}")]
    Store(String),
    #[error("the event writer has stopped")]
    Stopped,
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

type Done = oneshot::Sender<Result<Vec<AgentEvent>, WriteError>>;

enum WriteOp {
    Append {
        events: Vec<NewEvent>,
        team: Vec<NewTeamEvent>,
        done: Option<Done>,
    },
    /// The agent's actor stopped: drop its cached seq (memory stays flat).
    Forget(AgentId),
}

#[derive(Clone)]
pub struct EventWriter {
    tx: mpsc::Sender<WriteOp>,
}

impl EventWriter {
    /// Start the writer task on the current runtime.
    pub fn spawn(pool: PgPool, bus: Arc<Bus>, max_batch: usize, linger: Duration) -> Self {
        let (tx, rx) = mpsc::channel(max_batch.max(1024) * 4);
        tokio::spawn(run(pool, bus, rx, max_batch, linger));
        Self { tx }
    }

    /// Queue one event; it becomes visible once committed. Waits only for queue space.
    pub async fn append(&self, event: NewEvent) -> Result<(), WriteError> {
        self.tx
            .send(WriteOp::Append {
                events: vec![event],
                team: Vec::new(),
                done: None,
            })
            .await
            .map_err(|_| WriteError::Stopped)
    }

    /// Queue several events of one producer, in order, as one operation.
    pub async fn append_many(&self, events: Vec<NewEvent>) -> Result<(), WriteError> {
        self.tx
            .send(WriteOp::Append {
                events,
                team: Vec::new(),
                done: None,
            })
            .await
            .map_err(|_| WriteError::Stopped)
    }

    /// Append events (and team activity) and wait until they are committed.
    pub async fn append_committed(
        &self,
        events: Vec<NewEvent>,
        team: Vec<NewTeamEvent>,
    ) -> Result<Vec<AgentEvent>, WriteError> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(WriteOp::Append {
                events,
                team,
                done: Some(done),
            })
            .await
            .map_err(|_| WriteError::Stopped)?;
        rx.await.map_err(|_| WriteError::Stopped)?
    }

    /// Wait until everything queued before this call is committed.
    pub async fn flush(&self) -> Result<(), WriteError> {
        self.append_committed(Vec::new(), Vec::new())
            .await
            .map(|_| ())
    }

    pub async fn forget(&self, agent: AgentId) {
        let _ = self.tx.send(WriteOp::Forget(agent)).await;
    }
}

/// Add an operation to the batch; returns how many events it brought.
fn push(op: WriteOp, batch: &mut Vec<Pending>) -> usize {
    match op {
        WriteOp::Append { events, team, done } => {
            let n = events.len() + team.len();
            batch.push(Pending {
                events,
                team,
                done,
                forget: None,
            });
            n
        }
        // Applied in order with the batch, after the events queued before it got their seq.
        WriteOp::Forget(id) => {
            batch.push(Pending {
                events: Vec::new(),
                team: Vec::new(),
                done: None,
                forget: Some(id),
            });
            0
        }
    }
}

struct Pending {
    events: Vec<NewEvent>,
    team: Vec<NewTeamEvent>,
    done: Option<Done>,
    forget: Option<AgentId>,
}

async fn run(
    pool: PgPool,
    bus: Arc<Bus>,
    mut rx: mpsc::Receiver<WriteOp>,
    max_batch: usize,
    linger: Duration,
) {
    let mut next_seq: HashMap<AgentId, i64> = HashMap::new();
    let mut batch: Vec<Pending> = Vec::new();
    loop {
        let Some(first) = rx.recv().await else { break };
        let mut count = push(first, &mut batch);
        let deadline = tokio::time::Instant::now() + linger;
        while count < max_batch {
            match rx.try_recv() {
                Ok(op) => count += push(op, &mut batch),
                Err(mpsc::error::TryRecvError::Empty) if !linger.is_zero() => {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(op)) => count += push(op, &mut batch),
                        _ => break,
                    }
                }
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            commit(&pool, &bus, &mut next_seq, std::mem::take(&mut batch)).await;
        }
    }
}

async fn commit(
    pool: &PgPool,
    bus: &Bus,
    next_seq: &mut HashMap<AgentId, i64>,
    mut batch: Vec<Pending>,
) {
    // Assign sequence numbers, moving each event's data (no copies on the hot path).
    let total: usize = batch.iter().map(|p| p.events.len()).sum();
    let mut events: Vec<AgentEvent> = Vec::with_capacity(total);
    let mut spans: Vec<(usize, usize)> = Vec::with_capacity(batch.len());
    let now = Utc::now();
    for i in 0..batch.len() {
        let start = events.len();
        for e in std::mem::take(&mut batch[i].events) {
            let seq = match next_seq.get(&e.agent_id) {
                Some(s) => *s,
                None => match store::events::last_seq(pool, e.agent_id.uuid()).await {
                    Ok(last) => last + 1,
                    Err(err) => {
                        fail(batch, &events, next_seq, WriteError::Store(err.to_string()));
                        return;
                    }
                },
            };
            next_seq.insert(e.agent_id, seq + 1);
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
        if let Some(id) = batch[i].forget {
            next_seq.remove(&id);
        }
    }
    let team: Vec<&NewTeamEvent> = batch.iter().flat_map(|p| p.team.iter()).collect();

    let mut attempt = 0;
    let team_rows = loop {
        match try_commit(pool, &events, &team).await {
            Ok(rows) => break rows,
            Err(err) if attempt < 3 => {
                attempt += 1;
                tracing::warn!(error = %err, attempt, "event batch commit failed; retrying");
                tokio::time::sleep(Duration::from_millis(100 * 4u64.pow(attempt))).await;
            }
            Err(err) => {
                tracing::error!(error = %err, events = events.len(), "event batch could not be committed");
                fail(batch, &events, next_seq, WriteError::Store(err.to_string()));
                return;
            }
        }
    };

    // Committed: now, and only now, visible.
    for (p, (start, end)) in batch.into_iter().zip(spans) {
        if let Some(done) = p.done {
            let _ = done.send(Ok(events[start..end].to_vec()));
        }
    }
    bus.publish(events.into_iter().map(|e| Arc::new(Published::new(e))));
    for row in team_rows {
        bus.publish_team(Arc::new(TeamActivity {
            id: row.id,
            team_id: row.team_id,
            project_id: row.project_id,
            workspace_id: row.workspace_id,
            kind: row.kind,
            at: row.at,
            data: row.data,
        }));
    }
}

async fn try_commit(
    pool: &PgPool,
    events: &[AgentEvent],
    team: &[&NewTeamEvent],
) -> Result<Vec<store::events::TeamEventRow>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if !events.is_empty() {
        store::events::insert_batch(&mut tx, events).await?;
    }
    let mut rows = Vec::with_capacity(team.len());
    for t in team {
        rows.push(
            store::events::insert_team_event(
                &mut tx,
                t.team_id,
                t.project_id,
                t.workspace_id,
                t.kind,
                &t.data,
            )
            .await?,
        );
    }
    tx.commit().await?;
    Ok(rows)
}

fn fail(
    batch: Vec<Pending>,
    assigned: &[AgentEvent],
    next_seq: &mut HashMap<AgentId, i64>,
    err: WriteError,
) {
    // Nothing of this batch was stored: read the next seq from the database next time.
    for e in assigned {
        next_seq.remove(&e.agent_id);
    }
    for p in batch {
        for e in &p.events {
            next_seq.remove(&e.agent_id);
        }
        if let Some(done) = p.done {
            let _ = done.send(Err(err.clone()));
        }
    }
}
