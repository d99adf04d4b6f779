//! The usage ledger (one row per ended turn), team budgets, agent and workspace caps and
//! the budget thresholds a team was told of.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

/// One ended turn, as the ledger stores it; who it is attributed to comes from its agent.
pub struct NewTurnUsage<'a> {
    pub turn_id: Uuid,
    pub agent_id: Uuid,
    pub provider: &'a str,
    pub model: Option<&'a str>,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cached_input_tokens: i64,
    pub cost_usd: f64,
    pub cost_source: &'a str,
    pub wall_ms: i64,
    pub started_at: DateTime<Utc>,
    pub ended_at: DateTime<Utc>,
}

/// Store a turn's usage once: a turn already in the ledger is left as it is. Returns the
/// team the row was written for and whether that team has a budget, or `None` when it was
/// already there (or the agent is unknown).
pub async fn insert_turn(
    db: impl PgExecutor<'_>,
    u: &NewTurnUsage<'_>,
) -> Result<Option<(Uuid, bool)>, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO usage_ledger (turn_id, team_id, agent_id, workspace_id, project_id, created_by,
                                   service_token_id, parent_agent_id, provider, model, input_tokens,
                                   output_tokens, cached_input_tokens, cost_usd, cost_source, wall_ms,
                                   started_at, ended_at)
         SELECT $1, a.team_id, a.id, a.workspace_id, w.project_id, a.created_by, st.token_id,
                a.parent_agent_id, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12
           FROM agents a JOIN workspaces w ON w.id = a.workspace_id
           LEFT JOIN agent_service_tokens st ON st.agent_id = a.id
          WHERE a.id = $2
         ON CONFLICT (turn_id) DO NOTHING
         RETURNING team_id,
                   EXISTS (SELECT 1 FROM team_budgets b WHERE b.team_id = usage_ledger.team_id)",
    )
    .bind(u.turn_id)
    .bind(u.agent_id)
    .bind(u.provider)
    .bind(u.model)
    .bind(u.input_tokens)
    .bind(u.output_tokens)
    .bind(u.cached_input_tokens)
    .bind(u.cost_usd)
    .bind(u.cost_source)
    .bind(u.wall_ms)
    .bind(u.started_at)
    .bind(u.ended_at)
    .fetch_optional(db)
    .await
}

/// Sums over a set of ledger rows.
#[derive(Debug, Clone, Default, FromRow)]
pub struct Sums {
    pub turns: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cached_input_tokens: i64,
    pub cost_usd: f64,
    /// The part of `cost_usd` estimated from the price table.
    pub estimated_cost_usd: f64,
    pub wall_ms: i64,
}

/// Sums of one group (`key`: a day `YYYY-MM-DD`, a person's or project's uuid, `tok:` and
/// a service token's uuid, a provider or a model name; empty for rows without one).
#[derive(Debug, Clone, FromRow)]
pub struct GroupSums {
    pub key: String,
    #[sqlx(flatten)]
    pub sums: Sums,
}

/// The columns of `Sums` over the ledger rows a `WHERE` that follows selects (a literal,
/// for `concat!`: the statements stay static SQL).
macro_rules! sums {
    () => {
        "count(*)::bigint AS turns,
                coalesce(sum(input_tokens), 0)::bigint AS input_tokens,
                coalesce(sum(output_tokens), 0)::bigint AS output_tokens,
                coalesce(sum(cached_input_tokens), 0)::bigint AS cached_input_tokens,
                coalesce(sum(cost_usd), 0)::double precision AS cost_usd,
                coalesce(sum(cost_usd) FILTER (WHERE cost_source = 'estimated'), 0)::double precision
                    AS estimated_cost_usd,
                coalesce(sum(wall_ms), 0)::bigint AS wall_ms
           FROM usage_ledger"
    };
}

/// A team's totals over `[from, to)`.
pub async fn team_totals(
    db: impl PgExecutor<'_>,
    team: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Sums, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT ",
        sums!(),
        " WHERE team_id = $1 AND ended_at >= $2 AND ended_at < $3"
    ))
    .bind(team)
    .bind(from)
    .bind(to)
    .fetch_one(db)
    .await
}

