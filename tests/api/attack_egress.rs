//! The egress proxy as an agent meets it: from inside a network namespace of its own
//! (bubblewrap, the bridge first) an agent reaches an allowed host, is refused another —
//! the refusal in its timeline as `network_denied` — cannot reach anything directly, and
//! reaches a brokered model API whose key never enters the namespace. Also: a name that
//! resolves to an internal address behind a wildcard is refused, and a team's own
//! additions to the allow list are set by its owners only.
//!
//! The "outside world" here is servers on the host's loopback: internal addresses, so the
//! lists name them exactly (only an exact entry reaches an internal address).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentry::auth::tokens;
use agentry::domain::{AgentId, SecretValue};
use agentry::egress::{AgentNet, AllowList, Brokered};
use agentry::store::identity;
use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::helpers::*;

/// A plain HTTP server answering every request with `body`; records each request head
/// and counts connections.
pub(crate) struct Origin {
    pub(crate) port: u16,
    pub(crate) requests: Arc<Mutex<Vec<String>>>,
    pub(crate) connections: Arc<AtomicUsize>,
}

pub(crate) async fn origin(body: &'static str) -> Origin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(AtomicUsize::new(0));
    let (seen, count) = (requests.clone(), connections.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The whole request, body included: closing with a body unread would
                // reset the connection, and the reset can overtake the answer.
                let mut want = None;
                while want.is_none_or(|w| buf.len() < w) {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    if want.is_none() {
                        want = request_len(&buf);
                    }
                }
                seen.lock()
                    .await
                    .push(String::from_utf8_lossy(&buf).to_string());
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    Origin {
        port,
        requests,
        connections,
    }
}

/// The length of the request in `buf` (head and `Content-Length` body), once its head is
/// whole.
fn request_len(buf: &[u8]) -> Option<usize> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let body = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    Some(head_end + body)
}

fn agent_id(agent: &str) -> AgentId {
    agent.parse().expect("an agent id")
}

/// The agent's `network_denied` events, read from its SSE stream.
async fn denials_on_stream(app: &TestApp, agent: &str, want: usize) -> Vec<Value> {
    let mut stream = app.events(agent, None).await;
    let mut found = Vec::new();
    while found.len() < want {
        let events = stream
            .until("network_denied", Duration::from_secs(15))
            .await;
        found.push(events.last().unwrap().data["data"].clone());
    }
    found
}

/// What the script inside the sandbox saw, as JSON.
const INSIDE: &str = r#"
import json, os, socket, sys, urllib.error, urllib.request
allowed, denied, brokered, direct_port = sys.argv[1:5]
proxied = urllib.request.build_opener(urllib.request.ProxyHandler(
    {"http": os.environ["HTTP_PROXY"], "https": os.environ["HTTPS_PROXY"]}))
plain = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def call(opener, url, data=None):
    try:
        r = opener.open(urllib.request.Request(url, data=data), timeout=15)
        return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]
    except Exception as e:
        return [0, repr(e)]
out = {"allowed": call(proxied, allowed), "denied": call(proxied, denied),
       "brokered": call(plain, brokered, b"{}")}
try:
    socket.create_connection(("127.0.0.1", int(direct_port)), timeout=3)
    out["direct"] = "connected"
except Exception as e:
    out["direct"] = repr(e)
out["environ"] = open("/proc/self/environ", "rb").read().decode(errors="replace")
print(json.dumps(out))
"#;

