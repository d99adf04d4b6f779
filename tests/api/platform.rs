//! Auth, errors, health, providers and the OpenAPI document.

use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn auth_is_required_and_revocation_is_immediate() {
    let app = spawn_app().await;
    let r = app.client.get(app.url("/v1/me")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(
        r.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .starts_with("Bearer")
    );
    assert_eq!(expect_status(r, 401).await["code"], "token_missing");
    let r = app
        .client
        .get(app.url("/v1/me"))
        .bearer_auth("nonsense")
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 401).await["code"], "token_malformed");

    let me = app.get_ok("/v1/me").await;
    assert_eq!(me["teams"][0]["role"], "owner");
    let created = app
        .post_ok(
            "/v1/tokens",
            json!({"name": "ci", "expires_in_days": 7}),
            201,
        )
        .await;
    let token = created["token"].as_str().unwrap().to_owned();
    assert!(token.starts_with("agt_pat_"));
    assert!(token.starts_with(created["prefix"].as_str().unwrap()));
    let r = app
        .client
        .get(app.url("/v1/me"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let list = app.get_ok("/v1/tokens").await;
    assert!(
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.get("token").is_none()),
        "secrets never listed"
    );
    let stored: Vec<Vec<u8>> = sqlx::query_scalar("SELECT token_hash FROM api_tokens")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert!(
        stored
            .iter()
            .all(|h| h.len() == 32 && h.as_slice() != token.as_bytes()),
        "only hashes are stored"
    );
    let r = app
        .delete(&format!("/v1/tokens/{}", created["id"].as_str().unwrap()))
        .await;
    assert_eq!(r.status(), 204);
    let r = app
        .client
        .get(app.url("/v1/me"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 401).await["code"], "token_revoked");
}

