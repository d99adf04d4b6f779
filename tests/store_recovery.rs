//! The embedded database fails under load and the server brings it back by itself. The
//! server here runs its own embedded cluster, started and supervised as `agentry serve`
//! without `database.url` does: the crash is a real `SIGKILL` of its postmaster.
//!
//! What must hold: requests answer 503 `store_unavailable` fast (with `Retry-After`)
//! while it is down and `/readyz` says why; it runs again well within 30 s; every turn
//! that was running ends exactly once, no agent stays `running`; exactly one postmaster
//! runs the cluster afterwards; a new agent works; a stream open through it all delivers
//! every event once, at the seq the timeline holds it at. And a cluster that cannot start
//! says why and keeps being tried until it can.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;
#[path = "support/serve.rs"]
#[allow(dead_code)]
mod serve;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use helpers::*;
use serde_json::Value;
use serve::{cwd, postmasters_of, postmasters_under};

/// The tests here each run a cluster of their own, but share two CPUs: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The server's log on stderr with `RUST_LOG` (what the supervisor did, and why).
fn log() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// The postmaster this test process runs (the server forks it): its pid and data dir.
fn our_postmaster() -> (i32, PathBuf) {
    let pid = *postmasters_under(std::process::id() as i32)
        .first()
        .expect("a postmaster runs under this test process");
    (pid, cwd(pid))
}

fn kill(pid: i32, signal: libc::c_int) {
    // SAFETY: kill(2) on the test's own database server.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(rc, 0, "kill {pid}");
}

