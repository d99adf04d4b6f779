//! Several replicas on one database: streams, commands and permission answers work
//! whichever replica the client reaches; a replica that dies has its agents taken over
//! (the interrupted turn fails with `owner_lost`, the next prompt resumes, no seq twice);
//! a stopping replica drains its running turns first.

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use agentry::config::Settings;
use serde_json::{Value, json};

use crate::helpers::*;

const TTL: u64 = 3;

fn short_lease(s: &mut Settings) {
    s.cluster.lease_ttl_s = TTL;
}

fn draining(s: &mut Settings) {
    short_lease(s);
    s.cluster.drain_timeout_s = 15;
}

/// Two replicas on one fresh database, each with its own data dir.
async fn replicas(tweak: fn(&mut Settings)) -> (TestApp, TestApp) {
    let a = spawn_app_with(tweak).await;
    let b = spawn_on_with(
        a.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(a.token.clone()),
        tweak,
    )
    .await;
    (a, b)
}

async fn replica_of(app: &TestApp, agent: &str) -> String {
    let a = app.get_ok(&format!("/v1/agents/{agent}")).await;
    a["runtime"]["replica"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Seqs 1..=n, each once.
fn assert_dense(events: &[Value]) {
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    let want: Vec<i64> = (1..=seqs.len() as i64).collect();
    assert_eq!(seqs, want, "seqs are dense and unique");
}

#[tokio::test]
async fn two_replicas_serve_one_agent_whichever_the_client_reaches() {
    let (a, b) = replicas(short_lease).await;
    let repo = git_repo();
    let (id, ws) = a.mock_agent(repo.path()).await;
    let owner = replica_of(&a, &id).await;
    assert!(!owner.is_empty());
    assert_eq!(
        replica_of(&b, &id).await,
        owner,
        "both replicas name the owner"
    );

    // Both replicas are listed, the owner with its agent.
    let cluster = b.get_ok("/v1/cluster").await;
    let items = cluster["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{cluster}");
    let mine = items.iter().find(|r| r["id"] == owner.as_str()).unwrap();
    assert_eq!(mine["agents"], 1);
    assert_eq!(mine["advertise_url"], a.base.as_str());
    let theirs = items.iter().find(|r| r["id"] != owner.as_str()).unwrap();
    assert_eq!(theirs["agents"], 0);

    // A stream on the replica that does not run the agent; the prompt sent there too.
    let mut stream = b.events(&id, None).await;
    let mut team = b
        .client
        .get(b.url("/v1/events"))
        .bearer_auth(&b.token)
        .send()
        .await
        .unwrap();
    assert_eq!(team.status(), 200);
    b.prompt(&id, "hello from the other replica").await;
    let seen = stream
        .until("turn_completed", Duration::from_secs(30))
        .await;
    assert_eq!(
        seen.last().unwrap().data["data"]["outcome"],
        "completed",
        "{:?}",
        seen.last()
    );
    assert!(
        seen.iter().any(|e| e.event == "assistant_delta"),
        "streamed text arrived live"
    );

    // A permission raised on the owner, answered through the other replica.
    b.prompt(&id, "/ask deploy to production?").await;
    let asked = stream
        .until("permission_requested", Duration::from_secs(30))
        .await;
    let request = asked.last().unwrap().data["data"]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let res = b
        .post(
            &format!("/v1/agents/{id}/permissions/{request}"),
            json!({"behavior": "allow"}),
        )
        .await;
    expect_status(res, 200).await;
    let rest = stream
        .until("turn_completed", Duration::from_secs(30))
        .await;
    assert_eq!(rest.last().unwrap().data["data"]["outcome"], "completed");
    // `wait` through the other replica waits on the owner.
    let waited = b.wait(&id).await;
    assert_eq!(waited["status"], "idle");

    // What the other replica streamed is the timeline: in order, nothing twice, no gap.
    let streamed: Vec<i64> = seen
        .iter()
        .chain(&asked)
        .chain(&rest)
        .map(|e| e.id)
        .collect();
    let timeline = a.timeline(&id).await;
    assert_dense(&timeline);
    let want: Vec<i64> = (1..=*streamed.last().unwrap()).collect();
    assert_eq!(streamed, want);

    // The team stream of the other replica heard the agent's status changes.
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !text.contains("agent_status") && tokio::time::Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, team.chunk()).await {
            Ok(Ok(Some(c))) => text.push_str(&String::from_utf8_lossy(&c)),
            _ => break,
        }
    }
    assert!(text.contains("agent_status"), "{text}");
    assert!(text.contains(&id), "{text}");

    // The other replica never started the agent.
    assert_eq!(replica_of(&b, &id).await, owner);

    // New agents go to the replica running fewer, or where a label pins them.
    let other = theirs["id"].as_str().unwrap().to_owned();
    let create = |labels: Value| json!({"workspace_id": ws, "provider": "mock", "labels": labels});
    let placed = a.post_ok("/v1/agents", create(json!({})), 201).await;
    assert_eq!(placed["runtime"]["replica"], other.as_str(), "{placed}");
    let pinned = b
        .post_ok("/v1/agents", create(json!({"agentry.replica": owner})), 201)
        .await;
    assert_eq!(pinned["runtime"]["replica"], owner.as_str(), "{pinned}");
    let res = b
        .post("/v1/agents", create(json!({"agentry.replica": "nowhere"})))
        .await;
    let problem = expect_status(res, 422).await;
    assert_eq!(problem["code"], "validation_failed");
    assert!(
        problem["detail"].as_str().unwrap().contains("nowhere"),
        "{problem}"
    );
    b.stop().await;
    a.stop().await;
}

