//! Secrets at rest and revocation, played through the API by a plain member: no secret a
//! creation answers is ever in the database in the clear (an idempotent replay included),
//! idempotency keys expire, and whatever ends a caller's rights ends the event streams and
//! waits they have open, at once and on every replica.

use std::time::Duration;

use futures::StreamExt;
use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

/// How long a stream may take to end after its caller lost the right to it.
const PROMPTLY: Duration = Duration::from_secs(5);

/// A stream opened by `who` on `path` of `app`.
async fn open_stream(app: &TestApp, token: &str, path: &str) -> reqwest::Response {
    let res = app
        .client
        .get(app.url(path))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "{path}");
    res
}

/// Everything the stream sends until it ends; `None` when it is still open after
/// `within`.
async fn until_end(res: reqwest::Response, within: Duration) -> Option<String> {
    let mut body = res.bytes_stream();
    let mut text = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => text.extend_from_slice(&chunk),
            Ok(None) | Ok(Some(Err(_))) => return Some(String::from_utf8_lossy(&text).into()),
            Err(_) => return None,
        }
    }
}

/// A team of `owner`'s with a project the admin set up (`repo`), a workspace and a mock
/// agent in it, made by `owner`: `(team id, agent id)`.
async fn team_with_agent(
    app: &TestApp,
    owner: &Person,
    repo: &std::path::Path,
) -> (String, String) {
    let team = team(owner, "platform").await;
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": "demo", "repo_path": repo, "team_id": team}),
            201,
        )
        .await;
    let ws = owner
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    let agent = owner
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws["id"], "provider": "mock"})),
            201,
        )
        .await;
    (team, agent["id"].as_str().unwrap().to_owned())
}

/// A personal token of `who`, made with their own token: `(id, secret)`.
async fn own_token(who: &Person, name: &str) -> (String, String) {
    let t = who
        .api
        .ok(Method::POST, "/v1/tokens", Some(json!({"name": name})), 201)
        .await;
    (
        t["id"].as_str().unwrap().to_owned(),
        t["token"].as_str().unwrap().to_owned(),
    )
}

#[tokio::test]
async fn an_idempotent_token_creation_replays_the_token_without_storing_it() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let admin = Caller::new(&app, &app.token);
    let body = json!({"name": "ci"});

    // A personal token, created then replayed: the same token both times.
    let (s1, first, _) = ana
        .api
        .call_full_with_key(Method::POST, "/v1/tokens", &body, "create-ci-token")
        .await;
    let (s2, again, _) = ana
        .api
        .call_full_with_key(Method::POST, "/v1/tokens", &body, "create-ci-token")
        .await;
    assert_eq!((s1, s2), (201, 200), "{first} {again}");
    assert_eq!(first, again, "the replay is the original answer");
    let token = first["token"].as_str().unwrap();
    Caller::new(&app, token)
        .ok(Method::GET, "/v1/me", None, 200)
        .await;

    // A user's token issued by the admin, the same way.
    let path = format!("/v1/users/{}/tokens", ana.id);
    let (s1, issued, _) = admin
        .call_full_with_key(Method::POST, &path, &body, "issue-ana")
        .await;
    let (s2, replayed, _) = admin
        .call_full_with_key(Method::POST, &path, &body, "issue-ana")
        .await;
    assert_eq!((s1, s2), (201, 200), "{issued} {replayed}");
    assert_eq!(issued, replayed);

    // The stored answers keep the tokens sealed: the database holds neither.
    let stored: Vec<String> = sqlx::query_scalar(
        "SELECT response::text FROM idempotency_keys WHERE response IS NOT NULL",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert!(stored.iter().all(|r| r.contains("$sealed")), "{stored:?}");
    app.assert_database_lacks(&[token, issued["token"].as_str().unwrap()])
        .await;
}

#[tokio::test]
async fn an_idempotency_key_expires_after_a_day_and_is_purged() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let body = json!({"name": "nightly"});
    let (_, first, _) = ana
        .api
        .call_full_with_key(Method::POST, "/v1/tokens", &body, "nightly")
        .await;
    sqlx::query("UPDATE idempotency_keys SET created_at = now() - interval '25 hours'")
        .execute(&app.pool)
        .await
        .unwrap();
    // Expired: the key is new again, and creates again.
    let (status, second, _) = ana
        .api
        .call_full_with_key(Method::POST, "/v1/tokens", &body, "nightly")
        .await;
    assert_eq!(status, 201, "{second}");
    assert_ne!(first["id"], second["id"]);

    // Purged, in bounded batches: only the expired keys go.
    ana.api
        .call_full_with_key(Method::POST, "/v1/tokens", &json!({"name": "x"}), "fresh")
        .await;
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '25 hours' WHERE key = 'nightly'",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let purged = agentry::store::idempotency::purge_expired(&app.pool, 1000)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, vec!["fresh".to_owned()]);
}

