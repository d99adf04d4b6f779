//! The disk of the embedded database fills up under load, and is freed again. A real
//! `agentry serve` runs on the embedded default; its cluster lives on a small tmpfs that
//! only the server (and what it starts) sees: the server is started in a mount namespace
//! of its own (`unshare(CLONE_NEWNS)`, `/` made private, a tmpfs with `size=` mounted on
//! the clusters' directory). This test reaches that file system through
//! `/proc/<server pid>/root` and fills it with a file until `ENOSPC`.
//!
//! What must hold: once the full disk is known, `/readyz` answers 503 within a second and
//! names the reason, and requests answer 503 `store_unavailable` within a second with a
//! `Retry-After`; nothing acknowledged is lost (every event a client saw or read stays at
//! its seq); once the file is deleted the store comes back without a restart of agentry;
//! every turn ends exactly once (completed when all its events landed, else failed with
//! `store_unavailable`), no agent stays `running`, new agents work, and a stream open
//! through it all delivers every event once, at the seq the timeline holds it at.
//!
//! It needs root, and says so rather than skipping. Run as root, agentry runs the
//! embedded cluster as the `postgres` system user, which an unprivileged user namespace
//! (`unshare -Urm`) cannot offer: only the caller's own uid is mapped in it, so the switch
//! to `postgres` fails (and inside it agentry would believe it is root). The project's CI
//! runs the suite as root.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;
#[path = "support/serve.rs"]
#[allow(dead_code)]
mod serve;

use std::ffi::CString;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use helpers::*;
use serde_json::{Value, json};
use serve::{Serve, Server};

/// Where agentry keeps its clusters when it runs as root.
const CLUSTERS: &str = "/var/lib/agentry";
/// The size of the file system the cluster lives on: room for the cluster and some WAL.
const FS_SIZE: &str = "256m";
const AGENTS: usize = 8;
/// Events of each agent's turn, one every 2 ms (40 s): the turns run well past the disk
/// filling, even on a busy machine.
const LOAD: &str = "/load 20000 2";
/// How long the disk stays full once the server knows it.
const FULL_FOR: Duration = Duration::from_secs(4);
/// The longest any answer may take once the full disk is known.
const FAST: Duration = Duration::from_secs(1);

