//! The CI examples of docs/ci.md: their script steps, taken from the document as written,
//! run with bash against a real server (the mock provider standing in for Claude).

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

/// Run `script` the way both CI systems do (bash, stopping at the first failing
/// command) in `dir`; its exit status.
async fn run_job(app: &TestApp, dir: &Path, script: &str, project: &str) -> Option<i32> {
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
        .env("AGENTRY_PROJECT", project)
        .env("AGENTRY_PROVIDER", "mock")
        .env("GITHUB_RUN_ID", "4242")
        .env("CI_PIPELINE_ID", "4242")
        .output()
        .await
        .unwrap();
    eprintln!(
        "job stdout:\n{}\njob stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.code()
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