#[tokio::test]
async fn no_secret_any_call_hands_out_is_in_the_database() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let admin = Caller::new(&app, &app.token);
    let team = team(&ana, "platform").await;
    let mut secrets: Vec<String> = Vec::new();

    // Personal tokens, with and without an Idempotency-Key.
    let plain = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "plain"})),
            201,
        )
        .await;
    secrets.push(plain["token"].as_str().unwrap().into());
    let (_, keyed, _) = ana
        .api
        .call_full_with_key(Method::POST, "/v1/tokens", &json!({"name": "keyed"}), "k1")
        .await;
    secrets.push(keyed["token"].as_str().unwrap().into());
    // A team service token, with a key.
    let (_, service, _) = ana
        .api
        .call_full_with_key(
            Method::POST,
            "/v1/tokens",
            &json!({"name": "bot", "team_id": team, "role": "member"}),
            "k2",
        )
        .await;
    secrets.push(service["token"].as_str().expect("a service token").into());
    // A user's token, issued by the admin with a key.
    let (_, issued, _) = admin
        .call_full_with_key(
            Method::POST,
            &format!("/v1/users/{}/tokens", ana.id),
            &json!({"name": "issued"}),
            "k3",
        )
        .await;
    secrets.push(issued["token"].as_str().unwrap().into());
    // A team secret.
    let value = "sk-team-secret-7f3a9c1e5b2d4086";
    ana.api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{team}/secrets/ANTHROPIC_API_KEY"),
            Some(json!({"value": value})),
            201,
        )
        .await;
    secrets.push(value.into());
    // A hook with its signing secret, with a key.
    let hook_secret = "whsec-9d8c7b6a5f4e3d2c1b0a";
    let (status, hook, _) = ana
        .api
        .call_full_with_key(
            Method::POST,
            "/v1/hooks",
            &json!({"name": "tickets", "events": ["agent.turn.after"], "team_id": team,
                "url": "https://hooks.example.com/in", "secret": hook_secret}),
            "k4",
        )
        .await;
    assert_eq!(status, 201, "{hook}");
    secrets.push(hook_secret.into());
    // A device sign-in that yields a token.
    let codes: Value = app
        .client
        .post(app.url("/auth/device"))
        .json(&json!({"client_name": "laptop"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    ana.api
        .ok(
            Method::POST,
            "/v1/auth/device/approve",
            Some(json!({"user_code": codes["user_code"]})),
            200,
        )
        .await;
    let device: Value = app
        .client
        .post(app.url("/auth/device/token"))
        .json(&json!({"device_code": codes["device_code"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    secrets.push(
        device["access_token"]
            .as_str()
            .expect("a device token")
            .into(),
    );
    secrets.push(codes["device_code"].as_str().unwrap().into());
    // The admin's own token too.
    secrets.push(app.token.clone());

    let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
    app.assert_database_lacks(&secrets).await;
}

#[tokio::test]
async fn revoking_a_token_ends_its_streams_and_waits_at_once() {
    let app = spawn_app().await;
    let repo = git_repo();
    let ana = person(&app, "ana").await;
    let (_, agent) = team_with_agent(&app, &ana, repo.path()).await;
    let (token_id, token) = own_token(&ana, "laptop").await;
    let team_stream = open_stream(&app, &token, "/v1/events").await;
    let agent_stream = open_stream(&app, &token, &format!("/v1/agents/{agent}/events")).await;
    // A wait that would last: the agent is busy for a minute.
    ana.api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent}/messages"),
            Some(json!({"text": "/sleep 60000"})),
            202,
        )
        .await;
    let wait = {
        let (client, url, token) = (
            app.client.clone(),
            app.url(&format!("/v1/agents/{agent}/wait?timeout_s=120")),
            token.clone(),
        );
        tokio::spawn(async move {
            let res = client.get(url).bearer_auth(token).send().await.unwrap();
            (res.status().as_u16(), res.json::<Value>().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    ana.api
        .ok(Method::DELETE, &format!("/v1/tokens/{token_id}"), None, 204)
        .await;
    let revoked_at = std::time::Instant::now();
    // Each stream rechecks its caller on its own (spread over a quarter second), so both
    // are read from the revocation on, side by side.
    let readers = [("team", team_stream), ("agent", agent_stream)]
        .map(|(what, res)| (what, tokio::spawn(until_end(res, PROMPTLY))));
    let (status, body) = tokio::time::timeout(PROMPTLY, wait)
        .await
        .expect("the wait ended")
        .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("token_revoked")),
        "{body}"
    );
    assert!(revoked_at.elapsed() < PROMPTLY);
    for (what, reader) in readers {
        let text = reader
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("the {what} stream is still open after the revocation"));
        let last = text.lines().rev().find(|l| !l.is_empty()).unwrap_or("");
        assert!(
            last.starts_with(": ended token_revoked"),
            "{what}: the last word names the revocation: {text}"
        );
    }
    // The agent goes on for its team; the revoked caller hears none of it.
    ana.api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent}/interrupt"),
            None,
            202,
        )
        .await;

    // Reconnecting with the revoked token is refused.
    let (status, body) = Caller::new(&app, &token)
        .call(Method::GET, "/v1/events", None)
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("token_revoked")),
        "{body}"
    );
}

#[tokio::test]
async fn an_expired_token_or_a_deleted_user_ends_the_streams() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let bo = person(&app, "bo").await;
    team(&ana, "platform").await;
    team(&bo, "tools").await;
    let (ana_token_id, ana_token) = own_token(&ana, "expiring").await;
    let (_, bo_token) = own_token(&bo, "laptop").await;
    let expiring = open_stream(&app, &ana_token, "/v1/events").await;
    let deleted = open_stream(&app, &bo_token, "/v1/events").await;

    sqlx::query("UPDATE api_tokens SET expires_at = now() WHERE id = $1")
        .bind(uuid::Uuid::parse_str(ana_token_id.trim_start_matches("tok_")).unwrap())
        .execute(&app.pool)
        .await
        .unwrap();
    let text = until_end(expiring, PROMPTLY)
        .await
        .expect("the stream ended");
    assert!(text.contains(": ended token_expired"), "{text}");

    sqlx::query("DELETE FROM users WHERE email = 'bo@example.com'")
        .execute(&app.pool)
        .await
        .unwrap();
    let text = until_end(deleted, PROMPTLY)
        .await
        .expect("the stream ended");
    assert!(text.contains(": ended token_"), "{text}");
    let (status, _) = Caller::new(&app, &bo_token)
        .call(Method::GET, "/v1/events", None)
        .await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn a_removed_member_loses_the_teams_streams_and_waits() {
    let app = spawn_app().await;
    let repo = git_repo();
    let ana = person(&app, "ana").await;
    let bo = person(&app, "bo").await;
    let (team, agent) = team_with_agent(&app, &ana, repo.path()).await;
    add(&ana, &team, &bo, "member").await;
    let team_stream = open_stream(&app, &bo.api.token, "/v1/events").await;
    let agent_stream =
        open_stream(&app, &bo.api.token, &format!("/v1/agents/{agent}/events")).await;
    // Ana's own stream is not affected.
    let owners = open_stream(&app, &ana.api.token, "/v1/events").await;
    ana.api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent}/messages"),
            Some(json!({"text": "/sleep 60000"})),
            202,
        )
        .await;
    let wait = {
        let (client, url, token) = (
            app.client.clone(),
            app.url(&format!("/v1/agents/{agent}/wait?timeout_s=120")),
            bo.api.token.clone(),
        );
        tokio::spawn(async move {
            let res = client.get(url).bearer_auth(token).send().await.unwrap();
            (res.status().as_u16(), res.json::<Value>().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    ana.api
        .ok(
            Method::DELETE,
            &format!("/v1/teams/{team}/members/{}", bo.id),
            None,
            204,
        )
        .await;
    for (what, res) in [("team", team_stream), ("agent", agent_stream)] {
        let text = until_end(res, PROMPTLY)
            .await
            .unwrap_or_else(|| panic!("bo's {what} stream is still open"));
        assert!(text.contains(": ended not_found"), "{what}: {text}");
    }
    let (status, body) = tokio::time::timeout(PROMPTLY, wait)
        .await
        .expect("the wait ended")
        .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    assert!(
        until_end(owners, Duration::from_secs(1)).await.is_none(),
        "the owner's stream stays open"
    );
    bo.api
        .refused(
            Method::GET,
            &format!("/v1/agents/{agent}/events"),
            None,
            404,
            "not_found",
        )
        .await;
}

#[tokio::test]
async fn a_revocation_on_one_replica_ends_the_streams_of_another() {
    let a = spawn_app().await;
    let b = spawn_on(
        a.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(a.token.clone()),
    )
    .await;
    let ana = person(&a, "ana").await;
    team(&ana, "platform").await;
    let (token_id, token) = own_token(&ana, "laptop").await;
    let on_b = open_stream(&b, &token, "/v1/events").await;
    // Warm b's token cache: the revocation must reach it too.
    Caller::new(&b, &token)
        .ok(Method::GET, "/v1/me", None, 200)
        .await;
    ana.api
        .ok(Method::DELETE, &format!("/v1/tokens/{token_id}"), None, 204)
        .await;
    let text = until_end(on_b, PROMPTLY)
        .await
        .expect("the other replica's stream ended");
    assert!(text.contains(": ended token_revoked"), "{text}");
    let (status, body) = Caller::new(&b, &token)
        .call(Method::GET, "/v1/events", None)
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("token_revoked")),
        "{body}"
    );
}

#[tokio::test]
async fn without_any_notification_the_floor_check_ends_a_stream() {
    // A change the replica never hears of (its notification lost) is still caught by the
    // periodic check.
    let app = spawn_app_with(|s| s.events.revalidate_s = 1).await;
    let ana = person(&app, "ana").await;
    team(&ana, "platform").await;
    let (token_id, token) = own_token(&ana, "laptop").await;
    let stream = open_stream(&app, &token, "/v1/events").await;
    let id = uuid::Uuid::parse_str(token_id.trim_start_matches("tok_")).unwrap();
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE api_tokens DISABLE TRIGGER api_tokens_auth_changed")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE api_tokens SET revoked_at = now() WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE api_tokens ENABLE TRIGGER api_tokens_auth_changed")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let text = until_end(stream, PROMPTLY).await.expect("the stream ended");
    assert!(text.contains(": ended token_revoked"), "{text}");
}
