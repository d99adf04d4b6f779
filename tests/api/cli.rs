//! The command-line client, run as a real process against a real server with the mock
//! provider: exit statuses, text and `--json` output, permissions, logs that resume.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use serde_json::{Value, json};

use crate::helpers::*;

/// Run `agentry <args>` against `app` with a config home of its own (so no stored login
/// leaks in); the process's output. The future owns what it needs, so it can be spawned.
fn agentry(
    app: &TestApp,
    home: &Path,
    args: &[&str],
) -> impl Future<Output = Output> + Send + 'static {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"));
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("AGENTRY_URL", &app.base)
        .env("AGENTRY_TOKEN", &app.token)
        .kill_on_drop(true);
    async move {
        tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .expect("the command ends")
            .unwrap()
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Each line of `--json` output as an event.
fn json_lines(o: &Output) -> Vec<Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[tokio::test]
async fn run_streams_a_turn_and_exits_by_its_outcome() {
    let app = spawn_app().await;
    let repo = git_repo();
    app.project(repo.path()).await;
    let home = tempfile::tempdir().unwrap();

    let ok = agentry(
        &app,
        home.path(),
        &[
            "run",
            "--project",
            "demo",
            "--provider",
            "mock",
            "hello there",
        ],
    )
    .await;
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    let text = stdout(&ok);
    assert!(text.contains("> hello there"), "{text}");
    assert!(text.contains("— turn completed"), "{text}");
    assert!(!text.contains("\x1b["), "no colour when piped");

    let failed = agentry(
        &app,
        home.path(),
        &[
            "run",
            "--project",
            "demo",
            "--provider",
            "mock",
            "--json",
            "/fail broken on purpose",
        ],
    )
    .await;
    assert_eq!(failed.status.code(), Some(1), "{}", stderr(&failed));
    let events = json_lines(&failed);
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "every event once, in order"
    );
    let last = events.last().unwrap();
    assert_eq!(last["kind"], "turn_completed");
    assert_eq!(last["data"]["outcome"], "failed");

    let detached = agentry(
        &app,
        home.path(),
        &[
            "run",
            "--project",
            "demo",
            "--provider",
            "mock",
            "--label",
            "ci=7",
            "--detach",
            "/sleep 100",
        ],
    )
    .await;
    assert_eq!(detached.status.code(), Some(0));
    let id = stdout(&detached).trim().to_owned();
    assert!(id.starts_with("agt_"), "{id}");
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["labels"], json!({"ci": "7"}));

    // Mistakes are exit 2 with a message, never a panic.
    for args in [
        &["run", "--project", "nope", "hi"][..],
        &["run", "--project", "demo", "--label", "novalue", "hi"],
        &["send", "agt_00000000000000000000000000000000", "hi"],
    ] {
        let o = agentry(&app, home.path(), args).await;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).starts_with("agentry: "),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let o = agentry(&app, home.path(), &["run", "--project", "demo"]).await;
    assert_eq!(
        o.status.code(),
        Some(2),
        "a missing prompt is a usage error"
    );
}

