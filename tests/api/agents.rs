//! Agent lifecycle: turns, permissions, failures, interrupts, close/reopen, crashes and
//! restarts.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::helpers::*;

#[tokio::test]
async fn every_turn_has_one_start_one_user_message_one_completion() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    for text in ["hello", "/tool ls -la", "second message"] {
        let turn = app.prompt(&id, text).await;
        assert_eq!(app.wait(&id).await["last_turn"]["turn_id"], turn.as_str());
    }
    let events = app.timeline(&id).await;
    let turns: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "turn_started")
        .map(|e| e["turn_id"].as_str().unwrap())
        .collect();
    assert_eq!(turns.len(), 3);
    for turn in turns {
        let of: Vec<_> = events.iter().filter(|e| e["turn_id"] == turn).collect();
        let count = |k: &str| of.iter().filter(|e| e["kind"] == k).count();
        assert_eq!(count("turn_started"), 1);
        assert_eq!(count("user_message"), 1);
        assert_eq!(count("turn_completed"), 1);
        assert_eq!(
            of.last().unwrap()["kind"],
            "turn_completed",
            "nothing of a turn comes after its completion"
        );
        // Deltas of each message concatenate to the message.
        for msg in of.iter().filter(|e| e["kind"] == "assistant_message") {
            let mid = &msg["data"]["message_id"];
            let joined: String = of
                .iter()
                .filter(|e| e["kind"] == "assistant_delta" && &e["data"]["message_id"] == mid)
                .map(|e| e["data"]["text"].as_str().unwrap())
                .collect();
            assert_eq!(joined, msg["data"]["text"].as_str().unwrap());
            assert!(!joined.is_empty());
        }
    }
    let tool: Vec<_> = events.iter().filter(|e| e["kind"] == "tool_call").collect();
    assert_eq!(tool.first().unwrap()["data"]["tool_kind"], "shell");
    assert_eq!(tool.last().unwrap()["data"]["status"], "completed");
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "seq is dense"
    );
}

#[tokio::test]
async fn permission_answers_busy_and_expiry() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.prompt(&id, "/ask ship it?").await;
    let w = app.wait(&id).await;
    assert_eq!(w["status"], "waiting_permission");
    let req = w["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A prompt during the turn that may not be queued is refused.
    let busy = app
        .post(
            &format!("/v1/agents/{id}/messages"),
            json!({"text": "again", "queue": false}),
        )
        .await;
    assert_eq!(expect_status(busy, 409).await["code"], "agent_busy");

    let path = format!("/v1/agents/{id}/permissions/{req}");
    let bad = app
        .post(&path, json!({"behavior": "allow", "option_id": "deny"}))
        .await;
    assert_eq!(expect_status(bad, 422).await["code"], "validation_failed");
    app.post_ok(&path, json!({"behavior": "deny"}), 200).await;
    let twice = app.post(&path, json!({"behavior": "deny"})).await;
    assert_eq!(
        expect_status(twice, 409).await["code"],
        "permission_already_resolved"
    );
    let w = app.wait(&id).await;
    assert_eq!(w["last_turn"]["outcome"], "completed");
    let events = app.timeline(&id).await;
    let reply = events
        .iter()
        .rev()
        .find(|e| e["kind"] == "assistant_message")
        .unwrap();
    assert!(reply["data"]["text"].as_str().unwrap().contains("deny"));
    let resolved = events
        .iter()
        .find(|e| e["kind"] == "permission_resolved")
        .unwrap();
    assert_eq!(resolved["data"]["behavior"], "deny");

    // A request left pending when the agent closes expires.
    app.prompt(&id, "/ask another?").await;
    let w = app.wait(&id).await;
    let req = w["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    let late = app
        .post(
            &format!("/v1/agents/{id}/permissions/{req}"),
            json!({"behavior": "allow"}),
        )
        .await;
    assert_eq!(expect_status(late, 409).await["code"], "permission_expired");
    let perms = app
        .get_ok(&format!("/v1/agents/{id}/permissions?status=expired"))
        .await;
    assert_eq!(perms["items"][0]["request_id"], req.as_str());
    let unknown = app
        .post(
            &format!("/v1/agents/{id}/permissions/perm_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"),
            json!({"behavior": "allow"}),
        )
        .await;
    assert_eq!(expect_status(unknown, 404).await["code"], "not_found");
}

#[tokio::test]
async fn failed_and_interrupted_turns() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.prompt(&id, "/fail the tests are red").await;
    let w = app.wait(&id).await;
    assert_eq!(w["last_turn"]["outcome"], "failed");
    assert_eq!(w["last_turn"]["error"], "the tests are red");
    let done = app
        .timeline(&id)
        .await
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "turn_completed")
        .unwrap();
    assert_eq!(done["data"]["error"], "the tests are red");

    app.prompt(&id, "/sleep 30000").await;
    let started = Instant::now();
    let r = app
        .post(&format!("/v1/agents/{id}/interrupt"), json!({}))
        .await;
    assert_eq!(r.status(), 202);
    let w = app.wait(&id).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(w["last_turn"]["outcome"], "canceled");
    app.prompt(&id, "still there?").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
}

