//! Two `agentry serve` processes (the real binary) on one database, the owner of three
//! streaming agents paused with SIGSTOP past its lease: the other replica takes the agents
//! over and writes, then the first one resumes. What must hold: no seq a client has seen
//! (over SSE from either replica, or in the database) ever changes kind or content, the
//! paused replica's late batches are refused whole and counted on its own `/metrics`, and
//! it stops its agents' processes at once instead of writing on.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;
#[path = "support/serve.rs"]
#[allow(dead_code)]
mod serve;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use helpers::*;
use serde_json::{Value, json};
use serve::{Serve, Server};
use sqlx::PgPool;
use tokio::sync::watch;

const AGENTS: usize = 3;
const LEASE_TTL_S: u64 = 3;

/// One `agentry serve` process of the deployment, named `name`, on the database at
/// `database_url`.
fn replica(name: &str, database_url: &str) -> Server {
    Serve {
        name,
        database: &format!("url = \"{database_url}\"\nmax_connections = 10"),
        cluster: &format!("replica_id = \"{name}\"\nlease_ttl_s = {LEASE_TTL_S}"),
        ..Serve::default()
    }
    .start()
}

/// A client of one replica.
struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    fn of(replica: &Server, token: &str) -> Self {
        Client {
            base: replica.base.clone(),
            token: token.to_owned(),
            // No overall timeout: event streams stay open for the whole test.
            http: reqwest::Client::builder()
                .pool_idle_timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        }
    }

    async fn post(&self, path: &str, body: Value, status: u16) -> Value {
        let res = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(60))
            .json(&body)
            .send()
            .await
            .unwrap();
        expect_status(res, status).await
    }

    async fn get(&self, path: &str) -> Value {
        let res = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        expect_status(res, 200).await
    }

    async fn metric(&self, series: &str) -> f64 {
        let page = self
            .http
            .get(format!("{}/metrics", self.base))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        page.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    /// Read the agent's stream from its start into `seen` until `stop` says so.
    async fn follow(
        &self,
        agent: &str,
        seen: Arc<Mutex<Vec<SseEvent>>>,
        mut stop: watch::Receiver<bool>,
    ) {
        let res = self
            .http
            .get(format!("{}/v1/agents/{agent}/events", self.base))
            .bearer_auth(&self.token)
            .header("Last-Event-ID", "0")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let mut stream = SseReader::from_response(res);
        loop {
            tokio::select! {
                e = stream.next(Duration::from_secs(3600)) => match e {
                    Some(e) => seen.lock().unwrap().push(e),
                    None => return,
                },
                _ = stop.changed() => return,
            }
        }
    }
}

/// Every event of the agent's timeline, from the database: seq → (kind, data).
async fn stored(pool: &PgPool, agent: &str) -> BTreeMap<i64, (String, Value)> {
    let rows: Vec<(i64, String, Value)> = sqlx::query_as(
        "SELECT seq, kind, data FROM agent_events WHERE agent_id = $1::uuid ORDER BY seq",
    )
    .bind(agent.trim_start_matches("agt_"))
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter().map(|(s, k, d)| (s, (k, d))).collect()
}

