//! Resource limits of a child's whole process tree — memory, process count, CPU share and
//! open files — and how they are applied: a cgroup of its own per recorded child where
//! this host lets the server use cgroups (v2 delegated to it, else the v1 `memory`,
//! `pids` and `cpu` controllers), joined before exec so that nothing the child starts
//! escapes it, and rlimits set in the child before exec.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

/// How often a limited child's cgroup is checked for a limit it reached.
const WATCH_EVERY: Duration = Duration::from_millis(200);
/// Name of the directory holding this server's child cgroups, under its own cgroup.
const BASE_DIR: &str = "agentry";
/// The leaf a cgroup v2 server moves itself into so that its own cgroup may have
/// children with controllers (the "no internal processes" rule).
const SERVER_LEAF: &str = "server";

/// What one child's process tree may use; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceLimits {
    pub memory_bytes: Option<u64>,
    /// Processes and threads alive at once.
    pub max_processes: Option<u64>,
    /// CPU weight relative to the other children, 1–10000 (cgroup v2's scale: 100 is
    /// the default weight).
    pub cpu_weight: Option<u32>,
    /// `RLIMIT_NOFILE` of every process of the tree.
    pub open_files: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Controller {
    Memory,
    Pids,
    Cpu,
}

impl Controller {
    const ALL: [Controller; 3] = [Controller::Memory, Controller::Pids, Controller::Cpu];

    fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// A limit a child's tree reached, which ended it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitHit {
    Memory { limit: u64 },
    Processes { limit: u64 },
}

impl fmt::Display for LimitHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitHit::Memory { limit } => {
                write!(f, "memory limit of {} reached", format_bytes(*limit))
            }
            LimitHit::Processes { limit } => write!(f, "process limit of {limit} reached"),
        }
    }
}

/// `4 GiB`, `200 MiB`, `1536 KiB`, `100 B`: the largest binary unit that divides it.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

/// One directory under which child cgroups are made, and the controllers it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Base {
    controllers: Vec<Controller>,
    dir: PathBuf,
}

/// What this host offers, decided once at start: the cgroup directories this server may
/// make children in (`<its own cgroup>/agentry/<replica>`), if any.
#[derive(Debug, Clone)]
pub struct LimitHost {
    version: Option<CgroupVersion>,
    bases: Vec<Base>,
    root: bool,
}

impl Default for LimitHost {
    fn default() -> Self {
        Self::rlimits_only()
    }
}

impl LimitHost {
    /// No cgroups: rlimits only.
    pub fn rlimits_only() -> Self {
        Self {
            version: None,
            bases: Vec::new(),
            // SAFETY: geteuid has no preconditions.
            root: unsafe { libc::geteuid() } == 0,
        }
    }

    /// Find which cgroups this server may use for the children of `replica`: cgroup v2
    /// when its own cgroup is delegated to it (writable, with controllers to hand down),
    /// else every v1 controller among `memory`, `pids`, `cpu` whose hierarchy it may
    /// write to; else none.
    pub fn detect(replica: &str) -> Self {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let name = dir_name(replica);
        let mut host = Self::rlimits_only();
        if let Some(own_dir) = v2_own_dir(&mountinfo, &own)
            && let Some(base) = delegate_v2(&own_dir, &name)
        {
            host.version = Some(CgroupVersion::V2);
            host.bases = vec![base];
            return host;
        }
        let bases: Vec<Base> = v1_own_dirs(&mountinfo, &own)
            .into_iter()
            .filter_map(|(controller, own_dir)| {
                let dir = own_dir.join(BASE_DIR).join(&name);
                match std::fs::create_dir_all(&dir) {
                    Ok(()) => {
                        // Made again with the first child: a server that starts none
                        // leaves nothing behind.
                        let _ = std::fs::remove_dir(&dir);
                        Some(Base {
                            controllers: vec![controller],
                            dir,
                        })
                    }
                    Err(e) => {
                        tracing::debug!(controller = controller.name(), dir = %dir.display(), error = %e, "cgroup v1 controller not usable");
                        None
                    }
                }
            })
            .collect();
        if !bases.is_empty() {
            host.version = Some(CgroupVersion::V1);
            host.bases = bases;
        }
        host
    }

