//! What the runtime asks of the usage service (it never computes money itself): before a
//! turn, whether a budget still allows it and a meter for it; while it runs, whether the
//! usage it reported so far exhausts a budget; at its end, to record it once.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::{AgentId, TurnId};
use crate::providers::Usage;

/// A budget that ran out.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Exhausted {
    /// Which budget: `team.cost_usd`, `team.tokens`, `agent.cost_usd`, `agent.turns` or
    /// `agent.wall_time_s`.
    pub budget: String,
    /// `month` for a team's budget; `agent` for a cap over an agent's life.
    pub period: String,
    /// The budget's limit (USD, tokens, turns or seconds).
    pub limit: f64,
    /// What was used against it.
    pub used: f64,
    /// When the budget starts again (none for an agent's caps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resets_at: Option<DateTime<Utc>>,
}

impl std::fmt::Display for Exhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the budget `{}` ({} per {}) is exhausted: {} used",
            self.budget, self.limit, self.period, self.used
        )?;
        if let Some(at) = self.resets_at {
            write!(f, "; it resets at {}", at.to_rfc3339())?;
        }
        Ok(())
    }
}

/// The agent a turn runs for, as the runtime knows it.
#[derive(Debug, Clone)]
pub struct TurnSubject {
    pub agent: AgentId,
    pub team: uuid::Uuid,
    pub provider: String,
    pub model: Option<String>,
}

/// One ended turn, for the ledger.
#[derive(Debug, Clone)]
pub struct EndedTurn {
    pub subject: TurnSubject,
    pub turn: TurnId,
    /// The turn's usage: its end's figures, completed by its last `usage` event.
    pub usage: Usage,
    pub started_at: DateTime<Utc>,
    pub ended_at: DateTime<Utc>,
}

/// Watches one running turn against the budgets that applied when it started.
pub trait TurnMeter: Send + Sync {
    /// The turn's usage so far (counts are the turn's, as in a `usage` event): the budget
    /// it exhausts, if any.
    fn observe(&mut self, usage: &Usage) -> Option<Exhausted>;
    /// How long the turn may run before a wall-time cap ends it, and that cap.
    fn wall_time(&self) -> Option<(Duration, Exhausted)>;
}

#[async_trait]
pub trait Spend: Send + Sync {
    /// Before a turn: a meter for it, or the budget that is out.
    async fn open_turn(&self, subject: &TurnSubject) -> Result<Box<dyn TurnMeter>, Exhausted>;
    /// At a turn's end: store its usage (once, whatever the retries).
    async fn record(&self, ended: EndedTurn);
}