#[tokio::test]
async fn a_bad_token_or_an_unreachable_server_is_exit_2() {
    let app = spawn_app().await;
    let home = tempfile::tempdir().unwrap();
    let o = agentry(&app, home.path(), &["ls", "--token", "agt_pat_wrong"]).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("agentry login"), "{}", stderr(&o));
    // A refused event stream says why, from the refusal itself.
    let o = agentry(
        &app,
        home.path(),
        &["logs", "-f", "agt_01a2325aa80271258f70aa778486fac0"],
    )
    .await;
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not_found, 404"), "{}", stderr(&o));
    let o = agentry(
        &app,
        home.path(),
        &[
            "logs",
            "-f",
            "agt_01a2325aa80271258f70aa778486fac0",
            "--token",
            "agt_pat_wrong",
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("agentry login"), "{}", stderr(&o));
    let o = agentry(&app, home.path(), &["--url", "http://127.0.0.1:9", "ls"]).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("cannot reach http://127.0.0.1:9"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test]
async fn permissions_are_answered_by_flag_or_by_command() {
    let app = spawn_app().await;
    let repo = git_repo();
    app.project(repo.path()).await;
    let home = tempfile::tempdir().unwrap();

    let allowed = agentry(
        &app,
        home.path(),
        &[
            "run",
            "--project",
            "demo",
            "--provider",
            "mock",
            "--on-permission",
            "allow",
            "/ask deploy?",
        ],
    )
    .await;
    assert_eq!(allowed.status.code(), Some(0), "{}", stderr(&allowed));
    assert!(
        stdout(&allowed).contains("? permission: deploy?"),
        "{}",
        stdout(&allowed)
    );
    assert!(stdout(&allowed).contains("allow"), "{}", stdout(&allowed));

    // `wait`: someone else answers with `agentry deny`.
    let detached = agentry(
        &app,
        home.path(),
        &[
            "run",
            "--project",
            "demo",
            "--provider",
            "mock",
            "--detach",
            "/ask ship it?",
        ],
    )
    .await;
    let id = stdout(&detached).trim().to_owned();
    let waiting = app
        .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=10"))
        .await;
    assert_eq!(
        waiting["pending_permissions"].as_array().unwrap().len(),
        1,
        "{waiting}"
    );
    let none_named = agentry(&app, home.path(), &["approve", &id, "perm_nope"]).await;
    assert_eq!(none_named.status.code(), Some(2));
    let denied = agentry(&app, home.path(), &["deny", &id, "--message", "not today"]).await;
    assert_eq!(denied.status.code(), Some(0), "{}", stderr(&denied));
    let done = app.wait(&id).await;
    assert_eq!(done["last_turn"]["outcome"], "completed");
    let logs = agentry(&app, home.path(), &["logs", &id]).await;
    assert!(stdout(&logs).contains("deny"), "{}", stdout(&logs));
    let again = agentry(&app, home.path(), &["approve", &id]).await;
    assert_eq!(again.status.code(), Some(2), "nothing is pending any more");
    assert!(
        stderr(&again).contains("no pending permission"),
        "{}",
        stderr(&again)
    );
}

#[tokio::test]
async fn send_logs_diff_interrupt_archive_and_listings() {
    let app = spawn_app().await;
    let repo = git_repo();
    app.project(repo.path()).await;
    let home = tempfile::tempdir().unwrap();
    let run = agentry(
        &app,
        home.path(),
        &[
            "run",
            "--project",
            "demo",
            "--provider",
            "mock",
            "/write notes.txt from the cli",
        ],
    )
    .await;
    assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
    let id = app.get_ok("/v1/agents").await["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    let sent = agentry(
        &app,
        home.path(),
        &["send", &id, "second", "--wait", "--json"],
    )
    .await;
    assert_eq!(sent.status.code(), Some(0), "{}", stderr(&sent));
    let events = json_lines(&sent);
    assert_eq!(
        events.first().unwrap()["kind"],
        "turn_started",
        "only the new turn"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| e["kind"] == "user_message")
            .count(),
        1
    );

    let logs = agentry(&app, home.path(), &["logs", &id, "--json"]).await;
    let all = json_lines(&logs);
    assert_eq!(
        all.len(),
        app.timeline(&id).await.len(),
        "logs prints every event"
    );

    let diff = agentry(&app, home.path(), &["diff", &id]).await;
    assert!(stdout(&diff).contains("+from the cli"), "{}", stdout(&diff));

    let ls = agentry(&app, home.path(), &["ls"]).await;
    assert!(stdout(&ls).contains(&id), "{}", stdout(&ls));
    let ls = agentry(&app, home.path(), &["ls", "--json"]).await;
    let listed: Value = serde_json::from_str(&stdout(&ls)).unwrap();
    assert_eq!(listed["items"][0]["id"], id.as_str());

    let providers = agentry(&app, home.path(), &["providers"]).await;
    assert!(
        stdout(&providers).contains("mock"),
        "{}",
        stdout(&providers)
    );
    let models = agentry(&app, home.path(), &["models", "mock", "--json"]).await;
    let models: Value = serde_json::from_str(&stdout(&models)).unwrap();
    assert_eq!(models["items"][0]["id"], "mock-small");

    // Interrupt a sleeping turn: `send --wait` reports it canceled (exit 1).
    let mut events = app.events(&id, Some(latest_seq(&app, &id).await)).await;
    let waiter = tokio::spawn(agentry(
        &app,
        home.path(),
        &["send", &id, "/sleep 20000", "--wait"],
    ));
    // The sleeping turn started.
    events.until("turn_started", Duration::from_secs(30)).await;
    let interrupted = agentry(&app, home.path(), &["interrupt", &id]).await;
    assert_eq!(
        interrupted.status.code(),
        Some(0),
        "{}",
        stderr(&interrupted)
    );
    let waited = waiter.await.unwrap();
    assert_eq!(waited.status.code(), Some(1), "{}", stderr(&waited));
    assert!(String::from_utf8_lossy(&waited.stdout).contains("turn canceled"));

    let archived = agentry(&app, home.path(), &["archive", &id]).await;
    assert_eq!(archived.status.code(), Some(0));
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert!(!agent["archived_at"].is_null());
}

