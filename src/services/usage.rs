//! Usage and budgets: the ledger of what each turn used and cost (one row per turn,
//! written at its end), the totals and series of `GET /v1/usage`, a team's monthly budget
//! and an agent's caps. `Metering` is what the runtime asks before a turn starts, while it
//! runs (each `usage` event) and when it ends; costs are computed here, from the CLI's own
//! figure or else from the settings' price table.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::hooks::{self, Subject};
use super::{Data, Governance, ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::config::{Price, UsageSettings};
use crate::domain::{AgentId, HookEvent, ProjectId, TeamId, TokenId, UserId, WorkspaceId};
use crate::metrics::{Counter, Family};
use crate::providers::Usage;
use crate::runtime::{EndedTurn, Exhausted, Spend, TurnMeter, TurnSubject};
use crate::store::usage::{BudgetRow, CapsRow, Sums};
use crate::store::{self, DeadlinePool};

/// The percentages of a team budget its hooks hear of (`budget.threshold`), once each per
/// period.
const THRESHOLDS: [i32; 2] = [80, 100];

/// Cost is counted in millionths of a USD in the metrics' integer counters.
pub const MICRO_USD: f64 = 1_000_000.0;

/// The price table and owners' limits of the settings, and the usage metrics.
#[derive(Debug)]
pub struct UsageBook {
    settings: UsageSettings,
    /// Tokens recorded in the ledger by this server, by team, provider and kind (`input`,
    /// `output`, `cached_input`). Team ids are bounded by the number of teams.
    pub tokens: Family<Counter>,
    /// Cost recorded by this server in millionths of a USD, by team and provider.
    pub cost_micro_usd: Family<Counter>,
}

impl UsageBook {
    pub fn new(settings: &UsageSettings) -> Self {
        Self {
            settings: settings.clone(),
            tokens: Family::counters(&["team", "provider", "kind"]),
            cost_micro_usd: Family::counters(&["team", "provider"]),
        }
    }

    /// A turn's cost and where it comes from: the CLI's own figure, else the price table,
    /// else unknown (0).
    fn cost(&self, provider: &str, model: Option<&str>, usage: &Usage) -> (f64, &'static str) {
        if let Some(c) = usage.cost_usd.filter(|c| c.is_finite() && *c >= 0.0) {
            return (c, "reported");
        }
        match self.settings.price(provider, model) {
            Some(price) => (estimate(&price, usage), "estimated"),
            None => (0.0, "unknown"),
        }
    }
}

/// What `usage` costs at `price` (input tokens include the cached ones).
fn estimate(price: &Price, usage: &Usage) -> f64 {
    let cached = usage.cached_input_tokens.min(usage.input_tokens) as f64;
    let fresh = usage.input_tokens as f64 - cached;
    let cached_price = price.cached_per_mtok.unwrap_or(price.input_per_mtok);
    (fresh * price.input_per_mtok
        + cached * cached_price
        + usage.output_tokens as f64 * price.output_per_mtok)
        / 1_000_000.0
}

/// The calendar month (UTC) `at` falls in: its first instant and the next month's.
pub fn month_of(at: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    let first = |y: i32, m: u32| {
        Utc.from_utc_datetime(
            &NaiveDate::from_ymd_opt(y, m, 1)
                .unwrap_or_default()
                .and_hms_opt(0, 0, 0)
                .unwrap_or_default(),
        )
    };
    let start = first(at.year(), at.month());
    let next = if at.month() == 12 {
        first(at.year() + 1, 1)
    } else {
        first(at.year(), at.month() + 1)
    };
    (start, next)
}

// ---- reading the ledger ----------------------------------------------------------------

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// The team (default: your default team).
    #[param(value_type = Option<String>)]
    pub team_id: Option<TeamId>,
    /// From this instant (RFC 3339) or day (`YYYY-MM-DD`, UTC), inclusive; default: the
    /// start of the current month.
    pub from: Option<String>,
    /// Until this instant or day, exclusive; default: now.
    pub to: Option<String>,
    /// `day`, `person`, `provider`, `model`, `project` or `parent_agent` (the agent that
    /// created the one that spent; an empty key for agents no agent created): one series
    /// entry per value.
    pub group_by: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct UsageTotals {
    pub turns: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cached_input_tokens: i64,
    /// Reported by the CLIs where they report it, else estimated from the settings'
    /// `[usage.prices]`.
    pub cost_usd: f64,
    /// The part of `cost_usd` that is estimated.
    pub estimated_cost_usd: f64,
    /// Seconds the turns ran.
    pub wall_time_s: f64,
}

impl From<Sums> for UsageTotals {
    fn from(s: Sums) -> Self {
        Self {
            turns: s.turns,
            input_tokens: s.input_tokens,
            output_tokens: s.output_tokens,
            cached_input_tokens: s.cached_input_tokens,
            cost_usd: s.cost_usd,
            estimated_cost_usd: s.estimated_cost_usd,
            wall_time_s: s.wall_ms as f64 / 1000.0,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct UsageGroup {
    /// The day (`YYYY-MM-DD`), person (`usr_…`; a team's service token: `tok_…`),
    /// provider, model or project (`prj_…`); empty when the turns have none (a model the
    /// CLI did not name).
    pub key: String,
    #[serde(flatten)]
    pub totals: UsageTotals,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
    "from": "2026-12-01T00:00:00Z", "to": "2026-12-06T12:00:00Z", "group_by": "provider",
    "totals": {"turns": 3, "input_tokens": 3600, "output_tokens": 1020, "cached_input_tokens": 0,
        "cost_usd": 0.0261, "estimated_cost_usd": 0.0, "wall_time_s": 4.2},
    "groups": [{"key": "mock", "turns": 3, "input_tokens": 3600, "output_tokens": 1020,
        "cached_input_tokens": 0, "cost_usd": 0.0261, "estimated_cost_usd": 0.0, "wall_time_s": 4.2}]}))]
pub struct UsageReport {
    pub team_id: TeamId,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub group_by: Option<String>,
    pub totals: UsageTotals,
    /// One entry per group, in key order (empty without `group_by`).
    pub groups: Vec<UsageGroup>,
}

const GROUPS: [&str; 6] = [
    "day",
    "person",
    "provider",
    "model",
    "project",
    "parent_agent",
];

fn instant(field: &'static str, raw: &str) -> ServiceResult<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(raw) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(raw, "%Y-%m-%d") {
        return Ok(Utc.from_utc_datetime(&d.and_hms_opt(0, 0, 0).unwrap_or_default()));
    }
    Err(ServiceError::invalid(
        field,
        "an RFC 3339 instant or a day `YYYY-MM-DD`",
    ))
}

