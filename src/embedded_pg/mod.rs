//! The embedded default database: a private PostgreSQL cluster run from the system's
//! binaries (`initdb`, `postgres`), reachable only on a unix socket. Used by `agentry
//! serve` without `DATABASE_URL`, and by the test harness for its throwaway cluster.
//!
//! This module owns the cluster's whole life: locating the binaries, choosing and
//! preparing the cluster directory (`data/` is PGDATA, `sock/` the socket directory,
//! `postgres.log` the server log), `initdb` on first use, clearing what a crash left
//! behind, running the postmaster as a child we own, and shutting it down in order.
//!
//! The postmaster is forked from one process-wide thread that never exits, and asks the
//! kernel for `SIGINT` (a fast shutdown) when its parent dies; so even if agentry is
//! killed, the cluster shuts itself down cleanly.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgSslMode};

use crate::process;
use crate::store::StoreHealth;
use crate::store::health::{FULL_MARGIN, SpaceMeter};

/// Only used in the socket file name (`.s.PGSQL.5432`): the socket directory is private.
const PORT: u16 = 5432;
/// The cluster superuser created by `initdb -U`.
const SUPERUSER: &str = "postgres";
/// The system account the server runs as when agentry runs as root.
const SYSTEM_USER: &str = "postgres";
/// Where clusters live when running as root (the `postgres` user cannot enter /root).
const ROOT_CLUSTER_BASE: &str = "/var/lib/agentry";
/// `sun_path` holds 108 bytes; stay well clear of it.
const SOCKET_PATH_LIMIT: usize = 100;
/// Prefix of the per-process test cluster directories under /tmp.
const TEST_DIR_PREFIX: &str = "agentry-test-pg-";

const POLL_INTERVAL: Duration = Duration::from_millis(50);
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const LEFTOVER_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
const QUIT_TIMEOUT: Duration = Duration::from_secs(5);
const TEST_STOP_TIMEOUT: Duration = Duration::from_secs(5);
const LOG_TAIL_LINES: usize = 20;
/// How often the supervisor checks that the postmaster still runs.
const WATCH_EVERY: Duration = Duration::from_millis(100);
/// The first wait after a failed restart; it doubles up to `RESTART_BACKOFF_MAX`.
const RESTART_BACKOFF_MIN: Duration = Duration::from_millis(500);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How long orphaned backends of a dead postmaster get to exit after `SIGQUIT`, and then
/// after `SIGKILL`.
const ORPHAN_GRACE: Duration = Duration::from_secs(2);
/// The longest reason a failed restart gives the readiness probe.
const NOTE_LIMIT: usize = 600;

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "PostgreSQL server binaries (initdb, postgres) were not found on PATH or in /usr/lib/postgresql/*/bin; install PostgreSQL or set DATABASE_URL to use an external database"
    )]
    BinariesNotFound,
    #[error(
        "the embedded database in {data_dir} is in use by another process (pid {pid}); is another agentry running with this data dir?"
    )]
    InUse { pid: i32, data_dir: PathBuf },
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
///
/// Dropping a cluster that was not stopped sends the postmaster `SIGINT` without
/// waiting for it; call `stop` to wait for an orderly shutdown.
pub struct EmbeddedPostgres {
    pub cluster_dir: PathBuf,
    pub socket_dir: PathBuf,
    pub port: u16,
    data_dir: PathBuf,
    log_path: PathBuf,
    running: Arc<Running>,
    supervisor: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// The postmaster we run, as the supervisor shares it with its owner.
struct Running {
    layout: Layout,
    ephemeral: bool,
    pid: AtomicU32,
    child: Mutex<Option<Child>>,
    /// Set by `stop` (and on drop): the supervisor restarts nothing any more.
    stopping: AtomicBool,
}

impl Running {
    fn child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for EmbeddedPostgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedPostgres")
            .field("cluster_dir", &self.cluster_dir)
            .field("socket_dir", &self.socket_dir)
            .field("port", &self.port)
            .field("pid", &self.pid())
            .finish()
    }
}

impl EmbeddedPostgres {
    /// Start (initializing on first use) the cluster belonging to `opts.data_dir`.
    /// Returns once the server accepts connections.
    pub async fn start(opts: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        run_blocking(move || {
            find_binaries()?;
            let as_root = run_as()?.is_some();
            fs::create_dir_all(&opts.data_dir)?;
            let cluster_dir = default_cluster_dir(&opts.data_dir, as_root)?;
            if as_root {
                ensure_root_base()?;
            }
            Self::start_blocking(cluster_dir, opts.ephemeral)
        })
        .await
    }

    /// Start a cluster in an explicit `cluster_dir` instead of the one derived from a data
    /// dir. When running as root, every ancestor of `cluster_dir` must be enterable by the
    /// `postgres` user; the directory itself is created (or taken over) as its own.
    pub async fn start_in(
        cluster_dir: impl Into<PathBuf>,
        ephemeral: bool,
    ) -> Result<Self, EmbeddedError> {
        let cluster_dir = cluster_dir.into();
        run_blocking(move || Self::start_blocking(cluster_dir, ephemeral)).await
    }

    /// Connection options for `database` on the cluster of `data_dir` when a server is
    /// already running it (e.g. `agentry serve`), so a command can use it alongside.
    pub fn running(data_dir: &Path, database: &str) -> Option<PgConnectOptions> {
        let as_root = run_as().ok()?.is_some();
        let cluster_dir = default_cluster_dir(data_dir, as_root).ok()?;
        let pid = read_pid_file(&cluster_dir.join("data").join("postmaster.pid"))?;
        (process_alive(pid) && is_postgres_process(pid))
            .then(|| socket_connect_options(&socket_dir_for(&cluster_dir), PORT, database))
    }

    /// Connection options for `database` over the unix socket, as the cluster superuser.
    pub fn connect_options(&self, database: &str) -> PgConnectOptions {
        socket_connect_options(&self.socket_dir, self.port, database)
    }

