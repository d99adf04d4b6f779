//! What a server refuses instead of accepting and ignoring: a second server running as a
//! replica that already runs, and (for the model catalog) a refresh it would not perform.

use std::net::TcpListener;
use std::time::Duration;

use agentry::server::Application;

use agentry::config::ProviderSettings;
use serde_json::json;

use crate::helpers::{
    expect_status, git_repo, pid_alive, settings, spawn_app, spawn_app_with, spawn_on,
};

#[tokio::test]
async fn a_second_server_on_a_live_database_joins_it_and_leaves_the_first_ones_agents_alone() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.prompt(&id, "hello").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    let pid = agent["runtime"]["pid"].as_i64().expect("a live process") as i32;
    let first = agent["runtime"]["replica"]
        .as_str()
        .expect("a replica")
        .to_owned();
    let before = app.timeline(&id).await.len();

    // A second server with the same replica id (the same data dir) refuses to start.
    let pool = agentry::store::connect(app.db.clone(), 4).await.unwrap();
    let twin = Application::build_with(
        settings(app.data_dir.path()),
        pool.clone(),
        None,
        TcpListener::bind("127.0.0.1:0").unwrap(),
    )
    .await;
    let err = match twin {
        Ok(_) => panic!("a second server started as the same replica"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains(&format!("runs as replica `{first}`")), "{err}");
    assert!(err.contains("cluster.replica_id"), "{err}");

    // One with its own data dir is another replica: it starts and closes nothing.
    let other_dir = tempfile::tempdir().unwrap();
    let second = spawn_on(app.db.clone(), other_dir, Some(app.token.clone())).await;
    assert!(
        pid_alive(pid),
        "the first server's agent process still runs"
    );
    let agent = second.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["status"], "idle");
    assert_eq!(agent["runtime"]["replica"], first.as_str());
    assert_eq!(
        app.timeline(&id).await.len(),
        before,
        "nothing was appended"
    );
    // The agent takes prompts through either server, and still runs where it ran.
    second.prompt(&id, "still here").await;
    assert_eq!(second.wait(&id).await["last_turn"]["outcome"], "completed");
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["runtime"]["pid"].as_i64(), Some(pid as i64));
    second.stop().await;
    pool.close().await;

    // Once the first stops, a new server starts on the database (and can resume).
    let (db, dir, token) = app.stop().await;
    let app = tokio::time::timeout(Duration::from_secs(30), spawn_on(db, dir, Some(token)))
        .await
        .expect("the restart does not wait for a lock");
    app.prompt(&id, "after the restart").await;
    assert_eq!(app.wait(&id).await["last_turn"]["outcome"], "completed");
}

#[tokio::test]
async fn the_model_catalog_can_be_refreshed() {
    let app = spawn_app().await;
    let cached = app.get_ok("/v1/providers/mock/models").await;
    let refreshed = app.get_ok("/v1/providers/mock/models?refresh=true").await;
    assert_eq!(refreshed, cached);
    let ids: Vec<&str> = refreshed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["mock-small", "mock-large"]);
    let res = app.get("/v1/providers/mock/models?refresh=maybe").await;
    expect_status(res, 400).await;
    let res = app.get("/v1/providers/nope/models?refresh=true").await;
    expect_status(res, 404).await;

    // A workspace has its own catalog; an archived one has no files to probe in.
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let id = ws["id"].as_str().unwrap();
    let scoped = app
        .get_ok(&format!(
            "/v1/providers/mock/models?workspace_id={id}&refresh=true"
        ))
        .await;
    assert_eq!(scoped, cached);
    app.post_ok(&format!("/v1/workspaces/{id}/archive"), json!({}), 200)
        .await;
    let res = app
        .get(&format!("/v1/providers/mock/models?workspace_id={id}"))
        .await;
    assert_eq!(expect_status(res, 409).await["code"], "workspace_archived");
    let res = app
        .get("/v1/providers/mock/models?workspace_id=wsp_00000000000000000000000000000000")
        .await;
    expect_status(res, 404).await;
}

#[tokio::test]
async fn the_catalog_of_a_provider_that_cannot_run_says_why() {
    let app = spawn_app_with(|s| {
        s.providers.insert(
            "claude".into(),
            ProviderSettings {
                command: Some(vec!["/nonexistent/claude".into()]),
                ..ProviderSettings::default()
            },
        );
    })
    .await;
    for refresh in ["false", "true"] {
        let res = app
            .get(&format!("/v1/providers/claude/models?refresh={refresh}"))
            .await;
        let body = expect_status(res, 422).await;
        assert_eq!(body["code"], "provider_unavailable", "{body}");
        assert!(
            body["detail"]
                .as_str()
                .is_some_and(|d| d.contains("/nonexistent/claude")),
            "{body}"
        );
    }
}