/// Until `/readyz` answers 503 (within `limit`), asking every 10 ms: the reason it gave.
async fn until_unready(app: &TestApp, limit: Duration) -> String {
    let since = Instant::now();
    loop {
        let res = app.client.get(app.url("/readyz")).send().await.unwrap();
        if res.status() == 503 {
            let problem = expect_status(res, 503).await;
            assert_eq!(problem["code"], "store_unavailable", "{problem}");
            return problem["reason"].as_str().unwrap_or_default().to_owned();
        }
        assert!(
            since.elapsed() < limit,
            "/readyz still answered 200 {:?} after the failure",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Until `/readyz` answers 200 (within `limit` of `since`): every answer on the way, and
/// a read of the API beside each, must come fast, and as 503 `store_unavailable` with a
/// `Retry-After`. Returns how long it took and the reasons `/readyz` gave.
async fn until_ready_answering_fast(
    app: &TestApp,
    since: Instant,
    limit: Duration,
) -> (Duration, Vec<String>) {
    let mut reasons = Vec::new();
    let mut slowest = Duration::ZERO;
    loop {
        let asked = Instant::now();
        let res = app.client.get(app.url("/readyz")).send().await.unwrap();
        let took = asked.elapsed();
        if res.status() == 200 {
            eprintln!("slowest answer while the database was down: {slowest:?}");
            return (since.elapsed(), reasons);
        }
        assert!(
            took < Duration::from_secs(2),
            "/readyz answered after {took:?}"
        );
        slowest = slowest.max(took);
        let problem = expect_status(res, 503).await;
        assert_eq!(problem["code"], "store_unavailable", "{problem}");
        assert_eq!(problem["ready"], false, "{problem}");
        reasons.push(problem["reason"].as_str().unwrap_or_default().to_owned());

        let asked = Instant::now();
        let res = app.get("/v1/projects").await;
        let took = asked.elapsed();
        if res.status() == 503 {
            assert!(
                took < Duration::from_secs(2),
                "a read answered after {took:?}"
            );
            slowest = slowest.max(took);
            assert!(
                res.headers().contains_key("retry-after"),
                "{:?}",
                res.headers()
            );
            let problem = expect_status(res, 503).await;
            assert_eq!(problem["code"], "store_unavailable", "{problem}");
        }
        assert!(
            since.elapsed() < limit,
            "not ready {:?} after the failure; said: {:?}",
            since.elapsed(),
            reasons.last()
        );
        // Often enough to see each state of an outage that can be over in half a second.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Removes the cluster directory of an app's embedded database (under /var/lib/agentry
/// when the tests run as root) once the test is over.
struct RemoveCluster(PathBuf);

impl Drop for RemoveCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const AGENTS: usize = 20;

#[tokio::test]
async fn a_killed_postmaster_comes_back_and_every_turn_ends_once() {
    let _serial = SERIAL.lock().await;
    log();
    let app = spawn_embedded_app(|_| {}).await;
    let (postmaster, data_dir) = our_postmaster();
    let _cleanup = RemoveCluster(data_dir.parent().unwrap().to_path_buf());
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    let mut stream = app.events(&agents[0], None).await;
    for a in &agents {
        app.prompt(a, "/load 3000 2").await;
    }
    let start = app.writer.stats().committed_events;
    let flowing = Instant::now();
    while app.writer.stats().committed_events < start + 3000 {
        assert!(flowing.elapsed() < Duration::from_secs(30), "events flow");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The stream has delivered some of the turn before the crash.
    let mut seen = Vec::new();
    while seen.len() < 20 {
        seen.push(
            stream
                .next(Duration::from_secs(10))
                .await
                .expect("events before the crash"),
        );
    }

    kill(postmaster, libc::SIGKILL);
    let killed = Instant::now();
    // The supervisor notices within a tenth of a second; the restart can take little
    // more, so `/readyz` is asked from the kill on rather than after a pause.
    let first = until_unready(&app, Duration::from_secs(5)).await;
    let (back_in, mut reasons) =
        until_ready_answering_fast(&app, killed, Duration::from_secs(30)).await;
    reasons.insert(0, first);
    eprintln!(
        "SIGKILL of the postmaster with {AGENTS} agents streaming: /readyz 200 again after {back_in:?}; it said {:?}",
        reasons.first()
    );
    assert!(
        reasons.iter().any(|r| r.contains("exited")),
        "/readyz said why: {reasons:?}"
    );

    // Every turn ends once; none stays running.
    for a in &agents {
        let w = app
            .get_ok(&format!("/v1/agents/{a}/wait?timeout_s=45"))
            .await;
        assert_eq!(w["timed_out"], false, "{a}: {w}");
        assert_ne!(w["status"], "running", "{w}");
        let outcome = w["last_turn"]["outcome"].as_str().unwrap_or_default();
        match outcome {
            "completed" => {}
            "failed" => assert!(
                w["last_turn"]["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("store_unavailable")),
                "{w}"
            ),
            other => panic!("turn of {a} ended {other}: {w}"),
        }
        let events = app.timeline(a).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>(), "{a}");
        let ended = events
            .iter()
            .filter(|e| e["kind"] == "turn_completed")
            .count();
        assert_eq!(ended, 1, "{a}: the turn ended once");
    }

    // The stream stayed open and delivered the rest: each event once, at its seq.
    let rest = stream
        .until("turn_completed", Duration::from_secs(30))
        .await;
    seen.extend(rest);
    assert_eq!(
        seen.last().map(|e| e.event.as_str()),
        Some("turn_completed"),
        "the stream delivered the end of the turn"
    );
    let timeline = app.timeline(&agents[0]).await;
    let first = seen[0].id;
    for (i, e) in seen.iter().enumerate() {
        assert_eq!(e.id, first + i as i64, "no gap, no duplicate");
        let stored: &Value = &timeline[(e.id - 1) as usize];
        assert_eq!(stored["seq"].as_i64(), Some(e.id));
        assert_eq!(stored["kind"].as_str(), Some(e.event.as_str()));
        assert_eq!(stored["data"], e.data["data"], "seq {}", e.id);
    }

    // One postmaster runs the cluster, and the server works as before.
    assert_eq!(postmasters_of(&data_dir).len(), 1);
    let fresh = app.agent_in_new_workspace(&project, "mock").await;
    app.prompt(&fresh, "/load 10 0").await;
    let w = app.wait(&fresh).await;
    assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
    app.stop().await;
}

#[tokio::test]
async fn a_cluster_that_cannot_start_says_why_and_is_tried_until_it_can() {
    let _serial = SERIAL.lock().await;
    log();
    let app = spawn_embedded_app(|_| {}).await;
    let (postmaster, data_dir) = our_postmaster();
    let _cleanup = RemoveCluster(data_dir.parent().unwrap().to_path_buf());
    let repo = git_repo();
    let project = app.project(repo.path()).await;

    // Break its configuration, then crash it: every restart fails until it is mended.
    let conf = data_dir.join("postgresql.auto.conf");
    let original = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(&conf, format!("{original}\nwork_mem = 'not a size'\n")).unwrap();
    kill(postmaster, libc::SIGKILL);
    let killed = Instant::now();
    let mut said = String::new();
    while !said.contains("work_mem") {
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "/readyz said why it cannot start: {said}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let asked = Instant::now();
        let res = app.client.get(app.url("/readyz")).send().await.unwrap();
        assert!(asked.elapsed() < Duration::from_secs(2));
        let problem = expect_status(res, 503).await;
        said = problem["reason"].as_str().unwrap_or_default().to_owned();
    }
    eprintln!("while it could not start, /readyz said: {said}");
    // It keeps trying: a few more attempts fail, then the mended cluster starts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        app.client
            .get(app.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    std::fs::write(&conf, original).unwrap();
    let mended = Instant::now();
    // The backoff is at most 10 s between attempts.
    let (back_in, _) = until_ready_answering_fast(&app, mended, Duration::from_secs(20)).await;
    eprintln!("mended: ready again after {back_in:?}");
    assert_eq!(postmasters_of(&data_dir).len(), 1);
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    app.prompt(&agent, "/load 10 0").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    app.stop().await;
}
