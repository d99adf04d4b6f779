//! The server under test: `agentry serve` run as a child process on a fresh data dir (so
//! its memory is measured apart from the bench's clients), its admin token, a small pool
//! on its embedded PostgreSQL for the raw reference and the checks, and `/proc` readings
//! of its memory and CPU time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::PgPool;

use super::{BenchArgs, TurnLimit};
use crate::embedded_pg::EmbeddedPostgres;

/// Where the embedded cluster lives when the server runs as root.
const ROOT_CLUSTER_BASE: &str = "/var/lib/agentry";

const RUNNING_TURNS: &str = "AGENTRY_LIMITS__MAX_RUNNING_TURNS";

/// Settings that bound one caller or one team, lifted for a load (the running-turn limit
/// unless `--turn-limit` says otherwise).
const BENCH_LIMITS: [(&str, &str); 6] = [
    (RUNNING_TURNS, "0"),
    ("AGENTRY_LIMITS__MAX_STREAMS_PER_PRINCIPAL", "1000000"),
    ("AGENTRY_LIMITS__MAX_WAITS_PER_PRINCIPAL", "1000000"),
    ("AGENTRY_LIMITS__MAX_AGENTS_PER_TEAM", "1000000"),
    ("AGENTRY_LIMITS__MAX_WORKSPACES_PER_TEAM", "1000000"),
    ("AGENTRY_LIMITS__MAX_PROJECTS_PER_TEAM", "1000000"),
];

pub struct ServerProcess {
    child: Child,
    /// The bench's temporary directory: the repository, the data dir, the server log.
    dir: PathBuf,
    pub base: String,
    pub token: String,
    pub repo: PathBuf,
    pub pool: PgPool,
    cluster_dir: Option<PathBuf>,
    keep: bool,
    /// Callgrind's output file, when the server runs under it (`--callgrind`).
    callgrind: Option<PathBuf>,
}

/// Memory of one process, in KiB, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
    pub anon_kib: u64,
    pub file_kib: u64,
}

impl ServerProcess {
    /// Start `agentry serve` (this executable) on a fresh data dir and wait until it is
    /// ready. `--keep` leaves the directory and the server log behind; `--turn-limit`
    /// sets its running-turn limit.
    pub async fn start(args: &BenchArgs) -> anyhow::Result<Self> {
        Self::start_with(args, &[]).await
    }

