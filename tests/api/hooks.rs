//! Lifecycle hooks against a real webhook receiver: a small HTTP server in the test that
//! checks every signature, records what it got and answers as each test scripts it.
//! CRUD and validation, each waiting hook (unchanged, replaced, invalid, error, timeout)
//! and what the operation then did, ordering and `env` reaching the provider process, a
//! policy bot answering permission requests, and notifications that retry, survive a
//! restart and can be redelivered.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::helpers::*;
use crate::people::*;

#[path = "../support/http.rs"]
#[allow(dead_code)] // here only its request reader is used
pub(crate) mod http;

const SECRET: &str = "whsec_test_0123456789";

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    event: String,
    delivery: String,
    body: Value,
    raw: String,
}

/// How the receiver answers one request.
#[derive(Debug, Clone)]
enum Reply {
    Status(u16),
    Json(u16, Value),
    Raw(u16, String),
    /// Wait this long, then answer 204.
    Slow(Duration),
}

type Script = Arc<dyn Fn(&Received) -> Reply + Send + Sync>;

/// A webhook receiver: verifies `Agentry-Signature` against `SECRET` (a bad signature is
/// a test failure, answered 401 and remembered), records every request, answers by its
/// script.
struct Receiver {
    addr: SocketAddr,
    got: Arc<Mutex<Vec<Received>>>,
    bad_signatures: Arc<Mutex<Vec<String>>>,
    script: Arc<Mutex<Script>>,
    /// Woken each time a request is recorded.
    arrived: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn hmac_hex(secret: &[u8], message: &[u8]) -> String {
    // HMAC-SHA256 by its definition, so the test does not reuse the server's code.
    let mut key = [0u8; 64];
    if secret.len() > 64 {
        key[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        key[..secret.len()].copy_from_slice(secret);
    }
    let inner: Vec<u8> = key.iter().map(|b| b ^ 0x36).collect();
    let outer: Vec<u8> = key.iter().map(|b| b ^ 0x5c).collect();
    let inner_hash = Sha256::new()
        .chain_update(&inner)
        .chain_update(message)
        .finalize();
    hex::encode(
        Sha256::new()
            .chain_update(&outer)
            .chain_update(inner_hash)
            .finalize(),
    )
}

impl Receiver {
    async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    async fn start_on(addr: SocketAddr) -> Self {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let bad = Arc::new(Mutex::new(Vec::new()));
        let script: Arc<Mutex<Script>> =
            Arc::new(Mutex::new(Arc::new(|_: &Received| Reply::Status(204))));
        let arrived = Arc::new(tokio::sync::Notify::new());
        let (g, b, s, n) = (got.clone(), bad.clone(), script.clone(), arrived.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let (g, b, s, n) = (g.clone(), b.clone(), s.clone(), n.clone());
                tokio::spawn(async move {
                    let Some((head, body)) = http::read_request(&mut stream).await else {
                        return;
                    };
                    let header = |name: &str| {
                        head.lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.trim()
                                    .eq_ignore_ascii_case(name)
                                    .then(|| v.trim().to_owned())
                            })
                            .unwrap_or_default()
                    };
                    let ts = header("agentry-timestamp");
                    let mut message = format!("{ts}.").into_bytes();
                    message.extend_from_slice(&body);
                    let expected = format!("sha256={}", hmac_hex(SECRET.as_bytes(), &message));
                    let now = chrono::Utc::now().timestamp();
                    let fresh = ts.parse::<i64>().is_ok_and(|t| (now - t).abs() < 300);
                    let raw = String::from_utf8_lossy(&body).into_owned();
                    let reply = if header("agentry-signature") != expected || !fresh {
                        b.lock().unwrap().push(raw.clone());
                        n.notify_waiters();
                        Reply::Status(401)
                    } else {
                        let r = Received {
                            event: header("agentry-event"),
                            delivery: header("agentry-delivery"),
                            body: serde_json::from_str(&raw).unwrap_or(Value::Null),
                            raw,
                        };
                        let f = s.lock().unwrap().clone();
                        let reply = f(&r);
                        g.lock().unwrap().push(r);
                        n.notify_waiters();
                        reply
                    };
                    let (status, text) = match reply {
                        Reply::Status(s) => (s, String::new()),
                        Reply::Json(s, v) => (s, v.to_string()),
                        Reply::Raw(s, t) => (s, t),
                        Reply::Slow(d) => {
                            tokio::time::sleep(d).await;
                            (204, String::new())
                        }
                    };
                    let out = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                        text.len()
                    );
                    let _ = stream.write_all(out.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self {
            addr,
            got,
            bad_signatures: bad,
            script,
            arrived,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn answer(&self, f: impl Fn(&Received) -> Reply + Send + Sync + 'static) {
        *self.script.lock().unwrap() = Arc::new(f);
    }

    fn got(&self) -> Vec<Received> {
        assert!(
            self.bad_signatures.lock().unwrap().is_empty(),
            "requests with a bad signature: {:?}",
            self.bad_signatures.lock().unwrap()
        );
        self.got.lock().unwrap().clone()
    }

    fn of(&self, event: &str) -> Vec<Received> {
        self.got()
            .into_iter()
            .filter(|r| r.event == event)
            .collect()
    }

    /// Wait until `n` requests of `event` arrived; returns them. Each recorded request
    /// wakes the wait, which then counts again.
    async fn wait_for(&self, event: &str, n: usize, within: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // Listen before counting, so a request recorded in between still wakes us.
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let got = self.of(event);
            if got.len() >= n {
                return got;
            }
            assert!(
                tokio::time::timeout_at(deadline, arrived).await.is_ok(),
                "waited for {n} `{event}`; got {:?}",
                self.got().iter().map(|r| &r.event).collect::<Vec<_>>()
            );
        }
    }
}

/// An app whose team hooks may call the test's loopback receivers, with a short timeout.
async fn app() -> TestApp {
    spawn_app_with(|s| {
        s.hooks.allow_private_networks = true;
        s.hooks.timeout_s = 2;
    })
    .await
}

async fn hook(app: &TestApp, name: &str, events: &[&str], url: &str) -> Value {
    app.post_ok(
        "/v1/hooks",
        json!({"name": name, "events": events, "url": url, "secret": SECRET}),
        201,
    )
    .await
}

async fn refused(res: reqwest::Response, status: u16, code: &str) -> Value {
    let got = res.status().as_u16();
    let body: Value = res.json().await.unwrap_or(Value::Null);
    assert_eq!((got, body["code"].as_str()), (status, Some(code)), "{body}");
    body
}

async fn workspaces(app: &TestApp) -> Vec<Value> {
    app.get_ok("/v1/workspaces").await["items"]
        .as_array()
        .unwrap()
        .clone()
}

fn branches(repo: &std::path::Path) -> String {
    let out = std::process::Command::new("git")
        .args(["branch", "--list"])
        .current_dir(repo)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn hooks_are_managed_by_owners_validated_and_never_show_their_secret() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let bob = person(&app, "bob").await;
    let vic = person(&app, "vic").await;
    let team_a = team(&ana, "alpha").await;
    team(&bob, "beta").await;
    add(&ana, &team_a, &vic, "viewer").await;

    let created = ana
        .api
        .ok(
            Method::POST,
            "/v1/hooks",
            Some(
                json!({"name": "tickets", "events": ["agent.turn.after", "agent.turn.after"],
                "url": "https://hooks.example.com/in", "secret": SECRET, "labels": {"ci": "1"}}),
            ),
            201,
        )
        .await;
    let id = created["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("hook_"), "{created}");
    assert_eq!(created["team_id"], team_a.as_str());
    assert_eq!(created["events"], json!(["agent.turn.after"]));
    assert_eq!(created["enabled"], true);
    assert!(created.get("secret").is_none(), "{created}");
    let read = ana
        .api
        .ok(Method::GET, &format!("/v1/hooks/{id}"), None, 200)
        .await;
    let listed = ana.api.ok(Method::GET, "/v1/hooks", None, 200).await;
    for v in [&read, &listed] {
        assert!(!v.to_string().contains(SECRET), "{v}");
    }
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
    // Idempotent creation: the same key and body give the same hook; another body, 409.
    let body = json!({"name": "ci", "events": ["agent.turn.after"],
        "url": "https://hooks.example.com/ci", "secret": SECRET});
    let mut ids = Vec::new();
    for expected in [201, 200] {
        let (s, b, _) = ana
            .api
            .call_full_with_key(Method::POST, "/v1/hooks", &body, "hook-key-1")
            .await;
        assert_eq!(s, expected, "{b}");
        ids.push(b["id"].clone());
    }
    assert_eq!(ids[0], ids[1]);
    let mut other = body.clone();
    other["secret"] = json!("a different secret");
    let (s, b, _) = ana
        .api
        .call_full_with_key(Method::POST, "/v1/hooks", &other, "hook-key-1")
        .await;
    assert_eq!(
        (s, b["code"].as_str()),
        (409, Some("idempotency_key_reused")),
        "{b}"
    );
    ana.api
        .ok(
            Method::DELETE,
            &format!("/v1/hooks/{}", ids[0].as_str().unwrap()),
            None,
            204,
        )
        .await;
    // At rest the secret is sealed, never in clear.
    let stored: Vec<u8> = sqlx::query_scalar("SELECT ciphertext FROM hooks")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(!String::from_utf8_lossy(&stored).contains(SECRET));

    // Another team's hook is missing; a viewer of the team may not read it.
    bob.api
        .refused(
            Method::GET,
            &format!("/v1/hooks/{id}"),
            None,
            404,
            "not_found",
        )
        .await;
    bob.api
        .refused(
            Method::PATCH,
            &format!("/v1/hooks/{id}"),
            Some(json!({"enabled": false})),
            404,
            "not_found",
        )
        .await;
    bob.api
        .refused(
            Method::DELETE,
            &format!("/v1/hooks/{id}"),
            None,
            404,
            "not_found",
        )
        .await;
    assert_eq!(
        bob.api.ok(Method::GET, "/v1/hooks", None, 200).await["items"],
        json!([])
    );
    vic.api
        .refused(
            Method::GET,
            &format!("/v1/hooks/{id}"),
            None,
            403,
            "forbidden",
        )
        .await;
    bob.api
        .refused(
            Method::POST,
            "/v1/hooks",
            Some(
                json!({"name": "x", "events": ["agent.turn.after"], "url": "https://a.example.com",
                "secret": SECRET, "team_id": team_a}),
            ),
            404,
            "not_found",
        )
        .await;

    // Validation: event names, URLs (scheme, loopback and private literals for a team
    // hook), labels, secret.
    for (body, field) in [
        (json!({"events": ["agent.turn.during"]}), "events"),
        (json!({"events": []}), "events"),
        (json!({"url": "ftp://hooks.example.com"}), "url"),
        (json!({"url": "http://127.0.0.1:8080/x"}), "url"),
        (json!({"url": "http://10.0.0.7/x"}), "url"),
        (json!({"url": "http://169.254.169.254/latest"}), "url"),
        (json!({"url": "http://[::1]/x"}), "url"),
        (json!({"url": "http://localhost/x"}), "url"),
        (json!({"labels": {"a": 1}}), "labels"),
        (json!({"secret": ""}), "secret"),
        (json!({"name": ""}), "name"),
    ] {
        let mut full = json!({"name": "v", "events": ["agent.turn.after"],
            "url": "https://hooks.example.com/in", "secret": SECRET});
        for (k, v) in body.as_object().unwrap() {
            full[k] = v.clone();
        }
        let (status, answer) = ana.api.call(Method::POST, "/v1/hooks", Some(full)).await;
        assert_eq!(
            (status, answer["code"].as_str()),
            (422, Some("validation_failed")),
            "{body}: {answer}"
        );
        assert_eq!(answer["errors"][0]["field"], field, "{answer}");
    }

    // PATCH changes what is given; the secret can be replaced, never read.
    let patched = ana
        .api
        .ok(
            Method::PATCH,
            &format!("/v1/hooks/{id}"),
            Some(json!({"enabled": false, "secret": "another-secret", "events": ["agent.create.after"]})),
            200,
        )
        .await;
    assert_eq!(patched["enabled"], false);
    assert_eq!(patched["events"], json!(["agent.create.after"]));
    assert!(!patched.to_string().contains("another-secret"));
    ana.api
        .refused(
            Method::PATCH,
            &format!("/v1/hooks/{id}"),
            Some(json!({"url": "http://192.168.1.1/"})),
            422,
            "validation_failed",
        )
        .await;

    // Server-wide hooks are for admins.
    ana.api
        .refused(
            Method::POST,
            "/v1/hooks",
            Some(
                json!({"name": "srv", "events": ["agent.turn.after"], "url": "http://127.0.0.1:9/",
                "secret": SECRET, "team_id": null}),
            ),
            403,
            "forbidden",
        )
        .await;
    let server = app
        .post_ok(
            "/v1/hooks",
            json!({"name": "srv", "events": ["agent.turn.after"], "url": "http://127.0.0.1:9/",
                "secret": SECRET, "team_id": null}),
            201,
        )
        .await;
    assert!(server["team_id"].is_null(), "{server}");
    ana.api
        .refused(
            Method::GET,
            &format!("/v1/hooks/{}", server["id"].as_str().unwrap()),
            None,
            404,
            "not_found",
        )
        .await;

    // Deleting; the audit log has the three actions, with no secret.
    ana.api
        .ok(Method::DELETE, &format!("/v1/hooks/{id}"), None, 204)
        .await;
    ana.api
        .refused(
            Method::GET,
            &format!("/v1/hooks/{id}"),
            None,
            404,
            "not_found",
        )
        .await;
    let audit = ana
        .api
        .ok(
            Method::GET,
            &format!("/v1/audit?team_id={team_a}"),
            None,
            200,
        )
        .await;
    let actions: Vec<&str> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    for a in ["hook.create", "hook.update", "hook.delete"] {
        assert!(actions.contains(&a), "{actions:?}");
    }
    assert!(!audit.to_string().contains(SECRET));
    assert!(!audit.to_string().contains("another-secret"));
}

#[tokio::test]
async fn settings_file_hooks_are_server_wide_stable_and_read_only() {
    let receiver = Receiver::start().await;
    let url = receiver.url("/file");
    let app = spawn_app_with(|s| {
        s.hooks.server.push(agentry::config::FileHook {
            name: "audit-sink".into(),
            events: vec!["workspace.create.after".into()],
            url: url.clone(),
            secret: agentry::config::Secret::new(SECRET),
            project_id: None,
            labels: Default::default(),
            enabled: true,
        });
    })
    .await;
    let listed = app.get_ok("/v1/hooks").await;
    let file = &listed["items"][0];
    assert_eq!(file["source"], "settings", "{listed}");
    assert!(file["team_id"].is_null());
    let id = file["id"].as_str().unwrap().to_owned();
    let res = app
        .client
        .patch(app.url(&format!("/v1/hooks/{id}")))
        .bearer_auth(&app.token)
        .json(&json!({"enabled": false}))
        .send()
        .await
        .unwrap();
    refused(res, 409, "hook_read_only").await;
    refused(
        app.delete(&format!("/v1/hooks/{id}")).await,
        409,
        "hook_read_only",
    )
    .await;

    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let got = receiver
        .wait_for("workspace.create.after", 1, Duration::from_secs(20))
        .await;
    assert_eq!(got[0].body["payload"]["workspace"]["id"], ws["id"]);
    // Recorded as delivered (a stop in between would leave it pending, to be sent again).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let d = app.get_ok(&format!("/v1/hooks/{id}/deliveries")).await;
        if d["items"][0]["status"] == "delivered" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the delivery was never recorded as delivered: {d}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The same name is the same hook after a restart.
    let (db, dir, token) = app.stop().await;
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.hooks.server.push(agentry::config::FileHook {
            name: "audit-sink".into(),
            events: vec!["workspace.create.after".into()],
            url: url.clone(),
            secret: agentry::config::Secret::new(SECRET),
            project_id: None,
            labels: Default::default(),
            enabled: true,
        });
    })
    .await;
    let listed = app.get_ok("/v1/hooks").await;
    assert_eq!(listed["items"][0]["id"], id.as_str());
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
    let deliveries = app.get_ok(&format!("/v1/hooks/{id}/deliveries")).await;
    assert_eq!(
        deliveries["items"][0]["status"], "delivered",
        "{deliveries}"
    );
}

#[tokio::test]
async fn workspace_create_before_keeps_replaces_or_fails_the_creation() {
    let app = app().await;
    let receiver = Receiver::start().await;
    let gate = hook(
        &app,
        "gate",
        &["workspace.create.before"],
        &receiver.url("/gate"),
    )
    .await;
    let gate_id = gate["id"].as_str().unwrap().to_owned();
    let repo = git_repo();
    let project = app.project(repo.path()).await;

    // 204: unchanged.
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "first"}),
            201,
        )
        .await;
    assert_eq!(ws["title"], "first");
    let seen = receiver.of("workspace.create.before");
    assert_eq!(seen[0].body["payload"]["request"]["title"], "first");
    assert_eq!(seen[0].body["team_id"], ws_team(&app, &project).await);
    assert!(seen[0].body["id"].as_str().unwrap().starts_with("dlv_"));
    assert_eq!(seen[0].delivery, seen[0].body["id"].as_str().unwrap());

