//! The egress proxy: the only way a sandboxed agent reaches the network. The server runs
//! one endpoint per agent (and per run of a workspace's setup or teardown commands), a
//! Unix socket `<root>/<uuid>/egress.sock` that the sandbox mounts at
//! `/run/agentry/egress.sock`; inside the sandbox's own network
//! namespace the bridge (`agentry sandbox-bridge`, see `bridge`) listens on loopback and
//! forwards every connection to it. The endpoint speaks HTTP `CONNECT` (tunnels) and
//! absolute-form HTTP, checks each connection against the agent's allow list, refuses
//! with `403` and reports a `Denial`, counts what it allowed; and it brokers model API
//! credentials: an origin-form request under a brokered provider's path goes to that
//! provider's upstream with the credential added outside the sandbox.

mod allow;
pub mod bridge;
mod proxy;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use url::Url;

pub use allow::{
    AllowEntry, AllowList, DEFAULT_PORTS, EntryError, HostPattern, MAX_ENTRY_LEN, Verdict,
    is_loopback, normalise_host,
};

use crate::domain::{AgentId, SecretValue};

/// Whose an endpoint is: an agent's, while its process runs, or one run of a workspace's
/// setup or teardown commands (a fresh id per run, so that runs never share one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holder {
    Agent(AgentId),
    Commands(uuid::Uuid),
}

impl Holder {
    /// The name of the endpoint's directory under the proxy's root.
    fn uuid(self) -> uuid::Uuid {
        match self {
            Self::Agent(a) => a.uuid(),
            Self::Commands(run) => run,
        }
    }
}

impl From<AgentId> for Holder {
    fn from(agent: AgentId) -> Self {
        Self::Agent(agent)
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Agent(a) => write!(f, "{a}"),
            Self::Commands(run) => write!(f, "commands run {run}"),
        }
    }
}

/// The socket's name in an agent's endpoint directory.
pub const SOCKET_NAME: &str = "egress.sock";
/// Where an agent's endpoint directory is mounted inside its sandbox.
pub const INSIDE_DIR: &str = "/run/agentry";
/// Where the bridge listens inside the sandbox (its network namespace is its own, so any
/// port is free there).
pub const BRIDGE_LISTEN: &str = "127.0.0.1:3128";
/// The port of `BRIDGE_LISTEN`: never a loopback forward.
pub const BRIDGE_PORT: u16 = 3128;
/// How many denials may wait for the runtime before more are dropped (and counted).
const DENIAL_QUEUE: usize = 1024;
/// How many distinct hosts are counted per agent.
const MAX_COUNTED_HOSTS: usize = 512;
/// How many refusals of one agent are reported per minute: an agent that retries a
/// refused host in a loop does not fill its timeline (the rest are only answered `403`
/// and counted in `dropped_denials`).
pub const DENIALS_PER_MINUTE: u32 = 30;

/// What an agent's sandbox needs for the proxy's network mode: its own network
/// namespace, the endpoint's directory mounted in, the proxy variables, and the bridge
/// run before the CLI's own argv.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentNet {
    pub unshare_net: bool,
    /// Read-write binds: (host path, path inside the sandbox).
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// Added to the CLI's environment.
    pub env: BTreeMap<String, String>,
    /// Run inside the sandbox before the CLI's argv.
    pub argv_prefix: Vec<String>,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenialReason {
    /// No entry of the agent's allow list names the host and port.
    NotAllowed,
    /// The host resolves to an internal address and only a wildcard allowed it.
    InternalAddress,
}

impl DenialReason {
    /// The stable wire name (the `reason` of a `network_denied` event).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotAllowed => "not_allowed",
            Self::InternalAddress => "internal_address",
        }
    }

    fn explain(self) -> &'static str {
        match self {
            Self::NotAllowed => "no entry of this agent's allow list names this host and port",
            Self::InternalAddress => {
                "the host resolves to an internal address and no exact entry names it"
            }
        }
    }
}

/// A refused connection, for the agent's timeline (or the commands' outcome).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub holder: Holder,
    pub host: String,
    pub port: u16,
    pub reason: DenialReason,
}

/// A provider whose credential is added by the proxy: an origin-form request to
/// `/<path_prefix>/<rest>` on the agent's endpoint goes to `<upstream_base>/<rest>` with
/// `headers` set (replacing any the agent sent under those names).
#[derive(Debug, Clone)]
pub struct Brokered {
    pub provider: String,
    pub path_prefix: String,
    pub upstream_base: Url,
    pub headers: Vec<(String, SecretValue)>,
}

