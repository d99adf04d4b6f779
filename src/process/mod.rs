//! Child processes agentry starts: each in its own process group, with its workspace as
//! cwd, a minimal environment and argv (never a shell string), recorded in the
//! `managed_processes` ledger before use and ended through that record.

mod executable;
pub mod framing;
pub mod jsonrpc;
pub mod limits;
pub mod line_writer;
pub mod output;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sqlx::PgPool;
use tokio::process::{ChildStderr, ChildStdin, ChildStdout};
use uuid::Uuid;

use crate::domain::{AgentId, Redactor, SecretEnv};
use crate::store::processes as store;
use limits::{ChildCgroup, ChildSetup, LimitHit, LimitHost, LimitWatch, Prepared, ResourceLimits};

pub use crate::store::processes::LedgerRow;
pub use executable::{find_executable, find_executable_in, is_executable};

/// Lock a std mutex, taking it over when a thread panicked while holding it: the maps and
/// counters the adapters and the JSON-RPC peer keep under one stay usable, so one failed
/// handler does not fail every later request of its session.
pub fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Variables copied from agentry's own environment into every child, when set.
pub const BASE_ENV: &[&str] = &[
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME",
];

/// TERM → KILL grace for an agent's process when its session stops it.
pub const STOP_GRACE: Duration = Duration::from_secs(3);

/// How long `reconcile` gives a leftover process between TERM and KILL.
const RECONCILE_GRACE: Duration = Duration::from_secs(2);
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// A private temporary directory without a ledger row is removed at boot once its row id
/// (a UUID v7, which carries the time it was made) is older than this: a launch in
/// progress, here or on a replica sharing the data dir, records its row long before.
const ORPHAN_TMP_AGE: Duration = Duration::from_secs(600);

/// An argument that stands for the child's private temporary directory (see
/// `Ledger::with_tmp_root`): replaced by its path when it has one; a `--bind` of it to
/// itself (a sandbox's) is dropped when it has none, and the child's `TMPDIR` is `/tmp`.
pub const TMPDIR_ARG: &str = "@agentry-private-tmpdir@";

/// What to run. `program` is looked up on PATH unless it contains a `/`.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    pub program: String,
    pub args: Vec<String>,
    pub cwd: PathBuf,
    /// Extra environment for the child, on top of the minimal base (PATH, HOME, LANG…).
    pub env: BTreeMap<String, String>,
    /// Variables passed on from the server's own environment when set there (a
    /// provider's credentials, such as `ANTHROPIC_API_KEY`); `env` wins over them.
    pub pass_env: Vec<String>,
    /// Secret variables (a team's credentials), set last: they win over `env` and
    /// `pass_env`. Their values are redacted wherever the spec is formatted.
    pub secret_env: SecretEnv,
    /// What the process is called in its span when `program` is only a wrapper around
    /// it (a sandbox's launcher): the wrapped program's name.
    pub wraps: Option<String>,
    /// A loopback port the process serves the server on (OpenCode's HTTP server). When it
    /// runs in a network namespace of its own, its launcher makes the port reachable
    /// (`ProcessLauncher::reach`).
    pub serves: Option<u16>,
    /// Files written, mode 0600, into the child's private temporary directory before it
    /// starts: (name, contents). An argument `TMPDIR_ARG/<name>` names one. For what must
    /// not be on a command line, which every local user can read (`/proc/<pid>/cmdline`).
    pub private_files: Vec<(String, crate::domain::SecretValue)>,
    /// The process starts with TERM ignored: a launcher (the sandbox's `bwrap`) that
    /// must outlive the ledger's TERM to its group, so that the TERM reaches the program
    /// it runs (which restores TERM's default for itself).
    pub ignores_term: bool,
}

impl CommandSpec {
    /// `program` with `args` in `cwd`, with nothing else: no environment beyond the
    /// base, no secrets, no files, TERM as usual. The other fields are set with `..`.
    pub fn new(program: impl Into<String>, args: Vec<String>, cwd: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args,
            cwd: cwd.into(),
            env: BTreeMap::new(),
            pass_env: Vec::new(),
            secret_env: SecretEnv::new(),
            wraps: None,
            serves: None,
            private_files: Vec::new(),
            ignores_term: false,
        }
    }
}

/// The argument that names private file `name` of a `CommandSpec`.
pub fn private_file_arg(name: &str) -> String {
    format!("{TMPDIR_ARG}/{name}")
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("`{0}` was not found on PATH")]
    NotFound(String),
    #[error("could not start `{program}`: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
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
    /// Where each recorded child gets a temporary directory of its own (its `TMPDIR`),
    /// removed once the child is gone. `None`: children get the server's `TMPDIR`.
    tmp_root: Option<PathBuf>,
    /// The cgroups (or rlimits only) this host offers.
    host: Arc<LimitHost>,
    /// What an agent's process tree (or a workspace command) may use.
    agent_limits: Option<ResourceLimits>,
    /// The limit that ended an agent's process, until its runtime asks.
    hits: Arc<Mutex<HashMap<AgentId, LimitHit>>>,
    /// The cgroup of each agent's latest process, while it lives.
    live: Arc<Mutex<HashMap<AgentId, std::sync::Weak<ChildCgroup>>>>,
    /// `agentry-sandbox`, when installed: children that need setup before exec (limits,
    /// TERM ignored) start through its `launch` command (see `limits::LAUNCH`).
    launcher: Option<Arc<Path>>,
}

/// A started, recorded child with piped stdin/stdout/stderr.
///
/// Dropping it without [`ManagedChild::terminate`] kills the whole group at once
/// (SIGKILL) and deletes its ledger row in the background.
pub struct ManagedChild {
    pub child: tokio::process::Child,
    pub identity: ProcessIdentity,
    ledger: Option<(Ledger, Uuid)>,
    /// The agent it was started for, if any.
    agent: Option<AgentId>,
    /// The child's own temporary directory (its `TMPDIR`), removed once it is gone.
    tmpdir: Option<PathBuf>,
    /// The leader has been reaped (its exit status is known).
    reaped: bool,
    /// `terminate` has run to completion: nothing is left to clean up.
    finished: bool,
    /// Masks the values of the spec's `secret_env` (for what the child writes).
    redactor: Redactor,
    /// The process's trace span, from spawn until this handle is dropped.
    span: tracing::Span,
    /// The cgroup of its tree, removed once it is gone.
    cgroup: Option<Arc<ChildCgroup>>,
    /// Ends the tree when it reaches a limit, while it runs.
    watch: Option<LimitWatch>,
    /// The limit that ended the tree, once one did.
    hit: Arc<Mutex<Option<LimitHit>>>,
}

impl ManagedChild {
    pub fn pid(&self) -> u32 {
        self.identity.pid
    }

    pub fn pgid(&self) -> i32 {
        self.identity.pgid
    }

    /// Masks the child's secret values in text taken from it (its stderr).
    pub fn redactor(&self) -> Redactor {
        self.redactor.clone()
    }

