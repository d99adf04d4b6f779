//! The agent sandbox: turns a `CommandSpec` into one that runs the same argv inside
//! `bwrap` (user, PID, IPC, UTS and cgroup namespaces, a mount namespace that shows only
//! what the agent needs) from a description of the agent's view. See docs/security.md.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use uuid::Uuid;

use crate::config::{SandboxMode, SandboxNetwork, SandboxSettings};
use crate::egress::AgentNet;
use crate::process::{CommandSpec, TMPDIR_ARG, find_executable_in};

/// System directories every sandbox sees read-only (those that exist on the host).
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
];

/// Files under `/etc` never shown, whatever their mode (the sandbox's uid 0 owns them).
const MASKED_FILES: &[&str] = &[
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
];

/// Variables that name a directory where a CLI keeps its state: when a provider's `env`
/// sets one to an absolute path, that directory is mounted read-write.
const STATE_VARS: &[&str] = &[
    "HOME",
    "CLAUDE_CONFIG_DIR",
    "CODEX_HOME",
    "PI_CODING_AGENT_DIR",
    "COPILOT_HOME",
    "GEMINI_CLI_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
];

/// Variables that name a settings file a CLI reads: the file is shown read-only (one
/// agentry writes lies under `<data_dir>/providers/`, which is otherwise hidden).
pub const SETTINGS_FILE_VARS: &[&str] = &["GEMINI_CLI_SYSTEM_SETTINGS_PATH"];

/// How the sandbox reaches the network: produced for `host` and `none` here, and by the
/// egress proxy for `proxy`. Binds are read-write binds (host path, in-sandbox path);
/// `read_only` are shown read-only at their own path (the bridge's executable); `env` is
/// added to the child's; `argv_prefix` runs before the CLI's argv inside.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkPlan {
    pub unshare_net: bool,
    pub binds: Vec<(PathBuf, PathBuf)>,
    pub read_only: Vec<PathBuf>,
    /// Files shown read-only over what is at a path inside: (host file, path inside).
    pub files: Vec<(PathBuf, PathBuf)>,
    pub env: BTreeMap<String, String>,
    pub argv_prefix: Vec<String>,
}

impl From<AgentNet> for NetworkPlan {
    /// The plan of an agent's egress endpoint: the bridge (the first word of its argv
    /// prefix) is shown read-only where it is.
    fn from(net: AgentNet) -> Self {
        let read_only = net
            .argv_prefix
            .first()
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .into_iter()
            .collect();
        Self {
            unshare_net: net.unshare_net,
            binds: net.binds,
            read_only,
            files: Vec::new(),
            env: net.env,
            argv_prefix: net.argv_prefix,
        }
    }
}

impl NetworkPlan {
    pub fn for_mode(mode: SandboxNetwork) -> Self {
        Self {
            unshare_net: mode != SandboxNetwork::Host,
            ..Self::default()
        }
    }

    /// The egress endpoint's directory on the host, when the plan runs the bridge.
    fn endpoint_dir(&self) -> Option<&Path> {
        if !self.unshare_net || self.argv_prefix.is_empty() {
            return None;
        }
        self.binds
            .iter()
            .find(|(_, inside)| inside == Path::new(crate::egress::INSIDE_DIR))
            .map(|(host, _)| host.as_path())
    }

    /// The Unix socket on the host through which the bridge of this plan forwards to
    /// loopback port `port` inside (`serving`); `None` without a bridge.
    pub fn inbound_socket(&self, port: u16) -> Option<PathBuf> {
        Some(
            self.endpoint_dir()?
                .join(crate::egress::bridge::inbound_socket_name(port)),
        )
    }

    /// This plan with the bridge also forwarding connections to its inbound socket for
    /// `port` to that loopback port inside; `None` without a bridge.
    pub fn serving(&self, port: u16) -> Option<Self> {
        self.endpoint_dir()?;
        let split = self.argv_prefix.iter().rposition(|a| a == "--")?;
        let inside = Path::new(crate::egress::INSIDE_DIR)
            .join(crate::egress::bridge::inbound_socket_name(port));
        let mut plan = self.clone();
        plan.argv_prefix.splice(
            split..split,
            [
                "--inbound".to_owned(),
                inside.display().to_string(),
                "--inbound-port".to_owned(),
                port.to_string(),
            ],
        );
        Some(plan)
    }
}

