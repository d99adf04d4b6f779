//! Whether the database is known to be down, and why. A request that finds the store
//! unreachable asks for a probe; a probe that fails marks it down, and while it is down a
//! probe runs every `PROBE_EVERY` until one succeeds. While it is known down, the request
//! path's calls fail at once (`DeadlinePool`) instead of each waiting for a connection, so
//! clients get their 503 in milliseconds and know when to come back (`Retry-After`).
//!
//! Whoever knows more than a probe can tell (the supervisor of the embedded database: it
//! saw the postmaster exit) marks it down directly and says why.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::Notify;

/// How often a probe runs while the store is down.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);
/// A probe that takes longer than this (to connect and answer `SELECT 1`) failed.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// What clients are told to wait before they retry (`Retry-After`, seconds).
pub const RETRY_AFTER_S: u64 = 2;

#[derive(Debug, Default)]
struct State {
    /// Why the store is down, as a probe or a request saw it.
    reason: Option<String>,
    /// What the one who manages the database says (the embedded supervisor): shown first.
    note: Option<String>,
    since: Option<Instant>,
}

/// The store's health as this process knows it; shared by the request path, the prober
/// and the embedded database's supervisor.
#[derive(Debug, Default)]
pub struct StoreHealth {
    down: AtomicBool,
    state: Mutex<State>,
    wake: Notify,
}

impl StoreHealth {
    pub fn new() -> Self {
        Self::default()
    }

    /// The store is known to be down: calls fail without waiting for a connection.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Why the store is down (none while it is up).
    pub fn reason(&self) -> Option<String> {
        if !self.is_down() {
            return None;
        }
        let state = self.lock();
        let since = state
            .since
            .map(|s| format!(" (for {} s)", s.elapsed().as_secs()))
            .unwrap_or_default();
        match (&state.note, &state.reason) {
            (Some(note), _) => Some(format!("{note}{since}")),
            (None, Some(reason)) => Some(format!("{reason}{since}")),
            (None, None) => Some(format!("the database does not answer{since}")),
        }
    }

    /// Mark the store down because of `reason`; the prober then checks it every
    /// `PROBE_EVERY` until it answers.
    pub fn mark_down(&self, reason: impl Into<String>) {
        let reason = reason.into();
        let was_down = self.down.swap(true, Ordering::AcqRel);
        {
            let mut state = self.lock();
            if !was_down {
                state.since = Some(Instant::now());
                tracing::error!(reason = %reason, "the database is unavailable; requests that need it answer 503 store_unavailable until it answers again");
            }
            state.reason = Some(reason);
        }
        // The prober, waiting while the store was up, starts probing every
        // `PROBE_EVERY` (a prober marking it down again needs no wake-up: it would spin).
        if !was_down {
            self.wake.notify_one();
        }
    }

    /// Mark the store up (a probe succeeded).
    pub fn mark_up(&self) {
        if self.down.swap(false, Ordering::AcqRel) {
            let mut state = self.lock();
            let down_for = state.since.take().map(|s| s.elapsed()).unwrap_or_default();
            state.reason = None;
            tracing::info!(
                down_ms = down_for.as_millis() as u64,
                "the database answers again"
            );
        }
    }

    /// What the manager of the database says about it while it is down (`None` clears).
    pub fn set_note(&self, note: Option<String>) {
        self.lock().note = note;
    }

    /// A call failed as if the store were unreachable: probe it now (while it is known
    /// down, the prober already probes it on its own).
    pub fn suspect(&self) {
        if !self.is_down() {
            self.wake.notify_one();
        }
    }

    /// Whoever manages the database expects it back: probe it now rather than at the
    /// next `PROBE_EVERY`.
    pub fn probe_now(&self) {
        self.wake.notify_one();
    }

    /// The error a call gets while the store is known down: an I/O error, which the
    /// request path answers as 503 `store_unavailable`.
    pub fn down_error(&self) -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            format!(
                "the database is unavailable: {}",
                self.reason().unwrap_or_else(|| "it does not answer".into())
            ),
        ))
    }

    /// Probe the database on request, and every `PROBE_EVERY` while it is down; runs
    /// until the task is aborted.
    pub async fn watch(&self, options: PgConnectOptions) {
        loop {
            if self.is_down() {
                tokio::select! {
                    _ = tokio::time::sleep(PROBE_EVERY) => {}
                    _ = self.wake.notified() => {}
                }
            } else {
                self.wake.notified().await;
            }
            match probe(&options).await {
                Ok(()) => {
                    self.lock().reason = None;
                    self.mark_up();
                }
                Err(why) => self.mark_down(why),
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Connect and run `SELECT 1` on a connection of its own, within `PROBE_TIMEOUT`.
async fn probe(options: &PgConnectOptions) -> Result<(), String> {
    let attempt = async {
        let mut conn = PgConnection::connect_with(options).await?;
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        let _ = conn.close().await;
        Ok::<_, sqlx::Error>(())
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("the database cannot be reached: {e}")),
        Err(_) => Err(format!(
            "the database did not answer a probe within {} s",
            PROBE_TIMEOUT.as_secs()
        )),
    }
}

/// Whether `err` says the store could not be reached or did not answer in time (rather
/// than refusing the statement): a reason to probe it.
pub fn is_unreachable(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_and_up_with_the_reason() {
        let h = StoreHealth::new();
        assert!(!h.is_down());
        assert_eq!(h.reason(), None);
        h.mark_down("connection refused");
        assert!(h.is_down());
        assert!(h.reason().unwrap().starts_with("connection refused"));
        h.set_note(Some("the embedded PostgreSQL is restarting".into()));
        assert!(
            h.reason()
                .unwrap()
                .starts_with("the embedded PostgreSQL is restarting")
        );
        let err = h.down_error();
        assert!(matches!(err, sqlx::Error::Io(_)), "{err:?}");
        assert!(err.to_string().contains("restarting"), "{err}");
        h.mark_up();
        assert!(!h.is_down());
        assert_eq!(h.reason(), None);
    }

    #[tokio::test]
    async fn a_probe_of_an_unreachable_database_fails_in_time() {
        let options = PgConnectOptions::new_without_pgpass()
            .socket("/nonexistent-agentry-socket-dir")
            .username("nobody")
            .database("none");
        let h = StoreHealth::new();
        let started = Instant::now();
        let watching = async { h.watch(options).await };
        tokio::select! {
            _ = watching => unreachable!("watch runs until aborted"),
            _ = async {
                h.suspect();
                while !h.is_down() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            } => {}
        }
        assert!(started.elapsed() < PROBE_TIMEOUT + Duration::from_secs(1));
        assert!(h.reason().unwrap().contains("cannot be reached"));
    }
}