#[tokio::test]
async fn login_stores_the_server_and_token_privately() {
    use std::os::unix::fs::PermissionsExt;
    let app = spawn_app().await;
    let home = tempfile::tempdir().unwrap();
    let login = agentry(&app, home.path(), &["login"]).await;
    assert_eq!(login.status.code(), Some(0), "{}", stderr(&login));
    assert!(
        stdout(&login).contains("admin@localhost"),
        "{}",
        stdout(&login)
    );
    let file = home.path().join(".config/agentry/client.toml");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let stored = std::fs::read_to_string(&file).unwrap();
    assert!(stored.contains(&app.token));

    // Later commands use it with nothing in the environment.
    let o = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .arg("providers")
        .env_clear()
        .env("HOME", home.path())
        .output()
        .await
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A wrong token is not stored.
    let bad = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .args(["login", "--url", &app.base, "--token", "agt_pat_bad"])
        .env_clear()
        .env("HOME", home.path())
        .output()
        .await
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), stored);
}

#[tokio::test]
async fn login_with_device_stores_a_token_someone_approved() {
    let app = spawn_app().await;
    let home = tempfile::tempdir().unwrap();
    let mut login = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .args(["login", "--device", "--url", &app.base])
        .env_clear()
        .env("HOME", home.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // It shows the page and the code; a signed-in person approves that code.
    let err = login.stderr.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(err));
    let mut shown = String::new();
    let code = loop {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the code is shown")
            .unwrap()
            .unwrap_or_else(|| panic!("the login ended without a code: {shown}"));
        shown.push_str(&line);
        shown.push('\n');
        if let Some(code) = line.strip_prefix("and check that it shows the code ") {
            break code.trim().to_owned();
        }
    };
    assert!(
        shown.contains(&format!("{}/device?code={code}", app.base)),
        "{shown}"
    );
    let approved = app
        .post("/v1/auth/device/approve", json!({"user_code": code}))
        .await;
    assert_eq!(approved.status(), 200);
    let done = tokio::time::timeout(Duration::from_secs(30), login.wait_with_output())
        .await
        .expect("the login ends once approved")
        .unwrap();
    assert_eq!(done.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&done.stdout).contains("as admin@localhost"),
        "{}",
        String::from_utf8_lossy(&done.stdout)
    );
    // Later commands use the new token (not the one that approved it).
    let stored = std::fs::read_to_string(home.path().join(".config/agentry/client.toml")).unwrap();
    assert!(
        stored.contains("agt_pat_") && !stored.contains(&app.token),
        "{stored}"
    );
    let o = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .arg("providers")
        .env_clear()
        .env("HOME", home.path())
        .output()
        .await
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // A denied sign-in stores nothing and exits 2.
    let other = tempfile::tempdir().unwrap();
    let mut login = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .args(["login", "--device", "--url", &app.base])
        .env_clear()
        .env("HOME", other.path())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let err = login.stderr.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(err));
    let code = loop {
        let line = lines.next_line().await.unwrap().expect("a code");
        if let Some(code) = line.strip_prefix("and check that it shows the code ") {
            break code.trim().to_owned();
        }
    };
    let denied = app
        .post("/v1/auth/device/deny", json!({"user_code": code}))
        .await;
    assert_eq!(denied.status(), 200);
    let status = tokio::time::timeout(Duration::from_secs(30), login.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(2));
    assert!(!other.path().join(".config/agentry/client.toml").exists());
}

/// A TCP proxy in front of the server whose open connections the test can cut.
struct Cutter {
    addr: std::net::SocketAddr,
    cut: tokio::sync::watch::Sender<u64>,
    /// Connections accepted so far.
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Cutter {
    async fn start(target: &str) -> Self {
        let target = target.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, cuts) = tokio::sync::watch::channel(0u64);
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let target = target.clone();
                let mut cuts = cuts.clone();
                cuts.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cuts.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            cut,
            accepted,
        }
    }

    /// Drop every connection open now.
    fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
}

