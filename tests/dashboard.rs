//! The dashboard in a real browser: tests/browser/dashboard.py drives Debian's Chromium
//! through Playwright against a real server with the mock provider. Screenshots of each
//! page are kept in `target/dashboard-screenshots/` (or `$AGENTRY_SCREENSHOTS`).

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use std::path::PathBuf;

use helpers::*;
use serde_json::json;

/// The Python of the pinned Playwright install (`.ci/install-browser`); fails the test when
/// it or Chromium is missing.
fn playwright_python() -> PathBuf {
    let version = include_str!("../.ci/browser-pin")
        .lines()
        .find(|l| !l.starts_with('#') && !l.trim().is_empty())
        .expect("a version in .ci/browser-pin")
        .trim()
        .to_owned();
    let cache = std::env::var_os("AGENTRY_PLAYWRIGHT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/agentry"));
    let venv = cache.join(format!("playwright-{version}"));
    let chromium = std::path::Path::new("/usr/bin/chromium").exists();
    assert!(
        venv.join(".installed").exists() && chromium,
        "Playwright {version} (at {}) or Chromium is not installed; run the tests with \
         .ci/test, which installs them (or run .ci/install-browser)",
        venv.display()
    );
    venv.join("bin/python")
}

#[tokio::test]
async fn the_dashboard_works_in_a_real_browser() {
    let python = playwright_python();
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "dashboard"}),
            201,
        )
        .await;
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "title": "Dashboard demo",
                   "labels": {"team": "web"}, "prompt": "Say hello to the dashboard."}),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap().to_owned();
    app.wait(&agent).await;
    // An agent with a long timeline (100,000 streamed chunks, then many small turns so
    // that the tail is not one message).
    let long = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "title": "Long timeline",
                   "prompt": "/load 100000 0"}),
            201,
        )
        .await;
    let long = long["id"].as_str().unwrap().to_owned();
    // 100,000 events take a while on a busy machine: up to two minutes.
    let mut done = app.wait(&long).await;
    for _ in 0..3 {
        if done["timed_out"] != true {
            break;
        }
        done = app.wait(&long).await;
    }
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
    for i in 0..60 {
        app.prompt(&long, &format!("note {i}")).await;
        app.wait(&long).await;
    }

    let shots = std::env::var_os("AGENTRY_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../dashboard-screenshots")
        });
    std::fs::create_dir_all(&shots).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/dashboard.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            &app.base,
            &app.token,
            &agent,
            ws["id"].as_str().unwrap(),
            &shots.display().to_string(),
            &long,
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("dashboard: ok"), "{stdout}");
    eprintln!("{stdout}");
    for page in [
        "home",
        "agent",
        "agent-permission",
        "workspace",
        "agent-phone",
        "device",
        "agent-dark",
        "workspace-dark",
    ] {
        assert!(shots.join(format!("{page}.png")).is_file(), "{page}.png");
    }
    eprintln!("screenshots in {}", shots.display());
}

/// The page and its assets come with a policy that allows nothing but this server's own
/// files; deep links serve the same page.
#[tokio::test]
async fn the_dashboard_is_served_with_a_strict_policy() {
    let app = spawn_app().await;
    for path in [
        "/",
        "/agents/agt_x",
        "/workspaces/wsp_x",
        "/device",
        "/ui/app.js",
        "/ui/app.css",
    ] {
        let res = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(res.status(), 200, "{path}");
        let csp = res.headers()["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"),
            "{csp}"
        );
        assert_eq!(res.headers()["x-content-type-options"], "nosniff");
    }
    let page = app
        .client
        .get(app.url("/"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("/ui/app.js") && !page.contains("http"),
        "no outside resource"
    );
    let config: serde_json::Value = app
        .client
        .get(app.url("/ui/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(config, json!({"oidc": false}));
}
