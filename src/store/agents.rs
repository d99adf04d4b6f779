//! Agents: one provider session each, with its status, persistence handle and the
//! summary of its last turn. The timeline itself is in `events`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct AgentRow {
    pub id: Uuid,
    pub workspace_id: Uuid,
    pub team_id: Uuid,
    pub project_id: Uuid,
    pub workspace_path: String,
    /// The workspace is archived: its files are gone, so the agent cannot run again.
    pub workspace_archived: bool,
    pub provider: String,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub title: Option<String>,
    pub labels: Value,
    pub system_prompt: Option<String>,
    pub mcp_servers: Value,
    pub status: String,
    pub status_reason: Option<String>,
    pub last_seq: i64,
    pub persistence: Option<Value>,
    pub provider_session_id: Option<String>,
    pub last_turn_id: Option<Uuid>,
    pub last_turn_outcome: Option<String>,
    pub last_turn_error: Option<String>,
    pub created_by: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub archived_at: Option<DateTime<Utc>>,
    pub pending_permissions: i64,
    /// The replica running it: the holder of a lease that has not run out.
    pub owner_replica: Option<String>,
    /// The agent whose token created it.
    pub parent_agent_id: Option<Uuid>,
    /// How far below a root agent it is (0: a person or a bot created it).
    pub depth: i32,
    /// Its children that are not archived, and all of them.
    pub live_children: i64,
    pub children: i64,
    /// It is given agentry's own MCP server at launch (unless its team turned it off).
    pub agentry_mcp: bool,
    pub creator_role: Option<String>,
}

macro_rules! select_agents {
    ($where:literal) => {
        concat!(
            "SELECT a.id, a.workspace_id, a.team_id, w.project_id, w.path AS workspace_path,
                    w.archived_at IS NOT NULL AS workspace_archived, a.provider, a.model, a.mode,
                    a.title, a.labels, a.system_prompt, a.mcp_servers, a.status, a.status_reason,
                    COALESCE((SELECT max(e.seq) FROM agent_events e WHERE e.agent_id = a.id), 0) AS last_seq,
                    a.persistence, a.provider_session_id, a.last_turn_id, a.last_turn_outcome, a.last_turn_error,
                    a.created_by, a.created_at, a.archived_at,
                    (SELECT count(*) FROM permission_requests p WHERE p.agent_id = a.id AND p.status = 'pending')
                        AS pending_permissions,
                    a.parent_agent_id, a.depth, a.agentry_mcp, a.creator_role,
                    (SELECT count(*) FROM agents c WHERE c.parent_agent_id = a.id AND c.archived_at IS NULL)
                        AS live_children,
                    (SELECT count(*) FROM agents c WHERE c.parent_agent_id = a.id) AS children,
                    CASE WHEN ",
            lease_live!("a"),
            " THEN a.owner_replica END AS owner_replica
             FROM agents a JOIN workspaces w ON w.id = a.workspace_id ",
            $where
        )
    };
}

pub struct NewAgent<'a> {
    pub id: Uuid,
    pub workspace_id: Uuid,
    pub team_id: Uuid,
    pub provider: &'a str,
    pub model: Option<&'a str>,
    pub mode: Option<&'a str>,
    pub title: Option<&'a str>,
    pub labels: &'a Value,
    pub system_prompt: Option<&'a str>,
    pub mcp_servers: &'a Value,
    pub created_by: Uuid,
    /// The replica that runs it, and for how many seconds the agent's own lease lasts.
    pub owner: (&'a str, i64),
    pub parent_agent_id: Option<Uuid>,
    pub depth: i32,
    pub agentry_mcp: bool,
    pub creator_role: Option<&'a str>,
}

