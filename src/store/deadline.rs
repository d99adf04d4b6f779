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
use sqlx::error::BoxDynError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
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

/// A statement taken apart (its SQL, its arguments), so that it can be sent again.
#[derive(Clone)]
struct Statement {
    sql: SqlStr,
    arguments: Option<PgArguments>,
    persistent: bool,
}

impl Statement {
    fn of<'q>(mut query: impl Execute<'q, Postgres>) -> Result<Self, Error> {
        let arguments = query.take_arguments().map_err(Error::Encode)?;
        let persistent = query.persistent();
        Ok(Self {
            sql: query.sql(),
            arguments,
            persistent,
        })
    }
}

impl Execute<'_, Postgres> for Statement {
    fn sql(self) -> SqlStr {
        self.sql
    }

    fn statement(&self) -> Option<&PgStatement> {
        None
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, BoxDynError> {
        Ok(self.arguments.take())
    }

    fn persistent(&self) -> bool {
        self.persistent
    }
}

/// Words after which a statement is not a plain read: it writes, locks, takes a value
/// from a sequence, notifies, or calls a function of ours.
const NOT_READS: &[&str] = &[
    "insert",
    "update",
    "delete",
    "merge",
    "truncate",
    "into",
    "for",
    "lock",
    "nextval",
    "setval",
    "notify",
    "listen",
    "copy",
    "call",
    "do",
    "set_config",
];
const NOT_READ_PREFIXES: &[&str] = &[
    "pg_advisory",
    "pg_try_advisory",
    "pg_notify",
    "pg_terminate",
    "pg_cancel",
    "pg_reload",
    "agentry_",
];

/// Whether `sql` is one statement that only reads: a `SELECT` (or `WITH … SELECT`) that
/// names nothing in `NOT_READS`. It errs on the safe side: a word in a string literal or a
/// comment makes a read count as a write, which is then simply not sent again.
fn only_reads(sql: &str) -> bool {
    let sql = sql.trim().trim_end_matches(';');
    if sql.contains(';') {
        return false;
    }
    // Words of ASCII letters, digits and `_` (anything else separates them).
    let mut words = sql
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty());
    if !words.next().is_some_and(|first| {
        first.eq_ignore_ascii_case("select") || first.eq_ignore_ascii_case("with")
    }) {
        return false;
    }
    words.all(|w| {
        !NOT_READS.iter().any(|n| w.eq_ignore_ascii_case(n))
            && !NOT_READ_PREFIXES
                .iter()
                .any(|p| w.len() >= p.len() && w[..p.len()].eq_ignore_ascii_case(p))
    })
}

/// The connection itself failed: the database ended it (a restart, `pg_terminate_backend`)
/// or the socket broke. A statement it carried did not run, or ran and its answer was lost.
fn connection_broken(err: &Error) -> bool {
    match err {
        Error::Io(_) => true,
        Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            code.starts_with("08") || matches!(code, "57P01" | "57P02")
        }
        _ => false,
    }
}

/// A connection that answers a ping, within the deadline: a pooled one the database
/// ended is closed, not returned, and the next is tried. Gives up at once when the store
/// is known down meanwhile.
async fn answering(
    pool: &PgPool,
    health: &StoreHealth,
    until: Instant,
    deadline: Duration,
) -> Result<PoolConnection<Postgres>, Error> {
    loop {
        let mut conn = tokio::select! {
            conn = acquire(pool, health, until, deadline) => conn?,
            () = health.until_down() => return Err(health.down_error()),
        };
        match tokio::time::timeout_at(until, sqlx::Connection::ping(&mut *conn)).await {
            Ok(Ok(())) => return Ok(conn),
            Ok(Err(e)) if connection_broken(&e) => conn.close_on_drop(),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(expire(conn, deadline)),
        }
    }
}

/// A call on one connection: the statement sent, and its answer read whole.
type Call<T> = for<'c> fn(&'c mut PgConnection, Statement) -> BoxFuture<'c, Result<T, Error>>;

fn fetch_all_on(
    conn: &mut PgConnection,
    statement: Statement,
) -> BoxFuture<'_, Result<Items, Error>> {
    conn.fetch_many(statement)
        .collect::<Vec<_>>()
        .map(Ok)
        .boxed()
}

fn fetch_optional_on(
    conn: &mut PgConnection,
    statement: Statement,
) -> BoxFuture<'_, Result<Option<PgRow>, Error>> {
    conn.fetch_optional(statement)
}

