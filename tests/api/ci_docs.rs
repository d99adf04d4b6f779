//! The CI examples of docs/ci.md: their script steps and the shell examples of its
//! trigger sections, taken from the document as written, run with bash against a real
//! server (the mock provider standing in for Claude).

use std::path::Path;

use crate::helpers::*;

const DOC: &str = include_str!("../../docs/ci.md");

/// The lines of the GitHub Actions `run: |` block, unindented.
fn github_script(doc: &str) -> String {
    let mut lines = doc.lines();
    let start = lines
        .by_ref()
        .find(|l| l.trim_start() == "run: |")
        .expect("a run: | step");
    let indent = start.len() - start.trim_start().len();
    lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
        .map(|l| l.trim_start())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The commands of the GitLab CI `script:` list, one per line.
fn gitlab_script(doc: &str) -> String {
    let mut lines = doc.lines();
    lines
        .by_ref()
        .find(|l| l.trim_start() == "script:")
        .expect("a script: list");
    lines
        .map_while(|l| l.trim_start().strip_prefix("- "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The contents of the ```sh blocks of the section under `heading`, in order.
fn sh_blocks(doc: &str, heading: &str) -> Vec<String> {
    let mut lines = doc
        .lines()
        .skip_while(|l| *l != heading)
        .skip(1)
        .take_while(|l| !l.starts_with("## "));
    let mut blocks = Vec::new();
    while lines.by_ref().any(|l| l == "```sh") {
        blocks.push(
            lines
                .by_ref()
                .take_while(|l| *l != "```")
                .collect::<Vec<_>>()
                .join("\n"),
        );
    }
    blocks
}

/// Run `script` the way both CI systems do (bash, stopping at the first failing
/// command) in `dir`; its exit status.
async fn run_job(app: &TestApp, dir: &Path, script: &str, project: &str) -> Option<i32> {
    run_script(app, dir, script, &[("AGENTRY_PROJECT", project)])
        .await
        .0
}

/// Run `script` with bash (`-e`) in `dir` with the server's URL and token, the mock
/// provider and `vars`; its exit status and what it printed.
async fn run_script(
    app: &TestApp,
    dir: &Path,
    script: &str,
    vars: &[(&str, &str)],
) -> (Option<i32>, String) {
    let bin = Path::new(env!("CARGO_BIN_EXE_agentry")).parent().unwrap();
    let out = tokio::process::Command::new("bash")
        .args(["-e", "-c", script])
        .current_dir(dir)
        .env_clear()
        .env(
            "PATH",
            format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display()),
        )
        .env("HOME", dir)
        .env("AGENTRY_URL", &app.base)
        .env("AGENTRY_TOKEN", &app.token)
        .env("AGENTRY_PROVIDER", "mock")
        .env("GITHUB_RUN_ID", "4242")
        .env("CI_PIPELINE_ID", "4242")
        .envs(vars.iter().copied())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "job stdout:\n{stdout}\njob stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), stdout)
}

#[tokio::test]
async fn the_documented_ci_jobs_run_as_written() {
    let app = spawn_app().await;
    let repo = git_repo();
    app.project(repo.path()).await;
    for (system, script) in [
        ("github", github_script(DOC)),
        ("gitlab", gitlab_script(DOC)),
    ] {
        assert!(script.contains("agentry run"), "{system}: {script}");
        let dir = tempfile::tempdir().unwrap();
        let status = run_job(&app, dir.path(), &script, "demo").await;
        assert_eq!(status, Some(0), "{system}");
        let events = std::fs::read_to_string(dir.path().join("agent-events.jsonl")).unwrap();
        let last: serde_json::Value = serde_json::from_str(events.lines().last().unwrap()).unwrap();
        assert_eq!(last["data"]["outcome"], "completed", "{system}");
        let agent = last["agent_id"].as_str().unwrap();
        let a = app.get_ok(&format!("/v1/agents/{agent}")).await;
        assert_eq!(a["labels"]["ci_run"], "4242", "{system}");
        assert!(dir.path().join("agent.patch").is_file(), "{system}");

        // A job whose agent cannot run fails.
        let dir = tempfile::tempdir().unwrap();
        let status = run_job(&app, dir.path(), &script, "no-such-project").await;
        assert_ne!(status, Some(0), "{system}");
    }
}

#[tokio::test]
async fn the_documented_trigger_examples_run_as_written() {
    use serde_json::Value;
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let project_id = project["id"].as_str().unwrap();
    let vars = [("AGENTRY_PROJECT_ID", project_id)];

    // Webhooks: the trigger is made and a signed ping is received and recorded.
    let webhook = sh_blocks(DOC, "## Webhook triggers");
    assert_eq!(webhook.len(), 3, "{webhook:?}");
    let dir = tempfile::tempdir().unwrap();
    let (status, out) = run_script(&app, dir.path(), &webhook.join("\n"), &vars).await;
    assert_eq!(status, Some(0), "{out}");
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 3, "{out}");
    let trigger: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("trigger.json")).unwrap())
            .unwrap();
    assert_eq!(trigger["kind"], "github", "{trigger}");
    assert_eq!(trigger["project_id"], project_id, "{trigger}");
    assert!(trigger["secret"].as_str().unwrap().len() >= 32, "{trigger}");
    assert_eq!(lines[0]["webhook_path"], trigger["webhook_path"], "{out}");
    assert_eq!(lines[0]["secret"], trigger["secret"], "{out}");
    // The signed ping: answered, recorded once, as ignored with the reason.
    assert_eq!(lines[1]["duplicate"], false, "{out}");
    assert_eq!(lines[1]["run"]["outcome"], "ignored", "{out}");
    assert_eq!(
        (
            lines[2]["delivery_id"].as_str(),
            lines[2]["state"].as_str(),
            lines[2]["outcome"].as_str()
        ),
        (Some("ping-1"), Some("done"), Some("ignored")),
        "{out}"
    );
    assert!(
        lines[2]["reason"].as_str().unwrap().starts_with("a ping"),
        "{out}"
    );

    // Schedules: the cron trigger says when it runs next, in its time zone.
    let cron = sh_blocks(DOC, "## Scheduled triggers");
    assert_eq!(cron.len(), 1, "{cron:?}");
    let (status, out) = run_script(&app, dir.path(), &cron[0], &vars).await;
    assert_eq!(status, Some(0), "{out}");
    let made: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let id = made["id"].as_str().unwrap();
    let read = app.get_ok(&format!("/v1/triggers/{id}")).await;
    assert_eq!(
        (
            read["schedule"].as_str(),
            read["time_zone"].as_str(),
            read["next_run_at"].as_str()
        ),
        (
            Some("0 6 * * 1-5"),
            Some("Europe/Berlin"),
            made["next_run_at"].as_str()
        ),
        "{read}"
    );
    let next: chrono::DateTime<chrono::Utc> =
        made["next_run_at"].as_str().unwrap().parse().unwrap();
    assert!(
        matches!(next.format("%H:%M").to_string().as_str(), "04:00" | "05:00"),
        "06:00 in Berlin: {next}"
    );
}
