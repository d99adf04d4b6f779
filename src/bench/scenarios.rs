//! The scenarios: each starts its own server, drives it, checks what it delivered, prints
//! its details and returns its figures for the final table.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::client::Api;
use super::server::{
    CpuReading, CpuShares, Memory, ServerProcess, StealSampler, agent_processes, process_pss_kib,
    stolen_by_second, tree_cpu,
};
use super::stream::{self, Subscription, Until};
use super::verify::{self, Seen};
use super::{BenchArgs, Figure, Percentiles, raw};

const MB: f64 = 1_000_000.0;

fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / MB
}

fn memory_line(m: &Memory) -> String {
    format!(
        "RSS {:.1} MB (anonymous {:.1} MB, file-backed {:.1} MB), peak {:.1} MB",
        mb(m.rss_kib),
        mb(m.anon_kib),
        mb(m.file_kib),
        mb(m.peak_rss_kib)
    )
}

fn thousands(n: f64) -> String {
    let s = format!("{:.0}", n);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

struct LoadPlan {
    agents: usize,
    events: u64,
    interval_ms: u64,
    subscribers: usize,
}

impl LoadPlan {
    fn from_args(args: &BenchArgs, agents: usize, events: u64, interval_ms: u64) -> Self {
        Self {
            agents: args.agents.unwrap_or(agents),
            events: args.events.unwrap_or(events),
            interval_ms: args.interval_ms.unwrap_or(interval_ms),
            subscribers: args.subscribers.unwrap_or(1).max(1),
        }
    }

    fn describe(&self) -> String {
        let pace = if self.interval_ms == 0 {
            "as fast as they can".to_owned()
        } else {
            format!(
                "one event every {} ms each ({} events/s offered)",
                self.interval_ms,
                thousands(self.offered_rate())
            )
        };
        format!(
            "{} agents × {} events, {pace}, {} SSE subscriber(s) per agent",
            self.agents,
            thousands(self.events as f64),
            self.subscribers
        )
    }

    fn offered_rate(&self) -> f64 {
        if self.interval_ms == 0 {
            f64::INFINITY
        } else {
            self.agents as f64 * 1000.0 / self.interval_ms as f64
        }
    }
}

struct LoadRun {
    elapsed: Duration,
    /// Events of the measured window, each counted once (all durable, checked).
    durable_events: u64,
    /// The same events counted once per subscriber that received them.
    deliveries: u64,
    latency: Option<Percentiles>,
    /// Only the events emitted after every prompt was accepted (all agents running).
    steady: Option<Percentiles>,
    /// p99 of the events emitted in each second of the load, from the first prompt: where
    /// in the run the slow events were.
    p99_by_second: Vec<f64>,
    /// The same, of the part before the server's writer took each event into a batch
    /// (emission→`at`): the rest is the commit and the way to the subscriber.
    p99_before_writer_by_second: Vec<f64>,
    /// CPU time the hypervisor took from the machine in each of those seconds (ms, all
    /// cores): a slow second with theft in it is the machine's, not the server's.
    stolen_by_second: Vec<f64>,
    /// When the first prompt was sent, to find the load's seconds in the server's and
    /// PostgreSQL's logs.
    started_at: chrono::DateTime<chrono::Utc>,
    /// From the first prompt sent to the last one accepted.
    prompts_accepted: Duration,
    prompts: usize,
    /// WAL segments PostgreSQL created (rather than reused) during the load.
    wal_created: i64,
    /// Where the machine's CPU went during the load.
    cpu: CpuShares,
    /// The server process's own CPU time over the load (its threads; not PostgreSQL,
    /// not the mock agents).
    server_cpu: Duration,
}

/// A second that lost this much CPU time to the hypervisor (all cores together) is
/// called out even when the load's whole share looks small: in run AK of
/// docs/benchmarks.md, the fanout misses with little steal overall each held seconds that
/// lost 170 ms or more.
const WORST_SECOND_WARNING_MS: f64 = 100.0;

impl LoadRun {
    /// What else used the machine during the load: the figures skew with it.
    fn machine_figures(&self, scenario: &'static str) -> [Figure; 3] {
        [
            Figure::info(
                scenario,
                "CPU used by other processes during the load",
                format!("{:.0} % of the machine", self.cpu.other),
            ),
            Figure::info(
                scenario,
                "CPU stolen by the hypervisor during the load",
                format!("{:.0} % of the machine", self.cpu.stolen),
            ),
            Figure::info(
                scenario,
                "CPU stolen by the hypervisor in its worst second",
                format!("{:.0} ms (all cores)", self.worst_stolen_second().1),
            ),
        ]
    }

    /// The second of the load the hypervisor took the most from, and how much (ms, all
    /// cores): a share over the whole load hides a theft packed into a few seconds.
    fn worst_stolen_second(&self) -> (usize, f64) {
        worst_second(&self.stolen_by_second)
    }

    fn durable_per_s(&self) -> f64 {
        self.durable_events as f64 / self.elapsed.as_secs_f64()
    }

    fn deliveries_per_s(&self) -> f64 {
        self.deliveries as f64 / self.elapsed.as_secs_f64()
    }

    fn server_cpu_per_delivery_us(&self) -> f64 {
        self.server_cpu.as_secs_f64() * 1e6 / self.deliveries.max(1) as f64
    }

    fn print(&self) {
        println!(
            "  durable events: {} in {:.2} s = {} events/s (each checked in the database)",
            thousands(self.durable_events as f64),
            self.elapsed.as_secs_f64(),
            thousands(self.durable_per_s())
        );
        println!(
            "  SSE deliveries: {} = {} deliveries/s",
            thousands(self.deliveries as f64),
            thousands(self.deliveries_per_s())
        );
        match &self.latency {
            Some(p) => println!("  emission→SSE: {}", p.line()),
            None => println!("  emission→SSE: no stamped event"),
        }
        println!(
            "  the {} prompts were accepted in {:.2} s",
            self.prompts,
            self.prompts_accepted.as_secs_f64()
        );
        if let Some(p) = &self.steady {
            println!("  emission→SSE once every agent runs: {}", p.line());
        }
        if !self.p99_by_second.is_empty() {
            println!(
                "  emission→SSE p99 in each second of the load (ms), from {}: {}",
                self.started_at.format("%H:%M:%S%.3f UTC"),
                whole_ms(&self.p99_by_second)
            );
            println!(
                "    of which before the writer took the event (emission→`at`, p99 per second): {}",
                whole_ms(&self.p99_before_writer_by_second)
            );
            println!(
                "  CPU time stolen by the hypervisor in each second of the load (ms, all cores): {}",
                whole_ms(&self.stolen_by_second)
            );
        }
        println!(
            "  WAL segments created during the load (not reused): {}",
            self.wal_created
        );
        println!("  {}", self.cpu);
        println!(
            "  server CPU: {:.2} s, {:.1} µs per delivery",
            self.server_cpu.as_secs_f64(),
            self.server_cpu_per_delivery_us()
        );
        if self.cpu.other > 10.0 {
            println!(
                "  WARNING: other processes used {:.0} % of the machine during this load; \
                 its figures do not represent this server alone",
                self.cpu.other
            );
        }
        if self.cpu.stolen > 2.0 {
            println!(
                "  WARNING: the hypervisor gave {:.0} % of this machine's time to other guests \
                 during this load; each theft stalls whatever ran, so latency figures suffer most",
                self.cpu.stolen
            );
        }
        let (second, ms) = self.worst_stolen_second();
        if self.cpu.stolen <= 2.0 && ms >= WORST_SECOND_WARNING_MS {
            println!(
                "  WARNING: the hypervisor took {ms:.0} ms of the machine's time in second {second} \
                 of this load; that second's latencies are the host's more than the server's"
            );
        }
    }
}

/// Open subscribers on every agent, send every agent `/load … stamp` at once, read until
/// every load turn completed, then check everything against the database.
async fn run_load(
    server: &ServerProcess,
    api: &Api,
    agents: &[String],
    plan: &LoadPlan,
) -> anyhow::Result<LoadRun> {
    // The window starts after what each timeline already holds.
    let from: Vec<anyhow::Result<(String, i64)>> = futures::stream::iter(agents)
        .map(|a| async move {
            let v = api.get_ok(&format!("/v1/agents/{a}")).await?;
            Ok((a.clone(), v["last_seq"].as_i64().context("last_seq")?))
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let from: HashMap<String, i64> = from.into_iter().collect::<anyhow::Result<_>>()?;
    // Every subscriber reads from seq 1, so it can show it saw 1..N.
    let opened: Vec<anyhow::Result<_>> = futures::stream::iter(
        agents
            .iter()
            .flat_map(|a| std::iter::repeat_n(a, plan.subscribers)),
    )
    .map(|a| async move {
        let s = api.stream(&format!("/v1/agents/{a}/events"), None).await?;
        Ok((a.clone(), s))
    })
    .buffer_unordered(64)
    .collect()
    .await;
    let mut readers = Vec::new();
    for o in opened {
        let (agent, s) = o?;
        let from_seq = from[&agent];
        readers.push(tokio::spawn(stream::read(
            s,
            agent,
            from_seq,
            Until::LoadTurn,
        )));
    }
    let wal_before = server.wal_files().await?;
    let cpu_before = CpuReading::take(server.pid());
    let steal = StealSampler::start(Duration::from_millis(100));
    let started = Instant::now();
    let started_at = chrono::Utc::now();
    let started_us = crate::providers::mock::unix_micros();
    api.prompt_all(
        agents,
        &format!("/load {} {} stamp", plan.events, plan.interval_ms),
    )
    .await?;
    let prompts_accepted = started.elapsed();
    let all_running_us = crate::providers::mock::unix_micros();
    let bound = Duration::from_millis(plan.events * plan.interval_ms) + Duration::from_secs(180);
    let mut subs: Vec<Subscription> = Vec::with_capacity(readers.len());
    let all = async {
        for r in readers {
            subs.push(r.await??);
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(bound, all)
        .await
        .map_err(|_| anyhow::anyhow!("the load did not complete within {bound:?}"))??;
    let cpu_after = CpuReading::take(server.pid());
    let steal = steal.finish();
    let wal_created = server.wal_files().await? - wal_before;
    let finished = subs.iter().map(|s| s.finished).max().unwrap_or(started);
    let mut seen: HashMap<String, Vec<Seen>> = HashMap::new();
    let mut durable_events = 0;
    let mut deliveries = 0;
    let mut latencies = Vec::new();
    let mut steady = Vec::new();
    let mut by_second: Vec<Vec<u32>> = Vec::new();
    let mut before_by_second: Vec<Vec<u32>> = Vec::new();
    let mut connections = Vec::with_capacity(subs.len());
    for s in subs {
        connections.push(s.connection);
        deliveries += s.window_events;
        let entry = seen.entry(s.agent).or_default();
        if entry.is_empty() {
            durable_events += s.window_events;
        }
        entry.push(s.seen);
        for (stamp, us, before_us) in s.latencies_us {
            latencies.push(us);
            let second = (stamp - started_us).max(0) as usize / 1_000_000;
            if by_second.len() <= second {
                by_second.resize_with(second + 1, Vec::new);
                before_by_second.resize_with(second + 1, Vec::new);
            }
            by_second[second].push(us);
            before_by_second[second].push(before_us);
            if stamp >= all_running_us {
                steady.push(us);
            }
        }
    }
    // The load is over and measured: only now do the subscribers hang up.
    drop(connections);
    verify::check_durable(&server.pool, &seen, Some(plan.events)).await?;
    Ok(LoadRun {
        elapsed: finished - started,
        durable_events,
        deliveries,
        latency: Percentiles::of(latencies),
        steady: Percentiles::of(steady),
        stolen_by_second: stolen_by_second(&steal, started_us, by_second.len()),
        p99_by_second: p99s(by_second),
        p99_before_writer_by_second: p99s(before_by_second),
        started_at,
        prompts_accepted,
        prompts: agents.len(),
        wal_created,
        cpu: cpu_before.shares_until(&cpu_after),
        server_cpu: cpu_after.server.saturating_sub(cpu_before.server),
    })
}

/// The first second with the largest value (counted from 0, as the per-second lines
/// are), and that value; `(0, 0.0)` for none.
fn worst_second(values: &[f64]) -> (usize, f64) {
    values.iter().copied().enumerate().fold(
        (0, 0.0),
        |worst, (i, v)| if v > worst.1 { (i, v) } else { worst },
    )
}

/// Milliseconds, whole, separated by spaces.
fn whole_ms(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.0}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The p99 of each group, 0 for an empty one.
fn p99s(groups: Vec<Vec<u32>>) -> Vec<f64> {
    groups
        .into_iter()
        .map(|v| Percentiles::of(v).map_or(0.0, |p| p.p99))
        .collect()
}

pub async fn throughput(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "throughput";
    let plan = LoadPlan::from_args(args, 50, 20_000, 0);
    println!("== throughput: {}", plan.describe());
    let server = ServerProcess::start(args).await?;
    let api = Api::new(&server.base, &server.token);
    let raw_before = raw::measure(&server.pool, args.raw_seconds).await?;
    print_raw("before", &raw_before);
    let ws = api.workspace(&server.repo).await?;
    let agents = api.open_agents(&ws, plan.agents, 16).await?;
    let before = server.memory();
    let run = run_load(&server, &api, &agents, &plan).await?;
    run.print();
    let pipeline_bytes: f64 = sqlx::query_scalar(
        "SELECT coalesce(avg(pg_column_size(data)), 0)::float8 FROM
         (SELECT data FROM agent_events WHERE kind = 'assistant_delta' LIMIT 10000) s",
    )
    .fetch_one(&server.pool)
    .await?;
    println!("  the pipeline's chunks: data {pipeline_bytes:.0} bytes/row");
    // Measured again after the load: the disk and CPU are shared, so the reference can
    // move during a run; the ratio is taken against the better of the two (the lower
    // ratio), and both are shown.
    let raw_after = raw::measure(&server.pool, args.raw_seconds).await?;
    print_raw("after", &raw_after);
    let raw_rate = raw_before.rows_per_s().max(raw_after.rows_per_s());
    let ratio = run.durable_per_s() / raw_rate;
    println!(
        "  durable events/s ÷ raw rows/s = {:.1} % (against {} rows/s)",
        ratio * 100.0,
        thousands(raw_rate)
    );
    let after = server.memory();
    println!("  server before: {}", memory_line(&before));
    println!("  server after:  {}", memory_line(&after));
    server.stop().await?;
    let mut figures = vec![
        Figure::info(
            S,
            "raw rows/s before / after the load",
            format!(
                "{} / {}",
                thousands(raw_before.rows_per_s()),
                thousands(raw_after.rows_per_s())
            ),
        ),
        Figure::info(
            S,
            format!("durable events/s ({} agents)", plan.agents),
            thousands(run.durable_per_s()),
        ),
        Figure::target(
            S,
            "durable events/s ÷ raw rows/s",
            format!("{:.1} %", ratio * 100.0),
            "≥ 33 %",
            ratio >= 0.33,
        ),
    ];
    if plan.subscribers > 1 {
        figures.push(Figure::info(
            S,
            format!("SSE deliveries/s ({} per agent)", plan.subscribers),
            thousands(run.deliveries_per_s()),
        ));
    }
    figures.push(Figure::info(
        S,
        "server CPU per SSE delivery",
        format!("{:.1} µs", run.server_cpu_per_delivery_us()),
    ));
    if let Some(p) = &run.latency {
        figures.push(Figure::info(
            S,
            "emission→SSE p99 at full load",
            format!("{:.1} ms", p.p99),
        ));
    }
    figures.push(Figure::info(
        S,
        "server peak RSS",
        format!("{:.1} MB", mb(after.peak_rss_kib)),
    ));
    figures.extend(run.machine_figures(S));
    Ok(figures)
}

fn print_raw(when: &str, raw: &raw::RawResult) {
    println!(
        "  raw reference {when} the load: {} rows/s — logged table LIKE agent_events, {} rows \
         per INSERT transaction, {} clients, {:.1} s, synchronous_commit={}, fsync={}, data \
         {:.0} bytes/row",
        thousands(raw.rows_per_s()),
        raw::BATCH_ROWS,
        raw::CLIENTS,
        raw.elapsed.as_secs_f64(),
        raw.synchronous_commit,
        raw.fsync,
        raw.data_bytes
    );
}

pub async fn latency(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "latency";
    let plan = LoadPlan::from_args(args, 20, 10_000, 1);
    println!("== latency: {}", plan.describe());
    let server = ServerProcess::start(args).await?;
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    let agents = api.open_agents(&ws, plan.agents, 16).await?;
    let run = run_load(&server, &api, &agents, &plan).await?;
    run.print();
    server.stop().await?;
    let rate = run.durable_per_s();
    let mut figures = vec![
        Figure::info(S, "durable events/s delivered", thousands(rate)),
        Figure::info(
            S,
            "server CPU per SSE delivery",
            format!("{:.1} µs", run.server_cpu_per_delivery_us()),
        ),
    ];
    if let Some(p) = &run.latency {
        figures.push(Figure::info(
            S,
            "emission→SSE p50 / p90",
            format!("{:.1} / {:.1} ms", p.p50, p.p90),
        ));
        figures.push(Figure::target(
            S,
            "emission→SSE p99",
            format!("{:.1} ms at {} events/s", p.p99, thousands(rate)),
            "≤ 25 ms at ≥ 19,000 events/s",
            p.p99 <= 25.0 && rate >= 19_000.0,
        ));
        figures.push(Figure::info(
            S,
            "emission→SSE max",
            format!("{:.1} ms", p.max),
        ));
    }
    figures.extend(run.machine_figures(S));
    Ok(figures)
}

pub async fn fanout(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "fanout";
    let plan = LoadPlan::from_args(args, 1000, 100, 100);
    println!("== fanout: {}", plan.describe());
    let server = ServerProcess::start(args).await?;
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    let opening = Instant::now();
    let agents = api.open_agents(&ws, plan.agents, 32).await?;
    let opened_in = opening.elapsed();
    let mocks = agent_processes(server.pid());
    let mock_pss: u64 = mocks.iter().map(|p| process_pss_kib(*p)).sum();
    println!(
        "  {} agents open in {:.1} s: {} processes for them (mock agents, sandboxes, bridges), \
         {:.0} MB PSS together",
        agents.len(),
        opened_in.as_secs_f64(),
        mocks.len(),
        mb(mock_pss)
    );
    let run = run_load(&server, &api, &agents, &plan).await?;
    run.print();
    let mem = server.memory();
    println!("  server: {}", memory_line(&mem));
    server.stop().await?;
    let mut figures = vec![
        Figure::info(
            S,
            format!("{} agents opened", agents.len()),
            format!("{:.1} s", opened_in.as_secs_f64()),
        ),
        Figure::info(
            S,
            "durable events/s delivered",
            thousands(run.durable_per_s()),
        ),
    ];
    if let Some(p) = &run.latency {
        figures.push(Figure::target(
            S,
            format!("emission→SSE p99, {} agents × 10/s", agents.len()),
            format!("{:.1} ms", p.p99),
            "≤ 50 ms with 1,000 agents",
            p.p99 <= 50.0 && agents.len() >= 1000 && plan.interval_ms <= 100,
        ));
    }
    if let Some(p) = &run.steady {
        figures.push(Figure::info(
            S,
            "emission→SSE p99 once all agents run",
            format!("{:.1} ms", p.p99),
        ));
    }
    figures.push(Figure::info(
        S,
        "server RSS with the agents open",
        format!("{:.1} MB", mb(mem.rss_kib)),
    ));
    figures.extend(run.machine_figures(S));
    Ok(figures)
}

pub async fn idle(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "idle";
    println!("== idle: the server process alone (not PostgreSQL, not the mock agents)");
    let server = ServerProcess::start(args).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let fresh = server.memory();
    println!("  just started: {}", memory_line(&fresh));
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    let agents = api.open_agents(&ws, 1, 1).await?;
    let id = &agents[0];
    api.post_ok(
        &format!("/v1/agents/{id}/messages"),
        &json!({"text": "hello"}),
    )
    .await?;
    let w = api
        .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=60"))
        .await?;
    anyhow::ensure!(
        w["last_turn"]["outcome"] == "completed",
        "the warm-up turn did not complete: {w}"
    );
    api.get_ok(&format!("/v1/agents/{id}/timeline")).await?;
    api.get_ok("/v1/agents").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let warm = server.memory();
    println!(
        "  one agent open and idle after a turn: {}",
        memory_line(&warm)
    );
    server.stop().await?;
    let rss = mb(warm.rss_kib);
    Ok(vec![
        Figure::info(
            S,
            "server RSS just started",
            format!("{:.1} MB", mb(fresh.rss_kib)),
        ),
        Figure::target(
            S,
            "server RSS idle (one agent open, after a turn)",
            format!("{rss:.1} MB"),
            "≤ 50 MB",
            rss <= 50.0,
        ),
    ])
}

pub async fn create(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "create";
    let n = args.agents.unwrap_or(200);
    println!("== create: {n} × POST /v1/agents with a first prompt, all at once, one workspace");
    let server = ServerProcess::start(args).await?;
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    // The team stream says when each agent's session started (status leaves `starting`)
    // and when its first turn ended (back to `idle` after `running`).
    let mut team = api
        .stream(&format!("/v1/events?workspace_id={ws}"), None)
        .await?;
    let (status_tx, mut status_rx) = tokio::sync::mpsc::unbounded_channel();
    let watcher = tokio::spawn(async move {
        while let Some(frames) = team.next_chunk(Duration::from_secs(120)).await? {
            let at = Instant::now();
            for f in frames {
                let v: Value = serde_json::from_slice(&f)?;
                if v["kind"] == "agent_status"
                    && let (Some(a), Some(s)) =
                        (v["data"]["agent_id"].as_str(), v["data"]["status"].as_str())
                    && status_tx.send((a.to_owned(), s.to_owned(), at)).is_err()
                {
                    return anyhow::Ok(());
                }
            }
        }
        anyhow::Ok(())
    });
    let body = json!({"workspace_id": ws, "provider": "mock", "prompt": "hello"});
    let tree_cpu0 = tree_cpu(server.pid());
    let machine0 = super::server::machine_cpu();
    let started = Instant::now();
    let answers = futures::future::join_all((0..n).map(|_| async {
        let r = api.post("/v1/agents", &body).await;
        (r, Instant::now())
    }))
    .await;
    let mut ids = Vec::with_capacity(n);
    let mut all_created = started;
    for (r, at) in answers {
        let (status, v) = r?;
        anyhow::ensure!(status == 201, "POST /v1/agents answered {status}: {v}");
        ids.push(v["id"].as_str().context("agent id")?.to_owned());
        all_created = all_created.max(at);
    }
    let mut started_at: HashMap<String, Instant> = HashMap::new();
    let mut running: HashMap<String, bool> = HashMap::new();
    let mut turn_done: HashMap<String, Instant> = HashMap::new();
    let wanted: std::collections::HashSet<&String> = ids.iter().collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while turn_done.len() < n {
        let (agent, status, at) = tokio::time::timeout_at(deadline, status_rx.recv())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "after 120 s, {} of {n} sessions had started and {} first turns ended",
                    started_at.len(),
                    turn_done.len()
                )
            })?
            .context("the team stream ended")?;
        if !wanted.contains(&agent) {
            continue;
        }
        match status.as_str() {
            "starting" => {}
            "error" | "closed" => anyhow::bail!("agent {agent} went `{status}`"),
            s => {
                started_at.entry(agent.clone()).or_insert(at);
                if s == "running" {
                    running.insert(agent.clone(), true);
                } else if s == "idle" && running.get(&agent).copied().unwrap_or(false) {
                    turn_done.entry(agent).or_insert(at);
                }
            }
        }
    }
    watcher.abort();
    let tree_cpu_used = tree_cpu(server.pid()).saturating_sub(tree_cpu0);
    let machine1 = super::server::machine_cpu();
    let all_started = started_at.values().max().copied().unwrap_or(started);
    let all_turns = turn_done.values().max().copied().unwrap_or(started);
    // Every first prompt was answered: its turn completed.
    let outcomes: Vec<anyhow::Result<Value>> = futures::stream::iter(&ids)
        .map(|a| {
            let api = &api;
            async move {
                api.get_ok(&format!("/v1/agents/{a}/wait?timeout_s=60"))
                    .await
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    for w in outcomes {
        let w = w?;
        anyhow::ensure!(
            w["last_turn"]["outcome"] == "completed",
            "a first turn did not complete: {w}"
        );
    }
    let secs = |t: Instant| (t - started).as_secs_f64();
    println!("  all {n} answered 201 after {:.2} s", secs(all_created));
    println!(
        "  all {n} sessions started after {:.2} s",
        secs(all_started)
    );
    println!(
        "  all {n} first turns completed after {:.2} s",
        secs(all_turns)
    );
    let stolen = machine1
        .stolen
        .saturating_sub(machine0.stolen)
        .as_secs_f64();
    let total = machine1.total.saturating_sub(machine0.total).as_secs_f64();
    println!(
        "  CPU until then: the server and its processes {:.2} s ({:.1} ms per agent); the \
         machine busy {:.2} s of {:.2} s, stolen {:.1} %",
        tree_cpu_used.as_secs_f64(),
        tree_cpu_used.as_secs_f64() * 1000.0 / n.max(1) as f64,
        machine1.busy.saturating_sub(machine0.busy).as_secs_f64(),
        total,
        100.0 * stolen / total.max(1e-9)
    );
    let mem = server.memory();
    println!("  server: {}", memory_line(&mem));
    server.stop().await?;
    Ok(vec![
        Figure::target(
            S,
            format!("{n} agents: all 201s"),
            format!("{:.2} s", secs(all_created)),
            "≤ 2 s (200 agents)",
            secs(all_created) <= 2.0 && n >= 200,
        ),
        Figure::target(
            S,
            format!("{n} agents: all sessions started"),
            format!("{:.2} s", secs(all_started)),
            "≤ 2 s (200 agents)",
            secs(all_started) <= 2.0 && n >= 200,
        ),
        Figure::info(
            S,
            format!("{n} agents: all first turns completed"),
            format!("{:.2} s", secs(all_turns)),
        ),
    ])
}

/// The sandbox's added start latency: `n` mock agents created one after another (no
/// prompt, so nothing else runs meanwhile), each timed from its `POST /v1/agents` to its
/// session started (its status leaving `starting` on the team stream), on a server with
/// `sandbox.mode = "off"` and then on one with `"enforce"`, in the same run.
pub async fn sandbox(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "sandbox";
    let n = args.agents.unwrap_or(50);
    println!("== sandbox: {n} mock agents started one by one, sandbox off then on");
    let mut figures = Vec::new();
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    let mut cpus = Vec::new();
    for (label, mode) in [("off", "off"), ("on", "enforce")] {
        let server = ServerProcess::start_with(args, &[("AGENTRY_SANDBOX__MODE", mode)]).await?;
        let api = Api::new(&server.base, &server.token);
        let providers = api.get_ok("/v1/providers").await?;
        let confined =
            providers["sandbox"]["mode"] == "enforce" && providers["sandbox"]["available"] == true;
        anyhow::ensure!(
            confined == (mode == "enforce"),
            "the server's sandbox is not {label}: {}",
            providers["sandbox"]
        );
        let ws = api.workspace(&server.repo).await?;
        let mut team = api
            .stream(&format!("/v1/events?workspace_id={ws}"), None)
            .await?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let watcher = tokio::spawn(async move {
            while let Some(frames) = team.next_chunk(Duration::from_secs(60)).await? {
                let at = Instant::now();
                for f in frames {
                    let v: Value = serde_json::from_slice(&f)?;
                    if v["kind"] == "agent_status"
                        && v["data"]["status"] != "starting"
                        && let Some(a) = v["data"]["agent_id"].as_str()
                        && tx.send((a.to_owned(), at)).is_err()
                    {
                        return anyhow::Ok(());
                    }
                }
            }
            anyhow::Ok(())
        });
        let body = json!({"workspace_id": ws, "provider": "mock"});
        let tree_cpu0 = tree_cpu(server.pid());
        let mut samples_us = Vec::with_capacity(n);
        let mut seen: HashMap<String, Instant> = HashMap::new();
        for _ in 0..n {
            let t0 = Instant::now();
            let (status, v) = api.post("/v1/agents", &body).await?;
            anyhow::ensure!(status == 201, "POST /v1/agents answered {status}: {v}");
            let id = v["id"].as_str().context("agent id")?.to_owned();
            let at = loop {
                if let Some(at) = seen.get(&id) {
                    break *at;
                }
                let (agent, at) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
                    .await
                    .context("no session started within 30 s")?
                    .context("the team stream ended")?;
                seen.entry(agent).or_insert(at);
            };
            samples_us.push((at - t0).as_micros().min(u32::MAX as u128) as u32);
        }
        watcher.abort();
        let cpu_ms = tree_cpu(server.pid())
            .saturating_sub(tree_cpu0)
            .as_secs_f64()
            * 1000.0
            / n.max(1) as f64;
        server.stop().await?;
        let p = Percentiles::of(samples_us).context("no sample")?;
        println!(
            "  sandbox {label}: start {}; CPU of the server and its processes {cpu_ms:.1} ms per start",
            p.line()
        );
        cpus.push(cpu_ms);
        p50s.push(p.p50);
        p99s.push(p.p99);
        figures.push(Figure::info(
            S,
            format!("agent start, sandbox {label} (p50 / p99)"),
            format!("{:.1} / {:.1} ms", p.p50, p.p99),
        ));
    }
    figures.push(Figure::info(
        S,
        "added by the sandbox (p50 / p99)",
        format!("{:+.1} / {:+.1} ms", p50s[1] - p50s[0], p99s[1] - p99s[0]),
    ));
    figures.push(Figure::info(
        S,
        "CPU added by the sandbox per start (server and its processes)",
        format!("{:+.1} ms", cpus[1] - cpus[0]),
    ));
    Ok(figures)
}

pub async fn growth(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "growth";
    const TURN: u64 = 10_000;
    let target = args.events.unwrap_or(1_000_000).max(TURN);
    println!(
        "== growth: one timeline grown to {} events in turns of /load {TURN} 0, one live subscriber",
        thousands(target as f64)
    );
    let server = ServerProcess::start(args).await?;
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    let agents = api.open_agents(&ws, 1, 1).await?;
    let agent = agents[0].clone();
    let (end_tx, end_rx) = watch::channel(i64::MAX);
    let s = api
        .stream(&format!("/v1/agents/{agent}/events"), None)
        .await?;
    let reader = tokio::spawn(stream::read(s, agent.clone(), 0, Until::Seq(end_rx)));
    let started = Instant::now();
    let mut chunks = 0u64;
    let mut next_report = TURN;
    let mut samples: Vec<(u64, Memory)> = Vec::new();
    println!("  {:>10}  {:>8}  {:>8}", "events", "RSS MB", "seconds");
    while chunks < target {
        api.post_ok(
            &format!("/v1/agents/{agent}/messages"),
            &json!({"text": format!("/load {TURN} 0")}),
        )
        .await?;
        let w = api
            .get_ok(&format!("/v1/agents/{agent}/wait?timeout_s=120"))
            .await?;
        anyhow::ensure!(
            w["last_turn"]["outcome"] == "completed",
            "a load turn did not complete: {w}"
        );
        chunks += TURN;
        if chunks >= next_report {
            let m = server.memory();
            println!(
                "  {:>10}  {:>8.1}  {:>8.1}",
                thousands(chunks as f64),
                mb(m.rss_kib),
                started.elapsed().as_secs_f64()
            );
            samples.push((chunks, m));
            next_report = if next_report < 100_000 {
                next_report + TURN
            } else {
                next_report + 100_000
            };
        }
    }
    let last_seq = api.get_ok(&format!("/v1/agents/{agent}")).await?["last_seq"]
        .as_i64()
        .context("last_seq")?;
    let _ = end_tx.send(last_seq);
    let sub = tokio::time::timeout(Duration::from_secs(120), reader)
        .await
        .context("the subscriber did not catch up within 120 s")???;
    let seen = HashMap::from([(agent.clone(), vec![sub.seen])]);
    let stored = verify::check_durable(&server.pool, &seen, Some(chunks)).await?;
    println!(
        "  the subscriber saw seq 1..{last_seq} in order; the database holds {} events",
        thousands(stored as f64)
    );
    let end = server.memory();
    println!("  server at the end: {}", memory_line(&end));
    server.stop().await?;
    let first = samples.first().map_or(0.0, |(_, m)| mb(m.rss_kib));
    let max = samples
        .iter()
        .map(|(_, m)| mb(m.rss_kib))
        .fold(0.0, f64::max);
    Ok(vec![
        Figure::info(
            S,
            format!("server RSS at {} events", thousands(TURN as f64)),
            format!("{first:.1} MB"),
        ),
        Figure::info(
            S,
            format!("server RSS at {} events", thousands(chunks as f64)),
            format!("{:.1} MB (highest sample {max:.1} MB)", mb(end.rss_kib)),
        ),
    ])
}

pub async fn mcp(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "mcp";
    let n = args.events.unwrap_or(2000) as usize;
    println!(
        "== mcp: {n} × the timeline page of one agent, alternately GET /v1/agents/{{id}}/timeline \
         and the tool get_timeline over /mcp, one request at a time"
    );
    let server = ServerProcess::start(args).await?;
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    let agents = api.open_agents(&ws, 1, 1).await?;
    let id = &agents[0];
    api.post_ok(
        &format!("/v1/agents/{id}/messages"),
        &json!({"text": "/load 40 0"}),
    )
    .await?;
    let w = api
        .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=60"))
        .await?;
    anyhow::ensure!(
        w["last_turn"]["outcome"] == "completed",
        "the turn did not complete: {w}"
    );
    let session = api.mcp_session().await?;
    let path = format!("/v1/agents/{id}/timeline?limit=20");
    let arguments = json!({"agent_id": id, "limit": 20});
    // Warm both paths (connections, caches), then alternate so that both see the same
    // machine.
    for _ in 0..50 {
        api.get_ok(&path).await?;
        api.mcp_call(&session, "get_timeline", &arguments).await?;
    }
    let (mut rest, mut tool) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        let page = api.get_ok(&path).await?;
        rest.push(t.elapsed().as_micros() as u32);
        let t = Instant::now();
        let result = api.mcp_call(&session, "get_timeline", &arguments).await?;
        tool.push(t.elapsed().as_micros() as u32);
        anyhow::ensure!(
            result["structuredContent"]["items"] == page["items"],
            "the tool's page differs from the route's"
        );
    }
    server.stop().await?;
    let rest = Percentiles::of(rest).context("no samples")?;
    let tool = Percentiles::of(tool).context("no samples")?;
    println!("  GET /v1/agents/{{id}}/timeline: {}", rest.line());
    println!("  tools/call get_timeline:       {}", tool.line());
    let added = tool.p50 - rest.p50;
    Ok(vec![
        Figure::info(S, "REST timeline page p50", format!("{:.2} ms", rest.p50)),
        Figure::info(S, "MCP get_timeline p50", format!("{:.2} ms", tool.p50)),
        Figure::target(
            S,
            "added by the tool call, p50",
            format!("{added:.2} ms"),
            "< 2 ms",
            added < 2.0,
        ),
    ])
}

/// One round of the `ledger` scenario: `agents` mock agents, each running `turns` turns of
/// `/spend 100 100 <steps> 0` (a `usage` event per step) one after another, all agents at
/// once; with the ledger on, the team has a budget and each agent caps, so every `usage`
/// event is metered and every turn's end written to the ledger.
struct LedgerRound {
    events: u64,
    seconds: f64,
    /// The server process's own CPU time over the load (its writer and handlers; not
    /// PostgreSQL, not the mock agents), which other load on the machine barely moves.
    server_cpu: Duration,
    stolen_share: f64,
    /// The instructions the server executed over the load (`--callgrind`).
    instructions: Option<u64>,
    /// What PostgreSQL did for the server's database over the load.
    pg: PgWork,
}

/// PostgreSQL's counters for one database (`pg_stat_database`), or their difference over a
/// load: work counted in statements and rows, whatever the machine's load.
#[derive(Debug, Clone, Copy, Default)]
struct PgWork {
    commits: i64,
    rows_written: i64,
    rows_read: i64,
    buffers: i64,
}

impl PgWork {
    /// Read once every backend has reported: one reports what it did when it goes idle, at
    /// most once a second, and within 10 s of its last report.
    async fn read(pool: &sqlx::PgPool) -> anyhow::Result<Self> {
        tokio::time::sleep(Duration::from_secs(11)).await;
        let (commits, rows_written, rows_read, buffers): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted, tup_fetched,
                    blks_hit + blks_read
               FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(pool)
        .await?;
        Ok(Self {
            commits,
            rows_written,
            rows_read,
            buffers,
        })
    }

    fn since(self, before: Self) -> Self {
        Self {
            commits: self.commits - before.commits,
            rows_written: self.rows_written - before.rows_written,
            rows_read: self.rows_read - before.rows_read,
            buffers: self.buffers - before.buffers,
        }
    }

    /// Per 1,000 events.
    fn line(self, events: u64) -> String {
        let k = events.max(1) as f64 / 1000.0;
        format!(
            "{:.1} commits, {:.0} rows written, {:.0} rows read, {:.0} buffers per 1,000 events",
            self.commits as f64 / k,
            self.rows_written as f64 / k,
            self.rows_read as f64 / k,
            self.buffers as f64 / k
        )
    }
}

async fn ledger_round(
    args: &BenchArgs,
    on: bool,
    agents: usize,
    turns: usize,
    steps: u64,
) -> anyhow::Result<LedgerRound> {
    let ledger = if on { "true" } else { "false" };
    let server = ServerProcess::start_with(args, &[("AGENTRY_USAGE__LEDGER", ledger)]).await?;
    let api = Api::new(&server.base, &server.token);
    let ws = api.workspace(&server.repo).await?;
    let mut body = json!({"workspace_id": ws, "provider": "mock"});
    if on {
        let me = api.get_ok("/v1/me").await?;
        let team = me["default_team_id"].as_str().context("a default team")?;
        api.put_ok(
            &format!("/v1/teams/{team}/budget"),
            &json!({"period": "month", "max_cost_usd": 1.0e9, "max_tokens": 1_000_000_000_000u64}),
        )
        .await?;
        body["budget"] = json!({"max_cost_usd": 1.0e9, "max_turns": 1_000_000});
    }
    let created: Vec<anyhow::Result<String>> = futures::stream::iter(0..agents)
        .map(|_| async {
            let a = api.post_ok("/v1/agents", &body).await?;
            let id = a["id"].as_str().context("agent id")?.to_owned();
            let w = api
                .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=120"))
                .await?;
            anyhow::ensure!(w["status"] == "idle", "agent {id} did not start: {w}");
            Ok(id)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let ids: Vec<String> = created.into_iter().collect::<anyhow::Result<_>>()?;
    let last_seqs = |ids: &[String]| {
        let api = &api;
        let ids = ids.to_vec();
        async move {
            let mut sum = 0u64;
            for id in &ids {
                let a = api.get_ok(&format!("/v1/agents/{id}")).await?;
                sum += a["last_seq"].as_u64().unwrap_or(0);
            }
            anyhow::Ok(sum)
        }
    };
    let before = last_seqs(&ids).await?;
    let pg0 = PgWork::read(&server.pool).await?;
    if args.callgrind {
        server.zero_instructions()?;
    }
    let cpu0 = super::server::machine_cpu();
    let server_cpu0 = super::server::process_cpu(server.pid());
    let started = Instant::now();
    let text = format!("/spend 100 100 {steps} 0");
    let runs: Vec<anyhow::Result<()>> = futures::stream::iter(&ids)
        .map(|id| {
            let (api, text) = (&api, &text);
            async move {
                for _ in 0..turns {
                    api.post_ok(&format!("/v1/agents/{id}/messages"), &json!({"text": text}))
                        .await?;
                    let w = api
                        .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=300"))
                        .await?;
                    anyhow::ensure!(
                        w["last_turn"]["outcome"] == "completed",
                        "a turn of {id} did not complete: {w}"
                    );
                }
                Ok(())
            }
        })
        .buffer_unordered(agents.max(1))
        .collect()
        .await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu1 = super::server::machine_cpu();
    let server_cpu = super::server::process_cpu(server.pid()).saturating_sub(server_cpu0);
    let instructions = match args.callgrind {
        true => Some(server.instructions()?),
        false => None,
    };
    for r in runs {
        r?;
    }
    let after = last_seqs(&ids).await?;
    let pg = PgWork::read(&server.pool).await?.since(pg0);
    if on {
        let usage = api.get_ok("/v1/usage").await?;
        let recorded = usage["totals"]["turns"].as_u64().unwrap_or(0);
        anyhow::ensure!(
            recorded == (agents * turns) as u64,
            "the ledger holds {recorded} turns, not {}",
            agents * turns
        );
    }
    server.stop().await?;
    let total = (cpu1.total - cpu0.total).as_secs_f64();
    let stolen_share = if total > 0.0 {
        (cpu1.stolen - cpu0.stolen).as_secs_f64() / total
    } else {
        0.0
    };
    Ok(LedgerRound {
        events: after - before,
        seconds,
        server_cpu,
        stolen_share,
        instructions,
        pg,
    })
}

/// What the usage ledger and budgets add to event writes: the same turns, full of `usage`
/// events, on a server with `usage.ledger` off and on one with it on (and budgets set),
/// in alternating rounds of one run.
pub async fn ledger(args: &BenchArgs) -> anyhow::Result<Vec<Figure>> {
    const S: &str = "ledger";
    const ROUNDS: usize = 2;
    const TURNS: usize = 5;
    let agents = args.agents.unwrap_or(20);
    let steps = args.events.unwrap_or(500).max(1);
    println!(
        "== ledger: {agents} agents × {TURNS} turns of /spend 100 100 {steps} 0, ledger off then on, {ROUNDS} rounds"
    );
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut costs: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut instructions: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut figures = Vec::new();
    for round in 1..=ROUNDS {
        for (i, on) in [false, true].into_iter().enumerate() {
            let r = ledger_round(args, on, agents, TURNS, steps).await?;
            let rate = r.events as f64 / r.seconds;
            let cpu_us = r.server_cpu.as_secs_f64() * 1e6 / r.events.max(1) as f64;
            let label = if on { "on" } else { "off" };
            println!(
                "  round {round}, ledger {label}: {} events in {:.2} s = {} events/s; server CPU {:.1} µs per event (stolen {:.1} %)",
                thousands(r.events as f64),
                r.seconds,
                thousands(rate),
                cpu_us,
                r.stolen_share * 100.0
            );
            figures.push(Figure::info(
                S,
                format!("round {round}, ledger {label}: server CPU per event; events/s (stolen)"),
                format!(
                    "{cpu_us:.1} µs; {} ({:.1} %)",
                    thousands(rate),
                    r.stolen_share * 100.0
                ),
            ));
            println!("    PostgreSQL: {}", r.pg.line(r.events));
            figures.push(Figure::info(
                S,
                format!("round {round}, ledger {label}: PostgreSQL"),
                r.pg.line(r.events),
            ));
            if let Some(n) = r.instructions {
                let per_event = n as f64 / r.events.max(1) as f64;
                println!(
                    "    server instructions (callgrind): {} = {} per event",
                    thousands(n as f64),
                    thousands(per_event)
                );
                figures.push(Figure::info(
                    S,
                    format!("round {round}, ledger {label}: server instructions per event"),
                    thousands(per_event),
                ));
                instructions[i].push(per_event);
            }
            rates[i].push(rate);
            costs[i].push(cpu_us);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (off, on) = (mean(&costs[0]), mean(&costs[1]));
    figures.push(Figure::info(
        S,
        "ledger on against off: server CPU per event (mean)",
        format!("{:+.1} %", (on - off) / off * 100.0),
    ));
    if args.callgrind {
        let (off, on) = (mean(&instructions[0]), mean(&instructions[1]));
        figures.push(Figure::info(
            S,
            "ledger on against off: server instructions per event (mean)",
            format!(
                "{} against {} ({:+.1} %)",
                thousands(on),
                thousands(off),
                (on - off) / off * 100.0
            ),
        ));
    }
    let (off, on) = (mean(&rates[0]), mean(&rates[1]));
    figures.push(Figure::info(
        S,
        "ledger on against off: events/s (mean)",
        format!("{:+.1} %", (on - off) / off * 100.0),
    ));
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_second_is_the_first_with_the_most() {
        assert_eq!(worst_second(&[0.0, 10.0, 190.0, 40.0, 190.0]), (2, 190.0));
        assert_eq!(worst_second(&[0.0, 0.0]), (0, 0.0));
        assert_eq!(worst_second(&[]), (0, 0.0));
    }
}