    /// `cgroup v1 (memory, pids, cpu)`, `cgroup v2 (memory, pids, cpu)` or `rlimits only`.
    pub fn describe(&self) -> String {
        let Some(version) = self.version else {
            return "rlimits only".into();
        };
        let mut names: Vec<Controller> = self
            .bases
            .iter()
            .flat_map(|b| b.controllers.iter().copied())
            .collect();
        names.sort();
        let names: Vec<&str> = names.iter().map(|c| c.name()).collect();
        let v = match version {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        };
        format!("cgroup {v} ({})", names.join(", "))
    }

    pub fn version(&self) -> Option<CgroupVersion> {
        self.version
    }

    fn has(&self, controller: Controller) -> bool {
        self.bases
            .iter()
            .any(|b| b.controllers.contains(&controller))
    }

    /// The cgroup directories of the child recorded as `id` (they may not exist).
    fn dirs_of(&self, id: Uuid) -> Vec<(Vec<Controller>, PathBuf)> {
        self.bases
            .iter()
            .map(|b| (b.controllers.clone(), b.dir.join(cgroup_name(id))))
            .collect()
    }

    /// Make the cgroup of the child to be recorded as `id` with `limits` written, and
    /// everything the child must do before exec (without cgroups: the rlimits only).
    pub fn prepare(&self, id: Uuid, limits: &ResourceLimits) -> io::Result<Prepared> {
        let cgroup = if self.version.is_some() {
            Some(ChildCgroup::create(self, id, limits)?)
        } else {
            None
        };
        let join = match &cgroup {
            Some(c) => c
                .dirs
                .iter()
                .map(|(_, dir)| c_path(&dir.join("cgroup.procs")))
                .collect::<io::Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let open_files = limits.open_files.map(|n| {
            let hard = current_limit(libc::RLIMIT_NOFILE).1;
            // Only root may raise a hard limit.
            if self.root { n } else { n.min(hard) }
        });
        // RLIMIT_NPROC counts every process and thread of the server's user, and does not
        // bind root: it stands in for a pids cgroup only for an ordinary user, as a bound
        // on what the tree may add to what that user runs now.
        let processes = match limits.max_processes {
            Some(n) if !self.root && !self.has(Controller::Pids) => {
                // SAFETY: geteuid has no preconditions.
                Some(uid_tasks(unsafe { libc::geteuid() }).saturating_add(n))
            }
            _ => None,
        };
        Ok(Prepared {
            cgroup: cgroup.map(Arc::new),
            setup: ChildSetup {
                join,
                rlimits: Rlimits {
                    open_files,
                    processes,
                },
            },
        })
    }

    /// Remove the cgroup of the child recorded as `id`, ending whatever is still in it
    /// (only this server's children are ever placed there). For rows of an earlier run.
    pub async fn remove_leftover(&self, id: Uuid) {
        if self.version.is_none() {
            return;
        }
        let cgroup = ChildCgroup {
            version: self.version.unwrap_or(CgroupVersion::V1),
            dirs: self
                .dirs_of(id)
                .into_iter()
                .filter(|(_, d)| d.is_dir())
                .collect(),
            limits: ResourceLimits::default(),
        };
        if !cgroup.dirs.is_empty() {
            cgroup.remove().await;
        }
    }

    /// The row ids of the child cgroups present now (to find those no row holds).
    pub fn present(&self) -> Vec<Uuid> {
        let mut ids: Vec<Uuid> = self
            .bases
            .iter()
            .filter_map(|b| std::fs::read_dir(&b.dir).ok())
            .flatten()
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| {
                let name = e.file_name();
                let id = Uuid::try_parse(name.to_str()?).ok()?;
                (cgroup_name(id) == name.to_str()?).then_some(id)
            })
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

/// A replica id as one directory name.
fn dir_name(replica: &str) -> String {
    let name: String = replica
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    match name.as_str() {
        "" | "." | ".." => "replica".into(),
        _ => name,
    }
}

fn cgroup_name(id: Uuid) -> String {
    id.simple().to_string()
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path holds a NUL byte"))
}

/// The mounts of type `fstype`: (mount point, root of the mount, super options).
fn mounts<'a>(mountinfo: &'a str, fstype: &str) -> Vec<(&'a str, &'a str, &'a str)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let mut right = right.split(' ');
            let kind = right.next()?;
            let _source = right.next()?;
            let options = right.next().unwrap_or("");
            (kind == fstype).then_some((*left.get(4)?, *left.get(3)?, options))
        })
        .collect()
}