    /// `start`, with `env` set for the server (settings as `AGENTRY_*` variables).
    pub async fn start_with(args: &BenchArgs, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let keep = args.keep;
        // Short: the data dir's Unix sockets (an agent's egress endpoint,
        // `<dir>/data/egress/<agent uuid>/egress.sock`) must fit `sun_path` (108 bytes),
        // which 32 hex digits here overran. The last 12 of a v7 UUID are random.
        let unique = uuid::Uuid::now_v7().simple().to_string();
        let dir = std::env::temp_dir().join(format!("agentry-bench-{}", &unique[20..]));
        std::fs::create_dir_all(&dir)?;
        // As root the cluster runs as `postgres`, which canonicalizes the data dir's path.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        let repo = dir.join("repo");
        init_repo(&repo)?;
        let data_dir = dir.join("data");
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
            probe.local_addr()?.port()
        };
        let log = std::fs::File::create(dir.join("server.log"))?;
        let exe = std::env::current_exe().context("cannot find the agentry executable")?;
        // Under callgrind, instructions are counted from when the bench zeroes them; its
        // mock agents (child processes) run natively.
        let callgrind = args.callgrind.then(|| dir.join("callgrind.out"));
        let mut serve = match &callgrind {
            Some(out) => {
                let mut c = Command::new("valgrind");
                c.arg("--tool=callgrind")
                    .arg(format!("--callgrind-out-file={}", out.display()))
                    .arg(&exe);
                c
            }
            None => Command::new(exe),
        };
        // A load is one client opening up to thousands of agents and streams with one
        // token: the per-caller and per-team bounds are lifted (unless the environment
        // sets them, to measure them).
        for (var, value) in BENCH_LIMITS {
            if std::env::var_os(var).is_none() {
                serve.env(var, value);
            }
        }
        match args.turn_limit {
            TurnLimit::Off => {}
            TurnLimit::Host => {
                serve.env_remove(RUNNING_TURNS);
            }
            TurnLimit::At(n) => {
                serve.env(RUNNING_TURNS, n.to_string());
            }
        }
        serve.envs(env.iter().copied());
        let child = serve
            .arg("serve")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            // Always the embedded default on the fresh data dir; other AGENTRY_* variables
            // pass through so a setting can be tried under load.
            .env_remove("AGENTRY_CONFIG")
            .env_remove("DATABASE_URL")
            .env_remove("AGENTRY_DATABASE__URL")
            .env_remove("AGENTRY_DATA_DIR")
            .env_remove("AGENTRY_LISTEN")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("cannot start `agentry serve`")?;
        let base = format!("http://127.0.0.1:{port}");
        let mut starting = Starting {
            child: Some(child),
            dir,
            slow: callgrind.is_some(),
        };
        starting.wait_ready(&base).await?;
        let token = std::fs::read_to_string(data_dir.join("admin-token"))
            .context("the fresh server wrote no admin token")?
            .trim()
            .to_owned();
        let opts = EmbeddedPostgres::running(&data_dir, "agentry")
            .context("the server's embedded PostgreSQL is not running")?;
        let pool = crate::store::connect(opts, 4).await?;
        let data_directory: String = sqlx::query_scalar("SHOW data_directory")
            .fetch_one(&pool)
            .await?;
        let cluster_dir = Path::new(&data_directory).parent().map(Path::to_path_buf);
        match args.turn_limit {
            TurnLimit::Off => {}
            TurnLimit::Host => println!(
                "  running-turn limit: the host's default ({}): every turn start takes the \
                 queue's lock",
                crate::config::HostCapacity::measure().running_turns()
            ),
            TurnLimit::At(n) => {
                println!("  running-turn limit: {n}: every turn start takes the queue's lock")
            }
        }
        let ready = warm_wal(&pool).await?;
        println!(
            "  WAL warmed: {ready} segments ready for reuse (min_wal_size's worth, as on a \
             server that has checkpointed once)"
        );
        Ok(Self {
            child: starting.child.take().expect("still owned by `starting`"),
            dir: starting.dir.clone(),
            base,
            token,
            repo,
            pool,
            cluster_dir,
            keep,
            callgrind,
        })
    }

    /// Under `--callgrind`: count the server's instructions from zero.
    pub fn zero_instructions(&self) -> anyhow::Result<()> {
        self.callgrind_control("-z")?;
        Ok(())
    }

    /// Under `--callgrind`: the instructions the server executed since
    /// `zero_instructions` (callgrind's `totals` of the dump this asks for).
    pub fn instructions(&self) -> anyhow::Result<u64> {
        let out = self.callgrind_control("-d")?;
        let name = out
            .file_name()
            .and_then(|n| n.to_str())
            .context("callgrind's output file")?
            .to_owned();
        let dir = out.parent().context("callgrind's output directory")?;
        // Each dump is `<out>.<n>`: the highest is this one.
        let dump = std::fs::read_dir(dir)?
            .flatten()
            .filter_map(|e| {
                let n = e
                    .file_name()
                    .to_str()?
                    .strip_prefix(&format!("{name}."))?
                    .parse::<u32>()
                    .ok()?;
                Some((n, e.path()))
            })
            .max()
            .context("callgrind wrote no dump")?
            .1;
        let text = std::fs::read_to_string(&dump)?;
        text.lines()
            .find_map(|l| l.strip_prefix("totals:"))
            .and_then(|t| t.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no `totals:` line in {}", dump.display()))
    }

    fn callgrind_control(&self, command: &str) -> anyhow::Result<PathBuf> {
        let out = self
            .callgrind
            .clone()
            .context("the server does not run under callgrind (--callgrind)")?;
        let status = Command::new("callgrind_control")
            .arg(command)
            .arg(self.pid().to_string())
            .stdout(Stdio::null())
            .status()
            .context("cannot run callgrind_control")?;
        anyhow::ensure!(
            status.success(),
            "callgrind_control {command} failed: {status}"
        );
        Ok(out)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The number of files in the cluster's WAL directory: it grows only when PostgreSQL
    /// creates a segment (and fills it with zeros) rather than reusing one.
    pub async fn wal_files(&self) -> anyhow::Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM pg_ls_waldir() WHERE name ~ '^[0-9A-F]{24}$'")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    pub fn memory(&self) -> Memory {
        process_memory(self.pid())
    }

    /// SIGTERM, wait for the graceful stop (agents, HTTP, the embedded cluster), then
    /// remove what the run created.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.pool.close().await;
        // Under callgrind the server stops (and writes its counts) far more slowly.
        let grace = if self.callgrind.is_some() { 300 } else { 60 };
        let status = terminate(&mut self.child, Duration::from_secs(grace)).await?;
        anyhow::ensure!(
            status.success(),
            "the server exited with {status}; log: {}",
            self.dir.join("server.log").display()
        );
        if self.keep {
            println!("kept {}", self.dir.display());
            // As root the cluster is not under the run's directory: say where it stays.
            if let Some(c) = &self.cluster_dir
                && !c.starts_with(&self.dir)
            {
                println!("kept its PostgreSQL cluster in {}", c.display());
            }
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
            // As root the cluster lives outside the data dir; remove only that layout.
            if let Some(c) = &self.cluster_dir
                && c.parent() == Some(Path::new(ROOT_CLUSTER_BASE))
                && c.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("pg-"))
            {
                let _ = std::fs::remove_dir_all(c);
            }
        }
        Ok(())
    }
}

