//! Traces as a collector receives them: `agentry serve` runs as a real process with
//! `log.otlp_endpoint` pointed at an OTLP/HTTP receiver this test owns; after some
//! requests and a turn, SIGTERM flushes the exporter and the test decodes what arrived.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;
use serde_json::{Value, json};

const EXE: &str = env!("CARGO_BIN_EXE_agentry");

/// One OTLP/HTTP request as received: its request line and headers, and its body.
struct Received {
    head: String,
    body: Vec<u8>,
}

/// A minimal OTLP/HTTP receiver on 127.0.0.1: it keeps every request and answers 200
/// (an empty `ExportTraceServiceResponse`), one request per connection.
fn receiver() -> (String, Arc<Mutex<Vec<Received>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let keep = got.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let mut data = Vec::new();
            let mut buf = [0u8; 64 * 1024];
            let received = loop {
                let n = conn.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break None;
                }
                data.extend_from_slice(&buf[..n]);
                let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") else {
                    continue;
                };
                let head = String::from_utf8_lossy(&data[..end]).into_owned();
                let len = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .and_then(|v| v.trim().parse::<usize>().ok())
                    })
                    .unwrap_or(0);
                if data.len() >= end + 4 + len {
                    break Some(Received {
                        head,
                        body: data[end + 4..end + 4 + len].to_vec(),
                    });
                }
            };
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
            if let Some(r) = received {
                keep.lock().unwrap().push(r);
            }
        }
    });
    (endpoint, got)
}

/// The server child: SIGKILLed if the test fails before it stops it.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Api {
    base: String,
    token: String,
    http: reqwest::blocking::Client,
}