    /// Create `database` if it does not exist.
    pub async fn ensure_database(&self, database: &str) -> Result<(), EmbeddedError> {
        validate_database_name(database)?;
        let mut conn = PgConnection::connect_with(&self.connect_options("postgres"))
            .await
            .map_err(|e| db_error("connect to the maintenance database", e))?;
        let exists = sqlx::query("SELECT 1 FROM pg_database WHERE datname = $1")
            .bind(database)
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| db_error("look up database", e))?
            .is_some();
        if !exists {
            // The name was validated above to be `[a-z0-9_]{1,63}`, so quoting it is enough.
            let create = sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{database}\""));
            match sqlx::query(create).execute(&mut conn).await {
                Ok(_) => tracing::info!(database, "created database in embedded PostgreSQL"),
                // Someone else created it between the check and the CREATE.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
                Err(e) => {
                    return Err(db_error(&format!("create database {database}"), e));
                }
            }
        }
        let _ = conn.close().await;
        Ok(())
    }

    /// Fast shutdown: `SIGINT`, up to 15 s for the postmaster to exit, then `SIGQUIT`
    /// (and as a last resort `SIGKILL`). Ends the supervision first. Calling it again
    /// does nothing.
    pub async fn stop(&self) -> Result<(), EmbeddedError> {
        self.running.stopping.store(true, Ordering::SeqCst);
        let supervisor = self
            .supervisor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = supervisor {
            run_blocking(move || {
                let _ = thread.join();
                Ok(())
            })
            .await?;
        }
        let Some(child) = self.take_child() else {
            return Ok(());
        };
        run_blocking(move || shutdown_child(child, STOP_TIMEOUT, true)).await
    }

    /// Watch the postmaster from now on and start it again whenever it exits (a crash, an
    /// OOM kill, a stray `kill`): clear what the dead one left (its orphaned backends, a
    /// stale `postmaster.pid`), start it again (PostgreSQL replays its WAL), retrying with
    /// a backoff from 0.5 s doubling to 10 s for as long as it takes. `health` hears that
    /// the store is down, and why, until it runs again. Once per cluster; later calls do
    /// nothing.
    pub fn supervise(&self, health: Arc<StoreHealth>) {
        let mut slot = self
            .supervisor
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() || self.running.stopping.load(Ordering::SeqCst) {
            return;
        }
        let running = self.running.clone();
        match std::thread::Builder::new()
            .name("agentry-pg-supervisor".into())
            .spawn(move || supervise(&running, &health))
        {
            Ok(thread) => *slot = Some(thread),
            Err(e) => {
                tracing::error!(error = %e, "could not start the supervisor of the embedded PostgreSQL; it is not restarted should it exit");
            }
        }
    }

    /// Measures the free space of the file system that holds the cluster (for
    /// `StoreHealth`: a full disk ends when it has room again).
    pub fn space_meter(&self) -> SpaceMeter {
        let dir = self.data_dir.clone();
        Box::new(move || free_bytes(&dir))
    }

    /// The cluster's PGDATA directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server log (stdout and stderr of `initdb` and the postmaster, appended).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Process id of the postmaster (the current one, after a restart).
    pub fn pid(&self) -> u32 {
        self.running.pid.load(Ordering::SeqCst)
    }

    fn take_child(&self) -> Option<Child> {
        self.running.child().take()
    }

    /// Blocking `stop` with a custom grace period; used at process exit.
    fn stop_blocking(&self, grace: Duration, log: bool) -> Result<(), EmbeddedError> {
        match self.take_child() {
            Some(child) => shutdown_child(child, grace, log),
            None => Ok(()),
        }
    }

    fn start_blocking(cluster_dir: PathBuf, ephemeral: bool) -> Result<Self, EmbeddedError> {
        let started = Instant::now();
        let bins = find_binaries()?;
        let owner = run_as()?;
        let layout = prepare_layout(cluster_dir, owner)?;
        clear_stale_state(&layout)?;
        init_cluster(&bins, &layout, owner, ephemeral)?;
        let child = launch(&bins, &layout, owner, ephemeral)?;
        let pid = child.id();
        tracing::info!(
            cluster = %layout.cluster_dir.display(),
            pid,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "embedded PostgreSQL is ready"
        );
        Ok(Self {
            cluster_dir: layout.cluster_dir.clone(),
            socket_dir: layout.socket_dir.clone(),
            port: PORT,
            data_dir: layout.data_dir.clone(),
            log_path: layout.log_path.clone(),
            running: Arc::new(Running {
                layout,
                ephemeral,
                pid: AtomicU32::new(pid),
                child: Mutex::new(Some(child)),
                stopping: AtomicBool::new(false),
            }),
            supervisor: Mutex::new(None),
        })
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        // The supervisor sees the flag within `WATCH_EVERY` (or after the restart it is
        // in) and ends without restarting anything.
        self.running.stopping.store(true, Ordering::SeqCst);
        let Some(mut child) = self.take_child() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            send_signal(child.id() as i32, libc::SIGINT);
            // Reap it in the background so no zombie is left behind.
            let _ = std::thread::Builder::new()
                .name("agentry-pg-reaper".into())
                .spawn(move || {
                    let _ = child.wait();
                });
        }
    }
}

/// The process-wide PostgreSQL cluster for tests (unit and integration): started lazily
/// on first call in `/tmp/agentry-test-pg-<pid>`, ephemeral (no fsync), shared by every
/// caller in the process, and stopped and removed when the process exits. Not meant for
/// production use. Blocks while the cluster starts; panics if it cannot be started.
pub fn test_cluster() -> &'static EmbeddedPostgres {
    TEST_CLUSTER.get_or_init(|| {
        sweep_abandoned_test_dirs();
        let dir = Path::new("/tmp").join(format!("{TEST_DIR_PREFIX}{}", std::process::id()));
        if let Err(e) = remove_path(&dir) {
            panic!("could not remove old test cluster {}: {e}", dir.display());
        }
        let cluster = EmbeddedPostgres::start_blocking(dir, true)
            .unwrap_or_else(|e| panic!("could not start the test PostgreSQL cluster: {e}"));
        // SAFETY: registers a plain `extern "C"` function with no arguments.
        unsafe {
            libc::atexit(stop_test_cluster_at_exit);
        }
        cluster
    })
}