/// A paced `/load` runs on a thread of the mock's own: an interrupt still ends it at once,
/// nothing of it arrives after its turn's end, and the next paced load runs on.
#[tokio::test]
async fn an_interrupted_paced_load_ends_at_once_and_the_next_one_runs() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let mut events = app.events(&id, None).await;
    // 1,000 chunks 20 ms apart: 20 s unless interrupted.
    let first = app.prompt(&id, "/load 1000 20").await;
    let mut chunks = 0;
    while chunks < 3 {
        let e = events
            .next(Duration::from_secs(10))
            .await
            .expect("the load's chunks arrive");
        if e.event == "assistant_delta" {
            chunks += 1;
        }
    }
    let started = Instant::now();
    let r = app
        .post(&format!("/v1/agents/{id}/interrupt"), json!({}))
        .await;
    assert_eq!(r.status(), 202);
    let w = app.wait(&id).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the interrupt took {:?}",
        started.elapsed()
    );
    assert_eq!(w["last_turn"]["outcome"], "canceled");
    let second = app.prompt(&id, "/load 5 10").await;
    let w = app.wait(&id).await;
    assert_eq!(w["last_turn"]["turn_id"], second.as_str());
    assert_eq!(w["last_turn"]["outcome"], "completed");

    let timeline = app.timeline(&id).await;
    for turn in [&first, &second] {
        let end = timeline
            .iter()
            .find(|e| e["kind"] == "turn_completed" && e["turn_id"] == turn.as_str())
            .unwrap_or_else(|| panic!("turn {turn} ended"))["seq"]
            .as_i64()
            .unwrap();
        let late: Vec<&Value> = timeline
            .iter()
            .filter(|e| e["kind"] == "assistant_delta" && e["seq"].as_i64().unwrap() > end)
            .filter(|e| e["turn_id"] == turn.as_str() || e["turn_id"].is_null())
            .collect();
        assert!(late.is_empty(), "chunks after turn {turn} ended: {late:?}");
    }
    let deltas = |turn: &str| {
        timeline
            .iter()
            .filter(|e| e["kind"] == "assistant_delta" && e["turn_id"] == turn)
            .count()
    };
    assert!((3..1000).contains(&deltas(&first)), "{}", deltas(&first));
    assert_eq!(deltas(&second), 5);
}

