//! `agentry bench`: runs `agentry serve` as a child process on a fresh data dir (its
//! embedded PostgreSQL, fsync on), drives it over real HTTP the way dashboards and CI bots
//! do — mock agents running `/load`, SSE subscribers — checks that everything delivered is
//! durable, gapless and in order, and prints each scenario's figures against its target.
//! docs/benchmarks.md explains every figure.

mod client;
mod raw;
mod scenarios;
mod server;
mod stream;
mod verify;

use std::fmt::Write as _;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// 50 agents streaming as fast as they can, against the raw insert rate.
    Throughput,
    /// 20 agents × 1,000 events/s: emission→SSE latency at 20,000 events/s.
    Latency,
    /// The server's own memory, idle.
    Idle,
    /// 200 agents created with a first prompt, all at once.
    Create,
    /// 1,000 open agents at 10 events/s each.
    Fanout,
    /// One timeline grown to 1,000,000 events: does memory stay flat?
    Growth,
    /// What a `/mcp` tool call adds over the same `/v1` request.
    Mcp,
    /// What the sandbox adds to an agent's start: the same mock agents started one by one
    /// on a server with the sandbox off, then on one with it on.
    Sandbox,
    /// What the usage ledger adds to event writes: the same turns full of `usage` events
    /// with `usage.ledger` off, then on (budgets set), in alternating rounds.
    Ledger,
    /// Every scenario above, each on its own fresh server.
    All,
}

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The scenario to run.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    pub scenario: Scenario,
    /// Mock agents (default: the scenario's own). Not with `all`.
    #[arg(long)]
    pub agents: Option<usize>,
    /// Events each agent emits; for `growth`, the timeline length to reach; for `ledger`,
    /// the steps (`usage` events) of each turn. Not with `all`.
    #[arg(long)]
    pub events: Option<u64>,
    /// Milliseconds between an agent's events, 0 = as fast as it can. Not with `all`.
    #[arg(long)]
    pub interval_ms: Option<u64>,
    /// SSE subscribers per agent. Not with `all`.
    #[arg(long)]
    pub subscribers: Option<usize>,
    /// Seconds of the raw insert reference (throughput).
    #[arg(long, default_value_t = 5)]
    pub raw_seconds: u64,
    /// Keep each run's directory and server log.
    #[arg(long)]
    pub keep: bool,
    /// Seconds of rest before each scenario after the first (with `all`).
    #[arg(long, default_value_t = 20)]
    pub rest_s: u64,
    /// `limits.max_running_turns` of the server under test: `off` (the default: no limit,
    /// so no turn start takes the queue's lock), `host` (the server's own default, from
    /// this host's CPUs and memory) or a number (a number above the load's turns takes
    /// the lock on every turn start without queueing any).
    #[arg(long, default_value = "off", value_parser = parse_turn_limit)]
    pub turn_limit: TurnLimit,
}

/// The running-turn limit a bench server runs with (`--turn-limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnLimit {
    Off,
    Host,
    At(u32),
}

fn parse_turn_limit(s: &str) -> Result<TurnLimit, String> {
    match s {
        "off" | "0" => Ok(TurnLimit::Off),
        "host" => Ok(TurnLimit::Host),
        n => n
            .parse::<u32>()
            .map(TurnLimit::At)
            .map_err(|_| format!("`{n}`: expected off, host or a number")),
    }
}

/// One line of the final table.
pub struct Figure {
    scenario: &'static str,
    name: String,
    value: String,
    target: Option<String>,
    met: Option<bool>,
}

impl Figure {
    fn info(scenario: &'static str, name: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            scenario,
            name: name.into(),
            value: value.into(),
            target: None,
            met: None,
        }
    }

    fn target(
        scenario: &'static str,
        name: impl Into<String>,
        value: impl Into<String>,
        target: impl Into<String>,
        met: bool,
    ) -> Self {
        Self {
            scenario,
            name: name.into(),
            value: value.into(),
            target: Some(target.into()),
            met: Some(met),
        }
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.scenario == Scenario::All {
        let overridden = [
            args.agents.is_some(),
            args.events.is_some(),
            args.interval_ms.is_some(),
            args.subscribers.is_some(),
        ];
        anyhow::ensure!(
            !overridden.contains(&true),
            "--agents, --events, --interval-ms and --subscribers apply to one scenario; \
             pick it with --scenario"
        );
    }
    raise_open_files_limit()?;
    println!("{}", machine());
    let scenarios = match args.scenario {
        Scenario::All => vec![
            Scenario::Idle,
            Scenario::Create,
            Scenario::Throughput,
            Scenario::Latency,
            Scenario::Fanout,
            Scenario::Growth,
            Scenario::Mcp,
            Scenario::Sandbox,
            Scenario::Ledger,
        ],
        one => vec![one],
    };
    let mut figures = Vec::new();
    for (i, s) in scenarios.into_iter().enumerate() {
        // A load carries over into the next one on a shared virtual machine: fanout run
        // right after the throughput and latency loads came out worse in every full run
        // than alone after a rest. Each scenario starts rested.
        if i > 0 && args.rest_s > 0 {
            println!("(resting {} s)", args.rest_s);
            tokio::time::sleep(std::time::Duration::from_secs(args.rest_s)).await;
        }
        println!("{}", cpu_probe().await);
        let started = std::time::Instant::now();
        let mut found = match s {
            Scenario::Throughput => scenarios::throughput(&args).await,
            Scenario::Latency => scenarios::latency(&args).await,
            Scenario::Idle => scenarios::idle(&args).await,
            Scenario::Create => scenarios::create(&args).await,
            Scenario::Fanout => scenarios::fanout(&args).await,
            Scenario::Growth => scenarios::growth(&args).await,
            Scenario::Mcp => scenarios::mcp(&args).await,
            Scenario::Sandbox => scenarios::sandbox(&args).await,
            Scenario::Ledger => scenarios::ledger(&args).await,
            Scenario::All => unreachable!("expanded above"),
        }?;
        println!("({s:?} took {:.0} s)\n", started.elapsed().as_secs_f64());
        figures.append(&mut found);
    }
    println!("{}", cpu_probe().await);
    println!("{}", table(&figures));
    Ok(())
}

