//! A git remote over smart HTTP for tests: a small HTTP/1.1 server on 127.0.0.1 that
//! checks Basic auth and hands each request to `git http-backend`, run as a CGI child
//! (argv and environment only). It serves fetches of any ref and pushes; repositories are
//! bare repositories under its root, made and changed through the helpers below.

#![allow(dead_code)] // each suite uses the part it needs

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use base64::Engine;
use tempfile::TempDir;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

// The shared request reader; a suite that also loads it for its fake servers holds two
// copies of this small module, which is harmless.
#[allow(clippy::duplicate_mod)]
#[path = "http.rs"]
mod http;
use http::read_request;

/// One request the remote answered: method, path and query, and its status.
#[derive(Debug, Clone)]
pub struct Served {
    pub method: String,
    pub target: String,
    pub status: u16,
}

/// Holds requests back while it is closed: a slow remote, on demand.
#[derive(Default)]
struct Gate {
    closed: tokio::sync::watch::Sender<bool>,
    /// How many requests wait at the gate now.
    waiting: tokio::sync::watch::Sender<usize>,
}

pub struct GitHttp {
    pub addr: SocketAddr,
    root: TempDir,
    served: Arc<Mutex<Vec<Served>>>,
    gate: Arc<Gate>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GitHttp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl GitHttp {
    /// A remote that accepts `user`/`password` (HTTP Basic) and nothing else.
    pub async fn start(user: &str, password: &str) -> Self {
        let root = tempfile::tempdir().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let expected = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
        );
        let served = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Gate::default());
        let project_root = root.path().to_path_buf();
        let log = Arc::clone(&served);
        let user = user.to_owned();
        let held = Arc::clone(&gate);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (expected, root, log, user, gate) = (
                    expected.clone(),
                    project_root.clone(),
                    Arc::clone(&log),
                    user.clone(),
                    Arc::clone(&held),
                );
                tokio::spawn(async move {
                    serve(stream, &expected, &user, &root, &log, &gate).await;
                });
            }
        });
        Self {
            addr,
            root,
            served,
            gate,
            task,
        }
    }

    /// From now on requests wait, unanswered, until `open` (a remote that is slow).
    pub fn close(&self) {
        self.gate.closed.send_replace(true);
    }

    /// Answers the waiting requests and those to come.
    pub fn open(&self) {
        self.gate.closed.send_replace(false);
    }

    /// Resolves once a request waits at the closed gate.
    pub async fn request_waiting(&self) {
        let mut rx = self.gate.waiting.subscribe();
        let _ = rx.wait_for(|n| *n > 0).await;
    }

    /// The URL of repository `name` (`<name>.git` under the root).
    pub fn url(&self, name: &str) -> String {
        format!("http://{}/{name}.git", self.addr)
    }

    /// The bare repository `name` on disk.
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(format!("{name}.git"))
    }

    /// Makes bare repository `name` with one commit on `main` (a README); returns it.
    pub fn create_repo(&self, name: &str) -> String {
        let bare = self.path(name);
        git(
            self.root.path(),
            &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()],
        );
        self.commit(name, "README.md", "# remote\n", "initial")
    }

    /// Commits `file` with `content` on `main` of repository `name` (through a scratch
    /// clone on disk); returns the new commit id.
    pub fn commit(&self, name: &str, file: &str, content: &str, message: &str) -> String {
        let bare = self.path(name);
        let scratch = tempfile::tempdir().unwrap();
        let work = scratch.path().join("w");
        git(
            scratch.path(),
            &[
                "clone",
                "-q",
                bare.to_str().unwrap(),
                work.to_str().unwrap(),
            ],
        );
        // An empty remote clones without a branch: start `main`.
        git(&work, &["checkout", "-q", "-B", "main"]);
        if let Some(parent) = Path::new(file).parent() {
            std::fs::create_dir_all(work.join(parent)).unwrap();
        }
        std::fs::write(work.join(file), content).unwrap();
        git(&work, &["add", "--", file]);
        git(&work, &["commit", "-q", "-m", message]);
        git(&work, &["push", "-q", "origin", "main"]);
        git(&work, &["rev-parse", "HEAD"]).trim().to_owned()
    }

    /// Commits `file` with `content` on `branch` of repository `name` (made from `main`
    /// when it does not exist yet); returns the new commit id.
    pub fn commit_on(
        &self,
        name: &str,
        branch: &str,
        file: &str,
        content: &str,
        message: &str,
    ) -> String {
        let bare = self.path(name);
        let scratch = tempfile::tempdir().unwrap();
        let work = scratch.path().join("w");
        git(
            scratch.path(),
            &[
                "clone",
                "-q",
                bare.to_str().unwrap(),
                work.to_str().unwrap(),
            ],
        );
        let exists = !git(
            &work,
            &["ls-remote", "origin", &format!("refs/heads/{branch}")],
        )
        .trim()
        .is_empty();
        if exists {
            git(
                &work,
                &["checkout", "-q", "-B", branch, &format!("origin/{branch}")],
            );
        } else {
            git(&work, &["checkout", "-q", "-b", branch]);
        }
        if let Some(parent) = Path::new(file).parent() {
            std::fs::create_dir_all(work.join(parent)).unwrap();
        }
        std::fs::write(work.join(file), content).unwrap();
        git(&work, &["add", "--", file]);
        git(&work, &["commit", "-q", "-m", message]);
        git(&work, &["push", "-q", "origin", branch]);
        git(&work, &["rev-parse", "HEAD"]).trim().to_owned()
    }

    /// Points `refname` (e.g. `refs/pull/12/head`) of repository `name` at `commit`.
    pub fn set_ref(&self, name: &str, refname: &str, commit: &str) {
        git(&self.path(name), &["update-ref", refname, commit]);
    }

    /// The commit `rev` names in repository `name`, if any.
    pub fn rev(&self, name: &str, rev: &str) -> Option<String> {
        let out = std::process::Command::new("git")
            .args([
                "-c",
                "safe.directory=*",
                "rev-parse",
                "--verify",
                "--quiet",
                rev,
            ])
            .current_dir(self.path(name))
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// `git log -1 --format=<format> <rev>` in repository `name`.
    pub fn show(&self, name: &str, rev: &str, format: &str) -> String {
        git(
            &self.path(name),
            &["log", "-1", &format!("--format={format}"), rev],
        )
    }

    /// The requests answered so far.
    pub fn served(&self) -> Vec<Served> {
        self.served.lock().unwrap().clone()
    }
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "safe.directory=*",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn header(head: &str, name: &str) -> Option<String> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

async fn serve(
    mut stream: TcpStream,
    expected_auth: &str,
    user: &str,
    root: &Path,
    log: &Mutex<Vec<Served>>,
    gate: &Gate,
) {
    let Some((head, body)) = read_request(&mut stream).await else {
        return;
    };
    if *gate.closed.borrow() {
        gate.waiting.send_modify(|n| *n += 1);
        let _ = gate.closed.subscribe().wait_for(|closed| !closed).await;
        gate.waiting.send_modify(|n| *n -= 1);
    }
    let mut first = head.lines().next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_owned();
    let target = first.next().unwrap_or("/").to_owned();
    let record = |status: u16| {
        log.lock().unwrap().push(Served {
            method: method.clone(),
            target: target.clone(),
            status,
        })
    };
    if header(&head, "authorization").as_deref() != Some(expected_auth) {
        record(401);
        let _ = stream
            .write_all(
                b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\n\
                  Content-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await;
        return;
    }
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut cgi = Command::new("git");
    cgi.arg("http-backend")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("REMOTE_USER", user)
        .env("REMOTE_ADDR", "127.0.0.1")
        .env("CONTENT_LENGTH", body.len().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(t) = header(&head, "content-type") {
        cgi.env("CONTENT_TYPE", t);
    }
    if let Some(e) = header(&head, "content-encoding") {
        cgi.env("HTTP_CONTENT_ENCODING", e);
    }
    if let Some(p) = header(&head, "git-protocol") {
        cgi.env("GIT_PROTOCOL", p);
    }
    let mut child = cgi.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = async move {
        let _ = stdin.write_all(&body).await;
        drop(stdin);
    };
    let (_, out) = tokio::join!(writer, child.wait_with_output());
    let out = out.unwrap().stdout;
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4))
        .or_else(|| out.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2)));
    let Some((end, skip)) = split else {
        record(502);
        let _ = stream
            .write_all(
                b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await;
        return;
    };
    let cgi_head = String::from_utf8_lossy(&out[..end]).into_owned();
    let mut status = "200 OK".to_owned();
    let mut headers = String::new();
    for line in cgi_head.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(s) = line.strip_prefix("Status:") {
            status = s.trim().to_owned();
        } else if !line.is_empty() {
            headers.push_str(line);
            headers.push_str("\r\n");
        }
    }
    let body = &out[end + skip..];
    record(
        status
            .split(' ')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
    );
    let response = format!(
        "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.write_all(body).await;
    let _ = stream.flush().await;
}
