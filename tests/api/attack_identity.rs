//! Identity boundaries, played through the API by a plain user: a team cannot be
//! captured (by posing as a mapped team's name, or by becoming someone's default team),
//! the device sign-in limit keys on the real client behind trusted proxies (and on the
//! peer otherwise), and a dashboard session acts on an agent another replica runs.
//! What needs the test identity provider is in `tests/oidc.rs`.

use std::time::Duration;

use agentry::config::{GroupMapping, OidcSettings, Settings};
use reqwest::Method;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::helpers::*;
use crate::people::*;

/// `[auth.oidc]` against an issuer nobody answers at (bearer API tokens keep working),
/// with group `eng` mapped to team `engineering`, and browser sessions for the origin
/// `http://agentry.test`.
fn oidc_mapping(s: &mut Settings) {
    let mut o = OidcSettings::new("http://127.0.0.1:9", vec!["agentry".into()]);
    o.groups.insert(
        "eng".into(),
        GroupMapping {
            team: "engineering".into(),
            role: "owner".into(),
        },
    );
    o.client_id = Some("agentry-web".into());
    o.redirect_url = Some("http://agentry.test/auth/callback".into());
    s.auth.oidc = Some(o);
}

#[tokio::test]
async fn a_plain_user_cannot_make_a_team_named_like_a_mapped_group_team() {
    let app = spawn_app_with(oidc_mapping).await;
    let mallory = person(&app, "mallory").await;
    for name in ["engineering", "Engineering", " engineering "] {
        mallory
            .api
            .refused(
                Method::POST,
                "/v1/teams",
                Some(json!({"name": name})),
                409,
                "team_name_reserved",
            )
            .await;
    }
    // Nothing happened: no team of that name, no membership, no audit entry.
    let teams: i64 =
        sqlx::query_scalar("SELECT count(*) FROM teams WHERE lower(name) = 'engineering'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(teams, 0);
    let created: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'team.create'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(created, 0);
    let me = mallory.api.ok(Method::GET, "/v1/me", None, 200).await;
    assert_eq!(me["teams"], json!([]), "{me}");
    // Other names are anyone's.
    team(&mallory, "engineering-fans").await;
}

#[tokio::test]
async fn being_added_to_a_team_never_changes_the_default_team() {
    let app = spawn_app().await;
    let victim = person(&app, "victim").await;
    let own = team(&victim, "zeta").await;
    let mallory = person(&app, "mallory").await;
    // A name that sorts first, and the victim made an owner so that anything may land.
    let trap = team(&mallory, "0000").await;
    add(&mallory, &trap, &victim, "owner").await;

    let me = victim.api.ok(Method::GET, "/v1/me", None, 200).await;
    assert_eq!(me["default_team_id"], own.as_str(), "{me}");
    assert_eq!(me["teams"][0]["id"], own.as_str(), "{me}");
    assert_eq!(me["teams"].as_array().unwrap().len(), 2);

    // What the victim creates without naming a team lands in their own team.
    let hook = victim
        .api
        .ok(
            Method::POST,
            "/v1/hooks",
            Some(json!({"name": "ci", "events": ["agent.turn.after"],
                "url": "https://hooks.example.com/agentry", "secret": "s3cret-s3cret-s3cret"})),
            201,
        )
        .await;
    assert_eq!(hook["team_id"], own.as_str(), "{hook}");
    let in_trap: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM hooks h JOIN teams t ON t.id = h.team_id WHERE t.name = '0000'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(in_trap, 0, "nothing landed in the trap team");

    // The victim's own choice is what counts from then on, and only among their teams.
    let outsider = team(&mallory, "elsewhere").await;
    victim
        .api
        .refused(
            Method::PUT,
            "/v1/me/default-team",
            Some(json!({"team_id": outsider})),
            404,
            "not_found",
        )
        .await;
    let chosen: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT default_team_id FROM users WHERE email = 'victim@example.com'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(chosen, None, "a refused choice writes nothing");
    let me = victim
        .api
        .ok(
            Method::PUT,
            "/v1/me/default-team",
            Some(json!({"team_id": trap})),
            200,
        )
        .await;
    assert_eq!(me["default_team_id"], trap.as_str(), "{me}");
    let me = victim.api.ok(Method::GET, "/v1/me", None, 200).await;
    assert_eq!(me["default_team_id"], trap.as_str(), "{me}");
    // Leaving the chosen team falls back to the oldest membership.
    victim
        .api
        .ok(
            Method::DELETE,
            &format!("/v1/teams/{trap}/members/{}", victim.id),
            None,
            204,
        )
        .await;
    let me = victim.api.ok(Method::GET, "/v1/me", None, 200).await;
    assert_eq!(me["default_team_id"], own.as_str(), "{me}");
    // Being added back does not bring the old choice back either.
    add(&mallory, &trap, &victim, "owner").await;
    let me = victim.api.ok(Method::GET, "/v1/me", None, 200).await;
    assert_eq!(me["default_team_id"], own.as_str(), "{me}");
}

async fn start_device(app: &TestApp, forwarded_for: &str) -> (u16, Value) {
    let res = app
        .client
        .post(app.url("/auth/device"))
        .header("x-forwarded-for", forwarded_for)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

async fn device_codes(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM device_codes")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_device_sign_in_limit_keys_on_the_client_behind_trusted_proxies_only() {
    // No trusted proxy: a forged X-Forwarded-For does not buy a fresh limit.
    let app = spawn_app().await;
    for i in 0..10 {
        let (status, body) = start_device(&app, &format!("203.0.113.{i}")).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = start_device(&app, "203.0.113.99").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (429, Some("too_many_requests"))
    );
    assert_eq!(
        device_codes(&app).await,
        10,
        "the refused start stored nothing"
    );

    // Behind a trusted proxy (here, the test's own address), each client has its own.
    let app = spawn_app_with(|s| s.server.trusted_proxies = vec!["127.0.0.0/8".into()]).await;
    for _ in 0..10 {
        let (status, body) = start_device(&app, "6.6.6.6, 203.0.113.1").await;
        assert_eq!(status, 200, "{body}");
    }
    // The forged left-most hop changes nothing: the client is the right-most untrusted.
    let (status, body) = start_device(&app, "7.7.7.7, 203.0.113.1").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (429, Some("too_many_requests"))
    );
    let (status, body) = start_device(&app, "203.0.113.2").await;
    assert_eq!(status, 200, "another client is not limited: {body}");
    let addrs: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT client_ip FROM device_codes ORDER BY 1")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(addrs, ["203.0.113.1", "203.0.113.2"]);
}

/// A browser session of `user` (as the callback opens it), straight in the database.
async fn session_for(app: &TestApp, user: &str) -> String {
    let secret = format!("agt_ses_{}", "ab".repeat(32));
    let hash = Sha256::digest(secret.as_bytes()).to_vec();
    let user: uuid::Uuid = user.trim_start_matches("usr_").parse().unwrap();
    sqlx::query(
        "INSERT INTO user_sessions (id, user_id, session_hash, idle_expires_at, absolute_expires_at)
         VALUES ($1, $2, $3, now() + interval '1 hour', now() + interval '1 hour')",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(user)
    .bind(hash)
    .execute(&app.pool)
    .await
    .unwrap();
    format!("agentry_session={secret}")
}

#[tokio::test]
async fn a_dashboard_session_answers_a_permission_of_an_agent_on_another_replica() {
    let a = spawn_app_with(oidc_mapping).await;
    let b = spawn_on_with(
        a.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(a.token.clone()),
        oidc_mapping,
    )
    .await;
    let repo = git_repo();
    let (id, _ws) = a.mock_agent(repo.path()).await;
    let me = a.get_ok("/v1/me").await;
    let cookie = session_for(&a, me["id"].as_str().unwrap()).await;

    let mut stream = a.events(&id, None).await;
    a.prompt(&id, "/ask deploy to production?").await;
    let asked = stream
        .until("permission_requested", Duration::from_secs(30))
        .await;
    let request = asked.last().unwrap().data["data"]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // The dashboard reached the replica that does not run the agent.
    let answer = |origin: &'static str| {
        b.client
            .post(b.url(&format!("/v1/agents/{id}/permissions/{request}")))
            .header("cookie", &cookie)
            .header("origin", origin)
            .json(&json!({"behavior": "allow"}))
            .send()
    };
    // Another origin is still refused, by the owner.
    let res = answer("http://evil.test").await.unwrap();
    assert_eq!(expect_status(res, 403).await["code"], "csrf_rejected");
    let res = answer("http://agentry.test").await.unwrap();
    expect_status(res, 200).await;
    let rest = stream
        .until("turn_completed", Duration::from_secs(30))
        .await;
    assert_eq!(rest.last().unwrap().data["data"]["outcome"], "completed");
}