    // 200 with a replacement: the whole request is replaced.
    receiver.answer(|r| {
        let mut req = r.body["payload"]["request"].clone();
        req["title"] = json!("renamed by policy");
        req["branch"] = json!("policy/chosen");
        Reply::Json(200, json!({"request": req}))
    });
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "second"}),
            201,
        )
        .await;
    assert_eq!(ws["title"], "renamed by policy");
    assert_eq!(ws["branch"], "policy/chosen");

    let before = workspaces(&app).await.len();
    let branches_before = branches(repo.path());
    // Each failure: 422 hook_failed naming the hook, nothing made.
    let cases: Vec<(Reply, &str)> = vec![
        (
            Reply::Json(
                200,
                json!({"request": {"project_id": project["id"], "colour": "red"}}),
            ),
            "not a workspace request",
        ),
        (
            Reply::Json(200, json!({"title": "no request key"})),
            "without a JSON object",
        ),
        (Reply::Raw(200, "not json".into()), "without a JSON object"),
        (Reply::Status(500), "500"),
        (Reply::Status(201), "201"),
        (Reply::Status(302), "302"),
        (Reply::Slow(Duration::from_secs(4)), "no answer within 2 s"),
    ];
    for (reply, why) in cases {
        let r = reply.clone();
        receiver.answer(move |_| r.clone());
        let res = app
            .post(
                "/v1/workspaces",
                json!({"project_id": project["id"], "title": "vetoed"}),
            )
            .await;
        let body = refused(res, 422, "hook_failed").await;
        let detail = body["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("hook gate ({gate_id}) failed: ")) && detail.contains(why),
            "{reply:?}: {detail}"
        );
    }
    assert_eq!(workspaces(&app).await.len(), before);
    assert_eq!(branches(repo.path()), branches_before);
    // Each refusal is in the audit log, with who asked.
    let audit = app.get_ok("/v1/audit?limit=200").await;
    let fails: Vec<&Value> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "hook.fail")
        .collect();
    assert_eq!(fails.len(), 7, "{audit}");
    assert_eq!(fails[0]["target"]["id"], gate_id.as_str());
    assert_eq!(fails[0]["details"]["event"], "workspace.create.before");
    assert_eq!(fails[0]["actor"]["kind"], "admin");
    // Each call is listed with its outcome.
    let deliveries = app.get_ok(&format!("/v1/hooks/{gate_id}/deliveries")).await;
    let items = deliveries["items"].as_array().unwrap();
    assert_eq!(items.len(), 9, "{deliveries}");
    assert_eq!(items[0]["status"], "failed");
    assert_eq!(items[8]["status"], "delivered");
    assert_eq!(items[8]["response_status"], 204);
    // A waiting call belonged to its operation: it is not sent again.
    let res = app
        .post(
            &format!(
                "/v1/hooks/{gate_id}/deliveries/{}/redeliver",
                items[0]["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    refused(res, 404, "not_found").await;

    // A disabled hook is not called.
    app.client
        .patch(app.url(&format!("/v1/hooks/{gate_id}")))
        .bearer_auth(&app.token)
        .json(&json!({"enabled": false}))
        .send()
        .await
        .unwrap();
    app.post_ok(
        "/v1/workspaces",
        json!({"project_id": project["id"], "title": "free"}),
        201,
    )
    .await;
}

/// The team id of `project`'s team, as hook bodies carry it.
async fn ws_team(app: &TestApp, project: &Value) -> Value {
    let p = app
        .get_ok(&format!("/v1/projects/{}", project["id"].as_str().unwrap()))
        .await;
    p["team_id"].clone()
}

#[tokio::test]
async fn worktree_hooks_choose_branch_and_destination_and_a_failing_after_hook_removes_the_worktree()
 {
    let app = app().await;
    let receiver = Receiver::start().await;
    hook(
        &app,
        "placement",
        &["worktree.create.before"],
        &receiver.url("/before"),
    )
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let root = app.data_dir.path().join("worktrees");
    let chosen = root.join("placed").join("feature-x");
    let dest = chosen.clone();
    receiver.answer(move |r| {
        let mut req = r.body["payload"]["request"].clone();
        req["branch"] = json!("feature/x");
        req["path"] = json!(dest);
        Reply::Json(200, json!({"request": req}))
    });
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    assert_eq!(ws["branch"], "feature/x");
    assert_eq!(ws["path"], chosen.to_string_lossy().as_ref());
    assert!(chosen.join("README.md").exists());
    let request = &receiver.of("worktree.create.before")[0].body["payload"]["request"];
    assert_eq!(request["project_id"], project["id"]);
    assert_eq!(request["base_ref"], "main");
    assert!(request["branch"].as_str().unwrap().starts_with("agentry/"));

    // Destinations outside the data dir, relative, existing, or a changed project fail.
    let before = workspaces(&app).await.len();
    let branches_before = branches(repo.path());
    let outside = tempfile::tempdir().unwrap();
    let bad: Vec<Value> = vec![
        json!({"path": outside.path().join("w")}),
        json!({"path": "relative/dir"}),
        json!({"path": root.join("..").join("escape")}),
        json!({"path": chosen}),
        json!({"project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"}),
        json!({"branch": "bad..branch"}),
    ];
    for change in bad {
        let c = change.clone();
        let next = root.join("placed").join("next");
        receiver.answer(move |r| {
            let mut req = r.body["payload"]["request"].clone();
            req["path"] = json!(next);
            for (k, v) in c.as_object().unwrap() {
                req[k] = v.clone();
            }
            Reply::Json(200, json!({"request": req}))
        });
        let res = app
            .post("/v1/workspaces", json!({"project_id": project["id"]}))
            .await;
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap();
        assert!(
            (status == 422
                && ["hook_failed", "validation_failed"].contains(&body["code"].as_str().unwrap())),
            "{change}: {status} {body}"
        );
    }
    assert_eq!(workspaces(&app).await.len(), before);
    assert_eq!(branches(repo.path()), branches_before);
    assert!(!outside.path().join("w").exists());

    // worktree.create.after: the worktree exists while it runs; a failure removes it.
    receiver.answer(|_| Reply::Status(204));
    let after = Receiver::start().await;
    hook(
        &app,
        "warm-caches",
        &["worktree.create.after"],
        &after.url("/after"),
    )
    .await;
    after.answer(|r| {
        let path = r.body["payload"]["worktree"]["path"].as_str().unwrap();
        if std::path::Path::new(path).join("README.md").exists() {
            Reply::Status(500)
        } else {
            Reply::Status(409)
        }
    });
    let res = app
        .post(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "doomed"}),
        )
        .await;
    let body = refused(res, 422, "hook_failed").await;
    assert!(body["detail"].as_str().unwrap().contains("500"), "{body}");
    let got = after.of("worktree.create.after");
    let made = got[0].body["payload"]["worktree"].clone();
    assert_eq!(
        made["source_checkout"],
        repo.path().to_string_lossy().as_ref()
    );
    assert!(!std::path::Path::new(made["path"].as_str().unwrap()).exists());
    assert!(
        !branches(repo.path()).contains(made["branch"].as_str().unwrap()),
        "{}",
        branches(repo.path())
    );
    assert_eq!(workspaces(&app).await.len(), before);
    // Acknowledged: the workspace is made.
    after.answer(|_| Reply::Status(204));
    app.post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
}