    /// The limit its tree reached (which ended it), if any: known while its cgroup
    /// exists and after `terminate`.
    pub fn limit_hit(&self) -> Option<LimitHit> {
        let seen = *self.hit.lock().unwrap_or_else(|p| p.into_inner());
        seen.or_else(|| self.cgroup.as_ref().and_then(|c| c.limit_hit()))
    }

    /// The ledger row recording this child, if it was started through [`Ledger::launch`].
    pub fn ledger_id(&self) -> Option<Uuid> {
        self.ledger.as_ref().map(|(_, id)| *id)
    }

    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    /// The three pipes of a child started with piped stdio; a child without them is
    /// stopped at once and the answer is `None`.
    pub async fn take_stdio(&mut self) -> Option<(ChildStdin, ChildStdout, ChildStderr)> {
        match (self.take_stdin(), self.take_stdout(), self.take_stderr()) {
            (Some(stdin), Some(stdout), Some(stderr)) => Some((stdin, stdout, stderr)),
            _ => {
                self.terminate(STOP_GRACE).await;
                None
            }
        }
    }

    /// The end of a session's process once its stdin is closed: unless it already ended
    /// (`status`), it gets `after_eof` to exit on its own (a CLI finishing its transcript),
    /// then whatever is left of its group is stopped. Answers how it ended, when known.
    pub async fn wind_down(
        &mut self,
        status: Option<ExitStatus>,
        after_eof: Duration,
    ) -> Option<ExitStatus> {
        let mut status = status;
        if status.is_none()
            && let Ok(Ok(exited)) = tokio::time::timeout(after_eof, self.wait()).await
        {
            status = Some(exited);
        }
        let terminated = self.terminate(STOP_GRACE).await;
        status.or(terminated)
    }

    /// Waits for the group leader to exit (closing its stdin first if still held).
    /// Other members of the group may outlive it: call `terminate` afterwards (it returns
    /// at once for an exited leader) to end them and delete the ledger row.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        let status = self.child.wait().await?;
        self.reaped = true;
        self.record_exit(&status);
        Ok(status)
    }

    fn record_exit(&self, status: &ExitStatus) {
        use std::os::unix::process::ExitStatusExt as _;
        if let Some(code) = status.code() {
            self.span.record("exit_code", code);
        }
        if let Some(signal) = status.signal() {
            self.span.record("signal", signal);
        }
    }

    /// TERM the group, wait up to `grace`, KILL the group, reap, drop the ledger row.
    ///
    /// When the leader has already exited no TERM is sent, but members of the group that
    /// outlived it are still killed. Calling it again is harmless.
    pub async fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let status = match self.child.try_wait() {
            Ok(Some(status)) => Some(status),
            Ok(None) => {
                self.signal(libc::SIGTERM);
                match tokio::time::timeout(grace, self.child.wait()).await {
                    Ok(Ok(status)) => Some(status),
                    Ok(Err(e)) => {
                        tracing::warn!(pid = self.pid(), error = %e, "waiting for a child failed");
                        None
                    }
                    Err(_) => {
                        self.signal(libc::SIGKILL);
                        match self.child.wait().await {
                            Ok(status) => Some(status),
                            Err(e) => {
                                tracing::warn!(pid = self.pid(), error = %e, "waiting for a killed child failed");
                                None
                            }
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(pid = self.pid(), error = %e, "checking a child's status failed");
                None
            }
        };
        if let Some(status) = &status {
            self.reaped = true;
            self.record_exit(status);
        }

        // A CLI may leave grandchildren behind in its group after the leader exits.
        if self.group_is_ours() && group_has_members(self.pgid()) {
            send_to_group(self.pgid(), libc::SIGKILL);
        }

        // Its cgroup holds what left the group too (a new session, a daemon).
        self.watch.take();
        if let Some(cgroup) = &self.cgroup {
            cgroup.kill_all();
            if let Some(hit) = cgroup.limit_hit() {
                let mut seen = self.hit.lock().unwrap_or_else(|p| p.into_inner());
                if seen.is_none() {
                    *seen = Some(hit);
                    if let Some((ledger, _)) = &self.ledger
                        && let Some(agent) = self.agent
                    {
                        ledger.record_hit(agent, hit);
                    }
                }
            }
        }
        if status.is_some()
            && let Some(cgroup) = self.cgroup.take()
        {
            cgroup.remove().await;
        }

        if let Some((ledger, id)) = self.ledger.take() {
            if status.is_some() {
                if let Some(dir) = self.tmpdir.take() {
                    remove_private_tmp_off_runtime(dir, id).await;
                }
                if let Err(e) = store::delete(&ledger.pool, id).await {
                    tracing::warn!(pid = self.pid(), row = %id, error = %e, "could not delete a ledger row");
                }
            } else {
                tracing::warn!(
                    pid = self.pid(),
                    row = %id,
                    "the child's exit could not be confirmed; its ledger row is kept"
                );
            }
        }
        self.finished = true;
        status
    }

    /// Signals the group (and the leader itself if it moved to another group).
    fn signal(&self, signal: libc::c_int) {
        if self.group_is_ours() {
            send_to_group(self.pgid(), signal);
        }
        if !self.reaped
            && identity_of(self.pid()).is_some_and(|now| {
                now.start_ticks == self.identity.start_ticks && now.pgid != self.pgid()
            })
        {
            send_to_pid(self.pid(), signal);
        }
    }

    /// Whether a signal to our pgid can only reach our own processes. While the leader
    /// exists (even as a zombie) its group number cannot be reused; once it is reaped the
    /// number stays taken as long as any member remains. Only a different process now
    /// holding the leader's pid means the number was reused.
    fn group_is_ours(&self) -> bool {
        match read_stat(self.pid()) {
            Ok(stat) => stat.start_ticks == self.identity.start_ticks,
            Err(e) if e.kind() == io::ErrorKind::NotFound => true,
            Err(_) => !self.reaped,
        }
    }
}

impl Drop for ManagedChild {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if self.group_is_ours() {
            send_to_group(self.pgid(), libc::SIGKILL);
        }
        self.watch.take();
        if let Some(cgroup) = self.cgroup.take() {
            cgroup.remove_in_background();
        }
        if let Some((ledger, id)) = self.ledger.take() {
            let tmpdir = self.tmpdir.take();
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn(async move {
                        if let Some(dir) = tmpdir {
                            remove_private_tmp_off_runtime(dir, id).await;
                        }
                        if let Err(e) = store::delete(&ledger.pool, id).await {
                            tracing::warn!(row = %id, error = %e, "could not delete a ledger row");
                        }
                    });
                }
                Err(_) => {
                    tracing::warn!(row = %id, "no runtime to delete a ledger row; it is left for reconcile");
                }
            }
        }
    }
}

