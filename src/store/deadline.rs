//! The database as the request path sees it: a pool on which every call — waiting for a
//! connection, running the statement, reading its rows — ends within one deadline. A
//! stalled database then fails a call with a timeout (`is_unavailable`, 503 at the edge)
//! instead of hanging the request, and the connection caught in the stalled statement is
//! closed rather than returned, so the pool never hands it out again; later calls open
//! fresh connections once the database answers.
//!
//! It is an `Executor`, so every store function (`impl PgExecutor`) takes it as it takes
//! a pool. Rows are read whole before they are handed out, which suits the request path's
//! bounded pages.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryFutureExt};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Describe, Either, Error, Execute, Executor, PgPool, Postgres, SqlStr};
use tokio::time::Instant;

use super::health::{StoreHealth, is_disk_full, is_unreachable};

/// A pool whose every call has a deadline.
#[derive(Clone)]
pub struct DeadlinePool {
    pool: PgPool,
    deadline: Duration,
    health: Arc<StoreHealth>,
}

impl DeadlinePool {
    pub fn new(pool: PgPool, deadline: Duration) -> Self {
        Self {
            pool,
            deadline,
            health: Arc::new(StoreHealth::new()),
        }
    }

    /// Share `health`: while it says the store is down, every call fails at once, and a
    /// call that finds the store unreachable asks it for a probe.
    pub fn with_health(mut self, health: Arc<StoreHealth>) -> Self {
        self.health = health;
        self
    }

    /// What this pool knows of the store's health.
    pub fn health(&self) -> &Arc<StoreHealth> {
        &self.health
    }

    /// The pool itself, for work that is not bounded by a request (the writer, the
    /// runtime, start-up).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
    }
}

impl fmt::Debug for DeadlinePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadlinePool")
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

/// A call that did not end in time: an I/O timeout, which `events::is_unavailable`
/// classifies as the store being unavailable.
fn stalled(deadline: Duration) -> Error {
    Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the database did not answer within {} ms",
            deadline.as_millis()
        ),
    ))
}

/// A connection of `pool`, if one comes before `until`; none at all while the store is
/// known to be down.
async fn acquire(
    pool: &PgPool,
    health: &StoreHealth,
    until: Instant,
    deadline: Duration,
) -> Result<PoolConnection<Postgres>, Error> {
    if health.is_down() {
        return Err(health.down_error());
    }
    match tokio::time::timeout_at(until, pool.acquire()).await {
        Ok(conn) => conn,
        Err(_) => Err(stalled(deadline)),
    }
}

/// A call failed as if the store were unreachable (or stalled): have it probed. One the
/// database refused for want of disk space marks the store full.
fn noted<T>(health: &StoreHealth, result: Result<T, Error>) -> Result<T, Error> {
    if let Err(e) = &result {
        if is_unreachable(e) {
            health.suspect();
        } else if is_disk_full(e) {
            health.disk_full(&e.to_string());
        }
    }
    result
}

/// The statement on `conn` did not end in time. It may still run, or the server may
/// answer it later: the connection's state is unknown, so it is closed, not reused.
fn expire(mut conn: PoolConnection<Postgres>, deadline: Duration) -> Error {
    conn.close_on_drop();
    stalled(deadline)
}

/// Every method is the same three steps: a connection within the deadline, the call on
/// it within what is left, and on expiry the connection closed.
impl<'p> Executor<'p> for &'p DeadlinePool {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let (pool, deadline, health) = (self.pool.clone(), self.deadline, self.health.clone());
        async move {
            let until = Instant::now() + deadline;
            let mut conn = noted(&health, acquire(&pool, &health, until, deadline).await)?;
            let items =
                tokio::time::timeout_at(until, conn.fetch_many(query).collect::<Vec<_>>()).await;
            match items {
                Ok(items) => {
                    if let Some(Err(e)) = items.iter().find(|i| i.is_err()) {
                        if is_unreachable(e) {
                            health.suspect();
                        } else if is_disk_full(e) {
                            health.disk_full(&e.to_string());
                        }
                    }
                    Ok(futures::stream::iter(items))
                }
                Err(_) => noted(&health, Err(expire(conn, deadline))),
            }
        }
        .try_flatten_stream()
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let (pool, deadline, health) = (self.pool.clone(), self.deadline, self.health.clone());
        async move {
            let until = Instant::now() + deadline;
            let mut conn = noted(&health, acquire(&pool, &health, until, deadline).await)?;
            let row = tokio::time::timeout_at(until, conn.fetch_optional(query)).await;
            match row {
                Ok(row) => noted(&health, row),
                Err(_) => noted(&health, Err(expire(conn, deadline))),
            }
        }
        .boxed()
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, Error>>
    where
        'p: 'e,
    {
        let (pool, deadline, health) = (self.pool.clone(), self.deadline, self.health.clone());
        async move {
            let until = Instant::now() + deadline;
            let mut conn = noted(&health, acquire(&pool, &health, until, deadline).await)?;
            let statement =
                tokio::time::timeout_at(until, conn.prepare_with(sql, parameters)).await;
            match statement {
                Ok(statement) => noted(&health, statement),
                Err(_) => noted(&health, Err(expire(conn, deadline))),
            }
        }
        .boxed()
    }

    fn describe<'e>(self, sql: SqlStr) -> BoxFuture<'e, Result<Describe<Postgres>, Error>>
    where
        'p: 'e,
    {
        let (pool, deadline, health) = (self.pool.clone(), self.deadline, self.health.clone());
        async move {
            let until = Instant::now() + deadline;
            let mut conn = noted(&health, acquire(&pool, &health, until, deadline).await)?;
            let described = tokio::time::timeout_at(until, conn.describe(sql)).await;
            match described {
                Ok(described) => noted(&health, described),
                Err(_) => noted(&health, Err(expire(conn, deadline))),
            }
        }
        .boxed()
    }
}
