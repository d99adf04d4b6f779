//! Fan-out between replicas. A replica that commits events tells the others through
//! `NOTIFY agentry_events` — the payload names agents with seq ranges and team event ids,
//! never the events — and each other replica reads what its own subscribers need from
//! Postgres and publishes it on its `Bus`. SSE rules stay the bus's: an agent stream that
//! sees a gap reads it from the database, so a lost notice delays an event, never loses
//! it. After the listening connection is lost, every stream is nudged to resync.
//!
//! Notices are only sent while another replica is alive (a single server pays nothing),
//! and a starting replica says so at once (`{"join": …}`), before it serves a stream.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::bus::{Bus, Published, TeamActivity};
use crate::domain::AgentId;
use crate::store;

pub const CHANNEL: &str = "agentry_events";

/// `NOTIFY` payloads must stay under 8000 bytes.
const MAX_PAYLOAD: usize = 7000;

/// What one replica committed: agents with their first and last new seq, team event ids.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
pub struct Notice {
    /// The replica that committed them.
    pub r: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub a: Vec<(Uuid, i64, i64)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub t: Vec<i64>,
    /// A replica starting: the others start sending notices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<String>,
}

/// The sending side, attached to the bus by the server.
pub struct Fanout {
    replica: String,
    /// Whether another replica is alive (notices are sent only then).
    peers: AtomicBool,
    tx: mpsc::UnboundedSender<Notice>,
}

impl Fanout {
    /// Start the sender of `replica`'s notices on `pool`.
    pub fn start(pool: PgPool, replica: String) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_notices(pool, rx));
        Arc::new(Self {
            replica,
            peers: AtomicBool::new(false),
            tx,
        })
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    pub fn set_peers(&self, alive: bool) {
        self.peers.store(alive, Ordering::Relaxed);
    }

    pub fn has_peers(&self) -> bool {
        self.peers.load(Ordering::Relaxed)
    }

    /// Tell the other replicas about committed agent events and team events.
    pub fn committed(&self, agents: Vec<(Uuid, i64, i64)>, team: Vec<i64>) {
        if !self.has_peers() || (agents.is_empty() && team.is_empty()) {
            return;
        }
        let _ = self.tx.send(Notice {
            r: self.replica.clone(),
            a: agents,
            t: team,
            join: None,
        });
    }

    /// Say this replica is starting, so the others send notices from now on.
    pub fn join(&self) {
        let _ = self.tx.send(Notice {
            r: self.replica.clone(),
            join: Some(self.replica.clone()),
            ..Default::default()
        });
    }
}

/// Send queued notices in order, folding what queued up meanwhile into few payloads.
async fn send_notices(pool: PgPool, mut rx: mpsc::UnboundedReceiver<Notice>) {
    while let Some(first) = rx.recv().await {
        let mut pending = vec![first];
        while let Ok(more) = rx.try_recv() {
            pending.push(more);
        }
        for payload in fold(pending) {
            // A lost notice only delays: receivers heal gaps at the next one.
            if let Err(e) = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(CHANNEL)
                .bind(&payload)
                .execute(&pool)
                .await
            {
                tracing::debug!(error = %e, "could not notify the other replicas");
            }
        }
    }
}

/// Merge notices (per agent: the widest range) into payloads under `MAX_PAYLOAD` bytes.
fn fold(pending: Vec<Notice>) -> Vec<String> {
    let Some(r) = pending.first().map(|n| n.r.clone()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut agents: BTreeMap<Uuid, (i64, i64)> = BTreeMap::new();
    let mut team = Vec::new();
    for n in pending {
        if n.join.is_some() {
            out.push(serde_json::to_string(&n).unwrap_or_default());
        }
        for (id, from, to) in n.a {
            let e = agents.entry(id).or_insert((from, to));
            e.0 = e.0.min(from);
            e.1 = e.1.max(to);
        }
        team.extend(n.t);
    }
    // ~60 bytes an agent, ~12 a team id.
    let mut current = Notice {
        r: r.clone(),
        ..Default::default()
    };
    let mut size = 0;
    let flush = |current: &mut Notice, out: &mut Vec<String>, size: &mut usize| {
        if !current.a.is_empty() || !current.t.is_empty() {
            out.push(serde_json::to_string(current).unwrap_or_default());
        }
        current.a.clear();
        current.t.clear();
        *size = 0;
    };
    for (id, (from, to)) in agents {
        if size + 64 > MAX_PAYLOAD {
            flush(&mut current, &mut out, &mut size);
        }
        current.a.push((id, from, to));
        size += 64;
    }
    for id in team {
        if size + 24 > MAX_PAYLOAD {
            flush(&mut current, &mut out, &mut size);
        }
        current.t.push(id);
        size += 24;
    }
    flush(&mut current, &mut out, &mut size);
    out
}

/// Hear the other replicas' notices until the process ends; publish what they committed
/// on `bus` for this replica's subscribers.
pub async fn listen(pool: PgPool, bus: Arc<Bus>, fanout: Arc<Fanout>) {
    let mut max_team_id = store::events::last_team_event_id(&pool).await.unwrap_or(0);
    loop {
        let mut listener = store::listener(&pool, CHANNEL, "the other replicas' events").await;
        // Anything committed while nobody listened is read from the database now.
        resync(&pool, &bus, &mut max_team_id).await;
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    let Ok(notice) = serde_json::from_str::<Notice>(n.payload()) else {
                        tracing::debug!(
                            payload = n.payload(),
                            "ignoring a malformed replica notice"
                        );
                        continue;
                    };
                    if notice.r == fanout.replica() {
                        continue;
                    }
                    if notice.join.is_some() {
                        fanout.set_peers(true);
                        continue;
                    }
                    fanout.set_peers(true);
                    deliver(&pool, &bus, notice, &mut max_team_id).await;
                }
                Ok(None) => {
                    tracing::warn!(
                        "the connection listening for other replicas was lost; resyncing streams"
                    );
                    resync(&pool, &bus, &mut max_team_id).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "listening for other replicas failed; reconnecting");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    break;
                }
            }
        }
    }
}