/// Give a process group a lower CPU priority (`nice`): every process in it now, and what
/// they start later (children inherit it).
pub fn lower_priority(pgid: i32, nice: i32) -> io::Result<()> {
    // SAFETY: setpriority only reads its integer arguments.
    let rc = unsafe { libc::setpriority(libc::PRIO_PGRP, pgid as libc::id_t, nice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Spawn `spec` in a new process group (not yet recorded).
pub fn spawn(spec: &CommandSpec) -> Result<ManagedChild, ProcessError> {
    spawn_in(spec, None, None, None)
}

/// `agentry-sandbox` installed beside the `agentry` executable, if it is: it runs the
/// egress bridge inside sandboxes and launches children that need setup before exec.
pub fn sandbox_helper(agentry: &Path) -> Option<PathBuf> {
    companion(agentry, "agentry-sandbox")
}

/// The executable `name` installed beside the `agentry` executable, if it is.
pub fn companion(agentry: &Path, name: &str) -> Option<PathBuf> {
    let helper = agentry.with_file_name(name);
    helper.is_file().then_some(helper)
}

/// `spawn`, with `tmpdir` as the child's `TMPDIR` unless a secret sets it, and in the
/// cgroup and under the rlimits of `limits`. What must happen between fork and exec is
/// done by `launcher` when there is one, else in a forked copy of this process.
fn spawn_in(
    spec: &CommandSpec,
    tmpdir: Option<&Path>,
    limits: Option<&Prepared>,
    launcher: Option<&Path>,
) -> Result<ManagedChild, ProcessError> {
    let mut extra = spec.env.clone();
    if let Some(dir) = tmpdir {
        // A provider's own TMPDIR is kept (its directory is made for its private files).
        extra
            .entry("TMPDIR".to_owned())
            .or_insert_with(|| dir.to_string_lossy().into_owned());
    }
    write_private_files(spec, tmpdir)?;
    let args = with_tmpdir(&spec.args, tmpdir);
    if tmpdir.is_none() && args.len() != spec.args.len() {
        extra.insert("TMPDIR".to_owned(), "/tmp".to_owned());
    }
    extra.extend(
        spec.secret_env
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_owned())),
    );
    let env = child_env(|name| std::env::var_os(name), &spec.pass_env, &extra);
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone());
    let program = find_executable_in(&spec.program, path_var.as_deref(), &[], &spec.cwd)
        .ok_or_else(|| ProcessError::NotFound(spec.program.clone()))?;

    let spawn_error = |source: io::Error| ProcessError::Spawn {
        program: spec.program.clone(),
        source,
    };
    if !spec.cwd.is_dir() {
        return Err(spawn_error(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "working directory {} is not a directory",
                spec.cwd.display()
            ),
        )));
    }

    let setup = limits.map(Prepared::setup);
    let ignores_term = spec.ignores_term;
    let needs_setup = setup.is_some() || ignores_term;
    let mut command = match launcher.filter(|_| needs_setup) {
        Some(launcher) => {
            let launch = limits::Launch {
                setup,
                ignores_term,
                program: program.display().to_string(),
                argv: std::iter::once(spec.program.clone())
                    .chain(args.iter().cloned())
                    .collect(),
            };
            let mut command = tokio::process::Command::new(launcher);
            command.arg(limits::LAUNCH).args(launch.to_args());
            command
        }
        None => {
            let mut command = tokio::process::Command::new(&program);
            command.arg0(&spec.program).args(&args);
            if needs_setup {
                // SAFETY: `apply` makes only async-signal-safe calls (open, write, close,
                // setrlimit) on data prepared before the fork, and allocates nothing; so
                // does `signal`.
                unsafe {
                    command.pre_exec(move || {
                        if ignores_term
                            && libc::signal(libc::SIGTERM, libc::SIG_IGN) == libc::SIG_ERR
                        {
                            return Err(io::Error::last_os_error());
                        }
                        setup.as_ref().map_or(Ok(()), ChildSetup::apply)
                    });
                }
            }
            command
        }
    };
    command
        .current_dir(&spec.cwd)
        .env_clear()
        .envs(env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = command.spawn().map_err(spawn_error)?;

    let Some(pid) = child.id() else {
        return Err(spawn_error(io::Error::other(
            "the child exited before it could be identified",
        )));
    };
    let start_ticks = match read_stat(pid) {
        Ok(stat) => stat.start_ticks,
        Err(e) => {
            // Its group is its own (process_group(0)) and the leader is not reaped yet.
            send_to_group(pid as i32, libc::SIGKILL);
            let _ = child.start_kill();
            return Err(spawn_error(io::Error::new(
                e.kind(),
                format!("could not read /proc/{pid}/stat: {e}"),
            )));
        }
    };
    let shown = spec.wraps.as_ref().unwrap_or(&spec.program);
    let name = std::path::Path::new(shown)
        .file_name()
        .map_or_else(|| shown.clone(), |n| n.to_string_lossy().into_owned());
    let span = tracing::info_span!("process", program = %name, pid,
        agent_id = tracing::field::Empty, exit_code = tracing::field::Empty,
        signal = tracing::field::Empty);
    Ok(ManagedChild {
        span,
        child,
        identity: ProcessIdentity {
            pid,
            pgid: pid as i32,
            start_ticks,
            boot_id: boot_id().unwrap_or_default().to_owned(),
        },
        ledger: None,
        tmpdir: None,
        reaped: false,
        finished: false,
        redactor: Redactor::new(&spec.secret_env),
        cgroup: limits.and_then(Prepared::cgroup),
        watch: None,
        hit: Arc::default(),
        agent: None,
    })
}

/// Write `spec`'s private files into `tmpdir`, each new and readable by its owner only.
fn write_private_files(spec: &CommandSpec, tmpdir: Option<&Path>) -> Result<(), ProcessError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    if spec.private_files.is_empty() {
        return Ok(());
    }
    let error = |source: io::Error| ProcessError::Spawn {
        program: spec.program.clone(),
        source,
    };
    let Some(dir) = tmpdir else {
        return Err(error(io::Error::other(
            "its private files need a private temporary directory (the data dir's `tmp`)",
        )));
    };
    for (name, contents) in &spec.private_files {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(error(io::Error::other(format!(
                "`{name}` is not a private file's name"
            ))));
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join(name))
            .map_err(error)?;
        f.write_all(contents.expose().as_bytes()).map_err(error)?;
    }
    Ok(())
}

/// `args` with `TMPDIR_ARG` (alone, or as the start of `TMPDIR_ARG/<name>`) replaced by
/// `tmpdir`, or without the `--bind` of it when there is none.
fn with_tmpdir(args: &[String], tmpdir: Option<&Path>) -> Vec<String> {
    match tmpdir {
        Some(dir) => args
            .iter()
            .map(|a| match a.strip_prefix(TMPDIR_ARG) {
                Some("") => dir.to_string_lossy().into_owned(),
                Some(rest) if rest.starts_with('/') => {
                    format!("{}{rest}", dir.to_string_lossy())
                }
                _ => a.clone(),
            })
            .collect(),
        None => {
            let mut out = Vec::with_capacity(args.len());
            let mut i = 0;
            while i < args.len() {
                if args[i] == "--bind"
                    && args.get(i + 1).is_some_and(|a| a == TMPDIR_ARG)
                    && args.get(i + 2).is_some_and(|a| a == TMPDIR_ARG)
                {
                    i += 3;
                    continue;
                }
                out.push(args[i].clone());
                i += 1;
            }
            out
        }
    }
}