/// `mount point` + (`path` below `root`), when `path` is below `root`.
fn below(mount_point: &str, root: &str, path: &str) -> Option<PathBuf> {
    let rel = if root == "/" {
        path
    } else {
        let rest = path.strip_prefix(root)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        rest
    };
    Some(Path::new(mount_point).join(rel.trim_start_matches('/')))
}

/// This process's cgroup v2 directory, when a cgroup2 hierarchy is mounted.
fn v2_own_dir(mountinfo: &str, own: &str) -> Option<PathBuf> {
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    mounts(mountinfo, "cgroup2")
        .into_iter()
        .find_map(|(point, root, _)| below(point, root, path))
}

/// This process's cgroup v1 directory for each of our controllers that is mounted.
fn v1_own_dirs(mountinfo: &str, own: &str) -> Vec<(Controller, PathBuf)> {
    let v1 = mounts(mountinfo, "cgroup");
    Controller::ALL
        .into_iter()
        .filter_map(|controller| {
            let name = controller.name();
            let path = own.lines().find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let _id = parts.next()?;
                let list = parts.next()?;
                let path = parts.next()?;
                list.split(',').any(|c| c == name).then_some(path)
            })?;
            let dir = v1.iter().find_map(|(point, root, options)| {
                options
                    .split(',')
                    .any(|o| o == name)
                    .then(|| below(point, root, path))
                    .flatten()
            })?;
            Some((controller, dir))
        })
        .collect()
}

/// Make `<own>/agentry/<name>` with our controllers enabled down to it, when `own` is a
/// cgroup v2 directory delegated to this server. The server moves itself (and what runs
/// beside it there) into `<own>/server` if that is what it takes to enable them.
fn delegate_v2(own: &Path, name: &str) -> Option<Base> {
    let available = std::fs::read_to_string(own.join("cgroup.controllers")).ok()?;
    let controllers: Vec<Controller> = Controller::ALL
        .into_iter()
        .filter(|c| available.split_whitespace().any(|a| a == c.name()))
        .collect();
    if controllers.is_empty() {
        return None;
    }
    let enable = controllers
        .iter()
        .map(|c| format!("+{}", c.name()))
        .collect::<Vec<_>>()
        .join(" ");
    let write = |dir: &Path| std::fs::write(dir.join("cgroup.subtree_control"), &enable);
    if let Err(e) = write(own) {
        if e.raw_os_error() != Some(libc::EBUSY) {
            tracing::debug!(dir = %own.display(), error = %e, "cgroup v2 not delegated");
            return None;
        }
        // Processes in `own` keep it from handing controllers down: move them to a leaf.
        let leaf = own.join(SERVER_LEAF);
        if let Err(e) = std::fs::create_dir_all(&leaf) {
            tracing::debug!(dir = %leaf.display(), error = %e, "cgroup v2 not delegated");
            return None;
        }
        let procs = std::fs::read_to_string(own.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            if let Err(e) = std::fs::write(leaf.join("cgroup.procs"), pid)
                && e.raw_os_error() != Some(libc::ESRCH)
            {
                tracing::debug!(pid, error = %e, "could not move a process to the server's leaf cgroup");
                return None;
            }
        }
        if let Err(e) = write(own) {
            tracing::debug!(dir = %own.display(), error = %e, "cgroup v2 controllers not enabled");
            return None;
        }
    }
    let top = own.join(BASE_DIR);
    let dir = top.join(name);
    let made = std::fs::create_dir_all(&dir)
        .and_then(|()| write(&top))
        .and_then(|()| write(&dir));
    match made {
        Ok(()) => Some(Base { controllers, dir }),
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "cgroup v2 controllers not enabled");
            None
        }
    }
}