impl Drop for ServerProcess {
    /// On an error path: stop the server rather than leave it (and its agents) running.
    fn drop(&mut self) {
        stop_blocking(&mut self.child, &self.dir);
    }
}

/// A server that has not answered `/readyz` yet; dropped on failure, it is stopped.
struct Starting {
    child: Option<Child>,
    dir: PathBuf,
    /// Under callgrind: the server takes minutes, not seconds, to be ready.
    slow: bool,
}

impl Starting {
    async fn wait_ready(&mut self, base: &str) -> anyhow::Result<()> {
        let client = reqwest::Client::new();
        let wait = Duration::from_secs(if self.slow { 600 } else { 90 });
        let deadline = Instant::now() + wait;
        loop {
            let child = self.child.as_mut().expect("owned while starting");
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "`agentry serve` exited with {status} before it was ready:\n{}",
                    log_tail(&self.dir)
                );
            }
            if let Ok(res) = client.get(format!("{base}/readyz")).send().await
                && res.status().is_success()
            {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "`agentry serve` was not ready within {} s:\n{}",
                wait.as_secs(),
                log_tail(&self.dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            stop_blocking(child, &self.dir);
        }
    }
}

fn init_repo(repo: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(repo)?;
    for args in [
        &["init", "-q", "-b", "main"][..],
        &[
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@localhost",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "init",
        ],
    ] {
        let ok = Command::new("git")
            .args(args)
            .current_dir(repo)
            .stdout(Stdio::null())
            .status()
            .context("cannot run git")?
            .success();
        anyhow::ensure!(ok, "git {args:?} failed");
    }
    Ok(())
}