/// The team a request names, checked: members (any role) see it, admins any team, anyone
/// else finds it missing.
async fn visible_team(
    data: &Data,
    principal: &Principal,
    team: Option<TeamId>,
) -> ServiceResult<Uuid> {
    let team = match team {
        Some(t) => t.uuid(),
        None => principal
            .default_team()
            .ok_or_else(|| ServiceError::invalid("team_id", "required: you are in no team"))?,
    };
    principal.authorize_in(team, Operation::ReadTeam, "team")?;
    store::teams::get(&data.pool, team)
        .await?
        .ok_or(ServiceError::NotFound("team"))?;
    Ok(team)
}

#[tracing::instrument(name = "services::usage::report", skip_all)]
pub async fn report(
    data: &Data,
    principal: &Principal,
    q: &UsageQuery,
) -> ServiceResult<UsageReport> {
    let team = visible_team(data, principal, q.team_id).await?;
    let now = Utc::now();
    let from = match &q.from {
        Some(raw) => instant("from", raw)?,
        None => month_of(now).0,
    };
    // The default end is a little past now, so a turn that just ended is counted.
    let to = match &q.to {
        Some(raw) => instant("to", raw)?,
        None => now + chrono::Duration::seconds(1),
    };
    if to < from {
        return Err(ServiceError::invalid("to", "must not be before `from`"));
    }
    if let Some(g) = &q.group_by
        && !GROUPS.contains(&g.as_str())
    {
        return Err(ServiceError::invalid(
            "group_by",
            format!("one of {}", GROUPS.join(", ")),
        ));
    }
    let totals = store::usage::team_totals(&data.pool, team, from, to).await?;
    let groups = match &q.group_by {
        Some(g) => store::usage::team_groups(&data.pool, team, from, to, g)
            .await?
            .into_iter()
            .map(|row| UsageGroup {
                key: shown_key(g, row.key),
                totals: row.sums.into(),
            })
            .collect(),
        None => Vec::new(),
    };
    Ok(UsageReport {
        team_id: team.into(),
        from,
        to,
        group_by: q.group_by.clone(),
        totals: totals.into(),
        groups,
    })
}