/// The soft and hard limit of `resource` for this process.
fn current_limit(resource: libc::__rlimit_resource_t) -> (u64, u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit to write to.
    if unsafe { libc::getrlimit(resource, &mut r) } == 0 {
        (r.rlim_cur, r.rlim_max)
    } else {
        (u64::MAX, u64::MAX)
    }
}

/// Processes and threads of user `uid` now (what `RLIMIT_NPROC` counts).
fn uid_tasks(uid: u32) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().as_bytes().iter().all(u8::is_ascii_digit))
        .filter(|e| e.metadata().is_ok_and(|m| m.uid() == uid))
        .map(|e| std::fs::read_dir(e.path().join("task")).map_or(1, |t| t.count() as u64))
        .sum()
}

/// The rlimits a child sets on itself before exec.
#[derive(Debug, Clone, Copy)]
struct Rlimits {
    open_files: Option<u64>,
    processes: Option<u64>,
}

/// A child's cgroup, made before it is spawned, and what it does before exec.
pub struct Prepared {
    cgroup: Option<Arc<ChildCgroup>>,
    setup: ChildSetup,
}

impl Prepared {
    /// The child's cgroup, if it has one.
    pub fn cgroup(&self) -> Option<Arc<ChildCgroup>> {
        self.cgroup.clone()
    }

    /// What the child runs between fork and exec (see [`ChildSetup::apply`]).
    pub fn setup(&self) -> ChildSetup {
        self.setup.clone()
    }
}

/// What a child does between fork and exec.
#[derive(Debug, Clone)]
pub struct ChildSetup {
    /// `cgroup.procs` of each of its cgroup's directories.
    join: Vec<CString>,
    rlimits: Rlimits,
}

impl ChildSetup {
    /// No cgroup to join and no rlimits but the core size's.
    fn none() -> Self {
        Self {
            join: Vec::new(),
            rlimits: Rlimits {
                open_files: None,
                processes: None,
            },
        }
    }

    /// In the forked child, before exec: join the cgroup, set the rlimits. Only
    /// async-signal-safe calls (`open`, `write`, `close`, `setrlimit`), on data prepared
    /// before the fork.
    pub fn apply(&self) -> io::Result<()> {
        for path in &self.join {
            // SAFETY: `path` is a valid NUL-terminated string owned by `self`.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // "0" names the writing process itself.
            // SAFETY: `fd` is open; the buffer is one valid byte.
            let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
            let error = io::Error::last_os_error();
            // SAFETY: `fd` is ours to close.
            unsafe { libc::close(fd) };
            if written != 1 {
                return Err(error);
            }
        }
        set_limit(libc::RLIMIT_CORE, 0)?;
        if let Some(n) = self.rlimits.open_files {
            set_limit(libc::RLIMIT_NOFILE, n)?;
        }
        if let Some(n) = self.rlimits.processes {
            set_limit(libc::RLIMIT_NPROC, n)?;
        }
        Ok(())
    }
}

/// The command of `agentry-sandbox` that applies a [`ChildSetup`] and execs a program:
/// `launch [--join PATH]... [--nofile N] [--nproc N] [--ignore-term] -- PROGRAM ARGV0
/// ARGS...`. With it the server starts a child by `posix_spawn` instead of forking its own
/// large address space to run the setup in the copy.
pub const LAUNCH: &str = "launch";