fn digest(value: &str) -> String {
    hex::encode(Sha256::digest(value.as_bytes()))
}

#[tokio::test]
async fn agent_hooks_run_server_first_accumulate_env_that_reaches_the_process_and_is_never_stored()
{
    let app = app().await;
    let srv = Receiver::start().await;
    let team_rx = Receiver::start().await;
    // A server-wide hook (admins), then a team hook: called in that order.
    app.post_ok(
        "/v1/hooks",
        json!({"name": "company", "events": ["agent.create.before", "agent.open.before"],
            "url": srv.url("/company"), "secret": SECRET, "team_id": null}),
        201,
    )
    .await;
    hook(
        &app,
        "team-env",
        &["agent.open.before"],
        &team_rx.url("/team"),
    )
    .await;
    srv.answer(|r| {
        let mut req = r.body["payload"]["request"].clone();
        if r.event == "agent.create.before" {
            req["config"]["title"] = json!("titled by policy");
            req["config"]["labels"]["owner"] = json!("platform");
            req["env"] = json!({"FIRST_VAR": "first-secret-value"});
        } else {
            req["env"]["SECOND_VAR"] = json!("second-secret-value");
        }
        Reply::Json(200, json!({"request": req}))
    });
    // The team hook sees what the server hook made, and adds to it.
    team_rx.answer(|r| {
        let req = &r.body["payload"]["request"];
        if req["env"]["SECOND_VAR"] != "second-secret-value" {
            return Reply::Status(412);
        }
        let mut req = req.clone();
        req["env"]["THIRD_VAR"] = json!("third-secret-value");
        Reply::Json(200, json!({"request": req}))
    });
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "title": "mine",
                "labels": {"ci": "1"}, "prompt": "/env FIRST_VAR"}),
            201,
        )
        .await;
    let id = agent["id"].as_str().unwrap().to_owned();
    assert_eq!(agent["title"], "titled by policy");
    assert_eq!(agent["labels"], json!({"ci": "1", "owner": "platform"}));
    let create = &srv.of("agent.create.before")[0].body["payload"]["request"];
    assert_eq!(create["config"]["workspace_id"], ws["id"]);
    assert!(create["config"].get("prompt").is_none(), "{create}");
    let open = &team_rx.of("agent.open.before")[0].body["payload"]["request"];
    assert_eq!(open["agent_id"], id.as_str());
    assert_eq!(open["env"]["FIRST_VAR"], "first-secret-value");
    app.wait(&id).await;
    for name in ["SECOND_VAR", "THIRD_VAR"] {
        app.post_ok(
            &format!("/v1/agents/{id}/messages"),
            json!({"text": format!("/env {name}")}),
            202,
        )
        .await;
        app.wait(&id).await;
    }
    let text = serde_json::to_string(&app.timeline(&id).await).unwrap();
    for (name, value) in [
        ("FIRST_VAR", "first-secret-value"),
        ("SECOND_VAR", "second-secret-value"),
        ("THIRD_VAR", "third-secret-value"),
    ] {
        assert!(
            text.contains(&format!("{name} sha256={}", digest(value))),
            "{name} did not reach the process: {text}"
        );
    }

    // Reopened after a close: agent.open.before runs again.
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    app.post_ok(
        &format!("/v1/agents/{id}/messages"),
        json!({"text": "/env THIRD_VAR"}),
        202,
    )
    .await;
    app.wait(&id).await;
    assert_eq!(team_rx.of("agent.open.before").len(), 2);
    let text = serde_json::to_string(&app.timeline(&id).await).unwrap();
    assert_eq!(
        text.matches(&format!(
            "THIRD_VAR sha256={}",
            digest("third-secret-value")
        ))
        .count(),
        2
    );

    // The values are nowhere at rest: not in a timeline, the audit log, a delivery.
    let audit = app.get_ok("/v1/audit").await.to_string();
    let stored: Vec<String> = sqlx::query_scalar("SELECT body FROM hook_deliveries")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    let agents_row: Vec<String> = sqlx::query_scalar("SELECT row_to_json(a)::text FROM agents a")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    for value in [
        "first-secret-value",
        "second-secret-value",
        "third-secret-value",
    ] {
        assert!(!text.contains(value) && !audit.contains(value));
        assert!(stored.iter().all(|b| !b.contains(value)), "{stored:?}");
        assert!(agents_row.iter().all(|b| !b.contains(value)));
    }

    // A replacement outside the limits fails the creation, leaving no agent.
    srv.answer(|r| {
        let mut req = r.body["payload"]["request"].clone();
        if r.event == "agent.create.before" {
            req["config"]["workspace_id"] = json!("wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b");
        }
        Reply::Json(200, json!({"request": req}))
    });
    let count = app.get_ok("/v1/agents").await["items"]
        .as_array()
        .unwrap()
        .len();
    let res = app
        .post(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock"}),
        )
        .await;
    let body = refused(res, 422, "hook_failed").await;
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .starts_with("hook company (hook_"),
        "{body}"
    );
    assert!(
        body["detail"].as_str().unwrap().contains("workspace_id"),
        "{body}"
    );
    // With a workspace to make in the same call: neither is left behind.
    let spaces = workspaces(&app).await.len();
    let res = app
        .post(
            "/v1/agents",
            json!({"workspace": {"project_id": project["id"]}, "provider": "mock"}),
        )
        .await;
    refused(res, 422, "hook_failed").await;
    assert_eq!(workspaces(&app).await.len(), spaces);
    // An open hook that fails (bad env name) leaves no agent either.
    srv.answer(|r| {
        let mut req = r.body["payload"]["request"].clone();
        if r.event == "agent.open.before" {
            req["env"]["bad name"] = json!("x");
        }
        Reply::Json(200, json!({"request": req}))
    });
    let res = app
        .post(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock"}),
        )
        .await;
    refused(res, 422, "hook_failed").await;
    // An MCP server colliding with a saved one names both sources.
    srv.answer(|r| {
        let mut req = r.body["payload"]["request"].clone();
        if r.event == "agent.open.before" {
            req["mcp_servers"]["tools"] =
                json!({"type": "http", "url": "https://tools.example.com/mcp"});
        }
        Reply::Json(200, json!({"request": req}))
    });
    let res = app
        .post(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock",
                "mcp_servers": {"tools": {"type": "http", "url": "https://tools.example.com/saved"}}}),
        )
        .await;
    let body = refused(res, 422, "hook_failed").await;
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("hook company (") && detail.contains("saved MCP server `tools`"),
        "{detail}"
    );
    assert_eq!(
        app.get_ok("/v1/agents").await["items"]
            .as_array()
            .unwrap()
            .len(),
        count
    );
}