/// A group's key as the API shows it: people, service tokens, projects and parent agents
/// by their typed ids.
fn shown_key(group: &str, key: String) -> String {
    if group == "person"
        && let Some(token) = key
            .strip_prefix("tok:")
            .and_then(|t| Uuid::parse_str(t).ok())
    {
        return TokenId::from(token).to_string();
    }
    let parsed = Uuid::parse_str(&key);
    match (group, parsed) {
        ("person", Ok(u)) => UserId::from(u).to_string(),
        ("project", Ok(u)) => ProjectId::from(u).to_string(),
        ("parent_agent", Ok(u)) => AgentId::from(u).to_string(),
        _ => key,
    }
}

// ---- budgets ---------------------------------------------------------------------------

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"period": "month", "max_cost_usd": 500.0, "max_tokens": 200000000}))]
pub struct PutBudget {
    /// Only `month` (calendar months, UTC).
    pub period: String,
    /// Spend per period in USD; absent: no cost budget.
    pub max_cost_usd: Option<f64>,
    /// Input plus output tokens per period; absent: no token budget.
    pub max_tokens: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "period": "month",
    "max_cost_usd": 500.0, "max_tokens": null, "period_start": "2026-12-01T00:00:00Z",
    "resets_at": "2027-01-01T00:00:00Z", "used_cost_usd": 123.4, "used_tokens": 41000000,
    "limits": {"max_cost_usd": 1000.0, "max_tokens": null}}))]