/// A whole answer of `fetch_many`: every result and row, or the error in their place.
type Items = Vec<Result<Either<PgQueryResult, PgRow>, Error>>;

/// The first error among the items of a whole answer.
#[allow(clippy::ptr_arg)] // the shape `DeadlinePool::run` takes
fn item_error(items: &Items) -> Option<&Error> {
    items.iter().find_map(|i| i.as_ref().err())
}

fn no_item_error<T>(_: &T) -> Option<&Error> {
    None
}

impl DeadlinePool {
    /// One statement within the deadline: a connection, then `call` on it. When the
    /// connection turns out to have been ended by the database (the first use of a pooled
    /// connection after a database restart) and the statement only reads, it is sent once
    /// more, on a connection that answers, within what is left of the same deadline. A
    /// write is never sent twice (it may have run), and nothing here runs inside a
    /// transaction: those hold a connection of their own, not this pool's calls.
    async fn run<T>(
        &self,
        statement: Statement,
        call: Call<T>,
        error_in: fn(&T) -> Option<&Error>,
    ) -> Result<T, Error> {
        let (pool, health, deadline) = (&self.pool, &*self.health, self.deadline);
        let until = Instant::now() + deadline;
        let again = only_reads(statement.sql.as_str()).then(|| statement.clone());
        let mut conn = noted(health, acquire(pool, health, until, deadline).await)?;
        let answer = match tokio::time::timeout_at(until, call(&mut conn, statement)).await {
            Ok(answer) => answer,
            Err(_) => return noted(health, Err(expire(conn, deadline))),
        };
        let broken = match &answer {
            Err(e) => connection_broken(e),
            Ok(t) => error_in(t).is_some_and(connection_broken),
        };
        let Some(statement) = again.filter(|_| broken) else {
            return answered(health, answer, error_in);
        };
        conn.close_on_drop();
        drop(conn);
        // The database may be gone rather than restarted: have it probed meanwhile.
        health.suspect();
        tracing::debug!("a read met a connection the database had ended; sending it once more");
        let mut conn = noted(health, answering(pool, health, until, deadline).await)?;
        match tokio::time::timeout_at(until, call(&mut conn, statement)).await {
            Ok(answer) => answered(health, answer, error_in),
            Err(_) => noted(health, Err(expire(conn, deadline))),
        }
    }
}

/// `noted`, for an answer whose error may also sit among its items.
fn answered<T>(
    health: &StoreHealth,
    answer: Result<T, Error>,
    error_in: fn(&T) -> Option<&Error>,
) -> Result<T, Error> {
    if let Some(e) = answer.as_ref().ok().and_then(error_in) {
        if is_unreachable(e) {
            health.suspect();
        } else if is_disk_full(e) {
            health.disk_full(&e.to_string());
        }
    }
    noted(health, answer)
}

/// Every method is the same three steps: a connection within the deadline, the call on
/// it within what is left, and on expiry the connection closed. Reads are sent once more
/// when the connection they met had been ended by the database (`DeadlinePool::run`).
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
        async move {
            let items = self
                .run(Statement::of(query)?, fetch_all_on, item_error)
                .await?;
            Ok(futures::stream::iter(items))
        }
        .try_flatten_stream()
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        async move {
            self.run(Statement::of(query)?, fetch_optional_on, no_item_error)
                .await
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

#[cfg(test)]
mod tests {
    use super::only_reads;

    #[test]
    fn only_plain_reads_count_as_reads() {
        for sql in [
            "SELECT 1",
            "  select id, updated_at FROM agents WHERE id = $1;",
            "WITH t AS (SELECT * FROM teams) SELECT count(*) FROM t",
            "SELECT EXISTS (SELECT 1 FROM agent_moments)",
        ] {
            assert!(only_reads(sql), "{sql}");
        }
        for sql in [
            "INSERT INTO t VALUES (1)",
            "UPDATE agents SET status = 'idle'",
            "WITH d AS (DELETE FROM t RETURNING id) SELECT * FROM d",
            "SELECT * FROM agents FOR UPDATE",
            "SELECT id FROM q FOR NO KEY UPDATE SKIP LOCKED",
            "SELECT * INTO copy FROM t",
            "SELECT nextval('s')",
            "SELECT pg_advisory_xact_lock(1)",
            "SELECT pg_notify('c', 'x')",
            "SELECT agentry_insert_events_each($1)",
            "SELECT 1; DELETE FROM t",
            "BEGIN",
            "",
        ] {
            assert!(!only_reads(sql), "{sql}");
        }
    }
}