impl Api {
    fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().unwrap();
        let status = res.status().as_u16();
        let text = res.text().unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

fn git(dir: &Path, args: &[&str]) {
    let out = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
}

struct Started {
    server: Server,
    api: Api,
    /// The server's stderr lines, once it has exited.
    log: std::thread::JoinHandle<Vec<String>>,
}

/// `agentry serve` on the embedded default database, exporting to `endpoint`.
fn start(data: &Path, endpoint: &str, env: &[(&str, &str)]) -> Started {
    let port = free_port();
    let mut server = Server(
        Command::new(EXE)
            .args(["serve", "--data-dir"])
            .arg(data)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env_remove("DATABASE_URL")
            .env("AGENTRY_LOG__OTLP_ENDPOINT", endpoint)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = server.0.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let mut lines = BufReader::new(server.0.stdout.take().unwrap()).lines();
    while !lines
        .next()
        .expect("serve printed its address")
        .unwrap()
        .contains("listening on")
    {}
    std::thread::spawn(move || for _ in lines {});
    let token = std::fs::read_to_string(data.join("admin-token"))
        .expect("the bootstrap token")
        .trim()
        .to_owned();
    agentry::telemetry::install_crypto_provider();
    Started {
        server,
        api: Api {
            base: format!("http://127.0.0.1:{port}"),
            token,
            http: reqwest::blocking::Client::new(),
        },
        log,
    }
}

/// SIGTERM the server and wait (at most 30 s) for it to exit; how, and how long it took.
fn stop(server: &mut Server) -> (std::process::ExitStatus, Duration) {
    let started = Instant::now();
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    loop {
        if let Some(st) = server.0.try_wait().unwrap() {
            return (st, started.elapsed());
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "serve did not stop within 30 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Remove the embedded cluster kept for a test's data dir (as root it lives under
/// /var/lib/agentry, outside the temporary directory).
fn remove_cluster(cluster: Option<PathBuf>) {
    if let Some(cluster) = cluster.as_deref().and_then(Path::parent)
        && cluster.starts_with("/var/lib/agentry")
    {
        let _ = std::fs::remove_dir_all(cluster);
    }
}

/// A span as exported, with its attributes as text.
#[derive(Debug)]
struct SpanSeen {
    name: String,
    trace_id: String,
    span_id: String,
    /// Empty for a trace's root.
    parent_span_id: String,
    attrs: HashMap<String, String>,
    status_code: i32,
}

fn text_of(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn spans_of_requests_turns_processes_and_commits_reach_an_otlp_receiver() {
    let (endpoint, received) = receiver();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = dir.path().join("data");
    let repo = dir.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("README.md"), "# demo\n").unwrap();
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-q", "-m", "initial"]);

    let Started {
        mut server,
        api,
        log,
    } = start(
        &data,
        &endpoint,
        // A quiet log: only the request module's debug lines. The traces must not
        // depend on it.
        &[
            ("AGENTRY_LOG__FORMAT", "json"),
            ("RUST_LOG", "warn,agentry::api::middleware=debug"),
        ],
    );

    // A request that succeeds, one that is not found, one that is refused.
    assert_eq!(api.call(reqwest::Method::GET, "/v1/me", None).0, 200);
    let missing = "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b";
    let (status, not_found) =
        api.call(reqwest::Method::GET, &format!("/v1/agents/{missing}"), None);
    assert_eq!(status, 404, "{not_found}");
    let (status, project) = api.call(
        reqwest::Method::POST,
        "/v1/projects",
        Some(json!({"name": "demo", "repo_path": repo})),
    );
    assert_eq!(status, 201, "{project}");
    let (status, refused) = api.call(
        reqwest::Method::POST,
        "/v1/agents",
        Some(json!({"workspace": {"project_id": project["id"]}, "provider": "no-such-provider"})),
    );
    assert_eq!(status, 422, "{refused}");

    // Problem bodies name their trace beside their request.
    let trace_of = |problem: &Value| -> String {
        let t = problem["trace_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no trace_id in {problem}"))
            .to_owned();
        assert!(
            t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()) && t != "0".repeat(32),
            "{t}"
        );
        t
    };
    let not_found_trace = trace_of(&not_found);
    let refused_trace = trace_of(&refused);
    assert_ne!(not_found_trace, refused_trace, "one trace per request");

    // A mock agent whose first prompt runs a turn.
    let (status, agent) = api.call(
        reqwest::Method::POST,
        "/v1/agents",
        Some(
            json!({"workspace": {"project_id": project["id"]}, "provider": "mock",
            "prompt": "hello"}),
        ),
    );
    assert_eq!(status, 201, "{agent}");
    let agent_id = agent["id"].as_str().unwrap().to_owned();
    let (status, waited) = api.call(
        reqwest::Method::GET,
        &format!("/v1/agents/{agent_id}/wait?timeout_s=60"),
        None,
    );
    assert_eq!(status, 200, "{waited}");
    assert_eq!(waited["last_turn"]["outcome"], "completed", "{waited}");
    let turn_id = waited["last_turn"]["turn_id"].as_str().unwrap().to_owned();
    // And a turn that fails.
    let (status, failing) = api.call(
        reqwest::Method::POST,
        &format!("/v1/agents/{agent_id}/messages"),
        Some(json!({"text": "/fail on purpose"})),
    );
    assert_eq!(status, 202, "{failing}");
    let failed_turn_id = failing["turn_id"].as_str().unwrap().to_owned();
    let (_, waited) = api.call(
        reqwest::Method::GET,
        &format!("/v1/agents/{agent_id}/wait?timeout_s=60"),
        None,
    );
    assert_eq!(waited["last_turn"]["outcome"], "failed", "{waited}");
    let (_, agent) = api.call(
        reqwest::Method::GET,
        &format!("/v1/agents/{agent_id}"),
        None,
    );
    let pid = agent["runtime"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no provider pid in {agent}"));

    let cluster = embedded_cluster_of(server.0.id());
    // SIGTERM: the server stops its agents and flushes the exporter on the way out.
    let (exit, _) = stop(&mut server);
    assert!(exit.success(), "{exit:?}");
    let log = log.join().unwrap();

    let received = std::mem::take(&mut *received.lock().unwrap());
    assert!(!received.is_empty(), "the receiver got nothing");
    let mut spans = Vec::new();
    for r in &received {
        let head = r.head.to_ascii_lowercase();
        assert!(head.starts_with("post /v1/traces "), "{}", r.head);
        assert!(
            head.lines()
                .any(|l| l.starts_with("content-type:") && l.contains("application/x-protobuf")),
            "{}",
            r.head
        );
        let export = ExportTraceServiceRequest::decode(r.body.as_slice())
            .expect("an OTLP trace export (protobuf)");
        for rs in export.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(text_of);
            assert_eq!(service.as_deref(), Some("agentry"));
            for ss in rs.scope_spans {
                for s in ss.spans {
                    spans.push(SpanSeen {
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        attrs: s
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text_of(kv)))
                            .collect(),
                        status_code: s.status.map_or(0, |st| st.code),
                    });
                }
            }
        }
    }
    let find = |what: &str, pred: &dyn Fn(&SpanSeen) -> bool| -> &SpanSeen {
        spans.iter().find(|s| pred(s)).unwrap_or_else(|| {
            panic!(
                "no {what} span among {:#?}",
                spans
                    .iter()
                    .map(|s| (&s.name, &s.attrs))
                    .collect::<Vec<_>>()
            )
        })
    };
    let attr = |s: &SpanSeen, k: &str| s.attrs.get(k).cloned().unwrap_or_default();

    // Request spans: named by method and route, carrying the request's id and status, in
    // the trace the problem body names.
    let me = find("GET /v1/me", &|s| s.name == "GET /v1/me");
    assert_eq!(attr(me, "status"), "200");
    // The request's span is its trace's root; the service steps within share the trace.
    let nf = find("not found request", &|s| {
        s.trace_id == not_found_trace && s.parent_span_id.is_empty()
    });
    assert_eq!(nf.name, "GET /v1/agents/{id}");
    assert_eq!(attr(nf, "route"), "/v1/agents/{id}");
    assert_eq!(attr(nf, "path"), format!("/v1/agents/{missing}"));
    assert_eq!(attr(nf, "status"), "404");
    assert_eq!(
        attr(nf, "request_id"),
        not_found["request_id"].as_str().unwrap()
    );
    assert_eq!(attr(nf, "trace_id"), not_found_trace);
    let rf = find("refused request", &|s| {
        s.trace_id == refused_trace && s.parent_span_id.is_empty()
    });
    assert_eq!(rf.name, "POST /v1/agents");
    assert_eq!(attr(rf, "status"), "422");
    assert_ne!(
        rf.status_code, 2,
        "a client's mistake is not a server error"
    );

    // The service steps of a request are spans inside the request's span.
    let within = |inner: &SpanSeen, outer: &SpanSeen| -> bool {
        let mut at = inner;
        while !at.parent_span_id.is_empty() {
            if at.parent_span_id == outer.span_id {
                return true;
            }
            match spans
                .iter()
                .find(|s| s.span_id == at.parent_span_id && s.trace_id == at.trace_id)
            {
                Some(parent) => at = parent,
                None => return false,
            }
        }
        false
    };
    let get = find("services::agents::get", &|s| {
        s.name == "services::agents::get" && s.trace_id == not_found_trace
    });
    assert_eq!(attr(get, "agent_id"), missing);
    assert!(within(get, nf), "{get:?} is not inside {nf:?}");
    let created = find("services::agents::create", &|s| {
        s.name == "services::agents::create" && attr(s, "agent_id") == agent_id
    });
    let create_request = find("the request that created the agent", &|s| {
        s.name == "POST /v1/agents" && s.trace_id == created.trace_id
    });
    assert_eq!(attr(create_request, "status"), "201");
    assert!(
        within(created, create_request),
        "{created:?} is not inside {create_request:?}"
    );
    assert!(
        !created.attrs.keys().any(|k| k == "body" || k == "prompt"),
        "{:?}",
        created.attrs
    );
    // A service a service calls is a step inside it.
    let project_lookup = find("services::projects::find", &|s| {
        s.name == "services::projects::find" && s.trace_id == created.trace_id
    });
    assert!(within(project_lookup, created), "{project_lookup:?}");
    // The queue's steps too: reading an agent looks at its queue (so does a create whose
    // first prompt passed the turn limits, in its own trace).
    let in_a_read = |q: &SpanSeen| {
        spans
            .iter()
            .any(|g| g.name == "services::agents::get" && g.trace_id == q.trace_id && within(q, g))
    };
    let queue_look = find("services::queue::agent_queue in a read", &|s| {
        s.name == "services::queue::agent_queue" && attr(s, "agent_id") == agent_id && in_a_read(s)
    });
    assert_eq!(attr(queue_look, "agent_id"), agent_id);

    // The turn, from its start to its recorded outcome.
    let turn = find("turn", &|s| {
        s.name == "turn" && attr(s, "turn_id") == turn_id
    });
    assert_eq!(attr(turn, "agent_id"), agent_id);
    assert_eq!(attr(turn, "provider"), "mock");
    assert_eq!(attr(turn, "outcome"), "completed");
    assert_ne!(turn.status_code, 2);
    let failed = find("failed turn", &|s| {
        s.name == "turn" && attr(s, "turn_id") == failed_turn_id
    });
    assert_eq!(attr(failed, "outcome"), "failed");
    assert_eq!(failed.status_code, 2, "a failed turn has status ERROR");
    assert_ne!(failed.trace_id, turn.trace_id, "each turn is its own trace");

    // The provider process, from spawn to exit (stopped by the shutdown).
    let process = find("process", &|s| {
        s.name == "process" && attr(s, "pid") == pid.to_string()
    });
    // The `mock` provider runs `agentry-mock`, installed beside `agentry` by the build.
    assert_eq!(attr(process, "program"), "agentry-mock");
    assert_eq!(attr(process, "agent_id"), agent_id);
    assert!(
        process.attrs.contains_key("exit_code") || process.attrs.contains_key("signal"),
        "the process span ends with its exit: {:?}",
        process.attrs
    );

    // The writer's batch commits.
    let commit = find("commit", &|s| s.name == "commit");
    assert!(
        attr(commit, "events").parse::<u64>().unwrap()
            + attr(commit, "team_events").parse::<u64>().unwrap()
            > 0,
        "{:?}",
        commit.attrs
    );

    // The request's JSON log lines carry the trace id too.
    let request_id = not_found["request_id"].as_str().unwrap();
    let lines: Vec<&String> = log.iter().filter(|l| l.contains(request_id)).collect();
    assert!(!lines.is_empty(), "no log line of the request in {log:#?}");
    for line in lines {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}"));
        assert_eq!(v["span"]["trace_id"], not_found_trace.as_str(), "{line}");
    }

