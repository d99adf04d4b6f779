//! The database stalls under load: every process of the test cluster is stopped with
//! SIGSTOP for ten seconds while agents stream. Its own test binary, so its own cluster:
//! pausing it stalls no other test.
//!
//! What must hold: the writer's queue stays within its budget in events and bytes (the
//! agents are slowed instead), an API write during the pause answers 503
//! `store_unavailable` within the bounded wait, and once the cluster runs again every event
//! of every agent is committed, dense and in order, and every turn completes.
//!
//! And every other database call of a request has a deadline: with the cluster stopped,
//! a read and a write answer 503 `store_unavailable` within `statement_deadline_ms`, and
//! once it runs again the same requests succeed on a pool that kept no stuck connection.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use helpers::*;
use serde_json::{Value, json};

/// The postmaster (from `postmaster.pid` in the cluster's data dir) and its children.
fn cluster_processes(data_dir: &Path) -> Vec<i32> {
    let pid_file = std::fs::read_to_string(data_dir.join("postmaster.pid")).unwrap();
    let postmaster: i32 = pid_file.lines().next().unwrap().trim().parse().unwrap();
    let mut pids = vec![postmaster];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid: Option<i32> = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok());
        if ppid == Some(postmaster) {
            pids.push(pid);
        }
    }
    pids
}

/// Processes stopped with SIGSTOP; SIGCONT when dropped, whatever happens in between.
struct Paused(Vec<i32>);

impl Paused {
    fn stop(pids: Vec<i32>) -> Self {
        let paused = Paused(pids);
        for pid in &paused.0 {
            // SAFETY: kill(2) with a pid of the test's own database cluster.
            let rc = unsafe { libc::kill(*pid, libc::SIGSTOP) };
            assert_eq!(rc, 0, "SIGSTOP {pid}");
        }
        paused
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: as above.
            unsafe {
                libc::kill(*pid, libc::SIGCONT);
            }
        }
    }
}