pub struct Budget {
    pub team_id: TeamId,
    /// `month`; null when the team has no budget.
    pub period: Option<String>,
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<i64>,
    pub period_start: DateTime<Utc>,
    pub resets_at: DateTime<Utc>,
    pub used_cost_usd: f64,
    pub used_tokens: i64,
    /// The most an owner may set (the settings' `[usage]`); admins may set more.
    pub limits: BudgetLimits,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BudgetLimits {
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<u64>,
}

async fn budget_view(
    data: &Data,
    governance: &Governance,
    team: Uuid,
    row: Option<BudgetRow>,
) -> ServiceResult<Budget> {
    let (start, next) = month_of(Utc::now());
    let used = store::usage::team_totals(&data.pool, team, start, next).await?;
    Ok(Budget {
        team_id: team.into(),
        period: row.as_ref().map(|r| r.period.clone()),
        max_cost_usd: row.as_ref().and_then(|r| r.max_cost_usd),
        max_tokens: row.as_ref().and_then(|r| r.max_tokens),
        period_start: start,
        resets_at: next,
        used_cost_usd: used.cost_usd,
        used_tokens: used.input_tokens + used.output_tokens,
        limits: BudgetLimits {
            max_cost_usd: governance.usage.settings.max_team_cost_usd,
            max_tokens: governance.usage.settings.max_team_tokens,
        },
    })
}

#[tracing::instrument(name = "services::usage::get_budget", skip_all, fields(team_id = %team))]
pub async fn get_budget(
    data: &Data,
    governance: &Governance,
    principal: &Principal,
    team: TeamId,
) -> ServiceResult<Budget> {
    let team = visible_team(data, principal, Some(team)).await?;
    let row = store::usage::team_budget(&data.pool, team).await?;
    budget_view(data, governance, team, row).await
}

/// Set a team's budget: its owners within the settings' limits, admins any.
#[tracing::instrument(name = "services::usage::put_budget", skip_all, fields(team_id = %team))]
pub async fn put_budget(
    data: &Data,
    governance: &Governance,
    principal: &Principal,
    team: TeamId,
    body: &PutBudget,
) -> ServiceResult<Budget> {
    let team = visible_team(data, principal, Some(team)).await?;
    principal.authorize_in(team, Operation::ManageTeam, "team")?;
    ledger_on(governance, "period")?;
    if body.period != "month" {
        return Err(ServiceError::invalid("period", "only `month` is supported"));
    }
    if let Some(c) = body.max_cost_usd
        && !(c.is_finite() && c >= 0.0)
    {
        return Err(ServiceError::invalid(
            "max_cost_usd",
            "a number of USD, 0 or more",
        ));
    }
    let max_tokens = body
        .max_tokens
        .map(i64::try_from)
        .transpose()
        .map_err(|_| ServiceError::invalid("max_tokens", "too large"))?;
    if !principal.is_server_admin() {
        let limits = &governance.usage.settings;
        if let (Some(max), Some(want)) = (limits.max_team_cost_usd, body.max_cost_usd)
            && want > max
        {
            return Err(ServiceError::invalid(
                "max_cost_usd",
                format!("at most {max} (usage.max_team_cost_usd); a server admin may set more"),
            ));
        }
        if let (Some(max), Some(want)) = (limits.max_team_tokens, body.max_tokens)
            && want > max
        {
            return Err(ServiceError::invalid(
                "max_tokens",
                format!("at most {max} (usage.max_team_tokens); a server admin may set more"),
            ));
        }
        // An owner may not lift a limit by leaving it out.
        if limits.max_team_cost_usd.is_some() && body.max_cost_usd.is_none() {
            return Err(ServiceError::invalid(
                "max_cost_usd",
                "required: the server limits team cost budgets (usage.max_team_cost_usd)",
            ));
        }
        if limits.max_team_tokens.is_some() && body.max_tokens.is_none() {
            return Err(ServiceError::invalid(
                "max_tokens",
                "required: the server limits team token budgets (usage.max_team_tokens)",
            ));
        }
    }
    let row = store::usage::put_team_budget(
        &data.pool,
        team,
        &body.period,
        body.max_cost_usd,
        max_tokens,
    )
    .await?;
    super::audit::record(
        data,
        principal,
        super::audit::Entry::new(
            super::audit::Action::BudgetSet,
            Some(team),
            "team",
            TeamId::from(team),
        )
        .details(json!({"period": body.period, "max_cost_usd": body.max_cost_usd, "max_tokens": body.max_tokens})),
    )
    .await?;
    budget_view(data, governance, team, Some(row)).await
}

/// A team budget that is out now, if any.
fn team_exhausted(budget: &BudgetRow, used: &Sums, resets_at: DateTime<Utc>) -> Option<Exhausted> {
    let tokens = (used.input_tokens + used.output_tokens) as f64;
    let out = |name: &str, limit: f64, used: f64| Exhausted {
        budget: name.into(),
        period: budget.period.clone(),
        limit,
        used,
        resets_at: Some(resets_at),
    };
    if let Some(max) = budget.max_cost_usd
        && used.cost_usd >= max
    {
        return Some(out("team.cost_usd", max, used.cost_usd));
    }
    if let Some(max) = budget.max_tokens
        && tokens >= max as f64
    {
        return Some(out("team.tokens", max as f64, tokens));
    }
    None
}

/// Refuse new work for a team whose budget is out (429 `budget_exhausted`).
#[tracing::instrument(name = "services::usage::admit_team", skip_all, fields(team_id = %team))]
pub async fn admit_team(data: &Data, team: Uuid) -> ServiceResult<()> {
    let Some(budget) = store::usage::team_budget(&data.pool, team).await? else {
        return Ok(());
    };
    let (start, next) = month_of(Utc::now());
    let used = store::usage::team_totals(&data.pool, team, start, next).await?;
    match team_exhausted(&budget, &used, next) {
        Some(x) => Err(ServiceError::BudgetExhausted(Box::new(x))),
        None => Ok(()),
    }
}

/// Caps on one agent over its whole life, given when it is created.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"max_cost_usd": 5.0, "max_turns": 20, "max_wall_time_s": 3600}))]
pub struct AgentCaps {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_turns: Option<u64>,
    /// Seconds the agent's turns may run in all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_wall_time_s: Option<u64>,
}

/// Budgets hold only with the ledger on (`usage.ledger`): with it off, setting one is
/// refused rather than kept and not enforced.
pub fn ledger_on(governance: &Governance, field: &'static str) -> ServiceResult<()> {
    if governance.usage.settings.ledger {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            field,
            "budgets are off on this server (usage.ledger = false)",
        ))
    }
}