#[tokio::test]
async fn client_mistakes_get_problem_json() {
    let app = spawn_app().await;
    let r = app
        .client
        .post(app.url("/v1/projects"))
        .bearer_auth(&app.token)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 400).await["code"], "invalid_json");
    let r = app
        .post(
            "/v1/projects",
            json!({"name": "x", "repo_path": "/tmp", "surprise": 1}),
        )
        .await;
    assert_eq!(expect_status(r, 422).await["code"], "validation_failed");
    let r = app
        .post(
            "/v1/projects",
            json!({"name": "x", "repo_path": "/definitely/not/here"}),
        )
        .await;
    let p = expect_status(r, 422).await;
    assert_eq!(p["errors"][0]["field"], "repo_path");
    for path in [
        "/v1/agents/agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
        "/v1/agents/nope",
        "/v1/workspaces/wsp_x/diff",
        "/v1/projects/prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
    ] {
        let r = app.get(path).await;
        assert_eq!(expect_status(r, 404).await["code"], "not_found", "{path}");
    }
    let r = app.get("/v1/nothing-here").await;
    assert_eq!(expect_status(r, 404).await["code"], "route_not_found");
    let r = app
        .client
        .patch(app.url("/v1/projects"))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    assert!(r.headers()["allow"].to_str().unwrap().contains("GET"));
    assert_eq!(expect_status(r, 405).await["code"], "method_not_allowed");
    let r = app
        .post(
            "/v1/agents",
            json!({"workspace_id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "provider": "nope"}),
        )
        .await;
    assert_eq!(expect_status(r, 422).await["code"], "unknown_provider");
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    let big = "x".repeat(300 * 1024);
    let r = app
        .post(&format!("/v1/agents/{id}/messages"), json!({"text": big}))
        .await;
    assert_eq!(expect_status(r, 413).await["code"], "prompt_too_large");
    let huge = "x".repeat(2 * 1024 * 1024);
    let r = app
        .post(&format!("/v1/agents/{id}/messages"), json!({"text": huge}))
        .await;
    assert_eq!(expect_status(r, 413).await["code"], "payload_too_large");
}

#[tokio::test]
async fn health_docs_and_providers() {
    let app = spawn_app().await;
    assert_eq!(
        app.client
            .get(app.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        app.client
            .get(app.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let doc: serde_json::Value = app
        .client
        .get(app.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["paths"]["/v1/agents/{id}/events"].is_object());
    let ui = app.client.get(app.url("/docs/")).send().await.unwrap();
    assert_eq!(ui.status(), 200);
    assert!(
        ui.text().await.unwrap().contains("swagger"),
        "the UI is served from the binary"
    );
    let init = app
        .get("/docs/swagger-initializer.js")
        .await
        .text()
        .await
        .unwrap();
    assert!(
        init.contains("\"/openapi.json\""),
        "the UI loads the served document: {init}"
    );
    let mock = app.provider("mock").await;
    assert_eq!(mock["available"], true);
    assert!(
        mock["modes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["unattended"] == true)
    );
    // Each provider says whether its agents run sandboxed here and where its model API
    // key is; the mock calls no model API, so nothing is brokered for it.
    let list = app.get_ok("/v1/providers").await;
    let expected = match (&list["sandbox"]["mode"], &list["sandbox"]["available"]) {
        (m, _) if m == "off" => "off",
        (_, a) if a == true => "enforced",
        _ => "unavailable",
    };
    for item in list["items"].as_array().unwrap() {
        assert_eq!(item["sandbox"], expected, "{item}");
        assert!(
            item["credentials"] == "brokered" || item["credentials"] == "inside",
            "{item}"
        );
        assert!(item.get("credential").is_none(), "{item}");
    }
    assert_eq!(mock["credentials"], "inside", "{mock}");
}

#[test]
fn committed_openapi_document_matches_the_code() {
    let generated = agentry::api::docs::document_json();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if std::env::var_os("AGENTRY_BLESS").is_some() {
        std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi")).unwrap();
        std::fs::write(path, &generated).unwrap();
        return;
    }
    assert!(
        committed == generated,
        "openapi/openapi.json is out of date: run `cargo run -- openapi > openapi/openapi.json` (or AGENTRY_BLESS=1 cargo test)"
    );
}

/// A member of another team sees none of this team's resources: 404, never 403.
#[tokio::test]
async fn another_teams_resources_answer_404() {
    use agentry::auth::tokens;
    use agentry::store::identity;
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, ws) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;

    let (user, team) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    identity::insert_user(&app.pool, user, "other@example.com", "Other", false)
        .await
        .unwrap();
    identity::insert_team(&app.pool, team, "other")
        .await
        .unwrap();
    identity::upsert_member(&app.pool, team, user, "owner")
        .await
        .unwrap();
    let token = tokens::generate();
    identity::insert_token(
        &app.pool,
        uuid::Uuid::now_v7(),
        user,
        None,
        None,
        "t",
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &[],
        None,
    )
    .await
    .unwrap();
    let other = |path: String| app.client.get(app.url(&path)).bearer_auth(&token).send();
    for path in [
        format!("/v1/agents/{agent}"),
        format!("/v1/agents/{agent}/timeline"),
        format!("/v1/agents/{agent}/events"),
        format!("/v1/workspaces/{ws}"),
        format!("/v1/workspaces/{ws}/diff"),
    ] {
        assert_eq!(
            expect_status(other(path.clone()).await.unwrap(), 404).await["code"],
            "not_found",
            "{path}"
        );
    }
    let r = app
        .client
        .post(app.url(&format!("/v1/agents/{agent}/messages")))
        .bearer_auth(&token)
        .json(&serde_json::json!({"text": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 404).await["code"], "not_found");
    let r = app
        .client
        .post(app.url("/v1/agents"))
        .bearer_auth(&token)
        .json(&serde_json::json!({"workspace_id": ws, "provider": "mock"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 404).await["code"], "not_found");
    let lists = [
        other("/v1/agents".into()).await.unwrap(),
        other("/v1/workspaces".into()).await.unwrap(),
        other("/v1/projects".into()).await.unwrap(),
    ];
    for r in lists {
        let v = expect_status(r, 200).await;
        assert!(
            v["items"].as_array().unwrap().is_empty(),
            "lists are scoped to the caller's teams"
        );
    }
    // The team activity stream shows nothing of the other team.
    let res = app
        .client
        .get(app.url("/v1/events"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let mut r = SseReader::from_response(res);
    assert!(
        r.next(std::time::Duration::from_millis(500))
            .await
            .is_none()
    );
}

/// A problem names the request it answers, as the response header does, so a report that
/// quotes the body leads to the request's log lines.
#[tokio::test]
async fn problems_carry_their_request_id() {
    let app = crate::helpers::spawn_app().await;
    let res = app
        .client
        .get(app.url("/v1/agents/agt_00000000000000000000000000000000"))
        .bearer_auth(&app.token)
        .header("X-Request-Id", "report-me-42")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
    assert_eq!(res.headers()["x-request-id"], "report-me-42");
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(body["request_id"], "report-me-42");
    assert_eq!(body["code"], "not_found");
    // No trace id while no traces are exported (tests/otel.rs checks it when they are).
    assert_eq!(body.get("trace_id"), None, "{body}");
    // One the server makes up is the same in both places too.
    let res = app.client.get(app.url("/v1/me")).send().await.unwrap();
    let header = res.headers()["x-request-id"].to_str().unwrap().to_owned();
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(body["request_id"], header.as_str());
}
