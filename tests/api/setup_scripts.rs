//! Repository setup scripts: `.agentry.toml` on the base branch names commands that run
//! in each new worktree (and before it is archived), with their progress on the team
//! stream and their outcome on the workspace. Under the `proxy` network mode they reach
//! the network through an egress endpoint of their own run, and a refusal is recorded.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::attack_egress::origin;
use crate::helpers::*;

/// A repository whose `main` commits `.agentry.toml` with `toml`.
fn repo_with(toml: &str) -> tempfile::TempDir {
    let repo = git_repo();
    std::fs::write(repo.path().join(".agentry.toml"), toml).unwrap();
    git(repo.path(), &["add", "."]);
    git(repo.path(), &["commit", "-q", "-m", "setup"]);
    repo
}

async fn team_stream(app: &TestApp) -> SseReader {
    let res = app
        .client
        .get(app.url("/v1/events"))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    SseReader::from_response(res)
}

async fn workspace(app: &TestApp, repo: &Path) -> Value {
    let project = app.project(repo).await;
    app.post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await
}

async fn ledger_rows(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn setup_runs_in_the_new_worktree_and_reports_progress() {
    let app = spawn_app().await;
    let repo = repo_with(
        r#"[worktree]
setup = [["sh", "-c", "echo preparing; echo made > made.txt"], ["sh", "-c", "echo \"$AGENTRY_WORKSPACE_ID\" >&2"]]
"#,
    );
    let mut stream = team_stream(&app).await;
    let ws = workspace(&app, repo.path()).await;
    assert_eq!(ws["status"], "active");
    assert_eq!(ws["setup_status"], "succeeded");
    let output = ws["setup_output"].as_str().unwrap();
    assert!(
        output.contains("$ sh -c 'echo preparing; echo made > made.txt'\npreparing\n"),
        "{output}"
    );
    assert!(
        output.contains(ws["id"].as_str().unwrap()),
        "the workspace id reaches the commands: {output}"
    );
    assert_eq!(
        std::fs::read_to_string(path_of(&ws["path"]).join("made.txt")).unwrap(),
        "made\n"
    );

    let events = stream
        .until("workspace_setup", Duration::from_secs(10))
        .await;
    assert_eq!(events.last().unwrap().data["data"]["status"], "running");
    let mut statuses = vec!["running".to_owned()];
    loop {
        let e = stream
            .next(Duration::from_secs(10))
            .await
            .expect("setup progress");
        if e.event != "workspace_setup" {
            continue;
        }
        assert_eq!(e.data["data"]["workspace_id"], ws["id"]);
        let status = e.data["data"]["status"].as_str().unwrap().to_owned();
        statuses.push(status.clone());
        if status != "running" {
            assert_eq!(e.data["data"]["output"], ws["setup_output"]);
            break;
        }
    }
    assert_eq!(statuses.last().unwrap(), "succeeded");
    assert_eq!(ledger_rows(&app).await, 0, "every command was reaped");

    // The outcome stays on the workspace.
    let again = app
        .get_ok(&format!("/v1/workspaces/{}", ws["id"].as_str().unwrap()))
        .await;
    assert_eq!(again["setup_status"], "succeeded");
    assert_eq!(again["setup_output"], ws["setup_output"]);
}

#[tokio::test]
async fn a_failed_setup_marks_the_workspace_and_agents_can_still_open() {
    let app = spawn_app().await;
    let repo = repo_with(
        r#"[worktree]
setup = [["sh", "-c", "echo boom >&2; exit 3"], ["touch", "never-made"]]
"#,
    );
    // What the project's checkout has uncommitted does not count: only the base commit.
    std::fs::write(
        repo.path().join(".agentry.toml"),
        "[worktree]\nsetup = [[\"true\"]]\n",
    )
    .unwrap();
    let ws = workspace(&app, repo.path()).await;
    assert_eq!(ws["status"], "setup_failed");
    assert_eq!(ws["setup_status"], "failed");
    let output = ws["setup_output"].as_str().unwrap();
    assert!(output.contains("boom\n"), "{output}");
    assert!(output.contains("`sh` exited with status 3"), "{output}");
    assert!(
        !output.contains("never-made"),
        "setup stops at the first failure"
    );
    assert!(!path_of(&ws["path"]).join("never-made").exists());

    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "hello"}),
            201,
        )
        .await;
    let w = app.wait(agent["id"].as_str().unwrap()).await;
    assert_eq!(w["last_turn"]["outcome"], "completed");
}