/// `agentry serve` as a separate process on `app`'s database.
struct Replica {
    child: tokio::process::Child,
    base: String,
    _dir: tempfile::TempDir,
}

async fn serve_beside(app: &TestApp, id: &str) -> Replica {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = env!("CARGO_BIN_EXE_agentry");
    let config = dir.path().join("agentry.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n[cluster]\nreplica_id = \"{id}\"\nlease_ttl_s = {TTL}\n[providers.mock]\ncommand = [\"{exe}\"]\n",
            dir.path().join("data").display()
        ),
    )
    .unwrap();
    let child = tokio::process::Command::new(exe)
        .args(["serve", "--config"])
        .arg(&config)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap())
        .env("HOME", dir.path())
        .env("DATABASE_URL", database_url(&app.db))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let ready = format!("{base}/readyz");
    let client = app.client.clone();
    for _ in 0..300 {
        if let Ok(r) = client.get(&ready).send().await
            && r.status() == 200
        {
            return Replica {
                child,
                base,
                _dir: dir,
            };
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the second replica did not become ready");
}

async fn call(app: &TestApp, method: reqwest::Method, url: &str, body: Value) -> Value {
    let res = app
        .client
        .request(method, url)
        .bearer_auth(&app.token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let text = res.text().await.unwrap();
    assert!(status < 300, "{url}: {status} {text}");
    serde_json::from_str(&text).unwrap()
}

#[tokio::test]
async fn a_replica_that_dies_has_its_agents_taken_over() {
    let survivor = spawn_app_with(short_lease).await;
    let mut doomed = serve_beside(&survivor, "doomed").await;
    let repo = git_repo();
    let project = survivor.project(repo.path()).await;
    let post = reqwest::Method::POST;
    let ws = call(
        &survivor,
        post.clone(),
        &format!("{}/v1/workspaces", doomed.base),
        json!({"project_id": project["id"]}),
    )
    .await;
    let agent = call(
        &survivor,
        post.clone(),
        &format!("{}/v1/agents", doomed.base),
        json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "first words"}),
    )
    .await;
    let id = agent["id"].as_str().unwrap().to_owned();
    let waited = call(
        &survivor,
        reqwest::Method::GET,
        &format!("{}/v1/agents/{id}/wait?timeout_s=30", doomed.base),
        Value::Null,
    )
    .await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    // A long turn, then the replica running it dies without a word.
    let turn = call(
        &survivor,
        post,
        &format!("{}/v1/agents/{id}/messages", doomed.base),
        json!({"text": "/sleep 600000"}),
    )
    .await;
    let agent = survivor.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["runtime"]["replica"], "doomed");
    assert_eq!(agent["status"], "running");
    let there = call(
        &survivor,
        reqwest::Method::GET,
        &format!("{}/v1/agents/{id}", doomed.base),
        Value::Null,
    )
    .await;
    let pid = there["runtime"]["pid"]
        .as_i64()
        .expect("the provider process") as i32;
    assert!(pid_alive(pid));
    let mut stream = survivor.events(&id, None).await;
    doomed.child.start_kill().unwrap();
    doomed.child.wait().await.unwrap();

    // Within the lease time and 10 s, the survivor takes the agent over.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(TTL + 10);
    let done = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let seen = stream.until("turn_completed", left).await;
        let last = seen.last().unwrap().data["data"].clone();
        if last["turn_id"] == turn["turn_id"] {
            break last;
        }
    };
    assert_eq!(done["outcome"], "failed");
    assert!(
        done["error"].as_str().unwrap().contains("owner_lost"),
        "{done}"
    );
    let closed = stream.until("status", Duration::from_secs(10)).await;
    assert_eq!(closed.last().unwrap().data["data"]["status"], "closed");
    let agent = survivor.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["status"], "closed");
    assert_eq!(agent["runtime"]["replica"], Value::Null);
    // The dead replica's agent process on this host was ended too.
    eventually(
        "the dead replica's process is gone",
        Duration::from_secs(10),
        || !pid_alive(pid),
    )
    .await;
    assert_one_takeover(&survivor).await;

    // The next prompt resumes the agent here; no seq was written twice.
    survivor.prompt(&id, "are you back?").await;
    let waited = survivor.wait(&id).await;
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    assert_eq!(
        replica_of(&survivor, &id).await,
        survivor.get_ok("/v1/cluster").await["items"][0]["id"]
            .as_str()
            .unwrap()
    );
    let timeline = survivor.timeline(&id).await;
    assert_dense(&timeline);
    let turns: HashSet<&str> = timeline
        .iter()
        .filter(|e| e["kind"] == "turn_completed")
        .map(|e| e["turn_id"].as_str().unwrap())
        .collect();
    assert_eq!(turns.len(), 3, "each turn ended once");
    // The dead replica is forgotten once nothing refers to it.
    eventually_async(&survivor, |c: Value| {
        c["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["id"] != "doomed")
    })
    .await;
    survivor.stop().await;
}