/// What one agent (or one workspace's setup) sees besides the system.
#[derive(Debug, Clone)]
pub struct AgentView {
    /// The agent whose private home is `<data_dir>/agent-homes/<uuid>`; `None` (setup
    /// commands): HOME is the sandbox's private `/tmp`.
    pub agent: Option<Uuid>,
    /// The worktree (or directory) the agent works in: read-write.
    pub worktree: PathBuf,
    /// The agent's provider, whose state directory `<data_dir>/providers/<id>` (Pi's
    /// session files) is mounted read-write when it exists.
    pub provider: Option<String>,
    /// How the agent reaches the network when it is not what the settings' mode gives
    /// (`proxy`: its egress endpoint's plan, or the setup run's). `None`:
    /// `NetworkPlan::for_mode`.
    pub network: Option<NetworkPlan>,
}

/// Whether this host can sandbox, found once at start.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct SandboxStatus {
    /// `enforce` or `off`.
    #[schema(value_type = String)]
    pub mode: SandboxMode,
    /// The host can sandbox (bwrap found and a trial sandbox ran).
    pub available: bool,
    /// Why not, when it cannot.
    pub reason: Option<String>,
    /// `host`, `none` or `proxy`.
    #[schema(value_type = String)]
    pub network: SandboxNetwork,
}

impl SandboxStatus {
    /// Agent processes are confined.
    pub fn confines(&self) -> bool {
        self.mode == SandboxMode::Enforce && self.available
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("could not prepare the sandbox: {0}")]
    Prepare(String),
}

/// The sandbox builder of a server.
#[derive(Debug, Clone)]
pub struct Sandbox {
    settings: SandboxSettings,
    data_dir: PathBuf,
    config_file: Option<PathBuf>,
    /// The resolved bwrap executable.
    bwrap: Option<PathBuf>,
    status: SandboxStatus,
}

impl Sandbox {
    /// Probe once whether the host can sandbox (bwrap found, a trial `bwrap … true` with
    /// the namespaces used succeeds).
    pub fn probe(settings: &SandboxSettings, data_dir: &Path, config_file: Option<&Path>) -> Self {
        let path_var = std::env::var_os("PATH");
        let bwrap = find_executable_in(&settings.bwrap, path_var.as_deref(), &[], Path::new("/"));
        let reason = match &bwrap {
            None => Some(format!("`{}` was not found", settings.bwrap)),
            Some(exe) => trial(exe, settings.network),
        };
        let status = SandboxStatus {
            mode: settings.mode,
            available: reason.is_none(),
            reason,
            network: settings.network,
        };
        Self {
            settings: settings.clone(),
            data_dir: data_dir.to_owned(),
            config_file: config_file.map(Path::to_owned),
            bwrap,
            status,
        }
    }

    pub fn status(&self) -> &SandboxStatus {
        &self.status
    }

    pub fn settings(&self) -> &SandboxSettings {
        &self.settings
    }

    /// The private home of `agent`.
    pub fn home_of(&self, agent: Uuid) -> PathBuf {
        self.data_dir.join("agent-homes").join(agent.to_string())
    }

    /// `spec`, to run inside the sandbox of `view` (unchanged when the sandbox does not
    /// confine).
    pub fn wrap(&self, spec: CommandSpec, view: &AgentView) -> Result<CommandSpec, SandboxError> {
        let (true, Some(bwrap)) = (self.status.confines(), self.bwrap.as_ref()) else {
            return Ok(spec);
        };
        let plan = view
            .network
            .clone()
            .unwrap_or_else(|| NetworkPlan::for_mode(self.settings.network));
        self.wrap_with(spec, view, bwrap, &plan)
    }