/// Until `/readyz` answers 200 (at most 10 s).
async fn until_ready(app: &TestApp) {
    let asked = Instant::now();
    while app.get("/readyz").await.status() != 200 {
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "ready again after the database resumed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tests here stop the whole cluster: one at a time.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const AGENTS: usize = 4;
const CHUNKS: usize = 4000;
const MAX_EVENTS: usize = 2000;
const MAX_BYTES: usize = 200_000;

#[tokio::test]
async fn a_stopped_database_slows_agents_loses_nothing_and_recovers() {
    let _cluster = CLUSTER.lock().await;
    let app = spawn_app_with(|s| {
        s.events.queue_max_events = MAX_EVENTS;
        s.events.queue_max_bytes = MAX_BYTES;
        s.events.commit_wait_ms = 2000;
    })
    .await;
    let cluster = agentry::embedded_pg::test_cluster();
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    let probe = agents[0].clone();
    // The probe agent stays idle; the others stream.
    for a in &agents[1..] {
        app.prompt(a, &format!("/load {CHUNKS} 0")).await;
    }
    let start = app.writer.stats().committed_events;
    let flowing = Instant::now();
    while app.writer.stats().committed_events < start + 500 {
        assert!(
            flowing.elapsed() < Duration::from_secs(20),
            "events start flowing"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Sample the writer's queue all through the pause.
    let sampling = Arc::new(AtomicBool::new(true));
    let (max_events, max_bytes, saw_down) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let sampler = {
        let (writer, sampling) = (app.writer.clone(), sampling.clone());
        let (max_events, max_bytes, saw_down) =
            (max_events.clone(), max_bytes.clone(), saw_down.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                let s = writer.stats();
                max_events.fetch_max(s.queued_events, Ordering::Relaxed);
                max_bytes.fetch_max(s.queued_bytes, Ordering::Relaxed);
                if s.store_down {
                    saw_down.store(true, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    let pids = cluster_processes(cluster.data_dir());
    assert!(pids.len() > 2, "the postmaster and its children: {pids:?}");
    let paused = Paused::stop(pids);
    let paused_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let committed_while_paused = app.writer.stats().committed_events;

    // An API write while the database is stopped: a bounded wait, then 503.
    let asked = Instant::now();
    let res = reqwest::Client::new()
        .put(app.url(&format!("/v1/agents/{probe}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "default"}))
        .send()
        .await
        .unwrap();
    let answered_in = asked.elapsed();
    let problem = expect_status(res, 503).await;
    assert_eq!(problem["code"], "store_unavailable", "{problem}");
    assert!(
        answered_in < Duration::from_secs(8),
        "answered after {answered_in:?}"
    );

    let rest = Duration::from_secs(10).saturating_sub(paused_at.elapsed());
    tokio::time::sleep(rest).await;
    let during = app.writer.stats();
    assert_eq!(
        during.committed_events, committed_while_paused,
        "nothing commits while the database is stopped"
    );
    drop(paused);
    sampling.store(false, Ordering::Relaxed);
    sampler.await.unwrap();
    // Known down, requests answer 503 until the probe finds the database again.
    until_ready(&app).await;

    let (max_events, max_bytes) = (
        max_events.load(Ordering::Relaxed),
        max_bytes.load(Ordering::Relaxed),
    );
    eprintln!(
        "paused 10 s: queue peaked at {max_events} events / {max_bytes} bytes; API write answered 503 in {answered_in:?}"
    );
    assert!(
        saw_down.load(Ordering::Relaxed),
        "the writer noticed the stall"
    );
    // The queue filled up to its budget and no further: the agents waited.
    assert!(
        max_events as usize <= MAX_EVENTS && max_bytes as usize <= MAX_BYTES,
        "queued {max_events} events / {max_bytes} bytes; budget {MAX_EVENTS} / {MAX_BYTES}"
    );
    assert!(
        max_events as usize >= MAX_EVENTS / 2 || max_bytes as usize >= MAX_BYTES / 2,
        "the queue filled while the database was stopped: {max_events} events / {max_bytes} bytes"
    );

    // Back: everything accepted is committed, in order; every turn completes.
    for a in &agents[1..] {
        let w = app
            .get_ok(&format!("/v1/agents/{a}/wait?timeout_s=120"))
            .await;
        assert_eq!(w["timed_out"], false, "{w}");
        assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
        let events = app.timeline(a).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());
        let deltas: Vec<&str> = events
            .iter()
            .filter(|e| e["kind"] == "assistant_delta")
            .map(|e| e["data"]["text"].as_str().unwrap())
            .collect();
        assert_eq!(deltas.len(), CHUNKS, "every chunk of {a} committed");
        let message: &Value = events
            .iter()
            .find(|e| e["kind"] == "assistant_message")
            .expect("the closing message");
        assert_eq!(deltas.concat(), message["data"]["text"].as_str().unwrap());
        assert!(events.iter().any(|e| e["kind"] == "turn_completed"));
        assert!(events.iter().all(|e| e["kind"] != "error"), "no errors");
    }
    let after = app.writer.stats();
    assert!(!after.store_down, "the writer saw the store come back");
    assert_eq!(after.overdrafts, 0);
    assert_eq!(after.rejected_events, 0);
    assert!(after.high_water_events as usize <= MAX_EVENTS);
    assert!(after.high_water_bytes as usize <= MAX_BYTES);
    // The service answers writes again.
    let res = app
        .client
        .put(app.url(&format!("/v1/agents/{probe}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "default"}))
        .send()
        .await
        .unwrap();
    assert_ne!(res.status().as_u16(), 503);
    app.stop().await;
}

const DEADLINE_MS: u64 = 800;

#[tokio::test]
async fn requests_answer_503_within_the_statement_deadline_while_the_database_is_stopped() {
    let _cluster = CLUSTER.lock().await;
    let app = spawn_app_with(|s| s.database.statement_deadline_ms = DEADLINE_MS).await;
    let cluster = agentry::embedded_pg::test_cluster();
    let repo = git_repo();
    let other_repo = git_repo();
    app.project(repo.path()).await;
    let create_other = json!({"name": "other", "repo_path": other_repo.path()});

    let paused = Paused::stop(cluster_processes(cluster.data_dir()));
    let limit = Duration::from_millis(DEADLINE_MS) + Duration::from_millis(1500);
    for attempt in 0..3 {
        let asked = Instant::now();
        let read = app.get("/v1/projects").await;
        let read_in = asked.elapsed();
        let problem = expect_status(read, 503).await;
        assert_eq!(problem["code"], "store_unavailable", "{problem}");
        assert!(read_in < limit, "read {attempt} answered after {read_in:?}");

        let asked = Instant::now();
        let write = app.post("/v1/projects", create_other.clone()).await;
        let write_in = asked.elapsed();
        let problem = expect_status(write, 503).await;
        assert_eq!(problem["code"], "store_unavailable", "{problem}");
        assert!(
            write_in < limit,
            "write {attempt} answered after {write_in:?}"
        );
        eprintln!("stopped database: read answered 503 in {read_in:?}, write in {write_in:?}");
    }
    drop(paused);
    // Known down, the server answers 503 at once until its probe (every 0.5 s) finds the
    // database answering again.
    let resumed = Instant::now();
    until_ready(&app).await;
    eprintln!("resumed: ready again after {:?}", resumed.elapsed());

    // Back: the same requests succeed, more of them than the pool has connections, so a
    // connection left stuck in a stalled statement would show.
    let listed = app.get_ok("/v1/projects").await;
    assert_eq!(
        listed["items"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    app.post_ok("/v1/projects", create_other, 201).await;
    for _ in 0..40 {
        let listed = app.get_ok("/v1/projects").await;
        assert_eq!(
            listed["items"].as_array().map(Vec::len),
            Some(2),
            "{listed}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn a_statement_past_its_deadline_closes_its_connection_and_the_pool_serves_on() {
    let _cluster = CLUSTER.lock().await;
    let options = fresh_database().await;
    let pool = agentry::store::connect(options, 2).await.unwrap();
    let db = agentry::store::DeadlinePool::new(pool.clone(), Duration::from_millis(300));
    for _ in 0..4 {
        let asked = Instant::now();
        let err = sqlx::query("SELECT pg_sleep(10)")
            .execute(&db)
            .await
            .expect_err("past the deadline");
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "{:?}",
            asked.elapsed()
        );
        assert!(agentry::events::is_unavailable(&err), "{err:?}");
    }
    // Four stalled statements on a pool of two, still running on the server: a pool that
    // kept their connections would have none to give for the next 10 s.
    for _ in 0..10 {
        let asked = Instant::now();
        let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&db).await.unwrap();
        assert_eq!(one, 1);
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "{:?}",
            asked.elapsed()
        );
    }
    assert!(pool.size() <= 2);
}

#[tokio::test]
async fn a_query_stalled_behind_a_lock_answers_503_and_the_service_recovers() {
    let _cluster = CLUSTER.lock().await;
    let app = spawn_app_with(|s| s.database.statement_deadline_ms = DEADLINE_MS).await;
    let repo = git_repo();
    let other_repo = git_repo();
    app.project(repo.path()).await;

    // The token lookup still answers; the service's own queries wait on the lock.
    let mut lock = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE projects IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let limit = Duration::from_millis(DEADLINE_MS) + Duration::from_millis(1500);
    for _ in 0..3 {
        let asked = Instant::now();
        let problem = expect_status(app.get("/v1/projects").await, 503).await;
        assert_eq!(problem["code"], "store_unavailable", "{problem}");
        assert!(
            asked.elapsed() < limit,
            "read answered after {:?}",
            asked.elapsed()
        );
        let asked = Instant::now();
        let write = app
            .post(
                "/v1/projects",
                json!({"name": "other", "repo_path": other_repo.path()}),
            )
            .await;
        let problem = expect_status(write, 503).await;
        assert_eq!(problem["code"], "store_unavailable", "{problem}");
        assert!(
            asked.elapsed() < limit,
            "write answered after {:?}",
            asked.elapsed()
        );
    }
    lock.rollback().await.unwrap();

    for _ in 0..40 {
        let listed = app.get_ok("/v1/projects").await;
        assert_eq!(
            listed["items"].as_array().map(Vec::len),
            Some(1),
            "{listed}"
        );
    }
    app.post_ok(
        "/v1/projects",
        json!({"name": "other", "repo_path": other_repo.path()}),
        201,
    )
    .await;
    app.stop().await;
}

const STALLED_AGENTS: usize = 10;

/// Ten agents each in a turn of `/load 4000 1` (four seconds of events); the cluster is
/// stopped for ten seconds in the middle. Once it runs again, every turn ends completed,
/// with every event stored, dense and in order.
#[tokio::test]
async fn after_a_stall_every_running_turn_completes() {
    let _cluster = CLUSTER.lock().await;
    let app = spawn_app().await;
    let cluster = agentry::embedded_pg::test_cluster();
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..STALLED_AGENTS {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    for a in &agents {
        app.prompt(a, "/load 4000 1").await;
    }
    let start = app.writer.stats().committed_events;
    let flowing = Instant::now();
    while app.writer.stats().committed_events < start + 2000 {
        assert!(
            flowing.elapsed() < Duration::from_secs(20),
            "events start flowing"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let paused = Paused::stop(cluster_processes(cluster.data_dir()));
    tokio::time::sleep(Duration::from_secs(10)).await;
    drop(paused);
    let resumed = Instant::now();
    until_ready(&app).await;

    for a in &agents {
        let w = app
            .get_ok(&format!("/v1/agents/{a}/wait?timeout_s=45"))
            .await;
        assert_eq!(w["timed_out"], false, "{a} ended its turn: {w}");
        assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
        let events = app.timeline(a).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());
        let completed = events
            .iter()
            .filter(|e| e["kind"] == "turn_completed")
            .count();
        assert_eq!(completed, 1, "one turn_completed for {a}");
    }
    eprintln!(
        "stalled 10 s: every turn completed {:?} after the database resumed",
        resumed.elapsed()
    );
    app.stop().await;
}

/// Every connection of `pool` (open, idle, just used) ended by the database, as a restart
/// or `pg_terminate_backend` ends them; returns once their server processes are gone.
async fn end_every_connection(pool: &sqlx::PgPool, admin: &mut sqlx::PgConnection, size: u32) {
    let mut held = Vec::new();
    for _ in 0..size {
        held.push(pool.acquire().await.unwrap());
    }
    drop(held);
    let since = Instant::now();
    while pool.num_idle() < size as usize {
        assert!(since.elapsed() < Duration::from_secs(5), "back in the pool");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ended: Vec<(i32, bool)> = sqlx::query_as(
        "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut *admin)
    .await
    .unwrap();
    assert_eq!(ended.len(), size as usize, "{ended:?}");
    assert!(ended.iter().all(|(_, done)| *done), "{ended:?}");
    let pids: Vec<i32> = ended.into_iter().map(|(pid, _)| pid).collect();
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)")
                .bind(&pids)
                .fetch_one(&mut *admin)
                .await
                .unwrap();
        if left == 0 {
            break;
        }
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "{left} still run"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// After a database restart each pooled connection is found broken by the first statement
/// that uses it. A read that meets one is sent once more on a connection that answers, and
/// succeeds; a write is not sent again (it may have run) and answers `store_unavailable`.
#[tokio::test]
async fn a_read_on_a_connection_the_database_ended_is_sent_again_and_a_write_is_not() {
    use sqlx::Connection;
    const SIZE: u32 = 4;
    let _cluster = CLUSTER.lock().await;
    let options = fresh_database().await;
    // Never pinged before use: every ended connection reaches a statement.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(SIZE)
        .test_before_acquire(false)
        .connect_with(options.clone())
        .await
        .unwrap();
    let db = agentry::store::DeadlinePool::new(pool.clone(), Duration::from_secs(5));
    sqlx::query("CREATE TABLE written (n int)")
        .execute(&db)
        .await
        .unwrap();
    let mut admin = sqlx::PgConnection::connect_with(&options).await.unwrap();

    // One row (`fetch_one`), and every row (`fetch_all`).
    end_every_connection(&pool, &mut admin, SIZE).await;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM written")
        .fetch_one(&db)
        .await
        .expect("a read after the connections ended");
    assert_eq!(count, 0);
    end_every_connection(&pool, &mut admin, SIZE).await;
    let rows: Vec<i32> = sqlx::query_scalar("SELECT n FROM written")
        .fetch_all(&db)
        .await
        .expect("a read of many rows after the connections ended");
    assert!(rows.is_empty());

    end_every_connection(&pool, &mut admin, SIZE).await;
    let err = sqlx::query("INSERT INTO written VALUES (1)")
        .execute(&db)
        .await
        .expect_err("a write on an ended connection is not sent again");
    assert!(agentry::events::is_unavailable(&err), "{err:?}");
    let err = sqlx::query_scalar::<_, i32>("SELECT n FROM written FOR UPDATE")
        .fetch_all(&db)
        .await;
    assert!(
        err.as_ref().is_err_and(agentry::events::is_unavailable),
        "a locking read is not sent again either: {err:?}"
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM written")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(count, 0, "the write was not sent again");
    admin.close().await.unwrap();
    pool.close().await;
}
