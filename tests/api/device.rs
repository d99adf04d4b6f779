//! Device sign-in (RFC 8628): a client without a browser gets a code pair, a signed-in
//! person approves or denies the user code, and the client's poll gets a new personal
//! token of that person — once.

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

/// An unauthenticated `POST` (the client has no token yet): status and body.
async fn anonymous(
    app: &TestApp,
    path: &str,
    body: Value,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let res = app
        .client
        .post(app.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    (status, res.json().await.unwrap_or(Value::Null), headers)
}

async fn start(app: &TestApp, client_name: &str) -> Value {
    let (status, body, _) =
        anonymous(app, "/auth/device", json!({"client_name": client_name})).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn poll(app: &TestApp, codes: &Value) -> (u16, Value) {
    let (status, body, _) = anonymous(
        app,
        "/auth/device/token",
        json!({"device_code": codes["device_code"]}),
    )
    .await;
    (status, body)
}

fn code_of(codes: &Value) -> Value {
    json!({"user_code": codes["user_code"]})
}

#[tokio::test]
async fn a_device_signs_in_when_a_person_approves_and_the_token_is_theirs_once() {
    let app = spawn_app().await;
    let alice = person(&app, "alice").await;
    let codes = start(&app, "agentry CLI on build-7").await;
    let user_code = codes["user_code"].as_str().unwrap();
    assert_eq!(user_code.len(), 9, "XXXX-XXXX: {user_code}");
    assert_eq!(codes["expires_in"], 600);
    assert_eq!(codes["interval"], 5);
    assert!(codes["device_code"].as_str().unwrap().starts_with("dev_"));
    assert_eq!(
        codes["verification_uri"].as_str().unwrap(),
        app.url("/device")
    );
    assert_eq!(
        codes["verification_uri_complete"].as_str().unwrap(),
        format!("{}?code={user_code}", app.url("/device"))
    );

    let (status, body) = poll(&app, &codes).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("authorization_pending")),
        "{body}"
    );
    let (status, body) = poll(&app, &codes).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("slow_down")),
        "polled again at once: {body}"
    );

    // The approver sees which client asks (the code typed in any case, without the dash).
    let typed = user_code.replace('-', "").to_lowercase();
    let seen = alice
        .api
        .ok(
            Method::GET,
            &format!("/v1/auth/device?user_code={typed}"),
            None,
            200,
        )
        .await;
    assert_eq!(seen["client_name"], "agentry CLI on build-7");
    assert_eq!(seen["status"], "pending");
    assert_eq!(seen["user_code"], user_code);

    let approved = alice
        .api
        .ok(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&codes)),
            200,
        )
        .await;
    assert_eq!(approved["status"], "approved");

    let (status, token) = poll(&app, &codes).await;
    assert_eq!(status, 200, "{token}");
    assert_eq!(token["token_type"], "Bearer");
    assert_eq!(token["name"], "agentry CLI on build-7");
    let secret = token["access_token"].as_str().unwrap();
    let me = Caller::new(&app, secret)
        .ok(Method::GET, "/v1/me", None, 200)
        .await;
    assert_eq!(
        me["email"], "alice@example.com",
        "the token is the approver's"
    );
    let listed = alice.api.ok(Method::GET, "/v1/tokens", None, 200).await;
    assert!(
        listed["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["id"] == token["id"]),
        "alice sees (and can revoke) it: {listed}"
    );

    // Once: the code is spent for the client and for approvers.
    let (status, body) = poll(&app, &codes).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    alice
        .api
        .refused(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&codes)),
            404,
            "not_found",
        )
        .await;

    // Audited as alice creating a token, without its secret.
    let admin = Caller::new(&app, &app.token);
    let audit = admin
        .ok(Method::GET, "/v1/audit?action=token.create", None, 200)
        .await;
    let entry = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["target"]["id"] == token["id"])
        .unwrap_or_else(|| panic!("no token.create for the device token: {audit}"));
    assert_eq!(entry["actor"]["id"], alice.id.as_str());
    assert_eq!(entry["details"]["via"], "device");
    assert!(!entry.to_string().contains(secret));

    // The codes are stored hashed: neither appears in the database.
    let stored: Vec<(Vec<u8>, Vec<u8>)> =
        sqlx::query_as("SELECT device_code_hash, user_code_hash FROM device_codes")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(stored.len(), 1);
    let dump: String = sqlx::query_scalar("SELECT row_to_json(d)::text FROM device_codes d")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(
        !dump.contains(codes["device_code"].as_str().unwrap()),
        "{dump}"
    );
    assert!(!dump.contains(&user_code.replace('-', "")), "{dump}");
    assert!(!dump.contains(secret), "{dump}");
}