fn log_tail(dir: &Path) -> String {
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child's pid; the child is not reaped yet, so the pid is
    // still ours.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

async fn terminate(child: &mut Child, grace: Duration) -> anyhow::Result<std::process::ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    signal(child, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            signal(child, libc::SIGKILL);
            let status = child.wait()?;
            anyhow::bail!("the server did not stop within {grace:?} of SIGTERM ({status})");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn stop_blocking(child: &mut Child, dir: &Path) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    signal(child, libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            eprintln!(
                "server stopped; its log: {}",
                dir.join("server.log").display()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    signal(child, libc::SIGKILL);
    let _ = child.wait();
}

pub fn process_memory(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Memory {
        rss_kib: field("VmRSS:"),
        peak_rss_kib: field("VmHWM:"),
        anon_kib: field("RssAnon:"),
        file_kib: field("RssFile:"),
    }
}

/// CPU time of a process so far: the scheduler's run time of each of its threads
/// (`/proc/<pid>/task/<tid>/schedstat`, in nanoseconds). The user and system times of
/// `/proc/<pid>/stat` are sampled at the clock tick, and a process that runs often but
/// briefly (a paced mock agent: a thousand wake-ups of 30 µs each) is seldom caught by a
/// tick: it showed 0 % while it used a third of the machine. A thread that ended before
/// the reading is not counted; the server's runtime threads live as long as it does, and
/// a mock agent keeps its `/load` thread for the next load.
pub fn process_cpu(pid: u32) -> Duration {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    let nanos: u64 = tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(nanos)
}

/// CPU time of `pid` and everything it started: its own threads and its live
/// descendants' (`schedstat`), plus what its children that have ended and been waited
/// for used (`cutime` + `cstime` of `/proc/<pid>/stat`, tick-sampled): a sandbox's
/// short-lived helpers and setup commands are counted too.
pub fn tree_cpu(pid: u32) -> Duration {
    let live: Duration = descendants(pid)
        .into_iter()
        .map(|(p, _)| process_cpu(p))
        .sum();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command (which may hold spaces) start at the last ')'.
    let reaped_ticks: u64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            let f: Vec<&str> = rest.split_whitespace().collect();
            // state is field 3 (index 0 here); cutime and cstime are fields 16 and 17.
            [13, 14]
                .iter()
                .filter_map(|i| f.get(*i)?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    process_cpu(pid) + live + Duration::from_secs_f64(reaped_ticks as f64 / clock_ticks())
}

/// The whole machine's CPU time so far, from `/proc/stat`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MachineCpu {
    /// Everything but idle and I/O wait: interrupts and steal included.
    pub busy: Duration,
    pub total: Duration,
    /// Hardware and software interrupts (network delivery on loopback among them).
    pub interrupts: Duration,
    /// Time the hypervisor gave another guest while this one wanted to run.
    pub stolen: Duration,
}

pub fn machine_cpu() -> MachineCpu {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let values: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is counted in user).
    let at = |i: usize| values.get(i).copied().unwrap_or(0);
    let total: u64 = values.iter().take(8).sum();
    let idle = at(3) + at(4);
    let hz = clock_ticks();
    let time = |ticks: u64| Duration::from_secs_f64(ticks as f64 / hz);
    MachineCpu {
        busy: time(total - idle.min(total)),
        total: time(total),
        interrupts: time(at(5) + at(6)),
        stolen: time(at(7)),
    }
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// The processes the server started for its agents: everything below it but PostgreSQL
/// (the mock agents, whichever executable runs them, and their sandboxes and egress
/// bridges).
pub fn agent_processes(server_pid: u32) -> Vec<u32> {
    descendants(server_pid)
        .into_iter()
        .filter(|(_, comm)| comm != "postgres")
        .map(|(pid, _)| pid)
        .collect()
}

/// Every process below `pid` (children, their children, …) with its command name.
pub fn descendants(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let mut queue = vec![pid];
    while let Some(p) = queue.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                let comm =
                    std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
                out.push((child, comm.trim().to_owned()));
                queue.push(child);
            }
        }
    }
    out
}

/// CPU time used so far by the server, its mock agents, its PostgreSQL, the bench itself
/// and the whole machine: two readings give each one's share of a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuReading {
    pub server: Duration,
    pub agents: Duration,
    pub postgres: Duration,
    pub bench: Duration,
    pub machine: MachineCpu,
}

impl CpuReading {
    pub fn take(server_pid: u32) -> Self {
        let mut r = Self {
            server: process_cpu(server_pid),
            bench: process_cpu(std::process::id()),
            ..Self::default()
        };
        for (pid, comm) in descendants(server_pid) {
            if comm == "postgres" {
                r.postgres += process_cpu(pid);
            } else {
                r.agents += process_cpu(pid);
            }
        }
        r.machine = machine_cpu();
        r
    }