/// Time a fixed single-core computation. A shared virtual machine's speed moves (its
/// neighbours, its host), and the same build's figures move with it, so each scenario is
/// preceded by this probe, and the run ends with one.
async fn cpu_probe() -> String {
    const ROUNDS: u64 = 150_000_000;
    let took = tokio::task::spawn_blocking(|| {
        let started = std::time::Instant::now();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..ROUNDS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x = std::hint::black_box(x);
        }
        std::hint::black_box(x);
        started.elapsed()
    })
    .await
    .unwrap_or_default();
    format!(
        "CPU probe: {:.0} ms for a fixed single-core computation (lower is faster; compare \
         runs only at similar probes)",
        took.as_secs_f64() * 1000.0
    )
}

fn table(figures: &[Figure]) -> String {
    let rows: Vec<[String; 5]> = figures
        .iter()
        .map(|f| {
            [
                f.scenario.to_owned(),
                f.name.clone(),
                f.value.clone(),
                f.target.clone().unwrap_or_else(|| "—".into()),
                match f.met {
                    Some(true) => "yes".into(),
                    Some(false) => "NO".into(),
                    None => "".into(),
                },
            ]
        })
        .collect();
    let header = ["scenario", "figure", "value", "target", "met"];
    let mut widths = header.map(|h| h.chars().count());
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[String]| {
        for (i, c) in cells.iter().enumerate() {
            let pad = widths[i] - c.chars().count();
            let _ = write!(out, "{c}{}  ", " ".repeat(pad));
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    };
    line(&mut out, &header.map(String::from));
    line(&mut out, &widths.map(|w| "-".repeat(w)));
    for r in &rows {
        line(&mut out, r);
    }
    out
}

/// The bench opens a connection per subscriber and the server three pipes per agent:
/// lift the soft open-files limit to the hard one (the server inherits it).
fn raise_open_files_limit() -> anyhow::Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
        }
    }
    Ok(())
}

/// The machine, as docs/benchmarks.md records it.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown", |(_, m)| m.trim())
        .to_owned();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "machine: {cpus} CPUs ({model}), {:.1} GiB RAM; load average {}; {}",
        mem_kib as f64 / 1024.0 / 1024.0,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
    )
}

/// Percentiles of latencies in microseconds.
pub struct Percentiles {
    pub count: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// In milliseconds; `None` when there is no sample.
    pub fn of(mut samples_us: Vec<u32>) -> Option<Self> {
        if samples_us.is_empty() {
            return None;
        }
        samples_us.sort_unstable();
        let n = samples_us.len();
        // Nearest rank: the smallest sample with at least p of them at or below it.
        let at = |p: f64| {
            let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
            samples_us[rank - 1] as f64 / 1000.0
        };
        Some(Self {
            count: n,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: samples_us[n - 1] as f64 / 1000.0,
        })
    }

    pub fn line(&self) -> String {
        format!(
            "p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} samples)",
            self.p50, self.p90, self.p99, self.max, self.count
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_limits_parse() {
        assert_eq!(parse_turn_limit("off"), Ok(TurnLimit::Off));
        assert_eq!(parse_turn_limit("0"), Ok(TurnLimit::Off));
        assert_eq!(parse_turn_limit("host"), Ok(TurnLimit::Host));
        assert_eq!(parse_turn_limit("1000"), Ok(TurnLimit::At(1000)));
        assert!(parse_turn_limit("-1").is_err());
        assert!(parse_turn_limit("many").is_err());
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let p = Percentiles::of((1..=100).map(|ms| ms * 1000).collect()).unwrap();
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        let one = Percentiles::of(vec![2500]).unwrap();
        assert_eq!((one.p50, one.p99, one.max), (2.5, 2.5, 2.5));
        assert!(Percentiles::of(Vec::new()).is_none());
    }
}