/// A team's sums over `[from, to)` grouped by `group` (`day`, `person`, `provider`,
/// `model`, `project` or `parent_agent`), in key order.
pub async fn team_groups(
    db: impl PgExecutor<'_>,
    team: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    group: &str,
) -> Result<Vec<GroupSums>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT coalesce(CASE $4
                    WHEN 'day' THEN to_char(ended_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')
                    WHEN 'person' THEN coalesce('tok:' || service_token_id::text, created_by::text)
                    WHEN 'provider' THEN provider
                    WHEN 'model' THEN model
                    WHEN 'project' THEN project_id::text
                    WHEN 'parent_agent' THEN parent_agent_id::text
                END, '') AS key,
                ",
        sums!(),
        " WHERE team_id = $1 AND ended_at >= $2 AND ended_at < $3
          GROUP BY 1 ORDER BY 1"
    ))
    .bind(team)
    .bind(from)
    .bind(to)
    .bind(group)
    .fetch_all(db)
    .await
}

/// Everything an agent spent, over its whole life.
pub async fn agent_totals(db: impl PgExecutor<'_>, agent: Uuid) -> Result<Sums, sqlx::Error> {
    sqlx::query_as(concat!("SELECT ", sums!(), " WHERE agent_id = $1"))
        .bind(agent)
        .fetch_one(db)
        .await
}

#[derive(Debug, Clone, FromRow)]
pub struct BudgetRow {
    pub team_id: Uuid,
    pub period: String,
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<i64>,
    pub updated_at: DateTime<Utc>,
}

pub async fn team_budget(
    db: impl PgExecutor<'_>,
    team: Uuid,
) -> Result<Option<BudgetRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT team_id, period, max_cost_usd, max_tokens, updated_at
           FROM team_budgets WHERE team_id = $1",
    )
    .bind(team)
    .fetch_optional(db)
    .await
}

pub async fn put_team_budget(
    db: impl PgExecutor<'_>,
    team: Uuid,
    period: &str,
    max_cost_usd: Option<f64>,
    max_tokens: Option<i64>,
) -> Result<BudgetRow, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO team_budgets (team_id, period, max_cost_usd, max_tokens, updated_at)
         VALUES ($1, $2, $3, $4, now())
         ON CONFLICT (team_id) DO UPDATE
            SET period = EXCLUDED.period, max_cost_usd = EXCLUDED.max_cost_usd,
                max_tokens = EXCLUDED.max_tokens, updated_at = now()
         RETURNING team_id, period, max_cost_usd, max_tokens, updated_at",
    )
    .bind(team)
    .bind(period)
    .bind(max_cost_usd)
    .bind(max_tokens)
    .fetch_one(db)
    .await
}

/// Give `child` the service token its `parent` was created with, if any: an agent's own
/// token acts for whoever its agent acts for, so a child's spend is theirs too.
pub async fn inherit_service_token(
    db: impl PgExecutor<'_>,
    child: Uuid,
    parent: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO agent_service_tokens (agent_id, token_id)
         SELECT $1, token_id FROM agent_service_tokens WHERE agent_id = $2
         ON CONFLICT (agent_id) DO NOTHING",
    )
    .bind(child)
    .bind(parent)
    .execute(db)
    .await?;
    Ok(())
}

/// Remember that `agent` was created with the service token `token`.
pub async fn set_agent_service_token(
    db: impl PgExecutor<'_>,
    agent: Uuid,
    token: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO agent_service_tokens (agent_id, token_id) VALUES ($1, $2)
         ON CONFLICT (agent_id) DO NOTHING",
    )
    .bind(agent)
    .bind(token)
    .execute(db)
    .await?;
    Ok(())
}

#[derive(Debug, Clone, Default, FromRow)]
pub struct CapsRow {
    pub max_cost_usd: Option<f64>,
    pub max_turns: Option<i64>,
    pub max_wall_s: Option<i64>,
}

pub async fn set_agent_caps(
    db: impl PgExecutor<'_>,
    agent: Uuid,
    caps: &CapsRow,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO agent_caps (agent_id, max_cost_usd, max_turns, max_wall_s)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (agent_id) DO UPDATE
            SET max_cost_usd = EXCLUDED.max_cost_usd, max_turns = EXCLUDED.max_turns,
                max_wall_s = EXCLUDED.max_wall_s",
    )
    .bind(agent)
    .bind(caps.max_cost_usd)
    .bind(caps.max_turns)
    .bind(caps.max_wall_s)
    .execute(db)
    .await?;
    Ok(())
}

