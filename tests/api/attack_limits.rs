//! Resource limits per agent, played through the API by a member whose agent runs what an
//! injected prompt tells it (the scripted `exec_agent.py`): a memory hog and a fork bomb
//! are stopped, their turns fail with `resource_limit`, the server and another agent are
//! unharmed, and nothing of the stopped tree is left.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::helpers::{TestApp, git_repo, spawn_app_with};

const EXEC: &str = crate::helpers::EXEC_PROVIDER;

async fn app_with_limits() -> TestApp {
    spawn_app_with(|s| {
        crate::helpers::with_exec_agent(s);
        s.agents.limits.memory = "200MiB".into();
        s.agents.limits.max_processes = 64;
        s.agents.limits.open_files = 256;
    })
    .await
}

/// The last `turn_completed` of the agent's timeline (the agent has gone idle or failed).
async fn last_turn(app: &TestApp, agent: &str) -> Value {
    app.wait(agent).await;
    app.timeline(agent)
        .await
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "turn_completed")
        .map(|e| e["data"].clone())
        .expect("a turn_completed")
}

/// The text of the agent's last assistant message.
async fn last_reply(app: &TestApp, agent: &str) -> String {
    app.timeline(agent)
        .await
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "assistant_message")
        .and_then(|e| e["data"]["text"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The directories of the cgroups `pid` is in below agentry's own (`.../agentry/...`).
fn agentry_cgroups_of(pid: i64) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let _ = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            if !path.contains("/agentry/") {
                return None;
            }
            let mount = if controllers.is_empty() {
                "/sys/fs/cgroup".to_owned()
            } else {
                format!("/sys/fs/cgroup/{}", controllers.split(',').next()?)
            };
            Some(PathBuf::from(format!("{mount}{path}")))
        })
        .collect()
}

async fn agent_pid(app: &TestApp, agent: &str) -> i64 {
    app.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["pid"]
        .as_i64()
        .expect("a running agent has a pid")
}