/// Two `agent.create.before` hooks, the first answering 200 with exactly the request it
/// got: the second sees the same configuration (no field added, `prompt` still absent)
/// and the agent is created with the caller's prompt.
#[tokio::test]
async fn a_chain_of_create_hooks_passes_an_unchanged_config_on_as_it_was() {
    let app = app().await;
    let first = Receiver::start().await;
    let second = Receiver::start().await;
    hook(&app, "echo", &["agent.create.before"], &first.url("/echo")).await;
    hook(
        &app,
        "check",
        &["agent.create.before"],
        &second.url("/check"),
    )
    .await;
    let echo = |r: &Received| Reply::Json(200, json!({"request": r.body["payload"]["request"]}));
    first.answer(echo);
    second.answer(echo);
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "hello"}),
            201,
        )
        .await;
    let seen_first = &first.of("agent.create.before")[0].body["payload"]["request"];
    let seen_second = &second.of("agent.create.before")[0].body["payload"]["request"];
    assert_eq!(seen_first, seen_second);
    assert!(
        seen_second["config"].get("prompt").is_none(),
        "{seen_second}"
    );
    let id = agent["id"].as_str().unwrap();
    app.wait(id).await;
    let text = serde_json::to_string(&app.timeline(id).await).unwrap();
    assert!(text.contains("hello"), "{text}");
}