static TEST_CLUSTER: OnceLock<EmbeddedPostgres> = OnceLock::new();

extern "C" fn stop_test_cluster_at_exit() {
    if let Some(cluster) = TEST_CLUSTER.get() {
        // No logging here: thread-local state may already be torn down.
        let _ = cluster.stop_blocking(TEST_STOP_TIMEOUT, false);
        let _ = fs::remove_dir_all(&cluster.cluster_dir);
    }
}

/// Removes test cluster directories whose test process is gone (killed before its exit
/// handler could run).
fn sweep_abandoned_test_dirs() {
    let Ok(entries) = fs::read_dir("/tmp") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(TEST_DIR_PREFIX))
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if pid <= 0 || pid as u32 == std::process::id() || process_alive(pid) {
            continue;
        }
        let path = entry.path();
        if !fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        if let Some(pm) = read_pid_file(&path.join("data").join("postmaster.pid"))
            && process_alive(pm)
            && is_postgres_process(pm)
        {
            continue;
        }
        let _ = fs::remove_dir_all(&path);
    }
}

// ---------------------------------------------------------------------------------------
// Binaries and accounts

#[derive(Debug, Clone)]
struct Binaries {
    initdb: PathBuf,
    postgres: PathBuf,
}

/// Where PostgreSQL packages of Debian and Ubuntu put one `bin/` per major version.
const VERSIONED_INSTALLS: &str = "/usr/lib/postgresql";

/// `initdb` from PATH, else from the newest `/usr/lib/postgresql/<version>/bin` that has
/// both programs; `postgres` from the same directory as `initdb`, since `initdb` itself
/// runs the `postgres` beside it and a pair from two installs would not match.
fn find_binaries() -> Result<Binaries, EmbeddedError> {
    let versioned = versioned_bin_dirs(Path::new(VERSIONED_INSTALLS));
    let pair = |initdb: PathBuf| {
        let postgres = initdb.with_file_name("postgres");
        process::is_executable(&postgres).then_some(Binaries { initdb, postgres })
    };
    let path = std::env::var_os("PATH");
    process::find_executable_in("initdb", path.as_deref(), &versioned, Path::new(""))
        .and_then(pair)
        // An `initdb` on PATH without its `postgres` does not hide a complete install.
        .or_else(|| versioned.first().and_then(|bin| pair(bin.join("initdb"))))
        .ok_or(EmbeddedError::BinariesNotFound)
}

/// The `<version>/bin` directories under `root` holding both `initdb` and `postgres`,
/// newest version first.
fn versioned_bin_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut dirs: Vec<(Vec<u32>, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str().and_then(parse_version)?;
            let bin = entry.path().join("bin");
            let complete = process::is_executable(&bin.join("initdb"))
                && process::is_executable(&bin.join("postgres"));
            complete.then_some((version, bin))
        })
        .collect();
    dirs.sort_by(|a, b| b.0.cmp(&a.0));
    dirs.into_iter().map(|(_, bin)| bin).collect()
}

/// `"15"` → `[15]`, `"9.6"` → `[9, 6]`.
fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

#[derive(Debug, Clone, Copy)]
struct Account {
    uid: u32,
    gid: u32,
}

/// The account to run `initdb` and `postgres` as: `None` means "as ourselves"; when we
/// are root it is the `postgres` system user (PostgreSQL refuses to run as root).
fn run_as() -> Result<Option<Account>, EmbeddedError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    lookup_account(SYSTEM_USER).map(Some).ok_or_else(|| {
        EmbeddedError::Failed(format!(
            "running as root, but there is no `{SYSTEM_USER}` system user to run the database server as"
        ))
    })
}