    /// `wrap` with an explicit network plan.
    pub fn wrap_with(
        &self,
        spec: CommandSpec,
        view: &AgentView,
        bwrap: &Path,
        plan: &NetworkPlan,
    ) -> Result<CommandSpec, SandboxError> {
        let mut a = Args::default();
        a.flag(&[
            "--unshare-user",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
        ]);
        if plan.unshare_net {
            a.flag(&["--unshare-net"]);
        }
        for dir in SYSTEM_DIRS {
            let p = Path::new(dir);
            match std::fs::symlink_metadata(p) {
                Ok(m) if m.file_type().is_symlink() => {
                    if let Ok(target) = std::fs::read_link(p) {
                        a.pair("--symlink", &target, p);
                    }
                }
                Ok(m) if m.is_dir() => a.pair("--ro-bind", p, p),
                _ => {}
            }
        }
        for f in MASKED_FILES {
            if Path::new(f).exists() {
                a.pair("--ro-bind", Path::new("/dev/null"), Path::new(f));
            }
        }
        // The settings file, wherever it is, and its directory when that is not a system
        // directory itself (`/etc/agentry`).
        if let Some(file) = &self.config_file
            && let Some(dir) = file.parent()
            && dir.starts_with("/etc")
        {
            if SYSTEM_DIRS.iter().any(|s| Path::new(s) == dir) {
                a.pair("--ro-bind", Path::new("/dev/null"), file);
            } else {
                a.flag(&["--tmpfs"]);
                a.path(dir);
            }
        }
        a.flag(&["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);

        // The CLI's installation and the admin's extra paths, read-only.
        let path_var = spec
            .env
            .get("PATH")
            .cloned()
            .or_else(|| std::env::var("PATH").ok());
        let mut read_only: Vec<PathBuf> = self.settings.extra_read_only.clone();
        read_only.extend(plan.read_only.iter().cloned());
        if let Some(exe) = find_executable_in(
            &spec.program,
            path_var.as_deref().map(std::ffi::OsStr::new),
            &[],
            &spec.cwd,
        ) {
            let resolved = std::fs::canonicalize(&exe).unwrap_or(exe.clone());
            read_only.push(install_root(&exe));
            read_only.push(install_root(&resolved));
        }
        read_only.sort();
        read_only.dedup();
        for p in &read_only {
            if self.is_system(p) || !p.exists() {
                continue;
            }
            if self.touches_private(p) {
                tracing::warn!(path = %p.display(), "not mounting a path that holds the data dir or the settings file into a sandbox");
                continue;
            }
            a.pair("--ro-bind", p, p);
        }

        // The worktree and the git metadata a commit needs.
        let worktree = &view.worktree;
        a.pair("--bind", worktree, worktree);
        let dot_git = worktree.join(".git");
        if dot_git.is_dir() {
            read_only_git_files(&mut a, &dot_git)?;
        } else if let Some(common) = worktree_common_dir(worktree) {
            a.pair("--bind", &common, &common);
            read_only_git_files(&mut a, &common)?;
        }

        // HOME, and the state directories the provider's `env` names.
        let mut env = spec.env.clone();
        let own_home = view.agent.map(|id| self.home_of(id));
        if !env.contains_key("HOME") {
            match &own_home {
                Some(home) => {
                    make_private_dir(home)?;
                    a.pair("--bind", home, home);
                    env.insert("HOME".into(), home.display().to_string());
                }
                None => {
                    env.insert("HOME".into(), "/tmp".into());
                }
            }
        }
        for var in STATE_VARS {
            let Some(value) = spec.env.get(*var) else {
                continue;
            };
            let dir = PathBuf::from(value);
            if dir.is_relative() || dir == Path::new("/") {
                continue;
            }
            let providers = self.data_dir.join("providers");
            let allowed_inside = dir.starts_with(&providers)
                || own_home.as_ref().is_some_and(|h| dir.starts_with(h));
            if (self.touches_private(&dir) && !allowed_inside) || self.is_system(&dir) {
                tracing::warn!(var, path = %dir.display(), "not mounting a provider's state directory that holds private server files");
                continue;
            }
            make_private_dir(&dir)?;
            a.pair("--bind", &dir, &dir);
        }
        for var in SETTINGS_FILE_VARS {
            let Some(file) = spec.env.get(*var).map(PathBuf::from) else {
                continue;
            };
            let ours = file.starts_with(self.data_dir.join("providers"));
            if !file.is_absolute()
                || !file.is_file()
                || self.is_system(&file)
                || (self.touches_private(&file) && !ours)
            {
                continue;
            }
            a.pair("--ro-bind", &file, &file);
        }
        if let Some(id) = &view.provider
            && !id.is_empty()
            && !id.contains('/')
            && id != ".."
        {
            let dir = self.data_dir.join("providers").join(id);
            if dir.is_dir() {
                a.pair("--bind", &dir, &dir);
            }
        }
        for (host, inside) in &plan.binds {
            a.pair("--bind", host, inside);
        }
        for (host, inside) in &plan.files {
            a.pair("--ro-bind", host, inside);
        }
        env.extend(plan.env.clone());
        // The ledger's private temporary directory (its `TMPDIR`), at its own path.
        env.remove("TMPDIR");
        a.flag(&["--bind", TMPDIR_ARG, TMPDIR_ARG]);

        // Only the binds above are writable: not the sandbox's root, nor `/tmp` with the
        // mount points made in it (TMPDIR is the private directory bound above).
        a.flag(&["--remount-ro", "/tmp", "--remount-ro", "/"]);
        a.flag(&["--chdir"]);
        a.path(worktree);
        // bwrap starts with TERM ignored (`ignores_term` below), so the ledger's TERM to
        // the group reaches the CLI, which can save its session; the CLI gets TERM's
        // default back: from `env`, or from the bridge when it runs first (it handles
        // TERM itself, and a handled signal is back to its default in what it starts),
        // which saves a process start per agent.
        a.flag(&["--"]);
        if plan.argv_prefix.is_empty() {
            a.flag(&["env", "--default-signal=TERM"]);
        }
        a.0.extend(plan.argv_prefix.iter().cloned());
        a.0.push(spec.program.clone());
        a.0.extend(spec.args.iter().cloned());

        Ok(CommandSpec {
            program: bwrap.display().to_string(),
            args: a.0,
            cwd: spec.cwd,
            env,
            pass_env: spec.pass_env,
            wraps: Some(spec.wraps.unwrap_or(spec.program)),
            serves: spec.serves,
            secret_env: spec.secret_env,
            private_files: spec.private_files,
            ignores_term: true,
        })
    }

    fn is_system(&self, p: &Path) -> bool {
        SYSTEM_DIRS.iter().any(|s| p.starts_with(s))
    }

    /// `p` is, holds or lies in the data dir, or holds the settings file.
    fn touches_private(&self, p: &Path) -> bool {
        p.starts_with(&self.data_dir)
            || self.data_dir.starts_with(p)
            || self.config_file.as_ref().is_some_and(|f| f.starts_with(p))
    }
}

/// Run `bwrap --ro-bind / / … true` with the namespaces used: `None` when it works, else
/// why not.
fn trial(bwrap: &Path, network: SandboxNetwork) -> Option<String> {
    let mut cmd = std::process::Command::new(bwrap);
    cmd.args([
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
    ]);
    if network != SandboxNetwork::Host {
        cmd.arg("--unshare-net");
    }
    cmd.args([
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--",
        "env",
        "--default-signal=TERM",
        "true",
    ]);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    match cmd.output() {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "a trial sandbox failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("could not run `{}`: {e}", bwrap.display())),
    }
}

/// The directory tree a program belongs to: above its `node_modules` for a node package,
/// above `bin`/`shims` for an installation with its own prefix, else its directory.
fn install_root(exe: &Path) -> PathBuf {
    let mut root = PathBuf::new();
    for c in exe.components() {
        if c.as_os_str() == "node_modules" {
            return root;
        }
        root.push(c);
    }
    let dir = exe.parent().unwrap_or(Path::new("/"));
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("bin" | "shims") => dir.parent().unwrap_or(dir).to_owned(),
        _ => dir.to_owned(),
    }
}

/// The repository's git dir of a linked worktree, when its `.git` file names an admin dir
/// `<common>/worktrees/<name>` that names this worktree back (the worktree is the agent's
/// to write, so its `.git` file is checked against the admin dir, which it cannot write).
fn worktree_common_dir(worktree: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(worktree.join(".git")).ok()?;
    let admin = PathBuf::from(text.strip_prefix("gitdir:")?.trim());
    let admin = std::fs::canonicalize(worktree.join(admin)).ok()?;
    let parent = admin.parent()?;
    if parent.file_name()? != "worktrees" {
        return None;
    }
    let back = std::fs::read_to_string(admin.join("gitdir")).ok()?;
    let back = std::fs::canonicalize(back.trim()).ok()?;
    let own = std::fs::canonicalize(worktree.join(".git")).ok()?;
    if back != own {
        return None;
    }
    Some(parent.parent()?.to_owned())
}

/// The repository's `config`, `hooks/` and `info/` read-only over a writable git dir (the
/// directories made first when missing, so that the agent cannot make them).
fn read_only_git_files(a: &mut Args, git_dir: &Path) -> Result<(), SandboxError> {
    for dir in ["hooks", "info"] {
        let p = git_dir.join(dir);
        if !p.exists() {
            std::fs::create_dir_all(&p)
                .map_err(|e| SandboxError::Prepare(format!("{}: {e}", p.display())))?;
        }
        a.pair("--ro-bind", &p, &p);
    }
    for file in ["config", "config.worktree"] {
        let p = git_dir.join(file);
        if p.exists() {
            a.pair("--ro-bind", &p, &p);
        }
    }
    Ok(())
}

/// Make `dir` (mode 0700) when missing.
fn make_private_dir(dir: &Path) -> Result<(), SandboxError> {
    use std::os::unix::fs::DirBuilderExt as _;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| SandboxError::Prepare(format!("{}: {e}", dir.display())))
}

