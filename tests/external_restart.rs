//! An external PostgreSQL (one the server does not run) goes away under load and comes
//! back: a fast shutdown and start (what `pg_ctl restart -m fast` does), and every
//! connection of the server ended by `pg_terminate_backend`. Its own test binary with a
//! cluster of its own, so no other test loses its database.
//!
//! What must hold: the pool reconnects, the listeners (`LISTEN` for token changes and
//! for other replicas' events) listen again, every turn that was running ends once with
//! its events dense, a stream open through it all delivers each event once at the seq
//! the timeline holds it at, and a token revoked afterwards (by another writer) is
//! refused.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use agentry::embedded_pg::EmbeddedPostgres;
use helpers::*;
use serde_json::{Value, json};

const DATABASE: &str = "agentry_external";
const AGENTS: usize = 5;

async fn until_ready(app: &TestApp, since: Instant) -> Duration {
    while app.get("/readyz").await.status() != 200 {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "ready again within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    since.elapsed()
}

/// Every agent's turn ended once, completed, with a dense timeline.
async fn every_turn_completed(app: &TestApp, agents: &[String], turns: usize) {
    for a in agents {
        let w = app
            .get_ok(&format!("/v1/agents/{a}/wait?timeout_s=45"))
            .await;
        assert_eq!(w["timed_out"], false, "{a}: {w}");
        assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
        let events = app.timeline(a).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>(), "{a}");
        let ended = events
            .iter()
            .filter(|e| e["kind"] == "turn_completed")
            .count();
        assert_eq!(ended, turns, "{a}: each turn ended once");
    }
}

/// What a stream delivered is what the timeline holds: consecutive seqs, same events.
async fn stream_matches_timeline(app: &TestApp, agent: &str, seen: &[SseEvent]) {
    let timeline = app.timeline(agent).await;
    let first = seen[0].id;
    for (i, e) in seen.iter().enumerate() {
        assert_eq!(e.id, first + i as i64, "no gap, no duplicate");
        let stored: &Value = &timeline[(e.id - 1) as usize];
        assert_eq!(stored["kind"].as_str(), Some(e.event.as_str()));
        assert_eq!(stored["data"], e.data["data"], "seq {}", e.id);
    }
}