    remove_cluster(cluster);
}

/// The data directory of the embedded PostgreSQL that `pid` runs as a child, if any.
fn embedded_cluster_of(pid: u32) -> Option<PathBuf> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let children =
            std::fs::read_to_string(task.ok()?.path().join("children")).unwrap_or_default();
        for c in children.split_whitespace() {
            let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
            if comm.trim() == "postgres" {
                return std::fs::read_link(format!("/proc/{c}/cwd")).ok();
            }
        }
    }
    None
}

/// A collector that accepts connections and never answers costs requests nothing (the
/// export runs beside them), and stopping the server waits a bounded time for it.
#[test]
fn an_unresponsive_collector_neither_fails_nor_slows_requests() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let held = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            held.lock().unwrap().push(conn);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = dir.path().join("data");
    // Export every 100 ms, so exports hang while the requests run.
    let Started {
        mut server,
        api,
        log,
    } = start(
        &data,
        &endpoint,
        &[("OTEL_BSP_SCHEDULE_DELAY", "100"), ("RUST_LOG", "warn")],
    );
    let cluster = embedded_cluster_of(server.0.id());

    assert_eq!(api.call(reqwest::Method::GET, "/v1/me", None).0, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while accepted.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the exporter never connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    for _ in 0..20 {
        assert_eq!(api.call(reqwest::Method::GET, "/v1/me", None).0, 200);
    }
    // An export waits 10 s for an answer; requests waiting on it would take far longer.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "20 requests took {:?} while the collector hung",
        started.elapsed()
    );

    let (exit, took) = stop(&mut server);
    assert!(exit.success(), "{exit:?}");
    assert!(took < Duration::from_secs(15), "stopping took {took:?}");
    let log = log.join().unwrap();
    assert!(
        log.iter().any(|l| l.contains("could not flush traces")),
        "{log:#?}"
    );
    remove_cluster(cluster);
}
