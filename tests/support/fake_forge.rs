//! Fake GitHub and GitLab REST APIs for tests: a small HTTP/1.1 server on 127.0.0.1 that
//! checks the token, records every call and answers pull request (GitHub) or merge
//! request (GitLab) create, update, get and list calls, check runs, head pipelines and
//! job logs, in the shapes the forges document. Tests change a request's state and its checks
//! through the helpers below.

#![allow(dead_code)] // each suite uses the part it needs

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

#[allow(clippy::duplicate_mod)]
#[path = "http.rs"]
mod http;
use http::read_request;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    GitHub,
    GitLab,
}

/// One call the fake answered.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: String,
    /// The path as sent (percent-encoding kept).
    pub path: String,
    pub query: String,
    /// The `Authorization` header (GitHub) or `PRIVATE-TOKEN` header (GitLab).
    pub credential: Option<String>,
    pub body: Value,
    pub status: u16,
}

#[derive(Default)]
struct State {
    next: i64,
    /// Requests by number, in the forge's own shape.
    requests: BTreeMap<i64, Value>,
    /// GitHub: the check runs every head commit reports.
    check_runs: Vec<Value>,
    /// GitLab: the head pipeline's status, if any.
    pipeline: Option<String>,
    /// GitLab: job logs by job id (`GET /projects/:id/jobs/:job_id/trace`).
    traces: BTreeMap<i64, String>,
    /// GitHub: the jobs of workflow runs by run id (`GET …/actions/runs/:id/jobs`).
    workflow_jobs: BTreeMap<i64, Vec<Value>>,
    /// GitHub: job logs by job id, served at a redirect target outside the API
    /// (`GET …/actions/jobs/:id/logs` answers 302 to `/_blobs/job-logs/:id`).
    job_logs: BTreeMap<i64, String>,
}

pub struct FakeForge {
    pub addr: SocketAddr,
    pub flavor: Flavor,
    calls: Arc<Mutex<Vec<Call>>>,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeForge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeForge {
    /// A forge that accepts `token` and nothing else; request numbers start at 7.
    pub async fn start(flavor: Flavor, token: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let state = Arc::new(Mutex::new(State {
            next: 7,
            ..State::default()
        }));
        let (c, s, token) = (Arc::clone(&calls), Arc::clone(&state), token.to_owned());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (c, s, token) = (Arc::clone(&c), Arc::clone(&s), token.clone());
                tokio::spawn(async move { serve(stream, flavor, &token, &c, &s).await });
            }
        });
        Self {
            addr,
            flavor,
            calls,
            state,
            task,
        }
    }

    /// The API base URL a project names as `forge_api_url`.
    pub fn api_url(&self) -> String {
        match self.flavor {
            Flavor::GitHub => format!("http://{}", self.addr),
            Flavor::GitLab => format!("http://{}/api/v4", self.addr),
        }
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The request `number` as the forge holds it.
    pub fn request(&self, number: i64) -> Option<Value> {
        self.state.lock().unwrap().requests.get(&number).cloned()
    }

    pub fn request_count(&self) -> usize {
        self.state.lock().unwrap().requests.len()
    }

    /// Merges request `number`.
    pub fn merge(&self, number: i64) {
        let mut s = self.state.lock().unwrap();
        let r = s.requests.get_mut(&number).unwrap();
        match self.flavor {
            Flavor::GitHub => {
                r["state"] = json!("closed");
                r["merged"] = json!(true);
                r["merged_at"] = json!("2026-12-06T12:00:00Z");
            }
            Flavor::GitLab => r["state"] = json!("merged"),
        }
    }

    /// GitHub: the check runs of every head commit (`[{"status", "conclusion"}]`).
    pub fn set_check_runs(&self, runs: Value) {
        self.state.lock().unwrap().check_runs = runs.as_array().unwrap().clone();
    }

    /// GitLab: the log of job `id`.
    pub fn set_job_trace(&self, id: i64, text: &str) {
        self.state
            .lock()
            .unwrap()
            .traces
            .insert(id, text.to_owned());
    }

    /// GitHub: the jobs of workflow run `run` (`[{"id", "name", "conclusion"}]`).
    pub fn set_workflow_jobs(&self, run: i64, jobs: Value) {
        self.state
            .lock()
            .unwrap()
            .workflow_jobs
            .insert(run, jobs.as_array().unwrap().clone());
    }

    /// GitHub: the log of job `id`, read through a redirect.
    pub fn set_job_log(&self, id: i64, text: &str) {
        self.state
            .lock()
            .unwrap()
            .job_logs
            .insert(id, text.to_owned());
    }

    /// GitLab: the status of every merge request's head pipeline.
    pub fn set_pipeline(&self, status: &str) {
        self.state.lock().unwrap().pipeline = Some(status.to_owned());
    }
}