#[tokio::test]
async fn logs_follow_resumes_after_a_dropped_connection_without_gaps_or_repeats() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    let proxy = Cutter::start(&app.base).await;
    let home = tempfile::tempdir().unwrap();
    let mut follower = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentry"))
        .args(["logs", "-f", &agent, "--json"])
        .env_clear()
        .env("HOME", home.path())
        .env("AGENTRY_URL", format!("http://{}", proxy.addr))
        .env("AGENTRY_TOKEN", &app.token)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    // What it prints, read as it comes (a full pipe would stall it).
    let (seq_tx, mut seq_rx) = tokio::sync::mpsc::unbounded_channel();
    let stdout = follower.stdout.take().unwrap();
    tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let e: Value = serde_json::from_str(&line).unwrap();
            let _ = seq_tx.send(e["seq"].as_i64().unwrap());
        }
    });

    eventually("the follower to connect", Duration::from_secs(10), || {
        proxy.accepted.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    // A long turn; the connection is cut twice while it streams, each time once the
    // follower has printed another 500 events of it.
    let mut seqs = Vec::new();
    app.prompt(&agent, "/load 3000 1").await;
    for round in 1..=2 {
        while seqs.len() < round * 500 {
            let seq = tokio::time::timeout(Duration::from_secs(30), seq_rx.recv())
                .await
                .expect("the follower keeps printing")
                .expect("the follower is still running");
            seqs.push(seq);
        }
        proxy.cut();
        eventually("the follower to reconnect", Duration::from_secs(10), || {
            proxy.accepted.load(std::sync::atomic::Ordering::SeqCst) > round
        })
        .await;
    }
    let done = app.wait(&agent).await;
    assert_eq!(done["last_turn"]["outcome"], "completed");
    let last = app.timeline(&agent).await.last().unwrap()["seq"]
        .as_i64()
        .unwrap();

    while seqs.last() != Some(&last) {
        let seq = tokio::time::timeout(Duration::from_secs(30), seq_rx.recv())
            .await
            .expect("the follower keeps printing")
            .expect("the follower is still running");
        seqs.push(seq);
    }
    assert_eq!(
        seqs,
        (1..=last).collect::<Vec<_>>(),
        "every event once, in order"
    );
    let connections = proxy.accepted.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        connections >= 3,
        "the stream was cut and reopened: {connections} connections"
    );
    follower.kill().await.unwrap();
}

