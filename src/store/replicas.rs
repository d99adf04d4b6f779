//! Replicas and agent leases: each running server has a row in `replicas` whose lease it
//! renews; each live agent is owned by one replica through `agents.owner_replica`. An
//! agent's lease is its owner's (`replicas.lease_expires_at`), or its own
//! (`agents.lease_expires_at`, set when it is claimed) while that has not run out. Replicas
//! of the previous version know only the agent's own lease: while one runs, the others
//! renew that too (`Renewal::EveryAgent`).

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow)]
pub struct ReplicaRow {
    pub id: String,
    pub advertise_url: String,
    pub started_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
    /// Agents this replica holds a lease on.
    pub agents: i64,
}

/// Register `id` (again, after a restart: its start time is reset), with a lease of
/// `ttl_s` seconds.
pub async fn register(
    db: impl PgExecutor<'_>,
    id: &str,
    url: &str,
    ttl_s: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO replicas (id, advertise_url, lease_expires_at)
         VALUES ($1, $2, now() + make_interval(secs => $3))
         ON CONFLICT (id) DO UPDATE SET advertise_url = $2, started_at = now(), last_seen_at = now(),
                                        lease_expires_at = now() + make_interval(secs => $3)",
    )
    .bind(id)
    .bind(url)
    .bind(ttl_s as f64)
    .execute(db)
    .await
    .map(|_| ())
}

/// Say `id` is alive and renew its lease, and so the leases of the agents it owns;
/// registers it again if another replica had given it up for dead.
pub async fn heartbeat(
    db: impl PgExecutor<'_>,
    id: &str,
    url: &str,
    ttl_s: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO replicas (id, advertise_url, lease_expires_at)
         VALUES ($1, $2, now() + make_interval(secs => $3))
         ON CONFLICT (id) DO UPDATE SET last_seen_at = now(),
                                        lease_expires_at = now() + make_interval(secs => $3)",
    )
    .bind(id)
    .bind(url)
    .bind(ttl_s as f64)
    .execute(db)
    .await
    .map(|_| ())
}

/// How a replica renews the leases of the agents it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Its own lease is theirs: it only checks that they are still its own.
    Replica,
    /// Each agent's own lease is renewed too, for replicas of the previous version.
    EveryAgent,
}

/// `Renewal::EveryAgent` while a replica other than `me` that knows only agents' own
/// leases (one of the previous version: it leaves `lease_expires_at` unset, or lets
/// `last_seen_at` pass it) was seen within `ttl_s` seconds.
pub async fn renewal(
    db: impl PgExecutor<'_>,
    me: &str,
    ttl_s: i64,
) -> Result<Renewal, sqlx::Error> {
    let previous: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM replicas WHERE id <> $1
                          AND last_seen_at > now() - make_interval(secs => $2)
                          AND (lease_expires_at IS NULL OR last_seen_at > lease_expires_at))",
    )
    .bind(me)
    .bind(ttl_s as f64)
    .fetch_one(db)
    .await?;
    Ok(if previous {
        Renewal::EveryAgent
    } else {
        Renewal::Replica
    })
}

pub async fn unregister(db: impl PgExecutor<'_>, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM replicas WHERE id = $1")
        .bind(id)
        .execute(db)
        .await
        .map(|_| ())
}

/// Every registered replica, with the number of agents it holds, oldest first.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<ReplicaRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.advertise_url, r.started_at, r.last_seen_at,
                (SELECT count(*) FROM agents a WHERE a.owner_replica = r.id) AS agents
           FROM replicas r ORDER BY r.started_at, r.id",
    )
    .fetch_all(db)
    .await
}

/// Whether a replica other than `me` was seen within `ttl_s` seconds.
pub async fn peers_alive(
    db: impl PgExecutor<'_>,
    me: &str,
    ttl_s: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM replicas WHERE id <> $1
                          AND last_seen_at > now() - make_interval(secs => $2))",
    )
    .bind(me)
    .bind(ttl_s as f64)
    .fetch_one(db)
    .await
}

/// Whether any replica other than `me` is registered (alive, or not yet taken over).
pub async fn others_registered(db: impl PgExecutor<'_>, me: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM replicas WHERE id <> $1)")
        .bind(me)
        .fetch_one(db)
        .await
}

/// Replicas other than `me` not seen for `ttl_s` seconds.
pub async fn silent(
    db: impl PgExecutor<'_>,
    me: &str,
    ttl_s: i64,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM replicas WHERE id <> $1
            AND last_seen_at < now() - make_interval(secs => $2) ORDER BY id",
    )
    .bind(me)
    .bind(ttl_s as f64)
    .fetch_all(db)
    .await
}

/// Forget a silent replica once nothing refers to it any more.
pub async fn forget_if_idle(db: impl PgExecutor<'_>, id: &str) -> Result<bool, sqlx::Error> {
    sqlx::query(
        "DELETE FROM replicas r WHERE r.id = $1
            AND NOT EXISTS (SELECT 1 FROM agents a WHERE a.owner_replica = r.id)
            AND NOT EXISTS (SELECT 1 FROM managed_processes p WHERE p.replica = r.id)",
    )
    .bind(id)
    .execute(db)
    .await
    .map(|r| r.rows_affected() > 0)
}

