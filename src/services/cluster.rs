//! Several replicas on one database. Each replica registers itself and, every third of
//! the lease time, says it is alive, renews the leases of the agents it runs and looks
//! for replicas that stopped answering: their agents are taken over (the interrupted turn
//! ends `failed` with `owner_lost`; the next prompt resumes the agent), their processes on
//! this host ended and their unfinished setups failed. Commands for an agent another
//! replica runs are handed to it (`route`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Data, Fleet, ServiceContext, ServiceError, ServiceResult};
use crate::auth::{AuthError, Operation, Principal};
use crate::domain::{AgentId, WorkspaceId};
use crate::events::Fanout;
use crate::store;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReplicaView {
    /// The replica's id (`cluster.replica_id`).
    pub id: String,
    /// How the other replicas reach it.
    pub advertise_url: String,
    pub started_at: DateTime<Utc>,
    /// When it last said it is alive; a replica silent for `cluster.lease_ttl_s` is taken
    /// for dead.
    pub last_seen_at: DateTime<Utc>,
    /// Agents it runs now.
    pub agents: i64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReplicaList {
    pub items: Vec<ReplicaView>,
}

/// `GET /v1/cluster`: the replicas of this deployment (server admins).
#[tracing::instrument(name = "services::cluster::list", skip_all)]
pub async fn list(data: &Data, principal: &Principal) -> ServiceResult<ReplicaList> {
    // A read: a server admin's `read` token may see the cluster.
    principal.authorize(Operation::ReadSelf)?;
    if !principal.is_server_admin() {
        return Err(AuthError::Forbidden("this needs a server admin").into());
    }
    let rows = store::replicas::list(&data.pool).await?;
    Ok(ReplicaList {
        items: rows
            .into_iter()
            .map(|r| ReplicaView {
                id: r.id,
                advertise_url: r.advertise_url,
                started_at: r.started_at,
                last_seen_at: r.last_seen_at,
                agents: r.agents,
            })
            .collect(),
    })
}

/// Where to send a command for agent `id`: the URL of the replica that runs it, when that
/// is not this one. (No authorization here: the owner authorizes the command itself.)
#[tracing::instrument(name = "services::cluster::route", skip_all, fields(replica_id = %id))]
pub async fn route(data: &Data, fleet: &Fleet, id: AgentId) -> ServiceResult<Option<String>> {
    let owner =
        store::replicas::remote_owner(&data.pool, id.uuid(), fleet.agents.replica()).await?;
    Ok(owner.map(|(_, url)| url))
}

/// The label that pins a new agent to a replica: `{"agentry.replica": "<replica id>"}`.
pub const PIN_LABEL: &str = "agentry.replica";

/// Where a new agent with `labels` should run: `None` for here, else the URL of the
/// replica it is pinned to (by `PIN_LABEL`) or of the replica running the fewest agents,
/// when that runs fewer than this one. A pin to a replica that is not alive is refused.
#[tracing::instrument(name = "services::cluster::place", skip_all)]
pub async fn place(
    data: &Data,
    fleet: &Fleet,
    labels: Option<&serde_json::Value>,
) -> ServiceResult<Option<String>> {
    let me = fleet.agents.replica();
    let loads = store::replicas::loads(&data.pool, fleet.agents.lease_ttl_s()).await?;
    if let Some(pin) = labels.and_then(|l| l.get(PIN_LABEL)) {
        let Some(pin) = pin.as_str() else {
            return Ok(None); // the create refuses non-string label values itself
        };
        if pin == me {
            return Ok(None);
        }
        return match loads.into_iter().find(|(id, _, _)| id == pin) {
            Some((_, url, _)) => Ok(Some(url)),
            None => Err(ServiceError::Invalid {
                field: "labels",
                message: format!(
                    "`{PIN_LABEL}` names `{pin}`, which is not a live replica (GET /v1/cluster lists them)"
                ),
            }),
        };
    }
    let mine = loads.iter().find(|(id, _, _)| id == me).map_or(0, |l| l.2);
    Ok(loads
        .into_iter()
        .next()
        .filter(|(id, _, agents)| id != me && *agents < mine)
        .map(|(_, url, _)| url))
}

/// The agents of workspace `ws` that other replicas run, with where to reach each (an
/// archive closes them there first).
#[tracing::instrument(name = "services::cluster::remote_agents_in_workspace", skip_all, fields(workspace_id = %ws))]
pub async fn remote_agents_in_workspace(
    data: &Data,
    fleet: &Fleet,
    ws: WorkspaceId,
) -> ServiceResult<Vec<(AgentId, String)>> {
    let rows =
        store::replicas::remote_agents_in_workspace(&data.pool, ws.uuid(), fleet.agents.replica())
            .await?;
    Ok(rows.into_iter().map(|(id, url)| (id.into(), url)).collect())
}

/// Tell the other replicas this one is here (it registered at boot), before serving.
#[tracing::instrument(name = "services::cluster::join", skip_all)]
pub async fn join(data: &Data, fleet: &Fleet, fanout: &Fanout) -> ServiceResult<()> {
    let me = fleet.agents.replica();
    fanout.join();
    fanout
        .set_peers(store::replicas::peers_alive(&data.pool, me, fleet.agents.lease_ttl_s()).await?);
    Ok(())
}

/// Leave: forget this replica (its leases were given up when its agents closed).
#[tracing::instrument(name = "services::cluster::leave", skip_all)]
pub async fn leave(data: &Data, fleet: &Fleet) {
    if let Err(e) = store::replicas::unregister(&data.pool, fleet.agents.replica()).await {
        tracing::warn!(error = %e, "could not unregister this replica");
    }
}

/// Say this replica is alive, renew its leases and take over from silent replicas, every
/// third of the lease time, until the task is ended (after the agents are drained at
/// shutdown: leases of turns still running must stay renewed until then).
pub async fn run(ctx: ServiceContext, fanout: std::sync::Arc<Fanout>, advertise_url: String) {
    let period = Duration::from_millis((ctx.fleet.agents.lease_ttl_s() as u64 * 1000 / 3).max(500));
    let ttl = Duration::from_secs(ctx.fleet.agents.lease_ttl_s() as u64);
    let mut last_ok = tokio::time::Instant::now();
    let mut resync_until = None;
    loop {
        match tick(&ctx, &fanout, &advertise_url).await {
            Ok(()) => {
                // Silent past its lease (paused, cut off from the database): the others took
                // this replica for dead and stopped sending it notices, until their next
                // heartbeat sees it again. Its open streams read what they missed from the
                // database, now and at each heartbeat for one more lease time.
                let now = tokio::time::Instant::now();
                if now.duration_since(last_ok) > ttl {
                    tracing::warn!(
                        silent_s = now.duration_since(last_ok).as_secs_f64(),
                        "this replica was silent past its lease; resyncing its streams"
                    );
                    resync_until = Some(now + ttl);
                }
                if resync_until.is_some_and(|until| now <= until) {
                    crate::events::resync_streams(ctx.data.pool.pool(), &ctx.data.bus).await;
                } else {
                    resync_until = None;
                }
                last_ok = now;
            }
            Err(e) => tracing::warn!(error = %e, "the cluster heartbeat failed; retrying"),
        }
        tokio::time::sleep(period).await;
    }
}

async fn tick(ctx: &ServiceContext, fanout: &Fanout, advertise_url: &str) -> ServiceResult<()> {
    let me = ctx.fleet.agents.replica();
    let ttl = ctx.fleet.agents.lease_ttl_s();
    store::replicas::heartbeat(&ctx.data.pool, me, advertise_url, ttl).await?;
    let renewal = store::replicas::renewal(&ctx.data.pool, me, ttl).await?;
    ctx.fleet.agents.renew_leases(renewal).await?;
    fanout.set_peers(store::replicas::peers_alive(&ctx.data.pool, me, ttl).await?);
    take_over_expired(&ctx.data, &ctx.fleet).await?;
    for silent in store::replicas::silent(&ctx.data.pool, me, ttl).await? {
        let procs = ctx.fleet.agents.ledger().reconcile_replica(&silent).await?;
        if !procs.killed.is_empty() {
            tracing::warn!(replica = silent, pids = ?procs.killed, "ended the processes of a replica that stopped answering");
        }
        if let Err(e) = super::setup::fail_interrupted(ctx, &silent).await {
            tracing::warn!(replica = silent, error = %e, "could not fail the setups of a replica that stopped answering");
        }
        if store::replicas::forget_if_idle(&ctx.data.pool, &silent).await? {
            tracing::info!(replica = silent, "forgot a replica that stopped answering");
        }
    }
    Ok(())
}

/// Take over every agent whose lease ran out unrenewed.
async fn take_over_expired(data: &Data, fleet: &Fleet) -> ServiceResult<()> {
    for (agent, owner) in store::replicas::expired(&data.pool, fleet.agents.replica()).await? {
        fleet.agents.take_over(agent.into(), &owner).await?;
    }
    Ok(())
}