/// The base URL a CLI inside the sandbox is given for a brokered provider.
pub fn brokered_base_url(path_prefix: &str) -> String {
    format!("http://{BRIDGE_LISTEN}/{}", path_prefix.trim_matches('/'))
}

/// Bounds of every endpoint.
#[derive(Debug, Clone)]
pub struct EgressLimits {
    /// Connections one agent may hold open at once; more wait for a free one (up to the
    /// header timeout), then are answered `503`.
    pub max_connections_per_agent: usize,
    /// A connection with no byte in either direction for this long is closed.
    pub idle_timeout: Duration,
    /// Time a client has to send its request head, and a connect or a lookup may take.
    pub header_timeout: Duration,
    /// The largest request head accepted (`431` beyond).
    pub max_header_bytes: usize,
}

impl Default for EgressLimits {
    fn default() -> Self {
        Self {
            max_connections_per_agent: 64,
            idle_timeout: Duration::from_secs(600),
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 32 * 1024,
        }
    }
}

/// The longest path a Unix socket may have (`sun_path` holds 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The longest socket path under a root: `<root>/<uuid>/<the longest socket name>`
/// (the inbound socket of a CLI's server on the highest port).
fn longest_socket_path(root: &Path) -> usize {
    let name = bridge::inbound_socket_name(u16::MAX)
        .len()
        .max(SOCKET_NAME.len());
    root.as_os_str().len() + 1 + uuid::Uuid::nil().to_string().len() + 1 + name
}

/// `root` when every endpoint socket under it fits a Unix socket's path; else a fresh
/// private directory (mode 0700, random name) under the system's temporary directory,
/// which lives as long as the proxy. A long data dir would otherwise fail every
/// sandboxed agent's start.
fn short_enough(root: PathBuf) -> (PathBuf, Option<tempfile::TempDir>) {
    if longest_socket_path(&root) <= MAX_SOCKET_PATH {
        return (root, None);
    }
    match tempfile::Builder::new().prefix("agentry-egress-").tempdir() {
        Ok(dir) if longest_socket_path(dir.path()) <= MAX_SOCKET_PATH => {
            tracing::info!(
                data_dir_root = %root.display(),
                root = %dir.path().display(),
                "egress endpoints live in a private temporary directory: sockets under the data dir would have paths too long for a Unix socket"
            );
            (dir.path().to_path_buf(), Some(dir))
        }
        Ok(_) | Err(_) => {
            tracing::warn!(
                root = %root.display(),
                "egress endpoint sockets would have paths too long for a Unix socket, and no shorter private directory could be made: set a shorter data_dir or TMPDIR"
            );
            (root, None)
        }
    }
}

/// The proxy: one endpoint per holder it was opened for. Cheap to clone.
#[derive(Clone)]
pub struct Egress {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    /// A private directory that stands in for `root` when sockets under it would have
    /// paths too long for a Unix socket; removed with the proxy.
    _short_root: Option<tempfile::TempDir>,
    /// The bridge's program and command (`[program, command]`), see `bridge_command`.
    bridge: [String; 2],
    limits: EgressLimits,
    denials: mpsc::Sender<Denial>,
    dropped_denials: AtomicU64,
    endpoints: Mutex<HashMap<Holder, Endpoint>>,
}

struct Endpoint {
    dir: PathBuf,
    stop: CancellationToken,
    state: Arc<AgentState>,
}

/// What one endpoint's connections share.
pub(crate) struct AgentState {
    pub holder: Holder,
    pub policy: AllowList,
    pub brokered: Vec<Brokered>,
    pub limits: EgressLimits,
    counts: Mutex<BTreeMap<String, u64>>,
    /// The start of the current minute of reported refusals, and how many it has had.
    reported: Mutex<(std::time::Instant, u32)>,
    /// Where this endpoint's denials go when not to the proxy's receiver (a run of
    /// commands hears its own).
    denials: Option<mpsc::Sender<Denial>>,
    egress: std::sync::Weak<Inner>,
}

impl AgentState {
    pub(crate) fn count(&self, host: &str) {
        let mut counts = self.counts.lock().expect("egress counts lock");
        if let Some(n) = counts.get_mut(host) {
            *n += 1;
        } else if counts.len() < MAX_COUNTED_HOSTS {
            counts.insert(host.to_owned(), 1);
        }
    }