impl AgentCaps {
    /// The caps of an agent's `budget` field, checked.
    pub fn checked(&self) -> ServiceResult<CapsRow> {
        self.checked_as([
            "budget.max_cost_usd",
            "budget.max_turns",
            "budget.max_wall_time_s",
        ])
    }

    /// The caps, checked, an error naming the field of `fields` (cost, turns, wall time).
    fn checked_as(&self, fields: [&'static str; 3]) -> ServiceResult<CapsRow> {
        if let Some(c) = self.max_cost_usd
            && !(c.is_finite() && c >= 0.0)
        {
            return Err(ServiceError::invalid(
                fields[0],
                "a number of USD, 0 or more",
            ));
        }
        let int = |field: &'static str, v: Option<u64>| {
            v.map(i64::try_from)
                .transpose()
                .map_err(|_| ServiceError::invalid(field, "too large"))
        };
        Ok(CapsRow {
            max_cost_usd: self.max_cost_usd,
            max_turns: int(fields[1], self.max_turns)?,
            max_wall_s: int(fields[2], self.max_wall_time_s)?,
        })
    }
}

/// A workspace's caps (over the life of all its agents together) and what they used.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"workspace_id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
    "max_cost_usd": 20.0, "max_turns": 100, "max_wall_time_s": 7200,
    "used_cost_usd": 3.25, "used_turns": 14, "used_wall_time_s": 812.4}))]
pub struct WorkspaceBudget {
    pub workspace_id: WorkspaceId,
    pub max_cost_usd: Option<f64>,
    pub max_turns: Option<i64>,
    /// Seconds the workspace's turns may run in all.
    pub max_wall_time_s: Option<i64>,
    pub used_cost_usd: f64,
    pub used_turns: i64,
    pub used_wall_time_s: f64,
}

async fn workspace_budget_view(data: &Data, workspace: Uuid) -> ServiceResult<WorkspaceBudget> {
    let caps = store::usage::workspace_caps(&data.pool, workspace)
        .await?
        .unwrap_or_default();
    let used = store::usage::workspace_totals(&data.pool, workspace).await?;
    Ok(WorkspaceBudget {
        workspace_id: workspace.into(),
        max_cost_usd: caps.max_cost_usd,
        max_turns: caps.max_turns,
        max_wall_time_s: caps.max_wall_s,
        used_cost_usd: used.cost_usd,
        used_turns: used.turns,
        used_wall_time_s: used.wall_ms as f64 / 1000.0,
    })
}

/// A workspace's caps and use: anyone who sees the workspace.
pub async fn get_workspace_budget(
    data: &Data,
    principal: &Principal,
    id: WorkspaceId,
) -> ServiceResult<WorkspaceBudget> {
    let ws = super::workspaces::find(data, principal, id).await?;
    workspace_budget_view(data, ws.id).await
}

/// Set (or, with every field left out, lift) a workspace's caps: the team's owners.
pub async fn put_workspace_budget(
    data: &Data,
    governance: &Governance,
    principal: &Principal,
    id: WorkspaceId,
    body: &AgentCaps,
) -> ServiceResult<WorkspaceBudget> {
    let ws = super::workspaces::find(data, principal, id).await?;
    principal.authorize_in(ws.team_id, Operation::ManageTeam, "workspace")?;
    ledger_on(governance, "max_cost_usd")?;
    let caps = body.checked_as(["max_cost_usd", "max_turns", "max_wall_time_s"])?;
    store::usage::set_workspace_caps(&data.pool, ws.id, &caps).await?;
    super::audit::record(
        data,
        principal,
        super::audit::Entry::new(
            super::audit::Action::BudgetSet,
            Some(ws.team_id),
            "workspace",
            id,
        )
        .details(
            json!({"max_cost_usd": body.max_cost_usd, "max_turns": body.max_turns,
            "max_wall_time_s": body.max_wall_time_s}),
        ),
    )
    .await?;
    workspace_budget_view(data, ws.id).await
}