/// What stands in the way of `me` leasing an agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The lease is `me`'s now, in this epoch (the fencing token its writes carry).
    Taken {
        epoch: i64,
    },
    /// Another replica holds it; `expired` when its lease ran out unrenewed.
    Held {
        owner: String,
        expired: bool,
    },
    NotFound,
}

/// Lease agent `id` to `me` for `ttl_s` seconds, unless another replica holds it. Taking
/// an agent nobody holds starts a new epoch: whoever held it before (and may still have
/// writes on their way) is fenced off. Claiming it again while `me` holds it keeps the
/// epoch of the actor that runs it.
pub async fn claim(
    db: impl PgExecutor<'_> + Copy,
    id: Uuid,
    me: &str,
    ttl_s: i64,
) -> Result<Claim, sqlx::Error> {
    let taken: Option<i64> = sqlx::query_scalar(
        "UPDATE agents SET owner_replica = $2, lease_expires_at = now() + make_interval(secs => $3),
                           lease_epoch = lease_epoch + CASE WHEN owner_replica IS NULL THEN 1 ELSE 0 END
          WHERE id = $1 AND (owner_replica IS NULL OR owner_replica = $2)
          RETURNING lease_epoch",
    )
    .bind(id)
    .bind(me)
    .bind(ttl_s as f64)
    .fetch_optional(db)
    .await?;
    if let Some(epoch) = taken {
        return Ok(Claim::Taken { epoch });
    }
    let row: Option<(Option<String>, bool)> = sqlx::query_as(concat!(
        "SELECT a.owner_replica, NOT ",
        lease_live!("a"),
        " FROM agents a WHERE a.id = $1"
    ))
    .bind(id)
    .fetch_optional(db)
    .await?;
    Ok(match row {
        None => Claim::NotFound,
        Some((None, _)) => Claim::Held {
            owner: String::new(),
            expired: true,
        },
        Some((Some(owner), expired)) => Claim::Held { owner, expired },
    })
}

/// Take agent `id` over from `owner`, whose lease expired: the new epoch when `me` holds
/// it now.
/// The agent's epoch grows: from this commit on, the event writer refuses every batch
/// `owner` sends for it (see `events::writer`), however late it arrives.
///
/// The owner's row in `replicas` is locked (shared) until this commits: a heartbeat of the
/// owner at the same moment either renews its lease first (and the agent is left to it) or
/// waits for the takeover, and the owner's check that follows its heartbeat then finds the
/// agent gone.
pub async fn take_over(
    db: impl PgExecutor<'_>,
    id: Uuid,
    owner: &str,
    me: &str,
    ttl_s: i64,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH holder AS MATERIALIZED (
            SELECT lease_expires_at FROM replicas WHERE id = $2 FOR SHARE
         )
         UPDATE agents SET owner_replica = $3, lease_expires_at = now() + make_interval(secs => $4),
                           lease_epoch = lease_epoch + 1
          WHERE id = $1 AND owner_replica = $2 AND coalesce(lease_expires_at < now(), true)
            AND NOT EXISTS (SELECT 1 FROM holder WHERE lease_expires_at > now())
          RETURNING lease_epoch",
    )
    .bind(id)
    .bind(owner)
    .bind(me)
    .bind(ttl_s as f64)
    .fetch_optional(db)
    .await
}

/// How `renew` treats an agent row another transaction has locked (the event writer's,
/// writing the agent's turn or status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// Leave it out: it is neither renewed nor returned.
    Skip,
    /// Wait for it.
    Wait,
}

/// Renew the agents' own leases of `me` on `ids` (taking those nobody holds); returns the
/// ids renewed. Those left out were taken over or archived meanwhile (they must stop too),
/// or, with `Busy::Skip`, locked by another transaction.
///
/// The rows are locked in id order first, like every statement that locks several agent
/// rows (the event writer's batch), so two of them never wait on each other in a cycle.
pub async fn renew(
    db: impl PgExecutor<'_>,
    me: &str,
    ids: &[Uuid],
    ttl_s: i64,
    busy: Busy,
) -> Result<Vec<Uuid>, sqlx::Error> {
    let lock = match busy {
        Busy::Skip => "FOR NO KEY UPDATE SKIP LOCKED",
        Busy::Wait => "FOR NO KEY UPDATE",
    };
    let query = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "WITH locked AS MATERIALIZED (
            SELECT id FROM agents WHERE id = ANY($2) ORDER BY id {lock}
         )
         UPDATE agents SET owner_replica = $1, lease_expires_at = now() + make_interval(secs => $3)
          WHERE id IN (SELECT id FROM locked) AND (owner_replica IS NULL OR owner_replica = $1)
            AND archived_at IS NULL
            AND NOT EXISTS (SELECT 1 FROM workspaces w
                             WHERE w.id = agents.workspace_id AND w.archived_at IS NOT NULL)
          RETURNING id"
    )));
    query
        .bind(me)
        .bind(ids)
        .bind(ttl_s as f64)
        .fetch_all(db)
        .await
}