pub async fn insert(db: impl PgExecutor<'_>, a: NewAgent<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO agents (id, workspace_id, team_id, provider, model, mode, title, labels, system_prompt,
                             mcp_servers, status, created_by, owner_replica, lease_expires_at,
                             parent_agent_id, depth, agentry_mcp, creator_role)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'starting', $11, $12,
                 now() + make_interval(secs => $13), $14, $15, $16, $17)",
    )
    .bind(a.id)
    .bind(a.workspace_id)
    .bind(a.team_id)
    .bind(a.provider)
    .bind(a.model)
    .bind(a.mode)
    .bind(a.title)
    .bind(a.labels)
    .bind(a.system_prompt)
    .bind(a.mcp_servers)
    .bind(a.created_by)
    .bind(a.owner.0)
    .bind(a.owner.1 as f64)
    .bind(a.parent_agent_id)
    .bind(a.depth)
    .bind(a.agentry_mcp)
    .bind(a.creator_role)
    .execute(db)
    .await
    .map(|_| ())
}

pub async fn get(
    db: impl PgExecutor<'_>,
    id: Uuid,
    teams: Option<&[Uuid]>,
) -> Result<Option<AgentRow>, sqlx::Error> {
    sqlx::query_as(select_agents!(
        "WHERE a.id = $1 AND ($2::uuid[] IS NULL OR a.team_id = ANY($2))"
    ))
    .bind(id)
    .bind(teams)
    .fetch_optional(db)
    .await
}

pub struct AgentFilter<'a> {
    pub teams: Option<&'a [Uuid]>,
    pub workspace_id: Option<Uuid>,
    pub status: Option<&'a str>,
    /// `{"key": "value"}` containment on labels.
    pub labels: Option<&'a Value>,
    pub include_archived: bool,
    /// Only the children of this agent.
    pub parent_agent_id: Option<Uuid>,
    /// Only these agents.
    pub only: Option<&'a [Uuid]>,
    /// None of these agents.
    pub except: Option<&'a [Uuid]>,
    pub after: Option<Uuid>,
    pub limit: i64,
}

pub async fn list(
    db: impl PgExecutor<'_>,
    f: AgentFilter<'_>,
) -> Result<Vec<AgentRow>, sqlx::Error> {
    sqlx::query_as(select_agents!(
        "WHERE ($1::uuid[] IS NULL OR a.team_id = ANY($1)) AND ($2::uuid IS NULL OR a.workspace_id = $2)
           AND ($3::text IS NULL OR a.status = $3) AND ($4::jsonb IS NULL OR a.labels @> $4)
           AND ($5 OR a.archived_at IS NULL) AND ($6::uuid IS NULL OR a.id > $6)
           AND ($8::uuid IS NULL OR a.parent_agent_id = $8)
           AND ($9::uuid[] IS NULL OR a.id = ANY($9)) AND ($10::uuid[] IS NULL OR a.id <> ALL($10))
         ORDER BY a.id LIMIT $7"
    ))
    .bind(f.teams)
    .bind(f.workspace_id)
    .bind(f.status)
    .bind(f.labels)
    .bind(f.include_archived)
    .bind(f.after)
    .bind(f.limit)
    .bind(f.parent_agent_id)
    .bind(f.only)
    .bind(f.except)
    .fetch_all(db)
    .await
}

pub async fn ids_in_workspace(
    db: impl PgExecutor<'_>,
    workspace_id: Uuid,
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM agents WHERE workspace_id = $1")
        .bind(workspace_id)
        .fetch_all(db)
        .await
}

/// Store the provider's session id and persistence handle. With `epoch` (the fence of the
/// actor that writes them) only while the agent's lease is still in that epoch: false when
/// another replica took the agent over meanwhile and nothing was written.
pub async fn set_session(
    db: impl PgExecutor<'_>,
    id: Uuid,
    provider_session_id: Option<&str>,
    persistence: Option<&Value>,
    epoch: Option<i64>,
) -> Result<bool, sqlx::Error> {
    sqlx::query(
        "UPDATE agents SET provider_session_id = COALESCE($2, provider_session_id),
                           persistence = COALESCE($3, persistence)
          WHERE id = $1 AND ($4::int8 IS NULL OR lease_epoch = $4)",
    )
    .bind(id)
    .bind(provider_session_id)
    .bind(persistence)
    .bind(epoch)
    .execute(db)
    .await
    .map(|r| r.rows_affected() > 0)
}

