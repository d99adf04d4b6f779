//! The boot reconciler: ends leftover processes of an earlier run (only those the ledger
//! positively identifies) and closes what that run left open, so no agent stays
//! `running` after its process is gone. It only appends events; it never rewrites any.

use serde_json::json;
use sqlx::PgPool;

use crate::domain::{AgentId, EventKind, NewEvent, TurnId};
use crate::events::{EventWriter, NewTeamEvent};
use crate::process::Ledger;
use crate::store;

use super::ReplicaLock;

#[derive(Debug, Default)]
pub struct BootReport {
    pub processes_killed: usize,
    pub agents_closed: usize,
    pub turns_failed: usize,
}

/// `lock` is the proof that no other process runs as this replica: what this closes (the
/// agents this replica held, and those nobody holds) is then truly left over, not a live
/// server's agents.
pub async fn reconcile_at_boot(
    pool: &PgPool,
    writer: &EventWriter,
    ledger: &Ledger,
    lock: &ReplicaLock,
) -> anyhow::Result<BootReport> {
    let mut report = BootReport::default();
    // Requests that died with the previous server can be retried with their keys at once
    // (unless other replicas run: their requests in flight hold claims too, which expire
    // on their own).
    let claims = if store::replicas::others_registered(pool, lock.replica()).await? {
        0
    } else {
        store::idempotency::release_unfinished(pool).await?
    };
    if claims > 0 {
        tracing::info!(
            claims,
            "released idempotency keys of requests the previous run left unfinished"
        );
    }
    let procs = ledger.reconcile().await?;
    report.processes_killed = procs.killed.len();
    if !procs.killed.is_empty() {
        tracing::warn!(pids = ?procs.killed, "ended leftover agent processes of an earlier run");
    }
    for agent in store::agents::open_agents(pool, lock.replica()).await? {
        let (turn_failed, closed) = close_left_open(
            pool,
            writer,
            &agent,
            "the server stopped during this turn",
            "the server restarted",
        )
        .await?;
        report.turns_failed += usize::from(turn_failed);
        report.agents_closed += usize::from(closed);
        store::replicas::release(pool, agent.id, lock.replica()).await?;
    }
    Ok(report)
}

/// Close what a stopped run left open of one agent: its unfinished turn ends `failed` with
/// `turn_error`, its pending permission requests expire, and it is `closed` for `reason`.
/// Returns whether a turn was failed and whether the agent was closed.
pub(crate) async fn close_left_open(
    pool: &PgPool,
    writer: &EventWriter,
    agent: &store::agents::OpenAgent,
    turn_error: &str,
    reason: &str,
) -> anyhow::Result<(bool, bool)> {
    let id = AgentId::from(agent.id);
    let mut events = Vec::new();
    let mut turn_failed = false;
    if let (Some(turn), None) = (agent.last_turn_id, &agent.last_turn_outcome) {
        let turn_id = TurnId::from(turn);
        events.push(NewEvent {
            agent_id: id,
            turn_id: Some(turn_id),
            kind: EventKind::TurnCompleted,
            data: json!({"turn_id": turn_id, "outcome": "failed", "error": turn_error}),
        });
        store::agents::turn_finished(pool, agent.id, turn, "failed", Some(turn_error)).await?;
        turn_failed = true;
    }
    store::permissions::expire_pending(pool, agent.id).await?;
    let mut team = Vec::new();
    let closed = agent.status != "closed";
    if closed {
        store::agents::set_status(pool, agent.id, "closed", Some(reason)).await?;
        events.push(NewEvent {
            agent_id: id,
            turn_id: None,
            kind: EventKind::Status,
            data: json!({"status": "closed", "reason": reason}),
        });
        team.push(NewTeamEvent {
            team_id: agent.team_id,
            project_id: None,
            workspace_id: Some(agent.workspace_id),
            kind: "agent_status",
            data: json!({"agent_id": id, "status": "closed"}),
        });
    }
    // Numbered from the table: another replica may have written this timeline last.
    writer.forget(id).await;
    writer.append_committed(events, team).await?;
    writer.forget(id).await;
    Ok((turn_failed, closed))
}