#[tokio::test]
async fn close_ends_the_process_and_a_prompt_reopens() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    let pid = agent["runtime"]["pid"].as_i64().expect("a live pid") as i32;
    assert!(pid_alive(pid));
    let tmp = tmpdir_of(pid);
    assert_eq!(
        tmp.parent(),
        Some(app.data_dir.path().join("tmp").as_path()),
        "the process has a TMPDIR of its own"
    );
    std::fs::write(tmp.join("left-behind.so"), b"what a CLI leaves").unwrap();
    let closed = app
        .post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    assert_eq!(closed["status"], "closed");
    assert!(closed["runtime"]["pid"].is_null());
    let owner: Option<String> =
        sqlx::query_scalar("SELECT owner_replica FROM agents WHERE id = $1")
            .bind(id.parse::<agentry::domain::AgentId>().unwrap().uuid())
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        owner, None,
        "a closed agent's lease is given up before the answer"
    );
    eventually("the process group is gone", Duration::from_secs(5), || {
        !pid_alive(pid)
    })
    .await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the ledger row goes with the process");
    assert!(!tmp.exists(), "its TMPDIR goes with it, contents and all");

    app.prompt(&id, "are you back?").await;
    let w = app.wait(&id).await;
    assert_eq!(w["last_turn"]["outcome"], "completed");
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_ne!(
        agent["runtime"]["pid"].as_i64().unwrap() as i32,
        pid,
        "a new process"
    );
    let starts = app
        .timeline(&id)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "session_started")
        .collect::<Vec<_>>();
    assert_eq!(starts.len(), 2);
    assert_eq!(
        starts[1]["data"]["resumed"], true,
        "the session was resumed from its handle"
    );

    // Archive hides it from the default list and keeps the timeline.
    let r = app.delete(&format!("/v1/agents/{id}")).await;
    assert_eq!(r.status(), 204);
    let list = app.get_ok("/v1/agents").await;
    assert!(list["items"].as_array().unwrap().is_empty());
    let list = app
        .get_ok("/v1/agents?include_archived=true&label=ci_run:1")
        .await;
    assert!(
        list["items"].as_array().unwrap().is_empty(),
        "label filter applies"
    );
    assert!(!app.timeline(&id).await.is_empty());
}

/// The `nice` of a process, from /proc (field 19 of its stat line).
fn nice_of(pid: i32) -> i64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("a live process");
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    // Fields after the command name start at field 3.
    fields[19 - 3].parse().unwrap()
}

#[tokio::test]
async fn agent_processes_run_below_the_servers_cpu_priority() {
    let ours = nice_of(std::process::id() as i32);
    assert!(
        ours < 10,
        "the test runs at nice {ours}; it needs less than 10"
    );
    let repo = git_repo();
    let app = spawn_app().await;
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let pid = app.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["pid"]
        .as_i64()
        .expect("a live pid") as i32;
    assert_eq!(nice_of(pid), 10, "agents.nice defaults to 10");

    let app = spawn_app_with(|s| s.agents.nice = 0).await;
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let pid = app.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["pid"]
        .as_i64()
        .expect("a live pid") as i32;
    assert_eq!(nice_of(pid), ours, "0 leaves them at the server's priority");
}

#[tokio::test]
async fn an_idle_agent_process_is_stopped_and_the_next_prompt_resumes() {
    let app = spawn_app_with(|s| s.agents.idle_timeout_s = 2).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.prompt(&id, "remember me").await;
    app.wait(&id).await;
    let pid = app.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["pid"]
        .as_i64()
        .expect("a live pid") as i32;
    eventually(
        "the idle process is stopped",
        Duration::from_secs(10),
        || !pid_alive(pid),
    )
    .await;
    // The actor records the close right after the process is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    let agent = loop {
        let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
        if agent["status"] == "closed" || Instant::now() > deadline {
            break agent;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(agent["status"], "closed");
    assert!(agent["runtime"]["pid"].is_null());
    assert!(
        agent["status_reason"]
            .as_str()
            .is_some_and(|r| r.contains("idle")),
        "the reason says why: {agent}"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the ledger row goes with the process");

    app.prompt(&id, "still there?").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
    let starts: Vec<Value> = app
        .timeline(&id)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "session_started")
        .collect();
    assert_eq!(starts.len(), 2);
    assert_eq!(
        starts[1]["data"]["resumed"], true,
        "the same session resumed"
    );
}

#[tokio::test]
async fn a_waiting_permission_request_keeps_an_agent_from_idling_out() {
    let app = spawn_app_with(|s| s.agents.idle_timeout_s = 1).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.prompt(&id, "/ask run it").await;
    let mut events = app.events(&id, None).await;
    events
        .until("permission_requested", Duration::from_secs(10))
        .await;
    let pid = app.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["pid"]
        .as_i64()
        .unwrap() as i32;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(pid_alive(pid), "a turn waiting for a person is not idle");
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["status"], "waiting_permission");
}