    pub(crate) fn deny(&self, host: &str, port: u16, reason: DenialReason) {
        let Some(egress) = self.egress.upgrade() else {
            return;
        };
        let denial = Denial {
            holder: self.holder,
            host: host.to_owned(),
            port,
            reason,
        };
        let within = {
            let mut r = self.reported.lock().expect("egress reported lock");
            if r.0.elapsed() >= Duration::from_secs(60) {
                *r = (std::time::Instant::now(), 0);
            }
            r.1 += 1;
            r.1 <= DENIALS_PER_MINUTE
        };
        if !within {
            egress.dropped_denials.fetch_add(1, Ordering::Relaxed);
            return;
        }
        tracing::info!(holder = %self.holder, host, port, reason = reason.as_str(), "egress refused");
        let sink = self.denials.as_ref().unwrap_or(&egress.denials);
        if sink.try_send(denial).is_err() {
            egress.dropped_denials.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How a sandbox starts its bridge, given the `agentry` executable: the small
/// `agentry-sandbox bridge` installed beside it when there is one (each agent's start then
/// maps a few megabytes, not the whole server), else `agentry sandbox-bridge`.
fn bridge_command(agentry: &Path) -> [String; 2] {
    match crate::process::sandbox_helper(agentry) {
        Some(small) => [small.display().to_string(), "bridge".to_owned()],
        None => [agentry.display().to_string(), "sandbox-bridge".to_owned()],
    }
}

impl Egress {
    /// A proxy whose endpoints live under `root`; denials arrive on the receiver.
    pub fn start(root: PathBuf) -> (Self, mpsc::Receiver<Denial>) {
        Self::start_with(root, EgressLimits::default())
    }

    pub fn start_with(root: PathBuf, limits: EgressLimits) -> (Self, mpsc::Receiver<Denial>) {
        let (tx, rx) = mpsc::channel(DENIAL_QUEUE);
        let bridge =
            bridge_command(&std::env::current_exe().unwrap_or_else(|_| PathBuf::from("agentry")));
        let (root, short_root) = short_enough(root);
        let inner = Inner {
            root,
            _short_root: short_root,
            bridge,
            limits,
            denials: tx,
            dropped_denials: AtomicU64::new(0),
            endpoints: Mutex::new(HashMap::new()),
        };
        (
            Self {
                inner: Arc::new(inner),
            },
            rx,
        )
    }

    /// The `agentry` executable the bridge comes from (see `bridge_command`); by default
    /// this executable. Set it before the proxy is cloned.
    pub fn with_bridge_program(mut self, program: PathBuf) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("the bridge program is set before the proxy is shared")
            .bridge = bridge_command(&program);
        self
    }

    /// Where endpoints live.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The directory of `holder`'s endpoint (it exists while the endpoint is open).
    pub fn endpoint_dir(&self, holder: impl Into<Holder>) -> PathBuf {
        self.inner.root.join(holder.into().uuid().to_string())
    }

    /// Open (or reopen, closing the old one) `agent`'s endpoint with its allow list and
    /// brokered providers; the answer is what its sandbox needs. Its denials arrive on the
    /// proxy's receiver. Needs a Tokio runtime.
    pub fn open(
        &self,
        agent: impl Into<Holder>,
        policy: AllowList,
        brokered: Vec<Brokered>,
    ) -> io::Result<AgentNet> {
        self.open_endpoint(agent.into(), policy, brokered, None)
    }

    /// Open an endpoint for one run of a workspace's setup or teardown commands, with
    /// `policy` and no brokered provider: it is closed, its directory removed, when the
    /// answer is dropped, and its denials arrive there. Needs a Tokio runtime.
    pub fn open_for_commands(&self, policy: AllowList) -> io::Result<CommandsEndpoint> {
        let holder = Holder::Commands(uuid::Uuid::now_v7());
        let (tx, denials) = mpsc::channel(DENIAL_QUEUE);
        let net = self.open_endpoint(holder, policy, Vec::new(), Some(tx))?;
        Ok(CommandsEndpoint {
            egress: self.clone(),
            holder,
            net,
            denials,
        })
    }

    fn open_endpoint(
        &self,
        holder: Holder,
        policy: AllowList,
        brokered: Vec<Brokered>,
        denials: Option<mpsc::Sender<Denial>>,
    ) -> io::Result<AgentNet> {
        let rt = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
        let forwards = policy.forwards().to_vec();
        self.close(holder);
        let root = &self.inner.root;
        std::fs::create_dir_all(root)?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))?;
        let dir = self.endpoint_dir(holder);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let path = dir.join(SOCKET_NAME);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = std::os::unix::net::UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        let listener = {
            let _guard = rt.enter();
            tokio::net::UnixListener::from_std(listener)?
        };
        let state = Arc::new(AgentState {
            holder,
            policy,
            brokered,
            limits: self.inner.limits.clone(),
            counts: Mutex::new(BTreeMap::new()),
            reported: Mutex::new((std::time::Instant::now(), 0)),
            denials,
            egress: Arc::downgrade(&self.inner),
        });
        let stop = CancellationToken::new();
        rt.spawn(proxy::accept(listener, state.clone(), stop.clone()));
        self.inner
            .endpoints
            .lock()
            .expect("egress endpoints lock")
            .insert(
                holder,
                Endpoint {
                    dir: dir.clone(),
                    stop,
                    state,
                },
            );
        Ok(self.plan(&dir, &forwards))
    }