/// What the launcher is told: the setup (when there are limits), whether TERM starts
/// ignored, and the program with its `argv` (`argv[0]` first).
#[derive(Debug, Clone)]
pub struct Launch {
    pub setup: Option<ChildSetup>,
    pub ignores_term: bool,
    pub program: String,
    pub argv: Vec<String>,
}

impl Launch {
    /// The arguments after `LAUNCH`, read back by [`Launch::parse`].
    pub fn to_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(setup) = &self.setup {
            out.push("--setup".to_owned());
            for path in &setup.join {
                out.push("--join".to_owned());
                out.push(path.to_string_lossy().into_owned());
            }
            if let Some(n) = setup.rlimits.open_files {
                out.extend(["--nofile".to_owned(), n.to_string()]);
            }
            if let Some(n) = setup.rlimits.processes {
                out.extend(["--nproc".to_owned(), n.to_string()]);
            }
        }
        if self.ignores_term {
            out.push("--ignore-term".to_owned());
        }
        out.push("--".to_owned());
        out.push(self.program.clone());
        out.extend(self.argv.iter().cloned());
        out
    }

    pub fn parse(args: &[String]) -> io::Result<Self> {
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        let number = |flag: &str, v: &str| {
            v.parse::<u64>()
                .map_err(|_| bad(format!("`{flag}` takes a number, not `{v}`")))
        };
        let mut setup: Option<ChildSetup> = None;
        let mut ignores_term = false;
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            if flag == "--" {
                break;
            }
            if flag == "--ignore-term" {
                ignores_term = true;
                continue;
            }
            if flag == "--setup" {
                setup.get_or_insert_with(ChildSetup::none);
                continue;
            }
            let value = it
                .next()
                .ok_or_else(|| bad(format!("`{flag}` needs a value")))?;
            let s = setup
                .as_mut()
                .ok_or_else(|| bad(format!("`{flag}` comes after `--setup`")))?;
            match flag.as_str() {
                "--join" => s
                    .join
                    .push(CString::new(value.as_bytes()).map_err(|e| bad(e.to_string()))?),
                "--nofile" => s.rlimits.open_files = Some(number(flag, value)?),
                "--nproc" => s.rlimits.processes = Some(number(flag, value)?),
                other => return Err(bad(format!("unknown argument `{other}`"))),
            }
        }
        let program = it
            .next()
            .ok_or_else(|| bad("no program after `--`".into()))?
            .clone();
        let argv: Vec<String> = it.cloned().collect();
        if argv.is_empty() {
            return Err(bad("no argv[0] after the program".into()));
        }
        Ok(Self {
            setup,
            ignores_term,
            program,
            argv,
        })
    }

    /// In the launcher: what a forked copy of the server would do before exec, then
    /// become the program. Returns only on failure.
    pub fn exec(self) -> io::Error {
        use std::os::unix::process::CommandExt as _;
        if self.ignores_term {
            // SAFETY: setting a signal's disposition to ignored; no handler is involved.
            if unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) } == libc::SIG_ERR {
                return io::Error::last_os_error();
            }
        }
        if let Some(setup) = &self.setup
            && let Err(e) = setup.apply()
        {
            return e;
        }
        let (argv0, args) = self.argv.split_first().expect("checked by parse");
        std::process::Command::new(&self.program)
            .arg0(argv0)
            .args(args)
            .exec()
    }
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let r = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: `r` is a valid rlimit.
    if unsafe { libc::setrlimit(resource, &r) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The cgroup of one recorded child (a directory per v1 controller, one for v2).
#[derive(Debug)]
pub struct ChildCgroup {
    version: CgroupVersion,
    dirs: Vec<(Vec<Controller>, PathBuf)>,
    limits: ResourceLimits,
}

impl ChildCgroup {
    fn create(host: &LimitHost, id: Uuid, limits: &ResourceLimits) -> io::Result<Self> {
        let cgroup = Self {
            version: host.version.unwrap_or(CgroupVersion::V1),
            dirs: host.dirs_of(id),
            limits: *limits,
        };
        let made = cgroup.make(limits);
        if made.is_err() {
            for (_, dir) in &cgroup.dirs {
                let _ = std::fs::remove_dir(dir);
            }
        }
        made.map(|()| cgroup)
    }

    fn make(&self, limits: &ResourceLimits) -> io::Result<()> {
        for (controllers, dir) in &self.dirs {
            make_dir(dir)?;
            for controller in controllers {
                self.write_limit(*controller, dir, limits)?;
            }
        }
        Ok(())
    }

    fn write_limit(
        &self,
        controller: Controller,
        dir: &Path,
        limits: &ResourceLimits,
    ) -> io::Result<()> {
        let write = |file: &str, value: String| {
            std::fs::write(dir.join(file), value).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("could not write {file} in {}: {e}", dir.display()),
                )
            })
        };
        let exists = |file: &str| dir.join(file).exists();
        match (self.version, controller) {
            (CgroupVersion::V1, Controller::Memory) => {
                if let Some(n) = limits.memory_bytes {
                    write("memory.limit_in_bytes", n.to_string())?;
                    // Memory and swap together: swapping out does not escape the limit.
                    if exists("memory.memsw.limit_in_bytes") {
                        write("memory.memsw.limit_in_bytes", n.to_string())?;
                    }
                }
            }
            (CgroupVersion::V2, Controller::Memory) => {
                if let Some(n) = limits.memory_bytes {
                    write("memory.max", n.to_string())?;
                    if exists("memory.swap.max") {
                        write("memory.swap.max", "0".into())?;
                    }
                    // The OOM killer ends the whole tree, not one process of it.
                    if exists("memory.oom.group") {
                        write("memory.oom.group", "1".into())?;
                    }
                }
            }
            (_, Controller::Pids) => {
                if let Some(n) = limits.max_processes {
                    write("pids.max", n.to_string())?;
                }
            }
            (CgroupVersion::V1, Controller::Cpu) => {
                if let Some(w) = limits.cpu_weight {
                    write("cpu.shares", shares_of_weight(w).to_string())?;
                }
            }
            (CgroupVersion::V2, Controller::Cpu) => {
                if let Some(w) = limits.cpu_weight {
                    write("cpu.weight", w.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// The directory of `controller`, if this cgroup has it.
    fn dir_of(&self, controller: Controller) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| c.contains(&controller))
            .map(|(_, d)| d.as_path())
    }

    /// The limit the tree reached, if the kernel counted one: a process killed by the
    /// OOM killer in this cgroup, or a fork refused at `pids.max`.
    pub fn limit_hit(&self) -> Option<LimitHit> {
        if let (Some(dir), Some(limit)) =
            (self.dir_of(Controller::Memory), self.limits.memory_bytes)
        {
            let file = match self.version {
                CgroupVersion::V1 => "memory.oom_control",
                CgroupVersion::V2 => "memory.events",
            };
            let text = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
            if counter(&text, "oom_kill") > 0 {
                return Some(LimitHit::Memory { limit });
            }
        }
        if let (Some(dir), Some(limit)) = (self.dir_of(Controller::Pids), self.limits.max_processes)
        {
            let text = std::fs::read_to_string(dir.join("pids.events")).unwrap_or_default();
            if counter(&text, "max") > 0 {
                return Some(LimitHit::Processes { limit });
            }
        }
        None
    }

    /// The processes in the cgroup now.
    pub fn members(&self) -> Vec<i32> {
        let Some((_, dir)) = self.dirs.first() else {
            return Vec::new();
        };
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|&p: &i32| p > 1)
            .collect()
    }

    /// SIGKILL every process in the cgroup (a tree that left its process group too).
    /// Only this server's children are ever placed in it.
    pub fn kill_all(&self) {
        if self.version == CgroupVersion::V2
            && let Some((_, dir)) = self.dirs.first()
            && std::fs::write(dir.join("cgroup.kill"), "1").is_ok()
        {
            return;
        }
        let me = std::process::id() as i32;
        for pid in self.members() {
            if pid != me {
                // SAFETY: kill has no memory-safety preconditions; `pid` is positive.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    /// `remove` on a thread of its own, for a handle dropped without `terminate` (the
    /// runtime may be stopping and run no more tasks).
    pub fn remove_in_background(self: Arc<Self>) {
        let spawned = std::thread::Builder::new()
            .name("cgroup-remove".into())
            .spawn(move || {
                for attempt in 0..50 {
                    if self.remove_once(attempt == 49) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.remove_parents();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start removing a process's cgroup; it is left for the next start");
        }
    }

    /// End what is left in the cgroup and remove its directories (retrying while killed
    /// processes finish exiting), then the replica's directory when it is empty.
    pub async fn remove(&self) {
        for attempt in 0..50 {
            if self.remove_once(attempt == 49) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.remove_parents();
    }

    /// One attempt: whether every directory is gone.
    fn remove_once(&self, last: bool) -> bool {
        self.kill_all();
        let mut left = false;
        for (_, dir) in &self.dirs {
            match std::fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    left = true;
                    if last {
                        tracing::warn!(dir = %dir.display(), error = %e, "could not remove a process's cgroup");
                    }
                }
            }
        }
        !left
    }

    fn remove_parents(&self) {
        for (_, dir) in &self.dirs {
            // Fails while another child's cgroup is there: that is fine.
            if let Some(parent) = dir.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
    }
}

/// v1 `cpu.shares` for a v2-scale weight (100 ↦ 1024, the v1 default).
fn shares_of_weight(weight: u32) -> u64 {
    (u64::from(weight) * 1024 / 100).max(2)
}

/// Make a child cgroup's directory and its parents; a parent removed at the same moment
/// by the end of the replica's last child is made again.
fn make_dir(dir: &Path) -> io::Result<()> {
    let mut last = None;
    for _ in 0..5 {
        if let Some(parent) = dir.parent()
            && let Err(e) = std::fs::create_dir_all(parent)
        {
            last = Some(e);
            continue;
        }
        match std::fs::create_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => last = Some(e),
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("could not make cgroup {}: {e}", dir.display()),
                ));
            }
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("could not make a cgroup")))
}

/// The value of `key` in a flat keyed file (`key value` lines).
fn counter(text: &str, key: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Watches a limited child's cgroup while it runs: once a limit is reached the whole
/// tree is killed (the kernel's OOM killer of cgroup v1 ends one process; a fork bomb at
/// its limit goes on trying) and the hit is handed to `on_hit`.
pub struct LimitWatch {
    task: tokio::task::JoinHandle<()>,
}

impl LimitWatch {
    pub fn start(cgroup: Arc<ChildCgroup>, on_hit: impl FnOnce(LimitHit) + Send + 'static) -> Self {
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(WATCH_EVERY);
            loop {
                tick.tick().await;
                if let Some(hit) = cgroup.limit_hit() {
                    tracing::warn!(%hit, "a process tree reached its limit; ending it");
                    on_hit(hit);
                    cgroup.kill_all();
                    return;
                }
            }
        });
        Self { task }
    }
}