#[tokio::test]
async fn a_killed_agent_process_fails_the_turn_quickly() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    app.prompt(&id, "/sleep 60000").await;
    let pid = app.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["pid"]
        .as_i64()
        .unwrap() as i32;
    let killed = Instant::now();
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let w = app.wait(&id).await;
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "the turn failed within 2 s ({:?})",
        killed.elapsed()
    );
    assert_eq!(w["last_turn"]["outcome"], "failed");
    let err = w["last_turn"]["error"].as_str().unwrap();
    assert!(err.contains("exited"), "a clear error: {err}");
    assert_ne!(w["status"], "running");
    app.prompt(&id, "usable again?").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
}

/// A ledger row of this server's replica, as a server that stopped would have left it:
/// process `pid` (its own group) started at `start_ticks` in this boot, with `tmpdir`.
async fn record_process(
    app: &TestApp,
    id: uuid::Uuid,
    pid: i32,
    start_ticks: i64,
    tmpdir: &std::path::Path,
) {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let replica = crate::helpers::settings(app.data_dir.path()).replica();
    sqlx::query(
        "INSERT INTO managed_processes (id, pid, pgid, start_ticks, boot_id, command, replica, tmpdir)
         VALUES ($1, $2, $2, $3, $4, '{leftover}', $5, $6)",
    )
    .bind(id)
    .bind(pid)
    .bind(start_ticks)
    .bind(boot_id.trim())
    .bind(&replica)
    .bind(tmpdir.to_str().unwrap())
    .execute(&app.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_restart_keeps_timelines_and_leaves_nothing_running() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.prompt(&id, "before the restart").await;
    app.wait(&id).await;
    app.prompt(&id, "/sleep 60000").await;
    let before = app.timeline(&id).await;

    // A leftover of "an earlier run": a live process recorded in the ledger.
    use std::os::unix::process::CommandExt;
    let mut leftover = std::process::Command::new("sleep")
        .arg("600")
        .process_group(0)
        .spawn()
        .unwrap();
    let lpid = leftover.id();
    let stat = std::fs::read_to_string(format!("/proc/{lpid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let start_ticks: i64 = fields[19].parse().unwrap();
    let row = uuid::Uuid::now_v7();
    let ltmp = app
        .data_dir
        .path()
        .join("tmp")
        .join(row.simple().to_string());
    std::fs::create_dir_all(ltmp.join("sub")).unwrap();
    std::fs::write(ltmp.join("sub/left.so"), b"x").unwrap();
    record_process(&app, row, lpid as i32, start_ticks, &ltmp).await;
    // The agent row still says running, as after a crash.
    let (db, dir, token) = app.stop().await;
    sqlx::query("UPDATE agents SET status = 'running', last_turn_outcome = NULL")
        .execute(&agentry::store::connect(db.clone(), 2).await.unwrap())
        .await
        .unwrap();

    let app = spawn_on(db, dir, Some(token)).await;
    let status = leftover.wait().unwrap();
    assert!(
        !status.success(),
        "the leftover was ended by the reconciler"
    );
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["status"], "closed");
    let after = app.timeline(&id).await;
    assert_eq!(
        &after[..before.len()],
        &before[..],
        "earlier events are untouched"
    );
    let done: Vec<_> = after
        .iter()
        .filter(|e| e["kind"] == "turn_completed")
        .collect();
    assert_eq!(done.last().unwrap()["data"]["outcome"], "failed");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    assert!(!ltmp.exists(), "the leftover's TMPDIR was removed with it");
    let tmp_left: Vec<_> = std::fs::read_dir(app.data_dir.path().join("tmp"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        tmp_left.is_empty(),
        "no process's TMPDIR is left: {tmp_left:?}"
    );
    app.prompt(&id, "after the restart").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
}

/// At boot, a private temporary directory no ledger row holds (the server stopped between
/// making it and recording its process) is removed once it is old enough that no launch
/// can still be recording it; one a row holds, a recent one and anything not named after
/// a row stay.
#[tokio::test]
async fn a_restart_removes_temporary_directories_no_process_holds() {
    let app = spawn_app().await;
    let root = app.data_dir.path().join("tmp");
    let hour_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 3600;
    let old = || uuid::Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, hour_ago, 0));
    let dir = |id: uuid::Uuid| root.join(id.simple().to_string());
    let orphan = dir(old());
    std::fs::create_dir_all(orphan.join("sub")).unwrap();
    std::fs::write(orphan.join("sub/left.so"), b"x").unwrap();
    let recent = dir(uuid::Uuid::now_v7());
    std::fs::create_dir_all(&recent).unwrap();
    let notes = root.join("notes");
    std::fs::create_dir_all(&notes).unwrap();
    // A row the reconciler cannot judge (pid 1) keeps its process's directory.
    let held_id = old();
    let held = dir(held_id);
    std::fs::create_dir_all(&held).unwrap();
    record_process(&app, held_id, 1, 0, &held).await;
    let (db, data_dir, token) = app.stop().await;

    let app = spawn_on(db, data_dir, Some(token)).await;
    assert!(
        !orphan.exists(),
        "the old directory no row holds is removed"
    );
    assert!(held.exists(), "a directory a row holds stays");
    assert!(
        recent.exists(),
        "a recent one stays: its launch may be recording it"
    );
    assert!(notes.exists(), "what is not named after a row stays");
    app.stop().await;
}

/// The mode change's answer comes behind thousands of queued chunks on the agent's
/// stream; the agent must still be read while the change waits for it (it used to hang
/// until the client gave up).
#[tokio::test]
async fn a_mode_change_during_a_full_speed_stream_is_answered() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    app.prompt(&agent, "/load 60000 0").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    let res = app
        .client
        .put(app.url(&format!("/v1/agents/{agent}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "unattended"}))
        .send()
        .await
        .unwrap();
    eprintln!(
        "mode change answered {} in {:?}",
        res.status(),
        asked.elapsed()
    );
    assert_eq!(res.status().as_u16(), 200);
    let done = app.wait(&agent).await;
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
}

#[tokio::test]
async fn mcp_servers_an_agent_could_not_start_are_refused_by_name() {
    let app = spawn_app_with(|s| {
        s.mcp.servers.insert(
            "docs".into(),
            agentry::config::McpServerSetting {
                command: "docs-mcp".into(),
                args: vec!["--stdio".into()],
                env: Default::default(),
                teams: None,
            },
        );
    })
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let create = |servers: Value| json!({"workspace_id": ws["id"], "provider": "mock", "mcp_servers": servers});
    for (servers, field) in [
        (json!([]), "mcp_servers"),
        (json!({"docs": {}}), "mcp_servers.docs.server"),
        (json!({"docs": {"command": ""}}), "mcp_servers.docs.command"),
        (
            json!({"docs": {"command": ["srv", "-v"]}}),
            "mcp_servers.docs.command",
        ),
        (
            json!({"docs": {"server": "docs", "args": ["--a"]}}),
            "mcp_servers.docs.args",
        ),
        (
            json!({"docs": {"server": "docs", "env": {"A": "1"}}}),
            "mcp_servers.docs.env",
        ),
        (
            json!({"docs": {"server": "nope"}}),
            "mcp_servers.docs.server",
        ),
        (json!({"web": {"type": "http"}}), "mcp_servers.web.url"),
        (
            json!({"web": {"type": "sse", "url": "ftp://x"}}),
            "mcp_servers.web.url",
        ),
        (
            json!({"web": {"type": "http", "url": "http://10.0.0.1/mcp"}}),
            "mcp_servers.web.url",
        ),
        (
            json!({"web": {"type": "grpc", "url": "http://x"}}),
            "mcp_servers.web.type",
        ),
        (json!({"web": "http://x"}), "mcp_servers.web"),
    ] {
        let res = app.post("/v1/agents", create(servers.clone())).await;
        let body = expect_status(res, 422).await;
        assert_eq!(body["code"], "validation_failed", "{servers}: {body}");
        assert_eq!(body["errors"][0]["field"], field, "{servers}: {body}");
    }
    let ok = json!({
        "docs": {"server": "docs"},
        "web": {"type": "http", "url": "https://mcp.example.com", "headers": {"X": "y"}},
    });
    let agent = app.post_ok("/v1/agents", create(ok), 201).await;
    assert!(agent["id"].is_string());
}

/// Prompts that arrive together share the audit log's commits, and each is still
/// recorded. An entry the database refuses fails only its own request: the others,
/// refused with it as one batch at first, are written again one by one.
#[tokio::test]
async fn prompts_sent_together_are_each_audited_and_a_refused_entry_fails_only_its_own() {
    const AGENTS: usize = 8;
    const REFUSED: usize = 3;
    let app = spawn_app().await;
    sqlx::query(
        "ALTER TABLE audit_log ADD CONSTRAINT refuse_marked
         CHECK (coalesce(details->>'client_message_id', '') <> 'refused')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    let marker = |i: usize| {
        if i == REFUSED {
            "refused".to_owned()
        } else {
            format!("m{i}")
        }
    };
    let paths: Vec<String> = agents
        .iter()
        .map(|a| format!("/v1/agents/{a}/messages"))
        .collect();
    let prompt = |i: usize| {
        app.post(
            &paths[i],
            json!({"text": "hello", "client_message_id": marker(i)}),
        )
    };
    // The audit log is held, so the first prompt's entry waits in its batch while the
    // others queue behind it: they then go together, the refused one among them.
    let mut hold = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE audit_log IN EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let first_waits = until_a_statement_waits_on_a_lock(
        &app.pool,
        "INSERT INTO audit_log",
        "the first entry never reached the table",
    );
    let (first, rest) = tokio::join!(prompt(0), async {
        first_waits.await;
        let rest = futures::future::join_all((1..AGENTS).map(prompt));
        let release = async {
            tokio::time::sleep(Duration::from_millis(700)).await;
            hold.commit().await.unwrap();
        };
        tokio::join!(rest, release).0
    });
    for (i, res) in std::iter::once(first).chain(rest).enumerate() {
        let status = res.status().as_u16();
        if i == REFUSED {
            assert_eq!(status, 500, "an action that cannot be audited is not done");
        } else {
            assert_eq!(status, 202, "prompt {i}: {}", res.text().await.unwrap());
        }
    }
    let page = app.get_ok("/v1/audit?action=agent.prompt&limit=100").await;
    let mut recorded: Vec<String> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            e["details"]["client_message_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    recorded.sort();
    let mut expected: Vec<String> = (0..AGENTS).filter(|&i| i != REFUSED).map(marker).collect();
    expected.sort();
    assert_eq!(recorded, expected);
    app.stop().await;
}