/// A token used once (so this replica holds its principal), then revoked by a write
/// of the database's own (as another replica would): refused within two seconds, which
/// only a listener that listens again can tell this replica in time.
async fn a_revoked_token_is_refused(app: &TestApp, name: &str) {
    let created = app.post_ok("/v1/tokens", json!({"name": name}), 201).await;
    let token = created["token"].as_str().unwrap().to_owned();
    let me = |t: String| app.client.get(app.url("/v1/me")).bearer_auth(t).send();
    assert_eq!(me(token.clone()).await.unwrap().status(), 200);
    sqlx::query("UPDATE api_tokens SET revoked_at = now() WHERE name = $1")
        .bind(name)
        .execute(&app.pool)
        .await
        .unwrap();
    let revoked = Instant::now();
    loop {
        let status = me(token.clone()).await.unwrap().status();
        if status == 401 {
            break;
        }
        assert!(
            revoked.elapsed() < Duration::from_secs(2),
            "a revoked token still answered {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn start_turns(app: &TestApp, agents: &[String], load: &str) {
    let start = app.writer.stats().committed_events;
    for a in agents {
        app.prompt(a, load).await;
    }
    let flowing = Instant::now();
    while app.writer.stats().committed_events < start + 1000 {
        assert!(flowing.elapsed() < Duration::from_secs(30), "events flow");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn read(stream: &mut SseReader, n: usize) -> Vec<SseEvent> {
    let mut seen = Vec::new();
    while seen.len() < n {
        seen.push(
            stream
                .next(Duration::from_secs(10))
                .await
                .expect("an event"),
        );
    }
    seen
}

#[tokio::test]
async fn an_external_restart_and_terminated_connections_are_survived() {
    let dir = tempfile::Builder::new()
        .prefix("agentry-ext-")
        .tempdir_in("/tmp")
        .unwrap();
    // The database server's account must reach it when the tests run as root.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cluster_dir = dir.path().join("cluster");
    let cluster = EmbeddedPostgres::start_in(&cluster_dir, true)
        .await
        .unwrap();
    cluster.ensure_database(DATABASE).await.unwrap();
    let options = cluster.connect_options(DATABASE);
    let app = spawn_on(options, tempfile::tempdir().unwrap(), None).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }

    // 1. A fast shutdown and a start, under load.
    let mut stream = app.events(&agents[0], None).await;
    start_turns(&app, &agents, "/load 2000 2").await;
    let mut seen = read(&mut stream, 20).await;
    let down = Instant::now();
    cluster.stop().await.unwrap();
    drop(cluster);
    let cluster = EmbeddedPostgres::start_in(&cluster_dir, true)
        .await
        .unwrap();
    let back_in = until_ready(&app, down).await;
    eprintln!("external fast restart under load: /readyz 200 after {back_in:?}");
    every_turn_completed(&app, &agents, 1).await;
    seen.extend(
        stream
            .until("turn_completed", Duration::from_secs(30))
            .await,
    );
    assert_eq!(seen.last().unwrap().event, "turn_completed");
    stream_matches_timeline(&app, &agents[0], &seen).await;
    a_revoked_token_is_refused(&app, "after-restart").await;

    // 2. Every connection of the server ended by the database, under load.
    let mut stream = app.events(&agents[0], Some(seen.last().unwrap().id)).await;
    start_turns(&app, &agents, "/load 2000 2").await;
    let mut seen = read(&mut stream, 20).await;
    let admin = sqlx::PgPool::connect_with(cluster.connect_options("postgres"))
        .await
        .unwrap();
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(DATABASE)
    .fetch_all(&admin)
    .await
    .unwrap();
    let terminated = Instant::now();
    assert!(ended.len() > 3, "the server's connections: {}", ended.len());
    let back_in = until_ready(&app, terminated).await;
    eprintln!(
        "{} connections terminated under load: /readyz 200 after {back_in:?}",
        ended.len()
    );
    every_turn_completed(&app, &agents, 2).await;
    seen.extend(
        stream
            .until("turn_completed", Duration::from_secs(30))
            .await,
    );
    assert_eq!(seen.last().unwrap().event, "turn_completed");
    stream_matches_timeline(&app, &agents[0], &seen).await;
    a_revoked_token_is_refused(&app, "after-terminate").await;

    let fresh = app.agent_in_new_workspace(&project, "mock").await;
    app.prompt(&fresh, "/load 10 0").await;
    assert_eq!(app.wait(&fresh).await["last_turn"]["outcome"], "completed");
    app.stop().await;
    admin.close().await;
    cluster.stop().await.unwrap();
    assert!(!Path::new(&cluster_dir).join("data/postmaster.pid").exists());
}

/// The database is down for longer than a lease, under load, with two replicas: when it
/// is back, every lease has run out at once. Whichever replica acts first — the owner
/// renewing, or the other taking its agents over — each agent ends up run by exactly one
/// of them: its turn ends once (completed by its owner, or failed `owner_lost` by the
/// replica that took it over, and then the owner has stopped its process), its timeline
/// is dense, no agent stays `running`, and a stream open on the other replica through it
/// all delivers each event once at the seq the timeline holds it at.
#[tokio::test]
async fn an_outage_longer_than_a_lease_leaves_each_agent_owned_once() {
    const TTL: u64 = 3;
    let dir = tempfile::Builder::new()
        .prefix("agentry-lease-out-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cluster_dir = dir.path().join("cluster");
    let cluster = EmbeddedPostgres::start_in(&cluster_dir, true)
        .await
        .unwrap();
    cluster.ensure_database(DATABASE).await.unwrap();
    let options = cluster.connect_options(DATABASE);
    let a = spawn_on_with(options.clone(), tempfile::tempdir().unwrap(), None, |s| {
        s.cluster.replica_id = Some("a".into());
        s.cluster.lease_ttl_s = TTL;
    })
    .await;
    let b = spawn_on_with(
        options,
        tempfile::tempdir().unwrap(),
        Some(a.token.clone()),
        |s| {
            s.cluster.replica_id = Some("b".into());
            s.cluster.lease_ttl_s = TTL;
        },
    )
    .await;
    let repo = git_repo();
    let project = a.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        let ws = a
            .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
            .await;
        let agent = a
            .post_ok(
                "/v1/agents",
                json!({"workspace_id": ws["id"], "provider": "mock",
                       "labels": {"agentry.replica": "a"}}),
                201,
            )
            .await;
        let id = agent["id"].as_str().unwrap().to_owned();
        a.wait(&id).await;
        agents.push(id);
    }
    let mut stream = b.events(&agents[0], Some(0)).await;
    start_turns(&a, &agents, "/load 3000 3").await;
    let mut pids = Vec::new();
    for id in &agents {
        let agent = a.get_ok(&format!("/v1/agents/{id}")).await;
        pids.push(agent["runtime"]["pid"].as_i64().expect("a live process") as i32);
    }
    let mut seen = read(&mut stream, 20).await;

    // Down for twice the lease (held: nothing to wait for but time itself).
    cluster.stop().await.unwrap();
    drop(cluster);
    let down = Instant::now();
    tokio::time::sleep(Duration::from_secs(2 * TTL)).await;
    let cluster = EmbeddedPostgres::start_in(&cluster_dir, true)
        .await
        .unwrap();
    let back_in = until_ready(&a, down).await.max(until_ready(&b, down).await);
    let restarted = Instant::now();

    let mut taken = 0;
    for (i, id) in agents.iter().enumerate() {
        // A `wait` answers once the turn has ended, whichever replica runs the agent now
        // (or none yet: it reads the agent's row until it settles).
        let w = b
            .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=45"))
            .await;
        assert_eq!(w["timed_out"], false, "{id}: {w}");
        assert!(!w["last_turn"]["outcome"].is_null(), "{id}: {w}");
        let events = b.timeline(id).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>(), "{id}");
        let ends: Vec<&Value> = events
            .iter()
            .filter(|e| e["kind"] == "turn_completed")
            .collect();
        assert_eq!(
            ends.len(),
            1,
            "{id}: the turn ended once: {ends:?}; last events: {:?}",
            &events[events.len().saturating_sub(4)..]
        );
        match ends[0]["data"]["outcome"].as_str() {
            Some("completed") => {}
            Some("failed") => {
                let error = ends[0]["data"]["error"].as_str().unwrap_or("");
                assert!(error.contains("owner_lost"), "{id}: {error}");
                taken += 1;
                eventually(
                    "the deposed owner stops the process",
                    Duration::from_secs(10),
                    || !pid_alive(pids[i]),
                )
                .await;
            }
            other => panic!("{id}: outcome {other:?}"),
        }
        let status: String = sqlx::query_scalar("SELECT status FROM agents WHERE id = $1::uuid")
            .bind(id.trim_start_matches("agt_"))
            .fetch_one(&a.pool)
            .await
            .unwrap();
        assert_ne!(status, "running", "{id}");
    }
    let settled_in = restarted.elapsed();
    eprintln!(
        "database down {:?} (lease {TTL} s): /readyz 200 after {back_in:?}, every turn ended {settled_in:?} later; {taken} of {AGENTS} agents taken over",
        Duration::from_secs(2 * TTL)
    );
    let takeovers = |page: &str| {
        page.lines()
            .find_map(|l| {
                l.strip_prefix("agentry_lease_takeovers_total ")?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    let mut counted = 0.0;
    for app in [&a, &b] {
        let page = app.get("/metrics").await.text().await.unwrap();
        counted += takeovers(&page);
    }
    assert_eq!(counted, taken as f64, "each takeover counted once");

    // The stream on the other replica delivered each event once, as stored.
    let last = b.timeline(&agents[0]).await.len() as i64;
    while seen.last().map(|e| e.id) < Some(last) {
        seen.push(
            stream
                .next(Duration::from_secs(30))
                .await
                .expect("the stream delivers up to the last event"),
        );
    }
    assert_eq!(seen[0].id, 1);
    stream_matches_timeline(&b, &agents[0], &seen).await;

    // Every agent runs again, on one replica.
    for id in &agents {
        a.prompt(id, "/load 10 0").await;
        assert_eq!(a.wait(id).await["last_turn"]["outcome"], "completed");
    }
    b.stop().await;
    a.stop().await;
    cluster.stop().await.unwrap();
}