/// The identity of a live (or zombie) process, read from /proc.
pub fn identity_of(pid: u32) -> Option<ProcessIdentity> {
    let stat = read_stat(pid).ok()?;
    Some(ProcessIdentity {
        pid,
        pgid: stat.pgid,
        start_ticks: stat.start_ticks,
        boot_id: boot_id()?.to_owned(),
    })
}

/// How long a start waits for its ledger row to be stored while the database is only
/// busy or briefly gone: past it, the process is ended and the start fails.
const RECORD_PATIENCE: Duration = Duration::from_secs(20);

/// Store a process's ledger row, trying again while the store is unavailable (a pool
/// with no free connection, a connection that broke) for up to `RECORD_PATIENCE`. The
/// process runs already: ending it because the pool was full for one acquire timeout
/// would fail the agent's start for nothing. An attempt that landed but whose answer was
/// lost shows as the row's id being taken, which counts as stored.
async fn record(pool: &PgPool, row: &store::NewLedgerRow<'_>) -> Result<(), sqlx::Error> {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(50);
    let mut retried = false;
    loop {
        match store::insert(pool, row).await {
            Ok(()) => return Ok(()),
            Err(sqlx::Error::Database(db)) if retried && db.code().as_deref() == Some("23505") => {
                return Ok(());
            }
            Err(e)
                if crate::events::is_unavailable(&e)
                    && started.elapsed() + pause < RECORD_PATIENCE =>
            {
                tracing::warn!(process = %row.id, error = %e, "the process ledger is unavailable; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
                retried = true;
            }
            Err(e) => return Err(e),
        }
    }
}

impl Ledger {
    pub fn new(pool: PgPool, replica: impl Into<String>) -> Self {
        Self {
            pool,
            replica: replica.into(),
            tmp_root: None,
            host: Arc::new(LimitHost::rlimits_only()),
            agent_limits: None,
            hits: Arc::default(),
            live: Arc::default(),
            launcher: None,
        }
    }

    /// Start children that need setup before exec through `launcher`
    /// (`agentry-sandbox launch`): spawned without a copy of the server's address space,
    /// which costs the server a fork of all its memory mappings at every start.
    pub fn with_launcher(mut self, launcher: Option<PathBuf>) -> Self {
        self.launcher = launcher.map(Arc::from);
        self
    }

    /// Apply `agent_limits` (see [`Ledger::launch_limited`]) through what `host` offers.
    pub fn with_limits(mut self, host: LimitHost, agent_limits: ResourceLimits) -> Self {
        self.host = Arc::new(host);
        self.agent_limits = Some(agent_limits);
        self
    }

    /// What this host offers for limits (`cgroup v1 (memory, pids, cpu)`, `rlimits only`).
    pub fn limits_mechanism(&self) -> String {
        self.host.describe()
    }

    /// The limit that ended a process of `agent`, if one did since it was last asked (and
    /// since the agent's last process started).
    pub fn take_limit_hit(&self, agent: AgentId) -> Option<LimitHit> {
        self.hits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&agent)
    }

    /// Whether the tree of `agent`'s running process has reached a limit (the kernel
    /// counted it) before its watch noticed; if so it is ended at once, as the watch would.
    /// For a turn that ends right after, so that it fails rather than completes.
    pub fn stop_if_over_limit(&self, agent: AgentId) -> Option<LimitHit> {
        let cgroup = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&agent)?
            .upgrade()?;
        let hit = cgroup.limit_hit()?;
        self.record_hit(agent, hit);
        cgroup.kill_all();
        Some(hit)
    }

    fn record_hit(&self, agent: AgentId, hit: LimitHit) {
        self.hits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(agent, hit);
    }

    /// Give each child a temporary directory of its own under `root`
    /// (`<root>/<ledger row id>`, mode 0700) as its `TMPDIR`, removed with the child, or
    /// by `reconcile` when the server stopped before it could. A provider whose `env`
    /// sets `TMPDIR` keeps its own.
    ///
    /// A root whose path is not UTF-8 cannot be recorded: children then get the
    /// server's `TMPDIR`, and a warning says so.
    pub fn with_tmp_root(mut self, root: PathBuf) -> Self {
        if root.to_str().is_some() {
            self.tmp_root = Some(root);
        } else {
            tracing::warn!(root = %root.display(), "the data dir's path is not UTF-8: agent processes share the server's TMPDIR");
        }
        self
    }

    /// Spawn and record before returning: the child is never used unrecorded.
    pub async fn launch(
        &self,
        spec: &CommandSpec,
        agent_id: Option<AgentId>,
    ) -> Result<ManagedChild, ProcessError> {
        self.launch_with(spec, agent_id, None).await
    }

    /// `launch` under the agents' resource limits (`[agents.limits]`): an agent's
    /// process, a workspace's setup command. Its tree gets a cgroup of its own where the
    /// host allows, ended as a whole when it reaches a limit.
    pub async fn launch_limited(
        &self,
        spec: &CommandSpec,
        agent_id: Option<AgentId>,
    ) -> Result<ManagedChild, ProcessError> {
        self.launch_with(spec, agent_id, self.agent_limits.as_ref())
            .await
    }

    async fn launch_with(
        &self,
        spec: &CommandSpec,
        agent_id: Option<AgentId>,
        limits: Option<&ResourceLimits>,
    ) -> Result<ManagedChild, ProcessError> {
        let id = Uuid::now_v7();
        let tmpdir = match &self.tmp_root {
            Some(root) if !spec.env.contains_key("TMPDIR") || !spec.private_files.is_empty() => {
                Some(
                    make_private_tmp(root, id).map_err(|source| ProcessError::Spawn {
                        program: spec.program.clone(),
                        source: io::Error::new(
                            source.kind(),
                            format!(
                                "could not make its temporary directory under {}: {source}",
                                root.display()
                            ),
                        ),
                    })?,
                )
            }
            _ => None,
        };
        let prepared = match limits.map(|l| self.host.prepare(id, l)).transpose() {
            Ok(prepared) => prepared,
            Err(source) => {
                if let Some(dir) = &tmpdir {
                    remove_private_tmp(dir, id);
                }
                return Err(ProcessError::Spawn {
                    program: spec.program.clone(),
                    source,
                });
            }
        };
        let spawned = spawn_in(
            spec,
            tmpdir.as_deref(),
            prepared.as_ref(),
            self.launcher.as_deref(),
        );
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                if let Some(dir) = &tmpdir {
                    remove_private_tmp(dir, id);
                }
                if let Some(cgroup) = prepared.as_ref().and_then(Prepared::cgroup) {
                    cgroup.remove().await;
                }
                return Err(e);
            }
        };
        child.tmpdir = tmpdir;
        child.agent = agent_id;
        if let Some(agent) = agent_id {
            // A hit of an earlier process is no news any more.
            self.take_limit_hit(agent);
        }
        if let Some(cgroup) = child.cgroup.clone() {
            if let Some(agent) = agent_id {
                self.live
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(agent, Arc::downgrade(&cgroup));
            }
            let (ledger, seen) = (self.clone(), child.hit.clone());
            child.watch = Some(LimitWatch::start(cgroup, move |hit| {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(hit);
                if let Some(agent) = agent_id {
                    ledger.record_hit(agent, hit);
                }
            }));
        }
        let redactor = Redactor::new(&spec.secret_env);
        let command: Vec<String> = std::iter::once(spec.program.clone())
            .chain(spec.args.iter().cloned())
            .map(|a| mask_api_tokens(&redactor.text(&a)))
            .collect();
        let row = store::NewLedgerRow {
            id,
            pid: child.identity.pid as i32,
            pgid: child.identity.pgid,
            start_ticks: i64::try_from(child.identity.start_ticks).unwrap_or(i64::MAX),
            boot_id: &child.identity.boot_id,
            command: &command,
            agent_id: agent_id.map(|a| a.uuid()),
            replica: &self.replica,
            tmpdir: child.tmpdir.as_deref().and_then(Path::to_str),
        };
        if let Err(e) = record(&self.pool, &row).await {
            child.terminate(Duration::ZERO).await;
            if let Some(dir) = child.tmpdir.take() {
                remove_private_tmp(&dir, id);
            }
            return Err(e.into());
        }
        child.ledger = Some((self.clone(), id));
        if let Some(agent) = agent_id {
            child
                .span
                .record("agent_id", tracing::field::display(agent));
        }
        Ok(child)
    }

    /// Every row of this replica.
    pub async fn list(&self) -> Result<Vec<LedgerRow>, sqlx::Error> {
        store::list_for_replica(&self.pool, &self.replica).await
    }

    /// At boot: end the leftovers of this replica that are positively identified (pid,
    /// start time and boot id match), drop rows whose process is gone; leave the rest.
    pub async fn reconcile(&self) -> Result<ReconcileReport, sqlx::Error> {
        self.reconcile_replica(&self.replica).await
    }

    /// Like `reconcile`, for the rows of `replica`: a replica that stopped answering, whose
    /// processes on this host are ended by the replica that takes its agents over.
    pub async fn reconcile_replica(&self, replica: &str) -> Result<ReconcileReport, sqlx::Error> {
        let rows = store::list_for_replica(&self.pool, replica).await?;
        let current_boot = boot_id();
        let mut report = ReconcileReport::default();
        for row in rows {
            let probe = if row.pid > 0 {
                probe(row.pid as u32)
            } else {
                Probe::Unreadable
            };
            match judge(&row, current_boot, &probe) {
                Verdict::Gone => {
                    self.host.remove_leftover(row.id).await;
                    remove_row_tmp(&row).await;
                    store::delete(&self.pool, row.id).await?;
                    report.gone += 1;
                }
                Verdict::Ours => {
                    let pid = row.pid as u32;
                    let start = row.start_ticks as u64;
                    tracing::info!(pid, pgid = row.pgid, command = ?row.command, "ending a leftover process");
                    end_leftover(pid, row.pgid, start).await;
                    self.host.remove_leftover(row.id).await;
                    remove_row_tmp(&row).await;
                    store::delete(&self.pool, row.id).await?;
                    report.killed.push(pid);
                }
                Verdict::LeaveAlone => {
                    tracing::warn!(pid = row.pid, row = %row.id, "cannot identify a recorded process; its row is kept");
                    report.left_alone += 1;
                }
            }
        }
        Ok(report)
    }

    /// At boot, after `reconcile`: remove the private temporary directories that no
    /// ledger row holds, left by a server that stopped between making a child's directory
    /// and recording the child, or by a removal that failed. Only directories named after
    /// a row id and made more than `ORPHAN_TMP_AGE` ago are touched; anything else under
    /// the root is left alone. Returns how many were removed.
    pub async fn sweep_tmp(&self) -> Result<usize, sqlx::Error> {
        let Some(root) = self.tmp_root.clone() else {
            return Ok(0);
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let found = tokio::task::spawn_blocking(move || orphan_candidates(&root, now))
            .await
            .unwrap_or_default();
        if found.is_empty() {
            return Ok(0);
        }
        let ids: Vec<Uuid> = found.iter().map(|(id, _)| *id).collect();
        let held: std::collections::HashSet<Uuid> = store::existing(&self.pool, &ids)
            .await?
            .into_iter()
            .collect();
        let mut removed = 0;
        for (id, dir) in found {
            if !held.contains(&id) {
                tracing::info!(dir = %dir.display(), "removing a temporary directory no process holds");
                remove_private_tmp_off_runtime(dir, id).await;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

impl Ledger {
    /// At boot, after `reconcile`: end and remove the child cgroups of this replica that
    /// no ledger row holds (a server that stopped before it could). Only this server's
    /// children are ever placed in them. Returns how many were removed.
    pub async fn sweep_cgroups(&self) -> Result<usize, sqlx::Error> {
        let found = self.host.present();
        if found.is_empty() {
            return Ok(0);
        }
        let held: std::collections::HashSet<Uuid> = store::existing(&self.pool, &found)
            .await?
            .into_iter()
            .collect();
        let mut removed = 0;
        for id in found.into_iter().filter(|id| !held.contains(id)) {
            tracing::info!(row = %id, "removing a cgroup no process holds");
            self.host.remove_leftover(id).await;
            removed += 1;
        }
        Ok(removed)
    }
}

/// The directories under `root` named after a ledger row id made more than
/// `ORPHAN_TMP_AGE` before `now` (since the Unix epoch).
fn orphan_candidates(root: &Path, now: Duration) -> Vec<(Uuid, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name();
            let name = name.to_str()?;
            let id = Uuid::try_parse(name).ok()?;
            if private_tmp_name(id) != name {
                return None;
            }
            let (secs, nanos) = id.get_timestamp()?.to_unix();
            let made = Duration::new(secs, nanos);
            (now.saturating_sub(made) > ORPHAN_TMP_AGE).then(|| (id, e.path()))
        })
        .collect()
}

#[derive(Debug, Default, Clone)]
pub struct ReconcileReport {
    pub killed: Vec<u32>,
    pub gone: usize,
    pub left_alone: usize,
}

/// The name of the private temporary directory of the child recorded as `id`.
fn private_tmp_name(id: Uuid) -> String {
    id.simple().to_string()
}

/// Make `<root>/<id>`, mode 0700 (and `root`, 0700, when missing).
fn make_private_tmp(root: &Path, id: Uuid) -> io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)?;
    let dir = root.join(private_tmp_name(id));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    Ok(dir)
}