#[tokio::test]
async fn an_invalid_file_fails_the_setup_and_says_why() {
    let app = spawn_app().await;
    let repo = repo_with("[worktree]\nsetup = [[\"true\"]]\nprepare = []\n");
    let ws = workspace(&app, repo.path()).await;
    assert_eq!(ws["status"], "setup_failed");
    let output = ws["setup_output"].as_str().unwrap();
    assert!(
        output.contains(".agentry.toml") && output.contains("prepare"),
        "{output}"
    );

    // No file, no setup.
    let plain = git_repo();
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": "plain", "repo_path": plain.path()}),
            201,
        )
        .await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    assert_eq!(ws["status"], "active");
    assert!(ws["setup_status"].is_null());
    assert!(ws["setup_output"].is_null());
}

#[tokio::test]
async fn a_setup_that_runs_out_of_time_is_stopped() {
    let app = spawn_app_with(|s| s.workspaces.setup_timeout_s = 1).await;
    let repo = repo_with(
        r#"[worktree]
setup = [["sh", "-c", "echo started; sleep 3737 & sleep 3737"]]
"#,
    );
    let ws = workspace(&app, repo.path()).await;
    assert_eq!(ws["status"], "setup_failed");
    let output = ws["setup_output"].as_str().unwrap();
    assert!(output.contains("started\n"), "{output}");
    assert!(output.contains("timed out after 1 s"), "{output}");
    assert_eq!(
        ledger_rows(&app).await,
        0,
        "the command's group was stopped"
    );
    let left = std::process::Command::new("pgrep")
        .args(["-f", "sleep 3737"])
        .output()
        .unwrap();
    assert!(
        left.stdout.is_empty(),
        "no `sleep 3737` is left: {}",
        String::from_utf8_lossy(&left.stdout)
    );
    assert_eq!(
        endpoints(&app),
        Vec::<std::ffi::OsString>::new(),
        "the run's egress endpoint went with it"
    );
}

#[tokio::test]
async fn teardown_runs_before_the_worktree_goes() {
    // The marker is written outside the worktree, which a sandbox forbids.
    let app = crate::helpers::spawn_app_with(|s| {
        s.sandbox.mode = agentry::config::SandboxMode::Off;
    })
    .await;
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("torn-down");
    let repo = repo_with(&format!(
        r#"[worktree]
teardown = [["sh", "-c", "test -f README.md && echo \"$AGENTRY_BRANCH\" > '{}'"]]
"#,
        marker.display()
    ));
    let ws = workspace(&app, repo.path()).await;
    assert!(ws["setup_status"].is_null(), "no setup commands, no setup");
    let mut stream = team_stream(&app).await;
    let id = ws["id"].as_str().unwrap();
    app.post_ok(&format!("/v1/workspaces/{id}/archive"), json!({}), 200)
        .await;
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        format!("{}\n", ws["branch"].as_str().unwrap()),
        "teardown ran inside the worktree before it was removed"
    );
    assert!(!path_of(&ws["path"]).exists());
    let events = stream
        .until("workspace_archived", Duration::from_secs(10))
        .await;
    let teardown: Vec<&str> = events
        .iter()
        .filter(|e| e.event == "workspace_teardown")
        .map(|e| e.data["data"]["status"].as_str().unwrap())
        .collect();
    assert_eq!(teardown.first(), Some(&"running"));
    assert_eq!(teardown.last(), Some(&"succeeded"));
}