    /// Where the CPU went between `self` and `later`, in percent of all cores.
    pub fn shares_until(&self, later: &Self) -> CpuShares {
        let total = (later.machine.total.saturating_sub(self.machine.total))
            .as_secs_f64()
            .max(1e-9);
        let pct = |a: Duration, b: Duration| 100.0 * b.saturating_sub(a).as_secs_f64() / total;
        let busy = pct(self.machine.busy, later.machine.busy);
        let server = pct(self.server, later.server);
        let postgres = pct(self.postgres, later.postgres);
        let agents = pct(self.agents, later.agents);
        let bench = pct(self.bench, later.bench);
        let interrupts = pct(self.machine.interrupts, later.machine.interrupts);
        let stolen = pct(self.machine.stolen, later.machine.stolen);
        CpuShares {
            busy,
            server,
            postgres,
            agents,
            bench,
            interrupts,
            stolen,
            other: (busy - server - postgres - agents - bench - interrupts - stolen).max(0.0),
        }
    }
}

/// Shares of all cores over a load, in percent.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuShares {
    pub busy: f64,
    pub server: f64,
    pub postgres: f64,
    pub agents: f64,
    pub bench: f64,
    /// Hardware and software interrupts, charged to no process.
    pub interrupts: f64,
    /// Time the hypervisor ran another guest instead of this machine: stalls that no
    /// process here caused, and that latency figures feel most.
    pub stolen: f64,
    /// Processes outside the benchmark, kernel threads included.
    pub other: f64,
}

impl std::fmt::Display for CpuShares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CPU (share of all cores): busy {:.0} % = server {:.0} % + PostgreSQL {:.0} % + \
             mock agents and their sandboxes {:.0} % + bench clients {:.0} % + interrupts \
             {:.0} % + stolen by the hypervisor {:.0} % + other {:.0} %",
            self.busy,
            self.server,
            self.postgres,
            self.agents,
            self.bench,
            self.interrupts,
            self.stolen,
            self.other
        )
    }
}

/// Samples the machine's stolen time on a thread of its own (the bench's runtime is
/// busy with the load) every `every`, until `stop`: when in a load the hypervisor took the
/// time, to set beside the latency of each second.
pub struct StealSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<StealSample>>>,
}

/// The machine's stolen time so far, read at `at_us` (microseconds since the Unix epoch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StealSample {
    pub at_us: i64,
    pub stolen: Duration,
}