    /// What a sandbox needs to use the endpoint in `dir`, with the loopback forwards to
    /// `forwards` (`host:port` each).
    fn plan(&self, dir: &Path, forwards: &[String]) -> AgentNet {
        let proxy = format!("http://{BRIDGE_LISTEN}");
        let mut env = BTreeMap::new();
        for name in [
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "http_proxy",
            "https_proxy",
            "ALL_PROXY",
            "all_proxy",
        ] {
            env.insert(name.to_owned(), proxy.clone());
        }
        // Loopback inside the sandbox is the bridge itself (brokered base URLs, and the
        // loopback forwards to the host's loopback).
        for name in ["NO_PROXY", "no_proxy"] {
            env.insert(name.to_owned(), "localhost,127.0.0.1,::1".to_owned());
        }
        let socket = Path::new(INSIDE_DIR).join(SOCKET_NAME);
        let mut argv_prefix = vec![
            self.inner.bridge[0].clone(),
            self.inner.bridge[1].clone(),
            "--listen".into(),
            BRIDGE_LISTEN.into(),
            "--socket".into(),
            socket.display().to_string(),
        ];
        for target in forwards {
            argv_prefix.push("--loopback".into());
            argv_prefix.push(target.clone());
        }
        argv_prefix.push("--".into());
        AgentNet {
            unshare_net: true,
            binds: vec![(dir.to_path_buf(), PathBuf::from(INSIDE_DIR))],
            env,
            argv_prefix,
        }
    }

    /// Close `holder`'s endpoint: its open connections end and its directory is removed.
    pub fn close(&self, holder: impl Into<Holder>) {
        let holder = holder.into();
        let endpoint = self
            .inner
            .endpoints
            .lock()
            .expect("egress endpoints lock")
            .remove(&holder);
        if let Some(e) = endpoint {
            e.stop.cancel();
            if let Err(err) = std::fs::remove_dir_all(&e.dir)
                && err.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(holder = %holder, error = %err, "could not remove the egress endpoint");
            }
        }
    }

    /// Close every endpoint (at shutdown).
    pub fn close_all(&self) {
        let holders: Vec<Holder> = self
            .inner
            .endpoints
            .lock()
            .expect("egress endpoints lock")
            .keys()
            .copied()
            .collect();
        for h in holders {
            self.close(h);
        }
    }

    /// Connections allowed for `holder` by host, since its endpoint was opened (`None`:
    /// no endpoint).
    pub fn counts(&self, holder: impl Into<Holder>) -> Option<BTreeMap<String, u64>> {
        let endpoints = self.inner.endpoints.lock().expect("egress endpoints lock");
        let e = endpoints.get(&holder.into())?;
        let counts = e.state.counts.lock().expect("egress counts lock").clone();
        Some(counts)
    }

    /// Denials not reported: beyond `DENIALS_PER_MINUTE` for their agent, or because the
    /// runtime did not take them fast enough.
    pub fn dropped_denials(&self) -> u64 {
        self.inner.dropped_denials.load(Ordering::Relaxed)
    }
}

/// The endpoint of one run of commands (see [`Egress::open_for_commands`]): open while
/// this lives.
pub struct CommandsEndpoint {
    egress: Egress,
    holder: Holder,
    /// What the commands' sandbox needs to use it.
    pub net: AgentNet,
    /// Its refused connections (at most `DENIALS_PER_MINUTE` a minute, like an agent's).
    pub denials: mpsc::Receiver<Denial>,
}

impl Drop for CommandsEndpoint {
    fn drop(&mut self) {
        self.egress.close(self.holder);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let endpoints = std::mem::take(self.endpoints.get_mut().expect("egress endpoints lock"));
        for (_, e) in endpoints {
            e.stop.cancel();
            let _ = std::fs::remove_dir_all(&e.dir);
        }
    }
}

/// Slots for one agent's connections.
pub(crate) fn slots(limits: &EgressLimits) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(limits.max_connections_per_agent.max(1)))
}
