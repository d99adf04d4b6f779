//! `agentry serve` as a real process of a test: a settings file of its own, a free port,
//! started and waited for until it listens, stopped with SIGTERM (or killed when a test
//! fails); and the database servers (postmasters) a process runs, read from `/proc`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const EXE: &str = env!("CARGO_BIN_EXE_agentry");

/// How to start one server. Every server listens on a port of its own on loopback, keeps
/// its state in a fresh directory, does not wait to drain on stop, and runs the mock
/// provider.
#[derive(Default)]
pub struct Serve<'a> {
    /// Names its data directory and its failures.
    pub name: &'a str,
    /// Lines of the `[database]` table; none: the embedded default.
    pub database: &'a str,
    /// More lines of the `[cluster]` table.
    pub cluster: &'a str,
    /// `RUST_LOG`; empty: `warn`.
    pub rust_log: &'a str,
}

/// A running `agentry serve`.
pub struct Server {
    pub name: String,
    pub child: Child,
    /// `http://127.0.0.1:<port>`
    pub base: String,
    pub data: tempfile::TempDir,
}

impl Serve<'_> {
    pub fn start(&self) -> Server {
        self.start_with(|_| {})
    }

    /// Starts it, `before` changing the command first (a `pre_exec`, say); returns once
    /// it listens.
    pub fn start_with(&self, before: impl FnOnce(&mut Command)) -> Server {
        let name = self.name;
        let data = tempfile::Builder::new()
            .prefix(&format!("agentry-{name}-"))
            .tempdir()
            .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let database = match self.database {
            "" => String::new(),
            lines => format!("\n[database]\n{lines}\n"),
        };
        let config = data.path().join("agentry.toml");
        std::fs::write(
            &config,
            format!(
                r#"listen = "127.0.0.1:{port}"
data_dir = "{state}"
{database}
[cluster]
drain_timeout_s = 0
{cluster}

[providers.mock]
command = ["{EXE}"]
"#,
                state = data.path().join("state").display(),
                cluster = self.cluster,
            ),
        )
        .unwrap();
        let mut cmd = Command::new(EXE);
        cmd.args(["serve", "--config"])
            .arg(&config)
            .env_remove("DATABASE_URL")
            .env(
                "RUST_LOG",
                if self.rust_log.is_empty() {
                    "warn"
                } else {
                    self.rust_log
                },
            )
            .stdout(Stdio::piped());
        before(&mut cmd);
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("serve {name} exited before it listened"))
                .unwrap();
            if line.contains("listening on") {
                break;
            }
        }
        // Keep reading, so that the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            name: name.to_owned(),
            child,
            base: format!("http://127.0.0.1:{port}"),
            data,
        }
    }
}

impl Server {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The administrator token it wrote at its first start.
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.data.path().join("state/admin-token"))
            .unwrap()
            .trim()
            .to_owned()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: a signal to the child this test started, by its pid.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    /// The postmasters it runs.
    pub fn postmasters(&self) -> Vec<i32> {
        postmasters_under(self.pid())
    }

    /// Stops it as an operator would (resumed first, if it was paused), within 30 s.
    pub fn stop(mut self) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "serve {} did not stop",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    /// A test that fails leaves no server behind (its embedded cluster stops with it).
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signals to the child this test started, by its pid.
            unsafe {
                libc::kill(self.pid(), libc::SIGCONT);
                libc::kill(self.pid(), libc::SIGKILL);
            }
            let _ = self.child.wait();
        }
    }
}

// ---- processes, from /proc -------------------------------------------------------------

/// A process's state letter and parent pid.
pub fn stat_fields(pid: i32) -> Option<(String, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.to_owned();
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// A process's command name.
pub fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Every process's pid.
pub fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Live `postgres` processes whose parent is `parent`: the postmasters it runs.
pub fn postmasters_under(parent: i32) -> Vec<i32> {
    pids()
        .into_iter()
        .filter(|&pid| {
            comm(pid) == "postgres"
                && stat_fields(pid).is_some_and(|(state, ppid)| ppid == parent && state != "Z")
        })
        .collect()
}

/// The working directory of a process (a postmaster's is its data directory).
pub fn cwd(pid: i32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap()
}

/// Live postmasters of `data_dir`: `postgres` processes working in it whose parent is
/// not one of them.
pub fn postmasters_of(data_dir: &Path) -> Vec<i32> {
    pids()
        .into_iter()
        .filter(|&pid| {
            comm(pid) == "postgres"
                && std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|c| c == data_dir)
                && stat_fields(pid)
                    .is_some_and(|(state, ppid)| state != "Z" && comm(ppid) != "postgres")
        })
        .collect()
}