impl StealSampler {
    pub fn start(every: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            loop {
                // Read first, so that the last sample is taken after `finish` asked.
                let last = flag.load(std::sync::atomic::Ordering::Acquire);
                samples.push(StealSample {
                    at_us: crate::providers::mock::unix_micros(),
                    stolen: machine_cpu().stolen,
                });
                if last {
                    return samples;
                }
                // Woken early by `finish`.
                std::thread::park_timeout(every);
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stop sampling (after one last sample, taken at once) and return the samples.
    pub fn finish(mut self) -> Vec<StealSample> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let Some(thread) = self.thread.take() else {
            return Vec::new();
        };
        thread.thread().unpark();
        thread.join().unwrap_or_default()
    }
}

/// A load that failed half-way stops the sampling too.
impl Drop for StealSampler {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Milliseconds stolen in each of `seconds` seconds from `from_us` (all cores together):
/// each interval between two samples counts in the second its end falls in.
pub fn stolen_by_second(samples: &[StealSample], from_us: i64, seconds: usize) -> Vec<f64> {
    let mut out = vec![Duration::ZERO; seconds];
    for pair in samples.windows(2) {
        let second = (pair[1].at_us - from_us).div_euclid(1_000_000);
        if let Some(slot) = usize::try_from(second).ok().and_then(|s| out.get_mut(s)) {
            *slot += pair[1].stolen.saturating_sub(pair[0].stolen);
        }
    }
    out.into_iter()
        .map(|d| d.as_micros() as f64 / 1000.0)
        .collect()
}

/// Proportional set size of a process (shared pages divided among their users), in KiB.
pub fn process_pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Give the fresh cluster what every cluster that has run through a checkpoint keeps:
/// `min_wal_size` worth of WAL segments to reuse. A new cluster has none, so under load
/// it creates a 16 MB segment every few seconds, filling each with zeros and syncing it
/// while commits wait; a running server renames an old one instead. Returns the number
/// of segments ready beyond the current one.
async fn warm_wal(pool: &PgPool) -> anyhow::Result<i64> {
    let (min_wal_mb, segment_mb): (i64, i64) = sqlx::query_as(
        "SELECT setting::bigint, (SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size') / 1048576
           FROM pg_settings WHERE name = 'min_wal_size'",
    )
    .fetch_one(pool)
    .await
    .context("reading min_wal_size")?;
    let segments = (min_wal_mb / segment_mb.max(1)).max(1);
    let mut conn = pool.acquire().await?;
    for i in 0..segments {
        // A logged write in each segment, so that each switch moves on to a new one.
        sqlx::query("SELECT pg_logical_emit_message(false, 'agentry-bench', $1::text)")
            .bind(i.to_string())
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT pg_switch_wal()")
            .execute(&mut *conn)
            .await
            .context("switching WAL segments (the bench needs a superuser connection)")?;
    }
    sqlx::query("CHECKPOINT").execute(&mut *conn).await?;
    let current: String = sqlx::query_scalar("SELECT pg_walfile_name(pg_current_wal_lsn())")
        .fetch_one(&mut *conn)
        .await?;
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM pg_ls_waldir() WHERE name ~ '^[0-9A-F]{24}$' AND name > $1",
    )
    .bind(current)
    .fetch_one(&mut *conn)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steal_sampler_stops_at_once_with_a_last_sample() {
        let started = Instant::now();
        let sampler = StealSampler::start(Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(20));
        let asked = crate::providers::mock::unix_micros();
        let samples = sampler.finish();
        // Not a minute: `finish` wakes the sampler from its wait.
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(
            samples.last().is_some_and(|s| s.at_us >= asked),
            "{samples:?}"
        );
        assert!(samples.windows(2).all(|w| w[0].at_us <= w[1].at_us));
    }

    #[test]
    fn stolen_time_is_counted_in_the_second_each_interval_ends_in() {
        let sample = |at_us, ms| StealSample {
            at_us,
            stolen: Duration::from_millis(ms),
        };
        let from = 10_000_000;
        let samples = [
            // Before the load: its interval ends before the first second, so not counted.
            sample(9_500_000, 100),
            sample(9_900_000, 130),
            // Second 0.
            sample(10_400_000, 150),
            sample(10_999_999, 160),
            // Second 2 (nothing in second 1), then past the last second asked for.
            sample(12_100_000, 200),
            sample(13_000_000, 260),
        ];
        assert_eq!(stolen_by_second(&samples, from, 3), vec![30.0, 0.0, 40.0]);
        assert_eq!(stolen_by_second(&samples[..1], from, 2), vec![0.0, 0.0]);
    }

    #[test]
    fn time_no_process_is_charged_with_is_shown_apart_from_other_processes() {
        let s = Duration::from_secs;
        let before = CpuReading::default();
        // 10 s of two cores: 16 s busy, of which 3 s stolen and 1 s in interrupts.
        let after = CpuReading {
            server: s(6),
            agents: s(2),
            postgres: s(3),
            bench: s(1),
            machine: MachineCpu {
                busy: s(16),
                total: s(20),
                interrupts: s(1),
                stolen: s(3),
            },
        };
        let shares = before.shares_until(&after);
        assert_eq!(
            (shares.busy, shares.server, shares.stolen, shares.interrupts),
            (80.0, 30.0, 15.0, 5.0)
        );
        assert_eq!(shares.other, 0.0);
        // Another process's second shows as other, and never below zero.
        let busier = CpuReading {
            machine: MachineCpu {
                busy: s(17),
                ..after.machine
            },
            ..after
        };
        assert_eq!(before.shares_until(&busier).other, 5.0);
        let idle_machine = CpuReading {
            machine: MachineCpu::default(),
            ..after
        };
        assert_eq!(before.shares_until(&idle_machine).other, 0.0);
    }
}
