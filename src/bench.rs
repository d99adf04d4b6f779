//! `agentry bench`: starts the server on its embedded default (a fresh data dir), opens
//! mock agents running `/load` and SSE subscribers against it over real HTTP, and reports
//! durable events per second delivered, emit→SSE latency percentiles and the server's
//! RSS, plus the same database's raw batched-insert rate for reference.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::config::Settings;
use crate::server::Application;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Mock agents running `/load` at once.
    #[arg(long, default_value_t = 50)]
    pub agents: usize,
    /// Events each agent emits.
    #[arg(long, default_value_t = 20000)]
    pub events: usize,
    /// Milliseconds between an agent's events (0 = as fast as it can).
    #[arg(long, default_value_t = 0)]
    pub interval_ms: u64,
    /// SSE subscribers per agent.
    #[arg(long, default_value_t = 1)]
    pub subscribers: usize,
    /// Instead of the throughput run: grow one agent's timeline to this many events with
    /// repeated `/load` turns (one SSE subscriber attached) and report RSS along the way.
    #[arg(long)]
    pub growth: Option<usize>,
    /// Rows for the raw batched-insert reference (0 to skip).
    #[arg(long, default_value_t = 200_000)]
    pub raw_rows: usize,
}

struct SubscriberResult {
    events: usize,
    latencies_us: Vec<u64>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile_dir()?;
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo)?;
    for a in [
        &["init", "-q", "-b", "main"][..],
        &[
            "-c",
            "user.name=b",
            "-c",
            "user.email=b@b",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "init",
        ],
    ] {
        let ok = std::process::Command::new("git")
            .args(a)
            .current_dir(&repo)
            .status()?
            .success();
        anyhow::ensure!(ok, "git {a:?} failed");
    }
    let mut settings = Settings {
        data_dir: dir.join("data"),
        listen: "127.0.0.1:0".into(),
        ..Default::default()
    };
    settings.database.max_connections = 20;
    let (pool, pg) = crate::server::open_database(&settings).await?;
    let cluster_dir = pg.as_ref().map(|p| p.cluster_dir.clone());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let app = Application::build_with(settings, pool.clone(), pg, listener).await?;
    let token = app
        .bootstrap_token()
        .context("fresh data dir has a bootstrap token")?
        .to_owned();
    let base = format!("http://127.0.0.1:{}", app.port());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async {
        let _ = stop_rx.await;
    }));
    let client = reqwest::Client::new();
    let post = |path: String, body: Value| {
        let req = client
            .post(format!("{base}{path}"))
            .bearer_auth(&token)
            .json(&body);
        async move {
            let res = req.send().await?;
            let status = res.status();
            let v: Value = res.json().await?;
            anyhow::ensure!(status.is_success(), "{status}: {v}");
            Ok::<_, anyhow::Error>(v)
        }
    };
    let project = post(
        "/v1/projects".into(),
        json!({"name": "bench", "repo_path": repo}),
    )
    .await?;
    let ws = post(
        "/v1/workspaces".into(),
        json!({"project_id": project["id"], "kind": "directory"}),
    )
    .await?;
    let mut agents = Vec::new();
    for _ in 0..args.agents {
        let a = post(
            "/v1/agents".into(),
            json!({"workspace_id": ws["id"], "provider": "mock"}),
        )
        .await?;
        agents.push(a["id"].as_str().context("agent id")?.to_owned());
    }
    for a in &agents {
        client
            .get(format!("{base}/v1/agents/{a}/wait?timeout_s=30"))
            .bearer_auth(&token)
            .send()
            .await?;
    }
    if let Some(target) = args.growth {
        grow(&client, &base, &token, &agents[0], target).await?;
        let _ = stop_tx.send(());
        server.await??;
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(c) = cluster_dir {
            let _ = std::fs::remove_dir_all(c);
        }
        return Ok(());
    }
    let rss_before = rss_kib();

    // Subscribers first, from the current end of each timeline.
    let mut subs = Vec::new();
    for a in &agents {
        let last: i64 = sqlx::query_scalar("SELECT last_seq FROM agents WHERE id = $1")
            .bind(uuid::Uuid::parse_str(&a[4..])?)
            .fetch_one(&pool)
            .await?;
        for _ in 0..args.subscribers {
            let res = client
                .get(format!("{base}/v1/agents/{a}/events"))
                .bearer_auth(&token)
                .header("Last-Event-ID", last.to_string())
                .send()
                .await?;
            subs.push(tokio::spawn(subscribe(res)));
        }
    }
    let started = Instant::now();
    for a in &agents {
        post(
            format!("/v1/agents/{a}/messages"),
            json!({"text": format!("/load {} {}", args.events, args.interval_ms)}),
        )
        .await?;
    }
    let mut total = 0usize;
    let mut lat = Vec::new();
    for s in subs {
        let r = s.await??;
        total += r.events;
        lat.extend(r.latencies_us);
    }
    let elapsed = started.elapsed();
    let rss_after = rss_kib();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let durable: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_events")
        .fetch_one(&pool)
        .await?;
    println!(
        "agents: {}  events/agent: {}  interval: {} ms  subscribers/agent: {}",
        args.agents, args.events, args.interval_ms, args.subscribers
    );
    println!(
        "delivered over SSE: {total} events in {:.2} s = {:.0} events/s",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    println!("durable events in the database: {durable}");
    println!(
        "emit→SSE latency: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        pct(0.50) as f64 / 1000.0,
        pct(0.99) as f64 / 1000.0,
        lat.last().copied().unwrap_or(0) as f64 / 1000.0
    );
    println!(
        "process RSS: {} MiB before, {} MiB after",
        rss_before / 1024,
        rss_after / 1024
    );

    if args.raw_rows > 0 {
        let rate = raw_insert_rate(&pool, args.raw_rows).await?;
        println!("raw batched insert (4096 rows per transaction, same database): {rate:.0} rows/s");
    }
    let _ = stop_tx.send(());
    server.await??;
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(c) = cluster_dir {
        let _ = std::fs::remove_dir_all(c);
    }
    Ok(())
}