#[tokio::test]
async fn each_approver_gets_their_own_token_and_denial_is_final() {
    let app = spawn_app().await;
    let alice = person(&app, "alice").await;
    let bob = person(&app, "bob").await;
    let for_alice = start(&app, "alice's laptop").await;
    let for_bob = start(&app, "bob's laptop").await;
    bob.api
        .ok(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&for_bob)),
            200,
        )
        .await;
    alice
        .api
        .ok(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&for_alice)),
            200,
        )
        .await;
    for (codes, email) in [
        (&for_alice, "alice@example.com"),
        (&for_bob, "bob@example.com"),
    ] {
        let (status, token) = poll(&app, codes).await;
        assert_eq!(status, 200, "{token}");
        let me = Caller::new(&app, token["access_token"].as_str().unwrap())
            .ok(Method::GET, "/v1/me", None, 200)
            .await;
        assert_eq!(me["email"], email);
    }

    let denied = start(&app, "someone else").await;
    let answer = alice
        .api
        .ok(
            Method::POST,
            "/v1/auth/device/deny",
            Some(code_of(&denied)),
            200,
        )
        .await;
    assert_eq!(answer["status"], "denied");
    let (status, body) = poll(&app, &denied).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("access_denied")),
        "{body}"
    );
    bob.api
        .refused(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&denied)),
            409,
            "device_code_answered",
        )
        .await;
    let (status, body) = poll(&app, &denied).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("access_denied")),
        "still: {body}"
    );
}

#[tokio::test]
async fn expired_wrong_and_unauthenticated_answers_are_refused() {
    let app = spawn_app().await;
    let alice = person(&app, "alice").await;
    let codes = start(&app, "cli").await;
    sqlx::query("UPDATE device_codes SET expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, body) = poll(&app, &codes).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("expired_token")),
        "{body}"
    );
    alice
        .api
        .refused(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&codes)),
            400,
            "expired_token",
        )
        .await;

    // Codes never issued, malformed ones, and device codes never issued.
    for wrong in ["BCDF-GHJK", "not a code", ""] {
        alice
            .api
            .refused(
                Method::POST,
                "/v1/auth/device/approve",
                Some(json!({"user_code": wrong})),
                404,
                "not_found",
            )
            .await;
    }
    let (status, body) = poll(&app, &json!({"device_code": "dev_0000"})).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );

    // Answering needs a person's token with the admin scope.
    let fresh = start(&app, "cli").await;
    let (status, _, _) = anonymous(&app, "/v1/auth/device/approve", code_of(&fresh)).await;
    assert_eq!(status, 401);
    let read_only = alice
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "reader", "scopes": ["read"]})),
            201,
        )
        .await;
    Caller::new(&app, read_only["token"].as_str().unwrap())
        .refused(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&fresh)),
            403,
            "insufficient_scope",
        )
        .await;
    let team = team(&alice, "devs").await;
    let bot = alice
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "bot", "team_id": team, "role": "owner"})),
            201,
        )
        .await;
    Caller::new(&app, bot["token"].as_str().unwrap())
        .refused(
            Method::POST,
            "/v1/auth/device/approve",
            Some(code_of(&fresh)),
            403,
            "forbidden",
        )
        .await;

    // Bad client names are a validation failure.
    let (status, body, _) =
        anonymous(&app, "/auth/device", json!({"client_name": "a\u{7}b"})).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("validation_failed")),
        "{body}"
    );
}

#[tokio::test]
async fn starting_is_rate_limited_per_address() {
    let app = spawn_app().await;
    for _ in 0..10 {
        start(&app, "cli").await;
    }
    let (status, body, headers) = anonymous(&app, "/auth/device", json!({})).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (429, Some("too_many_requests")),
        "{body}"
    );
    assert_eq!(headers["retry-after"], "60");
}