async fn uses_cgroups(app: &TestApp) -> bool {
    let ready: Value = app
        .client
        .get(app.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    ready["limits"]
        .as_str()
        .expect("readyz names the limits")
        .starts_with("cgroup")
}

/// What the test checks holds only with cgroups: a host without them (an ordinary user
/// with no delegated cgroup) fails it, saying so, rather than passing it unrun.
async fn require_cgroups(app: &TestApp) {
    assert!(
        uses_cgroups(app).await,
        "this test needs cgroups (run as root, or with a delegated cgroup v2 subtree); /readyz says the limits are rlimits only"
    );
}

#[tokio::test]
async fn a_memory_hog_is_stopped_alone_and_its_agent_can_go_on() {
    let app = app_with_limits().await;
    let cgroups = uses_cgroups(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let hog = app.agent_in_new_workspace(&project, EXEC).await;
    let other = app.agent_in_new_workspace(&project, EXEC).await;

    // The open files limit holds inside.
    app.prompt(&hog, "ulimit -n").await;
    assert_eq!(last_turn(&app, &hog).await["outcome"], "completed");
    assert!(
        last_reply(&app, &hog).await.contains("\n256"),
        "{}",
        last_reply(&app, &hog).await
    );

    let pid = agent_pid(&app, &hog).await;
    let dirs = agentry_cgroups_of(pid);
    assert_eq!(
        !dirs.is_empty(),
        cgroups,
        "the agent is in a cgroup of its own: {dirs:?}"
    );

    // Another agent's turn runs meanwhile.
    app.prompt(&other, "sleep 2; echo other-done").await;
    app.prompt(
        &hog,
        "python3 -c 'b = bytes(1) * (1 << 30); print(len(b))'; echo survived",
    )
    .await;
    let hog_turn = last_turn(&app, &hog).await;
    let other_turn = last_turn(&app, &other).await;
    assert_eq!(other_turn["outcome"], "completed", "{other_turn}");
    assert!(last_reply(&app, &other).await.contains("other-done"));
    if cgroups {
        assert_eq!(hog_turn["outcome"], "failed", "{hog_turn}");
        assert_eq!(hog_turn["error_code"], "resource_limit", "{hog_turn}");
        let error = hog_turn["error"].as_str().unwrap();
        assert!(error.contains("memory limit of 200 MiB reached"), "{error}");
        // (On cgroup v1 the kernel ends the largest process and the shell may print
        // `survived` before the whole tree is ended: the turn fails all the same.)
        // Nothing of the tree is left: its cgroups are gone, and so is its ledger row.
        for dir in &dirs {
            crate::helpers::eventually("the cgroup is removed", Duration::from_secs(10), || {
                !dir.exists()
            })
            .await;
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_processes WHERE pid = $1")
            .bind(pid as i32)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(rows, 0);
    }
    // The server is healthy and the agent can be prompted again.
    assert_eq!(
        app.client
            .get(app.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    app.prompt_within(&hog, "echo again", Duration::from_secs(60))
        .await;
    assert_eq!(last_turn(&app, &hog).await["outcome"], "completed");
    assert!(last_reply(&app, &hog).await.contains("again"));
}

#[tokio::test]
async fn a_fork_bomb_is_stopped_at_the_process_limit() {
    let app = app_with_limits().await;
    require_cgroups(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let bomb = app.agent_in_new_workspace(&project, EXEC).await;
    let other = app.agent_in_new_workspace(&project, EXEC).await;
    let pid = agent_pid(&app, &bomb).await;
    let dirs = agentry_cgroups_of(pid);
    let pids_dir = dirs
        .iter()
        .find(|d| d.join("pids.max").exists())
        .cloned()
        .expect("a pids cgroup");
    assert_eq!(
        std::fs::read_to_string(pids_dir.join("pids.max"))
            .unwrap()
            .trim(),
        "64"
    );

    // Bounded: even unlimited it starts 300 sleeps of 30 s.
    app.prompt(
        &bomb,
        "i=0; while [ $i -lt 300 ]; do sleep 30 & i=$((i+1)); done; wait",
    )
    .await;
    app.prompt(&other, "echo unharmed").await;
    let mut peak = 0u64;
    for _ in 0..50 {
        if let Ok(n) = std::fs::read_to_string(pids_dir.join("pids.current")) {
            peak = peak.max(n.trim().parse().unwrap_or(0));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(peak <= 64, "{peak} processes in the cgroup");
    let turn = last_turn(&app, &bomb).await;
    assert_eq!(turn["outcome"], "failed", "{turn}");
    assert_eq!(turn["error_code"], "resource_limit", "{turn}");
    assert!(
        turn["error"]
            .as_str()
            .unwrap()
            .contains("process limit of 64 reached"),
        "{turn}"
    );
    assert_eq!(last_turn(&app, &other).await["outcome"], "completed");
    assert!(last_reply(&app, &other).await.contains("unharmed"));
    // Everything of the bomb is gone.
    crate::helpers::eventually(
        "the bomb's cgroup is removed",
        Duration::from_secs(10),
        || !pids_dir.exists(),
    )
    .await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_processes WHERE pid = $1")
        .bind(pid as i32)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
}

#[tokio::test]
async fn cgroups_no_process_holds_are_ended_and_removed_at_boot() {
    let app = app_with_limits().await;
    require_cgroups(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, EXEC).await;
    let dirs = agentry_cgroups_of(agent_pid(&app, &agent).await);
    let replica_dir = dirs[0].parent().unwrap().to_owned();

    // A cgroup a crashed server left, with a process still in it, and no row.
    let leftover = replica_dir.join(uuid::Uuid::now_v7().simple().to_string());
    std::fs::create_dir(&leftover).unwrap();
    let mut sleeper = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    std::fs::write(leftover.join("cgroup.procs"), sleeper.id().to_string()).unwrap();
    // Not a row id: left alone.
    let other = replica_dir.join("not-a-row");
    std::fs::create_dir(&other).unwrap();

    let token = app.token.clone();
    let (db, data_dir, _) = app.stop().await;
    let app = crate::helpers::spawn_on_with(db, data_dir, Some(token), |s| {
        s.agents.limits.max_processes = 64;
    })
    .await;
    assert!(!leftover.exists(), "the leftover cgroup is removed");
    let status = sleeper.wait().unwrap();
    assert!(!status.success(), "the process in it was ended");
    assert!(other.is_dir());
    std::fs::remove_dir(&other).unwrap();
    app.stop().await;
    let _ = std::fs::remove_dir(&replica_dir);
}

/// The same limits, and TERM ignored by the sandbox's launcher, whether the server starts
/// the agent's process through the `agentry-sandbox` beside `agentry` (`posix_spawn`, the
/// installed layout) or, when that is missing, from a forked copy of itself.
#[tokio::test]
async fn the_limits_hold_through_the_launcher_and_through_a_fork() {
    let lone = tempfile::tempdir().unwrap();
    let agentry = lone.path().join("agentry");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_agentry"), &agentry).unwrap();
    for program in [None, Some(agentry.clone())] {
        let app = spawn_app_with(|s| {
            crate::helpers::with_exec_agent(s);
            s.agents.limits.max_processes = 64;
            s.agents.limits.open_files = 256;
            if let Some(p) = &program {
                s.bridge_program = Some(p.clone());
            }
        })
        .await;
        let repo = git_repo();
        let project = app.project(repo.path()).await;
        let agent = app.agent_in_new_workspace(&project, EXEC).await;
        app.prompt(
            &agent,
            "grep -E '^Max (processes|open files)' /proc/self/limits",
        )
        .await;
        assert_eq!(last_turn(&app, &agent).await["outcome"], "completed");
        let reply = last_reply(&app, &agent).await;
        let held = |name: &str, n: &str| {
            reply.lines().any(|l| {
                l.starts_with(name) && l.split_whitespace().filter(|w| *w == n).count() == 2
            })
        };
        assert!(held("Max open files", "256"), "{program:?}: {reply}");
        // The recorded process is the sandbox itself, with TERM ignored (bit 15 of
        // SigIgn) so that the ledger's TERM reaches what it runs.
        let pid = agent_pid(&app, &agent).await;
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
        assert!(exe.ends_with("bwrap"), "{program:?}: {}", exe.display());
        // Which helper the server found: the bridge it runs inside tells.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let bridge = match &program {
            None => format!("{} bridge ", env!("CARGO_BIN_EXE_agentry-sandbox")),
            Some(p) => format!("{} sandbox-bridge ", p.display()),
        };
        assert!(cmdline.contains(&bridge), "{cmdline}");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let ignored = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
            .unwrap();
        assert_ne!(
            ignored & (1 << (libc::SIGTERM - 1)),
            0,
            "{program:?}: {status}"
        );
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        assert!(
            limits
                .lines()
                .any(|l| l.starts_with("Max open files") && l.contains(" 256 ")),
            "{program:?}: {limits}"
        );
        // The process limit is its cgroup's where the host has them (an rlimit would
        // count every process of the user), and the process joined it before exec.
        if uses_cgroups(&app).await {
            let pids = agentry_cgroups_of(pid)
                .into_iter()
                .find(|d| d.join("pids.max").exists())
                .expect("a pids cgroup");
            assert_eq!(
                std::fs::read_to_string(pids.join("pids.max"))
                    .unwrap()
                    .trim(),
                "64"
            );
        } else {
            assert!(held("Max processes", "64"), "{program:?}: {reply}");
        }
    }
}