async fn eventually_async(app: &TestApp, ok: impl Fn(Value) -> bool) {
    for _ in 0..100 {
        if ok(app.get_ok("/v1/cluster").await) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "the cluster never got there: {}",
        app.get_ok("/v1/cluster").await
    );
}

#[tokio::test]
async fn a_stopping_replica_lets_its_running_turn_end_first() {
    let (a, b) = replicas(draining).await;
    let repo = git_repo();
    let (id, _) = a.mock_agent(repo.path()).await;
    a.prompt(&id, "/sleep 1500").await;
    let stopped = tokio::spawn(a.stop());
    // Meanwhile the other replica answers for the agent, and the turn ends well.
    let mut stream = b.events(&id, None).await;
    let seen = stream
        .until("turn_completed", Duration::from_secs(30))
        .await;
    assert_eq!(seen.last().unwrap().data["data"]["outcome"], "completed");
    // (Its data dir stays: worktrees live on storage every replica reaches.)
    let (_db, _data_dir, _) = stopped.await.unwrap();
    // Its lease was given up: the next prompt runs the agent on the remaining replica.
    b.prompt(&id, "over here now").await;
    assert_eq!(b.wait(&id).await["last_turn"]["outcome"], "completed");
    let timeline = b.timeline(&id).await;
    assert_dense(&timeline);
    b.stop().await;
}

#[tokio::test]
async fn a_stream_on_another_replica_survives_its_listening_connection_being_cut() {
    let (a, b) = replicas(short_lease).await;
    let repo = git_repo();
    let (id, _) = a.mock_agent(repo.path()).await;
    let mut stream = b.events(&id, None).await;
    a.prompt(&id, "/load 200 5").await;
    let first = stream.next(Duration::from_secs(30)).await.unwrap();
    // Cut every connection listening for replica notices, mid-turn.
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
          WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_one(&a.pool)
    .await
    .unwrap();
    assert!(cut >= 1, "a listening connection was found");
    let mut seen = vec![first];
    seen.extend(
        stream
            .until("turn_completed", Duration::from_secs(30))
            .await,
    );
    // Everything arrived, in order, once.
    let ids: Vec<i64> = seen.iter().map(|e| e.id).collect();
    let want: Vec<i64> = (1..=*ids.last().unwrap()).collect();
    assert_eq!(ids, want);
    let deltas = seen.iter().filter(|e| e.event == "assistant_delta").count();
    assert!(deltas >= 200, "{deltas} chunks streamed");
    b.stop().await;
    a.stop().await;
}