/// Wait (at most `within`) until `f` holds, polling the database or a replica.
async fn until<F, Fut>(what: &str, within: Duration, mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let since = Instant::now();
    while !f().await {
        assert!(since.elapsed() < within, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    since.elapsed()
}

async fn turns_ended_by_takeover(pool: &PgPool, agent: &str) -> usize {
    stored(pool, agent)
        .await
        .values()
        .filter(|(k, d)| {
            k == "turn_completed" && d["error"].as_str().unwrap_or("").contains("owner_lost")
        })
        .count()
}

/// What a stream delivered is what the timeline holds now: from seq 1, each seq once, in
/// order, each with the kind and content stored at that seq.
fn stream_matches(seen: &[SseEvent], timeline: &BTreeMap<i64, (String, Value)>, who: &str) {
    assert!(!seen.is_empty(), "{who}: the stream delivered events");
    for (i, e) in seen.iter().enumerate() {
        assert_eq!(e.id, i as i64 + 1, "{who}: no gap, no duplicate");
        let (kind, data) = timeline
            .get(&e.id)
            .unwrap_or_else(|| panic!("{who}: seq {} is not in the timeline", e.id));
        assert_eq!(&e.event, kind, "{who}: seq {} changed kind", e.id);
        assert_eq!(&e.data["data"], data, "{who}: seq {} changed content", e.id);
    }
}

#[tokio::test]
async fn a_paused_owner_resumed_after_a_takeover_writes_nothing_and_stops_its_agents() {
    agentry::telemetry::install_crypto_provider();
    let db = fresh_database().await;
    let pool = PgPool::connect_with(db.clone()).await.unwrap();
    let url = database_url(&db);
    let a = replica("a", &url);
    let b = replica("b", &url);
    let token = a.token();
    let (ca, cb) = (Client::of(&a, &token), Client::of(&b, &token));

    // Three agents that replica `a` runs, streaming.
    let repo = git_repo();
    let project = ca
        .post(
            "/v1/projects",
            json!({"name": "pause", "repo_path": repo.path()}),
            201,
        )
        .await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        let ws = ca
            .post("/v1/workspaces", json!({"project_id": project["id"]}), 201)
            .await;
        let agent = ca
            .post(
                "/v1/agents",
                json!({"workspace_id": ws["id"], "provider": "mock",
                       "labels": {"agentry.replica": "a"}}),
                201,
            )
            .await;
        let id = agent["id"].as_str().unwrap().to_owned();
        ca.get(&format!("/v1/agents/{id}/wait?timeout_s=30")).await;
        agents.push(id);
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let seen_a = Arc::new(Mutex::new(Vec::new()));
    let seen_b = Arc::new(Mutex::new(Vec::new()));
    let readers = [
        tokio::spawn({
            let (c, s, r, id) = (
                Client::of(&a, &token),
                seen_a.clone(),
                stop_rx.clone(),
                agents[0].clone(),
            );
            async move { c.follow(&id, s, r).await }
        }),
        tokio::spawn({
            let (c, s, r, id) = (
                Client::of(&b, &token),
                seen_b.clone(),
                stop_rx.clone(),
                agents[0].clone(),
            );
            async move { c.follow(&id, s, r).await }
        }),
    ];
    for id in &agents {
        ca.post(
            &format!("/v1/agents/{id}/messages"),
            json!({"text": "/load 20000 2"}),
            202,
        )
        .await;
    }
    let mut pids = Vec::new();
    for id in &agents {
        let agent = ca.get(&format!("/v1/agents/{id}")).await;
        assert_eq!(agent["runtime"]["replica"], "a", "{agent}");
        pids.push(agent["runtime"]["pid"].as_i64().expect("a live process") as i32);
    }
    until("every agent streams", Duration::from_secs(30), || async {
        for id in &agents {
            if stored(&pool, id).await.len() < 200 {
                return false;
            }
        }
        true
    })
    .await;

    // Pause the owner past its lease, until the other replica has taken every agent over.
    a.signal(libc::SIGSTOP);
    let mut before_pause = Vec::new();
    for id in &agents {
        before_pause.push(stored(&pool, id).await);
    }
    let taken_in = until(
        "replica b takes every agent over",
        Duration::from_secs(30),
        || async {
            for id in &agents {
                if turns_ended_by_takeover(&pool, id).await == 0 {
                    return false;
                }
            }
            true
        },
    )
    .await;
    eprintln!("owner paused: every agent taken over after {taken_in:?} (lease {LEASE_TTL_S} s)");
    assert_eq!(
        cb.metric("agentry_lease_takeovers_total").await,
        AGENTS as f64
    );
    // The new owner writes: a turn of the first agent runs on `b` now.
    cb.post(
        &format!("/v1/agents/{}/messages", agents[0]),
        json!({"text": "/load 50 0"}),
        202,
    )
    .await;
    let waited = cb
        .get(&format!("/v1/agents/{}/wait?timeout_s=30", agents[0]))
        .await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let agent = cb.get(&format!("/v1/agents/{}", agents[0])).await;
    assert_eq!(agent["runtime"]["replica"], "b", "{agent}");
    let mut before_resume = Vec::new();
    for id in &agents {
        before_resume.push(stored(&pool, id).await);
    }

    // Resume the paused owner: its late batches are refused and counted, its agents'
    // processes stop at once.
    let resumed = Instant::now();
    a.signal(libc::SIGCONT);
    let fenced_in = until(
        "replica a refuses a late batch",
        Duration::from_secs(15),
        || async { ca.metric("agentry_fenced_batches_total").await >= 1.0 },
    )
    .await;
    until(
        "replica a stops its deposed agents",
        Duration::from_secs(5),
        || async { pids.iter().all(|p| !pid_alive(*p)) },
    )
    .await;
    let stopped_in = resumed.elapsed();
    eprintln!(
        "owner resumed: a late batch refused after {fenced_in:?}, its agents' processes gone after {stopped_in:?}"
    );

    // Replica `a` wrote nothing after the takeover, and everything seen is still there.
    let last = *before_resume[0].keys().last().unwrap();
    let streamed = until(
        "both streams reach the last event",
        Duration::from_secs(30),
        || async {
            [&seen_a, &seen_b]
                .iter()
                .all(|s| s.lock().unwrap().last().is_some_and(|e| e.id >= last))
        },
    )
    .await;
    eprintln!("both streams delivered the last event {streamed:?} after that");
    for (i, id) in agents.iter().enumerate() {
        let now = stored(&pool, id).await;
        assert_eq!(
            now, before_resume[i],
            "{id}: nothing written after the resume"
        );
        for (seq, event) in &before_pause[i] {
            assert_eq!(now.get(seq), Some(event), "{id}: seq {seq} changed");
        }
        let seqs: Vec<i64> = now.keys().copied().collect();
        assert_eq!(
            seqs,
            (1..=now.len() as i64).collect::<Vec<_>>(),
            "{id}: dense"
        );
        assert_eq!(
            turns_ended_by_takeover(&pool, id).await,
            1,
            "{id}: one takeover"
        );
        let status: String = sqlx::query_scalar("SELECT status FROM agents WHERE id = $1::uuid")
            .bind(id.trim_start_matches("agt_"))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_ne!(status, "running", "{id}");
    }
    let _ = stop_tx.send(true);
    for r in readers {
        r.await.unwrap();
    }
    let timeline = stored(&pool, &agents[0]).await;
    stream_matches(&seen_a.lock().unwrap(), &timeline, "stream from a");
    stream_matches(&seen_b.lock().unwrap(), &timeline, "stream from b");
    assert!(ca.metric("agentry_fenced_batches_total").await >= 1.0);
    assert_eq!(cb.metric("agentry_fenced_batches_total").await, 0.0);

    a.stop();
    b.stop();
    pool.close().await;
}