/// Publish what a notice names, for the agents someone here streams.
async fn deliver(pool: &PgPool, bus: &Bus, notice: Notice, max_team_id: &mut i64) {
    for (agent, from, to) in notice.a {
        let id = AgentId::from(agent);
        if !bus.has_subscribers(id) || to < from {
            continue;
        }
        match store::events::page_after(pool, agent, from - 1, to - from + 1).await {
            Ok(rows) => bus.publish(
                rows.into_iter()
                    .map(|r| Arc::new(Published::new(r.into_event()))),
            ),
            Err(e) => {
                tracing::debug!(error = %e, agent_id = %id, "cannot read another replica's events; the stream heals at the next one")
            }
        }
    }
    if !notice.t.is_empty() {
        match store::events::team_events_by_ids(pool, &notice.t).await {
            Ok(rows) => {
                for r in rows {
                    *max_team_id = (*max_team_id).max(r.id);
                    bus.publish_team(Arc::new(TeamActivity::from(r)));
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot read another replica's team events"),
        }
    }
}

/// Other replicas may have stopped sending this one notices (they took it for dead while
/// it was paused or cut off): publish each streamed agent's latest event, so that a stream
/// behind it reads what it missed from the database.
pub async fn resync_streams(pool: &PgPool, bus: &Bus) {
    for id in bus.subscribed_agents() {
        if let Ok(rows) = store::events::page_before(pool, id.uuid(), i64::MAX, 1).await {
            bus.publish(
                rows.into_iter()
                    .map(|r| Arc::new(Published::new(r.into_event()))),
            );
        }
    }
}

/// After notices may have been missed: publish each streamed agent's latest event (a
/// stream behind it sees the gap and reads the rest from the database) and the team
/// events since the last one seen.
async fn resync(pool: &PgPool, bus: &Bus, max_team_id: &mut i64) {
    resync_streams(pool, bus).await;
    if let Ok(rows) = store::events::team_events_after(pool, None, *max_team_id, 1000).await {
        for r in rows {
            *max_team_id = (*max_team_id).max(r.id);
            bus.publish_team(Arc::new(TeamActivity::from(r)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_fold_into_widest_ranges_and_bounded_payloads() {
        let a = Uuid::now_v7();
        let b = Uuid::now_v7();
        let n = |agents: Vec<(Uuid, i64, i64)>, t: Vec<i64>| Notice {
            r: "r1".into(),
            a: agents,
            t,
            join: None,
        };
        let out = fold(vec![
            n(vec![(a, 1, 3), (b, 7, 7)], vec![5]),
            n(vec![(a, 4, 9)], vec![6]),
        ]);
        assert_eq!(out.len(), 1);
        let got: Notice = serde_json::from_str(&out[0]).unwrap();
        assert_eq!(got.r, "r1");
        let mut want = vec![(a, 1, 9), (b, 7, 7)];
        want.sort();
        assert_eq!(got.a, want);
        assert_eq!(got.t, vec![5, 6]);

        let many: Vec<(Uuid, i64, i64)> = (0..500).map(|i| (Uuid::now_v7(), i, i)).collect();
        let out = fold(vec![n(many, (0..500).collect())]);
        assert!(out.len() > 1);
        let mut agents = 0;
        let mut team = 0;
        for p in &out {
            assert!(p.len() < 8000, "{} bytes", p.len());
            let got: Notice = serde_json::from_str(p).unwrap();
            agents += got.a.len();
            team += got.t.len();
        }
        assert_eq!((agents, team), (500, 500));
    }
}