/// Remove the private temporary directory of the child recorded as `id`, with whatever
/// it left there. Only a directory named after `id` is touched, whatever the row says.
fn remove_private_tmp(dir: &Path, id: Uuid) {
    if dir.file_name() != Some(std::ffi::OsStr::new(&private_tmp_name(id))) {
        tracing::warn!(dir = %dir.display(), row = %id, "not removing a temporary directory that is not named after its process");
        return;
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove a process's temporary directory");
        }
    }
}

/// `remove_private_tmp` off the runtime's threads: a directory may hold a lot.
async fn remove_private_tmp_off_runtime(dir: PathBuf, id: Uuid) {
    let _ = tokio::task::spawn_blocking(move || remove_private_tmp(&dir, id)).await;
}

/// The directory of a ledger row that has one, removed (see `remove_private_tmp`).
async fn remove_row_tmp(row: &LedgerRow) {
    if let Some(dir) = &row.tmpdir {
        remove_private_tmp_off_runtime(PathBuf::from(dir), row.id).await;
    }
}

/// The environment of a child: the base variables taken from `parent`, then `extra`.
fn child_env(
    parent: impl Fn(&str) -> Option<OsString>,
    pass: &[String],
    extra: &BTreeMap<String, String>,
) -> Vec<(OsString, OsString)> {
    let mut names: Vec<&str> = BASE_ENV.to_vec();
    names.extend(pass.iter().map(String::as_str));
    names.sort_unstable();
    names.dedup();
    let mut env: Vec<(OsString, OsString)> = names
        .into_iter()
        .filter(|name| !extra.contains_key(*name))
        .filter_map(|name| parent(name).map(|value| (OsString::from(name), value)))
        .collect();
    env.extend(
        extra
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v))),
    );
    env
}