/// Refuse new agents in a workspace whose caps are out (429 `budget_exhausted`).
pub async fn admit_workspace(
    data: &Data,
    governance: &Governance,
    workspace: Uuid,
) -> ServiceResult<()> {
    let Some(caps) = store::usage::workspace_caps(&data.pool, workspace).await? else {
        return Ok(());
    };
    let used = store::usage::workspace_totals(&data.pool, workspace).await?;
    let mut probe = Meter {
        book: governance.usage.clone(),
        provider: String::new(),
        model: None,
        team: None,
        costs: Vec::new(),
        wall: None,
    };
    match probe.cap(CapScope::Workspace, &caps, &used) {
        Some(x) => Err(ServiceError::BudgetExhausted(Box::new(x))),
        None => Ok(()),
    }
}

// ---- metering turns --------------------------------------------------------------------

/// The runtime's view of budgets (`runtime::Spend`), over the services.
///
/// It holds only what it uses, never the whole `ServiceContext`: the context owns the
/// agent manager that owns this, and a cycle would keep the pool (and its connections)
/// alive after the server is gone.
pub struct Metering {
    ctx: MeteringContext,
}

struct MeteringContext {
    pool: DeadlinePool,
    usage: Arc<UsageBook>,
    hooks: Arc<hooks::Hooks>,
}

impl Metering {
    pub fn new(ctx: &ServiceContext) -> Arc<Self> {
        Arc::new(Self {
            ctx: MeteringContext {
                pool: ctx.data.pool.clone(),
                usage: ctx.governance.usage.clone(),
                hooks: ctx.hooks.clone(),
            },
        })
    }

    async fn open(&self, s: &TurnSubject) -> ServiceResult<Result<Meter, Exhausted>> {
        let ctx = &self.ctx;
        let mut meter = Meter {
            book: ctx.usage.clone(),
            provider: s.provider.clone(),
            model: s.model.clone(),
            team: None,
            costs: Vec::new(),
            wall: None,
        };
        let limits = store::usage::turn_limits(&ctx.pool, s.team, s.agent.uuid()).await?;
        if let Some(budget) = limits.team {
            let (start, next) = month_of(Utc::now());
            let used = store::usage::team_totals(&ctx.pool, s.team, start, next).await?;
            if let Some(x) = team_exhausted(&budget, &used, next) {
                return Ok(Err(x));
            }
            meter.team = Some((budget, used, next));
        }
        if let Some(caps) = limits.agent {
            let used = store::usage::agent_totals(&ctx.pool, s.agent.uuid()).await?;
            if let Some(x) = meter.cap(CapScope::Agent, &caps, &used) {
                return Ok(Err(x));
            }
        }
        if let Some((workspace, caps)) = limits.workspace {
            let used = store::usage::workspace_totals(&ctx.pool, workspace).await?;
            if let Some(x) = meter.cap(CapScope::Workspace, &caps, &used) {
                return Ok(Err(x));
            }
        }
        Ok(Ok(meter))
    }

    async fn store(&self, ended: &EndedTurn) -> ServiceResult<()> {
        let ctx = &self.ctx;
        let s = &ended.subject;
        let u = &ended.usage;
        let (cost, source) = ctx.usage.cost(&s.provider, s.model.as_deref(), u);
        let wall_ms = (ended.ended_at - ended.started_at)
            .num_milliseconds()
            .max(0);
        let written = store::usage::insert_turn(
            &ctx.pool,
            &store::usage::NewTurnUsage {
                turn_id: ended.turn.uuid(),
                agent_id: s.agent.uuid(),
                provider: &s.provider,
                model: s.model.as_deref(),
                input_tokens: clamp(u.input_tokens),
                output_tokens: clamp(u.output_tokens),
                cached_input_tokens: clamp(u.cached_input_tokens),
                cost_usd: cost,
                cost_source: source,
                wall_ms,
                started_at: ended.started_at,
                ended_at: ended.ended_at,
            },
        )
        .await?;
        let Some((team, budgeted)) = written else {
            return Ok(());
        };
        let team_label = TeamId::from(team).to_string();
        for (kind, n) in [
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cached_input", u.cached_input_tokens),
        ] {
            ctx.usage
                .tokens
                .with(&[&team_label, &s.provider, kind])
                .add(n);
        }
        ctx.usage
            .cost_micro_usd
            .with(&[&team_label, &s.provider])
            .add((cost * MICRO_USD).round() as u64);
        if !budgeted {
            return Ok(());
        }
        self.thresholds(team, ended.ended_at).await
    }