/// Run `argv` under bubblewrap with the plan: a network namespace of its own, the
/// endpoint mounted, the proxy variables set, the bridge first. The rest of the sandbox
/// (the whole root read-only) is only what this test needs, not the agent sandbox.
async fn run_in_sandbox(net: &AgentNet, argv: &[&str]) -> std::process::Output {
    assert!(net.unshare_net);
    let mut cmd = tokio::process::Command::new("bwrap");
    cmd.args(["--unshare-all", "--die-with-parent"])
        .args(["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])
        .args(["--tmpfs", "/run"]);
    for (host, inside) in &net.binds {
        cmd.arg("--bind").arg(host).arg(inside);
    }
    // The test's hosts are on loopback, which the plan's NO_PROXY sends direct (meant
    // for brokered base URLs): left out here so that they go through the proxy.
    cmd.args(["--unsetenv", "NO_PROXY", "--unsetenv", "no_proxy"]);
    for (k, v) in &net.env {
        if !k.eq_ignore_ascii_case("no_proxy") {
            cmd.args(["--setenv", k, v]);
        }
    }
    // The bridge is this build's `agentry-sandbox` (the test app names this build's
    // `agentry`, and the small executable beside it runs the bridge).
    assert_eq!(
        net.argv_prefix[..2],
        [env!("CARGO_BIN_EXE_agentry-sandbox"), "bridge"]
    );
    cmd.arg("--").args(&net.argv_prefix).args(argv);
    cmd.kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .expect("the sandboxed command ends")
        .expect("bwrap runs")
}

#[tokio::test]
async fn inside_its_own_network_namespace_an_agent_reaches_only_what_is_allowed() {
    // The server's own agents share the host's network: the endpoint opened here for its
    // mock agent is the only one that agent has (none of its runtime's replaces it).
    let app = spawn_app_with(|s| s.sandbox.network = agentry::config::SandboxNetwork::Host).await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    let allowed = origin("hello from an allowed host").await;
    let upstream = origin("{\"brokered\": true}").await;
    let api_key = "sk-ant-team-secret-0123456789";
    let net = app
        .egress
        .open(
            agent_id(&agent),
            AllowList::parse(&[format!("127.0.0.1:{}", allowed.port)]).unwrap(),
            vec![Brokered {
                provider: "claude".into(),
                path_prefix: "anthropic".into(),
                upstream_base: format!("http://127.0.0.1:{}", upstream.port)
                    .parse()
                    .unwrap(),
                headers: vec![("x-api-key".into(), SecretValue::new(api_key))],
            }],
        )
        .unwrap();
    let out = run_in_sandbox(
        &net,
        &[
            "/usr/bin/python3",
            "-c",
            INSIDE,
            &format!("http://127.0.0.1:{}/allowed", allowed.port),
            "http://blocked.example.com/steal",
            &format!(
                "{}/v1/messages",
                agentry::egress::brokered_base_url("anthropic")
            ),
            app.base.rsplit(':').next().unwrap(),
        ],
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_str(stdout.trim()).expect("the script's report");

    // The allowed host answered through the proxy.
    assert_eq!(seen["allowed"], json!([200, "hello from an allowed host"]));
    assert_eq!(allowed.connections.load(Ordering::SeqCst), 1);
    // Another host: refused by the proxy with a body naming the rule.
    assert_eq!(seen["denied"][0], 403, "{seen}");
    let body = seen["denied"][1].as_str().unwrap();
    assert!(
        body.contains("blocked.example.com:80") && body.contains("not_allowed"),
        "{body}"
    );
    // Nothing is reachable without the proxy: not even the server's own port.
    assert!(
        seen["direct"]
            .as_str()
            .unwrap()
            .contains("ConnectionRefused"),
        "{seen}"
    );
    // The brokered call arrived with the team's key, which the sandbox never held.
    assert_eq!(seen["brokered"], json!([200, "{\"brokered\": true}"]));
    let upstream_seen = upstream.requests.lock().await.clone();
    assert_eq!(upstream_seen.len(), 1);
    assert!(
        upstream_seen[0].starts_with("POST /v1/messages HTTP/1.1\r\n"),
        "{upstream_seen:?}"
    );
    assert!(
        upstream_seen[0].contains(&format!("x-api-key: {api_key}\r\n")),
        "{upstream_seen:?}"
    );
    let environ = seen["environ"].as_str().unwrap();
    assert!(!environ.contains(api_key));
    assert!(
        environ.contains("HTTPS_PROXY=http://127.0.0.1:3128"),
        "{environ}"
    );

    // The refusal is in the agent's timeline, on its stream.
    let denied = denials_on_stream(&app, &agent, 1).await;
    assert_eq!(
        denied[0],
        json!({"host": "blocked.example.com", "port": 80, "reason": "not_allowed"})
    );
    let counts = app.egress.counts(agent_id(&agent)).unwrap();
    assert_eq!(counts["127.0.0.1"], 2, "{counts:?}");
    app.egress.close(agent_id(&agent));
}

#[tokio::test]
async fn a_name_that_resolves_inside_is_refused_behind_a_wildcard_and_recorded() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    let target = origin("internal service").await;
    app.egress
        .open(
            agent_id(&agent),
            AllowList::parse(&[format!("*:{}", target.port)]).unwrap(),
            vec![],
        )
        .unwrap();
    let socket = app
        .egress
        .root()
        .join(agent_id(&agent).uuid().to_string())
        .join("egress.sock");
    for request in [
        format!("CONNECT localhost:{} HTTP/1.1\r\n\r\n", target.port),
        format!(
            "GET http://localhost:{}/admin HTTP/1.1\r\nHost: localhost\r\n\r\n",
            target.port
        ),
    ] {
        let mut s = tokio::net::UnixStream::connect(&socket).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
        assert!(answer.contains("internal_address"), "{answer}");
    }
    assert_eq!(
        target.connections.load(Ordering::SeqCst),
        0,
        "the internal service was never reached"
    );
    let denied = denials_on_stream(&app, &agent, 2).await;
    for d in denied {
        assert_eq!(
            d,
            json!({"host": "localhost", "port": target.port, "reason": "internal_address"})
        );
    }
    assert!(app.egress.counts(agent_id(&agent)).unwrap().is_empty());
    // Closing the agent's endpoint removes it.
    app.egress.close(agent_id(&agent));
    assert!(!socket.exists());
}

async fn call(
    app: &TestApp,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = app.client.request(method, app.url(path)).bearer_auth(token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let text = res.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A new user with `role` in `team` and a token for them.
pub(crate) async fn user_in(app: &TestApp, team: Uuid, role: &str) -> String {
    let user = Uuid::now_v7();
    identity::insert_user(&app.pool, user, &format!("{user}@example.com"), "U", false)
        .await
        .unwrap();
    identity::upsert_member(&app.pool, team, user, role)
        .await
        .unwrap();
    let token = tokens::generate();
    identity::insert_token(
        &app.pool,
        Uuid::now_v7(),
        user,
        None,
        None,
        "t",
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &[],
        None,
    )
    .await
    .unwrap();
    token
}

async fn stored_entries(app: &TestApp, team: Uuid) -> Option<Vec<String>> {
    sqlx::query_scalar("SELECT allow FROM team_network WHERE team_id = $1")
        .bind(team)
        .fetch_optional(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn only_owners_set_their_teams_allow_list_and_bad_entries_change_nothing() {
    let app = spawn_app().await;
    let team = app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let team_uuid: Uuid = team.strip_prefix("team_").unwrap().parse().unwrap();
    let path = format!("/v1/teams/{team}/network");
    let member = user_in(&app, team_uuid, "member").await;
    let viewer = user_in(&app, team_uuid, "viewer").await;
    let other = Uuid::now_v7();
    identity::insert_team(&app.pool, other, "elsewhere")
        .await
        .unwrap();
    let outsider = user_in(&app, other, "owner").await;

    // Nothing set yet: an empty list.
    let (status, body) = call(&app, &app.token, Method::GET, &path, None).await;
    assert_eq!(status, 200);
    assert_eq!(body["allow"], json!([]));

    // The owner sets it; entries come back in their normal spelling, repeats once.
    let (status, body) = call(
        &app,
        &app.token,
        Method::PUT,
        &path,
        Some(json!({"allow": ["PyPI.org", "pypi.org", "*.pythonhosted.org", "registry.npmjs.org:443"]})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let set = json!(["pypi.org", "*.pythonhosted.org", "registry.npmjs.org:443"]);
    assert_eq!(body["allow"], set);
    assert!(body["updated_by"].as_str().unwrap().starts_with("usr_"));

    // Members and viewers read it; a member cannot change it.
    for token in [&member, &viewer] {
        let (status, body) = call(&app, token, Method::GET, &path, None).await;
        assert_eq!((status, &body["allow"]), (200, &set));
    }
    let (status, body) = call(
        &app,
        &member,
        Method::PUT,
        &path,
        Some(json!({"allow": ["*"]})),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["code"], "forbidden");
    // Another team's owner does not see the team at all.
    for method in [Method::GET, Method::PUT] {
        let (status, body) = call(
            &app,
            &outsider,
            method,
            &path,
            Some(json!({"allow": ["*"]})),
        )
        .await;
        assert_eq!(status, 404, "{body}");
    }

    // Bad entries: 422 naming the entry; nothing changes.
    for (bad, field) in [
        (
            json!(["ok.example.com", "http://evil.example.com"]),
            "allow[1]",
        ),
        (json!(["*.com"]), "allow[0]"),
        (json!(["example.com:99999"]), "allow[0]"),
        (json!(["bad host"]), "allow[0]"),
        // The server's loopback is opened only by the server's settings.
        (json!(["pypi.org", "127.0.0.1:5432"]), "allow[1]"),
        (json!(["localhost:8080"]), "allow[0]"),
        (json!(["[::1]"]), "allow[0]"),
    ] {
        let (status, body) = call(
            &app,
            &app.token,
            Method::PUT,
            &path,
            Some(json!({"allow": bad})),
        )
        .await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["code"], "validation_failed");
        assert!(body.to_string().contains(field), "{body}");
    }
    let too_many: Vec<String> = (0..101).map(|i| format!("h{i}.example.com")).collect();
    let (status, body) = call(
        &app,
        &app.token,
        Method::PUT,
        &path,
        Some(json!({"allow": too_many})),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("validation_failed"))
    );
    let (status, _) = call(
        &app,
        &app.token,
        Method::PUT,
        &path,
        Some(json!({"allow": [], "deny": []})),
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(
        stored_entries(&app, team_uuid).await,
        Some(vec![
            "pypi.org".to_owned(),
            "*.pythonhosted.org".to_owned(),
            "registry.npmjs.org:443".to_owned()
        ])
    );
    assert_eq!(
        stored_entries(&app, other).await,
        None,
        "the other team has no row"
    );

    // One audit entry: the owner's change, with the list.
    let audit = app
        .get_ok(&format!("/v1/audit?team_id={team}&action=network.set"))
        .await;
    let items = audit["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{audit}");
    assert_eq!(items[0]["details"]["allow"], set);
}

fn bridge(argv: &[&str]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"));
    c.args(["sandbox-bridge", "--listen", "127.0.0.1:0"])
        .args(["--socket", "/nonexistent/egress.sock", "--"])
        .args(argv)
        .kill_on_drop(true);
    c
}

async fn until_exists(path: &std::path::Path) {
    eventually(
        "the CLI under the bridge started",
        Duration::from_secs(10),
        || path.exists(),
    )
    .await;
}

#[tokio::test]
async fn the_bridge_passes_term_on_and_ends_as_its_cli_ended() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    // The CLI's exit code is the bridge's.
    let status = bridge(&["sh", "-c", "exit 7"]).status().await.unwrap();
    assert_eq!(status.code(), Some(7));

    // TERM to the bridge reaches the CLI, which ends its own way.
    let ready = dir.path().join("ready");
    let got = dir.path().join("got-term");
    let script = format!(
        "trap 'touch {}; exit 3' TERM; touch {}; while :; do sleep 0.1; done",
        got.display(),
        ready.display()
    );
    let mut child = bridge(&["sh", "-c", &script]).spawn().unwrap();
    until_exists(&ready).await;
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling the bridge this test started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the bridge ends")
        .unwrap();
    assert_eq!(status.code(), Some(3));
    assert!(got.exists(), "the CLI heard TERM");

    // A CLI killed by the signal: the bridge ends killed by the same signal.
    let ready = dir.path().join("ready-2");
    let script = format!("touch {}; exec sleep 30", ready.display());
    let mut child = bridge(&["sh", "-c", &script]).spawn().unwrap();
    until_exists(&ready).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    unsafe { libc::kill(child.id().unwrap() as i32, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the bridge ends")
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");

    // Started with TERM ignored, as bwrap starts it in a sandbox: it still hears TERM,
    // and the CLI it starts has TERM's default back (the sandbox runs no `env` to
    // restore it when the bridge runs first).
    let ready = dir.path().join("ready-3");
    let script = format!("touch {}; exec sleep 30", ready.display());
    let mut command = bridge(&["sh", "-c", &script]);
    // SAFETY: `signal` is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut child = command.spawn().unwrap();
    until_exists(&ready).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    unsafe { libc::kill(child.id().unwrap() as i32, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the bridge ends: the CLI under it died of TERM")
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
}

// ---- the proxy network mode, end to end -------------------------------------------------

/// Settings where every agent's sandbox reaches the network only through the proxy, the
/// scripted exec agent runs, and `allow` are the server's entries.
fn proxy_mode(s: &mut agentry::config::Settings, allow: Vec<String>) {
    with_exec_agent(s);
    s.sandbox.network = agentry::config::SandboxNetwork::Proxy;
    s.egress.allow = allow;
}

/// Run `tests/support/net_probe.py <args>` as the agent's next prompt (inside its
/// sandbox): what the probe printed.
async fn probe(app: &TestApp, agent: &str, args: &str) -> Value {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/net_probe.py");
    app.prompt(agent, &format!("python3 {} {args}", script.display()))
        .await;
    app.wait(agent).await;
    let text = app
        .timeline(agent)
        .await
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "assistant_message")
        .and_then(|e| e["data"]["text"].as_str().map(str::to_owned))
        .expect("an answer");
    let printed = text
        .strip_prefix("exit=0\n")
        .unwrap_or_else(|| panic!("the probe ran: {text}"));
    serde_json::from_str(printed.trim()).unwrap_or_else(|_| panic!("the probe's report: {text}"))
}

/// The endpoint directory of `agent` under the server's data dir.
fn endpoint_dir(app: &TestApp, agent: &str) -> std::path::PathBuf {
    app.data_dir
        .path()
        .join("egress")
        .join(agent_id(agent).uuid().to_string())
}

#[tokio::test]
async fn under_the_proxy_mode_an_agent_reaches_only_what_is_allowed_and_its_refusals_are_recorded()
{
    let allowed = origin("hello through the proxy").await;
    let not_listed = origin("never reached").await;
    let port = allowed.port;
    // A loopback address is internal: only an exact entry reaches it.
    let app = spawn_app_with(|s| proxy_mode(s, vec![format!("127.0.0.1:{port}")])).await;
    let providers = app.get_ok("/v1/providers").await;
    assert_eq!(providers["sandbox"]["network"], "proxy", "{providers}");
    assert_eq!(providers["sandbox"]["available"], true, "{providers}");
    let repo = git_repo();
    let agent = exec_agent_in(&app, repo.path(), &format!("p-{}", Uuid::now_v7().simple()))
        .await
        .0;
    assert!(endpoint_dir(&app, &agent).join("egress.sock").exists());

    // (a) The allowed server, through the proxy: absolute-form HTTP, then a tunnel.
    let r = probe(&app, &agent, &format!("http http://127.0.0.1:{port}/a")).await;
    assert_eq!(r, json!([200, "hello through the proxy"]));
    let r = probe(&app, &agent, &format!("connect 127.0.0.1 {port}")).await;
    assert_eq!(r, json!([200, "hello through the proxy"]));
    assert_eq!(allowed.connections.load(Ordering::SeqCst), 2);
    let requests = allowed.requests.lock().await.clone();
    assert!(
        requests[0].starts_with("GET /a HTTP/1.1\r\n"),
        "{requests:?}"
    );
    // Counted per agent, in the agent object.
    let shown = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(
        shown["runtime"]["egress_hosts"],
        json!({"127.0.0.1": 2}),
        "{shown}"
    );

    // (b) Hosts not listed are refused by the proxy, with a body naming the rule.
    let r = probe(&app, &agent, "http http://blocked.example.com/steal").await;
    assert_eq!(r[0], 403, "{r}");
    assert!(r[1].as_str().unwrap().contains("not_allowed"), "{r}");
    let r = probe(&app, &agent, "connect blocked.example.com 443").await;
    assert_eq!(r[0], 403, "{r}");
    let r = probe(
        &app,
        &agent,
        &format!("connect 127.0.0.1 {}", not_listed.port),
    )
    .await;
    assert_eq!(r[0], 403, "{r}");
    assert_eq!(not_listed.connections.load(Ordering::SeqCst), 0);
    // Each refusal is a `network_denied` event of the agent's, in order.
    let denied = denials_on_stream(&app, &agent, 3).await;
    assert_eq!(
        denied,
        [
            json!({"host": "blocked.example.com", "port": 80, "reason": "not_allowed"}),
            json!({"host": "blocked.example.com", "port": 443, "reason": "not_allowed"}),
            json!({"host": "127.0.0.1", "port": not_listed.port, "reason": "not_allowed"}),
        ]
    );

    // (c) Without naming the proxy, the host's loopback is reachable only on the ports
    // the server allows (loopback forwards of the sandbox, checked by the proxy and
    // counted like any other connection) and on this server's own port (the agent has
    // agentry's MCP server); any other loopback port is closed inside the sandbox.
    let r = probe(&app, &agent, &format!("get http://127.0.0.1:{port}/b")).await;
    assert_eq!(r, json!([200, "hello through the proxy"]));
    let requests = allowed.requests.lock().await.clone();
    assert!(
        requests[2].starts_with("GET /b HTTP/1.1\r\n"),
        "{requests:?}"
    );
    let r = probe(
        &app,
        &agent,
        &format!("direct 127.0.0.1 {}", not_listed.port),
    )
    .await;
    assert!(
        r.as_str().unwrap().contains("ConnectionRefused"),
        "port {}: {r}",
        not_listed.port
    );
    let server_port: u16 = app.base.rsplit(':').next().unwrap().parse().unwrap();
    let r = probe(
        &app,
        &agent,
        &format!("get http://localhost:{server_port}/healthz"),
    )
    .await;
    assert_eq!(r[0], 200, "{r}");
    assert_eq!(allowed.connections.load(Ordering::SeqCst), 3);
    assert_eq!(not_listed.connections.load(Ordering::SeqCst), 0);
    let shown = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(
        shown["runtime"]["egress_hosts"],
        json!({"127.0.0.1": 4}),
        "{shown}"
    );
    // Nothing else was refused on the way.
    let refused = app
        .timeline(&agent)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "network_denied")
        .count();
    assert_eq!(refused, 3);
}

#[tokio::test]
async fn an_agents_endpoint_lives_while_its_process_runs_and_is_gone_after_close_archive_and_stop()
{
    let app = spawn_app_with(|s| proxy_mode(s, Vec::new())).await;
    let repo = git_repo();
    let agent = exec_agent_in(&app, repo.path(), &format!("p-{}", Uuid::now_v7().simple()))
        .await
        .0;
    let dir = endpoint_dir(&app, &agent);
    assert!(dir.join("egress.sock").exists());

    // Closed: its process ends, and so does its endpoint; counts are gone with it.
    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    assert!(!dir.exists(), "the endpoint of a closed agent");
    let shown = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(shown["runtime"]["egress_hosts"], Value::Null, "{shown}");

    // The next prompt starts its process again, with a new endpoint and the list as it
    // is then: the team's owners added a host meanwhile (a name that never resolves, so
    // the proxy lets it past the list and answers that it does not resolve, where it
    // answered 403 before).
    let r = probe(&app, &agent, "http http://team-host.invalid/").await;
    assert_eq!(r[0], 403, "{r}");
    let team = app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.put_ok(
        &format!("/v1/teams/{team}/network"),
        json!({"allow": ["team-host.invalid"]}),
    )
    .await;
    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    let r = probe(&app, &agent, "http http://team-host.invalid/").await;
    assert_eq!(r[0], 502, "{r}");
    assert!(r[1].as_str().unwrap().contains("does not resolve"), "{r}");
    assert!(dir.join("egress.sock").exists());
    assert_eq!(
        app.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["egress_hosts"],
        json!({})
    );

    // Archived: gone for good.
    let res = app.delete(&format!("/v1/agents/{agent}")).await;
    assert!(res.status().is_success(), "{}", res.status());
    assert!(!dir.exists(), "the endpoint of an archived agent");
    let endpoints = |root: &std::path::Path| {
        std::fs::read_dir(root.join("egress"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        endpoints(app.data_dir.path()),
        Vec::<std::ffi::OsString>::new()
    );

    // A running agent's endpoint goes when the server stops.
    let other = git_repo();
    let running = exec_agent_in(
        &app,
        other.path(),
        &format!("p-{}", Uuid::now_v7().simple()),
    )
    .await
    .0;
    assert!(endpoint_dir(&app, &running).join("egress.sock").exists());
    let (_db, data_dir, _token) = app.stop().await;
    assert_eq!(endpoints(data_dir.path()), Vec::<std::ffi::OsString>::new());
}