/// `agentry serve` with its cluster on a tmpfs of its own mount namespace.
fn start_on_a_small_disk() -> Server {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test mounts a small file system in a mount namespace of the server's own, \
             which needs root (CI runs as root); run it as root"
    );
    std::fs::create_dir_all(CLUSTERS).unwrap();
    let tmpfs = CString::new("tmpfs").unwrap();
    let root = CString::new("/").unwrap();
    let target = CString::new(CLUSTERS).unwrap();
    let options = CString::new(format!("size={FS_SIZE},mode=0755")).unwrap();
    let serve = Serve {
        name: "disk-full",
        rust_log: "warn,agentry::store=info,agentry::embedded_pg=info",
        ..Serve::default()
    };
    serve.start_with(|cmd| {
        // SAFETY: between fork and exec the closure makes only system calls (unshare,
        // mount) on strings prepared before the fork, and reads errno.
        unsafe {
            cmd.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Nothing mounted here propagates back to the host's mounts.
                if libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::mount(
                    tmpfs.as_ptr(),
                    target.as_ptr(),
                    tmpfs.as_ptr(),
                    0,
                    options.as_ptr().cast(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    })
}

/// A path of the server's mount namespace, as this process reaches it.
fn inside(server: &Server, path: &str) -> PathBuf {
    Path::new(&format!("/proc/{}/root", server.pid())).join(path.trim_start_matches('/'))
}

/// The last lines of the cluster's server log, for a failure's message.
fn postgres_log_tail(server: &Server) -> String {
    let clusters = inside(server, CLUSTERS);
    let Some(cluster) = std::fs::read_dir(&clusters)
        .into_iter()
        .flatten()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("pg-"))
    else {
        return format!("(no cluster in {})", clusters.display());
    };
    let log = std::fs::read_to_string(cluster.path().join("postgres.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    fn of(server: &Server) -> Self {
        Client {
            base: server.base.clone(),
            token: server.token(),
            // No overall timeout: event streams stay open for the whole test.
            http: reqwest::Client::builder()
                .pool_idle_timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        }
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(90));
        if let Some(body) = body {
            req = req.json(&body);
        }
        req.send().await.unwrap()
    }

    async fn post(&self, path: &str, body: Value, status: u16) -> Value {
        expect_status(
            self.send(reqwest::Method::POST, path, Some(body)).await,
            status,
        )
        .await
    }

    async fn get(&self, path: &str) -> Value {
        expect_status(self.send(reqwest::Method::GET, path, None).await, 200).await
    }

    async fn readyz(&self) -> reqwest::Response {
        self.http
            .get(format!("{}/readyz", self.base))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap()
    }

    async fn agent(&self, project: &Value) -> String {
        let ws = self
            .post("/v1/workspaces", json!({"project_id": project["id"]}), 201)
            .await;
        let agent = self
            .post(
                "/v1/agents",
                json!({"workspace_id": ws["id"], "provider": "mock"}),
                201,
            )
            .await;
        let id = agent["id"].as_str().unwrap().to_owned();
        self.get(&format!("/v1/agents/{id}/wait?timeout_s=30"))
            .await;
        id
    }

    async fn prompt(&self, agent: &str, text: &str) {
        self.post(
            &format!("/v1/agents/{agent}/messages"),
            json!({ "text": text }),
            202,
        )
        .await;
    }

    async fn events(&self, agent: &str) -> SseReader {
        let res = self
            .http
            .get(format!("{}/v1/agents/{agent}/events", self.base))
            .bearer_auth(&self.token)
            .header("Last-Event-ID", "0")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        SseReader::from_response(res)
    }

    /// Every event of the agent's timeline, oldest first.
    async fn timeline(&self, agent: &str) -> Vec<Value> {
        let mut out = Vec::new();
        let mut path = format!("/v1/agents/{agent}/timeline?after_seq=0&limit=1000");
        loop {
            let page = self.get(&path).await;
            out.extend(page["items"].as_array().unwrap().iter().cloned());
            match page["next_cursor"].as_str() {
                Some(c) => path = format!("/v1/agents/{agent}/timeline?cursor={c}&limit=1000"),
                None => return out,
            }
        }
    }
}

/// Write zeros to `path` until the file system has no room left; the bytes written.
fn fill(path: &Path) -> u64 {
    let mut file = std::fs::File::create(path).unwrap();
    let mut written = 0u64;
    // Large writes first, then small ones for what is left.
    for size in [1 << 20, 4096, 1] {
        let chunk = vec![0u8; size];
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
    }
    written
}

/// A file that fills the file system of the server's cluster until it is deleted.
struct Filler(PathBuf);

impl Filler {
    /// Fills the cluster's file system up; the filler and the bytes it took.
    fn fill(server: &Server) -> (Filler, u64) {
        let path = inside(server, &format!("{CLUSTERS}/filler"));
        let written = fill(&path);
        (Filler(path), written)
    }

    /// Deletes the file, then waits (at most `within`) until `/readyz` answers 200, every
    /// answer on the way a fast 503.
    async fn free(self, c: &Client, within: Duration) {
        std::fs::remove_file(&self.0).unwrap();
        let freed = Instant::now();
        loop {
            let asked = Instant::now();
            let res = c.readyz().await;
            let took = asked.elapsed();
            if res.status() == 200 {
                eprintln!("space freed: /readyz 200 again after {:?}", freed.elapsed());
                return;
            }
            unavailable(res, took, "/readyz").await;
            assert!(
                freed.elapsed() < within,
                "not ready {:?} after the space was freed",
                freed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Once the space is back: one postmaster runs the cluster, and a new agent's turn
/// completes.
async fn works_again(server: &Server, c: &Client, project: &Value) {
    assert_eq!(server.postmasters().len(), 1);
    let agent = c.agent(project).await;
    c.prompt(&agent, "/load 10 0").await;
    let w = c
        .get(&format!("/v1/agents/{agent}/wait?timeout_s=30"))
        .await;
    assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
}

/// A 503 `store_unavailable` answer, in time, with `Retry-After`; its problem.
async fn unavailable(res: reqwest::Response, took: Duration, what: &str) -> Value {
    assert!(took < FAST, "{what} answered after {took:?}");
    assert!(
        res.headers().contains_key("retry-after"),
        "{what}: {:?}",
        res.headers()
    );
    let problem = expect_status(res, 503).await;
    assert_eq!(problem["code"], "store_unavailable", "{what}: {problem}");
    problem
}

#[tokio::test]
async fn a_full_disk_answers_fast_loses_nothing_and_the_store_returns_once_it_is_freed() {
    agentry::telemetry::install_crypto_provider();
    let server = start_on_a_small_disk();
    let c = Client::of(&server);
    let repo = git_repo();
    let project = c
        .post(
            "/v1/projects",
            json!({"name": "disk", "repo_path": repo.path()}),
            201,
        )
        .await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        agents.push(c.agent(&project).await);
    }
    let mut stream = c.events(&agents[0]).await;
    let prompted = Instant::now();
    for a in &agents {
        c.prompt(a, LOAD).await;
    }
    // The turns stream: the first agent's stream has delivered some of its turn.
    let mut seen = Vec::new();
    while seen.len() < 100 {
        seen.push(
            stream
                .next(Duration::from_secs(30))
                .await
                .expect("events before the disk fills"),
        );
    }
    // What a client reads of every agent's timeline now is acknowledged: it must stay
    // as it is (a page each: the disk fills while the turns run).
    let mut acknowledged = Vec::new();
    for a in &agents {
        let page = c
            .get(&format!("/v1/agents/{a}/timeline?after_seq=0&limit=1000"))
            .await;
        acknowledged.push(page["items"].as_array().unwrap().clone());
    }

    // The turns are still running, so the writer has events to store when the disk fills.
    for a in &agents {
        let agent = c.get(&format!("/v1/agents/{a}")).await;
        assert_eq!(agent["status"], "running", "{agent}");
    }
    let (filler, filled_bytes) = Filler::fill(&server);
    let filled = Instant::now();
    eprintln!(
        "filled the cluster's file system with {} MiB, {:?} into the turns",
        filled_bytes >> 20,
        prompted.elapsed()
    );

    // The server finds out from the database's refusals; from then on it answers at once.
    let reason = loop {
        let res = c.readyz().await;
        let status = res.status();
        let body = res.text().await.unwrap();
        if status == 503 {
            let problem: Value = serde_json::from_str(&body).unwrap();
            let reason = problem["reason"].as_str().unwrap_or_default().to_owned();
            if reason.contains("disk is full") {
                break reason;
            }
        }
        assert!(
            filled.elapsed() < Duration::from_secs(30),
            "/readyz does not say the disk is full {:?} after it filled: {status} {body}; \
             the end of postgres.log:\n{}",
            filled.elapsed(),
            postgres_log_tail(&server)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let known = filled.elapsed();
    eprintln!("full disk known after {known:?}; /readyz said: {reason}");
    let mut slowest = Duration::ZERO;
    let mut tries = 0;
    let holding = Instant::now();
    while holding.elapsed() < FULL_FOR {
        tries += 1;
        let asked = Instant::now();
        let res = c.readyz().await;
        let took = asked.elapsed();
        let problem = unavailable(res, took, "/readyz").await;
        assert_eq!(problem["ready"], false, "{problem}");
        let reason = problem["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("disk is full"), "{problem}");
        slowest = slowest.max(took);

        let asked = Instant::now();
        let res = c
            .send(
                reqwest::Method::POST,
                "/v1/projects",
                Some(json!({"name": format!("full-{tries}"), "repo_path": repo.path()})),
            )
            .await;
        let took = asked.elapsed();
        unavailable(res, took, "a write").await;
        slowest = slowest.max(took);

        let asked = Instant::now();
        let res = c.send(reqwest::Method::GET, "/v1/projects", None).await;
        let took = asked.elapsed();
        unavailable(res, took, "a read").await;
        slowest = slowest.max(took);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("while the disk was full: {tries} rounds, the slowest answer took {slowest:?}");

    filler.free(&c, Duration::from_secs(30)).await;

    // Every turn ends once; none stays running; nothing acknowledged changed.
    let mut outcomes = Vec::new();
    for (a, before) in agents.iter().zip(&acknowledged) {
        let w = c.get(&format!("/v1/agents/{a}/wait?timeout_s=60")).await;
        assert_eq!(w["timed_out"], false, "{a}: {w}");
        assert_ne!(w["status"], "running", "{w}");
        outcomes.push(
            w["last_turn"]["outcome"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        match w["last_turn"]["outcome"].as_str().unwrap_or_default() {
            "completed" => {}
            "failed" => assert!(
                w["last_turn"]["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("store_unavailable")),
                "{w}"
            ),
            other => panic!("the turn of {a} ended {other}: {w}"),
        }
        let events = c.timeline(a).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>(), "{a}");
        assert!(events.len() >= before.len(), "{a}");
        assert_eq!(
            &events[..before.len()],
            &before[..],
            "{a}: acknowledged events kept"
        );
        let ended = events
            .iter()
            .filter(|e| e["kind"] == "turn_completed")
            .count();
        assert_eq!(ended, 1, "{a}: the turn ended once");
    }

    eprintln!("the turns ended: {outcomes:?}");

    // The stream stayed open and delivered the rest: each event once, at its seq.
    seen.extend(
        stream
            .until("turn_completed", Duration::from_secs(60))
            .await,
    );
    assert_eq!(
        seen.last().map(|e| e.event.as_str()),
        Some("turn_completed"),
        "the stream delivered the end of the turn"
    );
    let timeline = c.timeline(&agents[0]).await;
    for (i, e) in seen.iter().enumerate() {
        assert_eq!(e.id, i as i64 + 1, "no gap, no duplicate");
        let stored = &timeline[i];
        assert_eq!(stored["seq"].as_i64(), Some(e.id));
        assert_eq!(stored["kind"].as_str(), Some(e.event.as_str()));
        assert_eq!(stored["data"], e.data["data"], "seq {}", e.id);
    }

    // One postmaster runs the cluster, and the server works as before.
    works_again(&server, &c, &project).await;
    c.post(
        "/v1/projects",
        json!({"name": "after", "repo_path": repo.path()}),
        201,
    )
    .await;
    server.stop();
}

/// The postmaster dies while the disk is full: it cannot start again (not even its lock
/// file can be written), `/readyz` says the disk is full, and the supervisor keeps
/// trying with a growing backoff; once the space is freed it starts at once, not at the
/// end of that backoff.
#[tokio::test]
async fn a_cluster_that_cannot_start_on_a_full_disk_starts_as_soon_as_there_is_room() {
    agentry::telemetry::install_crypto_provider();
    let server = start_on_a_small_disk();
    let c = Client::of(&server);
    let repo = git_repo();
    let project = c
        .post(
            "/v1/projects",
            json!({"name": "restart", "repo_path": repo.path()}),
            201,
        )
        .await;
    let (filler, _) = Filler::fill(&server);
    let postmasters = server.postmasters();
    assert_eq!(postmasters.len(), 1);
    // SAFETY: a signal to the database server of the test's own server, by its pid.
    assert_eq!(unsafe { libc::kill(postmasters[0], libc::SIGKILL) }, 0);
    let killed = Instant::now();

    // The supervisor sees the postmaster exit within a tenth of a second.
    while c.readyz().await.status() == 200 {
        assert!(killed.elapsed() < Duration::from_secs(5), "still ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Attempts fail until the backoff has grown to 8 s; every answer is fast meanwhile.
    let mut said = String::new();
    while !said.contains("next in 8000 ms") {
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the supervisor kept trying: {said}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let asked = Instant::now();
        let res = c.readyz().await;
        let problem = unavailable(res, asked.elapsed(), "/readyz").await;
        said = problem["reason"].as_str().unwrap_or_default().to_owned();
        assert!(said.contains("disk is full"), "{said}");
    }
    eprintln!("while it could not start, /readyz said: {said}");

    // Well before the 8 s the backoff would still wait.
    filler.free(&c, Duration::from_secs(5)).await;
    works_again(&server, &c, &project).await;
    server.stop();
}
