//! The boot reconciler: ends leftover processes of an earlier run (only those the ledger
//! positively identifies) and closes what that run left open, so no agent stays
//! `running` after its process is gone. It only appends events; it never rewrites any.

use serde_json::json;
use sqlx::PgPool;

use crate::domain::{AgentId, EventKind, NewEvent, TurnId};
use crate::events::{EventWriter, NewTeamEvent};
use crate::process::Ledger;
use crate::store;

use super::ServerLock;

#[derive(Debug, Default)]
pub struct BootReport {
    pub processes_killed: usize,
    pub agents_closed: usize,
    pub turns_failed: usize,
}

/// `_lock` is the proof that no other server uses the database: what this closes is
/// then truly left over, not a live server's agents.
pub async fn reconcile_at_boot(
    pool: &PgPool,
    writer: &EventWriter,
    ledger: &Ledger,
    _lock: &ServerLock,
) -> anyhow::Result<BootReport> {
    let mut report = BootReport::default();
    // Requests that died with the previous server can be retried with their keys at once.
    let claims = store::idempotency::release_unfinished(pool).await?;
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
    for agent in store::agents::open_agents(pool).await? {
        let id = AgentId::from(agent.id);
        let mut events = Vec::new();
        if let (Some(turn), None) = (agent.last_turn_id, &agent.last_turn_outcome) {
            let turn_id = TurnId::from(turn);
            let error = "the server stopped during this turn";
            events.push(NewEvent {
                agent_id: id,
                turn_id: Some(turn_id),
                kind: EventKind::TurnCompleted,
                data: json!({"turn_id": turn_id, "outcome": "failed", "error": error}),
            });
            store::agents::turn_finished(pool, agent.id, turn, "failed", Some(error)).await?;
            report.turns_failed += 1;
        }
        store::permissions::expire_pending(pool, agent.id).await?;
        let mut team = Vec::new();
        if agent.status != "closed" {
            let reason = "the server restarted";
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
            report.agents_closed += 1;
        }
        writer.append_committed(events, team).await?;
        writer.forget(id).await;
    }
    Ok(report)
}