/// bwrap's argv being built.
#[derive(Default)]
struct Args(Vec<String>);

impl Args {
    fn flag(&mut self, flags: &[&str]) {
        self.0.extend(flags.iter().map(|f| (*f).to_owned()));
    }

    fn path(&mut self, p: &Path) {
        self.0.push(p.display().to_string());
    }

    fn pair(&mut self, flag: &str, src: &Path, dst: &Path) {
        self.0.push(flag.to_owned());
        self.path(src);
        self.path(dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_roots() {
        assert_eq!(
            install_root(Path::new("/c/pkg@1/node_modules/.bin/claude")),
            Path::new("/c/pkg@1")
        );
        assert_eq!(
            install_root(Path::new("/opt/node/bin/node")),
            Path::new("/opt/node")
        );
        assert_eq!(
            install_root(Path::new("/x/target/debug/agentry")),
            Path::new("/x/target/debug")
        );
    }

    /// The server stops an agent with TERM to its process group, then KILL after a grace:
    /// through the sandbox's launcher (bwrap ignores TERM) the TERM must reach the program
    /// itself, so a CLI can save its session before it exits.
    #[tokio::test]
    async fn term_reaches_the_program_inside_the_sandbox() {
        use tokio::io::AsyncReadExt;

        let data = tempfile::tempdir().unwrap();
        let worktree = tempfile::tempdir().unwrap();
        let sandbox = Sandbox::probe(&SandboxSettings::default(), data.path(), None);
        assert!(
            sandbox.status().confines(),
            "this host must be able to sandbox (bwrap installed, user namespaces): {:?}",
            sandbox.status().reason
        );
        let marker = worktree.path().join("termed");
        let script = format!(
            "import signal, sys, time\n\
             def on_term(*_):\n    open({marker:?}, 'w').write('term')\n    sys.exit(0)\n\
             signal.signal(signal.SIGTERM, on_term)\n\
             print('ready', flush=True)\n\
             time.sleep(60)\n",
            marker = marker.display().to_string()
        );
        let spec = CommandSpec::new("python3", vec!["-c".into(), script], worktree.path());
        let view = AgentView {
            agent: None,
            worktree: worktree.path().to_owned(),
            provider: None,
            network: None,
        };
        let wrapped = sandbox.wrap(spec, &view).unwrap();
        assert!(
            wrapped.program.ends_with("bwrap") && wrapped.ignores_term,
            "the program runs through the sandbox, whose launcher ignores TERM: {wrapped:?}"
        );
        assert_eq!(wrapped.wraps.as_deref(), Some("python3"));
        let mut child = crate::process::spawn(&wrapped).unwrap();
        let mut stdout = child.take_stdout().unwrap();
        let mut ready = [0u8; 6];
        stdout.read_exact(&mut ready).await.unwrap();
        assert_eq!(&ready, b"ready\n");
        let status = child
            .terminate(std::time::Duration::from_secs(10))
            .await
            .expect("an exit status");
        assert_eq!(
            std::fs::read_to_string(&marker).ok().as_deref(),
            Some("term"),
            "the program heard TERM (exit: {status:?})"
        );
        assert!(
            status.success(),
            "it exited by itself, not by KILL: {status:?}"
        );
    }

    #[test]
    fn network_plans() {
        assert!(!NetworkPlan::for_mode(SandboxNetwork::Host).unshare_net);
        assert!(NetworkPlan::for_mode(SandboxNetwork::None).unshare_net);
        // `proxy` without an endpoint (a process the proxy was not opened for): loopback
        // only.
        assert!(NetworkPlan::for_mode(SandboxNetwork::Proxy).unshare_net);
    }

    #[test]
    fn an_endpoints_plan_shows_the_bridge_read_only() {
        let net = AgentNet {
            unshare_net: true,
            binds: vec![(PathBuf::from("/d/egress/x"), PathBuf::from("/run/agentry"))],
            env: BTreeMap::from([("HTTP_PROXY".into(), "http://127.0.0.1:3128".into())]),
            argv_prefix: vec!["/opt/agentry/bin/agentry".into(), "sandbox-bridge".into()],
        };
        let plan = NetworkPlan::from(net.clone());
        assert!(plan.unshare_net);
        assert_eq!(plan.read_only, [PathBuf::from("/opt/agentry/bin/agentry")]);
        assert_eq!(
            (plan.binds, plan.env, plan.argv_prefix),
            (net.binds, net.env, net.argv_prefix)
        );
        // A bridge looked up on PATH is not mounted by name.
        let relative = AgentNet {
            argv_prefix: vec!["agentry".into()],
            ..AgentNet {
                unshare_net: true,
                binds: Vec::new(),
                env: BTreeMap::new(),
                argv_prefix: Vec::new(),
            }
        };
        assert!(NetworkPlan::from(relative).read_only.is_empty());
    }
}