impl Drop for LimitWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launchers_command_line_is_read_back_as_written() {
        let launch = Launch {
            setup: Some(ChildSetup {
                join: vec![CString::new("/sys/fs/cgroup/pids/agentry/x/cgroup.procs").unwrap()],
                rlimits: Rlimits {
                    open_files: Some(256),
                    processes: None,
                },
            }),
            ignores_term: true,
            program: "/usr/bin/bwrap".into(),
            argv: vec!["bwrap".into(), "--".into(), "--setup".into()],
        };
        let args = launch.to_args();
        let back = Launch::parse(&args).unwrap();
        assert_eq!(back.to_args(), args);
        let setup = back.setup.unwrap();
        assert_eq!(setup.join, launch.setup.as_ref().unwrap().join);
        assert_eq!(setup.rlimits.open_files, Some(256));
        assert_eq!(setup.rlimits.processes, None);
        assert!(back.ignores_term);
        // What follows the program is its argv, flags of the launcher's or not.
        assert_eq!(back.argv, ["bwrap", "--", "--setup"]);
        let bare = Launch::parse(&["--".into(), "/bin/true".into(), "true".into()]).unwrap();
        assert!(bare.setup.is_none() && !bare.ignores_term);

        let strings = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for (bad, why) in [
            (
                &["--nofile", "5", "--", "/bin/true", "true"][..],
                "after `--setup`",
            ),
            (
                &["--setup", "--nproc", "many", "--", "/bin/true", "true"][..],
                "takes a number",
            ),
            (
                &["--setup", "--cap", "x", "--", "/bin/true", "true"][..],
                "unknown argument",
            ),
            (&["--"][..], "no program"),
            (&["--", "/bin/true"][..], "no argv[0]"),
            (&["--setup", "--join"][..], "needs a value"),
        ] {
            let e = Launch::parse(&strings(bad)).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const OWN: &str = "\
8:pids:/
4:memory:/svc/abc
1:cpu:/
0::/
";

    #[test]
    fn finds_own_v1_directories() {
        let dirs = v1_own_dirs(MOUNTINFO, OWN);
        assert_eq!(
            dirs,
            vec![
                (
                    Controller::Memory,
                    PathBuf::from("/sys/fs/cgroup/memory/svc/abc")
                ),
                (Controller::Pids, PathBuf::from("/sys/fs/cgroup/pids")),
                (Controller::Cpu, PathBuf::from("/sys/fs/cgroup/cpu")),
            ]
        );
        assert_eq!(
            v2_own_dir(MOUNTINFO, OWN),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        // A co-mounted hierarchy, and a cgroup namespace whose mount root is not `/`.
        let info = "1 0 0:1 /ns /cg/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
                    2 0 0:2 /ns /cg2 rw - cgroup2 cgroup2 rw\n";
        let own = "3:cpu,cpuacct:/ns/a\n0::/ns/b\n";
        assert_eq!(
            v1_own_dirs(info, own),
            vec![(Controller::Cpu, PathBuf::from("/cg/cpu,cpuacct/a"))]
        );
        assert_eq!(v2_own_dir(info, own), Some(PathBuf::from("/cg2/b")));
        assert_eq!(v2_own_dir(info, "0::/elsewhere\n"), None);
    }

    #[test]
    fn names_and_counters() {
        assert_eq!(dir_name("host-1.a_b"), "host-1.a_b");
        assert_eq!(dir_name("a/../b c"), "a_.._b_c");
        assert_eq!(dir_name(".."), "replica");
        assert_eq!(
            counter("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", "oom_kill"),
            3
        );
        assert_eq!(counter("max 0\n", "max"), 0);
        assert_eq!(counter("", "max"), 0);
        assert_eq!(shares_of_weight(100), 1024);
        assert_eq!(shares_of_weight(1), 10);
        assert_eq!(format_bytes(200 << 20), "200 MiB");
        assert_eq!(format_bytes(4 << 30), "4 GiB");
        assert_eq!(format_bytes(1000), "1000 B");
        assert_eq!(
            LimitHit::Memory { limit: 2 << 30 }.to_string(),
            "memory limit of 2 GiB reached"
        );
        assert_eq!(
            LimitHit::Processes { limit: 64 }.to_string(),
            "process limit of 64 reached"
        );
    }

    #[test]
    fn rlimits_only_describes_itself() {
        assert_eq!(LimitHost::rlimits_only().describe(), "rlimits only");
        let host = LimitHost {
            version: Some(CgroupVersion::V1),
            bases: vec![
                Base {
                    controllers: vec![Controller::Pids],
                    dir: "/p".into(),
                },
                Base {
                    controllers: vec![Controller::Memory],
                    dir: "/m".into(),
                },
            ],
            root: true,
        };
        assert_eq!(host.describe(), "cgroup v1 (memory, pids)");
    }
}