/// Which of `ids` are still `me`'s to run, read without locking anything: `(id, owned)`,
/// where `owned` is false for an agent nobody holds (`renew` takes it). Those left out were
/// taken over or archived meanwhile.
pub async fn held(
    db: impl PgExecutor<'_>,
    me: &str,
    ids: &[Uuid],
) -> Result<Vec<(Uuid, bool)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT a.id, a.owner_replica IS NOT NULL FROM agents a
          WHERE a.id = ANY($2) AND (a.owner_replica IS NULL OR a.owner_replica = $1)
            AND a.archived_at IS NULL
            AND NOT EXISTS (SELECT 1 FROM workspaces w
                             WHERE w.id = a.workspace_id AND w.archived_at IS NOT NULL)",
    )
    .bind(me)
    .bind(ids)
    .fetch_all(db)
    .await
}

/// Who holds agent `id`'s lease (whether or not it ran out) and its epoch; None when there
/// is no such agent.
pub async fn lease_of(
    db: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<(Option<String>, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT owner_replica, lease_epoch FROM agents WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await
}

/// Give up `me`'s lease on `id` (no-op when another replica holds it).
pub async fn release(db: impl PgExecutor<'_>, id: Uuid, me: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE agents SET owner_replica = NULL, lease_expires_at = NULL
          WHERE id = $1 AND owner_replica = $2",
    )
    .bind(id)
    .bind(me)
    .execute(db)
    .await
    .map(|_| ())
}

/// Take agent `id` back for the actor that runs it here in `epoch`, after a release of
/// `me` raced with that actor's start: only while nobody else took it meanwhile (its
/// epoch is still `epoch`), and without starting a new epoch. True when `me` holds it.
pub async fn reclaim(
    db: impl PgExecutor<'_>,
    id: Uuid,
    me: &str,
    epoch: i64,
    ttl_s: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query(
        "UPDATE agents SET owner_replica = $2, lease_expires_at = now() + make_interval(secs => $4)
          WHERE id = $1 AND (owner_replica IS NULL OR owner_replica = $2) AND lease_epoch = $3",
    )
    .bind(id)
    .bind(me)
    .bind(epoch)
    .bind(ttl_s as f64)
    .execute(db)
    .await
    .map(|r| r.rows_affected() > 0)
}

/// Give up every lease of `me` (rows locked in id order, as in `renew`).
pub async fn release_all(db: impl PgExecutor<'_>, me: &str) -> Result<u64, sqlx::Error> {
    sqlx::query(
        "WITH locked AS MATERIALIZED (
            SELECT id FROM agents WHERE owner_replica = $1 ORDER BY id FOR NO KEY UPDATE
         )
         UPDATE agents SET owner_replica = NULL, lease_expires_at = NULL
          WHERE id IN (SELECT id FROM locked) AND owner_replica = $1",
    )
    .bind(me)
    .execute(db)
    .await
    .map(|r| r.rows_affected())
}

/// Leases held by replicas other than `me` that ran out unrenewed: `(agent, owner)`.
pub async fn expired(
    db: impl PgExecutor<'_>,
    me: &str,
) -> Result<Vec<(Uuid, String)>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT a.id, a.owner_replica FROM agents a
          WHERE a.owner_replica IS NOT NULL AND a.owner_replica <> $1 AND NOT ",
        lease_live!("a"),
        " ORDER BY a.id"
    ))
    .bind(me)
    .fetch_all(db)
    .await
}

/// Where to reach the replica that holds a live lease on agent `id`, when it is not `me`.
pub async fn remote_owner(
    db: impl PgExecutor<'_>,
    id: Uuid,
    me: &str,
) -> Result<Option<(String, String)>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT r.id, r.advertise_url FROM agents a JOIN replicas r ON r.id = a.owner_replica
          WHERE a.id = $1 AND a.owner_replica <> $2 AND ",
        lease_live!("a")
    ))
    .bind(id)
    .bind(me)
    .fetch_optional(db)
    .await
}

/// The agents of workspace `ws` that replicas other than `me` run, with where to reach them.
pub async fn remote_agents_in_workspace(
    db: impl PgExecutor<'_>,
    ws: Uuid,
    me: &str,
) -> Result<Vec<(Uuid, String)>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT a.id, r.advertise_url FROM agents a JOIN replicas r ON r.id = a.owner_replica
          WHERE a.workspace_id = $1 AND a.owner_replica <> $2 AND ",
        lease_live!("a"),
        " ORDER BY a.id"
    ))
    .bind(ws)
    .bind(me)
    .fetch_all(db)
    .await
}

/// The replicas seen within `ttl_s` seconds with the number of agents each runs, fewest
/// first (ties: by id).
pub async fn loads(
    db: impl PgExecutor<'_>,
    ttl_s: i64,
) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT r.id, r.advertise_url,
                (SELECT count(*) FROM agents a WHERE a.owner_replica = r.id AND ",
        lease_live!("a"),
        ") AS agents
           FROM replicas r WHERE r.last_seen_at > now() - make_interval(secs => $1)
          ORDER BY agents, r.id"
    ))
    .bind(ttl_s as f64)
    .fetch_all(db)
    .await
}