/// `agentry <args>` on a pseudo-terminal (util-linux `script` gives the process a
/// terminal for stdout and stderr); everything the terminal received, and the exit code.
async fn agentry_on_a_terminal(
    app: &TestApp,
    home: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
) -> (String, Option<i32>) {
    let quote = |a: &str| format!("'{}'", a.replace('\'', r"'\''"));
    let line = std::iter::once(env!("CARGO_BIN_EXE_agentry"))
        .chain(args.iter().copied())
        .map(quote)
        .collect::<Vec<_>>()
        .join(" ");
    let mut cmd = tokio::process::Command::new("script");
    cmd.args(["-qfec", &line, "/dev/null"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("TERM", "xterm-256color")
        .env("AGENTRY_URL", &app.base)
        .env("AGENTRY_TOKEN", &app.token)
        .envs(envs.iter().copied())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the command ends")
        .expect("util-linux `script` runs (it gives the client a terminal)");
    (stdout(&out), out.status.code())
}

/// Whether `text` holds an SGR (colour) escape sequence, `ESC [ <digits;> m`.
fn has_colour(text: &str) -> bool {
    text.split("\x1b[").skip(1).any(|rest| {
        let params = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b';')
            .count();
        rest.as_bytes().get(params) == Some(&b'm')
    })
}

#[tokio::test]
async fn a_terminal_sees_a_spinner_and_no_colour_with_no_color() {
    let app = spawn_app().await;
    let repo = git_repo();
    app.project(repo.path()).await;
    let home = tempfile::tempdir().unwrap();
    let frames = ["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"];
    let run = [
        "run",
        "--project",
        "demo",
        "--provider",
        "mock",
        "/sleep 1500",
    ];

    let (tty, code) = agentry_on_a_terminal(&app, home.path(), &run, &[]).await;
    assert_eq!(code, Some(0), "{tty}");
    let spun = frames.iter().filter(|f| tty.contains(*f)).count();
    assert!(spun >= 3, "the spinner turns while the turn runs: {tty:?}");
    assert!(
        tty.contains("working"),
        "it says what the agent does: {tty:?}"
    );
    assert!(has_colour(&tty), "coloured on a terminal: {tty:?}");
    // The conversation is still whole lines, the spinner cleared around them.
    assert!(tty.contains("— turn completed"), "{tty:?}");
    // What is left on screen of each line: the text after its last carriage return.
    let reply = tty
        .lines()
        .map(|l| l.trim_end_matches('\r').rsplit('\r').next().unwrap_or(""))
        .find(|l| l.contains("Slept"))
        .unwrap_or_else(|| panic!("the reply is printed: {tty:?}"));
    assert!(
        reply.ends_with("Slept for 1500 ms.") && !frames.iter().any(|f| reply.contains(f)),
        "the reply's line holds the reply alone: {reply:?}"
    );
    assert!(
        !tty.contains("[running]"),
        "on a terminal the status is the spinner's, not a line: {tty:?}"
    );

    let (plain, code) = agentry_on_a_terminal(&app, home.path(), &run, &[("NO_COLOR", "1")]).await;
    assert_eq!(code, Some(0), "{plain}");
    let spun = frames.iter().filter(|f| plain.contains(*f)).count();
    assert!(spun >= 3, "NO_COLOR keeps the spinner: {plain:?}");
    assert!(!has_colour(&plain), "NO_COLOR: no colour at all: {plain:?}");
    assert!(plain.contains("— turn completed"), "{plain:?}");
}

#[tokio::test]
async fn send_to_a_busy_agent_says_the_message_was_queued_and_waits_for_its_turn() {
    let app = spawn_app().await;
    let home = tempfile::tempdir().unwrap();
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    app.prompt(&id, "/ask go on?").await;
    let w = app.wait(&id).await;
    assert_eq!(w["status"], "waiting_permission");
    let request = w["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let sent = agentry(&app, home.path(), &["send", &id, "queued one"]).await;
    assert_eq!(sent.status.code(), Some(0), "{}", stderr(&sent));
    assert!(
        stdout(&sent).contains("queued (position 1"),
        "{}",
        stdout(&sent)
    );
    // `--wait` follows the turn the queued message starts, once the running one ends.
    let mut events = app.events(&id, Some(latest_seq(&app, &id).await)).await;
    let waiter = tokio::spawn(agentry(
        &app,
        home.path(),
        &["send", &id, "queued two", "--wait", "--json"],
    ));
    events
        .until("message_queued", Duration::from_secs(30))
        .await;
    let q = app
        .get_ok(&format!("/v1/agents/{id}/messages?state=queued"))
        .await;
    assert_eq!(
        q["items"].as_array().unwrap().len(),
        2,
        "the second message waits: {q}"
    );
    app.post_ok(
        &format!("/v1/agents/{id}/permissions/{request}"),
        json!({"behavior": "allow"}),
        200,
    )
    .await;
    let out = waiter.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let lines = json_lines(&out);
    assert_eq!(lines[0]["queued"], true, "{lines:?}");
    let texts: Vec<&Value> = lines
        .iter()
        .filter(|e| e["kind"] == "user_message")
        .map(|e| &e["data"]["text"])
        .collect();
    assert_eq!(texts, ["queued two"], "only its own turn is shown");
    assert_eq!(lines.last().unwrap()["kind"], "turn_completed", "{lines:?}");
}

#[tokio::test]
async fn usage_prints_the_teams_totals_and_groups() {
    let app = spawn_app().await;
    let home = tempfile::tempdir().unwrap();
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    app.prompt(&id, "hello").await;
    app.wait(&id).await;
    let api = app.get_ok("/v1/usage?group_by=provider").await;
    let out = agentry(
        &app,
        home.path(),
        &["usage", "--group-by", "provider", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let printed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(printed["totals"], api["totals"]);
    assert_eq!(printed["totals"]["turns"], 1, "{printed}");
    assert_eq!(printed["groups"][0]["key"], "mock", "{printed}");
    let text = agentry(
        &app,
        home.path(),
        &["usage", "--group-by", "provider", "--from", "2020-01-01"],
    )
    .await;
    assert_eq!(text.status.code(), Some(0), "{}", stderr(&text));
    let lines = stdout(&text);
    assert!(lines.lines().any(|l| l.starts_with("mock ")), "{lines}");
    assert!(lines.lines().any(|l| l.starts_with("total ")), "{lines}");
    let bad = agentry(&app, home.path(), &["usage", "--group-by", "weather"]).await;
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
}

/// The seq of the agent's latest event: a stream opened after it shows only what follows.
async fn latest_seq(app: &TestApp, agent: &str) -> i64 {
    app.timeline(agent)
        .await
        .last()
        .and_then(|e| e["seq"].as_i64())
        .unwrap_or(0)
}
