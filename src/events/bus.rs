//! In-process fan-out of committed events: one broadcast channel per agent with
//! subscribers, and one for team activity. Senders never block; a receiver that falls
//! behind sees `Lagged` and resynchronises from the database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::sync::broadcast;
use uuid::Uuid;

use super::fanout::Fanout;
use crate::domain::{AgentEvent, AgentId};
use crate::metrics::Counter;
use crate::store::events::TeamEventRow;

/// A committed agent event, serialised at most once however many clients read it.
#[derive(Debug)]
pub struct Published {
    pub event: AgentEvent,
    json: OnceLock<String>,
}

impl Published {
    pub fn new(event: AgentEvent) -> Self {
        Self {
            event,
            json: OnceLock::new(),
        }
    }

    pub fn json(&self) -> &str {
        self.json
            .get_or_init(|| serde_json::to_string(&self.event).unwrap_or_default())
    }
}

/// A committed team activity event (`GET /v1/events`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TeamActivity {
    pub id: i64,
    #[serde(skip)]
    pub team_id: Uuid,
    #[serde(skip)]
    pub project_id: Option<Uuid>,
    #[serde(skip)]
    pub workspace_id: Option<Uuid>,
    pub kind: String,
    pub at: DateTime<Utc>,
    pub data: Value,
}

impl From<TeamEventRow> for TeamActivity {
    fn from(r: TeamEventRow) -> Self {
        Self {
            id: r.id,
            team_id: r.team_id,
            project_id: r.project_id,
            workspace_id: r.workspace_id,
            kind: r.kind,
            at: r.at,
            data: r.data,
        }
    }
}

pub struct Bus {
    agents: Mutex<HashMap<AgentId, broadcast::Sender<Arc<Published>>>>,
    /// Tells the other replicas what this one committed (when several run).
    fanout: OnceLock<Arc<Fanout>>,
    team: broadcast::Sender<Arc<TeamActivity>>,
    capacity: usize,
    /// Streams that fell behind and caught up from the database.
    pub resyncs: Counter,
}

impl Bus {
    pub fn new(capacity: usize) -> Self {
        let (team, _) = broadcast::channel(capacity);
        Self {
            agents: Mutex::new(HashMap::new()),
            fanout: OnceLock::new(),
            team,
            capacity,
            resyncs: Counter::default(),
        }
    }

    pub fn subscribe(&self, agent: AgentId) -> broadcast::Receiver<Arc<Published>> {
        let mut map = self.agents.lock().expect("bus lock");
        map.entry(agent)
            .or_insert_with(|| broadcast::channel(self.capacity).0)
            .subscribe()
    }

    /// Receivers listening now (agent streams and team streams).
    pub fn subscribers(&self) -> usize {
        let map = self.agents.lock().expect("bus lock");
        map.values().map(|tx| tx.receiver_count()).sum::<usize>() + self.team.receiver_count()
    }

    /// Whether someone here streams `agent`'s events.
    pub fn has_subscribers(&self, agent: AgentId) -> bool {
        let map = self.agents.lock().expect("bus lock");
        map.get(&agent).is_some_and(|tx| tx.receiver_count() > 0)
    }

    /// The agents someone here streams.
    pub fn subscribed_agents(&self) -> Vec<AgentId> {
        let map = self.agents.lock().expect("bus lock");
        map.iter()
            .filter(|(_, tx)| tx.receiver_count() > 0)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Tell other replicas about commits through `fanout` from now on.
    pub fn attach_fanout(&self, fanout: Arc<Fanout>) {
        let _ = self.fanout.set(fanout);
    }

    /// Whether commits must be announced to other replicas now.
    pub fn announcing(&self) -> bool {
        self.fanout.get().is_some_and(|f| f.has_peers())
    }

    /// Announce committed events to the other replicas: agents with their seq ranges, and
    /// team event ids.
    pub fn announce(&self, agents: Vec<(Uuid, i64, i64)>, team: Vec<i64>) {
        if let Some(f) = self.fanout.get() {
            f.committed(agents, team);
        }
    }

    pub fn subscribe_team(&self) -> broadcast::Receiver<Arc<TeamActivity>> {
        self.team.subscribe()
    }

    /// Publish a batch of committed events (in order).
    pub fn publish(&self, events: impl IntoIterator<Item = Arc<Published>>) {
        let mut map = self.agents.lock().expect("bus lock");
        for p in events {
            let id = p.event.agent_id;
            if let Some(tx) = map.get(&id)
                && tx.send(p).is_err()
            {
                // Nobody listens any more: drop the channel so the map stays small.
                map.remove(&id);
            }
        }
    }

    pub fn publish_team(&self, activity: Arc<TeamActivity>) {
        let _ = self.team.send(activity);
    }
}
