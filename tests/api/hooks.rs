//! Lifecycle hooks against a real webhook receiver: a small HTTP server in the test that
//! checks every signature, records what it got and answers as each test scripts it.
//! CRUD and validation, each waiting hook (unchanged, replaced, invalid, error, timeout)
//! and what the operation then did, ordering and `env` reaching the provider process, a
//! policy bot answering permission requests, and notifications that retry, survive a
//! restart and can be redelivered.

use std::collections::VecDeque;
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
mod http;

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
        let (g, b, s) = (got.clone(), bad.clone(), script.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let (g, b, s) = (g.clone(), b.clone(), s.clone());
                tokio::spawn(async move {
                    let Some((head, body)) = http::read_request(&mut stream).await else {
                        return;
                    };
                    let header = |name: &str| {
                        head.lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
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
        self.got().into_iter().filter(|r| r.event == event).collect()
    }

    /// Wait until `n` requests of `event` arrived; returns them.
    async fn wait_for(&self, event: &str, n: usize, within: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let got = self.of(event);
            if got.len() >= n {
                return got;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "waited for {n} `{event}`; got {:?}",
                self.got().iter().map(|r| &r.event).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
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
            Some(json!({"name": "tickets", "events": ["agent.turn.after", "agent.turn.after"],
                "url": "https://hooks.example.com/in", "secret": SECRET, "labels": {"ci": "1"}})),
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
    // At rest the secret is sealed, never in clear.
    let stored: Vec<u8> = sqlx::query_scalar("SELECT ciphertext FROM hooks")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(!String::from_utf8_lossy(&stored).contains(SECRET));

    // Another team's hook is missing; a viewer of the team may not read it.
    bob.api
        .refused(Method::GET, &format!("/v1/hooks/{id}"), None, 404, "not_found")
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
        .refused(Method::DELETE, &format!("/v1/hooks/{id}"), None, 404, "not_found")
        .await;
    assert_eq!(
        bob.api.ok(Method::GET, "/v1/hooks", None, 200).await["items"],
        json!([])
    );
    vic.api
        .refused(Method::GET, &format!("/v1/hooks/{id}"), None, 403, "forbidden")
        .await;
    bob.api
        .refused(
            Method::POST,
            "/v1/hooks",
            Some(json!({"name": "x", "events": ["agent.turn.after"], "url": "https://a.example.com",
                "secret": SECRET, "team_id": team_a})),
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
            Some(json!({"name": "srv", "events": ["agent.turn.after"], "url": "http://127.0.0.1:9/",
                "secret": SECRET, "team_id": null})),
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
        .refused(Method::GET, &format!("/v1/hooks/{id}"), None, 404, "not_found")
        .await;
    let audit = ana
        .api
        .ok(Method::GET, &format!("/v1/audit?team_id={team_a}"), None, 200)
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
    refused(app.delete(&format!("/v1/hooks/{id}")).await, 409, "hook_read_only").await;

    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let got = receiver
        .wait_for("workspace.create.after", 1, Duration::from_secs(20))
        .await;
    assert_eq!(got[0].body["payload"]["workspace"]["id"], ws["id"]);

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
    assert_eq!(deliveries["items"][0]["status"], "delivered", "{deliveries}");
}
