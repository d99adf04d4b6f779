//! SQL, grouped by aggregate; every function takes an executor or a transaction.
//! Visibility is part of every query that lists or loads a team resource: `teams` is the
//! caller's team ids, or `None` for a server admin who sees every team.

/// SQL: the lease of the agent row aliased `$a` has not run out: its owner replica's
/// lease, or the agent's own (see `replicas`). True or false, never NULL (an agent without
/// a lease of its own, or without an owner, has none that lasts).
macro_rules! lease_live {
    ($a:literal) => {
        concat!(
            "(coalesce(",
            $a,
            ".lease_expires_at > now(), false) OR EXISTS (SELECT 1 FROM replicas lr WHERE lr.id = ",
            $a,
            ".owner_replica AND lr.lease_expires_at > now()))"
        )
    };
}

pub mod agents;
pub mod audit;
pub mod bounds;
pub mod deadline;
pub mod device_codes;
pub mod events;
pub mod health;
pub mod hooks;
pub mod idempotency;
pub mod identity;
pub mod oidc;
pub mod permissions;
pub mod processes;
pub mod projects;
pub mod queue;
pub mod replica_lock;
pub mod replicas;
pub mod sealed;
pub mod secrets;
pub mod team_network;
pub mod teams;
pub mod triggers;
pub mod usage;
pub mod workspace_remotes;
pub mod workspaces;

pub use deadline::DeadlinePool;
pub use health::StoreHealth;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{PgExecutor, PgPool};

/// Migrations embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// How long a query waits for a connection before it fails (`PoolTimedOut`, answered as
/// 503 `store_unavailable`): an unreachable or stalled database must not hang requests.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections the event writer holds beside the shared pool: two batches committing at
/// once, and one to read where a timeline ends.
pub const WRITER_CONNECTIONS: u32 = 3;

/// A pooled connection idle for longer than this is pinged before it is handed out.
pub const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

/// Connect a pool with the settings every agentry pool shares.
pub async fn connect(
    options: PgConnectOptions,
    max_connections: u32,
) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .min_connections(1)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        // A ping before every query doubled the round trips of the request path and of
        // each commit of the event writer. A connection that answered within the last
        // second is handed out as is (should it have broken since, its query fails like
        // any query cut off mid-way); one idle longer, as after a database restart, is
        // pinged first and replaced when it does not answer.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IDLE_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
}

/// Apply pending migrations (they take an advisory lock, so replicas can race safely).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// The newest migration applied successfully, if any.
pub async fn applied_migration(db: impl PgExecutor<'_>) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
        .fetch_one(db)
        .await
}

/// A connection of its own listening on `channel`, tried again every second until it is;
/// `what` names what it listens for in the warnings.
pub async fn listener(pool: &PgPool, channel: &str, what: &str) -> PgListener {
    loop {
        match PgListener::connect_with(pool).await {
            Ok(mut l) => match l.listen(channel).await {
                Ok(()) => return l,
                Err(e) => tracing::warn!(error = %e, "cannot listen for {what}; retrying"),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot connect to listen for {what}; retrying")
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
