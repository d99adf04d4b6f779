//! The boot reconciler: ends leftover processes of an earlier run (only those the ledger
//! positively identifies) and closes what that run left open, so no agent stays
//! `running` after its process is gone. It only appends events; it never rewrites any.

use serde_json::json;
use sqlx::PgPool;

use crate::domain::{
    AgentId, AgentStatus, Behavior, EventKind, NewEvent, PermissionId, TurnId, TurnOutcome,
};
use crate::events::{
    Attached, EventWriter, Fence, NewMoment, NewTeamEvent, StateChange, WriteError,
};
use crate::process::Ledger;
use crate::store;

use super::{Moment, ReplicaLock, RuntimeError};

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
    let cgroups = ledger.sweep_cgroups().await?;
    if cgroups > 0 {
        tracing::info!(cgroups, "removed cgroups that no process held");
    }
    let swept = ledger.sweep_tmp().await?;
    if swept > 0 {
        tracing::info!(
            directories = swept,
            "removed temporary directories that no process held"
        );
    }
    for agent in store::agents::open_agents(pool, lock.replica()).await? {
        let done = match abandon_agent(
            pool,
            writer,
            &agent,
            "the server stopped during this turn",
            "the server restarted",
        )
        .await
        {
            Ok(done) => done,
            // Another replica claimed it since it was read: it is that replica's to run.
            Err(RuntimeError::Events(WriteError::Fenced)) => {
                tracing::info!(agent_id = %agent.id, "another replica took this agent while the server started; left to it");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        report.turns_failed += usize::from(done.turn_failed);
        report.agents_closed += usize::from(done.closed);
        store::replicas::release(pool, agent.id, lock.replica()).await?;
    }
    Ok(report)
}

/// What `abandon_agent` did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Abandoned {
    pub turn_failed: bool,
    pub closed: bool,
}

/// End, from outside its actor, an agent no live actor holds (its server is gone): its
/// unfinished turn fails with `error`, its pending permission requests expire, and it is
/// closed with `reason`. Each step is written as the actor would write it — the timeline
/// event with the moment hooks hear of (`agent.permission.after`, `agent.turn.after`
/// with outcome `failed`, `agent.close.after`) — and committed in one statement with what
/// the agent's row and its requests then say, so a crash can only repeat the whole step,
/// never keep half of it. An agent already closed with no open turn is left as it is.
///
/// All of it is written under the fence of `agent.lease_epoch` (the epoch of the ownership
/// that closes it: the takeover's, or the one read at boot): should yet another replica
/// have taken the agent since, nothing is written (`WriteError::Fenced`, counted in
/// `agentry_fenced_batches_total`) and the timeline stays that replica's.
pub async fn abandon_agent(
    pool: &PgPool,
    writer: &EventWriter,
    agent: &store::agents::OpenAgent,
    error: &str,
    reason: &str,
) -> Result<Abandoned, RuntimeError> {
    let id = AgentId::from(agent.id);
    let mut done = Abandoned::default();
    let mut events = Vec::new();
    let mut moments: Vec<NewMoment> = Vec::new();
    // Nothing runs for this agent: what is pending now is what the commit below expires.
    let expired = store::permissions::pending_ids(pool, agent.id).await?;
    let open_turn = match (agent.last_turn_id, &agent.last_turn_outcome) {
        (Some(turn), None) => Some(turn),
        _ => None,
    };
    if let Some(turn) = open_turn {
        let turn_id = TurnId::from(turn);
        events.push(NewEvent {
            agent_id: id,
            turn_id: Some(turn_id),
            kind: EventKind::TurnCompleted,
            data: json!({"turn_id": turn_id, "outcome": "failed", "error": error}),
        });
        done.turn_failed = true;
    }
    let mut team = Vec::new();
    if agent.status != "closed" {
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
        done.closed = true;
    }
    // The expired requests go with the first event, then the turn's end, then the close.
    if !events.is_empty() {
        moments.extend(expired.iter().map(|r| {
            Moment::PermissionResolved {
                request_id: PermissionId::from(*r),
                resolution: json!({"behavior": Behavior::Deny, "expired": true}),
            }
            .at(0)
        }));
    }
    if let Some(turn) = open_turn {
        moments.push(
            Moment::TurnEnded {
                turn_id: TurnId::from(turn),
                outcome: TurnOutcome::Failed,
                error: Some(error.to_owned()),
            }
            .at(0),
        );
    }
    if done.closed {
        moments.push(Moment::Closed {}.at(events.len() - 1));
    }
    let mut changes: Vec<StateChange> = expired
        .iter()
        .map(|r| StateChange::PermissionExpired(PermissionId::from(*r)))
        .collect();
    if let Some(turn) = open_turn {
        changes.push(StateChange::TurnEnded {
            agent: id,
            turn: TurnId::from(turn),
            outcome: TurnOutcome::Failed,
            error: Some(error.to_owned()),
        });
    }
    if done.closed {
        changes.push(StateChange::Status {
            agent: id,
            status: AgentStatus::Closed,
            reason: Some(reason.to_owned()),
        });
    }
    if !events.is_empty() || !changes.is_empty() {
        // Numbered from the table: another replica may have written this timeline last.
        writer.forget(id).await;
        let attached = Attached {
            team,
            moments,
            changes,
            fence: Some(Fence::new(id, agent.lease_epoch)),
        };
        writer.append_committed_with(events, attached).await?;
    }
    writer.forget(id).await;
    Ok(done)
}