/// Grow one timeline to `target` events in turns of 10,000, with a live subscriber, and
/// print the process RSS at each tenfold step.
async fn grow(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    agent: &str,
    target: usize,
) -> anyhow::Result<()> {
    let res = client
        .get(format!("{base}/v1/agents/{agent}/events"))
        .bearer_auth(token)
        .send()
        .await?;
    let reader = tokio::spawn(async move {
        let mut stream = res.bytes_stream();
        let mut bytes = 0usize;
        while let Some(Ok(chunk)) = stream.next().await {
            bytes += chunk.len();
        }
        bytes
    });
    let started = Instant::now();
    let mut events = 0usize;
    let mut next_report = 10_000usize;
    println!("{:>10}  {:>8}  {:>9}", "events", "RSS MiB", "seconds");
    while events < target {
        let res = client
            .post(format!("{base}/v1/agents/{agent}/messages"))
            .bearer_auth(token)
            .json(&json!({"text": "/load 10000 0"}))
            .send()
            .await?;
        anyhow::ensure!(res.status().is_success(), "prompt failed: {}", res.status());
        client
            .get(format!("{base}/v1/agents/{agent}/wait?timeout_s=600"))
            .bearer_auth(token)
            .send()
            .await?;
        events += 10_000;
        if events >= next_report {
            println!(
                "{events:>10}  {:>8}  {:>9.1}",
                rss_kib() / 1024,
                started.elapsed().as_secs_f64()
            );
            next_report = if next_report < 100_000 {
                next_report + 10_000
            } else {
                next_report + 100_000
            };
        }
    }
    reader.abort();
    Ok(())
}

/// Read one agent's stream until its turn completes.
async fn subscribe(res: reqwest::Response) -> anyhow::Result<SubscriberResult> {
    let mut stream = res.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut out = SubscriberResult {
        events: 0,
        latencies_us: Vec::new(),
    };
    let mut turn_started = false;
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(120), stream.next()).await? {
        buf.extend_from_slice(&chunk?);
        let now = Utc::now();
        let mut start = 0;
        while let Some(pos) = buf[start..].windows(2).position(|w| w == b"\n\n") {
            let block = &buf[start..start + pos];
            start += pos + 2;
            let Some(data) = block
                .split(|b| *b == b'\n')
                .find_map(|l| l.strip_prefix(b"data: "))
            else {
                continue;
            };
            let ev: Value = serde_json::from_slice(data)?;
            out.events += 1;
            if let Some(at) = ev["at"]
                .as_str()
                .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
            {
                let us = (now - at.with_timezone(&Utc))
                    .num_microseconds()
                    .unwrap_or(0)
                    .max(0) as u64;
                out.latencies_us.push(us);
            }
            match ev["kind"].as_str() {
                Some("turn_started") => turn_started = true,
                Some("turn_completed") if turn_started => return Ok(out),
                _ => {}
            }
        }
        buf.drain(..start);
    }
    anyhow::bail!("the stream ended before the turn completed")
}

async fn raw_insert_rate(pool: &sqlx::PgPool, rows: usize) -> anyhow::Result<f64> {
    let mut conn = pool.acquire().await?;
    sqlx::query("CREATE TEMP TABLE IF NOT EXISTS bench_raw (agent_id uuid, seq bigint, kind text, data jsonb)").execute(&mut *conn).await?;
    let agent = uuid::Uuid::now_v7();
    let started = Instant::now();
    let mut seq = 0i64;
    while (seq as usize) < rows {
        let n = 4096.min(rows - seq as usize);
        let seqs: Vec<i64> = (seq..seq + n as i64).collect();
        let ids = vec![agent; n];
        let kinds = vec!["assistant_delta"; n];
        let data: Vec<Value> = seqs
            .iter()
            .map(|s| json!({"message_id": "msg_x", "text": format!("{s} ")}))
            .collect();
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::query("INSERT INTO bench_raw SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::text[], $4::jsonb[])")
            .bind(&ids)
            .bind(&seqs)
            .bind(&kinds)
            .bind(&data)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        seq += n as i64;
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("agentry-bench-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir)?;
    // The embedded cluster runs as `postgres` when we are root: let it reach the data dir.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}