/// Record that `team` was told of `budget` reaching `percent` in the period starting at
/// `period_start`: true the first time only.
pub async fn first_notice(
    db: impl PgExecutor<'_>,
    team: Uuid,
    period_start: DateTime<Utc>,
    budget: &str,
    percent: i32,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO budget_notices (team_id, period_start, budget, percent)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(team)
    .bind(period_start)
    .bind(budget)
    .bind(percent)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Everything the agents of a workspace spent, over its whole life.
pub async fn workspace_totals(
    db: impl PgExecutor<'_>,
    workspace: Uuid,
) -> Result<Sums, sqlx::Error> {
    sqlx::query_as(concat!("SELECT ", sums!(), " WHERE workspace_id = $1"))
        .bind(workspace)
        .fetch_one(db)
        .await
}

pub async fn set_workspace_caps(
    db: impl PgExecutor<'_>,
    workspace: Uuid,
    caps: &CapsRow,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO workspace_caps (workspace_id, max_cost_usd, max_turns, max_wall_s, updated_at)
         VALUES ($1, $2, $3, $4, now())
         ON CONFLICT (workspace_id) DO UPDATE
            SET max_cost_usd = EXCLUDED.max_cost_usd, max_turns = EXCLUDED.max_turns,
                max_wall_s = EXCLUDED.max_wall_s, updated_at = now()",
    )
    .bind(workspace)
    .bind(caps.max_cost_usd)
    .bind(caps.max_turns)
    .bind(caps.max_wall_s)
    .execute(db)
    .await?;
    Ok(())
}

pub async fn workspace_caps(
    db: impl PgExecutor<'_>,
    workspace: Uuid,
) -> Result<Option<CapsRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT max_cost_usd, max_turns, max_wall_s FROM workspace_caps WHERE workspace_id = $1",
    )
    .bind(workspace)
    .fetch_optional(db)
    .await
}

/// Every limit a turn of `agent` (of `team`) starts under, read in one statement: the
/// team's budget, the agent's caps, and the caps of its workspace with that workspace's id.
pub async fn turn_limits(
    db: impl PgExecutor<'_>,
    team: Uuid,
    agent: Uuid,
) -> Result<TurnLimits, sqlx::Error> {
    #[derive(FromRow)]
    struct Row {
        team_id: Option<Uuid>,
        period: Option<String>,
        team_cost_usd: Option<f64>,
        team_tokens: Option<i64>,
        team_updated_at: Option<DateTime<Utc>>,
        agent_caps: bool,
        agent_cost_usd: Option<f64>,
        agent_turns: Option<i64>,
        agent_wall_s: Option<i64>,
        workspace_id: Option<Uuid>,
        workspace_cost_usd: Option<f64>,
        workspace_turns: Option<i64>,
        workspace_wall_s: Option<i64>,
    }
    let r: Row = sqlx::query_as(
        "SELECT b.team_id, b.period, b.max_cost_usd AS team_cost_usd, b.max_tokens AS team_tokens,
                b.updated_at AS team_updated_at,
                ac.agent_id IS NOT NULL AS agent_caps, ac.max_cost_usd AS agent_cost_usd,
                ac.max_turns AS agent_turns, ac.max_wall_s AS agent_wall_s,
                wc.workspace_id, wc.max_cost_usd AS workspace_cost_usd,
                wc.max_turns AS workspace_turns, wc.max_wall_s AS workspace_wall_s
           FROM (SELECT 1) AS one
           LEFT JOIN team_budgets b ON b.team_id = $1
           LEFT JOIN agent_caps ac ON ac.agent_id = $2
           LEFT JOIN agents a ON a.id = $2
           LEFT JOIN workspace_caps wc ON wc.workspace_id = a.workspace_id",
    )
    .bind(team)
    .bind(agent)
    .fetch_one(db)
    .await?;
    Ok(TurnLimits {
        team: match (r.team_id, r.period, r.team_updated_at) {
            (Some(team_id), Some(period), Some(updated_at)) => Some(BudgetRow {
                team_id,
                period,
                max_cost_usd: r.team_cost_usd,
                max_tokens: r.team_tokens,
                updated_at,
            }),
            _ => None,
        },
        agent: r.agent_caps.then_some(CapsRow {
            max_cost_usd: r.agent_cost_usd,
            max_turns: r.agent_turns,
            max_wall_s: r.agent_wall_s,
        }),
        workspace: r.workspace_id.map(|id| {
            (
                id,
                CapsRow {
                    max_cost_usd: r.workspace_cost_usd,
                    max_turns: r.workspace_turns,
                    max_wall_s: r.workspace_wall_s,
                },
            )
        }),
    })
}

/// What `turn_limits` reads.
#[derive(Debug, Default)]
pub struct TurnLimits {
    pub team: Option<BudgetRow>,
    pub agent: Option<CapsRow>,
    /// The caps of the agent's workspace, with that workspace's id.
    pub workspace: Option<(Uuid, CapsRow)>,
}
