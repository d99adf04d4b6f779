//! U+0000 in any place a client can put a string: 422 `validation_failed` naming the
//! field, and nothing about the request happens.

use serde_json::{Value, json};

use crate::helpers::*;

async fn assert_rejected(res: reqwest::Response, field: &str) {
    assert_eq!(
        res.headers()["content-type"],
        "application/problem+json",
        "{field}"
    );
    // Refused before any handler, and still traceable to its request.
    assert!(res.headers().contains_key("x-request-id"), "{field}");
    let body = expect_status(res, 422).await;
    assert_eq!(body["code"], "validation_failed", "{body}");
    assert_eq!(body["errors"][0]["field"], field, "{body}");
}

#[tokio::test]
async fn nul_in_any_request_string_is_refused_naming_the_field() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, ws) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    let agents_before = app.get_ok("/v1/agents").await["items"]
        .as_array()
        .unwrap()
        .len();
    let events_before = app.timeline(&agent).await.len();

    // Bodies: top-level strings, nested map values, map keys.
    for (path, body, field) in [
        (
            "/v1/agents".to_owned(),
            json!({"workspace_id": ws, "provider": "mock", "prompt": "a\u{0}b"}),
            "prompt",
        ),
        (
            "/v1/agents".to_owned(),
            json!({"workspace_id": ws, "provider": "mock", "labels": {"ci": "x\u{0}"}}),
            "labels.ci",
        ),
        (
            "/v1/agents".to_owned(),
            json!({"workspace_id": ws, "provider": "mock\u{0}"}),
            "provider",
        ),
        (
            format!("/v1/agents/{agent}/messages"),
            json!({"text": "hello\u{0}"}),
            "text",
        ),
        (
            format!("/v1/agents/{agent}/messages"),
            json!({"text": "hello", "client_message_id": "\u{0}"}),
            "client_message_id",
        ),
        (
            "/v1/projects".to_owned(),
            json!({"name": "n\u{0}", "repo_path": repo.path()}),
            "name",
        ),
        ("/v1/tokens".to_owned(), json!({"name": "t\u{0}"}), "name"),
    ] {
        assert_rejected(app.post(&path, body).await, field).await;
    }
    let res = app
        .client
        .put(app.url(&format!("/v1/agents/{agent}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "de\u{0}fault"}))
        .send()
        .await
        .unwrap();
    assert_rejected(res, "mode").await;

    // Query strings and paths.
    assert_rejected(app.get("/v1/agents?label=ci%3Aa%00").await, "label").await;
    assert_rejected(
        app.get("/v1/workspaces?project_id=prj_%00").await,
        "project_id",
    )
    .await;
    assert_rejected(app.get("/v1/agents/agt_%00").await, "id").await;
    assert_rejected(
        app.post(
            &format!("/v1/agents/{agent}/permissions/perm_%00"),
            json!({"behavior": "allow"}),
        )
        .await,
        "request_id",
    )
    .await;

    // Nothing happened: no agent, no prompt, no project, no token.
    let agents: Value = app.get_ok("/v1/agents").await;
    assert_eq!(agents["items"].as_array().unwrap().len(), agents_before);
    assert_eq!(app.timeline(&agent).await.len(), events_before);
    assert!(
        app.get_ok("/v1/projects").await["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| !p["name"].as_str().unwrap().contains('\u{0}'))
    );

    // A backslash followed by `u0000` is ordinary text.
    app.post_ok(
        &format!("/v1/agents/{agent}/messages"),
        json!({"text": "a\\u0000b"}),
        202,
    )
    .await;
    let done = app.wait(&agent).await;
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
    let timeline = app.timeline(&agent).await;
    assert!(
        timeline
            .iter()
            .any(|e| e["kind"] == "user_message" && e["data"]["text"] == "a\\u0000b")
    );
}

#[tokio::test]
async fn a_cursor_that_is_not_one_of_ours_is_a_client_error() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    for cursor in ["%EA%BD%93x", "a", "c5", "b-", "%C3%A9"] {
        let res = app
            .get(&format!("/v1/agents/{agent}/timeline?cursor={cursor}"))
            .await;
        let body = expect_status(res, 400).await;
        assert_eq!(body["code"], "invalid_cursor", "{cursor}: {body}");
    }
    let page = app
        .get_ok(&format!("/v1/agents/{agent}/timeline?cursor=a0"))
        .await;
    assert!(page["items"].is_array());
}
