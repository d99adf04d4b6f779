//! One process per replica id: the server takes the lock on its replica id on a
//! connection of its own before the boot reconciler runs and holds it for its lifetime. A
//! second server started with the same id on the same database refuses to start instead of
//! closing the first one's agents (the boot reconciler closes what its replica left open).
//! The lock goes with the connection: released when the server stops, or by PostgreSQL
//! when the server dies.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::store;

/// How often the holding connection is checked.
const CHECK_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ReplicaLockError {
    #[error(
        "another agentry server runs as replica `{0}` on this database{1}; give each server \
         its own `cluster.replica_id` (or its own data_dir), or stop the other one"
    )]
    InUse(String, String),
    #[error("cannot take the replica lock: {0}")]
    Store(#[from] sqlx::Error),
}

/// Proof that this process is the only one running as its replica; release it on stop.
pub struct ReplicaLock {
    replica: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ReplicaLock {
    /// Take the lock of `replica` on a new connection to `pool`'s database, or say who
    /// holds it.
    pub async fn acquire(pool: &PgPool, replica: &str) -> Result<Self, ReplicaLockError> {
        let options = pool.connect_options();
        let mut conn = PgConnection::connect_with(&options).await?;
        if !store::replica_lock::try_acquire(&mut conn, replica).await? {
            let who = match store::replica_lock::holder(&mut conn, replica).await {
                Ok(Some((addr, since))) => {
                    let mut s = String::new();
                    if let Some(since) = since {
                        s.push_str(&format!(
                            " (connected since {})",
                            since.format("%Y-%m-%d %H:%M:%S UTC")
                        ));
                    }
                    if let Some(addr) = addr {
                        s.push_str(&format!(" from {addr}"));
                    }
                    s
                }
                _ => String::new(),
            };
            let _ = conn.close().await;
            return Err(ReplicaLockError::InUse(replica.to_owned(), who));
        }
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(hold(conn, options, replica.to_owned(), stopped));
        Ok(Self {
            replica: replica.to_owned(),
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The replica this lock is held for.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// Release the lock (closing its connection) and wait until it is released.
    pub async fn release(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ReplicaLock {
    fn drop(&mut self) {
        // Dropping the sender ends the holding task, which closes the connection.
        self.stop.take();
    }
}

/// Hold the lock until told to stop (or the lock is dropped); check the connection now and
/// then, and take the lock again on a new connection if the old one was lost.
async fn hold(
    mut conn: PgConnection,
    options: Arc<PgConnectOptions>,
    replica: String,
    mut stopped: oneshot::Receiver<()>,
) {
    let mut lost = false;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = tokio::time::sleep(CHECK_EVERY) => {}
        }
        match store::replica_lock::held(&mut conn, &replica).await {
            Ok(true) => {
                if lost {
                    tracing::info!("holding the replica lock again");
                    lost = false;
                }
                continue;
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the connection holding the replica lock failed")
            }
        }
        lost = true;
        // Reconnect and take it again; until then a second server could start.
        match PgConnection::connect_with(&options).await {
            Ok(mut fresh) => match store::replica_lock::try_acquire(&mut fresh, &replica).await {
                Ok(true) => conn = fresh,
                Ok(false) => tracing::error!(
                    "another server took this replica's lock while this one runs; stop \
                     one of them"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot take the replica lock again"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot reconnect to take the replica lock"),
        }
    }
    if let Err(e) = store::replica_lock::release(&mut conn, &replica).await {
        tracing::debug!(error = %e, "could not give the replica lock up before closing");
    }
    let _ = conn.close().await;
}