/// A setup cut short by the server stopping does not stay `running` forever: the next
/// start of the same replica fails it (another replica's runs are left alone).
#[tokio::test]
async fn a_setup_interrupted_by_a_restart_is_failed_at_the_next_start() {
    let app = spawn_app().await;
    let repo = git_repo();
    let mine = workspace(&app, repo.path()).await;
    let theirs = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": mine["project_id"], "title": "other"}),
            201,
        )
        .await;
    let (db, data_dir, token) = app.stop().await;
    let pool = sqlx::PgPool::connect_with(db.clone()).await.unwrap();
    let replica = crate::helpers::settings(data_dir.path()).replica();
    for (ws, owner) in [(&mine, replica.as_str()), (&theirs, "another-replica")] {
        let id = ws["id"].as_str().unwrap().trim_start_matches("wsp_");
        sqlx::query(
            "UPDATE workspaces SET setup_status = 'running', setup_output = 'half way\n', setup_replica = $2
             WHERE id = $1::uuid",
        )
        .bind(id)
        .bind(owner)
        .execute(&pool)
        .await
        .unwrap();
    }
    pool.close().await;

    let app = spawn_on(db, data_dir, Some(token)).await;
    let ws = app
        .get_ok(&format!("/v1/workspaces/{}", mine["id"].as_str().unwrap()))
        .await;
    assert_eq!(ws["status"], "setup_failed");
    assert_eq!(ws["setup_status"], "failed");
    let output = ws["setup_output"].as_str().unwrap();
    assert!(output.starts_with("half way\n"), "{output}");
    assert!(
        output.contains("the server stopped while setup was running"),
        "{output}"
    );
    let other = app
        .get_ok(&format!(
            "/v1/workspaces/{}",
            theirs["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(other["setup_status"], "running", "not this replica's run");
}

// ---- the network, under the `proxy` mode --------------------------------------------

/// Settings where sandboxes reach the network only through the egress proxy, `allow` are
/// the server's entries, and the network probe is readable inside.
fn proxy_mode(s: &mut agentry::config::Settings, allow: Vec<String>) {
    s.sandbox.network = agentry::config::SandboxNetwork::Proxy;
    s.egress.allow = allow;
    s.sandbox
        .extra_read_only
        .push(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support"));
}

/// `python3 tests/support/net_probe.py <args>` as a TOML argv.
fn probe(args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/net_probe.py");
    let mut argv = vec!["python3".to_owned(), script.display().to_string()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    serde_json::to_string(&argv).unwrap()
}

/// What each probe printed, in order (the output's lines that are JSON).
fn probe_reports(output: &str) -> Vec<Value> {
    output
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

/// The egress endpoints open under the server's data dir.
fn endpoints(app: &TestApp) -> Vec<std::ffi::OsString> {
    match std::fs::read_dir(app.data_dir.path().join("egress")) {
        Ok(dir) => dir.map(|e| e.unwrap().file_name()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn under_the_proxy_mode_setup_reaches_what_the_server_allows() {
    let allowed = origin("hello from setup").await;
    let port = allowed.port;
    // A loopback address is internal: only an exact entry of the server's reaches it.
    let app = spawn_app_with(|s| proxy_mode(s, vec![format!("127.0.0.1:{port}")])).await;
    let repo = repo_with(&format!(
        "[worktree]\nsetup = [{}, {}]\n",
        probe(&["http", &format!("http://127.0.0.1:{port}/proxied")]),
        probe(&["get", &format!("http://127.0.0.1:{port}/forwarded")]),
    ));
    let ws = workspace(&app, repo.path()).await;
    let output = ws["setup_output"].as_str().unwrap();
    assert_eq!(ws["setup_status"], "succeeded", "{output}");
    // Through the proxy named in the commands' environment, then through the loopback
    // forward of the server's entry.
    assert_eq!(
        probe_reports(output),
        [
            json!([200, "hello from setup"]),
            json!([200, "hello from setup"])
        ],
        "{output}"
    );
    let requests = allowed.requests.lock().await.clone();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert!(requests[0].starts_with("GET /proxied HTTP/1.1\r\n"));
    assert!(requests[1].starts_with("GET /forwarded HTTP/1.1\r\n"));
    assert!(!output.contains("network_denied"), "{output}");
    assert_eq!(
        endpoints(&app),
        Vec::<std::ffi::OsString>::new(),
        "the run's egress endpoint is closed and its directory removed"
    );
}

#[tokio::test]
async fn a_setup_commands_refused_connections_are_recorded_with_its_outcome() {
    let app = spawn_app_with(|s| proxy_mode(s, Vec::new())).await;
    // The team's owners add a host (a name that never resolves: past the list, the proxy
    // answers that it does not resolve where it would answer 403).
    let team = app.get_ok("/v1/me").await["teams"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.put_ok(
        &format!("/v1/teams/{team}/network"),
        json!({"allow": ["team-host.invalid"]}),
    )
    .await;
    let repo = repo_with(&format!(
        "[worktree]\nsetup = [{}, {}, {}, [\"false\"]]\nteardown = [{}]\n",
        probe(&["http", "http://blocked.example.com/steal"]),
        // A provider's host is not on the commands' list: no provider runs them.
        probe(&["connect", "api.anthropic.com", "443"]),
        probe(&["http", "http://team-host.invalid/"]),
        probe(&["http", "http://teardown.example.com/"]),
    ));
    let mut stream = team_stream(&app).await;
    let ws = workspace(&app, repo.path()).await;
    let output = ws["setup_output"].as_str().unwrap();
    assert_eq!(ws["setup_status"], "failed", "{output}");
    let reports = probe_reports(output);
    assert_eq!(reports.len(), 3, "{output}");
    assert_eq!(reports[0][0], 403, "{output}");
    assert!(
        reports[0][1].as_str().unwrap().contains("not_allowed"),
        "{output}"
    );
    assert_eq!(reports[1][0], 403, "{output}");
    assert_eq!(reports[2][0], 502, "{output}");
    assert!(
        reports[2][1].as_str().unwrap().contains("does not resolve"),
        "{output}"
    );
    // Each refusal is in the output kept on the workspace…
    for line in [
        "[agentry] network_denied: blocked.example.com:80 (not_allowed)\n",
        "[agentry] network_denied: api.anthropic.com:443 (not_allowed)\n",
    ] {
        assert!(output.contains(line), "{line:?} in {output}");
    }
    assert_eq!(output.matches("network_denied").count(), 2, "{output}");
    // …and a `network_denied` event on the team stream, before the setup's last event.
    let mut denied = Vec::new();
    loop {
        let e = stream
            .next(Duration::from_secs(15))
            .await
            .expect("setup progress");
        match e.event.as_str() {
            "network_denied" => denied.push(e.data["data"].clone()),
            "workspace_setup" if e.data["data"]["status"] != "running" => break,
            _ => {}
        }
    }
    let refused = |host: &str, port: u16| {
        json!({"workspace_id": ws["id"], "phase": "setup", "host": host, "port": port,
            "reason": "not_allowed"})
    };
    assert_eq!(
        denied,
        [
            refused("blocked.example.com", 80),
            refused("api.anthropic.com", 443)
        ]
    );
    assert_eq!(
        endpoints(&app),
        Vec::<std::ffi::OsString>::new(),
        "a failed run's endpoint is closed too"
    );

    // Teardown's run has an endpoint of its own, and says its phase.
    let id = ws["id"].as_str().unwrap();
    app.post_ok(&format!("/v1/workspaces/{id}/archive"), json!({}), 200)
        .await;
    let events = stream
        .until("workspace_archived", Duration::from_secs(15))
        .await;
    let denied: Vec<&Value> = events
        .iter()
        .filter(|e| e.event == "network_denied")
        .map(|e| &e.data["data"])
        .collect();
    assert_eq!(
        denied,
        [&json!({"workspace_id": ws["id"], "phase": "teardown",
            "host": "teardown.example.com", "port": 80, "reason": "not_allowed"})]
    );
    let output = events
        .iter()
        .rfind(|e| e.event == "workspace_teardown")
        .map(|e| e.data["data"]["output"].as_str().unwrap().to_owned())
        .unwrap();
    assert!(
        output.contains("[agentry] network_denied: teardown.example.com:80 (not_allowed)\n"),
        "{output}"
    );
    assert_eq!(endpoints(&app), Vec::<std::ffi::OsString>::new());
}
