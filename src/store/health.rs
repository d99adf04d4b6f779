//! Whether the database is known to be down, and why. A request that finds the store
//! unreachable asks for a probe; a probe that fails marks it down, and while it is down a
//! probe runs every `PROBE_EVERY` until one succeeds. While it is known down, the request
//! path's calls fail at once (`DeadlinePool`) instead of each waiting for a connection, so
//! clients get their 503 in milliseconds and know when to come back (`Retry-After`).
//!
//! Whoever knows more than a probe can tell (the supervisor of the embedded database: it
//! saw the postmaster exit) marks it down directly and says why.
//!
//! A full disk is a database that answers but cannot write: `SELECT 1` succeeds while
//! every write that needs space is refused (SQLSTATE 53100). A refused write marks the
//! store down as full; when the database's file system can be measured (the embedded
//! cluster), the outage ends only once it has `FULL_MARGIN` free again, so the store does
//! not come and go with each probe. Without a measure (an external database), the next
//! probe that answers ends it, and the next refused write marks it full again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
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
/// The free space a full file system needs again before the store counts as writable: a
/// WAL segment (16 MiB) twice over, so the first writes after it do not fill it again.
pub const FULL_MARGIN: u64 = 32 * 1024 * 1024;

/// Measures the free bytes of the database's file system (`None` when it cannot).
pub type SpaceMeter = Box<dyn Fn() -> Option<u64> + Send + Sync>;

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
#[derive(Default)]
pub struct StoreHealth {
    down: AtomicBool,
    /// The store is down because a write was refused for want of space.
    full: AtomicBool,
    state: Mutex<State>,
    wake: Notify,
    /// Told whenever the store is marked down.
    downed: Notify,
    space: OnceLock<SpaceMeter>,
}

impl std::fmt::Debug for StoreHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreHealth")
            .field("down", &self.is_down())
            .field("full", &self.full.load(Ordering::Acquire))
            .field("reason", &self.reason())
            .finish()
    }
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
        let (why, since) = {
            let state = self.lock();
            let since = state
                .since
                .map(|s| format!(" (for {} s)", s.elapsed().as_secs()))
                .unwrap_or_default();
            let why = match (&state.note, &state.reason) {
                (Some(note), _) => note.clone(),
                (None, Some(reason)) => reason.clone(),
                (None, None) => "the database does not answer".to_owned(),
            };
            (why, since)
        };
        // Down on a file system with no room left (a cluster that stopped, or cannot
        // start, when it could not write its WAL): the full disk is said first.
        let why = match self.free_space() {
            Some(free) if free < FULL_MARGIN && !why.contains(FULL) => {
                full_reason(&why, Some(free))
            }
            _ => why,
        };
        Some(format!("{why}{since}"))
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
        self.downed.notify_waiters();
    }

    /// Resolves once the store is known down (at once if it is).
    pub async fn until_down(&self) {
        loop {
            let marked = self.downed.notified();
            tokio::pin!(marked);
            // Registered before the flag is read: a mark in between is not missed.
            marked.as_mut().enable();
            if self.is_down() {
                return;
            }
            marked.await;
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

    /// How to measure the free space of the database's file system (the embedded cluster's
    /// manager knows where it is). Set once; later calls do nothing.
    pub fn measure_space_with(&self, meter: SpaceMeter) {
        let _ = self.space.set(meter);
    }

    /// Free bytes of the database's file system, when it can be measured.
    pub fn free_space(&self) -> Option<u64> {
        self.space.get().and_then(|m| m())
    }

    /// A write was refused because the database's disk is full (`what` is the database's
    /// message): the store is down until it has room again.
    pub fn disk_full(&self, what: &str) {
        let first = !self.full.swap(true, Ordering::AcqRel);
        if first {
            tracing::error!(error = %what, "the database refused a write: its disk is full");
        }
        self.mark_down(full_reason(what, self.free_space()));
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
                Ok(()) if self.full.load(Ordering::Acquire) => match self.free_space() {
                    Some(free) if free < FULL_MARGIN => {
                        self.mark_down(full_reason("no space left on the device", Some(free)))
                    }
                    _ => {
                        self.full.store(false, Ordering::Release);
                        self.lock().reason = None;
                        self.mark_up();
                    }
                },
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

/// What every reason for a full disk starts with.
const FULL: &str = "the database's disk is full";

/// Why the store is down when its disk is full, with the free space when it is known.
fn full_reason(what: &str, free: Option<u64>) -> String {
    match free {
        Some(free) => format!(
            "{FULL} ({} KiB free; it needs {} MiB to write again): {what}",
            free / 1024,
            FULL_MARGIN / (1024 * 1024)
        ),
        None => format!("{FULL}: {what}"),
    }
}

/// Whether the database refused a statement because its disk is full (SQLSTATE 53100).
pub fn is_disk_full(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("53100"))
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

    #[test]
    fn a_full_disk_is_down_and_says_how_much_room_is_left() {
        let h = StoreHealth::new();
        h.disk_full("could not extend file \"base/5/16384\": No space left on device");
        assert!(h.is_down());
        let reason = h.reason().unwrap();
        assert!(
            reason.starts_with("the database's disk is full: could not extend"),
            "{reason}"
        );
        let h = StoreHealth::new();
        h.measure_space_with(Box::new(|| Some(3 * 1024)));
        assert_eq!(h.free_space(), Some(3 * 1024));
        h.disk_full("No space left on device");
        let reason = h.reason().unwrap();
        assert!(
            reason.starts_with(
                "the database's disk is full (3 KiB free; it needs 32 MiB to write again)"
            ),
            "{reason}"
        );
        assert!(matches!(h.down_error(), sqlx::Error::Io(_)));
        // A database that cannot be reached on a full file system: the full disk first.
        let h = StoreHealth::new();
        h.measure_space_with(Box::new(|| Some(0)));
        h.mark_down("the database cannot be reached: connection refused");
        let reason = h.reason().unwrap();
        assert!(
            reason.starts_with("the database's disk is full (0 KiB free")
                && reason.contains("connection refused"),
            "{reason}"
        );
        // With room, a reason is only its own.
        let h = StoreHealth::new();
        h.measure_space_with(Box::new(|| Some(FULL_MARGIN)));
        h.mark_down("the database cannot be reached: connection refused");
        assert!(
            h.reason()
                .unwrap()
                .starts_with("the database cannot be reached")
        );
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