    /// Tell the team's hooks, once per period, that its budget reached 80 % or 100 %.
    async fn thresholds(&self, team: Uuid, at: DateTime<Utc>) -> ServiceResult<()> {
        let ctx = &self.ctx;
        let Some(budget) = store::usage::team_budget(&ctx.pool, team).await? else {
            return Ok(());
        };
        let (start, next) = month_of(at);
        let used = store::usage::team_totals(&ctx.pool, team, start, next).await?;
        let tokens = (used.input_tokens + used.output_tokens) as f64;
        let measures = [
            ("team.cost_usd", budget.max_cost_usd, used.cost_usd),
            ("team.tokens", budget.max_tokens.map(|t| t as f64), tokens),
        ];
        let mut queued = 0;
        for (name, limit, used) in measures {
            let Some(limit) = limit else { continue };
            for percent in THRESHOLDS {
                let reached = if limit > 0.0 {
                    used * 100.0 >= limit * f64::from(percent)
                } else {
                    true
                };
                if !reached {
                    continue;
                }
                let mut tx = ctx.pool.pool().begin().await?;
                if store::usage::first_notice(&mut *tx, team, start, name, percent).await? {
                    queued += hooks::queue(
                        &mut tx,
                        HookEvent::BudgetThreshold,
                        Subject {
                            team,
                            project: None,
                            labels: None,
                            among: None,
                        },
                        json!({
                            "budget": name,
                            "period": budget.period,
                            "percent": percent,
                            "limit": limit,
                            "used": used,
                            "period_start": start,
                            "resets_at": next,
                        }),
                    )
                    .await?;
                }
                tx.commit().await?;
            }
        }
        if queued > 0 {
            ctx.hooks.queued();
        }
        Ok(())
    }
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[async_trait]
impl Spend for Metering {
    async fn open_turn(&self, subject: &TurnSubject) -> Result<Box<dyn TurnMeter>, Exhausted> {
        match self.open(subject).await {
            Ok(Ok(meter)) => Ok(Box::new(meter)),
            Ok(Err(exhausted)) => Err(exhausted),
            // Budgets cannot be read: the turn runs unmetered rather than not at all (its
            // usage is still recorded at its end), and the operator hears of it.
            Err(e) => {
                tracing::warn!(agent_id = %subject.agent, error = %e, "budgets could not be read; the turn runs unmetered");
                Ok(Box::new(Meter {
                    book: self.ctx.usage.clone(),
                    provider: subject.provider.clone(),
                    model: subject.model.clone(),
                    team: None,
                    costs: Vec::new(),
                    wall: None,
                }))
            }
        }
    }

    async fn record(&self, ended: EndedTurn) {
        if let Err(e) = self.store(&ended).await {
            tracing::error!(agent_id = %ended.subject.agent, turn_id = %ended.turn, error = %e,
                "the turn's usage could not be recorded in the ledger");
        }
    }
}

/// One turn against the budgets as they stood when it started.
struct Meter {
    book: Arc<UsageBook>,
    provider: String,
    model: Option<String>,
    /// The team's budget, what the period used before this turn, and when it resets.
    team: Option<(BudgetRow, Sums, DateTime<Utc>)>,
    /// The cost caps of the agent and its workspace, with what each had spent before this
    /// turn.
    costs: Vec<(CapScope, f64, f64)>,
    /// The nearest wall-time cap: how long this turn may run, and that cap.
    wall: Option<(Duration, Exhausted)>,
}

/// What a cap is on: one agent, or every agent of a workspace together.
#[derive(Debug, Clone, Copy)]
enum CapScope {
    Agent,
    Workspace,
}

impl CapScope {
    fn name(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Workspace => "workspace",
        }
    }

    /// The cap `measure` (`cost_usd`, `turns`, `wall_time_s`) of this scope, out.
    fn exhausted(self, measure: &str, limit: f64, used: f64) -> Exhausted {
        Exhausted {
            budget: format!("{}.{measure}", self.name()),
            period: self.name().into(),
            limit,
            used,
            resets_at: None,
        }
    }
}

