//! The embedded default database: a private PostgreSQL cluster run from the system's
//! binaries (`initdb`, `postgres`), reachable only on a unix socket. Used by `agentry
//! serve` without `DATABASE_URL`, and by the test harness for its throwaway cluster.

use std::path::PathBuf;

use sqlx::postgres::PgConnectOptions;

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "PostgreSQL server binaries (initdb, postgres) were not found on PATH or in /usr/lib/postgresql/*/bin; install PostgreSQL or set DATABASE_URL to use an external database"
    )]
    BinariesNotFound,
    #[error("embedded PostgreSQL: {0}")]
    Failed(String),
    #[error("embedded PostgreSQL I/O: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// agentry's data dir; the cluster lives in `<data_dir>/pg`, or when running as root
    /// in `/var/lib/agentry/pg-<hash of data_dir>` (the `postgres` user cannot enter /root).
    pub data_dir: PathBuf,
    /// Turn fsync off (test clusters only).
    pub ephemeral: bool,
}

/// A running cluster. `stop` shuts it down (fast shutdown); if agentry dies without
/// stopping it, the postmaster gets a signal from the kernel and shuts down too.
pub struct EmbeddedPostgres {
    pub cluster_dir: PathBuf,
    pub socket_dir: PathBuf,
    pub port: u16,
}

impl EmbeddedPostgres {
    pub async fn start(opts: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        let _ = opts;
        todo!()
    }

    /// Connection options for `database` over the unix socket, as the cluster superuser.
    pub fn connect_options(&self, database: &str) -> PgConnectOptions {
        let _ = database;
        todo!()
    }

    /// Create `database` if it does not exist.
    pub async fn ensure_database(&self, database: &str) -> Result<(), EmbeddedError> {
        let _ = database;
        todo!()
    }

    pub async fn stop(&self) -> Result<(), EmbeddedError> {
        todo!()
    }
}
