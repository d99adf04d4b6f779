//! One server per database, until several replicas are supported: the server takes the
//! single-server lock on a connection of its own before the boot reconciler runs and
//! holds it for its lifetime. A second server on the same database refuses to start
//! instead of closing the first one's agents. The lock goes with the connection: released
//! when the server stops, or by PostgreSQL when the server dies.

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
pub enum ServerLockError {
    #[error(
        "another agentry server is using this database{0}; running several servers on one \
         database is not supported yet: stop the other server, or give this one its own \
         database"
    )]
    InUse(String),
    #[error("cannot take the single-server lock: {0}")]
    Store(#[from] sqlx::Error),
}

/// Proof that this process is the only server on its database; release it on stop.
pub struct ServerLock {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ServerLock {
    /// Take the lock on a new connection to `pool`'s database, or say who holds it.
    pub async fn acquire(pool: &PgPool) -> Result<Self, ServerLockError> {
        let options = pool.connect_options();
        let mut conn = PgConnection::connect_with(&options).await?;
        if !store::server_lock::try_acquire(&mut conn).await? {
            let who = match store::server_lock::holder(&mut conn).await {
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
            return Err(ServerLockError::InUse(who));
        }
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(hold(conn, options, stopped));
        Ok(Self {
            stop: Some(stop),
            task: Some(task),
        })
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

impl Drop for ServerLock {
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
    mut stopped: oneshot::Receiver<()>,
) {
    let mut lost = false;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = tokio::time::sleep(CHECK_EVERY) => {}
        }
        match store::server_lock::held(&mut conn).await {
            Ok(true) => {
                if lost {
                    tracing::info!("holding the single-server lock again");
                    lost = false;
                }
                continue;
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the connection holding the single-server lock failed")
            }
        }
        lost = true;
        // Reconnect and take it again; until then a second server could start.
        match PgConnection::connect_with(&options).await {
            Ok(mut fresh) => match store::server_lock::try_acquire(&mut fresh).await {
                Ok(true) => conn = fresh,
                Ok(false) => tracing::error!(
                    "another server took the single-server lock of this database while this \
                     one runs; stop one of them"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot take the single-server lock again"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot reconnect to take the single-server lock"),
        }
    }
    if let Err(e) = store::server_lock::release(&mut conn).await {
        tracing::debug!(error = %e, "could not give the single-server lock up before closing");
    }
    let _ = conn.close().await;
}