fn lookup_account(name: &str) -> Option<Account> {
    let cname = CString::new(name).ok()?;
    let mut buf: Vec<libc::c_char> = vec![0; 16 * 1024];
    // SAFETY: `passwd` is plain data; all-zero is a valid (empty) value.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and `buf.len()` is its real size.
    let rc = unsafe {
        libc::getpwnam_r(
            cname.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    Some(Account {
        uid: pwd.pw_uid,
        gid: pwd.pw_gid,
    })
}

// ---------------------------------------------------------------------------------------
// Directory layout

#[derive(Debug, Clone)]
struct Layout {
    cluster_dir: PathBuf,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    log_path: PathBuf,
}

/// Where the cluster of `data_dir` lives. As root: `/var/lib/agentry/pg-<16 hex of the
/// sha256 of the canonical data dir>`; otherwise `<data_dir>/pg`.
fn default_cluster_dir(data_dir: &Path, as_root: bool) -> io::Result<PathBuf> {
    if as_root {
        let canonical = fs::canonicalize(data_dir)?;
        Ok(Path::new(ROOT_CLUSTER_BASE).join(format!("pg-{}", short_hash(&canonical))))
    } else {
        Ok(data_dir.join("pg"))
    }
}

fn short_hash(path: &Path) -> String {
    let digest = Sha256::digest(path.as_os_str().as_bytes());
    hex::encode(&digest[..8])
}

/// `/var/lib/agentry`, owned by root, mode 0755 when we create it.
fn ensure_root_base() -> io::Result<()> {
    let base = Path::new(ROOT_CLUSTER_BASE);
    if let Some(parent) = base.parent() {
        fs::create_dir_all(parent)?;
    }
    match fs::DirBuilder::new().mode(0o755).create(base) {
        Ok(()) => fs::set_permissions(base, fs::Permissions::from_mode(0o755)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The socket directory: `<cluster>/sock`, unless the socket path would get too long for
/// a unix socket address, then a private directory under /tmp.
fn socket_dir_for(cluster_dir: &Path) -> PathBuf {
    let preferred = cluster_dir.join("sock");
    if socket_path_len(&preferred) < SOCKET_PATH_LIMIT {
        preferred
    } else {
        Path::new("/tmp").join(format!("agentry-sock-{}", short_hash(cluster_dir)))
    }
}

fn socket_path_len(socket_dir: &Path) -> usize {
    socket_dir.as_os_str().len() + format!("/.s.PGSQL.{PORT}").len()
}

fn prepare_layout(cluster_dir: PathBuf, owner: Option<Account>) -> Result<Layout, EmbeddedError> {
    let cluster_dir = if cluster_dir.is_absolute() {
        cluster_dir
    } else {
        std::env::current_dir()?.join(cluster_dir)
    };
    if let Some(parent) = cluster_dir.parent() {
        fs::create_dir_all(parent)?;
    }
    make_private_dir(&cluster_dir, owner)?;
    let socket_dir = socket_dir_for(&cluster_dir);
    if socket_dir.starts_with(&cluster_dir) {
        make_private_dir(&socket_dir, owner)?;
    } else {
        make_shared_tmp_private_dir(&socket_dir, owner)?;
    }
    Ok(Layout {
        data_dir: cluster_dir.join("data"),
        log_path: cluster_dir.join("postgres.log"),
        socket_dir,
        cluster_dir,
    })
}

/// Create `path` (mode 0700) or take over an existing directory of ours.
fn make_private_dir(path: &Path, owner: Option<Account>) -> io::Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    if !fs::symlink_metadata(path)?.is_dir() {
        return Err(io::Error::other(format!(
            "{} exists and is not a directory",
            path.display()
        )));
    }
    if let Some(account) = owner {
        std::os::unix::fs::chown(path, Some(account.uid), Some(account.gid))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(0o700))
}

/// Like `make_private_dir`, for a directory in a world-writable place: an existing one is
/// only used if it already belongs to the server's account.
fn make_shared_tmp_private_dir(path: &Path, owner: Option<Account>) -> io::Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {
            if let Some(account) = owner {
                std::os::unix::fs::chown(path, Some(account.uid), Some(account.gid))?;
            }
            fs::set_permissions(path, fs::Permissions::from_mode(0o700))
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let meta = fs::symlink_metadata(path)?;
            // SAFETY: geteuid has no preconditions.
            let expected = owner.map_or_else(|| unsafe { libc::geteuid() }, |a| a.uid);
            if !meta.is_dir() || meta.uid() != expected || meta.mode() & 0o077 != 0 {
                return Err(io::Error::other(format!(
                    "{} exists but is not a private directory of the database server's user",
                    path.display()
                )));
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Open the server log for appending, owned by the server's account.
fn open_log(path: &Path, owner: Option<Account>) -> io::Result<File> {
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    if let Some(account) = owner {
        std::os::unix::fs::fchown(&file, Some(account.uid), Some(account.gid))?;
    }
    Ok(file)
}

/// The last lines of the log written since `offset`.
fn log_tail(path: &Path, offset: u64) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        if file.seek(SeekFrom::Start(offset)).is_err() {
            return text;
        }
        let mut bytes = Vec::new();
        let _ = file.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(LOG_TAIL_LINES);
    lines[start..].join("\n")
}

fn remove_path(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn remove_file_if_exists(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

// ---------------------------------------------------------------------------------------
// Processes

/// Free bytes for unprivileged writers (the database server) on the file system of
/// `path`; `None` when it cannot be measured.
fn free_bytes(path: &Path) -> Option<u64> {
    let path = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain data; all-zero is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string and `st` is valid for writes.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Whether `pid` is a live process (zombies do not count).
fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            // SAFETY: signal 0 only checks for existence and permission.
            let rc = unsafe { libc::kill(pid, 0) };
            rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
        }
    }
}

/// The parent of `pid` when it is a live process other than init: a postmaster that still
/// has its parent belongs to a running server, not to a crashed one.
fn live_parent(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ppid: i32 = stat
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    (ppid > 1 && process_alive(ppid) && ppid != std::process::id() as i32).then_some(ppid)
}

fn is_postgres_process(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|comm| matches!(comm.trim(), "postgres" | "postmaster"))
}

/// Whether the process' working directory is `data_dir` (the postmaster chdirs to it).
fn process_runs_in(pid: i32, data_dir: &Path) -> bool {
    let Ok(cwd) = fs::read_link(format!("/proc/{pid}/cwd")) else {
        return false;
    };
    let wanted = fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    cwd == wanted
}

fn send_signal(pid: i32, signal: libc::c_int) {
    if pid > 0 {
        // SAFETY: plain kill(2) on a positive pid.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

fn wait_until_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if !process_alive(pid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Waits for our child to exit (reaping it); `true` if it did within `timeout`.
fn wait_child(child: &mut Child, timeout: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait()?.is_some() {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

fn shutdown_child(mut child: Child, grace: Duration, log: bool) -> Result<(), EmbeddedError> {
    if child.try_wait()?.is_some() {
        return Ok(());
    }
    let pid = child.id() as i32;
    send_signal(pid, libc::SIGINT);
    if wait_child(&mut child, grace)? {
        if log {
            tracing::info!(pid, "embedded PostgreSQL stopped");
        }
        return Ok(());
    }
    if log {
        tracing::warn!(
            pid,
            "embedded PostgreSQL did not finish a fast shutdown in time; sending SIGQUIT"
        );
    }
    send_signal(pid, libc::SIGQUIT);
    if wait_child(&mut child, QUIT_TIMEOUT)? {
        return Ok(());
    }
    if log {
        tracing::warn!(pid, "embedded PostgreSQL ignored SIGQUIT; killing it");
    }
    child.kill()?;
    child.wait()?;
    Ok(())
}

fn read_pid_file(path: &Path) -> Option<i32> {
    let contents = fs::read_to_string(path).ok()?;
    contents
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
        .filter(|pid| *pid > 0)
}

/// Deals with what an earlier run may have left: a `postmaster.pid` of a dead (or
/// unrelated) process, a postmaster of ours still running on this data dir, stale socket
/// lock files.
fn clear_stale_state(layout: &Layout) -> Result<(), EmbeddedError> {
    let pid_file = layout.data_dir.join("postmaster.pid");
    if fs::symlink_metadata(&pid_file).is_ok() {
        let pid = read_pid_file(&pid_file);
        match pid {
            Some(pid)
                if process_alive(pid)
                    && is_postgres_process(pid)
                    && process_runs_in(pid, &layout.data_dir) =>
            {
                if let Some(owner) = live_parent(pid) {
                    return Err(EmbeddedError::InUse {
                        pid: owner,
                        data_dir: layout.data_dir.clone(),
                    });
                }
                tracing::warn!(
                    pid,
                    data = %layout.data_dir.display(),
                    "a PostgreSQL server from an earlier run is still running on the embedded cluster; shutting it down"
                );
                send_signal(pid, libc::SIGINT);
                if !wait_until_gone(pid, LEFTOVER_SHUTDOWN_TIMEOUT) {
                    return Err(EmbeddedError::Failed(format!(
                        "a PostgreSQL server (pid {pid}) is still running on {} and did not shut down within {} s",
                        layout.data_dir.display(),
                        LEFTOVER_SHUTDOWN_TIMEOUT.as_secs()
                    )));
                }
                // A clean shutdown removes the file; a zombie of ours may not have.
                remove_file_if_exists(&pid_file)?;
            }
            _ => {
                tracing::warn!(
                    pid = ?pid,
                    file = %pid_file.display(),
                    "removing stale postmaster.pid: no PostgreSQL server with that pid is running"
                );
                remove_file_if_exists(&pid_file)?;
            }
        }
    }
    // Nothing of ours runs on this cluster now, so socket files in its private socket
    // directory are leftovers (their lock file may name a pid that has been reused).
    for name in [format!(".s.PGSQL.{PORT}"), format!(".s.PGSQL.{PORT}.lock")] {
        let path = layout.socket_dir.join(name);
        if remove_file_if_exists(&path)? {
            tracing::warn!(file = %path.display(), "removed stale PostgreSQL socket file");
        }
    }
    Ok(())
}

fn init_cluster(
    bins: &Binaries,
    layout: &Layout,
    owner: Option<Account>,
    ephemeral: bool,
) -> Result<(), EmbeddedError> {
    if layout.data_dir.join("PG_VERSION").is_file() {
        return Ok(());
    }
    if fs::symlink_metadata(&layout.data_dir).is_ok() {
        tracing::warn!(
            data = %layout.data_dir.display(),
            "removing an incompletely initialized embedded PostgreSQL data directory"
        );
        remove_path(&layout.data_dir)?;
    }
    tracing::info!(
        data = %layout.data_dir.display(),
        initdb = %bins.initdb.display(),
        "initializing the embedded PostgreSQL cluster"
    );
    let mut log = open_log(&layout.log_path, owner)?;
    let mut failures = Vec::new();
    for locale in ["C.UTF-8", "C"] {
        let mut cmd = Command::new(&bins.initdb);
        cmd.arg("-D")
            .arg(&layout.data_dir)
            .args(["-U", SUPERUSER, "--auth=trust", "-E", "UTF8"])
            .arg(format!("--locale={locale}"))
            .current_dir(&layout.cluster_dir)
            .stdin(Stdio::null());
        if ephemeral {
            cmd.arg("--no-sync");
        }
        if let Some(account) = owner {
            cmd.uid(account.uid).gid(account.gid);
        }
        let output = cmd.output()?;
        let _ = log.write_all(&output.stdout);
        let _ = log.write_all(&output.stderr);
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        failures.push(format!(
            "initdb --locale={locale} failed ({}): {}",
            output.status,
            stderr.trim()
        ));
        remove_path(&layout.data_dir)?;
    }
    Err(EmbeddedError::Failed(failures.join("; ")))
}

// ---------------------------------------------------------------------------------------
// Starting the postmaster

struct SpawnRequest {
    command: Command,
    reply: mpsc::Sender<io::Result<Child>>,
}

/// The process-wide thread that forks the postmaster. The kernel delivers the
/// parent-death signal when the forking *thread* exits, so that thread must live as long
/// as the process does.
fn spawner() -> Result<&'static mpsc::Sender<SpawnRequest>, EmbeddedError> {
    static SPAWNER: OnceLock<Result<mpsc::Sender<SpawnRequest>, String>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<SpawnRequest>();
            std::thread::Builder::new()
                .name("agentry-pg-spawner".into())
                .spawn(move || {
                    // The sender lives in a static, so this loop never ends.
                    for request in rx {
                        let mut command = request.command;
                        let _ = request.reply.send(command.spawn());
                    }
                })
                .map(|_| tx)
                .map_err(|e| format!("could not start the process spawner thread: {e}"))
        })
        .as_ref()
        .map_err(|e| EmbeddedError::Failed(e.clone()))
}

fn spawn_from_spawner(command: Command) -> Result<Child, EmbeddedError> {
    let (reply, answer) = mpsc::channel();
    spawner()?
        .send(SpawnRequest { command, reply })
        .map_err(|_| EmbeddedError::Failed("the process spawner thread is gone".into()))?;
    let child = answer
        .recv()
        .map_err(|_| EmbeddedError::Failed("the process spawner thread is gone".into()))??;
    Ok(child)
}

fn launch(
    bins: &Binaries,
    layout: &Layout,
    owner: Option<Account>,
    ephemeral: bool,
) -> Result<Child, EmbeddedError> {
    let log = open_log(&layout.log_path, owner)?;
    let log_offset = log.metadata()?.len();
    let port = PORT.to_string();
    let mut cmd = Command::new(&bins.postgres);
    cmd.arg("-D")
        .arg(&layout.data_dir)
        .arg("-k")
        .arg(&layout.socket_dir)
        .args(["-c", "listen_addresses=", "-p", &port])
        .args(["-c", "max_connections=200", "-c", "shared_buffers=128MB"]);
    if ephemeral {
        cmd.args([
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
        ]);
    }
    cmd.current_dir(&layout.cluster_dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a terminal's Ctrl-C reaches agentry only, which then
        // stops the server in order.
        .process_group(0);
    if let Some(account) = owner {
        cmd.uid(account.uid).gid(account.gid);
    }
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the hook only makes async-signal-safe system calls and does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            // Runs after the switch to the server's account, which would reset it.
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGINT as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before the request was in place.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let mut child = spawn_from_spawner(cmd)?;
    match wait_ready(&mut child, layout) {
        Ok(()) => Ok(child),
        Err(problem) => {
            let _ = shutdown_child(child, QUIT_TIMEOUT, false);
            let tail = log_tail(&layout.log_path, log_offset);
            Err(EmbeddedError::Failed(format!(
                "{problem}; last lines of {}:\n{tail}",
                layout.log_path.display()
            )))
        }
    }
}

/// Polls until `postmaster.pid` names our child and says "ready".
fn wait_ready(child: &mut Child, layout: &Layout) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let pid = child.id().to_string();
    let pid_file = layout.data_dir.join("postmaster.pid");
    let socket = layout.socket_dir.join(format!(".s.PGSQL.{PORT}"));
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Err(format!("postgres exited during startup ({status})")),
            Ok(None) => {}
            Err(e) => return Err(format!("could not check on postgres: {e}")),
        }
        if let Ok(contents) = fs::read_to_string(&pid_file) {
            let mut lines = contents.lines();
            let ours = lines.next().map(str::trim) == Some(pid.as_str());
            // Line 8 is the postmaster status.
            let ready = lines.nth(6).map(str::trim) == Some("ready");
            if ours && ready && socket.exists() {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "postgres did not become ready within {} s",
                READY_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

// ---------------------------------------------------------------------------------------
// Supervision

/// Watch the postmaster until `stop`; restart it whenever it exits.
fn supervise(running: &Running, health: &StoreHealth) {
    loop {
        if running.stopping.load(Ordering::SeqCst) {
            return;
        }
        let exited = {
            let mut slot = running.child();
            let Some(child) = slot.as_mut() else {
                // Taken by `stop`.
                return;
            };
            match child.try_wait() {
                Ok(Some(status)) => {
                    slot.take();
                    Some(status)
                }
                Ok(None) => None,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot check on the embedded PostgreSQL");
                    None
                }
            }
        };
        match exited {
            None => std::thread::sleep(WATCH_EVERY),
            Some(status) => {
                if !recover(running, health, &status.to_string()) {
                    return;
                }
            }
        }
    }
}

/// The postmaster exited with `status`: start it again, for as long as it takes (false
/// when told to stop first).
fn recover(running: &Running, health: &StoreHealth, status: &str) -> bool {
    let lost = Instant::now();
    let old_pid = running.pid.load(Ordering::SeqCst);
    let note = format!("the embedded PostgreSQL exited ({status}); restarting it");
    tracing::error!(
        pid = old_pid,
        status,
        cluster = %running.layout.cluster_dir.display(),
        "the embedded PostgreSQL exited; restarting it"
    );
    health.set_note(Some(note.clone()));
    health.mark_down(note);
    let mut backoff = RESTART_BACKOFF_MIN;
    for attempt in 1u32.. {
        if running.stopping.load(Ordering::SeqCst) {
            return false;
        }
        match restart(running) {
            Ok(child) => {
                let pid = child.id();
                running.pid.store(pid, Ordering::SeqCst);
                *running.child() = Some(child);
                if running.stopping.load(Ordering::SeqCst) {
                    // Dropped while this attempt ran: nobody will stop this one.
                    if let Some(child) = running.child().take() {
                        let _ = shutdown_child(child, QUIT_TIMEOUT, false);
                    }
                    return false;
                }
                tracing::info!(
                    pid,
                    attempt,
                    down_ms = lost.elapsed().as_millis() as u64,
                    "the embedded PostgreSQL runs again (its crash recovery is done)"
                );
                health.set_note(None);
                // The prober confirms it answers and ends the outage.
                health.probe_now();
                return true;
            }
            Err(e) => {
                let why = compact(&e.to_string());
                tracing::warn!(
                    attempt,
                    retry_in_ms = backoff.as_millis() as u64,
                    error = %e,
                    "could not restart the embedded PostgreSQL; trying again"
                );
                health.set_note(Some(format!(
                    "the embedded PostgreSQL exited ({status}) and did not start again (attempt {attempt}, next in {} ms): {why}",
                    backoff.as_millis()
                )));
                // A cluster that could not start on a full disk is tried again as soon
                // as its file system has room, not at the end of the backoff.
                let short = |dir: &Path| free_bytes(dir).is_some_and(|f| f < FULL_MARGIN);
                let was_short = short(&running.layout.data_dir);
                let until = Instant::now() + backoff;
                while Instant::now() < until {
                    if running.stopping.load(Ordering::SeqCst) {
                        return false;
                    }
                    if was_short && !short(&running.layout.data_dir) {
                        tracing::info!(
                            "the disk of the embedded PostgreSQL has room again; starting it now"
                        );
                        break;
                    }
                    std::thread::sleep(WATCH_EVERY);
                }
                backoff = (backoff * 2).min(RESTART_BACKOFF_MAX);
            }
        }
    }
    unreachable!("the attempts never run out")
}

/// One attempt: clear what the dead postmaster left, start a new one, wait until ready.
fn restart(running: &Running) -> Result<Child, EmbeddedError> {
    let bins = find_binaries()?;
    let owner = run_as()?;
    let layout = &running.layout;
    let pid_file = layout.data_dir.join("postmaster.pid");
    // A postmaster someone else started on this data dir meanwhile is left alone
    // (`clear_stale_state` says who it is); only with none running are the processes
    // still at work in the data dir orphans of the one that died.
    let live_postmaster = read_pid_file(&pid_file).filter(|&pid| {
        process_alive(pid) && is_postgres_process(pid) && process_runs_in(pid, &layout.data_dir)
    });
    if live_postmaster.is_none() {
        end_orphans(&layout.data_dir, owner);
    }
    clear_stale_state(layout)?;
    launch(&bins, layout, owner, running.ephemeral)
}

/// End the backends a dead postmaster left running in `data_dir`: they hold its shared
/// memory, which keeps a new postmaster from starting. `SIGQUIT` (they exit at once),
/// then `SIGKILL` for any that did not.
fn end_orphans(data_dir: &Path, owner: Option<Account>) {
    // SAFETY: geteuid has no preconditions.
    let uid = owner.map_or_else(|| unsafe { libc::geteuid() }, |a| a.uid);
    let orphans = || -> Vec<i32> {
        let Ok(entries) = fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| {
                fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == uid)
                    && process_alive(pid)
                    && is_postgres_process(pid)
                    && process_runs_in(pid, data_dir)
            })
            .collect()
    };
    for (signal, name) in [(libc::SIGQUIT, "SIGQUIT"), (libc::SIGKILL, "SIGKILL")] {
        let pids = orphans();
        if pids.is_empty() {
            return;
        }
        tracing::warn!(
            pids = ?pids,
            signal = name,
            "ending the backends the dead embedded PostgreSQL left running"
        );
        for &pid in &pids {
            send_signal(pid, signal);
        }
        for &pid in &pids {
            wait_until_gone(pid, ORPHAN_GRACE);
        }
    }
}

/// A failure as one line the readiness probe can show: its last `NOTE_LIMIT` bytes.
fn compact(text: &str) -> String {
    let one_line = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ");
    if one_line.len() <= NOTE_LIMIT {
        return one_line;
    }
    let mut start = one_line.len() - NOTE_LIMIT;
    while !one_line.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &one_line[start..])
}

// ---------------------------------------------------------------------------------------
// Helpers

fn socket_connect_options(socket_dir: &Path, port: u16, database: &str) -> PgConnectOptions {
    PgConnectOptions::new_without_pgpass()
        .socket(socket_dir)
        .port(port)
        .username(SUPERUSER)
        .database(database)
        .ssl_mode(PgSslMode::Disable)
}

fn validate_database_name(name: &str) -> Result<(), EmbeddedError> {
    let valid = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(EmbeddedError::Failed(format!(
            "invalid database name {name:?}: use 1 to 63 of [a-z0-9_]"
        )))
    }
}

fn db_error(action: &str, e: sqlx::Error) -> EmbeddedError {
    EmbeddedError::Failed(format!("{action}: {e}"))
}

async fn run_blocking<T, F>(f: F) -> Result<T, EmbeddedError>
where
    F: FnOnce() -> Result<T, EmbeddedError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| EmbeddedError::Failed(format!("background task failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A temp dir the `postgres` user can enter when the tests run as root.
    fn reachable_tempdir() -> tempfile::TempDir {
        let dir = tempfile::Builder::new()
            .prefix("agentry-pg-")
            .tempdir_in("/tmp")
            .expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        dir
    }

    async fn select_one(pg: &EmbeddedPostgres, db: &str) -> i32 {
        let mut conn = PgConnection::connect_with(&pg.connect_options(db))
            .await
            .expect("connect");
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut conn)
            .await
            .expect("select 1");
        conn.close().await.expect("close");
        one
    }

    #[tokio::test]
    async fn start_create_restart_keeps_data() {
        let tmp = reachable_tempdir();
        let cluster_dir = tmp.path().join("cluster");

        let started = Instant::now();
        let pg = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("first start");
        eprintln!("first start (initdb + start): {:?}", started.elapsed());
        assert_eq!(pg.port, 5432);
        assert_eq!(pg.socket_dir, cluster_dir.join("sock"));
        assert!(pg.data_dir().join("PG_VERSION").is_file());

        pg.ensure_database("agentry_embedded_test")
            .await
            .expect("create db");
        pg.ensure_database("agentry_embedded_test")
            .await
            .expect("db exists");
        assert_eq!(select_one(&pg, "agentry_embedded_test").await, 1);

        let mut conn = PgConnection::connect_with(&pg.connect_options("agentry_embedded_test"))
            .await
            .expect("connect");
        sqlx::query("CREATE TABLE kept (v TEXT NOT NULL)")
            .execute(&mut conn)
            .await
            .expect("create table");
        sqlx::query("INSERT INTO kept (v) VALUES ('still here')")
            .execute(&mut conn)
            .await
            .expect("insert");
        conn.close().await.expect("close");

        let pid = pg.pid() as i32;
        pg.stop().await.expect("stop");
        pg.stop().await.expect("second stop is a no-op");
        assert!(!process_alive(pid));
        assert!(!pg.data_dir().join("postmaster.pid").exists());
        drop(pg);

        let started = Instant::now();
        let pg = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("restart");
        eprintln!("restart: {:?}", started.elapsed());
        let mut conn = PgConnection::connect_with(&pg.connect_options("agentry_embedded_test"))
            .await
            .expect("connect after restart");
        let v: String = sqlx::query_scalar("SELECT v FROM kept")
            .fetch_one(&mut conn)
            .await
            .expect("table survived the restart");
        assert_eq!(v, "still here");
        conn.close().await.expect("close");
        pg.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn stale_postmaster_pid_is_cleared() {
        let tmp = reachable_tempdir();
        let cluster_dir = tmp.path().join("cluster");
        let pg = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("start");
        pg.stop().await.expect("stop");

        let dead_pid = 999_999;
        assert!(
            !process_alive(dead_pid),
            "pid {dead_pid} unexpectedly alive"
        );
        let pid_file = pg.data_dir().join("postmaster.pid");
        fs::write(
            &pid_file,
            format!(
                "{dead_pid}\n{}\n1700000000\n5432\n{}\n\n  5432001     32768\nready   \n",
                pg.data_dir().display(),
                pg.socket_dir.display()
            ),
        )
        .expect("write stale pid file");
        fs::write(
            pg.socket_dir.join(".s.PGSQL.5432.lock"),
            format!(
                "{dead_pid}\n{}\n1700000000\n5432\n",
                pg.data_dir().display()
            ),
        )
        .expect("write stale socket lock");
        drop(pg);

        let pg = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("start over a stale postmaster.pid");
        assert_eq!(select_one(&pg, "postgres").await, 1);
        pg.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn leftover_postmaster_is_shut_down() {
        let tmp = reachable_tempdir();
        let cluster_dir = tmp.path().join("cluster");
        let first = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("start");
        // Lose track of the running server, as a crashed agentry would.
        let mut orphan = first.take_child().expect("child");
        drop(first);

        let second = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("start while the old server still runs");
        assert!(
            orphan.try_wait().expect("try_wait").is_some(),
            "old server stopped"
        );
        assert_ne!(second.pid(), orphan.id());
        assert_eq!(select_one(&second, "postgres").await, 1);
        second.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn startup_failure_reports_the_log() {
        let tmp = reachable_tempdir();
        let cluster_dir = tmp.path().join("cluster");
        let pg = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect("start");
        pg.stop().await.expect("stop");
        let conf = pg.data_dir().join("postgresql.conf");
        let mut file = OpenOptions::new()
            .append(true)
            .open(&conf)
            .expect("open conf");
        writeln!(file, "work_mem = 'not a size'").expect("break conf");
        drop(file);

        let err = EmbeddedPostgres::start_in(&cluster_dir, true)
            .await
            .expect_err("a broken configuration must fail the start");
        let message = err.to_string();
        assert!(message.contains("exited during startup"), "{message}");
        assert!(message.contains("work_mem"), "{message}");
    }

    #[tokio::test]
    async fn test_cluster_is_shared_across_threads() {
        let handles: Vec<_> = (0..2)
            .map(|_| std::thread::spawn(|| test_cluster() as *const EmbeddedPostgres as usize))
            .collect();
        let addresses: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(addresses[0], addresses[1]);
        let pg = test_cluster();
        assert_eq!(addresses[0], pg as *const EmbeddedPostgres as usize);
        assert!(
            pg.cluster_dir
                .ends_with(format!("{TEST_DIR_PREFIX}{}", std::process::id()))
        );
        assert_eq!(select_one(pg, "postgres").await, 1);

        pg.ensure_database("agentry_shared_test")
            .await
            .expect("create db");
        pg.ensure_database("agentry_shared_test")
            .await
            .expect("db exists");
        assert_eq!(select_one(pg, "agentry_shared_test").await, 1);
        assert!(pg.ensure_database("Not-Valid").await.is_err());
    }

    #[test]
    fn database_names_are_validated() {
        assert!(validate_database_name("agentry").is_ok());
        assert!(validate_database_name("a_1").is_ok());
        assert!(validate_database_name(&"a".repeat(63)).is_ok());
        assert!(validate_database_name("").is_err());
        assert!(validate_database_name(&"a".repeat(64)).is_err());
        assert!(validate_database_name("Agentry").is_err());
        assert!(validate_database_name("a\"b").is_err());
        assert!(validate_database_name("a-b").is_err());
    }

    #[test]
    fn cluster_dir_location() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = tmp.path().join("data");
        fs::create_dir(&data).unwrap();
        assert_eq!(default_cluster_dir(&data, false).unwrap(), data.join("pg"));

        let as_root = default_cluster_dir(&data, true).unwrap();
        let canonical = fs::canonicalize(&data).unwrap();
        let digest = hex::encode(Sha256::digest(canonical.as_os_str().as_bytes()));
        assert_eq!(
            as_root,
            Path::new("/var/lib/agentry").join(format!("pg-{}", &digest[..16]))
        );
    }

    #[test]
    fn long_cluster_paths_get_a_short_socket_dir() {
        let short = Path::new("/var/lib/agentry/pg-0123456789abcdef");
        assert_eq!(socket_dir_for(short), short.join("sock"));

        let long = PathBuf::from(format!("/home/someone/{}/pg", "x".repeat(90)));
        let socket_dir = socket_dir_for(&long);
        assert!(socket_dir.starts_with("/tmp"));
        assert!(socket_path_len(&socket_dir) < SOCKET_PATH_LIMIT);
    }

    #[test]
    fn finds_binaries() {
        let bins = find_binaries().expect("PostgreSQL binaries are installed");
        assert!(process::is_executable(&bins.initdb));
        assert!(process::is_executable(&bins.postgres));
        assert_eq!(bins.initdb.parent(), bins.postgres.parent());
        assert_eq!(parse_version("15"), Some(vec![15]));
        assert_eq!(parse_version("9.6"), Some(vec![9, 6]));
        assert_eq!(parse_version("x"), None);
    }

    #[test]
    fn versioned_installs_newest_first_and_complete_only() {
        let root = tempfile::tempdir().expect("tempdir");
        let install = |version: &str, programs: &[&str]| {
            let bin = root.path().join(version).join("bin");
            fs::create_dir_all(&bin).unwrap();
            for program in programs {
                let file = bin.join(program);
                fs::write(&file, "#!/bin/sh\n").unwrap();
                fs::set_permissions(&file, fs::Permissions::from_mode(0o755)).unwrap();
            }
        };
        install("9.6", &["initdb", "postgres"]);
        install("16", &["initdb", "postgres"]);
        install("17", &["initdb"]);
        install("15", &["initdb", "postgres"]);
        install("latest", &["initdb", "postgres"]);
        let bin = |version: &str| root.path().join(version).join("bin");
        assert_eq!(
            versioned_bin_dirs(root.path()),
            [bin("16"), bin("15"), bin("9.6")]
        );
        assert!(versioned_bin_dirs(&root.path().join("missing")).is_empty());
    }
}