impl Meter {
    /// Take the caps of `scope` into this turn's watch, given what was `used` before it:
    /// the cap that is already out, if any.
    fn cap(&mut self, scope: CapScope, caps: &CapsRow, used: &Sums) -> Option<Exhausted> {
        if let Some(max) = caps.max_cost_usd {
            if used.cost_usd >= max {
                return Some(scope.exhausted("cost_usd", max, used.cost_usd));
            }
            self.costs.push((scope, max, used.cost_usd));
        }
        if let Some(max) = caps.max_turns
            && used.turns >= max
        {
            return Some(scope.exhausted("turns", max as f64, used.turns as f64));
        }
        if let Some(max) = caps.max_wall_s {
            let spent = used.wall_ms as f64 / 1000.0;
            if spent >= max as f64 {
                return Some(scope.exhausted("wall_time_s", max as f64, spent));
            }
            let left = Duration::from_secs_f64(max as f64 - spent);
            if self.wall.as_ref().is_none_or(|(d, _)| left < *d) {
                self.wall = Some((left, scope.exhausted("wall_time_s", max as f64, max as f64)));
            }
        }
        None
    }
}

impl TurnMeter for Meter {
    fn observe(&mut self, usage: &Usage) -> Option<Exhausted> {
        let (cost, _) = self.book.cost(&self.provider, self.model.as_deref(), usage);
        if let Some((budget, before, resets_at)) = &self.team {
            let mut now = before.clone();
            now.cost_usd += cost;
            now.input_tokens += clamp(usage.input_tokens);
            now.output_tokens += clamp(usage.output_tokens);
            if let Some(x) = team_exhausted(budget, &now, *resets_at) {
                return Some(x);
            }
        }
        self.costs
            .iter()
            .find(|(_, max, before)| before + cost >= *max)
            .map(|(scope, max, before)| scope.exhausted("cost_usd", *max, before + cost))
    }

    fn wall_time(&self) -> Option<(Duration, Exhausted)> {
        self.wall.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_are_calendar_months_in_utc_and_december_rolls_over() {
        let at = Utc.with_ymd_and_hms(2026, 12, 31, 23, 59, 59).unwrap();
        let (start, next) = month_of(at);
        assert_eq!(start, Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap());
        assert_eq!(next, Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap());
        let (start, next) = month_of(Utc.with_ymd_and_hms(2027, 2, 1, 0, 0, 0).unwrap());
        assert_eq!(start, Utc.with_ymd_and_hms(2027, 2, 1, 0, 0, 0).unwrap());
        assert_eq!(next, Utc.with_ymd_and_hms(2027, 3, 1, 0, 0, 0).unwrap());
    }

    #[test]
    fn an_estimate_prices_cached_input_apart_and_a_reported_cost_wins() {
        let mut settings = UsageSettings::default();
        let mut models = std::collections::BTreeMap::new();
        models.insert(
            "gpt-5".to_owned(),
            Price {
                input_per_mtok: 1.0,
                output_per_mtok: 10.0,
                cached_per_mtok: Some(0.1),
            },
        );
        models.insert(
            "*".to_owned(),
            Price {
                input_per_mtok: 2.0,
                output_per_mtok: 20.0,
                cached_per_mtok: None,
            },
        );
        settings.prices.insert("codex".into(), models);
        let book = UsageBook::new(&settings);
        let usage = Usage {
            input_tokens: 1_000_000,
            cached_input_tokens: 400_000,
            output_tokens: 100_000,
            ..Usage::default()
        };
        let (cost, source) = book.cost("codex", Some("gpt-5"), &usage);
        assert_eq!(source, "estimated");
        assert!((cost - (0.6 + 0.04 + 1.0)).abs() < 1e-9, "{cost}");
        // Another model of the provider: its `*` table, cached input at the input price.
        let (cost, _) = book.cost("codex", Some("o4"), &usage);
        assert!((cost - (2.0 + 2.0)).abs() < 1e-9, "{cost}");
        let (cost, source) = book.cost("claude", None, &usage);
        assert_eq!((cost, source), (0.0, "unknown"));
        let reported = Usage {
            cost_usd: Some(0.25),
            ..usage
        };
        assert_eq!(
            book.cost("codex", Some("gpt-5"), &reported),
            (0.25, "reported")
        );
    }
}