/// The fields of /proc/<pid>/stat that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    state: u8,
    pgid: i32,
    start_ticks: u64,
}

fn read_stat(pid: u32) -> io::Result<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat"))
}

/// Parses `pid (comm) state ppid pgrp … starttime …`; `comm` may hold spaces and `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `fields[0]` is field 3 of the file (state), so field N is `fields[N - 3]`.
    Some(Stat {
        state: *fields.first()?.as_bytes().first()?,
        pgid: fields.get(2)?.parse().ok()?,
        start_ticks: fields.get(19)?.parse().ok()?,
    })
}

/// This boot's id, read once.
fn boot_id() -> Option<&'static str> {
    static BOOT_ID: OnceLock<String> = OnceLock::new();
    if let Some(id) = BOOT_ID.get() {
        return Some(id);
    }
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    if id.is_empty() {
        return None;
    }
    Some(BOOT_ID.get_or_init(|| id.to_owned()))
}

/// A group number that may be signalled: never 0, 1 or our own group.
fn signallable_group(pgid: i32) -> bool {
    // SAFETY: getpgrp has no preconditions.
    pgid > 1 && pgid != unsafe { libc::getpgrp() }
}

fn send_to_group(pgid: i32, signal: libc::c_int) -> bool {
    if !signallable_group(pgid) {
        tracing::warn!(pgid, "refusing to signal a process group");
        return false;
    }
    // SAFETY: kill has no memory-safety preconditions; a negative pid names a group.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

fn send_to_pid(pid: u32, signal: libc::c_int) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: as above; `pid` is positive and not ours.
    pid > 1 && pid as u32 != std::process::id() && unsafe { libc::kill(pid, signal) == 0 }
}

/// Whether any process (zombies included) is in the group.
fn group_has_members(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks existence and permission.
    signallable_group(pgid) && unsafe { libc::kill(-pgid, 0) == 0 }
}

/// What /proc says about a pid.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Probe {
    Absent,
    Present(Stat),
    Unreadable,
}