pub async fn mark_archived(db: impl PgExecutor<'_>, id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE agents SET archived_at = COALESCE(archived_at, now()) WHERE id = $1")
        .bind(id)
        .execute(db)
        .await
        .map(|_| ())
}

/// The descendants of `id` that are not archived, deepest first (so each is archived
/// before its parent).
pub async fn live_descendants(db: impl PgExecutor<'_>, id: Uuid) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH RECURSIVE tree (id, depth) AS (
             SELECT id, 1 FROM agents WHERE parent_agent_id = $1 AND archived_at IS NULL
             UNION ALL
             SELECT a.id, t.depth + 1 FROM agents a JOIN tree t ON a.parent_agent_id = t.id
             WHERE a.archived_at IS NULL AND t.depth < 1000
         )
         SELECT id FROM tree ORDER BY depth DESC, id",
    )
    .bind(id)
    .fetch_all(db)
    .await
}

/// Children of `parent` that are not archived.
pub async fn live_children(db: impl PgExecutor<'_>, parent: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM agents WHERE parent_agent_id = $1 AND archived_at IS NULL",
    )
    .bind(parent)
    .fetch_one(db)
    .await
}

/// The first of `candidates` that is a child of `parent` (its `parent_agent_id`).
pub async fn child_among(
    db: impl PgExecutor<'_>,
    parent: Uuid,
    candidates: &[Uuid],
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT c.id FROM unnest($2::uuid[]) WITH ORDINALITY AS k(id, n)
         JOIN agents c ON c.id = k.id AND c.parent_agent_id = $1
         ORDER BY k.n LIMIT 1",
    )
    .bind(parent)
    .bind(candidates)
    .fetch_optional(db)
    .await
}

/// Agents of `team` created by other agents that are not archived.
pub async fn live_team_children(db: impl PgExecutor<'_>, team: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM agents
         WHERE team_id = $1 AND parent_agent_id IS NOT NULL AND archived_at IS NULL",
    )
    .bind(team)
    .fetch_one(db)
    .await
}

/// Agents a previous run of this server left open (not closed), for the boot reconciler.
#[derive(Debug, Clone, FromRow)]
pub struct OpenAgent {
    pub id: Uuid,
    pub team_id: Uuid,
    pub workspace_id: Uuid,
    pub status: String,
    pub last_turn_id: Option<Uuid>,
    pub last_turn_outcome: Option<String>,
    /// The lease epoch read with it: what closing it is written under (see
    /// `runtime::abandon_agent`).
    pub lease_epoch: i64,
}

/// Open agents that `replica` holds, or that nobody holds.
pub async fn open_agents(
    db: impl PgExecutor<'_>,
    replica: &str,
) -> Result<Vec<OpenAgent>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, workspace_id, status, last_turn_id, last_turn_outcome, lease_epoch
           FROM agents
         WHERE (status <> 'closed' OR (last_turn_id IS NOT NULL AND last_turn_outcome IS NULL))
           AND (owner_replica IS NULL OR owner_replica = $1)",
    )
    .bind(replica)
    .fetch_all(db)
    .await
}

/// One agent as the reconciler sees it (open or not).
pub async fn open_agent(
    db: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<OpenAgent>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, team_id, workspace_id, status, last_turn_id, last_turn_outcome, lease_epoch
           FROM agents
         WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// Agents not archived, counted by provider and status.
pub async fn count_by_provider_and_status(
    db: impl PgExecutor<'_>,
) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT provider, status, count(*) FROM agents WHERE archived_at IS NULL
         GROUP BY provider, status ORDER BY provider, status",
    )
    .fetch_all(db)
    .await
}