/// One client's view of the live replicas: it sends each request to one of them and, when
/// that one is stopping or gone, to another.
#[derive(Clone)]
struct Bases(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Bases {
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn set(&self, bases: Vec<String>) {
        *self.0.lock().unwrap() = bases;
    }
}

/// Send `make(base)` to the live replicas in turn until one answers 2xx; 503s and
/// connection errors move on to the next.
async fn on_any(
    bases: &Bases,
    client: &reqwest::Client,
    token: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> Value {
    for attempt in 0..400 {
        let all = bases.all();
        let base = &all[attempt % all.len()];
        let mut req = client
            .request(method.clone(), format!("{base}{path}"))
            .bearer_auth(token);
        if let Some(b) = &body {
            req = req.json(b);
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => return r.json().await.unwrap(),
            Ok(r) if r.status() == 503 || r.status() == 409 => {}
            Ok(r) => {
                let status = r.status();
                panic!("{method} {path}: {status} {}", r.text().await.unwrap());
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{method} {path}: no replica took it");
}

#[tokio::test]
async fn a_rolling_restart_of_both_replicas_under_load_loses_nothing() {
    let tweak = draining;
    let (a, b) = replicas(tweak).await;
    let token = a.token.clone();
    let client = a.client.clone();
    let bases = Bases(std::sync::Arc::new(std::sync::Mutex::new(vec![
        a.base.clone(),
        b.base.clone(),
    ])));
    let repo = git_repo();
    let (first, ws) = a.mock_agent(repo.path()).await;
    let mut agents = vec![first];
    for _ in 0..3 {
        let agent = on_any(
            &bases,
            &client,
            &token,
            reqwest::Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws, "provider": "mock"})),
        )
        .await;
        agents.push(agent["id"].as_str().unwrap().to_owned());
    }

    // Load: each agent takes turn after turn, through whichever replica answers.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut drivers = Vec::new();
    for id in agents.clone() {
        let (bases, client, token, stop) =
            (bases.clone(), client.clone(), token.clone(), stop.clone());
        drivers.push(tokio::spawn(async move {
            let mut turns = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = on_any(
                    &bases,
                    &client,
                    &token,
                    reqwest::Method::POST,
                    &format!("/v1/agents/{id}/messages"),
                    // Not queued: a turn id is needed, and a replica whose actor has not
                    // yet seen the last turn end answers 409 (tried again), not 202.
                    Some(json!({"text": "/load 60 10", "queue": false})),
                )
                .await;
                turns.push(t["turn_id"].as_str().expect("a started turn").to_owned());
                loop {
                    let w = on_any(
                        &bases,
                        &client,
                        &token,
                        reqwest::Method::GET,
                        &format!("/v1/agents/{id}/wait?timeout_s=5"),
                        None,
                    )
                    .await;
                    if w["last_turn"]["turn_id"] == turns.last().unwrap().as_str()
                        && !w["last_turn"]["outcome"].is_null()
                    {
                        break;
                    }
                }
            }
            turns
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Restart A, then B: each drains, comes back as the same replica on a new port.
    let (db, dir, _) = a.stop().await;
    bases.set(vec![b.base.clone()]);
    let a = spawn_on_with(db, dir, Some(token.clone()), tweak).await;
    bases.set(vec![a.base.clone(), b.base.clone()]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    bases.set(vec![a.base.clone()]);
    let (db, dir, _) = b.stop().await;
    let b = spawn_on_with(db, dir, Some(token.clone()), tweak).await;
    bases.set(vec![a.base.clone(), b.base.clone()]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    for (id, driver) in agents.iter().zip(drivers) {
        let accepted = driver.await.unwrap();
        assert!(accepted.len() >= 2, "{id}: {} turns", accepted.len());
        let timeline = b.timeline(id).await;
        assert_dense(&timeline);
        // Every accepted turn ran to completion exactly once.
        for turn in &accepted {
            let ends: Vec<&Value> = timeline
                .iter()
                .filter(|e| e["kind"] == "turn_completed" && e["turn_id"] == turn.as_str())
                .collect();
            assert_eq!(ends.len(), 1, "{id} {turn}: {ends:?}");
            assert_eq!(
                ends[0]["data"]["outcome"], "completed",
                "{id} {turn}: {:?}",
                ends[0]
            );
            let chunks = timeline
                .iter()
                .filter(|e| e["kind"] == "assistant_delta" && e["turn_id"] == turn.as_str())
                .count();
            assert_eq!(chunks, 60, "{id} {turn}: every chunk was kept");
        }
    }
    b.stop().await;
    a.stop().await;
}

#[tokio::test]
async fn a_replica_stops_an_agent_whose_lease_it_lost_and_archives_reach_other_replicas() {
    let (a, b) = replicas(short_lease).await;
    let repo = git_repo();
    let (id, ws) = a.mock_agent(repo.path()).await;
    a.prompt(&id, "hello").await;
    assert_eq!(a.wait(&id).await["last_turn"]["outcome"], "completed");
    let pid = a.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["pid"]
        .as_i64()
        .expect("a live process") as i32;

    // Another replica holds its lease now (as after a takeover): A stops it at its next
    // renewal, within a third of the lease time.
    sqlx::query("UPDATE agents SET owner_replica = 'elsewhere' WHERE id = $1::uuid")
        .bind(id.trim_start_matches("agt_"))
        .execute(&a.pool)
        .await
        .unwrap();
    eventually("A stops the agent", Duration::from_secs(TTL + 5), || {
        !pid_alive(pid)
    })
    .await;
    sqlx::query(
        "UPDATE agents SET owner_replica = NULL, lease_expires_at = NULL WHERE id = $1::uuid",
    )
    .bind(id.trim_start_matches("agt_"))
    .execute(&a.pool)
    .await
    .unwrap();

    // Running on A again; archiving its workspace through B closes it on A first.
    a.prompt(&id, "back").await;
    assert_eq!(a.wait(&id).await["last_turn"]["outcome"], "completed");
    let agent = a.get_ok(&format!("/v1/agents/{id}")).await;
    let pid = agent["runtime"]["pid"].as_i64().expect("a live process") as i32;
    assert_eq!(replica_of(&b, &id).await, replica_of(&a, &id).await);
    b.post_ok(&format!("/v1/workspaces/{ws}/archive"), json!({}), 200)
        .await;
    eventually("A's process ends", Duration::from_secs(10), || {
        !pid_alive(pid)
    })
    .await;
    let agent = b.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["status"], "closed", "{agent}");
    assert_eq!(agent["runtime"]["replica"], Value::Null, "{agent}");
    b.stop().await;
    a.stop().await;
}

/// `n` idle mock agents of one workspace on `app`, as row ids.
async fn idle_mock_agents(app: &TestApp, repo: &std::path::Path, n: usize) -> Vec<uuid::Uuid> {
    use futures::StreamExt;
    let project = app.project(repo).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let body = json!({"workspace_id": ws["id"], "provider": "mock"});
    // A few at a time: the tests are about leases, not about a burst of creations (which
    // on a busy machine can wait out the database deadline).
    futures::stream::iter((0..n).map(|_| async {
        let agent = app.post_ok("/v1/agents", body.clone(), 201).await;
        let id = agent["id"].as_str().unwrap().to_owned();
        assert_eq!(app.wait(&id).await["status"], "idle");
        id.trim_start_matches("agt_").parse::<uuid::Uuid>().unwrap()
    }))
    .buffered(16)
    .collect()
    .await
}

/// When `app`'s own lease in `replicas` runs out, and the own leases of agents `ids`.
async fn leases(
    app: &TestApp,
    ids: &[uuid::Uuid],
) -> (
    chrono::DateTime<chrono::Utc>,
    Vec<Option<chrono::DateTime<chrono::Utc>>>,
) {
    let replica: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT r.lease_expires_at FROM replicas r
          WHERE r.id = (SELECT owner_replica FROM agents WHERE id = $1)",
    )
    .bind(ids[0])
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let mut agents = Vec::new();
    for id in ids {
        agents.push(
            sqlx::query_scalar("SELECT lease_expires_at FROM agents WHERE id = $1")
                .bind(id)
                .fetch_one(&app.pool)
                .await
                .unwrap(),
        );
    }
    (replica, agents)
}

#[tokio::test]
async fn a_replica_renews_its_agents_leases_without_writing_or_waiting_for_their_rows() {
    // The event writer holds an agent's row until its batch commits, and renewing 1,000
    // agents' rows every few seconds competed with it. A replica's lease is its agents'
    // leases: renewal writes one row, and checks its agents with a read.
    let app = spawn_app_with(short_lease).await;
    let repo = git_repo();
    let ids = idle_mock_agents(&app, repo.path(), 2).await;
    let (replica_before, agents_before) = leases(&app, &ids).await;
    // Both rows stay locked, as a slow writer batch would hold them.
    let mut holder = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM agents WHERE id = ANY($1) FOR NO KEY UPDATE")
        .bind(&ids)
        .execute(&mut *holder)
        .await
        .unwrap();
    // Past two lease times, the replica's lease was renewed several times meanwhile.
    tokio::time::sleep(Duration::from_secs(2 * TTL + 1)).await;
    let (replica_now, agents_now) = leases(&app, &ids).await;
    assert!(
        replica_now > replica_before + chrono::Duration::seconds(2 * TTL as i64 - 1),
        "the replica's lease was not renewed while its agents' rows were locked: \
         {replica_before} then {replica_now}"
    );
    assert_eq!(agents_now, agents_before, "no agent row was rewritten");
    holder.rollback().await.unwrap();
    // Their own leases ran out long ago; the replica's lease keeps them its own.
    for id in &ids {
        let agent = app.get_ok(&format!("/v1/agents/agt_{}", id.simple())).await;
        assert_eq!(agent["status"], "idle", "{agent}");
        assert!(agent["runtime"]["replica"].is_string(), "{agent}");
    }
    app.stop().await;
}

#[tokio::test]
async fn beside_a_replica_of_the_previous_version_every_agents_own_lease_is_renewed() {
    // A replica of the previous version knows only agents' own leases: it would take over
    // every agent whose own lease ran out. While one runs, the others renew those too, in
    // slices; an agent left out of every slice would count as taken over and be stopped.
    let app = spawn_app_with(short_lease).await;
    let repo = git_repo();
    let ids = idle_mock_agents(&app, repo.path(), 150).await;
    // Such a replica registers and heartbeats without a lease of its own.
    let pool = app.pool.clone();
    let previous = tokio::spawn(async move {
        loop {
            sqlx::query(
                "INSERT INTO replicas (id, advertise_url) VALUES ('previous', 'http://127.0.0.1:9')
                 ON CONFLICT (id) DO UPDATE SET last_seen_at = now()",
            )
            .execute(&pool)
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    // Past two lease times every agent's own lease was renewed several times.
    tokio::time::sleep(Duration::from_secs(2 * TTL + 1)).await;
    let (held, live): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE owner_replica IS NOT NULL AND lease_expires_at > now()),
                count(*) FILTER (WHERE status <> 'closed')
           FROM agents WHERE id = ANY($1::uuid[])",
    )
    .bind(&ids)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    previous.abort();
    assert_eq!(
        (held, live),
        (150, 150),
        "every agent kept its own lease and runs"
    );
    app.stop().await;
}

#[tokio::test]
async fn an_agent_whose_owner_stopped_answering_is_taken_over_whatever_its_own_lease_says() {
    // An agent's lease is its owner's, or its own while that lasts; one that has none of
    // its own (NULL) is judged by its owner's alone.
    let app = spawn_app_with(short_lease).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    assert_eq!(app.wait(&id).await["status"], "idle");
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    // A replica that stopped answering long ago holds it.
    sqlx::query(
        "INSERT INTO replicas (id, advertise_url, last_seen_at, lease_expires_at)
         VALUES ('gone', 'http://127.0.0.1:9', now() - interval '1 hour', now() - interval '1 hour')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE agents SET owner_replica = 'gone', lease_expires_at = NULL WHERE id = $1::uuid",
    )
    .bind(id.trim_start_matches("agt_"))
    .execute(&app.pool)
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(TTL + 5);
    loop {
        let owner: Option<String> =
            sqlx::query_scalar("SELECT owner_replica FROM agents WHERE id = $1::uuid")
                .bind(id.trim_start_matches("agt_"))
                .fetch_one(&app.pool)
                .await
                .unwrap();
        if owner.as_deref() != Some("gone") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent of a replica silent for an hour was not taken over"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_one_takeover(&app).await;
    // It runs here on its next prompt.
    app.prompt(&id, "hello").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
    app.stop().await;
}

/// The replica's metrics count exactly one lease taken over.
async fn assert_one_takeover(app: &TestApp) {
    let page = crate::metrics::scrape(app).await;
    assert_eq!(
        crate::metrics::sample(&page, "agentry_lease_takeovers_total"),
        Some(1.0),
        "{page}"
    );
}

/// An agent taken over while its old owner still streams (its lease epoch moved on, as a
/// takeover by another replica does, and the old owner has not renewed since): the old
/// owner cannot write one more event. Its next batch is refused whole and counted, its
/// process stops at once (long before a renewal would notice), and no seq a client saw
/// changes kind or content.
#[tokio::test]
async fn a_deposed_owner_cannot_write_and_stops_its_agent_at_once() {
    // Default leases: a renewal would take 5 s to notice; the fence acts at the next batch.
    let (a, b) = replicas(|_| {}).await;
    let repo = git_repo();
    let (id, _) = a.mock_agent(repo.path()).await;
    let row = id.trim_start_matches("agt_").to_owned();
    a.prompt(&id, "/load 20000 2").await;
    let pid = {
        let mut pid = None;
        for _ in 0..100 {
            let agent = a.get_ok(&format!("/v1/agents/{id}")).await;
            if let Some(p) = agent["runtime"]["pid"].as_i64() {
                pid = Some(p as i32);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        pid.expect("a live process")
    };
    // Wait until it has written a good part of its turn.
    for _ in 0..200 {
        if a.timeline(&id).await.len() > 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen_before = a.timeline(&id).await;
    assert!(seen_before.len() > 50, "{}", seen_before.len());

    // The takeover, as `replicas::take_over` writes it.
    sqlx::query(
        "UPDATE agents SET owner_replica = 'elsewhere', lease_epoch = lease_epoch + 1 WHERE id = $1::uuid",
    )
    .bind(&row)
    .execute(&a.pool)
    .await
    .unwrap();
    let last_at_takeover: i64 =
        sqlx::query_scalar("SELECT max(seq) FROM agent_events WHERE agent_id = $1::uuid")
            .bind(&row)
            .fetch_one(&a.pool)
            .await
            .unwrap();

    eventually("A stops the deposed agent", Duration::from_secs(3), || {
        !pid_alive(pid)
    })
    .await;
    let page = crate::metrics::scrape(&a).await;
    let fenced = crate::metrics::sample(&page, "agentry_fenced_batches_total").unwrap_or(0.0);
    assert!(fenced >= 1.0, "{page}");

    // Nothing written by A after the takeover, and what was seen is still there as it was.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let last_now: i64 =
        sqlx::query_scalar("SELECT max(seq) FROM agent_events WHERE agent_id = $1::uuid")
            .bind(&row)
            .fetch_one(&a.pool)
            .await
            .unwrap();
    assert_eq!(last_now, last_at_takeover);
    let after = b.timeline(&id).await;
    for e in &seen_before {
        let seq = e["seq"].as_i64().unwrap();
        let now = after.iter().find(|x| x["seq"].as_i64() == Some(seq));
        assert_eq!(now, Some(e), "seq {seq} changed");
    }
    b.stop().await;
    a.stop().await;
}

/// Wait until nobody holds the agent's lease (its closed actor gave it up).
async fn until_released(app: &TestApp, row: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let owner: Option<String> =
            sqlx::query_scalar("SELECT owner_replica FROM agents WHERE id = $1::uuid")
                .bind(row)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        if owner.is_none() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the lease was never given up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The agent's lease epoch, as the database holds it.
async fn epoch_of(app: &TestApp, row: &str) -> i64 {
    sqlx::query_scalar("SELECT lease_epoch FROM agents WHERE id = $1::uuid")
        .bind(row)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// A mode change of an agent no actor runs (the service writes it, not an actor) is an
/// owner's write too: when another replica claims the agent between the service reading
/// its lease and the writer storing the change, nothing is written — neither the event
/// nor the row's mode — and the refusal is counted like a deposed actor's batch.
#[tokio::test]
async fn a_mode_change_raced_by_another_replicas_claim_writes_nothing() {
    let app = spawn_app_with(short_lease).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    let row = id.trim_start_matches("agt_").to_owned();
    app.wait(&id).await;
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    until_released(&app, &row).await;
    let before = app.timeline(&id).await;
    let fenced_before = app.writer.stats().fenced_batches;

    // Another replica's claim, held open: the writer's statement waits for the row.
    let mut claim = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM agents WHERE id = $1::uuid FOR UPDATE")
        .bind(&row)
        .execute(&mut *claim)
        .await
        .unwrap();
    let request = {
        let req = app
            .client
            .put(app.url(&format!("/v1/agents/{id}/mode")))
            .bearer_auth(&app.token)
            .json(&json!({"mode": "unattended"}));
        tokio::spawn(req.send())
    };
    until_a_statement_waits_on_a_lock(
        &app.pool,
        "WITH locked AS MATERIALIZED",
        "the mode change never reached the writer's statement",
    )
    .await;
    sqlx::query(
        "UPDATE agents SET owner_replica = 'elsewhere', lease_epoch = lease_epoch + 1,
                           lease_expires_at = now() + interval '1 hour'
          WHERE id = $1::uuid",
    )
    .bind(&row)
    .execute(&mut *claim)
    .await
    .unwrap();
    claim.commit().await.unwrap();

    let res = request.await.unwrap().unwrap();
    let problem = expect_status(res, 503).await;
    assert_eq!(problem["code"], "agent_moved", "{problem}");
    assert_eq!(app.writer.stats().fenced_batches, fenced_before + 1);
    let mode: Option<String> = sqlx::query_scalar("SELECT mode FROM agents WHERE id = $1::uuid")
        .bind(&row)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_ne!(mode.as_deref(), Some("unattended"));
    assert_eq!(app.timeline(&id).await, before, "nothing was written");

    // Once the agent is nobody's again, the same change is written, event and row at once.
    sqlx::query(
        "UPDATE agents SET owner_replica = NULL, lease_expires_at = NULL WHERE id = $1::uuid",
    )
    .bind(&row)
    .execute(&app.pool)
    .await
    .unwrap();
    let agent = app
        .put_ok(
            &format!("/v1/agents/{id}/mode"),
            json!({"mode": "unattended"}),
        )
        .await;
    assert_eq!(agent["mode"], "unattended", "{agent}");
    let after = app.timeline(&id).await;
    assert_eq!(after.len(), before.len() + 1);
    assert_eq!(after.last().unwrap()["kind"], "mode_changed");
    assert_eq!(app.writer.stats().fenced_batches, fenced_before + 1);
    app.stop().await;
}

/// A mode change of an agent another replica holds is not written here at all.
#[tokio::test]
async fn a_mode_change_of_an_agent_held_elsewhere_is_not_written_here() {
    let app = spawn_app_with(short_lease).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    let row = id.trim_start_matches("agt_").to_owned();
    app.wait(&id).await;
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    until_released(&app, &row).await;
    let before = app.timeline(&id).await;
    // Held by a replica this one cannot hand the request to (it has no address).
    sqlx::query(
        "UPDATE agents SET owner_replica = 'unlisted', lease_expires_at = now() + interval '1 hour'
          WHERE id = $1::uuid",
    )
    .bind(&row)
    .execute(&app.pool)
    .await
    .unwrap();
    let res = app
        .client
        .put(app.url(&format!("/v1/agents/{id}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "unattended"}))
        .send()
        .await
        .unwrap();
    let problem = expect_status(res, 503).await;
    assert_eq!(problem["code"], "agent_moved", "{problem}");
    assert_eq!(app.timeline(&id).await, before);
    app.stop().await;
}

/// Closing an abandoned agent (what a takeover and the boot reconciler write) is written
/// under the epoch it was read in: if yet another replica took the agent since, nothing of
/// it is stored — no failed turn, no `closed` status in that replica's timeline — and it
/// is counted as a fenced batch.
#[tokio::test]
async fn an_abandon_written_after_another_takeover_is_refused_and_counted() {
    let app = spawn_app_with(short_lease).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    let row = id.trim_start_matches("agt_").to_owned();
    app.wait(&id).await;
    app.prompt(&id, "/load 3 0").await;
    app.wait(&id).await;
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    until_released(&app, &row).await;
    // An open turn and a running status, as a replica that died mid-turn leaves them.
    sqlx::query(
        "UPDATE agents SET status = 'running', last_turn_outcome = NULL WHERE id = $1::uuid",
    )
    .bind(&row)
    .execute(&app.pool)
    .await
    .unwrap();
    let uuid: uuid::Uuid = row.parse().unwrap();
    let read = agentry::store::agents::open_agent(&app.pool, uuid)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read.lease_epoch, epoch_of(&app, &row).await);
    // Yet another replica takes it (a new epoch) before the close is written.
    sqlx::query(
        "UPDATE agents SET owner_replica = 'third', lease_epoch = lease_epoch + 1,
                           lease_expires_at = now() + interval '1 hour'
          WHERE id = $1::uuid",
    )
    .bind(&row)
    .execute(&app.pool)
    .await
    .unwrap();
    let before = app.timeline(&id).await;
    let fenced_before = app.writer.stats().fenced_batches;

    let refused = agentry::runtime::abandon_agent(
        &app.pool,
        &app.writer,
        &read,
        "owner_lost: test",
        "owner_lost",
    )
    .await;
    assert!(
        matches!(
            refused,
            Err(agentry::runtime::RuntimeError::Events(
                agentry::events::WriteError::Fenced
            ))
        ),
        "{refused:?}"
    );
    assert_eq!(app.writer.stats().fenced_batches, fenced_before + 1);
    assert_eq!(app.timeline(&id).await, before, "nothing was written");
    let status: String = sqlx::query_scalar("SELECT status FROM agents WHERE id = $1::uuid")
        .bind(&row)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(status, "running", "the row is the new owner's");

    // Read again in the current epoch, the same close is written.
    let read = agentry::store::agents::open_agent(&app.pool, uuid)
        .await
        .unwrap()
        .unwrap();
    let done = agentry::runtime::abandon_agent(
        &app.pool,
        &app.writer,
        &read,
        "owner_lost: test",
        "owner_lost",
    )
    .await
    .unwrap();
    assert!(done.turn_failed && done.closed, "{done:?}");
    let after = app.timeline(&id).await;
    let kinds: Vec<&str> = after[before.len()..]
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["turn_completed", "status"]);
    app.stop().await;
}