fn probe(pid: u32) -> Probe {
    match read_stat(pid) {
        Ok(stat) => Probe::Present(stat),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Probe::Absent,
        Err(_) => Probe::Unreadable,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// The recorded process no longer exists: drop the row.
    Gone,
    /// The recorded process is running and positively identified: end it.
    Ours,
    /// Not enough is known to decide.
    LeaveAlone,
}

fn judge(row: &LedgerRow, current_boot: Option<&str>, probe: &Probe) -> Verdict {
    let Some(current_boot) = current_boot else {
        return Verdict::LeaveAlone;
    };
    if row.boot_id != current_boot {
        return Verdict::Gone;
    }
    if row.pid <= 1 || row.pgid <= 1 || row.start_ticks < 0 {
        return Verdict::LeaveAlone;
    }
    match probe {
        Probe::Absent => Verdict::Gone,
        Probe::Unreadable => Verdict::LeaveAlone,
        Probe::Present(stat) if stat.start_ticks != row.start_ticks as u64 => Verdict::Gone,
        Probe::Present(stat) if stat.state == b'Z' || stat.state == b'X' => Verdict::Gone,
        Probe::Present(_) => Verdict::Ours,
    }
}

/// Whether `pid` is still the process that started at `start_ticks` and has not exited.
fn still_running(pid: u32, start_ticks: u64) -> bool {
    match read_stat(pid) {
        Ok(stat) => stat.start_ticks == start_ticks && stat.state != b'Z' && stat.state != b'X',
        Err(_) => false,
    }
}

/// Whether signals to `pgid` (the group of a leader `pid` == `pgid` that started at
/// `start_ticks`) can reach only that leader's group.
fn leftover_group_is_ours(pid: u32, pgid: i32, start_ticks: u64) -> bool {
    if pid as i32 != pgid {
        return false;
    }
    match read_stat(pid) {
        Ok(stat) => stat.start_ticks == start_ticks,
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

/// TERM, up to `RECONCILE_GRACE` for the leader to go, then KILL, for a positively
/// identified leftover of an earlier server instance.
async fn end_leftover(pid: u32, pgid: i32, start_ticks: u64) {
    let signal = |sig: libc::c_int| {
        if leftover_group_is_ours(pid, pgid, start_ticks) {
            send_to_group(pgid, sig);
        }
        // The leader itself, should it have left its group.
        if still_running(pid, start_ticks) {
            send_to_pid(pid, sig);
        }
    };
    signal(libc::SIGTERM);
    let deadline = tokio::time::Instant::now() + RECONCILE_GRACE;
    while still_running(pid, start_ticks) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(POLL_INTERVAL).await;
    }
    signal(libc::SIGKILL);
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::AsyncReadExt;

    fn spec(program: &str, args: &[&str]) -> CommandSpec {
        CommandSpec::new(
            program,
            args.iter().map(|s| s.to_string()).collect(),
            std::env::temp_dir(),
        )
    }

    /// All the child writes to stdout, once it has exited successfully.
    async fn run_to_success(mut child: ManagedChild) -> String {
        let mut out = String::new();
        child
            .take_stdout()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        assert!(child.wait().await.unwrap().success(), "{out}");
        child.terminate(Duration::from_secs(1)).await;
        out
    }

    /// Gone, or a zombie nobody has reaped yet.
    fn is_dead(pid: u32) -> bool {
        match read_stat(pid) {
            Ok(stat) => stat.state == b'Z' || stat.state == b'X',
            Err(_) => true,
        }
    }

    async fn wait_dead(pid: u32) -> bool {
        for _ in 0..100 {
            if is_dead(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    async fn read_line(stdout: &mut ChildStdout) -> String {
        let mut out = Vec::new();
        let mut byte = [0u8; 1];
        while stdout.read(&mut byte).await.unwrap() == 1 && byte[0] != b'\n' {
            out.push(byte[0]);
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn parses_stat_with_odd_comm() {
        let line = "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 \
                    1000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                state: b'S',
                pgid: 1234,
                start_ticks: 987654
            })
        );
        assert_eq!(parse_stat("1234 (x"), None);
        assert_eq!(parse_stat("1234 (x) S 1 2"), None);
    }

    #[test]
    fn identity_of_self() {
        let me = identity_of(std::process::id()).expect("own identity");
        // SAFETY: getpgrp has no preconditions.
        assert_eq!(me.pgid, unsafe { libc::getpgrp() });
        assert!(!me.boot_id.is_empty());
        assert_eq!(me, identity_of(std::process::id()).unwrap());
    }

    #[test]
    fn child_env_is_base_plus_extra() {
        let parent = |name: &str| match name {
            "PATH" => Some(OsString::from("/bin")),
            "HOME" => Some(OsString::from("/root")),
            "AGENTRY_SECRET_TEST" => Some(OsString::from("secret")),
            "ANTHROPIC_API_KEY" => Some(OsString::from("sk-test")),
            _ => None,
        };
        let extra = BTreeMap::from([
            ("HOME".to_owned(), "/work".to_owned()),
            ("FOO".to_owned(), "bar".to_owned()),
        ]);
        let mut env = child_env(parent, &[], &extra);
        env.sort();
        assert_eq!(
            env,
            vec![
                (OsString::from("FOO"), OsString::from("bar")),
                (OsString::from("HOME"), OsString::from("/work")),
                (OsString::from("PATH"), OsString::from("/bin")),
            ]
        );
        // A provider's credential variables pass only when it names them.
        let pass = ["ANTHROPIC_API_KEY".to_owned(), "UNSET_VAR".to_owned()];
        let env = child_env(parent, &pass, &BTreeMap::new());
        assert!(env.contains(&(
            OsString::from("ANTHROPIC_API_KEY"),
            OsString::from("sk-test")
        )));
        assert!(
            !env.iter()
                .any(|(k, _)| k == "AGENTRY_SECRET_TEST" || k == "UNSET_VAR")
        );
    }

    #[test]
    fn judges_rows() {
        let boot = "b1";
        let row = LedgerRow {
            id: Uuid::now_v7(),
            pid: 4242,
            pgid: 4242,
            start_ticks: 100,
            boot_id: boot.to_owned(),
            command: vec!["x".to_owned()],
            agent_id: None,
            replica: "r".to_owned(),
            started_at: chrono::Utc::now(),
            tmpdir: None,
        };
        let running = |start_ticks, state| {
            Probe::Present(Stat {
                state,
                pgid: 4242,
                start_ticks,
            })
        };
        assert_eq!(judge(&row, Some(boot), &running(100, b'S')), Verdict::Ours);
        assert_eq!(judge(&row, Some(boot), &running(101, b'S')), Verdict::Gone);
        assert_eq!(judge(&row, Some(boot), &running(100, b'Z')), Verdict::Gone);
        assert_eq!(judge(&row, Some(boot), &Probe::Absent), Verdict::Gone);
        assert_eq!(
            judge(&row, Some(boot), &Probe::Unreadable),
            Verdict::LeaveAlone
        );
        assert_eq!(judge(&row, Some("b2"), &running(100, b'S')), Verdict::Gone);
        assert_eq!(judge(&row, None, &running(100, b'S')), Verdict::LeaveAlone);
        let bad = LedgerRow {
            pgid: 0,
            ..row.clone()
        };
        assert_eq!(
            judge(&bad, Some(boot), &running(100, b'S')),
            Verdict::LeaveAlone
        );
    }

    #[tokio::test]
    async fn spawn_uses_its_own_group() {
        let mut child = spawn(&spec("sleep", &["30"])).unwrap();
        let pid = child.pid();
        assert_eq!(child.pgid(), pid as i32);
        // SAFETY: getpgrp has no preconditions.
        assert_ne!(child.pgid(), unsafe { libc::getpgrp() });
        let seen = identity_of(pid).unwrap();
        assert_eq!(seen, child.identity);
        assert_eq!(seen.pgid, pid as i32);
        assert!(child.ledger_id().is_none());
        assert!(child.take_stdin().is_some() && child.take_stdout().is_some());
        assert!(child.take_stderr().is_some() && child.take_stdin().is_none());

        let status = child.terminate(Duration::from_secs(5)).await.unwrap();
        assert!(!status.success());
        assert!(wait_dead(pid).await);
        // Idempotent.
        assert_eq!(child.terminate(Duration::from_secs(5)).await, Some(status));
    }

    #[tokio::test]
    async fn private_files_are_written_for_the_child_alone_and_named_on_its_command_line() {
        use std::os::unix::fs::PermissionsExt as _;
        let root = tempfile::tempdir().unwrap();
        let id = Uuid::now_v7();
        let dir = make_private_tmp(&root.path().join("tmp"), id).unwrap();
        let mut s = spec("cat", &[&private_file_arg("config.json")]);
        s.private_files = vec![(
            "config.json".to_owned(),
            crate::domain::SecretValue::new("{\"token\": \"t\"}".to_owned()),
        )];
        let child = spawn_in(&s, Some(&dir), None, None).unwrap();
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", child.pid())).unwrap_or_default();
        assert!(!String::from_utf8_lossy(&cmdline).contains("token"));
        let out = run_to_success(child).await;
        assert_eq!(out, "{\"token\": \"t\"}");
        let mode = std::fs::metadata(dir.join("config.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // Without a private directory there is nowhere to put them: refused.
        assert!(spawn_in(&s, None, None, None).is_err());
        // A name is one plain file name.
        s.private_files[0].0 = "../x".to_owned();
        assert!(spawn_in(&s, Some(&dir), None, None).is_err());
        remove_private_tmp(&dir, id);
    }

    #[tokio::test]
    async fn a_private_tmpdir_is_the_childs_tmpdir_and_goes_with_its_contents() {
        let root = tempfile::tempdir().unwrap();
        let id = Uuid::now_v7();
        let dir = make_private_tmp(&root.path().join("tmp"), id).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o700,
            "only the server's account may enter it"
        );

        // The child sees it as TMPDIR and leaves something there, as CLIs do.
        let s = spec(
            "sh",
            &[
                "-c",
                "echo \"$TMPDIR\"; mkdir \"$TMPDIR/x\"; echo left > \"$TMPDIR/x/lib.so\"",
            ],
        );
        let out = run_to_success(spawn_in(&s, Some(&dir), None, None).unwrap()).await;
        assert_eq!(out.trim(), dir.to_str().unwrap());
        assert!(dir.join("x/lib.so").is_file());

        remove_private_tmp(&dir, id);
        assert!(!dir.exists(), "removed with what the child left");
        remove_private_tmp(&dir, id); // already gone: nothing to do

        // A directory not named after the row is never removed.
        let other = root.path().join("keep");
        std::fs::create_dir(&other).unwrap();
        remove_private_tmp(&other, id);
        assert!(other.is_dir());
    }

    #[tokio::test]
    async fn env_is_minimal() {
        // SAFETY: only this test reads or writes this variable.
        unsafe { std::env::set_var("AGENTRY_SECRET_TEST", "hunter2") };
        let mut s = spec("/usr/bin/env", &[]);
        s.env.insert("AGENTRY_EXTRA".to_owned(), "yes".to_owned());
        let out = run_to_success(spawn(&s).unwrap()).await;

        let names: Vec<&str> = out.lines().filter_map(|l| l.split('=').next()).collect();
        assert!(out.lines().any(|l| l == "AGENTRY_EXTRA=yes"), "{out}");
        assert!(!out.contains("AGENTRY_SECRET_TEST"), "{out}");
        for name in &names {
            assert!(
                BASE_ENV.contains(name) || *name == "AGENTRY_EXTRA",
                "unexpected {name}"
            );
        }
        if std::env::var_os("PATH").is_some() {
            assert!(names.contains(&"PATH"));
        }
    }

    #[tokio::test]
    async fn secret_env_reaches_the_child_and_wins_over_env() {
        let mut s = spec("/usr/bin/env", &[]);
        s.env
            .insert("TEAM_KEY".to_owned(), "from-settings".to_owned());
        s.env.insert("OTHER".to_owned(), "kept".to_owned());
        s.secret_env.insert(
            "TEAM_KEY".to_owned(),
            crate::domain::SecretValue::new("from-team"),
        );
        assert!(
            !format!("{s:?}").contains("from-team"),
            "a spec's Debug hides secret values"
        );
        let out = run_to_success(spawn(&s).unwrap()).await;
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines.contains(&"TEAM_KEY=from-team"), "{out}");
        assert!(lines.contains(&"OTHER=kept"), "{out}");
        assert!(!out.contains("from-settings"), "{out}");
    }

    #[tokio::test]
    async fn runs_in_cwd_with_argv() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(
            "sh",
            &["-c", "pwd; printf '%s|' \"$0\" \"$1\"", "a b", "c;d"],
        );
        s.cwd = dir.path().to_owned();
        let out = run_to_success(spawn(&s).unwrap()).await;
        let expected = format!("{}\na b|c;d|", dir.path().canonicalize().unwrap().display());
        assert_eq!(out, expected);
    }

    #[test]
    fn missing_program_is_not_found() {
        match spawn(&spec("no-such-program-agentry", &[])) {
            Err(ProcessError::NotFound(p)) => assert_eq!(p, "no-such-program-agentry"),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("spawned a missing program"),
        }
        assert!(matches!(
            spawn(&spec("/nonexistent/prog", &[])),
            Err(ProcessError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn missing_cwd_is_a_spawn_error() {
        let mut s = spec("sleep", &["1"]);
        s.cwd = PathBuf::from("/nonexistent-agentry-dir");
        assert!(matches!(spawn(&s), Err(ProcessError::Spawn { .. })));
    }

    #[tokio::test]
    async fn terminate_kills_grandchildren() {
        let mut child = spawn(&spec("sh", &["-c", "sleep 60 & echo $!; sleep 60"])).unwrap();
        let mut stdout = child.take_stdout().unwrap();
        let grandchild: u32 = read_line(&mut stdout).await.parse().unwrap();
        assert_eq!(identity_of(grandchild).unwrap().pgid, child.pgid());

        child.terminate(Duration::from_secs(5)).await.unwrap();
        assert!(wait_dead(child.pid()).await);
        assert!(wait_dead(grandchild).await);
    }

    #[tokio::test]
    async fn terminate_kills_members_that_outlive_the_leader() {
        // The grandchild ignores TERM; the leader does not.
        let script = "(trap '' TERM; exec sleep 60) & echo $!; exec sleep 60";
        let mut child = spawn(&spec("sh", &["-c", script])).unwrap();
        let mut stdout = child.take_stdout().unwrap();
        let grandchild: u32 = read_line(&mut stdout).await.parse().unwrap();
        // Let the subshell install its disposition and exec.
        tokio::time::sleep(Duration::from_millis(200)).await;

        let started = std::time::Instant::now();
        child.terminate(Duration::from_secs(10)).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(wait_dead(grandchild).await);
    }

    #[tokio::test]
    async fn terminate_escalates_to_kill() {
        let mut child = spawn(&spec(
            "sh",
            &["-c", "trap '' TERM; echo ready; exec sleep 60"],
        ))
        .unwrap();
        let mut stdout = child.take_stdout().unwrap();
        assert_eq!(read_line(&mut stdout).await, "ready");
        let started = std::time::Instant::now();
        let status = child.terminate(Duration::from_millis(300)).await.unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(started.elapsed() >= Duration::from_millis(300));
    }

    #[tokio::test]
    async fn terminate_after_exit_sends_nothing() {
        let mut child = spawn(&spec("true", &[])).unwrap();
        assert!(child.wait().await.unwrap().success());
        assert!(
            child
                .terminate(Duration::from_secs(1))
                .await
                .unwrap()
                .success()
        );
    }

    #[tokio::test]
    async fn drop_kills_the_group() {
        let mut child = spawn(&spec("sh", &["-c", "sleep 60 & echo $!; sleep 60"])).unwrap();
        let mut stdout = child.take_stdout().unwrap();
        let grandchild: u32 = read_line(&mut stdout).await.parse().unwrap();
        let pid = child.pid();
        drop(child);
        assert!(wait_dead(pid).await);
        assert!(wait_dead(grandchild).await);
    }

    #[tokio::test]
    async fn end_leftover_only_kills_a_matching_process() {
        let mut child = spawn(&spec("sleep", &["60"])).unwrap();
        let id = child.identity.clone();
        // A wrong start time must leave the process alone.
        end_leftover(id.pid, id.pgid, id.start_ticks + 1).await;
        assert!(!is_dead(id.pid));
        end_leftover(id.pid, id.pgid, id.start_ticks).await;
        assert!(wait_dead(id.pid).await);
        child.terminate(Duration::from_secs(1)).await.unwrap();
    }
}

/// `arg` with every agentry API token in it masked (an agent's MCP configuration may be
/// an argument, bearing the agent's token): the ledger records commands, never tokens.
fn mask_api_tokens(arg: &str) -> String {
    const PREFIX: &str = "agt_pat_";
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(i) = rest.find(PREFIX) {
        out.push_str(&rest[..i + PREFIX.len()]);
        rest = &rest[i + PREFIX.len()..];
        let secret = rest.bytes().take_while(u8::is_ascii_hexdigit).count();
        if secret > 0 {
            out.push_str(crate::domain::REDACTED);
            rest = &rest[secret..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod token_mask_tests {
    #[test]
    fn recorded_commands_hold_no_api_token() {
        let token = format!("agt_pat_{}", "ab12".repeat(16));
        let arg = format!(r#"{{"headers":{{"Authorization":"Bearer {token}"}}}}"#);
        let masked = super::mask_api_tokens(&arg);
        assert!(!masked.contains("ab12ab12"), "{masked}");
        assert!(masked.contains("agt_pat_[redacted]"), "{masked}");
        assert_eq!(
            super::mask_api_tokens("--model agt_pat_"),
            "--model agt_pat_"
        );
    }
}
