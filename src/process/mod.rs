//! Child processes agentry starts: each in its own process group, with its workspace as
//! cwd, a minimal environment and argv (never a shell string), recorded in the
//! `managed_processes` ledger before use and ended through that record.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::domain::AgentId;

/// What to run. `program` is looked up on PATH unless it contains a `/`.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    pub program: String,
    pub args: Vec<String>,
    pub cwd: PathBuf,
    /// Extra environment for the child, on top of the minimal base (PATH, HOME, LANG…).
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("`{0}` was not found on PATH")]
    NotFound(String),
    #[error("could not start `{program}`: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("could not record the process in the ledger: {0}")]
    Ledger(#[from] sqlx::Error),
}

/// How a running process is told apart from a later one that reused its pid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub pid: u32,
    pub pgid: i32,
    /// Start time in clock ticks since boot (field 22 of /proc/<pid>/stat).
    pub start_ticks: u64,
    /// /proc/sys/kernel/random/boot_id
    pub boot_id: String,
}

/// The ledger of processes this replica started.
#[derive(Clone)]
pub struct Ledger {
    pub pool: PgPool,
    pub replica: String,
}

/// A started, recorded child with piped stdin/stdout/stderr.
pub struct ManagedChild {
    pub child: tokio::process::Child,
    pub identity: ProcessIdentity,
    ledger: Option<(Ledger, Uuid)>,
}

impl ManagedChild {
    pub fn pid(&self) -> u32 {
        self.identity.pid
    }

    /// TERM the group, wait up to `grace`, KILL the group, reap, drop the ledger row.
    pub async fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let _ = (grace, &self.ledger);
        todo!()
    }
}

/// Spawn `spec` in a new process group (not yet recorded).
pub fn spawn(spec: &CommandSpec) -> Result<ManagedChild, ProcessError> {
    let _ = spec;
    todo!()
}

impl Ledger {
    /// Spawn and record before returning: the child is never used unrecorded.
    pub async fn launch(
        &self,
        spec: &CommandSpec,
        agent_id: Option<AgentId>,
    ) -> Result<ManagedChild, ProcessError> {
        let _ = (spec, agent_id);
        todo!()
    }

    /// At boot: end the leftovers of this replica that are positively identified (pid,
    /// start time and boot id match), drop rows whose process is gone; leave the rest.
    pub async fn reconcile(&self) -> Result<ReconcileReport, sqlx::Error> {
        todo!()
    }
}

#[derive(Debug, Default, Clone)]
pub struct ReconcileReport {
    pub killed: Vec<u32>,
    pub gone: usize,
    pub left_alone: usize,
}
