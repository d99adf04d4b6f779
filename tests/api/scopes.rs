//! Token scopes, unknown tokens and unknown ids in request bodies.

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;

/// A request with `token`; answers status and body (when there is one).
async fn call(
    app: &TestApp,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = app.client.request(method, app.url(path)).bearer_auth(token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let is_stream = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if is_stream {
        return (status, Value::Null);
    }
    let body = res.json().await.unwrap_or(Value::Null);
    (status, body)
}

async fn token_with_scopes(app: &TestApp, name: &str, scopes: &[&str]) -> String {
    let created = app
        .post_ok("/v1/tokens", json!({"name": name, "scopes": scopes}), 201)
        .await;
    created["token"].as_str().unwrap().to_owned()
}

/// Assert 403 `insufficient_scope` for each request.
async fn refused(
    app: &TestApp,
    token: &str,
    scope: &str,
    requests: &[(Method, String, Option<Value>)],
) {
    for (method, path, body) in requests {
        let (status, body) = call(app, token, method.clone(), path, body.clone()).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (403, Some("insufficient_scope")),
            "a `{scope}` token: {method} {path} answered {body}"
        );
    }
}

#[tokio::test]
async fn token_scopes_limit_what_a_token_may_do() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, ws) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    let project = app.get_ok("/v1/projects").await["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let other_repo = git_repo();
    let new_project = json!({"name": "second", "repo_path": other_repo.path()});

    let read = token_with_scopes(&app, "reader", &["read"]).await;
    let agents = token_with_scopes(&app, "driver", &["agents"]).await;
    let admin = token_with_scopes(&app, "admin", &["admin"]).await;
    let victim = app
        .post_ok("/v1/tokens", json!({"name": "victim"}), 201)
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // `read`: every GET and both streams.
    for path in [
        "/v1/me".to_owned(),
        "/v1/tokens".to_owned(),
        "/v1/projects".to_owned(),
        format!("/v1/projects/{project}"),
        "/v1/workspaces".to_owned(),
        format!("/v1/workspaces/{ws}"),
        format!("/v1/workspaces/{ws}/diff"),
        "/v1/agents".to_owned(),
        format!("/v1/agents/{agent}"),
        format!("/v1/agents/{agent}/timeline"),
        format!("/v1/agents/{agent}/permissions"),
        format!("/v1/agents/{agent}/wait?timeout_s=1"),
        format!("/v1/agents/{agent}/events"),
        "/v1/events".to_owned(),
        "/v1/providers".to_owned(),
        "/v1/providers/mock/models".to_owned(),
    ] {
        let (status, body) = call(&app, &read, Method::GET, &path, None).await;
        assert_eq!(status, 200, "a `read` token: GET {path} answered {body}");
    }
    let driving = |ws: &str, agent: &str| {
        vec![
            (
                Method::POST,
                "/v1/workspaces".to_owned(),
                Some(json!({"project_id": project})),
            ),
            (
                Method::POST,
                "/v1/agents".to_owned(),
                Some(json!({"workspace_id": ws, "provider": "mock"})),
            ),
            (
                Method::POST,
                format!("/v1/agents/{agent}/messages"),
                Some(json!({"text": "hello"})),
            ),
            (Method::POST, format!("/v1/agents/{agent}/interrupt"), None),
            (
                Method::PUT,
                format!("/v1/agents/{agent}/mode"),
                Some(json!({"mode": "default"})),
            ),
            (
                Method::PUT,
                format!("/v1/agents/{agent}/model"),
                Some(json!({"model": "mock-large"})),
            ),
            (
                Method::POST,
                format!("/v1/agents/{agent}/permissions/perm_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"),
                Some(json!({"behavior": "allow"})),
            ),
            (Method::POST, format!("/v1/agents/{agent}/close"), None),
            (Method::DELETE, format!("/v1/agents/{agent}"), None),
            (Method::POST, format!("/v1/workspaces/{ws}/archive"), None),
        ]
    };
    let managing = vec![
        (
            Method::POST,
            "/v1/projects".to_owned(),
            Some(new_project.clone()),
        ),
        (Method::DELETE, format!("/v1/projects/{project}"), None),
        (
            Method::POST,
            "/v1/tokens".to_owned(),
            Some(json!({"name": "escalate"})),
        ),
        (Method::DELETE, format!("/v1/tokens/{victim}"), None),
    ];
    refused(&app, &read, "read", &driving(&ws, &agent)).await;
    refused(&app, &read, "read", &managing).await;
    // Nothing a refused request would have done happened.
    assert_eq!(
        app.get_ok("/v1/workspaces").await["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        app.get_ok("/v1/agents").await["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // `agents`: read, plus creating and driving workspaces and agents.
    refused(&app, &agents, "agents", &managing).await;
    let (status, created_ws) = call(
        &app,
        &agents,
        Method::POST,
        "/v1/workspaces",
        Some(json!({"project_id": project})),
    )
    .await;
    assert_eq!(status, 201, "{created_ws}");
    let (status, created) = call(
        &app,
        &agents,
        Method::POST,
        "/v1/agents",
        Some(json!({"workspace_id": created_ws["id"], "provider": "mock", "prompt": "hi"})),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let mine = created["id"].as_str().unwrap();
    app.wait(mine).await;
    let (status, body) = call(
        &app,
        &agents,
        Method::POST,
        &format!("/v1/agents/{mine}/messages"),
        Some(json!({"text": "again"})),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    app.wait(mine).await;
    let (status, _) = call(
        &app,
        &agents,
        Method::DELETE,
        &format!("/v1/agents/{mine}"),
        None,
    )
    .await;
    assert_eq!(status, 204);

    // `admin`: everything the principal may do.
    let (status, body) = call(
        &app,
        &admin,
        Method::POST,
        "/v1/projects",
        Some(new_project),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = call(
        &app,
        &admin,
        Method::POST,
        "/v1/tokens",
        Some(json!({"name": "minted"})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, _) = call(
        &app,
        &admin,
        Method::DELETE,
        &format!("/v1/tokens/{victim}"),
        None,
    )
    .await;
    assert_eq!(status, 204);

    // A scope the server does not know is refused, never stored and ignored.
    let r = app
        .post(
            "/v1/tokens",
            json!({"name": "odd", "scopes": ["read", "write"]}),
        )
        .await;
    let body = expect_status(r, 422).await;
    assert_eq!(body["code"], "validation_failed");
    assert_eq!(body["errors"][0]["field"], "scopes");
}

#[tokio::test]
async fn a_well_formed_token_the_server_never_issued_is_unknown() {
    let app = spawn_app().await;
    let never_issued = agentry::auth::tokens::generate();
    let r = app
        .client
        .get(app.url("/v1/me"))
        .bearer_auth(&never_issued)
        .send()
        .await
        .unwrap();
    assert!(
        r.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .contains("token_unknown")
    );
    assert_eq!(expect_status(r, 401).await["code"], "token_unknown");
}

#[tokio::test]
async fn unknown_ids_in_a_body_are_not_found() {
    let app = spawn_app().await;
    let repo = git_repo();
    let missing_team = agentry::domain::TeamId::from(uuid::Uuid::now_v7()).to_string();
    let r = app
        .post(
            "/v1/projects",
            json!({"name": "nowhere", "team_id": missing_team, "repo_path": repo.path()}),
        )
        .await;
    assert_eq!(expect_status(r, 404).await["code"], "not_found");
    assert!(
        app.get_ok("/v1/projects").await["items"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    let r = app
        .post(
            "/v1/tokens",
            json!({"name": "svc", "team_id": missing_team, "role": "member"}),
        )
        .await;
    assert_eq!(expect_status(r, 404).await["code"], "not_found");
    let missing_project = agentry::domain::ProjectId::from(uuid::Uuid::now_v7()).to_string();
    let r = app
        .post("/v1/workspaces", json!({"project_id": missing_project}))
        .await;
    assert_eq!(expect_status(r, 404).await["code"], "not_found");
    let missing_ws = agentry::domain::WorkspaceId::from(uuid::Uuid::now_v7()).to_string();
    let r = app
        .post(
            "/v1/agents",
            json!({"workspace_id": missing_ws, "provider": "mock"}),
        )
        .await;
    assert_eq!(expect_status(r, 404).await["code"], "not_found");
}