/// Wait until the agent waits for an answer (`wait` returns then); its pending request.
async fn pending(app: &TestApp, agent: &str) -> Value {
    let w = app.wait(agent).await;
    assert_eq!(w["status"], "waiting_permission", "{w}");
    let p = app
        .get_ok(&format!("/v1/agents/{agent}/permissions?status=pending"))
        .await;
    p["items"][0].clone()
}

#[tokio::test]
async fn a_policy_bot_answers_permissions_from_notifications_and_every_notification_arrives() {
    let app = app().await;
    let rx = Receiver::start().await;
    let all = [
        "workspace.create.after",
        "workspace.archive.after",
        "agent.create.after",
        "agent.close.after",
        "agent.archive.after",
        "agent.turn.before",
        "agent.turn.after",
        "agent.permission.before",
        "agent.permission.after",
    ];
    hook(&app, "bot", &all, &rx.url("/bot")).await;
    // A hook narrowed to other labels hears no agent event.
    let narrow = Receiver::start().await;
    app.post_ok(
        "/v1/hooks",
        json!({"name": "narrow", "events": ["agent.turn.after", "agent.create.after"],
            "url": narrow.url("/n"), "secret": SECRET, "labels": {"team": "other"}}),
        201,
    )
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    // A hook narrowed to another project hears nothing of this one.
    let other_repo = git_repo();
    let other = app
        .post_ok(
            "/v1/projects",
            json!({"name": "other", "repo_path": other_repo.path()}),
            201,
        )
        .await;
    let elsewhere = Receiver::start().await;
    app.post_ok(
        "/v1/hooks",
        json!({"name": "elsewhere", "events": all, "url": elsewhere.url("/e"),
            "secret": SECRET, "project_id": other["id"]}),
        201,
    )
    .await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "labels": {"team": "infra"}}),
            201,
        )
        .await;
    let id = agent["id"].as_str().unwrap().to_owned();
    app.wait(&id).await;

    // The bot: reads each `agent.permission.before`, decides by the request, answers
    // through the permissions API.
    let mut outcomes = Vec::new();
    for (n, command) in ["rm -rf /", "git status"].into_iter().enumerate() {
        app.post_ok(
            &format!("/v1/agents/{id}/messages"),
            json!({"text": format!("/ask {command}")}),
            202,
        )
        .await;
        let asked = rx
            .wait_for("agent.permission.before", n + 1, Duration::from_secs(20))
            .await;
        let payload = &asked[n].body["payload"];
        assert_eq!(payload["agent"]["id"], id.as_str());
        let request = &payload["request"];
        assert_eq!(request["status"], "pending", "{payload}");
        let title = request["title"].as_str().unwrap();
        let behavior = if title.contains("rm -rf") {
            "deny"
        } else {
            "allow"
        };
        let request_id = request["request_id"].as_str().unwrap();
        assert_eq!(pending(&app, &id).await["request_id"], request_id);
        app.post_ok(
            &format!("/v1/agents/{id}/permissions/{request_id}"),
            json!({"behavior": behavior}),
            200,
        )
        .await;
        app.wait(&id).await;
        outcomes.push(behavior);
    }
    let text = serde_json::to_string(&app.timeline(&id).await).unwrap();
    assert!(text.contains("deny") && text.contains("allow"), "{text}");
    let resolved = rx
        .wait_for("agent.permission.after", 2, Duration::from_secs(20))
        .await;
    let got: Vec<&str> = resolved
        .iter()
        .map(|r| {
            r.body["payload"]["resolution"]["behavior"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(got, outcomes);
    let turns = rx
        .wait_for("agent.turn.after", 2, Duration::from_secs(20))
        .await;
    let before = rx.of("agent.turn.before");
    assert_eq!(before.len(), 2);
    for (b, a) in before.iter().zip(&turns) {
        assert_eq!(b.body["payload"]["turn_id"], a.body["payload"]["turn_id"]);
        assert_eq!(a.body["payload"]["outcome"], "completed");
        assert!(a.body["payload"]["error"].is_null());
    }
    // A failing turn carries its outcome and error.
    app.post_ok(
        &format!("/v1/agents/{id}/messages"),
        json!({"text": "/fail out of coffee"}),
        202,
    )
    .await;
    let turns = rx
        .wait_for("agent.turn.after", 3, Duration::from_secs(20))
        .await;
    assert_eq!(turns[2].body["payload"]["outcome"], "failed");
    assert!(
        turns[2].body["payload"]["error"]
            .as_str()
            .unwrap()
            .contains("out of coffee")
    );

    app.delete(&format!("/v1/agents/{id}")).await;
    app.post_ok(
        &format!("/v1/workspaces/{}/archive", ws["id"].as_str().unwrap()),
        json!({}),
        200,
    )
    .await;
    rx.wait_for("workspace.archive.after", 1, Duration::from_secs(20))
        .await;
    let archived = rx
        .wait_for("agent.archive.after", 1, Duration::from_secs(20))
        .await;
    assert!(archived[0].body["payload"]["archived_at"].is_string());
    for event in all {
        assert!(!rx.of(event).is_empty(), "no {event}");
    }
    assert_eq!(
        rx.of("agent.close.after")[0].body["payload"]["agent"]["id"],
        id.as_str()
    );
    assert_eq!(
        rx.of("agent.create.after")[0].body["payload"]["agent"]["labels"],
        json!({"team": "infra"})
    );
    // Every body has the delivery envelope; ids are unique.
    let got = rx.got();
    let mut ids: Vec<&str> = got.iter().map(|r| r.delivery.as_str()).collect();
    for r in &got {
        assert_eq!(r.body["hook"], r.event.as_str());
        assert_eq!(r.body["id"], r.delivery.as_str());
        assert!(r.body["at"].is_string() && r.body["team_id"].is_string());
        assert!(!r.raw.contains(&app.token));
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), got.len());
    assert!(narrow.got().is_empty(), "{:?}", narrow.got());
    assert!(elsewhere.got().is_empty(), "{:?}", elsewhere.got());
    app.post_ok("/v1/workspaces", json!({"project_id": other["id"]}), 201)
        .await;
    elsewhere
        .wait_for("workspace.create.after", 1, Duration::from_secs(20))
        .await;
}

/// The hook's deliveries, as the API lists them.
async fn deliveries(app: &TestApp, hook: &Value) -> Vec<Value> {
    app.get_ok(&format!(
        "/v1/hooks/{}/deliveries",
        hook["id"].as_str().unwrap()
    ))
    .await["items"]
        .as_array()
        .unwrap()
        .clone()
}

async fn delivered(app: &TestApp, hook: &Value, within: Duration) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let items = deliveries(app, hook).await;
        if !items.is_empty() && items.iter().all(|d| d["status"] == "delivered") {
            return items;
        }
        assert!(tokio::time::Instant::now() < deadline, "{items:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn notifications_are_retried_until_the_receiver_comes_back() {
    let app = app().await;
    let rx = Receiver::start().await;
    let addr = rx.addr;
    let h = hook(&app, "flaky", &["workspace.create.after"], &rx.url("/in")).await;
    drop(rx); // the receiver is down: wait until its port refuses connections
    eventually(
        "the receiver to stop listening",
        Duration::from_secs(10),
        || std::net::TcpStream::connect(addr).is_err(),
    )
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let started = std::time::Instant::now();
    app.post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    // The creation was not held up by the dead receiver.
    assert!(started.elapsed() < Duration::from_secs(2));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let first = loop {
        let items = deliveries(&app, &h).await;
        if items
            .first()
            .is_some_and(|d| d["attempts"].as_i64() >= Some(2))
        {
            break items[0].clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "{items:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(first["status"], "pending");
    assert!(first["error"].is_string(), "{first}");
    // Back up on the same address: the retry gets through, with the same delivery id.
    let rx = Receiver::start_on(addr).await;
    let items = delivered(&app, &h, Duration::from_secs(30)).await;
    assert_eq!(items[0]["id"], first["id"]);
    assert_eq!(items[0]["response_status"], 204);
    assert!(items[0]["delivered_at"].is_string());
    assert_eq!(
        rx.of("workspace.create.after")[0].delivery,
        first["id"].as_str().unwrap()
    );
}

#[tokio::test]
async fn the_outbox_survives_a_restart_and_a_delivery_can_be_sent_again() {
    let app = app().await;
    let rx = Receiver::start().await;
    rx.answer(|_| Reply::Status(503));
    let h = hook(&app, "durable", &["workspace.create.after"], &rx.url("/in")).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    app.post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    rx.wait_for("workspace.create.after", 1, Duration::from_secs(20))
        .await;
    let items = deliveries(&app, &h).await;
    assert_eq!(items[0]["status"], "pending");
    assert_eq!(items[0]["response_status"], 503);
    let (db, dir, token) = app.stop().await;
    let seen_while_down = rx.of("workspace.create.after").len();

    rx.answer(|_| Reply::Status(204));
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.hooks.allow_private_networks = true;
        s.hooks.timeout_s = 2;
    })
    .await;
    let items = delivered(&app, &h, Duration::from_secs(30)).await;
    assert_eq!(items.len(), 1);
    let got = rx.of("workspace.create.after");
    assert!(got.len() > seen_while_down);
    // Every attempt carried the same delivery id and the same body.
    assert!(
        got.iter()
            .all(|r| r.delivery == items[0]["id"].as_str().unwrap())
    );
    assert!(got.iter().all(|r| r.raw == got[0].raw));

    // Redeliver: sent once more, same id.
    let n = got.len();
    let res = app
        .post(
            &format!(
                "/v1/hooks/{}/deliveries/{}/redeliver",
                h["id"].as_str().unwrap(),
                items[0]["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!(res.status(), 202);
    let again = rx
        .wait_for("workspace.create.after", n + 1, Duration::from_secs(20))
        .await;
    assert_eq!(again[n].delivery, items[0]["id"].as_str().unwrap());
    delivered(&app, &h, Duration::from_secs(20)).await;
    // An unknown delivery is missing.
    let res = app
        .post(
            &format!(
                "/v1/hooks/{}/deliveries/dlv_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b/redeliver",
                h["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    refused(res, 404, "not_found").await;
}

#[tokio::test]
async fn a_team_hook_never_reaches_a_private_address_even_when_its_name_resolves_to_one() {
    // Default settings: private networks are off for team hooks.
    let app = spawn_app().await;
    let rx = Receiver::start().await;
    // A loopback literal is refused at creation; a name that resolves to loopback is
    // refused when called (so DNS cannot rebind around the first check).
    let res = app
        .post(
            "/v1/hooks",
            json!({"name": "sneaky", "events": ["workspace.create.after"],
                "url": rx.url("/in"), "secret": SECRET}),
        )
        .await;
    refused(res, 422, "validation_failed").await;
    // The machine's own name resolves to a loopback or private address here (and on
    // any ordinary host), but it is no literal address: accepted at creation.
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost.localdomain".into());
    let resolved: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
        .await
        .map(|a| a.collect())
        .unwrap_or_default();
    assert!(
        !resolved.is_empty(),
        "{host} does not resolve on this machine"
    );
    let res = app
        .post(
            "/v1/hooks",
            json!({"name": "sneaky", "events": ["workspace.create.after"],
                "url": format!("http://{host}:{}/in", rx.addr.port()), "secret": SECRET}),
        )
        .await;
    assert_eq!(res.status(), 201);
    let created: Option<Value> = res.json().await.ok();
    let h = created.expect("a host name is accepted at creation");
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    app.post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let items = deliveries(&app, &h).await;
        if let Some(d) = items
            .first()
            .filter(|d| d["attempts"].as_i64() >= Some(1) && d["error"].is_string())
        {
            assert_eq!(d["status"], "pending");
            let error = d["error"].as_str().unwrap();
            assert!(
                error.contains("a loopback, private or link-local address"),
                "{host} ({resolved:?}): {error}"
            );
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{items:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(rx.got().is_empty(), "the receiver was reached");
}

#[tokio::test]
async fn rotating_the_secrets_key_moves_hook_secrets_and_they_still_sign() {
    use crate::secrets::{rotate, with_keys};
    let rx = Receiver::start().await;
    let app = spawn_app_with(|s| {
        s.hooks.allow_private_networks = true;
        with_keys(s, 1, &[]);
    })
    .await;
    let h = hook(
        &app,
        "rotating",
        &["workspace.create.after"],
        &rx.url("/in"),
    )
    .await;
    let (db, dir, token) = app.stop().await;
    let (ok, out) = rotate(&db, dir.path(), 2, &[1]);
    assert!(ok && out.contains("hook secrets: 1 moved"), "{out}");
    assert!(!out.contains(SECRET), "{out}");
    // Under the new key alone the hook still signs with its secret.
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.hooks.allow_private_networks = true;
        with_keys(s, 2, &[]);
    })
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    app.post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    delivered(&app, &h, Duration::from_secs(20)).await;
    assert_eq!(rx.of("workspace.create.after").len(), 1);
}

// ---- crashes ---------------------------------------------------------------------------

/// The URL the database of `db` is reached at, for a server in another process.
fn database_url(db: &sqlx::postgres::PgConnectOptions) -> String {
    let name = db.get_database().expect("a database name");
    let mut url = match std::env::var("DATABASE_URL") {
        Ok(u) => url::Url::parse(&u).expect("DATABASE_URL"),
        Err(_) => {
            let mut u = url::Url::parse("postgres://localhost").unwrap();
            u.set_username(db.get_username()).unwrap();
            u.set_port(Some(db.get_port())).unwrap();
            let socket = db.get_socket().expect("the embedded cluster's socket");
            u.query_pairs_mut()
                .append_pair("host", &socket.to_string_lossy())
                .append_pair("sslmode", "disable");
            u
        }
    };
    url.set_path(&format!("/{name}"));
    url.to_string()
}

/// `agentry serve` as a real process on the test's database, so that it can be killed
/// (SIGKILL: no clean stop, nothing flushed) as a crash would; killed on drop as well.
/// Processes named in `leftovers` (its agents' provider processes) are killed on drop
/// too, in case the test fails before a restart's reconciler ends them.
struct Crashable {
    child: std::process::Child,
    base: String,
    token: String,
    client: reqwest::Client,
    leftovers: Vec<i32>,
}

impl Drop for Crashable {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in &self.leftovers {
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
    }
}

impl Crashable {
    fn start(db: &sqlx::postgres::PgConnectOptions, data_dir: &std::path::Path) -> Self {
        use std::io::{BufRead, BufReader};
        // Built first: nothing below may fail with the child running and not yet owned.
        agentry::telemetry::install_crypto_provider();
        let client = reqwest::Client::new();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = data_dir.join("crashable.toml");
        std::fs::write(
            &config,
            format!(
                "[hooks]\nallow_private_networks = true\ntimeout_s = 2\n\n[providers.mock]\ncommand = [{:?}]\n",
                env!("CARGO_BIN_EXE_agentry")
            ),
        )
        .unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
            .args(["serve", "--data-dir"])
            .arg(data_dir)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("AGENTRY_CONFIG", &config)
            .env("DATABASE_URL", database_url(db))
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut server = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            token: String::new(),
            client,
            leftovers: Vec::new(),
        };
        let mut lines = BufReader::new(stdout).lines();
        loop {
            let line = lines.next().expect("serve printed its address").unwrap();
            if line.starts_with("agt_pat_") {
                server.token = line.clone();
            }
            if line.contains("listening on") {
                break;
            }
        }
        std::thread::spawn(move || for _ in lines {});
        assert!(!server.token.is_empty(), "a bootstrap token");
        server
    }

    async fn send(&self, method: Method, path: &str, body: Option<Value>, status: u16) -> Value {
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.unwrap();
        let got = res.status().as_u16();
        let v: Value = res.json().await.unwrap_or(Value::Null);
        assert_eq!(got, status, "{path}: {v}");
        v
    }

    /// A hook, a project, a worktree and an idle mock agent; returns the agent's id.
    async fn agent(&mut self, repo: &std::path::Path, events: &[&str], url: &str) -> String {
        self.send(
            Method::POST,
            "/v1/hooks",
            Some(json!({"name": "crash", "events": events, "url": url, "secret": SECRET})),
            201,
        )
        .await;
        let project = self
            .send(
                Method::POST,
                "/v1/projects",
                Some(json!({"name": "demo", "repo_path": repo})),
                201,
            )
            .await;
        let ws = self
            .send(
                Method::POST,
                "/v1/workspaces",
                Some(json!({"project_id": project["id"]})),
                201,
            )
            .await;
        let agent = self
            .send(
                Method::POST,
                "/v1/agents",
                Some(json!({"workspace_id": ws["id"], "provider": "mock"})),
                201,
            )
            .await;
        let id = agent["id"].as_str().unwrap().to_owned();
        let idle = self
            .send(
                Method::GET,
                &format!("/v1/agents/{id}/wait?timeout_s=30"),
                None,
                200,
            )
            .await;
        assert_eq!(idle["status"], "idle", "{idle}");
        if let Some(pid) = self
            .send(Method::GET, &format!("/v1/agents/{id}"), None, 200)
            .await["runtime"]["pid"]
            .as_i64()
        {
            self.leftovers.push(pid as i32);
        }
        id
    }

    async fn prompt(&self, agent: &str, text: &str) -> String {
        let r = self
            .send(
                Method::POST,
                &format!("/v1/agents/{agent}/messages"),
                Some(json!({"text": text})),
                202,
            )
            .await;
        r["turn_id"].as_str().unwrap().to_owned()
    }

    /// SIGKILL: the server ends at once, its database connections with it.
    fn crash(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

fn restarted_settings(s: &mut agentry::config::Settings) {
    s.hooks.allow_private_networks = true;
    s.hooks.timeout_s = 2;
}

/// A server killed during a turn: the restart's reconciler fails the turn and closes the
/// agent, and the hooks hear both (`agent.turn.after` with outcome `failed` and the
/// reconciler's error, then `agent.close.after`).
#[tokio::test]
async fn a_turn_cut_short_by_a_crash_is_notified_as_failed_after_the_restart() {
    let rx = Receiver::start().await;
    let db = fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = git_repo();
    let mut server = Crashable::start(&db, dir.path());
    let events = ["agent.turn.before", "agent.turn.after", "agent.close.after"];
    let agent = server.agent(repo.path(), &events, &rx.url("/in")).await;
    let turn = server.prompt(&agent, "/sleep 60000").await;
    rx.wait_for("agent.turn.before", 1, Duration::from_secs(20))
        .await;
    server.crash();
    assert!(rx.of("agent.turn.after").is_empty());
    assert!(rx.of("agent.close.after").is_empty());

    let token = server.token.clone();
    let app = spawn_on_with(db, dir, Some(token), restarted_settings).await;
    let after = rx
        .wait_for("agent.turn.after", 1, Duration::from_secs(30))
        .await;
    let payload = &after[0].body["payload"];
    assert_eq!(payload["turn_id"], turn, "{payload}");
    assert_eq!(payload["outcome"], "failed", "{payload}");
    assert_eq!(payload["error"], "the server stopped during this turn");
    assert_eq!(payload["agent"]["id"], agent);
    let closed = rx
        .wait_for("agent.close.after", 1, Duration::from_secs(30))
        .await;
    assert_eq!(closed[0].body["payload"]["agent"]["id"], agent);
    assert_eq!(closed[0].body["payload"]["agent"]["status"], "closed");
    // Told once each. A duplicate would arrive after the first, and no event says none
    // is coming, so this pause is the check itself: half a second for a repeat to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rx.of("agent.turn.after").len(), 1);
    assert_eq!(rx.of("agent.close.after").len(), 1);
    assert!(rx.bad_signatures.lock().unwrap().is_empty());
    app.stop().await;
}

/// Moments committed with their events but not yet turned into outbox rows when the
/// server dies are not lost: the restarted server queues and delivers them. The test
/// holds a lock on the outbox table, so the killed server's moments worker is stuck in
/// its transaction (as on a slow database) when the crash comes.
#[tokio::test]
async fn moments_stored_before_a_crash_are_delivered_after_the_restart() {
    let rx = Receiver::start().await;
    let db = fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = git_repo();
    let mut server = Crashable::start(&db, dir.path());
    let agent = server
        .agent(repo.path(), &["agent.turn.after"], &rx.url("/in"))
        .await;

    let pool = agentry::store::connect(db.clone(), 2).await.unwrap();
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE hook_deliveries IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let turn = server.prompt(&agent, "hello").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stored: i64 =
            sqlx::query_scalar("SELECT count(*) FROM agent_moments WHERE kind = 'turn_ended'")
                .fetch_one(&pool)
                .await
                .unwrap();
        if stored == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the turn's end was never stored as a moment"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.crash();
    blocker.rollback().await.unwrap();
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM hook_deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(queued, 0, "nothing reached the outbox before the crash");
    assert!(rx.of("agent.turn.after").is_empty());

    let token = server.token.clone();
    let app = spawn_on_with(db, dir, Some(token), restarted_settings).await;
    let after = rx
        .wait_for("agent.turn.after", 1, Duration::from_secs(30))
        .await;
    assert_eq!(after[0].body["payload"]["turn_id"], turn);
    assert_eq!(after[0].body["payload"]["outcome"], "completed");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_moments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "every moment was turned into its notifications");
    app.stop().await;
}

/// A moment is stored only while a hook listens for it, so a server without hooks pays
/// nothing for them on every turn: with no hook, a turn stores no moment; a disabled hook
/// and a hook of another team change nothing; a hook of the agent's team for
/// `agent.turn.after` makes the next turn store its end and not its start, and the
/// receiver hears that end. A trigger of the test's database counts every stored moment,
/// since the worker deletes them as it turns them into notifications.
#[tokio::test]
async fn only_the_moments_a_hook_listens_for_are_stored() {
    let app = app().await;
    let others = Receiver::start().await;
    let ends = Receiver::start().await;
    for sql in [
        "CREATE TABLE moments_seen (kind text)",
        "CREATE FUNCTION copy_moment() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO moments_seen VALUES (NEW.kind); RETURN NEW; END $$",
        "CREATE TRIGGER copy_moment AFTER INSERT ON agent_moments FOR EACH ROW EXECUTE FUNCTION copy_moment()",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&app.pool)
            .await
            .unwrap();
    }
    let seen = async || -> Vec<String> {
        sqlx::query_scalar("SELECT kind FROM moments_seen ORDER BY kind")
            .fetch_all(&app.pool)
            .await
            .unwrap()
    };
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    let team = app.get_ok(&format!("/v1/agents/{agent}")).await["team_id"].clone();
    let turn = async |text: &str| {
        let id = app.prompt(&agent, text).await;
        let done = app.wait(&agent).await;
        assert_eq!(done["last_turn"]["turn_id"], id.as_str(), "{done}");
        id
    };

    turn("no hook yet").await;
    assert_eq!(seen().await, Vec::<String>::new());

    let elsewhere = app
        .post_ok("/v1/teams", json!({"name": "elsewhere"}), 201)
        .await;
    app.post_ok(
        "/v1/hooks",
        json!({"name": "other-team", "events": ["agent.turn.before", "agent.turn.after"],
            "url": others.url("/other"), "secret": SECRET, "team_id": elsewhere["id"]}),
        201,
    )
    .await;
    app.post_ok(
        "/v1/hooks",
        json!({"name": "disabled", "events": ["agent.turn.before", "agent.turn.after"],
            "url": others.url("/disabled"), "secret": SECRET, "team_id": team, "enabled": false}),
        201,
    )
    .await;
    turn("hooks that do not listen").await;
    assert_eq!(seen().await, Vec::<String>::new());

    app.post_ok(
        "/v1/hooks",
        json!({"name": "ends", "events": ["agent.turn.after"], "url": ends.url("/ends"),
            "secret": SECRET, "team_id": team}),
        201,
    )
    .await;
    let heard = turn("a hook listens").await;
    assert_eq!(seen().await, vec!["turn_ended".to_owned()]);
    let after = ends
        .wait_for("agent.turn.after", 1, Duration::from_secs(20))
        .await;
    assert_eq!(after[0].body["payload"]["turn_id"], heard.as_str());
    assert!(others.got().is_empty(), "{:?}", others.got());
    app.stop().await;
}

/// Service notifications are queued in the transaction of their operation: the outbox
/// row and the agent (or workspace) it tells of were written by one transaction (the
/// same `now()`), and the row is there as soon as the operation answers.
#[tokio::test]
async fn service_notifications_are_queued_in_their_operations_transaction() {
    let app = app().await;
    let rx = Receiver::start().await;
    rx.answer(|_| Reply::Status(503));
    hook(
        &app,
        "tx",
        &["workspace.create.after", "agent.create.after"],
        &rx.url("/in"),
    )
    .await;
    let repo = git_repo();
    let (agent, ws) = app.mock_agent(repo.path()).await;
    let same_tx = |table: &'static str, event: &'static str| {
        let pool = app.pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM hook_deliveries d JOIN {table} t ON t.created_at = d.created_at
                 WHERE d.event = $1"
            )))
            .bind(event)
            .fetch_one(&pool)
            .await
            .unwrap();
            n
        }
    };
    assert_eq!(same_tx("agents", "agent.create.after").await, 1);
    assert_eq!(same_tx("workspaces", "workspace.create.after").await, 1);
    let bodies: Vec<String> = sqlx::query_scalar("SELECT body FROM hook_deliveries ORDER BY id")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(bodies.len(), 2);
    assert!(bodies.iter().any(|b| b.contains(&ws)));
    assert!(bodies.iter().any(|b| b.contains(&agent)));
}