fn header(head: &str, name: &str) -> Option<String> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

fn query_param(query: &str, name: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

async fn serve(
    mut stream: TcpStream,
    flavor: Flavor,
    token: &str,
    calls: &Mutex<Vec<Call>>,
    state: &Mutex<State>,
) {
    let Some((head, body)) = read_request(&mut stream).await else {
        return;
    };
    let mut first = head.lines().next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_owned();
    let target = first.next().unwrap_or("/").to_owned();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (credential, expected) = match flavor {
        Flavor::GitHub => (header(&head, "authorization"), format!("Bearer {token}")),
        Flavor::GitLab => (header(&head, "private-token"), token.to_owned()),
    };
    // A log's short-lived address carries its own grant, as GitHub's blob storage does.
    let blob = path.starts_with("/_blobs/");
    let (status, answer) = if blob {
        let log = path
            .strip_prefix("/_blobs/job-logs/")
            .and_then(|id| id.parse().ok())
            .and_then(|id: i64| state.lock().unwrap().job_logs.get(&id).cloned());
        match log {
            Some(log) if query == "grant=fake" => (200, Value::String(log)),
            _ => not_found(),
        }
    } else if credential.as_deref() != Some(expected.as_str()) {
        match flavor {
            Flavor::GitHub => (401, json!({"message": "Bad credentials"})),
            Flavor::GitLab => (401, json!({"message": "401 Unauthorized"})),
        }
    } else {
        let mut s = state.lock().unwrap();
        match flavor {
            Flavor::GitHub => github(&mut s, &method, path, query, &body),
            Flavor::GitLab => gitlab(&mut s, &method, path, query, &body),
        }
    };
    calls.lock().unwrap().push(Call {
        method,
        path: path.to_owned(),
        query: query.to_owned(),
        credential,
        body,
        status,
    });
    // A job's log is plain text; a redirect names where to go.
    let mut location = String::new();
    let (text, content_type) = match answer {
        Value::String(log) if path.ends_with("/trace") || blob => (log, "text/plain"),
        Value::String(to) if status == 302 => {
            let host = header(&head, "host").unwrap_or_default();
            location = format!("Location: http://{host}{to}\r\n");
            (String::new(), "text/plain")
        }
        other => (other.to_string(), "application/json"),
    };
    let reason = match status {
        200 => "OK",
        201 => "Created",
        302 => "Found",
        401 => "Unauthorized",
        404 => "Not Found",
        _ => "Unprocessable Entity",
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{location}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.flush().await;
}

fn not_found() -> (u16, Value) {
    (404, json!({"message": "Not Found"}))
}

fn github(s: &mut State, method: &str, path: &str, query: &str, body: &Value) -> (u16, Value) {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (owner, repo, rest) = match parts.as_slice() {
        ["repos", owner, repo, rest @ ..] => (*owner, *repo, rest),
        _ => return not_found(),
    };
    match (method, rest) {
        ("GET", ["pulls"]) => {
            let wanted = query_param(query, "head");
            let open = query_param(query, "state").as_deref() == Some("open");
            let list: Vec<Value> = s
                .requests
                .values()
                .filter(|r| {
                    wanted.as_deref().is_none_or(|h| {
                        format!("{owner}:{}", r["head"]["ref"].as_str().unwrap()) == h
                    }) && (!open || r["state"] == "open")
                })
                .cloned()
                .collect();
            (200, Value::Array(list))
        }
        ("POST", ["pulls"]) => {
            let (Some(title), Some(head), Some(base)) = (
                body["title"].as_str(),
                body["head"].as_str(),
                body["base"].as_str(),
            ) else {
                return (422, json!({"message": "Validation Failed"}));
            };
            let number = s.next;
            s.next += 1;
            let pr = json!({
                "number": number,
                "html_url": format!("https://github.example/{owner}/{repo}/pull/{number}"),
                "state": "open", "merged": false, "merged_at": null,
                "title": title, "body": body["body"],
                "head": {"ref": head, "sha": format!("{:040x}", number)},
                "base": {"ref": base},
            });
            s.requests.insert(number, pr.clone());
            (201, pr)
        }
        ("PATCH", ["pulls", n]) => {
            let Some(pr) = n.parse().ok().and_then(|n: i64| s.requests.get_mut(&n)) else {
                return not_found();
            };
            for key in ["title", "body"] {
                if !body[key].is_null() {
                    pr[key] = body[key].clone();
                }
            }
            (200, pr.clone())
        }
        ("GET", ["pulls", n]) => match n.parse().ok().and_then(|n: i64| s.requests.get(&n)) {
            Some(pr) => (200, pr.clone()),
            None => not_found(),
        },
        ("GET", ["commits", _sha, "check-runs"]) => (
            200,
            json!({"total_count": s.check_runs.len(), "check_runs": s.check_runs}),
        ),
        ("GET", ["actions", "runs", run, "jobs"]) => {
            match run.parse().ok().and_then(|r: i64| s.workflow_jobs.get(&r)) {
                Some(jobs) => (200, json!({"total_count": jobs.len(), "jobs": jobs})),
                None => not_found(),
            }
        }
        ("GET", ["actions", "jobs", job, "logs"]) => {
            match job
                .parse()
                .ok()
                .filter(|j: &i64| s.job_logs.contains_key(j))
            {
                Some(j) => (
                    302,
                    Value::String(format!("/_blobs/job-logs/{j}?grant=fake")),
                ),
                None => not_found(),
            }
        }
        _ => not_found(),
    }
}

fn gitlab(s: &mut State, method: &str, path: &str, query: &str, body: &Value) -> (u16, Value) {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (project, rest) = match parts.as_slice() {
        ["api", "v4", "projects", project, rest @ ..] => (*project, rest),
        _ => return not_found(),
    };
    let project = url::form_urlencoded::parse(format!("p={project}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default();
    let with_pipeline = |mr: &Value, pipeline: &Option<String>| {
        let mut mr = mr.clone();
        mr["head_pipeline"] = match pipeline {
            Some(status) => json!({"id": 1, "status": status}),
            None => Value::Null,
        };
        mr
    };
    match (method, rest) {
        ("GET", ["merge_requests"]) => {
            let source = query_param(query, "source_branch");
            let state = query_param(query, "state");
            let list: Vec<Value> = s
                .requests
                .values()
                .filter(|r| {
                    source.as_deref().is_none_or(|b| r["source_branch"] == b)
                        && state.as_deref().is_none_or(|st| r["state"] == st)
                })
                .cloned()
                .collect();
            (200, Value::Array(list))
        }
        ("POST", ["merge_requests"]) => {
            let (Some(title), Some(source), Some(target)) = (
                body["title"].as_str(),
                body["source_branch"].as_str(),
                body["target_branch"].as_str(),
            ) else {
                return (400, json!({"message": "title is missing"}));
            };
            let iid = s.next;
            s.next += 1;
            let mr = json!({
                "id": 1000 + iid, "iid": iid,
                "web_url": format!("https://gitlab.example/{project}/-/merge_requests/{iid}"),
                "state": "opened", "title": title, "description": body["description"],
                "source_branch": source, "target_branch": target,
                "sha": format!("{:040x}", iid),
            });
            s.requests.insert(iid, mr.clone());
            (201, with_pipeline(&mr, &s.pipeline))
        }
        ("PUT", ["merge_requests", n]) => {
            let pipeline = s.pipeline.clone();
            let Some(mr) = n.parse().ok().and_then(|n: i64| s.requests.get_mut(&n)) else {
                return not_found();
            };
            for key in ["title", "description"] {
                if !body[key].is_null() {
                    mr[key] = body[key].clone();
                }
            }
            (200, with_pipeline(mr, &pipeline))
        }
        ("GET", ["merge_requests", n]) => {
            match n.parse().ok().and_then(|n: i64| s.requests.get(&n)) {
                Some(mr) => (200, with_pipeline(mr, &s.pipeline)),
                None => not_found(),
            }
        }
        ("GET", ["jobs", job, "trace"]) => {
            match job.parse().ok().and_then(|j: i64| s.traces.get(&j)) {
                Some(log) => (200, Value::String(log.clone())),
                None => not_found(),
            }
        }
        _ => not_found(),
    }
}
